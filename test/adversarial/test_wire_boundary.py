"""What one robot sends cannot hurt another: values refused at the boundary, alone, typed and counted.

Each test reproduces an attack from the break-it review against a real worker (gRPC on loopback, a real
capture store on disk) and asserts the outcome now holds.
"""

from __future__ import annotations

import json
import math
import socket
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest
from test_worker_support import Stream, channel, handshake, state_request, wait_for, wait_ready

from sequence_ai_ros.capture.settings import CaptureSettings, save_settings
from sequence_ai_ros.capture.store import CaptureStore
from sequence_ai_ros.protocol import PROTOCOL_VERSION, codec, limits
from sequence_ai_ros.protocol import sequence_ai_pb2 as pb
from sequence_ai_ros.protocol import sequence_ai_pb2_grpc as pb_grpc
from sequence_ai_ros.worker import serve_policy_file

FAST = Path(__file__).resolve().parents[1] / 'policies' / 'fast.py'
NAMES = [f'j{i}' for i in range(3)]
prom_parser = pytest.importorskip('prometheus_client.parser', reason='prometheus_client is not installed')


@pytest.fixture
def worker(tmp_path):
    """A worker of fast.py (D=3, deployment 'fast') capturing every episode, with metrics and a token."""
    save_settings(tmp_path / 'capture' / 'fast', CaptureSettings(rate=1.0, enabled=True, images=True, fps=30.0))
    servers = []

    def start(**kw):
        kw.setdefault('capture_root', tmp_path / 'capture')
        server = serve_policy_file(FAST, 'fast', dim=3, host='127.0.0.1', port=0, metrics_port=0, **kw)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop(grace=0.5)


def _stub(server, token=None):
    ch = channel(server.port)
    md = [('authorization', f'Bearer {token}')] if token else []
    stub = pb_grpc.PolicyServiceStub(ch)
    handshake(stub, 'fast', metadata=md or None)
    assert wait_ready(stub, 'fast', metadata=md or None).ready
    return ch, stub, md


def _frame(i: int, **kw) -> pb.TelemetryFrame:
    return pb.TelemetryFrame(robot_time_s=i / 30, state=codec.to_tensor(np.zeros(3, np.float32)),
                             action=codec.to_tensor(np.zeros(3, np.float32)), grid_index=i, step_start=float(i),
                             step_end=float(i + 1), **kw)


def _episode(stub, eid, end, frames=(), md=()):
    """Run one episode: start, one request, telemetry, the given EpisodeEnd; return every reply after the end."""
    s = Stream(stub, 'fast', eid, metadata=md)
    started = s.start()
    assert started.HasField('started'), started
    assert s.ask(state_request(1, np.zeros(3), NAMES)).HasField('chunk')
    if frames:
        s.send(telemetry=pb.Telemetry(frames=list(frames)))
    s.send(end=end)
    replies = []
    while True:
        reply = s.recv(timeout=10)
        if reply is None:
            break
        replies.append(reply)
        if reply.HasField('ended'):
            break
    s.close()
    return started.started, replies


def scrape(port, token=None):
    req = urllib.request.Request(f'http://127.0.0.1:{port}/metrics',
                                 headers={'Authorization': f'Bearer {token}'} if token else {})
    text = urllib.request.urlopen(req, timeout=10).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in prom_parser.text_string_to_metric_families(text) for s in fam.samples}


