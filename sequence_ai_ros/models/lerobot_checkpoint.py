"""What a LeRobot checkpoint needs to be served correctly, read from its files alone (no torch, no lerobot).

A checkpoint directory is what LeRobot 0.6's training writes as ``pretrained_model/``: ``config.json`` (the
policy's type and input/output features), ``model.safetensors`` and the processor pipelines
(``policy_preprocessor.json``, ``policy_postprocessor.json`` and their state files).

:func:`plan` decides, before anything heavy is imported (``seq deploy`` runs it), how the checkpoint is
served, or refuses it with a :class:`~sequence_ai_ros.exceptions.ConfigError` that names the policy type
and the reason. It never lets a checkpoint through that would be served silently wrong:

- ``act``: chunks as LeRobot's ``predict_action_chunk`` returns them. A checkpoint with
  ``temporal_ensemble_coeff`` set is refused: LeRobot then runs the model at every control step and
  averages overlapping chunks (``ACTTemporalEnsembler``, Zhao et al. 2023), which a chunk server cannot do.
- ``diffusion``: ``n_obs_steps`` real frames per request, from the contract's
  ``ObservationContract(history=n_obs_steps)`` (Chi et al. 2023); a checkpoint conditioned on
  ``observation.environment_state`` is refused (the robot sends no such field).
- ``smolvla``, ``pi0``, ``pi05``: their backbone's processor and tokenizer files come from a local Hugging
  Face cache or snapshot directory (:func:`hub_needs`), never from the network. With ``rtc_config.enabled``
  the worker keeps the previous chunk's raw model-space rows per episode for real-time chunking.
- any other type is refused with the list of served ones.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from sequence_ai_ros.exceptions import ConfigError
from sequence_ai_ros.protocol.contract import CameraSpec, Contract, ObservationContract
from sequence_ai_ros.protocol.spaces import ActionSpace

IMAGE_PREFIX = 'observation.images.'
STATE_KEY = 'observation.state'
SERVED = ('act', 'diffusion', 'smolvla', 'pi0', 'pi05')
FLOW_MATCHING = ('smolvla', 'pi0', 'pi05')
#: the files a backbone repository must hold locally, per kind (what transformers' Auto* loaders read).
TOKENIZER_FILES = ('tokenizer_config.json', 'special_tokens_map.json')
PROCESSOR_FILES = ('config.json', 'tokenizer_config.json', 'preprocessor_config.json')


def resolve(value: str, base: Path) -> Path:
    """Expand ``~`` and $VARS; a relative path is relative to ``base`` (the policy.py folder)."""
    path = Path(os.path.expandvars(os.path.expanduser(str(value))))
    return path if path.is_absolute() else (base / path)


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


@dataclasses.dataclass(frozen=True)
class HubNeed:
    """A Hugging Face repository a policy type loads besides its checkpoint (processor or tokenizer).

    :param repo_id: e.g. ``google/paligemma-3b-pt-224``.
    :param files: the files that must be present locally.
    :param role: what it is for, in words.
    """

    repo_id: str
    files: tuple[str, ...]
    role: str


def hub_needs(checkpoint: Path, cfg: dict[str, Any]) -> list[HubNeed]:
    """Return the backbone repositories ``cfg``'s policy type reads from the Hub when it is built.

    SmolVLA builds its VLM from ``vlm_model_name`` (config and processor); every tokenizer step of the
    saved preprocessor (``policy_preprocessor.json``, LeRobot 0.6's ``tokenizer_processor``) names its
    tokenizer (pi0 and pi0.5: the PaliGemma tokenizer).
    """
    needs = []
    if cfg.get('type') == 'smolvla' and cfg.get('vlm_model_name'):
        needs.append(HubNeed(str(cfg['vlm_model_name']), PROCESSOR_FILES, 'the SmolVLM2 config and processor'))
    pre = checkpoint / 'policy_preprocessor.json'
    try:
        steps = json.loads(pre.read_text(encoding='utf-8')).get('steps', []) if pre.is_file() else []
    except (OSError, json.JSONDecodeError):
        steps = []
    for step in steps:
        name = (step.get('config') or {}).get('tokenizer_name') if isinstance(step, dict) else None
        if name and all(n.repo_id != name for n in needs):
            needs.append(HubNeed(str(name), TOKENIZER_FILES, 'the prompt tokenizer'))
    return needs


def locate(need: HubNeed, hub_cache: Path | None, snapshots: dict[str, Path]) -> tuple[Path | None, list[str]]:
    """Find ``need`` in a snapshot directory or a Hub cache; return (snapshot dir or None, missing files).

    :param hub_cache: a Hugging Face hub cache (``models--org--name/snapshots/<rev>/``), as
        ``hf download REPO --cache-dir DIR`` writes it.
    :param snapshots: repo id -> a plain directory, as ``hf download REPO --local-dir DIR`` writes it.
    """
    if need.repo_id in snapshots:
        root = snapshots[need.repo_id]
        return root, [f for f in need.files if not (root / f).is_file()]
    if hub_cache is not None:
        snaps = hub_cache / ('models--' + need.repo_id.replace('/', '--')) / 'snapshots'
        for rev in sorted(snaps.glob('*')) if snaps.is_dir() else []:
            if all((rev / f).is_file() for f in need.files):
                return None, []
    return None, list(need.files)


def missing_hub_files(needs: list[HubNeed], hub_cache: Path | None, snapshots: dict[str, Path]) -> list[str]:
    """Describe every missing backbone file, with how to place it (empty when all are present)."""
    out = []
    for need in needs:
        _, gone = locate(need, hub_cache, snapshots)
        if gone:
            where = (f'the snapshot directory {snapshots[need.repo_id]}' if need.repo_id in snapshots else
                     f'the hub cache {hub_cache}' if hub_cache else 'no hub_cache or hub_snapshots entry')
            out.append(f'{need.role} {need.repo_id}: {", ".join(gone)} not in {where} (on a machine with '
                       f'network: `hf download {need.repo_id} --cache-dir DIR`, copy DIR here and set '
                       f'`hub_cache: DIR` in config.yaml, or `hf download {need.repo_id} --local-dir D` and '
                       f'set `hub_snapshots: {{{need.repo_id}: D}}`)')
    return out


@dataclasses.dataclass(frozen=True)
class ServingPlan:
    """How one checkpoint is served.

    :param policy_type: ``act``, ``diffusion``, ``smolvla``, ``pi0`` or ``pi05``.
    :param history: observation frames per request (diffusion's ``n_obs_steps``; 1 otherwise).
    :param steps: actions per chunk T.
    :param cameras: robot camera key -> checkpoint camera key (``observation.images.<key>``).
    :param sizes: checkpoint camera key -> (width, height) from its features.
    :param horizon: rows of the model's raw output (diffusion's ``horizon``, else ``chunk_size``).
    :param action_dim: D.
    :param rtc_horizon: RTC's execution horizon when the checkpoint enables RTC, else None.
    """

    policy_type: str
    history: int
    steps: int
    cameras: dict[str, str]
    sizes: dict[str, tuple[int, int]]
    horizon: int
    action_dim: int
    rtc_horizon: int | None = None


def _refuse(policy_type: str, reason: str) -> ConfigError:
    return ConfigError(f'the lerobot template cannot serve this {policy_type!r} checkpoint correctly: {reason}')


def plan(cfg: dict[str, Any], *, cameras: dict[str, str] | None = None, chunk_length: int | None = None) -> ServingPlan:
    """Decide how ``cfg`` (a checkpoint's config.json) is served, or refuse it.

    :param cameras: robot camera -> checkpoint camera (without ``observation.images.``); unnamed checkpoint
        cameras keep their own name.
    :param chunk_length: actions per chunk; default the checkpoint's ``n_action_steps``.
    :raises ConfigError: naming the policy type and the reason when it cannot be served correctly.
    """
    kind = str(cfg.get('type'))
    if kind not in SERVED:
        raise _refuse(kind, f'only {", ".join(SERVED)} are served (their inference path is checked here or by '
                            'test/gpu/); another type may need inputs or stateful inference this template lacks')
    inputs = cfg.get('input_features') or {}
    outputs = cfg.get('output_features') or {}
    extra = [k for k, f in inputs.items() if k != STATE_KEY and f.get('type') != 'VISUAL']
    if extra:
        raise _refuse(kind, f'it is conditioned on {extra}, which the robot does not send (only '
                            f'{STATE_KEY} and cameras)')
    action_dim = int(np.prod(outputs.get('action', {}).get('shape', [0])))
    if not action_dim:
        raise ConfigError('checkpoint config.json has no output feature "action"')
    if kind == 'act' and cfg.get('temporal_ensemble_coeff') is not None:
        raise _refuse(kind, f'temporal_ensemble_coeff={cfg["temporal_ensemble_coeff"]}: LeRobot then runs ACT at '
                            'every control step and averages the overlapping chunks (ACTTemporalEnsembler), which '
                            'a chunk server cannot reproduce. Serve it with "temporal_ensemble_coeff": null in '
                            'config.json (chunks as chunks; the robot can cross-fade seams with smooth_seam)')
    n_obs = int(cfg.get('n_obs_steps') or 1)
    if kind != 'diffusion' and n_obs != 1:
        raise _refuse(kind, f'n_obs_steps={n_obs}: LeRobot\'s {kind} reads one observation per chunk')
    ckpt_cams = {k.removeprefix(IMAGE_PREFIX): f for k, f in inputs.items() if f.get('type') == 'VISUAL'}
    mapping = dict(cameras or {})
    unknown = sorted(set(mapping.values()) - set(ckpt_cams))
    if unknown:
        raise ConfigError(f'cameras maps robot cameras onto {unknown}, which the checkpoint does not have; its '
                          f'cameras: {sorted(ckpt_cams)}')
    mapped = set(mapping.values())
    for key in ckpt_cams:
        if key not in mapped:
            mapping.setdefault(key, key)
    sizes = {k: (int(f['shape'][-1]), int(f['shape'][-2])) for k, f in ckpt_cams.items()}
    n_action = int(cfg.get('n_action_steps') or cfg.get('chunk_size') or 1)
    horizon = int(cfg.get('horizon') or cfg.get('chunk_size') or n_action)
    if kind == 'diffusion' and n_action > horizon - n_obs + 1:
        raise _refuse(kind, f'n_action_steps={n_action} > horizon - n_obs_steps + 1 = {horizon - n_obs + 1}')
    steps = int(chunk_length or n_action)
    if steps > n_action:
        raise _refuse(kind, f'chunk_length {steps} exceeds the checkpoint\'s n_action_steps {n_action}')
    rtc = cfg.get('rtc_config') or {}
    rtc_horizon = int(rtc.get('execution_horizon') or 10) if kind in FLOW_MATCHING and rtc.get('enabled') else None
    return ServingPlan(policy_type=kind, history=n_obs if kind == 'diffusion' else 1, steps=steps,
                       cameras=mapping, sizes=sizes, horizon=horizon, action_dim=action_dim, rtc_horizon=rtc_horizon)


def contract_for(contract: Contract, cfg: dict[str, Any], *, action_space: str, fps: float,
                 state_names: list[str] | None, action_names: list[str] | None,
                 chunk_length: int | None, cameras: dict[str, str] | None = None) -> Contract:
    """Build the contract from a checkpoint config: cameras (renamed, at the checkpoint's size), dims, history.

    :param cfg: the checkpoint's config.json.
    :param fps: control rate the policy was trained at (Hz); dt = 1/fps.
    :param state_names: the D state names (default ``state_0`` ...).
    :param action_names: the action names (default ``action_0`` ...).
    :param chunk_length: actions per chunk; default the checkpoint's ``n_action_steps``.
    :param cameras: robot camera -> checkpoint camera.
    :raises ConfigError: when names do not match the checkpoint's dimensions, or :func:`plan` refuses.
    """
    how = plan(cfg, cameras=cameras, chunk_length=chunk_length)
    inputs = cfg.get('input_features') or {}
    state_dim = int(np.prod(inputs.get(STATE_KEY, {}).get('shape', [0])))
    state_names = list(state_names or [f'state_{i}' for i in range(state_dim)])
    action_names = list(action_names or [f'action_{i}' for i in range(how.action_dim)])
    if len(state_names) != state_dim or len(action_names) != how.action_dim:
        raise ConfigError(f'the checkpoint has state dim {state_dim} and action dim {how.action_dim}; config.yaml '
                          f'names {len(state_names)} state and {len(action_names)} action entries')
    specs = tuple(CameraSpec(robot, width=how.sizes[ckpt][0], height=how.sizes[ckpt][1])
                  for robot, ckpt in how.cameras.items())
    return dataclasses.replace(contract, action_space=ActionSpace.parse(action_space), action_names=tuple(action_names),
                               dt=1.0 / float(fps), chunk_length=how.steps,
                               observation=ObservationContract(cameras=specs, state_names=tuple(state_names),
                                                               history=how.history))
