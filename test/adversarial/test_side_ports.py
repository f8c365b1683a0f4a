"""The HAProxy agent port under attack: answered without the token, a thread per idle connection."""

from __future__ import annotations

import shutil
import socket
import threading
import time
from pathlib import Path

import pytest
from test_worker_support import wait_for

from sequence_ai_ros.cli import main as seq_main
from sequence_ai_ros.worker import serve_policy_file

FAST = Path(__file__).resolve().parents[1] / 'policies' / 'fast.py'
ECHO = Path(__file__).resolve().parents[1] / 'policies' / 'replica_echo.py'


def _probe(port: int, send: bytes | None) -> str:
    with socket.create_connection(('127.0.0.1', port), timeout=10) as s:
        if send is not None:
            s.sendall(send)
        s.settimeout(10)
        try:
            return s.recv(64).decode().strip()
        except (TimeoutError, ConnectionError):
            return ''


@pytest.mark.slow
def test_the_agent_needs_the_token_and_idle_connections_cost_no_thread():
    server = serve_policy_file(FAST, 'fast', dim=3, host='127.0.0.1', port=0, agent_port=0, token='s3cret',
                               warm=True)
    try:
        port = server.agent.port
        assert wait_for(lambda: _probe(port, b's3cret\n') == 'up ready', timeout=30, what='the agent up')
        assert _probe(port, b's3cret') == 'up ready'             # HAProxy's agent-send, newline optional
        assert _probe(port, b'wrong!\n') == ''                    # nothing said to a probe without the token
        started = time.monotonic()
        assert _probe(port, None) == ''                           # silent: closed at the read deadline
        assert time.monotonic() - started < 10
        before = threading.active_count()
        idle = []
        try:
            for _ in range(1000):
                idle.append(socket.create_connection(('127.0.0.1', port), timeout=5))
            time.sleep(0.5)
            assert threading.active_count() <= before + 2, threading.active_count() - before
            assert wait_for(lambda: _probe(port, b's3cret\n') == 'up ready', timeout=30,
                            what='a probe under the flood')
        finally:
            for sock in idle:
                sock.close()
    finally:
        server.stop(grace=0.5)


HAPROXY = shutil.which('haproxy') or ('/usr/sbin/haproxy' if Path('/usr/sbin/haproxy').exists() else None)


def _agent_status(fleet) -> dict[str, str]:
    """HAProxy's view of each replica's agent (``show stat`` agent_status: L7OK when the agent answered)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(2.0)
        s.connect(str(fleet.stats_socket))
        s.sendall(b'show stat\n')
        data = b''
        while chunk := s.recv(65536):
            data += chunk
    lines = data.decode().splitlines()
    header = lines[0].lstrip('# ').split(',')
    rows = [dict(zip(header, line.split(','), strict=False)) for line in lines[1:]]
    return {r['svname']: r.get('agent_status', '') for r in rows if r.get('svname', '').startswith('replica')}


@pytest.mark.slow
@pytest.mark.skipif(HAPROXY is None, reason='HAProxy is not installed (as root: make haproxy)')
def test_a_fleet_with_a_token_probes_its_agents_with_it_on_the_real_haproxy(seq_home, tmp_path):
    from sequence_ai_ros.worker.fleet import Fleet

    token = tmp_path / 'token'
    token.write_text('fleet-s3cret\n')
    assert seq_main(['deploy', str(ECHO), '--name', 'replica_echo']) == 0
    with Fleet(['replica_echo'], 1, home=seq_home, serve_args=['--token-file', str(token)]) as fleet:
        replica = fleet.replicas[0]
        assert _probe(replica.agent_port, b'no token\n') == ''     # a local caller without it learns nothing
        assert fleet.agent_status(replica) == 'up ready'
        status = wait_for(lambda: _agent_status(fleet).get('replica1', '').startswith('L7OK') and _agent_status(fleet),
                          timeout=30, what="HAProxy's agent check to pass with the token")
        assert status['replica1'].startswith('L7OK'), status
