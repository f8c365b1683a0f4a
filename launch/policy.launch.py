"""Launch the policy node on a robot with a full ROS 2 install (launch + launch_ros).

    ros2 launch sequence_ai_ros policy.launch.py model:=g1 endpoint:=gpu-box:50551 \
        params_file:=$(ros2 pkg prefix sequence_ai_ros)/share/sequence_ai_ros/config/g1.yaml \
        namespace:=robot1 use_sim_time:=false autostart:=true

Parameters come from config/policy_node.yaml (the defaults, generated from the parameter schema), then
``params_file`` (the robot's config, e.g. config/g1.yaml or config/wx200.yaml), then ``model`` and
``endpoint`` when they are given. Topic names are relative: ``namespace:=robot1`` moves the node, its
inputs (``/robot1/joint_states``...), its commands and services. policy_node is a lifecycle (managed)
node; ``autostart`` (default true here) makes it configure and activate itself, which works on every
distro (launch_ros's own ``autostart=`` exists only from Jazzy on). With ``autostart:=false`` it waits
for ``ros2 lifecycle set /robot1/policy_node configure`` and ``activate``.
The YAML files are read here and passed as parameter dicts, so a ``namespace`` does not break the
``policy_node:`` key the files use. Written to the standard launch / launch_ros API (Humble, Jazzy, Kilted).
"""

import yaml
from launch import LaunchDescription
from launch.actions import DeclareLaunchArgument, OpaqueFunction
from launch.substitutions import LaunchConfiguration
from launch_ros.actions import Node
from launch_ros.substitutions import FindPackageShare

PACKAGE = 'sequence_ai_ros'
NODE_NAME = 'policy_node'


def _node_parameters(path, namespace=''):
    """Return the ``ros__parameters`` a params file gives ``policy_node`` in ``namespace``, as rcl applies them.

    rcl's rules for a node's fully qualified name (``/robot1/policy_node``): a key is a name pattern, ``*``
    one name token, ``**`` any number of them, a key without a leading ``/`` is absolute all the same
    (``policy_node`` is ``/policy_node``: the root namespace's node); every matching key applies, in the
    file's order, later ones overriding earlier ones. The shipped configs use ``/**/policy_node``.
    """
    def matches(pattern, name):
        if not pattern:
            return not name
        if pattern[0] == '**':
            return any(matches(pattern[1:], name[i:]) for i in range(len(name) + 1))
        return bool(name) and pattern[0] in ('*', name[0]) and matches(pattern[1:], name[1:])

    with open(path) as f:
        data = yaml.safe_load(f) or {}
    fqn = [t for t in namespace.split('/') if t] + [NODE_NAME]
    out = {}
    for key, section in data.items():
        if isinstance(key, str) and matches([t for t in key.split('/') if t], fqn):
            out.update((section or {}).get('ros__parameters', {}))
    return out


def _launch_node(context):
    share = FindPackageShare(PACKAGE).perform(context)
    defaults = f'{share}/config/policy_node.yaml'
    namespace = LaunchConfiguration('namespace').perform(context)
    params = _node_parameters(defaults, namespace)
    params_file = LaunchConfiguration('params_file').perform(context)
    if params_file:
        params.update(_node_parameters(params_file, namespace))
    given = {'model': LaunchConfiguration('model').perform(context),
             'endpoint': LaunchConfiguration('endpoint').perform(context)}
    params.update({k: v for k, v in given.items() if v})
    params['use_sim_time'] = LaunchConfiguration('use_sim_time').perform(context).lower() in ('true', '1')
    params['autostart'] = LaunchConfiguration('autostart').perform(context).lower() in ('true', '1')
    return [Node(package=PACKAGE, executable='policy_node', name=NODE_NAME,
                 namespace=LaunchConfiguration('namespace'), parameters=[params], output='screen',
                 emulate_tty=True)]


def generate_launch_description():
    return LaunchDescription([
        DeclareLaunchArgument('model', default_value='', description='deployment name on the worker'),
        DeclareLaunchArgument('endpoint', default_value='',
                              description='worker host:port (default: the params files, then 127.0.0.1:50551)'),
        DeclareLaunchArgument('params_file', default_value='',
                              description="the robot's params file (e.g. config/g1.yaml), over policy_node.yaml"),
        DeclareLaunchArgument('namespace', default_value='', description='namespace of the node'),
        DeclareLaunchArgument('use_sim_time', default_value='false',
                              description='use /clock (a bag player with --clock publishes it)'),
        DeclareLaunchArgument('autostart', default_value='true',
                              description='the node configures and activates itself (lifecycle); false: it waits'),
        OpaqueFunction(function=_launch_node),
    ])
