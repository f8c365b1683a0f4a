"""SIGINT/SIGTERM -> a stop callback that runs outside the signal handler.

A Python signal handler runs in the main thread between two bytecodes, possibly while that thread holds a
lock, e.g. inside ``threading.Event.wait``/``set`` (its Condition). A handler that calls ``set()`` on the
same Event then waits for that lock forever: a break-it review hung ``bag_player`` with a burst of SIGINTs
(``on_signal -> Event.set -> notify_all -> on_signal -> Event.set``), and only SIGKILL ended it. So the
handler only writes a byte to a pipe (no Python lock, async-signal-safe); a watcher thread, started when
the handlers are installed, reads it and runs the callback once.

After the first signal the process is stopping: later stop signals are ignored (``SIG_IGN``), also while
the interpreter shuts down, where Python would otherwise put the default handlers back and a launch's
SIGINT-then-SIGTERM would kill a process that had stopped cleanly (exit -2/-15 instead of 0). SIGKILL still
ends a stop that hangs.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable, Sequence
from typing import Any

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopSignals:
    """Handlers that run ``callback()`` once, in a thread of its own, on the first of ``signals``.

    Install from the main thread (``signal.signal``'s rule).

    :param callback: what to do on the first signal (set an Event, stop a player); its exceptions are the
        watcher thread's (printed by ``threading.excepthook``).
    :param signals: the signals that stop (default SIGINT, SIGTERM).
    """

    def __init__(self, callback: Callable[[], Any], signals: Sequence[int] = STOP_SIGNALS) -> None:
        self.fired = False          # a stop signal came (the process is stopping)
        self._signals = tuple(signals)
        read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._write_fd, False)

        def watch() -> None:
            try:
                os.read(read_fd, 1)
            except OSError:
                return
            callback()

        threading.Thread(target=watch, name='seq-stop-signals', daemon=True).start()
        self.previous = {sig: signal.signal(sig, self._handler) for sig in self._signals}

    def _handler(self, _signum: int, _frame: object) -> None:
        if self.fired:
            return
        self.fired = True
        for sig in self._signals:         # stopping now: later stop signals would only kill the clean stop
            signal.signal(sig, signal.SIG_IGN)
        try:
            os.write(self._write_fd, b'\0')
        except OSError:       # the pipe is full: the watcher has been told already
            pass

    def restore(self) -> None:
        """Put the previous handlers back, unless a stop signal came (the process is on its way out)."""
        if not self.fired:
            for sig, handler in self.previous.items():
                signal.signal(sig, handler)


def on_stop_signals(callback: Callable[[], Any], signals: Sequence[int] = STOP_SIGNALS) -> StopSignals:
    """Install :class:`StopSignals` for ``callback`` and return it (``restore()`` when done)."""
    return StopSignals(callback, signals)
