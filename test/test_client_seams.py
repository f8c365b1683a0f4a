"""Seams on real robot data: recorded G1 actions served as chunks by a real worker.

``test/policies/client_replay.py`` serves the recorded actions of G1 episode 0 aligned on the frame the
robot reports; every other chunk is shifted by ``shift`` frames, so its seams jump as a policy's
re-plans do. Numbers are printed; run with ``-s`` to see them.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from sequence_ai_ros.client import Observation, connect
from sequence_ai_ros.worker import serve_policy_file

REPLAY = Path(__file__).parent / 'policies' / 'client_replay.py'
DT, T = 0.01, 20


def _episode(dataset: Path) -> tuple[str, list[str], np.ndarray]:
    names = json.loads((dataset / 'meta' / 'info.json').read_text())['features']['action']['names']
    names = list(names[0] if isinstance(names[0], list) else names)
    parquet = dataset / 'data' / 'chunk-000' / 'episode_000000.parquet'
    actions = np.asarray(pq.read_table(parquet, columns=['action']).column('action').to_pylist(), np.float32)
    return str(parquet), names, actions


class Follower:
    """A robot that tracks its commands exactly and reports which recorded frame it is at."""

    def __init__(self, start: np.ndarray, names: list[str]) -> None:
        self.position = start.astype(np.float32)
        self.names = (*names, 'frame')
        self.actions: list = []

    def observe(self) -> Observation:
        return Observation(state=np.append(self.position, np.float32(len(self.actions))), state_names=self.names)

    def act(self, action) -> None:
        self.actions.append(action)
        self.position = action.values


def _run(dataset: Path, space: str, shift: int, smooth: int, max_actions: int):
    parquet, names, recorded = _episode(dataset)
    server = serve_policy_file(REPLAY, deployment='g1', port=0, parquet=parquet, names=names, shift=shift,
                               action_space=space, dt=DT, chunk_length=T)
    try:
        robot = Follower(recorded[0], names)
        with connect('g1', endpoint=f'127.0.0.1:{server.port}') as policy:
            out = policy.run(robot.observe, robot.act, max_actions=max_actions, smooth_seam=smooth)
    finally:
        server.stop(grace=0.5)
    return out, robot, recorded


@pytest.mark.slow
def test_smooth_seam_reduces_the_seam_jump_on_real_g1_actions(g1_dataset):
    n = 300
    aligned, _, recorded = _run(g1_dataset, 'joint_absolute', shift=0, smooth=0, max_actions=n)
    natural = float(np.abs(np.diff(recorded[:n + T], axis=0)).max())
    plain, _, _ = _run(g1_dataset, 'joint_absolute', shift=15, smooth=0, max_actions=n)
    smooth, robot, _ = _run(g1_dataset, 'joint_absolute', shift=15, smooth=8, max_actions=n)
    print(f'\nG1 episode 0, {n} actions, chunks of {T} at dt={DT}s; largest recorded per-frame step {natural:.4f}'
          f'\n  aligned seams      : max_seam_jump {aligned.max_seam_jump:.4f} ({aligned.chunks} chunks)'
          f'\n  15-frame seam shift: max_seam_jump {plain.max_seam_jump:.4f} ({plain.chunks} chunks)'
          f'\n  same, smooth_seam=8: max_seam_jump {smooth.max_seam_jump:.4f} ({smooth.chunks} chunks)')
    assert aligned.reason == plain.reason == smooth.reason == 'completed'
    assert aligned.max_seam_jump <= natural + 1e-6          # stale rows skipped by count: seams are seamless
    assert plain.max_seam_jump > 2 * natural
    assert smooth.max_seam_jump < 0.5 * plain.max_seam_jump
    assert not smooth.smooth_seam_ignored and len(robot.actions) == n


def test_delta_chunks_pass_through_byte_identical_with_or_without_smooth_seam(g1_dataset):
    n = 120
    runs = [_run(g1_dataset, 'joint_delta', shift=0, smooth=s, max_actions=n) for s in (0, 8)]
    (out0, robot0, recorded), (out8, robot8, _) = runs
    truth = [(recorded[k + 1] - recorded[k]).tobytes() for k in range(n)]
    assert [a.delta.tobytes() for a in robot0.actions] == truth
    assert [a.delta.tobytes() for a in robot8.actions] == truth
    assert out8.smooth_seam_ignored and not out0.smooth_seam_ignored
    # Integrated onto the measured state, then onto the last command: the recorded trajectory.
    np.testing.assert_allclose(robot0.actions[-1].values, recorded[n], atol=1e-4)
