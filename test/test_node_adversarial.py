"""Adversarial review of issue 15's node: bugs found with bad input and faults, one test each.

Real node processes (rclpy over DDS), a real gRPC worker on loopback and a probe node, as in
``test_node_*.py``.

Each test was first committed ``xfail(strict=True)`` naming the bug, and lost its mark with the fix.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from std_msgs.msg import Float64MultiArray
from test_node_support import RAMP, Probe, node_log, node_params, observation_refusals, spawn_node, wait_for

from sequence_ai_ros.worker import serve_policy_file

pytestmark = [pytest.mark.ros, pytest.mark.slow]

NAMES = ['j0', 'j1', 'j2', 'j3']
POLICIES = RAMP.parent


def bug(reason: str) -> pytest.MarkDecorator:
    """Mark a test that exposes an open bug: expected to fail on its assertion until the bug is fixed."""
    return pytest.mark.xfail(strict=True, raises=AssertionError, reason=f'bug: {reason}')


def _params(tmp_path, port, name='params.yaml', **extra):
    base = {'model': 'ramp', 'endpoint': f'127.0.0.1:{port}', 'joints.names': NAMES, 'command.controller': 'arm',
            'status_rate_hz': 10.0, 'diagnostics_rate_hz': 5.0}
    base.update(extra)
    return node_params(tmp_path, name, **base)


@pytest.fixture
def probe(rclpy_context):
    p = Probe(rclpy_context, Float64MultiArray, '/arm/commands')
    yield p
    p.close()


def _set_params(probe, **values):
    """``ros2 param set`` on the node; return the SetParametersResult list."""
    from rcl_interfaces.srv import SetParameters
    from rclpy.parameter import Parameter

    client = probe.node.create_client(SetParameters, f'{probe.node_path}/set_parameters')
    assert client.wait_for_service(timeout_sec=20)
    req = SetParameters.Request(parameters=[Parameter(k, value=v).to_parameter_msg() for k, v in values.items()])
    fut = client.call_async(req)
    assert wait_for(fut.done, 10)
    return fut.result().results


def _lifecycle(probe):
    """(state(), transition(label) -> success) through the node's lifecycle services."""
    from lifecycle_msgs.srv import ChangeState, GetState

    change = probe.node.create_client(ChangeState, f'{probe.node_path}/change_state')
    get = probe.node.create_client(GetState, f'{probe.node_path}/get_state')
    assert change.wait_for_service(timeout_sec=20) and get.wait_for_service(timeout_sec=20)

    def state():
        fut = get.call_async(GetState.Request())
        assert wait_for(fut.done, 10)
        return fut.result().current_state.label

    def transition(label, timeout=20.0):
        req = ChangeState.Request()
        req.transition.label = label
        fut = change.call_async(req)
        assert wait_for(fut.done, timeout), f'{label} did not answer'
        return fut.result().success
    return state, transition


def _moving(values) -> bool:
    return any(not np.allclose(a[1], b[1]) for a, b in zip(values, values[1:], strict=False))


def _hold_after(probe, t: float, timeout: float = 20.0) -> bool:
    """Wait (bounded) for a one-point hold trajectory received after ``t``; True when one came."""
    return bool(wait_for(lambda: any(x > t and len(m.points) == 1 for x, m in probe.commands), timeout))


def _zero_after(probe, timeout: float = 20.0) -> bool:
    """Wait (bounded) until the last velocity command received is all zero; then it must stay so (0.5 s)."""
    if not wait_for(lambda: probe.values() and np.allclose(probe.values()[-1][1], 0.0), timeout):
        return False
    time.sleep(0.5)                      # a later moving command would show here
    return bool(np.allclose(probe.values()[-1][1], 0.0))


def _quiet(probe, gap: float = 0.5, timeout: float = 20.0) -> bool:
    """Wait (bounded) until no command has arrived for ``gap`` s; True when the stream went quiet."""
    return bool(wait_for(lambda: not probe.values(since=time.monotonic() - gap), timeout, step=0.05))


# -- safety: what the controller receives ------------------------------------------------------------

def test_activate_again_does_not_command_the_old_hold_far_from_the_measured_state(tmp_path, processes, probe):
    """Deactivate, the arm is moved elsewhere (teleop, another controller), activate: no jump back.

    With no goal the node must not command the old episode's last position (1.5 rad away, max_step 0.02).
    """
    measured = {'q': np.linspace(0.1, 0.4, 4)}
    with serve_policy_file(RAMP, 'ramp', names=NAMES, step=0.002) as server:
        proc = spawn_node(processes, tmp_path / 'node.log', _params(
            tmp_path, server.port, autostart=False, **{'safety.max_step': [0.02]}))
        probe.publish_joints(NAMES, positions=lambda: measured['q'])
        _state, transition = _lifecycle(probe)
        assert transition('configure') and transition('activate'), node_log(proc)
        assert probe.wait_connected(), node_log(proc)
        handle = probe.send_goal(instruction='reach', max_seconds=20.0)
        assert wait_for(lambda: len(probe.values()) > 40, 30), node_log(proc)
        assert transition('deactivate') and probe.result(handle).reason == 'interrupted'
        old_hold = probe.values()[-1][1]
        measured['q'] = old_hold + 1.5          # moved elsewhere while the node is inactive
        time.sleep(0.5)
        t = time.monotonic()
        assert transition('activate'), node_log(proc)
        time.sleep(0.5)
        after = probe.values(since=t)
    assert not after or np.abs(after[0][1] - measured['q']).max() <= 0.02 + 1e-9, (
        f'on activate, with no goal, the node commanded the old hold {after[0][1]} {len(after)} times while the '
        f'arm is at {measured["q"]}')


def test_enabled_true_again_mid_episode_respects_the_step_limit(tmp_path, processes, probe):
    """Dry run mid-episode, then enabled again: the controller's next command is within max_step.

    enabled:=false sends the commands to ~/would_command while the policy keeps moving; after
    enabled:=true, safety.max_step (0.02 per period) must bound what the controller receives next.
    """
    with serve_policy_file(RAMP, 'ramp', names=NAMES, step=0.01) as server:
        proc = spawn_node(processes, tmp_path / 'node.log',
                          _params(tmp_path, server.port, **{'safety.max_step': [0.02]}))
        probe.publish_joints(NAMES)
        assert probe.wait_connected(), node_log(proc)
        handle = probe.send_goal(instruction='reach', max_seconds=20.0)
        assert wait_for(lambda: len(probe.values()) > 30, 30), node_log(proc)
        assert all(r.successful for r in _set_params(probe, enabled=False))
        time.sleep(1.5)
        assert all(r.successful for r in _set_params(probe, enabled=True))
        time.sleep(0.5)
        probe.call('interrupt')
        probe.result(handle)
    v = np.array([x for _, x in probe.values()])
    step = np.abs(np.diff(v, axis=0)).max()
    assert step <= 0.02 + 1e-6, f'the controller received a step of {step:.3f} rad (safety.max_step 0.02)'


def test_a_clock_jumping_back_never_makes_a_dead_source_fresh(tmp_path, processes, probe):
    """A /clock that jumps back 30 s as joint_states stop: the node holds after max_age, as always.

    use_sim_time and stamp_source=header (a looping bag, a reset simulator): the last message must go
    stale after joints.max_age_s (0.5 s) and the node hold, not count as fresh until the clock catches up.
    """
    from rosgraph_msgs.msg import Clock

    from sequence_ai_ros.node.trajectory import _time

    sim = {'t': 5000.0, 'last': time.monotonic()}
    clock_pub = probe.node.create_publisher(Clock, '/clock', 10)

    def clock_tick():
        now = time.monotonic()
        sim['t'] += now - sim['last']
        sim['last'] = now
        clock_pub.publish(Clock(clock=_time(int(sim['t'] * 1e9))))

    def joints():
        msg = probe.JointState(name=NAMES, position=[0.1, 0.2, 0.3, 0.4])
        msg.header.stamp = _time(int(sim['t'] * 1e9))
        probe.joint_pub.publish(msg)
    probe._timers.append(probe.node.create_timer(0.005, clock_tick))
    joint_timer = probe.node.create_timer(0.01, joints)
    probe._timers.append(joint_timer)
    with serve_policy_file(RAMP, 'ramp', names=NAMES, step=0.0005) as server:
        proc = spawn_node(processes, tmp_path / 'node.log', _params(
            tmp_path, server.port, use_sim_time=True, stamp_source='header'))
        assert probe.wait_connected(), node_log(proc)
        handle = probe.send_goal(instruction='reach', max_seconds=6.0)
        assert wait_for(lambda: probe.feedback and probe.feedback[-1].feedback.commands_sent > 30, 30), node_log(proc)
        joint_timer.cancel()
        sim['t'] -= 30.0
        t_stop = time.monotonic()
        # the node holds (one command over and over) once the source is max_age old: within 20 s, long before
        # the 30 s after which the bug's stale message stopped counting as fresh
        held = wait_for(lambda: len(probe.values(since=t_stop)) > 60
                        and not _moving(probe.values(since=t_stop)[-40:]), 20)
        age = probe.diag_value('observation', 'age_s./joint_states')
        observation = probe.diag_message('observation')
        probe.call('interrupt')
        probe.result(handle)
    assert held, f'commands follow the policy 20 s after joint_states stopped (age {age} s: {observation!r})'


