"""Observation assembly: the latest message per source, each with its own max age.

Subscription callbacks (executor thread) convert each message once and store an immutable
:class:`Sample` (joints: a new :class:`JointStates`); the control thread reads the latest samples without
a lock (one attribute write per message, atomic under the GIL) and builds an :class:`Observation`, or
reports why it cannot: a missing or stale source, an unmappable joint_states message. Ages are measured
against the local receive time (``time.monotonic()``) by default, because replayed bags carry
recording-time stamps; ``stamp_source='header'`` measures against the header stamp on the node's clock instead.

Joints are mapped by name (:class:`JointMapper`) into the configured order, and merged across messages
(:class:`JointStates`): a robot whose joint_states come from several publishers (an arm's and a gripper's
joint_state_broadcaster, a hand driver) fills each joint from the latest message that names it, as
``joint_state_publisher``'s ``source_list`` does; a message naming none of the configured joints changes
nothing, even a malformed one (no names, another publisher's name twice): its reason is shown only when
the joints are missing or stale. Each joint has its own age, and the joints' age is the oldest. A message
naming a configured joint twice, with fewer positions than names or non-finite positions is an error for
the configured joints it names until a good message names them again: never a silent positional (or
last-wins) mapping, and one bad message costs no more than itself.
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

    :param names: the configured joints, in state order.
    """

    def __init__(self, names: Sequence[str]) -> None:
        self.names = tuple(names)
        self._index = NameIndex(self.names, what='joint_states', noun='joints')   # shared with the Python API
        self._slot = {n: i for i, n in enumerate(self.names)}
        self._key: tuple[str, ...] | None = None
        self._pick: tuple[np.ndarray, np.ndarray] = (np.zeros(0, np.intp), np.zeros(0, np.intp))

    def locate(self, msg_names: tuple[str, ...]) -> tuple[np.ndarray, np.ndarray]:
        """Return (slots, where) of the configured joints ``msg_names`` holds (K of them, maybe 0).

        ``slots``: intp (K,) indices into the configured order; ``where``: intp (K,) their positions in
        ``msg_names``. Cached per name tuple.

        :raises ContractViolation: for an empty name field or a name given twice.
        """
        if msg_names != self._key:
            self._index.check_unique(msg_names)      # the Python API's rule and wording
            pairs = [(self._slot[n], i) for i, n in enumerate(msg_names) if n in self._slot]
            self._pick = (np.array([p[0] for p in pairs], np.intp), np.array([p[1] for p in pairs], np.intp))
            self._key = msg_names
        return self._pick

    def positions(self, msg: Any, slots: np.ndarray, where: np.ndarray) -> np.ndarray:
        """Return float32 (K,) positions (rad or m, as published) at ``where`` in the message (see :meth:`locate`).

        :raises ContractViolation: for fewer or more positions than names, or non-finite positions of the
            configured joints.
        """
        position = np.asarray(msg.position, dtype=np.float64)
        if position.shape[0] != len(msg.name):
            raise ContractViolation(f'joint_states has {len(msg.name)} names but {position.shape[0]} positions')
        values = position[where].astype(np.float32)
        if not np.all(np.isfinite(values)):
            bad = [self.names[i] for i in slots[~np.isfinite(values)]]
            raise ContractViolation(f'joint_states has non-finite positions for {bad}')
        return values

    def map(self, msg: Any) -> np.ndarray:
        """Return float32 (D,) positions in the configured order from one message that names every joint.

        :raises ContractViolation: as :meth:`locate` and :meth:`positions`, and for a configured joint the
            message lacks.
        """
        names = tuple(msg.name)
        self._index.index(names)      # names every configured joint (the Python API's rule)
        slots, where = self.locate(names)
        values = self.positions(msg, slots, where)
        state = np.empty(len(self.names), np.float32)
        state[slots] = values
        return state


@dataclasses.dataclass(frozen=True)
class JointStates:
    """The configured joints merged from every joint_states message so far (replaced whole, never mutated).

    :param values: float32 (D,) latest position per joint (nan before any message names it).
    :param received: float64 (D,) local receive time per joint, ``time.monotonic()`` (s; -inf before any).
    :param stamps: float64 (D,) header stamp per joint (s on the node's clock; nan without one).
    :param errors: per joint, why its last message was refused ('' when good).
    """

    values: np.ndarray
    received: np.ndarray
    stamps: np.ndarray
    errors: tuple[str, ...]

    @classmethod
    def empty(cls, n: int) -> JointStates:
        """No joint heard yet."""
        return cls(np.full(n, np.nan, np.float32), np.full(n, -np.inf), np.full(n, np.nan), ('',) * n)

    def update(self, slots: np.ndarray, values: np.ndarray | None, received: float, stamp: float,
               error: str = '') -> JointStates:
        """Return the merge with one message: ``values`` for ``slots`` (None with ``error``: refused)."""
        v, r, st, e = self.values.copy(), self.received.copy(), self.stamps.copy(), list(self.errors)
        r[slots], st[slots] = received, stamp
        if values is not None:
            v[slots] = values
        for i in slots.tolist():
            e[i] = error
        return JointStates(v, r, st, tuple(e))


