"""Error edges found by a break-it review, on a real worker over loopback.

- a plaintext client against a TLS worker (and the reverse) is told TLS at once, not after the timeout;
- a tensor shape whose size overflows int64 is a CONTRACT_VIOLATION (it was "worker internal error");
- an image is checked against its declared size from its header, before any pixel is decoded;
- after an inference timeout the next error says "inference exceeded", not "failed to load";
- ready() counts down from the deployment's measured load time;
- a closed Policy answers every call with EpisodeStateError (it raised gRPC's "closed channel" ValueError),
  and interrupt() on it does nothing;
- an episode begun with begin_episode() that the worker ends for idleness raises that error on the next
  next_action() once (it answered holds forever, with no signal).
"""

from __future__ import annotations

import io
import textwrap
import time

import numpy as np
import pytest
from doubles import CountingRobot
from PIL import Image
from test_worker_server import _self_signed
from test_worker_support import POLICIES, Stream, channel, state_request, wait_ready

from sequence_ai_ros.client import Observation, connect
from sequence_ai_ros.exceptions import ConnectionLost, ContractViolation, EpisodeStateError, NotReady
from sequence_ai_ros.protocol import codec
from sequence_ai_ros.protocol import sequence_ai_pb2 as pb
from sequence_ai_ros.protocol import sequence_ai_pb2_grpc as pb_grpc
from sequence_ai_ros.worker import create_server, serve_policy_file
from sequence_ai_ros.worker.registry import deploy

FAST = POLICIES / 'fast.py'
STUCK = POLICIES / 'worker_stuck.py'


def test_a_tls_mismatch_says_tls_at_once_both_ways(tmp_path):
    cert, key = _self_signed(tmp_path)
    with serve_policy_file(FAST, 'fast', tls=(cert, key)) as server:
        start = time.monotonic()
        with pytest.raises(ConnectionLost, match='speaks TLS but this client connects in plaintext'):
            connect('fast', endpoint=f'127.0.0.1:{server.port}', timeout=20)
        assert time.monotonic() - start < 10            # told at once, not after the 20 s handshake bound
        with connect('fast', endpoint=f'localhost:{server.port}', tls=cert) as policy:   # the right way works
            assert policy.contract.action_dim == 26
    with serve_policy_file(FAST, 'fast') as server:
        start = time.monotonic()
        with pytest.raises(ConnectionLost, match='with TLS but the worker .* speaks plaintext'):
            connect('fast', endpoint=f'127.0.0.1:{server.port}', tls=cert, timeout=20)
        assert time.monotonic() - start < 10


def test_nothing_listening_is_reported_as_no_worker_within_the_connect_timeout():
    import socket

    with socket.socket() as s:     # a port that was free a moment ago, nothing listens on it
        s.bind(('127.0.0.1', 0))
        port = s.getsockname()[1]
    with pytest.raises(ConnectionLost) as caught:
        connect('fast', endpoint=f'127.0.0.1:{port}', timeout=0.5)
    message = str(caught.value)
    assert 'no worker answered within 0.5 s (the connect timeout' in message
    assert f'endpoint 127.0.0.1:{port}; is `seq serve` running there?' in message
    assert 'DEADLINE_EXCEEDED' not in message


def test_a_shape_that_overflows_int64_is_a_contract_violation():
    huge = pb.Tensor(shape=[2 ** 62, 2 ** 62], dtype='float32', data=b'')   # int64 product wraps to 0
    with pytest.raises(ContractViolation, match='bytes for shape'):
        codec.from_tensor(huge)
    server = serve_policy_file(STUCK, 'stuck')
    ch = channel(server.port)
    try:
        stub = pb_grpc.PolicyServiceStub(ch)
        assert wait_ready(stub, 'stuck').ready
        stream = Stream(stub, 'stuck', 'overflow')
        assert stream.start().HasField('started')
        req = state_request(1, [0.5, -0.5], ['a', 'b'])
        req.state.CopyFrom(huge)
        reply = stream.ask(req)
        assert reply.HasField('error') and reply.error.code == pb.CONTRACT_VIOLATION, reply
        assert 'internal' not in reply.error.message
        assert stream.ask(state_request(2, [0.5, -0.5], ['a', 'b'])).HasField('chunk')   # the stream goes on
        stream.end()
    finally:
        ch.close()
        server.stop(grace=0.5)


def test_an_image_is_checked_against_its_header_before_decoding():
    buf = io.BytesIO()
    Image.new('RGB', (3840, 2160)).save(buf, format='PNG')          # ~24 KB that would decode to 25 MB
    bomb = pb.Image(key='cam', encoding='png', width=64, height=64, channels=3, data=buf.getvalue())
    with pytest.raises(ContractViolation, match='header says 3840x2160 but 64x64 is declared'):
        codec.decode_image(bomb)
    small = io.BytesIO()
    Image.fromarray(np.full((64, 64, 3), 7, np.uint8)).save(small, format='PNG')
    ok = pb.Image(key='cam', encoding='png', width=64, height=64, channels=3, data=small.getvalue())
    assert codec.decode_image(ok).shape == (64, 64, 3)


