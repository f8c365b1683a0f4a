"""Sampling the caller's ticks on the policy's clocks: observation history and capture telemetry.

The observation history uses a grid on the robot's monotonic clock (``floor((t - t0) / period)``), so a
50 Hz caller against dt = 1/30 s keeps frames 1/30 s apart on average (alternately one and two ticks
apart), not every second tick. Capture telemetry keeps every tick's record, with camera frames on the
ticks whose chunk-step span holds the start of a dataset row.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import Any

import numpy as np

from sequence_ai_ros.protocol.types import ImageLike, Observation

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
    """One telemetry record (one committed control tick, :class:`~sequence_ai_ros.client.steps.Step`) before packing.

    :param robot_time_s: the observation's monotonic timestamp (s).
    :param state: float32 (D,) measured state.
    :param action: float32 (A,) what the robot executed at this tick in the policy's action space (after
        its safety filter), or None when it commanded nothing.
    :param hold: True when no fresh policy action was executed at this tick.
    :param images: the tick's camera frames, on the ticks where a row starts, when capture keeps images
        (fitted to the contract's sizes when packed).
    :param policy_action: float32 (A,) the policy's action when the robot executed something else.
    :param clamped: True when the robot's safety filter changed the policy's action.
    :param grid_index: the control deadline the tick served (from the episode's first, 0).
    :param step_start: its span's start on the episode's chunk-step axis.
    :param step_end: its span's end.
    :param hold_reason: why it held ('' when it executed a fresh action).
    :param pieces: float32 (P, A) the policy's action over the parts of a span across chunk-step boundaries.
    :param piece_share: float (P,) each part's share of the span.
    """

    robot_time_s: float
    state: np.ndarray
    action: np.ndarray | None
    hold: bool
    images: dict[str, ImageLike] = dataclasses.field(default_factory=dict)
    policy_action: np.ndarray | None = None
    clamped: bool = False
    grid_index: int = 0
    step_start: float = 0.0
    step_end: float = 0.0
    hold_reason: str = ''
    pieces: np.ndarray | None = None
    piece_share: np.ndarray | None = None


class TelemetryBuffer:
    """Turns committed steps into telemetry records, with camera frames only where a dataset row starts.

    Every tick is kept, so that the worker's export reads its rows off the ticks' spans
    (:mod:`sequence_ai_ros.datasets.rows`) and sums delta increments without losing one; camera frames (the
    heavy part) ride only on the first executed tick and on each tick whose span holds the start of a row
    (rows at ``fps``, from the first executed tick's start).

    :param fps: row rate (Hz), > 0.
    :param images: keep camera frames.
    :param dt: the policy's action period (s): a chunk step is ``fps * dt`` rows.
    :param batch_s: seconds of ticks per ``Telemetry`` message (robot time).
    """

    def __init__(self, fps: float, images: bool, dt: float, batch_s: float = 0.5) -> None:
        self._rows_per_step = float(fps) * float(dt)
        self._images = images
        self._frames: list[TelemetrySample] = []
        self._batch_s = batch_s
        self._origin: float | None = None      # the first executed tick's start (rows)

    def _due(self, start: float, end: float, fresh: bool) -> bool:
        if self._origin is None:
            if not fresh:
                return False
            self._origin = start * self._rows_per_step
            return True
        a = start * self._rows_per_step - self._origin
        b = end * self._rows_per_step - self._origin
        return math.ceil(a - CELL_SLACK) < b - CELL_SLACK

    def add(self, step: Any) -> list[TelemetrySample] | None:
        """Keep one committed step; return a batch to send (every record so far), or None.

        :param step: a committed :class:`~sequence_ai_ros.client.steps.Step`.
        """
        obs = step.observation
        due = self._due(step.step_start, step.step_end, not step.held)
        self._frames.append(TelemetrySample(
            robot_time_s=obs.timestamp, state=obs.state,
            action=None if step.executed is None else np.array(step.executed, np.float32), hold=step.held,
            images=dict(obs.images) if (self._images and due) else {},
            policy_action=None if step.policy_action is None else _differs(step.policy_action, step.executed),
            clamped=step.clamped, grid_index=int(step.grid_index), step_start=float(step.step_start),
            step_end=float(step.step_end), hold_reason=step.hold_reason, pieces=step.pieces,
            piece_share=step.piece_share))
        if obs.timestamp - self._frames[0].robot_time_s >= self._batch_s:
            batch, self._frames = self._frames, []
            return batch
        return None

    def flush(self) -> list[TelemetrySample] | None:
        """Return and clear the pending frames (None when empty)."""
        frames, self._frames = self._frames, []
        return frames or None


def _differs(policy_action: np.ndarray, executed: np.ndarray | None) -> np.ndarray | None:
    """The policy's action when the robot executed something else (or nothing), else None (the same)."""
    if executed is not None and np.array_equal(policy_action, executed):
        return None
    return np.array(policy_action, np.float32)
