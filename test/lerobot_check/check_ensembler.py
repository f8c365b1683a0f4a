"""The client's weighted_average against LeRobot's own ``ACTTemporalEnsembler`` on the same chunks (LeRobot venv).

Two comparisons, float32 chunks from a seeded RNG, printed as one JSON line; exit 1 when either differs by
more than 1e-6:

1. ``merge``: one chunk per step folded by ``sequence_ai_ros.client.aggregate.merge`` against
   ``ACTTemporalEnsembler(coeff, chunk_size).update`` on the same chunks, step by step (the algorithm).
2. ``engine``: the chunk engine itself (``EpisodeEngine``, aggregate weighted_average, one request per
   tick, each answered one tick later) against the ensembler fed, at each step, the rows of the chunk the
   robot received last that are still to play (``chunk[:, 1:]``: its row 0 ran before it arrived), from the
   step the first chunk no longer reaches (its rows cover steps 0 .. T - 1).

Usage: ``python test/lerobot_check/check_ensembler.py [--coeff 0.01] [--chunk 10] [--steps 80]``.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np
import torch
from lerobot.policies.act.modeling_act import ACTTemporalEnsembler

from sequence_ai_ros.client import aggregate
from sequence_ai_ros.client.engine import EpisodeEngine, EpisodeSettings
from sequence_ai_ros.client.latency import LatencyWindow
from sequence_ai_ros.protocol.contract import Contract, ObservationContract
from sequence_ai_ros.protocol.messages import pack_chunk
from sequence_ai_ros.protocol.types import Observation

TOLERANCE = 1e-6


def by_merge(chunks: list[np.ndarray], coeff: float) -> float:
    t = chunks[0].shape[0]
    ref = ACTTemporalEnsembler(coeff, t)
    rows = counts = None
    worst = 0.0
    for chunk in chunks:
        expected = ref.update(torch.from_numpy(chunk)[None])[0].numpy()
        if rows is None:
            rows, counts = chunk, np.ones(t, np.int64)
        else:
            rows, counts = aggregate.merge(rows, counts, chunk, 0, coeff)
        worst = max(worst, float(np.max(np.abs(rows[0] - expected))))
        rows, counts = rows[1:], counts[1:]
    return worst


def by_engine(chunks: list[np.ndarray], coeff: float, steps: int) -> tuple[float, int]:
    t, d = chunks[0].shape
    names = tuple(f'j{i}' for i in range(d))
    c = Contract(action_space='joint_absolute', action_names=names, dt=0.02, chunk_length=t,
                 observation=ObservationContract(state_names=names), aggregate='weighted_average',
                 temporal_ensemble_coeff=coeff)
    now = [0.0]
    sent: list = []
    engine = EpisodeEngine(c, EpisodeSettings(control_period=c.dt), 'ep', LatencyWindow(), send=sent.append,
                           clock=lambda: now[0], fixed_step=True)
    emitted: dict[int, np.ndarray] = {}
    due: list = []
    for tick in range(steps + 1):
        for req in [r for r in due if r[0] <= tick]:
            due.remove(req)
            engine.on_chunk(pack_chunk(chunks[req[1].request_id - 1], c, request_id=req[1].request_id,
                                       episode_id='ep', robot_time_s=req[1].obs.timestamp))
        before = len(sent)
        action = engine.tick(Observation(state=np.zeros(d, np.float32), state_names=names, timestamp=now[0]), now[0])
        if action is not None and not action.hold:
            emitted[tick - 1] = action.values            # tick e + 1 runs step e (the first tick held)
        due += [(tick + 1, r) for r in sent[before:]]
        now[0] += c.dt
    ref = ACTTemporalEnsembler(coeff, t - 1)
    worst, compared = 0.0, 0
    for e in range(1, steps):
        expected = ref.update(torch.from_numpy(chunks[e][1:])[None])[0].numpy()   # origin e - 1: row 1 is step e
        if e >= t and e in emitted:
            worst = max(worst, float(np.max(np.abs(emitted[e] - expected))))
            compared += 1
    return worst, compared


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--coeff', type=float, default=0.01)
    parser.add_argument('--chunk', type=int, default=10)
    parser.add_argument('--steps', type=int, default=80)
    parser.add_argument('--dim', type=int, default=6)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    chunks = [rng.normal(size=(args.chunk, args.dim)).astype(np.float32) for _ in range(args.steps + 2)]
    merge_diff = by_merge(chunks[:args.steps], args.coeff)
    engine_diff, compared = by_engine(chunks, args.coeff, args.steps)
    ok = merge_diff <= TOLERANCE and engine_diff <= TOLERANCE and compared > 0
    print(json.dumps({'ok': ok, 'coeff': args.coeff, 'chunk': args.chunk, 'merge_max_abs_diff': merge_diff,
                      'engine_max_abs_diff': engine_diff, 'engine_steps_compared': compared}))
    return 0 if ok else 1


if __name__ == '__main__':
    sys.exit(main())
