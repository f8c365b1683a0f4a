"""The simulated robot's settings: one dataclass, validated in ``__post_init__``, declared as ROS parameters from it.

Every field is one ROS parameter of ``sim_robot`` (its ``help`` metadata is the parameter's description), so the
names, defaults and checks live here only; ``config/sim_robot.yaml`` sets them for a launch.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from sequence_ai_ros.exceptions import ConfigError


def _field(default: Any, help: str) -> Any:  # noqa: A002  (the dataclass metadata key)
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default), metadata={'help': help})
    return dataclasses.field(default=default, metadata={'help': help})


@dataclasses.dataclass
class SimConfig:
    """Parameters of ``sim_robot`` (read at start-up).

    :raises ConfigError: for a value outside its range (the message names the parameter).
    """

    task: str = _field('drawer-open-v3', 'Meta-World ML1 task')
    benchmark_seed: int = _field(0, 'seed of metaworld.ML1(task, seed): draws the train and test task instances')
    split: str = _field('test', 'instance list reset to at start-up: test (held-out) or train (demonstrations)')
    index: int = _field(0, 'instance index reset to at start-up')
    max_steps: int = _field(500, 'steps per episode, counted from its first command (after a reset the robot '
                                 'waits for one, publishing its reset state); at this count physics stops until '
                                 'the next reset')
    real_time_factor: float = _field(1.0, 'sim time per wall time: 1.0 steps at the task rate (80 Hz for '
                                          'Meta-World), on the steady clock')
    controller: str = _field('position_controller', 'controller name: Float64MultiArray on '
                                                     '<controller>/commands, JointTrajectory on '
                                                     '<controller>/joint_trajectory (relative)')
    joint_states_topic: str = _field('joint_states', 'sensor_msgs/JointState topic (relative)')
    camera_names: list[str] = _field(['corner'], 'MuJoCo cameras published as sensor_msgs/Image rgb8 on '
                                                 '<name>/image_raw; [""] for none')
    camera_width: int = _field(96, 'image width (px)')
    camera_height: int = _field(96, 'image height (px)')
    camera_rate_hz: float = _field(10.0, 'image rate (Hz), rendered between steps')
    status_rate_hz: float = _field(10.0, '~/status rate (Hz)')

    def __post_init__(self) -> None:
        self.camera_names = [c for c in self.camera_names if c]
        checks = [
            ('split', self.split in ('test', 'train'), 'test or train'),
            ('index', self.index >= 0, '>= 0'),
            ('max_steps', self.max_steps >= 1, '>= 1'),
            ('real_time_factor', 0 < self.real_time_factor <= 10, 'in (0, 10]'),
            ('camera_width', 8 <= self.camera_width <= 4096, 'in [8, 4096]'),
            ('camera_height', 8 <= self.camera_height <= 4096, 'in [8, 4096]'),
            ('camera_rate_hz', 0 < self.camera_rate_hz <= 100, 'in (0, 100]'),
            ('status_rate_hz', 0 < self.status_rate_hz <= 100, 'in (0, 100]'),
            ('controller', bool(self.controller) and not self.controller.startswith('/'), 'a relative name'),
            ('joint_states_topic', bool(self.joint_states_topic) and not self.joint_states_topic.startswith('/'),
             'a relative name'),
            ('camera_names', len(set(self.camera_names)) == len(self.camera_names), 'unique names'),
        ]
        for name, ok, expected in checks:
            value = getattr(self, name)
            if not ok or (isinstance(value, float) and not math.isfinite(value)):
                raise ConfigError(f'sim_robot parameter {name} must be {expected}, got {value!r}')

    @classmethod
    def fields(cls) -> list[dataclasses.Field]:
        """The parameters, in declaration order."""
        return list(dataclasses.fields(cls))


def declare_and_read(node: Any) -> SimConfig:
    """Declare every :class:`SimConfig` field on ``node`` (with its description) and return the validated config.

    :raises ConfigError: as :class:`SimConfig`.
    """
    from rcl_interfaces.msg import ParameterDescriptor

    values = {}
    defaults = SimConfig()
    for f in SimConfig.fields():
        default = getattr(defaults, f.name)
        if f.name == 'camera_names' and not default:
            default = ['']
        desc = ParameterDescriptor(description=f.metadata['help'], read_only=True)
        values[f.name] = node.declare_parameter(f.name, default, desc).value
    return SimConfig(**values)
