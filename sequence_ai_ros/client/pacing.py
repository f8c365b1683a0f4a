"""Pacing with absolute deadlines, and the one-thread-per-handle rule.

:class:`Pacer` sleeps until ``start + k * period`` (``time.monotonic()``), so a late call shortens the
next wait instead of pushing every later deadline: drift does not accumulate. The grid is fixed from its
start for good: when a tick overruns, the next tick serves the latest deadline that has come (at once) and
the deadlines passed over before it are skipped and counted, never bunched; the next wait is back on the
grid. So every period from the start is served or skipped, whatever fractions of a period the overruns
took (served + skipped = the periods elapsed, within one). It is the project's one deadline pacer:
act()/run() pace with it, and so does the policy node's control thread
(:class:`sequence_ai_ros.node.tick.TickThread`).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable


class Pacer:
    """Absolute-deadline pacing on the monotonic clock, on one grid from its start.

    :param period_s: seconds between ticks (> 0).
    :param wake: an Event that ends a wait early (interrupt, episode finished, a thread's stop).
    :param spin: sleep coarse, then spin the last ~1 ms (sharper deadlines for a caller that owns the
        process, as act()/run() do); False sleeps to the deadline in one wait, which leaves the GIL to
        the process's other threads (the policy node's control thread: spinning there cost it 5 Hz of
        its 50 Hz under camera load, test_node_replay).
    :param keep_phase: accepted for callers that pass it; every pacer keeps its phase (an overrun never
        moves the grid: re-anchoring it at the late tick lost each overrun's fraction of a period).
    :param clock: the monotonic clock (s); :func:`time.monotonic` unless a test scripts one.
    :param sleep: sleeps the given seconds in place of the wait (a scripted clock's); None sleeps for real,
        on ``wake`` when given. The wait still checks ``wake`` between sleeps.
    :param start_s: the grid's origin (the clock's s, deadline 0), e.g. the episode's start; None: now.

    ``skipped`` counts the deadlines passed over: a tick that comes after the next deadline's own period has
    begun (an overrunning tick, or a late wake-up under load) serves the latest deadline that has come, at
    once, and the ones before it are skipped; no deadline is served more than a period late and no two
    ticks serve one deadline. ``ticks`` counts the deadlines served (:meth:`first` and every :meth:`wait`
    that returned for a deadline, not one that ``wake`` ended, even as the deadline came: a control thread
    stopped there runs no tick for it), and :meth:`counts` says up to which deadline every one is decided:
    served, or skipped now or at the next wait. Deadlines are counted by index k (``start_s + k *
    period_s``), never by comparing float times: at a monotonic clock of days, ``(deadline - start) /
    period`` is no longer exactly k.
    """

    def __init__(self, period_s: float, wake: threading.Event | None = None, *, spin: bool = True,
                 keep_phase: bool = True, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], object] | None = None, start_s: float | None = None) -> None:
        if not period_s > 0:
            raise ValueError(f'period must be > 0 s, got {period_s!r}')
        self.period_s = float(period_s)
        self._wake = wake
        self._spin = spin
        self._clock = clock
        self._sleep = sleep
        self._start = clock() if start_s is None else float(start_s)
        self._k = 0
        self.skipped = 0
        self.ticks = 0
        self.served_k = -1                       # index of the latest deadline served (-1: none yet)
        self._lock = threading.Lock()            # a deadline's decision and its count, read as one

    @property
    def start_s(self) -> float:
        """The grid's origin (monotonic s): deadlines are ``start_s + k * period_s``."""
        return self._start

    def first(self) -> float:
        """Start the grid now and serve its first deadline (k = 0) without waiting; return it (monotonic s)."""
        with self._lock:
            self._start, self._k = self._clock(), 0
            self.ticks += 1
            self.served_k = 0
            return self._start

    def index_at(self, t: float) -> int:
        """Return the index of the last deadline at or before ``t`` (monotonic s); -1 before the first."""
        return max(-1, math.floor((t - self._start) / self.period_s))

    def counts(self) -> tuple[int, int, int]:
        """Return (settled, :attr:`ticks`, :attr:`skipped`), read together under the pacer's lock.

        ``settled`` is the index of the last deadline decided: every deadline up to it was served, or never
        will be (one more than a period old without a tick is skipped at the next wait); later ones may still
        get their tick. -1 before :meth:`first` (or a first wait) served anything.
        """
        with self._lock:
            if self.served_k < 0:
                return -1, self.ticks, self.skipped
            overdue = self.index_at(self._clock() - self.period_s)
            return max(self.served_k, overdue), self.ticks, self.skipped

    def wait(self, until: float | None = None) -> float:
        """Sleep until the next deadline (or ``wake``, or ``until``); return the deadline served (monotonic s).

        When the next deadline's period is already over (the caller overran), it returns at once for the
        latest deadline that has come, and counts the ones before it in :attr:`skipped`. Woken early (or cut
        by ``until``), it returns the time it woke.

        :param until: a hard stop (monotonic s), e.g. the episode's max_seconds: the wait never runs past it,
            whatever the period.
        """
        self._k += 1
        deadline = self._start + self._k * self.period_s
        if until is not None and until < deadline:
            deadline = max(until, self._clock())
        # Sleep coarse then spin the last ~1 ms: time.sleep/Event.wait overshoot by up to ~1 ms on Linux.
        while True:
            left = deadline - self._clock()
            if left <= 0:
                break
            if self._wake is not None and self._wake.is_set():
                return self._clock()
            if not self._spin or self._sleep is not None:
                self._nap(min(left, MAX_NAP_S))      # bounded: Event.wait overflows on huge timeouts
            elif left > 0.0015:
                self._nap(min(left - 0.001, MAX_NAP_S))
            else:
                time.sleep(0)
        with self._lock:
            now = self._clock()
            latest = self.index_at(now)
            if latest > self._k:                     # the next deadline's period is over: skip, never burst
                self.skipped += latest - self._k
                self._k = latest                     # the late tick serves the latest deadline; the next is on the grid
            if self._wake is not None and self._wake.is_set():
                # woken as the deadline came (a thread's stop): served no more than by a wake before it
                return now
            self.ticks += 1
            self.served_k = self._k
            return min(now, self._start + self._k * self.period_s)

    def _nap(self, seconds: float) -> None:
        if self._sleep is not None:
            self._sleep(seconds)
        elif self._wake is not None:
            self._wake.wait(seconds)
        else:
            time.sleep(seconds)


#: Longest single sleep inside :meth:`Pacer.wait` (s); a longer wait loops.
MAX_NAP_S = 1.0


class ThreadGuard:
    """Refuses a second thread on a handle while another thread is inside act/run/next_action.

    :param what: the handle's name, for the message.
    """

    RULE = ('one Policy per control loop: a second thread entered act()/run()/next_action() on the same handle '
            'while {owner!r} is inside it; call sequence_ai_ros.connect() once per control loop')

    def __init__(self, what: str = 'Policy') -> None:
        self._lock = threading.Lock()
        self._owner: threading.Thread | None = None
        self._depth = 0
        self._what = what

    def __enter__(self) -> ThreadGuard:
        me = threading.current_thread()
        with self._lock:
            if self._owner is not None and self._owner is not me:
                raise RuntimeError(f'{self._what}: ' + self.RULE.format(owner=self._owner.name))
            self._owner = me
            self._depth += 1
        return self

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            self._depth -= 1
            if self._depth == 0:
                self._owner = None
