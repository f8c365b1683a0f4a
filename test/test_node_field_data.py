"""Issue 12's "Must hold" through the ROS node: the seed's commands, run as the README writes them.

``seq deploy`` -> ``seq policy capture NAME --rate 1.0 --images`` -> ``seq serve`` (real processes) ->
``policy_node`` with a params file (its own process, real rclpy over DDS) -> one ``~/act`` goal ->
``~/label`` -> ``seq policy data export --format lerobot`` (v2.1 and ``--lerobot-version 3.0``) and
``seq policy stats``. A probe node plays the robot (joint states, a small rgb8 camera) and records every
command that reached the controller topic. The policy is ``test/policies/node_ramp.py`` (a ramp from the
last action); the node's position limit on j2 is below the ramp, so the safety filter clamps it.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from std_msgs.msg import Float64MultiArray
from test_node_support import RAMP, Probe, node_log, node_params, spawn_node

pytestmark = [pytest.mark.ros, pytest.mark.slow]

NAMES = ['j0', 'j1', 'j2', 'j3']
J2_LIMIT = 0.45           # the ramp starts at the measured 0.3 and passes it after a few steps
ACTIONS = 75              # policy steps in the goal (2.5 s at 30 Hz)


def _seq(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, '-m', 'sequence_ai_ros.cli', *args], capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, f'seq {" ".join(args)} -> {done.returncode}\n{done.stdout}\n{done.stderr}'
    return done


def _collapse(values: np.ndarray) -> np.ndarray:
    """Drop consecutive repeats (holds republish the last command)."""
    keep = np.ones(len(values), bool)
    keep[1:] = np.any(values[1:] != values[:-1], axis=1)
    return values[keep]


def _read_rows(out: Path, version: str) -> dict:
    import pyarrow.parquet as pq

    files = sorted(out.glob('data/chunk-000/*.parquet'))
    assert len(files) == 1, files
    rows = pq.read_table(files[0]).to_pydict()
    assert rows['episode_index'] == [0] * len(rows['episode_index'])
    if version == '2.1':
        [meta] = [json.loads(line) for line in (out / 'meta/episodes.jsonl').read_text().splitlines()]
    else:
        meta = pq.read_table(next(out.glob('meta/episodes/chunk-000/*.parquet'))).to_pylist()[0]
    return {'rows': rows, 'meta': meta}


def _decoded_frames(out: Path) -> int:
    import av

    [video] = list(out.glob('videos/**/*.mp4'))
    with av.open(str(video)) as container:
        return sum(1 for _ in container.decode(video=0))


@pytest.fixture
def probe(rclpy_context):
    p = Probe(rclpy_context, Float64MultiArray, '/arm/commands')
    yield p
    p.close()


@pytest.mark.parametrize('rate_hz', [30.0, 50.0])
def test_seed_commands_through_the_node_keep_what_the_robot_did(tmp_path, seq_home, processes, probe, rate_hz):
    # seq deploy: a policy folder as `seq init` makes one (policy.py + config.yaml)
    folder = tmp_path / 'ramp'
    folder.mkdir()
    shutil.copy(RAMP, folder / 'policy.py')
    (folder / 'config.yaml').write_text(yaml.safe_dump(
        {'names': NAMES, 'step': 0.01, 'camera': 'cam', 'camera_size': [64, 48]}))
    _seq('deploy', str(folder / 'policy.py'))
    _seq('policy', 'capture', 'ramp', '--rate', '1.0', '--images')
    serve = processes.spawn([sys.executable, '-m', 'sequence_ai_ros.cli', 'serve', 'ramp', '--port', '0'])
    line = serve.stdout.readline()
    assert 'serving ramp on' in line, line + (serve.stderr.read() if serve.poll() is not None else '')
    port = int(line.split('127.0.0.1:')[1].split()[0])

    params = node_params(tmp_path, model='ramp', endpoint=f'127.0.0.1:{port}', control_rate_hz=rate_hz,
                         status_rate_hz=10.0, camera_names=['front'], **{
                             'joints.names': NAMES, 'command.controller': 'arm',
                             'cameras.front.topic': '/front/image_raw', 'cameras.front.key': 'cam',
                             'safety.lower_limits': [-1.0] * 4, 'safety.upper_limits': [1.0, 1.0, J2_LIMIT, 1.0]})
    proc = spawn_node(processes, tmp_path / 'node.log', params)
    probe.publish_joints(NAMES)                               # measured state 0.1 .. 0.4
    probe.publish_camera('/front/image_raw', width=64, height=48, rate_hz=30.0)
    assert probe.wait_connected(timeout=60), node_log(proc)
    handle = probe.send_goal(instruction='reach', max_seconds=30.0, max_actions=ACTIONS)
    assert handle.accepted
    result = probe.result(handle, timeout=60)
    assert result.reason == 'completed' and result.actions == ACTIONS, (result, node_log(proc))
    label = probe.call('label', success=True, notes='reached', episode_id=result.episode_id)
    assert label.ok, label.message
    serve.terminate()
    serve.wait(timeout=20)
    commands = np.array([v for _, v in probe.values()], np.float32)

    exports = {}
    for version in ('2.1', '3.0'):
        out = tmp_path / f'export-{version}'
        args = ['policy', 'data', 'export', 'ramp', '--out', str(out), '--format', 'lerobot']
        _seq(*(args if version == '2.1' else [*args, '--lerobot-version', '3.0']), timeout=300)
        exports[version] = _read_rows(out, version)
        info = json.loads((out / 'meta/info.json').read_text())
        assert info['fps'] == 30 and info['total_episodes'] == 1
        n = len(exports[version]['rows']['action'])
        assert _decoded_frames(out) == n, f'{version}: every row has a decodable video frame'
        assert exports[version]['meta']['success'] is True        # the ~/label reached the export
    a21, a30 = (np.array(exports[v]['rows']['action'], np.float32) for v in ('2.1', '3.0'))
    np.testing.assert_array_equal(a21, a30)

    rows = exports['2.1']['rows']
    action = np.array(rows['action'], np.float32)
    policy = np.array(rows['action.policy'], np.float32)
    clamped, held = np.array(rows['action.clamped']), np.array(rows['action.held'])
    assert rows['next.success'][-1] is True
    np.testing.assert_allclose(rows['timestamp'], np.arange(len(action)) / 30, atol=1e-6)
    assert not held[0] and not held[-1]
    fresh = int((~held).sum())
    # rows == executed policy steps. Held rows stand for stalls/underruns in which nothing new was commanded.
    # At 30 Hz each command the node executed (commands_sent) is one row; the engine's step count (actions,
    # the floor of the clock-paced position) may be one less, as the last tick was emitted before the limit
    # was seen. At 50 Hz the rows sample the ticks, and the last command may take one more row (rows.py).
    # A stall of the control loop (a loaded machine) skips deadlines: the arm held, the rows are held, and
    # `actions` (the timeline's position, on the clock) counts the steps that passed (Act.action).
    if rate_hz == 30.0:
        assert fresh == result.commands_sent, (fresh, result)
        assert -result.ticks_skipped <= fresh - result.actions <= 1, (fresh, result)
    else:
        # each dry spell (an underrun: a loaded machine delays a chunk) ends on a 50 Hz tick part-way through a
        # 30 Hz step, which then takes one more, partial row, as the episode's last step does
        assert -int(held.sum()) <= fresh - result.actions <= 1 + result.underruns, (fresh, result, int(held.sum()))

    # action == the commands that reached the controller topic (float32), in order, none dropped or added
    start = int(np.flatnonzero(np.all(commands == action[0], axis=1))[0])
    topic = commands[start:]
    if rate_hz == 30.0:
        np.testing.assert_array_equal(_collapse(action), _collapse(topic)[:len(_collapse(action))])
    else:
        # 50 Hz ticks, 30 Hz rows: each row is the command in effect at k/30, i.e. the topic's ticks taken
        # one or two apart (20 ms ticks against 33.3 ms rows); a held row repeats the command in effect
        idx, j = [], 0
        for k, row in enumerate(action):
            while j < len(topic) and not np.array_equal(topic[j], row):
                j += 1
            assert j < len(topic), f'row {k} {row} is no command the controller received'
            idx.append(j)
        steps = np.diff(idx)[~held[1:]]
        assert set(steps.tolist()) <= {1, 2, 3}, np.unique(steps, return_counts=True)
        assert (steps == 3).sum() <= 2, 'more than jitter: rows skipped ticks'   # a tick late across a cell edge
        assert np.all(np.diff(idx)[held[1:]] == 0)

    # the safety clamp: the policy's raw output is the second feature and differs exactly where clamped
    # over the limit as the node's safety filter decides it: the float32 action read as float64 against the
    # float64 limit, no tolerance (the ramp lands on 0.45 within a float32 ulp, above or below it by where
    # the chunk boundaries fell, which a loaded machine moves)
    over = policy[:, 2].astype(np.float64) > J2_LIMIT
    assert over.sum() > 10, policy[:, 2]
    assert clamped[over].all()
    if rate_hz == 30.0:
        np.testing.assert_array_equal(clamped[~held], over[~held])
    else:   # a row is clamped when any tick of its cell was: the first clamped tick may be its second one
        assert (clamped & ~over & ~held).sum() <= 1
    np.testing.assert_allclose(action[over, 2], J2_LIMIT, atol=1e-7)
    assert np.all(action[~over] == policy[~over])
    assert np.all(action[:, 2] <= J2_LIMIT + 1e-7) and np.all(np.isfinite(action))
    assert not np.any(np.all(commands == 0, axis=1)), 'a zero command reached the controller'

    stats = _seq('policy', 'stats', 'ramp')
    assert 'policy ramp: 1 episodes' in stats.stdout and '100% of 1' in stats.stdout, stats.stdout


class _ScriptedGrid:
    """The control thread's deadlines ``start + k * period`` (Runner's ControlGrid).

    The test says which deadline each tick serves, as the TickThread's pacer does.
    """

    def __init__(self, start: float, period: float) -> None:
        self.start, self.period, self.k = start, period, -1

    def index_at(self, t: float) -> int:
        return int((t - self.start) // self.period) if t >= self.start else -1

    def settled_index(self) -> int:
        return self.k

    def current_index(self) -> int:
        return self.k

    def deadline_s(self, k: int) -> float:
        return self.start + k * self.period


def test_ticks_woken_late_keep_their_own_rows_on_the_control_grid(tmp_path):
    """Capture maps the node's ticks to rows by the deadline each served, not by when it woke.

    A 30 Hz node against a 30 Hz policy: ticks woken 0.6 of a period late (still serving their deadline, as
    the pacer does up to a period) and two skipped deadlines. Every fresh tick is its own row, a skipped
    deadline a held row, and each row's command and clamp flag are its own tick's (stamped by wake-up time,
    an early tick after a late first one shared its neighbour's row and lost its command).
    """
    import time

    from sensor_msgs.msg import JointState

    from sequence_ai_ros.capture.settings import CaptureSettings, save_settings
    from sequence_ai_ros.capture.store import CaptureStore
    from sequence_ai_ros.datasets.rows import build_rows
    from sequence_ai_ros.node.config import CommandConfig, JointsConfig, NodeConfig, SafetyConfig
    from sequence_ai_ros.node.controller_commands import CommandInterface
    from sequence_ai_ros.node.observation import ObservationAssembler
    from sequence_ai_ros.node.runner import Runner, episode_settings
    from sequence_ai_ros.node.safety import SafetyFilter
    from sequence_ai_ros.protocol.spaces import ActionSpace
    from sequence_ai_ros.worker import serve_policy_file

    names = tuple(NAMES)
    capture = tmp_path / 'capture'
    save_settings(capture / 'ramp', CaptureSettings(rate=1.0, enabled=True))
    rng = np.random.default_rng(7)
    late = rng.random(200) < 0.4           # which deadlines' ticks wake 0.6 of a period late
    late[:12] = True                       # the first command's tick among them
    skipped = {40, 41, 77}                 # deadlines that get no tick (a stall)
    ticks: list[tuple[int, np.ndarray | None, bool, bool]] = []   # (deadline, command, fresh, clamped)
    with serve_policy_file(RAMP, 'ramp', capture_root=capture, names=list(names), step=0.01) as server:
        cfg = NodeConfig(model='ramp', endpoint=f'127.0.0.1:{server.port}', control_rate_hz=30.0,
                         joints=JointsConfig(names=names), command=CommandConfig(controller='arm'),
                         safety=SafetyConfig(lower_limits=(-1.0,) * 4, upper_limits=(1.0, 1.0, J2_LIMIT, 1.0)))
        commands = CommandInterface(cfg.command, cfg.command_joint_names, cfg.period_s)
        runner = Runner(cfg, commands, SafetyFilter(cfg.safety, cfg.command_joint_names),
                        ObservationAssembler(names, 0.5, {}, joints_source='joint_states'))
        runner.accepting = True
        assert runner.connect_now() == ''
        # the first command's tick must be among the late first twelve: the deployment serves before the
        # episode begins, rather than the episode holding while it loads (its own process)
        runner.policy.wait_until_ready(timeout=60)
        period = cfg.period_s
        grid = runner.grid = _ScriptedGrid(time.monotonic() + 0.05, period)
        runner.start(episode_settings('reach', 30.0))
        for k in range(len(late)):
            if k in skipped:
                continue
            wake = grid.deadline_s(k) + (0.6 * period if late[k] else 0.0)
            time.sleep(max(0.0, wake - time.monotonic()))
            now = time.monotonic()
            runner.assembler.put_joints(JointState(name=list(names), position=[0.1, 0.2, 0.3, 0.4]), now)
            grid.k = k
            value = runner.tick(now)
            fresh = runner.last_action is not None
            was_clamped = fresh and not np.allclose(runner.last_action.values, value)
            ticks.append((k, value, fresh, bool(was_clamped)))
            runner.session_step(now)
        eid = runner.request_end('completed')
        runner.session_step(time.monotonic())
        result = runner.wait(eid, 10)
        runner.close()
    assert result is not None
    [episode] = CaptureStore(capture / 'ramp', 'ramp').episodes()
    rows = build_rows(episode, 30.0, ActionSpace.JOINT_ABSOLUTE, 4, 4, [])

    fresh = [(k, v, c) for k, v, f, c in ticks if f]
    assert len(fresh) > 100 and any(c for _, _, c in fresh), 'the ramp must run and cross the j2 limit'
    k0 = fresh[0][0]
    by_deadline = {k: (v, c) for k, v, c in fresh}
    last = max(by_deadline)
    # every deadline from the first command to the last is one row: its own tick's, or held
    assert len(rows) == last - k0 + 1, (len(rows), last - k0 + 1)
    for r in range(len(rows)):
        k = k0 + r
        if k in by_deadline:
            value, clamped = by_deadline[k]
            assert not rows.held[r], f'row {r} (deadline {k}) is its fresh tick, not a hold'
            np.testing.assert_array_equal(rows.action[r], np.asarray(value, np.float32), err_msg=f'row {r}')
            assert rows.clamped[r] == clamped, f'row {r} (deadline {k}): clamp flag of another tick'
        else:
            assert rows.held[r], f'row {r} (deadline {k}) had no fresh tick'


def test_a_dry_run_exports_no_executed_action_and_a_reused_episode_id_is_told(tmp_path, seq_home, processes,
                                                                                 probe):
    """enabled:=false: nothing reaches the controller, so no exported row may claim a command.

    A run under a captured id is not captured, and the goal's result says so.
    """
    import subprocess

    folder = tmp_path / 'ramp'
    folder.mkdir()
    shutil.copy(RAMP, folder / 'policy.py')
    (folder / 'config.yaml').write_text(yaml.safe_dump({'names': NAMES, 'step': 0.01}))
    _seq('deploy', str(folder / 'policy.py'))
    _seq('policy', 'capture', 'ramp', '--rate', '1.0')
    serve = processes.spawn([sys.executable, '-m', 'sequence_ai_ros.cli', 'serve', 'ramp', '--port', '0'])
    port = int(serve.stdout.readline().split('127.0.0.1:')[1].split()[0])
    params = node_params(tmp_path, model='ramp', endpoint=f'127.0.0.1:{port}', control_rate_hz=30.0,
                         enabled=False, **{'joints.names': NAMES, 'command.controller': 'arm'})
    proc = spawn_node(processes, tmp_path / 'node.log', params)
    probe.publish_joints(NAMES)
    assert probe.wait_connected(timeout=60), node_log(proc)
    handle = probe.send_goal(instruction='reach', max_seconds=30.0, max_actions=45, episode_id='dry-1')
    result = probe.result(handle, timeout=60)
    # a dry run's ticks send nothing to the controller: the client's ledger counts them held (dry_run)
    assert result.reason == 'completed' and result.commands_sent == 0 and result.ticks_held > 30, \
        (result, node_log(proc))
    assert probe.values() == [], 'dry run: nothing reaches the controller topic'
    # the same id again: served, not captured, and the goal's result says so
    again = probe.result(probe.send_goal(instruction='reach', max_seconds=5.0, max_actions=10, episode_id='dry-1'),
                         timeout=60)
    assert again.reason == 'completed' and "not captured: deployment ramp: episode 'dry-1' was already " \
        'captured' in again.message, again
    serve.terminate()
    serve.wait(timeout=20)

    out = tmp_path / 'export'
    done = subprocess.run([sys.executable, '-m', 'sequence_ai_ros.cli', 'policy', 'data', 'export', 'ramp', '--out',
                           str(out), '--format', 'lerobot'], capture_output=True, text=True, timeout=300)
    # the episode is kept (its policy actions and observations) but has no executed action: the export skips
    # it by name and says why; with nothing else to export it is an error (exit 2)
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    assert "no exportable episodes (skipped: [('dry-1', 'no executed action (0 rows)')])" in done.stderr, done
