"""The capture store's index: one SQLite database (stdlib ``sqlite3``, WAL journal) per deployment.

It holds what is cheap to query: the committed episodes (with counts and bytes), every sampling decision,
every episode the worker ran (``runs``: version, times, how it ended, underruns, latency p95, captured or
not; the scoreboard of ``seq policy stats``), the owner of every episode it started (the caller's identity,
:mod:`sequence_ai_ros.worker.identity`: its labels are accepted from that identity only), and the labels (of any
episode the worker saw, and, for fleet failover, of episodes it did not see, each with the identity that gave
it). The episode data
itself lives in files (see :mod:`sequence_ai_ros.capture.store`), and each committed episode directory
carries its own ``episode.json`` and ``label.json``, so the index can always be rebuilt from the files
(:meth:`CaptureStore.repair`): a corrupted index never loses a kept episode.

Each store object keeps one connection (serialised by a lock; used a few times per episode, never per
request); other processes (``seq policy capture NAME``, exports) open their own, as WAL allows.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

INDEX_FILE = 'store.db'

SCHEMA = """
CREATE TABLE IF NOT EXISTS episodes(
    episode_id TEXT PRIMARY KEY,
    dir TEXT NOT NULL,
    instruction TEXT NOT NULL DEFAULT '',
    started_at REAL NOT NULL,
    ended_at REAL NOT NULL,
    reason TEXT NOT NULL,
    requests INTEGER NOT NULL,
    frames INTEGER NOT NULL,
    bytes INTEGER NOT NULL,
    images INTEGER NOT NULL,
    fps REAL NOT NULL,
    stats TEXT NOT NULL DEFAULT '{}'
);
CREATE INDEX IF NOT EXISTS episodes_ended ON episodes(ended_at);
CREATE TABLE IF NOT EXISTS decisions(
    episode_id TEXT PRIMARY KEY,
    decided_at REAL NOT NULL,
    captured INTEGER NOT NULL,
    why TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS runs(
    episode_id TEXT PRIMARY KEY,
    version INTEGER NOT NULL DEFAULT 0,
    started_at REAL NOT NULL,
    ended_at REAL NOT NULL,
    reason TEXT NOT NULL,
    actions INTEGER NOT NULL DEFAULT 0,
    underruns INTEGER NOT NULL DEFAULT 0,
    latency_p95_ms REAL NOT NULL DEFAULT 0,
    captured INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS runs_started ON runs(started_at);
CREATE TABLE IF NOT EXISTS labels(
    episode_id TEXT PRIMARY KEY,
    success INTEGER NOT NULL,
    notes TEXT NOT NULL DEFAULT '',
    labelled_at REAL NOT NULL,
    owner TEXT NOT NULL DEFAULT ''
);
CREATE TABLE IF NOT EXISTS owners(
    episode_id TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    since REAL NOT NULL
);
"""
#: Created after :data:`SCHEMA` and the migration of an older store's ``labels`` (which had no ``owner``).
OWNER_INDEX = 'CREATE INDEX IF NOT EXISTS labels_owner ON labels(owner)'
#: Tables whose rows mean the store saw an episode (ran it, started it, decided on its capture, or holds it).
SEEN_TABLES = ('runs', 'decisions', 'episodes', 'owners')
#: :meth:`Index.label`'s verdicts: stored for an episode the store saw, stored for one it never saw, refused
#: because another identity owns the episode, refused because the labeller holds too many labels of unseen ones.
SEEN, UNSEEN, NOT_OWNER, OVER_BOUND = 'seen', 'unseen', 'not_owner', 'over_bound'

RUN_COLUMNS = ('episode_id', 'version', 'started_at', 'ended_at', 'reason', 'actions', 'underruns',
               'latency_p95_ms', 'captured')
EPISODE_COLUMNS = ('episode_id', 'dir', 'instruction', 'started_at', 'ended_at', 'reason', 'requests',
                   'frames', 'bytes', 'images', 'fps', 'stats')


class Index:
    """The SQLite index at ``root/store.db``.

    Every method may raise ``sqlite3.DatabaseError`` (corruption) or ``sqlite3.OperationalError``
    (disk full, locked); the store turns those into a paused capture with a diagnostic.
    """

    def __init__(self, root: Path, read_only: bool = False) -> None:
        self.path = Path(root) / INDEX_FILE
        self.read_only = read_only
        self._lock = threading.RLock()
        self._conn: sqlite3.Connection | None = None

    def _connect_read_only(self) -> sqlite3.Connection:
        """A connection that writes nothing: SQLite's ``mode=ro``, and ``immutable`` when no WAL is live.

        ``mode=ro`` on a WAL database still creates its ``-wal`` and ``-shm`` files when they are missing;
        with no ``-wal`` there is no writer (a worker keeps it while it has the index open), so the file is
        opened immutable and nothing is created. With a live writer its existing ``-shm`` (shared memory,
        no data) is used as SQLite's readers do.
        """
        wal = self.path.with_name(self.path.name + '-wal')
        mode = 'mode=ro' if wal.exists() else 'mode=ro&immutable=1'
        if not self.path.is_file():
            raise sqlite3.OperationalError(f'no index {self.path}')
        return sqlite3.connect(f'file:{self.path}?{mode}', uri=True, timeout=10.0, isolation_level=None,
                               check_same_thread=False)

    @contextlib.contextmanager
    def connect(self) -> Iterator[sqlite3.Connection]:
        """Yield the store's connection in one transaction (committed on success, rolled back on error).

        One connection per store object, kept open (closing the last connection of a WAL database
        checkpoints it, which would cost an fsync per call) and serialised by a lock; it is dropped after
        any error so that the next call reopens the file.
        """
        if self.read_only:   # one short connection per call: never held across an export
            with self._lock:
                wal = self.path.with_name(self.path.name + '-wal')
                immutable = not wal.exists()
                conn = self._connect_read_only()
                try:
                    conn.execute('BEGIN')
                    yield conn
                    conn.execute('COMMIT')
                except sqlite3.DatabaseError as exc:
                    if immutable and wal.exists():   # a worker opened it meanwhile: not a corrupt index
                        raise sqlite3.OperationalError(f'the index changed while it was read (a worker opened '
                                                       f'it): read it again ({exc})') from None
                    raise
                finally:
                    conn.close()
            return
        with self._lock:
            if self._conn is None:
                self._conn = sqlite3.connect(self.path, timeout=10.0, isolation_level=None, check_same_thread=False)
                self._conn.execute('PRAGMA synchronous=NORMAL')  # WAL (set once by create()): durable at checkpoints
            conn = self._conn
            try:
                conn.execute('BEGIN IMMEDIATE')
                try:
                    yield conn
                except BaseException:
                    conn.execute('ROLLBACK')
                    raise
                conn.execute('COMMIT')
            except sqlite3.Error:
                self.close()
                raise

    def close(self) -> None:
        """Close the connection (the next call reopens it)."""
        with self._lock:
            if self._conn is not None:
                try:
                    self._conn.close()
                except sqlite3.Error:
                    pass
                self._conn = None

    def checkpoint(self) -> None:
        """Move the WAL's content into the database file (once per committed episode or label)."""
        with self._lock:
            if self._conn is not None:
                try:
                    self._conn.execute('PRAGMA wal_checkpoint(TRUNCATE)').fetchall()
                except sqlite3.Error:
                    self.close()
                    raise

    def check(self) -> None:
        """Check a read-only index (``PRAGMA quick_check``), writing nothing.

        :raises sqlite3.DatabaseError: on corruption or a file that is not a database.
        """
        with self.connect() as conn:
            problems = [r[0] for r in conn.execute('PRAGMA quick_check').fetchall()]
            if problems != ['ok']:
                raise sqlite3.DatabaseError(f'quick_check: {"; ".join(problems[:3])}')
            conn.execute('SELECT COUNT(*) FROM episodes').fetchone()

    def create(self) -> None:
        """Create the tables when missing; check the file first (``PRAGMA quick_check``; raises on corruption)."""
        if self.read_only:
            raise sqlite3.OperationalError(f'index {self.path} is opened read-only')
        self.close()
        conn = sqlite3.connect(self.path, timeout=10.0, isolation_level=None)
        try:
            conn.execute('PRAGMA journal_mode=WAL')
            problems = [r[0] for r in conn.execute('PRAGMA quick_check').fetchall()]
            if problems != ['ok']:
                raise sqlite3.DatabaseError(f'quick_check: {"; ".join(problems[:3])}')
            conn.executescript(SCHEMA)
            if 'owner' not in _columns(conn, 'labels'):   # a store written before labels had owners
                conn.execute("ALTER TABLE labels ADD COLUMN owner TEXT NOT NULL DEFAULT ''")
            conn.execute(OWNER_INDEX)
            conn.execute('SELECT COUNT(*), COALESCE(SUM(bytes), 0) FROM episodes').fetchone()
        finally:
            conn.close()

    def add_episode(self, row: dict[str, Any], label: dict[str, Any] | None = None) -> None:
        """Insert (or replace) a committed episode, and its label when given, in one transaction."""
        values = [row[c] if c != 'stats' else json.dumps(row[c]) for c in EPISODE_COLUMNS]
        with self.connect() as conn:
            conn.execute(f'INSERT OR REPLACE INTO episodes({",".join(EPISODE_COLUMNS)}) '
                         f'VALUES ({",".join("?" * len(EPISODE_COLUMNS))})', values)
            if label is not None:
                conn.execute('INSERT OR REPLACE INTO labels(episode_id, success, notes, labelled_at, owner) '
                             'VALUES (?, ?, ?, ?, ?)',
                             (row['episode_id'], int(bool(label['success'])), label.get('notes', ''),
                              float(label.get('labelled_at', row['ended_at'])), str(label.get('owner') or '')))

    def decide(self, episode_id: str, when: float, captured: bool, why: str) -> bool:
        """Record the sampling decision for an episode; return False (recording nothing) if it was committed."""
        with self.connect() as conn:
            if conn.execute('SELECT 1 FROM episodes WHERE episode_id=?', (episode_id,)).fetchone():
                return False
            conn.execute('INSERT OR REPLACE INTO decisions VALUES (?, ?, ?, ?)',
                         (episode_id, when, int(captured), why))
        return True

    def decision(self, episode_id: str) -> tuple[bool, str] | None:
        """Return (captured, why) for an episode, or None if it was never seen."""
        with self.connect() as conn:
            row = conn.execute('SELECT captured, why FROM decisions WHERE episode_id=?', (episode_id,)).fetchone()
        return None if row is None else (bool(row[0]), str(row[1]))

    def episode(self, episode_id: str) -> dict[str, Any] | None:
        """Return one committed episode's row (with its label), or None."""
        rows = self.episodes(where='e.episode_id=?', args=(episode_id,))
        return rows[0] if rows else None

    def episodes(self, where: str = '1', args: tuple = ()) -> list[dict[str, Any]]:
        """Return committed episodes (oldest start first), each with ``label`` (dict or None)."""
        cols = ','.join(f'e.{c}' for c in EPISODE_COLUMNS)
        with self.connect() as conn:
            rows = conn.execute(f'SELECT {cols}, l.success, l.notes, l.labelled_at FROM episodes e '
                                f'LEFT JOIN labels l ON l.episode_id = e.episode_id WHERE {where} '
                                f'ORDER BY e.started_at, e.episode_id', args).fetchall()
        out = []
        for r in rows:
            d = dict(zip(EPISODE_COLUMNS, r[:len(EPISODE_COLUMNS)], strict=True))
            d['stats'] = json.loads(d['stats'] or '{}')
            d['images'] = bool(d['images'])
            success, notes, at = r[len(EPISODE_COLUMNS):]
            d['label'] = None if success is None else {'success': bool(success), 'notes': notes, 'labelled_at': at}
            out.append(d)
        return out

    def label(self, episode_id: str, success: bool, notes: str, when: float, owner: str = '',
              unseen_bound: tuple[int, int] | None = None) -> str:
        """Store (or replace) an episode's label, given by ``owner``, when the episode's owner allows it.

        One transaction: the owner check, the bound and the write cannot be raced by another thread or process.

        :param owner: the labeller's identity; '' (a local caller, not the wire) is not checked.
        :param unseen_bound: (labels, bytes): the most labels of episodes this store never saw that one owner
            may hold here, and their bytes (id and notes, UTF-8); None: no bound. Replacing a label counts once.
        :returns: :data:`SEEN` or :data:`UNSEEN` when stored; :data:`NOT_OWNER` (the episode's recorded owner is
            another identity) or :data:`OVER_BOUND` when refused, nothing stored.
        """
        with self.connect() as conn:
            row = conn.execute('SELECT owner FROM owners WHERE episode_id=?', (episode_id,)).fetchone()
            if row is not None and owner and row[0] != owner:
                return NOT_OWNER
            seen = row is not None or _seen(conn, episode_id)
            if not seen and unseen_bound is not None:
                count, nbytes = conn.execute(
                    'SELECT COUNT(*), COALESCE(SUM(LENGTH(CAST(episode_id AS BLOB)) + LENGTH(CAST(notes AS BLOB))), 0) '
                    f'FROM labels l WHERE owner=? AND episode_id != ? AND {_unseen_where()}',
                    (owner, episode_id)).fetchone()
                size = len(episode_id.encode('utf-8')) + len(notes.encode('utf-8'))
                if count + 1 > unseen_bound[0] or nbytes + size > unseen_bound[1]:
                    return OVER_BOUND
            conn.execute('INSERT OR REPLACE INTO labels(episode_id, success, notes, labelled_at, owner) '
                         'VALUES (?, ?, ?, ?, ?)', (episode_id, int(bool(success)), notes, when, owner))
        return SEEN if seen else UNSEEN

    def own(self, episode_id: str, owner: str, when: float) -> str:
        """Record ``owner`` as the owner of an episode starting now, unless it has one; return its owner.

        The first start of an id records it; a later start (a reconnect, or another caller reusing the id) gets
        the recorded owner back. A label another identity gave the id before it first started here (a forged
        one, or a mistyped id that is now an episode's) is dropped.
        """
        with self.connect() as conn:
            row = conn.execute('SELECT owner FROM owners WHERE episode_id=?', (episode_id,)).fetchone()
            if row is not None:
                return str(row[0])
            conn.execute('INSERT INTO owners VALUES (?, ?, ?)', (episode_id, owner, when))
            conn.execute('DELETE FROM labels WHERE episode_id=? AND owner != ?', (episode_id, owner))
        return owner

    def owners(self) -> dict[str, str]:
        """Return ``{episode_id: owner}`` of every episode whose start recorded one (none in an older store)."""
        with self.connect() as conn:
            if 'owners' not in _tables(conn):
                return {}
            return {str(e): str(o) for e, o in conn.execute('SELECT episode_id, owner FROM owners')}

    def pending_label(self, episode_id: str) -> dict[str, Any] | None:
        """Return the label stored for an episode (committed or not), or None."""
        with self.connect() as conn:
            row = conn.execute('SELECT success, notes, labelled_at, owner FROM labels WHERE episode_id=?',
                               (episode_id,)).fetchone()
        return None if row is None else {'success': bool(row[0]), 'notes': row[1], 'labelled_at': row[2],
                                         'owner': row[3]}

    def labels(self) -> dict[str, dict[str, Any]]:
        """Return every stored label, of committed episodes or not: ``{episode_id: label}``.

        A label is ``{'success', 'notes', 'labelled_at', 'owner'}``; ``owner`` is '' in a store written before
        labels had owners.
        """
        with self.connect() as conn:
            owner = 'owner' if 'owner' in _columns(conn, 'labels') else "''"
            rows = conn.execute(f'SELECT episode_id, success, notes, labelled_at, {owner} FROM labels').fetchall()
        return {e: {'success': bool(s), 'notes': n, 'labelled_at': at, 'owner': str(o or '')}
                for e, s, n, at, o in rows}

    def add_run(self, run: dict[str, Any]) -> None:
        """Record (or replace) one episode the worker ran: the keys of the ``runs`` table.

        A run that was not captured never replaces the record of a captured run of the same id (a reconnect
        of that episode, a reused id, or a refused duplicate start): the record stays the captured data's.
        """
        cols = RUN_COLUMNS
        updates = ','.join(f'{c}=excluded.{c}' for c in cols if c != 'episode_id')
        with self.connect() as conn:
            conn.execute(f'INSERT INTO runs({",".join(cols)}) VALUES ({",".join("?" * len(cols))}) '
                         f'ON CONFLICT(episode_id) DO UPDATE SET {updates} '
                         'WHERE runs.captured = 0 OR excluded.captured = 1',
                         [run.get(c, 0) for c in cols])

    def unmatched_labels(self) -> set[str]:
        """Return the ids of the labels whose episode this store never saw (no run, capture decision or episode).

        A store written before a table existed (an older worker's: no ``runs``) is read with the tables it has.
        """
        with self.connect() as conn:
            tables = _tables(conn)
            if 'labels' not in tables:
                return set()
            rows = conn.execute(f'SELECT episode_id FROM labels l WHERE {_unseen_where(tables)}').fetchall()
        return {r[0] for r in rows}

    def seen(self, episode_id: str) -> bool:
        """True when the worker ran or started this episode, or decided on its capture."""
        with self.connect() as conn:
            return _seen(conn, episode_id)

    def runs(self) -> list[dict[str, Any]]:
        """Return every recorded run (oldest first) with its label: ``success`` None, True or False."""
        cols = ','.join(f'r.{c}' for c in RUN_COLUMNS)
        with self.connect() as conn:
            rows = conn.execute(f'SELECT {cols}, l.success FROM runs r LEFT JOIN labels l '
                                f'ON l.episode_id = r.episode_id ORDER BY r.started_at').fetchall()
        out = []
        for r in rows:
            d = dict(zip(RUN_COLUMNS, r[:-1], strict=True))
            d['success'] = None if r[-1] is None else bool(r[-1])
            out.append(d)
        return out

    def delete_episode(self, episode_id: str) -> None:
        """Remove an episode's row and label (its directory is removed by the caller afterwards)."""
        with self.connect() as conn:
            conn.execute('DELETE FROM episodes WHERE episode_id=?', (episode_id,))
            conn.execute('DELETE FROM labels WHERE episode_id=?', (episode_id,))

    def forget_decisions(self, before: float) -> None:
        """Drop sampling decisions and labels without an episode here older than ``before`` (s since the epoch).

        A label without an episode in this store (an episode this worker ran but did not capture, or one that
        ran on another replica) is dropped at the same age as an episode: since a label is given after its
        episode ended, it outlives the episode in whichever store holds it.
        """
        with self.connect() as conn:
            conn.execute('DELETE FROM decisions WHERE decided_at < ?', (before,))
            conn.execute('DELETE FROM labels WHERE labelled_at < ? AND episode_id NOT IN '
                         '(SELECT episode_id FROM episodes)', (before,))
            conn.execute('DELETE FROM owners WHERE since < ? AND episode_id NOT IN (SELECT episode_id FROM episodes) '
                         'AND episode_id NOT IN (SELECT episode_id FROM runs)', (before,))

    def totals(self) -> dict[str, Any]:
        """Return episodes, frames, requests, bytes, labelled count, oldest/newest start."""
        with self.connect() as conn:
            n, frames, reqs, nbytes, oldest, newest = conn.execute(
                'SELECT COUNT(*), COALESCE(SUM(frames),0), COALESCE(SUM(requests),0), COALESCE(SUM(bytes),0), '
                'MIN(started_at), MAX(started_at) FROM episodes').fetchone()
            labelled = conn.execute('SELECT COUNT(*) FROM episodes e JOIN labels l '
                                    'ON l.episode_id = e.episode_id').fetchone()[0]
        return {'episodes': n, 'frames': frames, 'requests': reqs, 'bytes': nbytes, 'labelled': labelled,
                'unlabelled': n - labelled, 'oldest': oldest, 'newest': newest}

    def dirs(self) -> dict[str, str]:
        """Return {dir name: episode_id} of the committed episodes."""
        with self.connect() as conn:
            return {d: e for e, d in conn.execute('SELECT episode_id, dir FROM episodes')}


def _tables(conn: sqlite3.Connection) -> set[str]:
    return {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}


def _columns(conn: sqlite3.Connection, table: str) -> set[str]:
    return {r[1] for r in conn.execute(f'PRAGMA table_info({table})')}


def _unseen_where(tables: set[str] | None = None) -> str:
    """SQL: the label ``l`` is of an episode the store never saw (of the :data:`SEEN_TABLES` it has)."""
    seen_in = [t for t in SEEN_TABLES if tables is None or t in tables]
    return ' AND '.join(f'NOT EXISTS (SELECT 1 FROM {t} x WHERE x.episode_id = l.episode_id)' for t in seen_in) or '1'


def _seen(conn: sqlite3.Connection, episode_id: str) -> bool:
    tables = _tables(conn)
    return any(conn.execute(f'SELECT 1 FROM {t} WHERE episode_id=?', (episode_id,)).fetchone()
               for t in SEEN_TABLES if t in tables)
