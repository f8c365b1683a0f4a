"""Break-it: episode ends that wait never hold another robot's frames (``seq-decode`` apart from ``seq-io``).

The worker waits for an episode's ``@seq.on_episode`` hook (up to 30 s) on a thread of its small I/O pool
(``seq-io``), and a deployment's hooks run one after another. Eight robots of ``hooked`` ending together, with a
hook that takes its time, therefore hold every ``seq-io`` thread. A robot of ``camera``, another deployment,
sends JPEG frames, which the worker decodes off its event loop: its chunks must keep coming while those
hooks still run, not once they are done. Both deployments run in the worker (``--isolation none``), so
that only the pools are what is shared.
"""

from __future__ import annotations

import textwrap
import threading
from pathlib import Path

import numpy as np
from test_worker_support import Stream, channel, state_request, wait_for, wait_ready

from sequence_ai_ros.protocol import codec
from sequence_ai_ros.protocol import sequence_ai_pb2_grpc as pb_grpc
from sequence_ai_ros.worker import create_server
from sequence_ai_ros.worker.registry import deploy
from sequence_ai_ros.worker.server import IO_THREADS

HOOKED = textwrap.dedent('''
    import os, time
    import numpy as np
    import sequence_ai_ros.policy as seq

    HELD = {held!r}
    NAMES = ['a', 'b']

    @seq.policy(action_space='joint_absolute', action_names=NAMES, dt=0.1, chunk_length=4,
                observation=seq.ObservationContract(state_names=NAMES))
    class Hooked:
        def infer(self, inp, episode):
            return np.zeros((4, 2), np.float32)

        @seq.on_episode
        def ended(self, episode):
            open(HELD + '.' + episode.id, 'w').close()        # tells the test that this hook runs
            deadline = time.monotonic() + 60                   # bounded, whatever the test does
            while os.path.exists(HELD) and time.monotonic() < deadline:
                time.sleep(0.01)
''')

CAMERA = textwrap.dedent('''
    import numpy as np
    import sequence_ai_ros.policy as seq

    NAMES = ['a', 'b']

    @seq.policy(action_space='joint_absolute', action_names=NAMES, dt=0.1, chunk_length=4,
                observation=seq.ObservationContract(state_names=NAMES, cameras=[seq.CameraSpec('cam', 64, 48)]))
    class Camera:
        def infer(self, inp, episode):
            return np.full((4, 2), float(inp.observation.images['cam'].mean()), np.float32)
''')


def _write(root: Path, name: str, text: str) -> Path:
    path = root / name / 'policy.py'
    path.parent.mkdir(parents=True)
    path.write_text(text)
    return path


def test_episode_ends_waiting_on_every_io_thread_never_hold_another_deployments_jpeg_frames(seq_home, tmp_path):
    held = tmp_path / 'held'
    deploy(_write(tmp_path, 'hooked', HOOKED.format(held=str(held))), home=seq_home, dry_timeout_s=60)
    deploy(_write(tmp_path, 'camera', CAMERA), home=seq_home, dry_timeout_s=60)
    server = create_server(['hooked', 'camera'], home=seq_home, isolation='none', idle_timeout_s=120)
    ch = channel(server.port)
    ending: list[threading.Thread] = []
    try:
        stub = pb_grpc.PolicyServiceStub(ch)
        for name in ('hooked', 'camera'):
            assert wait_ready(stub, name, timeout=60).ready
        robot = Stream(stub, 'camera', 'camera-robot')              # started before the pool is taken
        assert robot.start().HasField('started')
        frame = codec.encode_image('cam', np.full((48, 64, 3), 120, np.uint8), 'jpeg')
        first = robot.ask(state_request(1, [0.0, 0.0], ['a', 'b'], images=[frame]))
        assert first.HasField('chunk'), first
        held.write_text('the hooks wait while this file exists')
        hooked = [Stream(stub, 'hooked', f'hooked-{k}') for k in range(IO_THREADS)]
        for stream in hooked:
            assert stream.start().HasField('started')
            assert stream.ask(state_request(1, [0.0, 0.0], ['a', 'b'])).HasField('chunk')
        for stream in hooked:                     # each end waits on a seq-io thread for its own hook
            ending.append(threading.Thread(target=stream.end, daemon=True))
            ending[-1].start()
        wait_for(lambda: any(Path(f'{held}.{s.episode_id}').exists() for s in hooked), what='the first hook to run')
        for rid in range(2, 6):                   # the hooks still run: the JPEG robot's chunks come all along
            reply = robot.ask(state_request(rid, [0.0, 0.0], ['a', 'b'], images=[frame]))
            assert reply.HasField('chunk') and reply.chunk.request_id == rid, reply
            assert held.exists()
        started = [s for s in hooked if Path(f'{held}.{s.episode_id}').exists()]
        assert len(started) == 1, started         # the first hook still holds the rest: none finished
        held.unlink()
        for thread in ending:
            thread.join(timeout=60)
        assert all(not t.is_alive() for t in ending)
        assert robot.end().HasField('ended')
    finally:
        held.unlink(missing_ok=True)
        ch.close()
        server.stop(grace=0.5)
