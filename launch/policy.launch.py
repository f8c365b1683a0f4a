"""Launch the policy node on a robot with a full ROS 2 install (launch + launch_ros).

    ros2 launch sequence_ai_ros policy.launch.py model:=g1 endpoint:=gpu-box:50551 \
        params_file:=$(ros2 pkg prefix sequence_ai_ros)/share/sequence_ai_ros/config/g1.yaml namespace:=robot1

Parameters, each layer over the one before, parameter by parameter:

1. config/policy_node.yaml: every parameter at the node's own default (generated from the parameter schema);
2. ``autostart: true``: this launch file's default (the node on its own waits for a lifecycle manager);
3. ``params_file``: the robot's config (e.g. config/g1.yaml or config/wx200.yaml);
4. each of ``model``, ``endpoint``, ``use_sim_time`` and ``autostart`` that is given (``autostart:=false``).
   They default to '', which means not given: a launch argument left out never overrides the params file.

So ``autostart`` is true unless ``params_file`` or the launch argument says false, and ``use_sim_time`` is what
the files say (false when neither sets it) unless the launch argument is given. Topic names are relative:
``namespace:=robot1`` moves the node, its inputs (``/robot1/joint_states``...), its commands and services.
policy_node is a lifecycle (managed) node; ``autostart`` makes it configure and activate itself, which works
on every distro (launch_ros's own ``autostart=`` exists only from Jazzy on). With ``autostart`` false it waits
for ``ros2 lifecycle set /robot1/policy_node configure`` and ``activate``.
The YAML files are read here (as rcl matches their keys to the node's name in its namespace) and passed as one
parameter dict, so a ``namespace`` does not break the ``/**/policy_node:`` key the files use. Written to the
standard launch / launch_ros API (Humble, Jazzy, Kilted).
"""

from launch import LaunchDescription
from launch.actions import DeclareLaunchArgument, OpaqueFunction, Shutdown
from launch.substitutions import LaunchConfiguration
from launch_ros.actions import Node
from launch_ros.substitutions import FindPackageShare

from sequence_ai_ros.node.launch_parameters import policy_node_parameters

PACKAGE = 'sequence_ai_ros'
NODE_NAME = 'policy_node'


def _launch_node(context):
    namespace = LaunchConfiguration('namespace').perform(context)
    params = policy_node_parameters(
        FindPackageShare(PACKAGE).perform(context), namespace, LaunchConfiguration('params_file').perform(context),
        model=LaunchConfiguration('model').perform(context), endpoint=LaunchConfiguration('endpoint').perform(context),
        use_sim_time=LaunchConfiguration('use_sim_time').perform(context),
        autostart=LaunchConfiguration('autostart').perform(context))
    # a node that exits (a parameter it refuses: exit 2) ends the launch, rather than leaving it up with no node
    return [Node(package=PACKAGE, executable='policy_node', name=NODE_NAME, namespace=namespace,
                 parameters=[params], output='screen', emulate_tty=True,
                 on_exit=[Shutdown(reason='policy_node exited; see its output above')])]


def generate_launch_description():
    return LaunchDescription([
        DeclareLaunchArgument('model', default_value='',
                              description='deployment name on the worker (not given: the params files)'),
        DeclareLaunchArgument('endpoint', default_value='',
                              description='worker host:port (not given: the params files, then $SEQ_ENDPOINT, '
                                          'then 127.0.0.1:50551)'),
        DeclareLaunchArgument('params_file', default_value='',
                              description="the robot's params file (e.g. config/g1.yaml), over policy_node.yaml"),
        DeclareLaunchArgument('namespace', default_value='', description='namespace of the node'),
        DeclareLaunchArgument('use_sim_time', default_value='',
                              description='true: use /clock (a bag player with --clock publishes it); '
                                          'not given: the params files (false when they do not set it)'),
        DeclareLaunchArgument('autostart', default_value='',
                              description='true: the node configures and activates itself (lifecycle); false: it '
                                          'waits; not given: params_file, else true'),
        OpaqueFunction(function=_launch_node),
    ])
