"""Break-it: one deployment's crash, os._exit, segfault or hang never reaches another (``--isolation process``).

Two deployments in one worker (registered in a temporary $SEQ_HOME): ``crashy`` misbehaves on demand, ``steady``
serves a robot all along. The crashing robot gets a typed error, then NOT_READY while its deployment
process restarts, then chunks again; the steady robot only ever gets chunks. Import and load misbehave
under ``seq deploy --timeout`` and ``seq serve --load-timeout``: bounded, with messages that name the
deployment and the exit code.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from test_worker_support import Stream, channel, state_request, wait_for, wait_ready

from sequence_ai_ros.protocol import codec
from sequence_ai_ros.protocol import sequence_ai_pb2 as pb
from sequence_ai_ros.protocol import sequence_ai_pb2_grpc as pb_grpc
from sequence_ai_ros.worker import create_server, serve_policy_file
from sequence_ai_ros.worker import server as server_module
from sequence_ai_ros.worker.registry import deploy

REPO = Path(__file__).resolve().parents[2]
#: Bounds of a wait that must stay generous on a loaded 2-core CI machine (s).
RESTART_WAIT_S = 60.0

POLICY = textwrap.dedent('''
    import ctypes, multiprocessing, os, struct, subprocess, sys, time
    import numpy as np
    import sequence_ai_ros.policy as seq

    AT_IMPORT = os.environ.get('SEQ_TEST_AT_IMPORT', '') if {misbehave_at_import} else ''
    if AT_IMPORT == 'exit':
        os._exit(7)
    elif AT_IMPORT == 'sleep':
        time.sleep(600)
    elif AT_IMPORT == 'spin':
        while True:
            pass

    NAMES = ['a', 'b']

    @seq.policy(action_space='joint_absolute', action_names=NAMES, dt=0.1, chunk_length=4,
                observation=seq.ObservationContract(state_names=NAMES))
    class Crashy:
        def __init__(self, load_hang: float = 0.0, kids: str = '', helper: str = ''):
            self.load_hang = float(load_hang)
            self.kids = kids
            self.helper = helper

        def load(self):
            if self.load_hang:
                time.sleep(self.load_hang)
            if self.kids:                        # a program of the policy's own, as a data loader's workers
                child = subprocess.Popen(['sleep', '300'])
                with open(self.kids, 'a') as out:
                    out.write(f'{{child.pid}}\\n')
            if self.helper == 'fork':            # a forked helper: a copy of this process, every fd of it
                self.held = multiprocessing.get_context('fork').Process(target=time.sleep, args=(300,), daemon=True)
                self.held.start()
            elif self.helper == 'program':       # a program holding the socket (as a C library's own fork may)
                self.held = subprocess.Popen(['sleep', '300'], pass_fds=(int(sys.argv[1]),))

        def infer(self, inp, episode):
            p = inp.observation.params
            if 'mark' in p:                      # tells a test that this inference has begun
                open(p['mark'], 'w').close()
            if 'exit' in p:
                os._exit(int(p['exit']))
            if 'segv' in p:
                ctypes.string_at(0)
            if 'hang' in p:
                time.sleep(float(p['hang']))
            if 'fork' in p:                      # a background job that forgets to exit: both copies go on
                copy = os.fork()
                if copy:
                    with open(p['fork'], 'w') as out:
                        out.write(f'{{copy}}\\n')
                else:
                    time.sleep(0.3)              # back from infer after its parent's answer
            if 'junk' in p:                      # bytes on the deployment process's socket (fd argv[1])
                os.write(int(sys.argv[1]), struct.pack('<II', 12, 1 << 30) + b'junkjunk')
                time.sleep(0.3)                  # read apart from the answer that follows
            episode.state['n'] = episode.state.get('n', 0) + 1
            return np.tile(np.array([inp.observation.state[0], episode.state['n']], np.float32), (4, 1))
''')


def write_policy(root: Path, name: str, misbehave_at_import: bool = False) -> Path:
    path = root / name / 'policy.py'
    path.parent.mkdir(parents=True)
    path.write_text(POLICY.format(misbehave_at_import=misbehave_at_import))
    return path


def req(rid: int, value: float = 1.0, **params: str) -> pb.ObservationRequest:
    return state_request(rid, [value, 0.0], ['a', 'b'], params=params)


@pytest.fixture
def two(seq_home, tmp_path):
    """A worker serving ``crashy`` and ``steady`` (each in its own process), inference deadline 2 s."""
    for name in ('crashy', 'steady'):
        deploy(write_policy(tmp_path, name), home=seq_home, dry_timeout_s=60)
    server = create_server(['crashy', 'steady'], home=seq_home, inference_timeout_s=2.0, idle_timeout_s=120,
                           isolation='process')
    ch = channel(server.port)
    stub = pb_grpc.PolicyServiceStub(ch)
    for name in ('crashy', 'steady'):
        assert wait_ready(stub, name, timeout=RESTART_WAIT_S).ready
    yield server, stub
    ch.close()
    server.stop(grace=0.5)


class Steady(threading.Thread):
    """A robot on ``steady`` asking chunk after chunk until stopped; keeps every reply's kind."""

    def __init__(self, stub) -> None:
        super().__init__(daemon=True)
        self.stream = Stream(stub, 'steady', 'robot-steady')
        assert self.stream.start().HasField('started')
        self.kinds: list[str] = []
        self.halt = threading.Event()

    def run(self) -> None:
        rid = 0
        while not self.halt.is_set():
            rid += 1
            reply = self.stream.ask(req(rid))
            self.kinds.append(reply.WhichOneof('kind') if reply is not None else 'closed')
            time.sleep(0.01)

    def finish(self) -> list[str]:
        self.halt.set()
        self.join(timeout=30)
        assert self.stream.end().HasField('ended')
        return self.kinds


