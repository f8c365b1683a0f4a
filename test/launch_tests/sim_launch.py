r"""launch_testing for ``sim.launch.py``: the simulated robot and the policy node, driven by the scripted expert.

Run by ``test/test_launch_files.py`` (``SEQ_LT_EXPERT``: a ``metaworld-expert`` policy.py from ``seq init``,
served here by ``seq serve <policy> --port 0``). Once the worker prints its port the launch file is included
as a user runs it::

    ros2 launch sequence_ai_ros sim.launch.py model:=expert endpoint:=127.0.0.1:<port> namespace:=sim1 \
        camera_names:=none max_steps:=400

The node autostarts to active. ``~/reset`` puts the task in a held-out instance; the robot then waits for its
first command (its step count stays 0 while nothing commands it), so the goal, sent after a pause, gets the
whole episode: the expert solves the task (the robot's ``~/status`` reports success), the launch argument
``max_steps:=400`` is in effect over config/sim_robot.yaml's 500, and every control period at 80 Hz is
counted. After the tests launch_testing shuts down as Ctrl-C does: every process exits 0.
"""

from __future__ import annotations

import os
import sys
import time
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
from launch_support import PACKAGE, ProbeTestCase, serve_then  # noqa: E402
from test_node_support import wait_for  # noqa: E402

NAMESPACE = 'sim1'
RATE_HZ = 80.0                   # config/sim_policy_node.yaml's control_rate_hz
MAX_STEPS = 400
WAIT_S = 90.0


def generate_test_description():
    def then(endpoint):
        arguments = {'model': 'expert', 'endpoint': endpoint, 'namespace': NAMESPACE, 'camera_names': 'none',
                     'max_steps': str(MAX_STEPS)}
        return [IncludeLaunchDescription(
            PythonLaunchDescriptionSource([FindPackageShare(PACKAGE), '/launch/sim.launch.py']),
            launch_arguments=arguments.items())]
    return LaunchDescription([*serve_then(os.environ['SEQ_LT_EXPERT'], then), launch_testing.actions.ReadyToTest()])


class TestSimLaunch(ProbeTestCase):

    COMMANDS = f'/{NAMESPACE}/position_controller/commands'
    NAMESPACE = NAMESPACE

    @classmethod
    def setUpClass(cls):
        from sequence_ai_msgs.msg import SimStatus
        from sequence_ai_msgs.srv import ResetSim

        super().setUpClass()
        cls.sim_status = []
        cls.probe.node.create_subscription(SimStatus, f'/{NAMESPACE}/sim_robot/status', cls.sim_status.append, 10)
        cls.reset = cls.probe.node.create_client(ResetSim, f'/{NAMESPACE}/sim_robot/reset')
        cls.ResetSim = ResetSim

    def _status_after(self, t):
        return [s for s in list(self.sim_status) if s.stamp.sec + s.stamp.nanosec * 1e-9 > t]

    def test_the_expert_solves_a_reset_sent_a_while_before_the_goal(self):
        probe = self.probe
        self.assertTrue(probe.wait_connected(timeout=WAIT_S), 'the node did not become connected and active')
        self.assertTrue(self.reset.wait_for_service(timeout_sec=WAIT_S), 'no sim_robot/reset')
        future = self.reset.call_async(self.ResetSim.Request(split='test', index=0))
        self.assertTrue(wait_for(future.done, WAIT_S), 'the reset did not answer')
        self.assertTrue(future.result().success, future.result().message)
        episode = future.result().episode
        # nothing commands the robot: it waits, publishing its reset state, with its step count at 0
        time.sleep(3.0)
        latest = [s for s in list(self.sim_status) if s.episode == episode]
        self.assertTrue(latest, 'no ~/status after the reset')
        self.assertEqual((latest[-1].steps, latest[-1].first_command_step), (0, -1), latest[-1])
        fresh = wait_for(lambda: probe.diag_message('observation') == 'all sources fresh', WAIT_S)
        self.assertTrue(fresh, f'observation: {probe.diag_message("observation")}')
        handle = probe.send_goal(instruction='open the drawer', max_seconds=MAX_STEPS / RATE_HZ)
        self.assertTrue(handle.accepted)
        result = probe.result(handle, timeout=WAIT_S)
        self.assertIn(result.reason, ('timeout', 'completed', 'until'), result.message)
        counted = result.commands_sent + result.ticks_held + result.ticks_skipped
        self.assertLessEqual(abs(counted - result.elapsed_s * RATE_HZ), 2.0, result)
        solved = wait_for(lambda: [s for s in list(self.sim_status) if s.episode == episode and s.success], 10)
        final = [s for s in list(self.sim_status) if s.episode == episode][-1]
        self.assertTrue(solved, f'the expert did not solve the task: {final}')
        self.assertGreaterEqual(final.first_command_step, 0)
        self.assertLessEqual(final.steps, MAX_STEPS)          # the launch argument's bound, not the file's 500
        self.assertEqual(final.commands_refused, 0, final.message)


@launch_testing.post_shutdown_test()
class TestShutdown(unittest.TestCase):

    def test_every_process_exits_0_on_ctrl_c(self, proc_info):
        launch_testing.asserts.assertExitCodes(proc_info)
        self.assertEqual(len(proc_info.process_names()), 3, proc_info.process_names())   # worker, sim, node
