"""Break-it: episode ends waiting on a slow ``@seq.on_episode`` hook, and slow capture writes, hold no other robot.

The worker waits for an episode's hook (up to 30 s) before answering EpisodeEnded, and a deployment's hooks run
one after another on its inference thread. Its small I/O pool (``seq-io``) starts episodes and writes capture.
Three ways that went wrong, each with a hook (or a capture write) that waits while a file exists:

- robots of one deployment ending together each waited for every hook ahead of their own;
- each waiting end held a ``seq-io`` thread: eight of them (one deployment's, or eight deployments') took the
  whole pool, and no episode of any deployment could start, nor a captured robot get its next chunk;
- JPEG frames were decoded on ``seq-io`` too: a full pool (eight captured robots behind a slow disk) held every
  JPEG robot of every deployment;
- capture was written on ``seq-io`` too: eight captured robots behind a slow disk held every other deployment's
  episode starts and ends.

And an end cut short (the robot cancels its call while the end waits for the pool) still commits its episode.

The deployments run in the worker (``--isolation none``), so that only the worker's pools are shared.
"""

from __future__ import annotations

import collections
import contextlib
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from test_worker_support import Stream, channel, state_request, wait_for, wait_ready

from sequence_ai_ros.capture.episode import EpisodeCapture
from sequence_ai_ros.capture.settings import CaptureSettings, save_settings
from sequence_ai_ros.protocol import codec
from sequence_ai_ros.protocol import sequence_ai_pb2 as pb
from sequence_ai_ros.protocol import sequence_ai_pb2_grpc as pb_grpc
from sequence_ai_ros.worker import create_server
from sequence_ai_ros.worker.capture_hook import EpisodeRecorder
from sequence_ai_ros.worker.registry import deploy
from sequence_ai_ros.worker.runtime import HOOK_WAIT_S, ActiveEpisode
from sequence_ai_ros.worker.scheduler import InferenceScheduler
from sequence_ai_ros.worker.server import CAPTURE_THREADS, IO_THREADS

NAMES = ['a', 'b']

HOOKED = textwrap.dedent('''
    import os, time
    import numpy as np
    import sequence_ai_ros.policy as seq

    HELD = {held!r}

    @seq.policy(action_space='joint_absolute', action_names=['a', 'b'], dt=0.1, chunk_length=4,
                observation=seq.ObservationContract(state_names=['a', 'b']))
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

    @seq.policy(action_space='joint_absolute', action_names=['a', 'b'], dt=0.1, chunk_length=4,
                observation=seq.ObservationContract(state_names=['a', 'b'], cameras=[seq.CameraSpec('cam', 64, 48)]))
    class Camera:
        def infer(self, inp, episode):
            return np.full((4, 2), float(inp.observation.images['cam'].mean()), np.float32)
''')

FRAME = codec.encode_image('cam', np.full((48, 64, 3), 120, np.uint8), 'jpeg')


def _policy(root: Path, name: str, text: str) -> Path:
    path = root / name / 'policy.py'
    path.parent.mkdir(parents=True)
    path.write_text(text)
    return path


def _started(stub: pb_grpc.PolicyServiceStub, deployment: str, episode_id: str, images=()) -> Stream:
    stream = Stream(stub, deployment, episode_id)
    assert stream.start().HasField('started')
    assert stream.ask(state_request(1, [0.0, 0.0], NAMES, images=images)).HasField('chunk')
    return stream


def _hooks_begun(held: Path, streams: list[Stream]) -> list[str]:
    return [s.episode_id for s in streams if Path(f'{held}.{s.episode_id}').exists()]


