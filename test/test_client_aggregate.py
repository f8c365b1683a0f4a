"""Aggregating overlapping chunks: ACT's temporal ensembling in the chunk engine, against ACT's formula.

Torch-free: the reference is ACT's published formula (Zhao et al. 2023, Algorithm 2; LeRobot's
``ACTTemporalEnsembler`` docstring): a step's action is ``sum_i w_i a_i / sum_i w_i`` over its predictions,
``w_i = exp(-m * i)``, i = 0 the oldest. ``make check-lerobot`` compares the same engine with LeRobot's own
``ACTTemporalEnsembler`` on the same chunks.
"""

from __future__ import annotations

import numpy as np
import pytest

from sequence_ai_ros.client import aggregate as ens
from sequence_ai_ros.client.engine import EpisodeEngine, EpisodeSettings
from sequence_ai_ros.client.latency import LatencyWindow
from sequence_ai_ros.exceptions import ContractViolation
from sequence_ai_ros.protocol import sequence_ai_pb2 as pb
from sequence_ai_ros.protocol.contract import Contract, ObservationContract
from sequence_ai_ros.protocol.messages import pack_chunk
from sequence_ai_ros.protocol.types import Observation

NAMES = ('a', 'b', 'c')


def contract(t: int = 8, dt: float = 0.1, **kw) -> Contract:
    return Contract(action_space='joint_absolute', action_names=NAMES, dt=dt, chunk_length=t,
                    observation=ObservationContract(state_names=NAMES), **kw)


def chunks(n: int, t: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.normal(size=(t, len(NAMES))).astype(np.float32) for _ in range(n)]


def test_merge_is_acts_formula_step_by_step():
    """One chunk per step folded online equals the offline weighted mean of every prediction of that step."""
    t, m = 6, 0.01
    cs = chunks(20, t)
    rows, counts = cs[0][1:], np.ones(t - 1, np.int64)           # step 0 consumed: the ensemble starts at 1
    for k in range(1, len(cs)):
        rows, counts = ens.merge(rows, counts, cs[k], 0, m)      # chunk k starts at step k, as the ensemble
        preds = [cs[j][k - j] for j in range(max(0, k - t + 1), k + 1)]   # step k's predictions, oldest first
        np.testing.assert_allclose(rows[0], ens.offline(preds, m), atol=1e-6, rtol=0)
        assert counts[0] == len(preds)
        rows, counts = rows[1:], counts[1:]                      # step k is consumed


@pytest.mark.parametrize('m', [0.01, 0.5, -0.2, 0.0])
def test_weights_follow_the_coefficient(m: float):
    a = [np.full(2, float(v), np.float32) for v in (1.0, 2.0, 4.0)]
    rows, counts = a[0][None], np.ones(1, np.int64)
    for v in a[1:]:
        rows, counts = ens.merge(rows, counts, v[None], 0, m)
    w = np.exp(-m * np.arange(3))
    np.testing.assert_allclose(rows[0], (w @ np.array([1.0, 2.0, 4.0])) / w.sum(), atol=1e-6)
    assert counts.tolist() == [3]


class Rig:
    """An engine on a manual clock; each request is answered ``latency`` ticks after it left."""

    def __init__(self, c: Contract, latency: int = 1, **settings) -> None:
        self.c, self.now, self.latency = c, 0.0, latency
        self.sent, self.due = [], []
        self.engine = EpisodeEngine(c, EpisodeSettings(control_period=c.dt, **settings), 'ep', LatencyWindow(),
                                    send=self.sent.append, clock=lambda: self.now, fixed_step=True)

    def run(self, policy, ticks: int) -> list:
        out, tick = [], 0
        for tick in range(ticks):
            for req in [r for r in self.due if r[0] <= tick]:
                self.due.remove(req)
                rows = policy(req[1])
                self.engine.on_chunk(pack_chunk(rows, self.c, request_id=req[1].request_id, episode_id='ep',
                                                robot_time_s=req[1].obs.timestamp))
            before = len(self.sent)
            obs = Observation(state=np.full(len(NAMES), 7.0, np.float32), state_names=NAMES, timestamp=self.now)
            action = self.engine.tick(obs, self.now)
            out.append((action, self.engine.step))
            self.due += [(tick + self.latency, r) for r in self.sent[before:]]
            self.now += self.c.dt
        return out


def test_engine_ensembles_every_step_as_act_does():
    """Through the engine: a chunk per tick, each step's action the weighted mean of the chunks that reached it.

    With a one-tick round trip the request of tick j (observed at step o_j) arrives before tick j + 1; tick
    e + 1 executes step e (the cold first tick held), as the weighted mean, oldest first, of the rows for e
    of every chunk arrived by then (a chunk's row for a step already run is stale, skipped by count).
    """
    t, m = 8, 0.01
    c = contract(t, aggregate='weighted_average', temporal_ensemble_coeff=m)
    cs = chunks(40, t, seed=3)
    rig = Rig(c)
    out = rig.run(lambda req: cs[req.request_id - 1], 30)
    origins = [int(r.observation_step) for r in rig.sent]
    assert origins == [0] + list(range(29))            # a request at every tick, row 0 the step it fell in
    first, step0 = out[0]
    assert first.hold and step0.hold_reason == 'waiting'
    np.testing.assert_array_equal(first.values, np.full(3, 7.0))             # holds the measured state
    worst = 0.0
    for s in range(1, 30):
        action, step = out[s]
        assert not action.hold and step.grid_index == s and step.step_start == s and step.hold_reason == ''
        e = s - 1
        preds = [cs[j][e - origins[j]] for j in range(s) if 0 <= e - origins[j] < t]
        worst = max(worst, float(np.max(np.abs(action.values - ens.offline(preds, m)))))
        np.testing.assert_array_equal(step.policy_action, action.values)
    assert worst <= 1e-6
    assert rig.engine.stats()['underruns'] == 0


