"""The node's configuration as validated dataclasses (ROS-free).

:mod:`.parameters` declares every ROS parameter and fills these; tests and the bench build them
directly. Every check runs in ``__post_init__`` and raises :class:`ConfigError` naming the parameter.
"""

from __future__ import annotations

import dataclasses
import math

from sequence_ai_ros.exceptions import ConfigError

#: Command interfaces, after the ros2_control conventions (see :mod:`.commands`).
INTERFACES = ('forward_command', 'joint_trajectory', 'joint_state', 'pose', 'twist')
CAMERA_TYPES = ('image', 'compressed')
QOS_RELIABILITY = ('best_effort', 'reliable')
ON_VIOLATION = ('clamp', 'stop')
ON_UNDERRUN = ('hold', 'stop')
STAMP_SOURCES = ('receive', 'header')


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f'parameter {name}: {value!r} is not one of {", ".join(choices)}')


def _check_positive(name: str, value: float) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise ConfigError(f'parameter {name}: must be a positive number, got {value!r}')


def _check_finite(name: str, values: tuple[float, ...]) -> None:
    bad = [i for i, v in enumerate(values) if not math.isfinite(v)]
    if bad:
        raise ConfigError(f'parameter {name}: non-finite values at indices {bad} ({[values[i] for i in bad]}); '
                          'every limit must be a finite number (use a large finite value for an unlimited joint)')


@dataclasses.dataclass(frozen=True)
class QosConfig:
    """QoS of the observation subscriptions.

    :param reliability: ``best_effort`` (sensor data, the default) or ``reliable``.
    :param depth: history depth (messages kept per subscription).
    """

    reliability: str = 'best_effort'
    depth: int = 5

    def __post_init__(self) -> None:
        _check_choice('qos.reliability', self.reliability, QOS_RELIABILITY)
        if self.depth < 1:
            raise ConfigError(f'parameter qos.depth: must be >= 1, got {self.depth}')


@dataclasses.dataclass(frozen=True)
class CameraConfig:
    """One camera input.

    :param name: the entry's name in ``camera_names``.
    :param topic: the image topic.
    :param type: ``image`` (sensor_msgs/Image) or ``compressed`` (sensor_msgs/CompressedImage).
    :param key: the observation key the policy's contract names (defaults to ``name``).
    :param max_age_s: older than this (s, local receive time) makes the observation invalid.
    """

    name: str
    topic: str
    type: str = 'image'
    key: str = ''
    max_age_s: float = 0.5

    def __post_init__(self) -> None:
        if not self.name or not self.topic:
            raise ConfigError(f'camera {self.name!r}: cameras.<name>.topic must be set')
        _check_choice(f'cameras.{self.name}.type', self.type, CAMERA_TYPES)
        _check_positive(f'cameras.{self.name}.max_age_s', self.max_age_s)
        if not self.key:
            object.__setattr__(self, 'key', self.name)


@dataclasses.dataclass(frozen=True)
class JointsConfig:
    """The joint_states input.

    :param topic: sensor_msgs/JointState topic.
    :param names: the joints to observe, in the order of the observation's state vector (a subset of
        the message's names, in any order).
    :param max_age_s: older than this (s) makes the observation invalid.
    """

    topic: str = '/joint_states'
    names: tuple[str, ...] = ()
    max_age_s: float = 0.5

    def __post_init__(self) -> None:
        object.__setattr__(self, 'names', tuple(self.names))
        _check_positive('joints.max_age_s', self.max_age_s)
        if any(not n for n in self.names) or len(set(self.names)) != len(self.names):
            raise ConfigError('parameter joints.names: names must be unique and non-empty')


