"""Sticky episodes on a real fleet on loopback: 3 ``seq serve`` replicas behind HAProxy, 12 robots.

Each robot is its own ``connect()`` (the real client) through HAProxy; the policy's actions are the pid of
the replica that served them, so every action tells where its request went. Capture is on, in the
fleet's shared $SEQ_HOME, and the export afterwards holds every episode exactly once.

Needs HAProxy (Debian's 2.6): ``make haproxy`` installs it as root; otherwise these tests skip and say so.
"""

from __future__ import annotations

import json
import shutil
import socket
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from test_worker_support import Stream, channel, state_request, wait_for

from sequence_ai_ros.cli import main as seq_main
from sequence_ai_ros.client import connect
from sequence_ai_ros.exceptions import SequenceAIError
from sequence_ai_ros.protocol import sequence_ai_pb2 as pb
from sequence_ai_ros.protocol import sequence_ai_pb2_grpc as pb_grpc
from sequence_ai_ros.protocol.types import Observation

POLICY = Path(__file__).resolve().parent / 'policies' / 'replica_echo.py'
ROBOTS = 12

if shutil.which('haproxy') is None and not Path('/usr/sbin/haproxy').exists():
    pytestmark = pytest.mark.skip(reason='HAProxy is not installed (as root: `make haproxy`, i.e. apt-get install '
                                         'haproxy); the fleet tests need a real load balancer')
else:
    from sequence_ai_ros.worker.fleet import Fleet


class Robot:
    """One robot: its own connect() to the balancer; ``drive`` runs one episode and records the pids."""

    def __init__(self, address: str, name: str) -> None:
        self.name = name
        self.policy = connect('replica_echo', endpoint=address, timeout=10.0)
        self.policy.wait_until_ready(timeout=30.0)

    def drive(self, episode_id: str, seconds: float) -> dict:
        pids: set[int] = set()
        held = []
        state = np.zeros(2, np.float32)

        def observe() -> Observation:
            return Observation(state=state, state_names=('a', 'b'))

        def act(action) -> None:
            if not action.hold:
                pids.add(int(round(float(action.values[0]))))

        try:
            outcome = self.policy.act('fleet test', observe, act, max_seconds=seconds, episode_id=episode_id,
                                      on_underrun=lambda: held.append(True))
            return {'pids': pids, 'outcome': outcome, 'error': None, 'held': bool(held)}
        except SequenceAIError as exc:
            return {'pids': pids, 'outcome': None, 'error': exc, 'held': bool(held)}

    def close(self) -> None:
        self.policy.close()


def drive_all(robots: list[Robot], episode: str, seconds: float, during=None) -> list[dict]:
    results: list[dict] = [{} for _ in robots]

    def run(k: int) -> None:
        results[k] = robots[k].drive(f'{robots[k].name}-{episode}', seconds)

    threads = [threading.Thread(target=run, args=(k,), name=f'robot{k}') for k in range(len(robots))]
    for t in threads:
        t.start()
    if during is not None:
        during()
    for t in threads:
        t.join(timeout=seconds + 60)
        assert not t.is_alive(), 'a robot did not finish'
    return results


@pytest.fixture
def fleet(seq_home: Path):
    assert seq_main(['deploy', str(POLICY), '--name', 'replica_echo']) == 0
    assert seq_main(['policy', 'capture', 'replica_echo', '--rate', '1']) == 0
    with Fleet(['replica_echo'], 3, home=seq_home, serve_args=['--idle-timeout', '30']) as f:
        yield f


