"""The worker's side of field data, over real gRPC on loopback with real stores.

Bad telemetry refused and counted back to the robot, runs recorded for labels and the scoreboard, and
``seq delete`` of a served deployment.
"""

from __future__ import annotations

import time

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from test_worker_support import POLICIES, Stream, channel, handshake, state_request, wait_ready

from sequence_ai_ros.capture.settings import CaptureSettings, save_settings
from sequence_ai_ros.capture.store import CaptureStore
from sequence_ai_ros.cli import main as seq_main
from sequence_ai_ros.protocol import codec
from sequence_ai_ros.protocol import sequence_ai_pb2 as pb
from sequence_ai_ros.protocol import sequence_ai_pb2_grpc as pb_grpc
from sequence_ai_ros.worker import create_server, serve_policy_file
from sequence_ai_ros.worker.registry import Registry, deploy
from sequence_ai_ros.worker.usage import read_usage

NAMES = [f'j{i}' for i in range(4)]


def _frame(t: float, state) -> pb.TelemetryFrame:
    s = codec.to_tensor(np.asarray(state, np.float32))
    return pb.TelemetryFrame(robot_time_s=t, state=s, action=s)


def test_bad_telemetry_is_refused_counted_and_the_episode_kept(tmp_path):
    root = tmp_path / 'capture'
    save_settings(root / 'fast', CaptureSettings(rate=1.0, enabled=True))
    with serve_policy_file(POLICIES / 'fast.py', 'fast', dim=4, capture_root=root) as server, \
            channel(server.port) as ch:
        stub = pb_grpc.PolicyServiceStub(ch)
        assert wait_ready(stub, 'fast').ready
        s = Stream(stub, 'fast', 'poison')
        started = s.start().started
        assert started.capture and started.capture_fps == 30.0   # the policy's 1/dt
        assert s.ask(state_request(1, np.zeros(4), NAMES)).HasField('chunk')
        nan = _frame(0.1, [0, np.nan, 0, 0])
        wrong = _frame(0.2, np.zeros(7))
        s.send(telemetry=pb.Telemetry(frames=[_frame(0.0, np.zeros(4)), nan, wrong, _frame(0.3, np.ones(4))]))
        ended = s.end().ended
        assert ended.captured and ended.telemetry_rejected == 2
        assert ended.telemetry_error.startswith('CONTRACT_VIOLATION') and 'non-finite' in ended.telemetry_error
    [ep] = CaptureStore(root / 'fast', 'fast').episodes()
    assert ep.frames == 2 and ep.stats['telemetry_rejected'] == 2


def test_every_seen_episode_is_a_run_and_takes_a_label(tmp_path, seq_home, capsys):
    deploy(POLICIES / 'fast.py', name='fast')
    save_settings(seq_home / 'capture' / 'fast', CaptureSettings(rate=0.0, enabled=True))   # nothing captured
    server = create_server(['fast'])
    try:
        with channel(server.port) as ch:
            stub = pb_grpc.PolicyServiceStub(ch)
            assert wait_ready(stub, 'fast').ready
            for eid, reason in (('r1', 'completed'), ('r2', 'interrupted')):
                s = Stream(stub, 'fast', eid)
                assert not s.start().started.capture
                assert s.ask(state_request(1, np.zeros(26), [f'j{i}' for i in range(26)])).HasField('chunk')
                s.end(reason)
            assert stub.Label(pb.LabelRequest(deployment='fast', episode_id='r1', success=True), timeout=5).ok
            other = stub.Label(pb.LabelRequest(deployment='fast', episode_id='nope', success=False), timeout=5)
            assert other.ok and 'did not run it' in other.message   # kept for a merge; counted as no run here
    finally:
        server.stop()
    assert seq_main(['policy', 'stats', 'fast', '--plot', str(tmp_path / 'stats.png')]) == 0
    out = capsys.readouterr().out
    assert 'policy fast: 2 episodes' in out and '100% of 1' in out and 'completed 1, interrupted 1' in out
    assert (tmp_path / 'stats.png').stat().st_size > 5000


