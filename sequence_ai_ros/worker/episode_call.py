"""Serve one Episode call (:class:`EpisodeCallHandler`): one bidirectional stream = one episode.

Message order: ``EpisodeStart`` -> ``EpisodeStarted{capture, capture_fps, capture_images}``; then each
``ObservationRequest`` -> an ``ActionChunk`` or an in-stream ``Error``; ``Telemetry`` -> capture;
``EpisodeEnd`` -> ``EpisodeEnded`` and the stream closes. Per-request failures (malformed request, policy
exception, overload, not ready) are typed in-stream errors and the stream keeps serving. A request that comes
while the deployment loads is answered NOT_READY at once (never queued) with ``retry_after_s``, the load's
estimated time left: the robot holds and sends a newer observation then, so the first chunk is computed from
what the robot sees when the policy is ready, not when the episode began.

EpisodeEnd is acted on the moment it arrives, never after an inference: the episode's queued requests are
dropped (those still unread behind it on the stream too, unanswered, and one whose JPEG/PNG frames are still
decoding), an inference already running is left to finish and its chunk is discarded (neither sent nor
captured), and EpisodeEnded follows at once
(:meth:`~sequence_ai_ros.worker.runtime.DeploymentRuntime.end_stats` counts all three).

The episode ends exactly once (:meth:`ActiveEpisode.end`) with reason:

- the robot's ``EpisodeEnd.reason`` (``completed`` when empty);
- ``disconnect`` when the stream ends without EpisodeEnd (cancelled, dropped, half-closed);
- ``idle_timeout`` after ``idle_timeout_s`` without episode activity (an Error and EpisodeEnded are sent):
  activity is a real message (EpisodeStart, an ObservationRequest, Telemetry, EpisodeEnd) or the reply to
  one; an empty EpisodeRequest is answered with an error and does *not* reset the timer, so keep-alives
  cannot hold a stream slot;
- a stream that sends no EpisodeStart within ``start_timeout_s`` is closed the same way (``start_timeout``),
  so idle streams cannot hold the worker's stream slots (admission);
- ``shutdown`` when the worker stops (an Error and EpisodeEnded are sent), ``drain_timeout`` when it stops on
  SIGTERM and the episode outlived the drain timeout (likewise), ``rollout`` when a new version that cannot
  load beside the running one replaces it at once (``seq serve --rollout cut``; likewise). A cut is acted on
  the moment it comes, as EpisodeEnd is: a request waiting for its inference or its decode gets no answer.
  After such a cut the call ends once the robot has closed its side (at most
  :data:`~sequence_ai_ros.worker.drain.LINGER_S`), as after a refusal: a balancer resets a call the server ends
  while the robot still sends.

Threads: none of its own. :meth:`EpisodeCallHandler.replies` is a coroutine on the worker's event loop
(``seq-grpc-loop``, gRPC asyncio); a reader *task* moves incoming messages into an inbox (:class:`_Inbox`) so that
idle and start time can be measured without blocking on the network. Inference runs on the deployment's
inference thread, or is sent to its deployment process from the loop itself, and is awaited; episode starts and
ends (usage) run on the loop's small bounded executor (``seq-io``), capture writes (each request and telemetry,
a captured episode's commit) on the worker's ``seq-capture`` threads, the wait for an episode's hook
on the loop itself, JPEG/PNG decoding on the worker's ``seq-decode`` threads (never queued behind ``seq-io``), so
an open stream costs no thread at all, and a slow capture disk holds only captured robots.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import logging
import os
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from google.protobuf.message import DecodeError

import sequence_ai_ros
from sequence_ai_ros.exceptions import EpisodeStateError, NotReady, SequenceAIError, UnknownDeployment
from sequence_ai_ros.protocol import codec, errors, limits, messages, tracing
from sequence_ai_ros.protocol import sequence_ai_pb2 as pb
from sequence_ai_ros.protocol.contract import clip
from sequence_ai_ros.protocol.pipeline import TailSplicer
from sequence_ai_ros.worker.boundary import refuse
from sequence_ai_ros.worker.capture_hook import EpisodeRecorder
from sequence_ai_ros.worker.drain import LINGER_S
from sequence_ai_ros.worker.metrics import UnderrunWatch
from sequence_ai_ros.worker.runtime import HOOK_WAIT_S, ActiveEpisode, DeploymentRuntime, describe
from sequence_ai_ros.worker.scheduler import LoopFuture

LOG = logging.getLogger(__name__)
_CLOSED = object()
_SHUTDOWN = object()
#: The reasons the worker cuts a live episode with (:meth:`EpisodeCallHandler.shutdown`), and what the robot is
#: told; each is a retryable NotReady.
CUT_WHY = {'shutdown': 'the worker is shutting down',
           'drain_timeout': 'the worker is stopping and its drain timeout passed',
           'rollout': 'a new version of the deployment replaces the running one at once (seq serve --rollout cut)'}
_UNDECODABLE = object()


_PENDING = object()
#: How long the loop polls a fast inference before the thread->loop hand-off (s). Polls are bare loop passes
#: (``sleep(0)``), never timed sleeps: a sub-millisecond asyncio timer costs a whole millisecond on an idle
#: loop (epoll's timeout is in ms, rounded up), which put ~1 ms into the round trip's tail.
QUICK_WAIT_S = 0.0002
#: The quick wait of a deployment process's inference (s): none. One run by the inference thread: polling would
#: keep the loop thread taking the GIL from the inference thread, which needs it to read the answer; the loop
#: sleeps instead and the inference thread wakes it once (:meth:`EpisodeCallHandler._await_inference`). One sent
#: from the loop itself (:class:`~sequence_ai_ros.worker.scheduler.LoopFuture`) is settled by the loop when the
#: process's answer makes its socket readable: the loop sleeps in ``epoll`` until then and the future's callback
#: wakes this stream directly (no thread hand-off). Polling it (a ``select(0)`` pass per ``sleep(0)``) cost the
#: worker about 0.1 ms of CPU per request for a 0 ms policy, and took a core from the deployment process.
QUICK_WAIT_ISOLATED_S = 0.0


class _Failed:
    """The inference future's exception, carried out of :func:`_quick_wait`."""

    __slots__ = ('exc',)

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


