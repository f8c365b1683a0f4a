"""The Python API's side of one tick, one record: frames captured as requested, overruns counted.

A real worker on loopback with capture on (real store, real record files), the Python client's act()/run().
Assertions are on counts and values; the only clock-dependent quantity (how many periods an overrunning
callback skips) is read from the run itself, never compared with a rate.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np
import pytest

from sequence_ai_ros.capture.settings import CaptureSettings, save_settings
from sequence_ai_ros.capture.store import CaptureStore
from sequence_ai_ros.client import Observation, connect
from sequence_ai_ros.datasets.lerobot_reader import LeRobotDataset
from sequence_ai_ros.datasets.lerobot_writer import export_lerobot
from sequence_ai_ros.datasets.rows import build_rows
from sequence_ai_ros.protocol import sequence_ai_pb2 as pb
from sequence_ai_ros.protocol.spaces import ActionSpace
from sequence_ai_ros.worker import serve_policy_file

FAST = Path(__file__).parent / 'policies' / 'fast.py'
DIM = 4
NAMES = tuple(f'j{i}' for i in range(DIM))


def _capture(tmp_path: Path, images: bool = False) -> Path:
    root = tmp_path / 'capture'
    save_settings(root / 'fast', CaptureSettings(rate=1.0, enabled=True, images=images))
    return root


def test_a_camera_of_another_size_is_captured_as_the_policy_saw_it(tmp_path: Path) -> None:
    """640x480 frames against a 224x224 contract: captured at 224x224, none refused.

    Every frame is fitted like the request's, and the LeRobot export holds the episode's video at that size.
    """
    root = _capture(tmp_path, images=True)
    rng = np.random.default_rng(0)
    frame = rng.integers(0, 255, (480, 640, 3), dtype=np.uint8)

    def observe() -> Observation:
        return Observation(state=np.zeros(DIM, np.float32), state_names=NAMES, images={'cam': frame})

    with serve_policy_file(FAST, 'fast', capture_root=root, dim=DIM, camera='cam') as server, \
            connect('fast', endpoint=f'127.0.0.1:{server.port}') as policy:
        policy.wait_until_ready(timeout=30)
        out = policy.run(observe, lambda a: None, max_actions=45)
    assert out.reason == 'completed', out
    assert out.telemetry_rejected == 0 and out.telemetry_error == '', out
    [episode] = CaptureStore(root / 'fast', 'fast').episodes()
    rows = build_rows(episode, 30.0, ActionSpace.JOINT_ABSOLUTE, DIM, DIM, ['cam'])
    # one row per executed action; a loaded machine's missed deadlines and underruns add held rows, no more
    assert int((~rows.held).sum()) == 45 and (rows.frame_ticks['cam'] >= 0).all()
    assert int(rows.held.sum()) <= out.ticks_skipped + out.ticks_held, (int(rows.held.sum()), out)
    res = export_lerobot(CaptureStore(root / 'fast', 'fast'), tmp_path / 'ds', progress=False)
    assert res['episodes'] == 1 and res['frames'] == len(rows), res
    ds = LeRobotDataset(tmp_path / 'ds')
    video = ds.info['features']['observation.images.cam']
    assert video['shape'][:2] == [224, 224], video


def test_a_frame_capture_refuses_is_counted_shown_and_logged_once(tmp_path: Path, caplog) -> None:
    """A camera whose channel count changes mid-episode: capture refuses those frames (one layout per video).

    The outcome counts them, its text says so, and the client logs it once for the episode.
    """
    root = _capture(tmp_path, images=True)
    calls = [0]

    def observe() -> Observation:
        calls[0] += 1
        grey = calls[0] > 20
        image = np.zeros((24, 32) if grey else (24, 32, 3), np.uint8)
        return Observation(state=np.zeros(DIM, np.float32), state_names=NAMES, images={'extra': image})

    with serve_policy_file(FAST, 'fast', capture_root=root, dim=DIM) as server, \
            connect('fast', endpoint=f'127.0.0.1:{server.port}') as policy:
        policy.wait_until_ready(timeout=30)
        with caplog.at_level(logging.WARNING, logger='sequence_ai_ros.client.policy'):
            out = policy.run(observe, lambda a: None, max_actions=40)
    assert out.telemetry_rejected > 0 and 'channels' in out.telemetry_error, out
    assert f'{out.telemetry_rejected} capture frames refused' in str(out)
    refusals = [r for r in caplog.records if 'capture refused' in r.getMessage()]
    assert len(refusals) == 1, [r.getMessage() for r in caplog.records]


@pytest.mark.parametrize('space', ['joint_absolute'])
def test_an_act_callback_that_overruns_is_counted_and_the_rows_stay_on_their_deadlines(
        tmp_path: Path, caplog, space: str) -> None:
    """act() takes 2.5 control periods every fifth call: the skipped periods are counted and logged once.

    They carry the node's name (ticks_skipped), are never bunched, and every period is accounted for; the
    export's rows are the commands in effect at their deadlines, the skipped periods held.
    """
    root = _capture(tmp_path)
    period = 1 / 30
    given: list[np.ndarray] = []

    def act(action) -> None:
        given.append(np.array(action.values, np.float32))
        if len(given) % 5 == 0:
            time.sleep(2.5 * period)

    def observe() -> Observation:
        return Observation(state=given[-1] if given else np.arange(DIM, dtype=np.float32), state_names=NAMES)

    with serve_policy_file(FAST, 'fast', capture_root=root, dim=DIM) as server, \
            connect('fast', endpoint=f'127.0.0.1:{server.port}') as policy:
        policy.wait_until_ready(timeout=30)
        with caplog.at_level(logging.WARNING, logger='sequence_ai_ros.client'):
            out = policy.run(observe, act, max_actions=60)
    assert out.reason == 'completed', out
    assert out.ticks_skipped >= 1, out
    assert out.commands_sent == len(given), (out, len(given))
    overran = [r for r in caplog.records if 'overran' in r.getMessage()]
    assert len(overran) == 1, [r.getMessage() for r in caplog.records]
    assert 'control periods skipped' in str(out)
    [episode] = CaptureStore(root / 'fast', 'fast').episodes()
    frames = [f for f in _telemetry(episode)]
    assert all(f.step_end > f.step_start for f in frames)
    grids = [f.grid_index for f in frames]
    assert grids == sorted(set(grids)), 'each record serves its own deadline, in order'
    missed = sum(b - a - 1 for a, b in zip(grids, grids[1:], strict=False))
    trailing = out.ticks_skipped - missed     # the 60th act() overran too: the periods after the last record
    assert 0 <= trailing <= 3, (missed, out)
    # grid indices count from the episode's first deadline (0); capture starts at EpisodeStarted, which can
    # follow the first waiting holds
    counted = out.commands_sent + out.ticks_held + out.ticks_skipped
    assert counted == grids[-1] + 1 + trailing
    assert abs(counted - out.elapsed_s / period) <= 1.0, (counted, out)     # every period of the episode
    rows = build_rows(episode, 30.0, ActionSpace(space), DIM, DIM, [])
    executed = rows.action[~rows.held]
    np.testing.assert_array_equal(executed, np.array(given)[:len(executed)])
    assert int(rows.held.sum()) >= out.ticks_skipped - 1


def _telemetry(episode) -> list[pb.TelemetryFrame]:
    from sequence_ai_ros.datasets.rows import telemetry_frames

    return list(telemetry_frames(episode))
