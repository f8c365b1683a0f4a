"""Edges of a fleet's worker: a forced delete during a rollout, TLS connects under JSON logs, a reused observation.

- ``seq delete --force`` while a rollout's old version still runs episodes: the deployment's metrics stay until
  the last episode of every version ended, each end counted under its deployment (never ``deployment=""``),
  and the capture that fails because the deployment is gone reaches the robot as ``capture_error``.
- ``seq serve --log-format json --tls-cert``: a client's connect (its transport probe, its certificate check,
  a plaintext client's mismatch) adds no non-JSON line (gRPC core's ``Handshake failed`` on a plaintext preface).
- A robot that hands the same ``Observation`` object to every tick (one timestamp) still shows its dry spells
  as live underrun seconds: the worker reads them off the telemetry's tick clock.

Real workers, real gRPC, real TLS (openssl-made certificates); counts and values, never rates.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest
from test_delete_races import write
from test_worker_support import Stream, channel, state_request, wait_for, wait_ready

from sequence_ai_ros.capture.settings import CaptureSettings, save_settings
from sequence_ai_ros.cli import main as seq_main
from sequence_ai_ros.client import Observation, connect
from sequence_ai_ros.exceptions import ConnectionLost
from sequence_ai_ros.protocol import sequence_ai_pb2 as pb
from sequence_ai_ros.protocol import sequence_ai_pb2_grpc as pb_grpc
from sequence_ai_ros.worker import create_server, serve_policy_file
from sequence_ai_ros.worker.registry import Registry, deploy

prom_parser = pytest.importorskip('prometheus_client.parser', reason='prometheus_client is not installed')
HERE = Path(__file__).resolve().parent
FAST = HERE.parent / 'policies' / 'fast.py'
ECHO = HERE.parent / 'policies' / 'worker_echo.py'
NAMES = ['a', 'b']



def _scrape(port: int) -> dict[tuple[str, tuple], float]:
    text = urllib.request.urlopen(f'http://127.0.0.1:{port}/metrics', timeout=5).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in prom_parser.text_string_to_metric_families(text) for s in family.samples}


def _ended(samples, deployment: str) -> float:
    return sum(v for (name, labels), v in samples.items()
               if name == 'seq_episodes_ended_total' and ('deployment', deployment) in labels)


def _deployments(samples) -> set[str]:
    return {dict(labels)['deployment'] for (name, labels) in samples
            if name == 'seq_episodes_ended_total' and 'deployment' in dict(labels)}


def _lookup(stub) -> None:
    with contextlib.suppress(grpc.RpcError):
        stub.Ready(pb.ReadyRequest(deployment='arm'), timeout=5)


def _version(stub) -> int:
    """The deployment version a new episode of ``arm`` gets."""
    stream = Stream(stub, 'arm', f'probe-{time.monotonic_ns()}')
    version = stream.start().started.deployment_version
    assert stream.end().HasField('ended')
    stream.close()
    return version


def test_a_forced_delete_during_a_rollout_keeps_metrics_until_the_old_versions_episodes_end(tmp_path, seq_home):
    policy = write(tmp_path / 'arm' / 'policy.py', 1.0)
    deploy(policy)
    save_settings(Registry().capture_dir('arm'), CaptureSettings(rate=1.0, enabled=True))
    with create_server(['arm'], home=seq_home, metrics_port=0, warm=True) as server, channel(server.port) as ch, \
            connect('arm', endpoint=f'127.0.0.1:{server.port}') as robot:
        stub = pb_grpc.PolicyServiceStub(ch)
        assert wait_ready(stub, 'arm').ready
        robot.wait_until_ready(timeout=30)
        # two episodes on version 1: the robot's (the client), and a second one that outlives it
        robot.begin_episode('old', episode_id='old-robot')
        t0 = time.monotonic()
        obs = [Observation(state=np.zeros(2, np.float32), state_names=tuple(NAMES), timestamp=t0 + k * 0.05)
               for k in range(40)]
        for k in range(10):
            robot.next_action(obs[k], now=obs[k].timestamp)
        other = Stream(stub, 'arm', 'old-other')
        assert other.start().started.deployment_version == 1
        deploy(write(policy, 2.0))                        # version 2 loads beside version 1, then takes over
        wait_for(lambda: _version(stub) == 2, timeout=60, what='version 2 to serve new episodes')
        assert seq_main(['delete', 'arm', '--force', '--yes']) == 0
        _lookup(stub)                                      # the worker looks at the registry: arm is retired
        assert 'arm' not in server.runtimes
        for _ in range(10):        # version 1 still runs: its series stay (the review: gone within 0.5 s)
            assert 'arm' in _deployments(_scrape(server.metrics_port))
            time.sleep(0.2)

        for k in range(10, 20):                              # --force: version 1's episodes go on
            robot.next_action(obs[k], now=obs[k].timestamp)
        out = robot.end_episode('completed')
        samples = _scrape(server.metrics_port)
        assert _ended(samples, 'arm') >= 1 and _ended(samples, '') == 0, samples   # never deployment=""
        assert out.worker_confirmed, out
        assert out.capture_error and 'not kept' in out.capture_error, out    # the deleted store refused it

        assert other.ask(state_request(1, [0.0, 0.0], NAMES)).HasField('chunk')
        reply = other.end()
        assert reply.HasField('ended') and reply.ended.capture_error, reply
        other.close()
        wait_for(lambda: 'arm' not in _deployments(_scrape(server.metrics_port)), timeout=30,
                 what="the deleted deployment's series to go once its last episode ended")
        assert _ended(_scrape(server.metrics_port), '') == 0


def _cert(tmp_path: Path) -> tuple[Path, Path]:
    if shutil.which('openssl') is None:
        pytest.skip('the openssl CLI is needed to make test certificates')
    cert, key = tmp_path / 'worker.pem', tmp_path / 'worker.key'
    subprocess.run(['openssl', 'req', '-x509', '-newkey', 'ec', '-pkeyopt', 'ec_paramgen_curve:P-256', '-nodes',
                    '-keyout', str(key), '-out', str(cert), '-days', '1', '-subj', '/CN=worker',
                    '-addext', 'subjectAltName=DNS:localhost,IP:127.0.0.1'], check=True, capture_output=True)
    return cert, key


def test_json_logs_stay_json_through_tls_connects_and_a_plaintext_mismatch(tmp_path, processes):
    cert, key = _cert(tmp_path)
    proc = processes.spawn([sys.executable, '-m', 'sequence_ai_ros.cli', 'serve', str(ECHO), '--port', '0',
                            '--log-format', 'json', '--tls-cert', str(cert), '--tls-key', str(key)])
    line = proc.stdout.readline()   # 'serving worker_echo on 127.0.0.1:PORT'
    match = re.match(r'^serving \S+ on \S+:(\d+)', line)
    assert match, (line, proc.poll())
    endpoint = f'127.0.0.1:{match.group(1)}'
    for _ in range(3):                                  # each connect probes the transport and the certificate
        with connect('worker_echo', endpoint=endpoint, tls=str(cert), timeout=20.0) as policy:
            assert policy.contract.action_names
    with pytest.raises(ConnectionLost, match='speaks TLS'):   # a plaintext client told at once, as before
        connect('worker_echo', endpoint=endpoint, timeout=20.0)
    time.sleep(0.5)                                     # gRPC core logs a failed handshake as it happens
    proc.terminate()
    _, err = proc.communicate(timeout=20)
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines, 'the worker logged nothing'
    bad = []
    for line in lines:
        try:
            assert isinstance(json.loads(line), dict)
        except (ValueError, AssertionError):
            bad.append(line)
    assert not bad, bad[:5]
    assert not any('Handshake failed' in line for line in lines), lines


def test_a_reused_observation_object_still_shows_live_underrun_seconds(tmp_path):
    """One Observation object (one timestamp) every tick; a 0.2 s policy that answers 3 steps: dry spells."""
    root = tmp_path / 'capture'
    save_settings(root / 'fast', CaptureSettings(rate=1.0, enabled=True))
    obs = Observation(state=np.zeros(4, np.float32), state_names=tuple(f'j{i}' for i in range(4)))
    with serve_policy_file(FAST, 'fast', dim=4, chunk_length=3, latency_s=0.2, metrics_port=0,
                           capture_root=root) as server, \
            connect('fast', endpoint=f'127.0.0.1:{server.port}') as policy:
        policy.wait_until_ready(timeout=30)
        out = policy.run(lambda: obs, lambda a: None, max_actions=12, prefetch=False)
        assert out.underruns > 0 and out.underrun_s > 0, out          # the robot ran dry
        samples = _scrape(server.metrics_port)
    live = samples.get(('seq_telemetry_underrun_seconds_total', (('deployment', 'fast'),)), 0.0)
    assert samples.get(('seq_telemetry_underruns_total', (('deployment', 'fast'),)), 0.0) > 0, samples
    assert 0 < live <= out.elapsed_s + 1.0, (live, out)


def test_a_dry_spell_counts_on_the_tick_clock_when_every_frame_has_one_timestamp():
    """The watch itself: frames at one robot time, spans one chunk step apart (dt 0.1 s)."""
    from sequence_ai_ros.worker.metrics import UnderrunWatch

    frames = [pb.TelemetryFrame(robot_time_s=5.0, step_start=k, step_end=k + 1, hold=why != '', hold_reason=why)
              for k, why in enumerate(['', 'underrun', 'underrun', 'underrun', '', 'underrun'])]
    count, seconds = UnderrunWatch(0.1).observe(frames)
    assert count == 2 and seconds == pytest.approx(0.4)            # 3 ticks, then 1 tick, of 0.1 s
    old = [pb.TelemetryFrame(robot_time_s=t, hold_reason=why) for t, why in ((1.0, ''), (1.5, 'underrun'))]
    assert UnderrunWatch(0.1).observe(old) == (1, pytest.approx(0.5))   # no span (an older client): robot time
