"""Break-it: the worker's health service, on the tokenless probe port and on the main port.

- 300 ``Health.Watch`` streams with 1 MB service names on the probe port (the issue's flood: a worker went from
  70 to 1,337 MB and held it) leave the worker process within +100 MB of its RSS before, each refused, while a
  robot runs an episode through the real client;
- without the token, a deployment's name cannot be told from any other name: the probe port, and a main-port
  caller let in by ``--anonymous-streams``, answer every name with the worker's readiness; ``List`` is
  UNIMPLEMENTED; with the token the main port still answers each deployment's own health;
- an oversize request is refused by the transport, a name over the bound is INVALID_ARGUMENT;
- a Watch stream that has nothing new to say ends after the idle limit, and Watch streams past the cap are
  RESOURCE_EXHAUSTED while Check still answers.

A real worker process (RSS of that process, via psutil) for the flood; in-process workers, over real gRPC, for
the answers. Waits are bounded generously (a loaded 2-core CI machine), never timed.
"""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from test_worker_support import POLICIES, wait_for

from sequence_ai_ros.client import connect
from sequence_ai_ros.protocol import PROTOCOL_VERSION
from sequence_ai_ros.protocol import sequence_ai_pb2 as pb
from sequence_ai_ros.protocol import sequence_ai_pb2_grpc as pb_grpc
from sequence_ai_ros.protocol.types import Observation
from sequence_ai_ros.worker import health_service, probe, serve_policy_file

FAST = POLICIES / 'fast.py'
REPO = Path(__file__).resolve().parents[2]
TOKEN = 's3cret'
AUTH = [('authorization', f'Bearer {TOKEN}')]
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
#: The issue's flood: streams and the size of each one's service name.
FLOOD_STREAMS = 300
NAME_BYTES = 1 << 20
#: The most the flood may leave the worker's RSS above what it was before (bytes): the issue's +100 MB.
RSS_MARGIN = 100 << 20


def _check(port: int, service: str = '', metadata=None) -> str:
    """One Check on ``127.0.0.1:port``: the status's name, or the gRPC error code's name."""
    with grpc.insecure_channel(f'127.0.0.1:{port}') as ch:
        try:
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service),
                                                         metadata=metadata, timeout=10)
        except grpc.RpcError as exc:
            return exc.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def _first_watch(port: int, service: str, metadata=None) -> str:
    """Open a Watch and return the name of its first status (or the error code's name), then cancel it."""
    with grpc.insecure_channel(f'127.0.0.1:{port}') as ch:
        call = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(service=service),
                                                    metadata=metadata, timeout=10)
        try:
            return health_pb2.HealthCheckResponse.ServingStatus.Name(next(call).status)
        except grpc.RpcError as exc:
            return exc.code().name
        finally:
            call.cancel()


def _serve_process(tmp_path: Path) -> tuple[subprocess.Popen, int, int]:
    """``seq serve fast.py`` with a token and a probe port, in a process of its own; return it and both ports."""
    token = tmp_path / 'token'
    token.write_text(TOKEN + '\n')
    proc = subprocess.Popen([sys.executable, '-m', 'sequence_ai_ros.cli', 'serve', str(FAST), '--port', '0',
                             '--probe-port', '0', '--token-file', str(token), '--warm'],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=open(tmp_path / 'worker.log', 'w'), text=True)
    ports: dict[str, int] = {}
    while 'probe' not in ports:
        line = proc.stdout.readline()
        assert line, (proc.poll(), (tmp_path / 'worker.log').read_text())
        for key in ('serving', 'probe'):
            match = re.match(rf'^{key} (?:.* )?on \S+:(\d+)', line)
            if match:
                ports[key] = int(match.group(1))
    return proc, ports['serving'], ports['probe']


def _robot_episode(port: int, actions: int = 20) -> int:
    """A robot's episode through the real client (token, connect, run); return the actions it executed."""
    obs = Observation(state=np.zeros(26, np.float32), state_names=tuple(f'j{k}' for k in range(26)))
    done: list[object] = []
    with connect('fast', endpoint=f'127.0.0.1:{port}', token=TOKEN, timeout=30) as policy:
        policy.wait_until_ready(timeout=60)
        out = policy.run(lambda: obs, done.append, max_actions=actions, max_seconds=60)
    assert out.actions == len(done) > 0, out
    return out.actions


