"""Static checks of launch/*.launch.py (``launch`` cannot be installed here) and of config/*.yaml.

The launch files are parsed with ``ast``: every executable they start is a console script of setup.py
(or a declared ROS executable), every parameter file they name exists in config/, every
LaunchConfiguration they read is declared, and every argument an included launch file receives is
declared there. Every config file is loaded into a real node: it names only declared parameters, with
valid values.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
LAUNCH = sorted((REPO / 'launch').glob('*.launch.py'))
#: policy_node's params files; config/sim_robot.yaml is the simulated robot's (test_sim_node.py checks it).
CONFIGS = sorted(p for p in (REPO / 'config').glob('*.yaml') if p.name != 'sim_robot.yaml')


def _console_scripts() -> set[str]:
    tree = ast.parse((REPO / 'setup.py').read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values, strict=True):
                if isinstance(key, ast.Constant) and key.value == 'console_scripts':
                    return {ast.literal_eval(e).split('=')[0].strip() for e in value.elts}
    raise AssertionError('setup.py declares no console_scripts')


def _calls(tree: ast.AST, name: str) -> list[ast.Call]:
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call)
            and getattr(n.func, 'id', getattr(n.func, 'attr', None)) == name]


def _kw(call: ast.Call, name: str) -> ast.AST | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def _strings(tree: ast.AST) -> list[str]:
    return [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def _declared(tree: ast.AST) -> set[str]:
    return {c.args[0].value for c in _calls(tree, 'DeclareLaunchArgument')}


def test_launch_files_exist_and_define_a_description():
    names = {p.name for p in LAUNCH}
    assert {'policy.launch.py', 'replay.launch.py'} <= names
    for path in LAUNCH:
        tree = ast.parse(path.read_text(), filename=str(path))
        assert any(isinstance(n, ast.FunctionDef) and n.name == 'generate_launch_description' for n in tree.body)


def test_policy_launch_declares_the_issue_arguments():
    tree = ast.parse((REPO / 'launch' / 'policy.launch.py').read_text())
    assert {'model', 'endpoint', 'params_file', 'namespace', 'use_sim_time', 'autostart'} <= _declared(tree)


#: Launch arguments that override the params files: declared with default '' (not given), or required.
OVERRIDES = ('model', 'endpoint', 'use_sim_time', 'autostart')


@pytest.mark.parametrize('path', LAUNCH, ids=lambda p: p.name)
def test_launch_arguments_that_override_the_params_files_default_to_not_given(path):
    """An argument left out must not override params_file: its default is '' (not given), and only then true."""
    tree = ast.parse(path.read_text())
    declared = {c.args[0].value: _kw(c, 'default_value') for c in _calls(tree, 'DeclareLaunchArgument')}
    assert 'autostart' in declared, f'{path.name} does not declare autostart'
    for name in OVERRIDES:
        if name in declared and declared[name] is not None:       # None: a required argument (replay's model)
            assert isinstance(declared[name], ast.Constant) and declared[name].value == '', (path.name, name)
    from sequence_ai_ros.node.parameter_schema import load

    assert load().default('autostart') is False, 'the node itself waits for transitions unless told to autostart'


def test_replay_loops_the_bag_by_default():
    """A 15 s bag that ends while the user types a goal leaves the node's sources stale: replay loops by default."""
    tree = ast.parse((REPO / 'launch' / 'replay.launch.py').read_text())
    declared = {c.args[0].value: _kw(c, 'default_value') for c in _calls(tree, 'DeclareLaunchArgument')}
    assert isinstance(declared['loop'], ast.Constant) and declared['loop'].value == 'true'


def _policy_params(params_file='', **given):
    from sequence_ai_ros.node.launch_parameters import policy_node_parameters

    return policy_node_parameters(str(REPO), '', str(params_file) if params_file else '', **given)


