"""The Episode stream algorithm: one bidirectional stream = one episode.

Message order: ``EpisodeStart`` -> ``EpisodeStarted{capture, capture_fps, capture_images}``; then each
``ObservationRequest`` -> an ``ActionChunk`` or an in-stream ``Error``; ``Telemetry`` -> capture;
``EpisodeEnd`` -> ``EpisodeEnded`` and the stream closes. Per-request failures (malformed request, policy
exception, overload, not ready) are typed in-stream errors and the stream keeps serving.

The episode ends exactly once (:meth:`ActiveEpisode.end`) with reason:

- the robot's ``EpisodeEnd.reason`` (``completed`` when empty);
- ``disconnect`` when the stream ends without EpisodeEnd (cancelled, dropped, half-closed);
- ``idle_timeout`` after ``idle_timeout_s`` without any message (an Error and EpisodeEnded are sent);
- ``shutdown`` when the worker stops (an Error and EpisodeEnded are sent).

Threads: the gRPC handler thread runs :meth:`EpisodeStream.replies`; a reader thread
``seq-episode-<id>`` moves incoming messages into a queue so that idle time can be measured without
blocking on the network. The reader ends when the call ends; :meth:`EpisodeStream.on_done` (wired to
``context.add_callback``) joins it with a timeout.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from collections.abc import Iterator

from sequence_ai_ros.exceptions import EpisodeStateError, NotReady, SequenceAIError
from sequence_ai_ros.protocol import errors
from sequence_ai_ros.protocol import sequence_ai_pb2 as pb
from sequence_ai_ros.protocol.contract import clip
from sequence_ai_ros.worker.runtime import ActiveEpisode, DeploymentRuntime

LOG = logging.getLogger(__name__)
_CLOSED = object()
_SHUTDOWN = object()


def _error(exc: BaseException, request_id: int = 0) -> pb.EpisodeReply:
    return pb.EpisodeReply(error=errors.to_error(exc, request_id))


class EpisodeStream:
    """Serve one Episode call.

    :param runtime: the deployment.
    :param episode_id: the call's ``x-episode-id`` metadata ('' when absent: EpisodeStart's id is used).
    :param idle_timeout_s: end the episode after this many seconds without a message (s).
    """

    def __init__(self, runtime: DeploymentRuntime, episode_id: str, idle_timeout_s: float) -> None:
        self.runtime = runtime
        self.episode_id = episode_id
        self.idle_timeout_s = idle_timeout_s
        self.active: ActiveEpisode | None = None
        self._inbox: queue.Queue = queue.Queue()
        self._reader: threading.Thread | None = None

    def shutdown(self) -> None:
        """Ask the stream to end its episode (reason ``shutdown``) and close; returns at once."""
        self._inbox.put(_SHUTDOWN)

    def on_done(self) -> None:
        """Call-termination callback: end the episode as ``disconnect`` if still running; join the reader."""
        self._inbox.put(_CLOSED)
        if self.active is not None:
            self.active.end('disconnect', wait=False)
        if self._reader is not None and self._reader is not threading.current_thread():
            self._reader.join(timeout=2.0)

    def _read(self, requests: Iterator[pb.EpisodeRequest]) -> None:
        try:
            for req in requests:
                self._inbox.put(req)
        except Exception as exc:  # grpc raises when the call is cancelled or the peer drops
            LOG.debug('episode %s: request stream ended: %s', self.episode_id, exc)
        finally:
            self._inbox.put(_CLOSED)

    def replies(self, requests: Iterator[pb.EpisodeRequest]) -> Iterator[pb.EpisodeReply]:
        """Consume the robot's messages and yield the replies (the gRPC response iterator)."""
        name = self.episode_id or 'pending'
        self._reader = threading.Thread(target=self._read, args=(requests,), name=f'seq-episode-{name}'[:60],
                                        daemon=True)
        self._reader.start()
        last = time.monotonic()
        try:
            while True:
                try:
                    item = self._inbox.get(timeout=max(0.0, self.idle_timeout_s - (time.monotonic() - last)))
                except queue.Empty:
                    yield from self._close('idle_timeout', f'no message for {self.idle_timeout_s:g} s')
                    return
                last = time.monotonic()
                if item is _CLOSED:
                    if self.active is not None:
                        self.active.end('disconnect', wait=False)
                    return
                if item is _SHUTDOWN:
                    yield from self._close('shutdown', 'the worker is shutting down')
                    return
                kind = item.WhichOneof('kind')
                if kind == 'observation':
                    yield self._observe(item.observation)
                elif kind == 'telemetry':
                    if self.active is None:
                        yield _error(EpisodeStateError('Telemetry before EpisodeStart'))
                    else:
                        self.active.recorder.add_telemetry(list(item.telemetry.frames))
                elif kind == 'start':
                    yield self._start(item.start)
                elif kind == 'end':
                    yield self._end(item.end)
                    return
                else:
                    yield _error(EpisodeStateError('empty EpisodeRequest (no start/observation/telemetry/end)'))
        finally:
            if self.active is not None and not self.active.ended:
                self.active.end('disconnect', wait=False)

    def _close(self, reason: str, why: str) -> Iterator[pb.EpisodeReply]:
        eid = self.active.episode.id if self.active is not None else self.episode_id
        cls = NotReady if reason == 'shutdown' else EpisodeStateError
        yield _error(cls(f'episode {clip(eid)!r} ended ({reason}): {why}'))
        captured = False
        if self.active is not None:
            self.active.end(reason, wait=True)
            captured = self.active.captured
        yield pb.EpisodeReply(ended=self._ended(eid, captured))

    def _start(self, start: pb.EpisodeStart) -> pb.EpisodeReply:
        if self.active is not None:
            return _error(EpisodeStateError(f'episode {self.active.episode.id!r} already started on this stream; '
                                            'open a new stream for a new episode'))
        if self.episode_id and start.episode_id and start.episode_id != self.episode_id:
            return _error(EpisodeStateError(f'EpisodeStart names episode {clip(start.episode_id)!r} but the '
                                            f'stream was opened for {clip(self.episode_id)!r} (x-episode-id)'))
        eid = self.episode_id or start.episode_id or uuid.uuid4().hex
        self.runtime.ensure_loading()
        try:
            self.active = self.runtime.start_episode(eid, start.instruction)
        except SequenceAIError as exc:
            return _error(exc)
        self.episode_id = eid
        rec = self.active.recorder
        return pb.EpisodeReply(started=pb.EpisodeStarted(episode_id=eid, capture=rec.active,
                                                         capture_fps=rec.fps, capture_images=rec.images))

    def _observe(self, req: pb.ObservationRequest) -> pb.EpisodeReply:
        rid = req.request_id
        active = self.active
        if active is None:
            return _error(EpisodeStateError(f'request {rid}: ObservationRequest before EpisodeStart'), rid)
        if req.episode_id and req.episode_id != active.episode.id:
            return _error(EpisodeStateError(f'request {rid}: episode {clip(req.episode_id)!r} on the stream of '
                                            f'{clip(active.episode.id)!r}'), rid)
        if rid <= active.last_request_id:
            return _error(EpisodeStateError(f'request id {rid} not above the previous {active.last_request_id}; '
                                            'request ids must increase strictly'), rid)
        active.last_request_id = rid
        try:
            chunk = self.runtime.infer(active, req)
        except SequenceAIError as exc:
            reply = _error(exc, rid)
            active.recorder.add_request(req, None, reply.error)
            return reply
        except Exception as exc:  # a worker bug: typed, logged, and the stream goes on
            LOG.exception('episode %s request %d: internal error', active.episode.id, rid)
            reply = pb.EpisodeReply(error=pb.Error(code=pb.POLICY_EXCEPTION, request_id=rid,
                                                   message=f'worker internal error: {type(exc).__name__}: {exc}'))
            active.recorder.add_request(req, None, reply.error)
            return reply
        active.requests += 1
        active.recorder.add_request(req, chunk, None)
        return pb.EpisodeReply(chunk=chunk)

    def _end(self, end: pb.EpisodeEnd) -> pb.EpisodeReply:
        if self.active is None:
            return pb.EpisodeReply(ended=pb.EpisodeEnded(episode_id=self.episode_id, captured=False))
        stats = {'actions': end.actions, 'chunks': end.chunks, 'underruns': end.underruns,
                 'underrun_s': end.underrun_s, 'max_seam_jump': end.max_seam_jump,
                 'latency_p95_ms': end.latency_p95_ms}
        self.active.end(end.reason or 'completed', stats, wait=True)
        return pb.EpisodeReply(ended=self._ended(self.active.episode.id, self.active.captured))

    def _ended(self, episode_id: str, captured: bool) -> pb.EpisodeEnded:
        """EpisodeEnded, with the count of telemetry frames capture refused (and the first reason)."""
        rec = self.active.recorder if self.active is not None else None
        return pb.EpisodeEnded(episode_id=episode_id, captured=captured,
                               telemetry_rejected=rec.rejected if rec is not None else 0,
                               telemetry_error=rec.rejected_first if rec is not None else '')
