"""The adapters under a user's faults: bad robot values and frames, bad openpi observations, a failing worker.

Each test reproduces a case from the adapters' break-it review against a real worker (gRPC on loopback,
test/policies/adapter_arm.py) and asserts the product's rules: a typed error naming what was wrong, nothing
dropped or zero-filled, the arm held (never sent zeros), no wait without a bound.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

import sequence_ai
from sequence_ai_ros.adapters.lerobot_robot import LeRobotRobot
from sequence_ai_ros.exceptions import ContractViolation
from sequence_ai_ros.worker import serve_policy_file

ARM = Path(__file__).resolve().parents[1] / 'policies' / 'adapter_arm.py'
START = {'shoulder.pos': 1.0, 'elbow.pos': 2.0, 'grip.pos': 3.0}


@pytest.fixture
def arm_worker():
    """``arm_worker(**config)``: the endpoint of a worker of adapter_arm.py (deployment 'arm'); stopped at teardown."""
    servers = []

    def start(**config):
        server = serve_policy_file(ARM, deployment='arm', host='127.0.0.1', port=0, **config)
        servers.append(server)
        return f'127.0.0.1:{server.port}'

    yield start
    for server in servers:
        server.stop(grace=0.5)


class Robot:
    """A LeRobot robot's two methods and two feature dicts (the adapter uses nothing else); ``frame`` is its camera."""

    def __init__(self, frame=None, **values) -> None:
        self.q = dict(START)
        self.values = values
        self.frame = np.zeros((48, 64, 3), np.uint8) if frame is None else frame
        self.sent: list[dict] = []

    observation_features = property(lambda self: {**dict.fromkeys(self.q, float), 'front': (48, 64, 3)})
    action_features = property(lambda self: dict.fromkeys(self.q, float))

    def get_observation(self) -> dict:
        return {**self.q, **self.values, 'front': self.frame}

    def send_action(self, action: dict) -> dict:
        self.sent.append(action)
        return action


class CudaTensor:
    """What numpy gets from a torch tensor on a GPU: ``__array__`` raises."""

    def __array__(self, *args, **kwargs):
        raise TypeError("can't convert cuda:0 device type tensor to numpy")


@pytest.mark.parametrize('frame, problem', [
    (np.zeros((3, 96, 128), np.uint8), r'shape \(3, 96, 128\)'),          # CHW, another size
    (np.zeros((96, 128, 3), np.float32), 'dtype float32'),                # float, another size
    (np.zeros((0, 128, 3), np.uint8), 'empty'),                           # was resized into a black frame
    (CudaTensor(), 'CudaTensor is not an array'),                         # the adapter's np.asarray raised TypeError
])
def test_a_frame_that_is_no_image_ends_the_run_validate_naming_the_camera_and_the_arm_is_not_moved(
        arm_worker, frame, problem):
    endpoint = arm_worker()
    robot = Robot(frame=frame)
    with sequence_ai.connect(model='arm', endpoint=endpoint) as policy:
        bot = LeRobotRobot(robot, policy.contract)
        out = policy.run(bot.observe, bot.act, max_seconds=30.0, on_underrun=bot.hold)
    assert out.reason == 'validate' and isinstance(out.error, ContractViolation), out
    assert re.search(rf"image 'front': .*{problem}", str(out.error)), out.error
    assert out.actions == 0 and robot.sent == []       # nothing was commanded: no chunk came, hold had nothing to hold


def test_a_malformed_chunk_mid_run_ends_validate_and_the_robot_holds_its_last_command(arm_worker):
    endpoint = arm_worker(nan_from=3)        # chunks 1 and 2 hold the pose, the third is NaN
    robot = Robot()
    with sequence_ai.connect(model='arm', endpoint=endpoint) as policy:
        bot = LeRobotRobot(robot, policy.contract)
        out = policy.run(bot.observe, bot.act, max_seconds=30.0, on_underrun=bot.hold)
    assert out.reason == 'validate' and 'non-finite' in str(out.error), out
    assert out.actions >= 1 and len(robot.sent) == out.actions + 1      # every action, then one hold
    assert all(sent == START for sent in robot.sent)                    # never NaN, never zeros


def test_a_robot_value_that_is_no_number_ends_the_run_with_the_error_naming_its_key(arm_worker):
    endpoint = arm_worker()
    robot = Robot(**{'elbow.pos': 'fault'})
    with sequence_ai.connect(model='arm', endpoint=endpoint) as policy:
        bot = LeRobotRobot(robot, policy.contract)
        with pytest.raises(ContractViolation, match=r"'elbow\.pos' is 'fault' \(str\), not a number"):
            policy.run(bot.observe, bot.act, max_seconds=30.0, on_underrun=bot.hold)
        assert policy.episode_outcome().reason == 'error'
    assert robot.sent == []
