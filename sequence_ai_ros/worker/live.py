"""Which deployments have episodes running, across the ``seq serve`` processes of one ``$SEQ_HOME``.

Each worker serving from a registry keeps ``$SEQ_HOME/run/live-<pid>.json`` = ``{deployment: open episode
streams}`` up to date (:class:`LiveFile`: its ``seq-live`` thread compares every :data:`POLL_S` and rewrites
the file, atomically, only on a change; removed at stop). :func:`running_episodes` reads them all, skipping
files of processes that are gone, so ``seq delete`` can refuse to delete a deployment mid-episode (its
capture would fail to commit, and its robots would not be told why).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

LOG = logging.getLogger(__name__)
#: How often (s) a worker compares its open streams with its live file.
POLL_S = 0.2
RUN_DIR = 'run'


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:   # another user's process: it exists
        return True
    return True


def running_episodes(home: Path) -> dict[str, dict[int, int]]:
    """Return ``{deployment: {worker pid: open episode streams}}`` from the live files under ``home``.

    Files of processes that no longer run are ignored (a worker killed with SIGKILL leaves its file).
    """
    out: dict[str, dict[int, int]] = {}
    for path in sorted((Path(home) / RUN_DIR).glob('live-*.json')):
        try:
            pid = int(path.stem.split('-', 1)[1])
            counts = json.loads(path.read_text())
        except (ValueError, OSError):
            continue
        if not _alive(pid) or not isinstance(counts, dict):
            continue
        for name, n in counts.items():
            if isinstance(n, int) and n > 0:
                out.setdefault(str(name), {})[pid] = n
    return out


class LiveFile:
    """Keep this process's live file under ``home`` in step with ``open_streams``.

    :param home: the ``$SEQ_HOME``.
    :param names: returns the served deployment names (the set may shrink: ``seq delete``).
    :param open_streams: returns the open episode streams of one deployment.
    """

    def __init__(self, home: Path, names: Callable[[], Iterable[str]], open_streams: Callable[[str], int]) -> None:
        self.path = Path(home) / RUN_DIR / f'live-{os.getpid()}.json'
        self._names, self._open_streams = names, open_streams
        self._last: dict[str, int] | None = None
        self._lock = threading.Lock()          # update() runs on seq-live and, at each episode start, on seq-io
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name='seq-live', daemon=True)
        self.update()
        self._thread.start()

    def update(self) -> None:
        """Rewrite the file when the counts changed (a write failure is logged, never raised); any thread.

        The worker calls it before an episode starts, so that ``seq delete`` sees every episode a robot was told
        had started (the poll alone lags by up to :data:`POLL_S`).
        """
        with self._lock:
            self._update()

    def _update(self) -> None:
        counts = {name: self._open_streams(name) for name in sorted(set(self._names()))}
        if counts == self._last:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix='.live-', dir=self.path.parent)
            with os.fdopen(fd, 'w') as f:
                json.dump(counts, f)
            os.replace(tmp, self.path)
            self._last = counts
        except OSError as exc:
            LOG.warning('cannot write %s (seq delete will not see this worker\'s episodes): %s', self.path, exc)

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            self.update()

    def close(self) -> None:
        """Stop and remove the file."""
        self._stop.set()
        self._thread.join(timeout=5.0)
        with contextlib.suppress(OSError):
            self.path.unlink()
