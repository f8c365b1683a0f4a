"""The ROS commands the docs teach, typed as a ROS engineer types them, against ``ros2 launch``.

One ``ros2 launch sequence_ai_ros replay.launch.py`` (a ``hold`` policy deployed with capture on, served by
the launch's ``seq serve``; ``policy_node`` with config/g1.yaml; the G1 episode as a looping rosbag) serves
the module, and every step is the real ``ros2`` command line in a subprocess (``--no-daemon``, and a
``--spin-time`` generous for a loaded machine where the verb has them):

- ``ros2 lifecycle get``, ``ros2 param get/set`` (refused for a read-only parameter and a value outside its
  choices, accepted and in effect for a valid one);
- ``ros2 action send_goal --feedback``: feedback, and a result whose counts sum to the episode's periods;
- ``ros2 service call .../interrupt`` during a goal, and ``.../label`` after it: the label is stored;
- ``ros2 lifecycle set deactivate`` during a goal: the goal is aborted, interrupted, and the arm holds (no
  new position after it); then cleanup, configure and activate bring the node back;
- Ctrl-C (SIGINT) on ``ros2 action send_goal``: the node ends the goal interrupted and holds, whether or not
  the command line managed to send its cancel before exiting;
- Ctrl-C on ``ros2 launch``: every process ends, exit 0, within a bounded wait.

The observations the commands cannot give (the controller topic, ~/status) come from a probe node in this
process. The module's tests run in order on one pytest worker (one launch).
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import G1_DATASET, REPO
from test_node_support import Probe, ros_command, wait_for

pytestmark = [pytest.mark.ros, pytest.mark.slow, pytest.mark.xdist_group('ros2cli')]

NODE = '/policy_node'
COMMANDS = '/g1_position_controller/commands'       # config/g1.yaml's controller
RATE_HZ = 50.0                                      # config/g1.yaml's control_rate_hz
#: --spin-time for the verbs that discover the node first (s): 0.5 s by default, too short on busy cores.
SPIN = ['--no-daemon', '--spin-time', '5']
#: Bounded waits (s), generous under load.
WAIT_S = 60.0
ACT = 'sequence_ai_msgs/action/Act'


def _ros2() -> str:
    """The ``ros2`` command; skips, saying why, where ros2cli or the launch tools are not installed."""
    return ros_command('ros2', ('ros2cli', 'ros2launch', 'ros2action', 'ros2lifecycle', 'ros2param', 'ros2service'),
                       'ros2cli and its verbs')


def ros2(*args: str, timeout: float = WAIT_S) -> subprocess.CompletedProcess:
    """Run ``ros2 <args>`` to its end; the CompletedProcess (text)."""
    return subprocess.run([_ros2(), *args], capture_output=True, text=True, timeout=timeout)


def lifecycle_state(node: str, state: str) -> bool:
    """True once ``ros2 lifecycle get`` shows ``node`` in ``state`` (bounded retries).

    Each ``get`` discovers the graph anew (``--no-daemon``): on loaded cores it may answer "Node not found" for a
    node that has just answered ``set``; that is discovery, not the node's state, so it asks again.
    """
    return bool(wait_for(lambda: ros2('lifecycle', 'get', node, *SPIN).stdout.startswith(state), WAIT_S))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def _seq(*args: str, env: dict[str, str]) -> str:
    done = subprocess.run([sys.executable, '-m', 'sequence_ai_ros.cli', *args], capture_output=True, text=True,
                          timeout=120, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


class Goal:
    """``ros2 action send_goal --feedback`` in a session of its own (so a SIGINT reaches it alone)."""

    def __init__(self, goal: str, log: Path) -> None:
        self.log = log
        self._out = open(log, 'w')  # noqa: SIM115  (closed in wait())
        self.proc = subprocess.Popen([_ros2(), 'action', 'send_goal', '--feedback', f'{NODE}/act', ACT, goal],
                                     stdout=self._out, stderr=subprocess.STDOUT, text=True, start_new_session=True)

    def output(self) -> str:
        return self.log.read_text()

    def commanding(self) -> bool:
        """True once a feedback message reports commands sent (the episode is moving the arm)."""
        return any(int(n) > 0 for n in re.findall(r'commands_sent: (\d+)', self.output()))

    def wait(self, timeout: float = WAIT_S) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            self._out.close()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._out.close()


def result_fields(output: str) -> dict[str, str]:
    """The ``Result:`` block of ``send_goal``'s output, as strings."""
    block = output.split('Result:', 1)[1].split('Goal finished', 1)[0]
    return dict(re.findall(r'^\s*(\w+): (.*)$', block, re.MULTILINE))


