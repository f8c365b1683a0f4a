"""The deployment process's wire: arrays reach the policy intact, as views of shared memory it may keep.

The codec alone for every dtype and layout; real deployment processes (``python -m
sequence_ai_ros.worker.policy_host`` over their Unix socket) for what a policy keeps across calls.
"""

from __future__ import annotations

import mmap
import os
import socket
import struct
import textwrap
import time

import numpy as np
import pytest

from sequence_ai_ros.policy.api import Episode, Result
from sequence_ai_ros.protocol import messages
from sequence_ai_ros.protocol.types import Observation
from sequence_ai_ros.worker import policy_host as wire
from sequence_ai_ros.worker.policy_process import describe_policy_file


def _readonly(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


def _arrays() -> dict[str, object]:
    shared = np.arange(5, dtype=np.float64)
    return {
        'image': _readonly(np.random.default_rng(0).integers(0, 255, (224, 224, 3), np.uint8)),
        'state': np.linspace(-1, 1, 26, dtype=np.float32),
        'strided': np.arange(60, dtype=np.int64).reshape(6, 10)[:, ::3],
        'fortran': np.asfortranarray(np.arange(12.0).reshape(3, 4)),
        'scalar': np.array(3.5),
        'empty': np.zeros((0, 26), np.float32),
        'bools': np.array([True, False, True]),
        'complex': np.array([1 + 2j, -3j], np.complex64),
        'big_endian': np.array([1, -2, 3], '>i4'),
        'dates': np.array(['2024-01-01', '2025-06-30'], 'datetime64[D]'),
        'text': np.array(['ab', 'xyz'], 'U3'),
        'objects': np.array([1, 'a', None], dtype=object),
        'structured': np.array([(1, 2.5)], dtype=[('a', 'i4'), ('b', 'f8')]),
        'masked': np.ma.array([1, 2, 3], mask=[0, 1, 0]),
        'same': [shared, shared],
    }


def _roundtrip(value: object, segments: wire.Segments, seg: int = 0, copy: bool = False) -> object:
    header, pickler = wire.encode_call(value)
    if seg not in segments.maps:
        segments.maps[seg] = mmap.mmap(-1, max(pickler.size, mmap.PAGESIZE))
    wire.fill(segments.maps[seg], pickler)
    payload = memoryview(wire.call_head(seg, copy, len(segments.maps[seg]), []) + header)
    out, got_seg = segments.parse(payload, [])
    assert got_seg == seg
    return out


@pytest.mark.parametrize('copy', [False, True])
def test_every_dtype_and_layout_arrives_equal_with_its_writeable_flag(copy):
    sent = _arrays()
    got = _roundtrip(sent, wire.Segments(), copy=copy)
    for key, value in sent.items():
        if key == 'same':
            continue
        back = got[key]
        assert type(back) is type(value), key
        assert back.dtype == value.dtype and back.shape == value.shape, key
        assert np.array_equal(np.ma.getdata(back), np.ma.getdata(value)), key
        if key in ('image', 'state'):
            assert back.flags.writeable == value.flags.writeable, key
    assert np.array_equal(got['masked'].mask, sent['masked'].mask)
    assert got['same'][0] is got['same'][1]          # one array referenced twice stays one array


def test_a_segment_is_free_again_only_once_nothing_references_its_arrays():
    segments = wire.Segments()
    kept = _roundtrip({'image': np.full((8, 8, 3), 7, np.uint8)}, segments)
    assert segments.release(0) == []                 # the policy still holds the image
    other = _roundtrip({'image': np.full((8, 8, 3), 9, np.uint8)}, segments, seg=1)
    del other
    assert segments.release(1) == [1]
    assert int(kept['image'][0, 0, 0]) == 7
    view = kept['image'][2:, ::2]                    # a view of it holds the segment too
    del kept
    assert segments.release(-1) == []
    del view
    assert segments.release(-1) == [0]


def test_copied_arrays_leave_their_segment_free_at_once():
    segments = wire.Segments()
    kept = _roundtrip({'image': np.full((8, 8, 3), 7, np.uint8)}, segments, copy=True)
    assert segments.release(0) == [0]
    segments.maps[0][:] = b'\0' * len(segments.maps[0])   # the worker writes the next call there
    assert int(kept['image'][0, 0, 0]) == 7


KEEPER = textwrap.dedent('''
    import numpy as np
    import sequence_ai_ros.policy as seq

    @seq.policy(action_space='joint_absolute', action_names=['a', 'b'], dt=0.1, chunk_length=2,
                observation=seq.ObservationContract(cameras=[seq.CameraSpec('cam', 32, 24, 'raw')],
                                                    state_names=['a', 'b']))
    class Keeper:
        """Keeps every image (keep=True) or none; answers (images kept, of them still as they came)."""

        def __init__(self, keep: bool = True):
            self.keep = bool(keep)
            self.kept = []

        def infer(self, inp, episode):
            if self.keep:
                self.kept.append((inp.observation.images['cam'], int(inp.observation.state[0])))
            intact = sum(int((img == fill).all()) for img, fill in self.kept)
            return np.array([[len(self.kept), intact]] * 2, np.float32)
''')


def _memfds(pid: int) -> set[str]:
    with open(f'/proc/{pid}/maps') as maps:
        return {line.split()[-2] for line in maps if 'memfd:seq-' in line}


@pytest.mark.parametrize('keep', [True, False])
def test_arrays_a_policy_keeps_never_change_under_it_and_shared_memory_stays_bounded(tmp_path, keep):
    path = tmp_path / 'policy.py'
    path.write_text(KEEPER)
    definition = describe_policy_file(path, 'keeper', 60, keep=keep)
    contract = definition.contract
    policy = definition.instantiate()
    try:
        policy.load()
        episode = Episode(id='e1', instruction='', deployment='keeper')
        calls = 2 * wire.MAX_HELD + 8                       # past the bound: later calls' arrays are copied
        for k in range(1, calls + 1):
            fill = k % 250
            obs = Observation(state=np.array([fill, 0], np.float32), state_names=('a', 'b'),
                              images={'cam': np.full((24, 32, 3), fill, np.uint8)})
            inp = messages.unpack_observation(
                messages.pack_observation(obs, contract, episode_id='e1', request_id=k), contract)
            out = policy.infer(inp, episode)
            kept, intact = (int(x) for x in out[0])
            assert (kept, intact) == ((k, k) if keep else (0, 0))
        segments = _memfds(policy.process.pid)
        assert 1 <= len(segments) <= (wire.MAX_HELD + 1 if keep else 1)
    finally:
        policy.close()


def test_a_frame_arrives_whole_whether_read_piecewise_without_blocking_or_at_once():
    ours, theirs = socket.socketpair()
    try:
        channel = wire.Channel(ours, size=64)
        big = bytes(range(256)) * 40                       # larger than the channel's first buffer
        frame = struct.pack('<II', len(big), 7) + big      # length, sequence number
        assert channel.poll() is None                      # nothing yet: never blocks
        theirs.sendall(frame[:3])
        assert channel.poll() is None                      # not even the length
        theirs.sendall(frame[3:2000])
        assert channel.poll() is None
        theirs.sendall(frame[2000:])
        deadline = time.monotonic() + 10
        while (got := channel.poll()) is None and time.monotonic() < deadline:
            time.sleep(0.001)
        assert got is not None and bytes(got) == big
        theirs.sendall(frame[:100])                        # begun piecewise, finished by a blocking read
        assert channel.poll() is None
        theirs.sendall(frame[100:])
        payload, fds = channel.recv(7)
        assert bytes(payload) == big and fds == [] and channel.seq == 7
        theirs.close()
        with pytest.raises(EOFError):
            channel.recv()
    finally:
        ours.close()
        theirs.close()


@pytest.mark.parametrize('written, words', [
    (struct.pack('<II', 12, 1 << 30) + b'junkjunkjunk', 'a frame numbered 1073741824 came where the answer to call 3'),
    (struct.pack('<II', 1 << 30, 3), 'a frame of 1073741824 bytes came, over the bound of 4096'),
    (struct.pack('<II', 4, 3) + bytes(4) + b'more', '4 more bytes came after the frame of call 3'),
], ids=['another sequence number', 'over the bound', 'bytes after the frame'])
@pytest.mark.parametrize('blocking', [True, False], ids=['recv', 'poll'])
def test_bytes_that_are_not_the_frame_due_fail_the_read_at_once(written, words, blocking):
    ours, theirs = socket.socketpair()
    try:
        channel = wire.Channel(ours, limit=4096)
        theirs.sendall(written)
        deadline = time.monotonic() + 10
        with pytest.raises(wire.ProtocolError, match=words):
            while time.monotonic() < deadline:
                if blocking:
                    channel.recv(3)
                elif channel.poll(3) is None:
                    time.sleep(0.001)
    finally:
        ours.close()
        theirs.close()


@pytest.mark.parametrize('payload', [b'', b'\x01\x00', struct.pack('<I', 1 << 30) + b'junkjunk'],
                         ids=['empty', 'short', 'more ids than bytes'])
def test_a_reply_too_short_for_its_head_is_no_answer(payload):
    with pytest.raises(wire.ProtocolError, match='cannot hold its head'):
        wire.parse_reply(memoryview(payload))


def test_an_answer_the_worker_cannot_unpickle_is_the_policys_failure_not_the_processs():
    body = b'cnowhere\nThing\n.'                          # a class of a module the worker lacks
    released, (status, value) = wire.parse_reply(memoryview(struct.pack('<Ii', 1, 4) + body))
    assert released == [4] and status == 'err' and "cannot be read in the worker: ModuleNotFoundError" in value


@pytest.mark.parametrize('value', [
    np.linspace(-1, 1, 30 * 26, dtype=np.float32).reshape(30, 26),
    Result(np.arange(12, dtype=np.float64).reshape(3, 4), True),
    Result(np.ones((2, 3), '>f4'), False),
    np.zeros((0, 26), np.float32),
    np.asfortranarray(np.arange(12.0).reshape(3, 4)),
    np.array([1 + 2j]), np.array(['ab']), np.arange(4).reshape(1, 1, 1, 1, 4),
], ids=['float32', 'result', 'big-endian', 'empty', 'fortran', 'complex', 'text', '5-d'])
def test_an_answer_arrives_equal_and_writeable_whether_laid_out_raw_or_pickled(value):
    """Chunks of plain numbers travel raw (no pickle either way); anything else is pickled, as before."""
    released, (status, got) = wire.parse_reply(memoryview(b''.join(wire.reply_parts([2], wire.reply_body('ok',
                                                                                                           value)))))
    assert released == [2] and status == 'ok'
    want, got_arr = (value.actions, got.actions) if isinstance(value, Result) else (value, got)
    assert type(got) is type(value) and getattr(got, 'done', None) == getattr(value, 'done', None)
    assert np.asarray(want).dtype == got_arr.dtype and np.array_equal(np.asarray(want), got_arr)
    assert got_arr.flags.writeable


def test_a_raw_answer_whose_sizes_disagree_is_the_policys_failure():
    body = wire.reply_body('ok', np.ones((30, 26), np.float32))
    assert body[:1] == b'R'                                # laid out raw
    released, (status, value) = wire.parse_reply(memoryview(struct.pack('<I', 0) + body[:-4]))
    assert released == [] and status == 'err' and 'a raw answer of shape (30, 26) float32 in 3116 bytes' in value


@pytest.mark.parametrize('blocking', [True, False], ids=['recv', 'poll'])
def test_frames_pipelined_behind_each_other_arrive_whole_in_order_each_fd_with_its_own(blocking):
    ours, theirs = socket.socketpair()
    try:
        channel = wire.Channel(ours, size=64)
        reader = os.pipe()
        payloads = [bytes([k]) * (10 + 30 * k) for k in range(4)]     # the later ones larger than the buffer
        sender = wire.Channel(theirs)
        for k, payload in enumerate(payloads):                          # one write each, read in fewer reads
            sender.send([payload], [reader[0]] if k in (1, 3) else [], seq=k + 1)
        got, fds = [], []
        deadline = time.monotonic() + 10
        while len(got) < len(payloads) and time.monotonic() < deadline:
            more = len(got) + 1 < len(payloads)
            if blocking:
                frame, taken = channel.recv(len(got) + 1, more=more)
            else:
                frame, taken = channel.poll(len(got) + 1, more=more), list(channel.fds)
                channel.fds.clear()
                if frame is None:
                    time.sleep(0.001)
                    continue
            got.append(bytes(frame))
            fds.extend(taken)
        assert got == payloads
        assert len(fds) == 2                        # the two sent, in the order sent (each a copy of the pipe's end)
        for fd in fds:
            os.close(fd)
        os.close(reader[0])
        os.close(reader[1])
        theirs.sendall(struct.pack('<II', 4, 5) + bytes(4) + b'more')      # no frame due after it: no answer
        with pytest.raises(wire.ProtocolError, match='4 more bytes came after the frame of call 5'):
            while time.monotonic() < deadline:
                if blocking:
                    channel.recv(5)
                elif channel.poll(5) is None:
                    time.sleep(0.001)
    finally:
        ours.close()
        theirs.close()
