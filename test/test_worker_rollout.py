"""A version registered while serving (``seq deploy`` again) is rolled out without a cut.

New episodes get it, running ones finish on the old one, which is then unloaded (under ``--isolation
process`` the new version loads in its own deployment process and the old one's process ends); when the new
one cannot load beside the old one, the old one keeps serving and the switch waits for its episodes to end,
or, with ``--rollout cut``, they are cut (reason ``rollout``) and the switch happens at once.

The policy's actions are its version's value and the pid of the process serving it, so every chunk tells
which version, and which process, served it.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from test_worker_support import Stream, channel, state_request, wait_for, wait_ready

from sequence_ai_ros.capture.store import CaptureStore
from sequence_ai_ros.exceptions import NotReady
from sequence_ai_ros.protocol import codec
from sequence_ai_ros.protocol import errors as perrors
from sequence_ai_ros.protocol import sequence_ai_pb2 as pb
from sequence_ai_ros.protocol import sequence_ai_pb2_grpc as pb_grpc
from sequence_ai_ros.worker import create_server
from sequence_ai_ros.worker.registry import deploy

POLICY = '''
import os
import time

import numpy as np

import sequence_ai_ros.policy as seq

NAMES = ['a', 'b']
VALUE = {value}
MARKER = {marker!r}
WAIT_S = {wait_s}
CALLS = {calls!r}


@seq.policy(action_space='joint_absolute', action_names=NAMES, dt=0.05, chunk_length=4,
            observation=seq.ObservationContract(state_names=NAMES))
class Versioned:
    def load(self):
        deadline = time.monotonic() + WAIT_S
        while MARKER and os.path.exists(MARKER) and time.monotonic() < deadline:
            time.sleep(0.05)
        if MARKER and os.path.exists(MARKER):   # the running version holds the memory this one needs
            raise MemoryError('no room for a second copy of the model')

    def infer(self, inp, episode):
        if CALLS:
            with open(CALLS, 'a') as f:
                f.write(episode.id + chr(10))
        return np.array([[VALUE, os.getpid()]] * 4, np.float32)   # its version, and the process serving it
'''


def write(path: Path, value: float, marker: str = '', wait_s: float = 0.0, calls: str = '') -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(POLICY.format(value=value, marker=marker, wait_s=wait_s, calls=calls))
    return path


def value_of(reply: pb.EpisodeReply) -> float:
    assert reply.HasField('chunk'), reply
    return float(codec.from_tensor(reply.chunk.actions)[0, 0])


def ask(stream: Stream, rid: int) -> float:
    return value_of(stream.ask(state_request(rid, [0.0, 0.0], ['a', 'b'])))


def served_by(stream: Stream, rid: int) -> tuple[float, int]:
    """(version value, pid of the process that ran the inference) of one answer."""
    reply = stream.ask(state_request(rid, [0.0, 0.0], ['a', 'b']))
    assert reply.HasField('chunk'), reply
    row = codec.from_tensor(reply.chunk.actions)[0]
    return float(row[0]), int(round(float(row[1])))


def ended(pid: int) -> bool:
    """True when process ``pid`` is gone (or a zombie, exited and not yet reaped)."""
    try:
        return Path(f'/proc/{pid}/stat').read_text().rsplit(')', 1)[1].split()[0] == 'Z'
    except (OSError, IndexError):
        return True


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


@pytest.mark.slow
def test_with_rollout_cut_the_old_versions_episodes_are_cut_typed_and_the_switch_is_at_once(tmp_path, seq_home):
    marker = tmp_path / 'memory-taken'
    policy = write(tmp_path / 'arm' / 'policy.py', 1.0)
    deploy(policy)
    with create_server(['arm'], home=seq_home, rollout='cut') as server, channel(server.port) as ch:
        stub = pb_grpc.PolicyServiceStub(ch)
        assert wait_ready(stub, 'arm').ready
        first = Stream(stub, 'arm', 'first')
        assert first.start().started.deployment_version == 1 and ask(first, 1) == 1.0
        # version 2 waits up to 2 s for version 1's memory at each load: beside version 1 it fails
        deploy(write(policy, 2.0, str(marker), wait_s=2.0))
        marker.write_text('version 1 is loaded')
        stub.Ready(pb.ReadyRequest(deployment='arm'), timeout=5)     # a lookup: the worker sees version 2
        wait_for(lambda: server._rollouts.state.get('arm') == 'loading', timeout=10, what='version 2 to load')
        assert ask(first, 2) == 1.0                 # version 2 loads in the background: version 1 still answers
        cut = first.recv(timeout=30)                                 # the running episode is cut, typed
        assert isinstance(perrors.from_error(cut.error), NotReady) and '(rollout)' in cut.error.message, cut
        assert first.recv(timeout=10).HasField('ended')
        marker.unlink()                                             # version 1 unloads: its memory is free
        assert server._rollouts.cuts == [('arm', 1, 1)]
        wait_for(lambda: serving_version(server, stub) == 2, timeout=30, what='the switch to version 2')
        assert server._rollouts.unloaded == [('arm', 1)]
        second = Stream(stub, 'arm', 'second')
        assert second.start().started.deployment_version == 2 and ask(second, 1) == 2.0
        assert second.end().HasField('ended')
    runs = {r['episode_id']: r for r in CaptureStore(seq_home / 'capture' / 'arm', 'arm').runs()}
    assert (runs['first']['reason'], runs['first']['version']) == ('rollout', 1)


def test_a_rollout_under_process_isolation_loads_the_new_version_in_its_own_process(tmp_path, seq_home):
    calls = tmp_path / 'v2-calls.log'
    policy = write(tmp_path / 'arm' / 'policy.py', 1.0)
    deploy(policy)
    with create_server(['arm'], home=seq_home, isolation='process') as server, channel(server.port) as ch:
        stub = pb_grpc.PolicyServiceStub(ch)
        assert wait_ready(stub, 'arm', timeout=60).ready
        old = Stream(stub, 'arm', 'old')
        assert old.start().started.deployment_version == 1
        value, v1_pid = served_by(old, 1)
        assert value == 1.0 and v1_pid != os.getpid()                # version 1 runs in a deployment process
        deploy(write(policy, 2.0, calls=str(calls)))
        wait_for(lambda: serving_version(server, stub) == 2, timeout=60, what='version 2 to take new episodes')
        worker_calls = [c for c in calls.read_text().split() if c != 'seq-deploy-dry-run']   # not seq deploy's own
        assert worker_calls == ['seq-dry-run']                       # loaded and dry-run before any robot got it
        new = Stream(stub, 'arm', 'new')
        assert new.start().started.deployment_version == 2
        value, v2_pid = served_by(new, 1)
        assert value == 2.0 and v2_pid not in (os.getpid(), v1_pid)  # version 2: its own deployment process
        assert served_by(old, 2) == (1.0, v1_pid)                   # the running episode stays on version 1
        assert not ended(v1_pid) and server._rollouts.unloaded == []
        assert old.end().HasField('ended')
        wait_for(lambda: server._rollouts.unloaded == [('arm', 1)], timeout=30, what='version 1 to be unloaded')
        wait_for(lambda: ended(v1_pid), timeout=30, what="version 1's deployment process to end")
        assert served_by(new, 2) == (2.0, v2_pid) and new.end().HasField('ended')
