"""Trajectory mode for joint_trajectory_controller: the messages checked against the chunks.

joint_trajectory_controller itself cannot run here (no ros2_control wheels exist), so the tests check
what the released controller relies on: one multi-point JointTrajectory per new chunk, rows already due
dropped, ``time_from_start`` from the chunk's dt, ``header.stamp`` the first point's time on the node's
ROS clock (sim time under ``use_sim_time``), joint names in command order, the safety limits on every
point, and a single-point hold when the episode stops. Unit tests on :mod:`.trajectory`, then the real
node against a real worker, with use_sim_time off and on.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from test_node_support import RAMP, Probe, node_log, node_params, spawn_node, wait_for

from sequence_ai_ros.exceptions import ConfigError
from sequence_ai_ros.node.config import CommandConfig, SafetyConfig
from sequence_ai_ros.node.safety import SafetyFilter
from sequence_ai_ros.node.trajectory import hold_message, plan_points, trajectory_message

NAMES = ['j0', 'j1', 'j2', 'j3']
DT = 1 / 30


def _rows(t: int = 10) -> np.ndarray:
    return (np.arange(t, dtype=np.float32)[:, None] * 0.01 + np.array([0.0, 1.0], np.float32)).astype(np.float32)


def test_rows_already_due_are_dropped_and_times_come_from_the_chunk_dt():
    safety = SafetyFilter(SafetyConfig(), ['b', 'a'])
    plan = plan_points(_rows(), 2.4, 0.1, order=np.array([1, 0]), delta=False, last=None, safety=safety,
                       period_s=0.02)
    assert not plan.stop and plan.positions.shape == (7, 2)              # rows 3..9; 0..2 were due
    assert plan.ahead_s == pytest.approx((np.arange(3, 10) - 2.4) * 0.1)
    assert plan.positions[0] == pytest.approx([1.03, 0.03])             # command order (b, a)
    msg = trajectory_message(plan, ('b', 'a'), ros_now_ns=5_000_000_000)
    assert msg.joint_names == ['b', 'a'] and len(msg.points) == 7
    assert (msg.header.stamp.sec, msg.header.stamp.nanosec) == (5, 60_000_000)   # the first point's due time
    tfs = [p.time_from_start.sec + p.time_from_start.nanosec * 1e-9 for p in msg.points]
    assert tfs == pytest.approx(np.arange(7) * 0.1) and tfs[0] == 0.0
    assert plan_points(_rows(), 9.0, 0.1, order=None, delta=False, last=None, safety=safety,
                       period_s=0.02).positions.shape == (0, 2)          # nothing ahead: nothing to publish
    whole = plan_points(_rows(), 0.0, 0.1, order=None, delta=False, last=None, safety=safety, period_s=0.02)
    assert whole.positions.shape[0] == 9, 'at position 0 the tick plays row 0: it is due, not ahead'


def test_limits_apply_to_every_point_and_the_step_limit_scales_with_time():
    safety = SafetyFilter(SafetyConfig(lower_limits=(-1.0, -1.0), upper_limits=(1.0, 1.05), max_step=(0.004,)),
                          ['a', 'b'])
    plan = plan_points(_rows(), 0.0, 0.1, order=None, delta=False, last=np.array([0.0, 1.0]), safety=safety,
                       period_s=0.02)
    assert np.all(plan.positions[:, 1] <= 1.05) and plan.positions[-1, 1] == pytest.approx(1.05)
    # 0.01 per 0.1 s row is within 0.004 per 0.02 s period (0.02 per row): no step clamp on joint a
    assert plan.positions[:, 0] == pytest.approx(np.arange(1, 10) * 0.01)
    assert safety.counts()['b']['limit'] > 0 and 'a' not in safety.counts()
    tight = SafetyFilter(SafetyConfig(max_step=(0.001,)), ['a', 'b'])
    plan = plan_points(_rows(), 0.0, 0.02, order=None, delta=False, last=np.array([0.0, 1.0]), safety=tight,
                       period_s=0.02)
    assert np.all(np.abs(np.diff(plan.positions, axis=0)) <= 0.001 + 1e-12)
    stop = SafetyFilter(SafetyConfig(upper_limits=(1.0, 1.0), lower_limits=(-1.0, -1.0), on_violation='stop'),
                        ['a', 'b'])
    plan = plan_points(_rows(), 0.0, 0.1, order=None, delta=False, last=None, safety=stop, period_s=0.02)
    assert plan.stop and "['b']" in plan.stop and plan.positions.shape[0] == 0


def test_joint_delta_rows_integrate_onto_the_last_command_and_hold_is_one_point():
    safety = SafetyFilter(SafetyConfig(), ['a', 'b'])
    rows = np.full((5, 2), 0.5, np.float32)
    plan = plan_points(rows, 1.0, 0.1, order=None, delta=True, last=np.array([1.0, 2.0]), safety=safety,
                       period_s=0.02)
    assert plan.positions == pytest.approx(np.array([[1.5, 2.5], [2.0, 3.0], [2.5, 3.5]]))
    hold = hold_message(np.array([0.3, 0.4]), ('a', 'b'), 7_500_000_000, 0.02)
    assert len(hold.points) == 1 and list(hold.points[0].positions) == [0.3, 0.4]
    assert hold.points[0].time_from_start.nanosec == 20_000_000 and hold.header.stamp.sec == 7


def test_trajectory_mode_needs_the_joint_trajectory_interface():
    with pytest.raises(ConfigError, match='command.mode: trajectory needs command.interface joint_trajectory'):
        CommandConfig(interface='forward_command', mode='trajectory')
    CommandConfig(interface='joint_trajectory', mode='trajectory', controller='arm')


def _seconds(stamp) -> float:
    return stamp.sec + stamp.nanosec * 1e-9


@pytest.mark.ros
@pytest.mark.slow
@pytest.mark.parametrize('sim_time', [False, True], ids=['wall_clock', 'use_sim_time'])
def test_node_publishes_each_chunk_as_one_trajectory_on_its_ros_clock(tmp_path, processes, rclpy_context, sim_time):
    from rosgraph_msgs.msg import Clock
    from trajectory_msgs.msg import JointTrajectory

    from sequence_ai_ros.worker import serve_policy_file

    probe = Probe(rclpy_context, JointTrajectory, '/arm/joint_trajectory')
    sim0, t0 = 1000.0, time.monotonic()
    if sim_time:   # a simulator's clock, far from the wall clock
        clock_pub = probe.node.create_publisher(Clock, '/clock', 10)

        def tick() -> None:
            s = sim0 + (time.monotonic() - t0)
            clock_pub.publish(Clock(clock=_time_msg(s)))
        probe._timers.append(probe.node.create_timer(0.005, tick))
    upper = [1.0, 1.0, 0.45, 1.0]
    try:
        with serve_policy_file(RAMP, 'ramp', names=NAMES, step=0.002) as server:
            params = node_params(tmp_path, model='ramp', endpoint=f'127.0.0.1:{server.port}', **{
                'joints.names': NAMES, 'command.interface': 'joint_trajectory', 'command.mode': 'trajectory',
                'command.controller': 'arm', 'safety.lower_limits': [-1.0] * 4, 'safety.upper_limits': upper,
                'status_rate_hz': 10.0, 'use_sim_time': sim_time})
            proc = spawn_node(processes, tmp_path / 'node.log', params)
            probe.publish_joints(NAMES)       # measured 0.1 .. 0.4
            assert probe.wait_connected(), node_log(proc)
            result = probe.result(probe.send_goal(instruction='reach', max_seconds=2.0))
            assert result.reason == 'timeout', (result, node_log(proc))
            assert wait_for(lambda: probe.commands and len(probe.commands[-1][1].points) == 1, 5), node_log(proc)
            received = list(probe.commands)
    finally:
        probe.close()
    trajectories = [(t, m) for t, m in received if len(m.points) > 1]
    assert 2 <= len(trajectories) <= result.chunks, (len(trajectories), result.chunks)
    for t_recv, msg in trajectories:
        assert msg.joint_names == NAMES
        tfs = np.array([_seconds(p.time_from_start) for p in msg.points])
        assert tfs[0] == 0.0 and np.allclose(np.diff(tfs), DT, atol=1e-6), 'time_from_start comes from dt'
        positions = np.array([p.positions for p in msg.points])
        assert np.all(positions <= np.array(upper) + 1e-9), 'the limits apply to every point'
        free = positions[:, [0, 1, 3]]
        assert np.allclose(np.diff(free, axis=0), 0.002, atol=1e-5), 'one point per chunk row (the ramp)'
        stamp = _seconds(msg.header.stamp)
        now = sim0 + (t_recv - t0) if sim_time else time.time() - (time.monotonic() - t_recv)
        # the first point lies ahead of the tick by at most one row, on the node's ROS clock
        assert now - 0.5 < stamp < now + DT + 0.5, (stamp, now, sim_time)
    hold = received[-1][1]
    assert len(hold.points) == 1 and np.allclose(hold.points[0].positions, trajectories[-1][1].points[0].positions,
                                                 atol=0.1)


def _time_msg(seconds: float):
    from builtin_interfaces.msg import Time

    ns = int(seconds * 1e9)
    return Time(sec=ns // 1_000_000_000, nanosec=ns % 1_000_000_000)
