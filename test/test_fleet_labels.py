"""Labels land with one capture store per replica, behind the real HAProxy, also while a replica is stopped.

Three ``seq serve`` replicas, each with its own $SEQ_HOME (registry, usage, capture store), as Kubernetes
pods have them; nine robots (the real client, through HAProxy's ``balance hdr(x-episode-id)``) run one
episode each, then label it. The Label call carries the episode's ``x-episode-id`` as its stream did, so it
reaches the replica that ran the episode, whose store holds it. While that replica is stopped the hash sends
the label to another replica, which stores it for an episode it does not hold; the export and ``seq policy
stats`` over the three stores merge labels by episode id (the newest wins): 9/9 labelled. A Label the worker
answers UNAVAILABLE is retried with the same id (a loopback gRPC server standing in for a replica that is
briefly unreachable).

Needs HAProxy (Debian's 2.6): ``make haproxy`` installs it as root; otherwise the fleet test skips.
"""

from __future__ import annotations

import json
import shutil
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from test_fleet import POLICY, Robot, drive_all

from sequence_ai_ros.capture.store import CaptureStore
from sequence_ai_ros.cli import main as seq_main
from sequence_ai_ros.client.session import LABEL_ATTEMPTS, Connection
from sequence_ai_ros.exceptions import ConnectionLost
from sequence_ai_ros.protocol import EPISODE_ID_METADATA
from sequence_ai_ros.protocol import sequence_ai_pb2 as pb
from sequence_ai_ros.protocol import sequence_ai_pb2_grpc as pb_grpc

ROBOTS = 9
HAPROXY = shutil.which('haproxy') or ('/usr/sbin/haproxy' if Path('/usr/sbin/haproxy').exists() else None)


@pytest.mark.slow
@pytest.mark.skipif(HAPROXY is None, reason='HAProxy is not installed (as root: `make haproxy`); the fleet '
                                            'tests need a real load balancer')
