"""A version registered while serving (``seq deploy`` again) is rolled out without a cut.

New episodes get it, running ones finish on the old one, which is then unloaded (under ``--isolation
process`` the new version loads in its own deployment process and the old one's process ends); when the new
one cannot load beside the old one, the old one keeps serving and the switch waits for its episodes to end,
or, with ``--rollout cut``, they are cut (reason ``rollout``) and the switch happens at once.

The policy's actions are its version's value and the pid of the process serving it, so every chunk tells
which version, and which process, served it.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import pytest
from test_worker_support import Stream, channel, state_request, wait_for, wait_ready

from sequence_ai_ros.capture.store import CaptureStore
from sequence_ai_ros.exceptions import DeploymentError, NotReady
from sequence_ai_ros.protocol import codec
from sequence_ai_ros.protocol import errors as perrors
from sequence_ai_ros.protocol import sequence_ai_pb2 as pb
from sequence_ai_ros.protocol import sequence_ai_pb2_grpc as pb_grpc
from sequence_ai_ros.worker import create_server
from sequence_ai_ros.worker.policy_process import PolicyProcessDied, RemoteError
from sequence_ai_ros.worker.registry import deploy
from sequence_ai_ros.worker.rollout import out_of_memory

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
def test_with_rollout_cut_the_old_versions_episodes_are_cut_typed_and_the_switch_is_at_once(tmp_path, seq_home,
                                                                                            caplog):
    caplog.set_level(logging.INFO, logger='sequence_ai_ros.worker.rollout')
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
        # the rollout thread records the cut once the cut returns: the robot may read it first
        wait_for(lambda: server._rollouts.cuts == [('arm', 1, 1)], timeout=10, what='the cut to be recorded')
        wait_for(lambda: serving_version(server, stub) == 2, timeout=30, what='the switch to version 2')
        wait_for(lambda: server._rollouts.unloaded == [('arm', 1)], timeout=10, what='version 1 to be unloaded')
        second = Stream(stub, 'arm', 'second')
        assert second.start().started.deployment_version == 2 and ask(second, 1) == 2.0
        assert second.end().HasField('ended')
    runs = {r['episode_id']: r for r in CaptureStore(seq_home / 'capture' / 'arm', 'arm').runs()}
    assert (runs['first']['reason'], runs['first']['version']) == ('rollout', 1)
    switched = [r.getMessage() for r in caplog.records if 'new episodes get version 2' in r.getMessage()]
    assert switched == ['deployment arm: new episodes get version 2; its 1 running episodes on version 1 are cut '
                        '(--rollout cut)'], switched     # the log says what happens to them: no "finish"


#: A version whose inference holds while its robot's request says ``gate`` and the gate file exists, and whose
#: end hook leaves a file behind: the old version's last call and hook, seen from the test.
GATED = POLICY.replace("""    def infer(self, inp, episode):""", """    def infer(self, inp, episode):
        if 'gate' in inp.observation.params:
            gate = inp.observation.params['gate']
            open(gate + '.in', 'w').close()
            deadline = time.monotonic() + 30
            while os.path.exists(gate) and time.monotonic() < deadline:
                time.sleep(0.01)""") + """
    @seq.on_episode
    def ended(self, episode):
        with open(CALLS, 'a') as f:
            f.write('hook:' + episode.id + chr(10))
