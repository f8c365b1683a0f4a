"""The fine-tuning set of the field-data loop: the original demos plus the served episodes labelled successful.

Runs in the LeRobot venv and reads and writes with LeRobot's own ``LeRobotDataset`` API. The export
(``seq policy data export --format lerobot --lerobot-version 3.0``) carries the robot's contract:
``observation.state`` is every state joint the policy reads (``ee_x ee_y ee_z gripper obs_0 .. obs_38``) and
``action`` the command that reached the robot; the demos (demos.py) carry the checkpoint's features
(``observation.state`` = the four commanded coordinates, ``observation.environment_state`` = ``obs_*``).
Each successful episode's rows are mapped into the demos' features by joint name (never by position), so the
fine-tuned checkpoint reads exactly what the first one read.

Usage: ``python finetune_data.py --demos DIR --export DIR --root OUT``; prints one JSON line (episodes from
each source, frames, the export's labelled successes and failures).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from demos import FPS, features  # noqa: E402


def _names(meta, key: str) -> list[str]:
    names = meta.features[key]['names']
    return list(names[0] if names and isinstance(names[0], list) else names)


def main() -> int:
    import warnings

    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    warnings.filterwarnings('ignore', message=r'Constant\(s\) may be too high')
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--demos', type=Path, required=True, help='the demos (demos.py)')
    parser.add_argument('--export', type=Path, required=True, help='the labelled export (LeRobot v3.0)')
    parser.add_argument('--root', type=Path, required=True, help='the dataset to write (must not exist)')
    args = parser.parse_args()
    demos = LeRobotDataset('local/demos', root=args.demos)
    field = LeRobotDataset('local/field', root=args.export)
    feats = features()
    where = {name: i for i, name in enumerate(_names(field.meta, 'observation.state'))}
    act_where = {name: i for i, name in enumerate(_names(field.meta, 'action'))}
    take = {key: [where[n] for n in ft['names']] for key, ft in feats.items() if key != 'action'}
    take_action = [act_where[n] for n in feats['action']['names']]
    episodes = field.meta.episodes
    if 'success' not in episodes.column_names:
        raise SystemExit(f'the export at {args.export} has no labelled episode (no success column)')
    wins = [int(i) for i, ok in zip(episodes['episode_index'], episodes['success'], strict=True) if ok is True]
    out = LeRobotDataset.create(demos.meta.repo_id + '_field', FPS, feats, root=args.root,
                                robot_type=demos.meta.robot_type, use_videos=False)

    def copy(ds: LeRobotDataset, episode: int, state_of, action_of) -> int:
        lo, hi = (int(ds.meta.episodes[k][episode]) for k in ('dataset_from_index', 'dataset_to_index'))
        rows = ds.hf_dataset.select(range(lo, hi)).with_format('numpy')
        tasks = ds.meta.tasks
        task = str(tasks.index[tasks['task_index'] == int(rows[0]['task_index'])][0])
        for r in rows:
            out.add_frame({**state_of(np.asarray(r['observation.state'], np.float32), r),
                           'action': action_of(np.asarray(r['action'], np.float32)), 'task': task})
        out.save_episode()
        return hi - lo

    frames = 0
    for e in range(demos.meta.total_episodes):
        frames += copy(demos, e, lambda s, r: {'observation.state': s, 'observation.environment_state': np.asarray(
            r['observation.environment_state'], np.float32)}, lambda a: a)
    for e in wins:
        frames += copy(field, e, lambda s, r: {k: s[idx] for k, idx in take.items()}, lambda a: a[take_action])
    out.finalize()
    print(json.dumps({'demo_episodes': demos.meta.total_episodes, 'field_successes': len(wins),
                      'field_failures': int(len(episodes) - len(wins)), 'frames': frames}))
    return 0


if __name__ == '__main__':
    raise SystemExit(main())
