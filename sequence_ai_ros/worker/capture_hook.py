"""The worker's side of field-data capture: a guarded bridge to :mod:`sequence_ai_ros.capture.store`.

The store decides per episode (``begin`` returns None when the episode is not sampled, capture is off or
paused). Capture never breaks serving: any :class:`~sequence_ai_ros.exceptions.CaptureError` (or other
store failure) is logged, capture of that episode stops (its partial data is aborted, so nothing half-written
becomes visible) and the episode goes on. When the data module is absent, capture is simply off.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from pathlib import Path
from typing import Any

from sequence_ai_ros.protocol import sequence_ai_pb2 as pb
from sequence_ai_ros.protocol.contract import Contract, clip

LOG = logging.getLogger(__name__)


def open_store(root: Path, deployment: str) -> Any | None:
    """Return a ``CaptureStore`` for ``root`` (the deployment's capture directory), or None.

    None when :mod:`sequence_ai_ros.capture.store` is not importable or the store cannot open (logged).
    """
    try:
        from sequence_ai_ros.capture.store import CaptureStore
    except ImportError as exc:
        LOG.info('capture disabled: sequence_ai_ros.capture.store not importable (%s)', exc)
        return None
    try:
        return CaptureStore(root=root, deployment=deployment, clock=time.time)
    except Exception as exc:  # a broken store must not stop serving
        LOG.error('capture disabled for %s: cannot open store at %s: %s', deployment, root, exc)
        return None


def _finite(value: Any) -> float:
    """Return ``value`` as a float, 0.0 when it is not a finite number (the boundary refused it already)."""
    try:
        value = float(value or 0.0)
    except (TypeError, ValueError):
        return 0.0
    return value if math.isfinite(value) else 0.0


class EpisodeRecorder:
    """Capture of one episode, or a no-op when the episode is not captured.

    :param store: the deployment's CaptureStore, or None.
    :param episode_id: the episode.
    :param instruction: its instruction.
    :param contract: the deployment's contract (stamped).
    :param owner: the identity running it (:mod:`sequence_ai_ros.worker.identity`), recorded as its owner at its
        first start; '' records none. A start of an id another identity owns is served but neither captured
        (its telemetry is not kept) nor recorded (its outcome does not replace the owner's run).
    """

    def __init__(self, store: Any | None, episode_id: str, instruction: str, contract: Contract,
                 version: int = 0, owner: str = '') -> None:
        self.episode_id = episode_id
        self._store = store
        self._version = int(version)
        self._started = time.time()
        self._lock = threading.Lock()  # the stream thread and the disconnect callback may race
        self._ep = None
        #: what came and is not written yet, in order: ('request', (req, chunk, error)) or ('telemetry', (frames,))
        self._held: list[tuple[str, tuple[Any, ...]]] = []
        self._dropped = ''                   # why the robot dropped this episode's capture (drop), else ''
        self._held_lock = threading.Lock()   # guards _held and _dropped alone: never held while writing
        self.fps = 0.0
        self.images = False
        self.rejected = 0
        self.rejected_first = ''
        #: why capture is on but this episode is not captured (told to the robot at its start), else ''
        self.not_captured = ''
        #: why this episode's capture stopped, or its run was not recorded (told to the robot in EpisodeEnded)
        self.capture_error = ''
        #: another identity owns this episode id: nothing of this run is captured or recorded
        self.foreign = False
        if store is None:
            return
        try:
            if owner and store.own(episode_id, owner) != owner:
                self.foreign = True
                self.not_captured = (f'episode {clip(episode_id)!r} was started by another client: this run of it '
                                     'is served but neither captured nor recorded; give each new episode its own id')
                self.capture_error = self.not_captured
                return
            self._ep = store.begin(episode_id, instruction, contract)
            if self._ep is None:   # capture on but paused, or its start failed: the robot is told why
                self.not_captured = store.refusal()
            else:
                settings = store.settings
                self.fps = float(settings.row_fps(contract.dt))
                self.images = bool(settings.images)
        except Exception as exc:
            LOG.error('capture of episode %s not started: %s', episode_id, exc)
            self.not_captured = str(exc)
            self._ep = None

    @property
    def active(self) -> bool:
        """True while this episode is being captured."""
        return self._ep is not None

    def _guarded(self, what: str, fn: Any, *args: Any) -> Any:
        if self._ep is None:
            return None
        try:
            return fn(*args)
        except Exception as exc:
            LOG.error('capture of episode %s stopped (%s failed: %s); serving goes on', self.episode_id, what, exc)
            self.capture_error = self.capture_error or f'episode {self.episode_id!r} not kept: {clip(exc, 300)}'
            ep, self._ep = self._ep, None
            try:
                ep.abort()
            except Exception as abort_exc:
                LOG.error('capture abort of %s failed: %s', self.episode_id, abort_exc)
            return None

    def hold(self, req: pb.ObservationRequest, chunk: pb.ActionChunk | None, error: pb.Error | None) -> None:
        """Keep one answered request to write once its reply went out; never blocks (the event loop calls it).

        :meth:`write_held` writes it, or else :meth:`commit` does, first: a write cancelled before it ran (the
        stream cut while the write waited for a thread) is not lost.
        """
        self._keep('request', (req, chunk, error))

    def hold_telemetry(self, frames: list[pb.TelemetryFrame]) -> None:
        """Keep telemetry frames to write (:meth:`write_held`, or else :meth:`commit`); never blocks."""
        self._keep('telemetry', (list(frames),))

    def drop(self, why: str) -> None:
        """Keep none of this episode, for ``why`` (told to the robot in EpisodeEnded); never blocks (the loop calls it).

        The robot stopped its capture (EpisodeEnd.capture_error: a record over the message limit), so what came
        is not a whole episode. Decided now; the next :meth:`write_held` or :meth:`commit` aborts its files (a
        stream cut before either ran keeps nothing all the same). Its run is still recorded (``captured`` 0).
        """
        with self._held_lock:
            self._dropped = self._dropped or why
            self._held = []

    def write_held(self) -> None:
        """Write what :meth:`hold` and :meth:`hold_telemetry` kept and is still there, in order (blocking)."""
        with self._lock:
            self._write_held()

    def _keep(self, kind: str, args: tuple[Any, ...]) -> None:
        if self._ep is None:
            return
        with self._held_lock:
            if not self._dropped:
                self._held.append((kind, args))

    def _write_held(self) -> None:
        """Under ``_lock``: write what is held, in order; abort instead when the robot dropped the capture."""
        with self._held_lock:
            held, self._held, dropped = self._held, [], self._dropped
        if dropped:
            self._abort(dropped)
            return
        for kind, args in held:
            if kind == 'request':
                self._guarded('add_request', lambda args=args: self._ep and self._ep.add_request(*args))
            else:
                self._guarded('add_telemetry', lambda args=args: self._ep and self._ep.add_telemetry(*args))
                ep = self._ep
                if ep is not None:
                    got = ep.rejections()
                    self.rejected, self.rejected_first = got['telemetry_rejected'], got['telemetry_error']

    def _abort(self, why: str) -> None:
        """Under ``_lock``: abort the episode's files for ``why`` (:meth:`drop`); its run is still recorded."""
        with self._held_lock:
            self._held = []
        ep, self._ep = self._ep, None
        if ep is None:
            return
        LOG.warning('capture of episode %s not kept: %s', self.episode_id, why)
        self.capture_error = self.capture_error or f'episode {self.episode_id!r} not kept: {why}'
        try:
            ep.abort()
        except Exception as abort_exc:
            LOG.error('capture abort of %s failed: %s', self.episode_id, abort_exc)

    def commit(self, reason: str, stats: dict[str, Any]) -> bool:
        """Commit the episode atomically (when captured) and record the run; return True when it was stored.

        What is still held (:meth:`hold`) is written first, or the episode aborted when the robot dropped it
        (:meth:`drop`).

        Every episode's run (captured or not) is recorded in the store's index, so that it can be labelled
        and counted by ``seq policy stats``; a failure there is logged and never stops serving.
        """
        stored = None
        with self._lock:
            self._write_held()                # the last request answered, if its own write has not run
            if self._ep is not None:
                stored = self._guarded('commit', self._ep.commit, reason, stats)
                self._ep = None
        if self._store is not None and not self.foreign:
            run = {'episode_id': self.episode_id, 'version': self._version, 'started_at': self._started,
                   'ended_at': time.time(), 'reason': str(reason),
                   'actions': int(stats.get('actions', 0) or 0), 'underruns': int(stats.get('underruns', 0) or 0),
                   'latency_p95_ms': _finite(stats.get('latency_p95_ms', 0.0)),
                   'captured': int(stored is not None)}
            try:
                self._store.record_run(run)
            except Exception as exc:  # the scoreboard must not break serving
                LOG.error('run of episode %s not recorded: %s', self.episode_id, exc)
                self.capture_error = self.capture_error or (f'run of episode {self.episode_id!r} not recorded: '
                                                            f'{clip(exc, 300)}')
        return stored is not None