"""


@pytest.mark.slow
def test_a_rollout_cut_unloads_the_old_version_once_its_running_inference_and_end_hook_ran(tmp_path, seq_home):
    """The cut reaches the robot at once; the old version's deployment process is closed only afterwards.

    Only once the inference it was running when the cut came, and the cut episode's end hook behind it, have run.
    """
    gate, marker = tmp_path / 'gate', tmp_path / 'memory-taken'
    policy = tmp_path / 'arm' / 'policy.py'
    policy.parent.mkdir(parents=True)
    calls = tmp_path / 'v1-calls.log'
    policy.write_text(GATED.format(value=1.0, marker='', wait_s=0.0, calls=str(calls)))
    deploy(policy)
    with create_server(['arm'], home=seq_home, rollout='cut', isolation='process') as server, \
            channel(server.port) as ch:
        stub = pb_grpc.PolicyServiceStub(ch)
        assert wait_ready(stub, 'arm', timeout=60).ready
        old = server.runtimes['arm']
        robot = Stream(stub, 'arm', 'gated')
        assert robot.start().HasField('started') and ask(robot, 1) == 1.0
        gate.write_text('held')
        robot.send(observation=state_request(2, [0.0, 0.0], ['a', 'b'], params={'gate': str(gate)}))
        wait_for(lambda: Path(f'{gate}.in').exists(), what='the inference held at the gate')
        policy.write_text(GATED.format(value=2.0, marker=str(marker), wait_s=2.0, calls=str(tmp_path / 'v2.log')))
        deploy(policy)                       # version 2 cannot load beside version 1: the episode is cut
        marker.write_text('version 1 is loaded')
        stub.Ready(pb.ReadyRequest(deployment='arm'), timeout=5)
        cut = robot.recv(timeout=30)
        assert cut is not None and '(rollout)' in cut.error.message, cut
        assert robot.recv(timeout=10).HasField('ended')
        wait_for(lambda: server._rollouts.cuts == [('arm', 1, 1)], timeout=10, what='the cut to be recorded')
        deadline = time.monotonic() + 1.0      # the inference still runs: version 1 is not being closed
        while time.monotonic() < deadline:
            assert old.scheduler.running and server._rollouts.unloaded == []
            time.sleep(0.02)
        gate.unlink()
        marker.unlink()
        wait_for(lambda: server._rollouts.unloaded == [('arm', 1)], timeout=30, what='version 1 to be unloaded')
    assert 'hook:gated' in calls.read_text().split()          # the cut episode's hook ran on version 1


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


BROKEN = '''
import os
import time

import numpy as np

import sequence_ai_ros.policy as seq

NAMES = ['a', 'b']
VALUE = {value}
FAIL = {fail!r}       # 'raise': load() raises; 'hang': the worker's dry run hangs; '': a good version
ARMED = {armed!r}     # the failure is armed while this file exists (seq deploy's own checks pass before)
LOADS = {loads!r}     # one line per load() of this version


@seq.policy(action_space='joint_absolute', action_names=NAMES, dt=0.05, chunk_length=4,
            observation=seq.ObservationContract(state_names=NAMES))
class Broken:
    def load(self):
        with open(LOADS, 'a') as f:
            f.write('load' + chr(10))
        if FAIL == 'raise' and os.path.exists(ARMED):
            raise RuntimeError('checkpoint shard 3 of 4 is missing')

    def infer(self, inp, episode):
        deadline = time.monotonic() + 30.0
        while FAIL == 'hang' and episode.id == 'seq-dry-run' and os.path.exists(ARMED) and time.monotonic() < deadline:
            time.sleep(0.05)
        return np.array([[VALUE, os.getpid()]] * 4, np.float32)
'''


def write_broken(path: Path, value: float, fail: str, armed: Path, loads: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(BROKEN.format(value=value, fail=fail, armed=str(armed), loads=str(loads)))
    return path


def failures_counted(server) -> float:
    """``seq_rollout_failures_total{deployment="arm"}`` in the worker's registry."""
    return server.metrics.registry.get_sample_value('seq_rollout_failures_total', {'deployment': 'arm'})


def loads(path: Path) -> int:
    return len(path.read_text().split()) if path.exists() else 0


