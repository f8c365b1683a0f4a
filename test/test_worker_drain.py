"""Drain of one worker in process (``WorkerServer.drain``, what ``seq serve`` does on SIGTERM).

New episodes get the typed ``draining`` refusal in the stream, the deployment's health turns NOT_SERVING
while the server's own (liveness) stays SERVING, a live episode goes on until the drain timeout and is then
cut with reason ``drain_timeout``. The fleet's rolling restart through HAProxy is test_fleet_drain.py.
"""

from __future__ import annotations

import logging
import socket
import threading
import time

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from test_worker_support import POLICIES, Stream, channel, handshake, state_request, wait_for, wait_ready

from sequence_ai_ros.client import Observation, connect
from sequence_ai_ros.exceptions import Draining, NotReady
from sequence_ai_ros.protocol import errors as perrors
from sequence_ai_ros.protocol import sequence_ai_pb2 as pb
from sequence_ai_ros.protocol import sequence_ai_pb2_grpc as pb_grpc
from sequence_ai_ros.worker import serve_policy_file

FAST = POLICIES / 'fast.py'
NAMES = ['j0', 'j1']
SERVING = health_pb2.HealthCheckResponse.SERVING


def _health(ch, service: str) -> int:
    return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


def test_drain_refuses_new_episodes_typed_and_cuts_the_live_one_at_its_timeout():
    with serve_policy_file(FAST, 'fast', dim=2) as server, channel(server.port) as ch:
        stub = pb_grpc.PolicyServiceStub(ch)
        assert wait_ready(stub, 'fast').ready
        live = Stream(stub, 'fast', 'live')
        assert live.start().HasField('started')
        cut: list[int] = []
        drainer = threading.Thread(target=lambda: cut.append(server.drain(1.0)), name='drain')
        drainer.start()
        wait_for(lambda: server.servicer.drain.draining, what='the drain to begin')
        refused = Stream(stub, 'fast', 'new')
        reply = refused.start()
        error = perrors.from_error(reply.error)
        assert isinstance(error, Draining) and error.refusal == 'draining', reply
        refused.close()
        assert refused.recv(timeout=10) is None and refused.error is None   # ended once the robot closed
        assert _health(ch, 'fast') != SERVING and _health(ch, '') == SERVING
        # the live episode is still served while the drain lasts
        assert live.ask(state_request(1, [0.1, 0.2], NAMES)).HasField('chunk')
        drainer.join(timeout=15)
        assert cut == [1]
        err = live.recv(timeout=10)
        assert isinstance(perrors.from_error(err.error), NotReady) and 'drain_timeout' in err.error.message
        assert live.recv(timeout=10).HasField('ended')


def test_drain_returns_at_once_when_the_episodes_end():
    with serve_policy_file(FAST, 'fast', dim=2) as server, channel(server.port) as ch:
        stub = pb_grpc.PolicyServiceStub(ch)
        assert wait_ready(stub, 'fast').ready
        live = Stream(stub, 'fast', 'live')
        assert live.start().HasField('started')
        cut: list[int] = []
        drainer = threading.Thread(target=lambda: cut.append(server.drain(60.0)), name='drain')
        drainer.start()
        assert live.end().HasField('ended')
        drainer.join(timeout=15)
        assert not drainer.is_alive() and cut == [0]


def _probe(port: int) -> str:
    """One HAProxy agent-check probe: the agent's answer line."""
    with socket.create_connection(('127.0.0.1', port), timeout=10) as s:
        s.settimeout(10)
        return s.recv(64).decode().strip()


def test_a_drain_behind_a_polling_balancer_lasts_until_it_heard_drain_twice():
    """No episode is open, yet the drain waits for the balancer: two probes answered ``drain``, then it returns.

    Without the wait a replica whose episodes had ended stopped before HAProxy's next agent probe, while
    HAProxy still hashed new calls to it: they failed as ConnectionLost instead of the typed, retried refusal.
    Without a balancer polling the agent, the drain returns at once (test_drain_returns_at_once...).
    """
    with serve_policy_file(FAST, 'fast', dim=2, host='127.0.0.1', port=0, agent_port=0, warm=True) as server:
        port = server.agent.port
        wait_for(lambda: _probe(port) == 'up ready', timeout=30, what='the agent up')    # a balancer polls it
        left: list[int] = []
        drainer = threading.Thread(target=lambda: left.append(server.drain(60.0)), name='drain')
        drainer.start()
        wait_for(lambda: server.servicer.drain.draining, timeout=30, what='the drain to begin')
        for _ in range(2):
            drainer.join(timeout=0.2)
            assert drainer.is_alive(), 'the drain ended before the balancer heard it'
            assert _probe(port) == 'drain'
        drainer.join(timeout=30)
        assert not drainer.is_alive() and left == [0]


