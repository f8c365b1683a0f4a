"""Labels from the wire under attack: conflicting labels at one instant, callers without the token, no id.

Also: another client's episode, a stranger reusing an episode id, a flood of forged ids, and a forged label
kept for a stopped replica.

Real capture stores on disk and a real worker (gRPC on loopback).
"""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import pytest
from test_worker_support import Stream, channel, wait_for, wait_ready

from sequence_ai_ros.capture import store as store_module
from sequence_ai_ros.capture.settings import CaptureSettings, save_settings
from sequence_ai_ros.capture.store import UNSEEN_LABEL_BYTES_PER_OWNER, UNSEEN_LABELS_REFUSAL, CaptureStore
from sequence_ai_ros.capture.store_set import StoreSet
from sequence_ai_ros.client.session import Connection
from sequence_ai_ros.datasets.jsonl_writer import export_jsonl
from sequence_ai_ros.exceptions import Overloaded, PermissionDenied
from sequence_ai_ros.protocol import errors
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


def _run(stub, eid: str, metadata=(), end: pb.EpisodeEnd | None = None, close: bool = True) -> Stream:
    """Run episode ``eid`` on a raw stream (start, then EpisodeEnd unless ``end`` is False-y and not closing)."""
    stream = Stream(stub, 'fast', eid, metadata=list(metadata))
    assert stream.start().HasField('started')
    if close:
        stream.send(end=end or pb.EpisodeEnd(reason='completed', actions=5))
        assert stream.recv().HasField('ended')
        stream.close()
    return stream


def _label(stub, eid: str, success: bool, notes: str = '', metadata=()) -> pb.LabelReply:
    return stub.Label(pb.LabelRequest(deployment='fast', episode_id=eid, success=success, notes=notes),
                      metadata=list(metadata), timeout=10)


def _refused(call, code: grpc.StatusCode) -> str:
    with pytest.raises(grpc.RpcError) as err:
        call()
    assert err.value.code() == code, err.value
    return err.value.details()


def test_a_caller_without_the_token_labels_no_episode(worker, tmp_path):
    """Attack: with --anonymous-streams, a Label with no token changed the token holder's episode T-1.

    The export showed ``{'success': False, 'notes': 'anon overwrote'}``; before that, 2,000 labels of made-up ids
    with 4 KB notes in 10 s (9 MB of index). Now every Label without the token is PERMISSION_DENIED, its own
    anonymous episode's too, and nothing is stored.
    """
    token = [('authorization', 'Bearer s3cret')]
    with channel(worker.port) as ch:
        stub = pb_grpc.PolicyServiceStub(ch)
        assert wait_ready(stub, 'fast').ready
        _run(stub, 'T-1', token)                                       # the token holder's episode
        assert _label(stub, 'T-1', True, 'grasped', token).ok
        details = _refused(lambda: _label(stub, 'T-1', False, 'anon overwrote'), grpc.StatusCode.PERMISSION_DENIED)
        assert details.startswith('[PERMISSION_DENIED]') and 'authorization: Bearer' in details, details
        _run(stub, 'ran-here')                                         # an anonymous robot's own episode
        _refused(lambda: _label(stub, 'ran-here', True), grpc.StatusCode.PERMISSION_DENIED)
        for k in range(20):
            _refused(lambda k=k: _label(stub, f'made-up-{k}', True, 'x' * 4096), grpc.StatusCode.PERMISSION_DENIED)
        moved = _label(stub, 'ran-elsewhere', False, metadata=token)
        assert moved.ok and 'did not run it' in moved.message  # a token holder's label of another replica's episode
        # nobody labels an anonymous episode: its owner is the anonymous caller, who may not
        _refused(lambda: _label(stub, 'ran-here', True, metadata=token), grpc.StatusCode.PERMISSION_DENIED)
    # the client raises the typed error, with the worker's words
    conn = Connection(f'127.0.0.1:{worker.port}')
    try:
        with pytest.raises(PermissionDenied, match='without the token'):
            conn.label('fast', 'T-1', False, 'anon overwrote', timeout=5.0)
    finally:
        conn.close()
    store = CaptureStore(tmp_path / 'capture' / 'fast', 'fast')
    labels = store.labels()
    assert sorted(labels) == ['T-1', 'ran-elsewhere']
    assert (labels['T-1']['success'], labels['T-1']['notes']) == (True, 'grasped')
    exported = {e.episode_id: e.label for e in StoreSet([store.root], 'fast').episodes()}
    assert (exported['T-1']['success'], exported['T-1']['notes']) == (True, 'grasped') and exported['ran-here'] is None


@pytest.fixture
def tokenless(tmp_path):
    """A worker without a token, reached through its proxy socket: ``x-forwarded-for`` names each client."""
    save_settings(tmp_path / 'capture' / 'fast', CaptureSettings(rate=1.0, enabled=True, fps=30.0))
    server = serve_policy_file(FAST, 'fast', dim=3, capture_root=tmp_path / 'capture', warm=True,
                               proxy_socket=str(tmp_path / 'proxy.sock'))
    with grpc.insecure_channel(f'unix:{tmp_path / "proxy.sock"}') as ch:
        stub = pb_grpc.PolicyServiceStub(ch)
        assert wait_ready(stub, 'fast').ready
        yield server, stub
    server.stop(grace=0.5)


