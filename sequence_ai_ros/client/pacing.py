"""Pacing with absolute deadlines, and the one-thread-per-handle rule.

:class:`Pacer` sleeps until ``start + k * period`` (``time.monotonic()``), so a late call shortens the
next wait instead of pushing every later deadline: drift does not accumulate. When a tick overruns by
more than a whole period the schedule skips forward rather than bursting to catch up, and the skipped
deadlines are counted. It is the project's one deadline pacer: act()/run() pace with it, and so does
the policy node's control thread (:class:`sequence_ai_ros.node.tick.TickThread`).
"""

from __future__ import annotations

import math
import threading
import time


class Pacer:
    """Absolute-deadline pacing on the monotonic clock.

    :param period_s: seconds between ticks (> 0).
    :param wake: an Event that ends a wait early (interrupt, episode finished, a thread's stop).
    :param spin: sleep coarse, then spin the last ~1 ms (sharper deadlines for a caller that owns the
        process, as act()/run() do); False sleeps to the deadline in one wait, which leaves the GIL to
        the process's other threads (the policy node's control thread: spinning there cost it 5 Hz of
        its 50 Hz under camera load, test_node_replay).
    :param keep_phase: after an overrun, skip the whole periods missed but stay on the original grid
        (``start + k * period``), so the late tick fires at once and the average rate holds; False
        re-anchors the grid at the late tick (act()/run()).

    ``skipped`` counts the deadlines passed over when a tick would be more than a period late (an
    overrunning tick, or a late wake-up under load: either way the tick fires at once for the latest
    deadline, never one more than a period old, so no two ticks burst). ``ticks`` counts the deadlines
    served (:meth:`first` and every :meth:`wait` that returned for a deadline, not one that ``wake`` ended,
    even as the deadline came: a control thread stopped there runs no tick for it), and :meth:`counts` says up
    to which deadline every one is decided: served, or skipped now or at the next wait. Deadlines are
    counted by index k (``start_s + k * period_s``), never by comparing float times: at a monotonic clock of
    days, ``(deadline - start) / period`` is no longer exactly k. The indices hold on a ``keep_phase`` grid
    (the policy node's control thread); a re-anchor (act()/run()) starts them again at 0.
    """

    def __init__(self, period_s: float, wake: threading.Event | None = None, *, spin: bool = True,
                 keep_phase: bool = False) -> None:
        if not period_s > 0:
            raise ValueError(f'period must be > 0 s, got {period_s!r}')
        self.period_s = float(period_s)
        self._wake = wake
        self._spin = spin
        self._keep_phase = keep_phase
        self._start = time.monotonic()
        self._k = 0
        self.skipped = 0
        self.ticks = 0
        self.served_k = -1                       # index of the latest deadline served (-1: none yet)
        self._lock = threading.Lock()            # a deadline's decision and its count, read as one

    @property
    def start_s(self) -> float:
        """The grid's origin (monotonic s): deadlines are ``start_s + k * period_s`` (until a re-anchor)."""
        return self._start

    def first(self) -> float:
        """Start the grid now and serve its first deadline (k = 0) without waiting; return it (monotonic s)."""
        with self._lock:
            self._start, self._k = time.monotonic(), 0
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
            overdue = self.index_at(time.monotonic() - self.period_s)
            return max(self.served_k, overdue), self.ticks, self.skipped

    def wait(self, until: float | None = None) -> float:
        """Sleep until the next deadline (or ``wake``, or ``until``); return the time it woke for (monotonic s).

        :param until: a hard stop (monotonic s), e.g. the episode's max_seconds: the wait never runs past it,
            whatever the period.
        """
        self._k += 1
        deadline = self._start + self._k * self.period_s
        if until is not None and until < deadline:
            deadline = max(until, time.monotonic())
        # Sleep coarse then spin the last ~1 ms: time.sleep/Event.wait overshoot by up to ~1 ms on Linux.
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            if self._wake is not None and self._wake.is_set():
                return time.monotonic()
            if not self._spin:
                nap = min(left, MAX_NAP_S)           # bounded: Event.wait overflows on huge timeouts
                if self._wake is not None:
                    self._wake.wait(nap)
                else:
                    time.sleep(nap)
            elif left > 0.0015:
                nap = min(left - 0.001, MAX_NAP_S)
                if self._wake is not None:
                    self._wake.wait(nap)
                else:
                    time.sleep(nap)
            else:
                time.sleep(0)
        with self._lock:
            now = time.monotonic()
            late = now - deadline > self.period_s
            if late:                                 # overran, or woke, more than a period late: skip, never burst
                missed = int((now - deadline) // self.period_s)
                self.skipped += missed
                if self._keep_phase:
                    self._k += missed                # the late tick fires now; the next is back on the grid
                else:
                    self._start, self._k = now, 0    # re-anchor the grid at the late tick
                    deadline = now
            if self._wake is not None and self._wake.is_set():
                # woken as the deadline came (a thread's stop): served no more than by a wake before it
                return now
            self.ticks += 1
            self.served_k = self._k
            return now if late else deadline


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
