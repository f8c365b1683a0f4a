"""``seq delete`` beside a running worker.

No deployment is deleted mid-episode unless forced, and its field data is removed only when asked for
(``--yes``, or "y" at the prompt) or kept (``--keep-data``).
"""

from __future__ import annotations

import pytest
from test_worker_support import POLICIES, Stream, channel, wait_for, wait_ready

from sequence_ai_ros.cli import main as seq_main
from sequence_ai_ros.protocol import sequence_ai_pb2 as pb
from sequence_ai_ros.protocol import sequence_ai_pb2_grpc as pb_grpc
from sequence_ai_ros.worker import create_server
from sequence_ai_ros.worker.live import running_episodes
from sequence_ai_ros.worker.registry import Registry, deploy

FAST = POLICIES / 'fast.py'


def test_delete_waits_for_running_episodes_unless_forced_and_keeps_data_when_told(seq_home, capsys):
    deploy(FAST, name='arm')
    deploy(FAST, name='hand')
    capture = Registry().capture_dir('arm')
    (capture / 'episodes' / 'e1').mkdir(parents=True)
    (capture / 'episodes' / 'e1' / 'blob').write_bytes(b'x' * 1000)   # field data of an earlier episode
    with create_server(['arm', 'hand'], home=seq_home) as server, channel(server.port) as ch:
        stub = pb_grpc.PolicyServiceStub(ch)
        for name in ('arm', 'hand'):
            assert wait_ready(stub, name).ready
        arm, hand = Stream(stub, 'arm', 'arm-1'), Stream(stub, 'hand', 'hand-1')
        assert arm.start().HasField('started') and hand.start().HasField('started')
        wait_for(lambda: set(running_episodes(seq_home)) == {'arm', 'hand'}, what='the live file to list both')
        capsys.readouterr()
        assert seq_main(['delete', 'arm', '--keep-data']) == 2
        err = capsys.readouterr().err
        assert 'arm has episodes running (1 on seq serve pid' in err and '--force' in err
        assert [r.name for r in Registry().list()] == ['arm', 'hand']
        assert arm.end().HasField('ended')
        wait_for(lambda: 'arm' not in running_episodes(seq_home), what='the ended episode to leave the live file')
        assert seq_main(['delete', 'arm', '--keep-data']) == 0
        assert 'captured data kept in' in capsys.readouterr().out
        assert (capture / 'episodes' / 'e1' / 'blob').is_file() and [r.name for r in Registry().list()] == ['hand']
        # --force deletes mid-episode (no field data here: nothing to ask)
        assert seq_main(['delete', 'hand', '--force']) == 0 and Registry().list() == []
        hand.close()
    assert running_episodes(seq_home) == {} and not list((seq_home / 'run').glob('live-*.json'))


def deployments_in_metrics(server) -> set[str]:
    """The deployment label values of every ``seq_`` series the worker exposes."""
    return {s.labels['deployment'] for family in server.metrics.registry.collect() if family.name.startswith('seq_')
            for s in family.samples if 'deployment' in s.labels}


def test_a_deleted_deployments_series_leave_the_metrics_once_it_is_unloaded(seq_home, capsys):
    pytest.importorskip('prometheus_client', reason='prometheus_client is not installed (the [metrics] extra)')
    deploy(FAST, name='arm')
    deploy(FAST, name='hand')
    with create_server(['arm', 'hand'], home=seq_home, metrics_port=0) as server, channel(server.port) as ch:
        stub = pb_grpc.PolicyServiceStub(ch)
        for name in ('arm', 'hand'):
            assert wait_ready(stub, name).ready
        arm = Stream(stub, 'arm', 'arm-1')
        assert arm.start().HasField('started') and arm.end().HasField('ended')   # its counters moved
        assert deployments_in_metrics(server) == {'arm', 'hand'}
        wait_for(lambda: 'arm' not in running_episodes(seq_home), what='the ended episode to leave the live file')
        assert seq_main(['delete', 'arm', '--yes']) == 0
        stub.Ready(pb.ReadyRequest(deployment='hand'), timeout=5)    # a lookup: the worker sees the delete
        wait_for(lambda: deployments_in_metrics(server) == {'hand'}, what="arm's series to be removed")
        build = [s.labels for family in server.metrics.registry.collect() if family.name == 'seq_build_info'
                 for s in family.samples]
        assert [b['deployment'] for b in build] == ['hand'], build
        hand = Stream(stub, 'hand', 'hand-1')                         # the other deployment is still counted
        assert hand.start().HasField('started') and hand.end().HasField('ended')
        assert server.metrics.registry.get_sample_value(
            'seq_episodes_ended_total', {'deployment': 'hand', 'reason': 'completed'}) == 1.0
        assert deployments_in_metrics(server) == {'hand'}
