"""Load an export in LeRobot's own v2.1 loader and decode every frame: ``make check-export``.

Usage: ``python test/check_export_lerobot.py DIR`` in a separate venv with ``lerobot==0.3.3`` (torch is
large, so ``make test`` does not run this; it re-reads exports with the project's own reader instead).
Offline: ``HF_HUB_OFFLINE=1`` is set before LeRobot is imported, and the dataset is opened from ``root``.
Exits 0 when every episode loads and every video frame decodes at its timestamp (frame_index / fps,
LeRobot's tolerance 1e-4 s), 1 otherwise. It imports nothing from sequence_ai_ros.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    """Check the dataset at ``argv[0]`` (default ``out/export``); return the exit code."""
    os.environ['HF_HUB_OFFLINE'] = '1'
    os.environ.setdefault('HF_DATASETS_OFFLINE', '1')
    root = Path(argv[0] if argv else 'out/export').resolve()
    try:
        from lerobot.datasets.lerobot_dataset import LeRobotDataset
    except ImportError:  # lerobot < 0.3 kept datasets under lerobot.common
        from lerobot.common.datasets.lerobot_dataset import LeRobotDataset

    info = json.loads((root / 'meta' / 'info.json').read_text())
    ds = LeRobotDataset(f'local/{root.name}', root=root, video_backend='pyav')
    print(f'{root}: {ds.num_episodes} episodes, {ds.num_frames} frames at {ds.fps} fps, '
          f'cameras {ds.meta.video_keys}, codebase {info["codebase_version"]}')
    problems = []
    if ds.num_frames != info['total_frames'] or ds.num_episodes != info['total_episodes']:
        problems.append('LeRobot counts differ from info.json')
    for i in range(len(ds)):
        item = ds[i]
        for key in ds.meta.video_keys:
            frame = item[key]
            h, w, c = ds.meta.features[key]['shape']
            if tuple(frame.shape) != (c, h, w):
                problems.append(f'frame {i} {key}: shape {tuple(frame.shape)}, expected {(c, h, w)}')
        if i % 200 == 0:
            print(f'  decoded {i + 1}/{len(ds)}', flush=True)
    if 'next.success' in ds.features:
        ends = ds.episode_data_index['to'].tolist()
        for ep, end in enumerate(ends):
            last = bool(ds.hf_dataset[int(end) - 1]['next.success'])
            meta = ds.meta.episodes[ep]
            if 'success' in meta and last != bool(meta['success']):
                problems.append(f'episode {ep}: next.success on its last frame is {last}, label is {meta["success"]}')
    for p in problems:
        print(f'FAIL: {p}', file=sys.stderr)
    print('ok: loads in LeRobot and every frame decodes' if not problems else f'{len(problems)} problems')
    return 1 if problems else 0


if __name__ == '__main__':
    sys.exit(main(sys.argv[1:]))