def test_trajectory_mode_holds_when_the_observation_goes_stale(tmp_path, processes, rclpy_context):
    """README: 'a stale or missing source makes the node hold'; trajectory mode too.

    The controller keeps playing the last trajectory (here 3 s of motion) unless the node replaces it
    with a hold.
    """
    from trajectory_msgs.msg import JointTrajectory

    probe = Probe(rclpy_context, JointTrajectory, '/arm/joint_trajectory')
    try:
        with serve_policy_file(RAMP, 'ramp', names=NAMES, step=0.002, chunk_length=90) as server:
            # stale_grace_s 30: the episode goes on, so a hold is the stale source's, not the episode end's
            proc = spawn_node(processes, tmp_path / 'node.log', _params(tmp_path, server.port, stale_grace_s=30.0, **{
                'command.interface': 'joint_trajectory', 'command.mode': 'trajectory'}))
            timer = probe.publish_joints(NAMES)
            assert probe.wait_connected(), node_log(proc)
            handle = probe.send_goal(instruction='reach', max_seconds=60.0)
            assert wait_for(lambda: len(probe.commands) >= 2, 30), node_log(proc)
            timer.cancel()                       # joint_states stop: stale after joints.max_age_s (0.5 s)
            t_stop = time.monotonic()
            held = _hold_after(probe, t_stop)
            after = [(t - t_stop, m) for t, m in probe.commands if t > t_stop]
            ticks_held = probe.feedback[-1].feedback.ticks_held
            probe.call('interrupt')
            probe.result(handle)
    finally:
        probe.close()
    assert held, (f'no hold within 20 s of joint_states stopping (messages after, s and points: '
                  f'{[(round(t, 3), len(m.points)) for t, m in after]}), while ticks_held says {ticks_held}')


# -- diagnostics and accounting ----------------------------------------------------------------------

def test_diagnostics_thresholds_set_at_run_time_take_effect(tmp_path, processes, probe):
    with serve_policy_file(RAMP, 'ramp', names=NAMES, step=0.002) as server:
        # skipped ticks on loaded cores must not raise the level this test reads (the jitter one)
        proc = spawn_node(processes, tmp_path / 'node.log', _params(tmp_path, server.port, **{
            'diagnostics.jitter_warn_ms': 1000.0, 'diagnostics.jitter_error_ms': 2000.0,
            'diagnostics.ticks_skipped_warn': 100000, 'diagnostics.ticks_skipped_error': 100000}))
        probe.publish_joints(NAMES)
        assert probe.wait_connected(), node_log(proc)
        assert wait_for(lambda: probe.diag_level('control') == 0, 30), node_log(proc)
        results = _set_params(probe, **{'diagnostics.jitter_warn_ms': 1e-6})   # below any real jitter
        assert all(r.successful for r in results), results
        t = time.monotonic()
        assert wait_for(lambda: probe.diagnostics_since(t + 0.5), 15)
        level, message = probe.diag_level('control'), probe.diag_message('control')
    assert level == 1, f'control level {level} ({message!r}) with jitter_warn_ms 1e-6 set at run time'


def test_run_time_thresholds_refuse_warn_above_error(tmp_path, processes, probe):
    with serve_policy_file(RAMP, 'ramp', names=NAMES, step=0.002) as server:
        proc = spawn_node(processes, tmp_path / 'node.log', _params(tmp_path, server.port))
        assert wait_for(lambda: probe.status, 20), node_log(proc)
        results = _set_params(probe, **{'diagnostics.jitter_error_ms': 0.5})    # below jitter_warn_ms 5.0
    assert not results[0].successful, 'jitter_error_ms 0.5 < jitter_warn_ms 5.0 accepted at run time'


def _skipped(probe):
    t = time.monotonic()
    assert wait_for(lambda: probe.diagnostics_since(t), 15), 'no /diagnostics'
    return int(probe.diag_value('control', 'ticks_skipped') or 0)


def _account(probe, goal, rate=50.0):
    """Send the goal; return its result, the ticks it skipped (checked against /diagnostics) and its periods."""
    before = _skipped(probe)
    result = probe.result(probe.send_goal(**goal), timeout=30)
    # /diagnostics counts a skip when the late tick comes: one message later it holds the episode's skips too
    assert wait_for(lambda: _skipped(probe) - before >= result.ticks_skipped, 15), (_skipped(probe) - before, result)
    return result, result.ticks_skipped, result.elapsed_s * rate


def test_every_period_is_accounted_for_with_on_underrun_stop(tmp_path, processes, probe):
    from test_node_support import spawn_worker

    names = ['frame', 'request']
    port = spawn_worker(processes, POLICIES / 'client_latency.py', 'slow', mean_s=0.3)   # slower than its chunks
    proc = spawn_node(processes, tmp_path / 'node.log', node_params(
        tmp_path, model='slow', endpoint=f'127.0.0.1:{port}', diagnostics_rate_hz=5.0, status_rate_hz=10.0,
        on_underrun='stop', **{'joints.names': names, 'command.controller': 'arm'}))
    probe.publish_joints(names)
    assert probe.wait_connected(), node_log(proc)
    result, skipped, periods = _account(probe, {'instruction': 'slow', 'max_seconds': 3.0})
    total = result.commands_sent + result.ticks_held + skipped
    assert result.underruns > 0
    assert abs(total - periods) <= 3, (f'commands {result.commands_sent} + holds {result.ticks_held} + skipped '
                                       f'{skipped} = {total} of {periods:.0f} periods')


def test_trajectory_mode_accounts_for_every_period(tmp_path, processes, rclpy_context):
    """Trajectory mode: commands_sent + ticks_held + skipped ticks = the periods, as in streaming mode.

    Act.action: commands_sent counts the control ticks the published trajectories cover, ticks_held the
    ticks that held (one hold message per stop, not one per tick); an underrunning policy has both.
    """
    from test_node_support import spawn_worker
    from trajectory_msgs.msg import JointTrajectory

    probe = Probe(rclpy_context, JointTrajectory, '/arm/joint_trajectory')
    try:
        names = ['frame', 'request']
        port = spawn_worker(processes, POLICIES / 'client_latency.py', 'slow', mean_s=0.3)
        proc = spawn_node(processes, tmp_path / 'node.log', node_params(
            tmp_path, model='slow', endpoint=f'127.0.0.1:{port}', diagnostics_rate_hz=5.0, status_rate_hz=10.0,
            **{'joints.names': names, 'command.controller': 'arm', 'command.interface': 'joint_trajectory',
               'command.mode': 'trajectory'}))
        probe.publish_joints(names)
        assert probe.wait_connected(), node_log(proc)
        t0 = time.monotonic()
        result, skipped, periods = _account(probe, {'instruction': 'slow', 'max_seconds': 3.0})
        time.sleep(0.3)
        wire = [m for t, m in probe.commands if t >= t0]
    finally:
        probe.close()
    trajectories = sum(len(m.points) > 1 for m in wire)
    total = result.commands_sent + result.ticks_held + skipped
    assert result.underruns > 0 and result.ticks_held > 0, result
    assert abs(total - periods) <= 3, (f'commands {result.commands_sent} + held {result.ticks_held} + skipped '
                                       f'{skipped} = {total} of {periods:.0f} periods')
    assert 0 < trajectories <= result.chunks, (trajectories, result.chunks)


# -- start-up --------------------------------------------------------------------------------------

@pytest.mark.parametrize('extra, name', [
    ({'joints.topic': 'joint states'}, 'joints.topic'),
    ({'command.controller': 'my arm'}, 'command.controller'),
    ({'command.topic': '/arm//commands'}, 'command.topic'),
    ({'camera_names': ['front'], 'cameras.front.topic': 'front camera/image'}, 'cameras.front.topic'),
], ids=['joints_topic', 'controller', 'command_topic', 'camera_topic'])
def test_an_invalid_topic_name_is_a_clear_parameter_error(tmp_path, processes, extra, name):
    proc = spawn_node(processes, tmp_path / 'node.log', _params(tmp_path, 1, **extra))
    assert proc.wait(timeout=30) == 2, node_log(proc)
    log = node_log(proc)
    assert f'policy_node: parameter {name}' in log and 'Traceback' not in log, log


def test_an_unexpected_configure_failure_is_logged_with_its_cause(tmp_path, processes, rclpy_context):
    probe = Probe(rclpy_context)
    try:
        with serve_policy_file(RAMP, 'ramp', names=NAMES, action_space='ee_absolute') as server:
            proc = spawn_node(processes, tmp_path / 'node.log', _params(tmp_path, server.port, **{
                'command.interface': 'pose', 'command.topic': '/ee/target_pose',
                'command.gripper_topic': 'gripper commands'}))
            found = wait_for(lambda: 'gripper' in node_log(proc) or proc.poll() is not None, 30)
            status = probe.status[-1].message if probe.status else ''
    finally:
        probe.close()
    assert found, f'no word of the cause after 30 s of retries (~/status: {status!r}); {node_log(proc)}'