def test_nan_latency_is_refused_for_that_robot_and_never_pauses_capture_for_the_next(worker, tmp_path):
    """Attack: EpisodeEnd(latency_p95_ms=nan) hit SQLite's NOT NULL, flagged the index corrupt, paused all capture."""
    server = worker()
    ch, stub, _ = _stub(server)
    with ch:
        _, replies = _episode(stub, 'poison', pb.EpisodeEnd(reason='completed', latency_p95_ms=math.nan,
                                                            underrun_s=math.inf))
        errors = [r.error for r in replies if r.HasField('error')]
        assert {e.code for e in errors} == {pb.CONTRACT_VIOLATION}
        assert any('latency_p95_ms' in e.message for e in errors) and any('underrun_s' in e.message for e in errors)
        ended = replies[-1].ended
        assert ended.captured and ended.capture_error == ''   # the episode itself is kept, the bad figures not
        started, replies = _episode(stub, 'next-robot', pb.EpisodeEnd(reason='completed', latency_p95_ms=12.5))
        assert started.capture and started.capture_error == ''
        assert replies[-1].ended.captured
        samples = scrape(server.metrics_port)
    store = CaptureStore(tmp_path / 'capture' / 'fast', 'fast')
    assert store.status()['state'] == 'capturing'
    runs = {r['episode_id']: r for r in store.runs()}
    assert runs['poison']['latency_p95_ms'] == 0.0 and runs['next-robot']['latency_p95_ms'] == 12.5
    assert samples[('seq_boundary_refused_total', (('deployment', 'fast'), ('field', 'latency_p95_ms')))] == 1
    # underrun_s=inf never reaches the counter (it stayed at +Inf for good)
    assert math.isfinite(samples.get(('seq_client_underrun_seconds_total', (('deployment', 'fast'),)), 0.0))


def test_a_row_the_index_refuses_refuses_that_episode_alone(tmp_path):
    """A value SQLite refuses (NOT NULL on NaN) is that episode's fault: no 'index is corrupt', no pause."""
    store = CaptureStore(tmp_path / 'cap', 'cap')
    save_settings(tmp_path / 'cap', CaptureSettings(rate=1.0, enabled=True))
    assert store.begin('a', 'x', None) is not None
    with pytest.raises(Exception, match='not kept'):
        store.record_run({'episode_id': 'bad', 'version': 0, 'started_at': 0.0, 'ended_at': 1.0, 'reason': 'x',
                          'latency_p95_ms': None})
    assert store.status()['state'] == 'capturing'
    assert store.begin('b', 'x', None) is not None


def test_camera_key_with_a_path_is_refused_and_never_becomes_a_path(worker, tmp_path):
    """Attack: images={'cam': img, '/../../../../ROOT/X': img} in telemetry; the export wrote outside --out."""
    server = worker()
    img = codec.encode_image('cam', np.zeros((8, 8, 3), np.uint8), 'raw')
    bad = []
    for key in ('/../../../../../../..ROOT/X', 'x/../../../Y', '..', '.hidden', 'a' * 65):
        image = pb.Image()
        image.CopyFrom(img)
        image.key = key
        bad.append(image)
    frames = [_frame(0, images=[img])] + [_frame(i + 1, images=[img, b]) for i, b in enumerate(bad)]
    ch, stub, _ = _stub(server)
    with ch:
        _, replies = _episode(stub, 'keys', pb.EpisodeEnd(reason='completed'), frames)
    ended = replies[-1].ended
    assert ended.captured and ended.telemetry_rejected == len(bad)
    assert 'image.key' in ended.telemetry_error
    store = CaptureStore(tmp_path / 'capture' / 'fast', 'fast')
    [episode] = store.episodes()
    kept = {im.key for _, f in episode.telemetry() for im in f.images}
    assert kept == {'cam'}
    for key in ('/../x', 'a/b', '..', 'cam', 'cam_high', 'observation.images.top'):
        ok = limits.NAME_PATTERN.fullmatch(key) is not None
        assert ok == (key in ('cam', 'cam_high', 'observation.images.top'))


