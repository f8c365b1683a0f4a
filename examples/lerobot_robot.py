"""Drive a LeRobot robot (any ``lerobot.robots.Robot``) from a policy that ``seq serve`` serves.

    python examples/lerobot_robot.py [MODEL]

It runs ``EchoArm``, a LeRobot Robot without hardware whose motors reach each goal at once. Your own arm goes in
its place, e.g. ``SO101Follower(SO101FollowerConfig(port='/dev/ttyACM0', id='my_arm'))`` from
``lerobot.robots.so_follower``; the policy's joint names are its motors (``shoulder_pan`` or ``shoulder_pan.pos``).
The endpoint is ``$SEQ_ENDPOINT``, else 127.0.0.1:50551.
"""
import dataclasses
import sys
import tempfile
from pathlib import Path

from lerobot.robots import Robot, RobotConfig

import sequence_ai
from sequence_ai_ros.adapters.lerobot_robot import LeRobotRobot

MOTORS = ('shoulder_pan', 'shoulder_lift', 'elbow_flex', 'wrist_flex', 'wrist_roll', 'gripper')


@RobotConfig.register_subclass('echo_arm')
@dataclasses.dataclass
class EchoArmConfig(RobotConfig):
    """No settings: the arm is simulated."""


class EchoArm(Robot):
    """A LeRobot robot whose motors (degrees, gripper 0..100) reach each goal position at once."""

    config_class = EchoArmConfig
    name = 'echo_arm'

    def __init__(self, config):
        super().__init__(config)
        self.q = {f'{m}.pos': 10.0 * i for i, m in enumerate(MOTORS)}
        self.connected = False

    observation_features = property(lambda self: dict.fromkeys(self.q, float))
    action_features = property(lambda self: dict.fromkeys(self.q, float))
    is_connected = property(lambda self: self.connected)
    is_calibrated = property(lambda self: True)

    def connect(self, calibrate=True):
        self.connected = True

    def calibrate(self):
        pass

    def configure(self):
        pass

    def get_observation(self):
        return dict(self.q)

    def send_action(self, action):
        self.q.update(action)
        return action

    def disconnect(self):
        self.connected = False


robot = EchoArm(EchoArmConfig(id='echo', calibration_dir=Path(tempfile.gettempdir()) / 'echo_arm'))
robot.connect()
with sequence_ai.connect(model=sys.argv[1] if len(sys.argv) > 1 else 'my_arm') as policy:
    arm = LeRobotRobot(robot, policy.contract)         # the policy's joints looked up in the robot's features
    policy.wait_until_ready()
    print(policy.run(arm.observe, arm.act, max_seconds=3.0, on_underrun=arm.hold))
    print('worker', policy.worker_version, 'pose', {k: round(v, 3) for k, v in robot.get_observation().items()})
robot.disconnect()