@pytest.mark.slow
def test_episodes_stay_on_their_replica_and_survive_a_replica_loss(fleet, seq_home: Path, tmp_path: Path):
    pid_of = {r.process.pid: r.index for r in fleet.replicas}
    robots = [Robot(fleet.address, f'robot{k:02d}') for k in range(ROBOTS)]
    try:
        # 1. every request of an episode lands on one replica; the episodes spread over the replicas
        first = drive_all(robots, 'ep1', 1.5)
        for k, res in enumerate(first):
            assert res['error'] is None and res['outcome'].reason == 'timeout', res
            assert len(res['pids']) == 1 and res['pids'] <= set(pid_of), (k, res['pids'])
        home = {k: next(iter(res['pids'])) for k, res in enumerate(first)}
        assert len(set(home.values())) >= 2

        # 2. a reconnect with the same episode id lands on the same replica
        again = Robot(fleet.address, 'robot00')
        try:
            for k in (0, 5, 11):
                res = again.drive(f'robot{k:02d}-ep1', 1.5)
                assert res['error'] is None and res['pids'] == {home[k]}, (k, res)
        finally:
            again.close()

        # 3. killing one replica: only its robots hold and get a typed error; the others see 0 underruns
        victim_pid = max(set(home.values()), key=lambda p: list(home.values()).count(p))
        victim = pid_of[victim_pid]

        def kill_soon() -> None:
            threading.Event().wait(1.0)
            fleet.kill(victim)

        lost = drive_all(robots, 'ep2', 3.0, during=kill_soon)
        homes2 = {}
        for k, res in enumerate(lost):
            on_victim = res['pids'] == {victim_pid}
            homes2[k] = on_victim
            if on_victim:
                assert isinstance(res['error'], SequenceAIError) and res['held'], res
            else:
                assert res['error'] is None, res
                assert res['outcome'].reason == 'timeout' and res['outcome'].underruns == 0, res
        assert any(homes2.values()) and not all(homes2.values())

        # ... and their next episode lands on a survivor
        fleet.wait_balanced(30.0, up={r.index for r in fleet.replicas if r.index != victim})
        wait_for(lambda: fleet.balancer_state()[f'replica{victim}'][0].startswith('DOWN'), timeout=10,
                 what='the h2 liveness check to mark the killed replica DOWN')
        for k, was_lost in homes2.items():
            if was_lost:
                res = robots[k].drive(f'robot{k:02d}-ep3', 2.0)
                assert res['error'] is None and len(res['pids']) == 1 and victim_pid not in res['pids'], res

        # 4. labels reach the episode's store whichever replica the call lands on
        for k in range(ROBOTS):
            assert robots[k].policy.label(True, notes=f'robot {k}', episode_id=f'robot{k:02d}-ep1')
    finally:
        for r in robots:
            r.close()
    fleet.stop()

    # 5. the fleet's field data exports as one dataset: every episode once, none lost
    out = tmp_path / 'export'
    assert seq_main(['policy', 'data', 'export', 'replica_echo', '--out', str(out), '--format', 'jsonl']) == 0
    episodes = [json.loads(line) for line in (out / 'episodes.jsonl').read_text().splitlines() if line.strip()]
    ids = [e['episode_id'] for e in episodes]
    expected = ({f'robot{k:02d}-ep1' for k in range(ROBOTS)} |
                {f'robot{k:02d}-ep2' for k, was_lost in homes2.items() if not was_lost} |
                {f'robot{k:02d}-ep3' for k, was_lost in homes2.items() if was_lost})
    assert len(ids) == len(set(ids)) and set(ids) == expected  # the victims' ep2 died with their replica
    # usage: the three replicas added into the one shared database (a killed replica loses only what it had not
    # flushed: its running episodes)
    from sequence_ai_ros.home import usage_file
    from sequence_ai_ros.worker.usage import read_usage

    usage = read_usage(usage_file(seq_home))['replica_echo']
    assert usage.sessions >= ROBOTS and usage.episodes >= len(ids)
    assert usage.requests >= sum(e['requests'] for e in episodes)
    labels = {e['episode_id']: e['label'] for e in episodes if e['episode_id'].endswith('-ep1')}
    assert labels == {f'robot{k:02d}-ep1': {'success': True, 'notes': f'robot {k}'} for k in range(ROBOTS)}


@pytest.mark.slow
def test_a_not_serving_replica_gets_no_new_episodes(seq_home: Path):
    assert seq_main(['deploy', str(POLICY), '--name', 'replica_echo']) == 0
    # in the worker (--isolation none), a wedged inference marks the deployment failed for good (a deployment
    # process would be restarted instead: test/adversarial/test_isolation.py)
    with Fleet(['replica_echo'], 3, home=seq_home, serve_args=['--inference-timeout', '0.5', '--isolation',
                                                              'none']) as fleet:
        sick = fleet.replicas[1]
        # push replica 2 past its inference deadline, straight to its port: its deployment is marked failed
        with channel(sick.port) as ch:
            stream = Stream(pb_grpc.PolicyServiceStub(ch), 'replica_echo', 'wedge')
            assert stream.start().HasField('started')
            reply = stream.ask(state_request(1, [0.0, 0.0], ['a', 'b'], params={'sleep': '3'}))
            assert reply.error.code == pb.POLICY_EXCEPTION and 'exceeded' in reply.error.message
            stream.cancel()
        assert fleet.agent_status(sick) == 'drain'  # liveness still passes: only the agent knows
        wait_for(lambda: fleet.balancer_state()['replica2'][0].startswith('DRAIN'), timeout=10,
                 what='HAProxy to drain the NOT_SERVING replica')
        robots = [Robot(fleet.address, f'robot{k:02d}') for k in range(ROBOTS)]
        try:
            results = drive_all(robots, 'ep1', 1.5)
        finally:
            for r in robots:
                r.close()
        served = set().union(*(res['pids'] for res in results))
        assert all(res['error'] is None for res in results), results
        assert sick.process.pid not in served and len(served) == 2


