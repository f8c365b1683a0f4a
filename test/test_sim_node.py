"""The simulated robot: its command semantics (ROS-free), its params file, and the node's cameras and trajectories.

The node tests run ``sim_robot`` in its own process (real rclpy over DDS, this test session's ROS domain).
The camera test needs headless EGL (Debian's libegl1, libgl1-mesa-dri): without it, it skips and says why.
"""

from __future__ import annotations

import subprocess
import sys
import time

import numpy as np
import pytest
import yaml
from test_node_support import REPO, wait_for

from sequence_ai_ros.exceptions import ConfigError, ContractViolation
from sequence_ai_ros.sim.commands import CommandInput, make_trajectory
from sequence_ai_ros.sim.config import SimConfig

NAMES = ('ee_x', 'ee_y', 'ee_z', 'gripper')


def test_a_new_trajectory_replaces_the_old_from_its_start_time():
    cmd = CommandInput(4)
    cmd.reset(np.zeros(4))
    first = make_trajectory(list(NAMES), NAMES, 10.0, [1.0], [[1.0, 0, 0, 0]], now_s=10.0)
    cmd.set_trajectory(first)
    assert cmd.target(9.0)[0] == 0.0                    # before its start: the held target
    assert cmd.target(10.5)[0] == pytest.approx(0.5)    # from the held target to point 0
    # names in another order are mapped by name; it starts at 11.0: until then the first one goes on
    second = make_trajectory(['gripper', 'ee_z', 'ee_y', 'ee_x'], NAMES, 11.0, [1.0], [[1.0, 0, 0, -1.0]], now_s=10.5)
    cmd.set_trajectory(second)
    assert cmd.target(10.75)[0] == pytest.approx(0.75)
    assert cmd.target(11.0)[0] == pytest.approx(1.0)    # anchored where the first one was at 11.0
    mid = cmd.target(11.5)
    assert mid[0] == pytest.approx(0.0) and mid[3] == pytest.approx(0.5)   # ee_x 1 -> -1, gripper 0 -> 1
    assert cmd.target(20.0)[0] == pytest.approx(-1.0)   # holds the last point
    cmd.set_forward(np.array([0.1, 0.2, 0.3, 0.4]))     # a forward command replaces any trajectory at once
    np.testing.assert_allclose(cmd.target(21.0), [0.1, 0.2, 0.3, 0.4])
    assert cmd.received == 3 and cmd.refused == 0


@pytest.mark.parametrize(('names', 'times', 'points', 'match'), [
    (['ee_x', 'ee_y', 'ee_z'], [1.0], [[0, 0, 0]], 'each of'),
    (list(NAMES), [1.0, 0.5], [[0, 0, 0, 0], [0, 0, 0, 0]], 'increasing'),
    (list(NAMES), [1.0], [[0, 0, np.nan, 0]], 'non-finite'),
    (list(NAMES), [1.0], [[0, 0, 0]], 'values'),
    (list(NAMES), [1.0], [[0, 0, 0, 0]], 'ended'),
])
def test_bad_commands_are_refused_by_name(names, times, points, match):
    with pytest.raises(ContractViolation, match=match):
        make_trajectory(names, NAMES, 0.0, times, points, now_s=5.0)
    cmd = CommandInput(4)
    with pytest.raises(ContractViolation):
        cmd.set_forward(np.array([0.0, 1.0]))
    assert cmd.refused == 1 and cmd.received == 0


def test_the_params_file_names_every_parameter_once_with_valid_values():
    doc = yaml.safe_load((REPO / 'config' / 'sim_robot.yaml').read_text())
    params = doc['/**/sim_robot']['ros__parameters']
    assert set(params) == {f.name for f in SimConfig.fields()}
    cfg = SimConfig(**params)
    assert cfg.task == 'drawer-open-v3' and cfg.controller == 'position_controller'
    with pytest.raises(ConfigError, match='camera_width'):
        SimConfig(camera_width=2)
    with pytest.raises(ConfigError, match='relative'):
        SimConfig(controller='/arm')


