"""A request's JPEG/PNG frames decode in two runs side by side on ``seq-decode`` threads, after every check.

The policy answers each camera's mean pixel value, current frame and history alike, so a chunk shows which frame
the policy got for which camera. Decoding side by side is shown without a clock: the frames' decodes wait for
each other at a barrier, which breaks (and the request fails) unless they run at once.
"""

from __future__ import annotations

import textwrap
import threading

import numpy as np
import pytest
from test_worker_support import Stream, serving, state_request, wait_for

from sequence_ai_ros.policy.loader import load_policy_file
from sequence_ai_ros.protocol import codec, messages
from sequence_ai_ros.protocol import sequence_ai_pb2 as pb
from sequence_ai_ros.worker import episode_call

NAMES = ['a', 'b']
POLICY = textwrap.dedent('''
    import numpy as np
    import sequence_ai_ros.policy as seq

    @seq.policy(action_space='joint_absolute', action_names=['a', 'b'], dt=0.1, chunk_length=2,
                observation=seq.ObservationContract(cameras=[seq.CameraSpec('left', 32, 24, 'jpeg'),
                                                             seq.CameraSpec('right', 32, 24, 'png')],
                                                    state_names=['a', 'b'], history=2))
    class Means:
        """Row 0: the current frame's mean pixel per camera; row 1: the previous frame's (0 without history)."""

        def infer(self, inp, episode):
            past = inp.history[0] if len(inp.history) > 1 else None
            return np.array([[inp.observation.images['left'].mean(), inp.observation.images['right'].mean()],
                             [past.images['left'].mean() if past else 0.0,
                              past.images['right'].mean() if past else 0.0]], np.float32)
''')


def _frame(key: str, value: int, encoding: str) -> pb.Image:
    return codec.encode_image(key, np.full((24, 32, 3), value, np.uint8), encoding)


def _images(left: int, right: int) -> list[pb.Image]:
    return [_frame('left', left, 'png'), _frame('right', right, 'png')]


@pytest.fixture
def means(tmp_path):
    path = tmp_path / 'means.py'
    path.write_text(POLICY)
    with serving(path, 'means', isolation='none') as (_, stub, runtime):
        yield stub, runtime


def _meeting(monkeypatch, parties: int) -> tuple[list[tuple[str, str]], list[int]]:
    """Make each frame's decode wait (10 s at most) until ``parties`` decode at once.

    :returns: the frames decoded, as they are (camera key, thread name), and the most decoding at once (a list of
        one number).
    """
    barrier = threading.Barrier(parties, timeout=10)
    seen: list[tuple[str, str]] = []
    lock, now, most = threading.Lock(), [0], [0]
    decode = codec.decode_image

    def meet(image: pb.Image, **kwargs):
        with lock:
            seen.append((image.key, threading.current_thread().name))
            now[0] += 1
            most[0] = max(most[0], now[0])
        try:
            barrier.wait()
            return decode(image, **kwargs)
        finally:
            with lock:
                now[0] -= 1

    monkeypatch.setattr(codec, 'decode_image', meet)
    return seen, most


def _rows(reply: pb.EpisodeReply) -> list[list[float]]:
    assert reply.HasField('chunk'), reply
    return np.frombuffer(reply.chunk.actions.data, np.float32).reshape(2, 2).tolist()


def test_a_requests_frames_decode_in_two_runs_side_by_side_each_reaching_the_policy_as_its_camera(means, monkeypatch):
    """Four frames (two cameras, now and one frame back): two runs of two meet at a barrier, two at a time."""
    stub, _ = means
    monkeypatch.setattr(episode_call, '_CORES', 2)
    seen, most = _meeting(monkeypatch, 2)
    stream = Stream(stub, 'means', 'side-by-side')
    assert stream.start().HasField('started')
    past = pb.Frame(robot_time_s=0.5, state=codec.to_tensor(np.zeros(2, np.float32)), images=_images(10, 20))
    reply = stream.ask(state_request(1, [0, 0], NAMES, images=_images(30, 40), history=[past]))
    assert _rows(reply) == [[30.0, 40.0], [10.0, 20.0]]
    assert len(seen) == 4 and all(name.startswith('seq-decode') for _, name in seen), seen
    assert most[0] == episode_call.FRAME_JOBS == 2
    assert stream.end().HasField('ended')


