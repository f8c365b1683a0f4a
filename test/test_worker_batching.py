"""Batched inference: a policy declaring ``seq.Batching`` gets requests of different episodes in one call.

The policy is the bench's torch-free iterative numpy MLP (few steps here). Its batch cost grows sublinearly
because one pass of the MLP serves the whole batch: the tests count passes per request, not seconds.
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
from test_worker_support import Stream, channel, handshake, state_request, wait_for, wait_ready

import sequence_ai_ros.policy as seq
from sequence_ai_ros.exceptions import ConfigError
from sequence_ai_ros.protocol import codec
from sequence_ai_ros.protocol import sequence_ai_pb2 as pb
from sequence_ai_ros.protocol import sequence_ai_pb2_grpc as pb_grpc
from sequence_ai_ros.worker.scheduler import InferenceScheduler
from sequence_ai_ros.worker.server import serve_policy_file

MLP = Path(seq.__file__).resolve().parents[1] / 'bench' / 'policies' / 'mlp_policy.py'
NAMES = [f'j{i}' for i in range(14)]


def test_batching_is_declared_and_validated():
    @seq.policy(action_space='joint_absolute', action_names=['a'], dt=0.1, chunk_length=2,
                batching=seq.Batching(max_batch_size=4, max_wait_s=0.01))
    class Ok:
        def infer(self, inp, episode):
            return np.zeros((2, 1), np.float32)

        def infer_batch(self, inputs, episodes):
            return [np.zeros((2, 1), np.float32) for _ in inputs]

    assert seq.spec_of(Ok).batching == seq.Batching(4, 0.01)
    with pytest.raises(ConfigError, match='needs an infer_batch'):
        seq.policy(action_space='joint_absolute', action_names=['a'], dt=0.1, chunk_length=2,
                   batching=seq.Batching())(type('NoBatch', (), {'infer': lambda self, i, e: None}))
    for bad in (dict(max_batch_size=0), dict(max_batch_size=2.0), dict(max_wait_s=-1), dict(max_wait_s=float('inf'))):
        with pytest.raises(ConfigError, match='Batching'):
            seq.Batching(**bad)
    with pytest.raises(ConfigError, match='must be a seq.Batching'):
        seq.policy(action_space='joint_absolute', action_names=['a'], dt=0.1, chunk_length=2, batching=8)


def test_scheduler_batches_oldest_first_and_starves_no_one():
    calls: list[list[int]] = []
    gate = threading.Event()

    def batch_call(payloads):
        gate.wait(5)
        calls.append(list(payloads))
        return [p * 10 if p != 7 else ValueError('seven') for p in payloads]

    sched = InferenceScheduler('t', max_pending=64, batching=(4, 0.0, batch_call))
    try:
        futures = [sched.submit(f'ep{i}', lambda: None, payload=i) for i in range(11)]
        gate.set()
        results = [f.exception(5) or f.result(5)[0] for f in futures]
    finally:
        sched.stop()
    # every request is served, each in exactly one batch, in arrival order, at most 4 per call
    assert [p for call in calls for p in call] == list(range(11))
    assert all(1 <= len(call) <= 4 for call in calls) and len(calls) <= 5
    assert results[:7] == [0, 10, 20, 30, 40, 50, 60] and isinstance(results[7], ValueError)
    assert results[8:] == [80, 90, 100]


@pytest.fixture
def mlp_server():
    with serve_policy_file(MLP, 'mlp', steps=20, isolation='none') as server:  # reads the instance
        ch = channel(server.port)
        stub = pb_grpc.PolicyServiceStub(ch)
        handshake(stub, 'mlp')
        assert wait_ready(stub, 'mlp').ready
        yield server, stub
        ch.close()


def test_concurrent_episodes_share_calls_and_keep_their_own_state(mlp_server):
    server, stub = mlp_server
    robots = [Stream(stub, 'mlp', f'robot-{k}') for k in range(8)]
    for r in robots:
        assert r.start().HasField('started')
    rng = np.random.default_rng(1)
    states = {r.episode_id: [rng.standard_normal(14).astype(np.float32) for _ in range(6)] for r in robots}
    for rid in range(1, 7):  # every robot sends its request at once, then waits for its chunk
        for r in robots:
            r.send(observation=state_request(rid, states[r.episode_id][rid - 1], NAMES))
        for r in robots:
            reply = r.recv()
            assert reply.HasField('chunk'), reply
            assert reply.chunk.request_id == rid and reply.chunk.episode_id == r.episode_id
            policy = server.runtimes['mlp']._instance.policy
            expected = policy.forward(states[r.episode_id][rid - 1][None])[0]
            np.testing.assert_allclose(codec.from_tensor(reply.chunk.actions), expected, rtol=1e-5, atol=1e-6)
    policy = server.runtimes['mlp']._instance.policy
    # 48 requests in fewer MLP passes than requests: the batch cost grows sublinearly in requests
    assert sum(policy.batch_sizes) == 48 and max(policy.batch_sizes) > 1
    assert len(policy.batch_sizes) < 48 and max(policy.batch_sizes) <= 8
    episodes = {a.episode.id: a.episode for a in server.runtimes['mlp'].running_episodes()}
    assert {eid: ep.state['requests'] for eid, ep in episodes.items()} == {r.episode_id: 6 for r in robots}
    for r in robots:
        ended = r.end()
        assert ended.HasField('ended') and ended.ended.episode_id == r.episode_id
    assert all(not ep.state for ep in episodes.values())  # on_episode ran once per episode


def test_a_failing_batch_fails_its_requests_and_the_streams_go_on(tmp_path):
    path = tmp_path / 'flaky' / 'policy.py'
    path.parent.mkdir()
    path.write_text('''
import numpy as np
import sequence_ai_ros.policy as seq

@seq.policy(action_space='joint_absolute', action_names=['a'], dt=0.1, chunk_length=2,
            observation=seq.ObservationContract(state_names=['a']), batching=seq.Batching(4, 0.05))
class Flaky:
    def infer(self, inp, episode):
        return self.infer_batch([inp], [episode])[0]

    def infer_batch(self, inputs, episodes):
        if any(i.observation.state[0] < 0 for i in inputs):
            raise RuntimeError('negative state')
        return [np.full((2, 1), i.observation.state[0], np.float32) if i.observation.state[0] != 5
                else np.zeros((3, 1), np.float32) for i in inputs]
''')
    with serve_policy_file(path, 'flaky') as server:
        ch = channel(server.port)
        stub = pb_grpc.PolicyServiceStub(ch)
        handshake(stub, 'flaky')
        assert wait_ready(stub, 'flaky').ready
        a, b = Stream(stub, 'flaky', 'a'), Stream(stub, 'flaky', 'b')
        a.start(), b.start()
        a.send(observation=state_request(1, [-1.0], ['a']))
        b.send(observation=state_request(1, [2.0], ['a']))
        ra, rb = a.recv(), b.recv()
        assert ra.error.code == pb.POLICY_EXCEPTION and 'negative state' in ra.error.message
        if rb.HasField('error'):  # gathered into the same batch: it fails with it
            assert rb.error.code == pb.POLICY_EXCEPTION
        a.send(observation=state_request(2, [5.0], ['a']))
        b.send(observation=state_request(2, [3.0], ['a']))
        ra, rb = a.recv(), b.recv()
        assert ra.error.code == pb.CONTRACT_VIOLATION  # its own malformed chunk only
        assert rb.HasField('chunk') and rb.chunk.request_id == 2
        a.end(), b.end()
        ch.close()


def test_an_exception_returned_for_one_request_fails_only_that_request(tmp_path):
    # the lerobot template returns a PolicyException for a request with too few frames: its batch-mates are served
    path = tmp_path / 'picky' / 'policy.py'
    path.parent.mkdir()
    path.write_text('''
import numpy as np
import sequence_ai_ros.policy as seq
from sequence_ai_ros.exceptions import PolicyException

@seq.policy(action_space='joint_absolute', action_names=['a'], dt=0.1, chunk_length=2,
            observation=seq.ObservationContract(state_names=['a']), batching=seq.Batching(2, 5.0))
class Picky:
    def __init__(self):
        self.batches = []

    def infer(self, inp, episode):
        return self.infer_batch([inp], [episode])[0]

    def infer_batch(self, inputs, episodes):
        self.batches.append(sorted(e.id for e in episodes))
        return [PolicyException('seven is refused') if i.observation.state[0] == 7
                else np.full((2, 1), i.observation.state[0], np.float32) for i in inputs]
''')
    with serve_policy_file(path, 'picky', isolation='none') as server:  # reads the instance
        ch = channel(server.port)
        stub = pb_grpc.PolicyServiceStub(ch)
        handshake(stub, 'picky')
        assert wait_ready(stub, 'picky').ready
        a, b = Stream(stub, 'picky', 'a'), Stream(stub, 'picky', 'b')
        a.start(), b.start()
        for rid in (1, 2):
            a.send(observation=state_request(rid, [7.0], ['a']))
            b.send(observation=state_request(rid, [3.0], ['a']))
            ra, rb = a.recv(), b.recv()
            assert ra.error.code == pb.POLICY_EXCEPTION and 'seven is refused' in ra.error.message
            assert rb.HasField('chunk') and rb.chunk.request_id == rid
            np.testing.assert_array_equal(codec.from_tensor(rb.chunk.actions), np.full((2, 1), 3.0, np.float32))
        # both requests of each round went in one call (the batch fills at 2 before its 5 s wait)
        assert server.runtimes['picky']._instance.policy.batches == [['a', 'b'], ['a', 'b']]
        assert a.end().HasField('ended') and b.end().HasField('ended')
        ch.close()


@pytest.mark.parametrize('batched', [False, True])
def test_an_episode_may_submit_again_as_soon_as_its_chunk_is_out(batched):
    # the robot answers a chunk at once: its next request must not be refused as "already in flight"
    plan = (4, 0.0, lambda payloads: [p for p in payloads]) if batched else None
    sched = InferenceScheduler('t', batching=plan)
    outcomes = []

    def resubmit(future) -> None:
        try:
            outcomes.append(sched.submit('ep', lambda: 2, payload=2))
        except Exception as exc:
            outcomes.append(exc)

    try:
        first = sched.submit('ep', lambda: 1, payload=1)
        first.add_done_callback(resubmit)  # runs on the inference thread, right when the future settles
        assert first.result(5)[0] == 1
        wait_for(lambda: outcomes, what='the second request')
        assert not isinstance(outcomes[0], Exception), outcomes
        assert outcomes[0].result(5)[0] == 2
    finally:
        sched.stop()
