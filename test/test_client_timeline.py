"""Exact timelines in delta spaces, on a real recorded trajectory (WidowX-200 joint states, ../shared/data).

A worker on loopback replays the recorded path as joint_delta or ee_delta chunks
(``test/policies/delta_replay.py``), with a latency of about a third of a chunk (+-20 %), so every chunk
after the first arrives with stale rows to skip. The robot double integrates what it is given and reports
how many chunk steps it executed (``clock``). Driven by run() at the policy's rate and by next_action() at
twice that rate (each row then runs as two half increments), the executed increments must be the
recorded ones one for one (none dropped, none applied twice, across seams and stale skips), and the
integrated path must be the recorded path to float32 precision.
"""

from __future__ import annotations

import collections
import math
import time
from pathlib import Path

import numpy as np
import pytest

from sequence_ai_ros.client import Action, Observation, connect
from sequence_ai_ros.worker import serve_policy_file

POLICY = Path(__file__).parent / 'policies' / 'delta_replay.py'
JOINTS = ('waist', 'shoulder', 'elbow', 'wrist_angle', 'wrist_rotate', 'gripper')
EE = ('x', 'y', 'z', 'roll', 'pitch', 'yaw', 'gripper')
DT, T, STEPS = 0.02, 20, 150


def recorded_joints(bag: Path) -> np.ndarray:
    """float32 (STEPS + 1, 6): the arm's joint positions (rad) at 10 Hz from the moving part of the bag."""
    from rosbags.highlevel import AnyReader

    rows = []
    with AnyReader([bag]) as reader:
        conns = [c for c in reader.connections if c.topic == '/wx200/joint_states']
        for conn, _, raw in reader.messages(connections=conns):
            msg = reader.deserialize(raw, conn.msgtype)
            rows.append([msg.position[list(msg.name).index(n)] for n in JOINTS])
    ten_hz = np.asarray(rows, np.float64)[::10]
    return ten_hz[20:20 + STEPS + 1].astype(np.float32)


def end_effector(q: np.ndarray) -> np.ndarray:
    """float32 (N, 7): an end-effector path from joint positions (a WidowX-200-like serial chain, m and rad)."""
    waist, shoulder, elbow, wrist, rotate, grip = (q[:, i].astype(np.float64) for i in range(6))
    reach = 0.206 * np.sin(shoulder) + 0.2 * np.cos(shoulder + elbow) + 0.065 * np.cos(shoulder + elbow + wrist)
    z = 0.11 + 0.206 * np.cos(shoulder) - 0.2 * np.sin(shoulder + elbow) - 0.065 * np.sin(shoulder + elbow + wrist)
    pose = np.stack([reach * np.cos(waist), reach * np.sin(waist), z, rotate, shoulder + elbow + wrist, waist, grip], 1)
    return pose.astype(np.float32)


class DeltaRobot:
    """Integrates the increments it executes; its state is the path so far plus ``clock`` (chunk steps run)."""

    def __init__(self, start: np.ndarray, names: tuple[str, ...], space: str, step: float) -> None:
        self.pose = start.astype(np.float32).copy()
        self.names, self.space, self.step = names, space, step
        self.clock = 0.0
        self.log: list[tuple[float, np.ndarray, np.ndarray]] = []   # (clock before, increment, pose after)

    def observe(self) -> Observation:
        return Observation(state=np.append(self.pose, np.float32(self.clock)).astype(np.float32),
                           state_names=(*self.names, 'clock'))

    def act(self, action: Action) -> None:
        assert not action.hold
        if self.space == 'joint_delta':
            self.pose = action.values.astype(np.float32)          # the engine integrates joint_delta
        else:
            self.pose[:6] = (self.pose[:6] + action.values[:6]).astype(np.float32)
            self.pose[6:] = action.values[6:]
        self.log.append((self.clock, action.delta.copy(), self.pose.copy()))
        self.clock += self.step


