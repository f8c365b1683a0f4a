"""Field data into LeRobot 0.6: export a deployment's captured episodes as v3.0, load them, train on them.

Run by ``make check-lerobot`` with the LeRobot venv's python (sequence_ai_ros pip-installed there), after
its closed loop ran with capture on::

    python test/lerobot_check/check_field_data.py --home SEQ_HOME_DIR --deployment NAME

1. ``seq policy data export NAME --lerobot-version 3.0`` (the product's own command, as a user runs it);
2. ``LeRobotDataset(repo_id, root=dir, video_backend="pyav")`` under ``HF_HUB_OFFLINE=1`` loads it with no
   conversion; every frame of every camera is decoded and its row checked (finite, shapes, k/fps);
3. ``lerobot-train`` runs a few ACT steps on it, offline, with no pretrained backbone and no hub push.

Exit status 0 when all three hold; the failing step is printed otherwise.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _seq() -> list[str]:
    """The ``seq`` of this venv (coreutils also has a ``seq``: never take that one)."""
    here = Path(sys.executable).parent / 'seq'
    return [str(here)] if here.exists() else [sys.executable, '-m', 'sequence_ai_ros.cli']


def export(home: Path, deployment: str, out: Path) -> None:
    env = {**os.environ, 'SEQ_HOME': str(home)}
    cmd = [*_seq(), 'policy', 'data', 'export', deployment, '--out', str(out), '--lerobot-version', '3.0',
           '--vcodec', 'h264', '--force']
    print('check_field_data: $', ' '.join(cmd[-10:]), flush=True)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    print(proc.stdout.strip())
    if proc.returncode not in (0, 3):   # 3: written, some episodes skipped (listed above)
        raise SystemExit(f'check_field_data: export failed ({proc.returncode}): {proc.stderr.strip()}')


def load_and_decode(root: Path) -> tuple[int, int, list[str]]:
    """Load with LeRobot 0.6 offline and read every item (decoding every video frame); return counts."""
    import numpy as np
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    ds = LeRobotDataset('local/field_data', root=root, video_backend='pyav')
    cams = list(ds.meta.camera_keys)
    if not cams:
        raise SystemExit('check_field_data: the export has no camera video (capture ran with --images?)')
    fps = ds.fps
    for i in range(len(ds)):
        item = ds[i]
        for key in ('observation.state', 'action'):
            if not np.isfinite(item[key].numpy()).all():
                raise SystemExit(f'check_field_data: row {i} {key} is not finite')
        if abs(float(item['timestamp']) - int(item['frame_index']) / fps) > 1e-4:
            raise SystemExit(f'check_field_data: row {i} timestamp {float(item["timestamp"])} is not k/fps')
        for cam in cams:
            if tuple(item[cam].shape)[0] != 3:
                raise SystemExit(f'check_field_data: row {i} {cam} decoded as {tuple(item[cam].shape)}')
    for key in ('observation.state', 'action'):
        missing = {'q01', 'q99'} - set(ds.meta.stats[key])
        if missing:
            raise SystemExit(f'check_field_data: stats of {key} lack {sorted(missing)}')
    return ds.num_episodes, len(ds), cams


def train(root: Path, out: Path, steps: int) -> None:
    exe = Path(sys.executable).parent / 'lerobot-train'
    train_cmd = [str(exe)] if exe.exists() else [sys.executable, '-m', 'lerobot.scripts.lerobot_train']
    cmd = [*train_cmd, '--policy.type=act', '--policy.device=cpu',
           '--policy.push_to_hub=false', '--policy.pretrained_backbone_weights=null', '--policy.chunk_size=8',
           '--policy.n_action_steps=8', '--policy.dim_model=64', '--policy.dim_feedforward=128',
           '--policy.n_encoder_layers=1', '--batch_size=2', '--dataset.repo_id=local/field_data',
           f'--dataset.root={root}', '--dataset.video_backend=pyav', f'--output_dir={out}', '--job_name=field_data',
           f'--steps={steps}', '--num_workers=0', f'--save_freq={steps}', '--log_freq=1', '--wandb.enable=false',
           '--seed=1']
    print(f'check_field_data: lerobot-train ACT, {steps} steps', flush=True)
    proc = subprocess.run(cmd, env={**os.environ, 'HF_HUB_OFFLINE': '1'}, capture_output=True, text=True,
                          timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f'check_field_data: lerobot-train failed ({proc.returncode}):\n{proc.stderr[-3000:]}')
    if not any(out.rglob('model.safetensors')):
        raise SystemExit('check_field_data: lerobot-train wrote no checkpoint')


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--home', type=Path, required=True, help='the SEQ_HOME the closed loop ran in')
    parser.add_argument('--deployment', required=True, help='the deployment whose capture is checked')
    parser.add_argument('--steps', type=int, default=4, help='training steps (default 4)')
    parser.add_argument('--keep', type=Path, default=None, help='keep the export and the run here')
    args = parser.parse_args(argv)
    os.environ['HF_HUB_OFFLINE'] = '1'
    work = Path(tempfile.mkdtemp(prefix='check-field-data-')) if args.keep is None else args.keep
    work.mkdir(parents=True, exist_ok=True)
    t = time.monotonic()
    try:
        dataset = work / 'dataset_v30'
        export(args.home, args.deployment, dataset)
        episodes, frames, cams = load_and_decode(dataset)
        print(f'check_field_data: LeRobot 0.6 loaded {episodes} episodes, {frames} frames, decoded every frame of '
              f'{", ".join(cams)}', flush=True)
        train(dataset, work / 'train', args.steps)
        print(f'check_field_data: OK ({time.monotonic() - t:.0f} s): exported v3.0, loaded, decoded, trained')
        return 0
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == '__main__':
    sys.exit(main())
