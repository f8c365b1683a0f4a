"""A 0 ms policy for the ROS node tests: a ramp (or a hold) from the last action, with named joints.

Config (constructor kwargs, e.g. ``serve_policy_file('test/policies/node_ramp.py', names=[...])``):

- ``names``: joint names of state and action, in order (default j0..j3);
- ``action_space``: any joint or ee space (default joint_absolute); ee spaces use 7 (pose) or 6 dims;
- ``camera`` / ``camera_size``: a camera key to require, and its (width, height) (default 224x224 jpeg);
- ``step``: added per action step along the chunk (0 = hold the last action); for joint_delta, every
  action is the increment ``step`` itself;
- ``offset``: added to every action (e.g. to cross a joint limit);
- ``chunk_length``: actions per chunk T (default 30); dt is 1/30 s;
- ``nan_after``: from this request id on, return NaN actions (0 = never);
- ``first_latency_s``: sleep this long in the first inference of an episode (s);
- ``load_s``: ``load()`` sleeps this long (s): the deployment warms for a while after the first handshake.
"""

import dataclasses
import time

import numpy as np

import sequence_ai_ros.policy as seq

NAMES = ('j0', 'j1', 'j2', 'j3')


@seq.policy(action_space='joint_absolute', action_names=list(NAMES), dt=1 / 30, chunk_length=30,
            observation=seq.ObservationContract(state_names=list(NAMES)))
class NodeRamp:
    """Continue from ``last_action`` (or the state) by ``step`` per action, plus ``offset``."""

    def __init__(self, names=NAMES, action_space='joint_absolute', camera='', camera_size=(224, 224), step=0.0,
                 offset=0.0, chunk_length=30, nan_after=0, first_latency_s=0.0, load_s=0.0) -> None:
        self.first_latency_s = float(first_latency_s)
        self.load_s = float(load_s)
        self.step = float(step)
        self.offset = float(offset)
        self.chunk_length = int(chunk_length)
        self.nan_after = int(nan_after)
        self.dim = {'ee_absolute': 7, 'ee_delta': 6}.get(action_space, len(names))
        self.delta = action_space == 'joint_delta'

    @classmethod
    def configure_contract(cls, contract: seq.Contract, config: dict) -> seq.Contract:
        names = tuple(config.get('names', NAMES))
        space = config.get('action_space', 'joint_absolute')
        actions = names if space.startswith('joint') else tuple(
            f'e{i}' for i in range({'ee_absolute': 7, 'ee_delta': 6}[space]))
        w, h = config.get('camera_size', (224, 224))
        cameras = (seq.CameraSpec(config['camera'], int(w), int(h), 'jpeg'),) if config.get('camera') else ()
        return dataclasses.replace(contract, action_space=space, action_names=actions,
                                   chunk_length=int(config.get('chunk_length', 30)),
                                   observation=seq.ObservationContract(cameras=cameras, state_names=names))

    def load(self) -> None:
        if self.load_s:
            time.sleep(self.load_s)

    def infer(self, inp: seq.PolicyInput, episode: seq.Episode) -> np.ndarray:
        if self.first_latency_s and inp.last_action is None:
            time.sleep(self.first_latency_s)
        if self.nan_after and inp.request_id >= self.nan_after:
            return np.full((self.chunk_length, self.dim), np.nan, np.float32)
        if self.delta:
            return np.full((self.chunk_length, self.dim), self.step, np.float32)
        if inp.last_action is not None:
            base = inp.last_action
        elif self.dim == inp.observation.state.shape[0]:
            base = inp.observation.state
        else:
            base = np.zeros(self.dim, np.float32)
        ramp = self.step * np.arange(1, self.chunk_length + 1, dtype=np.float32)[:, None]
        return (base[None, :] + ramp + self.offset).astype(np.float32)