def test_a_launch_argument_given_overrides_params_file_and_one_left_out_does_not(tmp_path):
    """config/policy_node.yaml < autostart true (the launch files') < params_file < a launch argument given."""
    from sequence_ai_ros.exceptions import ConfigError

    plain = _policy_params(REPO / 'config' / 'g1.yaml')
    assert plain['autostart'] is True and plain.get('use_sim_time', False) is False
    doc = yaml.safe_load((REPO / 'config' / 'g1.yaml').read_text())
    doc['/**/policy_node']['ros__parameters'].update(use_sim_time=True, autostart=False, model='from_file')
    robot = tmp_path / 'g1_sim.yaml'
    robot.write_text(yaml.safe_dump(doc))
    files = _policy_params(robot, model='', endpoint='', use_sim_time='', autostart='')
    assert (files['use_sim_time'], files['autostart'], files['model']) == (True, False, 'from_file')
    assert files['endpoint'] == plain['endpoint'] and files['joints.names'][0] == 'kLeftShoulderPitch'
    given = _policy_params(robot, model='x', endpoint='gpu:1', use_sim_time='false', autostart='True')
    assert (given['use_sim_time'], given['autostart'], given['model'], given['endpoint']) == (False, True, 'x', 'gpu:1')
    assert _policy_params(autostart='0')['autostart'] is False
    with pytest.raises(ConfigError, match='autostart'):
        _policy_params(autostart='ture')


def test_a_params_file_over_a_shipped_one_overrides_parameter_by_parameter(tmp_path):
    """sim.launch.py: the user's joints.max_age_s over config/sim_policy_node.yaml keeps its joints.names."""
    from sequence_ai_ros.node.launch_parameters import policy_node_parameters

    user = tmp_path / 'user.yaml'
    user.write_text(yaml.safe_dump({'/**/policy_node': {'ros__parameters': {'joints': {'max_age_s': 2.0}}}}))
    params = policy_node_parameters(str(REPO), 'sim1', str(user), shipped_file=str(REPO / 'config' /
                                                                                  'sim_policy_node.yaml'))
    assert params['joints.max_age_s'] == 2.0 and params['control_rate_hz'] == 80.0
    assert params['joints.names'][:4] == ['ee_x', 'ee_y', 'ee_z', 'gripper'] and params['autostart'] is True


def test_default_topics_are_relative_so_a_namespace_moves_them():
    from sequence_ai_ros.node.config import CommandConfig, JointsConfig

    assert not JointsConfig().topic.startswith('/')
    for interface in ('forward_command', 'joint_trajectory'):
        assert not CommandConfig(interface=interface, controller='arm').resolved_topic().startswith('/')
    for path in CONFIGS:
        text = path.read_text()
        assert not re.search(r'^\s*topic: /', text, re.M), f'{path.name} has an absolute topic'


@pytest.mark.parametrize('path', LAUNCH, ids=lambda p: p.name)
def test_every_executable_exists(path):
    tree = ast.parse(path.read_text())
    scripts = _console_scripts()
    started = 0
    for call in _calls(tree, 'Node'):
        exe = _kw(call, 'executable')
        assert isinstance(exe, ast.Constant), f'{path.name}: Node executable must be a literal'
        assert exe.value in scripts, f'{path.name}: executable {exe.value!r} is not a console script of setup.py'
        pkg = _kw(call, 'package')
        assert pkg is not None
        started += 1
    for call in _calls(tree, 'ExecuteProcess'):
        # a console script runs from the package's lib/<package> (not on PATH after sourcing the workspace;
        # a bare 'seq' there is coreutils' seq)
        first = _kw(call, 'cmd').elts[0]
        assert isinstance(first, ast.Call) and getattr(first.func, 'id', '') == 'PathJoinSubstitution', \
            f'{path.name}: ExecuteProcess must start lib/<package>/<script>, not {ast.dump(first)}'
        parts = first.args[0].elts
        assert getattr(parts[0].func, 'id', '') == 'FindPackagePrefix', ast.dump(parts[0])
        assert [getattr(e, 'value', None) for e in parts[1:3]] == ['lib', None] and parts[3].value in scripts, \
            f'{path.name}: {ast.dump(first)}'
        started += 1
    assert started or _calls(tree, 'IncludeLaunchDescription')


