"""Every ROS parameter of ``policy_node``, declared in one place with descriptors.

Defaults and comments live in ``config/policy_node.yaml``. Parameters that shape subscriptions,
publishers or the control thread are ``read_only`` (a change needs a restart); ranges are declared
where they exist. Cameras are a list of names (``camera_names``) with one parameter group each
(``cameras.<name>.topic|type|key|max_age_s``), since ROS parameters cannot hold a list of dicts.
"""

from __future__ import annotations

from typing import Any

from rcl_interfaces.msg import FloatingPointRange, IntegerRange, ParameterDescriptor
from rclpy.exceptions import InvalidParameterValueException, ParameterException
from rclpy.node import Node
from rclpy.parameter import Parameter

from sequence_ai_ros.exceptions import ConfigError
from sequence_ai_ros.node.config import (
    CameraConfig,
    CommandConfig,
    JointsConfig,
    NodeConfig,
    QosConfig,
    SafetyConfig,
)

_TYPES = {
    list[str]: Parameter.Type.STRING_ARRAY,
    list[float]: Parameter.Type.DOUBLE_ARRAY,
}


def _declare(node: Node, name: str, default: Any, description: str, *, read_only: bool = True,
             float_range: tuple[float, float] | None = None, int_range: tuple[int, int] | None = None,
             array: type | None = None) -> Any:
    """Declare one parameter and return its value (``default`` when an array is left unset).

    :raises ConfigError: naming the parameter when rclpy refuses the given value (out of the declared
        range, NaN, or of the wrong type, e.g. an integer for a double).
    """
    desc = ParameterDescriptor(description=description, read_only=read_only)
    bounds = float_range or int_range
    if float_range is not None:
        desc.floating_point_range = [FloatingPointRange(from_value=float(float_range[0]),
                                                        to_value=float(float_range[1]))]
    if int_range is not None:
        desc.integer_range = [IntegerRange(from_value=int_range[0], to_value=int_range[1])]
    value = _TYPES[array] if array is not None else default
    try:
        param = node.declare_parameter(name, value, desc)
    except ParameterException as exc:
        detail = exc.args[0] if exc.args else str(exc)
        if isinstance(exc, InvalidParameterValueException) and bounds is not None:
            detail = f'must be within [{bounds[0]}, {bounds[1]}] ({detail})'
        elif "'INTEGER', expecting type 'DOUBLE'" in detail:
            detail += ' (write a double with a decimal point, e.g. 50.0)'
        raise ConfigError(f'parameter {name}: {detail}') from None
    return default if param.value is None else param.value


def declare_and_read(node: Node) -> NodeConfig:
    """Declare all parameters on ``node`` and return them as a validated :class:`NodeConfig`.

    :raises ConfigError: when a value is invalid (refused by its descriptor or by :class:`NodeConfig`);
        the message names the parameter.
    """
    d = NodeConfig()
    top = dict(
        model=_declare(node, 'model', d.model, 'deployment name on the worker'),
        endpoint=_declare(node, 'endpoint', d.endpoint, 'worker address host:port'),
        token=_declare(node, 'token', d.token, 'bearer token for the worker; empty for none'),
        control_rate_hz=_declare(node, 'control_rate_hz', d.control_rate_hz,
                                 'commands per second (Hz), steady clock', float_range=(1.0, 1000.0)),
        enabled=_declare(node, 'enabled', d.enabled,
                         'false = dry run: run and report everything, publish no command', read_only=False),
        on_underrun=_declare(node, 'on_underrun', d.on_underrun,
                             'hold: republish the last command; stop: publish nothing', read_only=False),
        stamp_source=_declare(node, 'stamp_source', d.stamp_source,
                              'age of a source from its local receive time (receive) or header stamp'),
        stale_grace_s=_declare(node, 'stale_grace_s', d.stale_grace_s,
                               'a source stale this long (s) mid-run ends the episode with error',
                               float_range=(0.01, 3600.0)),
        connect_timeout_s=_declare(node, 'connect_timeout_s', d.connect_timeout_s,
                                   'timeout of one connection attempt to the worker (s)',
                                   float_range=(0.1, 600.0)),
        status_rate_hz=_declare(node, 'status_rate_hz', d.status_rate_hz, '~/status rate (Hz)',
                                float_range=(0.1, 50.0)),
        diagnostics_rate_hz=_declare(node, 'diagnostics_rate_hz', d.diagnostics_rate_hz,
                                     '/diagnostics rate (Hz)', float_range=(0.1, 50.0)),
    )
    jd = JointsConfig()
    joints = JointsConfig(
        topic=_declare(node, 'joints.topic', jd.topic, 'sensor_msgs/JointState topic'),
        names=tuple(_declare(node, 'joints.names', [], 'observed joints, in state order', array=list[str])),
        max_age_s=_declare(node, 'joints.max_age_s', jd.max_age_s, 'max age of joint_states (s)',
                           float_range=(0.001, 3600.0)))
    cameras = []
    for name in _declare(node, 'camera_names', [], 'camera entries; each has cameras.<name>.*',
                         array=list[str]):
        prefix = f'cameras.{name}.'
        cameras.append(CameraConfig(
            name=name,
            topic=_declare(node, prefix + 'topic', '', 'image topic'),
            type=_declare(node, prefix + 'type', 'image', 'image (sensor_msgs/Image) or compressed'),
            key=_declare(node, prefix + 'key', name, 'observation key in the contract'),
            max_age_s=_declare(node, prefix + 'max_age_s', 0.5, 'max age (s)', float_range=(0.001, 3600.0))))
    qd = QosConfig()
    qos = QosConfig(
        reliability=_declare(node, 'qos.reliability', qd.reliability, 'best_effort (sensor data) or reliable'),
        depth=_declare(node, 'qos.depth', qd.depth, 'subscription history depth', int_range=(1, 1000)))
    cd = CommandConfig()
    command = CommandConfig(
        interface=_declare(node, 'command.interface', cd.interface,
                           'forward_command | joint_trajectory | joint_state | pose | twist'),
        controller=_declare(node, 'command.controller', cd.controller, 'ros2_control controller name'),
        topic=_declare(node, 'command.topic', cd.topic, 'command topic; empty derives it from the controller'),
        kind=_declare(node, 'command.kind', cd.kind, 'position or velocity (forward_command, joint_state)'),
        joint_names=tuple(_declare(node, 'command.joint_names', [], 'commanded joints; empty = joints.names',
                                   array=list[str])),
        time_from_start_s=_declare(node, 'command.time_from_start_s', cd.time_from_start_s,
                                   'joint_trajectory point time (s); 0 = one control period',
                                   float_range=(0.0, 60.0)),
        frame_id=_declare(node, 'command.frame_id', cd.frame_id, 'frame of pose/twist commands'),
        gripper_topic=_declare(node, 'command.gripper_topic', cd.gripper_topic,
                               'Float64MultiArray topic for gripper channels of pose/twist commands'))
    sd = SafetyConfig()
    safety = SafetyConfig(
        lower_limits=tuple(_declare(node, 'safety.lower_limits', [], 'per commanded joint lower limit',
                                    array=list[float])),
        upper_limits=tuple(_declare(node, 'safety.upper_limits', [], 'per commanded joint upper limit',
                                    array=list[float])),
        max_step=tuple(_declare(node, 'safety.max_step', [], 'largest change per tick (1 or per joint)',
                                array=list[float])),
        on_violation=_declare(node, 'safety.on_violation', sd.on_violation, 'clamp or stop'))
    return NodeConfig(**top, joints=joints, cameras=tuple(cameras), qos=qos, command=command, safety=safety)
