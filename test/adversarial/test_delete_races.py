"""``seq delete`` beside a running worker of several deployments: what the worker keeps serving and unloads.

- The HAProxy agent answers for the deployments served now: deleting one does not drain the replica for the
  others.
- A deleted deployment's policy is unloaded (under ``--isolation process`` its deployment process ends) once the
  episodes ``--force`` left running have ended; nothing of it outlives them.
- A deployment deleted and registered again before the worker looked (versions start again at 1) is not
  served as the new registration's version 1: the worker retires what it served.
- ``seq delete`` right after a robot was told its episode started refuses (the worker lists the episode before
  it starts it), and an EpisodeStart on a stream opened before a forced delete is refused, typed.
- An episode started while ``seq delete`` asks whether to remove the field data is seen after the answer.
"""

from __future__ import annotations

import os
import pty
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
from test_worker_support import Stream, channel, state_request, wait_for, wait_ready

from sequence_ai_ros.cli import main as seq_main
from sequence_ai_ros.protocol import sequence_ai_pb2 as pb
from sequence_ai_ros.protocol import sequence_ai_pb2_grpc as pb_grpc
from sequence_ai_ros.worker import create_server
from sequence_ai_ros.worker.registry import Registry, deploy

POLICY = '''
import numpy as np

import sequence_ai_ros.policy as seq

NAMES = ['a', 'b']


@seq.policy(action_space='joint_absolute', action_names=NAMES, dt=0.05, chunk_length=4,
            observation=seq.ObservationContract(state_names=NAMES))
class Valued:
    def infer(self, inp, episode):
        return np.array([[{value}, 0.0]] * 4, np.float32)
'''


def write(path: Path, value: float) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(POLICY.format(value=value))
    return path


def agent(port: int) -> str:
    with socket.create_connection(('127.0.0.1', port), timeout=10) as s:
        s.settimeout(10)
        return s.recv(64).decode().strip()


def ended(pid: int) -> bool:
    """True when process ``pid`` is gone (or a zombie, exited and not yet reaped)."""
    try:
        return Path(f'/proc/{pid}/stat').read_text().rsplit(')', 1)[1].split()[0] == 'Z'
    except (OSError, IndexError):
        return True


def test_deleting_one_deployment_leaves_the_replica_ready_for_the_others(tmp_path, seq_home):
    deploy(write(tmp_path / 'arm' / 'policy.py', 1.0))
    deploy(write(tmp_path / 'hand' / 'policy.py', 2.0))
    with create_server(['arm', 'hand'], home=seq_home, agent_port=0, warm=True) as server, \
            channel(server.port) as ch:
        stub = pb_grpc.PolicyServiceStub(ch)
        assert wait_ready(stub, 'arm').ready and wait_ready(stub, 'hand').ready
        wait_for(lambda: agent(server.agent.port) == 'up ready', timeout=10, what='the agent up')
        assert seq_main(['delete', 'arm', '--yes']) == 0
        wait_ready(stub, 'hand')                        # a lookup: the worker retires arm
        assert list(server.runtimes) == ['hand']
        assert agent(server.agent.port) == 'up ready'   # hand is still served: HAProxy keeps sending its robots


def test_a_deleted_deployment_is_unloaded_once_its_forced_episodes_end(tmp_path, seq_home):
    deploy(write(tmp_path / 'arm' / 'policy.py', 1.0))
    deploy(write(tmp_path / 'hand' / 'policy.py', 2.0))
    with create_server(['arm', 'hand'], home=seq_home, isolation='process', warm=True) as server, \
            channel(server.port) as ch:
        stub = pb_grpc.PolicyServiceStub(ch)
        assert wait_ready(stub, 'arm', timeout=60).ready and wait_ready(stub, 'hand', timeout=60).ready
        arm = server.runtimes['arm']
        pid = arm._instance.process.process.pid            # arm's deployment process
        running = Stream(stub, 'arm', 'running')
        assert running.start().HasField('started')
        assert seq_main(['delete', 'arm', '--force', '--yes']) == 0
        wait_ready(stub, 'hand')                           # a lookup: the worker retires arm
        assert 'arm' not in server.runtimes
        assert running.ask(state_request(1, [0.0, 0.0], ['a', 'b'])).HasField('chunk')   # --force: it goes on
        assert not ended(pid)
        assert running.end().HasField('ended')
        wait_for(lambda: ended(pid), timeout=30, what="the deleted deployment's process to end")
        wait_for(lambda: not any(t.name == 'seq-infer-arm' for t in threading.enumerate()), timeout=30,
                 what="the deleted deployment's inference thread to stop")


