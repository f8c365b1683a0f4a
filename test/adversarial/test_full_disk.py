"""Usage on a real full filesystem: never undercounted, and every EpisodeEnd answered.

A small tmpfs (``size=``) is the worker's $SEQ_HOME; a file fills it while robots run episodes and
while the worker stops. The review: usage recorded 42 of 44 episodes.
"""

from __future__ import annotations

import errno
import subprocess
from pathlib import Path

import numpy as np
import pytest
from test_worker_support import Stream, channel, handshake, state_request, wait_ready

from sequence_ai_ros.home import usage_file
from sequence_ai_ros.protocol import sequence_ai_pb2 as pb
from sequence_ai_ros.protocol import sequence_ai_pb2_grpc as pb_grpc
from sequence_ai_ros.worker import serve_policy_file
from sequence_ai_ros.worker.usage import _connect, read_usage

FAST = Path(__file__).resolve().parents[1] / 'policies' / 'fast.py'
NAMES = ['j0', 'j1', 'j2']


@pytest.fixture
def small_disk(tmp_path):
    """A 1 MiB tmpfs (root only; skipped otherwise)."""
    mnt = tmp_path / 'disk'
    mnt.mkdir()
    done = subprocess.run(['mount', '-t', 'tmpfs', '-o', 'size=1m', 'tmpfs', str(mnt)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f'cannot mount a small tmpfs here (root needed): {done.stderr.decode().strip()}')
    yield mnt
    subprocess.run(['umount', '-l', str(mnt)], check=False)


def _fill(disk: Path) -> Path:
    """Fill ``disk`` to the last byte; return the filler (delete it to free the space)."""
    filler = disk / 'filler'
    with filler.open('wb', buffering=0) as f:
        for size in (65536, 4096, 1):
            try:
                while True:
                    f.write(b'\0' * size)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC
    return filler


def _episodes(server, n: int, prefix: str) -> list[pb.EpisodeEnded]:
    ended = []
    with channel(server.port) as ch:
        stub = pb_grpc.PolicyServiceStub(ch)
        handshake(stub, 'fast')
        assert wait_ready(stub, 'fast').ready
        for k in range(n):
            s = Stream(stub, 'fast', f'{prefix}-{k}')
            assert s.start().HasField('started')
            assert s.ask(state_request(1, np.zeros(3), NAMES)).HasField('chunk')
            s.send(end=pb.EpisodeEnd(reason='completed'))
            reply = s.recv(timeout=10)
            while reply is not None and not reply.HasField('ended'):
                reply = s.recv(timeout=10)
            assert reply is not None and reply.HasField('ended'), f'episode {k}: no EpisodeEnded'
            ended.append(reply.ended)
            s.close()
    return ended


CHILD = r"""
import json, sys
from pathlib import Path
sys.path[:0] = [sys.argv[3], sys.argv[4]]
from test_full_disk import FAST, _episodes, _fill
from sequence_ai_ros.worker import serve_policy_file
disk, home = Path(sys.argv[1]), Path(sys.argv[2])
server = serve_policy_file(FAST, 'fast', dim=3, host='127.0.0.1', port=0, home=home)
room = _episodes(server, 20, 'room')
_fill(disk)
full = _episodes(server, 24, 'full')
server.stop(grace=0.5)   # its flush fails too: the disk is still full
print(json.dumps({'room': [e.capture_error for e in room], 'full': [e.capture_error for e in full]}))
"""


def test_usage_is_never_undercounted_on_a_full_disk(small_disk):
    """A worker process runs 20 episodes, the disk fills, 24 more, it stops and exits on the full disk."""
    import json
    import sys

    home = small_disk / 'home'
    here = Path(__file__).resolve().parent
    done = subprocess.run([sys.executable, '-c', CHILD, str(small_disk), str(home), str(here), str(here.parent)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    errors = json.loads(done.stdout.splitlines()[-1])
    assert not any(errors['room']) and len(errors['full']) == 24          # every EpisodeEnd answered
    assert all(e.startswith("ending episode 'full-") for e in errors['full']), errors['full'][:2]
    assert read_usage(usage_file(home))['fast'].episodes == 44             # the process is gone: none lost
    (small_disk / 'filler').unlink()
    assert read_usage(usage_file(home))['fast'].episodes == 44

    # the next start writes the counts the last process could not, once: no double count
    server = serve_policy_file(FAST, 'fast', dim=3, host='127.0.0.1', port=0, home=home)
    try:
        assert not any(e.capture_error for e in _episodes(server, 1, 'after'))
    finally:
        server.stop(grace=0.5)
    assert read_usage(usage_file(home))['fast'].episodes == 45
    with _connect(usage_file(home)) as conn:   # in the database itself now
        assert conn.execute("SELECT episodes FROM usage WHERE deployment='fast'").fetchone()[0] == 45
    assert len(list((home / 'usage-pending').glob('*.json'))) == 1         # the last process's (empty) record
