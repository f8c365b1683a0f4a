"""Trajectory mode: each new action chunk's remaining horizon as one multi-point JointTrajectory.

For ros2_control's joint_trajectory_controller (JTC) in its released behaviour (Humble, Jazzy, Kilted),
which interpolates a whole trajectory in its real-time loop, so Python scheduling leaves the control
path. What that controller does with a trajectory (joint_trajectory_controller.cpp, trajectory.cpp of
ros2_controllers): a new trajectory replaces the old one at once (no splice; blending through
``allow_trajectory_replacement`` exists only on its master branch); it interpolates from its current
state to point 0 at ``header.stamp + time_from_start[0]`` and skips points already in the past; a
trajectory stamped so that it ends in the past is rejected. Hence, when a new chunk starts playing:

- rows already due (at or before the tick's chunk position) are dropped;
- point k is chunk row ``i0 + k`` (``i0`` the first row still ahead); ``header.stamp`` is the first
  point's due time on the node's ROS clock (``node.get_clock()``, so /clock under ``use_sim_time``),
  never the monotonic clock the engine runs on; ``time_from_start[k] = (i0 + k - i0) * dt`` from the
  chunk's own dt;
- positions only (JTC then interpolates linearly between points);
- the position limits and the step limit apply to every point: the step limit (``safety.max_step``,
  per control period) scales with the time between points, and the first point is measured from the
  last command, so a trajectory never asks for more than streaming mode would;
- joint_delta rows are integrated onto the last command.

Between chunks nothing is published (JTC holds the end of the last trajectory: that is its behaviour on
an underrun); when an episode stops (interrupt, end, refusal) one single-point trajectory holds the last
command, one control period ahead.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
from builtin_interfaces.msg import Duration, Time
from trajectory_msgs.msg import JointTrajectory, JointTrajectoryPoint

from sequence_ai_ros.node.safety import SafetyFilter


@dataclasses.dataclass(frozen=True)
class Plan:
    """The points of one trajectory, before they become a message.

    :param positions: float64 (K, D) in command order, safety-checked.
    :param ahead_s: float64 (K,) seconds from the tick until each point is due (> 0, increasing).
    :param stop: why the run must end instead ('' when it need not); positions are then empty.
    """

    positions: np.ndarray
    ahead_s: np.ndarray
    stop: str = ''


def plan_points(rows: np.ndarray, pos: float, dt: float, *, order: np.ndarray | None, delta: bool,
                last: np.ndarray | None, safety: SafetyFilter, period_s: float) -> Plan:
    """Turn the rest of a chunk into trajectory points.

    :param rows: float32 (T, D) the chunk's rows, in action order.
    :param pos: the chunk position played at this tick (chunk steps, may be fractional).
    :param dt: the chunk's step (s).
    :param order: column indices from action order to command order (None: already in command order).
    :param delta: rows are joint increments, integrated onto ``last``.
    :param last: float64 (D,) the last command (command order), the reference of the first step.
    :param safety: the node's safety filter (limits, step limit, clamp counts).
    :param period_s: the control period (s): ``safety.max_step`` is per period.
    :returns: the plan; empty when no row is ahead.
    """
    length = rows.shape[0]
    i0 = int(math.floor(pos + 1e-9)) + 1         # rows <= pos are due (the tick played pos): dropped
    if i0 >= length:
        return Plan(np.zeros((0, rows.shape[1])), np.zeros(0))
    sel = np.asarray(rows[i0:], np.float64)
    if order is not None:
        sel = sel[:, order]
    ahead = (np.arange(i0, length, dtype=np.float64) - pos) * dt
    if delta:
        if last is None:
            return Plan(np.zeros((0, sel.shape[1])), np.zeros(0), 'joint_delta needs a last command to integrate onto')
        sel = last + np.cumsum(sel, axis=0)
    out = np.empty_like(sel)
    prev, prev_t = last, 0.0
    for k in range(sel.shape[0]):
        scale = max(1.0, (ahead[k] - prev_t) / period_s)
        checked = safety.check(sel[k], prev, step_scale=scale)
        if checked.values is None:
            return Plan(np.zeros((0, sel.shape[1])), np.zeros(0), checked.stop)
        out[k] = checked.values
        prev, prev_t = checked.values, ahead[k]
    return Plan(out, ahead)


def _duration(seconds: float) -> Duration:
    ns = int(round(seconds * 1e9))
    return Duration(sec=ns // 1_000_000_000, nanosec=ns % 1_000_000_000)


def _time(ns: int) -> Time:
    return Time(sec=ns // 1_000_000_000, nanosec=ns % 1_000_000_000)


def trajectory_message(plan: Plan, joint_names: tuple[str, ...], ros_now_ns: int) -> JointTrajectory:
    """Return the JointTrajectory of ``plan``: stamped at its first point's due time on the ROS clock.

    :param ros_now_ns: the node's ROS clock at the tick (ns; sim time under ``use_sim_time``).
    """
    first = float(plan.ahead_s[0])
    msg = JointTrajectory(joint_names=list(joint_names))
    msg.header.stamp = _time(ros_now_ns + int(round(first * 1e9)))
    msg.points = [JointTrajectoryPoint(positions=p.tolist(), time_from_start=_duration(t - first))
                  for p, t in zip(plan.positions, plan.ahead_s, strict=True)]
    return msg


def hold_message(values: np.ndarray, joint_names: tuple[str, ...], ros_now_ns: int,
                 period_s: float) -> JointTrajectory:
    """A single-point trajectory holding ``values`` (command order), reached one control period ahead."""
    msg = JointTrajectory(joint_names=list(joint_names))
    msg.header.stamp = _time(ros_now_ns)
    msg.points = [JointTrajectoryPoint(positions=np.asarray(values, np.float64).tolist(),
                                       time_from_start=_duration(period_s))]
    return msg