@dataclasses.dataclass
class Snapshot:
    """What the control thread sees at one tick.

    :param observation: the observation, or None when it is invalid.
    :param problems: why it is invalid, one line per source (empty when valid).
    :param ages: age of each source (s); inf when never received.
    :param state: the latest measured joint state float32 (D,), even when the observation is invalid
        (None when joints never arrived or cannot be mapped).
    :param received: the oldest local receive time (``time.monotonic()``, s) of what the observation is made
        of: every configured joint and every camera the policy needs (-inf when one was never received).
    """

    observation: Observation | None
    problems: list[str]
    ages: dict[str, float]
    state: np.ndarray | None
    received: float = -math.inf


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
        self._joints = JointStates.empty(len(self.mapper.names))
        self._refused: tuple[float, str] | None = None   # the latest refused message naming none of the joints
        self._images: dict[str, Sample] = {}

    # -- writers (executor thread) ------------------------------------------------------------------
    def put_joints(self, msg: Any, received: float, stamp: float = math.nan) -> None:
        """Merge a JointState message into the configured joints (see the module docstring).

        A refused message marks the configured joints it names, or all of them when its names are unusable.
        """
        joints = self._joints
        try:
            slots, where = self.mapper.locate(tuple(msg.name))
        except ContractViolation as exc:
            # unusable names: the configured joints among them are refused (a duplicate leaves their value
            # ambiguous); a message naming none of them (another publisher's, or no names at all) changes
            # nothing, and its reason is kept for when the joints are missing or stale
            named = sorted({self.mapper.names.index(n) for n in msg.name if n in self.mapper.names})
            if named:
                self._joints = joints.update(np.array(named, np.intp), None, received, stamp, str(exc))
            else:
                self._refused = (received, str(exc))
            return
        if not slots.size:
            return          # another publisher's joints
        try:
            values = self.mapper.positions(msg, slots, where)
        except ContractViolation as exc:
            self._joints = joints.update(slots, None, received, stamp, str(exc))
            return
        self._joints = joints.update(slots, values, received, stamp)

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

    def _joint_problems(self, now: float, problems: list[str], ages: dict[str, float]) -> np.ndarray | None:
        """Check the merged joints at ``now``; add their problems and age; return the state or None."""
        joints, names, src = self._joints, self.mapper.names, self.joints_source
        heard = np.isfinite(joints.received)
        if self.stamp_source == 'header' and self.clock is not None:
            clock = self.clock()
            age = np.where(np.isfinite(joints.stamps), clock - joints.stamps, now - joints.received)
        else:
            age = now - joints.received
        ages[src] = float(age.max()) if heard.all() else math.inf
        refused = self._refused    # a message naming none of the joints: said only when they are not fine
        note = [f'{src}: refused a message since: {refused[1]}'] if (
            refused is not None and refused[0] >= float(np.min(joints.received))) else []
        if not heard.any():
            problems.extend([f'{src}: no message received yet', *note])
            return None
        invalid = [f'{src}: {e}' for e in dict.fromkeys(e for e in joints.errors if e)]
        if not heard.all():
            missing = [n for n, h in zip(names, heard, strict=True) if not h]
            invalid.insert(0, f'{src}: no message has named joints {missing} yet')
        if invalid:
            problems.extend(invalid + note)
            return None
        unfresh = ~((-self.joints_max_age_s <= age) & (age <= self.joints_max_age_s))
        if unfresh.any():
            worst = float(age[unfresh][np.abs(age[unfresh]).argmax()])
            which = '' if unfresh.all() else f' (joints {[n for n, u in zip(names, unfresh, strict=True) if u]})'
            problems.extend([f'{src}: {_stale(worst, self.joints_max_age_s)}{which}', *note])
            ages[src] = worst
        return joints.values

    def snapshot(self, now: float, instruction: str = '') -> Snapshot:
        """Assemble the observation at ``now`` (``time.monotonic()``, s).

        Joints and the cameras the contract needs must be fresh, or the observation is invalid (the
        problems name each source). Other configured cameras are added while fresh, for capture only.
        """
        problems: list[str] = []
        ages: dict[str, float] = {}
        state = self._joint_problems(now, problems, ages)
        images: dict[str, ImageLike] = {}
        for key, max_age in self.cameras.items():
            sample = self._images.get(key)
            source = self.camera_sources[key]
            ages[source] = age = self._age(sample, now)
            if key not in self.required_cameras:
                # a camera the policy does not use still goes to capture (telemetry) while it is fresh
                if sample is not None and not sample.error and _fresh(age, max_age):
                    images[key] = sample.value
                continue
            if sample is None:
                problems.append(f'{source} ({key}): no image received yet')
            elif sample.error:
                problems.append(f'{source} ({key}): {sample.error}')
            elif not _fresh(age, max_age):
                problems.append(f'{source} ({key}): {_stale(age, max_age)}')
            else:
                images[key] = sample.value
        if problems or state is None:     # no state: a problem says why
            return Snapshot(None, problems, ages, state)
        obs = Observation(state=state, state_names=self.mapper.names, images=images, instruction=instruction,
                          timestamp=now)
        received = min([float(np.min(self._joints.received))]
                       + [self._images[k].received for k in self.required_cameras if k in self._images])
        return Snapshot(obs, [], ages, state, received)


def _fresh(age: float, max_age: float) -> bool:
    """True when a sample's ``age`` (s) is within ``max_age`` (s) of now, on either side.

    A header stamp more than ``max_age`` ahead of the clock (sim time reset, /clock jumped back, a sender's
    clock far ahead) says nothing of the source's liveness: taken as fresh, a dead source would stay valid
    until the clock caught up.
    """
    return -max_age <= age <= max_age


def _stale(age: float, max_age: float) -> str:
    if age < 0:
        return f'stamp {-age:.3f} s ahead of the clock (> max_age {max_age} s; did the clock jump back?)'
    return f'stale ({age:.3f} s > max_age {max_age} s)'
