"""One captured episode: staged while it runs, committed atomically when it ends; and its read view.

Layout under ``$SEQ_HOME/capture/<deployment>/``::

    settings.json                  CaptureSettings (written by ``seq policy capture``)
    store.db                       SQLite index (WAL): episodes, sampling decisions, labels
    staging/<pid>-<dir>/           an episode being captured (invisible to readers)
    staging/.claim-<dir>           who captures that episode id (replicas share a store: one capture each;
                                   host, boot id, pid namespace, pid: see claims.py)
    episodes/<dir>/episode.rec     its records (requests, chunks, errors, telemetry; see records.py)
    episodes/<dir>/episode.json    its metadata (instruction, contract, reason, stats, counts)
    episodes/<dir>/label.json      its label, when labelled

Commit protocol (kill -9 safe): the records and ``episode.json`` are fsynced in the staging directory,
which is then renamed into ``episodes/`` (one atomic rename: the commit point), then indexed. A crash
before the rename leaves only a staging directory, removed on the next open once its process is dead;
a crash between rename and index leaves a complete directory, indexed on the next open. Readers list
only indexed episodes, so half an episode is never visible.

A storage fault while writing drops the episode being written (episodes are kept whole or not at all)
and pauses the store (:mod:`sequence_ai_ros.capture.store`). Each :class:`EpisodeCapture` has a lock, so
the servicer's threads may feed it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from sequence_ai_ros.capture.claims import REFRESH_S
from sequence_ai_ros.capture.frame_check import FrameChecker
from sequence_ai_ros.capture.index import Index
from sequence_ai_ros.capture.records import CHUNK, ERROR, REQUEST, TELEMETRY, Record, encode_record, read_records
from sequence_ai_ros.capture.settings import CaptureSettings
from sequence_ai_ros.exceptions import CaptureError, ContractViolation
from sequence_ai_ros.protocol import sequence_ai_pb2 as pb
from sequence_ai_ros.protocol.contract import CameraSpec, Contract, ObservationContract

RECORDS_FILE = 'episode.rec'
META_FILE = 'episode.json'
LABEL_FILE = 'label.json'
#: episode.json ``format``: 1 = telemetry sampled at the capture fps, ``action`` as the client resampled it;
#: 2 = telemetry at every control tick, ``action`` as commanded after the robot's safety filter,
#: ``policy_action`` and ``clamped`` when the robot reports them, frames checked before they are kept.
FORMAT = 2
_SAFE = re.compile(r'[A-Za-z0-9][A-Za-z0-9._-]{0,99}')


def episode_dir_name(episode_id: str) -> str:
    """Return the storage directory name of an episode id.

    A safe id (letters, digits, ``._-``, starting with a letter or digit) is its own name; any other id
    gets ``_h-<sha256 prefix>``, which starts with ``_`` and so can never equal a safe id. A name already
    taken on disk (e.g. a legacy ``ep-<hash>`` directory) is made unique at commit.
    """
    import hashlib

    if _SAFE.fullmatch(episode_id):
        return episode_id
    return '_h-' + hashlib.sha256(episode_id.encode()).hexdigest()[:32]


def _free_name(parent: Path, name: str) -> str:
    """Return ``name``, or ``name~N`` with the smallest N >= 1 not taken in ``parent``."""
    if not (parent / name).exists():
        return name
    n = 1
    while (parent / f'{name}~{n}').exists():
        n += 1
    return f'{name}~{n}'


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_atomic(path: Path, data: Any) -> None:
    """Write JSON to ``path`` atomically: a temp file beside it, fsync, rename."""
    tmp = path.with_name('.' + path.name + '.tmp')
    with tmp.open('w', encoding='utf-8') as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def contract_to_json(contract: Contract | None) -> dict[str, Any] | None:
    """Return the contract as a JSON-ready dict (action_space as its name)."""
    if contract is None:
        return None
    d = dataclasses.asdict(contract)
    d['action_space'] = contract.action_space.value
    return d


def contract_from_json(d: dict[str, Any] | None) -> Contract | None:
    """Rebuild a contract written by :func:`contract_to_json`."""
    if not d:
        return None
    obs = d.get('observation') or {}
    observation = ObservationContract(cameras=tuple(CameraSpec(**c) for c in obs.get('cameras', ())),
                                      state_names=tuple(obs.get('state_names', ())),
                                      history=int(obs.get('history', 1)))
    return Contract(**{**d, 'observation': observation})


@dataclasses.dataclass
class CapturedEpisode:
    """A committed episode, as readers (exports, ``seq policy capture NAME``) see it.

    :param started_at: wall-clock start (s since the epoch); ``ended_at`` likewise.
    :param fps: the telemetry rate of this episode (Hz).
    :param label: ``{'success': bool, 'notes': str, 'labelled_at': float}`` or None.
    """

    episode_id: str
    path: Path
    instruction: str
    started_at: float
    ended_at: float
    reason: str
    requests: int
    frames: int
    bytes: int
    images: bool
    fps: float
    stats: dict[str, Any]
    label: dict[str, Any] | None
    contract: Contract | None = None

    def records(self) -> list[Record]:
        """Return every record in order.

        :raises CaptureError: when the episode's file is missing, truncated or corrupt.
        """
        return list(read_records(self.path / RECORDS_FILE))

    def telemetry(self) -> list[tuple[float, pb.TelemetryFrame]]:
        """Return ``(wall_time, TelemetryFrame)`` in arrival order.

        :raises CaptureError: as :meth:`records`.
        """
        return [(r.wall_time, r.message) for r in read_records(self.path / RECORDS_FILE)
                if isinstance(r.message, pb.TelemetryFrame)]


class EpisodeHost(Protocol):
    """What an :class:`EpisodeCapture` needs of the store that began it (:class:`~.store.CaptureStore` is one).

    :ivar root: the store directory (``staging/`` and ``episodes/`` are under it).
    :ivar index: the store's index, where a committed episode is added.
    :ivar clock: wall clock (s since the epoch) for record and episode times.
    """

    root: Path
    index: Index
    clock: Callable[[], float]

    def reserve(self, nbytes: int) -> None:
        """Make room for ``nbytes`` more of an episode.

        :raises CaptureError: when they would take the store past its quota.
        """

    def release(self, ep: EpisodeCapture) -> None:
        """Forget ``ep`` as running and give up its claim on its id (it was committed or dropped)."""

    def fault(self, exc: BaseException, what: str) -> CaptureError:
        """Pause capture for a storage fault met while doing ``what``; return the CaptureError to raise."""


class EpisodeCapture:
    """One episode being captured; made by :meth:`CaptureStore.begin`, ended by commit() or abort().

    After a storage fault the episode is dropped, the store paused, and later calls do nothing.
    """

    def __init__(self, store: EpisodeHost, episode_id: str, instruction: str, contract: Contract | None,
                 settings: CaptureSettings, started_at: float) -> None:
        self.store = store
        self.episode_id = episode_id
        self.instruction = instruction
        self.contract = contract
        self.settings = settings
        self.images = settings.images
        self.fps = settings.row_fps(contract.dt if contract is not None else None)
        self.started_at = started_at
        self.dir_name = episode_dir_name(episode_id)
        self.staging = store.root / 'staging' / f'{os.getpid()}-{self.dir_name}'
        self.claim: Path | None = None   # the store's claim on the id (released at commit or drop)
        self._refreshed = time.monotonic()   # when the claim's mtime was last touched (claims.REFRESH_S)
        self._lock = threading.RLock()   # commit() reads the counters under it
        self._closed = False
        self.requests = 0
        self.frames = 0
        self.bytes = 0
        self.rejected = 0
        self.rejected_first = ''
        self._checker = FrameChecker(contract)
        self.staging.mkdir(parents=True)
        self._file = (self.staging / RECORDS_FILE).open('ab')

    @property
    def closed(self) -> bool:
        """True after commit, abort or a fault."""
        return self._closed

    def add_request(self, req: pb.ObservationRequest, chunk: pb.ActionChunk | None = None,
                    error: pb.Error | None = None) -> None:
        """Keep one observation request and its answer (a chunk, an error, or None if none yet).

        Without ``images`` the request's pixels (and its history frames' pixels) are not stored. An episode
        opened without an instruction takes its first request's (the robot's ``Observation.instruction``):
        that is the task its export names.

        :raises CaptureError: on a storage fault (the episode is dropped and capture paused).
        """
        if not self.images and (req.images or any(h.images for h in req.history)):
            stripped = pb.ObservationRequest()
            stripped.CopyFrom(req)
            stripped.ClearField('images')
            for h in stripped.history:
                h.ClearField('images')
            req = stripped
        if not self.instruction and req.instruction:
            self.instruction = req.instruction
        now = self.store.clock()
        blob = encode_record(REQUEST, now, req)
        if chunk is not None:
            blob += encode_record(CHUNK, now, chunk)
        if error is not None:
            blob += encode_record(ERROR, now, error)
        self._write(blob, requests=1)

    def add_telemetry(self, frames: list[pb.TelemetryFrame]) -> int:
        """Keep the telemetry frames that pass the contract check; count the others (see frame_check).

        :returns: the number of frames refused in this batch (:meth:`rejections` has the totals).
        :raises CaptureError: on a storage fault (the episode is dropped and capture paused).
        """
        now = self.store.clock()
        parts = []
        refused = 0
        for frame in frames:
            if not self.images and frame.images:
                copy = pb.TelemetryFrame()
                copy.CopyFrom(frame)
                copy.ClearField('images')
                frame = copy
            try:
                self._checker.check(frame)
            except ContractViolation as exc:
                refused += 1
                with self._lock:
                    self.rejected += 1
                    if not self.rejected_first:
                        self.rejected_first = (f'CONTRACT_VIOLATION: telemetry frame at robot time '
                                               f'{frame.robot_time_s:.3f} s: {exc}')
                continue
            parts.append(encode_record(TELEMETRY, now, frame))
        if parts:
            self._write(b''.join(parts), frames=len(parts))
        return refused

    def rejections(self) -> dict[str, Any]:
        """Return ``{'telemetry_rejected': n, 'telemetry_error': first refusal}`` so far."""
        with self._lock:
            return {'telemetry_rejected': self.rejected, 'telemetry_error': self.rejected_first}

    def commit(self, reason: str, stats: dict[str, Any] | None = None) -> CapturedEpisode | None:
        """End the episode and make it visible, atomically (see the module docstring).

        :param reason: completed | until | timeout | interrupted | validate | error.
        :param stats: the run's figures (actions, chunks, underruns, ...), JSON-serialisable.
        :returns: the committed episode, or None when it had already been closed or dropped.
        :raises CaptureError: on a storage fault (the episode is dropped and capture paused).
        """
        with self._lock:
            if self._closed:
                return None
            self._closed = True
            ended = self.store.clock()
            try:
                self._file.flush()
                os.fsync(self._file.fileno())
                self._file.close()
                final_parent = self.store.root / 'episodes'
                final_parent.mkdir(exist_ok=True)
                self.dir_name = _free_name(final_parent, self.dir_name)
                row: dict[str, Any] = {
                    'episode_id': self.episode_id, 'dir': self.dir_name, 'instruction': self.instruction,
                    'started_at': self.started_at, 'ended_at': ended, 'reason': str(reason),
                    'requests': self.requests, 'frames': self.frames,
                    'bytes': self.bytes, 'images': self.images, 'fps': self.fps,
                    'stats': {**dict(stats or {}), **(self.rejections() if self.rejected else {})}}
                meta = {**row, 'contract': contract_to_json(self.contract), 'format': FORMAT}
                write_json_atomic(self.staging / META_FILE, meta)
                final = final_parent / self.dir_name
                os.rename(self.staging, final)  # the commit point
                _fsync_dir(final.parent)
            except (OSError, TypeError, ValueError) as exc:
                self._drop()
                raise self.store.fault(exc, f'committing episode {self.episode_id}') from None
            label = None
            try:
                label = self.store.index.pending_label(self.episode_id)
                if label is not None:
                    write_json_atomic(final / LABEL_FILE, label)
                self.store.index.add_episode(row, label)
                self.store.index.checkpoint()
            except (OSError, sqlite3.Error) as exc:
                # Kept: the directory is complete; the next open() indexes it.
                raise self.store.fault(exc, f'indexing episode {self.episode_id}') from None
            finally:
                self.store.release(self)
            return CapturedEpisode(path=final, label=label, contract=self.contract,
                                   **{k: v for k, v in row.items() if k != 'dir'})

    def abort(self) -> None:
        """Drop the episode: nothing of it is kept."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._drop()

    def _write(self, blob: bytes, requests: int = 0, frames: int = 0) -> None:
        with self._lock:
            if self._closed:
                return
            try:
                self.store.reserve(len(blob))
                self._file.write(blob)
            except (OSError, CaptureError) as exc:
                self._closed = True
                self._drop()
                raise self.store.fault(exc, f'capturing episode {self.episode_id}') from None
            self.bytes += len(blob)
            self.requests += requests
            self.frames += frames
            if self.claim is not None and time.monotonic() - self._refreshed > REFRESH_S:
                self._refreshed = time.monotonic()
                try:   # other hosts and containers see a live holder by this (claims.py)
                    os.utime(self.claim)
                except OSError:
                    pass

    def _drop(self) -> None:
        try:
            self._file.close()
        except OSError:
            pass
        shutil.rmtree(self.staging, ignore_errors=True)
        self.store.release(self)

