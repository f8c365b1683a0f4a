"""The real recordings that :mod:`.exactness` replays (``../shared/data``, or ``$SEQ_DATA_DIR``).

- ``joint_delta`` / ``ee_delta``, dt 0.2 s: the WidowX-200 joint-state bag resampled to 0.2 s. The policy
  (``test/policies/delta_replay.py``) serves increments of the recorded path from the step the robot
  reports (its state's last value, ``clock``). For ee_delta the path is x y z roll pitch yaw of a planar
  forward kinematics of waist/shoulder/elbow/wrist, plus a position channel in the gripper's slot: the bag's
  gripper never moves (0.8437 rad throughout), which would check nothing, so that channel replays the
  recorded waist angle (rad), a real moving position that ee_delta interpolates rather than sums.
- ``joint_absolute``, dt 1/30 s: the G1 ``g1_pick_bottle_v21`` episode 0 actions (26 joints), served by
  ``test/policies/client_replay.py`` from the frame the robot reports; the robot's state is the recorded
  ``observation.state`` of that frame.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[2]
DATA = Path(os.environ.get('SEQ_DATA_DIR') or REPO.parent / 'shared' / 'data').resolve()
WX200_BAG = DATA / 'wx200_joint_states' / 'rosbag2'
G1_DATASET = DATA / 'g1_pick_bottle_v21'
POLICIES = REPO / 'test' / 'policies'

WX_JOINTS = ('waist', 'shoulder', 'elbow', 'wrist_angle', 'wrist_rotate', 'gripper')
WX_EE = ('x', 'y', 'z', 'roll', 'pitch', 'yaw', 'grip')
WX_DT, WX_CHUNK = 0.2, 10
#: Starts (0.2 s steps into the resampled bag) of stretches with motion: the waist sweeps back and forth
#: (~0.4 rad a step) from step 10 to 510; shoulder, elbow and wrist move in 510-520 too.
WX_STARTS = (505, 14, 110, 206, 302, 398)
WX_STEPS = 16
G1_DT, G1_CHUNK = 1 / 30, 30
#: Starts (frames of G1 episode 0, 393 frames) of the replayed stretches.
G1_STARTS = (60, 0, 120, 180, 240, 300)
G1_STEPS = 90


@dataclasses.dataclass
class Source:
    """What one action space replays.

    :param space: the action space.
    :param state_names: the robot's state names (the action names, then the step counter).
    :param dt: the policy's step (s). :param policy: the policy file. :param config: its constructor kwargs.
    :param path: float32 (M, D) recorded positions (delta spaces: the policy's path; absolute: actions).
    :param states: float32 (M, D) recorded observation.state (absolute), else None.
    :param rate_dims: how many leading action channels are rates (summed), the rest are positions.
    """

    space: str
    state_names: tuple[str, ...]
    dt: float
    policy: Path
    config: dict[str, Any]
    path: np.ndarray
    states: np.ndarray | None
    rate_dims: int


def wx200_joints(bag: Path = WX200_BAG, dt: float = WX_DT) -> np.ndarray:
    """float32 (M, 6) the WidowX-200's joint positions (rad, :data:`WX_JOINTS`) resampled to ``dt`` (s)."""
    return _wx200_joints(str(Path(bag).resolve()), float(dt)).copy()


@functools.lru_cache(maxsize=2)
def _wx200_joints(bag: str, dt: float) -> np.ndarray:
    from rosbags.highlevel import AnyReader

    rows, stamps = [], []
    with AnyReader([Path(bag)]) as reader:
        conns = [c for c in reader.connections if c.topic == '/wx200/joint_states']
        for conn, stamp, raw in reader.messages(connections=conns):
            msg: Any = reader.deserialize(raw, conn.msgtype)     # a sensor_msgs JointState
            names = list(msg.name)
            rows.append([msg.position[names.index(n)] for n in WX_JOINTS])
            stamps.append(stamp * 1e-9)
    q, t = np.asarray(rows, np.float64), np.asarray(stamps)
    grid = np.arange(t[0], t[-1], dt)
    return np.stack([np.interp(grid, t, q[:, i]) for i in range(q.shape[1])], 1).astype(np.float32)


def end_effector(q: np.ndarray) -> np.ndarray:
    """float32 (M, 7): x y z (m), roll pitch yaw (rad) of a WidowX-200-like planar chain, and the waist angle.

    The last channel is a position (ee_delta's gripper slot; see the module docstring).
    """
    waist, shoulder, elbow, wrist, rotate = (q[:, i].astype(np.float64) for i in range(5))
    reach = 0.206 * np.sin(shoulder) + 0.2 * np.cos(shoulder + elbow) + 0.065 * np.cos(shoulder + elbow + wrist)
    z = 0.11 + 0.206 * np.cos(shoulder) - 0.2 * np.sin(shoulder + elbow) - 0.065 * np.sin(shoulder + elbow + wrist)
    pose = np.stack([reach * np.cos(waist), reach * np.sin(waist), z, rotate, shoulder + elbow + wrist, waist,
                     waist], 1)
    return pose.astype(np.float32)


def wx200_source(space: str, workdir: Path, bag: Path = WX200_BAG) -> Source:
    """The joint_delta or ee_delta replay of the WidowX-200 bag (its path saved under ``workdir``)."""
    joints = wx200_joints(bag)
    path, names, rate_dims = (joints, WX_JOINTS, 6) if space == 'joint_delta' else (end_effector(joints), WX_EE, 6)
    npy = Path(workdir) / f'{space}.npy'
    np.save(npy, path)
    config = {'recording': str(npy), 'names': list(names), 'action_space': space, 'dt': WX_DT,
              'chunk_length': WX_CHUNK}
    return Source(space, (*names, 'clock'), WX_DT, POLICIES / 'delta_replay.py', config, path, None, rate_dims)


def g1_source(dataset: Path = G1_DATASET, episode: int = 0) -> Source:
    """The joint_absolute replay of a G1 episode's recorded actions."""
    from sequence_ai_ros.datasets.lerobot_reader import LeRobotDataset

    ds = LeRobotDataset(dataset)
    data = ds.episode(episode)
    names = ds.action_names
    config = {'parquet': str(ds.data_path(episode)), 'names': list(names), 'action_space': 'joint_absolute',
              'dt': G1_DT, 'chunk_length': G1_CHUNK}
    return Source('joint_absolute', (*names, 'frame'), G1_DT, POLICIES / 'client_replay.py', config,
                  data.action.astype(np.float32), data.state.astype(np.float32), 0)
