"""``hold``: answer every request with the robot's current measured position, for a safe bring-up.

The chunk is the measured state s[t] repeated ``chunk_length`` times (joint_absolute), so a robot that
executes it stays where it is: use it to check wiring, joint order, rates and the controller before any
learned policy moves the arm. It works for any number of joints: list them in ``config.yaml``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

import sequence_ai_ros.policy as seq

#: The joints of the G1 dataset in ../shared/data (14 arm joints in rad, 12 hand joints 0..1); config.yaml
#: replaces them with your robot's joint names.
DEFAULT_JOINTS = (
    'kLeftShoulderPitch', 'kLeftShoulderRoll', 'kLeftShoulderYaw', 'kLeftElbow', 'kLeftWristRoll',
    'kLeftWristPitch', 'kLeftWristYaw', 'kRightShoulderPitch', 'kRightShoulderRoll', 'kRightShoulderYaw',
    'kRightElbow', 'kRightWristRoll', 'kRightWristPitch', 'kRightWristYaw', 'kLeftHandPinky', 'kLeftHandRing',
    'kLeftHandMiddle', 'kLeftHandIndex', 'kLeftHandThumbBend', 'kLeftHandThumbRotation', 'kRightHandPinky',
    'kRightHandRing', 'kRightHandMiddle', 'kRightHandIndex', 'kRightHandThumbBend', 'kRightHandThumbRotation',
)


@seq.policy(action_space='joint_absolute', action_names=DEFAULT_JOINTS, dt=1 / 30, chunk_length=30,
            observation=seq.ObservationContract(state_names=DEFAULT_JOINTS),
            gripper='held like any other joint')
class Hold:
    """Repeat the measured joint positions.

    :param joint_names: the robot's joints, in the order of its state vector (D names).
    :param dt: action period (s).
    :param chunk_length: actions per chunk T.
    """

    def __init__(self, joint_names: Sequence[str] = DEFAULT_JOINTS, dt: float = 1 / 30, chunk_length: int = 30) -> None:
        self.chunk_length = int(chunk_length)

    @classmethod
    def configure_contract(cls, contract: seq.Contract, config: dict) -> seq.Contract:
        """Return the contract for ``config`` (joint names, dt, chunk_length)."""
        names = tuple(config.get('joint_names') or DEFAULT_JOINTS)
        return dataclasses.replace(contract, action_names=names, dt=float(config.get('dt', contract.dt)),
                                   chunk_length=int(config.get('chunk_length', contract.chunk_length)),
                                   observation=seq.ObservationContract(state_names=names))

    def infer(self, inp: seq.PolicyInput, episode: seq.Episode) -> np.ndarray:
        """Return float32 (T, D): the measured state s[t] (rad / m / hand units) repeated T times."""
        return np.repeat(inp.observation.state[None, :], self.chunk_length, axis=0).astype(np.float32)
