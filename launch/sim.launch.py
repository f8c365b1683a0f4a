"""Launch the simulated robot (sim_robot, a Meta-World task) and a policy node driving it.

    ros2 launch sequence_ai_ros sim.launch.py model:=expert endpoint:=127.0.0.1:50551 namespace:=sim1

sim_robot takes config/sim_robot.yaml. policy_node's parameters, each layer over the one before, parameter by
parameter: config/policy_node.yaml (every parameter at the node's own default), ``autostart: true`` (this launch
file's default), config/sim_policy_node.yaml (80 Hz, the simulator's joint names, its forward command topic),
then each of ``model``, ``endpoint`` and ``autostart`` that is given. They default to '', which means not
given: a launch argument left out never overrides a file. Both nodes run in ``namespace``, so their relative
topics meet there. ``autostart`` makes policy_node configure and activate itself. Written to the standard
launch / launch_ros API (Humble, Jazzy, Kilted).
"""

from launch import LaunchDescription
from launch.actions import DeclareLaunchArgument, OpaqueFunction
from launch.substitutions import LaunchConfiguration
from launch_ros.actions import Node
from launch_ros.substitutions import FindPackageShare

from sequence_ai_ros.node.launch_parameters import layered, policy_node_parameters

PACKAGE = 'sequence_ai_ros'


def _launch_nodes(context):
    share = FindPackageShare(PACKAGE).perform(context)
    namespace = LaunchConfiguration('namespace').perform(context)
    sim = layered('sim_robot', namespace, f'{share}/config/sim_robot.yaml')
    policy = policy_node_parameters(share, namespace, shipped_file=f'{share}/config/sim_policy_node.yaml',
                                    model=LaunchConfiguration('model').perform(context),
                                    endpoint=LaunchConfiguration('endpoint').perform(context),
                                    autostart=LaunchConfiguration('autostart').perform(context))
    return [
        Node(package=PACKAGE, executable='sim_robot', name='sim_robot', namespace=namespace, parameters=[sim],
             output='screen', emulate_tty=True),
        Node(package=PACKAGE, executable='policy_node', name='policy_node', namespace=namespace,
             parameters=[policy], output='screen', emulate_tty=True),
    ]


def generate_launch_description():
    return LaunchDescription([
        DeclareLaunchArgument('model', default_value='',
                              description='deployment name on the worker (not given: the params files)'),
        DeclareLaunchArgument('endpoint', default_value='',
                              description='worker host:port (not given: the params files, then $SEQ_ENDPOINT, '
                                          'then 127.0.0.1:50551)'),
        DeclareLaunchArgument('namespace', default_value='', description='namespace of both nodes'),
        DeclareLaunchArgument('autostart', default_value='',
                              description='true: policy_node configures and activates itself (lifecycle); false: '
                                          'it waits; not given: the params files, else true'),
        OpaqueFunction(function=_launch_nodes),
    ])
