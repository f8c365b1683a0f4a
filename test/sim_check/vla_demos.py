"""Write Meta-World's scripted expert on drawer-open-v3 as a LeRobot v3.0 dataset for a VLA (make rtc-sim).

Runs in the LeRobot venv, with LeRobot's own ``LeRobotDataset`` API and demos.py's expert and episodes
(``train_tasks[i]`` for i in 0..N-1, until success and ``--after`` steps more, at the task's 80 Hz). The
features are the ones a SmolVLA reads: LeRobot's SmolVLA takes its state from ``observation.state`` alone (it
reads no ``observation.environment_state``) and refuses a batch without a real camera, so

- ``observation.state`` float32 (43,): ``SimTask.state()``, i.e. ``joint_states`` as ``sim_robot`` publishes it
  (``ee_x ee_y ee_z gripper`` measured, then ``obs_0 .. obs_38``);
- ``observation.image`` uint8 (N, N, 3): the ``corner`` camera (``SimTask.render``) on the state before the step;
- ``action`` float32 (4,): the absolute command the node sends.

Usage: ``python vla_demos.py --root DIR [--episodes 50] [--image 64]``; prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parents[1])]

from demos import CAMERA, FPS, INSTRUCTIONS, expert_class, expert_command, repo_id  # noqa: E402

from sequence_ai_ros.sim.task import COMMAND_NAMES, JOINT_NAMES, SimTask  # noqa: E402

TASK = 'drawer-open-v3'


def features(image: int) -> dict:
    """The dataset's features (LeRobot's feature dict): the 43 joint_states, one ``image`` px camera, the action."""
    return {'observation.state': {'dtype': 'float32', 'shape': (len(JOINT_NAMES),), 'names': list(JOINT_NAMES)},
            'observation.image': {'dtype': 'image', 'shape': (image, image, 3),
                                  'names': ['height', 'width', 'channels']},
            'action': {'dtype': 'float32', 'shape': (len(COMMAND_NAMES),), 'names': list(COMMAND_NAMES)}}


def main() -> int:
    import os
    import warnings

    os.environ.setdefault('MUJOCO_GL', 'egl')
    import metaworld.policies
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    warnings.filterwarnings('ignore', message=r'Constant\(s\) may be too high')
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--root', type=Path, required=True, help='the dataset folder (must not exist)')
    parser.add_argument('--episodes', type=int, default=50)
    parser.add_argument('--after', type=int, default=20, help='steps recorded after the first success')
    parser.add_argument('--image', type=int, default=64, help='camera size (px, square)')
    args = parser.parse_args()
    task = SimTask(TASK, benchmark_seed=0, max_steps=500)
    expert = getattr(metaworld.policies, expert_class(TASK))()
    ds = LeRobotDataset.create(f'{repo_id(TASK)}_vla{args.image}', FPS, features(args.image), root=args.root,
                               robot_type='metaworld_sawyer', use_videos=False)
    success_steps = []
    for index in range(args.episodes):
        task.reset('train', index)
        first = -1
        while not task.truncated and (first < 0 or task.steps < first + args.after):
            command = expert_command(task, expert)
            ds.add_frame({'observation.state': task.state().astype(np.float32),
                          'observation.image': task.render(CAMERA, args.image, args.image),
                          'action': command.astype(np.float32), 'task': INSTRUCTIONS[TASK]})
            if task.step(command).success and first < 0:
                first = task.steps
        if first < 0:
            raise SystemExit(f'the expert did not solve train_tasks[{index}] within {task.max_steps} steps')
        ds.save_episode()
        success_steps.append(first)
    ds.finalize()
    task.close()
    print(json.dumps({'episodes': args.episodes, 'frames': int(ds.meta.total_frames),
                      'success_step_median': float(np.median(success_steps)), 'success_step_max': max(success_steps)}))
    return 0


if __name__ == '__main__':
    raise SystemExit(main())