def test_a_deployment_deleted_and_registered_again_unseen_is_not_served_as_the_new_version(tmp_path, seq_home):
    policy = write(tmp_path / 'arm' / 'policy.py', 1.0)
    deploy(policy)
    with create_server(['arm'], home=seq_home, warm=True) as server, channel(server.port) as ch:
        stub = pb_grpc.PolicyServiceStub(ch)
        assert wait_ready(stub, 'arm').ready
        assert seq_main(['delete', 'arm', '--yes']) == 0
        deploy(write(policy, 2.0))                  # no lookup in between: the worker never saw the gap
        assert Registry().get('arm').version == 1   # the new registration's version 1 is another content
        stream = Stream(stub, 'arm', 'after')
        assert stream.start() is None                # the call fails: arm (as served) was deleted
        assert stream.error.code() == grpc.StatusCode.NOT_FOUND and 'UNKNOWN_DEPLOYMENT' in stream.error.details()
        assert 'arm' not in server.runtimes


def test_seq_delete_refuses_right_after_a_robot_was_told_its_episode_started(tmp_path, seq_home, capsys):
    """Attack: ``seq delete`` (no --force) just after EpisodeStarted deleted the deployment in 4 of 5 tries.

    The worker's live file was polled every 0.2 s, so an episode started within that time was not listed.
    """
    deploy(write(tmp_path / 'arm' / 'policy.py', 1.0))
    with create_server(['arm'], home=seq_home, warm=True) as server, channel(server.port) as ch:
        stub = pb_grpc.PolicyServiceStub(ch)
        assert wait_ready(stub, 'arm').ready
        for k in range(5):
            stream = Stream(stub, 'arm', f'ep-{k}')
            assert stream.start().HasField('started')
            assert seq_main(['delete', 'arm', '--yes']) == 2, capsys.readouterr()
            assert 'arm has episodes running' in capsys.readouterr().err
            assert [r.name for r in Registry().list()] == ['arm']
            assert stream.end().HasField('ended')
            stream.close()


def test_an_episode_start_on_a_stream_opened_before_a_forced_delete_is_refused(tmp_path, seq_home):
    deploy(write(tmp_path / 'arm' / 'policy.py', 1.0))
    with create_server(['arm'], home=seq_home, warm=True) as server, channel(server.port) as ch:
        stub = pb_grpc.PolicyServiceStub(ch)
        assert wait_ready(stub, 'arm').ready
        stream = Stream(stub, 'arm', 'late')                 # opened, no EpisodeStart yet
        assert wait_for(lambda: server.servicer.open_streams('arm') == 1, what='the stream to be admitted')
        assert seq_main(['delete', 'arm', '--force', '--yes']) == 0
        reply = stream.start()
        assert reply.HasField('error') and reply.error.code == pb.UNKNOWN_DEPLOYMENT, reply
        assert 'was deleted' in reply.error.message
        stream.close()
        assert server.runtimes == {}


def _read_until(fd: int, text: str, timeout: float = 30.0) -> str:
    out = b''
    deadline = time.monotonic() + timeout
    os.set_blocking(fd, False)
    while text.encode() not in out:
        assert time.monotonic() < deadline, out
        try:
            out += os.read(fd, 4096)
        except BlockingIOError:
            time.sleep(0.02)
    return out.decode()


def test_an_episode_started_while_seq_delete_asks_is_seen_after_the_answer(tmp_path, seq_home):
    """Attack: ``seq delete`` looked at the running episodes before its prompt only.

    A robot started an episode while the operator read the question; the "y" then deleted the deployment and
    removed the field data that episode was writing.
    """
    deploy(write(tmp_path / 'arm' / 'policy.py', 1.0))
    blob = Registry().capture_dir('arm') / 'episodes' / 'e1' / 'blob'
    blob.parent.mkdir(parents=True)
    blob.write_bytes(b'x' * 1000)                          # field data of an earlier episode: delete asks
    with create_server(['arm'], home=seq_home, warm=True) as server, channel(server.port) as ch:
        stub = pb_grpc.PolicyServiceStub(ch)
        assert wait_ready(stub, 'arm').ready
        master, slave = pty.openpty()                      # a terminal: seq delete asks
        proc = subprocess.Popen([sys.executable, '-m', 'sequence_ai_ros.cli', 'delete', 'arm'], stdin=slave,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ})
        os.close(slave)
        try:
            assert 'remove it too? [y/N]' in _read_until(proc.stdout.fileno(), '[y/N]')
            stream = Stream(stub, 'arm', 'while-asked')
            assert stream.start().HasField('started')
            os.write(master, b'y\n')
            assert proc.wait(timeout=60) == 2
            assert 'arm has episodes running' in proc.stderr.read().decode()
        finally:
            if proc.poll() is None:
                proc.kill()
            os.close(master)
        assert [r.name for r in Registry().list()] == ['arm'] and blob.is_file()
        assert stream.end().HasField('ended')