def test_seq_fleet_starts_replicas_and_haproxy_in_one_command_and_stops_cleanly(processes, seq_home: Path):
    import re
    import signal
    import sys
    import urllib.request

    from sequence_ai_ros.protocol import PROTOCOL_VERSION
    from sequence_ai_ros.worker.fleet import free_port

    ports = []
    while len(ports) < 6:   # distinct free ports, pinned: replicas, agents, metrics
        if (p := free_port()) not in ports:
            ports.append(p)
    proc = processes.spawn([sys.executable, '-m', 'sequence_ai_ros.cli', 'fleet', str(POLICY), '--replicas', '2',
                            '--port', '0', '--replica-ports', f'{ports[0]},{ports[1]}',
                            '--agent-ports', f'{ports[2]},{ports[3]}', '--metrics-ports', f'{ports[4]},{ports[5]}'])
    lines = [proc.stdout.readline() for _ in range(3)]
    match = re.search(r'on 127\.0\.0\.1:(\d+) \(config and logs in (\S+)\)', lines[0])
    assert match, lines + [proc.stderr.read() if proc.poll() is not None else '']
    run_dir = Path(match.group(2))
    assert run_dir.is_dir() and run_dir.name.startswith('seq-fleet-') and (run_dir / 'haproxy.cfg').is_file()
    replicas = [tuple(int(x) for x in re.search(r'gRPC 127\.0\.0\.1:(\d+), agent (\d+), metrics '
                                                r'http://127\.0\.0\.1:(\d+)/metrics', line).groups())
                for line in lines[1:]]
    assert replicas == [(ports[0], ports[2], ports[4]), (ports[1], ports[3], ports[5])]
    for _, agent, metrics in replicas:   # each pinned port answers what it was pinned for
        with socket.create_connection(('127.0.0.1', agent), timeout=5) as s:
            assert s.recv(64).decode().strip() == 'up ready'
        with urllib.request.urlopen(f'http://127.0.0.1:{metrics}/metrics', timeout=5) as page:
            assert b'seq_open_streams' in page.read()
    with channel(int(match.group(1))) as ch:
        stub = pb_grpc.PolicyServiceStub(ch)
        reply = stub.Handshake(pb.HandshakeRequest(deployment='replica_echo', protocol_version=PROTOCOL_VERSION),
                               timeout=10)
        assert reply.contract.deployment == 'replica_echo'
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=30) == 0
    out = proc.stdout.read()
    assert 'stopping the fleet' in out and f'stopped; removed {run_dir}' in out
    assert not run_dir.exists()   # a clean stop leaves no /tmp/seq-fleet-* behind
    for port in ports:  # every replica is gone with it
        with pytest.raises(OSError):
            socket.create_connection(('127.0.0.1', port), timeout=1).close()


def test_a_fleet_keeps_its_logs_when_a_replica_crashed_and_refuses_overlapping_pins(seq_home: Path, capsys):
    import os
    import signal

    from sequence_ai_ros.exceptions import ConfigError

    with pytest.raises(ConfigError, match=r'overlap: \[50600\] used twice'):
        Fleet(['replica_echo'], 2, replica_ports=[50600], agent_ports=[50610, 50600])
    with pytest.raises(ConfigError, match='3 ports for 2 replicas'):
        Fleet(['replica_echo'], 2, metrics_ports=[1, 2, 3])
    # TLS replicas behind the shipped plaintext template would never come UP: refused before anything starts
    started = time.monotonic()
    with pytest.raises(ConfigError, match='--tls-cert in the replicas.*makes the replicas serve TLS.*plaintext h2'):
        Fleet(['replica_echo'], 2, serve_args=['--tls-cert', 'c.pem', '--tls-key', 'k.pem'])
    assert time.monotonic() - started < 5, 'refused up front, not after ready_timeout_s'
    capsys.readouterr()
    tls = '--tls-cert c.pem --tls-key k.pem'
    assert seq_main(['fleet', 'replica_echo', '--replicas', '2', '--serve-options', tls]) == 2
    err = capsys.readouterr().err
    assert 'seq fleet --serve-options' in err and 'serve_args --tls-cert' not in err, err   # the option the user gave
    assert seq_main(['deploy', str(POLICY), '--name', 'replica_echo']) == 0
    fleet = Fleet(['replica_echo'], 1, home=seq_home)
    try:
        os.killpg(fleet.replicas[0].process.pid, signal.SIGKILL)   # a crash, not fleet.kill()
        wait_for(lambda: fleet.reap() == [1], what='the crash to be seen')
        assert fleet.stop() is False and fleet.kept == fleet.run_dir
        assert (fleet.kept / 'replica1.log').is_file()   # its logs are there to read
    finally:
        fleet.stop()
        shutil.rmtree(fleet.run_dir, ignore_errors=True)