@contextlib.contextmanager
def _serving(seq_home: Path, tmp_path: Path, hooked: list[str]) -> Iterator[tuple[Path, Any, Any]]:
    """A worker serving ``hooked`` (their hook waits while the yielded file exists) and ``camera``, all ready.

    Yields (that file, the server, a stub); the file is removed and the worker stopped afterwards.
    """
    held = tmp_path / 'held'
    hooked_file = _policy(tmp_path, 'hooked', HOOKED.format(held=str(held)))
    for name in hooked:      # no dry run: it would run the hook
        deploy(hooked_file, name=name, home=seq_home, dry=False, isolation='none')
    deploy(_policy(tmp_path, 'camera', CAMERA), home=seq_home, dry_timeout_s=60, isolation='none')
    server = create_server([*hooked, 'camera'], home=seq_home, isolation='none', idle_timeout_s=120)
    ch = channel(server.port)
    try:
        stub = pb_grpc.PolicyServiceStub(ch)
        for name in (*hooked, 'camera'):
            assert wait_ready(stub, name, timeout=60).ready
        yield held, server, stub
    finally:
        held.unlink(missing_ok=True)
        ch.close()
        server.stop(grace=0.5)


def test_robots_ending_together_behind_a_slow_hook_get_episode_ended_and_hold_no_other_robot(seq_home, tmp_path):
    with _serving(seq_home, tmp_path, ['hooked']) as (held, _, stub):
        robot = _started(stub, 'camera', 'camera-robot', [FRAME])
        ending = [_started(stub, 'hooked', f'hooked-{k}') for k in range(IO_THREADS)]
        held.write_text('the hooks wait while this file exists')
        for stream in ending:
            stream.send(end=pb.EpisodeEnd(reason='completed'))
        [first] = wait_for(lambda: _hooks_begun(held, ending), what='the first hook to run')
        # the others' hooks are queued behind it: their robots get EpisodeEnded now, not once their hook ran or
        # the hook wait (HOOK_WAIT_S) passed
        for stream in ending:
            if stream.episode_id != first:
                assert stream.recv(timeout=HOOK_WAIT_S / 2).HasField('ended'), stream.episode_id
        assert held.exists() and _hooks_begun(held, ending) == [first]
        late = _started(stub, 'camera', 'started-meanwhile', [FRAME])     # episodes still start
        for rid in range(2, 5):                                            # and chunks still come
            assert robot.ask(state_request(rid, [0.0, 0.0], NAMES, images=[FRAME])).HasField('chunk')
        assert late.end().HasField('ended') and robot.end().HasField('ended')
        held.unlink()                       # the first hook returns; its robot's EpisodeEnded comes after it
        [waited] = [s for s in ending if s.episode_id == first]
        assert waited.recv(timeout=30).HasField('ended')
        wait_for(lambda: len(_hooks_begun(held, ending)) == IO_THREADS, what='every hook to have run')


def test_ends_waiting_on_hooks_in_eight_deployments_hold_no_start_and_no_captured_robot(seq_home, tmp_path):
    names = [f'hooked{k}' for k in range(IO_THREADS)]
    save_settings(seq_home / 'capture' / 'camera', CaptureSettings(rate=1.0, enabled=True))
    ending: list[threading.Thread] = []
    with _serving(seq_home, tmp_path, names) as (held, _, stub):
        robot = _started(stub, 'camera', 'camera-robot', [FRAME])      # captured: a write after each reply
        streams = [_started(stub, name, f'robot-{name}') for name in names]
        held.write_text('the hooks wait while this file exists')
        for stream in streams:         # one per deployment: each end waits for its own hook, which runs at once
            ending.append(threading.Thread(target=stream.end, daemon=True))
            ending[-1].start()
        wait_for(lambda: len(_hooks_begun(held, streams)) == IO_THREADS, what='every hook to run')
        for rid in range(2, 6):        # a captured robot's chunks come all along
            robot.send(observation=state_request(rid, [0.0, 0.0], NAMES, images=[FRAME]))
            reply = robot.recv(timeout=HOOK_WAIT_S / 2)
            assert reply.HasField('chunk') and reply.chunk.request_id == rid, reply
        late = Stream(stub, 'camera', 'started-meanwhile')                 # and episodes start
        late.send(start=pb.EpisodeStart(episode_id='started-meanwhile'))
        assert late.recv(timeout=HOOK_WAIT_S / 2).HasField('started')
        assert held.exists() and all(t.is_alive() for t in ending)     # the hooks still hold their own ends
        held.unlink()
        for thread in ending:
            thread.join(timeout=60)
        assert not any(t.is_alive() for t in ending)
        assert late.end().HasField('ended') and robot.end().ended.captured