@dataclasses.dataclass(frozen=True)
class CommandConfig:
    """Where and how commands go (see :mod:`.commands` for the message layouts).

    :param interface: one of :data:`INTERFACES`.
    :param controller: the ros2_control controller name; topics default to ``/<controller>/commands``
        (forward_command) and ``/<controller>/joint_trajectory`` (joint_trajectory).
    :param topic: overrides the derived topic (required for joint_state, pose and twist).
    :param kind: for forward_command and joint_state: ``position`` or ``velocity``.
    :param joint_names: the commanded joints, in command order (defaults to the observed joints).
    :param time_from_start_s: joint_trajectory point time (s); 0 means one control period.
    :param frame_id: header frame of pose/twist commands.
    :param gripper_topic: Float64MultiArray topic for the gripper channels of pose/twist commands.
    """

    interface: str = 'forward_command'
    controller: str = 'position_controller'
    topic: str = ''
    kind: str = 'position'
    joint_names: tuple[str, ...] = ()
    time_from_start_s: float = 0.0
    frame_id: str = 'base_link'
    gripper_topic: str = ''

    def __post_init__(self) -> None:
        object.__setattr__(self, 'joint_names', tuple(self.joint_names))
        _check_choice('command.interface', self.interface, INTERFACES)
        _check_choice('command.kind', self.kind, ('position', 'velocity'))
        if self.time_from_start_s < 0:
            raise ConfigError('parameter command.time_from_start_s: must be >= 0')
        if self.interface in ('joint_state', 'pose', 'twist') and not self.topic:
            raise ConfigError(f'parameter command.topic: required for interface {self.interface}')
        if self.interface in ('forward_command', 'joint_trajectory') and not (self.topic or self.controller):
            raise ConfigError('parameter command.controller: required to derive the command topic')

    def resolved_topic(self) -> str:
        """Return the command topic (``topic`` or the ros2_control default for the controller)."""
        if self.topic:
            return self.topic
        suffix = 'commands' if self.interface == 'forward_command' else 'joint_trajectory'
        return f'/{self.controller.strip("/")}/{suffix}'


@dataclasses.dataclass(frozen=True)
class SafetyConfig:
    """Per-joint limits applied to every position command before it is published.

    :param lower_limits: per commanded joint (rad or m); empty = no limit.
    :param upper_limits: per commanded joint; empty = no limit.
    :param max_step: largest change per tick, per joint or one value for all; empty = no limit.
    :param on_violation: ``clamp`` (clamp and count) or ``stop`` (end the run with 'validate').
    :raises ConfigError: naming the parameter, for a non-finite limit or step (NaN or inf: a NaN bound
        would turn every clamped command into NaN), lower and upper limits of different lengths, a lower
        limit above its upper limit, or a step <= 0.
    """

    lower_limits: tuple[float, ...] = ()
    upper_limits: tuple[float, ...] = ()
    max_step: tuple[float, ...] = ()
    on_violation: str = 'clamp'

    def __post_init__(self) -> None:
        for name in ('lower_limits', 'upper_limits', 'max_step'):
            try:
                values = tuple(float(v) for v in getattr(self, name))
            except (TypeError, ValueError):
                raise ConfigError(f'parameter safety.{name}: must be a list of numbers, '
                                  f'got {getattr(self, name)!r}') from None
            object.__setattr__(self, name, values)
            _check_finite(f'safety.{name}', values)
        _check_choice('safety.on_violation', self.on_violation, ON_VIOLATION)
        if self.lower_limits and self.upper_limits:
            if len(self.lower_limits) != len(self.upper_limits):
                raise ConfigError(f'parameter safety.lower_limits: {len(self.lower_limits)} values but '
                                  f'safety.upper_limits has {len(self.upper_limits)}')
            bad = [i for i, (lo, hi) in enumerate(zip(self.lower_limits, self.upper_limits, strict=True)) if lo > hi]
            if bad:
                raise ConfigError(f'parameter safety.lower_limits: lower limit above upper limit for joints {bad}')
        if any(s <= 0 for s in self.max_step):
            raise ConfigError(f'parameter safety.max_step: every value must be > 0, got {list(self.max_step)}')


