"""Admission on a real gRPC worker: the 256-idle-streams attack no longer locks robots out.

- a stream that sends no EpisodeStart within ``start_timeout_s`` is closed (typed EPISODE_STATE);
- one client holds at most ``max_streams_per_client`` streams; behind a trusted balancer the client is the
  ``x-forwarded-for`` address, and a client that is not a trusted proxy cannot spoof it;
- with a token, streams without it never get a slot, so the token's holders keep the whole capacity;
- with a token and ``anonymous_streams``, token-less streams hold at most that many slots (the rest is headroom
  for token holders), and a client's token-less streams are capped apart from its token streams.
"""

from __future__ import annotations

import grpc
import pytest
from test_worker_support import POLICIES, Stream, channel, state_request, wait_for, wait_ready

from sequence_ai_ros.exceptions import Overloaded, Unauthenticated
from sequence_ai_ros.protocol import errors as perrors
from sequence_ai_ros.protocol import sequence_ai_pb2 as pb
from sequence_ai_ros.protocol import sequence_ai_pb2_grpc as pb_grpc
from sequence_ai_ros.worker import serve_policy_file

FAST = POLICIES / 'fast.py'
NAMES = ['j0', 'j1']
ATTACK = 256


def _robot_runs(stub, episode_id: str, metadata=()) -> None:
    robot = Stream(stub, 'fast', episode_id, metadata=metadata)
    started = robot.start()
    assert started is not None and started.HasField('started'), (started, robot.error)
    reply = robot.ask(state_request(1, [0.1, 0.2], NAMES))
    assert reply.HasField('chunk') and reply.chunk.request_id == 1
    assert robot.end().HasField('ended')


def _refusal(stream: Stream):
    """Drain the stream; return its typed refusal (in-stream, or a status), or None when it was admitted.

    An admitted idle stream gets an Error and EpisodeEnded; a refused one its refusal (``Error.refusal``)
    at its start timeout, and it then ends when the robot closes its side.
    """
    replies = []
    while (reply := stream.recv(timeout=30)) is not None:
        replies.append(reply)
        if reply.error.refusal:
            stream.close()
    if replies and replies[0].error.refusal:
        assert len(replies) == 1 and stream.error is None, (replies, stream.error)
        return perrors.from_error(replies[0].error)
    if stream.error is None:
        assert 'no EpisodeStart within' in replies[0].error.message and replies[1].HasField('ended')
        return None
    return perrors.from_rpc_error(stream.error)


def proxy_channel(server) -> grpc.Channel:
    """A channel through the worker's proxy socket (as the fleet's HAProxy connects)."""
    return grpc.insecure_channel(f'unix:{server.config.proxy_socket}')


@pytest.mark.slow
def test_idle_streams_from_one_client_are_capped_and_closed_while_robots_run(tmp_path):
    # start_timeout_s: all 256 streams must open before the first admitted ones time out and free their slots
    with serve_policy_file(FAST, 'fast', dim=2, start_timeout_s=8.0, max_streams_per_client=32,
                           proxy_socket=str(tmp_path / 'proxy.sock')) as server, proxy_channel(server) as ch:
        stub = pb_grpc.PolicyServiceStub(ch)
        assert wait_ready(stub, 'fast').ready
        attacker = [('x-forwarded-for', '203.0.113.66')]
        idle = [Stream(stub, 'fast', f'idle{i}', metadata=attacker) for i in range(ATTACK)]
        # a robot of another client starts and is served while the attack holds its 32 streams
        _robot_runs(stub, 'robot-1', metadata=[('x-forwarded-for', '198.51.100.7')])
        errors = [_refusal(s) for s in idle]
        overloaded = [e for e in errors if isinstance(e, Overloaded)]
        assert len(overloaded) == ATTACK - 32
        assert all('max_streams_per_client' in str(e) and e.refusal == 'per_client' for e in overloaded)
        # the 32 admitted idle streams were told why (checked in _refusal) and closed
        assert sum(e is None for e in errors) == 32
        wait_for(lambda: server.servicer.open_streams() == 0, timeout=10, what='the idle streams to close')
        # after the attack, the attacker's address gets streams again (its slots were released)
        _robot_runs(stub, 'robot-2', metadata=attacker)


def test_idle_stream_gets_a_typed_error_before_it_is_closed():
    with serve_policy_file(FAST, 'fast', dim=2, start_timeout_s=0.5) as server, channel(server.port) as ch:
        stub = pb_grpc.PolicyServiceStub(ch)
        idle = Stream(stub, 'fast', 'silent')
        err = idle.recv(timeout=10)
        assert err.error.code == pb.EPISODE_STATE and 'no EpisodeStart within 0.5 s' in err.error.message
        assert idle.recv(timeout=10).HasField('ended')
        assert idle.recv(timeout=10) is None


@pytest.mark.slow
def test_forwarded_address_is_ignored_from_untrusted_peers():
    with serve_policy_file(FAST, 'fast', dim=2, max_streams_per_client=3) as server, channel(server.port) as ch:
        stub = pb_grpc.PolicyServiceStub(ch)
        assert wait_ready(stub, 'fast').ready
        streams = [Stream(stub, 'fast', f's{i}', metadata=[('x-forwarded-for', f'10.0.0.{i}')]) for i in range(4)]
        assert all(s.start().HasField('started') for s in streams[:3])
        err = _refusal(streams[3])
        assert isinstance(err, Overloaded) and '127.0.0.1' in str(err)
        for s in streams[:3]:
            s.end()
        assert server.servicer.open_streams() == 0 or wait_for(lambda: server.servicer.open_streams() == 0)


