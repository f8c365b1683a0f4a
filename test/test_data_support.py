"""Helpers of the field-data tests (no tests here): feed a real capture store with real G1 data.

Episodes are built from the real G1 recording (../shared/data/g1_pick_bottle_v21): the measured state,
the action and the decoded camera frames (JPEG-encoded as a robot would send them) become real
``ObservationRequest``/``ActionChunk``/``TelemetryFrame`` messages, fed to a real ``CaptureStore``.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np

from sequence_ai_ros.capture.settings import CaptureSettings, save_settings
from sequence_ai_ros.capture.store import CaptureStore
from sequence_ai_ros.datasets.lerobot_reader import LeRobotDataset
from sequence_ai_ros.protocol import codec
from sequence_ai_ros.protocol import sequence_ai_pb2 as pb
from sequence_ai_ros.protocol.contract import CameraSpec, Contract, ObservationContract


class FakeClock:
    """A settable wall clock (s since the epoch), injected into the store."""

    def __init__(self, t: float = 1_790_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def g1_contract(ds: LeRobotDataset, camera: bool = True) -> Contract:
    """The contract a G1 policy would declare: 26 named joints, cam_high 640x480 jpeg, 30 actions at 30 Hz."""
    cams = (CameraSpec('cam_high', 640, 480, 'jpeg'),) if camera else ()
    return Contract('joint_absolute', ds.action_names, 1 / ds.fps, 30,
                    ObservationContract(cams, ds.state_names), deployment='g1')


@functools.lru_cache(maxsize=8)
def g1_jpegs(root: str, k: int, n: int) -> tuple[bytes, ...]:
    """The first n frames of G1 episode k's camera, JPEG-encoded (decoded once per session)."""
    ds = LeRobotDataset(root)
    return tuple(codec.encode_image('cam_high', f).data for f in ds.frames(k, 'cam_high', 0, n))


def make_store(root: Path, clock: FakeClock | None = None, **settings) -> CaptureStore:
    """A store at ``root`` with settings.json written (capture on at rate 1 unless given)."""
    save_settings(root, CaptureSettings(**{'rate': 1.0, 'enabled': True, **settings}))
    return CaptureStore(root, deployment=root.name, clock=clock or FakeClock())


def feed_g1(store: CaptureStore, episode_id: str, ds: LeRobotDataset, k: int = 0, frames: int = 20,
            images: bool = True, instruction: str | None = None, commit: str | None = 'completed',
            clock: FakeClock | None = None, frame_dt: float = 1 / 15):
    """Run one G1 episode through the store: a request (+chunk) every 5 frames, telemetry every frame.

    Returns the EpisodeCapture (committed when ``commit`` is a reason), or None when not captured.
    """
    ep = store.begin(episode_id, instruction if instruction is not None else ds.task(k), g1_contract(ds, images))
    if ep is None:
        return None
    data = ds.episode(k)
    jpegs = g1_jpegs(str(ds.root), k, frames) if images else ()
    for i in range(frames):
        if clock is not None:
            clock.t += frame_dt
        imgs = [codec.encode_image('cam_high', jpegs[i])] if images else []
        if i % 5 == 0:
            req = pb.ObservationRequest(episode_id=episode_id, request_id=i // 5 + 1, instruction=ds.task(k),
                                        robot_time_s=i * frame_dt, state=codec.to_tensor(data.state[i]),
                                        state_names=list(ds.state_names), images=imgs, params={'seed': str(i)})
            chunk = pb.ActionChunk(request_id=i // 5 + 1, episode_id=episode_id,
                                   actions=codec.to_tensor(data.action[i:i + 30]), action_space=pb.JOINT_ABSOLUTE,
                                   dt=1 / 30, covers_seconds=1.0, timings=pb.Timings(inference_ms=3.5))
            ep.add_request(req, chunk)
        frame = pb.TelemetryFrame(robot_time_s=i * frame_dt, state=codec.to_tensor(data.state[i]),
                                  hold=(i == 0), images=imgs)
        if i > 0:
            frame.action.CopyFrom(codec.to_tensor(data.action[i]))
        ep.add_telemetry([frame])
    if commit:
        ep.commit(commit, {'actions': frames, 'chunks': frames // 5, 'underruns': 0})
    return ep


def state_of(ds: LeRobotDataset, k: int, n: int) -> np.ndarray:
    """The first n measured states of G1 episode k, float32 (n, 26)."""
    return ds.episode(k).state[:n]
