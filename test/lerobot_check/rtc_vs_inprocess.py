"""A served flow-matching policy, RTC on and off, against LeRobot's in-process ``predict_action_chunk``.

Run by ``make check-lerobot`` with the LeRobot venv's python, beside a running ``seq serve`` of two
deployments of one checkpoint (its ``rtc_config.enabled`` true, and a copy with it false), both with
``noise_seed: S``::

    rtc_vs_inprocess.py --endpoint HOST:PORT --rtc NAME --plain NAME --checkpoint DIR --dataset V21 \
        --noise-seed S --out result.json

One episode stream per deployment sends ``--requests`` frames of the held-out episode (PNG, lossless). From
the second request on, each carries the unexecuted rows of the previous served chunk as ``chunk_tail`` (the
robot ran ``--executed`` of its rows) and an expected delay ``d`` (alternately ``--delays``; one above the
checkpoint's ``execution_horizon``). The same frames go through LeRobot 0.6's own path here (Hugging Face
cache from ``HF_HUB_CACHE``, offline): ``prepare_observation_for_inference``, the saved preprocessor,
``predict_action_chunk(batch, noise=randn(Generator().manual_seed(S + k)))`` and, for RTC, LeRobot's own
arguments built from this process's previous chunk: ``inference_delay=d``, ``prev_chunk_left_over`` = its
raw model-space rows from the tail's position, ``execution_horizon = min(chunk_size, max(the checkpoint's,
d))``; then the postprocessor.

Reported: the max abs difference served vs in-process for each deployment, and the seam gap of every
request with a tail, ``max |chunk[:d] - chunk_tail[:d]|`` (robot units): how far the new chunk strays from
the rows the robot runs while it is computed. RTC in-paints them; without RTC they are whatever the model
draws. With ``--relative``, a third deployment of a checkpoint whose pipeline has LeRobot's
relative-action steps (pi0.5's ``use_relative_actions``) is compared the same way, its in-process leftover
re-anchored on each new state as LeRobot's RTC rollout does. ``row_step_max`` is the largest step between
two rows of one chunk, the scale a seam jump of the closed loop compares with.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from served_vs_inprocess import Stream  # noqa: E402

from sequence_ai_ros.datasets.lerobot_reader import LeRobotDataset  # noqa: E402
from sequence_ai_ros.protocol import codec  # noqa: E402
from sequence_ai_ros.protocol.types import Observation  # noqa: E402


class Local:
    """LeRobot 0.6's own inference on the checkpoint (no sequence_ai_ros code on this path)."""

    def __init__(self, checkpoint: Path, robot_type: str, rtc: bool) -> None:
        import torch
        from lerobot.configs.policies import PreTrainedConfig
        from lerobot.policies.factory import get_policy_class, make_pre_post_processors

        cfg = PreTrainedConfig.from_pretrained(str(checkpoint), local_files_only=True)
        cfg.device = 'cpu'
        if not rtc:
            cfg.rtc_config.enabled = False
        self.policy = get_policy_class(cfg.type).from_pretrained(str(checkpoint), config=cfg, local_files_only=True)
        self.policy.eval()
        self.pre, self.post = make_pre_post_processors(self.policy.config, pretrained_path=str(checkpoint),
                                                       preprocessor_overrides={'device_processor': {'device': 'cpu'}})
        self.torch, self.cfg, self.robot_type, self.rtc = torch, cfg, robot_type, rtc
        from lerobot.processor import NormalizerProcessorStep, RelativeActionsProcessorStep

        self.relative = next((s for s in self.pre.steps if isinstance(s, RelativeActionsProcessorStep) and s.enabled),
                             None)
        self.normalizer = next((s for s in self.pre.steps if isinstance(s, NormalizerProcessorStep)), None)

    def chunk(self, state: np.ndarray, images: dict[str, np.ndarray], task: str, seed: int,
              left_over=None, left_over_absolute: np.ndarray | None = None,
              delay: int = 0) -> tuple[object, np.ndarray]:
        """Return (raw model-space (1, H, D) tensor, robot-unit float32 (H, D)).

        A relative-action pipeline gets its leftover as LeRobot's RTC rollout builds it: the previous
        chunk's robot-unit rows re-anchored on this request's state (``reanchor_relative_rtc_prefix``).
        """
        torch = self.torch
        from lerobot.policies.utils import prepare_observation_for_inference

        obs = {'observation.state': np.asarray(state, np.float32)}
        obs.update({f'observation.images.{k}': v for k, v in images.items()})
        batch = prepare_observation_for_inference(obs, torch.device('cpu'), task, self.robot_type)
        noise = torch.randn((1, self.cfg.chunk_size, self.cfg.max_action_dim),
                            generator=torch.Generator().manual_seed(int(seed)))
        kwargs = {}
        if self.rtc and left_over is not None:
            own = self.cfg.rtc_config.execution_horizon
            kwargs = {'inference_delay': delay, 'prev_chunk_left_over': left_over,
                      'execution_horizon': min(self.cfg.chunk_size, max(own, delay))}
        with torch.no_grad():   # RTC's guidance takes a gradient inside (torch.enable_grad)
            pre = self.pre(batch)
            if kwargs and self.relative is not None:
                from lerobot.policies.rtc import reanchor_relative_rtc_prefix

                kwargs['prev_chunk_left_over'] = reanchor_relative_rtc_prefix(
                    prev_actions_absolute=torch.from_numpy(left_over_absolute)[None],
                    current_state=self.relative.get_cached_state(), relative_step=self.relative,
                    normalizer_step=self.normalizer, policy_device='cpu')
            raw = self.policy.predict_action_chunk(pre, noise=noise, **kwargs)
            actions = self.post(raw)
        return raw, actions[0].float().numpy()


