"""What a LeRobot checkpoint needs to be served correctly, read from its files alone (no torch, no lerobot).

A checkpoint directory is what LeRobot 0.6's training writes as ``pretrained_model/``: ``config.json`` (the
policy's type and input/output features), ``model.safetensors`` and the processor pipelines
(``policy_preprocessor.json``, ``policy_postprocessor.json`` and their state files).

:func:`plan` decides, before anything heavy is imported (``seq deploy`` runs it), how the checkpoint is
served, or refuses it with a :class:`~sequence_ai_ros.exceptions.ConfigError` that names the policy type
and the reason. It never lets a checkpoint through that would be served silently wrong:

- ``act``: chunks as LeRobot's ``predict_action_chunk`` returns them. With ``temporal_ensemble_coeff`` set,
  LeRobot runs the model at every control step and averages the overlapping chunks
  (``ACTTemporalEnsembler``, Zhao et al. 2023): whole chunks (``chunk_size``) are served and the contract
  declares ``aggregate: weighted_average`` with that coefficient, so the robot does the same.
- ``diffusion``: ``n_obs_steps`` real frames per request, from the contract's
  ``ObservationContract(history=n_obs_steps)`` (Chi et al. 2023).
- every type: ``observation.state``, ``observation.environment_state`` and other state features are made of
  named robot joints (config.yaml's ``state_names`` and ``features``), cameras of the robot's cameras;
  ``rename_map`` maps the robot's keys onto the checkpoint's in LeRobot's own form; cameras the robot lacks
  are padded as LeRobot pads them where the type pads (smolvla, pi0, pi05), else refused.
- ``smolvla``, ``pi0``, ``pi05``: their backbone's processor and tokenizer files come from a local Hugging
  Face cache or snapshot directory (:func:`hub_needs`), never from the network. With ``rtc_config.enabled``
  the worker keeps the previous chunk's raw model-space rows per episode for real-time chunking.
- any other type is refused with the list of served ones.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path
from typing import Any

import numpy as np

from sequence_ai_ros.exceptions import ConfigError
from sequence_ai_ros.protocol.contract import CameraSpec, Contract, ObservationContract
from sequence_ai_ros.protocol.spaces import ActionSpace

log = logging.getLogger(__name__)
IMAGE_PREFIX = 'observation.images.'
#: LeRobot's key of a single camera (its simulation datasets: pusht, xarm, ...)
IMAGE_KEY = 'observation.image'
STATE_KEY = 'observation.state'
#: the types whose model pads a camera missing from the batch (``prepare_images``), as LeRobot 0.6 does
PADDING = ('smolvla', 'pi0', 'pi05')
SERVED = ('act', 'diffusion', 'smolvla', 'pi0', 'pi05')
FLOW_MATCHING = ('smolvla', 'pi0', 'pi05')
#: the files a backbone repository must hold locally, per kind: each entry is satisfied by any one of its names,
#: exactly as transformers' loaders read them (AutoTokenizer: tokenizer_config.json and a vocabulary, fast or
#: sentencepiece; AutoProcessor: also the image processor's config, which transformers >= 5 saves inside
#: processor_config.json (``NAME#KEY``: the file holds KEY) and earlier versions as preprocessor_config.json;
#: AutoConfig: config.json).
TOKENIZER_FILES: tuple[tuple[str, ...], ...] = (
    ('tokenizer_config.json',), ('tokenizer.json', 'tokenizer.model', 'vocab.json', 'vocab.txt', 'spiece.model'))
PROCESSOR_FILES: tuple[tuple[str, ...], ...] = (
    ('config.json',), *TOKENIZER_FILES, ('preprocessor_config.json', 'processor_config.json#image_processor'))


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
    :param files: what must be present locally: each entry is satisfied by any one of its file names.
    :param role: what it is for, in words.
    """

    repo_id: str
    files: tuple[tuple[str, ...], ...]
    role: str

    def gone(self, root: Path) -> list[str]:
        """The entries of :attr:`files` that ``root`` lacks, each as ``a`` or ``a or b``."""
        return [' or '.join(map(_shown, alts)) for alts in self.files if not any(_holds(root, n) for n in alts)]

    def download_names(self) -> str:
        """The files to fetch, for ``hf download REPO FILES...``.

        The first name of each entry, and both names of a two-way entry (a repository saved by transformers 4
        holds its image processor in preprocessor_config.json, one saved by 5 in processor_config.json).
        """
        names = [alts[0].split('#')[0] for alts in self.files]
        names += [n.split('#')[0] for alts in self.files if len(alts) == 2 for n in alts[1:]]
        return ' '.join(dict.fromkeys(names))


