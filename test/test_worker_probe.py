"""Kubelet's gRPC probes against workers with a token and with TLS: the plaintext, health-only probe port.

Kubelet's built-in probe (``readinessProbe.grpc`` ...) dials the pod in plaintext and sends
``grpc.health.v1.Health/Check`` with no metadata. :func:`kubelet_probe` does the same (an insecure channel,
no metadata, a 1 s deadline as ``timeoutSeconds`` defaults to, success only for SERVING). The worker's
main port answers it UNAUTHENTICATED (token) or not at all (TLS); the probe port answers it, follows the
deployment's readiness, and serves nothing but health. The shipped manifests are then run as written:
``seq serve`` with the container's args (token file, and TLS), probed on the ports the probes name.
"""

from __future__ import annotations

import queue
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from test_worker_server import _self_signed
from test_worker_support import POLICIES, channel, handshake, wait_for

from sequence_ai_ros.cli import main as seq_main
from sequence_ai_ros.protocol import sequence_ai_pb2_grpc as pb_grpc
from sequence_ai_ros.worker import serve_policy_file

DEPLOY = Path(__file__).resolve().parents[1] / 'deploy' / 'kubernetes'
SERVING = health_pb2.HealthCheckResponse.SERVING


def kubelet_probe(port: int, service: str = '', timeout: float = 1.0) -> tuple[bool, str]:
    """Probe ``127.0.0.1:port`` as kubelet's gRPC probe does; return (success, what it got).

    Plaintext, no metadata at all, one Check with ``service``, ``timeout`` s; success only for SERVING.
    """
    with grpc.insecure_channel(f'127.0.0.1:{port}') as ch:
        try:
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service),
                                                         timeout=timeout)
        except grpc.RpcError as exc:
            return False, exc.code().name
    return reply.status == SERVING, health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def test_a_token_worker_answers_kubelet_on_the_probe_port_only_with_health():
    server = serve_policy_file(POLICIES / 'worker_stuck.py', 'stuck', token='s3cret', probe_port=0, warm=True,
                               hang_load=30.0, isolation='none')   # releases the instance's load in the worker
    try:
        assert server.probe_port not in (None, 0, server.port)
        # the main port: what kubelet got before, UNAUTHENTICATED
        assert kubelet_probe(server.port) == (False, 'UNAUTHENTICATED')
        # the probe port: '' is SERVING at once; the deployment is NOT_SERVING while its load hangs, and so is
        # any other name: without the token a name is the worker's readiness, never looked up ...
        assert kubelet_probe(server.probe_port) == (True, 'SERVING')
        assert kubelet_probe(server.probe_port, 'stuck') == (False, 'NOT_SERVING')
        assert kubelet_probe(server.probe_port, 'nope') == (False, 'NOT_SERVING')
        _release_loads(server)
        wait_for(lambda: kubelet_probe(server.probe_port, 'stuck')[0], timeout=10,
                 what='the deployment to turn SERVING on the probe port once loaded')
        assert kubelet_probe(server.probe_port, 'nope') == (True, 'SERVING')
        # ... and nothing else is served there: no policy call, token or not
        with channel(server.probe_port) as ch:
            with pytest.raises(grpc.RpcError) as info:
                handshake(pb_grpc.PolicyServiceStub(ch), 'stuck', metadata=[('authorization', 'Bearer s3cret')])
            assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
        # the main port still wants the token for everything, health included; with it, each deployment's own
        with channel(server.port) as ch:
            md = [('authorization', 'Bearer s3cret')]
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service='stuck'),
                                                         metadata=md, timeout=5)
            assert reply.status == SERVING
            with pytest.raises(grpc.RpcError) as info:
                health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service='nope'), metadata=md,
                                                     timeout=5)
            assert info.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        _release_loads(server)
        server.stop()
    # stopped: the probe port is gone with the worker
    assert not kubelet_probe(server.probe_port)[0]


def _release_loads(server) -> None:
    """Let every worker_stuck instance's hanging load() return."""
    for runtime in server.runtimes.values():
        for instance in getattr(runtime.definition.cls, 'instances', ()):
            instance.release.set()


