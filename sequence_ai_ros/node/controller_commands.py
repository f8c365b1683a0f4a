"""Command interfaces: an action vector -> the controller's message, after ros2_control conventions.

==================  ===========================================  =====================================
interface           message and topic                            action spaces accepted
==================  ===========================================  =====================================
forward_command     std_msgs/Float64MultiArray on                kind=position: joint_absolute,
                    ``<controller>/commands``                    joint_delta (JointGroupPosition-
                    (forward_command_controller)                 Controller); kind=velocity:
                                                                 joint_velocity (JointGroupVelocity-
                                                                 Controller)
joint_trajectory    trajectory_msgs/JointTrajectory, one point,  joint_absolute, joint_delta
                    on ``<controller>/joint_trajectory``;
                    time_from_start = one control period unless
                    ``command.time_from_start_s`` is set
joint_state         sensor_msgs/JointState on ``command.topic``  kind=position: joint_absolute,
                    (position or velocity field)                 joint_delta; kind=velocity:
                                                                 joint_velocity
pose                geometry_msgs/PoseStamped                    ee_absolute
twist               geometry_msgs/TwistStamped                   ee_delta
==================  ===========================================  =====================================

Joint commands are ordered by ``command.joint_names``; the policy's action_names are mapped onto them
by name (same set required; a different set is refused, never mapped by position).

End-effector layouts (``sequence_ai.proto``): ee_absolute is ``x y z`` (m) then the orientation as a
quaternion ``qx qy qz qw``, then any gripper channels; ee_delta is ``dx dy dz`` (m) and
``droll dpitch dyaw`` (rad) per action step, then any gripper channels. The twist is the delta
divided by the policy's dt (m/s, rad/s). Both are stamped with ``command.frame_id``. Gripper channels
(dimensions after the 7 pose or 6 twist values) go as a std_msgs/Float64MultiArray on
``command.gripper_topic``; a policy with gripper channels and no gripper topic is refused.
joint_delta actions arrive already integrated onto the last command (the client does it), so they are
published as positions.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from builtin_interfaces.msg import Duration
from geometry_msgs.msg import PoseStamped, TwistStamped
from sensor_msgs.msg import JointState
from std_msgs.msg import Float64MultiArray
from trajectory_msgs.msg import JointTrajectory, JointTrajectoryPoint

from sequence_ai_ros.exceptions import ActionSpaceMismatch
from sequence_ai_ros.node.config import CommandConfig
from sequence_ai_ros.protocol.contract import Contract
from sequence_ai_ros.protocol.spaces import ActionSpace

POSE_DIM = 7
TWIST_DIM = 6


def accepted_spaces(cfg: CommandConfig) -> tuple[ActionSpace, ...]:
    """Return the action spaces the configured interface can command."""
    if cfg.interface in ('forward_command', 'joint_state'):
        if cfg.kind == 'velocity':
            return (ActionSpace.JOINT_VELOCITY,)
        return (ActionSpace.JOINT_ABSOLUTE, ActionSpace.JOINT_DELTA)
    if cfg.interface == 'joint_trajectory':
        return (ActionSpace.JOINT_ABSOLUTE, ActionSpace.JOINT_DELTA)
    if cfg.interface == 'pose':
        return (ActionSpace.EE_ABSOLUTE,)
    return (ActionSpace.EE_DELTA,)


class CommandInterface:
    """Build command messages for one configured interface.

    :param cfg: the command configuration.
    :param joint_names: commanded joints, in command order (joint interfaces).
    :param period_s: the control period (s), the default trajectory point time.
    """

    def __init__(self, cfg: CommandConfig, joint_names: tuple[str, ...], period_s: float) -> None:
        self.cfg = cfg
        self.joint_names = tuple(joint_names)
        self.period_s = period_s
        self.gripper_topic = cfg.gripper_topic
        self.topic = cfg.resolved_topic()
        self.msg_type = {'forward_command': Float64MultiArray, 'joint_trajectory': JointTrajectory,
                         'joint_state': JointState, 'pose': PoseStamped, 'twist': TwistStamped}[cfg.interface]
        self._order: np.ndarray | None = None
        self._dt = period_s

    @property
    def is_joint(self) -> bool:
        """True for joint interfaces (a measured joint state can stand in for a command)."""
        return self.cfg.interface in ('forward_command', 'joint_trajectory', 'joint_state')

    @property
    def is_position(self) -> bool:
        """True when commands are positions: limits apply, and hold republishes the last command."""
        return self.cfg.interface in ('joint_trajectory', 'pose') or (
            self.cfg.interface in ('forward_command', 'joint_state') and self.cfg.kind == 'position')

    def bind(self, contract: Contract) -> None:
        """Check that the policy's contract can be commanded here, and prepare the name mapping.

        :raises ActionSpaceMismatch: when the action space does not fit the interface, the action
            names are not the commanded joints, or gripper channels have nowhere to go. The message
            says what to change.
        """
        space = contract.action_space
        ok = accepted_spaces(self.cfg)
        if space not in ok:
            raise ActionSpaceMismatch(
                f'policy action_space {space.value} cannot be commanded through {self.cfg.interface}'
                f'{f" (kind {self.cfg.kind})" if self.cfg.interface in ("forward_command", "joint_state") else ""}'
                f'; it accepts {", ".join(s.value for s in ok)}')
        self._dt = contract.dt
        if space.is_joint:
            names = contract.action_names
            if set(names) != set(self.joint_names) or len(names) != len(self.joint_names):
                missing = [n for n in self.joint_names if n not in names]
                extra = [n for n in names if n not in self.joint_names]
                raise ActionSpaceMismatch(f'policy action_names do not match command.joint_names: commanded '
                                          f'joints missing from the policy {missing}, policy names not '
                                          f'commanded {extra}')
            self._order = np.array([names.index(n) for n in self.joint_names], dtype=np.intp)
            return
        base = POSE_DIM if space is ActionSpace.EE_ABSOLUTE else TWIST_DIM
        if contract.action_dim < base:
            raise ActionSpaceMismatch(f'{space.value} needs at least {base} action dims, the policy has '
                                      f'{contract.action_dim}')
        if contract.action_dim > base and not self.gripper_topic:
            raise ActionSpaceMismatch(f'the policy has {contract.action_dim - base} gripper channel(s) after '
                                      f'the {base} {space.value} values; set command.gripper_topic')
        self._order = None

    @property
    def action_order(self) -> np.ndarray | None:
        """Column indices from the policy's action order to command order (None: the same order)."""
        return self._order

    def order(self, values: np.ndarray) -> np.ndarray:
        """Return the action reordered into command order, float64 (D,)."""
        v = np.asarray(values, dtype=np.float64)
        return v[self._order] if self._order is not None else v

    def unorder(self, values: np.ndarray) -> np.ndarray:
        """Return a command in command order back in the policy's action order, float64 (D,)."""
        v = np.asarray(values, dtype=np.float64)
        if self._order is None:
            return v
        out = np.empty_like(v)
        out[self._order] = v
        return out

    def hold_values(self, last: np.ndarray) -> np.ndarray:
        """Return what a hold publishes given the last command: itself for positions, zeros for rates."""
        if self.is_position:
            return last
        out = np.zeros_like(last)
        if self.cfg.interface == 'twist':
            out[TWIST_DIM:] = last[TWIST_DIM:]  # gripper channels are positions: they hold
        return out

    def build(self, values: np.ndarray, stamp: Any) -> tuple[Any, Float64MultiArray | None]:
        """Return (command message, gripper message or None) for one action in command order.

        :param values: float64 (D,) in command order (see :meth:`order`).
        :param stamp: builtin_interfaces/Time for headers.
        """
        cfg = self.cfg
        data = values.tolist()
        if cfg.interface == 'forward_command':
            return Float64MultiArray(data=data), None
        if cfg.interface == 'joint_trajectory':
            t = cfg.time_from_start_s or self.period_s
            sec = int(t)
            point = JointTrajectoryPoint(positions=data, time_from_start=Duration(
                sec=sec, nanosec=int(round((t - sec) * 1e9))))
            msg = JointTrajectory(joint_names=list(self.joint_names), points=[point])
            msg.header.stamp = stamp
            return msg, None
        if cfg.interface == 'joint_state':
            msg = JointState(name=list(self.joint_names))
            if cfg.kind == 'velocity':
                msg.velocity = data
            else:
                msg.position = data
            msg.header.stamp = stamp
            return msg, None
        if cfg.interface == 'pose':
            msg = PoseStamped()
            msg.header.stamp, msg.header.frame_id = stamp, cfg.frame_id
            p, q = msg.pose.position, msg.pose.orientation
            p.x, p.y, p.z = data[0:3]
            q.x, q.y, q.z, q.w = data[3:7]
            rest = data[POSE_DIM:]
        else:
            msg = TwistStamped()
            msg.header.stamp, msg.header.frame_id = stamp, cfg.frame_id
            lin, ang = msg.twist.linear, msg.twist.angular
            lin.x, lin.y, lin.z = (v / self._dt for v in data[0:3])
            ang.x, ang.y, ang.z = (v / self._dt for v in data[3:6])
            rest = data[TWIST_DIM:]
        return msg, (Float64MultiArray(data=rest) if rest and self.gripper_topic else None)