def test_while_another_requests_frames_keep_the_cores_busy_a_request_decodes_in_one_run(means, monkeypatch):
    """``first``'s two frames take both cores (held in their decode); ``second``'s two then decode on one thread."""
    stub, _ = means
    monkeypatch.setattr(episode_call, '_CORES', 2)
    held, release = _images(50, 60), threading.Event()
    threads: dict[bytes, str] = {}
    decode = codec.decode_image

    def hold(image: pb.Image, **kwargs):
        threads[image.data] = threading.current_thread().name
        if image.data in (held[0].data, held[1].data):
            release.wait(10)
        return decode(image, **kwargs)

    monkeypatch.setattr(codec, 'decode_image', hold)
    first, second = Stream(stub, 'means', 'first'), Stream(stub, 'means', 'second')
    for stream in (first, second):
        assert stream.start().HasField('started')
    first.send(observation=state_request(1, [0, 0], NAMES, images=held))
    wait_for(lambda: len(threads) == 2, what="first's frames decoding")
    later = _images(70, 80)
    reply = second.ask(state_request(1, [0, 0], NAMES, images=later))
    release.set()
    assert _rows(reply)[0] == [70.0, 80.0] and _rows(first.recv())[0] == [50.0, 60.0]
    assert threads[held[0].data] != threads[held[1].data]                # side by side: the cores were free
    assert threads[later[0].data] == threads[later[1].data]              # one run: they were not
    for stream in (first, second):
        assert stream.end().HasField('ended')


def test_a_frame_that_does_not_decode_fails_its_request_alone_naming_the_camera(means):
    stub, _ = means
    stream = Stream(stub, 'means', 'corrupt')
    assert stream.start().HasField('started')
    broken = _frame('right', 5, 'png')
    broken.data = broken.data[:40]            # truncated: its header reads, its pixels do not
    reply = stream.ask(state_request(1, [0, 0], NAMES, images=[_frame('left', 1, 'png'), broken]))
    assert reply.HasField('error') and reply.error.code == pb.CONTRACT_VIOLATION, reply
    assert "'right'" in reply.error.message and 'cannot decode' in reply.error.message
    assert _rows(stream.ask(state_request(2, [0, 0], NAMES, images=_images(7, 8))))[0] == [7.0, 8.0]
    assert stream.end().HasField('ended')


def test_a_request_the_contract_refuses_is_refused_before_any_frame_decodes(means, monkeypatch):
    """Unknown, resized or repeated cameras, a non-finite state: each refused as ever, with not one frame decoded."""
    stub, _ = means
    seen, _ = _meeting(monkeypatch, 1)
    stream = Stream(stub, 'means', 'refused')
    assert stream.start().HasField('started')
    corrupt = _frame('right', 5, 'png')
    corrupt.data = corrupt.data[:40]
    cases = (
        ([_frame('left', 1, 'png'), _frame('top', 2, 'png')], [0, 0], "unknown camera 'top'"),
        ([_frame('left', 1, 'png'), codec.encode_image('right', np.zeros((48, 64, 3), np.uint8), 'png')], [0, 0],
         "camera 'right' is 64x48"),
        ([_frame('left', 1, 'png')] * 8 + [_frame('right', 2, 'png')], [0, 0], "camera 'left' sent twice"),
        ([_frame('left', 1, 'png'), corrupt], [float('nan'), 0], 'non-finite'),
        ([_frame('top', 1, 'png'), corrupt], [0, 0], "unknown camera 'top'"),
    )
    for rid, (images, state, words) in enumerate(cases, start=1):
        reply = stream.ask(state_request(rid, state, NAMES, images=images))
        assert reply.HasField('error') and reply.error.code == pb.CONTRACT_VIOLATION, reply
        assert words in reply.error.message, (words, reply.error.message)
    assert seen == []
    assert _rows(stream.ask(state_request(9, [0, 0], NAMES, images=_images(3, 4))))[0] == [3.0, 4.0]
    assert stream.end().HasField('ended')


