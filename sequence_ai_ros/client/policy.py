"""``connect()`` and :class:`Policy`: a remote policy driven by a local control loop.

One :class:`Policy` per control loop (many robots, many ``connect()`` calls). ``act``/``run`` pace
themselves at the chunk's dt with absolute deadlines; loops that pace themselves (the ROS node, a plain
``while running: next_action(observe())``) use :meth:`Policy.next_action` (never blocks; opens an episode
when none is open), optionally :meth:`Policy.begin_episode` first, and :meth:`Policy.end_episode`.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import numpy as np

from sequence_ai_ros.client import checks, driving
from sequence_ai_ros.client.adapter import ObservationAdapter, check_fit
from sequence_ai_ros.client.driving import ActFn, ObserveFn
from sequence_ai_ros.client.engine import MAX_IN_FLIGHT, EpisodeEngine
from sequence_ai_ros.client.labels import LabelResult
from sequence_ai_ros.client.latency import RTO_DEVIATIONS, LatencyWindow
from sequence_ai_ros.client.outcome import RunOutcome
from sequence_ai_ros.client.pacing import ThreadGuard
from sequence_ai_ros.client.records import ready_poll_s
from sequence_ai_ros.client.sampling import TelemetryBuffer
from sequence_ai_ros.client.session import DRAIN_RETRY_S, Connection, EpisodeCall, TlsLike, resolve_endpoint
from sequence_ai_ros.client.settings import EpisodeSettings, check_space
from sequence_ai_ros.client.steps import Step, StepLedger
from sequence_ai_ros.client.stopping import Stop
from sequence_ai_ros.exceptions import CaptureError, ContractViolation, Draining, EpisodeStateError, NotReady
from sequence_ai_ros.protocol import DRAINING
from sequence_ai_ros.protocol import sequence_ai_pb2 as pb
from sequence_ai_ros.protocol.contract import Contract
from sequence_ai_ros.protocol.spaces import ActionSpace
from sequence_ai_ros.protocol.timeline import HOLD_REASONS
from sequence_ai_ros.protocol.types import Action, Observation

LOG = logging.getLogger(__name__)


class _OpenEpisode:
    """An open episode: its engine, its stream, its steps' ledger; ``implicit`` when next_action opened it."""

    def __init__(self, engine: EpisodeEngine, stream: EpisodeCall, implicit: bool = False) -> None:
        self.engine, self.stream, self.implicit = engine, stream, implicit
        on_target = engine.set_target if engine.contract.action_space is ActionSpace.JOINT_DELTA else None
        self.ledger = StepLedger(engine.contract.action_space, on_target, engine.episode_id)
        self.telemetry: TelemetryBuffer | None = None
        self.closed: RunOutcome | None = None
        #: a next_action() call returned this (implicit) episode's hold after it ended: the next call opens another
        self.end_told = False
        self.capture_error = ''     # the worker's word on why capture is on but this episode is not kept

    def told(self, out: RunOutcome) -> RunOutcome:
        """``out`` with what the worker told (``capture_error``, a refusal), for every outcome read.

        An episode the worker refused and never started (a draining replica, while the client opened it again)
        that ended otherwise than by the caller's interrupt or a bad observation (its ``max_seconds``, ``until``,
        ``end_episode()``) ends with reason ``error`` and the refusal: it never ran.
        """
        refusal = self.stream.refusal
        if refusal is not None and out.reason in ('completed', 'until', 'timeout'):
            out = dataclasses.replace(out, reason='error', error=refusal)
        if not self.capture_error or out.capture_error:
            return out
        return dataclasses.replace(out, capture_error=self.capture_error)

    def counted(self, out: RunOutcome) -> RunOutcome:
        """``out`` with the ledger's tick counts (commands_sent, ticks_held, ticks_skipped) so far."""
        counts = self.ledger.counts()
        return dataclasses.replace(out, commands_sent=counts.commands_sent, ticks_held=counts.ticks_held,
                                   ticks_skipped=counts.ticks_skipped)

    def capture(self, step: Step) -> None:
        """The ledger's sink: one committed step, one telemetry record (when the episode is captured)."""
        tel = self.telemetry
        if tel is not None:
            batch = tel.add(step)
            if batch:
                self.stream.send_telemetry(batch)


