"""The ROS side of the parameter schema: declarations with descriptors, and the on-set checks.

Every parameter, its type, default, description, ``read_only`` flag and validation are declared once,
in ``policy_node_parameters.yaml`` (read by :mod:`.parameter_schema`). Here each becomes a
``declare_parameter`` with a ParameterDescriptor (description, read_only, ``bounds<>`` as an integer or
floating-point range, the rest of the validation in ``additional_constraints``), and
:func:`on_set_check` validates changes at run time (``add_on_set_parameters_callback``). Cameras are a
list of names (``camera_names``) with one mapped parameter group each (``cameras.<name>.topic|type|key|
max_age_s``), since ROS parameters cannot hold a list of dicts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rcl_interfaces.msg import FloatingPointRange, IntegerRange, ParameterDescriptor, SetParametersResult
from rclpy.exceptions import InvalidParameterValueException, ParameterException
from rclpy.node import Node
from rclpy.parameter import Parameter

from sequence_ai_ros.exceptions import ConfigError
from sequence_ai_ros.node.config import (
    SCHEMA,
    CameraConfig,
    CommandConfig,
    DiagnosticsConfig,
    JointsConfig,
    NodeConfig,
    QosConfig,
    SafetyConfig,
)
from sequence_ai_ros.node.parameter_schema import ParamSpec

#: Array types rclpy cannot infer from an empty default: the type is declared instead.
_ARRAY_TYPES = {
    'string_array': Parameter.Type.STRING_ARRAY,
    'double_array': Parameter.Type.DOUBLE_ARRAY,
    'int_array': Parameter.Type.INTEGER_ARRAY,
    'bool_array': Parameter.Type.BOOL_ARRAY,
}


def descriptor(spec: ParamSpec) -> ParameterDescriptor:
    """The ParameterDescriptor of one schema entry (range from ``bounds<>``; all rules in words)."""
    desc = ParameterDescriptor(description=spec.description, read_only=spec.read_only,
                               additional_constraints=spec.constraints())
    bounds = spec.bounds()
    if bounds is not None and spec.type == 'double':
        desc.floating_point_range = [FloatingPointRange(from_value=float(bounds[0]), to_value=float(bounds[1]))]
    elif bounds is not None and spec.type == 'int':
        desc.integer_range = [IntegerRange(from_value=int(bounds[0]), to_value=int(bounds[1]))]
    return desc


def _declare(node: Node, name: str, default: Any = None) -> Any:
    """Declare parameter ``name`` from its schema entry and return its validated value.

    :param default: overrides the schema default (a mapped ``key`` defaults to the camera's name).
    :raises ConfigError: naming the parameter when rclpy refuses the given value (out of the declared
        range, NaN, or of the wrong type, e.g. an integer for a double) or the schema's validation does.
    """
    spec = SCHEMA.spec(name)
    default = spec.default if default is None else default
    value = _ARRAY_TYPES[spec.type] if spec.type in _ARRAY_TYPES else default
    bounds = spec.bounds()
    try:
        param = node.declare_parameter(name, value, descriptor(spec))
    except ParameterException as exc:
        detail = exc.args[0] if exc.args else str(exc)
        if isinstance(exc, InvalidParameterValueException) and bounds is not None:
            detail = f'must be within [{bounds[0]}, {bounds[1]}] ({detail})'
        elif "'INTEGER', expecting type 'DOUBLE'" in detail:
            detail += ' (write a double with a decimal point, e.g. 50.0)'
        raise ConfigError(f'parameter {name}: {detail}') from None
    got = default if param.value is None else param.value
    return SCHEMA.check(name, got)


def declare_and_read(node: Node) -> NodeConfig:
    """Declare every schema parameter on ``node`` and return them as a validated :class:`NodeConfig`.

    :raises ConfigError: when a value is invalid (refused by its descriptor, the schema or
        :class:`NodeConfig`); the message names the parameter.
    """
    top = {f.name: _declare(node, f.name) for f in _fields(NodeConfig)}
    joints = JointsConfig(**{f: _declare(node, f'joints.{f}') for f in _names(JointsConfig)})
    cameras = []
    for name in _declare(node, 'camera_names'):
        prefix = f'cameras.{name}.'
        cameras.append(CameraConfig(
            name=name, topic=_declare(node, prefix + 'topic'), type=_declare(node, prefix + 'type'),
            key=_declare(node, prefix + 'key', name), max_age_s=_declare(node, prefix + 'max_age_s')))
    qos = QosConfig(**{f: _declare(node, f'qos.{f}') for f in _names(QosConfig)})
    command = CommandConfig(**{f: _declare(node, f'command.{f}') for f in _names(CommandConfig)})
    safety = SafetyConfig(**{f: _declare(node, f'safety.{f}') for f in _names(SafetyConfig)})
    diagnostics = DiagnosticsConfig(**{f: _declare(node, f'diagnostics.{f}') for f in _names(DiagnosticsConfig)})
    _refuse_unknown(node)
    return NodeConfig(**top, joints=joints, cameras=tuple(cameras), qos=qos, command=command, safety=safety,
                      diagnostics=diagnostics)


def _refuse_unknown(node: Node) -> None:
    """Refuse parameters given to the node (params file, ``-p``) that it does not declare.

    A misspelt safety limit must not be dropped in silence. rclpy keeps a node's overrides in
    ``_parameter_overrides`` (Humble to Kilted); ``use_sim_time`` and ``qos_overrides.*`` are rclpy's own.

    :raises ConfigError: naming each unknown parameter and the closest declared name.
    """
    import difflib

    given = getattr(node, '_parameter_overrides', {}) or {}
    unknown = sorted(n for n in given if not node.has_parameter(n) and not n.startswith('qos_overrides.'))
    if not unknown:
        return
    declared = [name for name in node._parameters] if hasattr(node, '_parameters') else []
    hints = []
    for name in unknown:
        close = difflib.get_close_matches(name, declared, n=1)
        hints.append(f'{name} (did you mean {close[0]}?)' if close else name)
    raise ConfigError(f'unknown parameters: {", ".join(hints)}; policy_node declares only the parameters of '
                      'config/policy_node.yaml (a camera\'s settings need its name in camera_names)')


def _fields(cls: type) -> list[Any]:
    import dataclasses

    return [f for f in dataclasses.fields(cls) if f.name in SCHEMA.specs]


def _names(cls: type) -> list[str]:
    import dataclasses

    return [f.name for f in dataclasses.fields(cls)]


def on_set_check(params: Sequence[Parameter]) -> SetParametersResult:
    """Validate a set-parameters request against the schema (for ``add_on_set_parameters_callback``).

    ``read_only`` parameters are refused by rclpy itself; this checks the writable ones (types and
    validation), so a bad value never reaches the running node.
    """
    for p in params:
        try:
            spec = SCHEMA.spec(p.name)
        except ConfigError:
            continue      # use_sim_time and other parameters rclpy owns
        try:
            spec.check(p.value, p.name)
        except ConfigError as exc:
            return SetParametersResult(successful=False, reason=str(exc))
    return SetParametersResult(successful=True)