def served_again(stub, deployment: str, rid0: int) -> tuple[int, list[str]]:
    """Ask on a fresh episode of ``deployment`` until a chunk comes; return the request count and the codes seen."""
    stream = Stream(stub, deployment, f'robot-after-{rid0}')
    codes: list[str] = []
    try:
        assert stream.start().HasField('started')
        deadline = time.monotonic() + RESTART_WAIT_S
        rid = 0
        while time.monotonic() < deadline:
            rid += 1
            reply = stream.ask(req(rid))
            if reply.HasField('chunk'):
                return rid, codes
            codes.append(pb.ErrorCode.Name(reply.error.code))
            time.sleep(0.05)
        raise AssertionError(f'{deployment} not served again within {RESTART_WAIT_S} s: {codes[-3:]}')
    finally:
        stream.end()


@pytest.mark.parametrize('fault, words', [({'exit': '7'}, 'exit code 7'), ({'segv': '1'}, 'signal SIGSEGV'),
                                          ({'hang': '600'}, 'inference exceeded 2 s')])
def test_a_crash_exit_segfault_or_hang_fails_only_its_own_robots_and_the_deployment_comes_back(two, fault, words):
    server, stub = two
    steady = Steady(stub)
    steady.start()
    wait_for(lambda: len(steady.kinds) >= 3, 10, 'the steady robot served')
    robot = Stream(stub, 'crashy', 'robot-crash')
    assert robot.start().HasField('started')
    assert robot.ask(req(1)).HasField('chunk')
    reply = robot.ask(req(2, **fault))
    assert reply.error.code == pb.POLICY_EXCEPTION and words in reply.error.message, reply
    assert 'crashy' in reply.error.message
    after = robot.ask(req(3))                   # the same robot, while its deployment restarts (or already back)
    assert after.WhichOneof('kind') in ('chunk', 'error')
    if after.HasField('error'):
        assert after.error.code == pb.NOT_READY and 'restarting' in after.error.message, after
    robot.end()
    n, codes = served_again(stub, 'crashy', 3)
    assert set(codes) <= {'NOT_READY'}
    kinds = steady.finish()
    assert kinds and set(kinds) == {'chunk'}, kinds          # the other deployment never noticed
    runtime = server.runtimes['crashy']
    assert runtime.restarts == 1 and server.runtimes['steady'].restarts == 0


def test_episode_state_lives_in_the_deployment_process_per_episode(two):
    _, stub = two
    a, b = Stream(stub, 'crashy', 'ep-a'), Stream(stub, 'crashy', 'ep-b')
    a.start(), b.start()
    counts = []
    for rid in range(1, 4):
        counts.append(codec.from_tensor(a.ask(req(rid)).chunk.actions)[0, 1])
    counts.append(codec.from_tensor(b.ask(req(1)).chunk.actions)[0, 1])
    assert counts == [1, 2, 3, 1]
    a.end(), b.end()