@pytest.mark.parametrize('path', LAUNCH, ids=lambda p: p.name)
def test_every_file_named_exists(path):
    tree = ast.parse(path.read_text())
    named = set()
    for s in _strings(tree):
        named.update(re.findall(r'(?:config/)?[\w.]+\.yaml|[\w]+\.launch\.py', s))
    for call in _calls(tree, 'PathJoinSubstitution'):
        parts = [e.value for e in call.args[0].elts if isinstance(e, ast.Constant)]
        if parts and parts[-1].endswith(('.yaml', '.py')):
            named.add('/'.join(parts[-2:]))
    assert named, f'{path.name} names no file'
    for name in named:
        candidates = [REPO / name, REPO / 'config' / name, REPO / 'launch' / name]
        assert any(c.is_file() for c in candidates), f'{path.name} names {name}, which is not in the package'


@pytest.mark.parametrize('path', LAUNCH, ids=lambda p: p.name)
def test_every_launch_configuration_is_declared(path):
    tree = ast.parse(path.read_text())
    declared = _declared(tree)
    used = {c.args[0].value for c in _calls(tree, 'LaunchConfiguration')}
    assert used <= declared, f'{path.name}: used but not declared: {sorted(used - declared)}'
    assert declared <= used, f'{path.name}: declared but never used: {sorted(declared - used)}'
    for call in _calls(tree, 'IncludeLaunchDescription'):
        included = [s for s in _strings(call) if s.endswith('.launch.py')]
        assert included, f'{path.name}: include of an unnamed file'
        child = _declared(ast.parse((REPO / 'launch' / included[0]).read_text()))
        args = _kw(call, 'launch_arguments')
        keys = {k.value for k in args.func.value.keys} if args is not None else set()
        assert keys <= child, f'{path.name} passes {sorted(keys - child)} that {included[0]} does not declare'


@pytest.mark.parametrize('path', CONFIGS, ids=lambda p: p.name)
def test_config_names_only_declared_parameters(path, rclpy_context):
    import rclpy
    from rclpy.parameter import Parameter

    from sequence_ai_ros.node.parameters import declare_and_read

    doc = yaml.safe_load(path.read_text())
    assert list(doc) == ['/**/policy_node'], f'{path.name}: key it /**/policy_node, so a namespace keeps it'
    params = doc['/**/policy_node']['ros__parameters']
    flat: dict[str, object] = {}

    def walk(prefix: str, value: object) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f'{prefix}{k}.', v)
        else:
            flat[prefix[:-1]] = value
    walk('', params)
    node = rclpy.create_node('config_check', context=rclpy_context,
                             parameter_overrides=[Parameter(k, value=v) for k, v in flat.items()])
    try:
        cfg = declare_and_read(node)
        undeclared = [k for k in flat if not node.has_parameter(k)]
        assert not undeclared, f'{path.name} names undeclared parameters {undeclared}'
    finally:
        node.destroy_node()
    if path.name == 'g1.yaml':
        assert len(cfg.joints.names) == 26 and [c.key for c in cfg.cameras] == ['cam_high']
    if path.name == 'wx200.yaml':
        assert len(cfg.joints.names) == 8 and not cfg.cameras


def test_the_launch_files_read_the_params_keys_rcl_would_match_for_their_node(tmp_path):
    """The launch files merge params files themselves: a key naming the node in its namespace must apply too."""
    from sequence_ai_ros.node.launch_parameters import node_parameters

    params = tmp_path / 'robot.yaml'
    params.write_text(yaml.safe_dump({
        '/**': {'ros__parameters': {'control_rate_hz': 30.0, 'model': 'all'}},
        '/robot1/policy_node': {'ros__parameters': {'model': 'robot1'}},
        '/robot2/policy_node': {'ros__parameters': {'model': 'robot2'}},
        '/robot1/other_node': {'ros__parameters': {'model': 'not ours'}}}))

    def read(namespace=''):
        return node_parameters(str(params), 'policy_node', namespace)
    assert read('/robot1') == {'control_rate_hz': 30.0, 'model': 'robot1'}
    assert read('robot2') == {'control_rate_hz': 30.0, 'model': 'robot2'}
    assert read() == {'control_rate_hz': 30.0, 'model': 'all'}


