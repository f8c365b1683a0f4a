"""``lerobot``: serve any LeRobot policy checkpoint (ACT, diffusion, SmolVLA, pi0, pi05) from a local directory.

The checkpoint directory is what LeRobot's training writes as ``pretrained_model/``: config.json,
model.safetensors and the processor files (policy_preprocessor.json, policy_postprocessor.json and
their .safetensors). It is loaded through LeRobot's own path (sequence_ai_ros/models/lerobot_runtime.py).
The contract (cameras, state and
action dimensions, chunk length) comes from the checkpoint's config.json; names,
rate and action space from config.yaml. Without torch, lerobot>=0.4 or the weights, ``seq deploy``
fails with MissingDependency naming exactly what is missing.

Stateless: every request gets a fresh chunk from the current observation (``predict_action_chunk``), so
policies that stack several observation frames internally (diffusion's ``n_obs_steps`` > 1) are not
supported here.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

import sequence_ai_ros.policy as seq
from sequence_ai_ros.models import lerobot_runtime as runtime

HERE = Path(__file__).resolve().parent


def _checkpoint(config: dict) -> Path | None:
    """The checkpoint directory named in config.yaml, or None when it names none."""
    return runtime.resolve(config['checkpoint'], HERE) if config.get('checkpoint') else None


@seq.policy(action_space='joint_absolute', action_names=['placeholder'], dt=1 / 30, chunk_length=1,
            gripper='as the checkpoint was trained')
class LeRobot:
    """A LeRobot checkpoint served as action chunks.

    :param checkpoint: the checkpoint directory (absolute, or relative to this file).
    :param device: torch device (``cuda``, ``cuda:1``, ``cpu``, ``mps``).
    :param fps: the rate the policy was trained at (Hz).
    :param action_space: the meaning of its actions (joint_absolute for LeRobot's usual datasets).
    :param state_names: the D state names, in the order of ``observation.state``.
    :param action_names: the action names, in order.
    :param chunk_length: actions per chunk; default the checkpoint's ``n_action_steps``.
    """

    def __init__(self, checkpoint: str = '', device: str = 'cuda', fps: float = 30.0,
                 action_space: str = 'joint_absolute', state_names: list[str] | None = None,
                 action_names: list[str] | None = None, chunk_length: int | None = None) -> None:
        path = _checkpoint({'checkpoint': checkpoint})
        runtime.require(path, 'lerobot')
        assert path is not None
        self.path = path
        self.runner = runtime.LeRobotRunner(self.path, device, 'lerobot')
        cfg = runtime.read_config(self.path) if (self.path / 'config.json').is_file() else {}
        self.steps = int(chunk_length or cfg.get('n_action_steps') or 1)

    @classmethod
    def configure_contract(cls, contract: seq.Contract, config: dict) -> seq.Contract:
        """Return the checkpoint's contract; cheap (reads config.json, imports nothing heavy).

        :raises MissingDependency: when torch, lerobot>=0.4 or the checkpoint files are missing.
        """
        path = _checkpoint(config)
        runtime.require(path, 'lerobot')
        assert path is not None
        return runtime.contract_for(contract, runtime.read_config(path),
                                    action_space=config.get('action_space', 'joint_absolute'),
                                    fps=float(config.get('fps', 30.0)), state_names=config.get('state_names'),
                                    action_names=config.get('action_names'),
                                    chunk_length=config.get('chunk_length'))

    def load(self) -> None:
        """Load the weights onto the device (not billed)."""
        self.runner.load()

    def infer(self, inp: seq.PolicyInput, episode: seq.Episode) -> np.ndarray:
        """Return float32 (T, D): the first T actions of the checkpoint's chunk for this observation."""
        if self.runner.policy is None:
            self.load()
        obs = inp.observation
        return self.runner.chunk(obs.state, obs.images, episode.instruction or obs.instruction, self.steps)
