"""The control thread: one call per period on the steady clock, with its jitter measured.

Why a thread of its own, not an rclpy timer: measured on this 2-core machine with two 640x480 rgb8
cameras at 30 Hz and camera callbacks doing ~5 ms of work (``bench_node`` and the notes in
``node/__init__``), a 50 Hz rclpy timer sharing a SingleThreadedExecutor with the camera callbacks had
p99 |dt - 20 ms| = 7.9 ms (it waits behind callbacks), the EventsExecutor 17 ms, the
MultiThreadedExecutor fell to 38 Hz with p99 106 ms; a dedicated thread paced on absolute deadlines
held 50.00 Hz with p99 3.7 ms, bounded by the GIL switch interval, which the node lowers to 1 ms.
The thread never blocks on anything but its own deadline: the callback it runs must not wait on
gRPC or locks held across I/O. The deadlines come from the client's :class:`~sequence_ai_ros.client.pacing.Pacer`
(the project's one deadline pacer), without its final spin: the control thread shares the GIL with
the camera callbacks, and spinning for it cost 5 Hz of 50 under camera load; and on the grid of its
first tick after an overrun (``keep_phase``), so the average rate holds.

The thread asks for SCHED_FIFO at ``priority`` (the node's ``thread_priority``, 50 by default, as
ros2_control's controller_manager and its ``realtime_tools::configure_sched_fifo`` do): on 2 busy cores the
default scheduler woke it up to ~2.5 ms late at p99 (``make bench`` node). A refusal (no CAP_SYS_NICE, no
rtprio limit) leaves it on the default scheduler, with the reason in :attr:`TickThread.scheduling`. The
thread sleeps on its deadline whenever its tick takes less than a period (the node's tick reads buffers
and publishes; it never waits on I/O), so a real-time priority leaves the rest of the process the time
between ticks.
"""

from __future__ import annotations

import collections
import os
import threading
import time
from collections.abc import Callable

import numpy as np

from sequence_ai_ros.client.pacing import Pacer


