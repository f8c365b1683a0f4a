"""The admin API (``sequence_ai.v1.Admin``) of a real worker over real gRPC, and ``seq admin`` speaking it.

Live episodes with their robot, version, requests and underruns so far; statistics per deployment version;
the loaded versions; the log level; a drain through the API that takes SIGTERM's path (new episodes refused
``draining``, the live one finishes, then the worker stops); during a rollout, the old version told from the
new one. Access and rate bounds: test/adversarial/test_admin.py.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import grpc
import pytest
from test_worker_rollout import ask, write
from test_worker_support import POLICIES, Stream, channel, state_request, wait_for, wait_ready

from sequence_ai_ros.cli import main as seq_main
from sequence_ai_ros.protocol import sequence_ai_pb2 as pb
from sequence_ai_ros.protocol import sequence_ai_pb2_grpc as pb_grpc
from sequence_ai_ros.worker import create_server, serve_policy_file
from sequence_ai_ros.worker.registry import deploy

TOKEN = 'adm1n-t0ken'
AUTH = (('authorization', f'Bearer {TOKEN}'),)
NAMES = ('j0', 'j1', 'j2')


@pytest.fixture
def worker():
    server = serve_policy_file(POLICIES / 'fast.py', 'fast', dim=3, host='127.0.0.1', port=0, token=TOKEN, warm=True)
    try:
        wait_ready(pb_grpc.PolicyServiceStub(channel(server.port)), 'fast', timeout=30, metadata=AUTH)
        yield server
    finally:
        server.stop(grace=0.5)


def _start(stub, episode_id: str, robot: str) -> Stream:
    stream = Stream(stub, 'fast', episode_id, metadata=AUTH)
    stream.send(start=pb.EpisodeStart(episode_id=episode_id, instruction='admin test', client_id=robot))
    assert stream.recv().WhichOneof('kind') == 'started'
    return stream


def _underrun_batch() -> pb.Telemetry:
    """Three ticks on the chunk-step axis: one fresh, then two held in underrun (one underrun, 2 steps held)."""
    frames = [pb.TelemetryFrame(robot_time_s=0.0, step_start=0, step_end=1),
              pb.TelemetryFrame(robot_time_s=0.0, step_start=1, step_end=2, hold=True, hold_reason='underrun'),
              pb.TelemetryFrame(robot_time_s=0.0, step_start=2, step_end=3, hold=True, hold_reason='underrun')]
    return pb.Telemetry(frames=frames)


def test_the_admin_api_lists_live_episodes_stats_versions_and_sets_the_log_level(worker):
    ch = channel(worker.port)
    stub, admin = pb_grpc.PolicyServiceStub(ch), pb_grpc.AdminStub(ch)
    stream = _start(stub, 'ep-admin-1', 'robot-7')
    for rid in (1, 2):
        assert stream.ask(state_request(rid, [0.0, 0.0, 0.0], NAMES)).WhichOneof('kind') == 'chunk'
    stream.send(telemetry=_underrun_batch())
    listed = wait_for(lambda: (r := admin.ListEpisodes(pb.ListEpisodesRequest(), metadata=AUTH, timeout=10))
                      .episodes and r.episodes[0].underruns and r, timeout=20, what='the underrun to show')
    assert listed.total == 1 and not listed.draining and f':{worker.port} pid ' in listed.replica
    (ep,) = listed.episodes
    assert (ep.episode_id, ep.robot, ep.deployment, ep.version) == ('ep-admin-1', 'robot-7', 'fast', 0)
    assert ep.client == '127.0.0.1' and ep.requests == 2 and ep.in_flight == 0 and ep.age_s >= 0
    assert ep.underruns == 1 and ep.underrun_s == pytest.approx(2 / 30, rel=1e-6)
    assert admin.ListEpisodes(pb.ListEpisodesRequest(deployment='other'), metadata=AUTH, timeout=10).total == 0

    live = admin.Stats(pb.StatsRequest(), metadata=AUTH, timeout=10)
    (row,) = live.versions
    assert (row.deployment, row.version, row.live_episodes, row.episodes_ended, row.requests) == ('fast', 0, 1, 0, 2)
    assert live.open_streams == 1
    assert stream.end().WhichOneof('kind') == 'ended'
    stream.close()
    second = _start(stub, 'ep-admin-2', 'robot-8')
    assert second.ask(state_request(1, [0.0, 0.0, 0.0], NAMES)).WhichOneof('kind') == 'chunk'
    second.cancel()                                                   # a robot that drops: a disconnect
    ended = wait_for(lambda: (s := admin.Stats(pb.StatsRequest(deployment='fast'), metadata=AUTH, timeout=10))
                     .versions[0].episodes_ended == 2 and s, timeout=20, what='both ends counted')
    (row,) = ended.versions
    assert dict(row.ended_by_reason) == {'completed': 1, 'disconnect': 1}
    assert (row.live_episodes, row.requests, row.underruns) == (0, 3, 1)
    assert row.underrun_s == pytest.approx(2 / 30, rel=1e-6)

    (version,) = admin.ListVersions(pb.ListVersionsRequest(), metadata=AUTH, timeout=10).versions
    assert (version.deployment, version.version, version.role, version.state, version.ready) == \
        ('fast', 0, 'serving', 'ready', True)

    root = logging.getLogger()
    before = root.level
    try:
        reply = admin.SetLogLevel(pb.SetLogLevelRequest(level='DEBUG'), metadata=AUTH, timeout=10)
        assert reply.level == 'debug' and root.level == logging.DEBUG
        assert reply.previous == logging.getLevelName(before).lower()
        with pytest.raises(grpc.RpcError) as bad:
            admin.SetLogLevel(pb.SetLogLevelRequest(level='loud'), metadata=AUTH, timeout=10)
        assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT and 'debug, info' in bad.value.details()
    finally:
        root.setLevel(before)


def test_a_drain_through_the_api_refuses_new_episodes_lets_the_live_one_finish_then_stops(worker):
    ch = channel(worker.port)
    stub, admin = pb_grpc.PolicyServiceStub(ch), pb_grpc.AdminStub(ch)
    live = _start(stub, 'ep-live', 'robot-1')
    reply = admin.Drain(pb.DrainRequest(), metadata=AUTH, timeout=10)
    assert not reply.already_draining and reply.open_streams == 1
    assert reply.drain_timeout_s == worker.config.drain_timeout_s
    assert admin.Drain(pb.DrainRequest(), metadata=AUTH, timeout=10).already_draining      # once
    wait_for(lambda: admin.ListEpisodes(pb.ListEpisodesRequest(), metadata=AUTH, timeout=10).draining, timeout=10,
             what='the drain to begin')
    refused = Stream(stub, 'fast', 'ep-new', metadata=AUTH)
    refused.send(start=pb.EpisodeStart(episode_id='ep-new'))
    error = refused.recv().error
    assert error.code == pb.OVERLOADED and error.refusal == 'draining'
    refused.close()
    assert live.ask(state_request(1, [0.0, 0.0, 0.0], NAMES)).WhichOneof('kind') == 'chunk'   # goes on
    ended = live.end()
    assert ended.WhichOneof('kind') == 'ended'
    live.close()
    assert worker.wait(timeout=30), 'the worker did not stop after its drain'


def test_seq_admin_speaks_to_every_endpoint_and_names_the_replica(worker, tmp_path: Path, capsys):
    token_file = tmp_path / 'token'
    token_file.write_text(TOKEN + '\n')
    other = serve_policy_file(POLICIES / 'fast.py', 'fast', dim=3, host='127.0.0.1', port=0, token=TOKEN)
    try:
        replicas = tmp_path / 'replicas'
        replicas.write_text(f'127.0.0.1:{worker.port}\n# a comment\n127.0.0.1:{other.port}\n')
        assert seq_main(['admin', '--replicas', str(replicas), '--token-file', str(token_file), 'versions']) == 0
        out = capsys.readouterr().out
        assert out.count('== 127.0.0.1:') == 2 and f':{other.port} pid ' in out and 'serving' in out
        assert seq_main(['admin', '--endpoint', f'127.0.0.1:{worker.port}', '--token-file', str(token_file),
                         '--json', 'stats']) == 0
        (line,) = capsys.readouterr().out.splitlines()
        stats = json.loads(line)
        assert stats['endpoint'] == f'127.0.0.1:{worker.port}' and stats['versions'][0]['deployment'] == 'fast'
        # without the token: refused, said on stderr, exit 1
        assert seq_main(['admin', '--endpoint', f'127.0.0.1:{worker.port}', 'episodes']) == 1
        assert 'UNAUTHENTICATED' in capsys.readouterr().err
        # drain names one replica unless --all: a usage error, nothing drained
        assert seq_main(['admin', '--replicas', str(replicas), '--token-file', str(token_file), 'drain']) == 2
        assert 'name one --endpoint' in capsys.readouterr().err and not worker.servicer.drain.draining
    finally:
        other.stop(grace=0.5)


def test_during_a_rollout_versions_and_stats_tell_the_old_version_from_the_new(tmp_path: Path, seq_home: Path):
    policy = write(tmp_path / 'arm' / 'policy.py', 1.0)
    deploy(policy)
    with create_server(['arm'], home=seq_home, token=TOKEN) as server, channel(server.port) as ch:
        stub, admin = pb_grpc.PolicyServiceStub(ch), pb_grpc.AdminStub(ch)
        assert wait_ready(stub, 'arm', timeout=60, metadata=AUTH).ready
        old = Stream(stub, 'arm', 'old', metadata=AUTH)
        assert old.start().started.deployment_version == 1 and ask(old, 1) == 1.0
        deploy(write(policy, 2.0))                                  # version 2, while episode 'old' runs
        wait_for(lambda: _serving(server, stub) == 2, timeout=60, what='version 2 to take new episodes')
        new = Stream(stub, 'arm', 'new', metadata=AUTH)
        assert new.start().started.deployment_version == 2 and ask(new, 1) == 2.0 and ask(new, 2) == 2.0

        versions = admin.ListVersions(pb.ListVersionsRequest(), metadata=AUTH, timeout=10).versions
        assert [(v.version, v.role, v.live_episodes) for v in versions] == [(1, 'rollout_old', 1), (2, 'serving', 1)]
        assert all(v.deployment == 'arm' and len(v.content_sha256) == 64 for v in versions)
        assert versions[0].content_sha256 != versions[1].content_sha256
        listed = admin.ListEpisodes(pb.ListEpisodesRequest(), metadata=AUTH, timeout=10).episodes
        assert sorted((e.episode_id, e.version, e.requests) for e in listed) == [('new', 2, 2), ('old', 1, 1)]
        assert listed[0].episode_id == 'old'                        # oldest first
        stats = admin.Stats(pb.StatsRequest(), metadata=AUTH, timeout=10).versions
        assert [(s.version, s.live_episodes, s.requests) for s in stats] == [(1, 1, 1), (2, 1, 2)]

        for stream in (old, new):
            assert stream.end().HasField('ended')
            stream.close()
        ended = wait_for(lambda: (s := admin.Stats(pb.StatsRequest(), metadata=AUTH, timeout=10).versions)
                         and sum(r.episodes_ended for r in s) == 2 and s, timeout=20, what='both ends counted')
        assert [(s.version, s.live_episodes, s.episodes_ended, dict(s.ended_by_reason)) for s in ended] == \
            [(1, 0, 1, {'completed': 1}), (2, 0, 1, {'completed': 1})]


def _serving(server, stub) -> int:
    stub.Ready(pb.ReadyRequest(deployment='arm'), metadata=AUTH, timeout=5)   # a lookup: the registry is read
    runtime = server.runtimes['arm']
    return runtime.version if runtime.readiness()[0] else -1
