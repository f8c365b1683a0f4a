"""The client's chunk engine on pure logic: timeline, stale-row skip, resampling, seams, validation, limits.

Chunks are real ``sequence_ai.v1.ActionChunk`` messages (built with the protocol's own ``pack_chunk``);
time is the engine's clock, stepped by the test, so every number here is exact.
"""

from __future__ import annotations

import dataclasses
import threading
import time

import numpy as np
import pytest

from sequence_ai_ros.client.engine import (
    CHUNK_TIMEOUT_MIN_S,
    EpisodeEngine,
    EpisodeSettings,
    OutRequest,
    chunk_timeout_s,
)
from sequence_ai_ros.client.latency import LatencyWindow, percentile, upper_s
from sequence_ai_ros.client.outcome import RunOutcome
from sequence_ai_ros.client.pacing import Pacer, ThreadGuard
from sequence_ai_ros.client.resample import blend_seam, position_mask, sample
from sequence_ai_ros.client.sampling import GridSampler, History
from sequence_ai_ros.exceptions import ActionSpaceMismatch, ContractViolation, NotReady, PolicyException
from sequence_ai_ros.protocol import codec
from sequence_ai_ros.protocol.contract import Contract, ObservationContract
from sequence_ai_ros.protocol.messages import pack_chunk
from sequence_ai_ros.protocol.spaces import ActionSpace
from sequence_ai_ros.protocol.types import Observation

NAMES = ('a', 'b')


class Rig:
    """An engine on a manual clock that records what it would send."""

    def __init__(self, space: str = 'joint_absolute', dt: float = 0.1, t: int = 10, history: int = 1,
                 latency: LatencyWindow | None = None, **settings) -> None:
        self.contract = Contract(action_space=space, action_names=NAMES, dt=dt, chunk_length=t,
                                 observation=ObservationContract(state_names=NAMES, history=history))
        self.now = 0.0
        self.sent: list[OutRequest] = []
        settings.setdefault('control_period', dt)
        fixed_step = settings.pop('fixed_step', True)
        ready_timeout = settings.pop('ready_timeout', None)
        self.latency = LatencyWindow() if latency is None else latency   # a connection's, shared by its episodes
        self.engine = EpisodeEngine(self.contract, EpisodeSettings(**settings), 'ep', self.latency,
                                    send=self.sent.append, clock=lambda: self.now, fixed_step=fixed_step,
                                    ready_timeout=ready_timeout)
        self.executed: list = []

    def obs(self, state=(0.0, 0.0)) -> Observation:
        return Observation(state=np.asarray(state, np.float32), state_names=NAMES, timestamp=self.now)

    def tick(self, state=(0.0, 0.0), step: float | None = None):
        action = self.engine.tick(self.obs(state), self.now)
        if action is not None and not action.hold:
            self.executed.append(action)
        self.now += self.contract.dt if step is None else step
        return action

    def reply(self, rows, space: str | None = None, request: OutRequest | None = None, done: bool = False):
        req = request or self.sent[-1]
        msg = pack_chunk(np.asarray(rows, np.float32), self.contract, request_id=req.request_id, episode_id='ep',
                         robot_time_s=req.obs.timestamp, done=done)
        if space is not None:
            msg.action_space = ActionSpace.parse(space).to_proto()
        self.engine.on_chunk(msg)


def ramp(start: float, t: int = 10) -> np.ndarray:
    return np.stack([start + np.arange(t), np.zeros(t)], axis=1).astype(np.float32)


class Link:
    """A link on the rig's clock: request k (1-based) is answered ``rtts[k]`` s after it left (else ``rtt``).

    Each answer arrives at its own time, between ticks; ``step()`` delivers those due, then ticks.
    """

    def __init__(self, rig: Rig, rtt: float, rtts: dict[int, float] | None = None) -> None:
        self.rig, self.rtt, self.rtts = rig, rtt, rtts or {}
        self.sent_at: list[float] = []        # when each of rig.sent left (s)
        self.arrived_at: dict[int, float] = {}

    def _stamp(self) -> None:
        self.sent_at.extend([self.rig.now] * (len(self.rig.sent) - len(self.sent_at)))

    def step(self) -> None:
        tick_at = self.rig.now
        while True:
            due = [(at + self.rtts.get(k + 1, self.rtt), k) for k, at in enumerate(self.sent_at)
                   if k + 1 not in self.arrived_at]
            due = [d for d in due if d[0] <= tick_at + 1e-9]
            if not due:
                break
            at, k = min(due)
            self.rig.now = at
            self.arrived_at[k + 1] = at
            self.rig.reply(ramp(0, self.rig.contract.chunk_length), request=self.rig.sent[k])
            self._stamp()
        self.rig.now = tick_at
        self.rig.engine.tick(self.rig.obs(), tick_at)
        self._stamp()
        self.rig.now = tick_at + self.rig.contract.dt