class Policy:
    """A connected remote policy (use :func:`connect`); a context manager that closes on exit.

    :param model: the deployment name.
    :param endpoint: ``host:port``; default $SEQ_ENDPOINT, then ``127.0.0.1:DEFAULT_PORT``.
    :param token: the worker's token, or None.
    :param tls: None for plaintext, True for system roots, a PEM path, or grpc ChannelCredentials.
    :param timeout: seconds the handshake may take (the worker may still be starting) (s).
    :param ready_timeout: default bound on :meth:`wait_until_ready` (s), and the longest an episode begun while
        the deployment loads waits for it (with its own ``max_seconds``, whichever comes first).
    :param image_fit: how a camera frame of another size is fitted to the contract's: ``resize`` (default,
        as the node does) or ``pad`` (keep the aspect ratio), or ``{camera key: fit}``
        (:mod:`~sequence_ai_ros.client.adapter`).
    :raises ConnectionLost: when the worker cannot be reached within ``timeout``.
    :raises UnknownDeployment: when the worker serves no deployment ``model``.
    :raises ProtocolVersionError: when the worker speaks another protocol version.
    :raises Unauthenticated: when the worker needs a token and ``token`` is missing or wrong.
    :raises ValueError: for an unknown image_fit.

    After :meth:`close`, the calls that would talk to the worker (``ready``, ``wait_until_ready``, ``label``,
    ``begin_episode``, ``next_action``, ``act``, ``run``) raise :class:`EpisodeStateError`; ``interrupt``
    and ``report_command`` do nothing; ``end_episode``, ``episode_outcome``, ``stats`` and ``chunk_horizon``
    report the last episode; ``close`` again does nothing.
    """

    def __init__(self, model: str, *, endpoint: str | None = None, token: str | None = None, tls: TlsLike = None,
                 timeout: float = 10.0, ready_timeout: float = 600.0, client_id: str = '',
                 image_fit: str | Mapping[str, str] | None = None) -> None:
        check_fit(image_fit)
        self.model = model
        self.endpoint = resolve_endpoint(endpoint)
        self.client_id = client_id or f'sequence_ai_ros.client/{uuid.uuid4().hex[:8]}'
        self.ready_timeout = ready_timeout
        self._conn = Connection(self.endpoint, token, tls)
        try:
            reply = self._conn.handshake(model, self.client_id, timeout)
            self.contract: Contract = Contract.from_proto(reply)
        except BaseException:
            self._conn.close()
            raise
        self._ready = reply.ready
        self.adapter = ObservationAdapter(self.contract, image_fit)
        #: Requests in flight at most per episode (pipelining hides a round trip of up to ~0.9 of a chunk);
        #: 1 restores one request at a time. Read when an episode opens.
        self.max_in_flight = MAX_IN_FLIGHT
        self.latency = LatencyWindow()
        self._guard = ThreadGuard(f'Policy({model!r})')
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = Stop()          # what interrupt() stops: the running episode, or the one about to open
        self._episode: _OpenEpisode | None = None
        self._last_episode_id: str | None = None
        #: the id the next episode opened without one gets; Ready calls before it carry it (x-episode-id)
        self._next_episode_id = uuid.uuid4().hex
        self._closers: list[threading.Thread] = []
        self._closed = False
        # the begun episode whose idle end next_action() already raised (it raises it once)
        self._idle_raised: _OpenEpisode | None = None
        #: The worker's package version, as its last EpisodeStarted reported it ('' before the first episode,
        #: or from a worker that does not report it).
        self.worker_version = ''
        #: The deployment's registered version that served the last episode (its EpisodeStarted; 0 before
        #: the first episode, or from a worker that does not report it). ``contract.version`` is the handshake's.
        self.deployment_version = 0

    # -- connection -------------------------------------------------------------------------------

    def __enter__(self) -> Policy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        """Raise EpisodeStateError when this Policy is closed (its channel is gone)."""
        if self._closed:
            raise EpisodeStateError(f'Policy({self.model!r}) is closed: connect() again for a new handle')

    def _routing_id(self, episode_id: str | None) -> str:
        """The episode id a Ready call names: ``episode_id``, else the open episode's, else the next one's."""
        if episode_id:
            return episode_id
        episode = self._episode
        if episode is not None and episode.engine.outcome() is None:
            return episode.engine.episode_id
        return self._next_episode_id

    def ready(self, episode_id: str | None = None) -> tuple[bool, float]:
        """Return (ready, eta_seconds) without blocking (one Ready call, 2 s deadline); asking starts a cold worker.

        Behind a balancer the replica of ``episode_id`` answers (default: the running episode's, else the one
        the next episode opened without an id will get), so readiness is that of the replica it runs on. A
        draining replica (stopping) is not ready: it takes no new episode.

        :raises ConnectionLost: when the worker is unreachable.
        :raises EpisodeStateError: when this Policy is closed.
        """
        self._check_open()
        reply = self._conn.ready(self.model, timeout=2.0, episode_id=self._routing_id(episode_id))
        self._ready = reply.ready
        return reply.ready, reply.eta_seconds

    def wait_until_ready(self, timeout: float | None = None, episode_id: str | None = None) -> None:
        """Start a cold worker if need be and block until it is up (not billed).

        A draining replica (stopping) is asked again, as a refused episode is opened again: behind a balancer
        the next answer comes from another replica; :class:`Draining` is raised when every answer for
        :data:`~sequence_ai_ros.client.session.DRAIN_RETRY_S` (or until ``timeout``) was ``draining``.

        :param timeout: seconds to wait (s); None uses ``ready_timeout``.
        :param episode_id: behind a balancer, wait for that episode's replica (default as :meth:`ready`).
        :raises NotReady: when the load failed, or it is not ready within ``timeout``.
        :raises Draining: when the replica answering is draining, for the bound above.
        :raises ConnectionLost: when the worker is unreachable.
        :raises EpisodeStateError: when this Policy is closed.

        An :meth:`interrupt` while it waits does not cut the wait short: it is kept for the episode the handle
        opens next (the next :meth:`next_action`, :meth:`begin_episode`, :meth:`act` or :meth:`run`), which
        ends as it opens; :meth:`end_episode` drops it.
        """
        self._check_open()
        with self._stop.call(hand_on=True):
            self._wait_ready(timeout, episode_id, stoppable=False)

    def _wait_ready(self, timeout: float | None, episode_id: str | None, *, stoppable: bool) -> None:
        """wait_until_ready()'s loop; ``stoppable``: return early once a stop is kept (act()/run())."""
        bound = self.ready_timeout if timeout is None else timeout
        start = time.monotonic()
        deadline = start + bound
        routing = self._routing_id(episode_id)
        draining_since: float | None = None
        while True:
            if stoppable and self._stop.kept:
                return
            reply = self._conn.ready(self.model, timeout=2.0, episode_id=routing)
            self._ready = reply.ready
            if reply.ready:
                return
            if reply.state == 'failed':
                # The worker's message says why (failed to load, or an inference exceeded its deadline).
                raise NotReady(f'{self.model}: the deployment failed: {reply.message or "no reason given"}')
            now = time.monotonic()
            draining_since = (draining_since or now) if reply.state == DRAINING else None
            left = deadline - now
            if draining_since is not None and (left <= 0 or now - draining_since >= DRAIN_RETRY_S):
                raise Draining(f'{self.model}: {reply.message or "the replica is draining"}', refusal=DRAINING)
            if left <= 0:
                raise NotReady(f'{self.model}: not ready after {bound:g} s '
                               f'({reply.state}, eta {reply.eta_seconds:.1f} s)')
            nap = min(ready_poll_s(reply.eta_seconds), left)
            if stoppable:
                self._stop.kept_event.wait(nap)
            else:
                time.sleep(nap)

    def close(self) -> None:
        """End the open episode (reason 'interrupted' if it is still running) and close the channel; idempotent."""
        if self._closed:
            return
        try:
            self.end_episode('interrupted')
            for closer in self._closers:
                closer.join(timeout=3.0)
        finally:
            self._closed = True
            self._conn.close()

    def label(self, success: bool, notes: str = '', episode_id: str | None = None) -> LabelResult:
        """Label the last episode that act/run/begin_episode drove (or ``episode_id``): success and notes.

        Any episode the worker ran takes a label, captured or not (``seq policy stats`` counts it); a captured
        one also carries it into its export. The call carries the episode's ``x-episode-id``, as its stream
        did, so a balancer that hashes on it sends the label (and a retry, when the worker is unavailable) to
        the replica that ran the episode.

        A worker also stores a label for an episode it did not run, as a fleet needs: with the replica that
        ran it stopped, the balancer sends the label to another one, and the stores' labels join their
        episodes by id when exported or counted together. The result then has ``matched=False`` and a warning
        is logged: it is an episode of a stopped replica, or an id no episode has (mistyped, or past
        retention), which an export lists as a label matching no episode.

        :returns: a :class:`~sequence_ai_ros.client.labels.LabelResult` (true in a condition): ``matched``
            says whether the worker that stored the label ran the episode; ``message`` is its answer.
        :raises CaptureError: with the worker's answer when it did not store the label (a worker serving
            without a capture store, a store that cannot be written); never a silent ok.
        :raises PermissionDenied: when the episode is not this caller's to label: another identity (token, or
            without one client address) ran it, or the call carries no token on a worker with one.
        :raises Overloaded: (``refusal == 'unseen_labels'``) for an episode that worker never ran, when this
            caller already holds the most such labels it keeps.
        :raises EpisodeStateError: when there is no episode to label, or this Policy is closed.
        :raises ConnectionLost: when the worker cannot be reached.
        """
        self._check_open()
        eid = episode_id or self._last_episode_id
        if not eid:
            raise EpisodeStateError('no episode to label: run one first or pass episode_id')
        reply, matched = self._conn.label_call(self.model, eid, success, notes, timeout=5.0)
        if not reply.ok:
            raise CaptureError(reply.message or f'the worker did not store the label of {eid}')
        if not matched:
            LOG.warning('label of episode %r: the worker that stored it did not run that episode (%s); unless it '
                        'ran on a replica that was stopped, check the id: an export lists it as a label matching '
                        'no episode', eid, reply.message or 'no message')
        return LabelResult(episode_id=eid, matched=matched, message=reply.message)

    # -- episodes for self-paced loops -------------------------------------------------------------

    def begin_episode(self, instruction: str = '', episode_id: str | None = None, *, max_seconds: float | None = None,
                      max_actions: float | None = None, prefetch: bool = True, smooth_seam: int = 0,
                      expect_action_space: str | ActionSpace | None = None, control_period: float | None = None,
                      chunk_timeout: float | None = None, aggregate: str | None = None,
                      temporal_ensemble_coeff: float | None = None, prefetch_margin: float = RTO_DEVIATIONS,
                      settings: EpisodeSettings | None = None) -> str:
        """Open an episode (one Episode stream) and return its id; the first next_action() requests a chunk.

        Optional: next_action() opens an episode with the default settings when none is open. An episode
        begun while the deployment loads (right after connect(), or while it restarts) waits for it: its
        next_action() calls hold (reason ``waiting``, never an underrun) until the first chunk; one that ends
        before the deployment is ready (its ``max_seconds``, the connection's ``ready_timeout``, or
        end_episode()) ends with reason 'error' and a NotReady naming the worker's state and the wait. A load
        that failed ends it at once with that NotReady.

        :param instruction: the task, pinned for the episode.
        :param episode_id: its id (default a new uuid4 hex).
        :param max_seconds: finish with 'timeout' after this long (s).
        :param max_actions: finish with 'completed' after this many chunk steps.
        :param prefetch: request while playing (False: only when empty; the stall counts as an underrun).
        :param smooth_seam: rows cross-faded at each seam (absolute spaces; a reported no-op otherwise).
        :param expect_action_space: the space the caller commands; another one ends with 'validate'.
        :param control_period: the caller's period (s), to resample delta/velocity chunks; None measures it.
        :param chunk_timeout: the no-chunk deadline (s): a request unanswered this long ends the episode
            with reason 'error' and a PolicyException; None: ``max(10 s, 10 * covers_seconds)``
            (:data:`~sequence_ai_ros.client.engine.CHUNK_TIMEOUT_MIN_S`, ``CHUNK_TIMEOUT_COVERS``).
        :param aggregate: how overlapping chunks combine for one step (absolute spaces): ``latest_only``,
            ``weighted_average`` (ACT's temporal ensembling: a request at every tick), ``average``; None: as
            the contract declares.
        :param temporal_ensemble_coeff: weighted_average's m (weights ``exp(-m * i)``, i = 0 the oldest);
            None: the contract's, else ACT's 0.01.
        :param prefetch_margin: how far above the measured round trips the next request is timed, in mean
            deviations of the last 32 above their mean, never below their largest (>= 0): more is safer on a
            jittery link, less sends fewer requests (inferences). Default 4 (RFC 6298's retransmission
            timeout); 0: the largest measured round trip alone.
        :param settings: all of the above as one :class:`EpisodeSettings` (then leave them at their defaults).
        :raises EpisodeStateError: when an episode is still running on this handle, or this Policy is closed.
        :raises TypeError: for a bool or a non-number as a limit, period or chunk_timeout; for ``settings``
            together with other options.
        :raises ValueError: for a negative smooth_seam, a non-finite or non-positive period, limit or chunk_timeout.
        """
        self._check_open()
        given = EpisodeSettings(instruction=instruction, max_seconds=max_seconds, max_actions=max_actions,
                                prefetch=prefetch, smooth_seam=smooth_seam,
                                expect_action_space=check_space('expect_action_space', expect_action_space),
                                control_period=control_period, chunk_timeout=chunk_timeout, aggregate=aggregate,
                                temporal_ensemble_coeff=temporal_ensemble_coeff, prefetch_margin=prefetch_margin)
        if settings is not None:
            if given != EpisodeSettings():
                raise TypeError('begin_episode(): pass settings= or the separate options, not both')
            given = settings
        with self._stop.call():
            return self._open(given, episode_id).engine.episode_id

    def _open(self, settings: EpisodeSettings, episode_id: str | None, fixed_step: bool = False,
              implicit: bool = False) -> _OpenEpisode:
        self._check_open()
        with self._lock:
            if self._episode is not None:
                if self._episode.engine.outcome() is None:
                    raise EpisodeStateError(f'episode {self._episode.engine.episode_id!r} is still running; '
                                            'end_episode() it first')
                self._end_locked('completed', wait=not implicit)   # next_action never waits on the network
            eid = episode_id or self._next_episode_id
            if eid == self._next_episode_id:
                self._next_episode_id = uuid.uuid4().hex
            self._wake.clear()
            holder: dict[str, Any] = {}
            engine = EpisodeEngine(self.contract, settings, eid, self.latency,
                                   send=lambda req: holder['stream'].send_request(req), wake=self._wake,
                                   fixed_step=fixed_step, ready_timeout=self.ready_timeout)
            engine.max_in_flight = self.max_in_flight
            coeff = '' if engine.aggregate != 'weighted_average' else f' (m={engine.ensemble_coeff:g})'
            LOG.info('episode %s: %s, aggregate %s%s, up to %d requests in flight', eid,
                     self.contract.action_space.value, engine.aggregate, coeff, engine.max_in_flight)
            stream = EpisodeCall(self._conn, self.model, eid, settings.instruction, self.contract,
                                 on_chunk=engine.on_chunk, on_error=engine.fail,
                                 on_started=lambda m: self._on_started(episode, m), client_id=self.client_id,
                                 fit_images=self.adapter.images, fit_frames=self.adapter.fit_frames,
                                 on_not_ready=engine.on_not_ready)
            holder['stream'] = stream
            episode = _OpenEpisode(engine, stream, implicit)
            self._episode = episode
            self._last_episode_id = eid
            stream.start()
            self._stop.opened(engine)     # an interrupt kept for this episode ends it now
            return episode

    def next_action(self, observation: Observation | Mapping[str, Any], now: float | None = None, *,
                    grid_index: int | None = None) -> Action | None:
        """Return the action for *now* on the chunk's own timeline; never blocks (I/O runs on the episode's threads).

        A plain loop works as written (``while running: robot.act(policy.next_action(observe()))``, with
        or without ``policy.wait_until_ready()`` first: an episode begun while the deployment loads holds until
        it is ready, see :meth:`begin_episode`): when no episode is open, this call opens one with the
        default :class:`EpisodeSettings` (the first call after connect, after ``end_episode()``, and, for an
        episode opened this way, after ``interrupt()`` or after the worker ended it for idleness).
        :meth:`begin_episode` stays, optional, to pass settings; an episode it opened is the caller's to
        end: once finished it keeps answering holds until ``end_episode()``. When the worker ended such an
        episode for idleness (no message for its ``idle_timeout_s``), the next call raises the worker's
        EpisodeStateError once (``episode_outcome()`` has reason 'error' and the same error); the calls
        after it answer holds again, until ``end_episode()``.

        :param observation: the current observation (or a dict that converts to one).
        :param now: ``time.monotonic()`` of this tick (s); default the clock now.
        :param grid_index: the control deadline this tick serves on the caller's own grid (a fixed-rate
            control thread's deadline count: any origin, one per period, more after missed periods); None
            estimates it from ``now`` and the control period. Capture places the tick's record by it.
        :returns: the Action to command; ``hold=True`` on an underrun or after the episode finished
            (repeat the last command, or the measured state before the first); None when there is
            nothing to hold yet (e.g. an ee space before its first chunk).
        :raises ContractViolation: for a bad observation (not an Observation or dict, a state that is not a
            finite (D,) vector of the contract's size and names...); the open episode ends with reason
            'validate' and the caller holds the arm.
        :raises EpisodeStateError: when this Policy is closed; once, when the worker ended an episode
            begun with :meth:`begin_episode` for idleness (the message says ``idle_timeout``): hold the arm.
        :raises RuntimeError: when another thread is inside act/run/next_action on this handle.
        """
        self._check_open()
        with self._guard, self._stop.call():
            ep = self._episode
            try:
                obs = checks.observation(observation, self.contract, self.adapter)
            except ContractViolation as exc:
                if ep is not None and ep.closed is None:
                    ep.engine.finish('validate', exc)
                raise
            if self._opens_next(ep):
                ep = self._open(EpisodeSettings(), None, implicit=True)
            elif ep is not None and ep is not self._idle_raised and (idle := self._idle_end(ep)) is not None:
                self._idle_raised = ep       # once: the calls after it hold, until end_episode()
                raise idle
            assert ep is not None
            if grid_index is not None:
                ep.ledger.warn_overruns = False   # the caller's own grid: it counts its skips
            if ep.engine.outcome() is not None:
                ep.end_told = True           # this call returns the ended episode's hold
            return self._tick(obs, time.monotonic() if now is None else now, grid_index)

    @staticmethod
    def _idle_end(ep: _OpenEpisode) -> EpisodeStateError | None:
        """The EpisodeStateError the worker ended ``ep`` with for idleness (then its EpisodeEnded came), else None."""
        out = ep.engine.outcome()
        if out is not None and out.reason == 'error' and isinstance(out.error, EpisodeStateError) \
                and ep.stream.ended.is_set():
            return out.error
        return None

    def _opens_next(self, ep: _OpenEpisode | None) -> bool:
        """True when next_action() opens an episode.

        None is open; or an implicit one ended by the worker's idle timeout, or by an interrupt once a call
        returned its hold (the call right after an interrupt holds, so the loop sees the stop).
        """
        if ep is None or ep.closed is not None:
            return True
        out = ep.engine.outcome()
        if not ep.implicit or out is None:
            return False
        return (out.reason == 'interrupted' and ep.end_told) or self._idle_end(ep) is not None

    def report_command(self, commanded: Any, clamped: bool = False, *, hold_reason: str = '') -> None:
        """Complete this tick's record with what the robot really commanded for the action next_action returned.

        For loops that change the action before commanding it (a safety filter's clamps, a refusal, a dry
        run): the tick's record (:class:`~sequence_ai_ros.client.steps.Step`) then holds this command, and
        the policy's action is kept beside it. Call it at most once per tick, after deciding the command;
        without it the command is the action as returned (the record is committed at the next
        next_action() or at the episode's end). Cheap and never blocks. In joint_delta the next increment
        is integrated onto this target.

        :param commanded: float32 (D,) in the contract's action order, or None when the robot held (commanded
            nothing new). In joint_delta, the absolute target (as the action's ``values``); capture keeps the
            increment the robot executed (this target minus the previous one).
        :param clamped: True when a safety filter changed the policy's action.
        :param hold_reason: why the robot held (``refused`` when ``commanded`` is None and none is given;
            ``dry_run`` for a command that went elsewhere); see
            :data:`~sequence_ai_ros.protocol.timeline.HOLD_REASONS`.
        :raises ContractViolation: for a command that is not a finite (D,) vector (nothing is recorded: the
            engine keeps its own target, and the robot should hold).
        :raises ValueError: for an unknown hold_reason.
        """
        ep = self._episode
        if ep is None or ep.closed is not None:
            return
        command = None
        if commanded is not None:
            command = np.asarray(commanded, np.float32)
            d = self.contract.action_dim
            if command.shape != (d,) or not np.all(np.isfinite(command)):
                raise ContractViolation(f'report_command: a finite float32 ({d},) command in the contract\'s action '
                                        f'order is required, got shape {command.shape}'
                                        + ('' if command.shape != (d,) else ' with non-finite values'))
        ep.ledger.report(command, clamped=clamped, hold_reason=hold_reason)

    def episode_outcome(self) -> RunOutcome | None:
        """None while the episode runs; its RunOutcome once it finished (completed, timeout, validate, error...)."""
        ep = self._episode
        if ep is None:
            return None
        if ep.closed is not None:
            return ep.closed
        out = ep.engine.outcome()
        return None if out is None else ep.told(ep.counted(out))

    def stats(self) -> dict[str, Any]:
        """Live numbers of the current (or last) episode: buffer_s, actions, chunks, underruns, latency...

        With its tick counts so far, as its :class:`RunOutcome` has them at the end: ``commands_sent`` (ticks
        that executed a fresh policy action), ``ticks_held`` (ticks that held, any reason, a dry run's
        included), ``ticks_skipped`` (control deadlines no tick served), and ``ticks_grid_index``: the last
        control deadline they cover on the caller's grid (the ``grid_index`` its ticks gave), or None before
        any. A tick whose record is not committed yet (the latest hold, until the next tick) is not counted.
        """
        ep = self._episode
        if ep is None:
            return {}
        counts = ep.ledger.counts()
        return {**ep.engine.stats(), 'commands_sent': counts.commands_sent, 'ticks_held': counts.ticks_held,
                'ticks_skipped': counts.ticks_skipped, 'ticks_grid_index': counts.grid_index}

    # -- a control loop's ticks that asked for no action (the ROS node) -------------------------------------

    def start_ticks(self, grid_index: int) -> None:
        """Count the open episode's ticks from the control deadline after ``grid_index`` (its start).

        For a loop on its own grid that begins the episode before its first tick (the ROS node, right after
        :meth:`begin_episode`): every deadline after ``grid_index`` is then the episode's, counted as a tick
        (``commands_sent`` or ``ticks_held``) or as skipped, those before the first :meth:`next_action`
        included. Without it the counts start at the first tick. Never blocks; does nothing without an open
        episode, or once a tick was counted.
        """
        ep = self._episode
        if ep is not None and ep.closed is None:
            ep.ledger.start(grid_index)

    def hold_tick(self, grid_index: int | None, hold_reason: str) -> bool:
        """Count a control tick of the open episode that held without calling :meth:`next_action`.

        For a loop that holds the arm on its own (the ROS node: an invalid observation, before its first
        request, a tick that found the episode over or stopping): the tick is counted in ``ticks_held``, so
        the counts cover every deadline. It makes no record: a captured episode's export shows its deadline
        as a gap (a held row). Never blocks.

        :param grid_index: the control deadline the tick serves, on the grid of the ``grid_index`` given to
            :meth:`next_action` and :meth:`start_ticks`; None counts the tick without placing it.
        :param hold_reason: why, one of :data:`~sequence_ai_ros.protocol.timeline.HOLD_REASONS`
            (``waiting``, ``refused``, ``ended``...).
        :returns: True when counted; False without an open episode, or for a deadline already counted (a
            tick that raced :meth:`end_ticks`).
        :raises ValueError: for an unknown hold_reason.
        """
        ep = self._episode
        if ep is None or ep.closed is not None:
            if hold_reason not in HOLD_REASONS:
                raise ValueError(f'unknown hold_reason {hold_reason!r}; expected one of {HOLD_REASONS}')
            return False
        return ep.ledger.hold(grid_index, hold_reason)

    def end_ticks(self, grid_index: int) -> None:
        """Count the open episode's deadlines up to ``grid_index`` (included) that no tick served as skipped.

        For a loop on its own grid ending the episode (the ROS node, before :meth:`end_episode`):
        ``grid_index`` is the episode's last control deadline, so a stall across the end is counted as the
        ones between two ticks are. A tick after this at a deadline already counted is not counted again.
        Never blocks; does nothing without an open episode.
        """
        ep = self._episode
        if ep is not None and ep.closed is None:
            ep.ledger.end(grid_index)

    def chunk_horizon(self) -> tuple[int, float, float, Any] | None:
        """The playing chunk of the open episode: (number, next row position, dt (s), float32 (T, D) rows), or None.

        For callers that hand the rest of a chunk to a controller at once (see ``EpisodeEngine.horizon``).
        """
        ep = self._episode
        return ep.engine.horizon() if ep is not None else None

    def interrupt(self) -> None:
        """Stop what the handle is doing or about to do (thread-safe, from any thread, never blocks).

        - An episode that runs ends between two actions with reason 'interrupted': act()/run() fire hold
          and return; the next next_action() returns a hold (``episode_outcome()`` is the interrupted
          outcome), and for an episode next_action() opened itself the call after it opens the next.
        - During act()/run() before their episode runs (the wait for a warming deployment included), the
          call returns reason 'interrupted' with 0 actions, after hold.
        - During wait_until_ready(), or a begin_episode()/next_action() call opening its episode, the stop is
          kept for the episode the handle opens next, which ends as it opens (next_action() returns its
          hold); end_episode() drops a kept stop.
        - Otherwise (no episode runs, no call is under way, or a closed Policy) it does nothing, and nothing
          is kept for an episode started later: a stop handler may call it at any time.
        """
        if self._closed:
            return
        self._stop.press()
        self._wake.set()

    def end_episode(self, reason: str = 'completed') -> RunOutcome | None:
        """End the open episode (idempotent): a finished one keeps its own reason; return its outcome.

        A stop kept for an episode not yet opened (an :meth:`interrupt` during :meth:`wait_until_ready`) is
        dropped. On a closed Policy: the last episode's outcome (close() ended it), or None; nothing is sent.
        """
        if self._closed:
            return self.episode_outcome()
        self._stop.drop()                # a stop kept for an episode not yet opened goes with it
        with self._lock:
            return self._end_locked(reason)

    # -- self-paced loops ----------------------------------------------------------------------------

    def act(self, instruction: str, observe: ObserveFn, act: ActFn, *, max_seconds: float,
            until: Callable[[], bool] | None = None, on_underrun: Callable[[], Any] | None = None,
            episode_id: str | None = None, prefetch: bool = True, smooth_seam: int = 0,
            expect_action_space: str | ActionSpace | None = None, control_period: float | None = None,
            chunk_timeout: float | None = None, aggregate: str | None = None,
            temporal_ensemble_coeff: float | None = None, prefetch_margin: float = RTO_DEVIATIONS) -> RunOutcome:
        """Drive the arm with ``instruction`` until the policy is done, ``until()``, timeout or interrupt.

        A deployment still loading is waited for before the episode begins (:meth:`wait_until_ready`, bounded
        by ``ready_timeout``; ``max_seconds`` counts from the episode's start), and again within the episode
        should it load again before the first chunk (a restart: see :meth:`begin_episode`).

        Failures, decided once for act() and run():

        - a bad observation (``observe()`` returns None, a non-numeric, 2-d or non-finite state, empty
          names, a state whose size or names differ from the contract...) is a ContractViolation: hold
          fires, the episode ends with 'validate' and the outcome (``.error`` the violation) is returned;
        - the caller's own code raising (``observe``, ``act``, ``until``, ``on_underrun``): hold fires
          once (unless the arm already holds), the worker's episode ends with reason 'error'
          ('interrupted' for KeyboardInterrupt/SystemExit), and the caller's exception propagates unchanged;
        - the worker lost, erring, or not answering within ``chunk_timeout``: hold fires, then the typed
          error is raised.

        :param observe: returns the current Observation (or a dict); its instruction is overwritten.
        :param act: executes one Action.
        :param max_seconds: required time limit (s), > 0 and finite.
        :param until: checked between actions; True finishes with 'until'.
        :param on_underrun: called once per dry spell, and on interrupt/validate/error (hold the arm).
        :param control_period: pace at this period (s) with resampling, instead of the chunk's dt.
        :param chunk_timeout: the no-chunk deadline (s); see :meth:`begin_episode`.
        :param aggregate: how overlapping chunks combine; see :meth:`begin_episode`.
        :param temporal_ensemble_coeff: weighted_average's coefficient; see :meth:`begin_episode`.
        :param prefetch_margin: the prefetch lead's margin over the measured round trips; see :meth:`begin_episode`.
        :returns: the outcome (reason completed, until, timeout, interrupted or validate).
        :raises TypeError: for a missing max_seconds, or a bool or non-number as a limit or period.
        :raises ValueError: for a non-finite or non-positive max_seconds, control_period or chunk_timeout.
        :raises ConnectionLost: after firing hold, when the worker is lost.
        :raises NotReady: after firing hold, when the policy is not ready to serve.
        :raises PolicyException: after firing hold, when the policy raised or no chunk came within ``chunk_timeout``.
        :raises SequenceAIError: after firing hold, for any other error the worker answers.
        :raises EpisodeStateError: when this Policy is closed (before anything runs).
        """
        self._check_open()
        checks.positive('max_seconds', max_seconds, required=True)
        settings = EpisodeSettings(instruction=instruction, max_seconds=max_seconds, prefetch=prefetch,
                                   smooth_seam=smooth_seam,
                                   expect_action_space=check_space('expect_action_space', expect_action_space),
                                   control_period=control_period, chunk_timeout=chunk_timeout, aggregate=aggregate,
                                   temporal_ensemble_coeff=temporal_ensemble_coeff, prefetch_margin=prefetch_margin)
        return self._drive(observe, act, settings, pin=True, until=until, on_underrun=on_underrun,
                           episode_id=episode_id)

    def run(self, observe: ObserveFn, act: ActFn, *, max_actions: int = 250,
            on_underrun: Callable[[], Any] | None = None, prefetch: bool = True, smooth_seam: int = 0,
            instruction: str | None = None,
            max_seconds: float | None = None, episode_id: str | None = None,
            expect_action_space: str | ActionSpace | None = None, control_period: float | None = None,
            chunk_timeout: float | None = None, aggregate: str | None = None,
            temporal_ensemble_coeff: float | None = None, prefetch_margin: float = RTO_DEVIATIONS) -> RunOutcome:
        """Execute ``max_actions`` chunk steps (or until done, timeout or interrupt); return the RunOutcome.

        Same parameters and failure rules as :meth:`act`; ``instruction`` (optional) is pinned when given.
        The episode ends when run() returns, even on an exception.

        :raises TypeError: for a bool or non-number as a limit or period.
        :raises ValueError: for a non-finite or non-positive limit, period or chunk_timeout.
        :raises ConnectionLost: after firing hold, when the worker is lost.
        :raises NotReady: after firing hold, when the policy is not ready to serve.
        :raises PolicyException: after firing hold, when the policy raised or no chunk came within ``chunk_timeout``.
        :raises SequenceAIError: after firing hold, for any other error the worker answers.
        :raises EpisodeStateError: when this Policy is closed (before anything runs).
        """
        self._check_open()
        settings = EpisodeSettings(instruction=instruction or '', max_seconds=max_seconds, max_actions=max_actions,
                                   prefetch=prefetch, smooth_seam=smooth_seam,
                                   expect_action_space=check_space('expect_action_space', expect_action_space),
                                   control_period=control_period, chunk_timeout=chunk_timeout, aggregate=aggregate,
                                   temporal_ensemble_coeff=temporal_ensemble_coeff, prefetch_margin=prefetch_margin)
        return self._drive(observe, act, settings, pin=instruction is not None, until=None, on_underrun=on_underrun,
                           episode_id=episode_id)

    # -- internals ------------------------------------------------------------------------------------

    def _drive(self, observe: ObserveFn, act: ActFn, settings: EpisodeSettings, *, pin: bool,
               until: Callable[[], bool] | None, on_underrun: Callable[[], Any] | None,
               episode_id: str | None) -> RunOutcome:
        return driving.drive(_Driving(self), observe, act, settings, pin=pin, until=until,
                             on_underrun=on_underrun, episode_id=episode_id)

    def _tick(self, obs: Observation, now: float, grid_index: int | None = None) -> Action | None:
        ep = self._episode
        if ep is None or ep.closed is not None:
            raise EpisodeStateError('no open episode')
        if ep.engine.settings.instruction and not obs.instruction:
            obs = dataclasses.replace(obs, instruction=ep.engine.settings.instruction)
        action = ep.engine.tick(obs, now, grid_index)
        ep.ledger.open(ep.engine.step, grid_index)   # the previous tick's record is committed as it stands
        if ep.engine.outcome() is not None:
            ep.ledger.drop()                    # a tick after the end is not the episode's
        return action

    def _skip_to(self, grid_index: int) -> None:
        """Count the periods after the last committed tick and before ``grid_index`` as skipped (act()/run()).

        ``grid_index`` is the deadline whose period the episode ended in (the last act() may have overrun several).
        """
        ep = self._episode
        if ep is not None and ep.closed is None:
            ep.ledger.skip_to(grid_index)

    def _commit(self) -> None:
        """Commit this tick's record as it stands (act()/run(), once the caller's act() returned)."""
        ep = self._episode
        if ep is not None and ep.closed is None:
            ep.ledger.commit()

    def _on_started(self, episode: _OpenEpisode, msg: pb.EpisodeStarted) -> None:
        self.worker_version = msg.worker_version
        self.deployment_version = msg.deployment_version
        if msg.capture and msg.capture_fps > 0:
            episode.telemetry = TelemetryBuffer(msg.capture_fps, msg.capture_images, self.contract.dt)
            episode.ledger.set_sink(episode.capture)
        else:
            episode.ledger.set_sink(None)
        if msg.capture_error:
            episode.capture_error = msg.capture_error
            LOG.warning('episode %s is not captured: %s', msg.episode_id, msg.capture_error)

    def _end_locked(self, reason: str, wait: bool = True) -> RunOutcome | None:
        ep = self._episode
        if ep is None:
            return None
        if ep.closed is not None:
            return ep.closed
        out = ep.engine.finish(reason)
        ep.ledger.commit()        # the last tick's record is the episode's
        out = ep.counted(out)
        # The worker hears how it ended, 'error' included (the caller's code raised, or no chunk came within
        # chunk_timeout), so captured data is flagged; a stream that already failed sends nothing (close()).
        tel = ep.telemetry.flush() if ep.telemetry is not None else None
        if tel:
            ep.stream.send_telemetry(tel)
        out = ep.told(out)
        if ep.stream.dropped_telemetry:
            LOG.warning('episode %s: %d capture frames were dropped (send queue full)', out.episode_id,
                        ep.stream.dropped_telemetry)
            out = dataclasses.replace(out, dropped_telemetry=ep.stream.dropped_telemetry)
        end = pb.EpisodeEnd(reason=out.reason, actions=out.actions, chunks=out.chunks, underruns=out.underruns,
                            underrun_s=out.underrun_s, max_seam_jump=out.max_seam_jump,
                            latency_p95_ms=out.latency_p95_ms)
        if wait:
            if ep.stream.close(end):
                out = dataclasses.replace(out, worker_confirmed=True)
            if ep.stream.telemetry_rejected:
                out = dataclasses.replace(out, telemetry_rejected=ep.stream.telemetry_rejected,
                                          telemetry_error=ep.stream.telemetry_error)
                LOG.warning('episode %s: capture refused %d frames (the episode was kept without them); first: %s',
                            out.episode_id, out.telemetry_rejected, out.telemetry_error)
        else:          # the worker still hears how it ended; the wait for its answer runs on its own thread
            closer = threading.Thread(target=ep.stream.close, args=(end,), name=f'seq-close-{out.episode_id[:24]}',
                                      daemon=True)
            self._closers = [t for t in self._closers if t.is_alive()] + [closer]
            closer.start()
        if ep.stream.capture_error and not out.capture_error:   # the robot stopped it, or the worker did not keep it
            out = dataclasses.replace(out, capture_error=ep.stream.capture_error)
        ep.closed = out
        return out


