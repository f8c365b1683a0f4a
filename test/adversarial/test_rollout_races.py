"""Rollouts under rapid deploys, drains and stops.

``seq deploy`` twice in a row, a deploy during a drain, a stop while a new version loads.

The policy's actions are its version's value; its ``load()`` can be held at a gate (a file) so that a test
decides when a version's load ends, and tells when it has begun (a second file).
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from test_worker_support import Stream, channel, state_request, wait_for, wait_ready

from sequence_ai_ros.protocol import codec
from sequence_ai_ros.protocol import sequence_ai_pb2 as pb
from sequence_ai_ros.protocol import sequence_ai_pb2_grpc as pb_grpc
from sequence_ai_ros.worker import create_server
from sequence_ai_ros.worker.registry import Registry, deploy

POLICY = '''
import os
import time

import numpy as np

import sequence_ai_ros.policy as seq

NAMES = ['a', 'b']
GATE = {gate!r}


@seq.policy(action_space='joint_absolute', action_names=NAMES, dt=0.05, chunk_length=4,
            observation=seq.ObservationContract(state_names=NAMES))
class Gated:
    def load(self):
        if GATE and os.path.exists(GATE):
            open(GATE + '.entered', 'w').close()
        deadline = time.monotonic() + 60
        while GATE and os.path.exists(GATE) and time.monotonic() < deadline:
            time.sleep(0.02)

    def infer(self, inp, episode):
        return np.array([[{value}, 0.0]] * 4, np.float32)
'''


def write(path: Path, value: float, gate: Path | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(POLICY.format(value=value, gate=str(gate) if gate else ''))
    return path


def served(stub) -> tuple[int, float]:
    """(deployment version, action value) of a new episode's first chunk."""
    stream = Stream(stub, 'arm', 'probe')
    version = stream.start().started.deployment_version
    reply = stream.ask(state_request(1, [0.0, 0.0], ['a', 'b']))
    assert reply.HasField('chunk'), reply
    assert stream.end().HasField('ended')
    return version, float(codec.from_tensor(reply.chunk.actions)[0, 0])


def lookup(stub) -> None:
    stub.Ready(pb.ReadyRequest(deployment='arm'), timeout=5)   # the worker looks at the registry


def test_a_version_registered_while_the_previous_one_loads_is_rolled_out_after_it(tmp_path, seq_home):
    gate = tmp_path / 'gate'
    policy = write(tmp_path / 'arm' / 'policy.py', 1.0)
    deploy(policy)
    with create_server(['arm'], home=seq_home) as server, channel(server.port) as ch:
        stub = pb_grpc.PolicyServiceStub(ch)
        assert wait_ready(stub, 'arm').ready
        deploy(write(policy, 2.0, gate))             # version 2: its load waits at the gate in the worker
        gate.touch()
        lookup(stub)
        wait_for(lambda: Path(f'{gate}.entered').exists(), timeout=30, what="version 2's load to begin")
        deploy(write(policy, 3.0))                   # version 3 while version 2 still loads
        lookup(stub)
        gate.unlink()
        wait_for(lambda: server.runtimes['arm'].version == 3 and server.runtimes['arm'].readiness()[0],
                 timeout=30, what='version 3, the registered one, to be served')
        assert Registry().get('arm').version == 3
        assert served(stub) == (3, 3.0)
        assert [s[1:] for s in server._rollouts.switched] == [(1, 2), (2, 3)]


def test_a_stop_while_a_new_version_loads_is_not_reported_as_a_version_that_cannot_load(tmp_path, seq_home, caplog):
    gate = tmp_path / 'gate'
    policy = write(tmp_path / 'arm' / 'policy.py', 1.0)
    deploy(policy)
    server = create_server(['arm'], home=seq_home)
    try:
        with channel(server.port) as ch:
            stub = pb_grpc.PolicyServiceStub(ch)
            assert wait_ready(stub, 'arm').ready
            deploy(write(policy, 2.0, gate))
            gate.touch()
            lookup(stub)
            wait_for(lambda: Path(f'{gate}.entered').exists(), timeout=30, what="version 2's load to begin")
    finally:
        with caplog.at_level(logging.WARNING, logger='sequence_ai_ros.worker.rollout'):
            server.stop(grace=0.5)
        gate.unlink(missing_ok=True)
    assert not [r.getMessage() for r in caplog.records if 'cannot load beside' in r.getMessage()]
    assert server._rollouts.state.get('arm') == 'loading'       # given up as it was, not 'waiting'


def test_a_deploy_during_a_drain_neither_cuts_the_draining_episodes_nor_loads_the_new_version(tmp_path, seq_home):
    """Attack: with --rollout cut, a version deployed while the worker drained (SIGTERM) cut its episodes.

    The episodes the drain lets finish were cut with reason rollout, and the new version was loaded in a worker
    about to exit.
    """
    from test_worker_rollout import write as write_memory_bound

    marker = tmp_path / 'memory-taken'
    policy = write(tmp_path / 'arm' / 'policy.py', 1.0)
    deploy(policy)
    with create_server(['arm'], home=seq_home, rollout='cut') as server, channel(server.port) as ch:
        stub = pb_grpc.PolicyServiceStub(ch)
        assert wait_ready(stub, 'arm').ready
        live = Stream(stub, 'arm', 'live')
        assert live.start().HasField('started')
        left: list[int] = []
        drain = threading.Thread(target=lambda: left.append(server.drain(60.0)), name='drain')
        drain.start()
        wait_for(lambda: server.servicer.drain.draining, what='the drain to begin')
        deploy(write_memory_bound(policy, 2.0, str(marker), wait_s=1.0))   # cannot load beside version 1
        marker.touch()
        server.retire_deleted()                         # the worker's look at the registry (housekeeping)
        wait_for(lambda: not any(t.is_alive() for t in list(server._rollouts._threads.values())), timeout=60,
                 what='no rollout running')
        reply = live.ask(state_request(1, [0.0, 0.0], ['a', 'b']))
        assert reply.HasField('chunk'), reply           # the draining episode goes on, on version 1
        assert float(codec.from_tensor(reply.chunk.actions)[0, 0]) == 1.0
        assert live.end().HasField('ended')
        drain.join(timeout=30)
        assert left == [0]                              # it ended within the drain: nothing was cut
        assert server._rollouts.cuts == [] and server._rollouts.switched == []
        assert server.runtimes['arm'].version == 1
