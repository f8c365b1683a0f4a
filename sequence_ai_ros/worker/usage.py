"""Usage metering per deployment, persisted in SQLite under $SEQ_HOME (``usage.sqlite``).

Counted by the serving process: inference seconds (billed), warming seconds (loading; not billed),
sessions (handshakes), episodes and requests. Counts accumulate in memory and are added to the
database by :meth:`UsageMeter.flush` (on episode end, after loading, periodically and at stop), as
``UPDATE ... SET x = x + ?``, so several serving processes may share one $SEQ_HOME.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path

FIELDS = ('inference_s', 'warming_s', 'sessions', 'episodes', 'requests')
_SCHEMA = ('CREATE TABLE IF NOT EXISTS usage (deployment TEXT PRIMARY KEY, inference_s REAL NOT NULL DEFAULT 0, '
           'warming_s REAL NOT NULL DEFAULT 0, sessions INTEGER NOT NULL DEFAULT 0, '
           'episodes INTEGER NOT NULL DEFAULT 0, requests INTEGER NOT NULL DEFAULT 0)')


@dataclasses.dataclass
class Usage:
    """One deployment's usage.

    :param inference_s: seconds spent inside the policy's infer (billed), s.
    :param warming_s: seconds spent constructing and loading (not billed), s.
    :param sessions: handshakes.
    :param episodes: episodes started.
    :param requests: observation requests answered with a chunk.
    """

    inference_s: float = 0.0
    warming_s: float = 0.0
    sessions: int = 0
    episodes: int = 0
    requests: int = 0

    def add(self, other: Usage) -> None:
        """Add ``other`` field by field."""
        for f in FIELDS:
            setattr(self, f, getattr(self, f) + getattr(other, f))


@contextlib.contextmanager
def _connect(path: Path) -> Iterator[sqlite3.Connection]:
    path.parent.mkdir(parents=True, exist_ok=True)
    conn = sqlite3.connect(str(path), timeout=10.0)
    try:
        with conn:  # one transaction, committed on success
            conn.execute(_SCHEMA)
            yield conn
    finally:
        conn.close()


def read_usage(path: str | Path) -> dict[str, Usage]:
    """Return the stored usage per deployment (empty when the database does not exist)."""
    path = Path(path)
    if not path.exists():
        return {}
    with _connect(path) as conn:
        rows = conn.execute(f'SELECT deployment, {", ".join(FIELDS)} FROM usage ORDER BY deployment').fetchall()
    return {row[0]: Usage(*row[1:]) for row in rows}


def delete_usage(path: str | Path, deployment: str) -> None:
    """Forget a deployment's usage (``seq delete``)."""
    path = Path(path)
    if path.exists():
        with _connect(path) as conn:
            conn.execute('DELETE FROM usage WHERE deployment = ?', (deployment,))


class UsageMeter:
    """In-memory counters of one deployment, flushed into the database (or kept only in memory).

    :param deployment: the deployment name.
    :param path: the SQLite file, or None to keep usage in memory only (tests, ad-hoc serving).
    """

    def __init__(self, deployment: str, path: str | Path | None) -> None:
        self.deployment = deployment
        self.path = Path(path) if path is not None else None
        self._lock = threading.Lock()
        self._pending = Usage()
        self.total = Usage()
        self.retired = False

    def add(self, **counts: float) -> None:
        """Add to the counters, e.g. ``add(inference_s=0.002, requests=1)``."""
        with self._lock:
            for key, value in counts.items():
                setattr(self._pending, key, getattr(self._pending, key) + value)
                setattr(self.total, key, getattr(self.total, key) + value)

    def snapshot(self) -> Usage:
        """Return this process's totals since start."""
        with self._lock:
            return dataclasses.replace(self.total)

    def flush(self) -> None:
        """Add the pending counts to the database (no-op without a path or with nothing pending)."""
        with self._lock:
            pending, self._pending = self._pending, Usage()
        if self.path is None or pending == Usage() or self.retired:
            return
        try:
            with _connect(self.path) as conn:
                conn.execute('INSERT OR IGNORE INTO usage (deployment) VALUES (?)', (self.deployment,))
                conn.execute(f'UPDATE usage SET {", ".join(f"{f} = {f} + ?" for f in FIELDS)} WHERE deployment = ?',
                             (*[getattr(pending, f) for f in FIELDS], self.deployment))
        except (OSError, sqlite3.Error):
            with self._lock:   # a full disk loses nothing: the counts wait for the next flush (one transaction)
                self._pending.add(pending)
            raise

    def retire(self) -> None:
        """Stop writing (the deployment was deleted): a later flush must not re-create its row."""
        self.retired = True
