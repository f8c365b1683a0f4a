"""A deployment process's stdout and stderr, relayed into the worker's log: line by line, cut, and bounded.

The worker starts each deployment process with its stdout and stderr on pipes
(:class:`~sequence_ai_ros.worker.policy_process.PolicyProcess`); one :class:`OutputRelay` thread per pipe reads
it and logs each line through the ``sequence_ai_ros.worker.policy_output`` logger at INFO, as
``policy NAME stdout: LINE`` (fields ``deployment``, ``stream``, ``pid``), so a policy's prints and tracebacks land
in the worker's log format (:mod:`~sequence_ai_ros.worker.logs`), never past it:

- a line longer than :data:`MAX_LINE_BYTES` is cut there, and says how many bytes were cut;
- a deployment process's lines and bytes are metered by one :class:`OutputBudget` (both pipes together): a
  burst of :data:`BURST_LINES` lines / :data:`BURST_BYTES` bytes, refilled at :data:`LINES_PER_S` /
  :data:`BYTES_PER_S`. What does not fit is dropped and counted; the next line let through (or the pipe's end)
  is preceded by a warning saying how many lines and bytes were left out.

The pipe is always drained (a policy never blocks on a full pipe). Where no logging is configured (``seq deploy``)
the lines go to this process's stderr instead, as bounded. Programs the policy starts inherit the pipes, so they
never write into (or hold open) the stdout of ``seq deploy`` or of the worker.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable

LOG = logging.getLogger(__name__)
#: Longest line logged (bytes); the rest of a longer one is cut and counted.
MAX_LINE_BYTES = 2000
#: Lines a deployment process may log at once, and per second after that (both pipes together).
BURST_LINES = 2000
LINES_PER_S = 50.0
#: Bytes (of cut lines) a deployment process may log at once, and per second after that.
BURST_BYTES = 1 << 20
BYTES_PER_S = 64.0 * 1024
#: Bytes read from a pipe at a time.
READ_BYTES = 1 << 16


class OutputBudget:
    """What one deployment process's output may still put in the log: lines and bytes, refilled over time.

    Thread-safe (both pipes' relays share one). Counts what it refused until :meth:`take_dropped`.

    :param clock: a monotonic clock (s), for tests.
    """

    def __init__(self, burst_lines: int = BURST_LINES, lines_per_s: float = LINES_PER_S,
                 burst_bytes: int = BURST_BYTES, bytes_per_s: float = BYTES_PER_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._lock = threading.Lock()
        self._clock = clock
        self._rates = (float(burst_lines), lines_per_s, float(burst_bytes), bytes_per_s)
        self._lines = float(burst_lines)
        self._bytes = float(burst_bytes)
        self._at = clock()
        self._dropped_lines = 0
        self._dropped_bytes = 0
        #: lines and bytes refused since start
        self.dropped_total = 0

    def take(self, nbytes: int) -> bool:
        """True when a line of ``nbytes`` bytes may be logged now (and spend it); else count it as dropped."""
        burst_lines, lines_per_s, burst_bytes, bytes_per_s = self._rates
        with self._lock:
            now = self._clock()
            spent, self._at = now - self._at, now
            self._lines = min(burst_lines, self._lines + spent * lines_per_s)
            self._bytes = min(burst_bytes, self._bytes + spent * bytes_per_s)
            if self._lines >= 1 and self._bytes >= nbytes:
                self._lines -= 1
                self._bytes -= nbytes
                return True
            self._dropped_lines += 1
            self._dropped_bytes += nbytes
            self.dropped_total += 1
            return False

    def take_dropped(self) -> tuple[int, int]:
        """The lines and bytes refused since the last call (then zero)."""
        with self._lock:
            out = (self._dropped_lines, self._dropped_bytes)
            self._dropped_lines = self._dropped_bytes = 0
            return out


class OutputRelay:
    """Read one pipe of a deployment process in a daemon thread until its end; log its lines, bounded.

    :param fd: the pipe's read end (owned: closed at the end).
    :param name: the deployment.
    :param stream: ``stdout`` or ``stderr``.
    :param pid: the deployment process's pid (a field of each line).
    :param budget: the deployment process's :class:`OutputBudget`, shared by its pipes.
    """

    def __init__(self, fd: int, name: str, stream: str, pid: int, budget: OutputBudget) -> None:
        self.name = name
        self.stream = stream
        self.pid = pid
        self.budget = budget
        self._fd = fd
        self._line = bytearray()
        self._cut = 0              # bytes of the current line past MAX_LINE_BYTES
        #: lines read (logged or not)
        self.lines = 0
        self.thread = threading.Thread(target=self._run, name=f'seq-out-{name}-{stream}', daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            while True:
                try:
                    data = os.read(self._fd, READ_BYTES)
                except InterruptedError:
                    continue
                except OSError:
                    break
                if not data:
                    break
                self._feed(data)
            if self._line or self._cut:
                self._emit()
            self._say_dropped()
        finally:
            os.close(self._fd)

    def _feed(self, data: bytes) -> None:
        start = 0
        while start < len(data):
            end = data.find(b'\n', start)
            piece = data[start:] if end < 0 else data[start:end]
            room = MAX_LINE_BYTES - len(self._line)
            self._line += piece[:max(0, room)]
            self._cut += max(0, len(piece) - max(0, room))
            if end < 0:
                return
            self._emit()
            start = end + 1

    def _emit(self) -> None:
        line, cut = bytes(self._line), self._cut
        self._line.clear()
        self._cut = 0
        self.lines += 1
        if not self.budget.take(len(line)):
            return
        self._say_dropped()
        text = line.decode('utf-8', 'replace').rstrip('\r')
        if cut:
            text += f' ... ({cut} more bytes cut)'
        fields = {'deployment': self.name, 'stream': self.stream, 'pid': self.pid}
        if logging.getLogger().hasHandlers():
            LOG.info('policy %s %s: %s', self.name, self.stream, text, extra={'fields': fields})
        else:        # no log configured (seq deploy): this process's stderr, as bounded
            _write_stderr(f'policy {self.name} {self.stream}: {text}\n')

    def _say_dropped(self) -> None:
        lines, nbytes = self.budget.take_dropped()
        if not lines:
            return
        words = (f'{lines} line(s) ({nbytes} bytes) of the output of its deployment process (pid {self.pid}) were '
                 f'left out of the log: over {LINES_PER_S:g} lines or {BYTES_PER_S / 1024:g} KiB per second')
        if logging.getLogger().hasHandlers():
            LOG.warning('policy %s: %s', self.name, words,
                        extra={'fields': {'deployment': self.name, 'dropped_lines': lines, 'dropped_bytes': nbytes}})
        else:
            _write_stderr(f'policy {self.name}: {words}\n')

    def join(self, timeout: float) -> None:
        """Wait up to ``timeout`` s for the pipe's end (every writer gone) and its last lines."""
        self.thread.join(timeout)


def _write_stderr(text: str) -> None:
    try:
        sys.stderr.write(text)
        sys.stderr.flush()
    except (OSError, ValueError):      # stderr closed
        pass
