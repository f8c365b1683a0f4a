"""Action spaces, as policies and controllers name them.

``joint_velocity`` follows DROID (Khazatsky et al., 2024): joint velocities (rad/s) plus an absolute
gripper position in the last channel.
"""

from __future__ import annotations

import enum

import numpy as np

from sequence_ai_ros.protocol import sequence_ai_pb2 as pb


class ActionSpace(str, enum.Enum):
    """The meaning of an action vector."""

    JOINT_ABSOLUTE = 'joint_absolute'
    JOINT_DELTA = 'joint_delta'
    JOINT_VELOCITY = 'joint_velocity'
    EE_ABSOLUTE = 'ee_absolute'
    EE_DELTA = 'ee_delta'

    @property
    def is_absolute(self) -> bool:
        """True for spaces whose actions are positions (interpolated, seam-smoothed)."""
        return self in (ActionSpace.JOINT_ABSOLUTE, ActionSpace.EE_ABSOLUTE)

    @property
    def is_delta(self) -> bool:
        """True for increments per action step (integrated by the client)."""
        return self in (ActionSpace.JOINT_DELTA, ActionSpace.EE_DELTA)

    @property
    def is_joint(self) -> bool:
        """True for joint-space actions."""
        return self.value.startswith('joint_')

    @classmethod
    def parse(cls, value: str | ActionSpace) -> ActionSpace:
        """Return the space named ``value``.

        :raises ValueError: for an unknown name; the message lists the valid ones.
        """
        if isinstance(value, ActionSpace):
            return value
        try:
            return cls(str(value).strip().lower())
        except ValueError:
            names = ', '.join(s.value for s in cls)
            raise ValueError(f'unknown action_space {value!r}; expected one of {names}') from None

    def to_proto(self) -> pb.ActionSpace:
        """Return the ``sequence_ai.v1.ActionSpace`` enum number."""
        return _TO_PROTO[self]

    @classmethod
    def from_proto(cls, number: int) -> ActionSpace:
        """Return the space for a ``sequence_ai.v1.ActionSpace`` number.

        :raises ValueError: for ACTION_SPACE_UNSPECIFIED or an unknown number.
        """
        for space, n in _TO_PROTO.items():
            if n == number:
                return space
        raise ValueError(f'action_space {number} is unspecified or unknown')


_TO_PROTO: dict[ActionSpace, pb.ActionSpace] = {
    ActionSpace.JOINT_ABSOLUTE: pb.JOINT_ABSOLUTE,
    ActionSpace.JOINT_DELTA: pb.JOINT_DELTA,
    ActionSpace.JOINT_VELOCITY: pb.JOINT_VELOCITY,
    ActionSpace.EE_ABSOLUTE: pb.EE_ABSOLUTE,
    ActionSpace.EE_DELTA: pb.EE_DELTA,
}


#: ee_delta: dx dy dz (m), droll dpitch dyaw (rad) are increments; later channels (gripper) are positions.
EE_DELTA_RATE_DIMS = 6


def position_mask(space: ActionSpace, dim: int) -> np.ndarray:
    """Return bool (D,): True for channels that are positions (interpolated, sampled), False for rates.

    Rates (joint_delta and ee_delta increments, joint_velocity) are integrated by the client and summed or
    averaged by the export. joint_velocity keeps its last channel as an absolute gripper position (DROID,
    Khazatsky et al. 2024); ee_delta keeps channels after the first six as positions (the gripper).
    """
    mask = np.zeros(dim, dtype=bool)
    if space.is_absolute:
        mask[:] = True
    elif space is ActionSpace.JOINT_VELOCITY and dim > 1:
        mask[-1] = True
    elif space is ActionSpace.EE_DELTA:
        mask[EE_DELTA_RATE_DIMS:] = True
    return mask


def rest_mask(space: ActionSpace, dim: int) -> np.ndarray:
    """Return bool (D,): True for the channels a hold commands as 0, the rates of the action's ``values``.

    A rate holds by commanding no motion; a position (or joint_delta's target, which the client has
    already integrated) holds by commanding it again. True for joint_velocity's and ee_delta's rate
    channels (see :func:`position_mask`), nowhere else.
    """
    if space is ActionSpace.JOINT_VELOCITY or space is ActionSpace.EE_DELTA:
        return ~position_mask(space, dim)
    return np.zeros(dim, dtype=bool)