def test_cold_start_executes_row_zero_and_skips_nothing():
    rig = Rig()
    first = rig.tick()
    assert first.hold and np.array_equal(first.values, [0, 0])     # holds the measured state, never zeros-by-default
    assert len(rig.sent) == 1 and rig.sent[0].chunk_tail is None and rig.sent[0].expected_delay_actions == 0
    for _ in range(20):                                             # a 2 s cold start: nothing executes
        assert rig.tick().hold
    rig.reply(ramp(100))
    action = rig.tick()
    assert not action.hold and action.index == 0 and action.values[0] == 100
    assert rig.engine.stats()['stale_actions'] == 0
    assert rig.engine.stats()['underruns'] == 0                      # waiting for the first chunk is no underrun


def test_stale_rows_are_skipped_by_counting_executed_actions():
    rig = Rig(t=10)
    rig.tick()
    rig.reply(ramp(0))
    while len(rig.sent) < 2:                                         # rows execute until prefetch fires
        rig.tick()
    assert len(rig.executed) < 10                                    # before the chunk ran dry
    req = rig.sent[1]
    sent_at_row = int(req.chunk_tail[0, 0])                          # tail starts at the row being executed then
    rig.tick()
    rig.tick()                                                       # two more actions execute meanwhile
    rig.reply(ramp(1000), request=req)
    action = rig.tick()
    executed_since = rig.executed[-2].values[0] - sent_at_row + 1
    assert action.values[0] == 1000 + executed_since                 # chunk[0] aligned with the observation
    assert rig.engine.stats()['stale_actions'] == executed_since


def _jittered_request(late: float) -> tuple[Rig, OutRequest]:
    """Return a rig on the clock (as policy_node and next_action run) and its second request.

    Row 0 ran ``late`` s long, so the request's observation step is 7 +- a little (the cold round trip of a
    tick, 0.1 s: a lead of 1.5 x 0.1 + two 0.1 s periods = 3.5 steps, the second kept as the requests stay far
    apart); chunk 0 is ramp(0), so a row's value is its step.
    """
    rig = Rig(t=10, fixed_step=False)
    rig.tick()
    rig.reply(ramp(0))
    rig.tick(step=rig.contract.dt + late)
    while len(rig.sent) < 2:
        rig.tick()
    return rig, rig.sent[1]


def _inpainted(req: OutRequest, offset: float = 0.0) -> np.ndarray:
    """What an in-painting policy (RTC) answers: the tail's rows from row 0 on, continued (+ ``offset``)."""
    first = float(req.chunk_tail[0, 0])
    return np.stack([first + offset + np.arange(10), np.zeros(10)], axis=1).astype(np.float32)


@pytest.mark.parametrize('late', [0.0003, -0.0003, 0.0])
def test_the_tail_starts_at_the_observation_step_when_ticks_jitter(late):
    """Row 0 of chunk_tail is the old chunk's row at the observation step (7.003 or 6.997: row 7).

    Row 0 of the answer is that step too: an in-painting answer joins with no gap and the arm moves one row per
    tick across the seam, whichever way the tick jittered (the next whole row would skip a row when it ran late).
    """
    rig, req = _jittered_request(late)
    assert req.observation_step == pytest.approx(7.0, abs=0.01)
    assert float(req.chunk_tail[0, 0]) == 7.0
    rig.tick()
    rig.tick()
    rig.reply(_inpainted(req), request=req)
    rows = [rig.tick().values[0] for _ in range(3)]
    out = rig.engine.finish('completed')
    assert np.diff([a.values[0] for a in rig.executed]).max() <= 1.01 and rows[-1] == pytest.approx(rows[0] + 2)
    assert out.max_seam_jump <= 1.01 and out.max_seam_gap <= 0.01


def test_the_seam_gap_is_read_where_the_old_chunk_has_a_row():
    """The gap compares the new chunk with the old one's own row for the same step, where it has one.

    A new chunk 5 above the tail read within the old one's rows is a gap of 5; read past the old one's last
    row (which it would hold), the same step is a jump and no gap.
    """
    rig, req = _jittered_request(-0.0003)
    rig.reply(_inpainted(req, offset=5.0), request=req)                 # read within the old rows
    rig.tick()
    assert rig.engine.finish('completed').max_seam_gap == pytest.approx(5.0, abs=0.01)
    rig, req = _jittered_request(-0.0003)
    rig.tick()
    rig.tick()                                                          # old chunk read at 9.997: past row 9
    rig.reply(_inpainted(req), request=req)
    rig.tick()
    assert rig.engine.finish('completed').max_seam_gap == 0.0


