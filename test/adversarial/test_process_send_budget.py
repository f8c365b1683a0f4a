"""Calls pipelined behind a busy deployment process never block the worker's event loop in a send.

A robot may send params of up to 64 x 4096 characters (limits.MAX_PARAMS, MAX_TEXT): a call's header of ~60 KB.
The process reads its next call only after answering the running one, so what the worker sends behind it sits
in the socket; past the socket's send buffer a send blocked the event loop until the policy returned (every
deployment of the worker froze: Ready, other robots), and with an answer the process could not write meanwhile
(a large chunk) neither side ever read again. A call that would pass the budget (half the send buffer) waits in
the deployment's queue instead, and is sent as answers come. Run with the buffer the kernel gives and with a
small one (the budget binds at the second call).
"""

from __future__ import annotations

import textwrap
import threading
import time

import pytest
from test_worker_support import Stream, serving, state_request, wait_for

from sequence_ai_ros.protocol import codec
from sequence_ai_ros.protocol import sequence_ai_pb2 as pb
from sequence_ai_ros.worker import policy_process

WAIT_S = 60.0

POLICY = textwrap.dedent('''
    import os, time
    import numpy as np
    import sequence_ai_ros.policy as seq

    NAMES = ['a', 'b']
    ACTIONS = [f'j{k}' for k in range(64)]
    ROWS = int(os.environ.get('SEND_BUDGET_ROWS', '4'))

    @seq.policy(action_space='joint_absolute', action_names=ACTIONS, dt=0.1, chunk_length=ROWS,
                observation=seq.ObservationContract(state_names=NAMES))
    class Gated:
        def infer(self, inp, episode):
            p = inp.observation.params
            if 'gate' in p:
                deadline = time.monotonic() + 60
                while not os.path.exists(p['gate']) and time.monotonic() < deadline:
                    time.sleep(0.005)
            return np.full((ROWS, 64), inp.observation.state[0], np.float32)
''')

#: 15 params of 4000 characters: ~60 KB of header, within the limits.
BIG_PARAMS = {f'p{k}': 'x' * 4000 for k in range(15)}


def req(rid: int, value: float, **params: str) -> pb.ObservationRequest:
    return state_request(rid, [value, 0.0], ['a', 'b'], params=params)


@pytest.fixture
def served(tmp_path, monkeypatch, request):
    rows, buffer = request.param
    monkeypatch.setenv('SEND_BUDGET_ROWS', str(rows))
    if buffer:
        monkeypatch.setattr(policy_process, 'SOCKET_SEND_BUFFER_BYTES', buffer)
    path = tmp_path / 'gated' / 'policy.py'
    path.parent.mkdir(parents=True)
    path.write_text(POLICY)
    with serving(path, 'gated', timeout=WAIT_S, inference_timeout_s=120.0, idle_timeout_s=120) as served:
        yield served


def _ready_within(stub, seconds: float) -> bool:
    """Whether the worker answers Ready within ``seconds`` (its event loop runs)."""
    try:
        stub.Ready(pb.ReadyRequest(deployment='gated'), timeout=seconds)
        return True
    except Exception:
        return False


def _behind_a_held_inference(stub, runtime, gate) -> list[Stream]:
    """8 robots: the first's request held in ``infer`` until ``gate`` exists, then 7 with ~60 KB headers each."""
    robots = [Stream(stub, 'gated', f'robot-{k}') for k in range(8)]
    for robot in robots:
        assert robot.start().HasField('started')
    robots[0].send(observation=req(1, 1, gate=str(gate)))
    wait_for(lambda: runtime.scheduler.pipelined == 1, WAIT_S, 'the first inference in flight')
    for k in range(1, 8):
        robots[k].send(observation=req(1, 1 + k, **BIG_PARAMS))
    return robots


@pytest.mark.parametrize('served', [(4, 0), (4, 64 << 10)], indirect=True, ids=['kernel-buffer', 'small-buffer'])
def test_large_headers_behind_a_slow_inference_do_not_freeze_the_worker(served, tmp_path):
    _, stub, runtime = served
    gate = tmp_path / 'gate'
    robots = _behind_a_held_inference(stub, runtime, gate)
    # the requests reach the event loop: pipelined, or queued behind those when the budget binds
    wait_for(lambda: runtime.scheduler.queue_depth == 7, WAIT_S, 'the requests behind the held one')
    time.sleep(0.5)
    try:
        # the policy is busy (held at the gate); the worker must still answer anything else
        assert _ready_within(stub, 10.0), 'the worker froze: its event loop is blocked in a send to the process'
    finally:
        gate.touch()
    for k, robot in enumerate(robots):
        reply = robot.recv(timeout=WAIT_S)
        assert reply is not None and reply.HasField('chunk'), reply
        assert float(codec.from_tensor(reply.chunk.actions)[0, 0]) == 1 + k


@pytest.mark.parametrize('served', [(1000, 0), (1000, 64 << 10)], indirect=True,   # a (1000, 64) float32: 256 KB
                         ids=['kernel-buffer', 'small-buffer'])
def test_large_headers_and_a_large_chunk_never_deadlock_the_worker(served, tmp_path):
    _, stub, runtime = served
    gate = tmp_path / 'gate'
    robots = _behind_a_held_inference(stub, runtime, gate)
    threading.Timer(2.0, gate.touch).start()
    for k, robot in enumerate(robots):
        reply = robot.recv(timeout=WAIT_S)
        assert reply is not None and reply.HasField('chunk'), f'robot-{k}: {reply}'
        assert float(codec.from_tensor(reply.chunk.actions)[0, 0]) == 1 + k
    assert _ready_within(stub, 10.0)
