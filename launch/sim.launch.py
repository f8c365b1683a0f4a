"""Launch the simulated robot (sim_robot, a Meta-World task) and a policy node driving it.

    ros2 launch sequence_ai_ros sim.launch.py model:=expert endpoint:=127.0.0.1:50551 namespace:=sim1 \
        task:=push-v3 index:=3 camera_names:=none

Each node's parameters come in layers, each over the one before, parameter by parameter:

- sim_robot: config/sim_robot.yaml, then ``sim_params_file``, then each of the launch arguments ``task``,
  ``benchmark_seed``, ``split``, ``index``, ``max_steps``, ``real_time_factor``, ``camera_names``,
  ``camera_width``, ``camera_height`` and ``camera_rate_hz`` that is given (they are sim_robot's parameters of
  those names; ``camera_names`` is comma-separated, ``none`` for no camera);
- policy_node: config/policy_node.yaml (every parameter at the node's own default), ``autostart: true`` (this
  launch file's default), config/sim_policy_node.yaml (80 Hz, the simulator's joint names, its forward command
  topic), then ``params_file``, then each of ``model``, ``endpoint`` and ``autostart`` that is given.

Every argument but ``namespace`` defaults to '', which means not given: an argument left out never overrides a
file. So ``autostart`` is true unless ``params_file`` or ``autostart:=false`` says false. Both nodes run in
``namespace``, so their relative topics meet there. ``autostart`` makes policy_node configure and activate
itself. The robot waits for its first command after each reset (and at start-up), publishing its reset state,
so a goal sent any time after a reset gets the whole ``max_steps``. Written to the standard launch / launch_ros
API (Humble, Jazzy, Kilted).
"""

from launch import LaunchDescription
from launch.actions import DeclareLaunchArgument, OpaqueFunction, Shutdown
from launch.substitutions import LaunchConfiguration
from launch_ros.actions import Node
from launch_ros.substitutions import FindPackageShare

from sequence_ai_ros.node.launch_parameters import layered, policy_node_parameters

PACKAGE = 'sequence_ai_ros'


def _launch_nodes(context):
    share = FindPackageShare(PACKAGE).perform(context)
    namespace = LaunchConfiguration('namespace').perform(context)
    sim = layered('sim_robot', namespace, f'{share}/config/sim_robot.yaml',
                  files=[LaunchConfiguration('sim_params_file').perform(context)],
                  given={'task': (LaunchConfiguration('task').perform(context), str),
                         'benchmark_seed': (LaunchConfiguration('benchmark_seed').perform(context), int),
                         'split': (LaunchConfiguration('split').perform(context), str),
                         'index': (LaunchConfiguration('index').perform(context), int),
                         'max_steps': (LaunchConfiguration('max_steps').perform(context), int),
                         'real_time_factor': (LaunchConfiguration('real_time_factor').perform(context), float),
                         'camera_names': (LaunchConfiguration('camera_names').perform(context), list),
                         'camera_width': (LaunchConfiguration('camera_width').perform(context), int),
                         'camera_height': (LaunchConfiguration('camera_height').perform(context), int),
                         'camera_rate_hz': (LaunchConfiguration('camera_rate_hz').perform(context), float)})
    policy = policy_node_parameters(share, namespace, LaunchConfiguration('params_file').perform(context),
                                    shipped_file=f'{share}/config/sim_policy_node.yaml',
                                    model=LaunchConfiguration('model').perform(context),
                                    endpoint=LaunchConfiguration('endpoint').perform(context),
                                    autostart=LaunchConfiguration('autostart').perform(context))
    return [
        # either node exiting (a parameter it refuses: exit 2) ends the launch, rather than leaving the other alone
        Node(package=PACKAGE, executable='sim_robot', name='sim_robot', namespace=namespace, parameters=[sim],
             output='screen', emulate_tty=True, on_exit=[Shutdown(reason='sim_robot exited; see its output above')]),
        Node(package=PACKAGE, executable='policy_node', name='policy_node', namespace=namespace,
             parameters=[policy], output='screen', emulate_tty=True,
             on_exit=[Shutdown(reason='policy_node exited; see its output above')]),
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
        DeclareLaunchArgument('params_file', default_value='',
                              description="policy_node's params file, over config/sim_policy_node.yaml"),
        DeclareLaunchArgument('sim_params_file', default_value='',
                              description="sim_robot's params file, over config/sim_robot.yaml"),
        DeclareLaunchArgument('task', default_value='', description='Meta-World ML1 task (drawer-open-v3)'),
        DeclareLaunchArgument('benchmark_seed', default_value='',
                              description='seed of metaworld.ML1(task, seed): draws the task instances (0)'),
        DeclareLaunchArgument('split', default_value='',
                              description='instance list reset to at start-up: test or train (test)'),
        DeclareLaunchArgument('index', default_value='', description='instance index reset to at start-up (0)'),
        DeclareLaunchArgument('max_steps', default_value='',
                              description='steps per episode, from its first command (500 = 6.25 s at 80 Hz)'),
        DeclareLaunchArgument('real_time_factor', default_value='',
                              description='sim time per wall time (1.0)'),
        DeclareLaunchArgument('camera_names', default_value='',
                              description='cameras, comma-separated (corner); none: no camera'),
        DeclareLaunchArgument('camera_width', default_value='', description='image width in px (96)'),
        DeclareLaunchArgument('camera_height', default_value='', description='image height in px (96)'),
        DeclareLaunchArgument('camera_rate_hz', default_value='', description='image rate in Hz (10.0)'),
        OpaqueFunction(function=_launch_nodes),
    ])