def test_seq_delete_while_serving_stops_serving_and_capturing_it(tmp_path, seq_home):
    deploy(POLICIES / 'fast.py', name='fast')
    deploy(POLICIES / 'fast.py', name='other')
    save_settings(seq_home / 'capture' / 'fast', CaptureSettings(rate=1.0, enabled=True))
    server = create_server(['fast', 'other'])
    try:
        with channel(server.port) as ch:
            stub = pb_grpc.PolicyServiceStub(ch)
            assert wait_ready(stub, 'fast').ready
            s = Stream(stub, 'fast', 'before')
            s.start()
            assert s.ask(state_request(1, np.zeros(26), [f'j{i}' for i in range(26)])).HasField('chunk')
            s.end()
            Registry(seq_home).delete('fast')
            with pytest.raises(grpc.RpcError) as err:
                handshake(stub, 'fast')
            assert '[UNKNOWN_DEPLOYMENT]' in err.value.details()
            gone = Stream(stub, 'fast', 'after')
            assert gone.start() is None and '[UNKNOWN_DEPLOYMENT]' in gone.error.details()
            handshake(stub, 'other')   # the others are served as before
            # gRPC health (what a balancer's agent reads) no longer says SERVING for it
            health = health_pb2_grpc.HealthStub(ch)
            assert wait_ready(stub, 'other').ready
            status = health.Check(health_pb2.HealthCheckRequest(service='fast'), timeout=5).status
            assert status == health_pb2.HealthCheckResponse.SERVICE_UNKNOWN, status
            deadline = time.monotonic() + 5       # health is set on the server's loop right after Ready turns
            while (health.Check(health_pb2.HealthCheckRequest(service='other'), timeout=5).status !=
                   health_pb2.HealthCheckResponse.SERVING):
                assert time.monotonic() < deadline, 'the other deployment is ready but not SERVING'
                time.sleep(0.02)
    finally:
        server.stop()   # flushes usage: the deleted deployment's row must not come back
    assert 'fast' not in read_usage(seq_home / 'usage.sqlite')
    assert not (seq_home / 'capture' / 'fast').exists()


def test_a_loop_that_clamps_reports_what_it_commanded(tmp_path):
    """next_action() + report_command(): the rows hold the clamped command, the policy's action beside it."""
    import time

    import pyarrow.parquet as pq

    from sequence_ai_ros.client import connect
    from sequence_ai_ros.datasets.lerobot_writer import export_lerobot
    from sequence_ai_ros.protocol.types import Observation

    root = tmp_path / 'capture'
    save_settings(root / 'fast', CaptureSettings(rate=1.0, enabled=True))
    sent = []
    with serve_policy_file(POLICIES / 'fast.py', 'fast', dim=4, capture_root=root) as server, \
            connect('fast', endpoint=f'127.0.0.1:{server.port}') as policy:
        policy.wait_until_ready()
        policy.begin_episode('reach')
        t0 = time.monotonic()
        for k in range(60):
            now = t0 + k / 30
            time.sleep(max(0.0, now - time.monotonic()))
            obs = Observation(state=np.full(4, 0.8, np.float32), state_names=tuple(NAMES), timestamp=now)
            action = policy.next_action(obs, now=now)
            if action is None or action.hold:
                continue
            commanded = np.clip(action.values, -0.5, 0.5)          # the robot's safety limit
            policy.report_command(commanded, clamped=bool((commanded != action.values).any()))
            sent.append(commanded)
        out = policy.end_episode('completed')
    assert out.telemetry_rejected == 0 and sent
    store = CaptureStore(root / 'fast', 'fast')
    export_lerobot(store, tmp_path / 'ds', progress=False)
    rows = pq.read_table(tmp_path / 'ds/data/chunk-000/episode_000000.parquet').to_pydict()
    fresh = ~np.array(rows['action.held'])
    np.testing.assert_array_equal(np.array(rows['action'], np.float32)[fresh], np.array(sent, np.float32)[:fresh.sum()])
    assert np.array(rows['action.clamped'])[fresh].all()
    np.testing.assert_allclose(np.array(rows['action.policy'])[fresh], 0.8, atol=1e-6)