def test_a_velocity_interface_never_leaves_a_moving_command_behind(tmp_path, processes, rclpy_context):
    probe = Probe(rclpy_context, Float64MultiArray, '/vel/commands')
    try:
        with serve_policy_file(RAMP, 'ramp', names=NAMES, action_space='joint_velocity', offset=0.3) as server:
            proc = spawn_node(processes, tmp_path / 'node.log', _params(tmp_path, server.port, on_underrun='stop', **{
                'command.controller': 'vel', 'command.kind': 'velocity'}))
            probe.publish_joints(NAMES)
            assert probe.wait_connected(), node_log(proc)
            handle = probe.send_goal(instruction='move', max_seconds=20.0)
            assert wait_for(lambda: len(probe.values()) > 30, 30), node_log(proc)
            assert probe.call('interrupt').success
            assert probe.result(handle).reason == 'interrupted'
            stopped = _zero_after(probe)
            last = probe.values()[-1][1]
    finally:
        probe.close()
    assert stopped, f'the velocity controller was left with {last} after the episode stopped'


def test_on_underrun_set_at_run_time_survives_cleanup_and_configure(tmp_path, processes, probe):
    with serve_policy_file(RAMP, 'ramp', names=NAMES, step=0.002) as server:
        proc = spawn_node(processes, tmp_path / 'node.log', _params(tmp_path, server.port, autostart=False))
        probe.publish_joints(NAMES)
        _state, transition = _lifecycle(probe)
        assert transition('configure') and transition('activate'), node_log(proc)
        assert all(r.successful for r in _set_params(probe, on_underrun='stop'))
        assert transition('deactivate') and transition('cleanup'), node_log(proc)
        assert transition('configure') and transition('activate'), node_log(proc)
        assert probe.wait_connected(), node_log(proc)
        handle = probe.send_goal(instruction='reach', max_seconds=20.0)
        assert wait_for(lambda: len(probe.values()) > 20, 30), node_log(proc)
        assert probe.call('interrupt').success
        assert probe.result(handle).reason == 'interrupted'
        quiet = _quiet(probe)                  # what was in flight arrives; then nothing
        t_quiet = time.monotonic()
        time.sleep(1.0)
        later = probe.values(since=t_quiet)
    assert quiet and not later, "on_underrun reads 'stop' but the node holds (publishes) again"


# -- round 2, against the fixes of b7fc5ab/a0a0ea4 ----------------------------------------------------

def test_a_dry_run_on_a_velocity_interface_leaves_no_moving_command(tmp_path, processes, rclpy_context):
    probe = Probe(rclpy_context, Float64MultiArray, '/vel/commands')
    try:
        with serve_policy_file(RAMP, 'ramp', names=NAMES, action_space='joint_velocity', offset=0.3) as server:
            proc = spawn_node(processes, tmp_path / 'node.log', _params(tmp_path, server.port, **{
                'command.controller': 'vel', 'command.kind': 'velocity'}))
            probe.publish_joints(NAMES)
            assert probe.wait_connected(), node_log(proc)
            handle = probe.send_goal(instruction='move', max_seconds=20.0)
            assert wait_for(lambda: len(probe.values()) > 30, 30), node_log(proc)
            assert all(r.successful for r in _set_params(probe, enabled=False))
            stopped = _zero_after(probe)
            last = probe.values()[-1][1]
            probe.call('interrupt')
            probe.result(handle)
    finally:
        probe.close()
    assert stopped, f'during the dry run the velocity controller applies {last}'


def _trajectory_stop_probe(tmp_path, processes, rclpy_context, act):
    """Trajectory mode, on_underrun 'stop', 3 s chunks: ``act(probe)`` mid-chunk; the messages after it."""
    from trajectory_msgs.msg import JointTrajectory

    probe = Probe(rclpy_context, JointTrajectory, '/arm/joint_trajectory')
    try:
        with serve_policy_file(RAMP, 'ramp', names=NAMES, step=0.002, chunk_length=90) as server:
            # stale_grace_s 30, max_seconds 60: a hold within the wait below is the act's, not the episode end's
            proc = spawn_node(processes, tmp_path / 'node.log', _params(
                tmp_path, server.port, on_underrun='stop', stale_grace_s=30.0,
                **{'command.interface': 'joint_trajectory', 'command.mode': 'trajectory'}))
            timer = probe.publish_joints(NAMES)
            assert probe.wait_connected(), node_log(proc)
            handle = probe.send_goal(instruction='reach', max_seconds=60.0)
            assert wait_for(lambda: len(probe.commands) >= 2, 30), node_log(proc)
            t = time.monotonic()
            act(probe, timer)
            _hold_after(probe, t)
            after = [(x - t, m) for x, m in probe.commands if x > t]
            if probe.status and probe.status[-1].episode_id:
                probe.call('interrupt')
            probe.result(handle)
    finally:
        probe.close()
    return after


def test_trajectory_mode_interrupt_holds_with_on_underrun_stop(tmp_path, processes, rclpy_context):
    after = _trajectory_stop_probe(tmp_path, processes, rclpy_context, lambda probe, _timer: probe.call('interrupt'))
    assert any(len(m.points) == 1 for _, m in after), f'{len(after)} messages after ~/interrupt, no hold'


def test_trajectory_mode_deactivate_holds_with_on_underrun_stop(tmp_path, processes, rclpy_context):
    def deactivate(probe, _timer):
        assert _lifecycle(probe)[1]('deactivate')
    after = _trajectory_stop_probe(tmp_path, processes, rclpy_context, deactivate)
    assert any(len(m.points) == 1 for _, m in after), f'{len(after)} messages after deactivate, no hold'


def test_trajectory_mode_stale_source_holds_with_on_underrun_stop(tmp_path, processes, rclpy_context):
    after = _trajectory_stop_probe(tmp_path, processes, rclpy_context, lambda _probe, timer: timer.cancel())
    assert any(len(m.points) == 1 for _, m in after), \
        f'{len(after)} messages within 20 s of joint_states stopping (max_age 0.5 s), no hold'


def test_activate_again_publishes_nothing_before_a_goal_as_the_first_activate(tmp_path, processes, probe):
    measured = {'q': np.linspace(0.1, 0.4, 4)}
    with serve_policy_file(RAMP, 'ramp', names=NAMES, step=0.002) as server:
        proc = spawn_node(processes, tmp_path / 'node.log', _params(tmp_path, server.port, autostart=False))
        probe.publish_joints(NAMES, positions=lambda: measured['q'])
        _state, transition = _lifecycle(probe)
        t = time.monotonic()
        assert transition('configure') and transition('activate'), node_log(proc)
        time.sleep(1.0)
        first = len(probe.values(since=t))
        assert probe.result(probe.send_goal(instruction='reach', max_seconds=1.0)).reason == 'timeout'
        assert transition('deactivate'), node_log(proc)
        t = time.monotonic()
        assert transition('activate'), node_log(proc)
        measured['q'] = measured['q'] - 0.3      # the arm sags or is pushed: the node's commands follow it
        time.sleep(1.0)
        again = probe.values(since=t)
    assert first == 0
    assert len(again) <= 1, (f'{len(again)} commands in 1 s after re-activate with no goal, from {again[0][1]} to '
                             f'{again[-1][1]}')


def test_label_without_an_id_still_names_the_last_episode_after_cleanup(tmp_path, processes, probe):
    """~/label with no id labels the node's last episode, also after deactivate/cleanup/configure/activate."""
    from sequence_ai_ros.capture.settings import CaptureSettings, save_settings
    from sequence_ai_ros.capture.store import CaptureStore

    capture = tmp_path / 'capture'
    save_settings(capture / 'ramp', CaptureSettings(rate=1.0, enabled=True))
    with serve_policy_file(RAMP, 'ramp', capture_root=capture, names=NAMES, step=0.002) as server:
        proc = spawn_node(processes, tmp_path / 'node.log', _params(tmp_path, server.port, autostart=False))
        probe.publish_joints(NAMES)
        _state, transition = _lifecycle(probe)
        assert transition('configure') and transition('activate'), node_log(proc)
        assert probe.wait_connected(), node_log(proc)
        result = probe.result(probe.send_goal(instruction='reach', max_seconds=1.0))
        for step in ('deactivate', 'cleanup', 'configure', 'activate'):
            assert transition(step), (step, node_log(proc))
        resp = probe.call('label', success=True, notes='after cleanup')
        assert resp.ok, resp.message
    labels = {ep.episode_id: ep.label for ep in CaptureStore(capture / 'ramp', deployment='ramp').episodes()}
    assert labels[result.episode_id]['notes'] == 'after cleanup', labels


# -- round 3, against the fixes of d464f75/1bce5cd ----------------------------------------------------