def test_the_balancer_caps_connections_per_source_address(seq_home: Path):
    import grpc

    from sequence_ai_ros.protocol import PROTOCOL_VERSION

    assert seq_main(['deploy', str(POLICY), '--name', 'replica_echo']) == 0
    with Fleet(['replica_echo'], 1, home=seq_home, conn_per_client=4) as fleet:
        def handshake(ch: grpc.Channel) -> None:
            pb_grpc.PolicyServiceStub(ch).Handshake(
                pb.HandshakeRequest(deployment='replica_echo', protocol_version=PROTOCOL_VERSION), timeout=5)

        held = [grpc.insecure_channel(fleet.address, options=[('grpc.use_local_subchannel_pool', 1)])
                for _ in range(4)]
        try:
            for ch in held:  # each channel is one connection from 127.0.0.1
                handshake(ch)
            extra = grpc.insecure_channel(fleet.address, options=[('grpc.use_local_subchannel_pool', 1)])
            with pytest.raises(grpc.RpcError) as info:  # the stick-table's sc0_conn_cur rejects the fifth
                handshake(extra)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            extra.close()
            held.pop().close()
            wait_for(lambda: _answers(fleet.address, handshake), timeout=10, what='a slot after one closed')
        finally:
            for ch in held:
                ch.close()


def _answers(address: str, handshake) -> bool:
    import grpc

    ch = grpc.insecure_channel(address, options=[('grpc.use_local_subchannel_pool', 1)])
    try:
        handshake(ch)
        return True
    except grpc.RpcError:
        return False
    finally:
        ch.close()


def test_a_free_port_taken_before_it_is_bound_does_not_fail_the_fleet(seq_home: Path, monkeypatch):
    """A port picked free can be taken before it is bound (e.g. as a connection's source port).

    Here the first port the fleet is handed is already listening: HAProxy, which cannot bind port 0 and
    report it, is started again on another port; the replicas bind their own free ports (port 0) and the
    fleet reads them from their logs, so they never bind a port picked earlier.
    """
    import sequence_ai_ros.worker.fleet as fleet_module

    taken = socket.socket()
    taken.bind(('127.0.0.1', 0))
    taken.listen()
    handed = []

    def first_taken(host: str = '127.0.0.1') -> int:
        port = taken.getsockname()[1] if not handed else real(host)
        handed.append(port)
        return port

    real = fleet_module.free_port
    monkeypatch.setattr(fleet_module, 'free_port', first_taken)
    assert seq_main(['deploy', str(POLICY), '--name', 'replica_echo']) == 0
    try:
        with Fleet(['replica_echo'], 2, home=seq_home) as fleet:
            assert handed[0] == taken.getsockname()[1] and fleet.port == handed[-1] != handed[0]
            assert len({fleet.port, *(p for r in fleet.replicas for p in (r.port, r.agent_port, r.metrics_port))}) == 7
            for r in fleet.replicas:   # the ports read from the replicas' logs are theirs
                assert fleet.agent_status(r) == 'up ready'
            with channel(fleet.port) as ch:
                reply = pb_grpc.PolicyServiceStub(ch).Ready(pb.ReadyRequest(deployment='replica_echo'), timeout=10)
                assert reply.ready
    finally:
        taken.close()


def test_a_fleet_that_fails_to_start_says_where_its_logs_are(seq_home: Path):
    """A pinned replica port already taken: the replica exits 'cannot bind', and the error names the kept logs."""
    import re

    from sequence_ai_ros.exceptions import ConfigError

    assert seq_main(['deploy', str(POLICY), '--name', 'replica_echo']) == 0
    with socket.socket() as taken:
        taken.bind(('127.0.0.1', 0))
        taken.listen()
        with pytest.raises(ConfigError) as err:
            Fleet(['replica_echo'], 1, home=seq_home, replica_ports=[taken.getsockname()[1]])
    message = str(err.value)
    assert 'replica 1 exited' in message and 'cannot bind' in message, message
    kept = Path(re.search(r'logs are kept in (\S+)\)', message).group(1))
    try:
        assert (kept / 'replica1.log').is_file()
    finally:
        shutil.rmtree(kept, ignore_errors=True)
