"""Property-based tests of the chunk engine's parts under disturbance: drawn chunk arrivals, overruns, ratios.

Hypothesis draws a whole episode: the action space and its size, the chunk length, the caller's period
against the policy's dt (1x, 1.5x, 2x, 2.5x and 1/3x the policy rate), how it is driven (act/run pacing,
which gives each tick its control deadline and keeps phase, or a ``next_action`` loop whose ticks the engine
places), each request's round trip (early, late, straddling a tick, longer than a chunk, so answers also arrive out of
order), each answer's length (up to the contract's chunk length), each callback's
overrun (none, a fraction of a period, several periods) and max_actions. A simulated worker answers request
``r`` at its drawn time with real ``ActionChunk`` messages whose row for chunk step ``x`` of the episode is
``g(x)`` whichever request asked (so the truth is known without the engine: the executed path is the
integral of ``g`` over the executed steps). Every tick's Step is committed by the real
:class:`~sequence_ai_ros.client.steps.StepLedger`, packed by the client's real telemetry packer, stored by
the real :class:`~sequence_ai_ros.capture.store.CaptureStore` and exported by the real
:func:`~sequence_ai_ros.datasets.rows.build_rows` at the policy's rate.

What must hold for every drawn episode:

- the period identity: commands sent + ticks held + ticks skipped = the control periods (exact when the
  caller gives its deadlines; within one period when the engine places its ticks);
- spans: by step, the fresh ticks tile the executed chunk steps (their lengths sum to the executed count
  within 1e-9) and only whole held steps lie between them; records never overlap in delta spaces;
- delta increments: each fresh tick's increment is ``g`` integrated over the chunk steps it covered, and
  they sum to the executed path (float32 on the wire: 1e-5);
- rows: one row per step covered (executed steps plus whole held steps), every executed step in exactly one
  row and in order (delta rows are ``g(0), g(1), ...``), held rows move nothing.

Profiles (``HYPOTHESIS_PROFILE``, registered in conftest.py): ``fast`` (derandomized, in ``make test``) and
``long`` (``make test-properties``).
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st
from test_data_support import make_store

from sequence_ai_ros.client.engine import EpisodeEngine
from sequence_ai_ros.client.latency import MIN_SAMPLES, LatencyWindow
from sequence_ai_ros.client.requests import SAFETY_SPACING_PERIODS
from sequence_ai_ros.client.sampling import TelemetryBuffer
from sequence_ai_ros.client.session import _pack_telemetry
from sequence_ai_ros.client.settings import EpisodeSettings
from sequence_ai_ros.client.steps import Step, StepLedger
from sequence_ai_ros.datasets.rows import build_rows
from sequence_ai_ros.protocol.contract import Contract, ObservationContract
from sequence_ai_ros.protocol.messages import pack_chunk
from sequence_ai_ros.protocol.spaces import ActionSpace, position_mask
from sequence_ai_ros.protocol.types import Observation

DT = 0.1
MULTIPLES = (Fraction(1), Fraction(3, 2), Fraction(2), Fraction(5, 2), Fraction(1, 3))
SPAN_TOL = 1e-9        # the chunk-step axis is float64
VALUE_TOL = 1e-5       # actions are float32 on the wire


def g(x: float, dim: int, space: ActionSpace) -> np.ndarray:
    """The policy's row for the episode's chunk step ``x``: rates are whole-step constants, positions move."""
    k = math.floor(x + 1e-9)
    rates = np.array([((7 * k + 3 * c) % 11) - 5 for c in range(dim)], np.float64) / 4
    positions = np.array([x + c for c in range(dim)], np.float64) / 8
    return np.where(position_mask(space, dim), positions, rates)


@dataclasses.dataclass(frozen=True)
class Scenario:
    space: ActionSpace
    dim: int
    chunk: int
    multiple: Fraction
    paced: bool             # act/run: fixed step, the caller's deadlines given; else a next_action loop
    round_trips: tuple[float, ...]   # in chunk covers, request r takes round_trips[r % len]
    overruns: tuple[float, ...]      # in periods, tick k's callback takes overruns[k % len] beyond its period
    max_actions: int
    lengths: tuple[int, ...] = ()    # request r is answered with lengths[r % len] rows (<= chunk; () = chunk)

    @property
    def period(self) -> float:
        return DT / float(self.multiple)


@st.composite
def scenarios(draw: st.DrawFn, spaces: tuple[str, ...] = ('joint_delta', 'ee_delta', 'joint_absolute'),
              paced: bool | None = None) -> Scenario:
    space = ActionSpace.parse(draw(st.sampled_from(spaces)))
    dim = 7 if space is ActionSpace.EE_DELTA else draw(st.integers(1, 3))
    chunk = draw(st.integers(2, 12))
    rtts = draw(st.lists(st.sampled_from([0.0, 0.05, 0.2, 0.45, 0.5, 0.55, 0.8, 0.95, 1.0, 1.05, 1.6]),
                         min_size=1, max_size=12))
    overruns = draw(st.lists(st.sampled_from([0.0, 0.0, 0.0, 0.0, 0.3, 0.5, 0.99, 1.0, 1.4, 2.5]),
                             min_size=1, max_size=16))
    lengths = draw(st.one_of(st.just([]), st.lists(st.integers(1, chunk), min_size=1, max_size=6)))
    return Scenario(space, dim, chunk, draw(st.sampled_from(MULTIPLES)),
                    draw(st.booleans()) if paced is None else paced, tuple(rtts), tuple(overruns),
                    draw(st.integers(chunk, 4 * chunk)), tuple(lengths))


@dataclasses.dataclass
class Played:
    """One simulated episode: its committed steps, its ledger and engine, the last control deadline."""

    steps: list[Step]
    ledger: StepLedger
    engine: EpisodeEngine
    periods: float
    contract: Contract


def play(sc: Scenario) -> Played:
    names = tuple(f'j{c}' for c in range(sc.dim))
    contract = Contract(sc.space.value, names, DT, sc.chunk, ObservationContract(state_names=names), deployment='arm')
    clock = [0.0]
    sent: list = []
    engine = EpisodeEngine(contract, EpisodeSettings(control_period=sc.period, max_actions=sc.max_actions),
                           'ep', LatencyWindow(), send=sent.append, clock=lambda: clock[0], fixed_step=sc.paced)
    ledger = StepLedger(sc.space, engine.set_target if sc.space is ActionSpace.JOINT_DELTA else None, 'ep')
    committed: list[Step] = []
    ledger.set_sink(committed.append)
    covers = sc.chunk * DT
    arrivals: list[tuple[float, int]] = []      # (time, index into sent)
    queued = 0
    grid, now, k, last = 0, 0.0, 0, 0.0
    state = np.zeros(sc.dim, np.float32)

    def enqueue() -> None:
        nonlocal queued
        for i in range(queued, len(sent)):
            heapq.heappush(arrivals, (clock[0] + sc.round_trips[i % len(sc.round_trips)] * covers, i))
        queued = len(sent)

    while engine.outcome() is None and k < 3000:
        while arrivals and arrivals[0][0] <= now + 1e-12:
            at, i = heapq.heappop(arrivals)
            clock[0] = at
            req = sent[i]
            length = sc.lengths[i % len(sc.lengths)] if sc.lengths else sc.chunk
            rows = np.stack([g(req.observation_step + j, sc.dim, sc.space) for j in range(length)])
            engine.on_chunk(pack_chunk(rows.astype(np.float32), contract, request_id=req.request_id,
                                       episode_id='ep', robot_time_s=at))
            enqueue()
        clock[0] = now
        if sc.paced and engine.check(now) is not None:
            break
        engine.tick(Observation(state=state, state_names=names, timestamp=now), now, grid if sc.paced else None)
        last = now
        ledger.open(engine.step)
        ledger.commit()
        enqueue()
        late = sc.overruns[k % len(sc.overruns)]
        k += 1
        if sc.paced:        # a pacer that keeps phase: the next deadline at or after the callback returned
            grid = max(grid + 1, math.ceil(grid + 1 + late - 1e-9))
            now = grid * sc.period
        else:               # a next_action loop: its own sleep of one period after the overrun
            now += sc.period * (1 + late)
    engine.finish('until', now=now)
    if sc.paced:      # as act/run ends: the deadlines before the one the episode ended at are its periods
        ledger.skip_to(grid)
        periods = grid
    else:             # the periods from the first tick's deadline through the last tick's
        periods = last / sc.period + 1
    return Played(committed, ledger, engine, periods, contract)


def fresh_spans(played: Played) -> list[Step]:
    return [s for s in played.steps if not s.held]


def export(played: Played, tmp: Path):
    store = make_store(tmp)
    buffer = TelemetryBuffer(1 / DT, False, DT)
    samples = []
    for step in played.steps:
        samples.extend(buffer.add(step) or [])
    samples.extend(buffer.flush() or [])
    telemetry, _ = _pack_telemetry(samples, played.contract)
    ep = store.begin('ep', 'reach', played.contract)
    assert ep is not None
    refused = ep.add_telemetry(list(telemetry.frames))
    assert refused == 0, 'the worker refused records the client made'
    ep.commit('completed', {'actions': 1})
    captured = next(e for e in store.episodes() if e.episode_id == 'ep')
    d = played.contract.action_dim
    return build_rows(captured, 1 / DT, played.contract.action_space, d, d, [])


@given(scenarios())
def test_the_period_identity_holds(sc: Scenario) -> None:
    played = play(sc)
    led = played.ledger
    counted = led.commands_sent + led.ticks_held + led.ticks_skipped
    if sc.paced:
        assert counted == played.periods
    else:
        assert abs(counted - played.periods) <= 1, (counted, played.periods)


@given(scenarios(spaces=('joint_delta', 'ee_delta', 'joint_absolute'), paced=True)
       | scenarios(spaces=('joint_delta', 'ee_delta')))
def test_fresh_ticks_tile_the_executed_steps_with_whole_held_steps_between(sc: Scenario) -> None:
    played = play(sc)
    fresh = fresh_spans(played)
    covered = sum(s.step_end - s.step_start for s in fresh)
    assert covered == pytest.approx(played.engine.executed, abs=SPAN_TOL)
    for a, b in zip(fresh, fresh[1:], strict=False):
        held_steps = b.step_start - a.step_end
        assert held_steps > -SPAN_TOL and abs(held_steps - round(held_steps)) < SPAN_TOL, (a, b)
    if not sc.space.is_absolute:
        for a, b in zip(played.steps, played.steps[1:], strict=False):
            assert b.step_start >= a.step_end - SPAN_TOL, 'increments never overlap'


@given(scenarios(spaces=('joint_delta', 'ee_delta')))
def test_each_increment_is_the_policy_path_over_the_steps_it_covered(sc: Scenario) -> None:
    played = play(sc)
    rate = ~position_mask(sc.space, sc.dim)
    executed = 0.0
    total = np.zeros(sc.dim)
    for s in fresh_spans(played):
        ran = s.step_end - s.step_start
        want = np.zeros(sc.dim)
        j = math.floor(executed + 1e-9)
        while j < executed + ran - 1e-9:
            want += (min(executed + ran, j + 1) - max(executed, j)) * g(j, sc.dim, sc.space)
            j += 1
        assert s.executed is not None
        np.testing.assert_allclose(s.executed[rate], want[rate], atol=VALUE_TOL,
                                   err_msg=f'tick over [{executed}, {executed + ran}) of the executed steps')
        executed += ran
        total += s.executed.astype(np.float64)
    e = played.engine.executed
    path = sum((g(j, sc.dim, sc.space) for j in range(math.floor(e + 1e-9))), np.zeros(sc.dim))
    path = path + (e - math.floor(e + 1e-9)) * g(e, sc.dim, sc.space)
    np.testing.assert_allclose(total[rate], path[rate], atol=VALUE_TOL * (1 + e))


@given(sc=scenarios(spaces=('joint_delta', 'ee_delta', 'joint_absolute'), paced=True)
       | scenarios(spaces=('joint_delta', 'ee_delta')))
def test_export_rows_are_the_executed_steps_and_whole_held_rows(sc: Scenario, tmp_path_factory) -> None:
    played = play(sc)
    fresh = fresh_spans(played)
    if not fresh:
        return
    rows = export(played, tmp_path_factory.mktemp('store'))
    covered = math.ceil(fresh[-1].step_end - fresh[0].step_start - 1e-6)
    assert len(rows) == covered, f'{len(rows)} rows for {covered} steps covered'
    if sc.space.is_absolute:    # rows are the targets in effect at each step of the timeline
        return
    e = played.engine.executed
    assert int((~rows.held).sum()) == math.ceil(e - 1e-6), 'every executed step in exactly one row'
    rate = ~position_mask(sc.space, sc.dim)
    steps = rows.action[~rows.held][:, rate].astype(np.float64)
    want = np.stack([g(j, sc.dim, sc.space)[rate] * min(1.0, e - j) for j in range(len(steps))])
    np.testing.assert_allclose(steps, want, atol=VALUE_TOL, err_msg='rows are the policy steps in order')
    assert np.all(rows.action[rows.held][:, rate] == 0), 'a held row moves nothing'


@given(chunk=st.integers(4, 30), multiple=st.sampled_from(MULTIPLES), fraction=st.floats(0.0, 0.95),
       margin=st.sampled_from([0.0, 4.0]))
def test_a_fixed_round_trip_is_never_late_and_asked_at_most_once_per_chunk_less_the_lead(
        chunk: int, multiple: Fraction, fraction: float, margin: float) -> None:
    """Pipelining on a link whose every round trip is r (any chunk, any rate ratio, paced): no dry spell.

    A request leaves at the first tick with at most lead = max(r + P (+ P while requests stay
    SAFETY_SPACING_PERIODS apart with it), a quarter chunk) played or awaited
    (``prefetch_margin`` changes nothing when every round trip is the same): once the window is warm, the newest
    request before it covers at least r more (its chunk arrives before the tick that needs it), and requests
    leave at most once per ``max(P, covers - lead)``: over W seconds, at most ``W / max(P, covers - lead) + 1``.
    Feasible links only: r leaves at least two ticks of the chunk (``r <= covers - 2P``) and needs at most 12
    requests in flight (the bound is 16).
    """
    period = DT / float(multiple)
    covers = chunk * DT
    rtt = fraction * covers
    assume(rtt <= covers - 2 * period and rtt <= 12 * period)
    names = ('j0',)
    contract = Contract('joint_absolute', names, DT, chunk, ObservationContract(state_names=names), deployment='arm')
    clock = [0.0]
    sent: list = []
    sent_at: list[float] = []
    engine = EpisodeEngine(contract, EpisodeSettings(control_period=period, prefetch_margin=margin), 'ep',
                           LatencyWindow(), send=sent.append, clock=lambda: clock[0], fixed_step=True)

    def stamp() -> None:
        sent_at.extend([clock[0]] * (len(sent) - len(sent_at)))

    answered = 0
    grid = 0
    state = np.zeros(1, np.float32)
    while engine.executed < 25 * chunk and grid < 20000:
        now = grid * period
        while answered < len(sent) and sent_at[answered] + rtt <= now + 1e-12:
            clock[0] = sent_at[answered] + rtt
            req = sent[answered]
            rows = np.stack([g(req.observation_step + j, 1, ActionSpace.JOINT_ABSOLUTE) for j in range(chunk)])
            engine.on_chunk(pack_chunk(rows.astype(np.float32), contract, request_id=req.request_id,
                                       episode_id='ep', robot_time_s=clock[0]))
            stamp()
            answered += 1
        clock[0] = now
        engine.tick(Observation(state=state, state_names=names, timestamp=now), now, grid)
        stamp()
        grid += 1
    out = engine.finish('until', now=grid * period)
    assert out.underruns == 0, out
    assert out.requests == len(sent)
    lead = rtt + period
    if covers - (lead + period) >= SAFETY_SPACING_PERIODS * period:
        lead += period                      # the second period of safety, while requests stay that far apart
    lead = max(lead, 0.25 * covers)
    # sent once MIN_SAMPLES warm round trips (after the cold one) had arrived: the window times them, not a margin
    warm_at = sent_at[MIN_SAMPLES] + rtt
    warm = [k for k in range(1, len(sent)) if sent_at[k - 1] >= warm_at - 1e-9]
    for k in warm:
        ahead = (sent[k - 1].observation_step + chunk - sent[k].observation_step) * DT
        assert ahead >= rtt - 1e-9, (k, ahead, rtt)
    if len(warm) > 1:
        span = sent_at[warm[-1]] - sent_at[warm[0]]
        assert len(warm) <= span / max(period, covers - lead) + 1 + 1e-9, (len(warm), span, lead)
