"""The adapters' mapping of names and images, without a worker (the examples run them against one).

A robot here is a plain object with LeRobot's two methods and two feature dicts: the adapter uses nothing else
(``make check-lerobot`` drives a real ``lerobot.robots.Robot`` subclass through it).
"""

from __future__ import annotations

import numpy as np
import pytest

from sequence_ai_ros.adapters.lerobot_robot import LeRobotRobot
from sequence_ai_ros.exceptions import ContractViolation
from sequence_ai_ros.protocol.contract import CameraSpec, Contract, ObservationContract
from sequence_ai_ros.protocol.spaces import ActionSpace
from sequence_ai_ros.protocol.types import Action


class Arm:
    def __init__(self) -> None:
        self.q = {'shoulder.pos': 1.0, 'elbow.pos': 2.0, 'grip': 3.0}
        self.frame = np.zeros((48, 64, 3), np.uint8)
        self.sent: list[dict] = []

    observation_features = property(lambda self: {**dict.fromkeys(self.q, float), 'front': (48, 64, 3)})
    action_features = property(lambda self: dict.fromkeys(self.q, float))

    def get_observation(self) -> dict:
        return {**self.q, 'front': self.frame}

    def send_action(self, action: dict) -> dict:
        self.sent.append(action)
        return action


def _contract(names=('elbow', 'shoulder', 'grip'), camera='front') -> Contract:
    return Contract(action_space=ActionSpace.JOINT_ABSOLUTE, action_names=names, dt=0.05, chunk_length=4,
                    observation=ObservationContract(state_names=names, cameras=[CameraSpec(camera, 48, 64)]))


def test_contract_names_map_onto_lerobot_keys_and_pos_suffix_in_the_contracts_order():
    arm = Arm()
    bot = LeRobotRobot(arm, _contract())
    obs = bot.observe()
    assert obs.state.tolist() == [2.0, 1.0, 3.0] and obs.state_names == ('elbow', 'shoulder', 'grip')
    assert obs.images['front'].shape == (48, 64, 3)
    bot.act(Action(values=np.array([5, 6, 7], np.float32), action_space=ActionSpace.JOINT_ABSOLUTE))
    bot.hold()
    assert arm.sent == [{'elbow.pos': 5.0, 'shoulder.pos': 6.0, 'grip': 7.0}] * 2


def test_a_name_the_robot_lacks_is_refused_naming_it_and_the_robots_keys():
    with pytest.raises(ContractViolation, match=r"no state key for \['wrist'\].*shoulder\.pos"):
        LeRobotRobot(Arm(), _contract(names=('wrist', 'elbow')))
    with pytest.raises(ContractViolation, match=r"no camera key for \['wrist_cam'\]"):
        LeRobotRobot(Arm(), _contract(camera='wrist_cam'))
    bot = LeRobotRobot(Arm(), _contract(camera='wrist_cam'), camera_keys={'wrist_cam': 'front'})
    assert bot.observe().images['wrist_cam'].shape == (48, 64, 3)


def test_hold_before_any_action_sends_nothing():
    arm = Arm()
    LeRobotRobot(arm, _contract()).hold()
    assert arm.sent == []


def test_openpi_images_in_chw_are_handed_on_as_hwc():
    pytest.importorskip('openpi_client', reason='openpi-client is installed by make test')
    from sequence_ai_ros.adapters.openpi_policy import _hwc

    chw = np.arange(3 * 4 * 5, dtype=np.uint8).reshape(3, 4, 5)
    assert _hwc(chw).shape == (4, 5, 3) and (_hwc(chw)[..., 1] == chw[1]).all()
    hwc = np.zeros((4, 5, 3), np.uint8)
    assert _hwc(hwc).shape == (4, 5, 3)
    assert _hwc(b'\xff\xd8jpeg') == b'\xff\xd8jpeg'
