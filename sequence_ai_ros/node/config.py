"""The node's configuration as validated dataclasses (ROS-free).

Every default, type and single-value check comes from the parameter schema
(:mod:`.parameter_schema`, ``policy_node_parameters.yaml``); only checks across parameters (limits per
commanded joint, a topic an interface needs) are written here. Which fields are checked is not listed
by hand: every field whose name (with its group's prefix) the schema declares is checked against it, so
a parameter added to the schema and to its dataclass is validated with no further edit
(test/test_parameter_schema.py tries a value just outside every declared validation). :mod:`.parameters`
declares the ROS parameters from the same schema and fills these; tests and the bench build them
directly. Every check runs in ``__post_init__`` and raises :class:`ConfigError` naming the parameter.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from sequence_ai_ros.client.session import resolve_endpoint
from sequence_ai_ros.exceptions import ConfigError
from sequence_ai_ros.node import parameter_schema

#: The one declaration of every parameter: defaults, types and validation come from it.
SCHEMA = parameter_schema.load()


def _default(name: str) -> Any:
    return SCHEMA.default(name)


def _choices(name: str) -> tuple[str, ...]:
    return tuple(SCHEMA.spec(name).validation['one_of<>'][0])


#: The schema's prefix of the mapped camera group (``cameras.<name>.``).
CAMERA_GROUP = 'cameras.__map_camera_names.'

#: Command interfaces, after the ros2_control conventions (see :mod:`.controller_commands`).
INTERFACES = _choices('command.interface')
CAMERA_TYPES = _choices(CAMERA_GROUP + 'type')
QOS_RELIABILITY = _choices('qos.reliability')
ON_VIOLATION = _choices('safety.on_violation')
ON_UNDERRUN = _choices('on_underrun')
STAMP_SOURCES = _choices('stamp_source')


@functools.cache
def schema_fields(cls: type, group: str) -> tuple[str, ...]:
    """The fields of config dataclass ``cls`` that the schema declares as ``group + field``, in field order.

    :param group: the schema's prefix of the group (``''``, ``qos.``, :data:`CAMERA_GROUP`...).
    """
    return tuple(f.name for f in dataclasses.fields(cls) if group + f.name in SCHEMA.specs)


def _check(obj: Any, prefix: str, group: str | None = None) -> None:
    """Validate every schema-declared field of ``obj`` (``prefix + field``), storing the normalised values.

    :param prefix: the concrete prefix, for messages (``cameras.front.``).
    :param group: the schema's prefix when it differs from ``prefix`` (a mapped group); default ``prefix``.
    :raises ConfigError: ``parameter <prefix><field>: <why>`` for the first field that fails.
    """
    cls: type = type(obj)     # a type is hashable (functools.cache's key); type(Any) does not say so
    for field in schema_fields(cls, prefix if group is None else group):
        object.__setattr__(obj, field, SCHEMA.check(prefix + field, getattr(obj, field)))


@dataclasses.dataclass(frozen=True)
class QosConfig:
    """QoS of the observation subscriptions.

    :param reliability: ``best_effort`` (sensor data, the default) or ``reliable``.
    :param depth: history depth (messages kept per subscription).
    """

    reliability: str = _default('qos.reliability')
    depth: int = _default('qos.depth')

    def __post_init__(self) -> None:
        _check(self, 'qos.')


@dataclasses.dataclass(frozen=True)
class CameraConfig:
    """One camera input.

    :param name: the entry's name in ``camera_names``.
    :param topic: the image topic.
    :param type: ``image`` (sensor_msgs/Image) or ``compressed`` (sensor_msgs/CompressedImage).
    :param key: the observation key the policy's contract names (defaults to ``name``).
    :param max_age_s: older than this (s, local receive time) makes the observation invalid.
    :raises ConfigError: naming the parameter, for a name ``camera_names`` refuses (empty, or not usable
        in ``cameras.<name>.*``), an empty topic, or a value its schema entry refuses.
    """

    name: str
    topic: str
    type: str = _default(CAMERA_GROUP + 'type')
    key: str = _default(CAMERA_GROUP + 'key')
    max_age_s: float = _default(CAMERA_GROUP + 'max_age_s')

    def __post_init__(self) -> None:
        # the name is an entry of camera_names (a part of the parameter names cameras.<name>.*)
        object.__setattr__(self, 'name', SCHEMA.check('camera_names', (self.name,))[0])
        _check(self, f'cameras.{self.name}.', CAMERA_GROUP)
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

    topic: str = _default('joints.topic')
    names: tuple[str, ...] = _default('joints.names')
    max_age_s: float = _default('joints.max_age_s')

    def __post_init__(self) -> None:
        _check(self, 'joints.')


@dataclasses.dataclass(frozen=True)
class CommandConfig:
    """Where and how commands go (see :mod:`.commands` for the message layouts).

    :param interface: one of :data:`INTERFACES`.
    :param mode: ``streaming`` (one command per control tick) or ``trajectory`` (joint_trajectory only:
        each new chunk's remaining horizon as one multi-point JointTrajectory, see :mod:`.trajectory`).
    :param controller: the ros2_control controller name; topics default to ``<controller>/commands``
        (forward_command) and ``<controller>/joint_trajectory`` (joint_trajectory), relative names that
        resolve in the node's namespace.
    :param topic: overrides the derived topic (required for joint_state, pose and twist).
    :param kind: for forward_command and joint_state: ``position`` or ``velocity``.
    :param joint_names: the commanded joints, in command order (defaults to the observed joints).
    :param time_from_start_s: joint_trajectory point time (s); 0 means one control period.
    :param frame_id: header frame of pose/twist commands.
    :param gripper_topic: Float64MultiArray topic for the gripper channels of pose/twist commands.
    """

    interface: str = _default('command.interface')
    mode: str = _default('command.mode')
    controller: str = _default('command.controller')
    topic: str = _default('command.topic')
    kind: str = _default('command.kind')
    joint_names: tuple[str, ...] = _default('command.joint_names')
    time_from_start_s: float = _default('command.time_from_start_s')
    frame_id: str = _default('command.frame_id')
    gripper_topic: str = _default('command.gripper_topic')

    def __post_init__(self) -> None:
        _check(self, 'command.')
        if self.mode == 'trajectory' and self.interface != 'joint_trajectory':
            raise ConfigError(f'parameter command.mode: trajectory needs command.interface joint_trajectory, '
                              f'not {self.interface}')
        if self.interface in ('joint_state', 'pose', 'twist') and not self.topic:
            raise ConfigError(f'parameter command.topic: required for interface {self.interface}')
        if self.interface in ('forward_command', 'joint_trajectory') and not (self.topic or self.controller):
            raise ConfigError('parameter command.controller: required to derive the command topic')

    def resolved_topic(self) -> str:
        """Return the command topic: ``topic``, or the ros2_control default for the controller (relative)."""
        if self.topic:
            return self.topic
        suffix = 'commands' if self.interface == 'forward_command' else 'joint_trajectory'
        return f'{self.controller.strip("/")}/{suffix}'


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

    lower_limits: tuple[float, ...] = _default('safety.lower_limits')
    upper_limits: tuple[float, ...] = _default('safety.upper_limits')
    max_step: tuple[float, ...] = _default('safety.max_step')
    on_violation: str = _default('safety.on_violation')

    def __post_init__(self) -> None:
        _check(self, 'safety.')
        if self.lower_limits and self.upper_limits:
            if len(self.lower_limits) != len(self.upper_limits):
                raise ConfigError(f'parameter safety.lower_limits: {len(self.lower_limits)} values but '
                                  f'safety.upper_limits has {len(self.upper_limits)}')
            bad = [i for i, (lo, hi) in enumerate(zip(self.lower_limits, self.upper_limits, strict=True)) if lo > hi]
            if bad:
                raise ConfigError(f'parameter safety.lower_limits: lower limit above upper limit for joints {bad}')


@dataclasses.dataclass(frozen=True)
class DiagnosticsConfig:
    """Thresholds of the /diagnostics levels (see :mod:`.diagnostics`); counts and rates are over ``window_s``.

    :param window_s: the trailing window (s).
    :param jitter_warn_ms: WARN above this tick jitter p99 (ms).  :param jitter_error_ms: ERROR above (ms).
    :param ticks_skipped_warn: WARN at this many skipped ticks.  :param ticks_skipped_error: ERROR at this many.
    :param underrun_warn: WARN above this share of time in underruns (0..1).  :param underrun_error: ERROR above.
    :param clamp_warn: WARN above this share of clamped commands (0..1).  :param clamp_error: ERROR above.
    :param dropped_telemetry_warn: WARN at this many dropped capture frames.  :param dropped_telemetry_error: ERROR.
    :raises ConfigError: for a value out of its bounds, or a WARN threshold above its ERROR threshold.
    """

    window_s: float = _default('diagnostics.window_s')
    jitter_warn_ms: float = _default('diagnostics.jitter_warn_ms')
    jitter_error_ms: float = _default('diagnostics.jitter_error_ms')
    ticks_skipped_warn: int = _default('diagnostics.ticks_skipped_warn')
    ticks_skipped_error: int = _default('diagnostics.ticks_skipped_error')
    underrun_warn: float = _default('diagnostics.underrun_warn')
    underrun_error: float = _default('diagnostics.underrun_error')
    clamp_warn: float = _default('diagnostics.clamp_warn')
    clamp_error: float = _default('diagnostics.clamp_error')
    dropped_telemetry_warn: int = _default('diagnostics.dropped_telemetry_warn')
    dropped_telemetry_error: int = _default('diagnostics.dropped_telemetry_error')

    def __post_init__(self) -> None:
        _check(self, 'diagnostics.')
        for name in schema_fields(DiagnosticsConfig, 'diagnostics.'):
            if '_warn' in name:            # jitter_warn_ms / jitter_error_ms, clamp_warn / clamp_error...
                other = name.replace('_warn', '_error')
                if getattr(self, name) > getattr(self, other):
                    raise ConfigError(f'parameter diagnostics.{name}: {getattr(self, name)} is above '
                                      f'diagnostics.{other} ({getattr(self, other)})')


@dataclasses.dataclass(frozen=True)
class NodeConfig:
    """Everything the policy node needs (its ROS parameters, validated).

    :param autostart: the node configures and activates itself (lifecycle) at start-up.
    :param model: deployment name on the worker.
    :param endpoint: ``host:port`` of the worker; empty: $SEQ_ENDPOINT, else ``127.0.0.1:50551`` (the client's
        rule), resolved here, so the field always holds the endpoint the node connects to.
    :param token: bearer token, empty for none.
    :param control_rate_hz: commands per second (Hz) on the steady clock.
    :param thread_priority: SCHED_FIFO priority (1-99) of the control thread; 0 for the default scheduler.
    :param enabled: False is a dry run: everything runs and is reported, nothing is commanded (its ticks
        count as held).
    :param on_underrun: ``hold`` republishes the last command; ``stop`` publishes nothing.
    :param stamp_source: age measured from the local ``receive`` time or the message ``header`` stamp.
    :param stale_grace_s: a source stale for longer than this (s) mid-run ends the episode ('error').
    :param connect_timeout_s: each connection attempt's timeout (s).
    :param max_in_flight: requests in flight at most per episode (the client's ``Policy.max_in_flight``).
    :param prefetch_margin: each episode's ``EpisodeSettings.prefetch_margin`` (mean deviations above the
        measured round trips that time the next request: safety against inferences).
    :param aggregate: each episode's ``EpisodeSettings.aggregate`` ('' keeps the contract's).
    :param status_rate_hz: ~/status rate (Hz).
    :param diagnostics_rate_hz: /diagnostics rate (Hz).
    :param cameras: the camera inputs; their names are ``camera_names`` (each once).
    :raises ConfigError: naming the parameter, for a value its schema entry refuses (every field the schema
        declares is checked), two cameras of one name or one observation key, safety limits whose
        lengths do not fit the commanded joints, or (``endpoint`` empty) a $SEQ_ENDPOINT that is no host:port.
    """

    autostart: bool = _default('autostart')
    model: str = _default('model')
    endpoint: str = _default('endpoint')
    token: str = _default('token')
    control_rate_hz: float = _default('control_rate_hz')
    thread_priority: int = _default('thread_priority')
    enabled: bool = _default('enabled')
    on_underrun: str = _default('on_underrun')
    stamp_source: str = _default('stamp_source')
    stale_grace_s: float = _default('stale_grace_s')
    connect_timeout_s: float = _default('connect_timeout_s')
    max_in_flight: int = _default('max_in_flight')
    prefetch_margin: float = _default('prefetch_margin')
    aggregate: str = _default('aggregate')
    status_rate_hz: float = _default('status_rate_hz')
    diagnostics_rate_hz: float = _default('diagnostics_rate_hz')
    joints: JointsConfig = dataclasses.field(default_factory=JointsConfig)
    cameras: tuple[CameraConfig, ...] = ()
    qos: QosConfig = dataclasses.field(default_factory=QosConfig)
    command: CommandConfig = dataclasses.field(default_factory=CommandConfig)
    safety: SafetyConfig = dataclasses.field(default_factory=SafetyConfig)
    diagnostics: DiagnosticsConfig = dataclasses.field(default_factory=DiagnosticsConfig)

    def __post_init__(self) -> None:
        object.__setattr__(self, 'cameras', tuple(self.cameras))
        if not self.endpoint:
            endpoint = resolve_endpoint(None)        # $SEQ_ENDPOINT, else 127.0.0.1:50551
            try:
                SCHEMA.check('endpoint', endpoint)
            except ConfigError as exc:
                raise ConfigError(f'$SEQ_ENDPOINT (read as parameter endpoint is empty): '
                                  f'{str(exc).removeprefix("parameter endpoint: ")}') from None
            object.__setattr__(self, 'endpoint', endpoint)
        _check(self, '')
        SCHEMA.check('camera_names', tuple(c.name for c in self.cameras))   # each camera's name once
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
