"""Launch the simulated robot (sim_robot, a Meta-World task) and a policy node driving it.

    ros2 launch sequence_ai_ros sim.launch.py model:=expert endpoint:=127.0.0.1:50551 namespace:=sim1

sim_robot takes config/sim_robot.yaml; policy_node takes config/policy_node.yaml, then
config/sim_policy_node.yaml (80 Hz, the simulator's joint names, its forward command topic), then
``model`` and ``endpoint``. Both run in ``namespace``, so their relative topics meet there. ``autostart``
(default true) makes policy_node configure and activate itself. Written to the standard launch / launch_ros
API (Humble, Jazzy, Kilted).
"""

import yaml
from launch import LaunchDescription
from launch.actions import DeclareLaunchArgument, OpaqueFunction
from launch.substitutions import LaunchConfiguration
from launch_ros.actions import Node
from launch_ros.substitutions import FindPackageShare

PACKAGE = 'sequence_ai_ros'


def _section(path, key):
    with open(path) as f:
        return (yaml.safe_load(f) or {}).get(key, {}).get('ros__parameters', {})


def _launch_nodes(context):
    share = FindPackageShare(PACKAGE).perform(context)
    namespace = LaunchConfiguration('namespace')
    sim = _section(f'{share}/config/sim_robot.yaml', '/**/sim_robot')
    policy = _section(f'{share}/config/policy_node.yaml', '/**/policy_node')
    policy.update(_section(f'{share}/config/sim_policy_node.yaml', '/**/policy_node'))
    given = {'model': LaunchConfiguration('model').perform(context),
             'endpoint': LaunchConfiguration('endpoint').perform(context)}
    policy.update({k: v for k, v in given.items() if v})
    policy['autostart'] = LaunchConfiguration('autostart').perform(context).lower() in ('true', '1')
    return [
        Node(package=PACKAGE, executable='sim_robot', name='sim_robot', namespace=namespace, parameters=[sim],
             output='screen', emulate_tty=True),
        Node(package=PACKAGE, executable='policy_node', name='policy_node', namespace=namespace,
             parameters=[policy], output='screen', emulate_tty=True),
    ]


def generate_launch_description():
    return LaunchDescription([
        DeclareLaunchArgument('model', default_value='', description='deployment name on the worker'),
        DeclareLaunchArgument('endpoint', default_value='', description='worker host:port'),
        DeclareLaunchArgument('namespace', default_value='', description='namespace of both nodes'),
        DeclareLaunchArgument('autostart', default_value='true',
                              description='policy_node configures and activates itself (lifecycle); false: it waits'),
        OpaqueFunction(function=_launch_nodes),
    ])
