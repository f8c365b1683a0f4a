"""A test policy that serves recorded actions of a real LeRobot episode as chunks (client seam tests).

The robot reports in its state which recorded frame it is at (``frame``, the count of actions it has
executed); the chunk answering frame ``f`` holds recorded actions ``f + shift .. f + shift + T - 1``,
where ``shift`` applies to even request ids only, so every other seam jumps by ``shift`` frames.

Config (constructor kwargs): ``parquet`` (an episode file of a LeRobot v2.1 dataset), ``names`` (the
action names, from meta/info.json), ``shift`` (frames, default 0), ``action_space`` (joint_absolute,
or joint_delta: rows are differences of consecutive recorded actions), ``dt``, ``chunk_length``,
``mean_s`` (inference latency, s, default 0), ``jitter`` (uniform, fraction of the mean), ``seed``,
``aim_seam`` (frames; 0: off): answer when the playing chunk runs out, give or take a uniform draw of this many
frames (the observation's frame plus the rows of ``chunk_tail``, ``dt`` a frame after the observation's stamp,
the client's monotonic clock on this machine); without a tail, ``mean_s`` as above.
"""

import dataclasses
import random
import time

import numpy as np
import pyarrow.parquet as pq

import sequence_ai_ros.policy as seq


@seq.policy(action_space='joint_absolute', action_names=('a0',), dt=1 / 30, chunk_length=30)
class Replay:
    """Serve recorded actions, aligned on the robot's reported frame."""

    def __init__(self, parquet: str, names: list, shift: int = 0, action_space: str = 'joint_absolute',
                 dt: float = 1 / 30, chunk_length: int = 30, mean_s: float = 0.0, jitter: float = 0.0,
                 seed: int = 0, aim_seam: float = 0.0) -> None:
        table = pq.read_table(parquet, columns=['action'])
        self.actions = np.asarray(table.column('action').to_pylist(), dtype=np.float32)
        self.shift, self.delta = int(shift), action_space == 'joint_delta'
        self.chunk_length = int(chunk_length)
        self.mean_s, self.jitter = float(mean_s), float(jitter)
        self.rng = random.Random(seed)
        self.dt, self.aim_seam = float(dt), float(aim_seam)

    @classmethod
    def configure_contract(cls, contract: seq.Contract, config: dict) -> seq.Contract:
        names = tuple(config['names'])
        return dataclasses.replace(
            contract, action_names=names, dt=float(config.get('dt', 1 / 30)),
            chunk_length=int(config.get('chunk_length', 30)),
            action_space=seq.ActionSpace.parse(config.get('action_space', 'joint_absolute')),
            observation=seq.ObservationContract(state_names=(*names, 'frame')))

    def infer(self, inp: seq.PolicyInput, episode: seq.Episode) -> np.ndarray:
        clock = float(inp.observation.state[-1])
        frame = int(round(clock))
        delay = self.mean_s * (1.0 + self.jitter * self.rng.uniform(-1.0, 1.0))
        if self.aim_seam > 0 and len(inp.chunk_tail) and inp.observation.timestamp is not None:
            end = frame + len(inp.chunk_tail) + self.rng.uniform(-self.aim_seam, self.aim_seam)
            delay = float(inp.observation.timestamp) + (end - clock) * self.dt - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        start = frame + (self.shift if inp.request_id % 2 == 0 else 0)
        n = len(self.actions)
        idx = np.clip(np.arange(start, start + self.chunk_length), 0, n - 2)
        if self.delta:
            return self.actions[idx + 1] - self.actions[idx]
        return self.actions[idx]
