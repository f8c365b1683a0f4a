"""Observation and Action: the two values that cross between a robot and a policy.

Both are plain dataclasses, independent of ROS and gRPC; :mod:`sequence_ai_ros.protocol.messages`
converts them to and from the wire.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from sequence_ai_ros.exceptions import ContractViolation
from sequence_ai_ros.protocol.codec import numbers
from sequence_ai_ros.protocol.spaces import ActionSpace

ImageLike = np.ndarray | bytes


@dataclasses.dataclass
class Observation:
    """What the robot sees and feels at one instant.

    :param state: measured state, float32 (D,) (rad for revolute joints, m for prismatic).
    :param state_names: the D names, in order (joint names for joint_states).
    :param images: per camera key, uint8 (H, W, 3) RGB (or (H, W) mono) arrays, or already-encoded
        JPEG/PNG bytes, which are sent untouched.
    :param instruction: the task in natural language; act() overwrites it with its pinned instruction.
    :param timestamp: the robot's monotonic clock (s) when the observation was taken
        (``time.monotonic()`` by default; the ROS node gives its control tick's deadline); never compared
        across hosts. Capture puts telemetry on dataset rows by it.
    :param params: inference parameters (e.g. ``{'seed': '3'}``), kept by capture.
    :raises ContractViolation: for a state that is not 1-d, not finite, or whose names do not match;
        :class:`~sequence_ai_ros.protocol.codec.ValueKindViolation` (field ``state``) for a state that is not
        real numbers (complex, string, bool, object).
    """

    state: np.ndarray
    state_names: Sequence[str] = ()      # as given; __post_init__ keeps a tuple
    images: dict[str, ImageLike] = dataclasses.field(default_factory=dict)
    instruction: str = ''
    timestamp: float = dataclasses.field(default_factory=time.monotonic)
    params: dict[str, str] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        self.state = numbers(self.state, 'state')
        self.state_names = tuple(self.state_names)
        if self.state.ndim != 1:
            raise ContractViolation(f'observation state must be (D,), got shape {self.state.shape}')
        if not np.isfinite(self.state).all():
            raise ContractViolation('observation state has non-finite values (NaN or inf)')
        if self.state_names and len(self.state_names) != self.state.shape[0]:
            raise ContractViolation(f'{len(self.state_names)} state names for a state of '
                                    f'{self.state.shape[0]} values')
        if not all(self.state_names):
            raise ContractViolation('observation state_names has an empty name')
        self.images = dict(self.images)
        self.params = {str(k): str(v) for k, v in self.params.items()}

    @classmethod
    def coerce(cls, value: Observation | Mapping[str, Any]) -> Observation:
        """Return ``value`` as an Observation; a plain dict converts by field name.

        Accepted dict keys: state (required), state_names, images, instruction, timestamp, params.

        :raises ContractViolation: for a dict without ``state``, unknown keys, or bad values.
        :raises TypeError: for anything that is neither an Observation nor a mapping.
        """
        if isinstance(value, Observation):
            return value
        if not isinstance(value, Mapping):
            raise TypeError(f'observe() must return an Observation or a dict, not {type(value).__name__}')
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = set(value) - fields
        if unknown:
            raise ContractViolation(f'observation dict has unknown keys {sorted(unknown)}; '
                                    f'known: {sorted(fields)}')
        if 'state' not in value:
            raise ContractViolation("observation dict needs a 'state'")
        return cls(**value)


@dataclasses.dataclass(frozen=True)
class Action:
    """One action to execute now.

    :param values: float32 (D,), in the units of ``action_space`` (rad, rad/s, m; see ActionSpace).
        For a joint_delta space the client has already integrated it: ``values`` is the absolute
        target and ``delta`` the increment it came from.
    :param action_space: the space of ``values``.
    :param names: the D names, in order.
    :param chunk: index of the chunk in the episode (0-based).
    :param index: position within that chunk, in chunk steps (fractional when resampled).
    :param hold: True when the buffer is dry and this repeats the last command (an underrun).
    :param delta: the original increment for delta spaces, else None.
    """

    values: np.ndarray
    action_space: ActionSpace
    names: tuple[str, ...] = ()
    chunk: int = 0
    index: float = 0.0
    hold: bool = False
    delta: np.ndarray | None = None
