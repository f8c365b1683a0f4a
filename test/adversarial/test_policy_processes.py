"""Break-it: what a policy starts, prints and allocates stays within its deployment process (``--isolation process``).

- Detached programs (``Popen(start_new_session=True)``, a double fork with ``setsid``) started in ``__init__`` or
  ``infer`` end with their deployment process: after ``seq deploy`` (whose ``| tail -1`` then returns), after
  episodes, after the deployment process is killed with SIGKILL, and after the worker's exit, no process of the
  policy's is left (counted with psutil by a variable of its environment).
- A policy's prints go through the worker's log, cut and bounded: 18 prints of 2 MB leave a log of a few MB.
- With ``seq serve --deployment-memory-mb N``, a leaking policy's process is ended and restarted, its robot gets
  an error naming the limit, and another deployment's robot is served all along.
- ``signal.signal`` in a policy's ``__init__`` deploys and serves (the deployment process's main thread runs it).
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

import psutil
import pytest
from test_worker_support import Stream, channel, state_request, wait_for, wait_ready

from sequence_ai_ros.exceptions import DeploymentError
from sequence_ai_ros.policy.loader import load_policy_file
from sequence_ai_ros.protocol import codec
from sequence_ai_ros.protocol import sequence_ai_pb2 as pb
from sequence_ai_ros.protocol import sequence_ai_pb2_grpc as pb_grpc
from sequence_ai_ros.worker import create_server, serve_policy_file
from sequence_ai_ros.worker.registry import deploy
from sequence_ai_ros.worker.validate import dry_run

REPO = Path(__file__).resolve().parents[2]
#: Bound of a wait that must stay generous on a loaded 2-core CI machine (s).
WAIT_S = 60.0
#: The environment variable naming the test a policy's processes belong to (inherited by what they start).
RECORD_ENV = 'SEQ_TEST_RECORD'

POLICY = textwrap.dedent('''
    import os, signal, subprocess, sys, time
    import numpy as np
    import sequence_ai_ros.policy as seq

    NAMES = ['a', 'b']
    KEPT = []


    def detach():
        """A program in a session of its own, and a double fork with setsid: both outlive their parent."""
        subprocess.Popen(['sleep', '300'], start_new_session=True)
        first = os.fork()
        if first == 0:
            os.setsid()
            if os.fork() == 0:
                time.sleep(300)
            os._exit(0)
        os.waitpid(first, 0)


    @seq.policy(action_space='joint_absolute', action_names=NAMES, dt=0.1, chunk_length=4,
                observation=seq.ObservationContract(state_names=NAMES))
    class Tenant:
        def __init__(self):
            signal.signal(signal.SIGUSR1, lambda signum, frame: None)   # the main thread's alone
            if os.environ.get('SEQ_TEST_RECORD'):
                detach()

        def infer(self, inp, episode):
            p = inp.observation.params
            if 'detach' in p:
                detach()
            if 'line' in p:                       # one line of N bytes
                print('x' * int(p['line']), flush=True)
            if 'lines' in p:                      # N bytes in lines of 100
                sys.stderr.write(('y' * 99 + '\\n') * (int(p['lines']) // 100))
                sys.stderr.flush()
            if 'leak' in p:                       # N MB kept (written: resident)
                KEPT.append(np.ones(int(p['leak']) << 20, np.uint8))
                time.sleep(float(p.get('pause', 0)))
            if 'childleak' in p:                  # a helper process holding N MB (a server, a data worker)
                code = f'import time; b = bytearray({int(p["childleak"])} << 20); time.sleep(120)'
                KEPT.append(subprocess.Popen([sys.executable, '-c', code]))
                time.sleep(float(p.get('pause', 0)))
            return np.tile(np.array([inp.observation.state[0], len(KEPT)], np.float32), (4, 1))
''')


def write_policy(root: Path, name: str) -> Path:
    path = root / name / 'policy.py'
    path.parent.mkdir(parents=True)
    path.write_text(POLICY)
    return path


def req(rid: int, value: float = 1.0, **params: str) -> pb.ObservationRequest:
    return state_request(rid, [value, 0.0], ['a', 'b'], params=params)


def tenants(record: str, but: tuple[int, ...] = ()) -> list[psutil.Process]:
    """The live processes whose environment names ``record`` (zombies and ``but`` left out)."""
    out = []
    for proc in psutil.process_iter():
        try:
            if proc.pid in but or proc.pid == os.getpid() or proc.status() == psutil.STATUS_ZOMBIE:
                continue
            if proc.environ().get(RECORD_ENV) == record:
                out.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return out


def orphans(record: str, but: tuple[int, ...] = ()) -> list[psutil.Process]:
    """Of :func:`tenants`, those whose parent is pid 1 (or gone)."""
    out = []
    for proc in tenants(record, but):
        try:
            if proc.ppid() <= 1:
                out.append(proc)
        except psutil.NoSuchProcess:
            pass
    return out


def _env(record: str) -> dict[str, str]:
    return {**os.environ, RECORD_ENV: record, 'PYTHONPATH': os.pathsep.join(
        p for p in (str(REPO), os.environ.get('PYTHONPATH')) if p)}


def test_seq_deploy_leaves_no_process_behind_and_its_pipe_ends(seq_home, tmp_path):
    """``seq deploy ... | tail -1`` returns: nothing the policy detached holds its stdout, or lives on."""
    path = write_policy(tmp_path, 'detaches')
    record = f'deploy-{os.getpid()}-{time.monotonic_ns()}'
    shell = f'{sys.executable} -m sequence_ai_ros.cli deploy {path} --timeout 60 | tail -1'
    try:
        out = subprocess.run(['bash', '-c', shell], capture_output=True, text=True, timeout=120,
                             env=_env(record), cwd=REPO)
        assert out.returncode == 0, out.stderr
        assert out.stdout.startswith('serve it with: seq serve detaches'), (out.stdout, out.stderr)
        assert wait_for(lambda: not tenants(record), 10, 'the detached programs gone')
    finally:
        for proc in tenants(record):
            proc.kill()


def _serve(path: Path, record: str, log: Path, *options: str) -> tuple[subprocess.Popen, int]:
    """``seq serve PATH`` (its log into ``log``); return it and its port."""
    with log.open('wb') as err:
        worker = subprocess.Popen([sys.executable, '-m', 'sequence_ai_ros.cli', 'serve', str(path), '--port', '0',
                                   '--isolation', 'process', *options], stdout=subprocess.PIPE, stderr=err,
                                  text=True, cwd=REPO, env=_env(record), start_new_session=True)
    line = worker.stdout.readline()
    assert line.startswith('serving '), (line, log.read_text()[-2000:])
    return worker, int(line.rsplit(':', 1)[1].split()[0])


def _deployment_process(worker: subprocess.Popen) -> psutil.Process:
    (host,) = [p for p in psutil.Process(worker.pid).children() if 'policy_host' in ' '.join(p.cmdline())]
    return host


def _stop(worker: subprocess.Popen) -> None:
    if worker.poll() is None:
        worker.send_signal(signal.SIGTERM)
        try:
            worker.wait(timeout=WAIT_S)
        except subprocess.TimeoutExpired:
            os.killpg(worker.pid, signal.SIGKILL)
            worker.wait()


def test_detached_programs_end_with_episodes_a_killed_deployment_process_and_the_worker(tmp_path):
    path = write_policy(tmp_path, 'detaches')
    record = f'serve-{os.getpid()}-{time.monotonic_ns()}'
    worker, port = _serve(path, record, tmp_path / 'worker.log', '--warm', '--drain-timeout', '5')
    try:
        with channel(port) as ch:
            stub = pb_grpc.PolicyServiceStub(ch)
            assert wait_ready(stub, 'detaches', timeout=WAIT_S).ready
            for episode in range(9):
                robot = Stream(stub, 'detaches', f'robot-{episode}')
                assert robot.start().HasField('started')
                reply = robot.ask(req(1, float(episode), detach='1'))
                assert reply.HasField('chunk'), reply
                assert robot.end().HasField('ended')
                assert orphans(record, but=(worker.pid,)) == [], episode
            # 1 (__init__) + 9 episodes, two detached programs each, all under the deployment process
            host = _deployment_process(worker)
            assert len(tenants(record, but=(worker.pid, host.pid))) == 2 * 10
            assert all(p.ppid() == host.pid for p in tenants(record, but=(worker.pid, host.pid)))
            host.kill()                          # kill -9: it cannot end them; the worker does
            robot = Stream(stub, 'detaches', 'robot-after-kill')
            assert robot.start().HasField('started')
            deadline, rid = time.monotonic() + WAIT_S, 1
            while not (reply := robot.ask(req(rid, 2.0))).HasField('chunk'):
                assert time.monotonic() < deadline, reply
                rid += 1
                time.sleep(0.1)
            assert robot.end().HasField('ended')
            assert wait_for(lambda: not orphans(record, but=(worker.pid,)), 10, 'the killed process\'s programs gone')
            restarted = _deployment_process(worker)
            assert restarted.pid != host.pid
            assert len(tenants(record, but=(worker.pid, restarted.pid))) == 2     # its own __init__'s
        _stop(worker)
        assert worker.returncode == 0
        assert wait_for(lambda: not tenants(record), 10, 'every process of the policy gone with the worker')
    finally:
        _stop(worker)
        for proc in tenants(record):
            proc.kill()


def test_detached_programs_end_when_the_worker_is_killed(tmp_path):
    """``kill -9`` of the worker: its deployment process notices, ends what the policy started, and exits."""
    path = write_policy(tmp_path, 'detaches')
    record = f'killed-{os.getpid()}-{time.monotonic_ns()}'
    worker, port = _serve(path, record, tmp_path / 'worker.log', '--warm')
    try:
        with channel(port) as ch:
            stub = pb_grpc.PolicyServiceStub(ch)
            assert wait_ready(stub, 'detaches', timeout=WAIT_S).ready
            robot = Stream(stub, 'detaches', 'robot-killed')
            assert robot.start().HasField('started')
            assert robot.ask(req(1, detach='1')).HasField('chunk')
            host = _deployment_process(worker)
            assert len(tenants(record, but=(worker.pid, host.pid))) == 2 * 2
            worker.kill()
            worker.wait(timeout=WAIT_S)
            robot.cancel()
        assert wait_for(lambda: not tenants(record), 10, 'every process of the policy gone with the killed worker')
    finally:
        _stop(worker)
        for proc in tenants(record):
            proc.kill()


def test_a_policy_printing_megabytes_leaves_a_bounded_log(tmp_path):
    path = write_policy(tmp_path, 'chatty')
    record = f'print-{os.getpid()}-{time.monotonic_ns()}'
    log = tmp_path / 'worker.log'
    worker, port = _serve(path, record, log, '--warm', '--drain-timeout', '5')
    try:
        with channel(port) as ch:
            stub = pb_grpc.PolicyServiceStub(ch)
            assert wait_ready(stub, 'chatty', timeout=WAIT_S).ready
            robot = Stream(stub, 'chatty', 'robot-chatty')
            assert robot.start().HasField('started')
            for rid in range(1, 19):             # 18 x 2 MB: one long line, or lines of 100 bytes
                kind = 'line' if rid % 2 else 'lines'
                assert robot.ask(req(rid, **{kind: str(2 << 20)})).HasField('chunk')
            assert robot.end().HasField('ended')
        _stop(worker)
    finally:
        _stop(worker)
    text = log.read_text(errors='replace')
    assert log.stat().st_size < 6 << 20, log.stat().st_size      # 36 MB printed
    assert 'policy chatty stdout: xxxx' in text and 'more bytes cut' in text
    assert 'policy chatty stderr: yyyy' in text
    assert 'were left out of the log' in text


@pytest.fixture
def limited(seq_home, tmp_path):
    """A worker serving ``leaky`` and ``steady``, each deployment process limited to 400 MB."""
    for name in ('leaky', 'steady'):
        deploy(write_policy(tmp_path, name), home=seq_home, dry_timeout_s=60)
    server = create_server(['leaky', 'steady'], home=seq_home, idle_timeout_s=120, isolation='process',
                           deployment_memory_mb=400, inference_timeout_s=30.0)
    ch = channel(server.port)
    stub = pb_grpc.PolicyServiceStub(ch)
    for name in ('leaky', 'steady'):
        assert wait_ready(stub, name, timeout=WAIT_S).ready
    yield server, stub
    ch.close()
    server.stop(grace=0.5)


def test_a_leaking_policy_is_restarted_at_its_memory_limit_and_another_deployment_is_served(limited):
    server, stub = limited
    kinds: list[str] = []
    halt = threading.Event()

    def steady() -> None:
        stream = Stream(stub, 'steady', 'robot-steady')
        assert stream.start().HasField('started')
        rid = 0
        while not halt.is_set():
            rid += 1
            reply = stream.ask(req(rid))
            kinds.append(reply.WhichOneof('kind') if reply is not None else 'closed')
            time.sleep(0.02)
        stream.end()

    thread = threading.Thread(target=steady, daemon=True)
    thread.start()
    robot = Stream(stub, 'leaky', 'robot-leaky')
    assert robot.start().HasField('started')
    rss = psutil.Process(server.runtimes['leaky']._instance.process.pid).memory_info().rss
    assert rss < 300 << 20, rss           # room below the limit for a few leaks
    errors = []
    for rid in range(1, 12):              # 100 MB kept per request: over 400 MB within a few
        reply = robot.ask(req(rid, leak='100', pause='0.5'))
        if reply.HasField('error'):
            errors.append(reply.error)
            break
        assert codec.from_tensor(reply.chunk.actions)[0, 1] == rid
    assert errors, 'never stopped at its memory limit'
    assert errors[0].code == pb.POLICY_EXCEPTION, errors
    assert 'memory limit of 400 MB' in errors[0].message and "'leaky'" in errors[0].message, errors
    robot.end()
    again = Stream(stub, 'leaky', 'robot-leaky-again')
    assert again.start().HasField('started')
    deadline, rid = time.monotonic() + WAIT_S, 1
    while not (reply := again.ask(req(rid))).HasField('chunk'):
        assert reply.error.code == pb.NOT_READY and time.monotonic() < deadline, reply
        rid += 1
        time.sleep(0.1)
    assert codec.from_tensor(reply.chunk.actions)[0, 1] == 0       # a fresh process: nothing kept
    again.end()
    wait_for(lambda: len(kinds) >= 3, 10, 'the steady robot served')
    halt.set()
    thread.join(timeout=30)
    assert kinds and set(kinds) == {'chunk'}, kinds
    assert server.runtimes['leaky'].restarts == 1 and server.runtimes['steady'].restarts == 0


def test_signal_handlers_off_the_main_thread_are_named_with_what_to_do(tmp_path):
    """In the worker's threads (``--isolation none``) ``signal.signal`` fails: the message says what to do."""
    definition = load_policy_file(write_policy(tmp_path, 'signals'))
    with pytest.raises(DeploymentError) as info:
        dry_run(definition, timeout_s=60)
    assert 'signal only works in main thread' in str(info.value)
    assert '--isolation process' in str(info.value)


