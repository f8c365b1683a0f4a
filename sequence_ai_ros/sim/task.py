"""One Meta-World task as a robot, ROS-free: seeded resets, position commands, measured state, camera frames.

The commanded coordinates are ``ee_x ee_y ee_z`` (m), the end-effector target in the frame of Meta-World's
mocap body (the body the hand is welded to), and ``gripper``, the finger effort in -1 (open) .. 1 (closed).
Meta-World's own action is an increment (``dx dy dz`` in -1..1, times ``action_scale`` = 1 cm per step, and
the effort); a command becomes the increment that takes the mocap body to the target, so the hand follows at
most 1 cm per step (0.8 m/s at 80 Hz), as Meta-World's scripted experts move it.

The measured state is in the same coordinates, so that a hold at the measured state stands still:
``ee_*`` is the hand's position less its offset from the mocap body (measured once, at construction, on a
hand left to settle: :data:`SETTLE_STEPS`), ``gripper`` the effort in effect (the fingers' opening itself is
``obs_3``). ``obs_0 .. obs_38`` is Meta-World's observation of the step, as its experts and policies read it;
its last three (``obs_36 .. obs_38``) are the goal position, which Meta-World hides (zeros) by default: a task
observes it unless it is in :data:`GOAL_HIDDEN`.

Instances: ``metaworld.ML1(task, seed)``; ``train`` indexes its ``train_tasks`` (for demonstrations),
``test`` its ``test_tasks`` (held-out instances: the first 50 are the evaluation seeds).

Rendering is headless: ``MUJOCO_GL=egl`` (set here before MuJoCo loads, unless already set), with shadows,
reflections and multisampling off. It needs Debian's libegl1 and libgl1-mesa-dri; :func:`render_unavailable`
says why it cannot.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from typing import Any

import numpy as np

from sequence_ai_ros.exceptions import ConfigError, MissingDependency

#: The commanded coordinates, in command order.
COMMAND_NAMES = ('ee_x', 'ee_y', 'ee_z', 'gripper')
#: Meta-World's observation size (hand 3, gripper 1, objects 14, the previous frame's 18, goal 3).
OBS_DIM = 39
OBS_NAMES = tuple(f'obs_{i}' for i in range(OBS_DIM))
#: joint_states names: the commanded coordinates (measured), then the task observation.
JOINT_NAMES = COMMAND_NAMES + OBS_NAMES
SPLITS = ('test', 'train')
#: The effort in effect after a reset: open, as Meta-World's own hand reset leaves it.
RESET_GRIPPER = -1.0
#: Steps a held hand takes to settle on its mocap body (Meta-World's reset leaves it 5 mm off, settling in ~100).
SETTLE_STEPS = 150
#: Tasks that keep Meta-World's default of a hidden goal (obs_36..38 zero). drawer-open's goal is fixed to its
#: drawer (its expert reads none), and its demos and checkpoints were made so. Every other task observes its
#: goal, which its scripted expert, and so a policy, needs: push-v3 draws the puck's goal per instance.
GOAL_HIDDEN = frozenset({'drawer-open-v3'})
INSTALL_HINT = 'pip install metaworld==3.0.0 mujoco==3.8.1 packaging (or pip install "sequence_ai_ros[sim]")'


def _metaworld() -> Any:
    os.environ.setdefault('MUJOCO_GL', 'egl')
    try:
        import metaworld
    except ImportError as exc:
        raise MissingDependency(f'the simulated robot needs Meta-World and MuJoCo ({exc}): {INSTALL_HINT}') from None
    return metaworld


@dataclasses.dataclass(frozen=True)
class StepResult:
    """What one control step produced.

    :param obs: float64 (39,) Meta-World's observation after the step.
    :param success: the task's success signal (``info['success']``).
    """

    obs: np.ndarray
    success: bool


class SimTask:
    """One Meta-World ML1 task, driven by position commands (see the module docstring).

    :param task: the ML1 environment name, e.g. ``drawer-open-v3``.
    :param benchmark_seed: the ``metaworld.ML1`` seed that draws the task instances.
    :param max_steps: steps per episode before it is truncated (Meta-World's ``max_path_length``).
    :raises MissingDependency: without metaworld/mujoco (the message says what to install).
    :raises ConfigError: for an unknown task.
    """

    def __init__(self, task: str = 'drawer-open-v3', benchmark_seed: int = 0, max_steps: int = 500) -> None:
        metaworld = _metaworld()
        try:
            self.benchmark = metaworld.ML1(task, seed=benchmark_seed)
        except (KeyError, ValueError) as exc:
            raise ConfigError(f'unknown Meta-World task {task!r}: {exc}') from None
        self.task = task
        self.observe_goal = task not in GOAL_HIDDEN
        self.env = self.benchmark.train_classes[task]()
        self.env.max_path_length = int(max_steps)
        self.max_steps = int(max_steps)
        self.dt = float(self.env.dt)              # one control step (s): 0.0125 s, 80 Hz
        self.action_scale = float(self.env.action_scale)
        self.mocap_low = np.asarray(self.env.mocap_low, np.float64)
        self.mocap_high = np.asarray(self.env.mocap_high, np.float64)
        self.split, self.index = '', -1
        self.obs = np.zeros(OBS_DIM)
        self.success = False
        self.steps = 0
        self.target = np.zeros(3)
        self.gripper = RESET_GRIPPER
        self._renderers: dict[tuple[int, int], Any] = {}
        self._offset = np.zeros(3)
        self._offset = self._settled_offset()

    def _settled_offset(self) -> np.ndarray:
        """The hand's offset from the mocap body once a held hand has settled, float64 (3,) (m).

        The settling steps are no episode's: ``max_steps`` (Meta-World's ``max_path_length`` too) is lifted for them.
        """
        limit = self.max_steps
        self.max_steps = self.env.max_path_length = max(limit, SETTLE_STEPS)
        try:
            self.reset('train', 0)
            hold = np.concatenate([self.mocap(), [RESET_GRIPPER]])
            for _ in range(SETTLE_STEPS):
                self.step(hold)
            offset = self.obs[0:3] - self.mocap()
        finally:
            self.max_steps = self.env.max_path_length = limit
        self.split, self.index = '', -1
        return offset

    def tasks(self, split: str) -> list[Any]:
        """The task instances of ``split`` (``test`` or ``train``)."""
        if split not in SPLITS:
            raise ConfigError(f'split must be one of {", ".join(SPLITS)}, got {split!r}')
        return self.benchmark.test_tasks if split == 'test' else self.benchmark.train_tasks

    def reset(self, split: str = 'test', index: int = 0) -> np.ndarray:
        """Reset to instance ``index`` of ``split``; return the measured state (43,) in :data:`JOINT_NAMES` order.

        The target becomes the mocap body's position and the effort :data:`RESET_GRIPPER`: with no command the
        hand stays where the reset put it.

        :raises ConfigError: for an unknown split or an index outside it.
        """
        tasks = self.tasks(split)
        if not 0 <= index < len(tasks):
            raise ConfigError(f'{split} has {len(tasks)} task instances; index {index} is outside it')
        self.env.set_task(tasks[index])
        if self.observe_goal and self.env._partially_observable:
            # what set_task does when a task's observability changes (the observation space is a cached property),
            # computed again at once: the next set_task deletes it, and a reset without a step does not compute it
            self.env.__dict__.pop('sawyer_observation_space', None)
            self.env._partially_observable = False
            self.env.sawyer_observation_space  # noqa: B018
        obs, _ = self.env.reset()
        self.split, self.index = split, int(index)
        self.obs = np.asarray(obs, np.float64)
        self.target = self.mocap()
        self.gripper = RESET_GRIPPER
        self.success = False
        self.steps = 0
        return self.state()

    def mocap(self) -> np.ndarray:
        """The mocap body's position, float64 (3,) (m)."""
        return np.asarray(self.env.data.mocap_pos[0], np.float64).copy()

    @property
    def truncated(self) -> bool:
        """True once the episode has run :attr:`max_steps` steps (no further step until a reset)."""
        return self.steps >= self.max_steps

    def measured(self) -> np.ndarray:
        """The commanded coordinates as measured, float64 (4,): hand less its reset offset (m), effort."""
        return np.concatenate([self.obs[0:3] - self._offset, [self.gripper]])

    def state(self) -> np.ndarray:
        """float64 (43,): :meth:`measured` then the observation, in :data:`JOINT_NAMES` order."""
        return np.concatenate([self.measured(), self.obs])

    def action_for(self, command: np.ndarray) -> np.ndarray:
        """Meta-World's action (4,) that moves the mocap body toward ``command[:3]`` and applies ``command[3]``."""
        target = np.clip(np.asarray(command[:3], np.float64), self.mocap_low, self.mocap_high)
        delta = np.clip((target - self.mocap()) / self.action_scale, -1.0, 1.0)
        return np.concatenate([delta, [float(np.clip(command[3], -1.0, 1.0))]]).astype(np.float32)

    def step(self, command: np.ndarray) -> StepResult:
        """Run one control step toward ``command`` (float64 (4,), command order).

        :raises ConfigError: when the episode is truncated or no reset was made.
        """
        if self.index < 0:
            raise ConfigError('reset the simulator before stepping it')
        if self.truncated:
            raise ConfigError(f'the episode reached max_steps ({self.max_steps}): reset it')
        command = np.asarray(command, np.float64)
        self.target, self.gripper = command[:3].copy(), float(np.clip(command[3], -1.0, 1.0))
        obs, _, _, _, info = self.env.step(self.action_for(command))
        self.obs = np.asarray(obs, np.float64)
        self.success = bool(info.get('success', 0.0))
        self.steps += 1
        return StepResult(self.obs, self.success)

    def render(self, camera: str, width: int, height: int) -> np.ndarray:
        """Render ``camera`` (a MuJoCo camera of the scene, e.g. ``corner``): uint8 (height, width, 3) rgb.

        :raises ConfigError: for a camera the scene does not have.
        :raises MissingDependency: when no EGL context can be made (see :func:`render_unavailable`).
        """
        import mujoco

        model = self.env.model
        if mujoco.mj_name2id(model, mujoco.mjtObj.mjOBJ_CAMERA, camera) < 0:
            names = [model.camera(i).name for i in range(model.ncam)]
            raise ConfigError(f'no camera {camera!r} in the {self.task} scene; it has {names}')
        renderer = self._renderers.get((width, height))
        if renderer is None:
            model.vis.quality.offsamples = 0        # no multisampling
            model.vis.global_.offwidth = max(model.vis.global_.offwidth, width)
            model.vis.global_.offheight = max(model.vis.global_.offheight, height)
            try:
                renderer = mujoco.Renderer(model, height=height, width=width)
            except Exception as exc:  # EGL/OpenGL failures have no common type (mujoco.FatalError, OSError...)
                raise MissingDependency(f'cannot render headless ({type(exc).__name__}: {exc}); Debian needs '
                                        'libegl1 and libgl1-mesa-dri (apt-get install them)') from None
            self._renderers[(width, height)] = renderer
        renderer.update_scene(self.env.data, camera=camera)
        flags = renderer.scene.flags
        flags[mujoco.mjtRndFlag.mjRND_SHADOW] = 0
        flags[mujoco.mjtRndFlag.mjRND_REFLECTION] = 0
        return renderer.render()

    def close(self) -> None:
        """Free the renderers and the environment."""
        for renderer in self._renderers.values():
            renderer.close()
        self._renderers.clear()
        self.env.close()