@pytest.fixture(scope='module')
def launched(tmp_path_factory):
    """``ros2 launch sequence_ai_ros replay.launch.py ...`` as typed; yields (process, log, probe)."""
    _ros2()
    if not (G1_DATASET / 'meta' / 'info.json').exists():
        pytest.skip(f'real G1 dataset not found at {G1_DATASET} (set SEQ_DATA_DIR)')
    import rclpy
    from std_msgs.msg import Float64MultiArray

    from sequence_ai_ros.bags.to_rosbag import episode_to_rosbag

    root = tmp_path_factory.mktemp('ros2cli')
    env = {**os.environ, 'SEQ_HOME': str(root / 'seq_home')}
    _seq('init', 'hold', str(root / 'hold'), env=env)
    _seq('deploy', str(root / 'hold' / 'policy.py'), env=env)
    _seq('policy', 'capture', 'hold', '--rate', '1.0', env=env)
    episode_to_rosbag(G1_DATASET, 5, root / 'g1_episode5')
    log = root / 'launch.log'
    with open(log, 'w') as out:
        proc = subprocess.Popen(
            [_ros2(), 'launch', 'sequence_ai_ros', 'replay.launch.py', f'bag:={root / "g1_episode5"}',
             'policy:=hold', 'model:=hold', f'port:={_free_port()}', f'params_file:={REPO / "config" / "g1.yaml"}',
             'loop:=true'],
            stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    context = rclpy.Context()
    rclpy.init(context=context)
    probe = None
    try:
        # no Act client here: the goals are the command line's alone, as the node's client watch needs to see
        probe = Probe(context, Float64MultiArray, COMMANDS, name='ros2cli_probe', act_client=False)
        assert probe.wait_connected(timeout=WAIT_S), log.read_text()[-6000:]
        # this domain is the test's own: one policy_node, the launch's
        nodes = probe.node.get_node_names_and_namespaces()
        domain = os.environ['ROS_DOMAIN_ID']
        assert nodes.count(('policy_node', '/')) == 1, f'another policy_node in ROS domain {domain}'
        assert wait_for(lambda: probe.diag_message('observation') == 'all sources fresh', WAIT_S), \
            log.read_text()[-6000:]
        yield proc, log, probe
    finally:
        if probe is not None:
            probe.close()
        rclpy.shutdown(context=context)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def _episode_ended(probe: Probe, episode_id: str) -> bool:
    """~/status says the episode ended: its message names it as the last episode (with its reason).

    The state alone cannot tell: a running episode is also ``holding`` (an underrun, an invalid observation)
    or ``warming`` (before its first command), and an ended one ``holding`` (the arm holds) or ``idle``.
    """
    prefix = f'last episode {episode_id}:'
    return any(s.episode_id == episode_id and s.message.startswith(prefix) for s in list(probe.status)[-5:])


def _assert_holding(probe: Probe, since: float) -> None:
    """No new position reaches the controller after ``since`` (monotonic s): the arm holds."""
    time.sleep(0.5)
    after = [v for t, v in probe.values() if t > since]
    assert all(np.array_equal(v, after[0]) for v in after), f'{len(after)} commands after the stop, not one pose'


def test_lifecycle_get_and_parameters(launched):
    assert lifecycle_state(NODE, 'active')
    got = ros2('param', 'get', NODE, 'control_rate_hz', *SPIN)
    assert got.stdout.strip() == 'Double value is: 50.0', got.stdout + got.stderr
    refused = ros2('param', 'set', NODE, 'control_rate_hz', '20.0', *SPIN)
    assert 'Setting parameter failed: Trying to set a read-only parameter' in refused.stderr, refused
    refused = ros2('param', 'set', NODE, 'on_underrun', 'sideways', *SPIN)
    assert 'Setting parameter failed' in refused.stderr and 'sideways' in refused.stderr, refused
    accepted = ros2('param', 'set', NODE, 'on_underrun', 'stop', *SPIN)
    assert accepted.stdout.strip() == 'Set parameter successful', accepted.stdout + accepted.stderr
    assert ros2('param', 'get', NODE, 'on_underrun', *SPIN).stdout.strip() == 'String value is: stop'
    assert ros2('param', 'set', NODE, 'on_underrun', 'hold', *SPIN).stdout.strip() == 'Set parameter successful'
    assert ros2('param', 'get', NODE, 'control_rate_hz', *SPIN).stdout.strip() == 'Double value is: 50.0'


def test_send_goal_with_feedback_counts_every_period(launched, tmp_path):
    goal = Goal("{instruction: 'pick up the bottle', max_seconds: 3.0}", tmp_path / 'goal.log')
    assert goal.wait() == 0, goal.output()
    output = goal.output()
    assert 'Goal accepted with ID' in output and output.count('Feedback:') >= 3, output[-3000:]
    assert 'Goal finished with status: SUCCEEDED' in output, output[-3000:]
    result = result_fields(output)
    assert result['reason'] == 'timeout', result
    counted = int(result['commands_sent']) + int(result['ticks_held']) + int(result['ticks_skipped'])
    periods = float(result['elapsed_s']) * RATE_HZ
    assert abs(counted - periods) <= 2.0, f'{counted} ticks counted for {periods:.2f} periods: {result}'
    assert int(result['commands_sent']) > 0 and int(result['chunks']) > 0, result


def test_service_call_interrupt_during_a_goal_then_label(launched, tmp_path):
    _, _, probe = launched
    goal = Goal("{instruction: 'pick', max_seconds: 30.0}", tmp_path / 'goal.log')
    try:
        assert wait_for(goal.commanding, WAIT_S), goal.output()
        called = ros2('service', 'call', f'{NODE}/interrupt', 'std_srvs/srv/Trigger')
        t_interrupt = time.monotonic()
        assert 'success=True' in called.stdout and 'interrupted; holding' in called.stdout, called.stdout
        assert goal.wait() == 0, goal.output()
    finally:
        goal.stop()
    result = result_fields(goal.output())
    assert result['reason'] == 'interrupted', result
    assert 'Goal finished with status: ABORTED' in goal.output()
    _assert_holding(probe, t_interrupt + 0.5)
    labelled = ros2('service', 'call', f'{NODE}/label', 'sequence_ai_msgs/srv/Label',
                    "{success: true, notes: 'from ros2cli'}")
    assert 'ok=True' in labelled.stdout, labelled.stdout + labelled.stderr
    assert f"labelled {result['episode_id']}: success" in labelled.stdout, labelled.stdout


def test_lifecycle_deactivate_mid_goal_aborts_and_holds(launched, tmp_path):
    _, log, probe = launched
    goal = Goal("{instruction: 'pick', max_seconds: 30.0}", tmp_path / 'goal.log')
    try:
        assert wait_for(goal.commanding, WAIT_S), goal.output()
        done = ros2('lifecycle', 'set', NODE, 'deactivate', *SPIN)
        t_deactivate = time.monotonic()
        assert 'Transitioning successful' in done.stdout, done.stdout + done.stderr
        assert goal.wait() == 0, goal.output()
    finally:
        goal.stop()
    output = goal.output()
    assert 'Goal finished with status: ABORTED' in output, output[-3000:]
    result = result_fields(output)
    assert result['reason'] == 'interrupted' and 'deactivate' in result['message'], result
    _assert_holding(probe, t_deactivate)
    assert lifecycle_state(NODE, 'inactive')
    for transition in ('cleanup', 'configure', 'activate'):
        done = ros2('lifecycle', 'set', NODE, transition, *SPIN)
        assert 'Transitioning successful' in done.stdout, (transition, done.stdout + done.stderr,
                                                           log.read_text()[-4000:])
    assert lifecycle_state(NODE, 'active')
    assert probe.wait_connected(timeout=WAIT_S)


def test_ctrl_c_on_send_goal_interrupts_and_holds(launched, tmp_path):
    """SIGINT to ``ros2 action send_goal``: the node ends the goal interrupted and holds.

    The command line's cancel may or may not leave before it exits (ros2cli's own handling of SIGINT); the node
    ends the goal on the cancel, or once the goal's client has left the graph.
    """
    _, log, probe = launched
    ways = []
    for attempt in range(3):
        goal = Goal("{instruction: 'pick', max_seconds: 60.0}", tmp_path / f'goal{attempt}.log')
        try:
            assert wait_for(goal.commanding, WAIT_S), goal.output()
            episode_id = re.findall(r'episode_id: (\S+)', goal.output())[-1]
            os.killpg(goal.proc.pid, signal.SIGINT)
            t_sigint = time.monotonic()
            goal.wait(timeout=30)
        finally:
            goal.stop()
        ended_ok = wait_for(lambda eid=episode_id: _episode_ended(probe, eid), 30)
        assert ended_ok, (f'attempt {attempt}: episode {episode_id} still running', goal.output()[-1500:],
                          [line for line in log.read_text().splitlines() if episode_id in line][-5:])
        ended = ros2('service', 'call', f'{NODE}/end_episode', 'sequence_ai_msgs/srv/EndEpisode')
        assert f"episode_id='{episode_id}'" in ended.stdout and "reason='interrupted'" in ended.stdout, \
            (ended.stdout, goal.output(), log.read_text()[-4000:])
        _assert_holding(probe, t_sigint + 1.0)
        ways.append('cancel' if 'Canceling goal' in goal.output() else 'client left')
    print(f'\nCtrl-C on ros2 action send_goal, 3 times: the node stopped on {ways}')


def test_a_killed_goal_client_is_noticed_and_the_arm_holds(launched, tmp_path):
    """``kill -9`` of ``ros2 action send_goal``: no cancel can leave, yet the node interrupts the goal.

    It does so once the killed process is gone from the ROS graph (DDS drops a participant that stopped announcing
    itself when its lease runs out).
    """
    _, log, probe = launched
    goal = Goal("{instruction: 'pick', max_seconds: 120.0}", tmp_path / 'goal.log')
    try:
        assert wait_for(goal.commanding, WAIT_S), goal.output()
        episode_id = re.findall(r'episode_id: (\S+)', goal.output())[-1]
        os.killpg(goal.proc.pid, signal.SIGKILL)
    finally:
        goal.stop()
    assert wait_for(lambda: _episode_ended(probe, episode_id), 90), \
        [line for line in log.read_text().splitlines() if episode_id in line][-5:]
    t_end = time.monotonic()
    lines = [line for line in log.read_text().splitlines() if episode_id in line]
    assert any("client left the ROS graph without cancelling" in line for line in lines), lines[-5:]
    ended = ros2('service', 'call', f'{NODE}/end_episode', 'sequence_ai_msgs/srv/EndEpisode')
    assert "reason='interrupted'" in ended.stdout, ended.stdout
    _assert_holding(probe, t_end)


def test_ctrl_c_on_ros2_launch_ends_every_process(launched):
    import psutil

    proc, log, _ = launched
    children = psutil.Process(proc.pid).children(recursive=True)
    names = {c.pid: ' '.join(c.cmdline()[1:3]) for c in children}
    assert len(children) >= 3, names
    os.killpg(proc.pid, signal.SIGINT)
    assert proc.wait(timeout=WAIT_S) == 0, log.read_text()[-4000:]
    _, alive = psutil.wait_procs(children, timeout=10)
    assert not alive, f'still running after ros2 launch exited: {[names[p.pid] for p in alive]}'
    text = log.read_text()
    for name in ('seq-1', 'policy_node-2', 'bag_player-3'):
        assert f'[INFO] [{name}]: process has finished cleanly' in text, (name, text[-4000:])


def test_no_ros2_daemon_was_left_behind(launched):
    """Every verb above ran with --no-daemon or needs none: no ros2 daemon of this test's domain outlives it."""
    import psutil

    domain = os.environ['ROS_DOMAIN_ID']
    daemons = []
    for p in psutil.process_iter(['cmdline']):
        try:
            if any('_ros2_daemon' in part for part in p.info['cmdline'] or ()) and \
                    p.environ().get('ROS_DOMAIN_ID') == domain:
                daemons.append(p.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    assert not daemons, f'ros2 daemons of domain {domain}: {daemons}'