@pytest.mark.slow
def test_push_observes_its_goal_and_its_scripted_expert_solves_it_through_position_commands():
    pytest.importorskip('metaworld', reason='the simulated robot needs metaworld (requirements-dev.txt)')
    import metaworld.policies

    from sequence_ai_ros.sim.task import SimTask

    task = SimTask('push-v3')
    expert = metaworld.policies.SawyerPushV3Policy()
    try:
        task.reset('test', 4)       # resets with no step between (sim_robot waits for a command after each)
        for index in range(2):
            task.reset('test', index)
            assert np.abs(task.obs[36:39]).max() > 0.5          # the goal (obs_36..38), drawn per instance
            while not task.truncated and not task.success:
                move = np.clip(np.asarray(expert.get_action(task.obs), np.float64), -1, 1)
                task.step(np.concatenate([task.mocap() + move[:3] * task.action_scale, move[3:]]))
            assert task.success and task.steps < 150, (index, task.steps)
    finally:
        task.close()
    drawer = SimTask('drawer-open-v3')
    try:
        assert not drawer.reset('test', 0)[4 + 36:].any()        # drawer-open keeps Meta-World's hidden goal
    finally:
        drawer.close()


@pytest.fixture
def sim_node(tmp_path, processes):
    pytest.importorskip('metaworld', reason='the simulated robot needs metaworld (requirements-dev.txt)')

    def start(**params):
        (tmp_path / 'over.yaml').write_text(yaml.safe_dump({'sim_robot': {'ros__parameters': params}}))
        log = tmp_path / 'sim.log'
        proc = processes.spawn([sys.executable, '-m', 'sequence_ai_ros.sim.main', '--ros-args',
                                '--params-file', str(REPO / 'config' / 'sim_robot.yaml'),
                                '--params-file', str(tmp_path / 'over.yaml')],
                               stdout=open(log, 'w'), stderr=subprocess.STDOUT)  # noqa: SIM115
        proc.log = log
        return proc
    return start


class Probe:
    """A node of the test: joint_states, images, ~/reset, commands to the simulated robot."""

    def __init__(self, context):
        import threading

        import rclpy
        from rclpy.executors import SingleThreadedExecutor
        from rclpy.qos import qos_profile_sensor_data
        from sensor_msgs.msg import Image, JointState
        from sequence_ai_msgs.msg import SimStatus
        from sequence_ai_msgs.srv import ResetSim
        from std_msgs.msg import Float64MultiArray
        from trajectory_msgs.msg import JointTrajectory

        self.node = rclpy.create_node('sim_test_probe', context=context)
        self.joints, self.images, self.status = [], [], []
        self.node.create_subscription(JointState, '/joint_states', self.joints.append, 100)
        self.node.create_subscription(Image, '/corner/image_raw', self.images.append, qos_profile_sensor_data)
        self.node.create_subscription(SimStatus, '/sim_robot/status', self.status.append, 10)
        self.trajectory = self.node.create_publisher(JointTrajectory, '/position_controller/joint_trajectory', 10)
        self.forward = self.node.create_publisher(Float64MultiArray, '/position_controller/commands', 10)
        self.reset_client = self.node.create_client(ResetSim, '/sim_robot/reset')
        self.ResetSim = ResetSim
        self.executor = SingleThreadedExecutor(context=context)
        self.executor.add_node(self.node)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._spin, daemon=True)
        self._thread.start()

    def _spin(self):
        while not self._stop.is_set():
            self.executor.spin_once(timeout_sec=0.05)

    def reset(self, index):
        assert self.reset_client.wait_for_service(timeout_sec=60), '/sim_robot/reset never appeared'
        future = self.reset_client.call_async(self.ResetSim.Request(split='test', index=index))
        assert wait_for(future.done, 30)
        return future.result()

    def close(self):
        self._stop.set()
        self._thread.join(5)
        self.executor.shutdown(timeout_sec=1.0)
        self.node.destroy_node()


