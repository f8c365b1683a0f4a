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
        cell = int(math.floor((t - self._t0) / self.period_s + 1e-9))
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
    """One telemetry frame before packing.

    :param robot_time_s: the observation's monotonic timestamp (s).
    :param state: float32 (D,) measured state.
    :param action: float32 (D,) the command executed at this tick, or None while holding before any.
    :param hold: True when no fresh policy action was executed at this tick.
    :param images: the latest camera frames, only when capture keeps images.
    """

    robot_time_s: float
    state: np.ndarray
    action: np.ndarray | None
    hold: bool
    images: dict = dataclasses.field(default_factory=dict)


class TelemetryBuffer:
    """Samples ticks at the capture fps and batches them for sending.

    :param fps: capture rate (Hz), > 0.
    :param images: keep camera frames.
    :param batch_s: seconds of frames per ``Telemetry`` message.
    """

    def __init__(self, fps: float, images: bool, batch_s: float = 0.5) -> None:
        self._grid = GridSampler(1.0 / fps)
        self._images = images
        self._frames: list[TelemetrySample] = []
        self._batch = max(1, int(round(fps * batch_s)))

    def add(self, obs: Observation, action: np.ndarray | None, hold: bool) -> list[TelemetrySample] | None:
        """Sample one tick; return a full batch to send, or None."""
        if not self._grid.due(obs.timestamp):
            return None
        self._frames.append(TelemetrySample(
            robot_time_s=obs.timestamp, state=obs.state,
            action=None if action is None else np.array(action, np.float32),
            hold=hold, images=dict(obs.images) if self._images else {}))
        if len(self._frames) >= self._batch:
            return self.flush()
        return None

    def flush(self) -> list[TelemetrySample] | None:
        """Return and clear the pending frames (None when empty)."""
        frames, self._frames = self._frames, []
        return frames or None
