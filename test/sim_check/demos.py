"""Write Meta-World's scripted expert on one task (drawer-open-v3, push-v3) as a LeRobot v3.0 dataset.

Runs in the LeRobot venv (``LeRobotDataset.create`` / ``add_frame`` / ``save_episode`` / ``finalize``). The
robot is :class:`sequence_ai_ros.sim.task.SimTask`, the one definition the ``sim_robot`` node publishes, so
the demos' observations and actions are the node's coordinates:

- ``observation.state`` float32 (4,): ``ee_x ee_y ee_z gripper`` as measured (``SimTask.measured``);
- ``observation.environment_state`` float32 (39,): ``obs_0 .. obs_38`` (Meta-World's observation);
- ``action`` float32 (4,): the absolute command the node sends (mocap target in m, effort -1..1).

With ``--image N`` (the image ACT's demos) the observation is instead ``observation.state`` and
``observation.image`` uint8 (N, N, 3), the ``corner`` camera rendered by ``SimTask.render`` (the node's
camera) on the state before the step: no ``observation.environment_state``.

Frame t holds the state published before step t and the command of step t, at the task's 80 Hz. The expert
answers an increment; the command is the target it reaches (``mocap + increment * action_scale``, clipped
to the mocap box, as Meta-World moves its mocap body), so ``SimTask.step`` replays the expert exactly.
An episode is ``train_tasks[i]`` for i in 0..N-1, recorded until success and ``--after`` steps more.

The expert is Meta-World's own (``metaworld.policies.Sawyer<Task>V3Policy``).

Usage: ``python demos.py --root DIR [--task drawer-open-v3] [--episodes 50]``; prints one JSON line (episodes,
frames, success steps).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from sequence_ai_ros.sim.task import COMMAND_NAMES, OBS_NAMES, SimTask  # noqa: E402

FPS = 80
#: The tasks with demos: each one's instruction (the dataset's task text, the Act goal's instruction).
INSTRUCTIONS = {'drawer-open-v3': 'open the drawer', 'push-v3': 'push the puck to the goal'}


def expert_class(task: str) -> str:
    """Meta-World's scripted expert for ``task``: ``push-v3`` -> ``SawyerPushV3Policy``."""
    return 'Sawyer' + ''.join(w.capitalize() for w in task.removesuffix('-v3').split('-')) + 'V3Policy'


def repo_id(task: str) -> str:
    """The dataset's repo id (``local/metaworld_drawer_open`` for drawer-open-v3)."""
    return 'local/metaworld_' + task.removesuffix('-v3').replace('-', '_')


CAMERA = 'corner'


def features(image: int = 0) -> dict:
    """The dataset's features (LeRobot's feature dict); ``image`` > 0: state and an image of that size."""
    state = {'observation.state': {'dtype': 'float32', 'shape': (len(COMMAND_NAMES),), 'names': list(COMMAND_NAMES)}}
    if image:
        state['observation.image'] = {'dtype': 'image', 'shape': (image, image, 3),
                                      'names': ['height', 'width', 'channels']}
    else:
        state['observation.environment_state'] = {'dtype': 'float32', 'shape': (len(OBS_NAMES),),
                                                  'names': list(OBS_NAMES)}
    return {**state, 'action': {'dtype': 'float32', 'shape': (len(COMMAND_NAMES),), 'names': list(COMMAND_NAMES)}}


def expert_command(task: SimTask, expert) -> np.ndarray:
    """The absolute command (4,) that makes SimTask.step apply the expert's increment for the current obs."""
    action = np.asarray(expert.get_action(task.obs), np.float64)
    target = np.clip(task.mocap() + np.clip(action[:3], -1.0, 1.0) * task.action_scale, task.mocap_low,
                     task.mocap_high)
    return np.concatenate([target, [np.clip(action[3], -1.0, 1.0)]])


def main() -> int:
    import os
    import warnings

    os.environ.setdefault('MUJOCO_GL', 'egl')     # before MuJoCo loads (metaworld.policies imports it), as SimTask
    import metaworld.policies
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    warnings.filterwarnings('ignore', message=r'Constant\(s\) may be too high')
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--root', type=Path, required=True, help='the dataset folder (must not exist)')
    parser.add_argument('--episodes', type=int, default=50)
    parser.add_argument('--after', type=int, default=20, help='steps recorded after the first success')
    parser.add_argument('--task', default='drawer-open-v3', choices=sorted(INSTRUCTIONS))
    parser.add_argument('--image', type=int, default=0, help='image size (px): state + image demos (0: state only)')
    args = parser.parse_args()
    task = SimTask(args.task, benchmark_seed=0, max_steps=500)
    expert = getattr(metaworld.policies, expert_class(args.task))()
    ds = LeRobotDataset.create(repo_id(args.task) + (f'_image{args.image}' if args.image else ''), FPS,
                               features(args.image), root=args.root, robot_type='metaworld_sawyer',
                               use_videos=False)
    success_steps = []
    for index in range(args.episodes):
        task.reset('train', index)
        first = -1
        while not task.truncated and (first < 0 or task.steps < first + args.after):
            command = expert_command(task, expert)
            seen = ({'observation.image': task.render(CAMERA, args.image, args.image)} if args.image else
                    {'observation.environment_state': task.obs.astype(np.float32)})
            ds.add_frame({'observation.state': task.measured().astype(np.float32), **seen,
                          'action': command.astype(np.float32), 'task': INSTRUCTIONS[args.task]})
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