def test_a_version_whose_load_raises_fails_alone_the_old_version_serves_on_and_a_good_one_rolls_out(
        tmp_path, seq_home, caplog):
    """Not "cannot load beside": with --rollout cut nothing is cut, and the failed version is never tried again."""
    pytest.importorskip('prometheus_client', reason='prometheus_client is not installed (the [metrics] extra)')
    caplog.set_level(logging.INFO, logger='sequence_ai_ros.worker.rollout')
    armed, v2_loads = tmp_path / 'armed', tmp_path / 'v2-loads'
    policy = write(tmp_path / 'arm' / 'policy.py', 1.0)
    deploy(policy)
    with create_server(['arm'], home=seq_home, rollout='cut', metrics_port=0) as server, channel(server.port) as ch:
        stub = pb_grpc.PolicyServiceStub(ch)
        assert wait_ready(stub, 'arm').ready
        assert failures_counted(server) == 0.0                      # the series exists from the start
        first = Stream(stub, 'arm', 'first')
        assert first.start().started.deployment_version == 1 and ask(first, 1) == 1.0
        deploy(write_broken(policy, 2.0, 'raise', armed, v2_loads))  # seq deploy's dry run passed
        armed.write_text('the checkpoint is incomplete now')
        loaded_at_deploy = loads(v2_loads)
        stub.Ready(pb.ReadyRequest(deployment='arm'), timeout=5)     # a lookup: the worker sees version 2
        wait_for(lambda: server._rollouts.state.get('arm') == 'failed', timeout=30, what='version 2 to fail')
        [(name, version, why)] = server._rollouts.failures
        assert (name, version) == ('arm', 2) and 'checkpoint shard 3 of 4 is missing' in why, why
        assert server._rollouts.cuts == [] and server._rollouts.switched == [] and server._rollouts.unloaded == []
        assert ask(first, 2) == 1.0                                 # never cut: version 1 answers it still
        second = Stream(stub, 'arm', 'second')                      # and serves new episodes
        assert second.start().started.deployment_version == 1 and ask(second, 1) == 1.0
        assert failures_counted(server) == 1.0
        errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
        assert any('version 1 keeps serving' in e and 'checkpoint shard 3 of 4 is missing' in e for e in errors), errors
        assert loads(v2_loads) == loaded_at_deploy + 1
        registry = seq_home / 'deployments.json'
        registry.write_text(registry.read_text())                   # the registry changes: the worker looks again
        stub.Ready(pb.ReadyRequest(deployment='arm'), timeout=5)
        assert 'arm' not in server._rollouts._threads and loads(v2_loads) == loaded_at_deploy + 1   # not tried again
        deploy(write(policy, 3.0))                                  # a fixed version is rolled out
        wait_for(lambda: serving_version(server, stub) == 3, timeout=30, what='version 3 to take new episodes')
        third = Stream(stub, 'arm', 'third')
        assert third.start().started.deployment_version == 3 and ask(third, 1) == 3.0
        assert ask(first, 3) == 1.0                                 # running episodes finish on version 1
        for stream in (first, second, third):
            assert stream.end().HasField('ended')
        wait_for(lambda: server._rollouts.unloaded == [('arm', 1)], timeout=30, what='version 1 to be unloaded')
        assert failures_counted(server) == 1.0


