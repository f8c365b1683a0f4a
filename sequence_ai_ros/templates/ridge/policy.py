"""``ridge``: the embedded default policy, a closed-form ridge model on CPU (numpy only).

It maps what the robot sends (measured state s[t], the previous state s[t-1] from history 2, and the
last executed action a[t-1]) to the next H actions, joint_absolute. ``seq train ridge`` fits it on a
LeRobot v2.1 dataset in seconds, chooses its features by cross-validation, and writes ``model.npz``
beside this file; the contract (joint names, dt, H, history) comes from that model. See README.md for
the model, its features and the measured errors. No camera: image features did not help (README).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import numpy as np

import sequence_ai_ros.policy as seq
from sequence_ai_ros.models.ridge import RidgeModel

HERE = Path(__file__).resolve().parent


def _model_path(value: str) -> Path:
    path = Path(os.path.expandvars(os.path.expanduser(str(value))))
    return path if path.is_absolute() else HERE / path


@seq.policy(action_space='joint_absolute', action_names=['placeholder'], dt=1 / 30, chunk_length=30,
            observation=seq.ObservationContract(state_names=['placeholder'], history=2),
            gripper='hand joints predicted like arm joints (0..1 for the G1 Inspire hands)',
            batching=seq.Batching(max_batch_size=32, max_wait_s=0.002))
class Ridge:
    """Predict the next chunk with a trained :class:`~sequence_ai_ros.models.ridge.RidgeModel`.

    :param model: the ``model.npz`` written by ``seq train ridge`` (relative to this file).
    :raises ConfigError: when the model file is missing or unreadable.
    """

    def __init__(self, model: str = 'model.npz') -> None:
        self.path = _model_path(model)
        self.model: RidgeModel | None = None

    @classmethod
    def configure_contract(cls, contract: seq.Contract, config: dict) -> seq.Contract:
        """Return the model's contract: its joint names, dt, H and history (reads only model.npz)."""
        model = RidgeModel.load(_model_path(config.get('model', 'model.npz')))
        return dataclasses.replace(contract, action_names=model.action_names, dt=model.dt,
                                   chunk_length=model.horizon,
                                   observation=seq.ObservationContract(state_names=model.state_names,
                                                                       history=model.history))

    @classmethod
    def artifacts(cls, config: dict) -> list[Path]:
        """The files a deployment version hashes besides policy.py and config.yaml: model.npz."""
        return [_model_path(config.get('model', 'model.npz'))]

    def load(self) -> None:
        """Read the weights (milliseconds)."""
        self.model = RidgeModel.load(self.path)

    def infer(self, inp: seq.PolicyInput, episode: seq.Episode) -> np.ndarray:
        """Return float32 (H, D): the next H actions in the action's units (rad; hands 0..1).

        The last executed action falls back to the state before the first action (the robot holds);
        the previous state is the history frame one dt earlier, when the robot sent one.
        """
        return self.infer_batch([inp], [episode])[0]

    def infer_batch(self, inputs: list[seq.PolicyInput], episodes: list[seq.Episode]) -> list[np.ndarray]:
        """Return one float32 (H, D) chunk per input (requests of different robots), in one matrix product."""
        if self.model is None:
            self.load()
        assert self.model is not None      # load() sets it
        states = np.stack([inp.observation.state for inp in inputs])
        last = np.stack([inp.observation.state if inp.last_action is None else inp.last_action for inp in inputs])
        prev = np.stack([inp.history[-2].state if len(inp.history) >= 2 else inp.observation.state
                         for inp in inputs])
        elapsed = np.array([inp.observation.timestamp - ep.state.setdefault('t0', inp.observation.timestamp)
                            for inp, ep in zip(inputs, episodes, strict=True)])
        return list(self.model.predict_many(states, last, prev, elapsed))