class _Driving:
    """The handle's side of one act()/run() call, as :func:`~sequence_ai_ros.client.driving.drive` needs it.

    A :class:`~sequence_ai_ros.client.driving.Drivable` over its :class:`Policy`: the call's guard and stop,
    the warming wait, the episode's opening, ticks and records, its end.
    """

    def __init__(self, policy: Policy) -> None:
        self._policy = policy
        self.contract = policy.contract
        self.adapter = policy.adapter
        self.wake = policy._wake

    @contextmanager
    def call(self) -> Iterator[None]:
        """One control thread at a time; an interrupt from here on stops this call."""
        with self._policy._guard, self._policy._stop.call():
            yield

    def wait_ready(self, episode_id: str | None) -> None:
        """The warming wait before the episode, cut short by a kept interrupt."""
        self._policy._wait_ready(None, episode_id, stoppable=True)

    def open(self, settings: EpisodeSettings, episode_id: str | None) -> EpisodeEngine:
        """Open the call's episode, one chunk step per tick; return its engine."""
        return self._policy._open(settings, episode_id, fixed_step=True).engine

    def tick(self, obs: Observation, now: float, grid_index: int) -> Action | None:
        """One tick of the open episode (:meth:`Policy._tick`)."""
        return self._policy._tick(obs, now, grid_index)

    def commit(self) -> None:
        """Commit this tick's record (:meth:`Policy._commit`)."""
        self._policy._commit()

    def skip_to(self, grid_index: int) -> None:
        """Count the deadlines skipped after the last tick (:meth:`Policy._skip_to`)."""
        self._policy._skip_to(grid_index)

    def end(self, reason: str) -> RunOutcome | None:
        """End the episode: :meth:`Policy.end_episode`."""
        return self._policy.end_episode(reason)


