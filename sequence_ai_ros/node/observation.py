"""Observation assembly: the latest message per source, each with its own max age.

Subscription callbacks (executor thread) convert each message once and store an immutable
:class:`Sample`; the control thread reads the latest samples without a lock (one attribute write per
message, atomic under the GIL) and builds an :class:`Observation`, or reports why it cannot:
a missing or stale source, an unmappable joint_states message. Ages are measured against the local
receive time (``time.monotonic()``) by default, because replayed bags carry recording-time stamps;
``stamp_source='header'`` measures against the header stamp on the node's clock instead.

Joints are mapped by name (:class:`JointMapper`): the configured names, a subset of the message's, in
the configured order. A missing joint, a message without names or with a name given twice is an
error, never a silent positional (or last-wins) mapping.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from sequence_ai_ros.client.adapter import NameIndex
from sequence_ai_ros.exceptions import ContractViolation
from sequence_ai_ros.protocol.types import ImageLike, Observation


@dataclasses.dataclass(frozen=True)
class Sample:
    """The latest message of one source, converted.

    :param value: float32 (D,) state for joints; an image (array or JPEG bytes) for cameras; None on error.
    :param received: local receive time, ``time.monotonic()`` (s).
    :param stamp: header stamp (s on the node's clock), or nan when the message has none.
    :param error: why ``value`` is None (conversion or mapping failure).
    """

    value: Any
    received: float
    stamp: float = math.nan
    error: str = ''


class JointMapper:
    """Map sensor_msgs/JointState positions into the configured joint order, by name.

    :param names: the configured joints, in state order (a subset of the message's names).
    """

    def __init__(self, names: Sequence[str]) -> None:
        self.names = tuple(names)
        self._index = NameIndex(self.names, what='joint_states', noun='joints')   # shared with the Python API

    def map(self, msg: Any) -> np.ndarray:
        """Return float32 (D,) positions in the configured order (rad or m, as published).

        :raises ContractViolation: for an empty name field, a joint named twice, a missing joint, too few
            positions, or non-finite values.
        """
        msg_names = tuple(msg.name)
        index = self._index.index(msg_names)
        position = np.asarray(msg.position, dtype=np.float64)
        if position.shape[0] != len(msg_names):
            raise ContractViolation(f'joint_states has {len(msg_names)} names but {position.shape[0]} positions')
        state = position[index].astype(np.float32)
        if not np.all(np.isfinite(state)):
            bad = [self.names[i] for i in np.flatnonzero(~np.isfinite(state))]
            raise ContractViolation(f'joint_states has non-finite positions for {bad}')
        return state


@dataclasses.dataclass
class Snapshot:
    """What the control thread sees at one tick.

    :param observation: the observation, or None when it is invalid.
    :param problems: why it is invalid, one line per source (empty when valid).
    :param ages: age of each source (s); inf when never received.
    :param state: the latest measured joint state float32 (D,), even when the observation is invalid
        (None when joints never arrived or cannot be mapped).
    """

    observation: Observation | None
    problems: list[str]
    ages: dict[str, float]
    state: np.ndarray | None


class ObservationAssembler:
    """Keep the latest sample per source and assemble observations.

    :param joint_names: state order.
    :param joints_max_age_s: max age of joint_states (s).
    :param cameras: per observation key, its max age (s).
    :param joints_source: name of the joint source in diagnostics (its topic).
    :param camera_sources: per observation key, its name in diagnostics (the topic).
    :param clock: the node's clock in seconds, for ``stamp_source='header'``.
    :param stamp_source: ``receive`` or ``header``.
    """

    def __init__(self, joint_names: Sequence[str], joints_max_age_s: float, cameras: dict[str, float], *,
                 joints_source: str = 'joint_states', camera_sources: dict[str, str] | None = None,
                 clock: Callable[[], float] | None = None, stamp_source: str = 'receive') -> None:
        self.mapper = JointMapper(joint_names)
        self.joints_max_age_s = joints_max_age_s
        self.cameras = dict(cameras)
        self.joints_source = joints_source
        self.camera_sources = {k: (camera_sources or {}).get(k, k) for k in self.cameras}
        self.clock = clock
        self.stamp_source = stamp_source
        self.required_cameras: tuple[str, ...] = tuple(self.cameras)
        self._joints: Sample | None = None
        self._images: dict[str, Sample] = {}

    # -- writers (executor thread) ------------------------------------------------------------------
    def put_joints(self, msg: Any, received: float, stamp: float = math.nan) -> None:
        """Store a JointState message, mapped (an unmappable one is stored as an error)."""
        try:
            self._joints = Sample(self.mapper.map(msg), received, stamp)
        except ContractViolation as exc:
            self._joints = Sample(None, received, stamp, str(exc))

    def put_image(self, key: str, convert: Callable[[], ImageLike], received: float,
                  stamp: float = math.nan) -> None:
        """Store a camera frame: ``convert()`` runs here, once per message; its error is stored."""
        try:
            self._images[key] = Sample(convert(), received, stamp)
        except ContractViolation as exc:
            self._images[key] = Sample(None, received, stamp, str(exc))

    # -- reader (control thread) ----------------------------------------------------------------------
    def _age(self, sample: Sample | None, now: float) -> float:
        if sample is None:
            return math.inf
        if self.stamp_source == 'header' and self.clock is not None and math.isfinite(sample.stamp):
            return self.clock() - sample.stamp
        return now - sample.received

    def snapshot(self, now: float, instruction: str = '') -> Snapshot:
        """Assemble the observation at ``now`` (``time.monotonic()``, s).

        Joints and the cameras the contract needs must be fresh, or the observation is invalid (the
        problems name each source). Other configured cameras are added while fresh, for capture only.
        """
        problems: list[str] = []
        ages: dict[str, float] = {}
        joints = self._joints
        ages[self.joints_source] = age = self._age(joints, now)
        state = joints.value if joints is not None else None
        if joints is None:
            problems.append(f'{self.joints_source}: no message received yet')
        elif joints.error:
            problems.append(f'{self.joints_source}: {joints.error}')
        elif age > self.joints_max_age_s:
            problems.append(f'{self.joints_source}: stale ({age:.3f} s > max_age {self.joints_max_age_s} s)')
        images: dict[str, ImageLike] = {}
        for key, max_age in self.cameras.items():
            sample = self._images.get(key)
            source = self.camera_sources[key]
            ages[source] = age = self._age(sample, now)
            if key not in self.required_cameras:
                # a camera the policy does not use still goes to capture (telemetry) while it is fresh
                if sample is not None and not sample.error and age <= max_age:
                    images[key] = sample.value
                continue
            if sample is None:
                problems.append(f'{source} ({key}): no image received yet')
            elif sample.error:
                problems.append(f'{source} ({key}): {sample.error}')
            elif age > max_age:
                problems.append(f'{source} ({key}): stale ({age:.3f} s > max_age {max_age} s)')
            else:
                images[key] = sample.value
        if problems:
            return Snapshot(None, problems, ages, state)
        obs = Observation(state=state, state_names=self.mapper.names, images=images, instruction=instruction,
                          timestamp=now)
        return Snapshot(obs, [], ages, state)