def test_megabyte_ids_instructions_and_notes_are_refused_with_the_field_and_limit(worker, tmp_path):
    """Attack: 3 MB episode ids, instructions and notes were accepted (44 MB of store for three tiny episodes)."""
    server = worker()
    big = 'x' * (3 << 20)
    ch, stub, md = _stub(server)
    with ch:
        s = Stream(stub, 'fast', '')
        s.send(start=pb.EpisodeStart(episode_id=big[:300]))
        reply = s.recv()
        assert reply.error.code == pb.CONTRACT_VIOLATION and 'episode_id' in reply.error.message
        assert f'at most {limits.MAX_ID}' in reply.error.message and len(reply.error.message) < 500
        s.send(start=pb.EpisodeStart(episode_id='ok-1', instruction=big))
        reply = s.recv()
        assert reply.error.code == pb.CONTRACT_VIOLATION and 'instruction' in reply.error.message
        s.send(start=pb.EpisodeStart(episode_id='ok-1', instruction='pick'))
        assert s.recv().HasField('started')   # the same stream goes on: a refusal is typed, not fatal
        s.send(end=pb.EpisodeEnd(reason='completed'))
        assert s.recv().HasField('ended')
        with pytest.raises(grpc.RpcError) as err:
            stub.Label(pb.LabelRequest(deployment='fast', episode_id='ok-1', success=True, notes=big[:100_000]),
                       timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and 'notes' in err.value.details()
        assert stub.Label(pb.LabelRequest(deployment='fast', episode_id='ok-1', success=True, notes='fine'),
                          timeout=10).ok
    assert (tmp_path / 'capture' / 'fast').stat() and sum(
        f.stat().st_size for f in (tmp_path / 'capture' / 'fast').rglob('*') if f.is_file()) < (2 << 20)


def test_terminal_escapes_in_a_reason_are_refused_and_free_text_is_never_a_label(worker, tmp_path):
    """Attack: 2,000 unique reasons made 2,003 series; a 200 KB reason was accepted; escapes printed raw."""
    server = worker()
    ch, stub, _ = _stub(server)
    with ch:
        _, replies = _episode(stub, 'esc', pb.EpisodeEnd(reason='\x1b[2J\x1b]0;owned\x07'))
        assert any(r.HasField('error') and 'reason' in r.error.message for r in replies)
        _, replies = _episode(stub, 'huge', pb.EpisodeEnd(reason='r' * 200_000))
        assert any(r.HasField('error') and 'reason' in r.error.message for r in replies)
        for k in range(60):   # unique free-text reasons: stored, labelled 'other'
            s = Stream(stub, 'fast', f'free-{k}')
            assert s.start().HasField('started')
            s.send(end=pb.EpisodeEnd(reason=f'operator stop {k}'))
            assert s.recv(timeout=10).HasField('ended')
            s.close()
        samples = scrape(server.metrics_port)
    reasons = {dict(k[1])['reason'] for k in samples if k[0] == 'seq_episodes_ended_total'}
    assert reasons <= set(limits.REASONS) | {limits.OTHER_REASON} and 'other' in reasons
    assert samples[('seq_episodes_ended_total', (('deployment', 'fast'), ('reason', 'other')))] == 60
    runs = {r['episode_id']: r['reason'] for r in CaptureStore(tmp_path / 'capture' / 'fast', 'fast').runs()}
    assert runs['esc'] == 'error' and runs['huge'] == 'error' and runs['free-7'] == 'operator stop 7'
    assert limits.printable('\x1b[2J') == '\\x1b[2J'


def test_ids_that_would_split_or_reorder_a_log_line_are_refused(worker, caplog):
    """Attack: an id with a line separator (U+2028) forged a second text log line; U+202E reordered it.

    ``str.splitlines`` and log shippers split at U+2028; a terminal shows text after U+202E right to left. The
    episode id, the client id and the reason were accepted as printable.
    """
    server = worker()
    forged = 'ep\u20282030-01-01T00:00:00.000Z ERROR sequence_ai_ros.worker.server: forged'
    ch, stub, _ = _stub(server)
    with ch, caplog.at_level('INFO'):
        for start, field in ((pb.EpisodeStart(episode_id=forged), 'episode_id'),
                             (pb.EpisodeStart(episode_id='ep-rtl', client_id='robot\u202e7-tobor'), 'client_id'),
                             (pb.EpisodeStart(episode_id='ep-nbsp\u00a0x'), 'episode_id')):
            s = Stream(stub, 'fast', '')
            s.send(start=start)
            reply = s.recv()
            assert reply.error.code == pb.CONTRACT_VIOLATION and field in reply.error.message, reply
            s.close()
        _, replies = _episode(stub, 'ep-reason', pb.EpisodeEnd(reason='done\u2029forged'))
        assert any(r.HasField('error') and 'reason' in r.error.message for r in replies)
        with pytest.raises(grpc.RpcError) as err:
            stub.Handshake(pb.HandshakeRequest(deployment='fast', protocol_version=PROTOCOL_VERSION,
                                               client_id='a\u2028b'), timeout=5)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert stub.Label(pb.LabelRequest(deployment='fast', episode_id='ep-reason', success=True,
                                          notes='fine'), timeout=10).ok
    logged = [r.getMessage() for r in caplog.records]
    assert logged and not [m for m in logged if '\u2028' in m or '\u2029' in m or '\u202e' in m]
    assert any('\\u2028' in m for m in logged)               # the refusal names it, escaped
    assert limits.printable('a\u2028b\u202e') == 'a\\u2028b\\u202e'


@pytest.mark.slow
def test_metrics_need_the_token_and_idle_connections_cost_no_thread(worker, tmp_path):
    """Attack: /metrics answered without the token; 1,000 idle connections made 1,017 threads."""
    server = worker(token='s3cret')
    with pytest.raises(urllib.error.HTTPError) as err:
        scrape(server.metrics_port)
    assert err.value.code == 401
    with pytest.raises(urllib.error.HTTPError):
        scrape(server.metrics_port, token='wrong')
    assert scrape(server.metrics_port, token='s3cret')
    before = threading.active_count()
    idle = []
    try:
        for _ in range(1000):
            idle.append(socket.create_connection(('127.0.0.1', server.metrics_port), timeout=5))
        time.sleep(0.5)
        assert threading.active_count() <= before + 2, threading.active_count() - before
        got = wait_for(lambda: scrape(server.metrics_port, token='s3cret'), timeout=30, what='a scrape under the flood')
        assert got
    finally:
        for sock in idle:
            sock.close()


def test_undecodable_messages_fail_the_call_with_a_status(worker):
    """Attack: a stream of undecodable messages ended with status OK and no reply."""
    server = worker()
    with channel(server.port) as ch:
        call = ch.stream_stream('/sequence_ai.v1.PolicyService/Episode', request_serializer=lambda b: b,
                                response_deserializer=lambda b: b)
        replies = call(iter([b'\xff\xff\xff\xff garbage'] * 3), metadata=[('x-deployment', 'fast')], timeout=10)
        with pytest.raises(grpc.RpcError) as err:
            list(replies)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and 'EpisodeRequest' in err.value.details()


def test_an_end_whose_writes_fail_still_gets_episode_ended_naming_the_failure(worker, tmp_path):
    """Attack: an EpisodeEnd after a failed usage write returned RPC UNKNOWN with no EpisodeEnded."""
    home = tmp_path / 'home'
    (home / 'usage.sqlite').mkdir(parents=True)   # the usage database cannot be written
    server = worker(home=home)
    ch, stub, _ = _stub(server)
    with ch:
        _, replies = _episode(stub, 'full', pb.EpisodeEnd(reason='completed'))
    ended = replies[-1]
    assert ended.HasField('ended'), replies
    error = ended.ended.capture_error
    assert error.startswith("ending episode 'full'") and 'unable to open database file' in error
    assert server.usage()['fast'].episodes == 1   # counted in memory: written when the disk allows


def test_exported_jsonl_is_strict_json_even_from_an_old_store_with_nan(tmp_path):
    from sequence_ai_ros.protocol.limits import json_safe

    row = {'latency_p95_ms': math.nan, 'stats': {'underrun_s': math.inf}, 'ok': [1.0, -math.inf]}
    text = json.dumps(json_safe(row), allow_nan=False)
    assert json.loads(text) == {'latency_p95_ms': None, 'stats': {'underrun_s': None}, 'ok': [1.0, None]}
