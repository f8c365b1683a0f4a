r"""launch_testing for ``replay.launch.py``: its worker, the node and the bag player, in a namespace.

Run by ``test/test_launch_files.py`` (inputs in the environment: ``SEQ_LT_POLICY``, a ``hold`` policy.py
served unregistered; ``SEQ_LT_BAG``, the G1 episode as a rosbag2; ``SEQ_LT_PORT``, a free port for the
launch's ``seq serve``). The launch file is included as a user runs it::

    ros2 launch sequence_ai_ros replay.launch.py bag:=... policy:=.../hold/policy.py model:=hold \
        port:=... params_file:=.../config/g1.yaml namespace:=robot1

The node autostarts to active in ``/robot1``; the bag's topics are remapped into the namespace, so the
observations are fresh and a 3 s goal commands ``/robot1/g1_position_controller/commands`` with every control
period counted. After the tests launch_testing shuts down as Ctrl-C does: every process exits 0.
"""

from __future__ import annotations

import os
import sys
import unittest
from pathlib import Path

import launch_testing
import launch_testing.asserts
from launch import LaunchDescription
from launch.actions import IncludeLaunchDescription
from launch.launch_description_sources import PythonLaunchDescriptionSource
from launch_ros.substitutions import FindPackageShare

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from launch_support import PACKAGE, ProbeTestCase  # noqa: E402

NAMESPACE = 'robot1'
RATE_HZ = 50.0
COMMANDS = f'/{NAMESPACE}/g1_position_controller/commands'
WAIT_S = 60.0


def generate_test_description():
    share = FindPackageShare(PACKAGE)
    arguments = {'bag': os.environ['SEQ_LT_BAG'], 'policy': os.environ['SEQ_LT_POLICY'], 'model': 'hold',
                 'port': os.environ['SEQ_LT_PORT'], 'params_file': [share, '/config/g1.yaml'],
                 'namespace': NAMESPACE}
    return LaunchDescription([
        IncludeLaunchDescription(PythonLaunchDescriptionSource([share, '/launch/replay.launch.py']),
                                 launch_arguments=arguments.items()),
        launch_testing.actions.ReadyToTest(),
    ])


class TestReplayLaunch(ProbeTestCase):

    COMMANDS = COMMANDS
    NAMESPACE = NAMESPACE

    def test_replay_drives_the_namespaced_node(self):
        probe = self.probe
        self.assertTrue(probe.wait_connected(timeout=WAIT_S), 'the node did not become connected and active')
        self.assertEqual(probe.lifecycle_state(), 'active')
        self.assert_a_goal_is_counted(RATE_HZ, WAIT_S)


@launch_testing.post_shutdown_test()
class TestShutdown(unittest.TestCase):

    def test_every_process_exits_0_on_ctrl_c(self, proc_info):
        launch_testing.asserts.assertExitCodes(proc_info)
        self.assertEqual(len(proc_info.process_names()), 3, proc_info.process_names())   # worker, node, player
