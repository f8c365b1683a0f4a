"""Break-it: a real robot gets a stream under each flood that used to lock robots out.

- idle streams from 5 addresses (each up to its per-client cap, all slots taken), half of them sending empty
  keep-alives: they are closed after the idle limit, and the robot gets a stream within a bounded wait;
- 1,100 silent TCP connections against a worker started with a soft limit of 1,024 descriptors: the worker
  raises its limit and closes connections that never start HTTP/2, and the robot is served at once;
- a local caller forging x-forwarded-for on the TCP port: it is one client (127.0.0.1) under the per-client
  cap, and the robot coming through the proxy socket gets a stream.

Counts are small where the mechanism is the same (the slots of a worker with a small ``max_streams``); the
TCP flood is the issue's 1,100. Waits are bounded generously (a loaded 2-core CI machine), never timed.
"""

from __future__ import annotations

import re
import resource
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from test_worker_support import POLICIES, Stream, channel, state_request, wait_for, wait_ready

from sequence_ai_ros.client import connect
from sequence_ai_ros.protocol import sequence_ai_pb2 as pb
from sequence_ai_ros.protocol import sequence_ai_pb2_grpc as pb_grpc
from sequence_ai_ros.protocol.types import Observation
from sequence_ai_ros.worker import serve_policy_file

FAST = POLICIES / 'fast.py'
REPO = Path(__file__).resolve().parents[2]
#: A robot must get its stream within this long (s): the idle limit plus a start-up generous under load.
ROBOT_WAIT_S = 45.0


def robot_gets_a_stream(stub, metadata=(), episode_id: str = 'robot', dim: int = 2) -> float:
    """Retry (as a robot's client does on OVERLOADED) until an episode starts and a chunk comes; return the wait (s)."""
    start = time.monotonic()
    attempt = 0
    while time.monotonic() - start < ROBOT_WAIT_S:
        attempt += 1
        robot = Stream(stub, 'fast', f'{episode_id}-{attempt}', metadata=list(metadata))
        reply = robot.start()
        if reply is not None and reply.HasField('started'):
            chunk = robot.ask(state_request(1, [0.5] * dim, [f'j{k}' for k in range(dim)]))
            assert chunk.HasField('chunk'), chunk
            assert robot.end().HasField('ended')
            return time.monotonic() - start
        # refused: a typed refusal in the stream (Error.refusal, OVERLOADED), then the robot closes its side
        assert reply is not None and reply.error.refusal and reply.error.code == pb.OVERLOADED, (reply, robot.error)
        robot.close()
        time.sleep(0.2)
    raise AssertionError(f'no stream for the robot within {ROBOT_WAIT_S} s')


def _idle(stub, eid: str, metadata, keepalive: bool) -> Stream | None:
    stream = Stream(stub, 'fast', eid, metadata=list(metadata))
    reply = stream.start()
    if reply is None or not reply.HasField('started'):
        return None
    if keepalive:    # an empty EpisodeRequest every 0.3 s: answered with an error, and no longer activity
        def beat() -> None:
            while stream.error is None and not stream.call.done():
                stream.send()
                time.sleep(0.3)
        threading.Thread(target=beat, daemon=True).start()
    return stream


def test_idle_streams_from_five_addresses_with_keepalives_free_their_slots(tmp_path):
    # 5 addresses x 4 streams (their per-client cap) = every one of the 20 slots, as 256 = 4 x 64 in the field
    with serve_policy_file(FAST, 'fast', dim=2, max_streams=20, max_streams_per_client=4, idle_timeout_s=2.0,
                           proxy_socket=str(tmp_path / 'proxy.sock')) as server, \
            grpc.insecure_channel(f'unix:{tmp_path / "proxy.sock"}') as ch:
        stub = pb_grpc.PolicyServiceStub(ch)
        assert wait_ready(stub, 'fast').ready
        held = [_idle(stub, f'idle-{a}-{i}', [('x-forwarded-for', f'203.0.113.{a}')], keepalive=i % 2 == 0)
                for a in range(1, 6) for i in range(4)]
        assert all(s is not None for s in held) and server.servicer.open_streams() == 20
        waited = robot_gets_a_stream(stub, [('x-forwarded-for', '198.51.100.7')])
        assert waited >= 1.0          # it waited for the idle limit (2 s after the idle streams' last start)
        # every idle stream was told why it was closed, keep-alive or not
        for stream in held:
            replies = []
            while (reply := stream.recv(timeout=15)) is not None:
                replies.append(reply)
            texts = [r.error.message for r in replies if r.HasField('error')]
            assert any('idle_timeout' in t for t in texts) and replies[-1].HasField('ended'), texts[-2:]
        wait_for(lambda: server.servicer.open_streams() == 0, 10, 'the idle streams gone')


