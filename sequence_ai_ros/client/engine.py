"""The chunk engine of one episode: timeline, prefetch, stale-action skip, seams, underruns, outcome.

No I/O and no threads of its own. Two threads call it, under one lock, and neither ever waits on the
network: the control thread calls :meth:`EpisodeEngine.tick` (act/run/next_action) and the episode's
reader thread calls :meth:`EpisodeEngine.on_chunk` / :meth:`EpisodeEngine.fail`. Requests leave through
``send``, which only enqueues.

Timeline. ``executed`` counts chunk steps really executed (an action emitted at one tick counts as
executed at the next, by the caller's fixed period or by the clock). A request records ``executed``
when its observation was taken; the chunk that answers starts, on arrival, at position
``executed_now - executed_at_observation``: the actions it would already have executed are skipped by
counting, never by estimating from time. A cold start therefore executes chunk[0].

Aggregation (absolute spaces; ``EpisodeSettings.aggregate``, default the contract's): ``latest_only``
replaces the playing chunk with the new one. ``weighted_average`` and ``average`` request at every tick
(within the in-flight bounds) and fold each arriving chunk into the rows still to play, step by step
(ACT's temporal ensembling, :mod:`.aggregate`): row 0 of every answer is the whole step its observation
fell in, so all chunks share one grid of steps, and stale rows are still skipped by count.

Warming. An episode may begin while its deployment loads: the worker then answers its request NOT_READY
with an estimate of the time left (:meth:`EpisodeEngine.on_not_ready`). Until the first chunk that is a
wait, not a failure: the arm holds (reason ``waiting``, as before any first chunk: never an underrun) and a
tick after the worker's estimate sends a newer observation. The wait is bounded by the episode's
``max_seconds`` and the connection's ``ready_timeout``; an episode that ends before any chunk came, the
deployment still loading, ends with reason ``error`` and a :class:`~sequence_ai_ros.exceptions.NotReady`
naming the worker's state and the wait.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable

import numpy as np

from sequence_ai_ros.client import aggregate as ensemble
from sequence_ai_ros.client.latency import LatencyWindow, percentile
from sequence_ai_ros.client.outcome import RunOutcome
from sequence_ai_ros.client.player import Player
from sequence_ai_ros.client.records import (
    CHUNK_TIMEOUT_COVERS,
    CHUNK_TIMEOUT_MIN_S,
    MAX_IN_FLIGHT,
    MIN_LEAD_FRACTION,
    OutRequest,
    chunk_timeout_s,
)
from sequence_ai_ros.client.requests import RequestSchedule
from sequence_ai_ros.client.sampling import History
from sequence_ai_ros.client.settings import EpisodeSettings
from sequence_ai_ros.client.steps import Step
from sequence_ai_ros.client.tally import Tally
from sequence_ai_ros.client.timeline import GRID_EARLY, UNPACED_STALL, Timeline
from sequence_ai_ros.exceptions import (
    ActionSpaceMismatch,
    ContractViolation,
    NotReady,
    PolicyException,
    SequenceAIError,
)
from sequence_ai_ros.protocol import sequence_ai_pb2 as pb
from sequence_ai_ros.protocol.contract import ACT_TEMPORAL_ENSEMBLE_COEFF, Contract, check_aggregate
from sequence_ai_ros.protocol.messages import unpack_chunk
from sequence_ai_ros.protocol.spaces import ActionSpace
from sequence_ai_ros.protocol.types import Action, Observation

_EPS = 1e-9


class EpisodeEngine:
    """One episode's chunk buffer and timeline: a front over the parts that own them.

    :param contract: the policy's contract.
    :param settings: how the episode is driven.
    :param episode_id: its id.
    :param latency: the connection's round-trip window (shared across episodes).
    :param send: enqueues an :class:`OutRequest`; must not block.
    :param wake: set whenever the episode finishes, and when a chunk arrives while nothing is playing (the
        first chunk, the end of a dry spell), so a pacing wait ends early.
    :param clock: the robot's monotonic clock (s).
    :param fixed_step: advance exactly ``control_period`` per emitted action (act/run pacing) instead of
        by the clock (next_action).
    :param ready_timeout: the longest wait (s) for a deployment that loads, from the episode's start (the
        connection's ``ready_timeout``); None: only ``max_seconds`` bounds it.
    """

    def __init__(self, contract: Contract, settings: EpisodeSettings, episode_id: str, latency: LatencyWindow,
                 send: Callable[[OutRequest], None], wake: threading.Event | None = None,
                 clock: Callable[[], float] = time.monotonic, *, fixed_step: bool = False,
                 ready_timeout: float | None = None) -> None:
        self.contract, self.settings, self.episode_id = contract, settings, episode_id
        self.fixed_step = fixed_step
        self.ready_timeout = ready_timeout
        self._latency, self._wake, self._clock = latency, wake, clock
        self._lock = threading.RLock()
        space = settings.expect_action_space or contract.action_space
        self._space = space
        self.aggregate = settings.aggregate or contract.aggregate
        coeff = settings.temporal_ensemble_coeff
        if coeff is None:
            coeff = (contract.temporal_ensemble_coeff if contract.aggregate == 'weighted_average'
                     else ACT_TEMPORAL_ENSEMBLE_COEFF)
        check_aggregate(self.aggregate, coeff if self.aggregate == 'weighted_average' else 0.0, space)
        #: the ensembling coefficient m, or None for latest_only
        self.ensemble_coeff = ensemble.coefficient(self.aggregate, coeff)
        self.chunk_timeout = chunk_timeout_s(contract, settings.chunk_timeout)
        # a seam cross-fade is a no-op for rates, and redundant where overlapping chunks are averaged
        self.smooth_seam_ignored = settings.smooth_seam > 0 and (not space.is_absolute
                                                                 or self.ensemble_coeff is not None)
        # By step (act/run, and every delta or velocity space): an increment integrated over [p, p + s) must
        # advance the timeline by exactly s, else a caller whose ticks jitter would drop or repeat part of a row.
        by_step = fixed_step or not space.is_absolute
        self.tally = Tally()
        self.timeline = Timeline(settings, contract.dt, by_step)
        self.player = Player(contract, space, settings.smooth_seam, self.ensemble_coeff, by_step, self.tally)
        self.requests = RequestSchedule(contract, settings, latency, send, clock,
                                        whole_steps=not space.is_absolute or self.ensemble_coeff is not None,
                                        per_tick=self.ensemble_coeff is not None)
        self._history = History(contract.observation.history, contract.dt)
        self._started = clock()
        self._outcome: RunOutcome | None = None
        #: the Step the latest tick created, for the caller to complete and commit (None before any)
        self.step: Step | None = None

    # -- control thread ---------------------------------------------------------------------------

    def tick(self, obs: Observation, now: float, grid_index: int | None = None) -> Action | None:
        """Return the action for ``now`` (monotonic s) given the current observation; never blocks.

        The tick's :class:`~sequence_ai_ros.client.steps.Step` is left in :attr:`step`.

        :param grid_index: the control deadline this tick serves, on the caller's grid (any origin; it must
            grow by one per deadline, more when deadlines were missed); None estimates it from ``now``: with a
            fixed ``control_period``, the period holding ``now`` counted from the first tick (a tick may come
            :data:`GRID_EARLY` of a period early); without one, one deadline per call unless a tick comes
            more than :data:`UNPACED_STALL` measured periods after the previous one (a stall).
        :returns: an Action; ``hold=True`` repeats the last command (or the measured state before the
            first) when the buffer is dry or the episode has finished; None when there is nothing to hold.
        """
        with self._lock:
            player, timeline = self.player, self.timeline
            timeline.place(now, grid_index)
            player.advance(now, self._to_limit())
            timeline.measure(now)
            begun = player.executed
            self.requests.observe(obs, self._history.push(obs), begun)
            if self._outcome is None:
                self._check_limits(now)
            if self._outcome is not None:
                return self._record(obs, begun, 'ended')
            emitted: tuple[Action, float, float] | None = None
            if player.playing():
                # the tick's span of chunk steps, never past max_actions: a delta space integrates every row of it
                s = min(timeline.period / player.live.dt, max(self._to_limit(), _EPS))   # type: ignore[union-attr]
                try:
                    emitted = player.emit(obs, now, s)
                except ContractViolation as exc:     # joint_delta without a state to integrate onto
                    self.finish('validate', exc, now=now)
                    return self._record(obs, begun, 'ended')
            elif player.last_values is not None:
                self.tally.dry_begins(now)
            self._request(timeline.since_s(now))
            if emitted is not None:
                return self._record_fresh(obs, begun, *emitted)
            reason = 'waiting' if player.last_values is None else 'underrun'
            return self._record(obs, begun, reason)

    def set_target(self, target: np.ndarray) -> None:
        """Take the target the robot committed (joint_delta, float32 (A,)): the next increment integrates onto it."""
        with self._lock:
            self.player.last_values = np.array(target, np.float32)

    def _record(self, obs: Observation, begun: float, reason: str) -> Action | None:
        """Hold this tick (``reason``): create its Step (see client/steps.py) and return the hold, or None."""
        action = self.player.hold(obs)
        self.player.pieces = None
        start, end = self.timeline.span(begun, None)
        self.step = self.timeline.step(step_start=start, step_end=end, observation=obs, policy_action=None,
                                       command=None if action is None else np.array(action.values, np.float32),
                                       hold_reason=reason)
        return action

    def _record_fresh(self, obs: Observation, begun: float, action: Action, ran: float, wanted: float) -> Action:
        """Create this tick's Step for a fresh action covering ``ran`` of the ``wanted`` chunk steps; return it."""
        pieces, self.player.pieces = self.player.pieces, None
        if not self.timeline.by_step:
            ran = wanted = max(self._to_limit(), _EPS)     # on the clock: up to the limit
        start, end = self.timeline.span(begun, ran, wanted)
        policy_action = action.delta if action.delta is not None else action.values
        self.step = self.timeline.step(
            step_start=start, step_end=end, observation=obs, policy_action=np.array(policy_action, np.float32),
            command=np.array(action.values, np.float32), hold_reason='',
            pieces=None if pieces is None else pieces[0], piece_share=None if pieces is None else pieces[1])
        return action

    def check(self, now: float) -> RunOutcome | None:
        """Apply the limits (max_actions counting the last emitted action, max_seconds); return the outcome."""
        with self._lock:
            if self._outcome is None:
                pending = self.player.pending(now, self._to_limit())
                limit = self.settings.max_actions
                if limit is not None and self.player.executed + pending >= limit - _EPS:
                    self.finish('completed', now=now)
                else:
                    self._check_limits(now)
            return self._outcome

    # -- reader thread ----------------------------------------------------------------------------

    def on_chunk(self, msg: pb.ActionChunk) -> None:
        """Take a chunk from the worker: measure, validate, skip stale rows, blend the seam, maybe prefetch."""
        arrival = self._clock()
        with self._lock:
            pending = self.requests.answered(msg.request_id, arrival, msg.timings.inference_ms / 1000.0, self.tally)
            if self._outcome is not None or pending is None:
                return
            try:
                chunk = unpack_chunk(msg)
                self._validate(chunk.actions, chunk.action_space)
            except ContractViolation as exc:
                self.finish('validate', exc)
                return
            self.tally.chunks += 1
            dt = chunk.dt if math.isfinite(chunk.dt) and chunk.dt > 0 else self.contract.dt
            was_playing = self.player.playing()
            live = self.player.live
            newest = live is None or live.request_id < msg.request_id
            fate = self.player.take(chunk, dt, pending.origin, msg.request_id)
            if fate == 'overtaken':
                return
            if newest:              # an older answer's word (done or not) is out of date once a newer one plays
                self.requests.done = self.requests.done or chunk.done
            if fate == 'stale':
                if chunk.done and newest:
                    self.finish('completed')
                else:
                    self._request()
                return
            if self._wake is not None and not was_playing:
                self._wake.set()      # nothing was playing: a paced caller acts now, not a period later
            self._request()

    def on_not_ready(self, request_id: int, error: NotReady) -> bool:
        """Take the worker's NOT_READY for request ``request_id``; return True when it is a wait, not a failure.

        A wait: no chunk has arrived yet, the request is the one in flight and the worker expects the
        deployment ready in ``error.retry_after_s`` s (> 0: it loads). The request is forgotten, and the first
        tick after :func:`~sequence_ai_ros.client.records.ready_poll_s` of that estimate sends a newer
        observation; until then the arm holds (reason ``waiting``). Otherwise (a chunk came: a deployment
        restarting mid-episode; a failed load) the caller fails the episode with the error, as for any other.
        An episode that has already finished takes it as a wait (nothing more to do).
        """
        with self._lock:
            if self._outcome is not None:
                return True
            return self.requests.not_ready(request_id, error, self.tally.chunks)

    @property
    def warming(self) -> bool:
        """True while the episode waits for its deployment to load (the worker said so; no chunk yet)."""
        return self.requests.warming is not None

    def fail(self, error: SequenceAIError) -> None:
        """End the episode; hold follows.

        The reason is 'validate' for a contract violation the worker reports (e.g. the policy produced
        non-finite actions, or the observation broke the contract), else 'error' (connection lost, worker
        error).
        """
        self.finish('validate' if isinstance(error, ContractViolation) else 'error', error)

    # -- any thread -------------------------------------------------------------------------------

    def finish(self, reason: str, error: SequenceAIError | None = None, now: float | None = None) -> RunOutcome:
        """End the episode once with ``reason`` (later calls keep the first); return the outcome.

        An episode that ends (``completed``, ``until``, ``timeout``) while it still waits for its deployment to
        load ends with reason ``error`` and a NotReady naming the worker's state and the wait: it never ran.
        """
        with self._lock:
            if self._outcome is None:
                now = self._clock() if now is None else now
                if self.requests.warming is not None and reason in ('completed', 'until', 'timeout'):
                    why = (f"within the episode's max_seconds ({self.settings.max_seconds:g} s)"
                           if reason == 'timeout' and self.settings.max_seconds is not None
                           else 'when the episode was ended')
                    reason, error = 'error', self._not_ready(now, why)
                self.player.advance(now, self._to_limit())
                t = self.tally
                t.dry_ends(now)
                self._outcome = RunOutcome(
                    actions=int(math.floor(self.player.executed + _EPS)), chunks=t.chunks,
                    elapsed_s=now - self._started, reason=reason, underruns=t.underruns, underrun_s=t.underrun_s,
                    max_seam_jump=t.max_seam_jump, latency_p50_ms=t.latency_ms(50), latency_p95_ms=t.latency_ms(95),
                    episode_id=self.episode_id, stale_actions=int(round(t.stale)),
                    smooth_seam_ignored=self.smooth_seam_ignored, error=error, peak_in_flight=self.requests.peak,
                    discarded=t.discarded, max_seam_gap=t.max_seam_gap, requests=self.requests.sent)
                if self._wake is not None:
                    self._wake.set()
            return self._outcome

    @property
    def started_s(self) -> float:
        """When the episode started (the engine's clock, s): its control grid's origin and ``elapsed_s``'s."""
        return self._started

    @property
    def dry(self) -> bool:
        """True during a dry spell (an underrun after the first action)."""
        return self.tally.dry

    @property
    def executed(self) -> float:
        """Chunk steps executed so far (an emitted action counts from the next tick)."""
        return self.player.executed

    @property
    def max_in_flight(self) -> int:
        """Requests in flight at most (1: no pipelining); settable before the first tick."""
        return self.requests.max_in_flight

    @max_in_flight.setter
    def max_in_flight(self, value: int) -> None:
        self.requests.max_in_flight = int(value)

    def outcome(self) -> RunOutcome | None:
        """The outcome once finished, else None."""
        return self._outcome

    def horizon(self) -> tuple[int, float, float, np.ndarray] | None:
        """The playing chunk, for a controller that interpolates it (the node's trajectory mode).

        :returns: (chunk number, position of the next row to play in chunk steps, dt (s), float32 (T, D)
            rows as received (seam blending applies at their first read)), or None before the first chunk.
        """
        with self._lock:
            live = self.player.live
            if live is None:
                return None
            return live.number, live.pos, live.dt, live.actions.copy()

    def stats(self) -> dict[str, float | int | str | bool]:
        """A live snapshot: buffer_s, actions, chunks, requests, underruns, underrun_s, latency p50/p95 (ms), ..."""
        with self._lock:
            live = self.player.live
            buffer_s = self.player.left * live.dt if live is not None else 0.0
            rtts = self._latency.samples()
            t, req = self.tally, self.requests
            return {
                'episode_id': self.episode_id, 'buffer_s': buffer_s,
                'actions': int(math.floor(self.player.executed + _EPS)),
                'chunks': t.chunks, 'underruns': t.underruns, 'underrun_s': t.underrun_s,
                'stale_actions': int(round(t.stale)), 'max_seam_jump': t.max_seam_jump,
                'latency_p50_ms': 1000 * percentile(rtts, 50), 'latency_p95_ms': 1000 * percentile(rtts, 95),
                'prefetch_lead_s': req.lead_s(self.timeline.period), 'in_flight': len(req.in_flight),
                'requests': req.sent,
                'peak_in_flight': req.peak, 'discarded': t.discarded, 'max_seam_gap': t.max_seam_gap,
                'dry': t.dry, 'finished': self._outcome is not None,
                'reason': self._outcome.reason if self._outcome else '',
            }

    # -- internals (lock held) --------------------------------------------------------------------

    def _request(self, late: float = 0.0) -> None:
        """Let the schedule send a request if one is due; ``late``: the tick's lateness (s; see maybe_send)."""
        if self._outcome is None:
            self.requests.maybe_send(self.player, self.timeline.period, late)

    def _to_limit(self) -> float:
        """Chunk steps left before max_actions (inf without one): a stall never carries the count past it."""
        limit = self.settings.max_actions
        return math.inf if limit is None else max(0.0, limit - self.player.executed)

    def _not_ready(self, now: float, why: str) -> NotReady:
        """The NotReady an episode ends with when its deployment was still loading (``why``: which bound)."""
        return NotReady(f'deployment {self.contract.deployment!r} not ready {why} (waited '
                        f'{now - self._started:.1f} s): {self.requests.warming}')

    def _check_limits(self, now: float) -> None:
        s = self.settings
        live = self.player.live
        if s.max_seconds is not None and now - self._started >= s.max_seconds:
            self.finish('timeout', now=now)
        elif (self.requests.warming is not None and self.ready_timeout is not None
              and now - self._started >= self.ready_timeout):
            self.finish('error', self._not_ready(now, f'within ready_timeout ({self.ready_timeout:g} s)'), now=now)
        elif s.max_actions is not None and self.player.executed >= s.max_actions - _EPS:
            self.finish('completed', now=now)
        elif live is not None and live.done and live.pos >= live.length - _EPS:
            self.finish('completed', now=now)
        elif (late := self.requests.overdue(self.chunk_timeout)) is not None:
            rid, waited = late
            self.finish('error', PolicyException(
                f'no action chunk for request {rid} within {self.chunk_timeout:g} s '
                f'(waited {waited:.1f} s): the policy is not answering (hung inference?)'), now=now)

    def _validate(self, actions: np.ndarray, space: ActionSpace) -> None:
        if space is not self._space:
            raise ActionSpaceMismatch(f'chunk action_space {space.value} but {self._space.value} is expected')
        d = self.contract.action_dim
        if actions.ndim != 2 or actions.shape[0] < 1 or actions.shape[1] != d:
            raise ContractViolation(f'chunk actions of shape {actions.shape}; (T, {d}) with T >= 1 is required')
        if not np.all(np.isfinite(actions)):
            raise ContractViolation('chunk has non-finite actions (NaN or inf)')


__all__ = ['CHUNK_TIMEOUT_COVERS', 'CHUNK_TIMEOUT_MIN_S', 'GRID_EARLY', 'MAX_IN_FLIGHT', 'MIN_LEAD_FRACTION',
           'UNPACED_STALL', 'EpisodeEngine', 'EpisodeSettings', 'OutRequest', 'chunk_timeout_s']
