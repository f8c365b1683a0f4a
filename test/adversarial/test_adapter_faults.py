"""The adapters under a user's faults: bad robot values and frames, bad openpi observations, a failing worker.

Each test reproduces a case from the adapters' break-it review against a real worker (gRPC on loopback,
test/policies/adapter_arm.py) and asserts the product's rules: a typed error naming what was wrong, nothing
dropped or zero-filled, the arm held (never sent zeros), no wait without a bound.
"""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import serving

import sequence_ai
from sequence_ai_ros.adapters.lerobot_robot import LeRobotRobot
from sequence_ai_ros.exceptions import ConnectionLost, ContractViolation, NotReady, SequenceAIError
from sequence_ai_ros.worker import serve_policy_file

ARM = Path(__file__).resolve().parents[1] / 'policies' / 'adapter_arm.py'
START = {'shoulder.pos': 1.0, 'elbow.pos': 2.0, 'grip.pos': 3.0}


@pytest.fixture
def arm_worker():
    """``arm_worker(**config)``: the endpoint of a worker of adapter_arm.py (deployment 'arm'); stopped at teardown."""
    yield from serving(ARM, 'arm')


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


# -- openpi ------------------------------------------------------------------------------------------------

FRAME = np.zeros((48, 64, 3), np.uint8)


def _obs(**over) -> dict:
    return {'state': np.array([1.0, 2.0, 3.0], np.float32), 'images': {'front': FRAME}, 'prompt': 'hold', **over}


@pytest.fixture
def openpi_policy(arm_worker):
    """``openpi_policy(**config)``: a SequencePolicy (5 s first-chunk bound) on a worker of adapter_arm.py."""
    pytest.importorskip('openpi_client', reason='openpi-client is installed by make test')
    from sequence_ai_ros.adapters.openpi_policy import SequencePolicy

    handles = []

    def make(**config):
        served = sequence_ai.connect(model='arm', endpoint=arm_worker(**config))
        handles.append(served)
        return SequencePolicy(served, control_period=0.02, first_chunk_timeout=5.0)

    yield make
    for served in handles:
        served.close()


@pytest.mark.parametrize('obs, problem', [
    (None, 'an openpi observation is a dict, not NoneType'),
    (_obs(images=[FRAME]), r"'images' is a list; a dict \{camera: image\} is required"),
    (_obs(images=np.zeros((1, 48, 64, 3), np.uint8)), r"'images' is a ndarray; a dict"),
    (_obs(state=np.array(['a', 'b', 'c'])), "'state' is not a vector of numbers"),
    (_obs(prompt=np.array(['a', 'b'])), "'prompt' is a ndarray, not text"),
])
def test_an_openpi_observation_of_another_structure_is_a_contract_violation_naming_it(openpi_policy, obs, problem):
    policy = openpi_policy()
    with pytest.raises(ContractViolation, match=problem):
        policy.infer(obs)
    assert policy.infer(_obs())['actions'].tolist() == [1.0, 2.0, 3.0]     # nothing was opened: it runs after


@pytest.mark.parametrize('config, obs, error, problem', [
    ({}, _obs(images={'front': np.zeros((3, 48, 64), np.float32)}), ContractViolation, 'dtype float32'),
    ({'nan_from': 1}, _obs(), ContractViolation, 'non-finite'),
])
def test_an_episode_failing_before_its_first_chunk_raises_its_own_error_at_once(openpi_policy, config, obs, error,
                                                                                 problem):
    policy = openpi_policy(**config)
    start = time.monotonic()
    with pytest.raises(error, match=problem):
        policy.infer(obs)
    assert time.monotonic() - start < policy.first_chunk_timeout      # not the first-chunk bound's PolicyException
    assert policy.policy.episode_outcome() is not None and not policy._open          # ended: the next one opens anew


def test_an_episode_failing_after_its_first_chunk_raises_from_infer_instead_of_holding_forever(openpi_policy):
    policy = openpi_policy(nan_from=3)
    actions = []
    with pytest.raises(ContractViolation, match='non-finite'):
        for _ in range(2000):                  # bounded: the third chunk is NaN, well within it
            actions.append(policy.infer(_obs())['actions'].tolist())
            time.sleep(0.005)
    assert actions and all(a == [1.0, 2.0, 3.0] for a in actions)      # the pose, never NaN or zeros
    assert policy.policy.episode_outcome().reason == 'validate'
    policy.reset()                                                      # the runtime's next episode starts clean
    assert not policy._open


def test_a_worker_that_stops_mid_episode_raises_typed_from_infer(arm_worker):
    pytest.importorskip('openpi_client', reason='openpi-client is installed by make test')
    from sequence_ai_ros.adapters.openpi_policy import SequencePolicy

    server = serve_policy_file(ARM, deployment='arm', host='127.0.0.1', port=0)
    try:
        with sequence_ai.connect(model='arm', endpoint=f'127.0.0.1:{server.port}') as served:
            policy = SequencePolicy(served, control_period=0.02, first_chunk_timeout=5.0)
            assert policy.infer(_obs())['hold'] is False
            server.stop(grace=0.2)
            with pytest.raises(SequenceAIError) as raised:
                for _ in range(2000):
                    policy.infer(_obs())
                    time.sleep(0.005)
            assert isinstance(raised.value, (NotReady, ConnectionLost)), raised.value
    finally:
        server.stop(grace=0.2)


@pytest.mark.parametrize('kwargs, error', [({'first_chunk_timeout': float('nan')}, ValueError),
                                           ({'first_chunk_timeout': -1.0}, ValueError),
                                           ({'control_period': 0.0}, ValueError),
                                           ({'first_chunk_timeout': '5'}, TypeError)])
def test_a_first_chunk_bound_or_period_that_bounds_nothing_is_refused_when_made(openpi_policy, kwargs, error):
    from sequence_ai_ros.adapters.openpi_policy import SequencePolicy

    served = openpi_policy().policy
    with pytest.raises(error):
        SequencePolicy(served, **kwargs)


def test_a_second_thread_in_infer_is_refused_and_the_first_keeps_its_episode(openpi_policy):
    policy = openpi_policy(first_s=1.0)           # the first infer waits about 1 s for its first chunk
    got: list = []
    first = threading.Thread(target=lambda: got.append(policy.infer(_obs())))
    first.start()
    deadline = time.monotonic() + 10
    while not policy._open and time.monotonic() < deadline:     # the first thread is inside, waiting
        time.sleep(0.005)
    with pytest.raises(RuntimeError, match='a second thread called infer'):
        policy.infer(_obs())
    first.join(10)
    assert got and got[0]['actions'].tolist() == [1.0, 2.0, 3.0]      # the first thread's episode ran on
