"""Capture of large camera frames: split to fit the worker's message limit, or stopped with a capture error.

The review: a robot capturing 3 x 1280x720 (or 2 x 1080p) camera frames at 30 Hz against a contract without
those cameras got ``Overloaded: RESOURCE_EXHAUSTED: Received message larger than max (7545013 vs. 4194304)``:
half a second of records went on one message, over the worker's 4 MiB transport limit, and the episode was
lost. Now each telemetry batch goes on as many messages as the limit needs; a record over the limit alone
stops the episode's capture with a capture error naming its size and the limit (never Overloaded), the run
goes on, and the worker keeps none of the episode.

A real worker on loopback with capture on (real store, real export with videos), the Python client's run().
Assertions are on counts, sizes and values, never on rates.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from sequence_ai_ros.capture.settings import CaptureSettings, save_settings
from sequence_ai_ros.capture.store import CaptureStore
from sequence_ai_ros.client import Observation, connect
from sequence_ai_ros.client.sampling import TelemetrySample
from sequence_ai_ros.client.session import pack_telemetry
from sequence_ai_ros.datasets.lerobot_reader import LeRobotDataset
from sequence_ai_ros.datasets.lerobot_writer import export_lerobot
from sequence_ai_ros.exceptions import CaptureError, Overloaded
from sequence_ai_ros.protocol import codec
from sequence_ai_ros.protocol import contract as contract_module
from sequence_ai_ros.protocol import sequence_ai_pb2 as pb
from sequence_ai_ros.worker import serve_policy_file

FAST = Path(__file__).resolve().parents[1] / 'policies' / 'fast.py'
DIM = 4
NAMES = tuple(f'j{i}' for i in range(DIM))
#: the worker's transport limit the review hit (4 MiB): the floor before this fix
OLD_LIMIT = 4 << 20
#: chunk steps per episode: two thirds of a second at the policy's 30 Hz (a whole 0.5 s telemetry batch, and more)
STEPS = 20


def _capture(tmp_path: Path) -> Path:
    root = tmp_path / 'capture'
    save_settings(root / 'fast', CaptureSettings(rate=1.0, enabled=True, images=True))
    return root


def _scene(height: int, width: int, seed: int) -> np.ndarray:
    """A camera frame with a scene's gradients and sensor noise: a JPEG of ~0.25 MB at 720p, ~0.5 MB at 1080p."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    scene = np.stack([x * 255 // width, y * 255 // height, (x + y + seed * 40) % 256], -1)
    return np.clip(scene + rng.integers(-12, 12, (height, width, 3)), 0, 255).astype(np.uint8)


def _noise(height: int, width: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 255, (height, width, 3), dtype=np.uint8)


def _observe(cameras: dict[str, np.ndarray]):
    def observe() -> Observation:
        return Observation(state=np.zeros(DIM, np.float32), state_names=NAMES, images=cameras)
    return observe


@pytest.mark.parametrize('n, height, width', [(3, 720, 1280), (2, 1080, 1920)], ids=['3x720p', '2x1080p'])
def test_large_cameras_at_30_hz_are_captured_whole_and_exported(tmp_path, monkeypatch, n, height, width):
    """The worker's limit held at the 4 MiB of the review: every batch (> 4 MiB) is split, every row has frames."""
    monkeypatch.setattr(contract_module, 'MIN_RECEIVE_BYTES', OLD_LIMIT)   # the worker and the robot alike
    cameras = {f'cam{k}': _scene(height, width, k) for k in range(n)}
    record = sum(len(codec.encode_image(key, image).data) for key, image in cameras.items())
    assert 15 * record > OLD_LIMIT, record     # half a second of records is over the limit on one message
    root = _capture(tmp_path)
    with serve_policy_file(FAST, 'fast', capture_root=root, dim=DIM) as server, \
            connect('fast', endpoint=f'127.0.0.1:{server.port}') as policy:
        policy.wait_until_ready(timeout=30)
        out = policy.run(_observe(cameras), lambda a: None, max_actions=STEPS)
    assert out.reason == 'completed' and out.error is None, out
    assert out.capture_error == '' and out.telemetry_rejected == 0 and out.dropped_telemetry == 0, out
    assert out.worker_confirmed, out
    store = CaptureStore(root / 'fast', 'fast')
    assert len(store.episodes()) == 1
    res = export_lerobot(store, tmp_path / 'ds', progress=False, vcodec='h264')   # h264 ultrafast: quick
    assert res['episodes'] == 1 and res['frames'] >= STEPS and not res['skipped'], res
    features = LeRobotDataset(tmp_path / 'ds').info['features']
    for key in cameras:
        assert features[f'observation.images.{key}']['shape'][:2] == [height, width], features