def test_trajectory_mode_dry_run_replaces_the_playing_trajectory_with_a_hold(tmp_path, processes, rclpy_context):
    """enabled:=false mid-chunk in trajectory mode: the controller must stop, as a rate controller now does.

    Streaming position controllers stop at their last command and rate controllers get one zero-rate
    command (d464f75); joint_trajectory_controller keeps playing what it last received unless the node
    replaces it with a hold.
    """
    from trajectory_msgs.msg import JointTrajectory

    probe = Probe(rclpy_context, JointTrajectory, '/arm/joint_trajectory')
    try:
        with serve_policy_file(RAMP, 'ramp', names=NAMES, step=0.002, chunk_length=90) as server:
            proc = spawn_node(processes, tmp_path / 'node.log', _params(
                tmp_path, server.port, **{'command.interface': 'joint_trajectory', 'command.mode': 'trajectory'}))
            probe.publish_joints(NAMES)
            assert probe.wait_connected(), node_log(proc)
            handle = probe.send_goal(instruction='reach', max_seconds=60.0)   # a hold below is the dry run's
            assert wait_for(lambda: len(probe.commands) >= 2, 30), node_log(proc)
            t = time.monotonic()
            assert all(r.successful for r in _set_params(probe, enabled=False))
            _hold_after(probe, t)
            playing = [len(m.points) for x, m in probe.commands if x <= t][-1]
            after = [(round(x - t, 3), len(m.points)) for x, m in probe.commands if x > t]
            probe.call('interrupt')
            probe.result(handle)
    finally:
        probe.close()
    assert any(n == 1 for _, n in after), (
        f'dry run: the controller still has the {playing}-point trajectory it was playing; messages after '
        f'enabled:=false (s, points): {after}')


def test_trajectory_mode_resume_after_a_stale_source_respects_the_step_limit(tmp_path, processes, rclpy_context):
    """joint_states stop for 1 s (hold after max_age 0.5 s) while the policy's clock runs on; they come back.

    The controller holds at the hold's position; the republished horizon's first point is reached one chunk
    step (1/30 s) after it at most, so it must lie within safety.max_step x max(1, that time / period) of
    the hold, as streaming mode steps from its hold by max_step per period.
    """
    from trajectory_msgs.msg import JointTrajectory

    max_step, period, row_dt = 0.02, 1 / 50, 1 / 30
    probe = Probe(rclpy_context, JointTrajectory, '/arm/joint_trajectory')
    try:
        with serve_policy_file(RAMP, 'ramp', names=NAMES, step=0.006, chunk_length=90) as server:
            proc = spawn_node(processes, tmp_path / 'node.log', _params(
                tmp_path, server.port, stale_grace_s=30.0, **{
                    'command.interface': 'joint_trajectory', 'command.mode': 'trajectory',
                    'safety.max_step': [max_step]}))
            timer = probe.publish_joints(NAMES)
            assert probe.wait_connected(), node_log(proc)
            handle = probe.send_goal(instruction='reach', max_seconds=60.0)
            assert wait_for(lambda: len(probe.commands) >= 2, 30), node_log(proc)
            timer.cancel()
            assert _hold_after(probe, time.monotonic()), node_log(proc)     # stale: the node held
            time.sleep(0.5)                                                   # while the policy's clock runs on
            t_back = time.monotonic()
            probe.publish_joints(NAMES)
            assert wait_for(lambda: any(x > t_back and len(m.points) > 1 for x, m in probe.commands), 20), \
                node_log(proc)
            probe.call('interrupt')
            probe.result(handle)
    finally:
        probe.close()
    holds = [m for x, m in probe.commands if x < t_back and len(m.points) == 1]
    resumed = next(m for x, m in probe.commands if x > t_back and len(m.points) > 1)
    assert holds, 'no hold while joint_states were stale'
    hold = np.array(holds[-1].points[0].positions)
    first = np.array(resumed.points[0].positions)
    allowed = max_step * max(1.0, row_dt / period) + 1e-6
    assert np.abs(first - hold).max() <= allowed, (
        f'the controller holds at {hold}; the republished horizon starts at {first} within 1/30 s: a step of '
        f'{np.abs(first - hold).max():.4f} (safety.max_step {max_step} per {period} s period, at most {allowed:.4f})')


def test_trajectory_mode_enabled_true_republishes_the_playing_horizon(tmp_path, processes, rclpy_context):
    """enabled:=false then :=true mid-chunk (3 s chunks): the controller gets the playing chunk's horizon at once.

    Streaming mode commands the controller on the next tick after enabled:=true; after a stale source
    trajectory mode republishes the playing chunk's remaining horizon (d464f75). After a dry run it waits
    for the next chunk.
    """
    from trajectory_msgs.msg import JointTrajectory

    probe = Probe(rclpy_context, JointTrajectory, '/arm/joint_trajectory')
    try:
        # 10 s chunks: the next one is asked for 2.5 s before the playing one ends, long after the republish
        with serve_policy_file(RAMP, 'ramp', names=NAMES, step=0.002, chunk_length=300) as server:
            proc = spawn_node(processes, tmp_path / 'node.log', _params(
                tmp_path, server.port, **{'command.interface': 'joint_trajectory', 'command.mode': 'trajectory'}))
            probe.publish_joints(NAMES)
            assert probe.wait_connected(), node_log(proc)
            handle = probe.send_goal(instruction='reach', max_seconds=60.0)
            # the episode's second chunk follows its first at once (the first seam's request): from then on
            # the playing chunk lasts seconds, and the republish must come before the next one
            assert wait_for(lambda: probe.feedback and probe.feedback[-1].feedback.chunks >= 2, 30), node_log(proc)
            assert all(r.successful for r in _set_params(probe, enabled=False))
            playing = probe.feedback[-1].feedback.chunks
            t_on = time.monotonic()
            assert all(r.successful for r in _set_params(probe, enabled=True))
            got = wait_for(lambda: any(x > t_on and len(m.points) > 1 for x, m in probe.commands), 20)
            seen = len(probe.feedback)                       # the chunk count from two feedbacks later (5 Hz),
            wait_for(lambda: len(probe.feedback) >= seen + 2, 10)   # so it includes a chunk that brought it
            chunks = probe.feedback[-1].feedback.chunks
            after = [(round(x - t_on, 3), len(m.points)) for x, m in probe.commands if x > t_on]
            dry = len(probe.feedback) and probe.feedback[-1].feedback.commands_sent
            probe.call('interrupt')
            probe.result(handle)
    finally:
        probe.close()
    assert got and chunks == playing, (
        f'after enabled:=true the controller got no trajectory of the playing chunk (messages, s and points: '
        f'{after}; chunks {playing} then {chunks}); commands_sent {dry}')


def test_dry_run_and_deactivate_together_leave_no_moving_velocity_command(tmp_path, processes, rclpy_context):
    """A supervisor's 'stop' sends enabled:=false and deactivate at once (a rate interface, velocity).

    Each alone leaves zeros with the controller; together the controller keeps the last non-zero velocity.
    """
    from lifecycle_msgs.srv import ChangeState
    from rcl_interfaces.srv import SetParameters
    from rclpy.parameter import Parameter

    probe = Probe(rclpy_context, Float64MultiArray, '/vel/commands')
    left = []
    try:
        with serve_policy_file(RAMP, 'ramp', names=NAMES, action_space='joint_velocity', offset=0.3) as server:
            proc = spawn_node(processes, tmp_path / 'node.log', _params(tmp_path, server.port, **{
                'command.controller': 'vel', 'command.kind': 'velocity'}))
            probe.publish_joints(NAMES)
            assert probe.wait_connected(), node_log(proc)
            _state, transition = _lifecycle(probe)
            change = probe.node.create_client(ChangeState, f'{probe.node_path}/change_state')
            set_params = probe.node.create_client(SetParameters, f'{probe.node_path}/set_parameters')
            assert change.wait_for_service(timeout_sec=20) and set_params.wait_for_service(timeout_sec=20)
            for trial in range(5):
                if trial:
                    assert all(r.successful for r in _set_params(probe, enabled=True))
                    assert transition('activate'), node_log(proc)
                handle = probe.send_goal(instruction='move', max_seconds=20.0)
                t = time.monotonic()
                assert wait_for(lambda t=t: len(probe.values(since=t)) > 10, 30), node_log(proc)
                req = ChangeState.Request()
                req.transition.label = 'deactivate'
                dry = set_params.call_async(SetParameters.Request(
                    parameters=[Parameter('enabled', value=False).to_parameter_msg()]))
                deactivated = change.call_async(req)
                assert wait_for(lambda a=dry, b=deactivated: a.done() and b.done(), 10)
                assert deactivated.result().success and dry.result().results[0].successful
                probe.result(handle)
                wait_for(lambda: np.allclose(probe.values()[-1][1], 0.0), 10)   # the zero, however late
                time.sleep(0.3)                                                  # and nothing after it
                left.append(probe.values()[-1][1])
    finally:
        probe.close()
    moving = [v for v in left if not np.allclose(v, 0.0)]
    assert not moving, f'{len(moving)} of {len(left)} times the velocity controller was left with {moving[0]}'


