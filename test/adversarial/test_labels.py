"""Labels from the wire under attack: conflicting labels at one instant, callers without the token, no id.

Real capture stores on disk and a real worker (gRPC on loopback).
"""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from test_worker_support import Stream, channel, wait_ready

from sequence_ai_ros.capture.settings import CaptureSettings, save_settings
from sequence_ai_ros.capture.store import CaptureStore
from sequence_ai_ros.capture.store_set import StoreSet
from sequence_ai_ros.protocol import sequence_ai_pb2 as pb
from sequence_ai_ros.protocol import sequence_ai_pb2_grpc as pb_grpc
from sequence_ai_ros.worker import serve_policy_file

FAST = Path(__file__).resolve().parents[1] / 'policies' / 'fast.py'


def test_labels_given_at_one_instant_merge_the_same_whatever_the_order_of_the_stores(tmp_path):
    """Attack: conflicting labels of one episode stored by two replicas at the same labelled_at.

    The merged label was the first store's, so ``--store a --store b`` and ``--store b --store a`` exported
    opposite labels.
    """
    roots = []
    for name, success, notes in (('a', True, 'grasped'), ('b', False, 'dropped it')):
        root = tmp_path / name / 'fast'
        save_settings(root, CaptureSettings(rate=1.0, enabled=True, fps=30.0))
        store = CaptureStore(root, deployment='fast', clock=lambda: 1_800_000_000.0)
        assert store.label('ep-1', success, notes) is False       # an episode neither store ran
        store.close()
        roots.append(root)
    forward = StoreSet(roots, 'fast').labels()
    backward = StoreSet(roots[::-1], 'fast').labels()
    assert forward == backward
    assert forward['ep-1']['success'] is False and forward['ep-1']['notes'] == 'dropped it'


@pytest.fixture
def worker(tmp_path):
    save_settings(tmp_path / 'capture' / 'fast', CaptureSettings(rate=1.0, enabled=True, fps=30.0))
    server = serve_policy_file(FAST, 'fast', dim=3, capture_root=tmp_path / 'capture', token='s3cret',
                               anonymous_streams=2, warm=True)
    yield server
    server.stop(grace=0.5)


def test_a_caller_without_the_token_labels_only_episodes_this_worker_ran(worker, tmp_path):
    """Attack: with --anonymous-streams, a caller without the token labelled made-up episode ids.

    2,000 labels with 4 KB notes in 10 s (9 MB of index, each kept retention_days): labels of episodes the
    worker never ran, stored for anyone who can reach the port.
    """
    token = [('authorization', 'Bearer s3cret')]
    with channel(worker.port) as ch:
        stub = pb_grpc.PolicyServiceStub(ch)
        assert wait_ready(stub, 'fast').ready
        ran = Stream(stub, 'fast', 'ran-here')                  # an anonymous robot's own episode
        assert ran.start().HasField('started')
        ran.send(end=pb.EpisodeEnd(reason='completed'))
        assert ran.recv().HasField('ended')
        ran.close()
        for k in range(20):
            reply = stub.Label(pb.LabelRequest(deployment='fast', episode_id=f'made-up-{k}', success=True,
                                               notes='x' * 4096), timeout=5)
            assert not reply.ok and 'only a caller with the token' in reply.message, reply
        assert stub.Label(pb.LabelRequest(deployment='fast', episode_id='ran-here', success=True), timeout=5).ok
        moved = stub.Label(pb.LabelRequest(deployment='fast', episode_id='ran-elsewhere', success=False),
                           metadata=token, timeout=5)
        assert moved.ok and 'did not run it' in moved.message  # a token holder's label of another replica's episode
    labels = CaptureStore(tmp_path / 'capture' / 'fast', 'fast').labels()
    assert sorted(labels) == ['ran-elsewhere', 'ran-here']


def test_a_label_without_an_episode_id_is_refused(worker, tmp_path):
    """Attack: a Label with an empty episode id was stored as the label of episode ''."""
    with channel(worker.port) as ch:
        stub = pb_grpc.PolicyServiceStub(ch)
        with pytest.raises(grpc.RpcError) as err:
            stub.Label(pb.LabelRequest(deployment='fast', episode_id='', success=True),
                       metadata=[('authorization', 'Bearer s3cret')], timeout=5)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and 'episode_id' in err.value.details()
    assert CaptureStore(tmp_path / 'capture' / 'fast', 'fast').labels() == {}
