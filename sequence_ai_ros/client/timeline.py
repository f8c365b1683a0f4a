"""Where each tick of an episode sits: the control deadline it serves and the chunk steps it covers.

Two axes meet here (see :mod:`sequence_ai_ros.protocol.timeline` for the fields on the wire):

- the **control grid**: deadline ``g`` of the caller's period, counted from the episode's first tick
  (:meth:`Timeline.place`); deadlines no tick served (a callback or loop that overran) are skipped;
- the **chunk-step axis** the records' spans ``[step_start, step_end)`` lie on, which the export reads rows
  off (a row per chunk step when exporting at the policy's rate).

By step (act/run pacing, and every delta or velocity space) a fresh tick's span is exactly the chunk steps
it executed: the executed count where it began, plus a whole number of steps (:attr:`Timeline.offset`).
Time that executed nothing (a hold, a skipped deadline, the part of a tick past the end of a chunk that ran
out) is owed as held time (:attr:`Timeline.debt`) and paid as whole held steps (rounded up) before the next
fresh tick that begins on a step boundary (a skipped deadline mid-step is paid once the step that was
running is done), or after held records at the next fresh tick (in delta and velocity spaces a chunk always
runs out on a step boundary; an absolute chunk starts where its observation was taken). So a fractional
skip or a short dry spell becomes held rows on the policy's own step grid and never shifts the rows after
it: every row is one whole step the policy's chunks gave (delta spaces: one chunk row), or a held row. On
the clock (absolute spaces driven by ``next_action`` without act/run pacing) the chunk moves with time, and
so do the spans.
"""

from __future__ import annotations

import math
from typing import Any

from sequence_ai_ros.client.settings import EpisodeSettings
from sequence_ai_ros.client.steps import Step

#: A tick without a given grid index may come this share of a period before its deadline and still serve it.
GRID_EARLY = 0.05
#: Without a fixed control_period, a tick this many measured periods after the previous one missed deadlines.
UNPACED_STALL = 2.5
#: Float slack on the chunk-step axis (steps): spans are sums of periods in dt units.
SLACK = 1e-6


class Timeline:
    """One episode's control grid and the spans of its ticks (no I/O, no clock of its own).

    :param settings: the episode's settings (``control_period``: a fixed period in s, or None to measure it).
    :param dt: the policy's step (s).
    :param by_step: spans follow the executed chunk steps (see the module docstring), else the clock.
    """

    def __init__(self, settings: EpisodeSettings, dt: float, by_step: bool) -> None:
        self.fixed_period = settings.control_period
        self.dt = dt
        self.by_step = by_step
        #: the control period (s): the fixed one, else a running estimate of the caller's
        self.period = settings.control_period or dt
        self._last_tick: float | None = None
        self._first: int | None = None          # the caller's own index of the first deadline
        #: the deadline the latest tick serves, counted from the first (None before any tick)
        self.grid: int | None = None
        self._grid_t = self._t0 = 0.0
        self._start = self._len = 0.0
        #: by step: whole chunk steps added to the executed count to place a fresh tick (held time paid)
        self.offset = 0
        #: by step: chunk steps of time since the last fresh span that executed nothing (held, skipped, dry)
        self.debt = 0.0
        self._held = False          # by step: a held record was placed since the last fresh one

    def steps_per_tick(self) -> float:
        """The control period in chunk steps."""
        return self.period / self.dt

    def place(self, now: float, given: int | None) -> int:
        """Put a tick at ``now`` (s) on the grid; return the number of deadlines it skipped.

        :param given: the caller's index of the deadline (any origin, +1 per deadline), or None to estimate it:
            with a fixed period, the period holding ``now`` (a tick may come :data:`GRID_EARLY` early);
            without, one deadline per call unless a tick comes over :data:`UNPACED_STALL` periods late.
        """
        if given is not None:
            if self._first is None:
                self._first = int(given)
            g = int(given) - self._first
        elif self.grid is None:
            g = 0
        elif self.fixed_period:
            g = int(math.floor((now - self._t0) / self.fixed_period + GRID_EARLY))
        else:
            gap = (now - self._grid_t) / self.period
            g = self.grid + (int(math.floor(gap + 0.5)) if gap > UNPACED_STALL else 1)
        missed = 0
        if self.grid is None:
            g = max(0, g)
            self._t0 = now
            self._start = g * self.steps_per_tick()
        else:
            g = max(g, self.grid + 1)
            missed = g - self.grid - 1
            if self.by_step:
                self.debt += missed * self._len          # the deadlines a stall missed executed nothing
            elif self.fixed_period:
                self._start = g * self.steps_per_tick()
            else:
                self._start = max(self._start, (now - self._t0) / self.dt)
        self.grid, self._grid_t = g, now
        self._len = self.steps_per_tick()
        return missed

    def since_s(self, now: float) -> float:
        """Seconds (>= 0) from when the executed count was last current to ``now`` (a late paced tick's lateness).

        By step with a fixed period, from the latest tick's deadline (a tick that runs late still executes its
        deadline's step, so the rows ahead are due on the grid, not from when it ran); otherwise (on the clock,
        where a tick counts the time up to when it runs) from the latest tick, 0 at the tick itself. 0 before
        any tick.
        """
        if self.grid is None:
            return 0.0
        if self.by_step and self.fixed_period:
            return max(0.0, now - (self._t0 + self.grid * self.fixed_period))
        return max(0.0, now - self._grid_t)

    def measure(self, now: float) -> None:
        """Without a fixed period, fold the time since the previous tick into the period's estimate."""
        if self._last_tick is not None and self.fixed_period is None and now > self._last_tick:
            self.period = 0.8 * self.period + 0.2 * (now - self._last_tick)
        self._last_tick = now

    def span(self, executed: float, ran: float | None, wanted: float | None = None) -> tuple[float, float]:
        """The span of the tick just placed, on the chunk-step axis.

        :param executed: chunk steps executed before this tick's action.
        :param ran: chunk steps its fresh action covers, or None when it held.
        :param wanted: the chunk steps it would have covered (by step: its part past the end of a chunk that
            ran out is owed as held time); None: ``ran``.
        """
        if not self.by_step:
            start = self._start
            end = start + (self._len if ran is None else min(self._len, ran))
        elif ran is None:
            start = executed + self.offset + self.debt
            end = start + self._len
            self.debt += self._len
            self._held = True
        else:
            if self.debt > SLACK and (self._held or abs(executed - round(executed)) < SLACK):
                # paid at a step boundary, so a step the robot was executing when the time was lost stays in one
                # row (a tick after a skipped deadline mid-step goes on from where it was); after held records
                # at once, past their spans (an absolute chunk may run out between step boundaries)
                self.offset += math.ceil(self.debt - SLACK)
                self.debt = 0.0
            self._held = False
            start = executed + self.offset
            end = start + ran
            short = (ran if wanted is None else wanted) - ran
            if short > SLACK:
                self.debt += short
        return start, end

    def step(self, **fields: Any) -> Step:
        """A :class:`Step` at the latest tick's grid index (``fields``: the rest of Step's)."""
        return Step(grid_index=self.grid or 0, **fields)


__all__ = ['GRID_EARLY', 'SLACK', 'UNPACED_STALL', 'Timeline']