def test_label_without_an_id_survives_a_configure_refused_for_the_contract(tmp_path, processes, probe):
    """Episode, cleanup; the worker comes back with another policy (configure refused), then the right one."""
    from sequence_ai_ros.capture.settings import CaptureSettings, save_settings
    from sequence_ai_ros.capture.store import CaptureStore
    from sequence_ai_ros.worker.config import ServerConfig

    capture = tmp_path / 'capture'
    save_settings(capture / 'ramp', CaptureSettings(rate=1.0, enabled=True))
    with serve_policy_file(RAMP, 'ramp', capture_root=capture, names=NAMES, step=0.002) as server:
        port = server.port
        proc = spawn_node(processes, tmp_path / 'node.log', _params(tmp_path, port, autostart=False))
        probe.publish_joints(NAMES)
        _state, transition = _lifecycle(probe)
        assert transition('configure') and transition('activate'), node_log(proc)
        result = probe.result(probe.send_goal(instruction='reach', max_seconds=1.0))
        assert transition('deactivate') and transition('cleanup'), node_log(proc)
    with serve_policy_file(RAMP, 'ramp', ServerConfig.embedded(port=port), names=['a', 'b', 'c', 'd']):
        assert not transition('configure'), 'a policy with other joint names was accepted'
    with serve_policy_file(RAMP, 'ramp', ServerConfig.embedded(port=port), capture_root=capture, names=NAMES):
        assert transition('configure') and transition('activate'), node_log(proc)
        resp = probe.call('label', success=True, notes='after a refused configure')
    labels = {ep.episode_id: ep.label for ep in CaptureStore(capture / 'ramp', deployment='ramp').episodes()}
    assert resp.ok, f'{resp.message!r} (the node ran {result.episode_id})'
    assert labels[result.episode_id]['notes'] == 'after a refused configure', labels


def test_trajectory_mode_first_trajectory_respects_the_step_limit_from_the_measured_state(tmp_path, processes,
                                                                                         rclpy_context):
    """A policy starting 0.3 rad from the measured state, max_step 0.02 per 20 ms period, 1/30 s chunk steps.

    The first point (time_from_start 0, stamped less than one chunk step ahead) may lie at most
    max_step x (1/30 s / 20 ms) from the measured state; the same mechanism as after a stale source.
    """
    from trajectory_msgs.msg import JointTrajectory

    max_step, period, row_dt = 0.02, 1 / 50, 1 / 30
    measured = np.linspace(0.1, 0.4, 4)
    probe = Probe(rclpy_context, JointTrajectory, '/arm/joint_trajectory')
    try:
        with serve_policy_file(RAMP, 'ramp', names=NAMES, step=0.002, offset=0.3, chunk_length=90) as server:
            proc = spawn_node(processes, tmp_path / 'node.log', _params(tmp_path, server.port, **{
                'command.interface': 'joint_trajectory', 'command.mode': 'trajectory',
                'safety.max_step': [max_step]}))
            probe.publish_joints(NAMES, positions=lambda: measured)
            assert probe.wait_connected(), node_log(proc)
            handle = probe.send_goal(instruction='reach', max_seconds=20.0)
            assert wait_for(lambda: probe.commands, 30), node_log(proc)
            probe.call('interrupt')
            probe.result(handle)
    finally:
        probe.close()
    first = np.array(probe.commands[0][1].points[0].positions)
    allowed = max_step * max(1.0, row_dt / period) + 1e-6
    assert np.abs(first - measured).max() <= allowed, (
        f'the arm is at {measured}; the first trajectory starts at {first} within 1/30 s: a step of '
        f'{np.abs(first - measured).max():.4f} (at most {allowed:.4f})')


@pytest.mark.parametrize('namespace', ['bad name', 'a//b'])
def test_an_invalid_namespace_remap_is_a_clear_error(tmp_path, processes, namespace):
    """-r __ns:=... that rcl refuses ends policy_node with one line and exit 2, not an RCLError traceback."""
    proc = spawn_node(processes, tmp_path / 'node.log', _params(tmp_path, 1), namespace=namespace)
    assert proc.wait(timeout=30) == 2, node_log(proc)
    log = node_log(proc)
    assert 'policy_node: invalid --ros-args' in log and 'Traceback' not in log, log


# -- round 4, against 4622ce5 (feedback elapsed_s) and e19c416 (SCHED_FIFO control thread) --------------

def test_result_counts_cover_its_elapsed_time_when_the_end_waits_on_a_ready_poll_to_a_hung_worker(
        tmp_path, processes, probe):
    """Act.Result: commands_sent + ticks_held + ticks_skipped = elapsed_s x rate (the episode's periods), within 2.

    The worker hangs (SIGSTOP), so the session thread's once-a-second Ready call waits its 2 s deadline; the
    joint states then stop, and stale_grace_s later the control thread stops the episode (the counts stop
    there). The result's elapsed_s must end there too, not when the session thread gets round to ending it.
    Measured (3 of 3 runs): 87-88 periods counted against an elapsed_s of 143-147 periods (1.1-1.2 s more).
    """
    import signal

    from test_node_support import spawn_worker

    port = spawn_worker(processes, RAMP, 'ramp', names=NAMES, step=0.001)
    worker = processes.procs[-1]
    proc = spawn_node(processes, tmp_path / 'node.log', _params(tmp_path, port, stale_grace_s=0.3))
    joints = probe.publish_joints(NAMES)
    assert probe.wait_connected(), node_log(proc)
    handle = probe.send_goal(instruction='reach', max_seconds=10.0)
    assert wait_for(lambda: len(probe.values()) > 20, 30), node_log(proc)
    worker.send_signal(signal.SIGSTOP)
    try:
        time.sleep(0.5)
        joints.cancel()     # stale (max_age 0.5 s) + stale_grace_s 0.3 s: the node stops the episode ~1.3 s after
        #                     the freeze, while a Ready poll begun in the freeze's first second waits until 2-3 s
        result = probe.result(handle, timeout=30)
    finally:
        worker.send_signal(signal.SIGCONT)
    assert result.reason == 'error' and 'observation invalid' in result.message, result
    _assert_result_covers_its_time(result)


def _assert_result_covers_its_time(result, period=1 / 50):
    """Act.Result: commands_sent + ticks_held + ticks_skipped = elapsed_s x rate, within two periods."""
    counted = result.commands_sent + result.ticks_held + result.ticks_skipped
    assert abs(counted - result.elapsed_s / period) <= 2, (
        f'{counted} periods counted (sent {result.commands_sent}, held {result.ticks_held}, skipped '
        f'{result.ticks_skipped}) in a result elapsed_s of {result.elapsed_s:.3f} s = '
        f'{result.elapsed_s / period:.1f} periods')


HOG = r'''
import os, sys, time
os.sched_setaffinity(0, {int(sys.argv[1])})
os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(int(sys.argv[3])))
print('go', flush=True)
end = time.monotonic() + float(sys.argv[2])
while time.monotonic() < end:
    pass
'''
#: The tests that stall a node's control thread with a FIFO 60 hog pinned to the last core run on one xdist worker, in
#: turn: two at once pin both nodes' control threads and both hogs to the same core, so each stalls the other's node
#: too (one such make test under extra load left an Act goal unanswered for 15 s).
ONE_HOG_AT_A_TIME = pytest.mark.xdist_group('fifo_hog')


def _fifo_threads(pid: int) -> list[int]:
    """Thread ids of process ``pid`` whose policy is SCHED_FIFO (/proc/<pid>/task/<tid>/stat field 41)."""
    import os

    out = []
    for tid in os.listdir(f'/proc/{pid}/task'):
        try:
            fields = open(f'/proc/{pid}/task/{tid}/stat').read().rsplit(')', 1)[1].split()
        except FileNotFoundError:
            continue
        if int(fields[38]) == os.SCHED_FIFO:
            out.append(int(tid))
    return out


@ONE_HOG_AT_A_TIME
def test_result_counts_cover_a_control_thread_stall_that_an_interrupt_ends(tmp_path, processes, probe):
    """Act.Result: commands_sent + ticks_held + ticks_skipped = elapsed_s x rate, also when the stall ends the run.

    The control thread (SCHED_FIFO 50) is stalled by a busier real-time thread on its core (a FIFO 60 hog,
    0.8 s; on a robot another real-time process) while the rest of the node runs; an interrupt comes 0.3 s
    into the stall. The ~15 periods the control thread missed before the interrupt are the episode's, and the
    result's elapsed_s covers them, so ticks_skipped must too. Measured (3 of 3): 22-23 periods counted
    against an elapsed_s of 37.6-39.8 periods. The same loss follows a whole-node freeze (SIGSTOP 3 s, a
    1 s episode) when the session thread's max_seconds backstop runs before the control thread's first tick
    on resume: 26 periods counted against 175.9, 1 run of 4.
    """
    proc, cpu, _port = _stall_setup(tmp_path, processes, probe)
    result = _stop_during_a_stall(processes, probe, proc, cpu, 0.8, lambda: probe.call('interrupt'))
    assert result.reason == 'interrupted', result
    _assert_result_covers_its_time(result)


@ONE_HOG_AT_A_TIME
def test_feedback_counts_leave_out_periods_skipped_before_the_episode_started(tmp_path, processes, probe):
    """Every Act feedback: commands_sent + ticks_held + ticks_skipped = elapsed_s x rate, within two periods.

    The control thread is stalled 1 s (a FIFO 60 hog on its core) and the goal arrives 0.5 s into the stall
    (the action server runs on the other core): only the ~25 periods after the episode's start are its own.
    Measured (2 of 2): feedback counts 58-60 against elapsed_s of 32-33 periods (48-49 skipped), the result
    125-126 against 100.
    """
    period = 1 / 50
    proc, cpu, _port = _stall_setup(tmp_path, processes, probe)
    hog = processes.python(HOG, str(cpu), '1.0', '60')
    assert hog.stdout.readline().strip() == 'go', hog.stderr.read()
    time.sleep(0.5)
    handle = probe.send_goal(instruction='reach', max_seconds=2.0)
    hog.wait(10)
    result = probe.result(handle, timeout=30)
    fb = [f.feedback for f in probe.feedback if f.feedback.episode_id == result.episode_id]
    assert fb, node_log(proc)
    for f in fb:
        counted = f.commands_sent + f.ticks_held + f.ticks_skipped
        assert abs(counted - f.elapsed_s / period) <= 2, (
            f'{counted} periods counted (sent {f.commands_sent}, held {f.ticks_held}, skipped {f.ticks_skipped}) '
            f'in a feedback elapsed_s of {f.elapsed_s:.3f} s = {f.elapsed_s / period:.1f} periods')