A, B, STRANGER = ([('x-forwarded-for', f'203.0.113.{k}')] for k in (1, 2, 3))


def test_on_a_tokenless_worker_only_the_client_that_ran_an_episode_labels_it(tokenless, tmp_path):
    """Attack: client B relabelled client A's finished episode, and a stranger labelled a running one."""
    server, stub = tokenless
    _run(stub, 'a-done', A)
    assert _label(stub, 'a-done', True, 'lifted', A).ok
    details = _refused(lambda: _label(stub, 'a-done', False, 'B was here', B), grpc.StatusCode.PERMISSION_DENIED)
    assert 'another client' in details, details
    running = _run(stub, 'a-running', A, close=False)
    _refused(lambda: _label(stub, 'a-running', False, 'stranger', STRANGER), grpc.StatusCode.PERMISSION_DENIED)
    assert _label(stub, 'a-running', True, 'still going', A).ok          # its owner may, while it runs
    running.send(end=pb.EpisodeEnd(reason='completed'))
    assert running.recv().HasField('ended')
    running.close()
    # a label given before the episode ran, by another client, is dropped when the episode starts
    assert 'did not run it' in _label(stub, 'a-later', False, 'pre-poisoned', B).message
    _run(stub, 'a-later', A)
    labels = CaptureStore(tmp_path / 'capture' / 'fast', 'fast').labels()
    assert {e: (v['success'], v['notes']) for e, v in labels.items()} == {
        'a-done': (True, 'lifted'), 'a-running': (True, 'still going')}
    # the worker releases a stream once its call ends, just after the robot read EpisodeEnded (bounded)
    wait_for(lambda: server.servicer.open_streams() == 0, 10, 'every stream released')


def test_a_stranger_reusing_an_episode_id_sends_no_outcome_and_no_telemetry(tmp_path):
    """Attack: a stranger opened a stream with A's episode id and reported another outcome (the run's record)."""
    save_settings(tmp_path / 'capture' / 'fast', CaptureSettings(rate=1.0, enabled=False))   # runs, no data
    with serve_policy_file(FAST, 'fast', dim=3, capture_root=tmp_path / 'capture', warm=True,
                           proxy_socket=str(tmp_path / 'proxy.sock')), \
            grpc.insecure_channel(f'unix:{tmp_path / "proxy.sock"}') as ch:
        stub = pb_grpc.PolicyServiceStub(ch)
        assert wait_ready(stub, 'fast').ready
        _run(stub, 'a-1', A, end=pb.EpisodeEnd(reason='completed', actions=5))
        hijack = Stream(stub, 'fast', 'a-1', metadata=STRANGER)
        started = hijack.start()
        assert started.HasField('started') and not started.started.capture
        assert 'another client' in started.started.capture_error, started
        hijack.send(end=pb.EpisodeEnd(reason='error', actions=999, underruns=50))
        ended = hijack.recv()
        assert ended.HasField('ended') and not ended.ended.captured and 'another client' in ended.ended.capture_error
        hijack.close()
    runs = {r['episode_id']: r for r in CaptureStore(tmp_path / 'capture' / 'fast', 'fast').runs()}
    assert (runs['a-1']['reason'], runs['a-1']['actions'], runs['a-1']['underruns']) == ('completed', 5, 0)


