"""Sampling the caller's ticks on the policy's clocks: observation history and capture telemetry.

Both use a grid on the robot's monotonic clock (``floor((t - t0) / period)``), so a 50 Hz caller
against dt = 1/30 s keeps frames 1/30 s apart on average (alternately one and two ticks apart), not
every second tick.
"""

from __future__ import annotations

import collections
import dataclasses
import math

import numpy as np

from sequence_ai_ros.protocol.types import Observation

#: Share of a cell a time may fall short of its cell's start and still count in it. Times on an exact grid
#: (the node stamps its ticks ``start + k * period``) carry float error of about ulp(t): 1.2e-10 s at a
#: week of uptime, 3.6e-9 of a 30 Hz cell; 1e-4 (3.3 us at 30 Hz) covers clocks of decades.
CELL_SLACK = 1e-4


class GridSampler:
    """True once per grid cell of ``period_s`` on the given clock.

    :param period_s: grid period (s), > 0.
    """

    def __init__(self, period_s: float) -> None:
        self.period_s = float(period_s)
        self._t0: float | None = None
        self._cell = -1

    def due(self, t: float) -> bool:
        """Return True when ``t`` (s) falls in a new grid cell (always for the first call)."""
        if self._t0 is None:
            self._t0 = t
        cell = int(math.floor((t - self._t0) / self.period_s + CELL_SLACK))
        if cell > self._cell:
            self._cell = cell
            return True
        return False


class History:
    """The last ``n - 1`` observations before the current one, sampled at the policy's dt.

    :param n: the contract's history N (>= 1); 1 keeps nothing.
    :param dt: the policy's action period (s).
    """

    def __init__(self, n: int, dt: float) -> None:
        self._past: collections.deque[Observation] = collections.deque(maxlen=max(0, n - 1))
        self._grid = GridSampler(dt)
        self._n = n

    def push(self, obs: Observation) -> list[Observation]:
        """Record the current observation; return the sampled frames before it, oldest first (<= N - 1)."""
        if self._n <= 1:
            return []
        past = list(self._past)
        if self._grid.due(obs.timestamp):
            self._past.append(obs)
        return past


@dataclasses.dataclass
class TelemetrySample:
    """One telemetry frame (one control tick) before packing.

    :param robot_time_s: the observation's monotonic timestamp (s).
    :param state: float32 (D,) measured state.
    :param action: float32 (D,) the command executed at this tick (after the robot's safety filter when
        it reported one with :meth:`TelemetryBuffer.amend`), or None while holding before any.
    :param hold: True when no fresh policy action was executed at this tick.
    :param images: the latest camera frames, on the row grid only, when capture keeps images.
    :param policy_action: float32 (D,) the policy's action when the robot commanded something else.
    :param clamped: True when the robot's safety filter changed the policy's action.
    """

    robot_time_s: float
    state: np.ndarray
    action: np.ndarray | None
    hold: bool
    images: dict = dataclasses.field(default_factory=dict)
    policy_action: np.ndarray | None = None
    clamped: bool = False


class TelemetryBuffer:
    """Keeps every control tick for capture (state and command), with camera frames at the row rate.

    Every tick is kept, so that the worker's export can put rows exactly on its ``k / fps`` timeline and
    sum delta commands without losing one; camera frames (the heavy part) ride only on the ticks where
    the row grid of ``1 / fps`` starts a new cell. The newest tick is held back until the next tick, so
    the caller may still :meth:`amend` it with what it really commanded.

    :param fps: row rate (Hz), > 0: the camera frames' rate.
    :param images: keep camera frames.
    :param batch_s: seconds of ticks per ``Telemetry`` message (robot time).
    """

    def __init__(self, fps: float, images: bool, batch_s: float = 0.5) -> None:
        self._grid = GridSampler(1.0 / fps)
        self._images = images
        self._frames: list[TelemetrySample] = []
        self._batch_s = batch_s

    def add(self, obs: Observation, action: np.ndarray | None, hold: bool,
            policy_action: np.ndarray | None = None) -> list[TelemetrySample] | None:
        """Keep one tick; return a batch to send (every tick before this one), or None.

        :param policy_action: float32 (D,) the policy's action when it differs from ``action`` already.
        """
        due = self._grid.due(obs.timestamp)
        self._frames.append(TelemetrySample(
            robot_time_s=obs.timestamp, state=obs.state,
            action=None if action is None else np.array(action, np.float32),
            hold=hold, images=dict(obs.images) if (self._images and due) else {},
            policy_action=None if policy_action is None else np.array(policy_action, np.float32)))
        if len(self._frames) > 1 and obs.timestamp - self._frames[0].robot_time_s >= self._batch_s:
            batch, self._frames = self._frames[:-1], self._frames[-1:]
            return batch
        return None

    def amend(self, commanded: np.ndarray | None, clamped: bool) -> None:
        """Record what the robot commanded at the newest tick (after its safety filter).

        :param commanded: float32 (D,) in the contract's action order, or None when it held.
        :param clamped: True when the safety filter changed the policy's action.
        """
        if not self._frames:
            return
        last = self._frames[-1]
        new = None if commanded is None else np.array(commanded, np.float32)
        if last.policy_action is None and last.action is not None and (
                new is None or not np.array_equal(new, last.action)):
            last.policy_action = last.action    # the policy's own, kept across amends (clamped, then held)
        last.action = new
        last.clamped = bool(clamped)
        if new is None:
            last.hold = True

    def flush(self) -> list[TelemetrySample] | None:
        """Return and clear the pending frames (None when empty)."""
        frames, self._frames = self._frames, []
        return frames or None
