"""The parameter schema is the one declaration: the shipped YAML files, the dataclasses and the node agree with it.

- config/policy_node.yaml is exactly what the generator writes from the schema;
- every config/*.yaml validates against the schema (names, types, bounds), and a deliberately wrong file
  is refused, so the check itself cannot rot;
- the config dataclass defaults are the schema defaults; the ROS descriptors carry the schema's ranges;
- a writable parameter set at run time is checked against the schema (the on-set callback);
- every validation the schema declares is enforced by the config dataclasses: a value just outside each
  one is refused naming the parameter (the dataclasses find their checked fields in the schema, so a new
  bounded parameter cannot be accepted out of bounds).
"""

from __future__ import annotations

import dataclasses
import math
import re
import shlex
import subprocess
import sys
import time
import typing
from pathlib import Path
from typing import Any

import pytest

from sequence_ai_ros.exceptions import ConfigError
from sequence_ai_ros.node import parameter_schema
from sequence_ai_ros.node.config import (
    CAMERA_GROUP,
    CameraConfig,
    CommandConfig,
    JointsConfig,
    NodeConfig,
    QosConfig,
    SafetyConfig,
)

REPO = Path(__file__).resolve().parent.parent
SCHEMA = parameter_schema.load()
# policy_node's robot configs; sim_robot.yaml is the simulated robot's own (test_sim_node.py checks it)
ROBOT_CONFIGS = sorted(p for p in (REPO / 'config').glob('*.yaml')
                       if p.name not in ('policy_node.yaml', 'sim_robot.yaml'))


