"""``metaworld-expert``: Meta-World's scripted expert for a task, served as an action-chunking policy.

Meta-World's experts (``metaworld.policies``) are reactive: one observation in, one increment out. Served
in chunks, the expert is rolled forward: from the last executed action (the target the hand is tracking;
the measured state at an episode's first request) it plans ``chunk_length`` steps on a
kinematic model of the hand (each increment moves the target by at most ``action_scale`` per axis, as the
simulator's mocap body moves; the hand follows at the offset it has now), asking the expert again at each
predicted state. Objects stay where they are observed, except the drawer handle of ``drawer-*`` tasks,
which moves with the hand along the drawer's axis once the hand holds it. The next chunk plans again from
the robot's new state, so the model's errors last one chunk.

Contract: ``joint_absolute`` over the simulated robot's commanded coordinates ``ee_x ee_y ee_z gripper``
(the mocap target in m, the effort -1..1), state ``ee_x ee_y ee_z gripper obs_0 .. obs_38`` as the robot
(``sim_robot``) publishes them, dt = the task's step (1/80 s).
"""

from __future__ import annotations

import dataclasses
import warnings

import numpy as np

import sequence_ai_ros.policy as seq
from sequence_ai_ros.exceptions import ConfigError, MissingDependency

COMMAND_NAMES = ('ee_x', 'ee_y', 'ee_z', 'gripper')
STATE_NAMES = COMMAND_NAMES + tuple(f'obs_{i}' for i in range(39))
DT = 1 / 80
# the experts warn when a gain saturates; the environment clips the increment, and so does the rollout
warnings.filterwarnings('ignore', message=r'Constant\(s\) may be too high')


def expert_class_name(task: str) -> str:
    """``drawer-open-v3`` -> ``SawyerDrawerOpenV3Policy`` (metaworld.policies' naming)."""
    return 'Sawyer' + ''.join(part.capitalize() for part in task.split('-')) + 'Policy'


@seq.policy(action_space='joint_absolute', action_names=COMMAND_NAMES, dt=DT, chunk_length=20,
            observation=seq.ObservationContract(state_names=STATE_NAMES),
            gripper='the expert effort, -1 open .. 1 closed')
class MetaWorldExpert:
    """Meta-World's scripted expert, rolled forward into chunks.

    :param task: the Meta-World task (its expert and its mocap limits).
    :param chunk_length: actions per chunk T.
    :raises MissingDependency: without metaworld (the message says what to install).
    :raises ConfigError: for a task without a scripted expert.
    """

    def __init__(self, task: str = 'drawer-open-v3', chunk_length: int = 20) -> None:
        try:
            import metaworld
            import metaworld.policies as policies
        except ImportError as exc:
            raise MissingDependency(f'the metaworld-expert template needs Meta-World ({exc}): pip install '
                                    'metaworld==3.0.0 mujoco==3.8.1 packaging') from None
        name = expert_class_name(task)
        if not hasattr(policies, name):
            raise ConfigError(f'metaworld.policies has no scripted expert {name} for task {task!r}')
        self.expert = getattr(policies, name)()
        env_class = metaworld.ALL_V3_ENVIRONMENTS_GOAL_OBSERVABLE.get(f'{task}-goal-observable')
        if env_class is None:
            raise ConfigError(f'unknown Meta-World task {task!r}')
        env = env_class()
        self.action_scale = float(env.action_scale)
        self.low, self.high = np.asarray(env.mocap_low, np.float64), np.asarray(env.mocap_high, np.float64)
        env.close()
        self.drawer = task.startswith('drawer-')
        self.chunk_length = int(chunk_length)

    @classmethod
    def configure_contract(cls, contract: seq.Contract, config: dict) -> seq.Contract:
        """Return the contract for ``config`` (chunk_length)."""
        return dataclasses.replace(contract, chunk_length=int(config.get('chunk_length', contract.chunk_length)))

    def infer(self, inp: seq.PolicyInput, episode: seq.Episode) -> np.ndarray:
        """Return float32 (T, 4): the targets (m) and efforts of the expert's next T steps (module docstring)."""
        state = np.asarray(inp.observation.state, np.float64)
        obs = state[4:].copy()
        # from the target the hand is tracking: planned from the lagging hand, each chunk would start behind
        target = (state[0:3] if inp.last_action is None else np.asarray(inp.last_action[:3], np.float64)).copy()
        offset = obs[0:3] - target
        rows = np.empty((self.chunk_length, 4), np.float32)
        for k in range(self.chunk_length):
            action = np.asarray(self.expert.get_action(obs), np.float64)
            target = np.clip(target + np.clip(action[:3], -1.0, 1.0) * self.action_scale, self.low, self.high)
            hand = target + offset
            if self.drawer and self._holds_handle(obs):
                obs[5] += min(0.0, hand[1] - obs[1])     # the drawer opens along -y with the hand that pulls it
            obs[0:3] = hand
            rows[k, :3], rows[k, 3] = target, np.clip(action[3], -1.0, 1.0)
        return rows

    @staticmethod
    def _holds_handle(obs: np.ndarray) -> bool:
        """The drawer expert's own test of a hand at the handle (its pulling phase)."""
        handle = obs[4:7] + np.array([0.0, 0.0, -0.02])
        return bool(np.linalg.norm(obs[0:2] - handle[:2]) <= 0.06 and abs(obs[2] - handle[2]) <= 0.04)
