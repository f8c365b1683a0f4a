"""Usage metering per deployment, persisted in SQLite under $SEQ_HOME (``usage.sqlite``).

Counted by the serving process: inference seconds (billed), warming seconds (loading; not billed),
sessions (handshakes), episodes and requests. Counts accumulate in memory and are added to the
database by :meth:`UsageMeter.flush` (on episode end, after loading, periodically and at stop), as
``UPDATE ... SET x = x + ?``, so several serving processes may share one $SEQ_HOME. Flushes called together
share writes (group commit): one writes at a time, and a flush that waited for it returns at once when that
write held its counts. Robots ending together then cost a few transactions, not one each, and no flush sleeps
in SQLite's busy wait (128 at once on 8 threads: one waited 184 ms, and held a thread of the worker's small
I/O pool meanwhile).

Never undercounted on a full disk: each meter keeps a small pending record,
``usage-pending/<deployment>.<id>.json`` beside the database, created (its bytes allocated) when the
meter starts and locked (``flock``) while the process lives. When a flush cannot write the database, the
counts not written are overwritten into that record in place (no new blocks are needed, so a full disk
takes it) and fsynced. :func:`read_usage` adds every pending record to the database's counts, and the
next meter of the deployment to start adds the records of processes that are gone into the database.
A crash between a database write and the record's reset may count those counts twice, never zero times.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import logging
import os
import sqlite3
import threading
import uuid
import weakref
from collections.abc import Iterator
from pathlib import Path

LOG = logging.getLogger(__name__)
#: The folder of pending records beside the usage database.
PENDING_DIR = 'usage-pending'
#: Bytes allocated for one pending record (its JSON is padded with spaces to this size).
RECORD_BYTES = 512

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


def _read_record(path: Path) -> Usage | None:
    """The counts of one pending record, None when unreadable."""
    try:
        raw = json.loads(path.read_text(encoding='utf-8') or '{}')
        return Usage(**{f: raw.get(f, 0) for f in FIELDS})
    except (OSError, ValueError, TypeError):
        return None


def _records(path: Path) -> Iterator[tuple[str, Path]]:
    """(deployment, record path) of every pending record beside the database at ``path``."""
    folder = path.parent / PENDING_DIR
    for record in sorted(folder.glob('*.json')) if folder.is_dir() else ():
        parts = record.name.rsplit('.', 2)
        if len(parts) == 3:
            yield parts[0], record


def read_usage(path: str | Path) -> dict[str, Usage]:
    """Return the usage per deployment: the database's counts plus the pending records (never undercounted).

    Empty when neither exists.
    """
    path = Path(path)
    out: dict[str, Usage] = {}
    if path.exists():
        with _connect(path) as conn:
            rows = conn.execute(f'SELECT deployment, {", ".join(FIELDS)} FROM usage ORDER BY deployment').fetchall()
        out = {row[0]: Usage(*row[1:]) for row in rows}
    for deployment, record in _records(path):
        counts = _read_record(record)
        if counts is not None and counts != Usage():
            out.setdefault(deployment, Usage()).add(counts)
    return dict(sorted(out.items()))


def delete_usage(path: str | Path, deployment: str) -> None:
    """Forget a deployment's usage (``seq delete``): its row and its pending records."""
    path = Path(path)
    if path.exists():
        with _connect(path) as conn:
            conn.execute('DELETE FROM usage WHERE deployment = ?', (deployment,))
    for name, record in list(_records(path)):
        if name == deployment:
            record.unlink(missing_ok=True)


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
        self._flushing = threading.Lock()   # one database write at a time (flush)
        self._added = 0                     # additions so far (add() calls, records adopted)
        self._written = 0                   # additions whose counts the database holds
        self.total = Usage()
        self.retired = False
        self._record: Path | None = None   # this process's pending record (module docstring)
        self._fd: int | None = None
        if self.path is not None:
            self._open_record()
            self._adopt_orphans()

    def _open_record(self) -> None:
        """Create, allocate and lock this meter's pending record (best effort: a full disk at start has none)."""
        assert self.path is not None
        record = self.path.parent / PENDING_DIR / f'{self.deployment}.{uuid.uuid4().hex}.json'
        try:
            record.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(record, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        except OSError as exc:
            LOG.warning('usage of %s: no pending record (%s); a failed write is kept in memory only',
                        self.deployment, exc)
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.write(fd, self._record_bytes(Usage()))
            os.fsync(fd)
        except OSError as exc:
            os.close(fd)
            record.unlink(missing_ok=True)
            LOG.warning('usage of %s: no pending record (%s)', self.deployment, exc)
            return
        self._record, self._fd = record, fd
        weakref.finalize(self, os.close, fd)   # the lock goes with the meter (the record stays for adoption)

    def _record_bytes(self, counts: Usage) -> bytes:
        data = json.dumps(dataclasses.asdict(counts)).encode()
        return data + b' ' * max(0, RECORD_BYTES - len(data))

    def _save_record(self, counts: Usage) -> bool:
        """Overwrite the pending record with ``counts`` in place (fsynced); False when there is none or it fails."""
        if self._fd is None:
            return False
        try:
            os.pwrite(self._fd, self._record_bytes(counts), 0)
            os.fsync(self._fd)
            return True
        except OSError as exc:
            LOG.error('usage of %s: pending record %s not written: %s', self.deployment, self._record, exc)
            return False

    def _adopt_orphans(self) -> None:
        """Take over the pending records of this deployment's processes that are gone (their lock is free)."""
        assert self.path is not None
        for deployment, record in _records(self.path):
            if deployment != self.deployment or record == self._record:
                continue
            try:
                fd = os.open(record, os.O_RDWR)
            except OSError:
                continue
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError:
                    continue   # a live process's record
                counts = _read_record(record)
                if counts is None:
                    continue
                if counts != Usage():
                    with self._lock:
                        self._pending.add(counts)
                        self._added += 1            # the next flush writes them
                        keep = dataclasses.replace(self._pending)
                    if not self._save_record(keep):   # not durable in ours yet: leave it where it is
                        with self._lock:
                            for f in FIELDS:
                                setattr(self._pending, f, getattr(self._pending, f) - getattr(counts, f))
                        continue
                record.unlink(missing_ok=True)
            finally:
                os.close(fd)

    def add(self, **counts: float) -> None:
        """Add to the counters, e.g. ``add(inference_s=0.002, requests=1)``."""
        with self._lock:
            for key, value in counts.items():
                setattr(self._pending, key, getattr(self._pending, key) + value)
                setattr(self.total, key, getattr(self.total, key) + value)
            self._added += 1

    def snapshot(self) -> Usage:
        """Return this process's totals since start."""
        with self._lock:
            return dataclasses.replace(self.total)

    def flush(self) -> None:
        """Add the pending counts to the database (no-op without a path or with nothing pending).

        On return, every count added before the call is in the database: written by this call, or by the
        write it waited for (one write at a time; see the module docstring).

        :raises OSError, sqlite3.Error: when the write fails (the counts stay pending and in the pending record).
        """
        if self.path is None or self.retired:
            return
        with self._lock:
            wanted = self._added
        with self._flushing:
            with self._lock:
                # the write this call waited for held its counts, or the deployment was deleted meanwhile
                if self._written >= wanted or self.retired:
                    return
                pending, self._pending = self._pending, Usage()
                upto = self._added
            if pending != Usage():
                self._write(pending)
            with self._lock:
                self._written = max(self._written, upto)

    def _write(self, pending: Usage) -> None:
        """Add ``pending`` to the database in one transaction (under ``_flushing``); on failure keep it pending."""
        assert self.path is not None
        try:
            with _connect(self.path) as conn:
                conn.execute('INSERT OR IGNORE INTO usage (deployment) VALUES (?)', (self.deployment,))
                conn.execute(f'UPDATE usage SET {", ".join(f"{f} = {f} + ?" for f in FIELDS)} WHERE deployment = ?',
                             (*[getattr(pending, f) for f in FIELDS], self.deployment))
        except (OSError, sqlite3.Error):
            with self._lock:   # a full disk loses nothing: the counts wait for the next flush (one transaction)
                self._pending.add(pending)
                unwritten = dataclasses.replace(self._pending)
            self._save_record(unwritten)   # and survive this process in its pending record
            raise
        self._save_record(Usage())   # written: the record holds nothing any more

    def retire(self) -> None:
        """Stop writing (the deployment was deleted): a later flush must not re-create its row or record."""
        self.retired = True
        if self._record is not None:
            self._save_record(Usage())
            self._record.unlink(missing_ok=True)
