"""Child processes of the demo: started in their own process group, always stopped.

Every child is stopped on exit, on an exception and on Ctrl-C (SIGINT/SIGTERM): SIGINT first, so that
``policy_node`` publishes its last hold and ``seq serve`` stops gracefully, then SIGKILL after a grace
period. Nothing is left running and every port is freed.
"""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import threading
import time
from collections.abc import Sequence
from pathlib import Path


class Child:
    """One child process whose combined output is logged to a file and scanned line by line."""

    def __init__(self, name: str, argv: Sequence[str], log_dir: Path, env: dict[str, str]) -> None:
        self.name = name
        self.log_path = log_dir / f'{name}.log'
        self._log = self.log_path.open('w')
        self._lines: queue.Queue[str] = queue.Queue()
        self.proc = subprocess.Popen(list(argv), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=env, start_new_session=True, bufsize=1)
        self._reader = threading.Thread(target=self._read, name=f'demo-log-{name}', daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._log.write(line)
            self._log.flush()
            self._lines.put(line)

    def wait_for(self, pattern: str, timeout: float) -> re.Match:
        """Block until a line of output matches ``pattern``; return the match.

        :raises RuntimeError: when the process exits first or ``timeout`` (s) passes; the message
            names the log file.
        """
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self._lines.get(timeout=0.1)
            except queue.Empty:
                if self.proc.poll() is not None:
                    raise RuntimeError(f'{self.name} exited with {self.proc.returncode}; see {self.log_path}') from None
                continue
            m = rx.search(line)
            if m:
                return m
        raise RuntimeError(f'{self.name}: no line matching {pattern!r} within {timeout:.0f}s; see {self.log_path}')

    def stop(self, grace: float = 5.0) -> int | None:
        """SIGINT the process group, then SIGKILL after ``grace`` seconds; return the exit code."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGINT)
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=5)
            except ProcessLookupError:
                pass
        self._reader.join(2.0)
        self._log.close()
        return self.proc.returncode


class Processes:
    """The demo's children, stopped in reverse start order by :meth:`close`."""

    def __init__(self, log_dir: Path, env: dict[str, str]) -> None:
        self.log_dir = log_dir
        self.env = env
        self.children: list[Child] = []

    def start(self, name: str, argv: Sequence[str]) -> Child:
        """Start ``argv`` as child ``name`` (log in ``log_dir/name.log``)."""
        child = Child(name, argv, self.log_dir, self.env)
        self.children.append(child)
        return child

    def run(self, name: str, argv: Sequence[str], timeout: float) -> str:
        """Run ``argv`` to completion; return its output.

        :raises RuntimeError: on a non-zero exit or a timeout, naming the log file.
        """
        log = self.log_dir / f'{name}.log'
        try:
            done = subprocess.run(list(argv), capture_output=True, text=True, env=self.env, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f'{name} took more than {timeout:.0f}s') from None
        log.write_text(done.stdout + done.stderr)
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()[-5:]
            raise RuntimeError(f'{name} failed ({done.returncode}): ' + ' | '.join(tail) + f'; see {log}')
        return done.stdout

    def close(self) -> None:
        """Stop every child, last started first."""
        for child in reversed(self.children):
            child.stop()
        self.children.clear()
