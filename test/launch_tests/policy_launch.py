"""launch_testing for ``policy.launch.py``: a worker, the launch file under test and the G1 bag, as on a robot.

Run by ``test/test_launch_files.py`` (``launch_test test/launch_tests/policy_launch.py``), which prepares the
inputs and passes them in the environment:

- ``SEQ_LT_POLICY``: a ``hold`` policy.py (``seq init hold``), served by ``seq serve <policy> --port 0``;
- ``SEQ_LT_BAG``: the G1 episode as a rosbag2 (``seq data to-rosbag``), played by ``bag_player --loop``;
- ``SEQ_LT_PARAMS``: a copy of config/g1.yaml that also sets ``model: from_file``, ``autostart: false``,
  ``use_sim_time: true`` and ``diagnostics_rate_hz: 4.0``.

Two runs (``mode``):

- ``given``: ``model:=hold autostart:=true use_sim_time:=false`` are given: they win over the params file,
  whose other values stay in effect. The node reaches active by itself and runs a 3 s goal: commands reach
  the controller topic and every control period of the episode is counted
  (commands_sent + ticks_held + ticks_skipped = the periods).
- ``file``: only ``model:=hold``: the file's ``autostart: false`` and ``use_sim_time: true`` hold. The node
  stays unconfigured until ``ros2 lifecycle set`` configures and activates it (the bag player publishes
  /clock for the simulated time).

After the tests launch_testing shuts the launch down as Ctrl-C does (SIGINT to every process, SIGTERM only
after 5 s): every process must exit 0.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import unittest
from pathlib import Path

import launch_testing
import launch_testing.asserts
from launch import LaunchDescription
from launch.actions import IncludeLaunchDescription
from launch.launch_description_sources import PythonLaunchDescriptionSource
from launch_ros.actions import Node
from launch_ros.substitutions import FindPackageShare

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from launch_support import PACKAGE, ProbeTestCase, serve_then  # noqa: E402
from test_node_support import wait_for  # noqa: E402

RATE_HZ = 50.0                                     # config/g1.yaml's control_rate_hz
COMMANDS = '/g1_position_controller/commands'      # config/g1.yaml's controller
#: Launch arguments per mode.
ARGUMENTS = {
    'given': {'model': 'hold', 'autostart': 'true', 'use_sim_time': 'false'},
    'file': {'model': 'hold'},
}
#: Bounded waits (s), generous for a loaded 2-core machine.
WAIT_S = 60.0


@launch_testing.parametrize('mode', ['given', 'file'])
def generate_test_description(mode):
    def then(endpoint):
        policy_launch = PythonLaunchDescriptionSource([FindPackageShare(PACKAGE), '/launch/policy.launch.py'])
        args = dict(ARGUMENTS[mode], endpoint=endpoint, params_file=os.environ['SEQ_LT_PARAMS'])
        player_args = ['--clock'] if mode == 'file' else []     # the file's use_sim_time: true needs /clock
        return [IncludeLaunchDescription(policy_launch, launch_arguments=args.items()),
                Node(package=PACKAGE, executable='bag_player', name='bag_player', output='screen',
                     arguments=[os.environ['SEQ_LT_BAG'], '--loop', '--wait-subscribers', '30', *player_args])]
    return LaunchDescription([*serve_then(os.environ['SEQ_LT_POLICY'], then), launch_testing.actions.ReadyToTest()])


class TestPolicyLaunch(ProbeTestCase):

    COMMANDS = COMMANDS

    def _parameters(self, *names):
        from rcl_interfaces.srv import GetParameters
        from rclpy.parameter import parameter_value_to_python

        client = self.probe.node.create_client(GetParameters, '/policy_node/get_parameters')
        try:
            self.assertTrue(client.wait_for_service(timeout_sec=WAIT_S), 'no /policy_node/get_parameters')
            # a request sent just as the service appears can lose its response (the server has not matched this
            # client's response reader yet): ask again, as a bounded number of tries
            for _ in range(6):
                future = client.call_async(GetParameters.Request(names=list(names)))
                if wait_for(future.done, WAIT_S / 6):
                    break
            self.assertTrue(future.done(), 'get_parameters did not answer')
            return dict(zip(names, (parameter_value_to_python(v) for v in future.result().values), strict=True))
        finally:
            self.probe.node.destroy_client(client)

    def test_launch_arguments_override_the_params_file(self, mode):
        values = self._parameters('model', 'autostart', 'use_sim_time', 'diagnostics_rate_hz', 'control_rate_hz')
        self.assertEqual(values['model'], 'hold')                   # the launch argument, over the file's
        self.assertEqual(values['diagnostics_rate_hz'], 4.0)        # the params file's, over the defaults
        self.assertEqual(values['control_rate_hz'], RATE_HZ)
        if mode == 'given':
            self.assertEqual((values['autostart'], values['use_sim_time']), (True, False))
        else:
            self.assertEqual((values['autostart'], values['use_sim_time']), (False, True))

    def test_lifecycle_and_an_episode(self, mode):
        probe = self.probe
        if mode == 'file':
            # autostart: false from the file: the node waits, unconfigured, for the lifecycle transitions
            self.assertEqual(wait_for(lambda: probe.lifecycle_state(), WAIT_S), 'unconfigured')
            time.sleep(2.0)                                          # it does not move on by itself
            self.assertEqual(probe.lifecycle_state(), 'unconfigured')
            ros2 = shutil.which('ros2')
            self.assertIsNotNone(ros2, 'no ros2 command (ros2cli) on PATH')
            for transition in ('configure', 'activate'):
                done = subprocess.run([ros2, 'lifecycle', 'set', '/policy_node', transition, '--no-daemon',
                                       '--spin-time', '10'], capture_output=True, text=True, timeout=WAIT_S)
                self.assertEqual(done.returncode, 0, done.stdout + done.stderr)
                self.assertIn('Transitioning successful', done.stdout)
        self.assertTrue(probe.wait_connected(timeout=WAIT_S), 'the node did not become connected and active')
        self.assertEqual(probe.lifecycle_state(), 'active')
        if mode != 'given':
            return
        self.assert_a_goal_is_counted(RATE_HZ, WAIT_S)


@launch_testing.post_shutdown_test()
class TestShutdown(unittest.TestCase):

    def test_every_process_exits_0_on_ctrl_c(self, proc_info):
        launch_testing.asserts.assertExitCodes(proc_info)