def _holds(root: Path, name: str) -> bool:
    """``root/name`` is a file; for ``NAME#KEY``, a JSON object with KEY."""
    file, _, key = name.partition('#')
    if not (root / file).is_file():
        return False
    if not key:
        return True
    try:
        return key in json.loads((root / file).read_text(encoding='utf-8'))
    except (OSError, ValueError, TypeError):
        return False


def _shown(name: str) -> str:
    file, _, key = name.partition('#')
    return f'{file} (with {key})' if key else file


def hub_needs(checkpoint: Path, cfg: dict[str, Any]) -> list[HubNeed]:
    """Return the backbone repositories ``cfg``'s policy type reads from the Hub when it is built.

    SmolVLA builds its VLM from ``vlm_model_name`` (config and processor); every tokenizer step of the
    saved preprocessor (``policy_preprocessor.json``, LeRobot 0.6's ``tokenizer_processor``) names its
    tokenizer (pi0 and pi0.5: the PaliGemma tokenizer).
    """
    needs = []
    if cfg.get('type') == 'smolvla' and cfg.get('vlm_model_name'):
        needs.append(HubNeed(str(cfg['vlm_model_name']), PROCESSOR_FILES, 'the SmolVLM2 config and processor'))
    for step in _preprocessor_steps(checkpoint):
        name = (step.get('config') or {}).get('tokenizer_name')
        if name and all(n.repo_id != name for n in needs):
            needs.append(HubNeed(str(name), TOKENIZER_FILES, 'the prompt tokenizer'))
    return needs


def locate(need: HubNeed, hub_cache: Path | None, snapshots: dict[str, Path]) -> tuple[Path | None, list[str]]:
    """Find ``need`` in a snapshot directory or a Hub cache; return (its local directory or None, missing files).

    :param hub_cache: a Hugging Face hub cache (``models--org--name/snapshots/<rev>/``), as
        ``hf download REPO --cache-dir DIR`` writes it; the revision ``refs/main`` names is tried first.
    :param snapshots: repo id -> a plain directory, as ``hf download REPO --local-dir DIR`` writes it.
    :returns: the directory holding every file (the loaders are given this path, so nothing resolves a repo
        id on the Hub), or None with the missing entries of the best candidate.
    """
    if need.repo_id in snapshots:
        root = snapshots[need.repo_id]
        gone = need.gone(root)
        return (None if gone else root), gone
    if hub_cache is not None:
        repo = hub_cache / ('models--' + need.repo_id.replace('/', '--'))
        snaps = repo / 'snapshots'
        revs = sorted(snaps.glob('*')) if snaps.is_dir() else []
        main = repo / 'refs' / 'main'
        if main.is_file():
            head = snaps / main.read_text(encoding='utf-8').strip()
            revs = [head, *(r for r in revs if r != head)] if head.is_dir() else revs
        for rev in revs:
            if not need.gone(rev):
                return rev, []
        if revs:
            return None, need.gone(revs[0])
    return None, [' or '.join(map(_shown, alts)) for alts in need.files]


def missing_hub_files(needs: list[HubNeed], hub_cache: Path | None, snapshots: dict[str, Path]) -> list[str]:
    """Describe every missing backbone file, with how to place it (empty when all are present)."""
    out = []
    for need in needs:
        _, gone = locate(need, hub_cache, snapshots)
        if gone:
            where = (f'the snapshot directory {snapshots[need.repo_id]}' if need.repo_id in snapshots else
                     f'the hub cache {hub_cache}' if hub_cache else 'no hub_cache or hub_snapshots entry')
            names = need.download_names()
            out.append(f'{need.role} {need.repo_id}: {", ".join(gone)} not in {where} (on a machine with '
                       f'network: `hf download {need.repo_id} {names} --cache-dir DIR`, copy DIR here and set '
                       f'`hub_cache: DIR` in config.yaml, or `hf download {need.repo_id} {names} --local-dir D` '
                       f'and set `hub_snapshots: {{{need.repo_id}: D}}`)')
    return out