def test_a_drain_whose_balancer_stopped_polling_does_not_wait_for_it():
    """The balancer polled, then stopped (``seq fleet`` stops HAProxy before its replicas): the drain ends anyway."""
    with serve_policy_file(FAST, 'fast', dim=2, host='127.0.0.1', port=0, agent_port=0, warm=True) as server:
        wait_for(lambda: _probe(server.agent.port) == 'up ready', timeout=30, what='the agent up')
        left: list[int] = []
        drainer = threading.Thread(target=lambda: left.append(server.drain(60.0)), name='drain')
        drainer.start()
        drainer.join(timeout=30)        # bounded: QUIET_S without a probe, far below the drain's 60 s
        assert not drainer.is_alive() and left == [0]


def test_a_draining_worker_refuses_the_handshake_typed_and_is_not_ready(caplog):
    """The handshake is refused as Draining (the client sends it again, then raises it); Ready says draining."""
    caplog.set_level(logging.INFO, logger='sequence_ai_ros.client.session')
    with serve_policy_file(FAST, 'fast', dim=2) as server, channel(server.port) as ch:
        endpoint = f'127.0.0.1:{server.port}'
        stub = pb_grpc.PolicyServiceStub(ch)
        with connect('fast', endpoint=endpoint) as before:       # connected while the worker serves
            before.wait_until_ready(timeout=10)
            assert before.ready()[0] is True
            assert server.drain(1.0) == 0                         # no episode open: it returns at once, draining
            with pytest.raises(grpc.RpcError) as refused:
                handshake(stub, 'fast')
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            error = perrors.from_rpc_error(refused.value)
            assert isinstance(error, Draining) and error.refusal == 'draining', error
            reply = stub.Ready(pb.ReadyRequest(deployment='fast'), timeout=5)
            assert (reply.ready, reply.state) == (False, 'draining') and 'draining' in reply.message, reply
            assert before.ready()[0] is False
            with pytest.raises(Draining):
                before.wait_until_ready(timeout=1.0)
        with pytest.raises(Draining):
            connect('fast', endpoint=endpoint, timeout=2.0)
        again = [r for r in caplog.records if r.name == 'sequence_ai_ros.client.session' and 'sending it again' in
                 r.getMessage()]
        assert again, 'the refused handshake was not sent again'


def test_an_episode_refused_until_its_max_seconds_ran_out_ends_with_the_refusal_not_a_timeout():
    """Its outcome names the refusal (reason error, Draining), and run() raises it, whatever max_seconds."""
    observe = lambda: Observation(state=np.zeros(2, np.float32))    # noqa: E731
    with serve_policy_file(FAST, 'fast', dim=2) as server:
        with connect('fast', endpoint=f'127.0.0.1:{server.port}') as policy:
            policy.wait_until_ready(timeout=10)
            assert server.drain(1.0) == 0
            policy.begin_episode(max_seconds=1.0)                 # shorter than the client's 5 s of retries
            deadline = time.monotonic() + 10
            while policy.episode_outcome() is None and time.monotonic() < deadline:
                action = policy.next_action(observe())
                assert action is None or action.hold               # nothing to act on: the episode never ran
                time.sleep(0.02)
            out = policy.end_episode()
            assert out is not None and out.reason == 'error' and isinstance(out.error, Draining), out
            assert (out.actions, out.chunks, out.worker_confirmed) == (0, 0, False)
            assert 'error (Draining: this replica is draining' in str(out), str(out)
            acted: list = []
            with pytest.raises(Draining):
                policy.run(observe, acted.append, max_actions=None, max_seconds=1.0)
            assert acted == []