#: sim.launch.py's arguments for sim_robot: each one of its parameters, applied only when given.
SIM_ARGUMENTS = ('task', 'benchmark_seed', 'split', 'index', 'max_steps', 'real_time_factor', 'camera_names',
                 'camera_width', 'camera_height', 'camera_rate_hz')


def test_sim_launch_arguments_are_sim_robot_parameters_of_their_type_not_given_by_default():
    """Each sim argument names a sim_robot parameter, is read as its type, and says the default the file sets."""
    from sequence_ai_ros.sim.config import SimConfig

    tree = ast.parse((REPO / 'launch' / 'sim.launch.py').read_text())
    calls = {c.args[0].value: c for c in _calls(tree, 'DeclareLaunchArgument')}
    assert set(calls) == {*SIM_ARGUMENTS, 'sim_params_file', 'params_file', 'model', 'endpoint', 'namespace',
                          'autostart'}
    assert all(_kw(c, 'default_value').value == '' for c in calls.values())
    fields = {f.name: f.type for f in SimConfig.fields()}
    shipped = yaml.safe_load((REPO / 'config' / 'sim_robot.yaml').read_text())['/**/sim_robot']['ros__parameters']
    given = next(d for d in ast.walk(tree) if isinstance(d, ast.Dict) and d.keys
                 and getattr(d.keys[0], 'value', None) == 'task')
    kinds = {}
    for key, value in zip(given.keys, given.values, strict=True):
        read, kind = value.elts
        assert read.func.value.args[0].value == key.value, f'{key.value} reads another launch argument'
        kinds[key.value] = kind.id
    assert set(kinds) == set(SIM_ARGUMENTS)
    for name, kind in kinds.items():
        assert fields[name].split('[')[0] == kind, f'{name}: read as {kind}, declared {fields[name]}'
        value = shipped[name]
        text = ','.join(value) if isinstance(value, list) else str(value)
        description = ''.join(_strings(_kw(calls[name], 'description')))
        assert f'({text}' in description, f'{name}: {description!r} does not say the default {text}'


def test_sim_robot_parameters_layer_the_params_files_then_the_arguments_given(tmp_path):
    from sequence_ai_ros.node.launch_parameters import layered
    from sequence_ai_ros.sim.config import SimConfig

    user = tmp_path / 'sim.yaml'
    user.write_text(yaml.safe_dump({'sim_robot': {'ros__parameters': {'task': 'push-v3', 'index': 2}}}))
    shipped = str(REPO / 'config' / 'sim_robot.yaml')
    params = layered('sim_robot', '', shipped, files=[str(user)],
                     given={'index': ('4', int), 'max_steps': ('40', int), 'camera_names': ('none', list),
                            'real_time_factor': ('2', float), 'split': ('', str)})
    cfg = SimConfig(**params)
    assert (cfg.task, cfg.index, cfg.max_steps, cfg.camera_names, cfg.real_time_factor, cfg.split) == \
        ('push-v3', 4, 40, [], 2.0, 'test')
    assert params['camera_names'] == [''] and isinstance(params['real_time_factor'], float)
    names = layered('sim_robot', 'sim1', shipped, given={'camera_names': ('corner, behindGripper', list)})
    assert names['camera_names'] == ['corner', 'behindGripper']
    assert layered('sim_robot', '', shipped, given={'camera_names': ('[corner]', list)})['camera_names'] == ['corner']


@pytest.mark.parametrize('text', ['[1, 2]\n', '/**/policy_node: [a]\n', '/**/policy_node: {ros__parameters: 5}\n'],
                         ids=['a list', 'a section that is a list', 'parameters that are a number'])
def test_a_params_file_of_another_shape_is_refused_naming_it(tmp_path, text):
    from sequence_ai_ros.exceptions import ConfigError
    from sequence_ai_ros.node.launch_parameters import node_parameters

    path = tmp_path / 'bad.yaml'
    path.write_text(text)
    with pytest.raises(ConfigError, match=f'params file {path}'):
        node_parameters(str(path), 'policy_node')
