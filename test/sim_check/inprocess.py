"""The reference: a LeRobot checkpoint run in-process on the simulated task, with no delay and no product code.

Runs in the LeRobot venv. LeRobot 0.6's own path (``get_policy_class(...).from_pretrained``,
``make_pre_post_processors``, ``prepare_observation_for_inference``, ``select_action`` with its queue of
``n_action_steps``, the postprocessor) drives :class:`sequence_ai_ros.sim.task.SimTask` step by step. The
observation of each step is what the checkpoint's input features ask for, from the one definition the
``sim_robot`` node publishes: ``observation.state`` is ``SimTask.measured()`` (4 dimensions: the ACTs) or
``SimTask.state()`` (43: the VLA's, all of ``joint_states``), ``observation.environment_state`` is
``SimTask.obs``, a camera (``observation.image``) the ``corner`` camera at the feature's size. The action is
the absolute command the node would receive.

Time to success counts from the first commanded action: success at step s (the first action is step 1) is
``s * dt``. Usage: ``python inprocess.py --checkpoint DIR --seeds 0:50 --out result.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from sequence_ai_ros.sim.task import JOINT_NAMES, SimTask  # noqa: E402

TASK = 'drawer-open-v3'
INSTRUCTION = 'open the drawer'
CAMERA = 'corner'


def observe(task: SimTask, inputs: dict) -> dict:
    """The observation the checkpoint's ``input_features`` ask for, read from ``task``.

    :raises ValueError: for a feature this task cannot give.
    """
    out = {}
    for key, feature in inputs.items():
        shape = tuple(feature.shape)
        if key == 'observation.state':
            out[key] = (task.state() if shape == (len(JOINT_NAMES),) else task.measured()).astype(np.float32)
        elif key == 'observation.environment_state':
            out[key] = task.obs.astype(np.float32)
        elif key == 'observation.image':
            out[key] = task.render(CAMERA, shape[-1], shape[-2])
        else:
            raise ValueError(f'the checkpoint reads {key} {shape}, which the simulated task does not give')
    return out


def main() -> int:
    import torch
    from lerobot.configs.policies import PreTrainedConfig
    from lerobot.policies.factory import get_policy_class, make_pre_post_processors
    from lerobot.policies.utils import prepare_observation_for_inference

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--checkpoint', type=Path, required=True, help='the pretrained_model directory')
    parser.add_argument('--seeds', default='0:50', help='test_tasks indices, START:STOP')
    parser.add_argument('--max-steps', type=int, default=500)
    parser.add_argument('--out', type=Path, required=True)
    args = parser.parse_args()
    start, stop = (int(v) for v in args.seeds.split(':'))
    cfg = PreTrainedConfig.from_pretrained(str(args.checkpoint), local_files_only=True)
    cfg.device = 'cpu'
    policy = get_policy_class(cfg.type).from_pretrained(str(args.checkpoint), config=cfg, local_files_only=True)
    policy.eval()
    pre, post = make_pre_post_processors(policy.config, pretrained_path=str(args.checkpoint),
                                         preprocessor_overrides={'device_processor': {'device': 'cpu'}})
    task = SimTask(TASK, benchmark_seed=0, max_steps=args.max_steps)
    episodes = []
    t0 = time.monotonic()
    for index in range(start, stop):
        task.reset('test', index)
        policy.reset()
        pre.reset()
        post.reset()
        success_step = -1
        while not task.truncated:
            obs = observe(task, cfg.input_features)
            batch = prepare_observation_for_inference(obs, torch.device('cpu'), INSTRUCTION, 'metaworld_sawyer')
            with torch.inference_mode():
                action = post(policy.select_action(pre(batch)))
            if task.step(np.asarray(action[0], np.float64)).success:
                success_step = task.steps
                break
        episodes.append({'index': index, 'success': success_step > 0,
                         'time_to_success_s': success_step * task.dt if success_step > 0 else None})
    task.close()
    args.out.write_text(json.dumps({'episodes': episodes, 'dt': task.dt, 'wall_s': time.monotonic() - t0}, indent=1))
    solved = sum(e['success'] for e in episodes)
    print(f'in-process: {solved}/{len(episodes)} solved in {time.monotonic() - t0:.1f} s')
    return 0


if __name__ == '__main__':
    raise SystemExit(main())