def episode_run(args: argparse.Namespace, name: str, local: Local, frames: list[tuple[np.ndarray, dict]],
                task: str, fps: float) -> dict:
    """One episode stream on ``name``; every chunk against ``local``'s; the seam gap of each request."""
    stream = Stream(args.endpoint, name, task)
    names = stream.contract.observation.state_names
    steps = stream.contract.chunk_length
    diffs, gaps, delays, steps_in_chunk = [], [], [], []
    served_prev, raw_prev, mine_prev = None, None, None
    try:
        for k, (state, images) in enumerate(frames):
            png = {key: codec.encode_image(key, v, 'png').data for key, v in images.items()}
            obs = Observation(state=state, images=png, state_names=names, instruction=task, timestamp=k / fps)
            tail, delay, left, left_absolute = None, 0, None, None
            if served_prev is not None:
                tail = served_prev[args.executed:]
                delay = args.delays[(k - 1) % len(args.delays)]
                left = raw_prev[:, args.executed:steps]   # the tail's rows, model space (raw rows 0..T-1)
                left_absolute = np.ascontiguousarray(mine_prev[args.executed:steps])   # the same, robot units
            served, _, _ = stream.request([obs], chunk_tail=tail, delay=delay)
            raw, mine = local.chunk(state, images, task, args.noise_seed + k, left, left_absolute, delay)
            diffs.append(float(np.abs(served - mine[:steps]).max()))
            steps_in_chunk.append(float(np.abs(np.diff(served, axis=0)).max()))
            if tail is not None:
                gaps.append(float(np.abs(served[:delay] - tail[:delay]).max()))
                delays.append(delay)
            served_prev, raw_prev, mine_prev = served, raw, mine
    finally:
        stream.close()
    return {'max_abs_diff': max(diffs), 'requests': len(diffs), 'seam_gaps': gaps, 'delays': delays,
            'seam_gap_max': max(gaps), 'seam_gap_mean': float(np.mean(gaps)),
            'row_step_max': max(steps_in_chunk)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--endpoint', required=True)
    parser.add_argument('--rtc', required=True, help='the deployment with rtc_config.enabled')
    parser.add_argument('--plain', required=True, help='the same checkpoint with RTC off')
    parser.add_argument('--relative', default='', help='a deployment of --relative-checkpoint (RTC on)')
    parser.add_argument('--relative-checkpoint', type=Path, help='the checkpoint with relative actions')
    parser.add_argument('--checkpoint', type=Path, required=True)
    parser.add_argument('--dataset', type=Path, required=True)
    parser.add_argument('--episode', type=int, default=5)
    parser.add_argument('--noise-seed', type=int, default=0)
    parser.add_argument('--robot-type', default='')
    parser.add_argument('--requests', type=int, default=6)
    parser.add_argument('--executed', type=int, default=20, help='rows of a chunk run before the next request')
    parser.add_argument('--delays', type=lambda s: [int(x) for x in s.split(',')], default=[5, 27])
    parser.add_argument('--out', type=Path, required=True)
    args = parser.parse_args()
    os.environ.setdefault('HF_HUB_OFFLINE', '1')

    ds = LeRobotDataset(args.dataset)
    ep = ds.episode(args.episode)
    task = ds.task(args.episode)
    cams = {key.removeprefix('observation.images.'): list(ds.frames(args.episode, key)) for key in ds.camera_keys}
    at = np.linspace(0, len(ep) - 1, args.requests).astype(int)
    frames = [(ep.state[t], {k: v[t] for k, v in cams.items()}) for t in at]
    result = {}
    runs = [('rtc', args.rtc, args.checkpoint), ('plain', args.plain, args.checkpoint)]
    if args.relative:
        runs.append(('relative', args.relative, args.relative_checkpoint))
    for mode, name, checkpoint in runs:
        local = Local(checkpoint, args.robot_type, rtc=mode != 'plain')
        result[mode] = episode_run(args, name, local, frames, task, ds.fps)
    result['seam_ratio'] = result['rtc']['seam_gap_max'] / max(result['plain']['seam_gap_max'], 1e-12)
    result['params'] = sum(p.numel() for p in local.policy.parameters())
    args.out.write_text(json.dumps(result, indent=2) + '\n')
    print(json.dumps(result))
    return 0


if __name__ == '__main__':
    raise SystemExit(main())