def hub_overrides(checkpoint: Path, local: dict[str, Path]) -> dict[str, dict[str, str]]:
    """Point every saved preprocessor step that names a backbone repo at its local directory.

    :param local: repo id -> the local directory :func:`locate` found.
    :returns: LeRobot's ``preprocessor_overrides`` form, registry name -> {config key: local path}: every
        string in a step's config equal to a located repo id (SmolVLA's and pi0's ``tokenizer_processor``
        ``tokenizer_name`` among them).
    """
    out: dict[str, dict[str, str]] = {}
    for step in _preprocessor_steps(checkpoint):
        name = step.get('registry_name')
        for key, value in (step.get('config') or {}).items():
            if name and isinstance(value, str) and value in local:
                out.setdefault(str(name), {})[key] = str(local[value])
    return out


def _preprocessor_steps(checkpoint: Path) -> list[dict[str, Any]]:
    """The steps of the checkpoint's saved ``policy_preprocessor.json`` (none when absent or unreadable)."""
    pre = checkpoint / 'policy_preprocessor.json'
    try:
        steps = json.loads(pre.read_text(encoding='utf-8')).get('steps', []) if pre.is_file() else []
    except (OSError, json.JSONDecodeError, AttributeError):
        steps = []
    return [step for step in steps if isinstance(step, dict)]


@dataclasses.dataclass(frozen=True)
class ServingPlan:
    """How one checkpoint is served.

    :param policy_type: ``act``, ``diffusion``, ``smolvla``, ``pi0`` or ``pi05``.
    :param history: observation frames per request (diffusion's ``n_obs_steps``; 1 otherwise).
    :param steps: actions per chunk T.
    :param cameras: robot camera -> the checkpoint camera it feeds (full key, ``observation.images.<name>``
        or ``observation.image``), in the checkpoint's order.
    :param sizes: checkpoint camera key -> (width, height) from its features.
    :param horizon: rows of the model's raw output (diffusion's ``horizon``, else ``chunk_size``).
    :param action_dim: D.
    :param rtc_horizon: RTC's execution horizon when the checkpoint enables RTC, else None.
    :param padded: checkpoint cameras left out of the batch for the model to pad, as LeRobot does.
    :param state: checkpoint state feature (``observation.state``, ``observation.environment_state`` ...) ->
        the robot's joint names that make it, in order.
    :param state_names: the contract's state names: every joint of ``state``, each once.
    :param aggregate: how the robot combines overlapping chunks (``weighted_average`` for an ACT
        checkpoint with temporal ensembling, else ``latest_only``).
    :param temporal_ensemble_coeff: the checkpoint's coefficient for weighted_average, else 0.
    """

    policy_type: str
    history: int
    steps: int
    cameras: dict[str, str]
    sizes: dict[str, tuple[int, int]]
    horizon: int
    action_dim: int
    rtc_horizon: int | None = None
    padded: tuple[str, ...] = ()
    state: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    state_names: tuple[str, ...] = ()
    aggregate: str = 'latest_only'
    temporal_ensemble_coeff: float = 0.0

    @property
    def state_index(self) -> dict[str, tuple[int, ...]]:
        """Checkpoint state feature -> the indices of its joints in the contract's state vector."""
        where = {name: i for i, name in enumerate(self.state_names)}
        return {key: tuple(where[n] for n in names) for key, names in self.state.items()}


def _refuse(policy_type: str, reason: str) -> ConfigError:
    return ConfigError(f'the lerobot template cannot serve this {policy_type!r} checkpoint correctly: {reason}')


def camera_name(key: str) -> str:
    """The robot camera a LeRobot image key names.

    ``observation.images.top`` -> ``top``; ``observation.image`` (LeRobot's single-camera key) -> ``image``.
    """
    return 'image' if key == IMAGE_KEY else key.removeprefix(IMAGE_PREFIX)


def _is_image(key: str) -> bool:
    return key == IMAGE_KEY or key.startswith(IMAGE_PREFIX)


def _dim(feature: dict[str, Any]) -> int:
    return int(np.prod(feature.get('shape') or [0]))


def _names_of(value: object, what: str) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, (list, tuple)) or not all(isinstance(n, str) and n
                                                                                 for n in value):
        raise ConfigError(f'{what} must be a list of joint names, got {value!r}')
    return tuple(value)


def _padding(kind: str, cfg: dict[str, Any], padded: list[str], present: list[str]) -> None:
    """Refuse padding the model would not do as it was trained (LeRobot's own rules per type)."""
    if not padded:
        return
    if kind not in PADDING:
        raise _refuse(kind, f'it needs the cameras {padded}, which the robot does not send; LeRobot\'s {kind} '
                            'does not pad a missing camera (only smolvla, pi0 and pi05 do): map a robot camera '
                            'onto each with rename_map')
    if not present:
        raise _refuse(kind, f'every camera would be padded ({padded}); LeRobot\'s {kind} needs at least one '
                            'real camera')
    if kind == 'smolvla' and len(padded) > int(cfg.get('empty_cameras') or 0):
        raise _refuse(kind, f'{len(padded)} cameras would be padded ({padded}) but SmolVLA pads at most '
                            f'empty_cameras={int(cfg.get("empty_cameras") or 0)} (LeRobot drops the rest, so '
                            'the model would see fewer images than it was trained with)')