_PROBE = r'''
import os
os.environ.setdefault('MUJOCO_GL', 'egl')
import mujoco
model = mujoco.MjModel.from_xml_string('<mujoco><worldbody><geom size="0.1"/></worldbody></mujoco>')
r = mujoco.Renderer(model, 16, 16)
r.update_scene(mujoco.MjData(model))
assert r.render().shape == (16, 16, 3)
'''


def render_unavailable(timeout_s: float = 60.0) -> str:
    """Return why headless rendering cannot work here ('' when a 16x16 frame renders).

    It tries in a child process: a missing EGL driver can abort the process that tries.
    """
    try:
        import mujoco  # noqa: F401
    except ImportError as exc:
        return f'mujoco is not installed ({exc}): {INSTALL_HINT}'
    env = dict(os.environ)
    env.setdefault('MUJOCO_GL', 'egl')
    try:
        done = subprocess.run([sys.executable, '-c', _PROBE], capture_output=True, text=True, timeout=timeout_s,
                              env=env)
    except subprocess.TimeoutExpired:
        return f'a 16x16 EGL render did not finish within {timeout_s:g} s'
    if done.returncode == 0:
        return ''
    tail = (done.stderr.strip().splitlines() or ['no output'])[-1]
    return (f'headless rendering (MUJOCO_GL={env["MUJOCO_GL"]}) fails: {tail}; Debian needs libegl1 and '
            'libgl1-mesa-dri (make test installs them when root)')