def test_shipped_defaults_file_is_what_the_generator_writes(tmp_path):
    shipped = (REPO / 'config' / 'policy_node.yaml').read_text()
    assert shipped == parameter_schema.params_yaml(), \
        'config/policy_node.yaml differs from the schema: regenerate it with ' \
        'python -m sequence_ai_ros.node.parameter_schema --write-yaml'
    out = tmp_path / 'policy_node.yaml'
    done = subprocess.run([sys.executable, '-m', 'sequence_ai_ros.node.parameter_schema', '--write-yaml', str(out)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert out.read_text() == shipped


def test_defaults_file_sets_every_scalar_at_its_schema_default():
    params = parameter_schema.check_params_file(REPO / 'config' / 'policy_node.yaml')
    for spec in SCHEMA:
        if spec.mapped_by or (spec.type.endswith('_array') and not spec.default):
            assert spec.name not in params        # written commented out
        else:
            assert params[spec.name] == spec.default, spec.name


@pytest.mark.parametrize('path', ROBOT_CONFIGS, ids=lambda p: p.name)
def test_robot_configs_validate_against_the_schema(path):
    params = parameter_schema.check_params_file(path)
    assert params['joints.names'], f'{path.name} names no joints'
    if path.name == 'g1.yaml':
        assert params['camera_names'] == ('cam_high',) and params['cameras.cam_high.type'] == 'compressed'


@pytest.mark.parametrize('params, match', [
    ({'control_rate_hz': 2000.0}, r'control_rate_hz: must be within \[1.0, 1000.0\]'),
    ({'control_rate_hz': 50}, 'control_rate_hz: expected double, got int 50 .*decimal point'),
    ({'contol_rate_hz': 50.0}, 'contol_rate_hz: not a parameter'),
    ({'qos': {'depth': 0}}, r'qos.depth: must be within \[1, 1000\]'),
    ({'on_underrun': 'zero'}, "on_underrun: 'zero' is not one of hold, stop"),
    ({'safety': {'upper_limits': [1.0, float('inf')]}}, r'safety.upper_limits: non-finite values at indices \[1\]'),
    ({'camera_names': ['front'], 'cameras': {'front': {'topic': '/f', 'type': 'jpeg'}}}, 'cameras.front.type'),
    ({'camera_names': ['front'], 'cameras': {'back': {'topic': '/b'}}}, 'cameras.back.topic: not a parameter'),
    ({'joints': {'names': ['a', 'a']}}, 'joints.names: values must be unique'),
])
def test_a_wrong_params_file_is_refused_naming_the_parameter(tmp_path, params, match):
    import yaml

    path = tmp_path / 'bad.yaml'
    path.write_text(yaml.safe_dump({'policy_node': {'ros__parameters': params}}))
    with pytest.raises(ConfigError, match=match):
        parameter_schema.check_params_file(path)


def test_dataclass_defaults_are_the_schema_defaults():
    for cls, prefix in ((NodeConfig, ''), (JointsConfig, 'joints.'), (QosConfig, 'qos.'), (CommandConfig, 'command.'),
                        (SafetyConfig, 'safety.')):
        for field in dataclasses.fields(cls):
            name = prefix + field.name
            if name in SCHEMA.specs:
                assert field.default == SCHEMA.default(name), name
                if name != 'endpoint':      # an empty endpoint is resolved (next test)
                    assert getattr(cls(), field.name) == SCHEMA.default(name), name


def test_an_empty_endpoint_is_seq_endpoint_else_the_default_port(monkeypatch):
    """The client's rule: a given endpoint wins; empty, $SEQ_ENDPOINT; else 127.0.0.1:50551."""
    monkeypatch.delenv('SEQ_ENDPOINT', raising=False)
    assert SCHEMA.default('endpoint') == ''
    assert NodeConfig().endpoint == '127.0.0.1:50551'
    monkeypatch.setenv('SEQ_ENDPOINT', 'gpu-box:50600')
    assert NodeConfig().endpoint == 'gpu-box:50600'
    assert NodeConfig(endpoint='10.0.0.2:50551').endpoint == '10.0.0.2:50551'
    monkeypatch.setenv('SEQ_ENDPOINT', 'gpu-box')
    with pytest.raises(ConfigError, match=r"\$SEQ_ENDPOINT .*must be host:port .*got 'gpu-box'"):
        NodeConfig()
    assert NodeConfig(endpoint='10.0.0.2:50551').endpoint == '10.0.0.2:50551'   # a set parameter never reads it


def test_control_rate_bounds_are_the_same_everywhere(rclpy_context):
    """The disagreement of issue 10: [1, 1000] at declaration but only > 0 in the dataclass."""
    import rclpy

    from sequence_ai_ros.node.parameters import declare_and_read

    for bad in (0.5, 1000.5, math.nan):
        with pytest.raises(ConfigError, match=r'control_rate_hz: must be within \[1.0, 1000.0\]'):
            NodeConfig(control_rate_hz=bad)
    NodeConfig(control_rate_hz=1.0)
    node = rclpy.create_node('schema_probe', context=rclpy_context)
    try:
        declare_and_read(node)
        for spec in SCHEMA:
            if spec.mapped_by:
                continue
            desc = node.describe_parameter(spec.name)
            assert desc.description == spec.description and desc.read_only == spec.read_only, spec.name
            bounds = spec.bounds()
            if bounds and spec.type == 'double':
                rng = desc.floating_point_range[0]
                assert (rng.from_value, rng.to_value) == bounds, spec.name
    finally:
        node.destroy_node()


def test_writable_parameters_are_checked_when_set(rclpy_context):
    import rclpy
    from rclpy.parameter import Parameter

    from sequence_ai_ros.node.parameters import declare_and_read, on_set_check

    node = rclpy.create_node('schema_set', context=rclpy_context)
    try:
        declare_and_read(node)
        node.add_on_set_parameters_callback(on_set_check)
        refused = node.set_parameters([Parameter('on_underrun', value='zeros')])[0]
        assert not refused.successful and "'zeros' is not one of hold, stop" in refused.reason
        assert node.get_parameter('on_underrun').value == 'hold'
        assert node.set_parameters([Parameter('on_underrun', value='stop')])[0].successful
        assert not node.set_parameters([Parameter('control_rate_hz', value=10.0)])[0].successful   # read_only
    finally:
        node.destroy_node()


def _node(*ros_args: str) -> subprocess.CompletedProcess:
    """Start policy_node as a process (its own ROS domain from conftest) and return once it exits."""
    return subprocess.run([sys.executable, '-m', 'sequence_ai_ros.node.main', *ros_args],
                          capture_output=True, text=True, timeout=60)


@pytest.mark.ros
@pytest.mark.parametrize('extra, message', [
    (['-p', 'contrl_rate_hz:=10.0'], 'unknown parameters: contrl_rate_hz (did you mean control_rate_hz?)'),
    (['-p', 'safety.max_stepp:=[0.1]'], 'unknown parameters: safety.max_stepp (did you mean safety.max_step?)'),
    (['-p', 'cameras.back.topic:=/x'], 'unknown parameters: cameras.back.topic'),
    (['-p', 'endpoint:=notaport'], 'parameter endpoint: must be host:port'),
    (['-p', 'endpoint:=127.0.0.1:99999'], 'parameter endpoint: must be host:port'),
    (['-p', 'camera_names:=[cam.high]', '-p', 'cameras.cam.high.topic:=/x'], 'cannot be part of a parameter name'),
])
def test_the_node_refuses_unknown_and_malformed_parameters_naming_them(extra: list[str], message: str) -> None:
    """A misspelt safety limit must stop the node, not be dropped in silence (exit 2, the name on stderr)."""
    done = _node('--ros-args', '-p', 'model:=x', '-p', 'joints.names:=[a]', *extra)
    assert done.returncode == 2, (done.returncode, done.stderr[-2000:])
    assert message in done.stderr, done.stderr[-2000:]


@pytest.mark.ros
def test_the_run_example_of_the_node_package_starts_the_node_as_typed(tmp_path, processes) -> None:
    """``ros2 run ...`` in sequence_ai_ros/node's docstring starts the node; the template alone is refused.

    It runs as ``ros2 run`` runs the console script (``python -m sequence_ai_ros.node.main``), from the
    repository root; without autostart the node waits for lifecycle transitions, so no worker is needed.
    """
    import sequence_ai_ros.node

    example = re.search(r'``(ros2 run sequence_ai_ros policy_node --ros-args [^`]+)``',
                        ' '.join((sequence_ai_ros.node.__doc__ or '').split()))
    assert example, 'no ros2 run example in sequence_ai_ros/node/__init__.py'
    argv = shlex.split(example.group(1))[4:]         # after: ros2 run sequence_ai_ros policy_node
    log = tmp_path / 'node.log'
    with open(log, 'w') as out:
        proc = processes.spawn([sys.executable, '-m', 'sequence_ai_ros.node.main', *argv], cwd=REPO,
                               stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while proc.poll() is None and 'waiting for lifecycle transitions' not in log.read_text() \
                and time.monotonic() < deadline:
            time.sleep(0.1)
    assert proc.poll() is None and 'waiting for lifecycle transitions' in log.read_text(), log.read_text()
    template = _node('--ros-args', '--params-file', str(REPO / parameter_schema.DEFAULTS_FILE))
    assert template.returncode == 2, template.stderr[-2000:]
    assert 'parameter model: empty' in template.stderr, template.stderr[-2000:]


@pytest.mark.ros                # the node process loads rcl, even for --help
def test_policy_node_help_lists_every_parameter() -> None:
    done = _node('--help')
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith('usage: policy_node --ros-args')
    for name in ('model', 'endpoint', 'control_rate_hz', 'safety.max_step', 'cameras.<name>.topic', 'autostart'):
        assert f'  {name}  (' in done.stdout, name


def _outside(spec: parameter_schema.ParamSpec, rule: str, args: list) -> list[Any]:
    """Values of ``spec``'s type just outside validation ``rule`` (every other rule of the entry passes)."""
    integer = spec.type.startswith('int')

    def below(x: float) -> float:
        return x - 1 if integer else math.nextafter(float(x), -math.inf)

    def above(x: float) -> float:
        return x + 1 if integer else math.nextafter(float(x), math.inf)

    if rule == 'bounds<>':
        values = [below(args[0]), above(args[1])]
    elif rule in ('gt<>', 'lt<>'):
        values = [args[0] if integer else float(args[0])]
    elif rule == 'gt_eq<>':
        values = [below(args[0])]
    elif rule == 'lt_eq<>':
        values = [above(args[0])]
    elif rule == 'one_of<>':
        values = ['not-' + str(args[0][0])]
    elif rule == 'not_empty<>':
        values = [() if spec.type.endswith('_array') else '']
    elif rule == 'unique<>':
        values = [('a', 'a')]
    elif rule == 'sequence_ai_ros::no_empty_strings':
        values = [('a', '')]
    elif rule == 'sequence_ai_ros::name_parts':
        values = [('cam.high',), ('9cam',)]
    elif rule == 'sequence_ai_ros::endpoint':
        values = ['notaport', '127.0.0.1:0', '127.0.0.1:65536']
    elif rule == 'sequence_ai_ros::all_finite':
        values = [(math.inf,), (math.nan,)]
    elif rule == 'sequence_ai_ros::all_positive':
        values = [(0.0,), (-1.0,)]
    else:
        raise AssertionError(f'{spec.name}: no value outside validation {rule}; teach _outside this validator')
    if spec.type.endswith('_array'):
        values = [v if isinstance(v, tuple) else (v,) for v in values]
    return values


def _groups() -> dict[str, type]:
    """The schema group of each nested config dataclass of NodeConfig, read from NodeConfig's fields."""
    hints = typing.get_type_hints(NodeConfig)
    groups = {f.name + '.': hints[f.name] for f in dataclasses.fields(NodeConfig)
              if dataclasses.is_dataclass(hints[f.name])}
    (camera,) = typing.get_args(hints['cameras'])[:1]
    return {**groups, CAMERA_GROUP: camera}


def _build(name: str, value: Any) -> tuple[str, Any]:
    """Build the NodeConfig that holds ``value`` as schema parameter ``name``; return (concrete name, build)."""
    if name == 'camera_names':
        return name, lambda: NodeConfig(cameras=tuple(CameraConfig(n, f'/cam{i}', key=f'k{i}')
                                                      for i, n in enumerate(value)))
    group, leaf = name[:name.rfind('.') + 1], name[name.rfind('.') + 1:]
    groups = _groups()
    cls = NodeConfig if not group else groups.get(group)
    assert cls is not None, f'schema group {group} is held by no config dataclass of NodeConfig'
    assert leaf in {f.name for f in dataclasses.fields(cls)}, f'schema parameter {name} has no field in {cls.__name__}'
    if not group:
        return name, lambda: NodeConfig(**{leaf: value})
    if group == CAMERA_GROUP:
        given = {'name': 'front', 'topic': '/front', leaf: value}
        return f'cameras.front.{leaf}', lambda: NodeConfig(cameras=(cls(**given),))
    return name, lambda: NodeConfig(**{group[:-1]: cls(**{leaf: value})})


def test_every_validation_in_the_schema_is_enforced_by_the_config_dataclasses():
    """A value just outside each declared validation (bounds, comparisons, choices...) is a ConfigError naming it.

    A schema entry whose dataclass lacks the field fails here (TypeError), and so would a field the
    dataclass forgot to check: NodeConfig(status_depth=0) for a status_depth bounded [1, 1000].
    """
    tried: set[str] = set()
    for spec in SCHEMA:
        for rule, args in spec.validation.items():
            for value in _outside(spec, rule, args):
                concrete, build = _build(spec.name, value)
                with pytest.raises(ConfigError, match=rf'parameter {concrete.replace(".", "[.]")}: ') as info:
                    build()
                assert 'unknown validator' not in str(info.value), (spec.name, rule)
                tried.add(spec.name)
    assert tried == {spec.name for spec in SCHEMA if spec.validation} and len(tried) > 30


def test_a_value_at_each_bound_is_accepted():
    """The probes above are just outside: the bounds themselves pass (inclusive ``bounds<>``)."""
    for spec in SCHEMA:
        bounds = spec.bounds()
        if bounds is None or spec.name.startswith('diagnostics.'):   # warn <= error is a cross check
            continue
        for value in bounds:
            value = value if spec.type.startswith('int') else float(value)
            _, build = _build(spec.name, value)
            build()


def test_max_in_flight_defaults_to_the_clients_pipelining_bound():
    from sequence_ai_ros.client.engine import MAX_IN_FLIGHT

    assert SCHEMA.default('max_in_flight') == NodeConfig().max_in_flight == MAX_IN_FLIGHT
    assert NodeConfig(max_in_flight=1).max_in_flight == 1
    with pytest.raises(ConfigError, match='max_in_flight'):
        NodeConfig(max_in_flight=0)
