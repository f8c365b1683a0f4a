"""A version registered while serving (``seq deploy`` again) is rolled out without a cut.

New episodes get it, running ones finish on the old one, which is then unloaded; when the new one cannot load
beside the old one, the old one keeps serving and the switch waits for its episodes to end.

The policy's actions are its version's value, so every chunk tells which version served it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_worker_support import Stream, channel, state_request, wait_for, wait_ready

from sequence_ai_ros.protocol import codec
from sequence_ai_ros.protocol import sequence_ai_pb2 as pb
from sequence_ai_ros.protocol import sequence_ai_pb2_grpc as pb_grpc
from sequence_ai_ros.worker import create_server
from sequence_ai_ros.worker.registry import deploy

POLICY = '''
import os

import numpy as np

import sequence_ai_ros.policy as seq

NAMES = ['a', 'b']
VALUE = {value}
MARKER = {marker!r}


@seq.policy(action_space='joint_absolute', action_names=NAMES, dt=0.05, chunk_length=4,
            observation=seq.ObservationContract(state_names=NAMES))
class Versioned:
    def load(self):
        if MARKER and os.path.exists(MARKER):   # the running version holds the memory this one needs
            raise MemoryError('no room for a second copy of the model')

    def infer(self, inp, episode):
        return np.full((4, 2), VALUE, np.float32)
'''


def write(path: Path, value: float, marker: str = '') -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(POLICY.format(value=value, marker=marker))
    return path


def value_of(reply: pb.EpisodeReply) -> float:
    assert reply.HasField('chunk'), reply
    return float(codec.from_tensor(reply.chunk.actions)[0, 0])


def ask(stream: Stream, rid: int) -> float:
    return value_of(stream.ask(state_request(rid, [0.0, 0.0], ['a', 'b'])))


def build_versions(server) -> set[str]:
    """The deployment_version labels of ``seq_build_info`` in the worker's registry."""
    return {s.labels['deployment_version'] for family in server.metrics.registry.collect()
            if family.name == 'seq_build_info' for s in family.samples}


def serving_version(server, stub) -> int:
    stub.Ready(pb.ReadyRequest(deployment='arm'), timeout=5)   # a lookup: the worker looks at the registry
    runtime = server.runtimes['arm']
    return runtime.version if runtime.readiness()[0] else -1


def test_new_episodes_get_the_new_version_while_running_ones_finish_on_the_old(tmp_path, seq_home):
    pytest.importorskip('prometheus_client', reason='prometheus_client is not installed (the [metrics] extra)')
    policy = write(tmp_path / 'arm' / 'policy.py', 1.0)
    deploy(policy)
    with create_server(['arm'], home=seq_home, metrics_port=0) as server, channel(server.port) as ch:
        stub = pb_grpc.PolicyServiceStub(ch)
        assert wait_ready(stub, 'arm').ready
        assert build_versions(server) == {'1'}
        old = Stream(stub, 'arm', 'old')
        assert old.start().started.deployment_version == 1 and ask(old, 1) == 1.0
        deploy(write(policy, 2.0))                                  # version 2, while episode 'old' runs
        wait_for(lambda: serving_version(server, stub) == 2, timeout=30, what='version 2 to take new episodes')
        new = Stream(stub, 'arm', 'new')
        assert new.start().started.deployment_version == 2 and ask(new, 1) == 2.0
        assert ask(old, 2) == 1.0                                   # the running episode stays on version 1
        assert server._rollouts.unloaded == []
        assert old.end().HasField('ended')
        wait_for(lambda: server._rollouts.unloaded == [('arm', 1)], what='version 1 to be unloaded')
        assert ask(new, 2) == 2.0 and new.end().HasField('ended')
        assert build_versions(server) == {'2'}    # seq_build_info names the version now serving


def test_a_version_that_cannot_load_beside_waits_for_the_old_versions_episodes(tmp_path, seq_home):
    marker = tmp_path / 'memory-taken'
    policy = write(tmp_path / 'arm' / 'policy.py', 1.0)
    deploy(policy)
    with create_server(['arm'], home=seq_home) as server, channel(server.port) as ch:
        stub = pb_grpc.PolicyServiceStub(ch)
        assert wait_ready(stub, 'arm').ready
        first = Stream(stub, 'arm', 'first')
        assert first.start().HasField('started') and ask(first, 1) == 1.0
        deploy(write(policy, 2.0, str(marker)))     # its dry run passed; now version 1's memory is in the way
        marker.write_text('version 1 is loaded')
        wait_for(lambda: (serving_version(server, stub), server._rollouts.state.get('arm')) == (1, 'waiting'),
                 timeout=30, what='the rollout to wait for version 1')
        second = Stream(stub, 'arm', 'second')      # still served, by version 1
        assert second.start().started.deployment_version == 1 and ask(second, 1) == 1.0
        marker.unlink()                             # version 1's memory is freed once it is unloaded
        for stream in (first, second):
            assert stream.end().HasField('ended')
        wait_for(lambda: serving_version(server, stub) == 2, timeout=30, what='the switch to version 2')
        assert server._rollouts.unloaded == [('arm', 1)]
        third = Stream(stub, 'arm', 'third')
        assert third.start().started.deployment_version == 2 and ask(third, 1) == 2.0
        assert third.end().HasField('ended')
