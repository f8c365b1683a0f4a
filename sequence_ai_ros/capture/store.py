"""The worker's capture store: keep a sampled share of episodes whole, with labels, retention and usage.

Used by the worker, one store per deployment at ``$SEQ_HOME/capture/<deployment>/``::

    store = CaptureStore(root, deployment='fast')
    ep = store.begin(episode_id, instruction, contract)   # None: not sampled, capture off, or paused
    ep.add_request(request, chunk, error); ep.add_telemetry(frames)
    ep.commit('completed', stats)                         # atomic; or ep.abort()
    store.own(episode_id, owner)                          # at the episode's start: who may label it
    store.label(episode_id, success=True, notes='', owner=owner)   # False: not one this store ran
    store.apply_retention()                               # on worker start and periodically

Files, the commit protocol and crash safety: :mod:`sequence_ai_ros.capture.episode`. The index:
:mod:`sequence_ai_ros.capture.index`. Settings and sampling: :mod:`sequence_ai_ros.capture.settings`.

Faults never break serving: a full disk (``ENOSPC``; ``EFBIG`` under ``RLIMIT_FSIZE``), the store quota
(``settings.quota_bytes``, counted over every file of the store) or a corrupted index pause capture
with a diagnostic in :meth:`CaptureStore.status`: the episode being written is dropped, nothing
committed is touched, and :meth:`CaptureStore.begin` returns None while paused. A quota pause lifts at
the next episode start once the store is under its quota, a disk pause once a 1 MiB probe file can be
written again; a corrupted index is rebuilt from the episode directories (which hold everything)
automatically when no other live process captures into the store (at open, and at an episode start at most
once a minute; the bad file is kept aside), else it stays paused until :meth:`CaptureStore.repair`
(``seq policy capture NAME --repair --store DIR``).

Readers (``read_only=True``: exports, stats, plots) write nothing to the store: no pause file, no
recovery, no repair, no index created; the index is opened by SQLite's read-only modes.

Threads: none of its own; the worker's threads may call it concurrently (a lock guards its state).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from sequence_ai_ros.capture import claims
from sequence_ai_ros.capture import index as index_verdicts
from sequence_ai_ros.capture.episode import (
    LABEL_FILE,
    META_FILE,
    CapturedEpisode,
    EpisodeCapture,
    contract_from_json,
    episode_dir_name,
    write_json_atomic,
)
from sequence_ai_ros.capture.index import INDEX_FILE, Index
from sequence_ai_ros.capture.recovery import recover_store, tree_bytes
from sequence_ai_ros.capture.settings import CaptureSettings, load_settings
from sequence_ai_ros.exceptions import CaptureError, ConfigError, Overloaded, PermissionDenied
from sequence_ai_ros.protocol.contract import Contract

__all__ = ['CaptureStore', 'CaptureSettings', 'EpisodeCapture', 'CapturedEpisode']


#: Written by the process that paused capture (the worker), read by ``seq policy capture NAME``.
PAUSE_FILE = 'pause.json'
#: Bytes written to probe for room before lifting a disk-full pause.
PROBE_BYTES = 1 << 20
#: Seconds between two automatic repairs of a corrupt index (see CaptureStore._auto_repair).
AUTO_REPAIR_INTERVAL_S = 60.0
#: The most labels of episodes a store never saw (fleet failover, or forged ids) that one identity may hold in
#: it, and their bytes (ids and notes, UTF-8); past either, such a label is refused (:meth:`CaptureStore.label`).
UNSEEN_LABELS_PER_OWNER = 1000
UNSEEN_LABEL_BYTES_PER_OWNER = 1 << 20
#: The refusal (``Overloaded.refusal``) of a label past that bound.
UNSEEN_LABELS_REFUSAL = 'unseen_labels'
LOG = logging.getLogger(__name__)


class CaptureStore:
    """The capture store of one deployment.

    :param root: the store directory, ``$SEQ_HOME/capture/<deployment>``.
    :param deployment: the deployment's name (for messages).
    :param clock: wall clock (s since the epoch), injected by tests; used for episode times,
        labels and retention.
    """

    def __init__(self, root: str | Path, deployment: str = '', clock: Callable[[], float] = time.time,
                 read_only: bool = False) -> None:
        self.root = Path(root)
        self.deployment = deployment or self.root.name
        self.clock = clock
        #: a reader (exports, stats, plots): nothing is ever written, created or removed in the store
        self.read_only = read_only
        self.index = Index(self.root, read_only=read_only)
        self._lock = threading.Lock()
        self._active: set[EpisodeCapture] = set()
        self._ready = False
        self._settings: CaptureSettings | None = None
        self._pause: tuple[str, str, float] | None = None  # (kind, diagnostic, since)
        self._base_bytes = 0
        self.retired = False   # set by retire() when the deployment is deleted
        self._open_lock = threading.Lock()
        self._last_refusal = ''
        self._auto_repaired = -AUTO_REPAIR_INTERVAL_S   # monotonic time of the last automatic repair attempt

    # ------------------------------------------------------------------ settings and status
    @property
    def settings(self) -> CaptureSettings:
        """The settings read at the last begin() (read now if none yet); defaults when unreadable."""
        if self._settings is None:
            try:
                self._settings = load_settings(self.root)
            except ConfigError:
                return CaptureSettings()
        return self._settings

    def status(self) -> dict[str, Any]:
        """Return ``{'state': 'off'|'capturing'|'paused', 'diagnostic': str, 'since': float|None}``."""
        with self._lock:
            pause = self._pause
        if pause is None:   # another process (the worker) may have paused: it leaves pause.json
            try:
                saved = json.loads((self.root / PAUSE_FILE).read_text(encoding='utf-8'))
                pause = (str(saved['kind']), str(saved['diagnostic']), float(saved['since']))
            except (OSError, ValueError, KeyError, TypeError):
                pause = None
        if pause is not None:
            return {'state': 'paused', 'kind': pause[0], 'diagnostic': pause[1], 'since': pause[2]}
        state = 'capturing' if self.settings.active else 'off'
        return {'state': state, 'kind': '', 'diagnostic': '', 'since': None}

    # ------------------------------------------------------------------ capture
    def begin(self, episode_id: str, instruction: str = '', contract: Contract | None = None) -> EpisodeCapture | None:
        """Decide whether to capture an episode, and start capturing it if so.

        Reads ``settings.json`` afresh. The decision (kept or not, and why) is recorded so that a later
        label gets a clear answer.

        :param episode_id: the episode's id (sampling is decided from it, deterministically).
        :param instruction: the episode's instruction (a LeRobot export's task).
        :param contract: the deployment's contract (names and cameras of an export).
        :returns: the episode's capture, or None when not sampled, capture is off, or paused.
        :raises CaptureError: for an empty id or an id that was already captured.
        """
        if not episode_id:
            raise CaptureError('episode_id must not be empty')
        try:
            settings = load_settings(self.root)
        except ConfigError as exc:
            self._set_pause('settings', f'capture paused: {exc}')
            return None
        self._settings = settings
        if self.retired:
            return None
        now = self.clock()
        self._last_refusal = ''
        with self._lock:
            corrupt = self._pause is not None and self._pause[0] == 'corrupt'
        if corrupt:   # found corrupt while serving: rebuilt at an episode start when safe
            try:
                with self._open_lock:
                    repaired = self._auto_repair(CaptureError(self._pause[1] if self._pause else 'corrupt'))
                    if repaired:
                        self.recover()
                if repaired:
                    with self._lock:
                        self._pause = None
                    self._save_pause(None)
            except (OSError, sqlite3.Error) as exc:
                LOG.warning('capture %s: automatic repair failed: %s', self.deployment, exc)
        try:
            self._open()
            why = self._refuse(settings, episode_id)
            with self._lock:
                running = any(ep.episode_id == episode_id for ep in self._active)
            first = self.index.decide(episode_id, now, why is None, why or 'captured')
            if why is not None:     # not captured (off, paused, sampled out): why() tells
                return None
            if running:
                raise self._not_captured(episode_id, 'is being captured by this worker')
            if not first:
                raise self._not_captured(episode_id, 'was already captured (a reconnect of it, or a reused id)')
            claim = self._claim(episode_id)
            try:
                base = tree_bytes(self.root, skip='staging') if settings.quota_bytes is not None else 0
                with self._lock:
                    self._base_bytes = base
                    ep = EpisodeCapture(self, episode_id, instruction, contract, settings, now)
                    ep.claim = claim
                    self._active.add(ep)
            except BaseException:
                claim.unlink(missing_ok=True)
                raise
            return ep
        except (OSError, sqlite3.Error) as exc:
            self._last_refusal = str(self.fault(exc, f'starting episode {episode_id}'))
            return None

    def refusal(self) -> str:
        """Why the last :meth:`begin` that returned None did not capture although capture is on ('' otherwise).

        A paused store (disk full, quota, corrupt index) or a failed start: the robot is told (capture_error).
        """
        if self._last_refusal:
            return self._last_refusal
        status = self.status()
        return status['diagnostic'] if status['state'] == 'paused' else ''

    def own(self, episode_id: str, owner: str) -> str:
        """Record the identity starting an episode as its owner (the first start of the id); return its owner.

        An episode's labels are then accepted from its owner only (:meth:`label`); the worker captures and
        records a start of the id by another identity not at all (:class:`~sequence_ai_ros.worker.capture_hook.
        EpisodeRecorder`). Owners are kept as long as the episode's run or data, else ``retention_days``.

        :param owner: the caller's identity (:mod:`sequence_ai_ros.worker.identity`).
        :raises CaptureError: when the store cannot be written.
        """
        try:
            self._open()
            return self.index.own(episode_id, owner, self.clock())
        except (OSError, sqlite3.Error) as exc:
            raise self.fault(exc, f'recording the owner of episode {episode_id}') from None

    def owners(self) -> dict[str, str]:
        """Return ``{episode_id: owner}`` of the episodes whose start recorded an owner (:meth:`own`).

        :raises CaptureError: when the index cannot be read.
        """
        if not (self.root / INDEX_FILE).exists():
            return {}
        try:
            self._open()
            return self.index.owners()
        except (OSError, sqlite3.Error) as exc:
            raise self.fault(exc, 'reading owners') from None

    def label(self, episode_id: str, success: bool, notes: str = '', unseen: bool = True, owner: str = '') -> bool:
        """Store an episode's label (replacing an earlier one), captured or not; a running one gets it too.

        Any episode this worker ran is labelled (its label counts in ``seq policy stats``); a captured one
        also gets ``label.json`` beside its data. A label for an episode this store never saw is stored too:
        in a fleet with one store per replica the episode may have run on another replica (its replica was
        stopped when the robot labelled it, so the balancer sent the label here). Such a label is kept for
        ``retention_days`` from when it was given, as long as an episode is kept from its end, so it outlives
        its episode in the store that captured it; export and ``seq policy stats`` over several stores
        (:class:`~sequence_ai_ros.capture.store_set.StoreSet`) merge labels by episode id. Having no episode
        directory here, it lives in the index alone: a repair of a corrupt index does not bring it back.

        Ownership: an episode started here has an owner (:meth:`own`); a label from another identity is
        refused. A label of an episode this store never saw is kept with its ``owner``, and an export over
        several stores joins it to the episode only when that episode's owner is the same identity
        (:class:`~sequence_ai_ros.capture.store_set.StoreSet`). One owner may hold at most
        :data:`UNSEEN_LABELS_PER_OWNER` such labels here, of :data:`UNSEEN_LABEL_BYTES_PER_OWNER` bytes in all.

        :param unseen: store a label for an episode this store never saw; False refuses it.
        :param owner: the labeller's identity (:mod:`sequence_ai_ros.worker.identity`); '' (a local caller)
            is not checked and not bounded.
        :returns: True when this store ran (or is running) the episode; False when the label is kept for an
            episode it never saw (or one past retention).
        :raises LookupError: for an episode this store never saw, when ``unseen`` is False (nothing stored).
        :raises PermissionDenied: when another identity owns the episode (nothing stored).
        :raises Overloaded: (refusal :data:`UNSEEN_LABELS_REFUSAL`) when ``owner`` already holds the most labels
            of unseen episodes allowed here (nothing stored).
        :raises CaptureError: when the store cannot be written.
        """
        when = self.clock()
        bound = (UNSEEN_LABELS_PER_OWNER, UNSEEN_LABEL_BYTES_PER_OWNER) if owner else None
        try:
            self._open()
            row = self.index.episode(episode_id)
            with self._lock:
                running = any(ep.episode_id == episode_id for ep in self._active)
            if not (row is not None or running or self.index.seen(episode_id)) and not unseen:
                raise LookupError(f'episode {episode_id!r} did not run on this worker')
            verdict = self.index.label(episode_id, bool(success), str(notes), when, owner, bound)
            if verdict == index_verdicts.NOT_OWNER:
                raise PermissionDenied(f'episode {episode_id!r} was run by another client: only the identity that '
                                       'ran an episode may label it')
            if verdict == index_verdicts.OVER_BOUND:
                raise Overloaded(f'label of episode {episode_id!r} refused: this client already holds the most '
                                 f'labels of episodes this worker did not run ({UNSEEN_LABELS_PER_OWNER} labels, '
                                 f'{UNSEEN_LABEL_BYTES_PER_OWNER} bytes of ids and notes) until they pass '
                                 'retention_days; check the episode ids', refusal=UNSEEN_LABELS_REFUSAL)
            if row is not None:
                write_json_atomic(self.root / 'episodes' / row['dir'] / LABEL_FILE,
                                  {'success': bool(success), 'notes': str(notes), 'labelled_at': when,
                                   'owner': owner})
            self.index.checkpoint()
        except (OSError, sqlite3.Error) as exc:
            raise self.fault(exc, f'labelling episode {episode_id}') from None
        return row is not None or running or verdict == index_verdicts.SEEN

    def labels(self) -> dict[str, dict[str, Any]]:
        """Return every label the store holds, ``{episode_id: {'success', 'notes', 'labelled_at'}}``.

        Labels of episodes this store does not hold are included (see :meth:`label`); ``labelled_at`` is
        the wall time the worker stored it (s since the epoch).

        :raises CaptureError: when the index cannot be read.
        """
        if not (self.root / INDEX_FILE).exists():
            return {}
        try:
            self._open()
            return self.index.labels()
        except (OSError, sqlite3.Error) as exc:
            raise self.fault(exc, 'reading labels') from None

    def unmatched_labels(self) -> list[str]:
        """Return the ids of the labels held for an episode this store never saw, sorted.

        In a fleet with a store per replica such a label may belong to another replica's episode (see
        :meth:`label`); read the stores together (:meth:`StoreSet.unmatched_labels
        <sequence_ai_ros.capture.store_set.StoreSet.unmatched_labels>`) to find the labels no store ran: a
        mistyped id, or an episode past retention everywhere.

        :raises CaptureError: when the index cannot be read.
        """
        if not (self.root / INDEX_FILE).exists():
            return []
        try:
            self._open()
            return sorted(self.index.unmatched_labels())
        except (OSError, sqlite3.Error) as exc:
            raise self.fault(exc, 'reading labels') from None

    def seen(self, episode_ids: Iterable[str]) -> set[str]:
        """Return those of ``episode_ids`` this store saw (ran, decided on, or holds).

        :raises CaptureError: when the index cannot be read.
        """
        ids = set(episode_ids)
        if not ids or not (self.root / INDEX_FILE).exists():
            return set()
        try:
            self._open()
            return {eid for eid in ids if self.index.seen(eid)}
        except (OSError, sqlite3.Error) as exc:
            raise self.fault(exc, 'reading runs') from None

    def record_run(self, run: dict[str, Any]) -> None:
        """Record one episode the worker ran (captured or not), for labels and ``seq policy stats``.

        :param run: ``episode_id, version, started_at, ended_at`` (s since the epoch), ``reason``, ``actions``,
            ``underruns``, ``latency_p95_ms``, ``captured``.
        :raises CaptureError: when the store cannot be written (capture pauses as for any fault).
        """
        if self.retired:
            return
        try:
            self._open()
            self.index.add_run(run)
        except (OSError, sqlite3.Error) as exc:
            raise self.fault(exc, f'recording run {run.get("episode_id")}') from None

    def runs(self) -> list[dict[str, Any]]:
        """Return every run recorded (oldest first), each with ``success`` (None when unlabelled).

        :raises CaptureError: when the index cannot be read.
        """
        if not (self.root / INDEX_FILE).exists():
            return []
        try:
            self._open()
            return self.index.runs()
        except (OSError, sqlite3.Error) as exc:
            raise self.fault(exc, 'reading runs') from None

    def retire(self) -> None:
        """Stop for good (the deployment was deleted): no capture, no run, nothing re-created on disk."""
        self.retired = True
        self.index.close()

    # ------------------------------------------------------------------ housekeeping
    def apply_retention(self, now: float | None = None) -> int:
        """Delete the committed episodes that ended more than ``retention_days`` before ``now``.

        :param now: wall time (s since the epoch); the store's clock when None.
        :returns: the number of episodes deleted.
        :raises CaptureError: when the index cannot be read (corrupt).
        """
        if not self.root.exists():
            return 0
        now = self.clock() if now is None else now
        try:
            self._settings = load_settings(self.root)  # the retention in force now
        except ConfigError:
            pass  # keep the last good settings
        cutoff = now - self.settings.retention_days * 86400.0
        try:
            self._open()
            old = self.index.episodes(where='e.ended_at < ?', args=(cutoff,))
            for row in old:
                self.index.delete_episode(row['episode_id'])
                shutil.rmtree(self.root / 'episodes' / row['dir'], ignore_errors=True)
            self.index.forget_decisions(cutoff)
        except (OSError, sqlite3.Error) as exc:
            raise self.fault(exc, 'applying retention') from None
        return len(old)

    def bytes_used(self) -> int:
        """Return the bytes the store holds on disk (every file: episodes, index, staging, settings)."""
        return tree_bytes(self.root)

    def captured_bytes(self) -> int:
        """Return the bytes of captured data: episodes, committed and being written (``seq usage`` bills these).

        The index and settings are not captured data: a worker records every episode it runs there (for
        labels and ``seq policy stats``), captured or not, so a deployment that never captured holds 0.
        """
        return tree_bytes(self.root / 'episodes') + tree_bytes(self.root / 'staging')

    def recover(self) -> dict[str, int]:
        """Clean up after crashes: drop staging dirs of dead processes, index complete unindexed episodes.

        :returns: ``{'dropped': n, 'indexed': n, 'missing': n}``.
        """
        return recover_store(self.root, self.index)

    def repair(self) -> int:
        """Rebuild a corrupted index from the episode directories; the bad one is kept aside.

        :returns: the number of episodes in the rebuilt index.
        :raises CaptureError: when the store directory cannot be written.
        """
        if self.read_only:
            raise CaptureError(f'store {self.root} is opened read-only; repair it with: {self.repair_command()}')
        try:
            self._move_index_aside()
            self._ready = False
            self._open()
            count = self.index.totals()['episodes']
        except (OSError, sqlite3.Error) as exc:
            raise self.fault(exc, 'repairing the index') from None
        with self._lock:
            self._pause = None
        self._save_pause(None)
        return int(count)

    def _others_capturing(self) -> list[str]:
        """The claims in staging held by live processes other than this one (replicas sharing the store)."""
        staging = self.root / 'staging'
        busy = []
        for claim in sorted(staging.glob('.claim-*')) if staging.is_dir() else ():
            holder = claims.read_holder(claim)
            if holder is not None and not claims.is_mine(holder) and claims.alive(holder, claim):
                busy.append(f'{holder.host or "this host"} pid {holder.pid}')
        return busy

    def _auto_repair(self, exc: BaseException) -> bool:
        """Rebuild a corrupt index when that is safe; return True when it was rebuilt.

        Safe means no other live process is capturing into this store (no live claim of another
        holder): the rebuild reads the committed episode directories, which hold everything an export
        needs, and keeps the bad index aside (``store.db.corrupt-<time>``). Otherwise the store stays paused
        until :meth:`repair` (``seq policy capture NAME --repair --store DIR``). A reader never repairs.
        """
        if self.read_only:
            return False
        now = time.monotonic()
        if now - self._auto_repaired < AUTO_REPAIR_INTERVAL_S:
            return False
        self._auto_repaired = now
        self.index.close()
        try:   # another replica sharing the store may have rebuilt it already: then the file is good again
            self.index.create()
            return True
        except sqlite3.DatabaseError:
            pass
        busy = self._others_capturing()
        if busy:
            LOG.warning('capture %s: index %s is corrupt (%s); not rebuilt automatically while %s capture into '
                        'the store', self.deployment, self.index.path, exc, ', '.join(busy))
            return False
        LOG.warning('capture %s: index %s is corrupt (%s); rebuilding it from the episode files (the bad one is '
                    'kept aside)', self.deployment, self.index.path, exc)
        self._move_index_aside()
        self.index.create()
        return True

    def _move_index_aside(self) -> None:
        stamp = time.strftime('%Y%m%dT%H%M%S')
        self.index.close()
        for suffix in ('', '-wal', '-shm'):
            src = self.root / (INDEX_FILE + suffix)
            if src.exists():
                os.replace(src, self.root / f'{INDEX_FILE}{suffix}.corrupt-{stamp}')

    def repair_command(self) -> str:
        """The command that rebuilds THIS store's index (it names the store's directory)."""
        import shlex

        return f'seq policy capture {shlex.quote(self.deployment)} --repair --store {shlex.quote(str(self.root))}'

    def close(self) -> None:
        """Close the index connection (checkpointing its WAL); the store reopens it if used again."""
        self.index.close()

    # ------------------------------------------------------------------ reading
    def episodes(self, since: float | None = None, until: float | None = None,
                 labelled_only: bool = False) -> list[CapturedEpisode]:
        """Return the committed episodes, oldest first.

        :param since: keep episodes started at or after this wall time (s since the epoch).
        :param until: keep episodes started before this wall time.
        :param labelled_only: keep labelled episodes only.
        :raises CaptureError: when the index cannot be read.
        """
        where, args = ['1'], []
        if since is not None:
            where.append('e.started_at >= ?')
            args.append(float(since))
        if until is not None:
            where.append('e.started_at < ?')
            args.append(float(until))
        if labelled_only:
            where.append('l.success IS NOT NULL')
        if not (self.root / INDEX_FILE).exists():
            return []
        try:
            self._open()
            rows = self.index.episodes(where=' AND '.join(where), args=tuple(args))
        except (OSError, sqlite3.Error) as exc:
            raise self.fault(exc, 'listing episodes') from None
        out = []
        for row in rows:
            path = self.root / 'episodes' / row.pop('dir')
            if not path.is_dir():   # gone (retention while we read, or a row recovery would drop): not listed
                continue
            try:
                meta = json.loads((path / META_FILE).read_text(encoding='utf-8'))
            except (OSError, ValueError):
                meta = {}
            out.append(CapturedEpisode(path=path, contract=contract_from_json(meta.get('contract')), **row))
        return out

    def summary(self) -> dict[str, Any]:
        """Return settings, status and totals (episodes, frames, bytes, labelled, unlabelled, oldest, newest).

        :raises CaptureError: when the index cannot be read.
        """
        totals: dict[str, Any] = {'episodes': 0, 'frames': 0, 'requests': 0, 'bytes': 0, 'labelled': 0,
                                  'unlabelled': 0, 'oldest': None, 'newest': None}
        if (self.root / INDEX_FILE).exists():
            try:
                self._open()
                totals = self.index.totals()
            except (OSError, sqlite3.Error) as exc:
                raise self.fault(exc, 'reading totals') from None
        return {'deployment': self.deployment, 'root': str(self.root), 'settings': self.settings.to_json(),
                'status': self.status(), **totals, 'bytes_on_disk': self.bytes_used()}

    # ------------------------------------------------------------------ internals
    def _open(self) -> None:
        with self._open_lock:   # two worker threads' first episodes must not create the index at once
            if self._ready:
                return
            if self.read_only:   # a reader checks, never creates, recovers or repairs
                self.index.check()
                self._ready = True
                return
            (self.root / 'episodes').mkdir(parents=True, exist_ok=True)
            (self.root / 'staging').mkdir(exist_ok=True)
            try:
                self.index.create()
            except sqlite3.DatabaseError as exc:
                if isinstance(exc, sqlite3.OperationalError) or not self._auto_repair(exc):
                    raise
            self.recover()
            self._ready = True

    def _refuse(self, settings: CaptureSettings, episode_id: str) -> str | None:
        """Return why an episode is not captured, or None to capture it (lifts lapsed pauses)."""
        if not settings.enabled:
            return 'capture is off'
        if not settings.keeps(episode_id):
            return f'not sampled at rate {settings.rate:g}'
        with self._lock:
            pause = self._pause
        if pause is not None and pause[0] == 'corrupt':
            return pause[1]
        if pause is not None and pause[0] == 'disk' and not self._room_for(PROBE_BYTES):
            return pause[1]
        quota = settings.quota_bytes
        if quota is not None:
            used = self.bytes_used()
            if used >= quota:
                self._set_pause('quota', f'capture paused: the store holds {used} bytes, its quota is {quota} '
                                         f'(raise quota_bytes or lower the retention)')
                return self._pause[1] if self._pause else 'quota'
        self._set_pause(None, '')
        return None

    def _room_for(self, nbytes: int) -> bool:
        """Return True when a file of ``nbytes`` can be written in the store (probe after a disk fault)."""
        probe = self.root / 'staging' / f'.probe-{os.getpid()}'
        try:
            with probe.open('wb') as f:
                f.write(b'\0' * nbytes)
                f.flush()
                os.fsync(f.fileno())
            return True
        except OSError:
            return False
        finally:
            probe.unlink(missing_ok=True)

    def reserve(self, nbytes: int) -> None:
        """Make room for ``nbytes`` more of a running episode (:class:`~.episode.EpisodeHost`).

        :raises CaptureError: when they would take the store past ``settings.quota_bytes``.
        """
        quota = self.settings.quota_bytes
        if quota is None:
            return
        with self._lock:
            staged = sum(ep.bytes for ep in self._active)
            used = self._base_bytes + staged + nbytes
        if used > quota:
            raise CaptureError(f'store quota reached: {used} > quota_bytes {quota}')

    def _not_captured(self, episode_id: str, why: str) -> CaptureError:
        """The refusal told to the robot when capture is on but this run of ``episode_id`` is not kept."""
        return CaptureError(f'deployment {self.deployment}: episode {episode_id!r} {why}: this run of it is not '
                            'captured; give each new episode its own id')

    def _claim(self, episode_id: str) -> Path:
        """Claim an episode id for this process while it is captured: ``staging/.claim-<dir>`` names it.

        Replicas of a fleet share one store: a reconnect of an episode that lands on another replica while
        the first still captures it would be captured twice. The claim is created atomically (a hard link,
        which fails when the name exists) and names its holder by host, boot id, pid namespace, pid and
        start time (:mod:`sequence_ai_ros.capture.claims`); a dead holder's claim is taken over, a live
        one's (a container's included) never.

        :raises CaptureError: when a live process (this one included: a concurrent start) holds the claim.
        """
        import uuid

        staging = self.root / 'staging'
        path = staging / f'.claim-{episode_dir_name(episode_id)}'
        me = claims.this_process()
        mine = staging / f'.claim-new-{uuid.uuid4().hex}'
        mine.write_text(me.to_json(), encoding='utf-8')
        try:
            for _ in range(3):
                try:
                    os.link(mine, path)
                    return path
                except FileExistsError:
                    holder = claims.read_holder(path)
                    if holder is None or claims.alive(holder, path):
                        if holder is not None and claims.is_mine(holder):
                            where = 'this worker'
                        elif holder is None:
                            where = 'another worker process (its claim is being written)'
                        else:
                            where = f'another worker process (pid {holder.pid} on {holder.host or "this host"})'
                        raise self._not_captured(episode_id, f'is being captured by {where} sharing this '
                                                             'store') from None
                    path.unlink(missing_ok=True)   # a dead holder's claim
            raise CaptureError(f'deployment {self.deployment}: episode {episode_id!r}: its capture claim '
                               f'{path} could not be taken')
        finally:
            mine.unlink(missing_ok=True)

    def release(self, ep: EpisodeCapture) -> None:
        """Forget a committed or dropped episode and remove its claim (:class:`~.episode.EpisodeHost`)."""
        with self._lock:
            self._active.discard(ep)
        claim = ep.claim
        if claim is not None:
            ep.claim = None
            claim.unlink(missing_ok=True)

    def _set_pause(self, kind: str | None, diagnostic: str) -> None:
        with self._lock:
            before = self._pause
            if kind is None:
                if self._pause is not None and self._pause[0] != 'corrupt':
                    self._pause = None
            elif self._pause is None or self._pause[0] != kind:
                self._pause = (kind, diagnostic, self.clock())
            after = self._pause
        if after != before:
            self._save_pause(after)

    def _save_pause(self, pause: tuple[str, str, float] | None) -> None:
        """Leave the pause (or its end) in ``pause.json`` for other processes.

        Best effort: a full disk may refuse it, then only this process knows.
        """
        path = self.root / PAUSE_FILE
        if self.read_only:
            return
        try:
            if pause is None:
                path.unlink(missing_ok=True)
            elif self.root.exists():
                write_json_atomic(path, {'kind': pause[0], 'diagnostic': pause[1], 'since': pause[2]})
        except OSError:
            pass

    def fault(self, exc: BaseException, what: str) -> CaptureError:
        """Pause capture for a storage fault; return the CaptureError to raise (with the diagnostic).

        Its episodes call it too (:class:`~.episode.EpisodeHost`). A reader (read_only) pauses nothing: only
        its message says the store cannot be read.
        """
        lead = 'cannot read the store' if self.read_only else 'capture paused'
        if isinstance(exc, CaptureError) and 'quota' in str(exc):
            kind, text = 'quota', f'{lead} while {what}: {exc}'
        elif isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
            kind, text = 'disk', f'{lead} while {what}: disk full ({exc})'
        elif isinstance(exc, (sqlite3.IntegrityError, sqlite3.InterfaceError, TypeError, ValueError)):
            # this episode's own data (a value the index refuses): that episode alone is refused, no pause
            return CaptureError(f'not kept: {what} failed: {type(exc).__name__}: {exc}')
        elif isinstance(exc, OSError) and exc.errno not in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
            # any other write failure (EIO, EACCES...): that episode is refused and the robot told; the next
            # episode tries again (nothing to lift)
            return CaptureError(f'not kept: {what} failed: {type(exc).__name__}: {exc}')
        elif isinstance(exc, sqlite3.DatabaseError) and not isinstance(exc, sqlite3.OperationalError):
            kind, text = 'corrupt', (f'{lead} while {what}: the index {self.index.path} is corrupt ({exc}); '
                                     f'kept episodes are intact in episodes/; rebuild the index with: '
                                     f'{self.repair_command()}')
        elif isinstance(exc, sqlite3.OperationalError) and 'full' in str(exc):
            kind, text = 'disk', f'{lead} while {what}: disk full ({exc})'
        else:
            kind, text = 'io', f'{lead} while {what}: {type(exc).__name__}: {exc}'
        with self._lock:
            self._pause = (kind, text, self.clock())
            pause = self._pause
        self._save_pause(pause)
        return CaptureError(text)