def _unsent_hint(key: str, src: str | None, rename: dict[str, str], dim: int) -> str:
    """How to feed checkpoint feature ``key`` (``src``: the robot feature meant to feed it, None: renamed away)."""
    if src is None:
        return (f'rename_map takes the robot\'s {key} to {rename[key]} and maps nothing onto {key}; map a robot '
                f'feature onto it (rename_map: {{ROBOT_KEY: {key}}}) and name that feature\'s {dim} joints')
    where = 'state_names' if src == STATE_KEY else f'features: {{{src}: [joint, ...]}}'
    via = f' (rename_map feeds it from {src})' if src != key else ''
    return f'name the {dim} joints of {src} in config.yaml ({where}){via}'


def plan(cfg: dict[str, Any], *, rename_map: dict[str, str] | None = None,
         features: dict[str, list[str]] | None = None, state_names: list[str] | None = None,
         pad_cameras: list[str] | None = None, chunk_length: int | None = None,
         rtc_execution_horizon: int | None = None) -> ServingPlan:
    """Decide how ``cfg`` (a checkpoint's config.json) is served, or refuse it.

    The robot's features are its cameras (``observation.images.<camera>``), ``observation.state`` (the
    joints ``state_names``) and any further feature of named joints (``features``, e.g.
    ``{observation.environment_state: [obs_0, ...]}``). ``rename_map`` maps a robot feature key onto the
    checkpoint's, in LeRobot's own form (``RenameObservationsProcessorStep``: robot key -> policy key); a
    checkpoint feature that no rename feeds is fed by the robot feature of its own name, unless a rename
    takes that one elsewhere. A checkpoint camera left without a robot camera, SmolVLA's
    ``empty_camera_<i>`` and the cameras in ``pad_cameras`` (the robot lacks them) are padded by the model
    as LeRobot pads them (smolvla up to ``empty_cameras``, pi0 and pi0.5 any but one), and declared so in
    the contract; act and diffusion pad nothing, so a camera they lack is refused.

    :param rename_map: robot feature key -> checkpoint feature key.
    :param features: checkpoint-side or renamed state-like features -> their joint names, in order.
    :param state_names: the joints of the robot's ``observation.state`` (default ``state_0`` ... of the
        checkpoint feature it feeds).
    :param pad_cameras: checkpoint cameras (names or full keys) the robot lacks.
    :param chunk_length: actions per chunk; default the checkpoint's ``n_action_steps`` (``chunk_size``
        for an ACT with temporal ensembling, whose overlapping chunks the robot averages).
    :param rtc_execution_horizon: config.yaml's fixed RTC execution horizon: an integer 1 .. chunk_size, only
        for a checkpoint whose ``rtc_config.enabled`` is true; None = from the checkpoint and the delay.
    :raises ConfigError: naming the policy type and the reason when it cannot be served correctly, or the
        config.yaml entry that is wrong.
    """
    kind = str(cfg.get('type'))
    if kind not in SERVED:
        raise _refuse(kind, f'only {", ".join(SERVED)} are served (their inference path is checked here or by '
                            'test/gpu/); another type may need inputs or stateful inference this template lacks')
    inputs = cfg.get('input_features') or {}
    outputs = cfg.get('output_features') or {}
    action_dim = _dim(outputs.get('action', {}))
    if not action_dim:
        raise ConfigError('checkpoint config.json has no output feature "action"')
    rename = dict(rename_map or {})
    for src, dst in rename.items():
        if dst not in inputs:
            raise ConfigError(f'rename_map maps {src!r} onto {dst!r}, which the checkpoint does not take; its '
                              f'input features: {sorted(inputs)}')
        if _is_image(src) != (inputs[dst].get('type') == 'VISUAL'):
            raise ConfigError(f'rename_map maps {src!r} onto {dst!r}: a camera maps onto a camera, a state '
                              'feature onto a state feature')
    if len(set(rename.values())) != len(rename):
        raise ConfigError(f'rename_map maps several robot features onto one: {rename}')
    source = {dst: src for src, dst in rename.items()}

    def fed_by(key: str) -> str | None:
        return source.get(key, key if key not in rename else None)

    # cameras
    wanted_pad = {k if _is_image(k) else IMAGE_PREFIX + k for k in (pad_cameras or [])}
    ckpt_cams = [k for k, f in inputs.items() if f.get('type') == 'VISUAL']
    unknown = sorted(wanted_pad - set(ckpt_cams))
    if unknown:
        raise ConfigError(f'pad_cameras names {unknown}, which the checkpoint does not have; its cameras: '
                          f'{ckpt_cams}')
    own_pads = {f'{IMAGE_PREFIX}empty_camera_{i}' for i in range(int(cfg.get('empty_cameras') or 0))}
    cameras: dict[str, str] = {}
    padded: list[str] = []
    for key in ckpt_cams:
        cam = fed_by(key)
        if key in own_pads or key in wanted_pad or cam is None:
            padded.append(key)
            continue
        cameras[camera_name(cam)] = key
    _padding(kind, cfg, padded, list(cameras.values()))
    sizes = {k: (int(inputs[k]['shape'][-1]), int(inputs[k]['shape'][-2])) for k in ckpt_cams}
    # state features
    robot: dict[str, tuple[str, ...] | None] = {STATE_KEY: _names_of(state_names, 'state_names')
                                                if state_names else None}
    for key, given in (features or {}).items():
        robot[key] = _names_of(given, f'features[{key!r}]')
    state: dict[str, tuple[str, ...]] = {}
    used = set()
    for key, feat in inputs.items():
        if feat.get('type') == 'VISUAL':
            continue
        feeder = fed_by(key)
        if feeder is None or feeder not in robot:
            raise _refuse(kind, f'it is conditioned on {key}, which the robot does not send: '
                                + _unsent_hint(key, feeder, rename, _dim(feat)))
        names = robot[feeder]
        if names is None:
            names = tuple(f'state_{i}' for i in range(_dim(feat)))
        if len(names) != _dim(feat):
            raise ConfigError(f'the checkpoint\'s {key} has {_dim(feat)} dimensions; config.yaml names '
                              f'{len(names)} joints for {feeder}')
        state[key] = names
        used.add(feeder)
    idle = sorted(k for k, v in robot.items() if k not in used and (v is not None))
    if idle:
        named = ['state_names (the robot\'s observation.state)' if k == STATE_KEY else f'features[{k!r}]'
                 for k in idle]
        fed = {k: fed_by(k) for k, f in inputs.items() if f.get('type') != 'VISUAL'}
        raise ConfigError(f'config.yaml sets {", ".join(named)}, which feed none of the checkpoint\'s inputs; '
                          'they are fed as ' + ', '.join(f'{k} <- {v}' for k, v in fed.items())
                          + ' (rename_map robot key -> checkpoint key); remove the unused entries')
    contract_names = tuple(dict.fromkeys(n for names in state.values() for n in names))
    # chunks
    n_obs = int(cfg.get('n_obs_steps') or 1)
    if kind != 'diffusion' and n_obs != 1:
        raise _refuse(kind, f'n_obs_steps={n_obs}: LeRobot\'s {kind} reads one observation per chunk')
    n_action = int(cfg.get('n_action_steps') or cfg.get('chunk_size') or 1)
    horizon = int(cfg.get('horizon') or cfg.get('chunk_size') or n_action)
    if kind == 'diffusion' and n_action > horizon - n_obs + 1:
        raise _refuse(kind, f'n_action_steps={n_action} > horizon - n_obs_steps + 1 = {horizon - n_obs + 1}')
    aggregate, coeff = 'latest_only', 0.0
    if kind == 'act' and cfg.get('temporal_ensemble_coeff') is not None:
        # LeRobot runs such an ACT at every step and averages the chunks (ACTTemporalEnsembler): the robot
        # does the same with whole chunks (aggregate weighted_average, a request at every tick)
        aggregate, coeff = 'weighted_average', float(cfg['temporal_ensemble_coeff'])
        n_action = int(cfg.get('chunk_size') or n_action)
    steps = int(chunk_length or n_action)
    if steps > n_action:
        raise _refuse(kind, f'chunk_length {steps} exceeds the checkpoint\'s n_action_steps {n_action}')
    rtc = cfg.get('rtc_config') or {}
    rtc_horizon = int(rtc.get('execution_horizon') or 10) if kind in FLOW_MATCHING and rtc.get('enabled') else None
    _check_rtc_horizon(kind, rtc_execution_horizon, rtc_horizon, int(cfg.get('chunk_size') or horizon))
    return ServingPlan(policy_type=kind, history=n_obs if kind == 'diffusion' else 1, steps=steps,
                       cameras=cameras, sizes=sizes, horizon=horizon, action_dim=action_dim, rtc_horizon=rtc_horizon,
                       padded=tuple(padded), state=state, state_names=contract_names, aggregate=aggregate,
                       temporal_ensemble_coeff=coeff)


