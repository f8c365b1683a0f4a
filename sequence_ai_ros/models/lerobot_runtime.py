"""Load a LeRobot policy checkpoint from a local directory and turn observations into action chunks.

Shared by the ``lerobot`` and ``pi05-droid`` templates, whose policy.py imports it from the installed
package (``from sequence_ai_ros.models import lerobot_runtime``).

Loading follows LeRobot's own path (LeRobot >= 0.4, ``lerobot/policies/factory.py``):
``get_policy_class(config.type).from_pretrained(dir)`` and
``make_pre_post_processors(policy.config, pretrained_path=dir)`` for the normalisation pipelines saved
beside the weights. Inference mirrors ``lerobot.utils.control_utils.predict_action``: images become
float (1, 3, H, W) in [0, 1], the state (1, D), the instruction goes in ``task``; then the preprocessor,
``predict_action_chunk`` (1, T, D), and the postprocessor (unnormalise).

torch and lerobot are heavy (GBs, CUDA wheels); they live in the worker's own environment, never in the
ROS venv. Everything here checks for them with :func:`importlib.util.find_spec` (no import) and raises
:class:`MissingDependency` naming exactly what is missing.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from sequence_ai_ros.exceptions import ConfigError, MissingDependency
from sequence_ai_ros.protocol.contract import CameraSpec, Contract, ObservationContract
from sequence_ai_ros.protocol.spaces import ActionSpace

MIN_LEROBOT = (0, 4)
WEIGHTS = ('config.json', 'model.safetensors')
IMAGE_PREFIX = 'observation.images.'
STATE_KEY = 'observation.state'


def resolve(value: str, base: Path) -> Path:
    """Expand ``~`` and $VARS; a relative path is relative to ``base`` (the policy.py folder)."""
    path = Path(os.path.expandvars(os.path.expanduser(str(value))))
    return path if path.is_absolute() else (base / path)


def _version(dist: str) -> tuple[int, ...] | None:
    try:
        raw = importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None
    parts = []
    for piece in raw.split('.')[:3]:
        digits = ''.join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def missing(checkpoint: Path | None, *, extra_files: tuple[str, ...] = ()) -> list[str]:
    """Return what is missing to load ``checkpoint``: python packages and files, each with how to get it.

    :param checkpoint: the checkpoint directory, or None when config.yaml does not name one.
    """
    out = []
    if importlib.util.find_spec('torch') is None:
        out.append('python package torch (pip install torch, in the worker\'s own venv, not the ROS venv)')
    if importlib.util.find_spec('lerobot') is None:
        out.append('python package lerobot>=0.4 (pip install "lerobot>=0.4"; 0.4.4 is the newest on Python 3.11)')
    else:
        found = _version('lerobot')
        if found is not None and found[:2] < MIN_LEROBOT:
            out.append(f'lerobot>=0.4 (found {".".join(map(str, found))}; pip install -U "lerobot>=0.4")')
    if checkpoint is None:
        out.append('a checkpoint directory (set `checkpoint:` in config.yaml)')
    elif not checkpoint.is_dir():
        out.append(f'the checkpoint directory {checkpoint} (config.json + model.safetensors; set `checkpoint:` '
                   'in config.yaml)')
    else:
        out += [f'checkpoint file {checkpoint / name}' for name in (*WEIGHTS, *extra_files)
                if not (checkpoint / name).is_file()]
    return out


def require(checkpoint: Path | None, template: str, *, extra_files: tuple[str, ...] = ()) -> None:
    """Raise :class:`MissingDependency` listing everything :func:`missing` finds, or return.

    :raises MissingDependency: when torch, lerobot>=0.4 or a checkpoint file is missing.
    """
    gone = missing(checkpoint, extra_files=extra_files)
    if gone:
        raise MissingDependency(f'the {template} template cannot load: missing ' + '; '.join(gone)
                                + ' (see its README.md)')


def read_config(checkpoint: Path) -> dict[str, Any]:
    """Return the checkpoint's ``config.json`` (policy type, input/output features, chunk sizes).

    :raises ConfigError: when it is not JSON or has no ``type``.
    """
    path = checkpoint / 'config.json'
    try:
        cfg = json.loads(path.read_text(encoding='utf-8'))
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f'{path}: unreadable ({exc})') from None
    if not isinstance(cfg, dict) or 'type' not in cfg:
        raise ConfigError(f'{path}: not a LeRobot policy config (no "type")')
    return cfg


def contract_for(contract: Contract, cfg: dict[str, Any], *, action_space: str, fps: float,
                 state_names: list[str] | None, action_names: list[str] | None,
                 chunk_length: int | None) -> Contract:
    """Build the contract from a checkpoint config: cameras and dims from its features.

    :param cfg: the checkpoint's config.json.
    :param fps: control rate the policy was trained at (Hz); dt = 1/fps.
    :param state_names: the D state names (default ``state_0`` ...).
    :param action_names: the action names (default ``action_0`` ...).
    :param chunk_length: actions per chunk; default the checkpoint's ``n_action_steps``.
    :raises ConfigError: when names do not match the checkpoint's dimensions.
    """
    inputs = cfg.get('input_features') or {}
    outputs = cfg.get('output_features') or {}
    state_dim = int(np.prod(inputs.get(STATE_KEY, {}).get('shape', [0])))
    action_dim = int(np.prod(outputs.get('action', {}).get('shape', [0])))
    if not action_dim:
        raise ConfigError('checkpoint config.json has no output feature "action"')
    state_names = list(state_names or [f'state_{i}' for i in range(state_dim)])
    action_names = list(action_names or [f'action_{i}' for i in range(action_dim)])
    if len(state_names) != state_dim or len(action_names) != action_dim:
        raise ConfigError(f'the checkpoint has state dim {state_dim} and action dim {action_dim}; config.yaml '
                          f'names {len(state_names)} state and {len(action_names)} action entries')
    cameras = []
    for key, feat in inputs.items():
        if feat.get('type') == 'VISUAL':
            shape = list(feat.get('shape') or [3, 0, 0])
            cameras.append(CameraSpec(key.removeprefix(IMAGE_PREFIX), width=int(shape[-1]), height=int(shape[-2])))
    steps = int(chunk_length or cfg.get('n_action_steps') or cfg.get('chunk_size') or 1)
    return dataclasses.replace(contract, action_space=ActionSpace.parse(action_space), action_names=tuple(action_names),
                               dt=1.0 / float(fps), chunk_length=steps,
                               observation=ObservationContract(cameras=tuple(cameras), state_names=tuple(state_names)))


class LeRobotRunner:
    """A loaded LeRobot policy and its pre/post-processors.

    :param checkpoint: local directory with config.json, model.safetensors and the processor files.
    :param device: torch device, e.g. ``cuda`` or ``cpu``.
    :param template: the template's name, for error messages.
    """

    def __init__(self, checkpoint: Path, device: str, template: str) -> None:
        self.checkpoint = checkpoint
        self.device = device
        self.template = template
        self.policy: Any = None
        self.pre: Any = None
        self.post: Any = None
        self.torch: Any = None

    def load(self) -> None:
        """Import torch and lerobot, load the weights onto the device (slow; not billed).

        :raises MissingDependency: for a missing package, file, or CUDA when ``device`` is cuda.
        """
        require(self.checkpoint, self.template)
        import torch
        from lerobot.policies.factory import get_policy_class, make_pre_post_processors

        if self.device.startswith('cuda') and not torch.cuda.is_available():
            raise MissingDependency(f'the {self.template} template needs a CUDA GPU (device {self.device!r}); '
                                    'torch.cuda.is_available() is False')
        cfg = read_config(self.checkpoint)
        policy = get_policy_class(cfg['type']).from_pretrained(str(self.checkpoint))
        policy.to(self.device)
        policy.eval()
        self.pre, self.post = make_pre_post_processors(
            policy.config, pretrained_path=str(self.checkpoint),
            preprocessor_overrides={'device_processor': {'device': self.device}})
        self.policy, self.torch = policy, torch

    def chunk(self, state: np.ndarray, images: dict[str, np.ndarray], task: str, steps: int) -> np.ndarray:
        """Return float32 (steps, D): the first ``steps`` actions of the policy's next chunk.

        :param state: float32 (D,) measured state.
        :param images: per camera key, uint8 (H, W, 3) RGB.
        :param task: the instruction.
        """
        torch = self.torch
        batch: dict[str, Any] = {STATE_KEY: torch.from_numpy(np.asarray(state, np.float32))[None]}
        for key, img in images.items():
            tensor = torch.from_numpy(np.ascontiguousarray(img)).permute(2, 0, 1).float() / 255.0
            batch[IMAGE_PREFIX + key] = tensor[None]
        batch['task'] = task
        with torch.inference_mode():
            actions = self.policy.predict_action_chunk(self.pre(batch))
            actions = self.post(actions)
        out = actions.detach().float().cpu().numpy()
        out = out.reshape(-1, out.shape[-1])
        return out[:steps].astype(np.float32)
