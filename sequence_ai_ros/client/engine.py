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

import collections
import math
import threading
import time
from collections.abc import Callable

import numpy as np

from sequence_ai_ros.client import aggregate as ensemble
from sequence_ai_ros.client import resample
from sequence_ai_ros.client.latency import LatencyWindow, percentile
from sequence_ai_ros.client.outcome import RunOutcome
from sequence_ai_ros.client.records import (
    CHUNK_TIMEOUT_COVERS,
    CHUNK_TIMEOUT_MIN_S,
    MAX_IN_FLIGHT,
    MIN_LEAD_FRACTION,
    LiveChunk,
    OutRequest,
    Pending,
    chunk_timeout_s,
    ready_poll_s,
)
from sequence_ai_ros.client.sampling import History
from sequence_ai_ros.client.settings import EpisodeSettings
from sequence_ai_ros.client.steps import Step
from sequence_ai_ros.exceptions import (
    ActionSpaceMismatch,
    ContractViolation,
    NotReady,
    PolicyException,
    SequenceAIError,
)
from sequence_ai_ros.protocol import sequence_ai_pb2 as pb
from sequence_ai_ros.protocol.contract import ACT_TEMPORAL_ENSEMBLE_COEFF, Contract, check_aggregate
from sequence_ai_ros.protocol.messages import Chunk, unpack_chunk
from sequence_ai_ros.protocol.spaces import ActionSpace, position_mask, rest_mask
from sequence_ai_ros.protocol.types import Action, Observation

_EPS = 1e-9
#: A tick without a given grid index may come this share of a period before its deadline and still serve it.
GRID_EARLY = 0.05
#: Without a fixed control_period, a tick this many measured periods after the previous one missed deadlines.
UNPACED_STALL = 2.5
_Live = LiveChunk
_Pending = Pending


