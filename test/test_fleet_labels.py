"""Labels land on the episode's replica: one capture store per replica, behind the real HAProxy.

Three ``seq serve`` replicas, each with its own $SEQ_HOME (registry, usage, capture store), as Kubernetes
pods have them; nine robots (the real client, through HAProxy's ``balance hdr(x-episode-id)``) run one
episode each, then label it. The Label call carries the episode's ``x-episode-id`` as its stream did, so it
reaches the replica that ran the episode: every label is stored, in the store that holds its episode. A
Label the worker answers UNAVAILABLE is retried with the same id (a loopback gRPC server standing in for a
replica that is briefly unreachable).

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


@pytest.mark.skipif(HAPROXY is None, reason='HAProxy is not installed (as root: `make haproxy`); the fleet '
                                            'tests need a real load balancer')
def test_labels_land_on_the_episodes_replica_with_a_store_per_replica(tmp_path, monkeypatch):
    from sequence_ai_ros.worker.fleet import Fleet

    homes = [tmp_path / f'pod{k}' for k in range(1, 4)]
    for home in homes:   # each pod's image registers the deployment and turns capture on in its own home
        home.mkdir()
        monkeypatch.setenv('SEQ_HOME', str(home))
        assert seq_main(['deploy', str(POLICY), '--name', 'replica_echo']) == 0
        assert seq_main(['policy', 'capture', 'replica_echo', '--rate', '1']) == 0
    with Fleet(['replica_echo'], 3, replica_homes=homes, serve_args=['--idle-timeout', '30']) as fleet:
        home_of = {r.process.pid: homes[r.index - 1] for r in fleet.replicas}
        robots = [Robot(fleet.address, f'robot{k:02d}') for k in range(ROBOTS)]
        try:
            results = drive_all(robots, 'ep1', 1.0)
            for res in results:
                assert res['error'] is None and len(res['pids']) == 1, res
            for k, robot in enumerate(robots):     # the last episode's id, sent as x-episode-id
                assert robot.policy.label(k % 2 == 0, notes=f'robot {k}')
        finally:
            for robot in robots:
                robot.close()
        served = {f'robot{k:02d}-ep1': home_of[next(iter(res['pids']))] for k, res in enumerate(results)}
        assert len(set(served.values())) >= 2            # the episodes spread over the replicas
    labelled: dict[str, dict] = {}
    for home in homes:
        store = CaptureStore(home / 'capture' / 'replica_echo', 'replica_echo')
        for episode in store.episodes():
            assert served[episode.episode_id] == home     # each episode is in its replica's store ...
            assert episode.label is not None, episode.episode_id   # ... and so is its label
            labelled[episode.episode_id] = episode.label
    assert len(labelled) == ROBOTS                        # 9/9 labels stored
    for k in range(ROBOTS):
        label = labelled[f'robot{k:02d}-ep1']
        assert (label['success'], label['notes']) == (k % 2 == 0, f'robot {k}')
    # the pods' stores export as one dataset, every episode with its label
    out = tmp_path / 'export'
    stores = [a for home in homes for a in ('--store', str(home / 'capture' / 'replica_echo'))]
    assert seq_main(['policy', 'data', 'export', 'replica_echo', '--out', str(out), '--format', 'jsonl', *stores]) == 0
    exported = [json.loads(line) for line in (out / 'episodes.jsonl').read_text().splitlines() if line.strip()]
    assert {e['episode_id']: e['label']['notes'] for e in exported} == {
        f'robot{k:02d}-ep1': f'robot {k}' for k in range(ROBOTS)}


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