def test_labels_land_with_a_store_per_replica_also_while_one_replica_is_stopped(tmp_path, monkeypatch, capsys):
    from sequence_ai_ros.worker.fleet import Fleet

    homes = [tmp_path / f'pod{k}' for k in range(1, 4)]
    for home in homes:   # each pod's image registers the deployment and turns capture on in its own home
        home.mkdir()
        monkeypatch.setenv('SEQ_HOME', str(home))
        assert seq_main(['deploy', str(POLICY), '--name', 'replica_echo']) == 0
        assert seq_main(['policy', 'capture', 'replica_echo', '--rate', '1']) == 0
    stores = [home / 'capture' / 'replica_echo' for home in homes]
    store_args = [a for store in stores for a in ('--store', str(store))]

    def exported_labels(out: Path) -> dict[str, tuple[bool, str]]:
        assert seq_main(['policy', 'data', 'export', 'replica_echo', '--out', str(out), '--format', 'jsonl',
                         *store_args]) == 0
        rows = [json.loads(line) for line in (out / 'episodes.jsonl').read_text().splitlines() if line.strip()]
        return {e['episode_id']: (e['label']['success'], e['label']['notes']) for e in rows if e['label']}

    with Fleet(['replica_echo'], 3, replica_homes=homes, serve_args=['--idle-timeout', '30']) as fleet:
        replica_of = {r.process.pid: r.index for r in fleet.replicas}
        robots = [Robot(fleet.address, f'robot{k:02d}') for k in range(ROBOTS)]
        try:
            results = drive_all(robots, 'ep1', 1.0)
            for res in results:
                assert res['error'] is None and len(res['pids']) == 1, res
            served = {k: replica_of[next(iter(res['pids']))] for k, res in enumerate(results)}
            assert len(set(served.values())) >= 2            # the episodes spread over the replicas
            stopped = max(set(served.values()), key=lambda i: sum(v == i for v in served.values()))
            theirs = [k for k in range(ROBOTS) if served[k] == stopped]
            for k in range(ROBOTS):                           # the others label on their episode's replica
                if k not in theirs:
                    assert robots[k].policy.label(k % 2 == 0, notes=f'robot {k}')
            fleet.stop_replica(stopped)                       # SIGTERM, drained, HAProxy marks it DOWN
            for k in theirs:                                  # their labels hash to the replicas still up
                assert robots[k].policy.label(k % 2 == 0, notes=f'robot {k}')
            # while it is stopped: its store (a directory on its volume) exports with the others, 9/9 labelled
            assert exported_labels(tmp_path / 'while-stopped') == {
                f'robot{k:02d}-ep1': (k % 2 == 0, f'robot {k}') for k in range(ROBOTS)}
            fleet.restart(stopped)                            # back: the hash sends its episodes' ids to it again
            relabelled = theirs[0]
            assert robots[relabelled].policy.label(relabelled % 2 != 0, notes='relabelled on its own replica')
        finally:
            for robot in robots:
                robot.close()
    for k in range(ROBOTS):   # each episode is in its replica's store; a label given while it was stopped is not
        episode = next(e for e in CaptureStore(stores[served[k] - 1], 'replica_echo').episodes()
                       if e.episode_id == f'robot{k:02d}-ep1')
        assert (episode.label is None) == (k in theirs and k != relabelled), k
    held_elsewhere = {eid for i, store in enumerate(stores, 1) if i != stopped
                      for eid in CaptureStore(store, 'replica_echo').labels()
                      if served[int(eid[5:7])] == stopped}
    assert held_elsewhere == {f'robot{k:02d}-ep1' for k in theirs}   # ... it is on another replica
    want = {f'robot{k:02d}-ep1': (k % 2 == 0, f'robot {k}') for k in range(ROBOTS)}
    want[f'robot{relabelled:02d}-ep1'] = (relabelled % 2 != 0, 'relabelled on its own replica')   # newest wins
    assert exported_labels(tmp_path / 'after') == want
    capsys.readouterr()
    assert seq_main(['policy', 'stats', 'replica_echo', '--json', *store_args]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert sum(r['episodes'] for r in rows) == ROBOTS and sum(r['labelled'] for r in rows) == ROBOTS
    assert sum(r['successes'] for r in rows) == sum(success for success, _ in want.values())


class _Flaky(pb_grpc.PolicyServiceServicer):
    """A replica answering its first ``failures`` Label calls UNAVAILABLE; it records every call's episode id."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.seen: list[tuple[str, str]] = []

    def _record(self, method: str, context: grpc.ServicerContext) -> None:
        self.seen.append((method, dict(context.invocation_metadata()).get(EPISODE_ID_METADATA, '')))

    def Label(self, request, context):  # noqa: N802 - the generated servicer's name
        self._record('Label', context)
        if sum(m == 'Label' for m, _ in self.seen) <= self.failures:
            context.abort(grpc.StatusCode.UNAVAILABLE, 'replica briefly unreachable')
        return pb.LabelReply(ok=True)

    def Ready(self, request, context):  # noqa: N802
        self._record('Ready', context)
        return pb.ReadyReply(ready=True, state='ready')


@pytest.fixture
def flaky():
    servers = []

    def start(failures: int) -> tuple[str, _Flaky]:
        servicer = _Flaky(failures)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        pb_grpc.add_PolicyServiceServicer_to_server(servicer, server)
        port = server.add_insecure_port('127.0.0.1:0')
        server.start()
        servers.append(server)
        return f'127.0.0.1:{port}', servicer

    yield start
    for server in servers:
        server.stop(0)


def test_a_label_retry_carries_the_same_episode_id(flaky):
    endpoint, replica = flaky(LABEL_ATTEMPTS - 1)
    conn = Connection(endpoint)
    try:
        assert conn.label('d', 'robot01-ep7', True, '', timeout=5.0).ok
        assert conn.ready('d', timeout=2.0, episode_id='robot01-ep8').ready
    finally:
        conn.close()
    assert replica.seen == [('Label', 'robot01-ep7')] * LABEL_ATTEMPTS + [('Ready', 'robot01-ep8')]


def test_a_label_that_stays_unavailable_fails_typed_after_its_attempts(flaky):
    endpoint, replica = flaky(LABEL_ATTEMPTS)
    conn = Connection(endpoint)
    try:
        with pytest.raises(ConnectionLost, match='is `seq serve` running there'):
            conn.label('d', 'robot02-ep1', True, '', timeout=5.0)
    finally:
        conn.close()
    assert replica.seen == [('Label', 'robot02-ep1')] * LABEL_ATTEMPTS