class TickThread:
    """Call ``fn(now)`` every ``period_s`` seconds on ``time.monotonic()``, in a named thread.

    Deadlines are absolute (``start + k * period``, :class:`~sequence_ai_ros.client.pacing.Pacer`), so a
    late tick does not shift the ones after it; when more than one period late, missed ticks are
    skipped (counted in :attr:`skipped`), never bunched.

    :param period_s: the control period (s).
    :param fn: called with the tick's ``time.monotonic()``; exceptions are passed to ``on_error``.
    :param on_error: called with the exception when ``fn`` raises (the loop goes on).
    :param name: the thread's name.
    :param window: how many recent periods the jitter statistics cover.
    :param priority: SCHED_FIFO priority (1-99) the thread asks for; 0 keeps the default scheduler.
    """

    def __init__(self, period_s: float, fn: Callable[[float], None], *,
                 on_error: Callable[[BaseException], None] | None = None, name: str = 'seq-tick',
                 window: int = 3000, priority: int = 0) -> None:
        self.period_s = float(period_s)
        self.priority = int(priority)
        #: how the thread is scheduled once started: 'SCHED_FIFO 50', 'default', or 'default (why FIFO was refused)'
        self.scheduling = ''
        self._scheduled = threading.Event()
        self._ticking = threading.Event()     # set at the first tick: the grid exists from then on
        self.fn = fn
        self.on_error = on_error
        self._errors: collections.deque[float] = collections.deque(maxlen=window)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._pacer: Pacer | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> str:
        """Start the thread; return how it is scheduled (:attr:`scheduling`), once its first tick started."""
        self._thread.start()
        self._ticking.wait(2.0)
        return self.scheduling

    def stop(self, timeout: float = 2.0) -> None:
        """Ask the thread to stop and join it (bounded by ``timeout`` s)."""
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        """True while the thread runs."""
        return self._thread.is_alive()

    def jitter_ms(self, last: int | None = None) -> tuple[float, float, float]:
        """Return (p50, p99, max) of |dt - period| (ms) over the recent window; zeros before two ticks.

        :param last: only the last this many ticks (None: the whole window).
        """
        with self._lock:
            errors = np.fromiter(self._errors, float) if self._errors else None
        if errors is not None and last:
            errors = errors[-last:]
        if errors is None:
            return 0.0, 0.0, 0.0
        return (float(np.percentile(errors, 50)) * 1e3, float(np.percentile(errors, 99)) * 1e3,
                float(errors.max()) * 1e3)

    @property
    def skipped(self) -> int:
        """Ticks skipped since start because the thread fell more than a period behind."""
        pacer = self._pacer
        return pacer.skipped if pacer is not None else 0

    @property
    def ticks(self) -> int:
        """Ticks run since start (each served one deadline)."""
        pacer = self._pacer
        return pacer.ticks if pacer is not None else 0

    def index_at(self, t: float) -> int:
        """Index of the grid's last deadline at or before ``t`` (monotonic s); -1 before the first tick."""
        pacer = self._pacer
        return pacer.index_at(t) if pacer is not None else -1

    def deadline_s(self, k: int) -> float:
        """Time (monotonic s) of the grid's deadline ``k`` (``start + k * period``)."""
        pacer = self._pacer
        return pacer.start_s + k * self.period_s if pacer is not None else time.monotonic()

    def settled_index(self) -> int:
        """Index of the grid's last deadline decided: it and every one before got its tick or never will.

        Deadlines after it may still get a (late) tick. -1 before the first tick.
        """
        pacer = self._pacer
        return pacer.counts()[0] if pacer is not None else -1

    def current_index(self) -> int:
        """Index of the deadline the latest tick served (in ``fn``: the tick running); -1 before any."""
        pacer = self._pacer
        return pacer.served_k if pacer is not None else -1

    def skipped_now(self) -> int:
        """Deadlines so far that got no tick and never will: :attr:`skipped` plus those more than a period old.

        Never falls (a deadline counted here is not served later), and counts a stall's deadlines while it
        lasts: the pacer counts a skip only at the wait after the late tick, so a thread stopped in a stall (a
        deactivate) would never count it.
        """
        pacer = self._pacer
        if pacer is None:
            return 0
        settled, ticks, _ = pacer.counts()
        return settled + 1 - ticks     # deadlines 0 .. settled that no tick took

    def _set_scheduling(self) -> None:
        if not hasattr(os, 'sched_setscheduler'):
            self.scheduling = 'default'
        elif self.priority <= 0:
            try:   # the default scheduler, also when the creating thread was real-time (threads inherit it)
                os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
            except OSError:
                pass
            self.scheduling = 'default'
        else:
            try:   # pid 0: the calling thread (Linux sched_setscheduler(2))
                os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(self.priority))
                self.scheduling = f'SCHED_FIFO {self.priority}'
            except OSError as exc:
                self.scheduling = f'default (SCHED_FIFO {self.priority} refused: {exc.strerror or exc})'
        self._scheduled.set()

    def _run(self) -> None:
        pacer = Pacer(self.period_s, wake=self._stop, spin=False, keep_phase=True)
        self._set_scheduling()
        period = self.period_s
        last = None
        first = True
        while not self._stop.is_set():
            if first:
                pacer.first()          # the grid starts at the first tick, however late the thread started
                self._pacer = pacer
                self._ticking.set()
            else:
                pacer.wait()
                if self._stop.is_set():
                    break
            first = False
            now = time.monotonic()
            if last is not None:
                with self._lock:
                    self._errors.append(abs(now - last - period))
            last = now
            try:
                self.fn(now)
            except Exception as exc:  # the control loop must survive a bad tick; the error is reported
                if self.on_error is not None:
                    self.on_error(exc)


class ControlThreads:
    """The control thread of each activation, and the ticks skipped over all of them (for /diagnostics).

    One :class:`TickThread` runs while the node is active; each deactivate stops it, and its skipped ticks
    are added to those of the earlier ones. A thread being stopped still counts its skips
    (:meth:`skipped`), so the count never falls while a stop joins it.

    :param period_s: the control period (s).
    :param priority: the SCHED_FIFO priority the threads ask for (0: the default scheduler).
    """

    def __init__(self, period_s: float, priority: int) -> None:
        self.period_s = period_s
        self.priority = priority
        #: the running control thread (None while inactive)
        self.current: TickThread | None = None
        self._stopping: TickThread | None = None   # a control thread being stopped (its skips still count)
        self._skipped_before = 0                   # ticks skipped by control threads of earlier activations
        self._lock = threading.Lock()              # current, _stopping and _skipped_before change together

    def start(self, fn: Callable[[float], None], on_error: Callable[[BaseException], None]) -> TickThread:
        """Start a control thread calling ``fn(now)`` (``seq-tick``); return it, running (see its scheduling)."""
        tick = TickThread(self.period_s, fn, on_error=on_error, name='seq-tick', priority=self.priority)
        with self._lock:
            self.current = tick
        tick.start()
        return tick

    def stop(self) -> bool:
        """Stop the running control thread (joins it, up to 2 s); False when none ran."""
        with self._lock:
            tick, self.current = self.current, None
            self._stopping = tick          # /diagnostics goes on counting its skips while it stops
        if tick is None:
            return False
        tick.stop()
        with self._lock:
            self._skipped_before += tick.skipped_now()
            self._stopping = None
        return True

    def skipped(self) -> tuple[TickThread | None, int]:
        """The running thread (or None) and the ticks skipped so far by every thread (never falls)."""
        with self._lock:
            tick = self.current
            return tick, self._skipped_before + sum(t.skipped_now() for t in (tick, self._stopping) if t is not None)