def test_a_version_whose_dry_run_hangs_past_the_load_timeout_fails_and_the_old_version_serves_on(tmp_path, seq_home):
    """With --rollout wait, the end of the old version's episodes no longer switches to a version that hung."""
    armed, v2_loads = tmp_path / 'armed', tmp_path / 'v2-loads'
    armed.write_text('the dry run hangs')     # the worker's dry run only: seq deploy's has another episode id
    policy = write(tmp_path / 'arm' / 'policy.py', 1.0)
    deploy(policy)
    try:
        with create_server(['arm'], home=seq_home, load_timeout_s=6.0) as server, channel(server.port) as ch:
            stub = pb_grpc.PolicyServiceStub(ch)
            assert wait_ready(stub, 'arm').ready
            first = Stream(stub, 'arm', 'first')
            assert first.start().started.deployment_version == 1 and ask(first, 1) == 1.0
            deploy(write_broken(policy, 2.0, 'hang', armed, v2_loads))
            stub.Ready(pb.ReadyRequest(deployment='arm'), timeout=5)
            wait_for(lambda: server._rollouts.state.get('arm') == 'failed', timeout=30, what='version 2 to fail')
            [(_, version, why)] = server._rollouts.failures
            assert version == 2 and 'load exceeded 6 s' in why, why
            assert ask(first, 2) == 1.0 and first.end().HasField('ended')     # the old version's episodes end
            wait_for(lambda: 'arm' not in server._rollouts._threads, what='the rollout to end')
            assert server._rollouts.switched == [] and server._rollouts.unloaded == []   # no switch after them
            second = Stream(stub, 'arm', 'second')
            assert second.start().started.deployment_version == 1 and ask(second, 1) == 1.0
            assert second.end().HasField('ended')
            deploy(write(policy, 3.0))
            wait_for(lambda: serving_version(server, stub) == 3, timeout=30, what='version 3 to take new episodes')
            assert server._rollouts.switched == [('arm', 1, 3)]
    finally:
        armed.unlink(missing_ok=True)         # the hung dry run returns


class OutOfMemoryError(RuntimeError):
    """As torch names it (``torch.OutOfMemoryError``), without importing torch."""


@pytest.mark.parametrize(('exc', 'oom'), [
    (MemoryError(), True),
    (OutOfMemoryError('CUDA out of memory. Tried to allocate 2.00 GiB'), True),
    (RuntimeError('CUDA error: out of memory'), True),
    (RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory"), True),
    (RemoteError('torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB'), True),
    (RemoteError('MemoryError'), True),
    (RemoteError('RuntimeError: CUDA error: out of memory'), True),
    (RuntimeError('checkpoint shard 3 of 4 is missing'), False),
    (RemoteError("ModuleNotFoundError: No module named 'lerobot'"), False),
    (RemoteError('DeploymentError: MemoryBank.yaml is missing'), False),
    (ImportError('cannot import name X'), False),
    (None, False),                                          # the load passed its deadline
])
def test_only_an_out_of_memory_failure_means_cannot_load_beside(exc, oom):
    assert out_of_memory(exc) is oom


def test_a_load_failure_raised_from_an_out_of_memory_error_is_out_of_memory():
    try:
        try:
            raise OutOfMemoryError('CUDA out of memory')
        except RuntimeError as inner:
            raise DeploymentError('the checkpoint did not load') from inner
    except DeploymentError as exc:
        assert out_of_memory(exc)


KILLED_AT_LOAD = '''
import os
import signal

import numpy as np

import sequence_ai_ros.policy as seq


@seq.policy(action_space='joint_absolute', action_names=['a'], dt=0.05, chunk_length=4,
            observation=seq.ObservationContract(state_names=['a']))
class Killed:
    def load(self):
        if {killed}:
            os.kill(os.getpid(), signal.SIGKILL)    # as the kernel's out-of-memory killer does
        import time
        time.sleep(30)

    def infer(self, inp, episode):
        return np.zeros((4, 1), np.float32)
'''


@pytest.mark.parametrize('killed', [True, False])
def test_a_deployment_process_killed_by_sigkill_while_loading_is_out_of_memory_unless_the_worker_killed_it(
        tmp_path, killed):
    """The kernel's out-of-memory killer sends SIGKILL; the worker's own kill at the load timeout is not memory."""
    import threading

    from sequence_ai_ros.worker.policy_process import describe_policy_file

    path = tmp_path / 'killed' / 'policy.py'
    path.parent.mkdir()
    path.write_text(KILLED_AT_LOAD.format(killed=killed))
    instance = describe_policy_file(path, 'killed', 30.0).instantiate()
    if not killed:
        threading.Timer(0.5, instance.kill, kwargs={'why': 'load exceeded 0.5 s'}).start()
    try:
        with pytest.raises(PolicyProcessDied) as died:
            instance.load()
    finally:
        instance.close(timeout=1.0)
    assert out_of_memory(died.value) is killed, str(died.value)