def test_with_a_token_anonymous_streams_get_no_slot():
    token = [('authorization', 'Bearer s3cret')]
    with serve_policy_file(FAST, 'fast', dim=2, token='s3cret', max_streams=8, max_streams_per_client=0) as server, \
            channel(server.port) as ch:
        stub = pb_grpc.PolicyServiceStub(ch)
        assert wait_ready(stub, 'fast', metadata=token).ready
        anonymous = [Stream(stub, 'fast', f'anon{i}') for i in range(ATTACK)]
        errors = [_refusal(s) for s in anonymous]
        assert {type(e) for e in errors} == {Unauthenticated}
        assert server.servicer.open_streams() == 0
        _robot_runs(stub, 'robot-token', metadata=token)


def _refused(stream: Stream, reply) -> Overloaded:
    """The typed refusal that ``reply`` (the answer to EpisodeStart) carries; the stream then closes."""
    assert reply is not None and reply.error.refusal, (reply, stream.error)
    stream.close()
    return perrors.from_error(reply.error)


def _overloaded(stream: Stream) -> str:
    """The refused stream's typed OVERLOADED message (its refusal, the reply to EpisodeStart)."""
    reply = stream.start()
    assert reply is not None and reply.error.refusal, ('the stream was admitted', reply, stream.error)
    err = perrors.from_error(reply.error)
    assert isinstance(err, Overloaded), reply
    stream.close()
    assert stream.recv(timeout=10) is None and stream.error is None   # ended once the robot closed its side
    return str(err)


def test_with_a_token_anonymous_streams_leave_headroom_for_token_holders(tmp_path):
    # the 256-idle-streams attack from 256 addresses (per-client caps cannot stop it) without the token, on a
    # worker that admits token-less robots: they hold at most anonymous_streams slots, the rest is kept
    token = [('authorization', 'Bearer s3cret')]
    with serve_policy_file(FAST, 'fast', dim=2, token='s3cret', max_streams=40, anonymous_streams=8,
                           max_streams_per_client=0, proxy_socket=str(tmp_path / 'proxy.sock')) as server, \
            proxy_channel(server) as ch:
        stub = pb_grpc.PolicyServiceStub(ch)
        assert wait_ready(stub, 'fast').ready   # a caller without the token may ask
        attack = [Stream(stub, 'fast', f'anon{i}', metadata=[('x-forwarded-for', f'203.0.{i // 200}.{i % 200}')])
                  for i in range(ATTACK)]
        # each one starts an episode and then idles: it would hold its slot for the whole idle timeout
        first = {s: s.start() for s in attack}
        started = [s for s in attack if first[s] is not None and first[s].HasField('started')]
        assert len(started) == 8 and server.servicer.open_streams() == 8
        refused = [str(_refused(s, first[s])) for s in attack if s not in started]
        assert len(refused) == ATTACK - 8 and all('anonymous_streams' in m and '32 are kept for token holders' in m
                                                  for m in refused)
        # while the attack holds, token holders get every one of the other 32 slots and are served
        robots = [Stream(stub, 'fast', f'robot{i}', metadata=[*token, ('x-forwarded-for', f'198.51.100.{i}')])
                  for i in range(32)]
        for robot in robots:
            assert robot.start().HasField('started'), robot.error
            assert robot.ask(state_request(1, [0.1, 0.2], NAMES)).HasField('chunk')
        assert 'max_streams' in _overloaded(Stream(stub, 'fast', 'robot-extra', metadata=token))
        # a wrong token is still refused, whatever the anonymous allowance
        wrong = Stream(stub, 'fast', 'wrong', metadata=[('authorization', 'Bearer nope')])
        assert isinstance(_refusal(wrong), Unauthenticated)
        for stream in [*started, *robots]:
            assert stream.end().HasField('ended')
        wait_for(lambda: server.servicer.open_streams() == 0, what='the streams to close')
        _robot_runs(stub, 'anon-after')   # the anonymous slots were released


def test_a_clients_token_less_streams_do_not_take_its_token_streams_slots():
    # robots behind one address (a NAT, or a balancer that is not trusted): an attacker there without the
    # token fills that address's per-client cap for token-less streams only
    token = [('authorization', 'Bearer s3cret')]
    with serve_policy_file(FAST, 'fast', dim=2, token='s3cret', max_streams=64, anonymous_streams=32,
                           max_streams_per_client=4) as server, channel(server.port) as ch:
        stub = pb_grpc.PolicyServiceStub(ch)
        assert wait_ready(stub, 'fast', metadata=token).ready
        attack = [Stream(stub, 'fast', f'anon{i}') for i in range(ATTACK)]
        first = {s: s.start() for s in attack}
        started = [s for s in attack if first[s] is not None and first[s].HasField('started')]
        assert len(started) == 4
        refused = [str(_refused(s, first[s])) for s in attack if s not in started]
        assert len(refused) == ATTACK - 4
        assert all('127.0.0.1' in m and '4 episode streams without the token' in m for m in refused)
        robots = [Stream(stub, 'fast', f'robot{i}', metadata=token) for i in range(4)]
        for robot in robots:
            assert robot.start().HasField('started'), robot.error
            assert robot.ask(state_request(1, [0.1, 0.2], NAMES)).HasField('chunk')
        message = _overloaded(Stream(stub, 'fast', 'robot-extra', metadata=token))
        assert 'max_streams_per_client' in message and 'without the token' not in message
        for stream in [*started, *robots]:
            assert stream.end().HasField('ended')