class EpisodeEngine:
    """One episode's chunk buffer and timeline.

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
        #: the worker's last NOT_READY while the deployment loads, until the episode's first chunk (None: none)
        self._warming: NotReady | None = None
        self._retry_at = 0.0       # no request before this time (the clock's s) while warming
        self._latency, self._send, self._wake, self._clock = latency, send, wake, clock
        self._lock = threading.RLock()
        self._space = settings.expect_action_space or contract.action_space
        self._mask = position_mask(self._space, contract.action_dim)
        self._rest = rest_mask(self._space, contract.action_dim)
        self.aggregate = settings.aggregate or contract.aggregate
        coeff = settings.temporal_ensemble_coeff
        if coeff is None:
            coeff = (contract.temporal_ensemble_coeff if contract.aggregate == 'weighted_average'
                     else ACT_TEMPORAL_ENSEMBLE_COEFF)
        check_aggregate(self.aggregate, coeff if self.aggregate == 'weighted_average' else 0.0, self._space)
        #: the ensembling coefficient m, or None for latest_only
        self.ensemble_coeff = ensemble.coefficient(self.aggregate, coeff)
        self._history = History(contract.observation.history, contract.dt)
        self._started = clock()
        self._period = settings.control_period or contract.dt
        self.chunk_timeout = chunk_timeout_s(contract, settings.chunk_timeout)
        self._last_tick: float | None = None
        self.executed = 0.0
        self._live: _Live | None = None
        self._emit_t: float | None = None
        self._emit_step = 0.0
        self._last_obs: tuple[Observation, list[Observation], float, int] | None = None
        self._obs_seq = self._used_seq = 0
        self._in_flight: dict[int, _Pending] = {}
        self.max_in_flight = MAX_IN_FLIGHT
        self.peak_in_flight = self.discarded = 0
        self.max_seam_gap = 0.0
        self._serve_s: collections.deque[float] = collections.deque(maxlen=16)   # the worker's inference (s)
        self._prev_read: tuple[np.ndarray, float] | None = None
        self._next_rid = 1
        self._done_seen = False
        self._last_values: np.ndarray | None = None
        self._last_raw: np.ndarray | None = None
        self._last_chunk = -1
        self.chunks = self.underruns = 0
        self.underrun_s = self.max_seam_jump = self.skipped = 0.0
        self._dry_since: float | None = None
        self._rtts: list[float] = []
        self._outcome: RunOutcome | None = None
        # a seam cross-fade is a no-op for rates, and redundant where overlapping chunks are averaged
        self.smooth_seam_ignored = settings.smooth_seam > 0 and (not self._space.is_absolute
                                                                 or self.ensemble_coeff is not None)
        # the episode's timeline (see client/steps.py): the deadline of the latest tick, counted from the
        # first (and the caller's own index of the first), and where its span starts, in chunk steps
        self._grid_first: int | None = None
        self._grid: int | None = None
        self._grid_t = self._grid_t0 = 0.0
        self._span_start = self._span_end = 0.0
        self._span_len = 0.0
        #: the Step the latest tick created, for the caller to complete and commit (None before any)
        self.step: Step | None = None
        self._pieces: tuple[np.ndarray, np.ndarray] | None = None   # the emitted tick's parts (see Step.pieces)

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
            self._place(now, grid_index)
            self._advance(now)
            if self._last_tick is not None and self.settings.control_period is None and now > self._last_tick:
                self._period = 0.8 * self._period + 0.2 * (now - self._last_tick)
            self._last_tick = now
            self._obs_seq += 1
            self._last_obs = (obs, self._history.push(obs), self.executed, self._obs_seq)
            if self._outcome is None:
                self._check_limits(now)
            if self._outcome is not None:
                return self._record(obs, self._hold(obs), 'ended')
            live = self._live
            action = None
            if live is not None and live.pos < live.length - _EPS:
                action = self._emit(live, obs, now)
            elif self._last_values is not None and self._dry_since is None:
                self.underruns += 1
                self._dry_since = now
            if self._outcome is not None:      # emit may fail validation (joint_delta without a state)
                return self._record(obs, self._hold(obs), 'ended')
            self._maybe_request()
            if action is not None:
                return self._record(obs, action, '')
            return self._record(obs, self._hold(obs), 'waiting' if self._last_values is None else 'underrun')

    def set_target(self, target: np.ndarray) -> None:
        """Take the target the robot committed (joint_delta, float32 (A,)): the next increment integrates onto it."""
        with self._lock:
            self._last_values = np.array(target, np.float32)

    def _place(self, now: float, given: int | None) -> None:
        """Put this tick on the episode's timeline: its grid index and where its span starts."""
        if given is not None:
            if self._grid_first is None:
                self._grid_first = int(given)
            g = int(given) - self._grid_first
        elif self._grid is None:
            g = 0
        elif self.settings.control_period:
            # a fixed period: the deadline whose period holds ``now`` (a tick up to 0.95 of a period late still
            # serves its own), counted from the first tick
            g = int(math.floor((now - self._grid_t0) / self.settings.control_period + GRID_EARLY))
        else:
            # no fixed period: a deadline is missed only by a stall of well over the measured period (a loop
            # without pacing jitters by its own period, and is one deadline per call)
            gap = (now - self._grid_t) / self._period
            g = self._grid + (int(math.floor(gap + 0.5)) if gap > UNPACED_STALL else 1)
        if self._grid is None:
            g = max(0, g)
            self._grid_t0 = now
            self._span_start = g * self._steps_per_tick()
        else:
            g = max(g, self._grid + 1)
            gap = g - self._grid
            if self.settings.control_period:
                self._span_start = g * self._steps_per_tick()          # the control grid, exactly
            elif not self._by_step():
                # no fixed period, on the clock: the chunk moves with time, and so does the record
                self._span_start = max(self._span_start, (now - self._grid_t0) / self.contract.dt)
            else:
                # no fixed period, by step: right after the last record, plus the deadlines a stall missed
                self._span_start = self._span_end + (gap - 1) * self._span_len
        self._grid, self._grid_t = g, now
        self._span_len = self._steps_per_tick()

    def _steps_per_tick(self) -> float:
        return (self.settings.control_period or self._period) / self.contract.dt

    def _record(self, obs: Observation, action: Action | None, hold_reason: str) -> Action | None:
        """Create this tick's Step (see client/steps.py) and return ``action``."""
        fresh = action is not None and not action.hold
        policy_action = None
        if fresh and action is not None:
            policy_action = action.delta if action.delta is not None else action.values
        command = None if action is None else np.array(action.values, np.float32)
        pieces, self._pieces = (self._pieces if fresh else None), None
        length = self._span_len
        if fresh:
            # what this tick runs: by step, the emitted step (cut at max_actions); on the clock, up to the limit
            length = self._emit_step if self._by_step() else min(length, max(self._to_limit(), _EPS))
        self._span_end = self._span_start + length
        self.step = Step(grid_index=self._grid or 0, step_start=self._span_start,
                         step_end=self._span_end, observation=obs,
                         policy_action=None if policy_action is None else np.array(policy_action, np.float32),
                         command=command, hold_reason='' if fresh else hold_reason,
                         pieces=None if pieces is None else pieces[0],
                         piece_share=None if pieces is None else pieces[1])
        return action

    def check(self, now: float) -> RunOutcome | None:
        """Apply the limits (max_actions counting the last emitted action, max_seconds); return the outcome."""
        with self._lock:
            if self._outcome is None:
                pending = self._pending_advance(now)
                limit = self.settings.max_actions
                if limit is not None and self.executed + pending >= limit - _EPS:
                    self.finish('completed', now=now)
                else:
                    self._check_limits(now)
            return self._outcome

    # -- reader thread ----------------------------------------------------------------------------

    def on_chunk(self, msg: pb.ActionChunk) -> None:
        """Take a chunk from the worker: measure, validate, skip stale rows, blend the seam, maybe prefetch."""
        arrival = self._clock()
        with self._lock:
            pending = self._in_flight.pop(msg.request_id, None)
            if self._outcome is not None or pending is None:
                return
            self._warming = None       # the deployment serves
            sent, e_obs = pending.sent, pending.origin
            self._serve_s.append(max(0.0, msg.timings.inference_ms) / 1000.0)
            self._latency.add(arrival - sent)
            self._rtts.append(arrival - sent)
            try:
                chunk = unpack_chunk(msg)
                self._validate(chunk.actions, chunk.action_space)
            except ContractViolation as exc:
                self.finish('validate', exc)
                return
            self.chunks += 1
            self._done_seen = self._done_seen or chunk.done
            dt = chunk.dt if math.isfinite(chunk.dt) and chunk.dt > 0 else self.contract.dt
            skip = max(0.0, self.executed - e_obs)
            length = chunk.actions.shape[0]
            if skip >= length - _EPS:
                self.skipped += length
                self.discarded += 1
                if chunk.done:
                    self.finish('completed')
                else:
                    self._maybe_request()
                return
            old = self._live
            if self._wake is not None and (old is None or old.pos >= old.length - _EPS):
                self._wake.set()      # nothing was playing: a paced caller acts now, not a period later
            if self.ensemble_coeff is not None:
                self._live = self._folded(old, chunk, dt, skip, e_obs, msg.request_id, self.ensemble_coeff)
                self._maybe_request()
                return
            if old is not None and not old.read:
                self.discarded += 1   # replaced before any tick read it
            seam = None
            if old is not None and self.settings.smooth_seam > 0 and self._space.is_absolute:
                if old.read or old.seam is None:
                    seam = (old.actions, old.pos - skip)   # blended at its first read, once its start is known
                else:   # the old chunk never played: blend from what did (its own seam's rows), not from it
                    seam = (old.seam[0], old.seam[1] + old.pos - skip)
            self._live = _Live(chunk.actions, chunk.action_space, dt, self.chunks - 1, chunk.done, skip, seam,
                               origin=e_obs, request_id=msg.request_id)
            self._maybe_request()

    def _folded(self, old: _Live | None, chunk: Chunk, dt: float, skip: float, origin: float, request_id: int,
                coeff: float) -> _Live:
        """The playing rows with ``chunk`` folded in (aggregate, coefficient ``coeff``): from its first step on."""
        rows, counts = chunk.actions, np.ones(chunk.actions.shape[0], np.int64)
        if old is not None and old.counts is not None and old.pos < old.length - _EPS:
            offset = int(round(origin - old.origin))          # both whole steps (see _maybe_request)
            rows, counts = ensemble.merge(old.actions, old.counts, chunk.actions, offset, coeff,
                                          extend=not chunk.done)
        return _Live(rows, chunk.action_space, dt, self.chunks - 1, chunk.done, skip, None, origin=origin,
                     request_id=request_id, read=False, counts=counts)

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
            if self.chunks or request_id not in self._in_flight or not error.retry_after_s > 0:
                return False
            del self._in_flight[request_id]
            self._warming = error
            self._retry_at = self._clock() + ready_poll_s(error.retry_after_s)
            return True

    @property
    def warming(self) -> bool:
        """True while the episode waits for its deployment to load (the worker said so; no chunk yet)."""
        return self._warming is not None

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
                if self._warming is not None and reason in ('completed', 'until', 'timeout'):
                    why = (f"within the episode's max_seconds ({self.settings.max_seconds:g} s)"
                           if reason == 'timeout' and self.settings.max_seconds is not None
                           else 'when the episode was ended')
                    reason, error = 'error', self._not_ready(now, why)
                self.executed += self._pending_advance(now)
                self._emit_t = None
                if self._dry_since is not None:
                    self.underrun_s += max(0.0, now - self._dry_since)
                    self._dry_since = None
                self._outcome = RunOutcome(
                    actions=int(math.floor(self.executed + _EPS)), chunks=self.chunks, elapsed_s=now - self._started,
                    reason=reason, underruns=self.underruns, underrun_s=self.underrun_s,
                    max_seam_jump=self.max_seam_jump, latency_p50_ms=1000 * percentile(self._rtts, 50),
                    latency_p95_ms=1000 * percentile(self._rtts, 95), episode_id=self.episode_id,
                    stale_actions=int(round(self.skipped)), smooth_seam_ignored=self.smooth_seam_ignored, error=error,
                    peak_in_flight=self.peak_in_flight, discarded=self.discarded, max_seam_gap=self.max_seam_gap)
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
        return self._dry_since is not None

    def outcome(self) -> RunOutcome | None:
        """The outcome once finished, else None."""
        return self._outcome

    def horizon(self) -> tuple[int, float, float, np.ndarray] | None:
        """The playing chunk, for a controller that interpolates it (the node's trajectory mode).

        :returns: (chunk number, position of the next row to play in chunk steps, dt (s), float32 (T, D)
            rows as received (seam blending applies at their first read)), or None before the first chunk.
        """
        with self._lock:
            live = self._live
            if live is None:
                return None
            return live.number, live.pos, live.dt, live.actions.copy()

    def stats(self) -> dict[str, float | int | str | bool]:
        """A live snapshot: buffer_s, actions, chunks, underruns, underrun_s, latency p50/p95 (ms), ..."""
        with self._lock:
            live = self._live
            buffer_s = max(0.0, (live.length - live.pos) * live.dt) if live is not None else 0.0
            rtts = self._latency.samples()
            return {
                'episode_id': self.episode_id, 'buffer_s': buffer_s, 'actions': int(math.floor(self.executed + _EPS)),
                'chunks': self.chunks, 'underruns': self.underruns, 'underrun_s': self.underrun_s,
                'stale_actions': int(round(self.skipped)), 'max_seam_jump': self.max_seam_jump,
                'latency_p50_ms': 1000 * percentile(rtts, 50), 'latency_p95_ms': 1000 * percentile(rtts, 95),
                'prefetch_lead_s': self._latency.lead_s(self._period), 'in_flight': len(self._in_flight),
                'peak_in_flight': self.peak_in_flight, 'discarded': self.discarded,
                'max_seam_gap': self.max_seam_gap,
                'dry': self._dry_since is not None, 'finished': self._outcome is not None,
                'reason': self._outcome.reason if self._outcome else '',
            }

    # -- internals (lock held) --------------------------------------------------------------------

    def _by_step(self) -> bool:
        """True when the timeline advances by the emitted step rather than by the clock.

        So it does for act/run pacing, and for every delta or velocity space: an increment integrated over
        [p, p + s) must advance the timeline by exactly s, else a caller whose ticks jitter would drop or
        repeat part of a row.
        """
        return self.fixed_step or not self._space.is_absolute

    def _pending_advance(self, now: float) -> float:
        live = self._live
        if self._emit_t is None or live is None:
            return 0.0
        adv = self._emit_step if self._by_step() else (now - self._emit_t) / live.dt
        return max(0.0, min(adv, live.length - live.pos, self._to_limit()))

    def _to_limit(self) -> float:
        """Chunk steps left before max_actions (inf without one): a stall never carries the count past it."""
        limit = self.settings.max_actions
        return math.inf if limit is None else max(0.0, limit - self.executed)

    def _advance(self, now: float) -> None:
        live = self._live
        if self._emit_t is not None and live is not None:
            whole = live.length - live.pos
            by_step = self._by_step()
            # act/run: every step runs once, whatever the callback's overruns (counted: the ledger's
            # ticks_skipped; the deadlines they missed are held rows in the export)
            want = self._emit_step if by_step else (now - self._emit_t) / live.dt
            adv = max(0.0, min(want, whole, self._to_limit()))   # rows past max_actions never run
            if not by_step and want > whole + _EPS and self._dry_since is None and whole < self._to_limit():
                # The chunk ran out between two ticks: the dry spell began when it did, not at this tick.
                self.underruns += 1
                self._dry_since = self._emit_t + whole * live.dt
            live.pos += adv
            self.executed += adv
            if abs(live.pos - round(live.pos)) < 1e-7:
                live.pos = float(round(live.pos))
            if abs(self.executed - round(self.executed)) < 1e-7:
                self.executed = float(round(self.executed))
        self._emit_t = None

    def _not_ready(self, now: float, why: str) -> NotReady:
        """The NotReady an episode ends with when its deployment was still loading (``why``: which bound)."""
        return NotReady(f'deployment {self.contract.deployment!r} not ready {why} (waited '
                        f'{now - self._started:.1f} s): {self._warming}')

    def _check_limits(self, now: float) -> None:
        s = self.settings
        live = self._live
        if s.max_seconds is not None and now - self._started >= s.max_seconds:
            self.finish('timeout', now=now)
        elif (self._warming is not None and self.ready_timeout is not None
              and now - self._started >= self.ready_timeout):
            self.finish('error', self._not_ready(now, f'within ready_timeout ({self.ready_timeout:g} s)'), now=now)
        elif s.max_actions is not None and self.executed >= s.max_actions - _EPS:
            self.finish('completed', now=now)
        elif live is not None and live.done and live.pos >= live.length - _EPS:
            self.finish('completed', now=now)
        elif self._in_flight and self._clock() - min(p.sent for p in self._in_flight.values()) > self.chunk_timeout:
            rid, sent = min(((r, p.sent) for r, p in self._in_flight.items()), key=lambda item: item[1])
            self.finish('error', PolicyException(
                f'no action chunk for request {rid} within {self.chunk_timeout:g} s '
                f'(waited {self._clock() - sent:.1f} s): the policy is not answering (hung inference?)'), now=now)

    def _validate(self, actions: np.ndarray, space: ActionSpace) -> None:
        if space is not self._space:
            raise ActionSpaceMismatch(f'chunk action_space {space.value} but {self._space.value} is expected')
        d = self.contract.action_dim
        if actions.ndim != 2 or actions.shape[0] < 1 or actions.shape[1] != d:
            raise ContractViolation(f'chunk actions of shape {actions.shape}; (T, {d}) with T >= 1 is required')
        if not np.all(np.isfinite(actions)):
            raise ContractViolation('chunk has non-finite actions (NaN or inf)')

    def _step(self, live: _Live) -> float:
        return (self.settings.control_period or self._period) / live.dt

    def _emit(self, live: _Live, obs: Observation, now: float) -> Action | None:
        if live.seam is not None:
            old, offset = live.seam
            live.actions = resample.blend_seam(live.actions, live.pos, old, offset, self.settings.smooth_seam)
            live.seam = None
        # the tick's span of chunk steps, never past max_actions: a delta space integrates every row of it
        s = min(self._step(live), max(self._to_limit(), _EPS))
        raw = resample.sample(live.actions, live.space, live.pos, s, self._mask)
        self._pieces = None if self._mask.all() else resample.pieces(live.actions, live.space, live.pos, s,
                                                                       self._mask)
        delta = None
        values = raw
        if live.space is ActionSpace.JOINT_DELTA:
            base = self._last_values if self._last_values is not None else self._measured(obs)
            if base is None:
                self.finish('validate', ContractViolation(
                    'joint_delta needs the measured state (named like the actions, or of the action dimension) '
                    'to integrate the first increment onto'), now=now)
                return None
            delta, values = raw, (base.astype(np.float32) + raw).astype(np.float32)
        elif live.space.is_delta:
            delta = raw
        if live.number != self._last_chunk:
            self.skipped += live.pos          # rows of this chunk that will never run (stale at its arrival)
        if live.number != self._last_chunk and self._last_raw is not None:
            self.max_seam_jump = max(self.max_seam_jump, float(np.max(np.abs(raw - self._last_raw))))
            prev = self._prev_read
            p_old = live.origin + live.pos - prev[1] if prev is not None else -1.0
            if prev is not None and 0.0 <= p_old <= prev[0].shape[0] - 1 + _EPS:
                # The discontinuity: the new chunk against the old one's own row for the same step. Past its
                # last row the old chunk has none (it would hold that row), so a seam there is a jump only.
                cont = resample.sample(prev[0], live.space, p_old, s, self._mask)
                self.max_seam_gap = max(self.max_seam_gap, float(np.max(np.abs(raw - cont))))
        self._last_chunk = live.number
        live.read = True
        self._prev_read = (live.actions, live.origin)
        if self._dry_since is not None:
            self.underrun_s += max(0.0, now - self._dry_since)
            self._dry_since = None
        self._last_raw, self._last_values = raw, values
        self._emit_t, self._emit_step = now, s
        return Action(values=values, action_space=live.space, names=tuple(self.contract.action_names),
                      chunk=live.number, index=live.pos, hold=False, delta=delta)

    def _measured(self, obs: Observation) -> np.ndarray | None:
        names = self.contract.action_names
        if obs.state_names and all(n in obs.state_names for n in names):
            idx = [obs.state_names.index(n) for n in names]
            return obs.state[idx].astype(np.float32)
        if obs.state.shape[0] == len(names):
            return obs.state.astype(np.float32)
        return None

    def _hold(self, obs: Observation) -> Action | None:
        live = self._live
        chunk, index = (live.number, live.pos) if live is not None else (0, 0.0)
        if self._last_values is not None:
            values = self._last_values.copy()
            values[self._rest] = 0.0            # a rate holds by commanding no motion; positions stay
        elif self._space in (ActionSpace.JOINT_ABSOLUTE, ActionSpace.JOINT_DELTA):
            values = self._measured(obs)
            if values is None:
                return None
        else:
            return None
        delta = np.zeros_like(values) if self._space.is_delta else None
        return Action(values=values, action_space=self._space, names=tuple(self.contract.action_names),
                      chunk=chunk, index=index, hold=True, delta=delta)

    def _maybe_request(self) -> None:
        if (self._outcome is not None or self._done_seen or self._last_obs is None
                or len(self._in_flight) >= max(1, self.max_in_flight)):
            return
        obs, history, e_obs, seq = self._last_obs
        if seq == self._used_seq:
            return
        if self._warming is not None and self._clock() < self._retry_at:
            return   # the deployment loads: a newer observation goes once the worker's estimate has passed
        if len(history) < self.contract.observation.history - 1:
            return   # the first chunk waits for N real frames ((N - 1) * dt): none is invented in their place
        live = self._live
        dt = live.dt if live is not None else self.contract.dt
        remaining = max(0.0, live.length - live.pos) if live is not None else 0.0
        # Steps covered ahead of the timeline by the playing chunk and by the chunks awaited.
        cover_end = self.executed + remaining
        for p in self._in_flight.values():
            cover_end = max(cover_end, p.origin + self.contract.chunk_length)
        ahead = max(0.0, cover_end - self.executed)
        s = self.settings
        if s.max_actions is not None and self.executed + ahead >= s.max_actions - _EPS:
            return
        if ahead > _EPS:
            lead = max(self._latency.lead_s(self._period), MIN_LEAD_FRACTION * self.contract.chunk_length * dt)
            # aggregating: a chunk per tick, as LeRobot runs an ensembled ACT (one inference per step)
            if not s.prefetch or (ahead * dt > lead and self.ensemble_coeff is None):
                return
            if self._in_flight:
                # Never faster than the worker answers one episode's requests (its inference time, as the
                # chunks report it): faster would only queue them there and inflate the round trip. Until a
                # chunk of this episode has reported it, one request at a time. From then on any known round
                # trip times a second one, the connection's cold one included: the first seam of an episode
                # is covered only by a request sent soon after its first chunk arrived (the request sent at
                # that arrival has its observation at step 0 and ends where the first chunk ends), and a
                # warm sample comes a whole round trip later. A cold one longer than the whole chunk waits
                # for a warm one: overlap cannot cover such a link (each chunk would arrive stale), so it
                # is taken for a start-up outlier (JIT, caches) and sets off no burst of requests.
                if not self._serve_s:
                    return
                cold = self._latency.cold_s()
                if not self._latency.samples() and (cold is None or cold >= self.contract.chunk_length * dt):
                    return
                newest = max(p.sent for p in self._in_flight.values())
                spacing = max(self._period, 1.2 * percentile(list(self._serve_s), 50))
                if self._clock() - newest < spacing:
                    return
        # Row 0 of the answer is the step the observation fell in (whole steps for delta and velocity
        # spaces: one grid, so an increment split across a seam runs once).
        # (aggregating: whole steps too, so that the chunks folded together share one grid of steps)
        whole = not self._space.is_absolute or self.ensemble_coeff is not None
        origin = float(math.floor(e_obs + 1e-7)) if whole else e_obs
        tail = None
        delay = 0
        if live is not None and remaining > _EPS:
            # Row 0 of the tail is the playing chunk's row nearest the observation step, as row 0 of the answer
            # is that step: an in-painting policy (RTC) aligns the two row by row. On the clock the step is a
            # whole one give or take the tick's jitter (7.003 or 6.997); the next whole row (ceil) would shift
            # every in-painted row by one step whenever a tick ran a little late.
            tail = live.actions[max(0, int(math.floor(origin - live.origin + 0.5))):]
        if live is not None or self._in_flight:
            # An upper estimate (the window's largest warm round trip, with a margin while they are few, the
            # cold one only before any: LatencyWindow.delay_s; + two ticks: a request leaves at a tick and
            # its chunk is read at one), so that a policy in-painting chunk_tail[:delay] covers every step
            # that runs before its chunk is read.
            delay = int(math.ceil((self._latency.delay_s() + 2 * self._period) / dt - 1e-9))
            delay = min(delay, self.contract.chunk_length)
        rid = self._next_rid
        self._next_rid += 1
        self._used_seq = seq
        self._in_flight[rid] = _Pending(self._clock(), origin, origin + delay)
        self.peak_in_flight = max(self.peak_in_flight, len(self._in_flight))
        self._send(OutRequest(obs=obs, history=history, chunk_tail=tail, expected_delay_actions=delay,
                              last_action=self._last_raw, request_id=rid, observation_step=origin,
                              tail_request_id=live.request_id if live is not None else 0))


__all__ = ['CHUNK_TIMEOUT_COVERS', 'CHUNK_TIMEOUT_MIN_S', 'MAX_IN_FLIGHT', 'MIN_LEAD_FRACTION', 'EpisodeEngine',
           'EpisodeSettings', 'OutRequest', 'chunk_timeout_s']
