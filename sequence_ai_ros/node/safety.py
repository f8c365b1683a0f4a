"""Safety on every command: non-finite values, per-joint position limits, per-tick step limits.

Limits apply to position commands (joint positions, integrated joint deltas, and nothing else: rates
and end-effector poses pass unchanged except for the finiteness check). ``clamp`` clamps and counts
every clamped value; ``stop`` refuses the command, and the node ends the run with reason 'validate'.
A non-finite action always stops the run with 'validate'. The step limit is measured from the last
command published, or from the measured state for the first command of an episode. The command that
comes out is checked for finiteness again (defence in depth: :class:`SafetyConfig` already refuses
non-finite limits, but a NaN bound or a NaN ``last`` would make ``np.clip`` return NaN), so a
non-finite command is never returned for publishing.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence

import numpy as np

from sequence_ai_ros.node.config import SafetyConfig


@dataclasses.dataclass(frozen=True)
class Checked:
    """The outcome of :meth:`SafetyFilter.check`.

    :param values: float64 (D,) the command to publish (clamped), or None when the run must stop.
    :param clamped: number of values clamped in this command.
    :param stop: why the run must stop ('' when it need not).
    """

    values: np.ndarray | None
    clamped: int = 0
    stop: str = ''


class SafetyFilter:
    """Apply :class:`SafetyConfig` to commands, counting clamps per joint (thread-safe counters).

    :param cfg: limits and the violation policy.
    :param names: commanded joint names, in command order.
    :param positions: True when commands are positions (limits apply).
    """

    def __init__(self, cfg: SafetyConfig, names: Sequence[str], positions: bool = True) -> None:
        self.cfg = cfg
        self.names = tuple(names)
        self.positions = positions
        n = len(self.names)
        self.lower = np.array(cfg.lower_limits, np.float64) if cfg.lower_limits else None
        self.upper = np.array(cfg.upper_limits, np.float64) if cfg.upper_limits else None
        step = cfg.max_step
        self.max_step = np.full(n, step[0]) if len(step) == 1 else (np.array(step, np.float64) if step else None)
        self._lock = threading.Lock()
        self._limit_clamps = np.zeros(n, np.int64)
        self._step_clamps = np.zeros(n, np.int64)
        self.checked = 0             # position commands checked (and counted), for the clamp rate
        self.clamped_commands = 0    # of which had at least one value clamped

    @property
    def clamps(self) -> int:
        """Total values clamped since start (limits and steps)."""
        with self._lock:
            return int(self._limit_clamps.sum() + self._step_clamps.sum())

    def counts(self) -> dict[str, dict[str, int]]:
        """Return clamp counts per joint that was ever clamped: {name: {'limit': n, 'step': n}}."""
        with self._lock:
            rows = zip(self.names, self._limit_clamps, self._step_clamps, strict=True)
            return {name: {'limit': int(lim), 'step': int(st)} for name, lim, st in rows if lim or st}

    def check(self, values: np.ndarray, last: np.ndarray | None, *, step_scale: float = 1.0,
              count: bool = True) -> Checked:
        """Check one command.

        :param values: float64 (D,) in command order.
        :param last: the previous command (or measured state) in command order, or None.
        :param step_scale: control periods between ``last`` and this command (trajectory points further
            apart may move further; >= 1).
        :param count: count clamps and commands (False for a value that is not published).
        :returns: the command to publish (always finite), or ``values=None`` with ``stop`` saying why
            the run must end ('validate'): a non-finite action, a violation under ``on_violation='stop'``,
            or a command that is non-finite after the limits.
        """
        v = np.asarray(values, np.float64)
        if not np.all(np.isfinite(v)):
            bad = [self.names[i] if i < len(self.names) else str(i) for i in np.flatnonzero(~np.isfinite(v))]
            return Checked(None, stop=f'non-finite action values for {bad}')
        if not self.positions or v.shape[0] != len(self.names):
            return Checked(v)
        out = v
        limit_hit = np.zeros(v.shape[0], bool)
        # written as "not within" so that a NaN bound counts as a violation instead of passing silently
        if self.lower is not None:
            limit_hit |= ~(out >= self.lower)
        if self.upper is not None:
            limit_hit |= ~(out <= self.upper)
        if limit_hit.any():
            if self.cfg.on_violation == 'stop':
                names = [self.names[i] for i in np.flatnonzero(limit_hit)]
                return Checked(None, stop=f'position limit exceeded for {names}')
            lo = self.lower if self.lower is not None else -np.inf
            hi = self.upper if self.upper is not None else np.inf
            out = np.clip(out, lo, hi)
        step_hit = np.zeros(v.shape[0], bool)
        if self.max_step is not None and last is not None and np.shape(last) == out.shape:
            if not np.all(np.isfinite(last)):   # the step limit cannot be checked against NaN: refuse
                bad = [self.names[i] for i in np.flatnonzero(~np.isfinite(last))]
                return Checked(None, stop=f'non-finite reference for the step limit for {bad}')
            delta = out - last
            max_step = self.max_step * step_scale
            step_hit = np.abs(delta) > max_step
            if step_hit.any():
                if self.cfg.on_violation == 'stop':
                    names = [self.names[i] for i in np.flatnonzero(step_hit)]
                    return Checked(None, stop=f'step limit exceeded for {names}')
                out = last + np.clip(delta, -max_step, max_step)
        if not np.all(np.isfinite(out)):
            bad = [self.names[i] for i in np.flatnonzero(~np.isfinite(out))]
            return Checked(None, stop=f'non-finite command after the safety limits for {bad}')
        n = int(limit_hit.sum() + step_hit.sum())
        if count:
            with self._lock:
                self.checked += 1
                if n:
                    self.clamped_commands += 1
                    self._limit_clamps += limit_hit
                    self._step_clamps += step_hit
        return Checked(out, clamped=n)