def test_a_forged_forwarded_address_on_the_tcp_port_is_one_local_client(tmp_path):
    with serve_policy_file(FAST, 'fast', dim=2, max_streams=8, max_streams_per_client=4,
                           proxy_socket=str(tmp_path / 'proxy.sock')) as server, channel(server.port) as tcp, \
            grpc.insecure_channel(f'unix:{tmp_path / "proxy.sock"}') as proxied:
        stub = pb_grpc.PolicyServiceStub(tcp)
        assert wait_ready(stub, 'fast').ready
        forged = [Stream(stub, 'fast', f'forged{i}', metadata=[('x-forwarded-for', f'10.9.8.{i}')]) for i in range(8)]
        replies = [(s, s.start()) for s in forged]
        started = [s for s, r in replies if r is not None and r.HasField('started')]
        assert len(started) == 4                      # one client: 127.0.0.1, capped at 4
        refused = [r for s, r in replies if s not in started]   # typed refusals in the stream (Error.refusal)
        assert len(refused) == 4 and all(r is not None and r.error.refusal == 'per_client' for r in refused), refused
        assert all('127.0.0.1' in r.error.message and 'max_streams_per_client' in r.error.message for r in refused)
        for s in forged:
            if s not in started:
                s.close()
        robot_gets_a_stream(pb_grpc.PolicyServiceStub(proxied), [('x-forwarded-for', '198.51.100.7')])
        for s in started:
            s.end()


def _serve_with_1024_descriptors(tmp_path: Path) -> tuple[subprocess.Popen, int]:
    code = ('import resource, sys\n'
            'soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n'
            'resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))\n'
            f'sys.path.insert(0, {str(REPO)!r})\n'
            'from sequence_ai_ros.cli import main\n'
            'sys.exit(main())\n')
    proc = subprocess.Popen([sys.executable, '-c', code, 'serve', str(FAST), '--port', '0', '--warm'],
                            stdout=subprocess.PIPE, stderr=open(tmp_path / 'worker.log', 'w'), text=True)
    line = proc.stdout.readline()
    match = re.search(r'on 127\.0\.0\.1:(\d+)', line)
    assert match, (line, (tmp_path / 'worker.log').read_text())
    return proc, int(match.group(1))


@pytest.mark.slow
def test_1100_silent_tcp_connections_do_not_lock_a_robot_out(tmp_path):
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < 1100 + 200:
        pytest.skip(f'the hard open-files limit ({hard}) is below the flood')
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))    # this test process holds the 1,100 sockets
    proc, port = _serve_with_1024_descriptors(tmp_path)
    silent: list[socket.socket] = []
    try:
        for _ in range(1100):
            silent.append(socket.create_connection(('127.0.0.1', port), timeout=10))
        with channel(port) as ch:
            stub = pb_grpc.PolicyServiceStub(ch)
            assert wait_ready(stub, 'fast', timeout=30).ready
            robot_gets_a_stream(stub, dim=26)
        # the worker closes every connection that never started HTTP/2 (its handshake deadline)
        for s in silent:
            s.settimeout(30)
        closed = sum(1 for s in silent if _closed_by_peer(s))
        assert closed == 1100
    finally:
        for s in silent:
            s.close()
        proc.terminate()
        proc.wait(timeout=15)


def _closed_by_peer(s: socket.socket) -> bool:
    """Read what the worker sends (its HTTP/2 settings) until it closes the connection: True; a timeout: False."""
    try:
        while s.recv(4096):
            pass
        return True
    except TimeoutError:
        return False
    except OSError:
        return True


def test_the_worker_raises_its_open_files_limit_at_start():
    from sequence_ai_ros.worker.server import raise_open_files_limit

    soft = raise_open_files_limit()
    assert soft == resource.getrlimit(resource.RLIMIT_NOFILE)[1] or resource.getrlimit(
        resource.RLIMIT_NOFILE)[1] == resource.RLIM_INFINITY


def test_connect_opens_a_new_stream_after_the_worker_closed_an_idle_one():
    with serve_policy_file(FAST, 'fast', dim=2, idle_timeout_s=1.0) as server:
        obs = Observation(state=np.array([0.5, -0.5], np.float32), state_names=('j0', 'j1'))
        with connect('fast', endpoint=f'127.0.0.1:{server.port}') as policy:
            policy.wait_until_ready(timeout=30)
            wait_for(lambda: policy.next_action(obs) is not None, 20, 'a first action')
            first = policy.episode_id if hasattr(policy, 'episode_id') else None
            time.sleep(2.5)                           # the robot pauses past the idle limit: the stream is closed
            wait_for(lambda: server.servicer.open_streams() == 0, 10, 'the idle stream closed')
            actions = [policy.next_action(obs) for _ in range(3)]   # no error: a new episode stream opens
            wait_for(lambda: policy.next_action(obs) is not None and server.servicer.open_streams() == 1, 20,
                     'a new stream')
            assert all(a is None or not isinstance(a, Exception) for a in actions)
            del first
