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
"""

from __future__ import annotations

import collections
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
    """

    def __init__(self, period_s: float, fn: Callable[[float], None], *,
                 on_error: Callable[[BaseException], None] | None = None, name: str = 'seq-tick',
                 window: int = 3000) -> None:
        self.period_s = float(period_s)
        self.fn = fn
        self.on_error = on_error
        self.ticks = 0
        self._errors: collections.deque[float] = collections.deque(maxlen=window)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._pacer: Pacer | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        """Start the thread."""
        self._thread.start()

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

    def _run(self) -> None:
        pacer = self._pacer = Pacer(self.period_s, wake=self._stop, spin=False, keep_phase=True)
        period = self.period_s
        last = None
        first = True
        while not self._stop.is_set():
            if not first:
                pacer.wait()
                if self._stop.is_set():
                    break
            first = False
            now = time.monotonic()
            if last is not None:
                with self._lock:
                    self._errors.append(abs(now - last - period))
            last = now
            self.ticks += 1
            try:
                self.fn(now)
            except Exception as exc:  # the control loop must survive a bad tick; the error is reported
                if self.on_error is not None:
                    self.on_error(exc)
