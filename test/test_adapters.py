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


@pytest.mark.parametrize('value, problem', [
    ('abc', r"'elbow\.pos' is 'abc' \(str\), not a number"),
    (None, r"'elbow\.pos' is None \(NoneType\), not a number"),
    (np.array([1.0, 2.0]), r"'elbow\.pos' is array\(\[1\., 2\.\]\) \(ndarray\), not a number"),
    (float('nan'), r"'elbow\.pos' is nan, not a finite float32"),
    (1e39, r"'elbow\.pos' is 1e\+39, not a finite float32"),        # finite as a float, inf as float32
])
def test_a_robot_value_that_is_no_finite_number_is_refused_naming_its_key(value, problem):
    arm = Arm()
    arm.q['elbow.pos'] = value
    with pytest.raises(ContractViolation, match=problem):
        LeRobotRobot(arm, _contract()).observe()


def test_a_missing_robot_key_is_refused_naming_it_and_the_keys_there_are():
    arm = Arm()
    bot = LeRobotRobot(arm, _contract())
    del arm.q['elbow.pos']
    with pytest.raises(ContractViolation, match=r"no 'elbow\.pos' \(it has \['front', 'grip', 'shoulder\.pos'\]\)"):
        bot.observe()


def test_a_mapping_is_used_as_given_or_refused_never_replaced_by_a_lookalike():
    # a given key the robot lacks: refused, though 'elbow.pos' would match the name
    with pytest.raises(ContractViolation, match=r"state_keys gives \{'elbow': 'elbow_typo'\}, which the robot"):
        LeRobotRobot(Arm(), _contract(), state_keys={'elbow': 'elbow_typo'})
    # a mapping for a name the contract does not have
    with pytest.raises(ContractViolation, match=r"action_keys maps \['wrist'\], which the contract does not name"):
        LeRobotRobot(Arm(), _contract(), action_keys={'wrist': 'grip'})
    # two action names onto one motor: one command would be lost
    with pytest.raises(ContractViolation, match=r"serves several contract names: \{'grip': \['shoulder', 'grip'\]\}"):
        LeRobotRobot(Arm(), _contract(), action_keys={'shoulder': 'grip'})
    # a given key wins over the name's own key
    arm = Arm()
    bot = LeRobotRobot(arm, _contract(), state_keys={'elbow': 'shoulder.pos', 'shoulder': 'elbow.pos'})
    assert bot.observe().state.tolist() == [1.0, 2.0, 3.0]


def test_hold_commands_no_motion_velocity_keys_and_a_velocity_contracts_rates_are_zero():
    class Base(Arm):
        def __init__(self) -> None:
            super().__init__()
            self.q = {'arm.pos': 1.0, 'x.vel': 0.0, 'theta.vel': 0.0}    # LeKiwi's arm position and base velocities

    base = Base()
    names = ('arm', 'x.vel', 'theta.vel')
    bot = LeRobotRobot(base, _contract(names=names))
    bot.act(Action(values=np.array([0.5, 0.25, 30.0], np.float32), action_space=ActionSpace.JOINT_ABSOLUTE))
    bot.hold()
    assert base.sent == [{'arm.pos': 0.5, 'x.vel': 0.25, 'theta.vel': 30.0}, {'arm.pos': 0.5, 'x.vel': 0.0,
                                                                              'theta.vel': 0.0}]
    arm = Arm()
    velocity = Contract(action_space=ActionSpace.JOINT_VELOCITY, action_names=('elbow', 'shoulder', 'grip'), dt=0.05,
                        chunk_length=4, observation=ObservationContract(state_names=('elbow', 'shoulder', 'grip'),
                                                                        cameras=[CameraSpec('front', 48, 64)]))
    bot = LeRobotRobot(arm, velocity)
    bot.act(Action(values=np.array([0.1, -0.1, 40.0], np.float32), action_space=ActionSpace.JOINT_VELOCITY))
    bot.hold()          # joint_velocity: joints stop, the gripper (its last channel, a position) stays
    assert arm.sent[-1] == {'elbow.pos': 0.0, 'shoulder.pos': 0.0, 'grip': 40.0}


def test_act_holds_for_none_or_a_hold_and_refuses_non_finite_values_sending_nothing():
    arm = Arm()
    bot = LeRobotRobot(arm, _contract())
    bot.act(None)                      # next_action() before anything to hold: nothing is sent
    assert arm.sent == []
    bot.act(Action(values=np.array([5, 6, 7], np.float32), action_space=ActionSpace.JOINT_ABSOLUTE))
    bot.act(Action(values=np.array([0, 0, 0], np.float32), action_space=ActionSpace.JOINT_ABSOLUTE, hold=True))
    bot.act(None)
    assert arm.sent == [{'elbow.pos': 5.0, 'shoulder.pos': 6.0, 'grip': 7.0}] * 3
    for bad in ([5, float('nan'), 7], [5, 6]):
        with pytest.raises(ContractViolation, match='an action of 3 finite values is required'):
            bot.act(Action(values=np.array(bad, np.float32), action_space=ActionSpace.JOINT_ABSOLUTE))
    assert len(arm.sent) == 3
