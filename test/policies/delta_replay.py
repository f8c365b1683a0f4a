"""A test policy that replays a recorded path as delta chunks (joint_delta or ee_delta), aligned by step.

The path is float32 (N + 1, D) positions (``path``, an .npy file): joint positions (rad) for joint_delta;
for ee_delta x y z (m), roll pitch yaw (rad) and the gripper (a position channel). Row ``i`` of the chunk
answering an observation at recorded step ``k`` is the increment ``path[k + i + 1] - path[k + i]`` (the
gripper of ee_delta: ``path[k + i + 1]``, a position). The robot reports ``k`` in its state's last value
(``clock``, the chunk steps it executed). Past the end the increments are 0 (the arm stays).

Config (constructor kwargs): ``recording`` (the .npy), ``names`` (action names), ``action_space``, ``dt`` (s),
``chunk_length`` T, ``mean_s`` (inference latency, s), ``jitter`` (uniform, fraction of the mean),
``seed``, ``aim_seam`` (steps; 0: off): answer when the playing chunk runs out, give or take a uniform draw
of this many steps (a late seam: the chunk lands around the tick that runs the old one's end). The end is
the observation's step (``clock``) plus the rows of ``chunk_tail`` left from it, reached ``dt`` a step after
the observation's stamp (the client's monotonic clock, this machine's); without a tail, ``mean_s`` as above.
"""

import dataclasses
import math
import random
import time

import numpy as np

import sequence_ai_ros.policy as seq


@seq.policy(action_space='joint_delta', action_names=('a0',), dt=0.1, chunk_length=10)
class DeltaReplay:
    """Serve the recorded increments from the robot's reported step on."""

    def __init__(self, recording: str, names: list, action_space: str = 'joint_delta', dt: float = 0.1,
                 chunk_length: int = 10, mean_s: float = 0.0, jitter: float = 0.0, seed: int = 0,
                 aim_seam: float = 0.0) -> None:
        self.path = np.load(recording).astype(np.float32)
        self.ee = action_space == 'ee_delta'
        self.chunk_length = int(chunk_length)
        self.mean_s, self.jitter = float(mean_s), float(jitter)
        self.rng = random.Random(seed)
        self.dt, self.aim_seam = float(dt), float(aim_seam)

    @classmethod
    def configure_contract(cls, contract: seq.Contract, config: dict) -> seq.Contract:
        names = tuple(config['names'])
        return dataclasses.replace(
            contract, action_names=names, dt=float(config.get('dt', 0.1)),
            chunk_length=int(config.get('chunk_length', 10)),
            action_space=seq.ActionSpace.parse(config.get('action_space', 'joint_delta')),
            observation=seq.ObservationContract(state_names=(*names, 'clock')))

    def infer(self, inp: seq.PolicyInput, episode: seq.Episode) -> np.ndarray:
        clock = float(inp.observation.state[-1])
        k = int(math.floor(clock + 1e-6))
        delay = self.mean_s * (1.0 + self.jitter * self.rng.uniform(-1.0, 1.0))
        if self.aim_seam > 0 and len(inp.chunk_tail) and inp.observation.timestamp is not None:
            end = k + len(inp.chunk_tail) + self.rng.uniform(-self.aim_seam, self.aim_seam)
            delay = float(inp.observation.timestamp) + (end - clock) * self.dt - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        n = self.path.shape[0] - 1
        idx = np.arange(k, k + self.chunk_length)
        lo, hi = np.clip(idx, 0, n), np.clip(idx + 1, 0, n)
        rows = self.path[hi] - self.path[lo]
        if self.ee:
            rows[:, 6:] = self.path[hi][:, 6:]
        return rows.astype(np.float32)