def test_unpack_observation_checks_the_whole_request_before_asking_for_any_encoded_frame(tmp_path):
    (tmp_path / 'means.py').write_text(POLICY)
    contract = load_policy_file(tmp_path / 'means.py').contract
    past = pb.Frame(state=codec.to_tensor(np.zeros(2, np.float32)),
                    images=[_frame('left', 3, 'jpeg'), _frame('right', 4, 'raw')])
    req = state_request(1, [0, 0], NAMES, images=[_frame('left', 5, 'png'), _frame('right', 6, 'raw')],
                        history=[past])
    asked: list[str] = []

    def mark(image: pb.Image) -> str:
        asked.append(image.key)
        return f'later:{image.key}'

    inp = messages.unpack_observation(req, contract, decode=mark)
    assert asked == ['left', 'left']                          # encoded frames only; raw ones are unpacked
    assert inp.observation.images['left'] == 'later:left' and inp.history[0].images['left'] == 'later:left'
    assert int(inp.observation.images['right'].mean()) == 6
    plain = messages.unpack_observation(req, contract)
    assert int(plain.observation.images['left'].mean()) == 5 and int(plain.history[0].images['left'].mean()) == 3


def test_an_episode_end_that_comes_while_a_requests_frames_decode_is_answered_at_once(means, monkeypatch):
    """EpisodeEnded comes while the request's frames are still held in their decode; the request is dropped unanswered.

    The decode is left to finish on its threads: once released, the runs it held are free again, and no chunk is sent.
    """
    stub, runtime = means
    release, decoding = threading.Event(), threading.Event()
    decode = codec.decode_image

    def hold(image: pb.Image, **kwargs):
        decoding.set()
        release.wait(30)
        return decode(image, **kwargs)

    monkeypatch.setattr(codec, 'decode_image', hold)
    before = runtime.end_stats()['requests_dropped_at_end']
    stream = Stream(stub, 'means', 'end-while-decoding')
    try:
        assert stream.start().HasField('started')
        stream.send(observation=state_request(1, [0, 0], NAMES, images=_images(30, 40)))
        assert decoding.wait(30), 'the frames never began to decode'
        reply = stream.end()
        assert reply is not None and reply.HasField('ended'), reply
        assert not release.is_set()               # answered while the decode still held its frames
        assert runtime.end_stats()['requests_dropped_at_end'] == before + 1
    finally:
        release.set()
    assert stream.recv() is None                  # the stream closed: the request never got a chunk
    wait_for(lambda: episode_call._DECODING.runs == 0, what='the decode runs given back')


def test_frames_queued_for_a_request_whose_episode_ended_decode_nothing(means, monkeypatch):
    """A robot ends episode after episode while its frames wait for a decode thread: those runs decode nothing.

    Every ``seq-decode`` thread is held in a frame; 4 more requests' runs wait behind them, each ended at once.
    Released, the held runs finish their 2 frames each and the 4 queued ones decode none, so other robots' frames
    never wait behind a dropped request's decoding.
    """
    from sequence_ai_ros.worker.server import DECODE_THREADS

    stub, runtime = means
    monkeypatch.setattr(episode_call, '_CORES', 1)        # one run (2 frames) per request
    release, lock, calls = threading.Event(), threading.Lock(), [0]
    decode = codec.decode_image

    def hold(image: pb.Image, **kwargs):
        with lock:
            calls[0] += 1
        release.wait(30)
        return decode(image, **kwargs)

    monkeypatch.setattr(codec, 'decode_image', hold)
    before = runtime.end_stats()['requests_dropped_at_end']
    cycles = DECODE_THREADS + 4
    try:
        for k in range(cycles):
            stream = Stream(stub, 'means', f'cycle-{k}')
            assert stream.start().HasField('started')
            stream.send(observation=state_request(1, [0, 0], NAMES, images=_images(k, k)))
            reply = stream.end()
            assert reply is not None and reply.HasField('ended'), reply
            assert stream.recv() is None
        wait_for(lambda: calls[0] == DECODE_THREADS, what='every decode thread holding a frame')
        assert runtime.end_stats()['requests_dropped_at_end'] == before + cycles
    finally:
        release.set()
    wait_for(lambda: episode_call._DECODING.runs == 0, what='the decode runs given back')
    assert calls[0] == 2 * DECODE_THREADS          # the held runs' two frames each; the queued runs' none
