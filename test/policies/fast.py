"""A stateless 0 ms joint_absolute policy for tests: returns the last executed action (or the state) repeated.

Config (constructor kwargs, e.g. ``serve_policy_file('test/policies/fast.py', dim=7)``):

- ``dim``: state and action dimension D (default 26, names j0..j{D-1});
- ``camera``: a camera key to require (224x224 jpeg), default none;
- ``latency_s``: sleep this long per inference (s), default 0;
- ``chunk_length``: actions per chunk T (default 30); dt is 1/30 s.
"""

import dataclasses
import time

import numpy as np

import sequence_ai_ros.policy as seq

DIM = 26
NAMES = [f'j{i}' for i in range(DIM)]


@seq.policy(action_space='joint_absolute', action_names=NAMES, dt=1 / 30, chunk_length=30,
            observation=seq.ObservationContract(state_names=NAMES))
class Fast:
    """Hold: repeat ``last_action`` (or the measured state before the first action) for the whole chunk."""

    def __init__(self, dim: int = DIM, camera: str = '', latency_s: float = 0.0, chunk_length: int = 30) -> None:
        self.latency_s = float(latency_s)
        self.chunk_length = int(chunk_length)

    @classmethod
    def configure_contract(cls, contract: seq.Contract, config: dict) -> seq.Contract:
        names = tuple(f'j{i}' for i in range(int(config.get('dim', DIM))))
        cameras = (seq.CameraSpec(config['camera'], 224, 224, 'jpeg'),) if config.get('camera') else ()
        return dataclasses.replace(contract, action_names=names, chunk_length=int(config.get('chunk_length', 30)),
                                   observation=seq.ObservationContract(cameras=cameras, state_names=names))

    def infer(self, inp: seq.PolicyInput, episode: seq.Episode) -> np.ndarray:
        if self.latency_s:
            time.sleep(self.latency_s)
        row = inp.last_action if inp.last_action is not None else inp.observation.state
        return np.tile(row, (self.chunk_length, 1))
