"""Worker capture hook on the real capture store: announce, keep, label; a broken store never breaks serving."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from test_worker_support import POLICIES, Stream, channel, state_request, wait_ready

from sequence_ai_ros.protocol import codec
from sequence_ai_ros.protocol import sequence_ai_pb2 as pb
from sequence_ai_ros.protocol import sequence_ai_pb2_grpc as pb_grpc
from sequence_ai_ros.worker import serve_policy_file

capture = pytest.importorskip('sequence_ai_ros.capture.store')
from sequence_ai_ros.capture.settings import CaptureSettings, save_settings  # noqa: E402

NAMES = [f'j{i}' for i in range(4)]


def _telemetry(t: float) -> pb.EpisodeRequest:
    s = codec.to_tensor(np.full(4, t, np.float32))
    return pb.Telemetry(frames=[pb.TelemetryFrame(robot_time_s=t, state=s, action=s)])


def test_captured_episode_is_announced_stored_and_labelled(tmp_path):
    root = tmp_path / 'capture'
    save_settings(root / 'fast', CaptureSettings(rate=1.0, enabled=True, fps=15.0))
    with serve_policy_file(POLICIES / 'fast.py', 'fast', dim=4, capture_root=root) as server, \
            channel(server.port) as ch:
        stub = pb_grpc.PolicyServiceStub(ch)
        assert wait_ready(stub, 'fast').ready
        s = Stream(stub, 'fast', 'cap-1')
        started = s.start('pick the bottle').started
        assert started.capture and started.capture_fps == 15.0 and not started.capture_images
        for rid in (1, 2, 3):
            assert s.ask(state_request(rid, np.arange(4) * rid, NAMES)).HasField('chunk')
            s.send(telemetry=_telemetry(float(rid)))
        assert s.end('completed').ended.captured
        label = stub.Label(pb.LabelRequest(deployment='fast', episode_id='cap-1', success=True, notes='ok'),
                           timeout=5)
        assert label.ok, label.message
        # an episode another replica ran (its replica stopped, the balancer sent the label here): stored, said so
        elsewhere = stub.Label(pb.LabelRequest(deployment='fast', episode_id='never', success=True), timeout=5)
        assert elsewhere.ok and 'did not run it' in elsewhere.message, elsewhere.message
        assert label.ok and 'did not run' not in label.message
    store = capture.CaptureStore(root / 'fast', deployment='fast')
    episodes = list(store.episodes())
    assert len(episodes) == 1 and store.bytes_used() > 0


def test_capture_off_is_announced_and_label_is_still_stored(tmp_path):
    with serve_policy_file(POLICIES / 'fast.py', 'fast', dim=4, capture_root=tmp_path / 'capture') as server, \
            channel(server.port) as ch:
        stub = pb_grpc.PolicyServiceStub(ch)
        assert wait_ready(stub, 'fast').ready
        s = Stream(stub, 'fast', 'nocap')
        assert not s.start().started.capture
        assert s.ask(state_request(1, np.zeros(4), NAMES)).HasField('chunk')
        assert not s.end().ended.captured
        label = stub.Label(pb.LabelRequest(deployment='fast', episode_id='nocap', success=False), timeout=5)
        assert label.ok and 'labelled' in label.message   # seen, not captured: labelled for the scoreboard


def test_a_store_that_cannot_write_does_not_break_serving(tmp_path):
    root = tmp_path / 'capture'
    save_settings(root / 'fast', CaptureSettings(rate=1.0, enabled=True, fps=15.0))
    with serve_policy_file(POLICIES / 'fast.py', 'fast', dim=4, capture_root=root) as server, \
            channel(server.port) as ch:
        stub = pb_grpc.PolicyServiceStub(ch)
        assert wait_ready(stub, 'fast').ready
        s = Stream(stub, 'fast', 'cap-broken')
        assert s.start().started.capture
        episodes = root / 'fast' / 'episodes'
        shutil.rmtree(episodes)
        episodes.write_text('not a directory')  # the commit cannot rename into it, even as root
        for rid in range(1, 4):
            assert s.ask(state_request(rid, np.zeros(4), NAMES)).HasField('chunk')
        ended = s.end()
        assert ended.HasField('ended') and not ended.ended.captured
        s2 = Stream(stub, 'fast', 'after-broken')
        assert s2.start().HasField('started')
        assert s2.ask(state_request(1, np.zeros(4), NAMES)).HasField('chunk')
        assert s2.end().HasField('ended')
        label = stub.Label(pb.LabelRequest(deployment='fast', episode_id='cap-broken', success=True), timeout=5)
        assert label.ok   # the episode was seen; its label is kept in the index though its data was not
