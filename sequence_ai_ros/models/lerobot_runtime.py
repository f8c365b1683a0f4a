"""Load a LeRobot policy checkpoint from a local directory and turn observations into action chunks.

Shared by the ``lerobot`` and ``pi05-droid`` templates, whose policy.py imports it from the installed
package (``from sequence_ai_ros.models import lerobot_runtime``). What a checkpoint needs and whether it
can be served at all is decided from its files in :mod:`.lerobot_checkpoint` (no torch).

Loading follows LeRobot 0.6's own path (``lerobot/policies/factory.py``, the processor pipeline since 0.4):
``get_policy_class(type).from_pretrained(dir, config=...)`` and
``make_pre_post_processors(config, pretrained_path=dir)`` for the normalisation and tokenizer pipelines
saved beside the weights. Inference mirrors ``lerobot.common.control_utils.predict_action``: images become
float (1, 3, H, W) in [0, 1] (``prepare_observation_for_inference``), the state (1, D), the instruction goes
in ``task`` and the robot's type in ``robot_type``; then the preprocessor, ``predict_action_chunk``
(1, T, D) and the postprocessor (unnormalise). Diffusion gets its ``n_obs_steps`` frames stacked on a time
axis, (1, N, D) and (1, N, 3, H, W), exactly as LeRobot's training batches carry them.

Nothing is downloaded: ``HF_HUB_OFFLINE``, ``HF_DATASETS_OFFLINE`` and ``TRANSFORMERS_OFFLINE`` are set
before lerobot is imported, ``pretrained_backbone_weights`` (ImageNet weights from torchvision's server)
is cleared (the checkpoint's own weights replace them anyway), and backbone processors/tokenizers come
from ``hub_cache`` or ``hub_snapshots`` (see :mod:`.lerobot_checkpoint`).

Every tensor carries a leading batch axis of 1 per episode, so requests of several episodes are stacked on
that axis (:meth:`LeRobotRunner.frames_batch` per episode, then :meth:`LeRobotRunner.forward_many`): the
``lerobot`` template's ``infer_batch`` serves several robots in one ``predict_action_chunk`` call.

torch and lerobot are heavy (GBs, CUDA wheels); they live in the worker's own environment, never in the
ROS venv. Everything here checks for them with :func:`importlib.util.find_spec` (no import) and raises
:class:`MissingDependency` naming exactly what is missing.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from sequence_ai_ros.exceptions import ContractViolation, MissingDependency, PolicyException
from sequence_ai_ros.models.lerobot_checkpoint import (
    FLOW_MATCHING,
    IMAGE_PREFIX,
    STATE_KEY,
    ServingPlan,
    contract_for,
    hub_needs,
    hub_overrides,
    locate,
    missing_hub_files,
    plan,
    read_config,
    resolve,
)
from sequence_ai_ros.protocol.types import ImageLike

__all__ = ['IMAGE_PREFIX', 'STATE_KEY', 'LeRobotRunner', 'Raw', 'contract_for', 'missing', 'read_config', 'require',
           'resolve']

MIN_LEROBOT = (0, 4)
WEIGHTS = ('config.json', 'model.safetensors')
OFFLINE = {'HF_HUB_OFFLINE': '1', 'HF_DATASETS_OFFLINE': '1', 'TRANSFORMERS_OFFLINE': '1'}
LEROBOT_HINT = 'pip install -r requirements-lerobot.txt (LeRobot 0.6.x, Python >= 3.12)'
#: RTC's leftover in robot units (a relative-action policy re-anchors it on the new state after preprocessing)
LEFT_OVER_ABSOLUTE = 'prev_chunk_left_over_absolute'
#: how close the robot's chunk_tail must be to the served rows (robot units) for RTC to guide from them:
#: np.allclose's rtol and atol both
TAIL_TOLERANCE = 1e-4
log = logging.getLogger(__name__)


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
    # installed distributions, not bare import names (a folder named lerobot/ on sys.path is not LeRobot)
    if importlib.util.find_spec('torch') is None or _version('torch') is None:
        out.append(f'python package torch (in the worker\'s own venv, not the ROS venv: {LEROBOT_HINT})')
    found = _version('lerobot') if importlib.util.find_spec('lerobot') is not None else None
    if found is None:
        out.append(f'python package lerobot>=0.4 ({LEROBOT_HINT})')
    else:
        if found[:2] < MIN_LEROBOT:
            out.append(f'lerobot>=0.4 (found {".".join(map(str, found))}; {LEROBOT_HINT})')
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


def go_offline() -> None:
    """Switch every Hugging Face download path off for this process (before lerobot is imported)."""
    os.environ.update(OFFLINE)
    try:
        import huggingface_hub.constants as hub_constants
    except ImportError:
        return
    hub_constants.HF_HUB_OFFLINE = True


def use_hub_cache(hub_cache: Path) -> None:
    """Make ``hub_cache`` the Hugging Face hub cache of this process, imported or not.

    ``huggingface_hub`` reads ``HF_HUB_CACHE`` once, when first imported; where it already is (the worker
    may have imported it), its constants are set too. Loading does not rely on it: every backbone repo is
    given to LeRobot as its local directory (:meth:`LeRobotRunner.load`).
    """
    os.environ['HF_HUB_CACHE'] = str(hub_cache)
    constants = sys.modules.get('huggingface_hub.constants')
    if constants is not None:
        vars(constants)['HF_HUB_CACHE'] = str(hub_cache)     # the module's own global, as it set it


def default_hub_cache() -> Path:
    """The Hugging Face hub cache huggingface_hub itself would read: $HF_HUB_CACHE, else $HF_HOME/hub."""
    if os.environ.get('HF_HUB_CACHE'):
        return Path(os.environ['HF_HUB_CACHE']).expanduser()
    return Path(os.environ.get('HF_HOME', '~/.cache/huggingface')).expanduser() / 'hub'


@dataclasses.dataclass
class Raw:
    """One chunk as the model produced it, kept per episode for RTC.

    :param model: float32 (H, D') the model-space rows (before the postprocessor), H = the model's horizon.
    :param served: the number of rows served as the chunk (T).
    :param actions: float32 (H, D) the same rows in robot units (after the postprocessor), or None.
    """

    model: np.ndarray
    served: int
    actions: np.ndarray | None = None


def _stack_key(batch: dict[str, Any], kwargs: dict[str, Any]) -> tuple:
    """What two episodes' requests must share to go in one call: tensor shapes and the other arguments."""
    def part(d: dict[str, Any], skip: tuple[str, ...] = ()) -> tuple:
        return tuple(sorted((key, tuple(v.shape) if hasattr(v, 'shape') else repr(v)) for key, v in d.items()
                            if key not in skip))
    return part(batch, skip=('task',)), part(kwargs)


class LeRobotRunner:
    """A loaded LeRobot policy and its pre/post-processors.

    :param checkpoint: local directory with config.json, model.safetensors and the processor files.
    :param device: torch device, e.g. ``cuda`` or ``cpu``.
    :param template: the template's name, for error messages.
    :param robot_type: LeRobot's ``robot_type`` passed in every batch (the dataset's ``meta/info.json``).
    :param hub_cache: local Hugging Face hub cache for backbone processors/tokenizers; None = the default one
        (:func:`default_hub_cache`).
    :param hub_snapshots: repo id -> local snapshot directory.
    :param serving: :func:`~.lerobot_checkpoint.plan`'s config.yaml entries (rename_map, features,
        state_names, pad_cameras, chunk_length).
    :param rtc_execution_horizon: RTC's execution horizon for every request; None = min(chunk_size,
        max(the checkpoint's ``rtc_config.execution_horizon``, the request's expected delay)).
    :param action_names: the robot's action names, for a relative-action step that saved none (its
        ``exclude_joints`` match them, as LeRobot's rollout does).
    """

    def __init__(self, checkpoint: Path, device: str, template: str, *, robot_type: str = '',
                 hub_cache: Path | None = None, hub_snapshots: dict[str, Path] | None = None,
                 rtc_execution_horizon: int | None = None, action_names: Sequence[str] | None = None,
                 **serving: Any) -> None:
        self.checkpoint = checkpoint
        self.device = device
        self.template = template
        self.robot_type = robot_type
        if hub_cache is not None:   # before anything imports huggingface_hub
            use_hub_cache(hub_cache)
        self.hub_cache = hub_cache or default_hub_cache()
        self.hub_snapshots = dict(hub_snapshots or {})
        self.cfg = read_config(checkpoint) if (checkpoint / 'config.json').is_file() else {}
        self.plan: ServingPlan | None = (plan(self.cfg, rtc_execution_horizon=rtc_execution_horizon, **serving)
                                         if self.cfg else None)
        self.rtc_execution_horizon = rtc_execution_horizon
        self.action_names = list(action_names) if action_names else None
        self._delay_logged = False
        self._mismatch_logged = False
        #: set by the caller for seq deploy's dry run (its synthetic requests are worded as such in the logs)
        self.dry_run = False
        self.policy: Any = None
        self.pre: Any = None
        self.post: Any = None
        self.torch: Any = None
        self.relative: Any = None     # the enabled RelativeActionsProcessorStep (pi0.5 relative actions)
        self.normalizer: Any = None   # the preprocessor's NormalizerProcessorStep, for re-anchoring

    def check_hub_files(self) -> None:
        """Raise :class:`MissingDependency` naming each backbone file that is not local, and how to place it."""
        gone = missing_hub_files(hub_needs(self.checkpoint, self.cfg), self.hub_cache, self.hub_snapshots)
        if gone:
            raise MissingDependency(f'the {self.template} template cannot load {self.cfg.get("type")!r} offline: '
                                    + '; '.join(gone))

    def load(self) -> None:
        """Import torch and lerobot, load the weights onto the device (slow; not billed).

        :raises MissingDependency: for a missing package, file, backbone file, or CUDA when ``device`` is cuda.
        """
        require(self.checkpoint, self.template)
        self.check_hub_files()
        use_hub_cache(self.hub_cache)
        go_offline()
        import torch
        from lerobot.configs.policies import PreTrainedConfig
        from lerobot.policies.factory import get_policy_class, make_pre_post_processors
        from lerobot.processor import NormalizerProcessorStep, RelativeActionsProcessorStep

        if self.device.startswith('cuda') and not torch.cuda.is_available():
            raise MissingDependency(f'the {self.template} template needs a CUDA GPU (device {self.device!r}); '
                                    'torch.cuda.is_available() is False: set `device: cpu` in config.yaml to run '
                                    'on this machine\'s CPU (or `device: mps` on Apple silicon)')
        config = PreTrainedConfig.from_pretrained(str(self.checkpoint), local_files_only=True)
        if hasattr(config, 'pretrained_backbone_weights'):
            config.pretrained_backbone_weights = None   # ImageNet init is replaced by model.safetensors
        # every backbone repo goes to LeRobot as its local directory: nothing resolves a repo id on the Hub
        local = {need.repo_id: found for need in hub_needs(self.checkpoint, self.cfg)
                 if (found := locate(need, self.hub_cache, self.hub_snapshots)[0]) is not None}
        overrides: dict[str, dict] = {**hub_overrides(self.checkpoint, local),
                                      'device_processor': {'device': self.device}}
        if getattr(config, 'vlm_model_name', None) in local:
            config.vlm_model_name = str(local[config.vlm_model_name])
        config.device = self.device
        policy = get_policy_class(self.cfg['type']).from_pretrained(str(self.checkpoint), config=config,
                                                                   local_files_only=True)
        policy.to(self.device)
        policy.eval()
        self.pre, self.post = make_pre_post_processors(policy.config, pretrained_path=str(self.checkpoint),
                                                       preprocessor_overrides=overrides)
        self.relative = next((s for s in self.pre.steps if isinstance(s, RelativeActionsProcessorStep) and s.enabled),
                             None)
        self.normalizer = next((s for s in self.pre.steps if isinstance(s, NormalizerProcessorStep)), None)
        if self.relative is not None and self.relative.action_names is None:   # as LeRobot's rollout fills them
            self.relative.action_names = getattr(policy.config, 'action_feature_names', None) or self.action_names
        self.policy, self.torch = policy, torch

    def frames_batch(self, frames: Sequence[tuple[np.ndarray, Mapping[str, ImageLike]]], task: str) -> dict[str, Any]:
        """Return one episode's raw batch (before the preprocessor), leading batch axis 1.

        :param frames: (state float32 (D,), images per robot camera uint8 (H, W, 3)) oldest first; one frame,
            or exactly the plan's history N (diffusion's n_obs_steps). Images are arrays, as the worker
            decodes them before a policy sees them (an observation's type also admits encoded bytes).
        :returns: each state feature of the plan (``observation.state``, ``observation.environment_state``...:
            its joints of the state vector) (1, D) or (1, N, D); each checkpoint camera fed by a robot camera
            (1, 3, H, W) or (1, N, 3, H, W) float32 in [0, 1] (padded ones are left out: the model pads them,
            as in LeRobot); ``task``; ``robot_type``.
        :raises PolicyException: when fewer real frames than the history N arrive (none are invented).
        """
        torch = self.torch
        need = self.plan.history if self.plan else 1
        if len(frames) != need:
            raise PolicyException(f'{self.cfg.get("type")} with n_obs_steps={need} needs {need} real observation '
                                  f'frames per request, got {len(frames)} (no frame is repeated in their place)')
        cams = self.plan.cameras if self.plan else {k: IMAGE_PREFIX + k for k in frames[-1][1]}
        batch: dict[str, Any] = {}
        for key, idx in (self.plan.state_index if self.plan else {STATE_KEY: None}).items():
            # a copy (np.array with fancy indexing or not): wire arrays are read-only
            states = [torch.from_numpy(np.array(np.asarray(s)[list(idx)] if idx is not None else s, np.float32))
                      for s, _ in frames]
            batch[key] = torch.stack(states)[None] if need > 1 else states[0][None]
        for robot_key, ckpt_key in cams.items():
            imgs = [torch.from_numpy(np.array(images[robot_key], np.uint8)).permute(2, 0, 1).float() / 255.0
                    for _, images in frames]
            batch[ckpt_key] = torch.stack(imgs)[None] if need > 1 else imgs[0][None]
        batch['task'] = task
        batch['robot_type'] = self.robot_type
        return batch

    def noise(self, seed: int) -> Any:
        """Return a chunk's initial noise, drawn from ``torch.Generator().manual_seed(seed)``.

        :returns: float32 (1, horizon, D) for diffusion; (1, chunk_size, max_action_dim) for the
            flow-matching policies (SmolVLA, pi0, pi0.5 sample their noise at that padded size).
        :raises PolicyException: for a checkpoint without config.json (no shape to draw).
        """
        plan = self.plan
        if plan is None:
            raise PolicyException(f'{self.checkpoint}: no config.json, so no noise shape')
        torch = self.torch
        gen = torch.Generator().manual_seed(int(seed))
        shape = (1, plan.horizon, plan.action_dim)
        if plan.policy_type in FLOW_MATCHING:
            shape = (1, int(self.cfg.get('chunk_size') or plan.horizon),
                     int(self.cfg.get('max_action_dim') or plan.action_dim))
        return torch.randn(shape, generator=gen, dtype=torch.float32).to(self.device)

    def forward(self, batch: dict[str, Any], **kwargs: Any) -> tuple[np.ndarray, np.ndarray]:
        """Run preprocessor -> ``predict_action_chunk(batch, **kwargs)`` -> postprocessor.

        :param kwargs: e.g. ``noise=`` or RTC's ``inference_delay``, ``prev_chunk_left_over``,
            ``execution_horizon`` (flow-matching policies); ``prev_chunk_left_over_absolute`` (B, K, D) in robot
            units is re-anchored on this request's state for a relative-action policy (LeRobot's
            ``reanchor_relative_rtc_prefix``) and passed as ``prev_chunk_left_over``.
        :returns: (model-space float32 (B, H, D'), robot-unit float32 (B, H, D)).
        """
        torch = self.torch
        kwargs = dict(kwargs)
        absolute = kwargs.pop(LEFT_OVER_ABSOLUTE, None)
        # RTC's guidance takes a gradient inside predict_action_chunk (under torch.enable_grad), which tensors
        # made under inference_mode refuse: RTC checkpoints run under no_grad, the others as before
        rtc = self.plan is not None and self.plan.rtc_horizon is not None
        with torch.no_grad() if rtc else torch.inference_mode():
            pre = self.pre(batch)
            if absolute is not None:
                kwargs['prev_chunk_left_over'] = self._reanchor(absolute)
            raw = self.policy.predict_action_chunk(pre, **kwargs)
            actions = self.post(raw)
        return (raw.detach().float().cpu().numpy(), actions.detach().float().cpu().numpy())

    def _reanchor(self, absolute: Any) -> Any:
        """Robot-unit leftover rows (B, K, D) -> model space relative to the state the preprocessor just saw."""
        from lerobot.policies.rtc import reanchor_relative_rtc_prefix

        state = self.relative.get_cached_state()
        return reanchor_relative_rtc_prefix(prev_actions_absolute=absolute, current_state=state,
                                            relative_step=self.relative, normalizer_step=self.normalizer,
                                            policy_device=self.device)

    def forward_many(self, batches: Sequence[dict[str, Any]],
                     kwargs: Sequence[dict[str, Any]]) -> list[tuple[np.ndarray, np.ndarray]]:
        """Run :meth:`forward` for several episodes, stacking on the batch axis those that can share a call.

        Requests share one call when their tensors have the same shapes and their non-tensor arguments are
        equal (RTC's ``inference_delay`` and ``execution_horizon``); others get calls of their own, in order.
        Each episode's tensors keep their leading axis of 1, so row ``i`` of a call is exactly episode ``i``'s
        (``task`` becomes a list of the episodes' instructions, as LeRobot's batched ``task``).

        :param batches: one raw batch per episode from :meth:`frames_batch`.
        :param kwargs: one ``forward`` kwargs dict per episode (``noise`` (1, H, D), RTC's arguments).
        :returns: one (model-space float32 (H, D'), robot-unit float32 (H, D)) per episode, in order.
        """
        torch = self.torch
        groups: dict[tuple, list[int]] = {}
        for i, (batch, kw) in enumerate(zip(batches, kwargs, strict=True)):
            groups.setdefault(_stack_key(batch, kw), []).append(i)
        out: list[Any] = [None] * len(batches)
        for members in groups.values():
            first = batches[members[0]]
            joint = {key: (torch.cat([batches[i][key] for i in members]) if torch.is_tensor(value) else value)
                     for key, value in first.items()}
            joint['task'] = [batches[i]['task'] for i in members]
            kw0 = kwargs[members[0]]
            joint_kw = {key: (torch.cat([kwargs[i][key] for i in members]) if torch.is_tensor(value) else value)
                        for key, value in kw0.items()}
            model, actions = self.forward(joint, **joint_kw)
            for row, i in enumerate(members):
                out[i] = (model[row], actions[row])
        return out

    def rtc_kwargs(self, previous: Raw | None, tail: np.ndarray | int, delay: int) -> dict[str, Any]:
        """RTC's arguments from the episode's previous raw chunk, indexed by the tail's position.

        The robot's ``chunk_tail`` holds the K not-yet-executed rows of the last served chunk (robot units);
        the same rows in model space are ``previous.model[served - K : served]`` (LeRobot 0.6 ``RTCProcessor``
        wants model space). A relative-action policy gets them in robot units instead (``previous.actions``), to
        be re-anchored on the new state as LeRobot's RTC rollout does (:meth:`forward`).

        LeRobot guides the new chunk towards the actions its queue still holds, i.e. what the robot runs. The
        worker holds the model-space rows only of what it served, so it guides only when the robot's tail is
        those rows (equal to the stored robot-unit rows within :data:`TAIL_TOLERANCE`); a tail that differs (the
        robot smoothed, re-timed or replaced them) gets no guidance, logged once, rather than an in-painting
        towards rows the robot does not run.

        The execution horizon (the rows guidance reaches) is :attr:`rtc_execution_horizon` when set, else
        min(chunk_size, max(the checkpoint's value, ``delay``)): rows the robot runs before the new chunk is
        read are always guided. The first request whose delay exceeds the checkpoint's value is logged.

        :param tail: float32 (K, D) the robot's ``chunk_tail`` in robot units (or its row count K alone, which
            skips the value check).
        :raises ContractViolation: for a tail with more rows than the last served chunk (K > served: rows the
            robot already ran would be in-painted, a jump backwards).
        """
        if self.plan is None or self.plan.rtc_horizon is None:
            return {}
        delay, own = int(delay), self.plan.rtc_horizon
        horizon = self.rtc_execution_horizon or min(self.plan.horizon, max(own, delay))
        if delay > own and not self._delay_logged:
            self._delay_logged = True
            log.warning('%s: %s expects %d actions to run before a chunk arrives, more than the checkpoint\'s '
                        'rtc_config.execution_horizon %d; RTC guides %d rows (%s)', self.template,
                        'seq deploy\'s dry run (a synthetic request, no robot)' if self.dry_run else 'the robot',
                        delay, own, horizon, 'rtc_execution_horizon in config.yaml' if self.rtc_execution_horizon
                        else f'min(chunk_size {self.plan.horizon}, the delay)')
        kwargs: dict[str, Any] = {'inference_delay': delay, 'execution_horizon': int(horizon)}
        rows = tail if isinstance(tail, (int, np.integer)) else len(tail)
        if previous is None or rows <= 0:
            return kwargs
        if rows > previous.served:
            raise ContractViolation(f'chunk_tail has {rows} rows, more than the {previous.served} of the last served '
                                    'chunk: it can hold only that chunk\'s unexecuted rows')
        start = previous.served - int(rows)
        if not isinstance(tail, (int, np.integer)) and previous.actions is not None:
            stored = previous.actions[start:previous.served]
            if stored.shape != np.shape(tail) or not np.allclose(stored, tail, rtol=TAIL_TOLERANCE,
                                                                  atol=TAIL_TOLERANCE):
                if not self._mismatch_logged:
                    self._mismatch_logged = True
                    gap = (float(np.abs(stored - tail).max()) if stored.shape == np.shape(tail) else float('nan'))
                    log.warning('%s: the robot\'s chunk_tail (%d rows) is not the last served chunk\'s rows (max '
                                'difference %.3g in robot units); RTC guidance is skipped for such requests (it '
                                'would in-paint rows the robot does not run)', self.template, rows, gap)
                return kwargs
        if self.relative is not None and previous.actions is not None:
            kwargs[LEFT_OVER_ABSOLUTE] = self.torch.from_numpy(
                np.ascontiguousarray(previous.actions[start:previous.served]))[None]
        else:
            kwargs['prev_chunk_left_over'] = self.torch.from_numpy(
                np.ascontiguousarray(previous.model[start:previous.served]))[None].to(self.device)
        return kwargs

    def chunk(self, state: np.ndarray, images: Mapping[str, ImageLike], task: str, steps: int) -> np.ndarray:
        """Return float32 (steps, D): the first ``steps`` actions of the policy's chunk for one frame."""
        _, actions = self.forward(self.frames_batch([(state, images)], task))
        return actions.reshape(-1, actions.shape[-1])[:steps].astype(np.float32)
