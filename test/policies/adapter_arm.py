"""A hold policy for the adapters' fault tests: 3 joints, one camera, and a switch that breaks its chunks.

Each chunk repeats the observed state (the arm holds where it is). Config (constructor kwargs):

- ``nan_from``: from this inference on (1-based count, 0: never) the chunk is all NaN, which the worker
  refuses as malformed: the episode ends with reason 'validate' on the robot;
- ``first_s``: the first inference sleeps this long (s), default 0;
- ``action_space``: the contract's space, default joint_absolute.
"""

import dataclasses
import time

import numpy as np

import sequence_ai_ros.policy as seq

NAMES = ('shoulder', 'elbow', 'grip')
#: The camera: 64x48 jpeg.
CAMERA = seq.CameraSpec('front', 64, 48)


@seq.policy(action_space='joint_absolute', action_names=NAMES, dt=0.02, chunk_length=10,
            observation=seq.ObservationContract(state_names=NAMES, cameras=[CAMERA]))
class AdapterArm:
    """Repeat the observed state for the whole chunk (or NaN from inference ``nan_from`` on)."""

    def __init__(self, nan_from: int = 0, first_s: float = 0.0, action_space: str = 'joint_absolute') -> None:
        self.nan_from = int(nan_from)
        self.first_s = float(first_s)
        self.calls = 0

    @classmethod
    def configure_contract(cls, contract: seq.Contract, config: dict) -> seq.Contract:
        return dataclasses.replace(contract,
                                   action_space=seq.ActionSpace.parse(config.get('action_space', 'joint_absolute')))

    def infer(self, inp: seq.PolicyInput, episode: seq.Episode) -> np.ndarray:
        self.calls += 1
        if self.calls == 1 and self.first_s:
            time.sleep(self.first_s)
        out = np.tile(inp.observation.state, (10, 1)).astype(np.float32)
        if self.nan_from and self.calls >= self.nan_from:
            out[:] = np.nan
        return out