def test_after_an_inference_timeout_the_error_says_inference_exceeded():
    server = serve_policy_file(STUCK, 'stuck', inference_timeout_s=0.3, isolation='none')  # in-worker: failed
    try:
        with connect('stuck', endpoint=f'127.0.0.1:{server.port}') as policy:
            policy.wait_until_ready(timeout=30)
            obs = Observation(state=np.array([0.5, -0.5], np.float32), state_names=('a', 'b'), params={'hang': '20'})
            deadline = time.monotonic() + 15
            while policy.episode_outcome() is None and time.monotonic() < deadline:
                policy.next_action(obs)
                time.sleep(0.02)
            assert policy.episode_outcome().reason == 'error'
            with pytest.raises(NotReady) as info:
                policy.wait_until_ready(timeout=5)
            assert 'inference exceeded 0.3 s' in str(info.value) and 'failed to load' not in str(info.value)
    finally:
        for instance in getattr(server.runtimes['stuck'].definition.cls, 'instances', ()):
            instance.release.set()
        server.stop(grace=0.5)


def test_ready_counts_down_from_the_measured_load_time(tmp_path, seq_home):
    policy_file = tmp_path / 'slow' / 'policy.py'
    policy_file.parent.mkdir()
    policy_file.write_text(textwrap.dedent('''
        import time
        import numpy as np
        import sequence_ai_ros.policy as seq

        @seq.policy(action_space='joint_absolute', action_names=['a'], dt=0.1, chunk_length=2)
        class Slow:
            def load(self):
                time.sleep(1.5)

            def infer(self, inp, episode):
                return np.zeros((2, 1), np.float32)
    '''))
    record, figures = deploy(policy_file, home=seq_home)
    assert 1.4 < record.load_s < 10 and record.load_s == figures['load_s']
    server = create_server(home=seq_home)
    try:
        with connect('slow', endpoint=f'127.0.0.1:{server.port}') as policy:   # the handshake starts the load
            ready, eta = policy.ready()
            assert not ready and 0 < eta <= record.load_s    # not the 10 s default: the deploy measured the load
            policy.wait_until_ready(timeout=30)
            assert policy.ready() == (True, 0.0)
    finally:
        server.stop(grace=0.5)


def test_a_closed_policy_refuses_every_call_with_episode_state_error(serve):
    endpoint = serve(dt=0.01, chunk_length=10)
    policy = connect('lat', endpoint=endpoint)
    robot = CountingRobot()
    out = policy.run(robot.observe, robot.act, max_actions=5)
    assert out.reason == 'completed'
    policy.close()
    calls = {
        'ready': policy.ready,
        'wait_until_ready': lambda: policy.wait_until_ready(timeout=1),
        'label': lambda: policy.label(True),
        'begin_episode': policy.begin_episode,
        'next_action': lambda: policy.next_action(robot.observe()),
        'act': lambda: policy.act('pick', robot.observe, robot.act, max_seconds=1.0),
        'run': lambda: policy.run(robot.observe, robot.act, max_actions=5),
    }
    for name, call in calls.items():
        with pytest.raises(EpisodeStateError, match=r"Policy\('lat'\) is closed: connect\(\) again") as info:
            call()
        assert not isinstance(info.value, ValueError), name          # not gRPC's "closed channel"
    assert len(robot.actions) == 5                                    # nothing ran after close
    assert policy.interrupt() is None                                 # a documented no-op
    last = policy.end_episode()                                       # nothing sent: the last outcome
    assert last == policy.episode_outcome() and last.reason == 'completed' and last.episode_id == out.episode_id
    policy.close()                                                    # idempotent
    with connect('lat', endpoint=endpoint) as again:                  # a new handle works
        assert again.run(CountingRobot().observe, lambda a: None, max_actions=3).reason == 'completed'


def test_a_begun_episode_ended_for_idleness_raises_on_the_next_next_action_once(serve):
    endpoint = serve(dt=0.01, chunk_length=20, idle_timeout_s=0.4)
    with connect('lat', endpoint=endpoint) as policy:
        policy.wait_until_ready(timeout=30)
        eid = policy.begin_episode('pick')
        robot = CountingRobot()
        for _ in range(20):
            policy.next_action(robot.observe())
            time.sleep(0.01)
        deadline = time.monotonic() + 10
        while policy.episode_outcome() is None and time.monotonic() < deadline:
            time.sleep(0.05)                          # the robot pauses: no message reaches the worker
        out = policy.episode_outcome()
        assert out is not None and out.reason == 'error' and 'idle_timeout' in str(out.error)
        raised, answers = [], []
        deadline = time.monotonic() + 10
        while not raised and time.monotonic() < deadline:   # the worker's EpisodeEnded follows its error
            try:
                answers.append(policy.next_action(robot.observe()))
            except EpisodeStateError as exc:
                raised.append(exc)
            time.sleep(0.01)
        assert len(raised) == 1 and raised[0] is out.error and 'idle_timeout' in str(raised[0])
        assert all(a is None or a.hold for a in answers)       # before the end was confirmed: holds
        after = [policy.next_action(robot.observe()) for _ in range(5)]   # once: then holds again
        assert all(a is not None and a.hold for a in after)
        assert policy.stats()['episode_id'] == eid and policy.episode_outcome().reason == 'error'
        assert policy.end_episode().reason == 'error'         # it keeps its own reason
        policy.next_action(robot.observe())                   # a new (implicit) episode opens
        assert policy.stats()['episode_id'] != eid and policy.episode_outcome() is None