def _slow_capture_disk(slow: Path, monkeypatch: Any) -> tuple[list[str], collections.Counter]:
    """While ``slow`` exists, a captured episode's writes from its second request on wait, as on a slow disk.

    Each waits holding its episode's recorder. Returns (the episodes whose write waited, the requests written by
    (episode, request id)).
    """
    add_request = EpisodeCapture.add_request
    waiting: list[str] = []
    written: collections.Counter = collections.Counter()

    def on_a_slow_disk(capture, req, chunk=None, error=None):
        if capture.episode_id.startswith('captured-') and req.request_id >= 2 and slow.exists():
            waiting.append(capture.episode_id)
            deadline = time.monotonic() + 60              # bounded, whatever the test does
            while slow.exists() and time.monotonic() < deadline:
                time.sleep(0.01)
        add_request(capture, req, chunk, error)
        written[(capture.episode_id, req.request_id)] += 1

    monkeypatch.setattr(EpisodeCapture, 'add_request', on_a_slow_disk)
    return waiting, written


def _stop_then_free_the_disk(server: Any, slow: Path) -> None:
    """Stop the worker (grace 0.3 s: the streams are cut) while ``slow`` holds the disk; free it after 2 s."""
    stopping = threading.Thread(target=server.stop, kwargs={'grace': 0.3}, daemon=True)
    stopping.start()
    stopping.join(2.0)             # the streams are cut meanwhile; the commits wait for the disk
    slow.unlink()
    stopping.join(60)
    assert not stopping.is_alive()


def test_captured_robots_behind_a_slow_disk_hold_no_other_deployments_frames_starts_or_ends(seq_home, tmp_path,
                                                                                            monkeypatch):
    slow = tmp_path / 'held'         # _serving's file (removed whatever happens): here the disk is slow while it exists
    waiting, _ = _slow_capture_disk(slow, monkeypatch)
    save_settings(seq_home / 'capture' / 'hooked', CaptureSettings(rate=1.0, enabled=True))
    with _serving(seq_home, tmp_path, ['hooked']) as (_, _, stub):
        robot = _started(stub, 'camera', 'camera-robot', [FRAME])
        captured = [_started(stub, 'hooked', f'captured-{k}') for k in range(max(CAPTURE_THREADS, IO_THREADS))]
        slow.write_text('capture writes wait while this file exists')
        for stream in captured:        # each reply's capture write waits on a capture thread: the pool is full
            stream.send(observation=state_request(2, [0.0, 0.0], NAMES))
            assert stream.recv(timeout=HOOK_WAIT_S / 2).HasField('chunk')
        wait_for(lambda: len(waiting) == CAPTURE_THREADS, what='every capture thread to wait')
        for rid in range(2, 6):        # the JPEG robot's frames decode on threads of their own
            robot.send(observation=state_request(rid, [0.0, 0.0], NAMES, images=[FRAME]))
            reply = robot.recv(timeout=HOOK_WAIT_S / 2)
            assert reply.HasField('chunk') and reply.chunk.request_id == rid, reply
        late = Stream(stub, 'camera', 'started-meanwhile')     # an uncaptured deployment's episodes start and end
        late.send(start=pb.EpisodeStart(episode_id='started-meanwhile'))
        assert late.recv(timeout=HOOK_WAIT_S / 2).HasField('started')
        late.send(end=pb.EpisodeEnd(reason='completed'))
        assert late.recv(timeout=HOOK_WAIT_S / 2).HasField('ended')
        assert slow.exists()
        slow.unlink()
        for stream in captured:
            assert stream.end().HasField('ended')
        assert robot.end().HasField('ended')