@dataclasses.dataclass(frozen=True)
class NodeConfig:
    """Everything the policy node needs (its ROS parameters, validated).

    :param model: deployment name on the worker.
    :param endpoint: ``host:port`` of the worker.
    :param token: bearer token, empty for none.
    :param control_rate_hz: commands per second (Hz) on the steady clock.
    :param enabled: False is a dry run: everything runs and is reported, nothing is commanded.
    :param on_underrun: ``hold`` republishes the last command; ``stop`` publishes nothing.
    :param stamp_source: age measured from the local ``receive`` time or the message ``header`` stamp.
    :param stale_grace_s: a source stale for longer than this (s) mid-run ends the episode ('error').
    :param connect_timeout_s: each connection attempt's timeout (s).
    :param status_rate_hz: ~/status rate (Hz).
    :param diagnostics_rate_hz: /diagnostics rate (Hz).
    """

    model: str = ''
    endpoint: str = '127.0.0.1:50551'
    token: str = ''
    control_rate_hz: float = 50.0
    enabled: bool = True
    on_underrun: str = 'hold'
    stamp_source: str = 'receive'
    stale_grace_s: float = 2.0
    connect_timeout_s: float = 5.0
    status_rate_hz: float = 2.0
    diagnostics_rate_hz: float = 1.0
    joints: JointsConfig = dataclasses.field(default_factory=JointsConfig)
    cameras: tuple[CameraConfig, ...] = ()
    qos: QosConfig = dataclasses.field(default_factory=QosConfig)
    command: CommandConfig = dataclasses.field(default_factory=CommandConfig)
    safety: SafetyConfig = dataclasses.field(default_factory=SafetyConfig)

    def __post_init__(self) -> None:
        object.__setattr__(self, 'cameras', tuple(self.cameras))
        _check_positive('control_rate_hz', self.control_rate_hz)
        _check_positive('status_rate_hz', self.status_rate_hz)
        _check_positive('diagnostics_rate_hz', self.diagnostics_rate_hz)
        _check_positive('stale_grace_s', self.stale_grace_s)
        _check_positive('connect_timeout_s', self.connect_timeout_s)
        _check_choice('on_underrun', self.on_underrun, ON_UNDERRUN)
        _check_choice('stamp_source', self.stamp_source, STAMP_SOURCES)
        keys = [c.key for c in self.cameras]
        if len(set(keys)) != len(keys):
            raise ConfigError(f'cameras: duplicate observation keys {keys}')
        n = len(self.command_joint_names)
        for name in ('lower_limits', 'upper_limits'):
            limits = getattr(self.safety, name)
            if limits and len(limits) != n:
                raise ConfigError(f'safety.{name}: {len(limits)} values for {n} commanded joints')
        if len(self.safety.max_step) not in (0, 1, n):
            raise ConfigError(f'safety.max_step: {len(self.safety.max_step)} values; give 1 or {n}')

    def check_runnable(self) -> None:
        """Check what the running node needs beyond a valid configuration (a template may lack it).

        :raises ConfigError: when ``model`` is empty (nothing to drive) or ``joints.names`` is empty:
            observations are built from the named joints, so the node cannot run without them.
        """
        if not self.model:
            raise ConfigError('parameter model: empty; name the deployment to drive (-p model:=NAME, or the '
                              'launch argument model:=NAME), as `seq deployments` lists it')
        if not self.joints.names:
            raise ConfigError('parameter joints.names: empty; list the observed joints (in the order of the '
                              "policy's state vector): the node cannot build observations without joints")

    @property
    def period_s(self) -> float:
        """The control period (s)."""
        return 1.0 / self.control_rate_hz

    @property
    def command_joint_names(self) -> tuple[str, ...]:
        """The commanded joints, in command order (``command.joint_names`` or ``joints.names``)."""
        return self.command.joint_names or self.joints.names