def test_the_packer_keeps_every_message_within_the_limit_and_sends_a_large_record_alone():
    """15 records of 2 x 1080p noise (~3.7 MB each) against 8 MiB: messages of two, every one within the limit."""
    from sequence_ai_ros.protocol.contract import Contract

    contract = Contract.from_proto(pb.Contract(
        deployment='d', action_space=pb.JOINT_ABSOLUTE, action_names=list(NAMES), action_dim=DIM, dt=1 / 30,
        chunk_length=4, observation=pb.ObservationContract(state_dim=DIM, state_names=list(NAMES)),
        protocol_version=contract_module.PROTOCOL_VERSION))
    images = {'left': _noise(1080, 1920, 1), 'right': _noise(1080, 1920, 2)}
    records = [TelemetrySample(robot_time_s=k / 30, state=np.zeros(DIM, np.float32), action=None, hold=True,
                               images=images if k % 3 == 0 else {}, grid_index=k, step_start=k, step_end=k + 1)
               for k in range(15)]
    limit = 8 << 20
    packed = pack_telemetry(records, contract, limit=limit)
    assert packed.over_limit == '' and packed.problems == []
    sizes = [pb.EpisodeRequest(telemetry=m).ByteSize() for m in packed.messages]
    assert len(packed.messages) >= 3 and max(sizes) <= limit, sizes
    times = [f.robot_time_s for m in packed.messages for f in m.frames]
    assert times == [r.robot_time_s for r in records]             # every record, once, in order

    alone = pack_telemetry(records, contract, limit=3 << 20)          # one record of images is over 3 MiB
    assert [f.robot_time_s for m in alone.messages for f in m.frames] == []
    assert f'over the worker\'s {3 << 20}-byte message limit' in alone.over_limit, alone.over_limit
    assert 'a capture record of ' in alone.over_limit and '2 camera frames' in alone.over_limit


def test_a_record_over_the_limit_stops_capture_naming_its_size_and_the_limit_and_the_run_goes_on(tmp_path):
    """Three 4K cameras of noise (~22 MB a record) against the worker's 16 MiB: no Overloaded, run completed."""
    limit = contract_module.MIN_RECEIVE_BYTES
    cameras = {f'cam{k}': _noise(2160, 3840, k) for k in range(3)}
    root = _capture(tmp_path)
    with serve_policy_file(FAST, 'fast', capture_root=root, dim=DIM) as server, \
            connect('fast', endpoint=f'127.0.0.1:{server.port}') as policy:
        policy.wait_until_ready(timeout=30)
        out = policy.run(_observe(cameras), lambda a: None, max_actions=STEPS)
        assert policy.contract.receive_bytes() == limit
    assert out.reason == 'completed' and out.error is None and out.actions == STEPS, out
    assert f"over the worker's {limit}-byte message limit" in out.capture_error, out.capture_error
    size = int(out.capture_error.split('a capture record of ')[1].split(' bytes')[0])
    assert size > limit, out.capture_error
    assert 'Overloaded' not in str(out) and 'RESOURCE_EXHAUSTED' not in str(out)
    assert 'not captured' in str(out)
    store = CaptureStore(root / 'fast', 'fast')
    assert store.episodes() == []                 # the worker kept none of it: not half an episode


def test_a_worker_with_a_smaller_limit_fails_the_stream_as_a_capture_error_not_overloaded(tmp_path, monkeypatch):
    """An older worker (a 4 MiB limit) refuses a 10 MB message: the robot reads a CaptureError naming both sizes."""
    from sequence_ai_ros.worker import server as server_module

    monkeypatch.setattr(server_module, 'receive_limit', lambda max_message_bytes: OLD_LIMIT)
    cameras = {f'cam{k}': _scene(720, 1280, k) for k in range(3)}
    root = _capture(tmp_path)
    with serve_policy_file(FAST, 'fast', capture_root=root, dim=DIM) as server, \
            connect('fast', endpoint=f'127.0.0.1:{server.port}') as policy:
        policy.wait_until_ready(timeout=30)
        try:   # run() raises the error its episode ended on; one that came as it ended is its capture error
            out = policy.run(_observe(cameras), lambda a: None, max_actions=2 * STEPS)
            why = out.capture_error
        except CaptureError as exc:
            why = str(exc)
        except Overloaded as exc:
            pytest.fail(f'the transport limit read as Overloaded: {exc}')
    assert f'vs. {OLD_LIMIT}' in why and 'message limit' in why, why