def test_a_worker_stopping_while_captured_robots_wait_on_a_slow_disk_keeps_every_answered_request(seq_home,
                                                                                                   tmp_path,
                                                                                                   monkeypatch):
    """More captured robots than capture threads, each answered a request whose write waits; the worker stops.

    The writes still queued when the streams were cut were lost (cancelled with the stream): their episodes
    committed without the request each robot had been answered. Each is written by the commit now, once.
    """
    slow = tmp_path / 'held'
    waiting, written = _slow_capture_disk(slow, monkeypatch)
    save_settings(seq_home / 'capture' / 'hooked', CaptureSettings(rate=1.0, enabled=True))
    with _serving(seq_home, tmp_path, ['hooked']) as (_, server, stub):
        captured = [_started(stub, 'hooked', f'captured-{k}') for k in range(CAPTURE_THREADS + 3)]
        slow.write_text('capture writes wait while this file exists')
        for stream in captured:        # 8 writes wait on the disk, 3 more wait for a capture thread
            stream.send(observation=state_request(2, [0.0, 0.0], NAMES))
            assert stream.recv(timeout=HOOK_WAIT_S / 2).HasField('chunk')
        wait_for(lambda: len(waiting) == CAPTURE_THREADS, what='every capture thread to wait')
        _stop_then_free_the_disk(server, slow)
    ids = [s.episode_id for s in captured]
    wait_for(lambda: all(written[(e, 2)] for e in ids), what='every answered request written')
    assert [written[(e, 2)] for e in ids] == [1] * len(ids)
    assert [written[(e, 1)] for e in ids] == [1] * len(ids)


def test_of_two_hooks_queued_at_once_exactly_the_first_is_waited_for():
    scheduler = InferenceScheduler('race')
    both = threading.Barrier(2)
    release = threading.Event()
    waited: dict[str, bool] = {}
    futures: list = []

    def end(name: str) -> None:
        future = scheduler.control(lambda: release.wait(30))
        futures.append(future)
        both.wait(timeout=30)          # the other end queued its hook meanwhile: two robots ending together
        waited[name] = scheduler.runs_next(future)

    try:
        for _ in range(20):
            waited.clear()
            release.clear()
            threads = [threading.Thread(target=end, args=(name,)) for name in 'ab']
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(timeout=30)
            assert sorted(waited.values()) == [False, True], waited     # the first waits, the second does not
            release.set()
            wait_for(lambda: all(f.done() for f in futures), what='the hooks to run')
    finally:
        release.set()
        scheduler.stop()


def test_a_robot_that_gives_up_on_its_end_while_the_pool_is_busy_still_has_its_episode_committed(
        seq_home, tmp_path, monkeypatch):
    busy = threading.Event()
    begun = threading.Event()
    committed: list[str] = []
    server_of: dict[str, object] = {}
    begin_end, commit = ActiveEpisode.begin_end, EpisodeRecorder.commit

    def then_a_busy_pool(active, reason, wait=True):
        out = begin_end(active, reason, wait)
        if active.episode.id == 'gives-up':       # every seq-io thread taken: the rest of its end waits in line
            for _ in range(IO_THREADS):
                server_of['server']._io._executor.submit(busy.wait, 30)
            begun.set()
        return out

    def counted(recorder, reason, stats):
        committed.append(recorder.episode_id)
        return commit(recorder, reason, stats)

    monkeypatch.setattr(ActiveEpisode, 'begin_end', then_a_busy_pool)
    monkeypatch.setattr(EpisodeRecorder, 'commit', counted)
    save_settings(seq_home / 'capture' / 'camera', CaptureSettings(rate=1.0, enabled=True))
    deploy(_policy(tmp_path, 'camera', CAMERA), home=seq_home, dry_timeout_s=60, isolation='none')
    server = server_of['server'] = create_server(['camera'], home=seq_home, isolation='none', idle_timeout_s=120)
    ch = channel(server.port)
    try:
        stub = pb_grpc.PolicyServiceStub(ch)
        assert wait_ready(stub, 'camera', timeout=60).ready
        robot = _started(stub, 'camera', 'gives-up', [FRAME])
        robot.send(end=pb.EpisodeEnd(reason='completed'))
        assert begun.wait(30)
        time.sleep(0.2)                # its stream awaits the rest of the end, queued behind the busy pool
        robot.cancel()                 # the robot gives up waiting for EpisodeEnded (the client's close does)
        wait_for(lambda: server.servicer.open_streams() == 0, what='the worker to end the cancelled call')
        busy.set()
        wait_for(lambda: committed == ['gives-up'], what='the episode to be committed')
    finally:
        busy.set()
        ch.close()
        server.stop(grace=0.5)
