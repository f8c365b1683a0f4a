"""Capture end to end: a real worker (gRPC on 127.0.0.1:0), the real client, real G1 states, then export."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from sequence_ai_ros.capture.settings import CaptureSettings, save_settings
from sequence_ai_ros.capture.store import CaptureStore
from sequence_ai_ros.datasets.lerobot_reader import LeRobotDataset
from sequence_ai_ros.datasets.lerobot_writer import export_lerobot
from sequence_ai_ros.datasets.verify import verify_export
from sequence_ai_ros.exceptions import CaptureError

REPO = Path(__file__).resolve().parent.parent
FAST = REPO / 'test' / 'policies' / 'fast.py'
NAMES = tuple(f'j{i}' for i in range(26))


def _drive(port: int, g1: LeRobotDataset, episode_id: str, actions: int = 45):
    from sequence_ai_ros.client import Observation, connect

    state = g1.episode(0).state
    done: list = []

    def observe() -> Observation:
        return Observation(state=state[min(len(done), len(state) - 1)], state_names=NAMES)

    with connect('fast', endpoint=f'127.0.0.1:{port}') as policy:
        out = policy.run(observe, done.append, max_actions=actions, instruction='pick the yellow bottle',
                         episode_id=episode_id)
        try:
            labelled: bool | str = policy.label(True, 'bottle lifted')
        except CaptureError as exc:   # the worker's clear refusal, never a silent ok
            labelled = str(exc)
        return out, labelled, done


@pytest.mark.slow
def test_label_from_the_client_reaches_the_export(tmp_path: Path, g1_dataset: Path) -> None:
    from sequence_ai_ros.worker import serve_policy_file

    g1 = LeRobotDataset(g1_dataset)
    root = tmp_path / 'capture'
    save_settings(root / 'fast', CaptureSettings(rate=1.0, enabled=True))   # rows at the policy's 1/dt
    with serve_policy_file(FAST, 'fast', capture_root=root) as server:
        out, labelled, done = _drive(server.port, g1, 'field-1')
    assert out.reason == 'completed' and labelled.matched is True and len(done) == 45
    store = CaptureStore(root / 'fast', 'fast')
    (ep,) = store.episodes()
    assert ep.episode_id == 'field-1' and ep.label['success'] is True and ep.requests >= 1
    assert ep.frames >= 45  # telemetry: every control tick while the episode ran (~1.5 s)
    res = export_lerobot(store, tmp_path / 'export', progress=False)
    verify_export(tmp_path / 'export', reference=g1_dataset)
    eps = [json.loads(line) for line in (tmp_path / 'export/meta/episodes.jsonl').read_text().splitlines()]
    rows = pq.read_table(tmp_path / 'export/data/chunk-000/episode_000000.parquet').to_pydict()
    held = int(sum(rows['action.held']))
    assert eps[0]['success'] is True and eps[0]['length'] == res['frames'] and res['frames'] - held == len(done)
    np.testing.assert_array_equal(np.array(rows['action'], np.float32)[~np.array(rows['action.held'])],
                                  np.array([a.values for a in done], np.float32))   # what act() executed
    assert rows['next.success'][-1] is True and not any(rows['next.success'][:-1])
    tasks = (tmp_path / 'export/meta/tasks.jsonl').read_text()
    assert 'pick the yellow bottle' in tasks
    states = np.array(rows['observation.state'], np.float32)
    assert np.all(np.isin(states[:, 0], g1.episode(0).state[:60, 0]))  # the robot's measured G1 states


@pytest.mark.slow
def test_a_corrupt_store_is_rebuilt_and_a_quota_pauses_capture(tmp_path: Path, g1_dataset: Path) -> None:
    from sequence_ai_ros.worker import serve_policy_file

    g1 = LeRobotDataset(g1_dataset)
    root = tmp_path / 'capture'
    save_settings(root / 'fast', CaptureSettings(rate=1.0, enabled=True, fps=15.0))
    with serve_policy_file(FAST, 'fast', capture_root=root) as server:
        _drive(server.port, g1, 'kept-1', actions=30)
    db = root / 'fast' / 'store.db'
    with db.open('r+b') as f:
        f.truncate(db.stat().st_size // 2)
    with serve_policy_file(FAST, 'fast', capture_root=root) as server:
        out, labelled, done = _drive(server.port, g1, 'while-corrupt', actions=30)
    assert out.reason == 'completed' and len(done) == 30  # serving unaffected
    # no one else captured into the store, so the worker rebuilt its index from the episode files at open
    # (the bad file kept aside): the new episode is captured and labelled, and nothing kept is lost
    assert labelled.matched is True
    store = CaptureStore(root / 'fast', 'fast')
    assert sorted(e.episode_id for e in store.episodes()) == ['kept-1', 'while-corrupt']
    assert store.status()['state'] != 'paused'
    save_settings(root / 'fast', CaptureSettings(rate=1.0, enabled=True, fps=15.0, quota_bytes=store.bytes_used()))
    with serve_policy_file(FAST, 'fast', capture_root=root) as server:
        out, labelled, done = _drive(server.port, g1, 'over-quota', actions=30)
    assert out.reason == 'completed' and len(done) == 30
    assert labelled.matched is True   # not captured (over the quota), but seen: its label is kept for the scoreboard
    assert sorted(e.episode_id for e in CaptureStore(root / 'fast', 'fast').episodes()) == ['kept-1', 'while-corrupt']


WORKER = r'''
import sys, time
from sequence_ai_ros.worker import serve_policy_file
server = serve_policy_file(sys.argv[1], 'fast', capture_root=sys.argv[2])
print('serving', server.port, flush=True)
while True:
    time.sleep(1)
'''


@pytest.mark.slow
def test_kill9_of_the_worker_mid_capture_then_export(tmp_path: Path, g1_dataset: Path, processes) -> None:
    import signal
    import threading
    import time

    g1 = LeRobotDataset(g1_dataset)
    root = tmp_path / 'capture'
    save_settings(root / 'fast', CaptureSettings(rate=1.0, enabled=True, fps=15.0))
    worker = processes.python(WORKER, str(FAST), str(root), cwd=str(REPO))
    line = worker.stdout.readline().split()
    assert line[:1] == ['serving'], worker.stderr.read()
    port = int(line[1])
    for k in range(2):
        out, labelled, _ = _drive(port, g1, f'before-kill-{k}', actions=30)
        assert out.reason == 'completed' and labelled
    failure: list[BaseException] = []
    running = threading.Thread(target=lambda: _run_until_killed(port, g1, failure), name='test-doomed-episode')
    running.start()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not any((root / 'fast' / 'staging').glob('*/episode.rec')):
        time.sleep(0.02)
    time.sleep(0.5)  # the third episode is streaming into its staging file
    worker.send_signal(signal.SIGKILL)
    worker.wait(timeout=10)
    running.join(timeout=30)
    assert not running.is_alive() and failure  # the client saw the worker go
    store = CaptureStore(root / 'fast', 'fast')
    assert [e.episode_id for e in store.episodes()] == ['before-kill-0', 'before-kill-1']
    res = export_lerobot(store, tmp_path / 'export', progress=False)
    assert res['episodes'] == 2 and res['skipped'] == []
    verify_export(tmp_path / 'export', reference=g1_dataset)
    eps = [json.loads(line) for line in (tmp_path / 'export/meta/episodes.jsonl').read_text().splitlines()]
    assert [e['success'] for e in eps] == [True, True]


def _run_until_killed(port: int, g1: LeRobotDataset, failure: list) -> None:
    try:
        _drive(port, g1, 'doomed', actions=100_000)
    except Exception as exc:  # noqa: BLE001  (ConnectionLost is the expected end)
        failure.append(exc)


@pytest.mark.slow
def test_a_reused_episode_id_runs_and_the_robot_is_told_it_is_not_captured(tmp_path: Path,
                                                                          g1_dataset: Path) -> None:
    """A second run under a captured id (a reconnect, or a reused id) is served but not captured.

    The robot is told at the start (RunOutcome.capture_error); the store keeps the first run alone.
    """
    from sequence_ai_ros.worker import serve_policy_file

    g1 = LeRobotDataset(g1_dataset)
    root = tmp_path / 'capture'
    save_settings(root / 'fast', CaptureSettings(rate=1.0, enabled=True))
    with serve_policy_file(FAST, 'fast', capture_root=root) as server:
        first, labelled, _ = _drive(server.port, g1, 'trial-1')
        second, _, done = _drive(server.port, g1, 'trial-1')
    assert first.reason == 'completed' and labelled.matched is True and first.capture_error == ''
    assert second.reason == 'completed' and len(done) == 45
    assert "episode 'trial-1' was already captured" in second.capture_error, second
    assert 'this run of it is not captured' in second.capture_error
    (ep,) = CaptureStore(root / 'fast', 'fast').episodes()
    assert ep.episode_id == 'trial-1' and ep.frames >= 45