def connect(model: str, *, endpoint: str | None = None, token: str | None = None, tls: TlsLike = None,
            timeout: float = 10.0, ready_timeout: float = 600.0,
            image_fit: str | Mapping[str, str] | None = None) -> Policy:
    """Connect to the deployment ``model`` and return a :class:`Policy` (a context manager).

    The handshake starts a cold worker warming without blocking on it; :meth:`Policy.wait_until_ready`
    blocks, :meth:`Policy.ready` polls, and an episode begun before it is ready waits for it
    (:meth:`Policy.begin_episode`).

    :param endpoint: ``host:port``; default $SEQ_ENDPOINT, then ``127.0.0.1:DEFAULT_PORT``.
    :param token: the worker's token, or None.
    :param tls: None for plaintext, True for system roots, a PEM path, or grpc ChannelCredentials.
    :param timeout: bound on the handshake (s).
    :param ready_timeout: default bound on wait_until_ready (s), and on an episode's wait for the deployment.
    :param image_fit: ``resize`` (default) or ``pad`` per camera; see :class:`Policy`.
    :raises ConnectionLost: when the worker cannot be reached within ``timeout``.
    :raises UnknownDeployment: when the worker serves no deployment ``model``.
    :raises ProtocolVersionError: when the worker speaks another protocol version.
    :raises Unauthenticated: when the worker needs a token and ``token`` is missing or wrong.
    """
    return Policy(model, endpoint=endpoint, token=token, tls=tls, timeout=timeout, ready_timeout=ready_timeout,
                  image_fit=image_fit)


__all__ = ['Policy', 'connect']