def check(robot: DeltaRobot, path: np.ndarray, rate_dims: int) -> None:
    increments = (path[1:] - path[:-1])[:, :rate_dims]
    per_step: dict[int, list[np.ndarray]] = collections.defaultdict(list)
    for clock, delta, _ in robot.log:
        per_step[int(math.floor(clock + 1e-9))].append(delta[:rate_dims])
    assert sorted(per_step) == list(range(STEPS)), 'every recorded step executed, in order, none twice'
    per_row = round(1 / robot.step)
    for k in range(STEPS):
        parts = per_step[k]
        assert len(parts) == per_row, f'step {k} ran {len(parts)} times'
        total = np.sum(np.asarray(parts, np.float32), axis=0, dtype=np.float32)
        np.testing.assert_array_equal(total, increments[k], err_msg=f'recorded step {k}')
    for clock, _, pose in robot.log:       # the integrated path is the recorded one (linear within a row)
        c = clock + robot.step
        k, f = int(math.floor(c + 1e-9)), c - math.floor(c + 1e-9)
        want = path[k] if f == 0 else (1 - f) * path[k].astype(np.float64) + f * path[k + 1]
        np.testing.assert_allclose(pose[:rate_dims], np.asarray(want)[:rate_dims], rtol=0,
                                   atol=STEPS * 4 * np.finfo(np.float32).eps * (1 + np.abs(path).max()))


@pytest.mark.slow
@pytest.mark.parametrize('space', ['joint_delta', 'ee_delta'])
def test_delta_replay_of_a_real_trajectory_runs_every_recorded_step_once(space, wx200_bag, tmp_path):
    joints = recorded_joints(wx200_bag)
    path, names, rate_dims = (joints, JOINTS, 6) if space == 'joint_delta' else (end_effector(joints), EE, 6)
    np.save(tmp_path / 'path.npy', path)
    covers = DT * T
    server = serve_policy_file(POLICY, deployment='replay', port=0, recording=str(tmp_path / 'path.npy'),
                               names=list(names), action_space=space, dt=DT, chunk_length=T,
                               mean_s=0.3 * covers, jitter=0.2, seed=3)
    try:
        with connect('replay', endpoint=f'127.0.0.1:{server.port}') as policy:
            policy.wait_until_ready(timeout=30)
            # run() at the policy's own rate.
            robot = DeltaRobot(path[0], names, space, step=1.0)
            out = policy.run(robot.observe, robot.act, max_actions=STEPS)
            assert out.reason == 'completed' and out.actions == STEPS and out.chunks >= 5 and out.stale_actions > 0
            check(robot, path, rate_dims)
            # next_action() at twice the rate: every row runs as two half increments.
            robot = DeltaRobot(path[0], names, space, step=0.5)
            policy.begin_episode('replay', control_period=DT / 2, max_actions=STEPS)
            deadline = time.monotonic() + 300
            while policy.episode_outcome() is None and time.monotonic() < deadline:
                action = policy.next_action(robot.observe())
                if action is not None and not action.hold:
                    robot.act(action)
                time.sleep(DT / 2)
            assert policy.episode_outcome() is not None, 'the episode did not reach max_actions'
            out = policy.end_episode()
            assert out.reason == 'completed' and out.actions == STEPS and out.chunks >= 5 and out.stale_actions > 0
            check(robot, path, rate_dims)
    finally:
        server.stop(grace=0.5)


class TimedRobot:
    """Records when it observed and acted; row k of the latency policy is meant for its k-th action."""

    def __init__(self) -> None:
        self.observed: list[float] = []
        self.acted: list[float] = []

    def observe(self) -> Observation:
        self.observed.append(time.monotonic())
        return Observation(state=np.array([len(self.acted), 0], np.float32), state_names=('frame', 'request'))

    def act(self, action: Action) -> None:
        assert action.values[0] == len(self.acted)       # row k for the k-th action: row 0 first
        self.acted.append(time.monotonic())


def test_act_and_run_execute_the_first_action_when_the_first_chunk_arrives():
    """Not a period later.

    With dt = 0.5 s and a 10 ms policy the first action follows the first observation within a fraction of
    the period (early, for the episode's next deadline), and the next ones come on the episode's grid: the
    deadlines after it, a period apart.
    """
    server = serve_policy_file(Path(__file__).parent / 'policies' / 'client_latency.py', deployment='lat', port=0,
                               mean_s=0.01, dt=0.5, chunk_length=4)
    try:
        with connect('lat', endpoint=f'127.0.0.1:{server.port}') as policy:
            policy.wait_until_ready(timeout=30)
            for drive in ('run', 'act'):
                robot = TimedRobot()
                if drive == 'run':
                    out = policy.run(robot.observe, robot.act, max_actions=3)
                else:
                    out = policy.act('go', robot.observe, robot.act, max_seconds=1.7)
                first = robot.acted[0] - robot.observed[0]
                assert len(robot.acted) >= 3 and out.underruns == 0
                assert first < 0.25, f'{drive}: first action {first:.3f} s after the first observation'
                assert robot.acted[2] - robot.acted[0] > 0.9     # then paced at dt, on the episode's grid
    finally:
        server.stop(grace=0.5)