def _watch_flood(port: int, streams: int, name_bytes: int, connections: int = 10) -> dict[str, int]:
    """Open ``streams`` Watch calls with ``name_bytes``-byte names over ``connections`` connections; their codes."""
    codes: dict[str, int] = {}
    lock = threading.Lock()
    name = 'x' * name_bytes

    def one_connection(count: int) -> None:
        options = [('grpc.use_local_subchannel_pool', 1), ('grpc.max_send_message_length', 4 * name_bytes)]
        with grpc.insecure_channel(f'127.0.0.1:{port}', options=options) as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            calls = [stub.Watch(health_pb2.HealthCheckRequest(service=name), timeout=60) for _ in range(count)]
            for call in calls:
                try:
                    for _ in call:
                        pass
                    code = 'OK'
                except grpc.RpcError as exc:
                    code = exc.code().name
                with lock:
                    codes[code] = codes.get(code, 0) + 1

    threads = [threading.Thread(target=one_connection, args=(streams // connections,)) for _ in range(connections)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
        assert not thread.is_alive(), 'a flood connection did not finish within 120 s'
    return codes


@pytest.mark.slow
def test_300_watch_streams_with_1mb_names_leave_the_worker_within_100mb_while_a_robot_is_served(tmp_path):
    proc, port, probe_port = _serve_process(tmp_path)
    try:
        worker = psutil.Process(proc.pid)
        wait_for(lambda: _check(probe_port, 'fast') == 'SERVING', timeout=60, what='the worker ready')
        _robot_episode(port)                            # warm the serving path before the first measure
        _watch_flood(probe_port, 30, NAME_BYTES)         # ... and the refusal path
        before = worker.memory_info().rss
        served: list[int] = []
        errors: list[BaseException] = []

        def robot() -> None:
            try:
                while not stop.is_set() or not served:
                    served.append(_robot_episode(port))
            except BaseException as exc:  # noqa: BLE001 - reported by the test thread
                errors.append(exc)

        stop = threading.Event()
        robot_thread = threading.Thread(target=robot)
        robot_thread.start()
        peak = before
        flood = threading.Thread(target=lambda: codes.update(_watch_flood(probe_port, FLOOD_STREAMS, NAME_BYTES)))
        codes: dict[str, int] = {}
        flood.start()
        while flood.is_alive():
            peak = max(peak, worker.memory_info().rss)
            flood.join(timeout=0.05)
        stop.set()
        robot_thread.join(timeout=120)
        assert not robot_thread.is_alive() and not errors, errors
        # every stream refused by the transport (its request is over the probe port's message cap)
        assert codes == {'RESOURCE_EXHAUSTED': FLOOD_STREAMS}, codes
        assert served and all(n > 0 for n in served), served   # the robot ran whole episodes meanwhile
        time.sleep(2.0)
        after = worker.memory_info().rss
        assert after - before < RSS_MARGIN, f'{(after - before) / 2**20:.1f} MB kept (before {before / 2**20:.1f} MB)'
        assert peak - before < RSS_MARGIN, f'{(peak - before) / 2**20:.1f} MB at the peak'
        assert _check(probe_port, 'fast') == 'SERVING' and _check(probe_port) == 'SERVING'
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _release_loads(server) -> None:
    """Let every worker_stuck instance's hanging load() return."""
    for runtime in server.runtimes.values():
        for instance in getattr(runtime.definition.cls, 'instances', ()):
            instance.release.set()


def test_deployment_names_are_not_enumerable_without_the_token():
    server = serve_policy_file(POLICIES / 'worker_stuck.py', 'stuck', token=TOKEN, probe_port=0, warm=True,
                               hang_load=30.0, isolation='none', max_streams=4, anonymous_streams=1)
    try:
        ports = {'probe': (server.probe_port, None), 'anonymous': (server.port, None)}
        # loading: the deployment's name and any other answer alike, Check and Watch, on both tokenless paths
        for where, (port, md) in ports.items():
            assert _check(port, '', md) == 'SERVING', where
            answers = {name: (_check(port, name, md), _first_watch(port, name, md))
                       for name in ('stuck', 'nope', 'stuck2', 'x' * health_service.MAX_SERVICE_NAME_BYTES)}
            assert set(answers.values()) == {('NOT_SERVING', 'NOT_SERVING')}, (where, answers)
        # with the token, the main port tells each deployment's own health
        assert _check(server.port, 'stuck', AUTH) == 'NOT_SERVING'
        assert _check(server.port, 'nope', AUTH) == 'NOT_FOUND'
        assert _first_watch(server.port, 'nope', AUTH) == 'SERVICE_UNKNOWN'
        assert _check(server.port, 'nope', [('authorization', 'Bearer wrong')]) == 'UNAUTHENTICATED'
        _release_loads(server)
        wait_for(lambda: _check(server.probe_port, 'stuck') == 'SERVING', timeout=20, what='stuck loaded')
        for where, (port, md) in ports.items():
            answers = {name: (_check(port, name, md), _first_watch(port, name, md)) for name in ('stuck', 'nope')}
            assert set(answers.values()) == {('SERVING', 'SERVING')}, (where, answers)
        assert _check(server.port, 'stuck', AUTH) == 'SERVING' and _check(server.port, 'nope', AUTH) == 'NOT_FOUND'
        # nor does an unknown name's refusal on the policy service list them (Ready, Handshake, Episode)
        with grpc.insecure_channel(f'127.0.0.1:{server.port}') as ch:
            stub = pb_grpc.PolicyServiceStub(ch)
            for md, told in ((None, False), (AUTH, True)):
                with pytest.raises(grpc.RpcError) as info:
                    stub.Ready(pb.ReadyRequest(deployment='nope'), metadata=md, timeout=10)
                assert info.value.code() == grpc.StatusCode.NOT_FOUND
                assert ("'stuck'" in info.value.details()) is told, info.value.details()
                with pytest.raises(grpc.RpcError) as info:
                    stub.Handshake(pb.HandshakeRequest(protocol_version=PROTOCOL_VERSION, deployment='nope'),
                                   metadata=md, timeout=10)
                assert info.value.code() == grpc.StatusCode.NOT_FOUND
                assert ("'stuck'" in info.value.details()) is told, info.value.details()
        # List would name every service: not served, token or not
        for port, md in ((server.probe_port, None), (server.port, None), (server.port, AUTH)):
            with grpc.insecure_channel(f'127.0.0.1:{port}') as ch:
                with pytest.raises(grpc.RpcError) as info:
                    health_pb2_grpc.HealthStub(ch).List(health_pb2.HealthListRequest(), metadata=md, timeout=10)
                assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        _release_loads(server)
        server.stop(grace=0.5)


def test_oversize_requests_and_names_are_refused_before_any_lookup():
    with serve_policy_file(FAST, 'fast', token=TOKEN, probe_port=0, warm=True) as server:
        wait_for(lambda: _check(server.probe_port, 'fast') == 'SERVING', timeout=30, what='fast ready')
        over = 'x' * (health_service.MAX_SERVICE_NAME_BYTES + 1)
        # a name over the bound: INVALID_ARGUMENT on either port, whoever asks (no deployment is that long)
        for port, md in ((server.probe_port, None), (server.port, AUTH)):
            assert _check(port, over, md) == 'INVALID_ARGUMENT'
            assert _first_watch(port, over, md) == 'INVALID_ARGUMENT'
            assert _check(port, 'é' * (health_service.MAX_SERVICE_NAME_BYTES // 2 + 1), md) == 'INVALID_ARGUMENT'
        # a request over the probe port's message cap never reaches the servicer
        big = 'x' * (probe.MAX_MESSAGE_BYTES + 1)
        assert _check(server.probe_port, big) == 'RESOURCE_EXHAUSTED'
        assert _first_watch(server.probe_port, big) == 'RESOURCE_EXHAUSTED'
        # nor do headers over its metadata cap
        huge = [('x-filler', 'y' * (2 * probe.MAX_METADATA_BYTES))]
        assert _check(server.probe_port, '', huge) != 'SERVING'
        # the port still answers
        assert _check(server.probe_port) == 'SERVING' and _check(server.probe_port, 'fast') == 'SERVING'


def test_an_idle_watch_ends_and_watches_past_the_cap_are_refused_while_check_answers(monkeypatch):
    monkeypatch.setattr(health_service, 'WATCH_IDLE_S', 1.0)
    monkeypatch.setattr(health_service, 'MAX_WATCHES', 3)
    with serve_policy_file(FAST, 'fast', probe_port=0, warm=True) as server:
        wait_for(lambda: _check(server.probe_port, 'fast') == 'SERVING', timeout=30, what='fast ready')
        for port in (server.probe_port, server.port):
            with grpc.insecure_channel(f'127.0.0.1:{port}') as ch:
                stub = health_pb2_grpc.HealthStub(ch)
                # nothing changes: one status, then the stream ends with OK after the idle limit
                call = stub.Watch(health_pb2.HealthCheckRequest(service='fast'), timeout=30)
                assert [r.status for r in call] == [SERVING]
                assert call.code() == grpc.StatusCode.OK
                # the cap: three open, the fourth refused, Check answered all along
                open_calls = [stub.Watch(health_pb2.HealthCheckRequest(service=''), timeout=30) for _ in range(3)]
                assert [next(c).status for c in open_calls] == [SERVING] * 3
                extra = stub.Watch(health_pb2.HealthCheckRequest(service=''), timeout=30)
                with pytest.raises(grpc.RpcError) as info:
                    next(extra)
                assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert stub.Check(health_pb2.HealthCheckRequest(service='fast'), timeout=10).status == SERVING
                # the held ones end at their idle limit too, and free their slots
                assert all(list(c) == [] and c.code() == grpc.StatusCode.OK for c in open_calls)
                again = stub.Watch(health_pb2.HealthCheckRequest(service=''), timeout=30)
                assert next(again).status == SERVING
                again.cancel()


def test_a_watch_follows_the_drain_and_the_stop():
    with serve_policy_file(FAST, 'fast', probe_port=0, warm=True) as server:
        wait_for(lambda: _check(server.probe_port, 'fast') == 'SERVING', timeout=30, what='fast ready')
        with grpc.insecure_channel(f'127.0.0.1:{server.probe_port}') as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            ready = stub.Watch(health_pb2.HealthCheckRequest(service='fast'), timeout=30)
            live = stub.Watch(health_pb2.HealthCheckRequest(service=''), timeout=30)
            assert next(ready).status == SERVING and next(live).status == SERVING
            assert server.drain(timeout_s=0.5) == 0
            assert next(ready).status == NOT_SERVING       # readiness follows the drain; liveness does not
            assert _check(server.probe_port) == 'SERVING'
            server.stop(grace=0.5)
            assert next(live).status == NOT_SERVING        # graceful shutdown, before the port closes