def test_signal_handlers_in_init_serve_in_a_deployment_process_and_are_named_inside_the_worker(tmp_path):
    path = write_policy(tmp_path, 'signals')
    with serve_policy_file(path, isolation='process', warm=True) as server, channel(server.port) as ch:
        stub = pb_grpc.PolicyServiceStub(ch)
        assert wait_ready(stub, 'signals', timeout=WAIT_S).ready
    with serve_policy_file(path, isolation='none', warm=True) as server, channel(server.port) as ch:
        stub = pb_grpc.PolicyServiceStub(ch)
        reply = wait_ready(stub, 'signals', timeout=WAIT_S)
        assert reply.state == 'failed', reply
        assert 'signal only works in main thread' in reply.message and '--isolation process' in reply.message


def test_the_memory_limit_needs_a_deployment_process():
    from sequence_ai_ros.exceptions import ConfigError
    from sequence_ai_ros.worker.config import ServerConfig

    with pytest.raises(ConfigError, match='deployment_memory_mb'):
        ServerConfig(isolation='none', deployment_memory_mb=100)
    assert ServerConfig(deployment_memory_mb=100).deployment_memory_mb == 100
    assert ServerConfig().deployment_memory_mb == 0


def test_the_memory_limit_counts_what_the_policy_started(limited):
    """Helper processes count: three of 150 MB under a 400 MB limit restart the deployment, naming the limit."""
    server, stub = limited
    robot = Stream(stub, 'leaky', 'robot-children')
    assert robot.start().HasField('started')
    errors = []
    for rid in range(1, 8):
        reply = robot.ask(req(rid, childleak='150', pause='1.0'))
        if reply.HasField('error'):
            errors.append(reply.error)
            break
    assert errors, 'never stopped at its memory limit'
    assert errors[0].code == pb.POLICY_EXCEPTION and 'memory limit of 400 MB' in errors[0].message, errors
    robot.end()
    wait_for(lambda: server.runtimes['leaky'].restarts == 1, 20, 'the deployment restarted')