def test_a_flood_of_forged_ids_is_bounded_per_client(tmp_path, monkeypatch):
    """Attack: 3,000 forged ids with 4,000-character notes stored 2,391 labels in 56 s (+9.7 MB of index).

    Labels of episodes the worker never ran are kept for fleet failover, bounded per identity: the bytes bound
    (1 MiB of ids and notes) stops this flood after about 260; the refusals are OVERLOADED (refusal
    ``unseen_labels``) and counted in ``seq_labels_refused_total{reason="unseen_bound"}``. Another client's
    labels are not affected. (400 forged labels here: the bound, not the flood's length, is under test.)
    """
    prom_parser = pytest.importorskip('prometheus_client.parser')
    import urllib.request

    save_settings(tmp_path / 'capture' / 'fast', CaptureSettings(rate=1.0, enabled=True, fps=30.0))
    with serve_policy_file(FAST, 'fast', dim=3, capture_root=tmp_path / 'capture', warm=True, metrics_port=0,
                           proxy_socket=str(tmp_path / 'proxy.sock')) as server, \
            grpc.insecure_channel(f'unix:{tmp_path / "proxy.sock"}') as ch:
        stub = pb_grpc.PolicyServiceStub(ch)
        assert wait_ready(stub, 'fast').ready
        _run(stub, 'b-own', B)
        index = tmp_path / 'capture' / 'fast' / 'store.db'
        before = index.stat().st_size
        stored, refusals = 0, []
        for k in range(400):
            try:
                stored += _label(stub, f'forged-{k:04d}', True, 'n' * 4000, STRANGER).ok
            except grpc.RpcError as exc:
                refusals.append(exc)
        assert 200 <= stored <= UNSEEN_LABEL_BYTES_PER_OWNER // 4000, stored
        assert len(refusals) == 400 - stored
        assert all(r.code() == grpc.StatusCode.RESOURCE_EXHAUSTED for r in refusals)
        typed = errors.from_rpc_error(refusals[0])
        assert isinstance(typed, Overloaded) and typed.refusal == UNSEEN_LABELS_REFUSAL, typed
        assert 'did not run' in str(typed)
        # the bound is per client: B labels its own episode, and an episode of a stopped replica
        assert _label(stub, 'b-own', True, 'fine', B).ok
        assert _label(stub, 'b-elsewhere', True, 'fine', B).ok
        monkeypatch.setattr(store_module, 'UNSEEN_LABELS_PER_OWNER', 2)   # the count bound, with short notes
        _label(stub, 'b-elsewhere-2', True, '', B)
        _refused(lambda: _label(stub, 'b-elsewhere-3', True, '', B), grpc.StatusCode.RESOURCE_EXHAUSTED)
        assert _label(stub, 'b-elsewhere', False, 'relabelled', B).ok   # replacing a held label is not one more
        text = urllib.request.urlopen(f'http://127.0.0.1:{server.metrics_port}/metrics', timeout=5).read().decode()
        counted = {tuple(sorted(s.labels.items())): s.value for f in prom_parser.text_string_to_metric_families(text)
                   for s in f.samples if s.name == 'seq_labels_refused_total'}
        assert counted[(('deployment', 'fast'), ('reason', 'unseen_bound'))] == len(refusals) + 1
        assert counted[(('deployment', 'fast'), ('reason', 'not_owner'))] == 0
    store = CaptureStore(tmp_path / 'capture' / 'fast', 'fast')
    assert len(store.unmatched_labels()) == stored + 2
    store.close()
    assert index.stat().st_size - before < 3 * UNSEEN_LABEL_BYTES_PER_OWNER, (before, index.stat().st_size)


def test_a_label_kept_for_a_stopped_replica_joins_its_episode_only_from_its_owner(tmp_path):
    """Attack: a label forged for an episode of a stopped replica joined the episode at export.

    Two replicas, a store each: A ran two episodes on replica 1, then replica 1 stopped. On replica 2, A labels
    one of them and B forges a label for the other: the export joins A's label and leaves B's out.
    """
    roots = []
    for name in ('pod1', 'pod2'):
        save_settings(tmp_path / name / 'fast', CaptureSettings(rate=1.0, enabled=True, fps=30.0))
        roots.append(tmp_path / name / 'fast')
    sockets = [tmp_path / 'pod1.sock', tmp_path / 'pod2.sock']
    with serve_policy_file(FAST, 'fast', dim=3, capture_root=tmp_path / 'pod1', warm=True,
                           proxy_socket=str(sockets[0])), grpc.insecure_channel(f'unix:{sockets[0]}') as ch:
        stub = pb_grpc.PolicyServiceStub(ch)
        assert wait_ready(stub, 'fast').ready
        _run(stub, 'a-1', A)
        _run(stub, 'a-2', A)
    with serve_policy_file(FAST, 'fast', dim=3, capture_root=tmp_path / 'pod2', warm=True,
                           proxy_socket=str(sockets[1])), grpc.insecure_channel(f'unix:{sockets[1]}') as ch:
        stub = pb_grpc.PolicyServiceStub(ch)
        assert wait_ready(stub, 'fast').ready
        assert 'did not run it' in _label(stub, 'a-1', True, 'lifted', A).message
        assert 'did not run it' in _label(stub, 'a-2', False, 'forged by B', B).message   # replica 2 cannot tell
    both = StoreSet(roots, 'fast')
    labels = {e.episode_id: e.label for e in both.episodes()}
    assert (labels['a-1']['success'], labels['a-1']['notes']) == (True, 'lifted') and labels['a-2'] is None
    assert both.foreign_labels == [('a-2', roots[1].resolve())]
    assert both.unmatched_labels() == []
    runs = {r['episode_id']: r['success'] for r in both.runs()}
    assert runs == {'a-1': True, 'a-2': None}
    res = export_jsonl(both, tmp_path / 'out', progress=False)
    rows = [json.loads(line) for line in (tmp_path / 'out' / 'episodes.jsonl').read_text().splitlines()]
    assert {r['episode_id']: r['label'] for r in rows} == {'a-1': {'success': True, 'notes': 'lifted'}, 'a-2': None}
    assert any('a-2' in note and 'another client' in note for note in res['notes']), res['notes']


def test_a_label_without_an_episode_id_is_refused(worker, tmp_path):
    """Attack: a Label with an empty episode id was stored as the label of episode ''."""
    with channel(worker.port) as ch:
        stub = pb_grpc.PolicyServiceStub(ch)
        with pytest.raises(grpc.RpcError) as err:
            stub.Label(pb.LabelRequest(deployment='fast', episode_id='', success=True),
                       metadata=[('authorization', 'Bearer s3cret')], timeout=5)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and 'episode_id' in err.value.details()
    assert CaptureStore(tmp_path / 'capture' / 'fast', 'fast').labels() == {}