def test_average_and_latest_only():
    t = 5
    cs = chunks(12, t, seed=5)
    rig = Rig(contract(t), aggregate='average')
    out = rig.run(lambda req: cs[req.request_id - 1], 10)
    origins = [int(r.observation_step) for r in rig.sent]
    e = 8
    preds = [cs[j][e - origins[j]] for j in range(e + 1) if 0 <= e - origins[j] < t]
    assert len(preds) == t - 1
    np.testing.assert_allclose(out[e + 1][0].values, np.mean(preds, axis=0), atol=1e-6)
    plain = Rig(contract(t))      # latest_only: requests only when the chunk runs low, plays one chunk's rows
    out = plain.run(lambda req: cs[int(req.observation_step)], 10)
    assert len(plain.sent) < 10
    assert plain.engine.aggregate == 'latest_only' and plain.engine.ensemble_coeff is None


def test_contract_and_settings_validate_the_aggregate():
    with pytest.raises(ContractViolation, match='aggregate'):
        contract(aggregate='median')
    with pytest.raises(ContractViolation, match='weighted_average'):
        contract(aggregate='average', temporal_ensemble_coeff=0.1)
    with pytest.raises(ContractViolation, match='joint_delta'):
        Contract(action_space='joint_delta', action_names=NAMES, dt=0.1, chunk_length=4, aggregate='average')
    with pytest.raises(ValueError, match='aggregate'):
        EpisodeSettings(aggregate='mean')
    with pytest.raises(ValueError, match='finite'):
        EpisodeSettings(temporal_ensemble_coeff=float('nan'))
    delta = Contract(action_space='joint_delta', action_names=NAMES, dt=0.1, chunk_length=4)
    with pytest.raises(ContractViolation, match='absolute'):
        EpisodeEngine(delta, EpisodeSettings(aggregate='weighted_average'), 'ep', LatencyWindow(), send=print)
    c = contract(aggregate='weighted_average', temporal_ensemble_coeff=0.05)
    back = Contract.from_proto(c.to_proto())
    assert (back.aggregate, back.temporal_ensemble_coeff) == ('weighted_average', 0.05)
    assert Contract.from_proto(pb.Contract(action_dim=3, action_names=NAMES, dt=0.1, chunk_length=2,
                                           action_space=pb.JOINT_ABSOLUTE)).aggregate == 'latest_only'
    engine = EpisodeEngine(c, EpisodeSettings(), 'ep', LatencyWindow(), send=print)
    assert engine.ensemble_coeff == 0.05       # the contract's, unless the robot chooses its own
    engine = EpisodeEngine(contract(), EpisodeSettings(aggregate='weighted_average'), 'ep', LatencyWindow(),
                           send=print)
    assert engine.ensemble_coeff == 0.01       # ACT's default


@pytest.mark.parametrize('m', [-15.0, -1000.0])
def test_finite_negative_coefficient_never_commands_nan(m: float):
    """A large negative m (exp(-m * i) overflows float64) still ensembles: every command finite."""
    t = 50
    cs = chunks(80, t, seed=1)
    out = Rig(contract(t), aggregate='weighted_average', temporal_ensemble_coeff=m).run(
        lambda req: cs[req.request_id - 1], 70)
    bad = [s for s, (action, _) in enumerate(out) if not action.hold and not np.isfinite(action.values).all()]
    assert not bad, f'm={m}: non-finite commands at ticks {bad[:5]} ... ({len(bad)} of {len(out)})'
    assert sum(not action.hold for action, _ in out) > 60


def test_contract_coefficient_from_the_worker_too():
    """The same coefficient declared by a worker's contract (an ACT config.json's temporal_ensemble_coeff)."""
    t = 50
    cs = chunks(80, t, seed=1)
    out = Rig(contract(t, aggregate='weighted_average', temporal_ensemble_coeff=-20.0)).run(
        lambda req: cs[req.request_id - 1], 70)
    bad = [s for s, (action, _) in enumerate(out) if not action.hold and not np.isfinite(action.values).all()]
    assert not bad, f'non-finite commands at ticks {bad[:5]} ... ({len(bad)} of {len(out)})'


@pytest.mark.parametrize('m', [-20.0, -1000.0, 30.0])
def test_large_coefficients_equal_the_formula(m: float):
    """Online and offline agree with ACT's formula evaluated exactly (weights scaled by their largest)."""
    t = 50
    cs = chunks(60, t, seed=3)
    rows, counts = cs[0][1:], np.ones(t - 1, np.int64)
    for k in range(1, len(cs)):
        rows, counts = ens.merge(rows, counts, cs[k], 0, m)
        preds = [cs[j][k - j] for j in range(max(0, k - t + 1), k + 1)]
        ref = ens.offline(preds, m)
        assert np.isfinite(ref).all()
        np.testing.assert_allclose(rows[0], ref, atol=1e-5, rtol=0)
        rows, counts = rows[1:], counts[1:]
