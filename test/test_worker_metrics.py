"""Prometheus metrics: scrape a live worker over HTTP and watch the numbers move with traffic."""

from __future__ import annotations

import urllib.request
from pathlib import Path

import numpy as np
import pytest
from test_worker_support import Stream, channel, handshake, state_request, wait_for, wait_ready

import sequence_ai_ros.policy as seq
from sequence_ai_ros.protocol import sequence_ai_pb2 as pb
from sequence_ai_ros.protocol import sequence_ai_pb2_grpc as pb_grpc
from sequence_ai_ros.worker import serve_policy_file

prom_parser = pytest.importorskip('prometheus_client.parser', reason='prometheus_client is not installed')
MLP = Path(seq.__file__).resolve().parents[1] / 'bench' / 'policies' / 'mlp_policy.py'
NAMES = [f'j{i}' for i in range(14)]


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    text = urllib.request.urlopen(f'http://127.0.0.1:{port}/metrics', timeout=5).read().decode()
    out = {}
    for family in prom_parser.text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def value(samples, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_a_live_worker_exposes_metrics_that_move_with_traffic(tmp_path):
    from sequence_ai_ros.capture.settings import CaptureSettings, save_settings

    save_settings(tmp_path / 'capture' / 'mlp', CaptureSettings(rate=1.0, enabled=True, fps=15.0))
    with serve_policy_file(MLP, 'mlp', steps=5, metrics_port=0, capture_root=tmp_path / 'capture') as server, \
            channel(server.port) as ch:
        assert server.metrics_port
        server.metrics.capture_bytes_ttl_s = 0.0  # walk the store at every scrape
        stub = pb_grpc.PolicyServiceStub(ch)
        handshake(stub, 'mlp')
        assert wait_ready(stub, 'mlp').ready
        before = scrape(server.metrics_port)
        assert value(before, 'seq_requests_total', deployment='mlp', outcome='chunk') == 0
        assert value(before, 'seq_active_episodes', deployment='mlp') == 0
        robots = [Stream(stub, 'mlp', f'r{k}') for k in range(4)]
        for r in robots:
            assert r.start().HasField('started')
        rng = np.random.default_rng(0)
        for rid in (1, 2, 3):
            for r in robots:
                r.send(observation=state_request(rid, rng.standard_normal(14), NAMES))
            for r in robots:
                assert r.recv().HasField('chunk')
        bad = robots[0].ask(state_request(4, np.zeros(3), NAMES[:3]))
        assert bad.error.code == pb.CONTRACT_VIOLATION
        during = scrape(server.metrics_port)
        assert value(during, 'seq_active_episodes', deployment='mlp') == 4
        assert value(during, 'seq_open_streams', deployment='mlp') == 4
        assert value(during, 'seq_requests_total', deployment='mlp', outcome='chunk') == 12
        assert value(during, 'seq_requests_total', deployment='mlp', outcome='CONTRACT_VIOLATION') == 1
        calls = value(during, 'seq_batch_size_count', deployment='mlp')
        assert value(during, 'seq_batch_size_sum', deployment='mlp') == 12 and 3 <= calls <= 12
        assert value(during, 'seq_inference_seconds_count', deployment='mlp') == calls
        assert value(during, 'seq_inference_seconds_sum', deployment='mlp') > 0
        assert value(during, 'seq_queue_depth', deployment='mlp') == 0
        for k, r in enumerate(robots):
            r.send(end=pb.EpisodeEnd(reason='completed' if k else 'operator', underruns=k, underrun_s=0.5 * k))
            assert r.recv().HasField('ended')
        after = scrape(server.metrics_port)
        assert value(after, 'seq_active_episodes', deployment='mlp') == 0
        assert value(after, 'seq_episodes_ended_total', deployment='mlp', reason='completed') == 3
        assert value(after, 'seq_episodes_ended_total', deployment='mlp', reason='other') == 1  # a free-text reason
        assert value(after, 'seq_client_underruns_total', deployment='mlp') == 0 + 1 + 2 + 3
        assert value(after, 'seq_client_underrun_seconds_total', deployment='mlp') == pytest.approx(3.0)
        captured = value(after, 'seq_capture_bytes', deployment='mlp')
        assert captured > value(before, 'seq_capture_bytes', deployment='mlp')


def test_open_streams_are_counted_per_deployment(seq_home):
    from sequence_ai_ros.cli import main as seq_main
    from sequence_ai_ros.worker import create_server

    for name in ('arm', 'hand'):
        assert seq_main(['deploy', str(MLP), '--name', name]) == 0
    with create_server(['arm', 'hand'], home=seq_home, metrics_port=0) as server, channel(server.port) as ch:
        stub = pb_grpc.PolicyServiceStub(ch)
        for name in ('arm', 'hand'):
            handshake(stub, name)
            assert wait_ready(stub, name).ready
        assert {value(scrape(server.metrics_port), 'seq_open_streams', deployment=n) for n in ('arm', 'hand')} == {0}
        robots = [Stream(stub, 'arm', f'arm{k}') for k in range(3)] + [Stream(stub, 'hand', 'hand0')]
        for r in robots:
            assert r.start().HasField('started')
        during = scrape(server.metrics_port)
        assert value(during, 'seq_open_streams', deployment='arm') == 3
        assert value(during, 'seq_open_streams', deployment='hand') == 1
        assert not any(key[0] == 'seq_open_streams' and not key[1] for key in during)   # no unlabelled total
        for r in robots[:2]:
            assert r.end().HasField('ended')
            r.close()
        wait_for(lambda: value(scrape(server.metrics_port), 'seq_open_streams', deployment='arm') == 1,
                 what='the ended streams to close')
        assert value(scrape(server.metrics_port), 'seq_open_streams', deployment='hand') == 1
        for r in robots[2:]:
            assert r.end().HasField('ended')


def has(samples, name: str, **labels) -> bool:
    return (name, tuple(sorted(labels.items()))) in samples


def test_every_series_exists_at_zero_and_latency_underrun_build_and_process_metrics_move(tmp_path):
    from sequence_ai_ros import __version__
    from sequence_ai_ros.protocol import codec
    from sequence_ai_ros.worker.metrics import package_version

    assert package_version() == __version__

    with serve_policy_file(MLP, 'mlp', steps=5, metrics_port=0) as server, channel(server.port) as ch:
        stub = pb_grpc.PolicyServiceStub(ch)
        assert wait_ready(stub, 'mlp').ready
        before = scrape(server.metrics_port)
        # every labelled series is there before its first increment, so rate()/increase() see that one too
        for outcome in ('chunk', 'OVERLOADED', 'NOT_READY', 'POLICY_EXCEPTION'):
            assert has(before, 'seq_requests_total', deployment='mlp', outcome=outcome), outcome
        for reason in ('completed', 'disconnect', 'drain_timeout', 'other'):
            assert has(before, 'seq_episodes_ended_total', deployment='mlp', reason=reason), reason
        for reason in ('max_streams', 'per_client', 'anonymous', 'draining'):
            assert has(before, 'seq_streams_refused_total', reason=reason), reason
        assert has(before, 'seq_boundary_refused_total', deployment='mlp', field='images')
        for name in ('seq_client_underruns_total', 'seq_telemetry_underruns_total',
                     'seq_telemetry_underrun_seconds_total', 'seq_request_seconds_count', 'seq_queue_seconds_count',
                     'seq_time_to_first_chunk_seconds_count', 'seq_inference_seconds_count'):
            assert has(before, name, deployment='mlp') and value(before, name, deployment='mlp') == 0, name
        assert value(before, 'seq_build_info', version=__version__, deployment='mlp', deployment_version='0') == 1
        assert any(key[0] == 'process_resident_memory_bytes' for key in before)
        assert any(key[0] == 'python_info' for key in before)

        robot = Stream(stub, 'mlp', 'r0')
        assert robot.start().HasField('started')
        rng = np.random.default_rng(0)
        for rid in (1, 2, 3):
            assert robot.ask(state_request(rid, rng.standard_normal(14), NAMES)).HasField('chunk')
        state = codec.to_tensor(np.zeros(14, np.float32))
        frames = [pb.TelemetryFrame(robot_time_s=t, state=state, hold=hold, hold_reason=why)
                  for t, hold, why in ((1.0, False, ''), (1.5, True, 'underrun'), (2.0, True, 'underrun'),
                                       (2.5, False, ''), (3.0, True, 'underrun'))]
        robot.send(telemetry=pb.Telemetry(frames=frames))
        # live: counted from the telemetry while the episode runs, before (and without) any EpisodeEnd
        wait_for(lambda: value(scrape(server.metrics_port), 'seq_telemetry_underruns_total', deployment='mlp') == 2,
                 what='the telemetry underruns to be counted')
        during = scrape(server.metrics_port)
        assert value(during, 'seq_telemetry_underrun_seconds_total', deployment='mlp') == pytest.approx(1.5)
        assert value(during, 'seq_client_underruns_total', deployment='mlp') == 0
        assert value(during, 'seq_request_seconds_count', deployment='mlp') == 3
        assert value(during, 'seq_queue_seconds_count', deployment='mlp') == 3
        assert value(during, 'seq_time_to_first_chunk_seconds_count', deployment='mlp') == 1
        assert value(during, 'seq_request_seconds_sum', deployment='mlp') > 0
        robot.cancel()   # a crashed robot: no EpisodeEnd, and its underruns were counted all the same
        wait_for(lambda: value(scrape(server.metrics_port), 'seq_episodes_ended_total', deployment='mlp',
                               reason='disconnect') == 1, what='the dropped episode to end')
        assert value(scrape(server.metrics_port), 'seq_telemetry_underruns_total', deployment='mlp') == 2


def test_the_bearer_scheme_is_matched_in_any_case_and_the_token_exactly(tmp_path):
    """HTTP authentication schemes are case-insensitive (RFC 9110 11.1): the metrics port and gRPC agree."""
    import urllib.error

    import grpc

    fast = Path(__file__).resolve().parent / 'policies' / 'fast.py'
    with serve_policy_file(fast, 'fast', dim=2, token='s3cret', metrics_port=0) as server, \
            channel(server.port) as ch:
        def status(value: str | None) -> int:
            req = urllib.request.Request(f'http://127.0.0.1:{server.metrics_port}/metrics',
                                         headers={'Authorization': value} if value is not None else {})
            try:
                return urllib.request.urlopen(req, timeout=5).status
            except urllib.error.HTTPError as exc:
                return exc.code

        for good in ('Bearer s3cret', 'bearer s3cret', 'BEARER s3cret', 'bEaReR  s3cret'):
            assert status(good) == 200, good
        for bad in ('Bearer S3CRET', 'Basic s3cret', 's3cret', 'Bearers3cret', 'Bearer', '', None):
            assert status(bad) == 401, bad
        stub = pb_grpc.PolicyServiceStub(ch)
        assert handshake(stub, 'fast', metadata=[('authorization', 'bearer s3cret')]).action_dim == 2
        with pytest.raises(grpc.RpcError) as refused:
            handshake(stub, 'fast', metadata=[('authorization', 'bearer S3CRET')])
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
