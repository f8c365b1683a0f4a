"""``replay``: play back the recorded actions of one LeRobot v2.1 episode, for bringing up a robot or controller.

Timeline: the episode's clock starts at the first request (robot time t0, the observation's timestamp on
the robot's monotonic clock). A request observed at robot time t gets the recorded actions from index
``k = round((t - t0) / dt)`` on: chunk[0] is the action for the moment the observation was taken, as
the protocol defines, and the client skips what it has already executed by counting. Past the end of
the recording the chunk repeats the last recorded action and is marked ``done``.

Safety: before the first chunk the measured state is compared with the first recorded action; when any
joint is further than ``max_start_error`` (rad, or the joint's unit) the request fails with a clear
error and the robot holds, instead of jumping to the recording's start pose.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import numpy as np

import sequence_ai_ros.policy as seq
from sequence_ai_ros.datasets.lerobot_reader import LeRobotDataset
from sequence_ai_ros.exceptions import ConfigError

HERE = Path(__file__).resolve().parent


def _dataset_path(value: str) -> Path:
    """Resolve ``dataset`` from config.yaml: ``~`` and $VARS expand; a relative path is relative to policy.py."""
    if not value:
        raise ConfigError('replay: set `dataset:` in config.yaml to a LeRobot v2.1 directory')
    path = Path(os.path.expandvars(os.path.expanduser(str(value))))
    return path if path.is_absolute() else (HERE / path).resolve()


@seq.policy(action_space='joint_absolute', action_names=['placeholder'], dt=1 / 30, chunk_length=30,
            observation=seq.ObservationContract(state_names=['placeholder']),
            gripper='replayed like any other joint')
class Replay:
    """Replay episode ``episode`` of ``dataset`` chunk by chunk on the robot's clock.

    :param dataset: LeRobot v2.1 directory (absolute, or relative to this file).
    :param episode: episode index to replay.
    :param chunk_length: actions per chunk T.
    :param max_start_error: largest allowed |s[0] - a_rec[0]| per joint before moving; 0 disables.
    :raises ConfigError: for a bad dataset, episode, or a state/action dimension mismatch.
    """

    def __init__(self, dataset: str = '', episode: int = 0, chunk_length: int = 30,
                 max_start_error: float = 0.2) -> None:
        self.dataset = _dataset_path(dataset)
        self.episode = int(episode)
        self.chunk_length = int(chunk_length)
        self.max_start_error = float(max_start_error)
        self.actions: np.ndarray | None = None
        self.dt = 1 / 30

    @classmethod
    def configure_contract(cls, contract: seq.Contract, config: dict) -> seq.Contract:
        """Return the dataset's contract: its state/action names, dt = 1/fps, joint_absolute."""
        ds = LeRobotDataset(_dataset_path(config.get('dataset', '')))
        ds.length(int(config.get('episode', 0)))  # raises ConfigError for an unknown episode
        return dataclasses.replace(contract, action_names=ds.action_names, dt=1.0 / ds.fps,
                                   chunk_length=int(config.get('chunk_length', contract.chunk_length)),
                                   observation=seq.ObservationContract(state_names=ds.state_names))

    def load(self) -> None:
        """Read the episode's recorded actions, float32 (N, D)."""
        ds = LeRobotDataset(self.dataset)
        self.actions = ds.episode(self.episode).action
        self.dt = 1.0 / ds.fps

    def infer(self, inp: seq.PolicyInput, episode: seq.Episode) -> seq.Result:
        """Return the recorded actions a_rec[k : k+T] for the request's robot time (float32 (T, D))."""
        if self.actions is None:
            self.load()
        actions = self.actions
        assert actions is not None         # load() sets it
        now = inp.observation.timestamp
        if 't0' not in episode.state:
            error = np.abs(inp.observation.state - actions[0])
            if self.max_start_error > 0 and float(error.max()) > self.max_start_error:
                j = int(error.argmax())
                raise ValueError(f'replay: the robot is {error[j]:.3f} away from the recording\'s start on joint '
                                 f'{inp.observation.state_names[j] if inp.observation.state_names else j} '
                                 f'(max_start_error {self.max_start_error}); move it to the start pose first')
            episode.state['t0'] = now
        k = max(0, int(round((now - episode.state['t0']) / self.dt)))
        idx = np.minimum(np.arange(k, k + self.chunk_length), len(actions) - 1)
        return seq.Result(actions=actions[idx], done=k + self.chunk_length >= len(actions))
