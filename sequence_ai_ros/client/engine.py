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
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from collections.abc import Callable

import numpy as np

from sequence_ai_ros.client import resample
from sequence_ai_ros.client.latency import LatencyWindow, percentile
from sequence_ai_ros.client.outcome import RunOutcome
from sequence_ai_ros.client.sampling import History
from sequence_ai_ros.exceptions import ActionSpaceMismatch, ContractViolation, PolicyException, SequenceAIError
from sequence_ai_ros.protocol import sequence_ai_pb2 as pb
from sequence_ai_ros.protocol.contract import Contract
from sequence_ai_ros.protocol.messages import unpack_chunk
from sequence_ai_ros.protocol.spaces import ActionSpace
from sequence_ai_ros.protocol.types import Action, Observation

_EPS = 1e-9
#: The prefetch lead is never less than this share of the playing chunk's covers_seconds: a stall of the
#: robot's own process (GC, a loaded core) between two ticks must not eat the whole measured margin. With
#: a 0 ms policy the measured lead alone is ~2 ticks; the floor costs only more, earlier requests.
MIN_LEAD_FRACTION = 0.25
#: The no-chunk deadline: a request unanswered for longer than
#: ``max(CHUNK_TIMEOUT_MIN_S, CHUNK_TIMEOUT_COVERS * covers_seconds)`` (s) ends the episode with reason
#: 'error' and a :class:`~sequence_ai_ros.exceptions.PolicyException` (a hung inference must not leave
#: the arm in one endless underrun). Overridden per episode by ``chunk_timeout``.
CHUNK_TIMEOUT_MIN_S = 10.0
CHUNK_TIMEOUT_COVERS = 10.0


@dataclasses.dataclass(frozen=True)
class EpisodeSettings:
    """How one episode is driven.

    :param instruction: the pinned instruction (act/run overwrite each observation's with it when set).
    :param max_seconds: end with 'timeout' after this many seconds (s), or None.
    :param max_actions: end with 'completed' after this many chunk steps, or None.
    :param prefetch: request the next chunk while the current one plays; False requests only when empty.
    :param smooth_seam: rows to cross-fade at each seam (absolute spaces, never the first chunk).
    :param expect_action_space: the space the caller commands; other chunks end the episode 'validate'.
    :param control_period: the caller's period (s); None measures it from the ticks.
    :param fixed_step: advance exactly ``control_period`` per emitted action (act/run pacing) instead of
        by the clock (next_action).
    :param chunk_timeout: seconds a request may stay unanswered before the episode ends with 'error' (s);
        None: ``max(CHUNK_TIMEOUT_MIN_S, CHUNK_TIMEOUT_COVERS * covers_seconds)``.
    """

    instruction: str = ''
    max_seconds: float | None = None
    max_actions: float | None = None
    prefetch: bool = True
    smooth_seam: int = 0
    expect_action_space: ActionSpace | None = None
    control_period: float | None = None
    fixed_step: bool = False
    chunk_timeout: float | None = None


def chunk_timeout_s(contract: Contract, chunk_timeout: float | None = None) -> float:
    """The no-chunk deadline (s): ``chunk_timeout`` when given, else the default from the contract."""
    if chunk_timeout is not None:
        return float(chunk_timeout)
    return max(CHUNK_TIMEOUT_MIN_S, CHUNK_TIMEOUT_COVERS * contract.covers_seconds)


@dataclasses.dataclass
class OutRequest:
    """A request the engine wants sent (packed on the sender thread, not on the control thread).

    :param obs: the observation. :param history: earlier frames, oldest first.
    :param chunk_tail: float32 (K, D) not-yet-executed rows, or None. :param expected_delay_actions: steps.
    :param last_action: float32 (D,) the last executed row, or None. :param request_id: the id.
    """

    obs: Observation
    history: list[Observation]
    chunk_tail: np.ndarray | None
    expected_delay_actions: int
    last_action: np.ndarray | None
    request_id: int


@dataclasses.dataclass
class _Live:
    actions: np.ndarray          # float32 (T, D), seam-blended
    space: ActionSpace
    dt: float
    number: int
    done: bool
    pos: float                   # position the next tick reads (chunk steps)
    seam: tuple[np.ndarray, float] | None = None   # (old rows, old pos - new pos) to blend at the first read

    @property
    def length(self) -> int:
        return self.actions.shape[0]