def test_robots_asking_at_once_each_get_their_own_chunk_in_order(two):
    """Requests sent from the event loop while the inference thread is idle, and queued ones it runs, alike."""
    _, stub = two
    robots = [Stream(stub, 'steady', f'many-{k}') for k in range(4)]
    for robot in robots:
        assert robot.start().HasField('started')
    got: dict[int, list[tuple[float, float]]] = {k: [] for k in range(len(robots))}

    def ask(k: int) -> None:
        for rid in range(1, 26):
            reply = robots[k].ask(req(rid, value=100 * k + rid))
            first = codec.from_tensor(reply.chunk.actions)[0] if reply.HasField('chunk') else (-1.0, -1.0)
            got[k].append((float(first[0]), float(first[1])))

    threads = [threading.Thread(target=ask, args=(k,)) for k in range(len(robots))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    for k, robot in enumerate(robots):
        assert got[k] == [(100 * k + rid, rid) for rid in range(1, 26)]   # its own value, its own episode's count
        assert robot.end().HasField('ended')


def test_stopping_the_worker_during_an_inference_ends_it_and_its_deployment_processes(seq_home, tmp_path):
    deploy(write_policy(tmp_path, 'busy'), home=seq_home, dry_timeout_s=60)
    server = create_server(['busy'], home=seq_home, idle_timeout_s=120, isolation='process')
    ch = channel(server.port)
    stub = pb_grpc.PolicyServiceStub(ch)
    assert wait_ready(stub, 'busy', timeout=RESTART_WAIT_S).ready
    process = server.runtimes['busy']._instance.process.process
    robot = Stream(stub, 'busy', 'robot-busy')
    assert robot.start().HasField('started')
    robot.send(observation=req(1, hang='600'))
    wait_for(lambda: server.runtimes['busy'].scheduler.inferring, 10, 'the inference running')
    stopper = threading.Thread(target=server.stop, kwargs={'grace': 0.5})
    stopper.start()
    stopper.join(timeout=60)
    assert not stopper.is_alive()
    assert process.wait(timeout=10) is not None
    replies = []
    while (reply := robot.recv(timeout=10)) is not None:
        replies.append(reply.WhichOneof('kind'))
    assert 'chunk' not in replies
    ch.close()


def test_kill_9_of_a_deployment_process_while_idle_is_noticed_and_restarted(two):
    server, stub = two
    process = server.runtimes['crashy']._instance.process.process
    os.kill(process.pid, 9)
    wait_for(lambda: server.runtimes['crashy'].restarts == 1 or server.runtimes['crashy'].readiness()[2] != 'ready',
             10, 'the dead process noticed')
    served_again(stub, 'crashy', 0)


def test_the_worker_killed_with_9_leaves_no_deployment_process(tmp_path):
    path = write_policy(tmp_path, 'orphan')
    kids = tmp_path / 'kids'
    code = (f'import sys, time; sys.path.insert(0, {str(REPO)!r})\n'
            'from sequence_ai_ros.worker import serve_policy_file\n'
            f's = serve_policy_file({str(path)!r}, warm=True, isolation="process", kids={str(kids)!r})\n'
            'r = s.runtimes["orphan"]\n'
            'r.ready_event.wait(60)\n'
            'print(r._instance.process.pid, flush=True)\n'
            'time.sleep(600)\n')
    worker = subprocess.Popen([sys.executable, '-c', code], stdout=subprocess.PIPE, text=True)
    try:
        child = int(worker.stdout.readline())
        os.kill(worker.pid, 9)
        worker.wait(timeout=10)
        wait_for(lambda: not Path(f'/proc/{child}').exists() or _zombie(child), 10, 'the deployment process gone')
        (kid,) = _pids(kids)
        wait_for(lambda: _gone(kid), 10, 'the program the policy started gone')
    finally:
        if worker.poll() is None:
            worker.kill()
        _kill_all(_pids(kids))


def _pids(path: Path) -> list[int]:
    return [int(line) for line in path.read_text().split()] if path.exists() else []


def _gone(pid: int) -> bool:
    return not Path(f'/proc/{pid}').exists() or _zombie(pid)


def _kill_all(pids: list[int]) -> None:
    for pid in pids:
        if not _gone(pid):
            os.kill(pid, signal.SIGKILL)


def test_what_a_policy_started_ends_with_its_deployment_process_restarted_or_stopped(tmp_path):
    path = write_policy(tmp_path, 'parent')
    kids = tmp_path / 'kids'
    try:
        with serve_policy_file(path, isolation='process', kids=str(kids)) as server, channel(server.port) as ch:
            stub = pb_grpc.PolicyServiceStub(ch)
            assert wait_ready(stub, 'parent', timeout=RESTART_WAIT_S).ready
            robot = Stream(stub, 'parent', 'robot-parent')
            assert robot.start().HasField('started')
            assert robot.ask(req(1, exit='3')).error.code == pb.POLICY_EXCEPTION
            robot.end()
            served_again(stub, 'parent', 1)              # restarted: its load started a second program
            first, second = _pids(kids)
            wait_for(lambda: _gone(first), 10, "the crashed process's program gone")
            assert not _gone(second)
        wait_for(lambda: _gone(second), 10, "the stopped process's program gone")
    finally:
        _kill_all(_pids(kids))


def _zombie(pid: int) -> bool:
    try:
        return Path(f'/proc/{pid}/stat').read_text().split()[2] == 'Z'
    except OSError:
        return True


def _seq(*args: str, env: dict | None = None, timeout: float = 120) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    out = subprocess.run([sys.executable, '-m', 'sequence_ai_ros.cli', *args], capture_output=True, text=True,
                         timeout=timeout, env={**os.environ, **(env or {})}, cwd=REPO)
    return out, time.monotonic() - start


@pytest.mark.slow
@pytest.mark.parametrize('misbehaviour', ['sleep', 'spin'])
def test_seq_deploy_timeout_bounds_a_hang_at_import(seq_home, tmp_path, misbehaviour):
    path = write_policy(tmp_path, 'hangs', misbehave_at_import=True)
    out, took = _seq('deploy', str(path), '--timeout', '8', env={'SEQ_TEST_AT_IMPORT': misbehaviour})
    assert out.returncode != 0
    assert 'hangs' in out.stderr and 'exceeded 8 s' in out.stderr and 'importing' in out.stderr, out.stderr
    assert took < 8 + 30          # the bound plus a start-up generous under load, never the 600 s sleep


def test_os_exit_at_import_names_the_deployment_and_the_exit_code(seq_home, tmp_path):
    path = write_policy(tmp_path, 'exits', misbehave_at_import=True)
    out, _ = _seq('deploy', str(path), env={'SEQ_TEST_AT_IMPORT': 'exit'})
    assert out.returncode != 0 and "'exits'" in out.stderr and 'exit code 7' in out.stderr, out.stderr
    for isolation in ('process', 'none'):
        out, _ = _seq('serve', str(path), '--port', '0', '--isolation', isolation, env={'SEQ_TEST_AT_IMPORT': 'exit'},
                      timeout=60)
        assert out.returncode != 0 and "'exits'" in out.stderr and 'exit code 7' in out.stderr, out.stderr


@pytest.mark.slow
@pytest.mark.parametrize('isolation', ['process', 'none'])
def test_seq_serve_load_timeout_bounds_a_sleep_at_import(tmp_path, isolation):
    path = write_policy(tmp_path, 'sleepy', misbehave_at_import=True)
    out, took = _seq('serve', str(path), '--port', '0', '--load-timeout', '5', '--isolation', isolation,
                     env={'SEQ_TEST_AT_IMPORT': 'sleep'}, timeout=90)
    assert out.returncode != 0 and "'sleepy'" in out.stderr and 'exceeded 5 s' in out.stderr, out.stderr
    assert took < 5 + 30


def test_a_load_past_its_deadline_fails_that_deployment_and_its_process_is_killed(tmp_path):
    path = write_policy(tmp_path, 'slowload')
    with serve_policy_file(path, load_hang=600, load_timeout_s=1.0, warm=True, isolation='process') as server:
        ch = channel(server.port)
        reply = wait_ready(pb_grpc.PolicyServiceStub(ch), 'slowload', timeout=30)
        assert reply.state == 'failed' and 'load exceeded 1 s' in reply.message
        process = server.runtimes['slowload']._instance_loading.process.process
        assert process.wait(timeout=10) == -9
        ch.close()


def test_isolation_none_keeps_the_policy_in_the_worker(tmp_path):
    path = write_policy(tmp_path, 'inproc')
    with serve_policy_file(path, isolation='none') as server:
        stub = pb_grpc.PolicyServiceStub(channel(server.port))
        assert wait_ready(stub, 'inproc').ready
        robot = Stream(stub, 'inproc', 'r1')
        robot.start()
        chunk = robot.ask(req(1, 2.5)).chunk
        assert np.allclose(codec.from_tensor(chunk.actions)[:, 0], 2.5)
        robot.end()
        assert server.runtimes['inproc']._instance.policy.__class__.__name__ == 'Crashy'


def test_batching_across_robots_holds_in_the_deployment_process(tmp_path):
    path = tmp_path / 'batched' / 'policy.py'
    path.parent.mkdir()
    path.write_text(textwrap.dedent('''
        import numpy as np
        import sequence_ai_ros.policy as seq
        from sequence_ai_ros.exceptions import PolicyException

        @seq.policy(action_space='joint_absolute', action_names=['a', 'b'], dt=0.1, chunk_length=2,
                    observation=seq.ObservationContract(state_names=['a', 'b']), batching=seq.Batching(2, 5.0))
        class Batched:
            def infer(self, inp, episode):
                return self.infer_batch([inp], [episode])[0]

            def infer_batch(self, inputs, episodes):   # each chunk: (its state, the batch's size)
                return [PolicyException('seven is refused') if i.observation.state[0] == 7 else
                        np.tile(np.array([i.observation.state[0], len(inputs)], np.float32), (2, 1)) for i in inputs]
    '''))
    with serve_policy_file(path, 'batched', isolation='process') as server, channel(server.port) as ch:
        stub = pb_grpc.PolicyServiceStub(ch)
        assert wait_ready(stub, 'batched', timeout=RESTART_WAIT_S).ready
        a, b = Stream(stub, 'batched', 'a'), Stream(stub, 'batched', 'b')
        a.start(), b.start()
        a.send(observation=req(1, 3.0))
        b.send(observation=req(1, 7.0))
        ra, rb = a.recv(timeout=30), b.recv(timeout=30)
        assert codec.from_tensor(ra.chunk.actions)[0].tolist() == [3.0, 2.0]    # one call for both robots
        assert rb.error.code == pb.POLICY_EXCEPTION and 'seven is refused' in rb.error.message
        a.end(), b.end()
        assert server.runtimes['batched'].isolated


def _serve_cli(path: Path, *options: str) -> tuple[subprocess.Popen, int]:
    """``seq serve PATH`` in a session of its own (a terminal's or a unit's group, which a test may signal whole)."""
    worker = subprocess.Popen([sys.executable, '-m', 'sequence_ai_ros.cli', 'serve', str(path), '--port', '0',
                               '--isolation', 'process', *options], stdout=subprocess.PIPE, text=True, cwd=REPO,
                              start_new_session=True)
    line = worker.stdout.readline()
    assert line.startswith('serving '), line
    return worker, int(line.rsplit(':', 1)[1].split()[0])


@pytest.mark.slow
@pytest.mark.parametrize('sig', [signal.SIGINT, signal.SIGTERM], ids=['SIGINT', 'SIGTERM'])
def test_a_stop_signal_to_the_whole_group_drains_without_failing_the_inference_in_flight(tmp_path, sig):
    """Ctrl-C in a terminal, or systemd's stop, signals every process of the worker's group: the worker drains."""
    path = write_policy(tmp_path, 'drained')
    worker, port = _serve_cli(path, '--drain-timeout', '30')
    try:
        with channel(port) as ch:
            stub = pb_grpc.PolicyServiceStub(ch)
            assert wait_ready(stub, 'drained', timeout=RESTART_WAIT_S).ready
            robot = Stream(stub, 'drained', 'robot-drained')
            assert robot.start().HasField('started')
            assert robot.ask(req(1)).HasField('chunk')
            mark = tmp_path / 'inferring'
            robot.send(observation=req(2, 2.0, hang='1.0', mark=str(mark)))
            wait_for(mark.exists, 30, 'the inference to begin')
            os.killpg(worker.pid, sig)
            reply = robot.recv(timeout=30)
            assert reply.HasField('chunk'), reply          # the drain lets the running episode go on
            assert codec.from_tensor(reply.chunk.actions)[0, 0] == 2.0
            assert robot.ask(req(3, 3.0)).HasField('chunk')
            assert robot.end().HasField('ended')
        assert worker.wait(timeout=60) == 0
    finally:
        if worker.poll() is None:
            os.killpg(worker.pid, signal.SIGKILL)
            worker.wait()


def _two_robots_each_get_their_own_chunks(stub, deployment: str, first: int, last: int) -> None:
    robots = [Stream(stub, deployment, f'{deployment}-{k}') for k in range(2)]
    for robot in robots:
        assert robot.start().HasField('started')
    for rid in range(first, last):
        for k, robot in enumerate(robots):
            reply = robot.ask(req(rid, 100 * k + rid))
            assert reply.HasField('chunk'), reply
            value, count = codec.from_tensor(reply.chunk.actions)[0]
            assert (value, count) == (100 * k + rid, rid - first + 1)     # its request; its episode's count
    for robot in robots:
        assert robot.end().HasField('ended')


def test_a_policy_that_forks_and_goes_on_never_sends_a_robot_another_requests_chunk(tmp_path):
    path = write_policy(tmp_path, 'forks')
    forked = tmp_path / 'forked'
    with serve_policy_file(path, isolation='process') as server, channel(server.port) as ch:
        stub = pb_grpc.PolicyServiceStub(ch)
        assert wait_ready(stub, 'forks', timeout=RESTART_WAIT_S).ready
        robot = Stream(stub, 'forks', 'robot-forks')
        assert robot.start().HasField('started')
        reply = robot.ask(req(1, 1.0, fork=str(forked)))  # the forked copy returns too, but never answers
        assert codec.from_tensor(reply.chunk.actions)[0, 0] == 1.0
        (copy,) = _pids(forked)
        wait_for(lambda: _gone(copy), 10, 'the forked copy, back from infer, gone instead of serving')
        assert robot.end().HasField('ended')
        _two_robots_each_get_their_own_chunks(stub, 'forks', 2, 12)
        assert server.runtimes['forks'].restarts == 0


@pytest.mark.parametrize('batching', [False, True], ids=['from the event loop', 'from the inference thread'])
def test_bytes_that_are_no_answer_fail_the_request_and_restart_the_process_never_shifting_chunks(tmp_path, batching):
    """A stray write on the socket: read apart from the answer, it must not pass for it, nor the answer for the next."""
    path = write_policy(tmp_path, 'junk')
    if batching:
        text = path.read_text().replace('observation=seq.ObservationContract(state_names=NAMES))',
                                        'observation=seq.ObservationContract(state_names=NAMES), '
                                        'batching=seq.Batching(1, 0.001))')
        batch = ('    def infer_batch(self, inputs, episodes):\n'
                 '        return [self.infer(i, e) for i, e in zip(inputs, episodes)]\n\n')
        infer = '    def infer(self, inp, episode):'
        path.write_text(text.replace(infer, batch + infer))
    with serve_policy_file(path, isolation='process') as server, channel(server.port) as ch:
        stub = pb_grpc.PolicyServiceStub(ch)
        assert wait_ready(stub, 'junk', timeout=RESTART_WAIT_S).ready
        robot = Stream(stub, 'junk', 'robot-junk')
        assert robot.start().HasField('started')
        assert robot.ask(req(1, 1.0)).HasField('chunk')
        reply = robot.ask(req(2, 2.0, junk='1'))
        assert reply.error.code == pb.POLICY_EXCEPTION, reply
        assert "deployment 'junk'" in reply.error.message and 'no answer' in reply.error.message, reply
        robot.end()
        served_again(stub, 'junk', 2)
        _two_robots_each_get_their_own_chunks(stub, 'junk', 3, 9)
        assert server.runtimes['junk'].restarts == 1


@pytest.mark.parametrize('helper', ['fork', 'program'])
def test_a_process_that_exits_is_named_so_even_when_a_helper_it_started_holds_its_socket(tmp_path, helper,
                                                                                        monkeypatch):
    """The exit itself is noticed: neither the inference deadline nor the worker's periodic check (every 10 s)."""
    monkeypatch.setattr(server_module, 'USAGE_FLUSH_S', 600.0)
    path = write_policy(tmp_path, 'helped')
    with serve_policy_file(path, isolation='process', helper=helper, inference_timeout_s=600.0) as server, \
            channel(server.port) as ch:
        stub = pb_grpc.PolicyServiceStub(ch)
        assert wait_ready(stub, 'helped', timeout=RESTART_WAIT_S).ready
        robot = Stream(stub, 'helped', 'robot-helped')
        assert robot.start().HasField('started')
        robot.send(observation=req(1, exit='3'))
        reply = robot.recv(timeout=30)
        assert reply is not None, 'the exit not noticed within 30 s'
        assert reply.error.code == pb.POLICY_EXCEPTION and 'exit code 3' in reply.error.message, reply
        robot.end()