async def _quick_wait(future: concurrent.futures.Future, wait_s: float = QUICK_WAIT_S) -> Any:
    """Poll ``future`` for up to ``wait_s`` (s), yielding the loop (one pass, no timer) between polls.

    A fast inference (a 0 ms policy answers in tens of microseconds) is then picked up without
    ``wrap_future``'s hand-off (a task, a self-pipe write and wake-up per request); other streams keep
    running in between, and each pass's ``select(0)`` lets the inference thread take the GIL.

    :returns: the future's result, a :class:`_Failed` holding its exception, or ``_PENDING`` when it
        is still running after the quick wait (the caller then awaits it the slow way, with deadlines).
    """
    deadline = time.monotonic() + wait_s
    while not future.done():
        if time.monotonic() >= deadline:
            return _PENDING
        await asyncio.sleep(0)
    exc = future.exception()
    return _Failed(exc) if exc is not None else future.result()


class _Deadline:
    """A deadline on the event loop that costs no timer to move: ``fire()`` runs once the latest one set passes.

    A timer per wait (``call_later`` and its ``cancel``: a handle, a heap push, a cancelled entry the loop
    sweeps) cost every request two of them (the inbox's wait and the inference's slice). Here one timer stays
    armed across waits: when it fires before the deadline set since, it is re-armed for that (about once per
    deadline's length, not once per request). Loop thread only.

    :param loop: the event loop.
    :param fire: called (loop thread) when the deadline set last passes, unless cleared or moved since.
    """

    __slots__ = ('_armed', '_fire', '_loop', '_timer', '_when')

    def __init__(self, loop: asyncio.AbstractEventLoop, fire: Callable[[], None]) -> None:
        self._loop = loop
        self._fire = fire
        self._when: float | None = None     # the deadline (loop time, s), or None: nothing due
        self._timer: asyncio.TimerHandle | None = None
        self._armed = 0.0                   # when the timer fires (loop time, s)

    def set(self, delay: float) -> None:
        """Fire ``delay`` seconds from now (replacing the deadline set before)."""
        when = self._loop.time() + max(0.0, delay)
        self._when = when
        if self._timer is None or self._armed > when:
            if self._timer is not None:
                self._timer.cancel()
            self._armed = when
            self._timer = self._loop.call_at(when, self._due)

    def clear(self) -> None:
        """Nothing is due (the timer, if armed, fires and finds nothing)."""
        self._when = None

    def close(self) -> None:
        """Nothing is due and the timer goes (the stream ended: nothing holds it alive any more)."""
        self._when = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _due(self) -> None:
        self._timer = None
        when = self._when
        if when is None:
            return
        if when <= self._armed:
            self._when = None
            self._fire()
        else:          # moved since the timer was armed: wait for the new deadline
            self._armed = when
            self._timer = self._loop.call_at(when, self._due)