@ONE_HOG_AT_A_TIME
def test_result_counts_cover_a_control_thread_stall_past_max_seconds(tmp_path, processes, probe):
    """Act.Result: commands_sent + ticks_held + ticks_skipped = elapsed_s x rate when a stall crosses the end.

    The control thread is stalled 1 s (a FIFO 60 hog on its core) from 0.4 s into a 1 s episode; the joint
    states stay fresh (the rest of the node runs), so the first tick after the stall asks the client, which
    ends the episode with 'timeout' at that tick's time. Measured (3 of 3): 22 periods counted (skipped 0)
    against an elapsed_s of 72 periods.
    """
    proc, cpu, _port = _stall_setup(tmp_path, processes, probe)
    handle = probe.send_goal(instruction='reach', max_seconds=1.0)
    time.sleep(0.4)
    hog = processes.python(HOG, str(cpu), '1.0', '60')
    assert hog.stdout.readline().strip() == 'go', hog.stderr.read()
    hog.wait(10)
    result = probe.result(handle, timeout=30)
    assert result.reason == 'timeout', result
    _assert_result_covers_its_time(result)


# -- round 5, against 840454a (accounting on the control grid), 6dafcac (joint_states merge), 3f284ed, b6b8ac4 --

def _stall_setup(tmp_path, processes, probe, **params):
    """A node (control thread SCHED_FIFO 50) pinned to the last cpu; return (proc, cpu, port)."""
    import os

    from test_node_support import spawn_worker

    if os.geteuid() != 0 or len(os.sched_getaffinity(0)) < 2:
        pytest.skip('a FIFO 60 hog on one of two cores needs CAP_SYS_NICE and at least 2 cpus')
    port = spawn_worker(processes, RAMP, 'ramp', names=NAMES, step=0.001)
    proc = spawn_node(processes, tmp_path / 'node.log', _params(tmp_path, port, **params))
    probe.publish_joints(NAMES)
    assert probe.wait_connected(), node_log(proc)
    tick = _fifo_threads(proc.pid)
    assert len(tick) == 1, f'the control thread alone should be SCHED_FIFO: {tick}'
    cpu = max(os.sched_getaffinity(0))
    os.sched_setaffinity(tick[0], {cpu})
    return proc, cpu, port


def _stop_during_a_stall(processes, probe, proc, cpu, stall_s, stop):
    """Run a goal, stall the control thread ``stall_s`` s (a FIFO 60 hog on ``cpu``), call ``stop()`` 0.3 s in.

    Returns the goal's Act result, once the stall is over.
    """
    handle = probe.send_goal(instruction='reach', max_seconds=10.0)
    assert wait_for(lambda: len(probe.values()) > 20, 30), node_log(proc)
    hog = processes.python(HOG, str(cpu), str(stall_s), '60')
    assert hog.stdout.readline().strip() == 'go', hog.stderr.read()
    time.sleep(0.3)
    stop()
    hog.wait(10)
    return probe.result(handle, timeout=30)


def _deactivate(probe, proc):
    """A stop for :func:`_stop_during_a_stall`: the lifecycle deactivate transition."""
    _state, transition = _lifecycle(probe)

    def deactivate() -> None:
        assert transition('deactivate'), node_log(proc)
    return deactivate


def _periods(msg, sent, period=1 / 50):
    counted = sent + msg.ticks_held + msg.ticks_skipped
    return counted, msg.elapsed_s / period


@ONE_HOG_AT_A_TIME
def test_status_counts_cover_its_elapsed_time_after_an_episode_stopped_in_a_stall(tmp_path, processes, probe):
    """~/status: commands_sent + ticks_held + ticks_skipped cover elapsed_s (RunStatus.msg), also once it ended.

    The control thread is stalled 0.8 s (a FIFO 60 hog on its core) and an interrupt comes 0.3 s into the
    stall; the result is right (its skips run to the stop, and so does its elapsed_s). ~/status keeps
    reporting the ended episode until the next one starts: its counts are the result's, its elapsed_s ends
    at the last tick before the stall. Measured: status counts 37 periods (sent 21, held 1, skipped 15)
    against an elapsed_s of 21.5 periods, while the result agreed with itself (37 vs 37.3).
    """
    period = 1 / 50
    proc, cpu, _port = _stall_setup(tmp_path, processes, probe)
    result = _stop_during_a_stall(processes, probe, proc, cpu, 0.8, lambda: probe.call('interrupt'))
    assert result.reason == 'interrupted', result
    r_counted, r_periods = _periods(result, result.commands_sent)
    assert abs(r_counted - r_periods) <= 2, f'the result itself: {r_counted} counted vs {r_periods:.1f} ({result})'
    t = time.monotonic()
    assert wait_for(lambda: len(probe.status) and time.monotonic() - t > 0.5, 15)
    after = [s for s in probe.status[-3:] if s.episode_id == result.episode_id]
    assert after, [s.episode_id for s in probe.status[-3:]]
    s = after[-1]
    counted, periods = _periods(s, s.commands_sent, period)
    assert abs(counted - periods) <= 2, (
        f'~/status after the end: {counted} periods counted (sent {s.commands_sent}, held {s.ticks_held}, skipped '
        f'{s.ticks_skipped}) in an elapsed_s of {s.elapsed_s:.3f} s = {periods:.1f} periods; the result: '
        f'{r_counted} vs {r_periods:.1f}')


@ONE_HOG_AT_A_TIME
def test_result_keeps_its_skipped_periods_when_the_node_is_activated_again_before_the_end(
        tmp_path, processes, probe):
    """Act.Result: commands_sent + ticks_held + ticks_skipped = elapsed_s x rate across a deactivate/activate.

    The control thread is stalled 0.8 s mid-episode (a FIFO 60 hog on its core: ~40 skipped periods, counted
    at the next tick). Then the worker hangs (SIGSTOP), a deactivate interrupts the episode, and an activate
    follows at once, while the session thread is still waiting on the hung worker to end the episode (up to
    2 s). The episode's periods all lie on the first control thread's grid. Measured (2 of 2): 0 skipped, 40
    periods counted (feedback had shown 38-39 skipped) against an elapsed_s of 78.3-78.5 periods; the same run
    without the activate passes.
    """
    import signal

    period = 1 / 50
    proc, cpu, _port = _stall_setup(tmp_path, processes, probe)
    worker = processes.procs[0]
    _state, transition = _lifecycle(probe)
    handle = probe.send_goal(instruction='reach', max_seconds=20.0)
    assert wait_for(lambda: len(probe.values()) > 20, 30), node_log(proc)
    hog = processes.python(HOG, str(cpu), '0.8', '60')
    assert hog.stdout.readline().strip() == 'go', hog.stderr.read()
    hog.wait(10)
    time.sleep(0.3)
    skipped = [f.feedback.ticks_skipped for f in probe.feedback]
    worker.send_signal(signal.SIGSTOP)
    try:
        assert transition('deactivate'), node_log(proc)
        assert transition('activate'), node_log(proc)
        result = probe.result(handle, timeout=30)
    finally:
        worker.send_signal(signal.SIGCONT)
    assert result.reason == 'interrupted', result
    counted, periods = _periods(result, result.commands_sent, period)
    assert abs(counted - periods) <= 2, (
        f'{counted} periods counted (sent {result.commands_sent}, held {result.ticks_held}, skipped '
        f'{result.ticks_skipped}) in a result elapsed_s of {result.elapsed_s:.3f} s = {periods:.1f} periods '
        f'(feedback had skipped up to {max(skipped, default=0)})')


