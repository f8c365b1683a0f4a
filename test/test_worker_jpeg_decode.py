"""A request's JPEG/PNG frames decode each on a ``seq-decode`` thread of its own, side by side, on a real worker.

The policy answers each camera's mean pixel value, current frame and history alike, so a chunk shows which frame
the policy got for which camera. Decoding side by side is shown without a clock: the frames' decodes wait for
each other at a barrier, which breaks (and the request fails) unless they run at once.
"""

from __future__ import annotations

import textwrap
import threading

import numpy as np
import pytest
from test_worker_support import Stream, serving, state_request

from sequence_ai_ros.policy.loader import load_policy_file
from sequence_ai_ros.protocol import codec, messages
from sequence_ai_ros.protocol import sequence_ai_pb2 as pb

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


def _meeting(monkeypatch, parties: int) -> list[tuple[str, str]]:
    """Make each frame's decode wait (10 s at most) until ``parties`` decode at once.

    :returns: the frames decoded, as they are: (camera key, thread name).
    """
    barrier = threading.Barrier(parties, timeout=10)
    seen: list[tuple[str, str]] = []
    decode = codec.decode_image

    def meet(image: pb.Image, **kwargs):
        seen.append((image.key, threading.current_thread().name))
        barrier.wait()
        return decode(image, **kwargs)

    monkeypatch.setattr(codec, 'decode_image', meet)
    return seen


def test_a_requests_frames_decode_side_by_side_each_reaching_the_policy_as_its_camera(means, monkeypatch):
    stub, _ = means
    seen = _meeting(monkeypatch, 4)           # the current frame's two cameras and the history frame's two
    stream = Stream(stub, 'means', 'side-by-side')
    assert stream.start().HasField('started')
    past = pb.Frame(robot_time_s=0.5, state=codec.to_tensor(np.zeros(2, np.float32)), images=_images(10, 20))
    reply = stream.ask(state_request(1, [0, 0], NAMES, images=_images(30, 40), history=[past]))
    assert reply.HasField('chunk'), reply
    rows = np.frombuffer(reply.chunk.actions.data, np.float32).reshape(2, 2)
    assert rows.tolist() == [[30.0, 40.0], [10.0, 20.0]]
    assert len(seen) == 4 and all(name.startswith('seq-decode') for _, name in seen), seen
    assert stream.end().HasField('ended')


def test_a_frame_that_does_not_decode_fails_its_request_alone_naming_the_camera(means, monkeypatch):
    stub, _ = means
    stream = Stream(stub, 'means', 'corrupt')
    assert stream.start().HasField('started')
    broken = _frame('right', 5, 'png')
    broken.data = broken.data[:40]            # truncated: its header reads, its pixels do not
    reply = stream.ask(state_request(1, [0, 0], NAMES, images=[_frame('left', 1, 'png'), broken]))
    assert reply.HasField('error') and reply.error.code == pb.CONTRACT_VIOLATION, reply
    assert "'right'" in reply.error.message and 'cannot decode' in reply.error.message
    reply = stream.ask(state_request(2, [0, 0], NAMES, images=_images(7, 8)))
    assert np.frombuffer(reply.chunk.actions.data, np.float32)[:2].tolist() == [7.0, 8.0]
    assert stream.end().HasField('ended')


def test_a_frame_refused_by_the_contract_is_never_decoded(means, monkeypatch):
    stub, _ = means
    seen = _meeting(monkeypatch, 1)
    stream = Stream(stub, 'means', 'refused')
    assert stream.start().HasField('started')
    for rid, images, words in (
            (1, [_frame('left', 1, 'png'), _frame('top', 2, 'png')], "unknown camera 'top'"),
            (2, [_frame('left', 1, 'png'), codec.encode_image('right', np.zeros((48, 64, 3), np.uint8), 'png')],
             "camera 'right' is 64x48")):
        reply = stream.ask(state_request(rid, [0, 0], NAMES, images=images))
        assert reply.HasField('error') and words in reply.error.message, reply
    assert [key for key, _ in seen] == ['left', 'left'], seen      # never 'top', never the 64x48 frame
    assert stream.end().HasField('ended')


def test_encoded_frames_names_what_unpack_observation_decodes_and_its_arrays_are_used(tmp_path):
    (tmp_path / 'means.py').write_text(POLICY)
    contract = load_policy_file(tmp_path / 'means.py').contract
    past = pb.Frame(state=codec.to_tensor(np.zeros(2, np.float32)),
                    images=[_frame('left', 3, 'jpeg'), _frame('right', 4, 'raw')])
    req = state_request(1, [0, 0], NAMES, images=[_frame('left', 5, 'png'), _frame('right', 6, 'raw')],
                        history=[past])
    frames = messages.encoded_frames(req, contract)
    assert [key for key, _ in frames] == [(messages.CURRENT, 'left'), (0, 'left')]      # raw frames are not
    marked = {key: np.full((24, 32, 3), 99, np.uint8) for key, _ in frames}
    inp = messages.unpack_observation(req, contract, decoded=marked)
    assert inp.observation.images['left'] is marked[(messages.CURRENT, 'left')]
    assert inp.history[0].images['left'] is marked[(0, 'left')]
    assert int(inp.observation.images['right'].mean()) == 6
    plain = messages.unpack_observation(req, contract)
    assert int(plain.observation.images['left'].mean()) == 5 and int(plain.history[0].images['left'].mean()) == 3
    req.history.add().CopyFrom(past)          # more history than the contract's: its frames are not decoded first
    assert messages.encoded_frames(req, contract) == [((messages.CURRENT, 'left'), req.images[0])]
