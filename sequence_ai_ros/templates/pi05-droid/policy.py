"""``pi05-droid``: a pi0.5 DROID checkpoint served through LeRobot's PI05 policy, on CUDA.

DROID (Khazatsky et al., 2024) robots are Franka arms with a Robotiq gripper, commanded at 15 Hz. The
pi0.5 DROID policy (Physical Intelligence, openpi ``pi05_droid``) sees one exterior camera, the wrist
camera, the 7 joint positions plus the gripper position, and the instruction, and answers with a chunk of
joint velocities (rad/s, 7) plus an absolute gripper position (0..1): action_space ``joint_velocity``.

The checkpoint is a local directory in LeRobot's format (config.json with ``"type": "pi05"``,
model.safetensors, the processor files), loaded with LeRobot >= 0.4's ``PI05Policy.from_pretrained`` and
``make_pre_post_processors`` (sequence_ai_ros/models/lerobot_runtime.py). PI05 tokenises the prompt with the PaliGemma
tokenizer, which must be in the local Hugging Face cache (no download at serve time). Without torch,
lerobot>=0.4, the weights or a CUDA GPU, deploy/load fails with MissingDependency naming what is missing.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

import sequence_ai_ros.policy as seq
from sequence_ai_ros.exceptions import ConfigError
from sequence_ai_ros.models import lerobot_runtime as runtime

HERE = Path(__file__).resolve().parent
DROID_STATE = ('joint_0', 'joint_1', 'joint_2', 'joint_3', 'joint_4', 'joint_5', 'joint_6', 'gripper')
DROID_ACTIONS = ('joint_0_velocity', 'joint_1_velocity', 'joint_2_velocity', 'joint_3_velocity',
                 'joint_4_velocity', 'joint_5_velocity', 'joint_6_velocity', 'gripper_position')
DROID_FPS = 15.0


def _checkpoint(config: dict) -> Path | None:
    """The checkpoint directory named in config.yaml, or None when it names none."""
    return runtime.resolve(config['checkpoint'], HERE) if config.get('checkpoint') else None


@seq.policy(action_space='joint_velocity', action_names=DROID_ACTIONS, dt=1 / DROID_FPS, chunk_length=8,
            observation=seq.ObservationContract(
                cameras=[seq.CameraSpec('exterior_image_1_left', 224, 224, 'jpeg'),
                         seq.CameraSpec('wrist_image_left', 224, 224, 'jpeg')],
                state_names=DROID_STATE),
            gripper='last channel: absolute gripper position 0 (open) .. 1 (closed), as in DROID')
class Pi05Droid:
    """pi0.5 DROID on CUDA.

    :param checkpoint: the checkpoint directory (absolute, or relative to this file).
    :param device: a CUDA device (``cuda``, ``cuda:1``).
    :param chunk_length: actions executed per chunk; openpi's DROID client runs 8 of the 15 predicted.
    """

    def __init__(self, checkpoint: str = '', device: str = 'cuda', chunk_length: int = 8) -> None:
        path = _checkpoint({'checkpoint': checkpoint})
        runtime.require(path, 'pi05-droid')
        assert path is not None
        self.path = path
        if not str(device).startswith('cuda'):
            raise ConfigError(f'pi05-droid runs on CUDA; device {device!r} is not a cuda device')
        self.runner = runtime.LeRobotRunner(self.path, device, 'pi05-droid')
        self.steps = int(chunk_length)

    @classmethod
    def configure_contract(cls, contract: seq.Contract, config: dict) -> seq.Contract:
        """Return the DROID contract, with the camera keys and sizes of the checkpoint's config.json.

        :raises MissingDependency: when torch, lerobot>=0.4 or the checkpoint files are missing.
        :raises ConfigError: when the checkpoint is not a pi05 policy with 8-d state and action.
        """
        path = _checkpoint(config)
        runtime.require(path, 'pi05-droid')
        assert path is not None
        cfg = runtime.read_config(path)
        if cfg['type'] != 'pi05':
            raise ConfigError(f'{path}/config.json: type {cfg["type"]!r}, expected "pi05" (use the lerobot template)')
        return runtime.contract_for(contract, cfg, action_space='joint_velocity', fps=DROID_FPS,
                                    state_names=list(DROID_STATE), action_names=list(DROID_ACTIONS),
                                    chunk_length=int(config.get('chunk_length', 8)))

    @classmethod
    def artifacts(cls, config: dict) -> list[Path]:
        """What a deployment version hashes besides policy.py and config.yaml: the checkpoint directory."""
        path = _checkpoint(config)
        return [path] if path is not None else []

    def load(self) -> None:
        """Load the weights onto the GPU (not billed); checks CUDA."""
        self.runner.load()

    def infer(self, inp: seq.PolicyInput, episode: seq.Episode) -> np.ndarray:
        """Return float32 (T, 8): 7 joint velocities (rad/s) and the gripper position (0..1)."""
        if self.runner.policy is None:
            self.load()
        obs = inp.observation
        return self.runner.chunk(obs.state, obs.images, episode.instruction or obs.instruction, self.steps)