class _Inbox:
    """The stream's incoming messages in order, for one consumer on the event loop.

    Cheaper per message than ``asyncio.Queue`` + ``wait_for`` (a task, a getter future and a timer per
    wait, and two more loop passes before the consumer runs): a message that finds the consumer waiting is
    handed to its future directly; otherwise it waits in a deque. The wait's timeout is a :class:`_Deadline`,
    not a timer per wait. Loop thread only (``put`` included).
    """

    __slots__ = ('_deadline', '_items', '_loop', '_waiter')

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._items: collections.deque = collections.deque()
        self._loop = loop
        self._waiter: asyncio.Future | None = None
        self._deadline = _Deadline(loop, self._expire)

    def put(self, item: Any) -> bool:
        """Queue ``item`` (or hand it to the waiting consumer); True when handed over (the consumer runs next)."""
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            self._waiter = None
            waiter.set_result(item)
            return True
        self._items.append(item)
        return False

    async def get(self, timeout: float) -> Any:
        """Return the next item; wait up to ``timeout`` (s) for one.

        :raises asyncio.TimeoutError: when none came within ``timeout``.
        """
        if self._items:
            return self._items.popleft()
        waiter = self._waiter = self._loop.create_future()
        self._deadline.set(timeout)
        try:
            return await waiter
        finally:
            self._deadline.clear()
            if self._waiter is waiter:
                self._waiter = None

    def close(self) -> None:
        """The stream ended: its wait's timer goes."""
        self._deadline.close()

    def _expire(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_exception(asyncio.TimeoutError())


#: An Episode request as the stream hands it over: (message, size on the wire in bytes), or a bare message.
Request = tuple[pb.EpisodeRequest, int] | pb.EpisodeRequest


class Undecodable(Exception):  # noqa: N818 - the stream's own signal, turned into a status by the servicer
    """A message on the Episode stream was not an EpisodeRequest: the call fails with INVALID_ARGUMENT."""


def parse_request(data: bytes) -> tuple[pb.EpisodeRequest | None, int]:
    """The Episode stream's request deserializer: the message and its size on the wire (bytes).

    The size checks a request against its contract's limit without ``ByteSize()``, which in upb
    re-encodes the whole message (~300 KB for two raw 224x224 frames) just to measure it.

    :returns: ``(None, size)`` for bytes that are not an EpisodeRequest: the stream then fails the call with
        a status (:class:`Undecodable`), never ends it as if the robot had closed it.
    """
    try:
        return pb.EpisodeRequest.FromString(data), len(data)
    except DecodeError:
        return None, len(data)


def _has_encoded_images(req: pb.ObservationRequest) -> bool:
    """True when ``req`` carries a JPEG/PNG frame (costly to decode); raw frames decode in a copy."""
    return (any(image.encoding != 'raw' for image in req.images)
            or any(image.encoding != 'raw' for frame in req.history for image in frame.images))


#: At most this many jobs decode one request's JPEG/PNG frames side by side (a run of frames each), and only
#: while the cores are free of other requests' decoding (:class:`_Decoding`): a request with many frames takes no
#: more of the ``seq-decode`` threads than two robots' requests did, and under load each request is one run.
FRAME_JOBS = 2
_CORES = os.cpu_count() or 1


class _Decoding:
    """The runs of frames decoding now, across this process's streams (any thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.runs = 0

    def take(self, wanted: int) -> int:
        """Runs for a request that could use ``wanted``: all of them while the cores have room, else one."""
        with self._lock:
            got = wanted if self.runs + wanted <= _CORES else 1
            self.runs += got
            return got

    def give_back(self, runs: int) -> None:
        """A request's ``runs`` are done."""
        with self._lock:
            self.runs -= runs


_DECODING = _Decoding()


class _Frame:
    """A JPEG/PNG frame's place in a checked request until its pixels are decoded."""

    __slots__ = ('array',)

    def __init__(self) -> None:
        self.array: Any = None


class _Wanted:
    """Whether a request still waits for its frames (False once its episode ended or its stream went)."""

    __slots__ = ('yes',)

    def __init__(self) -> None:
        self.yes = True


def _decode_run(images: list[pb.Image], wanted: _Wanted) -> list[Any]:
    """Decode ``images`` in order, as :func:`~sequence_ai_ros.protocol.messages.unpack_observation` does.

    A run whose request no longer waits when its turn comes decodes nothing: a robot that ends episode after
    episode while its frames are queued leaves no decoding behind it for the other robots to wait on. The run
    is given back (:data:`_DECODING`) here, on its thread, once done.
    """
    try:
        if not wanted.yes:
            return []
        return [codec.decode_image(image, max_pixels=messages.MAX_PIXELS) for image in images]
    finally:
        _DECODING.give_back(1)


def _error(exc: BaseException, request_id: int = 0) -> pb.EpisodeReply:
    return pb.EpisodeReply(error=errors.to_error(exc, request_id))


class _EndArrived(Exception):  # noqa: N818 - a signal, not an error
    """The episode's EpisodeEnd arrived while a request was being served: the request gets no reply.

    ``started``: its inference had started (its result is discarded) rather than never starting.
    ``counted``: the scheduler already counted it as dropped.
    """

    def __init__(self, started: bool, counted: bool = False) -> None:
        super().__init__('episode ended')
        self.started, self.counted = started, counted


def _dropped_why(end: pb.EpisodeEnd) -> str:
    """Why an episode whose EpisodeEnd carries ``capture_error`` is not kept (told to the robot)."""
    return f'the robot stopped its capture: {clip(limits.printable(end.capture_error[:800]), 400)}'


def _settle(active: ActiveEpisode, reason: str, stats: dict[str, Any] | None) -> None:
    """Finish whatever of ``active``'s end has not run (:meth:`ActiveEpisode.settle`); a failure is logged."""
    try:
        active.settle(reason, stats)
    except Exception as exc:  # a full disk (usage, index): nobody is left to tell but the log
        LOG.error('episode %s: end of episode failed: %s', active.episode.id, describe(exc))


class EpisodeCallHandler:
    """Serve one Episode call on the event loop.

    :param runtime: the deployment.
    :param episode_id: the call's ``x-episode-id`` metadata ('' when absent: EpisodeStart's id is used).
    :param idle_timeout_s: end the episode after this many seconds without a message (s).
    :param start_timeout_s: close the stream when no EpisodeStart came within this many seconds (s).
    :param client: who holds the stream (an address), for the per-client cap and logs.
    :param owner: the caller's identity (:mod:`sequence_ai_ros.worker.identity`), the owner its episode records.
    :param before_start: called (on the executor) before an episode starts, with the runtime; False: the
        deployment is no longer served (``seq delete``), and the EpisodeStart gets UNKNOWN_DEPLOYMENT.
    :param start_refusal: called (on the loop) when EpisodeStart arrives: the refusal of a new episode (the
        worker drains), or None. A refused start gets it as the stream's answer, and the stream then ends
        once the robot closed its side (bounded), as a stream refused when it opened does.
    :param traceparent: the call's W3C ``traceparent`` metadata: when the worker traces
        (:mod:`~sequence_ai_ros.protocol.tracing`), the episode's spans continue the robot's trace.
    :param decoder: where JPEG/PNG frames are decoded (the worker's ``seq-decode`` threads); None: the loop's
        executor.
    :param capture_io: where capture files are written (the worker's ``seq-capture`` threads); None: the loop's
        executor.
    """

    def __init__(self, runtime: DeploymentRuntime, episode_id: str, idle_timeout_s: float,
                 start_timeout_s: float = float('inf'), client: str = '',
                 before_start: Callable[[DeploymentRuntime], bool] | None = None,
                 start_refusal: Callable[[], SequenceAIError | None] | None = None, owner: str = '',
                 traceparent: str = '', decoder: concurrent.futures.Executor | None = None,
                 capture_io: concurrent.futures.Executor | None = None) -> None:
        self.runtime = runtime
        self._decoder = decoder
        self._capture_io = capture_io
        self.owner = owner
        self.before_start = before_start
        self.start_refusal = start_refusal
        self.episode_id = episode_id
        self.idle_timeout_s = idle_timeout_s
        self.start_timeout_s = start_timeout_s
        self.client = client
        self.active: ActiveEpisode | None = None
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()   # the loop's thread: a callback there wakes a wait directly
        self._inbox = _Inbox(self._loop)
        self._splicer = TailSplicer()   # fills chunk_tail of pipelined requests from answers not yet received
        self._to_capture: EpisodeRecorder | None = None   # holds the request answered last, written after its reply
        self._end_seen = asyncio.Event()   # the robot's EpisodeEnd has arrived (it may still wait in the inbox)
        self._end_dropped = 0              # queued requests the scheduler dropped when it arrived
        self._waiter: asyncio.Future | None = None   # what _woken sleeps on (loop thread)
        self._slice = _Deadline(self._loop, self._wake)   # the end of _await_inference's wait slice
        self._cut = 'shutdown'             # the reason of a cut by the worker (shutdown, drain_timeout, rollout)
        self._started_at: float | None = None   # when EpisodeStart came (monotonic s): time to first chunk
        self._underruns = UnderrunWatch(runtime.contract.dt)  # underruns in this episode's telemetry, live
        self._traceparent = traceparent
        self._trace: tracing.WorkerTrace | None = None   # the episode's spans, when the worker traces

    def shutdown(self, reason: str = 'shutdown') -> None:
        """Ask the stream to end its episode (:data:`CUT_WHY`'s reasons) and close; at once; any thread.

        At once, as at the robot's EpisodeEnd: a request waiting for its inference or its frames' decode is not
        answered (the inference is left to finish, its chunk discarded), those queued never start, and the
        robot gets the cut's error and EpisodeEnded without waiting for them.
        """
        self._cut = reason
        self._loop.call_soon_threadsafe(self._cut_now)

    def _cut_now(self) -> None:
        """The worker cuts the episode (loop thread): no request of it starts or is answered; the stream ends it."""
        self._end_arrived()
        self._inbox.put(_SHUTDOWN)

    def on_done(self) -> None:
        """The call ended: end the episode as ``disconnect`` if still running (in the background).

        A request answered and not written yet (the robot left while its reply went out, or the stream was cut
        while the write waited for a thread) is written by the episode's commit, first.
        """
        self._to_capture = None
        if self._trace is not None:
            self._trace.end('disconnect')
        active = self.active
        if active is not None and not active.finished:   # never ended, or its end cut short
            self._loop.run_in_executor(self._writer(active), _settle, active, 'disconnect', None)

    async def _read(self, requests: AsyncIterator[Request]) -> None:
        try:
            async for req in requests:   # (message, wire bytes) from parse_request, or a bare message
                item = req if isinstance(req, tuple) else (req, None)
                if item[0] is None:
                    self._inbox.put(_UNDECODABLE)
                    return
                if item[0].WhichOneof('kind') == 'end':
                    self._end_arrived(item[0].end)
                if self._inbox.put(item):
                    # the consumer, waiting, takes it in the loop's next pass: this stream's next read starts
                    # after that (its request sent to the policy), off the round trip
                    await asyncio.sleep(0)
        except Exception as exc:  # grpc raises when the call is cancelled or the peer drops
            LOG.debug('episode %s: request stream ended: %s', self.episode_id, exc)
        finally:
            self._inbox.put(_CLOSED)

    def _end_arrived(self, end: pb.EpisodeEnd | None = None) -> None:
        """EpisodeEnd came in, or the worker cuts the episode (``end`` None): no request of it starts from now on.

        The consumer is woken.

        With ``capture_error`` (the robot stopped its capture) none of the episode is kept, decided here: a
        stream cut before the end is handled keeps none of it either.
        """
        if end is not None and end.capture_error and self.active is not None:   # also after the worker's cut
            self.active.recorder.drop(_dropped_why(end))
        if self._end_seen.is_set():
            return
        self._end_seen.set()
        if self.active is not None:
            self._end_dropped = self.active.end_arrived()
        self._wake()

    async def _io(self, fn: Any, *args: Any) -> Any:
        """Run blocking work (SQLite, registry and live files) on the loop's bounded executor."""
        return await self._loop.run_in_executor(None, fn, *args)

    async def _write(self, fn: Any, *args: Any) -> Any:
        """Run a capture write on the worker's capture threads."""
        return await self._loop.run_in_executor(self._capture_io, fn, *args)

    def _writer(self, active: ActiveEpisode | None) -> concurrent.futures.Executor | None:
        """Where ``active``'s end runs: the capture threads when it commits capture, else the loop's executor."""
        return self._capture_io if active is not None and active.recorder.active else None

    async def replies(self, requests: AsyncIterator[Request]) -> AsyncIterator[pb.EpisodeReply]:
        """Consume the robot's messages and yield the replies (the gRPC response stream).

        :param requests: the call's requests: ``(message, size on the wire)`` as :func:`parse_request` gives
            them, or bare messages (their size is then measured when checked).
        """
        reader = asyncio.ensure_future(self._read(requests))
        last = opened = time.monotonic()
        try:
            while True:
                now = time.monotonic()
                wait = self.idle_timeout_s - (now - last)
                if self.active is None:
                    wait = min(wait, self.start_timeout_s - (now - opened))
                try:
                    item = await self._inbox.get(wait)
                except asyncio.TimeoutError:
                    if self.active is None and time.monotonic() - opened >= self.start_timeout_s:
                        LOG.info('stream from %s closed: no EpisodeStart within %g s', self.client or '?',
                                 self.start_timeout_s)
                        async for reply in self._close('start_timeout',
                                                       f'no EpisodeStart within {self.start_timeout_s:g} s'):
                            yield reply
                    else:
                        async for reply in self._close('idle_timeout', f'no message for {self.idle_timeout_s:g} s'):
                            yield reply
                    return
                if item is _CLOSED:
                    return
                if item is _UNDECODABLE:
                    if self.active is not None:
                        await self._end_episode('error', None)
                    raise Undecodable('a message on the Episode stream is not an EpisodeRequest (undecodable '
                                      'protobuf); the call is closed')
                if item is _SHUTDOWN:
                    async for reply in self._close(self._cut, CUT_WHY[self._cut]):
                        yield reply
                    # the robot closes its side once it read them: a balancer (HAProxy 2.6) resets a call the
                    # server ends while the robot still sends, and the reset can overtake the Error
                    await self._linger()
                    return
                item, nbytes = item
                kind = item.WhichOneof('kind')
                try:   # the boundary: every value within the wire schema's limits (past its size: decode refuses)
                    if not (kind == 'observation' and nbytes is not None and nbytes > self.runtime.max_message_bytes):
                        limits.check_request(item)
                except limits.LimitViolation as exc:
                    rid = item.observation.request_id if kind == 'observation' else 0
                    yield _error(refuse(self.runtime, exc), rid)
                    continue
                if kind is not None:          # a real message: episode activity (an empty one is not)
                    last = time.monotonic()
                if kind == 'observation':
                    if self._end_seen.is_set():   # unread behind the episode's end: never started, unanswered
                        self.runtime.count_at_end(dropped=1)
                        continue
                    answer = await self._observe(item.observation, nbytes)
                    last = time.monotonic()           # a slow inference is activity until its reply
                    if answer is not None:
                        yield answer
                        if self._trace is not None:
                            self._trace.sent()
                        await self._capture_request()   # after the reply went out: off the round trip
                elif kind == 'telemetry':
                    if self.active is not None:   # live underruns, whether captured or not
                        live = self._underruns.observe(item.telemetry.frames)
                        self.runtime.metrics.underruns(self.runtime.name, *live)
                        self.active.live.underran(*live)
                    if self.active is None:
                        yield _error(EpisodeStateError('Telemetry before EpisodeStart'))
                    elif self.active.recorder.active:   # held until written: a stream cut meanwhile loses none
                        self.active.recorder.hold_telemetry(list(item.telemetry.frames))
                        await self._write(self.active.recorder.write_held)
                elif kind == 'start':
                    refusal = self.start_refusal() if self.start_refusal is not None and self.active is None else None
                    if refusal is not None:   # the stream opened before the drain began: refused as at its open
                        yield _error(refusal)
                        await self._linger()
                        return
                    yield await self._start(item.start)
                elif kind == 'end':
                    for reply in await self._end(item.end):
                        yield reply
                    return
                else:
                    yield _error(EpisodeStateError('empty EpisodeRequest (no start/observation/telemetry/end)'))
        finally:
            reader.cancel()
            self._inbox.close()
            self._slice.close()
            self.on_done()

    async def _linger(self, linger_s: float = LINGER_S) -> None:
        """After a refusal or a cut: wait up to ``linger_s`` for the robot to close its side, ignoring what it sends.

        A request of the cut episode read meanwhile never starts: it is counted as dropped at the episode's end.
        """
        deadline = time.monotonic() + linger_s
        while (left := deadline - time.monotonic()) > 0:
            try:
                item = await self._inbox.get(left)
            except asyncio.TimeoutError:
                return
            if item is _CLOSED:
                return
            if (self.active is not None and type(item) is tuple
                    and item[0].WhichOneof('kind') == 'observation'):
                self.runtime.count_at_end(dropped=1)

    async def _close(self, reason: str, why: str) -> AsyncIterator[pb.EpisodeReply]:
        eid = self.active.episode.id if self.active is not None else self.episode_id
        cls = NotReady if reason in CUT_WHY else EpisodeStateError   # a cut by the worker: retry (NotReady)
        yield _error(cls(f'episode {clip(eid)!r} ended ({reason}): {why}'))
        captured, failure = False, ''
        if self.active is not None:
            failure = await self._end_episode(reason, None)
            captured = self.active.captured
        yield pb.EpisodeReply(ended=self._ended(eid, captured, failure))

    async def _start(self, start: pb.EpisodeStart) -> pb.EpisodeReply:
        if self.active is not None:
            return _error(EpisodeStateError(f'episode {self.active.episode.id!r} already started on this stream; '
                                            'open a new stream for a new episode'))
        if self.episode_id and start.episode_id and start.episode_id != self.episode_id:
            return _error(EpisodeStateError(f'EpisodeStart names episode {clip(start.episode_id)!r} but the '
                                            f'stream was opened for {clip(self.episode_id)!r} (x-episode-id)'))
        eid = self.episode_id or start.episode_id or uuid.uuid4().hex
        if self.before_start is not None and not await self._io(self.before_start, self.runtime):
            return _error(UnknownDeployment(f'deployment {self.runtime.name!r} was deleted (seq delete) since this '
                                            'stream opened: it is not served here any more'))
        self._started_at = time.monotonic()
        self.runtime.ensure_loading()
        try:
            store = self.runtime.capture_store
            if store is None:
                self.active = self.runtime.start_episode(eid, start.instruction, start.client_id, self.owner)
            else:  # opening a captured episode touches its store's files
                self.active = await self._io(self.runtime.start_episode, eid, start.instruction, start.client_id,
                                             self.owner)
        except SequenceAIError as exc:
            return _error(exc)
        self.episode_id = eid
        if tracing.TRACER is not None:
            self._trace = tracing.WorkerTrace(tracing.TRACER, self._traceparent, {
                'seq.episode_id': eid, 'seq.deployment': self.runtime.name, 'seq.version': self.runtime.version,
                'seq.robot': start.client_id})
        rec = self.active.recorder
        return pb.EpisodeReply(started=pb.EpisodeStarted(episode_id=eid, capture=rec.active,
                                                         capture_fps=rec.fps, capture_images=rec.images,
                                                         capture_error=rec.not_captured,
                                                         worker_version=sequence_ai_ros.__version__,
                                                         deployment_version=self.runtime.version))

    async def _infer(self, active: ActiveEpisode, req: pb.ObservationRequest, nbytes: int | None) -> pb.ActionChunk:
        """Decode (raw frames inline; JPEG/PNG on the executor), queue, await the inference thread, pack.

        :raises _EndArrived: when the episode's EpisodeEnd arrives first (the wait ends at once).
        """
        runtime = self.runtime
        if _has_encoded_images(req):
            runtime.check_ready()      # a request refused while the deployment warms costs no decoding
            inp = await self._decode_encoded(req, nbytes)
        else:
            inp = runtime.decode(req, nbytes)                   # raw frames and state: a copy, cheaper than a hop
        if self._end_seen.is_set():
            raise _EndArrived(started=False)
        if self._trace is not None:     # the policy's deployment process continues the trace under this request
            inp.trace_context = self._trace.current
        future = runtime.submit(active, req, inp)
        quick = QUICK_WAIT_ISOLATED_S if runtime.isolated or isinstance(future, LoopFuture) else QUICK_WAIT_S
        result = await _quick_wait(future, quick) if quick > 0 or future.done() else _PENDING
        if self._end_seen.is_set():   # it came during the quick wait: whatever the result, it is not sent
            raise _EndArrived(started=not self._end_dropped, counted=bool(self._end_dropped))
        if result is _PENDING:
            result = await self._await_inference(active, req, future)
        elif isinstance(result, _Failed):
            if isinstance(result.exc, SequenceAIError):
                runtime.on_failure(result.exc)
            raise result.exc
        return runtime.finish(active, req, result)

    async def _decode_encoded(self, req: pb.ObservationRequest, nbytes: int | None) -> messages.PolicyInput:
        """Decode a request with JPEG/PNG frames: every check first, then the pixels, in up to :data:`FRAME_JOBS` jobs.

        The request is checked whole on the loop (size, state, cameras, history; raw frames are a copy), with a
        placeholder for each encoded frame, so a refused request costs no decoding and gets the refusal it always
        did. Its frames then decode on the ``seq-decode`` threads, never behind what waits on ``seq-io``: split into
        :data:`FRAME_JOBS` runs side by side while the cores have room (decoding releases the GIL: two cameras cost
        one camera's time on two cores), else in one run, as when other robots' frames keep the cores busy.

        The episode's EpisodeEnd ends the wait at once: the request is dropped unanswered, its decode left to finish.

        :raises ContractViolation: for a request the contract refuses, or the first frame, in the request's order,
            that does not decode.
        :raises _EndArrived: when the episode's EpisodeEnd arrives first.
        """
        frames: list[tuple[pb.Image, _Frame]] = []

        def later(image: pb.Image) -> _Frame:
            frame = _Frame()
            frames.append((image, frame))
            return frame

        inp = self.runtime.decode(req, nbytes, decode=later)
        n = len(frames)
        jobs = _DECODING.take(min(FRAME_JOBS, n))
        runs = [frames[k * n // jobs:(k + 1) * n // jobs] for k in range(jobs)]
        started: list[asyncio.Future] = []
        wanted = _Wanted()
        try:
            for run in runs:     # each run counts until its thread is done with it (_decode_run)
                started.append(self._loop.run_in_executor(self._decoder, _decode_run, [im for im, _ in run],
                                                          wanted))
        except BaseException:
            _DECODING.give_back(jobs - len(started))
            wanted.yes = False
            raise
        decoding = asyncio.gather(*started, return_exceptions=True)
        decoding.add_done_callback(lambda _: self._wake())
        try:
            while not (decoding.done() or self._end_seen.is_set()):   # the robot's EpisodeEnd never waits for it
                await self._woken()
        finally:
            if not decoding.done():      # the episode ended, or the stream went: runs not begun decode nothing
                wanted.yes = False
        if self._end_seen.is_set():     # the runs already decoding finish on their threads, unused
            raise _EndArrived(started=False)
        done = decoding.result()
        for run, got in zip(runs, done, strict=True):    # in the request's order: the earliest failure first
            if isinstance(got, BaseException):
                raise got
            for (_, frame), array in zip(run, got, strict=True):
                frame.array = array
        for obs in inp.history:   # the current observation is the last
            for key, value in obs.images.items():
                if type(value) is _Frame:
                    obs.images[key] = value.array
        return inp

    async def _await_inference(self, active: ActiveEpisode, req: pb.ObservationRequest,
                               future: concurrent.futures.Future) -> Any:
        """Await the inference thread's ``future`` in slices (the deadline, a robot gone), or the episode's end.

        One loop future per slice, woken by whichever comes first: the future's done callback (from the inference
        thread: one ``call_soon_threadsafe``; on the loop itself, a future the loop settles: a direct wake-up), the
        episode's end (:meth:`_end_arrived`) or the slice's end (a :class:`_Deadline`: no timer per request). No
        task per request, no self-pipe write beyond the one wake-up from another thread.
        """
        runtime = self.runtime
        loop = self._loop
        loop_thread = self._loop_thread

        def wake(_: concurrent.futures.Future) -> None:     # the inference thread, or the loop (LoopFuture, done)
            if threading.get_ident() == loop_thread:
                self._wake()
                return
            try:
                loop.call_soon_threadsafe(self._wake)
            except RuntimeError:      # the loop has closed (the worker stopped): nobody waits any more
                pass

        future.add_done_callback(wake)
        while True:
            if self._end_seen.is_set():
                # Not waited for: dropped from the queue (counted there), or running (its result discarded).
                raise _EndArrived(started=not self._end_dropped, counted=bool(self._end_dropped))
            if future.done():
                try:
                    return future.result()
                except SequenceAIError as exc:
                    runtime.on_failure(exc)
                    raise
            self._slice.set(runtime.wait_slice_s)
            try:
                await self._woken()
            finally:
                self._slice.clear()
            if not (future.done() or self._end_seen.is_set()):
                runtime.check_wait(active, req)

    async def _woken(self) -> None:
        """Sleep until :meth:`_wake` (loop thread): the wait for an inference or for a request's frames."""
        self._waiter = waiter = self._loop.create_future()
        try:
            await waiter
        finally:
            self._waiter = None

    def _wake(self) -> None:
        """Wake :meth:`_woken` (loop thread): an inference or a decode is done, the episode ended or a slice passed."""
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _observe(self, req: pb.ObservationRequest, nbytes: int | None = None) -> pb.EpisodeReply | None:
        """Serve one request: its chunk or a typed error; None when the episode's end arrived first (no reply)."""
        rid = req.request_id
        arrived = time.monotonic()
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
        if self._trace is not None:
            self._trace.arrived(req.trace_context, rid, time.time_ns() - int((time.monotonic() - arrived) * 1e9))
        chunk = None
        try:
            self._splicer.complete(req, self.runtime.definition.contract.action_dim)   # pipelined requests
            live = active.live            # the admin API's in_flight (as live.serving(), without a generator)
            live.in_flight += 1
            try:
                chunk = await self._infer(active, req, nbytes)
            finally:
                live.in_flight -= 1
            self._splicer.record(req, chunk)
            reply = pb.EpisodeReply(chunk=chunk)
        except _EndArrived as cut:
            if cut.started:
                self.runtime.count_at_end(discarded=1)
            elif not cut.counted:
                self.runtime.count_at_end(dropped=1)
            return None
        except SequenceAIError as exc:
            reply = _error(exc, rid)
        except (concurrent.futures.CancelledError, asyncio.CancelledError):
            raise
        except Exception as exc:  # a worker bug: typed, logged, and the stream goes on
            LOG.exception('episode %s request %d: internal error', active.episode.id, rid)
            reply = pb.EpisodeReply(error=pb.Error(code=pb.POLICY_EXCEPTION, request_id=rid,
                                                   message=f'worker internal error: {type(exc).__name__}: {exc}'))
        if chunk is not None:
            first = arrived - self._started_at if not active.requests and self._started_at is not None else None
            self.runtime.metrics.timed(self.runtime.name, time.monotonic() - arrived,
                                       chunk.timings.queue_wait_ms / 1000.0, first)
            active.requests += 1
            self.runtime.metrics.request(self.runtime.name, 'chunk')
        else:
            self.runtime.metrics.request(self.runtime.name, pb.ErrorCode.Name(reply.error.code))
        if active.recorder.active:
            active.recorder.hold(req, chunk, None if chunk is not None else reply.error)
            self._to_capture = active.recorder
        if self._trace is not None:
            self._trace.answered(chunk.timings.queue_wait_ms if chunk is not None else 0.0,
                                 chunk.timings.inference_ms if chunk is not None else 0.0,
                                 '' if chunk is not None else reply.error.message)
        return reply

    async def _capture_request(self) -> None:
        """Capture the request just answered (its chunk or error), before the stream's next message is read."""
        recorder, self._to_capture = self._to_capture, None
        if recorder is not None:
            await self._write(recorder.write_held)

    async def _end(self, end: pb.EpisodeEnd) -> list[pb.EpisodeReply]:
        """End the episode on the robot's EpisodeEnd: EpisodeEnded always, after an Error per refused value.

        A value outside its limit (a NaN latency, an unprintable reason) is refused alone: the robot gets
        a CONTRACT_VIOLATION naming it, and the episode ends without it (a refused reason ends it as ``error``).
        With ``capture_error`` (the robot stopped its capture) none of the episode's data is kept, and
        EpisodeEnded's ``capture_error`` says so.
        """
        reason, stats, bad = limits.end_stats(end)
        replies = [_error(refuse(self.runtime, exc)) for exc in bad]
        if self.active is None:
            return [*replies, pb.EpisodeReply(ended=pb.EpisodeEnded(episode_id=self.episode_id, captured=False))]
        if end.capture_error:     # the robot stopped its capture: the episode's commit aborts its files
            self.active.recorder.drop(_dropped_why(end))
        failure = await self._end_episode(reason, stats)
        return [*replies, pb.EpisodeReply(ended=self._ended(self.active.episode.id, self.active.captured, failure))]

    async def _end_episode(self, reason: str, stats: dict[str, Any] | None) -> str:
        """End the episode (hook, capture commit, usage); return '' or why a write failed (the robot is told)."""
        active = self.active
        if active is None:      # callers end only a started episode
            return ''
        trace = self._trace
        try:
            with trace.commit() if trace is not None else contextlib.nullcontext():
                try:
                    first, hook = await self._io(active.begin_end, reason)
                    if not first:
                        return ''
                    if hook is not None:      # awaited here: no seq-io thread is held while the policy runs it
                        await self._await_hook(hook, active)
                    await self._loop.run_in_executor(self._writer(active), active.finish_end, reason, stats)
                except asyncio.CancelledError:    # the robot left, the worker stops: the end completes all the same
                    self._settle_later(active, reason, stats)
                    raise
        except Exception as exc:  # a full disk (usage, index): the episode has ended; EpisodeEnded names it
            LOG.error('episode %s: end of episode failed: %s', active.episode.id, describe(exc))
            return f'ending episode {active.episode.id!r}: {clip(describe(exc), 300)}'
        finally:
            if trace is not None:
                trace.end(reason)
        return ''

    async def _await_hook(self, hook: concurrent.futures.Future, active: ActiveEpisode) -> None:
        """Wait up to :data:`HOOK_WAIT_S` for the episode's hook (its failure is logged where it runs)."""
        try:
            await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(hook)), HOOK_WAIT_S)
        except Exception as exc:      # past HOOK_WAIT_S, or the hook failed: EpisodeEnded all the same
            LOG.debug('hook wait for %s: %s', active.episode.id, exc)

    def _settle_later(self, active: ActiveEpisode, reason: str, stats: dict[str, Any] | None) -> None:
        """The stream was cancelled while ending ``active``: finish its end on the executor (never cancelled)."""
        try:
            self._loop.run_in_executor(self._writer(active), _settle, active, reason, stats)
        except RuntimeError:          # the executor has shut down (the worker stops): here, once
            _settle(active, reason, stats)

    def _ended(self, episode_id: str, captured: bool, failure: str = '') -> pb.EpisodeEnded:
        """EpisodeEnded, with the count of telemetry frames capture refused (and the first reason).

        ``capture_error``: why the episode was not kept (a store write failed) or a write at its end failed.
        """
        rec = self.active.recorder if self.active is not None else None
        error = (rec.capture_error if rec is not None else '') or failure
        return pb.EpisodeEnded(episode_id=episode_id, captured=captured,
                               telemetry_rejected=rec.rejected if rec is not None else 0,
                               telemetry_error=rec.rejected_first if rec is not None else '',
                               capture_error=error)