def _check_rtc_horizon(kind: str, value: object, rtc_horizon: int | None, chunk_size: int) -> None:
    """Refuse a config.yaml ``rtc_execution_horizon`` that is not an integer 1 .. chunk_size, or set without RTC."""
    if value is None:
        return
    if rtc_horizon is None:
        raise ConfigError(f'config.yaml rtc_execution_horizon: {value!r} is set, but this {kind!r} checkpoint does '
                          'not enable real-time chunking (rtc_config.enabled in its config.json); remove the key')
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= chunk_size:
        raise ConfigError(f'config.yaml rtc_execution_horizon: {value!r} is not null or an integer 1 .. {chunk_size} '
                          '(the checkpoint\'s chunk_size)')


def contract_for(contract: Contract, cfg: dict[str, Any], *, action_space: str, fps: float,
                 state_names: list[str] | None, action_names: list[str] | None,
                 chunk_length: int | None, rename_map: dict[str, str] | None = None,
                 features: dict[str, list[str]] | None = None, pad_cameras: list[str] | None = None,
                 rtc_execution_horizon: int | None = None) -> Contract:
    """Build the contract from a checkpoint config.

    Cameras (renamed, at the checkpoint's size; padded ones declared), state joints, dims, history, aggregate.

    :param cfg: the checkpoint's config.json.
    :param fps: control rate the policy was trained at (Hz); dt = 1/fps.
    :param state_names: the joints of ``observation.state`` (default ``state_0`` ...).
    :param action_names: the action names (default ``action_0`` ...).
    :param chunk_length: actions per chunk; default the checkpoint's ``n_action_steps``.
    :param rename_map: robot feature key -> checkpoint feature key (see :func:`plan`).
    :param features: further state features -> joint names (see :func:`plan`).
    :param pad_cameras: checkpoint cameras the robot lacks (see :func:`plan`).
    :param rtc_execution_horizon: config.yaml's fixed RTC execution horizon (see :func:`plan`).
    :raises ConfigError: when names do not match the checkpoint's dimensions, or :func:`plan` refuses.
    """
    how = plan(cfg, rename_map=rename_map, features=features, state_names=state_names, pad_cameras=pad_cameras,
               chunk_length=chunk_length, rtc_execution_horizon=rtc_execution_horizon)
    defaulted = [what for what, given in (('state_names', state_names), ('action_names', action_names)) if not given]
    if defaulted:   # config.json names no joints: the robot must send these exact names, or every request fails
        log.warning('config.yaml %s empty: the contract names them %s; a robot must send exactly these names '
                    '(set them to the robot\'s joints in the training dataset\'s order, its meta/info.json '
                    'features.observation.state.names / action.names)', ' and '.join(defaulted) + (' are' if
                    len(defaulted) > 1 else ' is'), ' and '.join(
                        f'{"state" if w == "state_names" else "action"}_0 ..' for w in defaulted))
    action_names = list(action_names or [f'action_{i}' for i in range(how.action_dim)])
    if len(action_names) != how.action_dim:
        raise ConfigError(f'the checkpoint has action dim {how.action_dim}; config.yaml names '
                          f'{len(action_names)} action entries')
    space = ActionSpace.parse(action_space)
    if how.aggregate != 'latest_only' and not space.is_absolute:
        raise _refuse(how.policy_type, f'temporal_ensemble_coeff={how.temporal_ensemble_coeff}: temporal ensembling '
                                       f'averages absolute targets, and action_space is {space.value}')
    specs = tuple(CameraSpec(robot, width=how.sizes[ckpt][0], height=how.sizes[ckpt][1])
                  for robot, ckpt in how.cameras.items())
    return dataclasses.replace(contract, action_space=space, action_names=tuple(action_names),
                               dt=1.0 / float(fps), chunk_length=how.steps, aggregate=how.aggregate,
                               temporal_ensemble_coeff=how.temporal_ensemble_coeff,
                               observation=ObservationContract(cameras=specs, state_names=how.state_names,
                                                               history=how.history, padded_cameras=how.padded))