def test_a_tls_worker_answers_kubelet_in_plaintext_on_the_probe_port(tmp_path):
    cert, key = _self_signed(tmp_path)
    with serve_policy_file(POLICIES / 'fast.py', 'fast', tls=(cert, key), token='t', probe_port=0,
                           warm=True) as server:
        assert not kubelet_probe(server.port)[0]              # TLS: a plaintext probe cannot even talk to it
        wait_for(lambda: kubelet_probe(server.probe_port, 'fast')[0], timeout=10, what='fast to be SERVING')
        assert kubelet_probe(server.probe_port) == (True, 'SERVING')
        creds = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
        with grpc.secure_channel(f'localhost:{server.probe_port}', creds) as ch:   # plaintext only
            with pytest.raises(grpc.RpcError):
                health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=2)


def _container(manifest: str) -> dict:
    workload = next(d for d in yaml.safe_load_all((DEPLOY / manifest).read_text())
                    if d and d['kind'] in ('Deployment', 'StatefulSet'))
    container, = workload['spec']['template']['spec']['containers']
    return container


def _run_manifest_args(processes, args: list[str], tmp_path: Path, tls: tuple | None) -> subprocess.Popen:
    """Start ``seq serve`` with a manifest container's ``args`` on loopback: ports 0, the token file in tmp."""
    token = tmp_path / 'token'
    token.write_text('kube-secret\n')
    argv = list(args)
    for flag, value in (('--host', '127.0.0.1'), ('--port', '0'), ('--metrics-port', '0'), ('--probe-port', '0'),
                        ('--token-file', str(token))):
        argv[argv.index(flag) + 1] = value
    if tls is not None:
        argv += ['--tls-cert', str(tls[0]), '--tls-key', str(tls[1])]
    assert argv[0] == 'seq'
    return processes.spawn([sys.executable, '-m', 'sequence_ai_ros.cli', *argv[1:]])


def _printed_ports(proc: subprocess.Popen, timeout: float = 60.0) -> dict[str, int]:
    """Read ``seq serve``'s stdout until its ``probe on`` line; return {'serving': port, 'probe': port}."""
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    ports: dict[str, int] = {}
    deadline = time.monotonic() + timeout
    while 'probe' not in ports:
        try:
            line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            pytest.fail(f'seq serve printed no probe port within {timeout} s (exit {proc.poll()})')
        for key in ('serving', 'probe'):
            match = re.match(rf'^{key} (?:.* )?on \S+:(\d+)', line)
            if match:
                ports[key] = int(match.group(1))
    return ports


@pytest.mark.parametrize('tls', [False, True], ids=['token', 'token+tls'])
@pytest.mark.parametrize('manifest', ['worker.yaml', 'worker-statefulset.yaml'])
def test_the_manifests_probes_pass_against_the_worker_they_start(manifest, tls, processes, seq_home, tmp_path):
    container = _container(manifest)
    args = container['args']
    deployment = args[2]
    assert '--token-file' in args                          # the manifests run a worker with a token
    assert seq_main(['deploy', str(POLICIES / 'fast.py'), '--name', deployment]) == 0
    proc = _run_manifest_args(processes, args, tmp_path, _self_signed(tmp_path) if tls else None)
    ports = _printed_ports(proc)
    manifest_probe_port = int(args[args.index('--probe-port') + 1])
    probes = {kind: container[kind]['grpc'] for kind in ('startupProbe', 'readinessProbe', 'livenessProbe')}
    for kind, probe in probes.items():
        assert probe['port'] == manifest_probe_port, (kind, probe)   # every probe asks the probe port
    # the main port turns kubelet away (the bug the probe port fixes) ...
    assert not kubelet_probe(ports['serving'], probes['readinessProbe'].get('service', ''))[0]
    # ... the probe port passes startup, then readiness and liveness, as kubelet runs them
    startup = probes['startupProbe']
    wait_for(lambda: kubelet_probe(ports['probe'], startup.get('service', ''))[0], timeout=30,
             what=f'the startup probe {startup} to pass')
    for kind in ('readinessProbe', 'livenessProbe'):
        assert kubelet_probe(ports['probe'], probes[kind].get('service', '')) == (True, 'SERVING'), kind
    proc.terminate()
    assert proc.wait(timeout=20) == 0
