"""A test policy whose round trip follows a configured latency distribution (client tests, bench_client).

Each chunk row says which robot step it is meant for: row ``i`` of a chunk answering an observation
whose state ``frame`` is ``f`` is ``[f + i, request_id]``. A robot whose ``frame`` counts the actions it
executed can then check that every executed action was meant for that step (stale rows skipped by
counting, a cold start beginning at row 0).

Config (constructor kwargs):

- ``mean_s``: mean inference latency (s), default 0; ``jitter``: uniform spread as a fraction of the
  mean (0.2 = +-20 %); ``first_s``: latency of the first request instead (a cold spike), default none;
- ``dt`` (s) and ``chunk_length`` T, default 0.01 and 25; ``action_space``, default joint_absolute;
- ``done_after``: mark the chunk answering this request id ``done`` (0: never); ``seed``;
- ``history``: the contract's history N; when > 1 the second column holds ``len(inp.history)`` instead;
- ``stall_at``: the request id whose inference hangs for ``stall_s`` seconds (a hung policy), 0: never;
- ``load_s``: ``load()`` sleeps this long (s), a deployment that warms for a while; ``load_error``: then
  ``load()`` raises RuntimeError with this message (a load that fails), '' (default): it loads.
"""

import dataclasses
import random
import time

import numpy as np

import sequence_ai_ros.policy as seq

NAMES = ('frame', 'request')


@seq.policy(action_space='joint_absolute', action_names=NAMES, dt=0.01, chunk_length=25,
            observation=seq.ObservationContract(state_names=NAMES))
class Latency:
    """Sleep a sampled latency, then return rows ``[frame + i, request_id]``."""

    def __init__(self, mean_s: float = 0.0, jitter: float = 0.0, first_s: float | None = None, dt: float = 0.01,
                 chunk_length: int = 25, action_space: str = 'joint_absolute', done_after: int = 0,
                 seed: int = 0, history: int = 1, stall_at: int = 0, stall_s: float = 0.0, load_s: float = 0.0,
                 load_error: str = '') -> None:
        self.mean_s, self.jitter, self.first_s = float(mean_s), float(jitter), first_s
        self.load_s, self.load_error = float(load_s), str(load_error)
        self.chunk_length, self.done_after = int(chunk_length), int(done_after)
        self.rng = random.Random(seed)
        self.calls = 0
        self.history = int(history)
        self.stall_at, self.stall_s = int(stall_at), float(stall_s)

    @classmethod
    def configure_contract(cls, contract: seq.Contract, config: dict) -> seq.Contract:
        return dataclasses.replace(contract, dt=float(config.get('dt', 0.01)),
                                   chunk_length=int(config.get('chunk_length', 25)),
                                   action_space=seq.ActionSpace.parse(config.get('action_space', 'joint_absolute')),
                                   observation=seq.ObservationContract(state_names=NAMES,
                                                                       history=int(config.get('history', 1))))

    def load(self) -> None:
        if self.load_s:
            time.sleep(self.load_s)
        if self.load_error:
            raise RuntimeError(self.load_error)

    def infer(self, inp: seq.PolicyInput, episode: seq.Episode) -> seq.Result:
        self.calls += 1
        if self.calls == 1 and self.first_s is not None:
            delay = float(self.first_s)
        else:
            delay = self.mean_s * (1.0 + self.jitter * self.rng.uniform(-1.0, 1.0))
        if self.stall_at and inp.request_id == self.stall_at:
            delay = self.stall_s
        if delay > 0:
            time.sleep(delay)
        frame = float(inp.observation.state[0])
        rows = np.stack([frame + np.arange(self.chunk_length, dtype=np.float64),
                         np.full(self.chunk_length, len(inp.history) if self.history > 1 else inp.request_id,
                                 dtype=np.float64)], axis=1)
        return seq.Result(actions=rows.astype(np.float32),
                          done=bool(self.done_after and inp.request_id >= self.done_after))
