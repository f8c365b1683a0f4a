"""Export bombs from inside the per-frame limits: an export is bounded by the episode, not by the frame.

Each test reproduces an attack from the break-it review (issue 36, tenancy) against a real worker (gRPC on
loopback, hand-built telemetry on a real Episode stream, the real capture store on disk) and the real LeRobot
export, and asserts the outcome now holds: the frame past the bound is refused with a typed error naming it
(``stall_s``, ``episode_s``: :data:`~sequence_ai_ros.protocol.limits.MAX_STALL_S`,
:data:`~sequence_ai_ros.protocol.limits.MAX_EPISODE_S`), and the export makes no more rows than the episode's
bounded duration allows (:func:`~sequence_ai_ros.datasets.rows.row_budget`), saying so if it stops.
Counts and values only, never rates.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from test_data_rows import _contract, _frame
from test_data_support import make_store
from test_worker_support import POLICIES, Stream, channel, handshake, state_request, wait_ready

from sequence_ai_ros.capture.settings import CaptureSettings, save_settings
from sequence_ai_ros.capture.store import CaptureStore
from sequence_ai_ros.datasets.lerobot_writer import export_lerobot
from sequence_ai_ros.datasets.rows import build_rows, row_budget
from sequence_ai_ros.protocol import codec, limits
from sequence_ai_ros.protocol import sequence_ai_pb2 as pb
from sequence_ai_ros.protocol import sequence_ai_pb2_grpc as pb_grpc
from sequence_ai_ros.protocol.spaces import ActionSpace
from sequence_ai_ros.worker import serve_policy_file

pytest.importorskip('pyarrow', reason='the LeRobot export needs pyarrow')

NAMES = ('frame', 'request')
FPS = 30.0   # the policy's dt is 1/30 s: one row per chunk step


@pytest.fixture
def worker(tmp_path):
    """A worker of client_latency.py (D=2, dt 1/30 s) in ``space``, capturing every episode without images."""
    servers = []

    def start(space: str):
        save_settings(tmp_path / 'capture' / 'arm', CaptureSettings(rate=1.0, enabled=True, images=False))
        server = serve_policy_file(POLICIES / 'client_latency.py', 'arm', action_space=space, dt=1 / 30,
                                   host='127.0.0.1', port=0, capture_root=tmp_path / 'capture')
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop(grace=0.5)


def _tick(g: int, t: float, step: float) -> pb.TelemetryFrame:
    """A record at robot time ``t`` (s) serving deadline ``g``, spanning one chunk step from ``step``."""
    v = codec.to_tensor(np.full(2, 0.1, np.float32))
    return pb.TelemetryFrame(robot_time_s=t, state=v, action=v, grid_index=g, step_start=step, step_end=step + 1.0)


def _run(server, frames: list[pb.TelemetryFrame]) -> pb.EpisodeEnded:
    """One episode on the real stream: start, one request, the telemetry, the end; its EpisodeEnded."""
    with channel(server.port) as ch:
        stub = pb_grpc.PolicyServiceStub(ch)
        handshake(stub, 'arm')
        assert wait_ready(stub, 'arm').ready
        s = Stream(stub, 'arm', 'bomb')
        assert s.start().HasField('started')
        assert s.ask(state_request(1, np.zeros(2), NAMES)).HasField('chunk')
        s.send(telemetry=pb.Telemetry(frames=frames))
        s.send(end=pb.EpisodeEnd(reason='completed', actions=len(frames)))
        ended = None
        while ended is None:
            reply = s.recv(timeout=30)
            assert reply is not None, 'the stream ended without EpisodeEnded'
            if reply.HasField('ended'):
                ended = reply.ended
        s.close()
    return ended


def _export(tmp_path: Path) -> dict:
    store = CaptureStore(tmp_path / 'capture' / 'arm', 'arm')
    return export_lerobot(store, tmp_path / 'out', images=False, progress=False)


def test_velocity_records_299_s_apart_are_refused_past_the_stall_bound_and_the_export_is_bounded(worker, tmp_path):
    """Attack: velocity telemetry with robot_time_s = 299 g was accepted (rejected=0).

    200 records exported 2,000,000 rows (11 h, five times the 7,200 s episode limit), stopped only by a silent MAX_ROWS.
    """
    server = worker('joint_velocity')
    frames = [_tick(g, 299.0 * g, float(g)) for g in range(200)]
    ended = _run(server, frames)
    assert ended.captured
    assert ended.telemetry_rejected == 198, ended          # the 3rd record passes MAX_STALL_S; the rest leap
    assert 'stall_s' in ended.telemetry_error and f'at most {limits.MAX_STALL_S:g} s' in ended.telemetry_error
    result = _export(tmp_path)
    assert result['episodes'] == 1
    # two records: the first commands its velocity for 299 s (a stall within the bound), the second one step
    assert result['frames'] <= row_budget(FPS, 2) and result['frames'] <= (limits.MAX_STALL_S + 2 * 10) * FPS + 1
    assert result['frames'] == pytest.approx(299 * FPS + 1, abs=2), result['frames']


def test_robot_time_past_the_episode_limit_is_refused_in_a_velocity_space(worker, tmp_path):
    """Attack: robot time since the episode's first record was never bounded (only step_end * dt was).

    800 records 10 s apart (no stall: each within MAX_TICK_S) spanned 7,990 s of velocity rows.
    """
    server = worker('joint_velocity')
    frames = [_tick(g, 10.0 * g, float(g)) for g in range(800)]
    ended = _run(server, frames)
    kept = int(limits.MAX_EPISODE_S // 10) + 1           # robot time 0 .. 7,200 s
    assert ended.telemetry_rejected == 800 - kept, ended
    assert 'episode_s' in ended.telemetry_error and f'{limits.MAX_EPISODE_S:g} s' in ended.telemetry_error
    result = _export(tmp_path)
    assert result['frames'] <= (limits.MAX_EPISODE_S + limits.MAX_TICK_S) * FPS + 1
    assert result['frames'] <= row_budget(FPS, kept)
    assert not [n for n in result['notes'] if 'stopped at' in n], result['notes']


def test_absolute_records_300_s_apart_are_refused_past_the_stall_bound(worker, tmp_path):
    """Attack: 24 joint_absolute records ~300 s apart (each gap under MAX_GAP_S) were accepted.

    They exported 345,001 held rows (about 2 h of video with --images) from 24 frames.
    """
    server = worker('joint_absolute')
    step = 8996                                         # 299.87 s at dt 1/30 s: under MAX_GAP_S
    frames = [_tick(g * step, 299.9 * g, float(g * step)) for g in range(24)]
    ended = _run(server, frames)
    assert ended.telemetry_rejected == 22, ended
    assert 'stall_s' in ended.telemetry_error
    result = _export(tmp_path)
    assert result['frames'] == step + 1                  # one stall of 300 s (held rows), then the second record
    assert result['frames'] <= row_budget(FPS, 2)


def test_an_old_store_whose_records_were_never_checked_exports_no_more_than_the_bound_and_says_so(tmp_path):
    """An old store's unchecked record: the export stops at the episode's bounded rows, and says so.

    A store written before capture checked spans (no contract: no dt to check them by) holds a record spanning
    a million steps.
    """
    store = make_store(tmp_path / 'arm')
    frames = [_frame(0.0, np.zeros(3), np.ones(3), span=(0, 0.0, 1.0)),
              _frame(1 / 30, np.zeros(3), np.ones(3), span=(1, 1.0, 1e6))]
    ep = store.begin('old', 'reach', None)
    assert ep.add_telemetry(frames) == 0
    ep.commit('completed', {'actions': 2})
    [episode] = store.episodes()
    rows = build_rows(episode, FPS, ActionSpace.JOINT_ABSOLUTE, 3, 3, [])
    assert len(rows) == row_budget(FPS, 2) < 1e6
    assert rows.stopped.startswith(f'stopped at {row_budget(FPS, 2)} rows')


def test_a_stall_within_the_bound_still_exports_its_held_rows(tmp_path):
    """One stall of up to MAX_GAP_S is still a true timeline: its held rows export, nothing refused."""
    store = make_store(tmp_path / 'arm')
    ep = store.begin('stall', 'reach', _contract())
    frames = [_frame(0.0, np.zeros(3), np.ones(3), span=(0, 0.0, 1.0)),
              _frame(1 / 30, np.zeros(3), np.ones(3), span=(1, 1.0, 2.0)),
              _frame(250.0, np.zeros(3), np.ones(3), span=(7500, 7500.0, 7501.0)),
              _frame(250.0 + 1 / 30, np.zeros(3), np.ones(3), span=(7501, 7501.0, 7502.0))]
    assert ep.add_telemetry(frames) == 0
    ep.commit('completed', {'actions': 4})
    [episode] = store.episodes()
    rows = build_rows(episode, FPS, ActionSpace.JOINT_ABSOLUTE, 3, 3, [])
    assert len(rows) == 7502 and rows.held.sum() == 7498 and rows.stopped == ''