@pytest.mark.parametrize('foreign', [[], ['wheel_l', 'wheel_l']], ids=['empty', 'foreign-duplicate'])
def test_a_message_naming_none_of_the_joints_changes_nothing_even_when_malformed(
        tmp_path, processes, probe, foreign):
    """observation.py: 'a message naming none of the configured joints changes nothing'.

    The arm's joints at 100 Hz and the gripper's at 10 Hz, as in test_node_episode's merge test, plus a third
    publisher on /joint_states at 50 Hz whose messages name none of the configured joints: an empty JointState
    (joint_state_publisher for a description without movable joints, a driver before it is up), or a base
    driver that names its wheel twice. None of them says anything about the arm or the gripper. Measured (both
    cases): the episode ends with 'error' (observation invalid for over stale_grace_s) with 0 actions executed;
    /diagnostics observation: 'joint_states has an empty name field ...' / 'names joints ['wheel_l'] more
    than once'.
    """
    from test_node_support import spawn_worker

    port = spawn_worker(processes, RAMP, 'ramp', names=NAMES, step=0.001)
    proc = spawn_node(processes, tmp_path / 'node.log', _params(tmp_path, port))
    probe.publish_joints(NAMES[:3], rate_hz=100.0, positions=lambda: [0.1, 0.2, 0.3])
    probe.publish_joints(NAMES[3:], rate_hz=10.0, positions=lambda: [0.4])
    assert probe.wait_connected(), node_log(proc)
    probe.publish_joints(foreign, rate_hz=50.0, positions=lambda: [0.0] * len(foreign))
    time.sleep(0.3)
    result = probe.result(probe.send_goal(instruction='reach', max_seconds=2.0))
    fb = [f.feedback for f in probe.feedback if f.feedback.episode_id == result.episode_id and f.feedback.commands_sent]
    assert result.reason == 'timeout' and result.commands_sent > 0, (result, probe.diag_message('observation'))
    # no hold after the first command but the episode's last period (the tick that finds it over holds for it),
    # unless a loaded machine explains it: the buffer ran dry, or the test's own publisher starved (stale); the
    # log names any observation the node refused
    assert fb, result
    assert (fb[-1].ticks_held - fb[0].ticks_held <= 1 or fb[-1].underruns > fb[0].underruns
            or observation_refusals(proc)[0]), ('held after the first command', fb[0], fb[-1])
    # the whole log: no reason but a source going stale, which names the test's own publisher starving under load
    assert not observation_refusals(proc)[1], node_log(proc)


@ONE_HOG_AT_A_TIME
def test_diagnostics_ticks_skipped_hold_an_episodes_skips_when_a_deactivate_ends_a_stall(
        tmp_path, processes, probe):
    """/diagnostics control ticks_skipped (all control threads so far) >= the episode's ticks_skipped.

    The control thread is stalled 0.8 s (a FIFO 60 hog on its core) and a deactivate comes 0.3 s into the
    stall; the result counts the ~15 periods missed before the stop as skipped (on the grid). The node's own
    count, which /diagnostics grades (ticks_skipped_warn/error), is the pacer's, and the pacer learns of a
    skip only at the wait after it, which the stopping thread never makes. Measured: /diagnostics
    ticks_skipped rose by 0 against the result's 15-16 (2 of 2).
    """
    proc, cpu, _port = _stall_setup(tmp_path, processes, probe)
    before = _skipped(probe)
    result = _stop_during_a_stall(processes, probe, proc, cpu, 0.8, _deactivate(probe, proc))
    assert result.reason == 'interrupted' and result.ticks_skipped >= 5, result
    assert wait_for(lambda: _skipped(probe) - before >= result.ticks_skipped, 15), (
        f'/diagnostics ticks_skipped rose by {_skipped(probe) - before}; the episode skipped '
        f'{result.ticks_skipped} periods ({result})')


# -- round 6, against ee34f2c (stall and max_actions), 6dacf6d (episode grid, joint_states), e1ff4e2 (stop_signals) --

def _stop_burst(proc, first: int, then: tuple[int, ...], spacing_s: float = 0.005, for_s: float = 15.0) -> float:
    """Send ``first``, then ``then`` in turn every ``spacing_s`` s until ``proc`` exits; return the seconds."""
    t = time.monotonic()
    proc.send_signal(first)
    k = 0
    while proc.poll() is None and time.monotonic() - t < for_s:
        time.sleep(spacing_s)
        try:
            proc.send_signal(then[k % len(then)])
        except ProcessLookupError:
            break
        k += 1
    proc.wait(30)
    return time.monotonic() - t


def test_an_active_node_exits_0_under_a_burst_of_stop_signals(tmp_path, processes, probe):
    """stop_signals: 'later signals are ignored', so Ctrl-C pressed again, or a launch's SIGTERM, changes nothing.

    main() returns 0 after a clean stop (hold published, episode ended, rclpy shut down), but the process then
    spends ~0.2 s in the interpreter's teardown with SIGINT/SIGTERM back at SIG_DFL (/proc/PID/status SigCgt:
    reset 2 ms after main returned, exit 0.19 s later), and a signal there kills it: exit -2 or -15, which
    launch reports as 'process has died'. Measured: a SIGINT then SIGINT/SIGTERM every 5 ms: -2 or -15 (5 of
    5; in the 3 runs wrapped to print when main() returned, it had returned 0 2-4 ms before the kill); two
    SIGINTs 50 ms apart then a SIGTERM 0.2 s later: -15 or -2 (2 of 2).
    """
    import signal

    from test_node_support import spawn_worker

    port = spawn_worker(processes, RAMP, 'ramp', names=NAMES, step=0.001)
    proc = spawn_node(processes, tmp_path / 'node.log', _params(tmp_path, port))
    probe.publish_joints(NAMES)
    assert probe.wait_connected(), node_log(proc)
    took = _stop_burst(proc, signal.SIGINT, (signal.SIGINT, signal.SIGTERM))
    assert proc.returncode == 0, (proc.returncode, f'{took:.2f} s', node_log(proc)[-1500:])


@pytest.mark.parametrize('sig', ['SIGINT', 'SIGTERM'])
def test_seq_serve_exits_0_under_a_burst_of_stop_signals(processes, sig):
    """cmd_serve: the first signal stops the server; the rest of a burst (Ctrl-C held down) must not kill it.

    The 'finally' puts the previous handlers back once server.stop() returned, and exit follows: a signal
    after that takes the default action. Measured: a burst every 5 ms ended -2 (SIGINT, 4 of 4) or -15
    (SIGTERM, 4 of 4) within 10 ms, after 'stopping ...'; two SIGINTs 5 ms apart: -2 (2 of 2).
    """
    import signal

    proc = processes.python('import sys; from sequence_ai_ros.cli.serving import main; sys.exit(main())',
                            'serve', str(POLICIES / 'replica_echo.py'), '--port', '0')
    line = proc.stdout.readline()
    assert line.startswith('serving'), (line, proc.stderr.read() if proc.poll() is not None else '')
    s = getattr(signal, sig)
    took = _stop_burst(proc, s, (s,))
    err = proc.stderr.read()
    assert proc.returncode == 0, (proc.returncode, f'{took:.2f} s', err[-1500:])


def test_seq_fleet_leaves_no_replica_running_when_sigterm_comes_during_start_up(processes, seq_home):
    """SIGTERM (systemd stop, a launch shutdown, a CI timeout) while `seq fleet` waits for its replicas.

    The replicas run in sessions of their own (start_new_session), so only the fleet process gets the signal,
    and its default action ends it at once: Fleet.__init__'s cleanup never runs. Measured: exit -15 at once;
    both replicas still serving on their ports afterwards (1 of 1; SIGINT at the same moment: exit 130, none
    left). A signal that comes once the fleet is up stops everything (exit 0).
    """
    import os
    import shutil
    import signal
    import sys

    if shutil.which('haproxy') is None:
        pytest.skip('seq fleet needs haproxy')
    proc = processes.spawn([sys.executable, '-m', 'sequence_ai_ros.cli', 'fleet', str(POLICIES / 'replica_echo.py'),
                            '--replicas', '2', '--port', '0'])

    def children() -> list[int]:
        kids = []
        for pid in filter(str.isdigit, os.listdir('/proc')):
            try:
                with open(f'/proc/{pid}/stat') as f:
                    if int(f.read().rsplit(')', 1)[1].split()[1]) == proc.pid:
                        kids.append(int(pid))
            except (OSError, IndexError, ValueError):
                pass
        return kids

    assert wait_for(lambda: len(children()) >= 2, 30), 'the fleet started no replicas'
    replicas = children()
    try:
        time.sleep(0.2)                      # the replicas are loading their policy; no 'fleet of' line yet
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)

        def alive() -> list[int]:
            out = []
            for p in replicas:
                try:
                    if open(f'/proc/{p}/stat').read().rsplit(')', 1)[1].split()[0] != 'Z':
                        out.append(p)
                except OSError:
                    pass
            return out
        wait_for(lambda: not alive(), 30)    # a replica told to stop goes (bounded: one left running fails)
        assert not alive(), f'fleet exit {proc.returncode}; replicas {alive()} of {replicas} still running'
    finally:
        for p in replicas:
            try:
                os.kill(p, signal.SIGKILL)
            except OSError:
                pass


def test_a_resampled_joint_delta_run_commands_no_row_past_max_actions(serve):
    """ee34f2c: 'the advance stops at the limit; the rows past it never run'. In a delta space they do.

    control_period 0.1 s on a chunk dt of 0.02 s: each tick integrates 5 rows. max_actions 31: the seventh
    tick starts at row 30 and is counted as 1 row (actions 31), but its increment (and the commanded position
    the hold keeps afterwards) is the sum of rows 30..34. Measured: integrated 595 (rows 0..34) for 465
    (rows 0..30); with control_period 0.03 s and the same limit, 480.5 (half of row 31 past the limit).
    """
    from sequence_ai_ros.client import Observation, connect

    endpoint = serve(mean_s=0.005, dt=0.02, chunk_length=60, action_space='joint_delta')
    with connect('lat', endpoint=endpoint) as policy:
        policy.begin_episode('reach', max_actions=31, max_seconds=10, control_period=0.1)
        obs = Observation(state=np.zeros(2, np.float32))
        deltas, last = [], None
        while policy.episode_outcome() is None:
            action = policy.next_action(obs)
            if action is not None and not action.hold:
                deltas.append(float(action.delta[0]))
                last = float(action.values[0])
            time.sleep(0.02)
        out = policy.end_episode()
    assert out.actions == 31 and out.chunks == 1, out
    assert sum(deltas) == pytest.approx(sum(range(31))) and last == pytest.approx(sum(range(31))), (
        f'integrated {sum(deltas)} over {len(deltas)} ticks (last commanded {last}); rows 0..30 sum to '
        f'{sum(range(31))}')