def test_prefetch_lead_comes_from_warm_round_trips_not_the_cold_one():
    window = LatencyWindow(window=10)
    window.add(5.0)                                                  # cold spike
    assert window.quantile(95) == 5.0 and window.lead_s(0.01) == pytest.approx(7.51)   # only until a warm one
    assert window.cold_s() == 5.0 and window.delay_s() == pytest.approx(7.5)
    window.add(0.10)
    assert window.lead_s(0.01) == pytest.approx(1.5 * 0.10 + 0.01)   # few samples: the largest, with a margin
    assert window.delay_s() == pytest.approx(1.5 * 0.10)             # the expected delay too: not from the cold one
    for s in (0.12, 0.11, 0.13, 0.12, 0.10, 0.11, 0.12, 0.11, 0.10, 0.11):
        window.add(s)
    assert window.quantile(95) == pytest.approx(0.13)
    warm = window.samples()
    mean = sum(warm) / len(warm)
    rto = mean + 4 * sum(abs(x - mean) for x in warm) / len(warm)    # RFC 6298's SRTT + 4 RTTVAR over the window
    assert rto > 0.13
    assert window.delay_s() == pytest.approx(rto)                    # eight and more: above the largest warm one
    assert window.lead_s(0.01) == pytest.approx(rto + 0.01)          # + one period: the trigger's tick
    # prefetch_margin: fewer deviations never go below the largest warm round trip
    assert window.lead_s(0.01, deviations=0) == pytest.approx(0.13 + 0.01)
    assert window.delay_s(2.0) == pytest.approx(max(0.13, mean + 2 * (rto - mean) / 4))
    assert len(window.samples()) == 10 and window.samples()[0] == 0.12   # sliding: 0.10 dropped
    assert percentile([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 95) == 10 and percentile([], 50) == 0


def test_upper_estimate_is_the_largest_sample_when_one_outlier_dominates():
    # a steady link with one slow round trip: the largest sample is above mean + 4 deviations, and is kept
    warm = [0.10] * 15 + [0.30]
    assert upper_s(warm) == pytest.approx(0.30)
    # a jittery link (+-20 % uniform): the estimate reaches past the window's largest sample
    rng = np.random.default_rng(3)
    jittery = list(0.3 + 0.06 * rng.uniform(-1, 1, 32))
    assert max(jittery) < upper_s(jittery) <= 0.3 + 4 * 0.06


def test_prefetch_false_requests_only_when_empty_and_counts_the_stall():
    rig = Rig(t=5, prefetch=False)
    rig.tick()
    rig.reply(ramp(0, 5))
    for _ in range(5):
        assert not rig.tick().hold
    assert len(rig.sent) == 1                                        # nothing requested while playing
    stall = rig.tick()
    assert stall.hold and np.array_equal(stall.values, rig.executed[-1].values)   # hold repeats the last command
    assert len(rig.sent) == 2 and rig.engine.stats()['underruns'] == 1
    rig.tick()
    rig.reply(ramp(10, 5))
    assert rig.tick().values[0] == 10                                # nothing executed while waiting: no skip
    out = rig.engine.finish('completed', now=rig.now)
    assert out.underruns == 1 and out.underrun_s == pytest.approx(0.2)


@pytest.mark.parametrize('case', ['space', 'nan', 'dim'])
def test_bad_chunk_ends_with_validate_before_any_of_its_actions(case):
    rig = Rig(expect_action_space=ActionSpace.JOINT_ABSOLUTE)
    rig.tick()
    rig.reply(ramp(0))
    while len(rig.sent) < 2:
        rig.tick()
    rid = rig.sent[-1].request_id
    if case == 'space':
        rig.reply(ramp(50), space='joint_delta')
        error = ActionSpaceMismatch
    else:
        rows = ramp(50) if case == 'nan' else np.zeros((10, 3), np.float32)
        if case == 'nan':
            rows[3, 1] = np.nan
        msg = pack_chunk(np.zeros((10, 2), np.float32), rig.contract, request_id=rid, episode_id='ep',
                         robot_time_s=0.0)
        msg.actions.CopyFrom(codec.to_tensor(rows))
        rig.engine.on_chunk(msg)
        error = ContractViolation
    held = rig.tick()
    assert held.hold and held.values[0] < 50                          # nothing of the bad chunk ran
    out = rig.engine.outcome()
    assert out.reason == 'validate' and isinstance(out.error, error)


def test_absolute_interpolated_at_a_faster_caller_rate():
    rig = Rig(dt=1 / 30, t=30, control_period=0.02, fixed_step=False)
    rig.tick(step=0.02)
    rig.now = 1.0
    rig.reply(ramp(0, 30))
    t0 = rig.now
    values = []
    for _ in range(25):                                               # 0.5 s at 50 Hz
        values.append(rig.tick(step=0.02).values[0])
    expected = [(k * 0.02) * 30 for k in range(25)]                   # the recorded speed: 30 rows per second
    np.testing.assert_allclose(values, expected, atol=1e-4)
    assert rig.now - t0 == pytest.approx(0.5)


@pytest.mark.parametrize('space', ['joint_delta', 'joint_velocity'])
def test_rates_rescaled_to_the_caller_period_keep_the_recorded_motion(space):
    rig = Rig(space=space, dt=1 / 30, t=30, control_period=0.02, fixed_step=False, max_actions=30)
    rig.tick(state=(1.0, 2.0), step=0.02)
    rows = np.stack([np.linspace(0.01, 0.3, 30), np.full(30, 0.5)], axis=1).astype(np.float32)
    rig.reply(rows)
    actions = []
    while rig.engine.outcome() is None:
        a = rig.tick(state=(1.0, 2.0), step=0.02)
        if not a.hold:
            actions.append(a)
    if space == 'joint_delta':
        total = sum(a.delta.astype(np.float64) for a in actions)
        np.testing.assert_allclose(total, rows.astype(np.float64).sum(axis=0), rtol=1e-5)
        np.testing.assert_allclose(actions[-1].values, np.array([1.0, 2.0]) + total, rtol=1e-5)   # integrated
        assert np.allclose(actions[0].values, [1.0, 2.0] + actions[0].delta)        # the first onto the state
    else:
        moved = sum(a.values[0] * 0.02 for a in actions)                            # rad/s * s
        assert moved == pytest.approx(float(rows[:, 0].sum()) / 30, rel=1e-4)
        assert all(a.values[1] == pytest.approx(0.5) for a in actions)              # gripper stays a position
    assert rig.engine.outcome().actions == 30


def test_sample_is_row_exact_at_integer_steps():
    rows = np.random.default_rng(0).normal(size=(8, 3)).astype(np.float32)
    for space in ActionSpace:
        for i in range(8):
            assert sample(rows, space, float(i), 1.0).tobytes() == rows[i].tobytes()
    assert position_mask(ActionSpace.JOINT_VELOCITY, 3).tolist() == [False, False, True]
    assert position_mask(ActionSpace.EE_DELTA, 7).tolist() == [False] * 6 + [True]


def test_seam_blend_is_linear_and_never_touches_the_first_chunk_or_delta_chunks():
    old = np.zeros((10, 1), np.float32)
    new = np.full((10, 1), 9.0, np.float32)
    out = blend_seam(new, 2.0, old, 5.0, 8)
    np.testing.assert_allclose(out[2:10, 0], [9 * (k + 1) / 9 for k in range(8)], rtol=1e-6)
    assert np.array_equal(out[:2], new[:2]) and np.array_equal(new, np.full((10, 1), 9.0))   # a copy

    def seams(space, smooth):
        rig = Rig(space=space, t=10, smooth_seam=smooth)
        rig.tick()
        rig.reply(ramp(0) if space == 'joint_absolute' else np.full((10, 2), 0.1, np.float32))
        first = rig.tick()
        while len(rig.sent) < 2:
            rig.tick()
        rig.reply(ramp(50) if space == 'joint_absolute' else np.full((10, 2), 0.7, np.float32))
        for _ in range(6):
            rig.tick()
        return first, rig.engine.finish('completed'), [a.delta if a.delta is not None else a.values
                                                       for a in rig.executed]

    first, plain, _ = seams('joint_absolute', 0)
    first_s, smooth, _ = seams('joint_absolute', 4)
    assert first.values[0] == first_s.values[0] == 0                 # the first chunk is never blended
    assert smooth.max_seam_jump < plain.max_seam_jump / 3
    _, d0, rows0 = seams('joint_delta', 0)
    _, d4, rows4 = seams('joint_delta', 4)
    assert [r.tobytes() for r in rows0] == [r.tobytes() for r in rows4]
    assert d4.smooth_seam_ignored and not d0.smooth_seam_ignored and d4.max_seam_jump == d0.max_seam_jump


def test_limits_done_flag_and_outcome_string():
    rig = Rig(t=5, max_actions=7)
    answered = 0
    for _ in range(100):
        if rig.engine.check(rig.now) is not None:
            break
        rig.tick()
        if len(rig.sent) > answered:
            answered += 1
            rig.reply(ramp(10 * answered, 5))
    out = rig.engine.outcome()
    assert (out.reason, out.actions) == ('completed', 7) and len(rig.executed) == 7
    assert len(rig.sent) == 2                                          # no request beyond max_actions
    rig2 = Rig(t=5)
    rig2.tick()
    rig2.reply(ramp(0, 5), done=True)
    for _ in range(100):
        if rig2.engine.check(rig2.now) is not None:
            break
        rig2.tick()
    assert rig2.engine.outcome().reason == 'completed' and len(rig2.executed) == 5 and len(rig2.sent) == 1
    rig3 = Rig(max_seconds=0.35)
    for _ in range(100):
        if rig3.engine.check(rig3.now) is not None:
            break
        rig3.tick()
    assert rig3.engine.outcome().reason == 'timeout'
    assert str(RunOutcome(250, 32, 16.84, 'completed')) == 'RunOutcome(250 actions over 32 chunks in 16.8s, completed)'
    with pytest.raises(ValueError):
        RunOutcome(1, 1, 1.0, 'finished')


def test_an_unanswered_request_ends_the_episode_with_error_at_the_chunk_timeout():
    rig = Rig(t=10, chunk_timeout=0.55)                              # dt 0.1 s: covers 1 s
    rig.tick()
    rig.reply(ramp(0))
    while len(rig.sent) < 2:                                         # play until the prefetch goes out
        rig.tick()
    sent_at = rig.now - rig.contract.dt
    for _ in range(5):                                               # 0.5 s unanswered: still within the bound
        rig.tick()
        assert rig.engine.outcome() is None
    while rig.engine.outcome() is None and rig.now < 5:
        rig.tick()                                                   # the chunk ran dry; the policy hangs
    out = rig.engine.outcome()
    assert out.reason == 'error' and isinstance(out.error, PolicyException)
    assert 'no action chunk for request 2 within 0.55 s' in str(out.error)
    assert 0.55 < rig.now - sent_at <= 0.55 + 2 * rig.contract.dt      # ended at the first tick past the bound
    assert rig.tick().hold                                           # and holds from then on
    rig.reply(ramp(1000))                                            # a late chunk changes nothing
    assert rig.engine.outcome() is out and rig.tick().hold
    # The default bound: max(10 s, 10 * covers_seconds), so a slow but live policy is never cut off.
    assert chunk_timeout_s(rig.contract) == CHUNK_TIMEOUT_MIN_S == 10.0
    slow = Contract(action_space='joint_absolute', action_names=NAMES, dt=0.05, chunk_length=40)
    assert chunk_timeout_s(slow) == pytest.approx(20.0) and chunk_timeout_s(slow, 0.3) == 0.3
    answered = Rig(t=10, chunk_timeout=0.55)
    for _ in range(60):                                              # every request answered at once: no error
        answered.tick()
        if answered.sent and answered.engine.stats()['in_flight']:
            answered.reply(ramp(len(answered.executed)))
    assert answered.engine.outcome() is None


def test_a_request_refused_while_the_deployment_warms_is_a_wait_then_a_newer_observation_goes():
    """NOT_READY with the worker's estimate before the first chunk: hold ('waiting'), send again, then run.

    dt 0.1 s; an estimate of 0.4 s is asked again after a quarter of it (0.1 s), one of 0.1 s after 0.025 s:
    the first tick after that sends that tick's observation (not the refused one), and the chunk answering
    it plays from row 0.
    """
    rig = Rig(t=10, max_seconds=5.0)
    rig.tick(state=(0.0, 0.0))                                       # t = 0: request 1 leaves
    assert [r.request_id for r in rig.sent] == [1]
    assert rig.engine.on_not_ready(1, NotReady('policy is warming; ready in about 0.4 s', retry_after_s=0.4))
    assert rig.engine.warming and rig.engine.stats()['in_flight'] == 0
    assert rig.tick(state=(1.0, 0.0)).hold and len(rig.sent) == 1   # t = 0.1: the refusal came at 0.1
    assert rig.engine.step.hold_reason == 'waiting'
    rig.tick(state=(2.0, 0.0))                                       # t = 0.2: the newer observation goes
    assert [r.request_id for r in rig.sent] == [1, 2] and rig.sent[-1].obs.state[0] == 2.0
    assert rig.engine.on_not_ready(2, NotReady('policy is warming; ready in about 0.1 s', retry_after_s=0.1))
    rig.tick(state=(3.0, 0.0))                                       # t = 0.3: refused at 0.3, 0.025 s to go
    assert len(rig.sent) == 2 and rig.engine.step.hold_reason == 'waiting'
    rig.tick(state=(4.0, 0.0))
    assert [r.request_id for r in rig.sent] == [1, 2, 3] and rig.sent[-1].obs.state[0] == 4.0
    rig.reply(ramp(0))                                               # the deployment served
    assert not rig.engine.warming
    for _ in range(5):
        assert not rig.tick().hold
    assert [a.values[0] for a in rig.executed] == [0.0, 1.0, 2.0, 3.0, 4.0]   # from row 0
    out = rig.engine.finish('completed')
    assert (out.reason, out.error, out.underruns, out.underrun_s) == ('completed', None, 0, 0.0)
    # Once a chunk came, NOT_READY is no wait (a deployment restarting mid-episode): the caller fails it.
    late = Rig(t=10)
    late.tick()
    late.reply(ramp(0))
    while len(late.sent) < 2:
        late.tick()
    assert not late.engine.on_not_ready(2, NotReady('restarting', retry_after_s=1.0))
    assert not Rig().engine.on_not_ready(7, NotReady('warming', retry_after_s=1.0))   # not a request in flight
    failed = Rig(t=10)
    failed.tick()
    assert not failed.engine.on_not_ready(1, NotReady('failed to load', retry_after_s=0.0))   # waiting won't help


@pytest.mark.parametrize('bound', ['max_seconds', 'ready_timeout', 'ended', 'interrupted'])
def test_an_episode_that_ends_while_its_deployment_still_loads_ends_with_not_ready(bound):
    """Bounded by max_seconds, else the connection's ready_timeout; ended by the caller it never ran either.

    An interrupt keeps its own reason (the caller stopped it).
    """
    settings = {'max_seconds': 0.45} if bound == 'max_seconds' else {}
    rig = Rig(t=10, ready_timeout=0.65 if bound == 'ready_timeout' else None, **settings)
    rid = 0
    while rig.engine.outcome() is None and rig.now < 2.0:
        rig.tick()
        if rig.sent and rig.sent[-1].request_id > rid:
            rid = rig.sent[-1].request_id
            assert rig.engine.on_not_ready(rid, NotReady("policy 'lat' is warming; ready in about 3.0 s",
                                                         retry_after_s=3.0))
        if bound in ('ended', 'interrupted') and rig.now >= 0.5:
            rig.engine.finish('completed' if bound == 'ended' else 'interrupted')
    out = rig.engine.outcome()
    assert out is not None and out.actions == 0 and out.chunks == 0 and out.underruns == 0
    assert rid >= 2        # sent again 0.2 s after each refusal (a quarter of 3 s is over the 0.2 s cap)
    if bound == 'interrupted':
        assert (out.reason, out.error) == ('interrupted', None)
        return
    assert out.reason == 'error' and isinstance(out.error, NotReady)
    words = {'max_seconds': "within the episode's max_seconds (0.45 s) (waited 0.5 s)",
             'ready_timeout': 'within ready_timeout (0.65 s) (waited 0.7 s)',
             'ended': 'when the episode was ended (waited 0.5 s)'}[bound]
    assert str(out.error) == f"deployment '' not ready {words}: policy 'lat' is warming; ready in about 3.0 s"


def test_history_is_sampled_on_the_policy_dt_grid():
    hist = History(3, dt=1 / 30)
    sent = [hist.push(Observation(state=np.zeros(1), timestamp=k * 0.02)) for k in range(10)]
    assert sent[0] == [] and len(sent[-1]) == 2
    times = [o.timestamp for o in sent[-1]]
    assert times == sorted(times) and times[-1] < 9 * 0.02
    grid = GridSampler(1 / 30)
    kept = [k for k in range(50) if grid.due(k * 0.02)]
    assert len(kept) == 30                                            # 30 Hz on average from a 50 Hz caller


def test_pacer_deadlines_are_absolute_and_guard_names_the_rule():
    pacer = Pacer(0.01)
    time.sleep(0.015)
    d1 = pacer.wait()
    d2 = pacer.wait()
    assert d2 - d1 == pytest.approx(0.01, abs=1e-9)                   # lateness does not shift later deadlines
    guard = ThreadGuard('Policy(x)')
    inside, release, errors = threading.Event(), threading.Event(), []

    def hold():
        with guard:
            inside.set()
            release.wait(5)

    t = threading.Thread(target=hold, name='owner')
    t.start()
    inside.wait(5)
    try:
        with pytest.raises(RuntimeError, match='one Policy per control loop'):
            with guard:
                pass
    finally:
        release.set()
        t.join(5)
    with guard:                                                       # free again once the owner left
        with guard:                                                   # re-entrant for the owner
            errors.append(1)
    assert errors == [1]


def test_a_chunk_replaced_before_it_played_is_not_what_the_next_seam_blends_from():
    """Pipelined chunks can arrive two between ticks: the seam blends from what played, not from the unread one."""
    rig = Rig(t=10, smooth_seam=4)
    rig.tick()
    rig.reply(ramp(0))                                   # chunk A, row k = k (the cold sample)
    while len(rig.sent) < 2:
        rig.tick()
    for _ in range(9):                                   # a 0.9 s round trip: A runs dry meanwhile
        rig.tick()
    rig.reply(ramp(100), request=rig.sent[1])            # chunk P plays from here (rows 100 + k)
    while len(rig.sent) < 4:                             # the measured round trip now needs more in flight
        rig.tick()
    assert rig.engine.stats()['in_flight'] >= 2
    unread, replacing = rig.sent[2], rig.sent[3]
    rig.reply(np.full((10, 2), 500.0, np.float32), request=unread)       # B arrives ...
    rig.reply(np.full((10, 2), 0.0, np.float32), request=replacing)      # ... and C replaces it before a tick
    first_c = rig.tick()
    assert rig.engine.stats()['discarded'] >= 1
    # The first row of C (0) is blended 1:4 with the continuation of what played (P's rows, themselves faded in
    # from A: below 110); blending from the unread B would give 0.8 * 500 = 400.
    assert 0.0 < first_c.values[0] < 150.0


def test_the_first_seam_is_requested_from_the_cold_round_trip_without_waiting_for_a_warm_one():
    """A 0.65 s round trip on a 1 s chunk: the request that covers the first seam leaves before any warm sample."""
    rig = Rig(t=10)                                          # dt 0.1 s: covers 1 s
    link = Link(rig, rtt=0.65)                               # > half a chunk: one request at a time runs dry
    while rig.engine.stats()['chunks'] == 0:
        link.step()
    arrival = link.arrived_at[1]
    assert len(rig.sent) == 2 and link.sent_at[1] == arrival   # the next request left at that arrival ...
    assert rig.sent[1].observation_step == 0                   # ... but it ends where the first chunk ends
    while len(rig.executed) < 1 and rig.now < 5:
        link.step()
    while len(link.arrived_at) < 2:
        link.step()
    # A request whose chunk reaches past the first seam (observation after step 0) left before the answer
    # to request 2 (the first warm round trip), early enough for its answer to arrive before step 10.
    later = [k for k, req in enumerate(rig.sent) if req.observation_step > 0]
    assert later and link.sent_at[later[0]] < link.arrived_at[2]
    assert rig.sent[later[0]].observation_step <= 10 - 7
    while rig.engine.executed < 15:                          # across the first seam (step 10)
        link.step()
    assert rig.engine.stats()['underruns'] == 0


def _drawer_open(rtt: float, steps: int = 400, rtts: dict[int, float] | None = None, **settings) -> tuple[Rig, Link]:
    """check-sim's chunk (20 rows at 80 Hz: covers 0.25 s) on a link of ``rtt`` s (``rtts``: per request), paced."""
    rig = Rig(dt=1 / 80, t=20, **settings)
    link = Link(rig, rtt=rtt, rtts=rtts)
    while rig.engine.executed < steps:
        link.step()
    return rig, link


@pytest.mark.parametrize(('rtt', 'periods', 'spacing'), [(0.12, 2, 9), (0.195, 2, 3), (0.215, 1, 2)])
def test_pipelined_requests_leave_a_chunk_less_the_lead_apart(rtt, periods, spacing):
    """A fixed round trip r (0.48, 0.78 and 0.86 of a chunk): each request leaves with more than r ahead, never less.

    The lead is r + P (P = 12.5 ms, the tick), plus a second P of safety while requests stay at least two periods
    apart with it (not at 0.215 s: 0.25 - 0.24 s leaves less). A request leaves at the first tick with at most the
    lead played or awaited, so with more than r (its chunk arrives before the tick that needs its first row: no
    dry spell), and the next leaves when the chunk it asked for (row 0 at its own step) has the lead left: every
    ``20 - floor(lead / dt)`` steps (9, 3 and 2). An ideal pipeline asks every covers - r (10.4, 4.4 and 2.8 steps);
    a second period at 0.215 s would ask at every step.
    """
    rig, link = _drawer_open(rtt)
    assert rig.engine.stats()['underruns'] == 0
    dt, chunk = rig.contract.dt, rig.contract.chunk_length
    lead = rtt + periods * dt
    steps = [req.observation_step for req in rig.sent]
    warm = [k for k in range(1, len(steps)) if steps[k] >= 100]       # the window is warm (>= 8 round trips)
    for k in warm:
        ahead = (steps[k - 1] + chunk - steps[k]) * dt                 # what the newest request before it covers
        assert lead - dt - 1e-9 <= ahead <= lead + 1e-9, (k, ahead)
        assert steps[k] - steps[k - 1] == spacing
    in_window = [k for k in warm if steps[k] < 400]
    assert len(in_window) == 300 // spacing
    assert len(in_window) <= 1.5 * 300 / (chunk - rtt / dt)             # within 1.5 x the ideal pipeline's count
    assert rig.engine.stats()['requests'] == len(rig.sent)


def test_a_paced_tick_that_runs_late_sends_as_if_on_time_less_its_lateness():
    """act()/run() ticks late by up to 0.7 of a period (in turn) on check-sim's chunk, a fixed 0.195 s round trip.

    A late paced tick still executes its deadline's step, so the rows ahead are due on the grid: the request it
    sends has its lateness less time. Counted against the lead, no request leaves too late (no dry spell, though
    the tick that reads the answer may be on time), and each one leaves with at least the round trip ahead of
    its send time.
    """
    rig = Rig(dt=1 / 80, t=20)
    period = rig.contract.dt
    late = [0.0, 0.6, 0.0, 0.0, 0.7, 0.0, 0.3]          # periods, tick k late by late[k % 7] (the first on time)
    sent_at: list[float] = []
    arrived = 0
    k = 0
    while rig.engine.executed < 400:
        tick_at = (k + late[k % len(late)]) * period
        while arrived < len(sent_at) and sent_at[arrived] + 0.195 <= tick_at:
            rig.now = sent_at[arrived] + 0.195
            rig.reply(ramp(0, 20), request=rig.sent[arrived])
            sent_at.extend([rig.now] * (len(rig.sent) - len(sent_at)))
            arrived += 1
        rig.now = tick_at
        rig.engine.tick(rig.obs(), tick_at)
        sent_at.extend([tick_at] * (len(rig.sent) - len(sent_at)))
        k += 1
    assert rig.engine.stats()['underruns'] == 0
    steps = [req.observation_step for req in rig.sent]
    for j in range(1, len(steps)):
        if steps[j] >= 100:                                            # the window is warm
            due = (steps[j - 1] + 20 - steps[j]) * period             # after the deadline of the tick it left at
            lateness = sent_at[j] - round(sent_at[j] / period - 0.45) * period
            assert due - lateness >= 0.195 - 1e-9, (j, due, lateness)


def test_prefetch_margin_trades_requests_for_safety():
    """A +-0.01 s link (0.14, 0.15, 0.16 s in turn) with one 0.19 s round trip, well above the window's largest.

    ``prefetch_margin=0`` times requests to the largest measured (0.16 s + two ticks: 0.185 s) and runs dry
    once, at the slow one; the default 4 reaches 4 mean deviations above the mean (0.177 s + two ticks: 0.202 s)
    and covers it. Fewer deviations, fewer requests; more, more safety.
    """
    rtts = {k: (0.14, 0.15, 0.16)[k % 3] for k in range(1, 400)}
    rtts[70] = 0.19
    lean, lean_link = _drawer_open(0.15, rtts=rtts, prefetch_margin=0)
    safe, _ = _drawer_open(0.15, rtts=rtts)
    assert 70 in lean_link.arrived_at
    assert lean.engine.stats()['underruns'] == 1 and safe.engine.stats()['underruns'] == 0
    assert lean.engine.stats()['requests'] < safe.engine.stats()['requests']


def test_a_slow_cold_round_trip_neither_sets_the_expected_delay_nor_sets_off_a_burst():
    """A 1.5 s cold call, then 0.05 s round trips on a 0.5 s chunk."""
    rig = Rig(dt=0.01, t=50)
    link = Link(rig, rtt=0.05, rtts={1: 1.5})
    while rig.engine.stats()['chunks'] == 0:
        link.step()
    assert len(rig.sent) == 2 and link.sent_at[1] == link.arrived_at[1]   # 1.5 x 1.5 s > covers: at once
    assert rig.sent[1].expected_delay_actions == 50          # only the cold one is known: the whole chunk
    while 2 not in link.arrived_at:
        link.step()
        assert len(rig.sent) == 2                            # nothing more in flight on the cold one alone
    while len(link.arrived_at) < 15:
        link.step()
    delays = [req.expected_delay_actions for req in rig.sent[2:]]
    # From the warm 0.05 s ones (+ two 10 ms ticks): 1.5 x 0.05 + 0.02 = 0.095 s while fewer than eight,
    # 0.07 s from then on; never the cold call's whole chunk.
    assert delays[:7] == [10] * 7 and set(delays[8:]) == {7}
    assert rig.engine.stats()['peak_in_flight'] == 1         # one request at a time: no burst at any point


def test_an_episode_starts_with_the_round_trips_its_connection_measured_before():
    """The window is the connection's: a second episode times and sizes its first requests from the first's."""
    window = LatencyWindow()
    delays = []
    for _ in range(2):
        rig = Rig(t=10, latency=window)
        link = Link(rig, rtt=0.65)
        while rig.engine.executed < 25:
            link.step()
        delays.append(rig.sent[1].expected_delay_actions)
        assert rig.engine.stats()['underruns'] == 0
    assert len(window.samples()) >= 8
    # The first episode's second request knew only the cold round trip: 1.5 x 0.65 + 0.2 > 1 s, the whole
    # chunk. The second episode's knew the first's warm ones: 0.65 + 0.2 s, 9 steps.
    assert delays == [10, 9]


def test_an_overtaken_answer_neither_plays_nor_ends_the_requests_even_when_it_says_done() -> None:
    """Pipelined answers out of order: request 3's chunk plays; request 2's, arriving after it, is discarded.

    Its ``done`` is the word of an older observation, so later requests still go, and the episode does not end
    'completed' (nor when an all-stale older answer says done while a newer chunk plays).
    """
    from sequence_ai_ros.client.records import Pending

    rig = Rig(space='joint_absolute', t=10)
    rig.tick()
    first = rig.sent[-1]
    rig.reply(ramp(0), request=first)
    rig.tick()                                                     # the first chunk plays
    for rid, origin in ((2, 1.0), (3, 2.0)):       # two more requests in flight (as the pipeline sends them)
        rig.engine.requests.in_flight[rid] = Pending(rig.now, origin, origin + 1)
    req = dataclasses.replace(first, request_id=3, obs=rig.obs())
    rig.reply(ramp(100), request=req)                              # the newer answer plays
    req2 = dataclasses.replace(first, request_id=2, obs=rig.obs())
    rig.reply(ramp(50), request=req2, done=True)                   # the older one, saying done, comes after it
    assert rig.engine.outcome() is None and not rig.engine.requests.done
    assert rig.engine.stats()['discarded'] == 1
    action = rig.tick()
    assert action is not None and action.values[0] >= 100          # request 3's rows play