class EpisodeEngine:
    """One episode's chunk buffer and timeline.

    :param contract: the policy's contract.
    :param settings: how the episode is driven.
    :param episode_id: its id.
    :param latency: the connection's round-trip window (shared across episodes).
    :param send: enqueues an :class:`OutRequest`; must not block.
    :param wake: set whenever the episode finishes, so a pacing wait ends early.
    :param clock: the robot's monotonic clock (s).
    """

    def __init__(self, contract: Contract, settings: EpisodeSettings, episode_id: str, latency: LatencyWindow,
                 send: Callable[[OutRequest], None], wake: threading.Event | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.contract, self.settings, self.episode_id = contract, settings, episode_id
        self._latency, self._send, self._wake, self._clock = latency, send, wake, clock
        self._lock = threading.RLock()
        self._space = settings.expect_action_space or contract.action_space
        self._mask = resample.position_mask(self._space, contract.action_dim)
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
        self._in_flight: tuple[int, float, float] | None = None
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
        self.smooth_seam_ignored = settings.smooth_seam > 0 and not self._space.is_absolute

    # -- control thread ---------------------------------------------------------------------------

    def tick(self, obs: Observation, now: float) -> Action | None:
        """Return the action for ``now`` (monotonic s) given the current observation; never blocks.

        :returns: an Action; ``hold=True`` repeats the last command (or the measured state before the
            first) when the buffer is dry or the episode has finished; None when there is nothing to hold.
        """
        with self._lock:
            self._advance(now)
            if self._last_tick is not None and self.settings.control_period is None and now > self._last_tick:
                self._period = 0.8 * self._period + 0.2 * (now - self._last_tick)
            self._last_tick = now
            self._obs_seq += 1
            self._last_obs = (obs, self._history.push(obs), self.executed, self._obs_seq)
            if self._outcome is None:
                self._check_limits(now)
            if self._outcome is not None:
                return self._hold(obs)
            live = self._live
            action = None
            if live is not None and live.pos < live.length - _EPS:
                action = self._emit(live, obs, now)
            elif self._last_values is not None and self._dry_since is None:
                self.underruns += 1
                self._dry_since = now
            if self._outcome is not None:      # emit may fail validation (joint_delta without a state)
                return self._hold(obs)
            self._maybe_request()
            return action if action is not None else self._hold(obs)

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
            if self._outcome is not None or self._in_flight is None or msg.request_id != self._in_flight[0]:
                return
            _, sent, e_obs = self._in_flight
            self._in_flight = None
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
                if chunk.done:
                    self.finish('completed')
                else:
                    self._maybe_request()
                return
            old = self._live
            seam = None
            if old is not None and self.settings.smooth_seam > 0 and self._space.is_absolute:
                seam = (old.actions, old.pos - skip)   # blended at its first read, once its start is known
            self._live = _Live(chunk.actions, chunk.action_space, dt, self.chunks - 1, chunk.done, skip, seam)
            self._maybe_request()

    def fail(self, error: SequenceAIError) -> None:
        """End the episode; hold follows.

        The reason is 'validate' for a contract violation the worker reports (e.g. the policy produced
        non-finite actions, or the observation broke the contract), else 'error' (connection lost, worker
        error).
        """
        self.finish('validate' if isinstance(error, ContractViolation) else 'error', error)

    # -- any thread -------------------------------------------------------------------------------

    def finish(self, reason: str, error: SequenceAIError | None = None, now: float | None = None) -> RunOutcome:
        """End the episode once with ``reason`` (later calls keep the first); return the outcome."""
        with self._lock:
            if self._outcome is None:
                now = self._clock() if now is None else now
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
                    skipped=int(round(self.skipped)), smooth_seam_ignored=self.smooth_seam_ignored, error=error)
                if self._wake is not None:
                    self._wake.set()
            return self._outcome

    @property
    def dry(self) -> bool:
        """True during a dry spell (an underrun after the first action)."""
        return self._dry_since is not None

    def outcome(self) -> RunOutcome | None:
        """The outcome once finished, else None."""
        return self._outcome

    def stats(self) -> dict[str, float | int | str | bool]:
        """A live snapshot: buffer_s, actions, chunks, underruns, underrun_s, latency p50/p95 (ms), ..."""
        with self._lock:
            live = self._live
            buffer_s = max(0.0, (live.length - live.pos) * live.dt) if live is not None else 0.0
            rtts = self._latency.samples()
            return {
                'episode_id': self.episode_id, 'buffer_s': buffer_s, 'actions': int(math.floor(self.executed + _EPS)),
                'chunks': self.chunks, 'underruns': self.underruns, 'underrun_s': self.underrun_s,
                'skipped': int(round(self.skipped)), 'max_seam_jump': self.max_seam_jump,
                'latency_p50_ms': 1000 * percentile(rtts, 50), 'latency_p95_ms': 1000 * percentile(rtts, 95),
                'prefetch_lead_s': self._latency.lead_s(self._period), 'in_flight': self._in_flight is not None,
                'dry': self._dry_since is not None, 'finished': self._outcome is not None,
                'reason': self._outcome.reason if self._outcome else '',
            }

    # -- internals (lock held) --------------------------------------------------------------------

    def _pending_advance(self, now: float) -> float:
        live = self._live
        if self._emit_t is None or live is None:
            return 0.0
        adv = self._emit_step if self.settings.fixed_step else (now - self._emit_t) / live.dt
        return max(0.0, min(adv, live.length - live.pos))

    def _advance(self, now: float) -> None:
        live = self._live
        if self._emit_t is not None and live is not None:
            whole = live.length - live.pos
            want = self._emit_step if self.settings.fixed_step else (now - self._emit_t) / live.dt
            adv = max(0.0, min(want, whole))
            if not self.settings.fixed_step and want > whole + _EPS and self._dry_since is None:
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

    def _check_limits(self, now: float) -> None:
        s = self.settings
        live = self._live
        if s.max_seconds is not None and now - self._started >= s.max_seconds:
            self.finish('timeout', now=now)
        elif s.max_actions is not None and self.executed >= s.max_actions - _EPS:
            self.finish('completed', now=now)
        elif live is not None and live.done and live.pos >= live.length - _EPS:
            self.finish('completed', now=now)
        elif self._in_flight is not None and self._clock() - self._in_flight[1] > self.chunk_timeout:
            rid, sent, _ = self._in_flight
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
        s = self._step(live)
        raw = resample.sample(live.actions, live.space, live.pos, s, self._mask)
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
        self._last_chunk = live.number
        if self._dry_since is not None:
            self.underrun_s += max(0.0, now - self._dry_since)
            self._dry_since = None
        self._last_raw, self._last_values = raw, values
        self._emit_t, self._emit_step = now, s
        return Action(values=values, action_space=live.space, names=self.contract.action_names,
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
            if self._space is ActionSpace.JOINT_VELOCITY or self._space is ActionSpace.EE_DELTA:
                values[~self._mask] = 0.0       # a rate holds by commanding no motion; positions stay
        elif self._space in (ActionSpace.JOINT_ABSOLUTE, ActionSpace.JOINT_DELTA):
            values = self._measured(obs)
            if values is None:
                return None
        else:
            return None
        delta = np.zeros_like(values) if self._space.is_delta else None
        return Action(values=values, action_space=self._space, names=self.contract.action_names,
                      chunk=chunk, index=index, hold=True, delta=delta)

    def _maybe_request(self) -> None:
        if self._outcome is not None or self._in_flight is not None or self._done_seen or self._last_obs is None:
            return
        obs, history, e_obs, seq = self._last_obs
        if seq == self._used_seq:
            return
        if len(history) < self.contract.observation.history - 1:
            return   # the first chunk waits for N real frames ((N - 1) * dt): none is invented in their place
        live = self._live
        remaining = max(0.0, live.length - live.pos) if live is not None else 0.0
        s = self.settings
        if s.max_actions is not None and self.executed + remaining >= s.max_actions - _EPS:
            return
        if live is not None and remaining > _EPS:
            lead = max(self._latency.lead_s(self._period), MIN_LEAD_FRACTION * live.length * live.dt)
            if not s.prefetch or remaining * live.dt > lead:
                return
        tail = None
        delay = 0
        if live is not None and remaining > _EPS:
            tail = live.actions[int(math.ceil(live.pos - 1e-7)):]
            delay = int(math.ceil(self._latency.quantile(50) / live.dt - 1e-9))
        rid = self._next_rid
        self._next_rid += 1
        self._used_seq = seq
        self._in_flight = (rid, self._clock(), e_obs)
        self._send(OutRequest(obs=obs, history=history, chunk_tail=tail, expected_delay_actions=delay,
                              last_action=self._last_raw, request_id=rid))