@pytest.fixture
def probe(rclpy_context):
    p = Probe(rclpy_context)
    yield p
    p.close()


@pytest.mark.ros
def test_cameras_publish_frames_of_the_configured_size_and_a_reset_publishes_one_at_once(sim_node, probe):
    from sequence_ai_ros.sim.task import render_unavailable

    why = render_unavailable()
    if why:
        pytest.skip(f'no headless rendering: {why}')
    proc = sim_node(camera_names=['corner'], camera_width=64, camera_height=48, camera_rate_hz=20.0)
    assert wait_for(lambda: probe.images, 60), proc.log.read_text()
    image = probe.images[-1]
    assert (image.width, image.height, image.encoding, len(image.data)) == (64, 48, 'rgb8', 64 * 48 * 3)
    assert np.frombuffer(bytes(image.data), np.uint8).std() > 0, 'a blank frame'
    before = len(probe.images)
    reply = probe.reset(4)
    assert reply.success and len(reply.state) == 43, reply.message
    assert wait_for(lambda: len(probe.images) > before, 5)


@pytest.mark.ros
def test_a_joint_trajectory_moves_the_hand_to_its_points(sim_node, probe):
    from builtin_interfaces.msg import Duration
    from trajectory_msgs.msg import JointTrajectory, JointTrajectoryPoint

    proc = sim_node(camera_names=[''])
    reply = probe.reset(2)
    assert reply.success, proc.log.read_text()
    start = np.array(reply.state[:4])
    goal = start + np.array([0.05, -0.03, 0.02, 0.0])
    msg = JointTrajectory(joint_names=list(NAMES))   # stamp 0: starts on receipt
    half = Duration(nanosec=250_000_000)
    msg.points = [JointTrajectoryPoint(positions=list((start + goal) / 2), time_from_start=half),
                  JointTrajectoryPoint(positions=list(goal), time_from_start=Duration(nanosec=500_000_000))]
    assert wait_for(lambda: probe.trajectory.get_subscription_count() > 0, 10)
    probe.trajectory.publish(msg)
    time.sleep(1.5)
    measured = np.array(probe.joints[-1].position[:4])
    assert list(probe.joints[-1].name[:5]) == [*NAMES, 'obs_0']
    np.testing.assert_allclose(measured[:3], goal[:3], atol=0.01)


@pytest.mark.ros
def test_an_episode_starts_at_its_first_command_and_the_robot_publishes_its_state_while_it_waits(sim_node, probe):
    """After a reset the robot publishes its reset state and counts no step; max_steps count from the first command."""
    from std_msgs.msg import Float64MultiArray

    proc = sim_node(camera_names=[''], max_steps=40)
    reply = probe.reset(1)
    assert reply.success, proc.log.read_text()

    def status_after(mark):
        return next((st for st in reversed(probe.status[mark:]) if st.episode == reply.episode), None)
    # more periods than max_steps pass (counted in joint_states messages): the episode has not started
    after_reset = len(probe.joints)
    assert wait_for(lambda: len(probe.joints) > after_reset + 3 * 40, 60), proc.log.read_text()
    mark = len(probe.status)
    waiting = wait_for(lambda: status_after(mark), 10)
    assert waiting and (waiting.steps, waiting.first_command_step, waiting.truncated) == (0, -1, False)
    np.testing.assert_allclose(probe.joints[-1].position, reply.state)       # the reset state, published fresh
    # the first command starts the episode: it runs its whole max_steps, then physics stops
    assert wait_for(lambda: probe.forward.get_subscription_count() > 0, 10)
    probe.forward.publish(Float64MultiArray(data=list(reply.state[:4])))
    ended = wait_for(lambda: (st := status_after(0)) is not None and st.truncated and st, 60)
    assert ended, proc.log.read_text()
    assert (ended.steps, ended.first_command_step, ended.commands) == (40, 1, 1)
