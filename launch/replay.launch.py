"""Replay a rosbag into the policy node against a local worker: worker, node and bag player.

    ros2 run sequence_ai_ros seq data to-rosbag ../shared/data/g1_pick_bottle_v21 --episode 5 --out /tmp/g1_ep5
    ros2 launch sequence_ai_ros replay.launch.py bag:=/tmp/g1_ep5 policy:=my_policy/policy.py model:=my_policy \
        params_file:=$(ros2 pkg prefix sequence_ai_ros)/share/sequence_ai_ros/config/g1.yaml

Starts the package's ``seq serve <policy> --port <port>`` (ExecuteProcess: the worker is no ROS node), the policy node
(policy.launch.py with ``endpoint:=127.0.0.1:<port>``) and ``bag_player <bag> --rate <rate>``. Send the node a goal to
run an episode:
``ros2 action send_goal /policy_node/act sequence_ai_msgs/action/Act "{instruction: 'pick', max_seconds: 10}"``.
``params_file``, ``use_sim_time`` and ``autostart`` go to policy.launch.py as they are given (an argument left out
stays not given there), so its rule decides: config/policy_node.yaml, then ``autostart: true``, then
``params_file``, then each argument given. The player publishes ``/clock`` (``--clock``) when the node's
``use_sim_time`` comes out true by that rule. The bag replays in a loop (``loop`` defaults to true), so the node's
inputs stay fresh for a goal sent whenever; ``loop:=false`` plays it once, after which the topics go quiet and a
goal ends ``error`` (its sources stale). When the worker exits (``port`` already taken, a policy that does not
load), the whole launch shuts down. With a ``namespace`` the bag's topics are remapped into it, so the
replay feeds that robot only.
"""

from launch import LaunchDescription
from launch.actions import DeclareLaunchArgument, ExecuteProcess, IncludeLaunchDescription, OpaqueFunction, Shutdown
from launch.launch_description_sources import PythonLaunchDescriptionSource
from launch.substitutions import LaunchConfiguration, PathJoinSubstitution
from launch_ros.actions import Node
from launch_ros.substitutions import FindPackagePrefix, FindPackageShare

from sequence_ai_ros.node.launch_parameters import argument_value, policy_node_parameters

PACKAGE = 'sequence_ai_ros'


def _player(context):
    args = [LaunchConfiguration('bag').perform(context), '--rate', LaunchConfiguration('rate').perform(context),
            '--wait-subscribers', '10']
    namespace = LaunchConfiguration('namespace').perform(context).strip('/')
    if namespace:
        args += ['--namespace', namespace]
    node = policy_node_parameters(FindPackageShare(PACKAGE).perform(context), namespace,
                                  LaunchConfiguration('params_file').perform(context),
                                  use_sim_time=LaunchConfiguration('use_sim_time').perform(context))
    if node.get('use_sim_time', False):           # what the node uses: the argument given, else the files
        args.append('--clock')
    if argument_value('loop', LaunchConfiguration('loop').perform(context), bool):
        args.append('--loop')
    return [Node(package=PACKAGE, executable='bag_player', name='bag_player', arguments=args, output='screen')]


def generate_launch_description():
    port = LaunchConfiguration('port')
    return LaunchDescription([
        DeclareLaunchArgument('bag', description='rosbag2 directory to replay (e.g. from seq data to-rosbag)'),
        DeclareLaunchArgument('policy', description='a registered deployment name, or a policy.py to serve'),
        DeclareLaunchArgument('model', description='the deployment name the node asks for'),
        DeclareLaunchArgument('port', default_value='50551', description='worker port on 127.0.0.1'),
        DeclareLaunchArgument('params_file', default_value='', description="the robot's params file"),
        DeclareLaunchArgument('namespace', default_value='', description='namespace of the node'),
        DeclareLaunchArgument('use_sim_time', default_value='',
                              description='true: the node uses /clock and the player publishes it; not given: '
                                          'the params files (false when they do not set it)'),
        DeclareLaunchArgument('autostart', default_value='',
                              description='true: the node configures and activates itself; false: it waits; '
                                          'not given: params_file, else true'),
        DeclareLaunchArgument('rate', default_value='1.0', description='playback speed factor'),
        DeclareLaunchArgument('loop', default_value='true',
                              description='replay the bag in a loop; false: once, then its topics go quiet'),
        # the package's own seq (lib/sequence_ai_ros/seq): a bare 'seq' on PATH is coreutils' seq on a robot
        # the replay is nothing without its worker: when it exits (its port taken, a policy that does not load), the
        # launch shuts down instead of leaving the node on whatever else answers on that port
        ExecuteProcess(cmd=[PathJoinSubstitution([FindPackagePrefix(PACKAGE), 'lib', PACKAGE, 'seq']), 'serve',
                            LaunchConfiguration('policy'), '--port', port], output='screen',
                       on_exit=[Shutdown(reason='the worker (seq serve) exited; see its output above')]),
        IncludeLaunchDescription(
            PythonLaunchDescriptionSource(PathJoinSubstitution([FindPackageShare(PACKAGE), 'launch',
                                                                'policy.launch.py'])),
            launch_arguments={'model': LaunchConfiguration('model'), 'endpoint': ['127.0.0.1:', port],
                              'params_file': LaunchConfiguration('params_file'),
                              'namespace': LaunchConfiguration('namespace'),
                              'use_sim_time': LaunchConfiguration('use_sim_time'),
                              'autostart': LaunchConfiguration('autostart')}.items()),
        OpaqueFunction(function=_player),
    ])