def test_a_nameless_joint_states_publisher_is_named_when_no_joint_was_ever_heard():
    """observation.py (6dacf6d): a refused message naming none of the joints 'is shown when the joints are missing'.

    The robot's only joint_states publisher sends messages without names (a driver that fills position but not
    name): the node's problem says no message was received at all, while one arrives at every period, and the
    operator looks for a dead driver or a wrong topic. Before 6dacf6d this message refused every joint and its
    reason was the problem. Measured: problems == ['/joint_states: no message received yet'].
    """
    from sensor_msgs.msg import JointState

    from sequence_ai_ros.node.observation import ObservationAssembler

    asm = ObservationAssembler(['a0', 'a1'], 0.1, {}, joints_source='/joint_states')
    for k in range(5):
        asm.put_joints(JointState(name=[], position=[0.1, 0.2]), received=1.0 + 0.02 * k)
    snap = asm.snapshot(1.1)
    assert snap.observation is None
    assert any('empty name field' in p for p in snap.problems), snap.problems


# -- round 7, against fb6914f (late wake-up skips, counts to the decided deadlines) and 792c474 (fleet ports);
#    both found bugs, now fixed: deadlines are counted by index, and a stopping control thread still counts --

def test_the_skip_count_never_falls_on_a_robot_up_twelve_days(monkeypatch):
    """tick.py/pacing.py (fb6914f): skipped_now() counts the grid's deadlines up to ``settled()`` less the ticks.

    ``settled()`` is now, most of the time, the latest deadline served (``start + k * period``, a float) and
    TickThread.periods() counts it with floor((t - start) / period + 1e-9). CLOCK_MONOTONIC is the time since
    boot: at 1e6 s (11.6 days) the rounding of start + k * period is up to ~6e-11 s, 3e-9 periods at 50 Hz, so
    about a third of the deadlines count as the one before. Here the clock reads 1e6 s more than this
    machine's (nothing else changes: a real TickThread at 50 Hz, idle ticks). Measured: skipped_now() in
    {-1, 0}, falling ~8 times a second, with no tick skipped. /diagnostics reads a fall as a counter reset
    (Health.update) and adds the whole new value to the window: after N real skips, each fall adds N - 1 to
    the ticks_skipped WARN/ERROR grading (fed 30, 29, 30, 29 the real Health graded 89 skips in 10 s; fed 0, -1,
    0 it grades 1, a WARN with nothing skipped). On this machine's own clock (~2.2e4 s up) 1 kHz shows it already.
    The episode's ticks_skipped (then Runner.account, until = settled()) fell by one the same way.
    """
    from sequence_ai_ros.node.tick import TickThread

    real = time.monotonic
    monkeypatch.setattr(time, 'monotonic', lambda: real() + 1e6)   # the robot's clock, 11.6 days after boot
    tick = TickThread(0.02, lambda now: None, name='test-uptime')
    counts = []
    try:
        tick.start()
        end = real() + 1.0
        while real() < end:
            counts.append(tick.skipped_now())
            time.sleep(0.002)
    finally:
        tick.stop()
    falls = sum(b < a for a, b in zip(counts, counts[1:], strict=False))
    assert min(counts) >= 0 and falls == 0, (f'skipped_now() took {sorted(set(counts))} and fell {falls} times '
                                            f'over {tick.ticks} ticks ({tick.skipped} skipped by the pacer)')


def _diag_series(probe, key, part='control'):
    """Every /diagnostics value ``key`` of status ``policy_node: part`` received so far, in order (int)."""
    out = []
    for arr in list(probe.diagnostics):
        for st in arr.status:
            if st.name == f'{probe.diag_prefix}: {part}':
                out += [int(float(kv.value)) for kv in st.values if kv.key == key]
    return out


@ONE_HOG_AT_A_TIME
def test_diagnostics_ticks_skipped_never_fall_while_a_deactivate_waits_on_a_stalled_control_thread(
        tmp_path, processes, probe):
    """policy_node.py (fb6914f claims /diagnostics ticks_skipped never falls): _hold_and_stop_ticking.

    ``tick, self._tick = self._tick, None`` comes before ``tick.stop()`` (a join of up to 2 s) and before
    ``self._skipped_before += tick.skipped_now()``; /diagnostics, published by the main thread meanwhile, counts
    ``_skipped_before + 0``. The control thread is stalled 1.0 s (a FIFO 60 hog on its core) and a deactivate
    comes 0.3 s into the stall, so the join waits ~0.7 s. Health.update takes the fall for a counter reset and
    the rise after it as new skips: window.ticks_skipped counts the stall's skips twice. Measured: the series
    2 .. 12, 13, then 0 for 11 messages (0.55 s), then 52; window.ticks_skipped peaked at 68 for 52 skips (3 of 3).
    """
    proc, cpu, _port = _stall_setup(tmp_path, processes, probe, diagnostics_rate_hz=20.0)
    _stop_during_a_stall(processes, probe, proc, cpu, 1.0, _deactivate(probe, proc))
    time.sleep(0.5)
    counts = _diag_series(probe, 'ticks_skipped')
    window = _diag_series(probe, 'window.ticks_skipped')
    falls = [(a, b) for a, b in zip(counts, counts[1:], strict=False) if b < a]
    assert not falls, (f'/diagnostics ticks_skipped fell {falls}: series {counts}; window.ticks_skipped peaked at '
                       f'{max(window)} against a final count of {counts[-1]}')


# -- round 8, against 1b9424e (accounting by deadline index), b83666f (episodes_failed), f748a8c (launch keys);
#    both found bugs (launch params keys vs rcl), now fixed: launch matches keys and order as rcl does --

def _launch_node_parameters():
    """The launch files' reading of a params file for ``policy_node`` (sequence_ai_ros.node.launch_parameters)."""
    from sequence_ai_ros.node.launch_parameters import node_parameters

    return lambda path, namespace='': node_parameters(path, 'policy_node', namespace)


def test_launch_params_keys_match_what_rcl_applies_to_a_namespaced_node(tmp_path):
    """policy.launch.py (f748a8c): _node_parameters' keys are 'as rcl matches them for this node'.

    The oracle is rclpy itself: a real ``policy_node`` in namespace ``robot1`` started with ``--params-file``
    (as the node would be without launch's merge). Measured: rcl applies ``/robot1/*``, ``/robot1/**`` and
    ``/*/policy_node`` (launch drops them silently: the fresh-user trial's symptom, for a key one wildcard
    away) and does not apply ``policy_node`` or ``/policy_node`` (the node ``/policy_node`` in the root
    namespace, another node's parameters), which launch applies to ``/robot1/policy_node``.
    """
    import yaml

    read = _launch_node_parameters()
    wrong = []
    for key in ('policy_node', '/policy_node', '/robot1/*', '/robot1/**', '/*/policy_node', '/robot1/policy_node'):
        path = tmp_path / f'p{abs(hash(key))}.yaml'
        path.write_text(yaml.safe_dump({key: {'ros__parameters': {'model': 'from the file'}}}))
        rcl = _rclpy_model(path, 'robot1')
        launch = read(str(path), 'robot1').get('model')
        if launch != rcl:
            wrong.append(f'{key!r}: rcl {rcl!r}, launch {launch!r}')
    assert not wrong, 'launch and rcl disagree on /robot1/policy_node: ' + '; '.join(wrong)


def _rclpy_model(path, namespace):
    """``model`` as rclpy applies a params file to a real ``policy_node`` in ``namespace`` (None: unset)."""
    import rclpy
    from rclpy.node import Node

    ctx = rclpy.Context()
    rclpy.init(context=ctx, args=['--ros-args', '--params-file', str(path)])
    try:
        node = Node('policy_node', namespace=namespace, context=ctx,
                    automatically_declare_parameters_from_overrides=True)
        value = node.get_parameter('model').value if node.has_parameter('model') else None
        node.destroy_node()
    finally:
        rclpy.shutdown(context=ctx)
    return value


def test_launch_params_precedence_follows_the_file_as_rcl_does(tmp_path):
    """policy.launch.py (f748a8c): 'later keys overriding earlier ones' is launch's key list, not the file's order.

    rclpy applies the matching keys in the order the file gives them (a ``/**`` after ``/robot1/policy_node``
    wins); launch always lets the node's own key win. Measured: rcl 'all', launch 'robot1'. Low severity
    (such a file is unusual), but the node then runs with another value than ``ros2 run ... --params-file``.
    """
    path = tmp_path / 'order.yaml'
    path.write_text('/robot1/policy_node:\n  ros__parameters:\n    model: robot1\n'
                    '/**:\n  ros__parameters:\n    model: all\n')
    rcl, launch = _rclpy_model(path, 'robot1'), _launch_node_parameters()(str(path), 'robot1').get('model')
    assert launch == rcl, f'rcl applies {rcl!r}, launch {launch!r}'
