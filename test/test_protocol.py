"""Protocol round trips: arrays, images, contracts, observations and chunks, with typed errors."""

from __future__ import annotations

import numpy as np
import pytest

from sequence_ai_ros.exceptions import ContractViolation, NotReady, UnknownDeployment
from sequence_ai_ros.protocol import (
    ActionSpace,
    CameraSpec,
    Contract,
    Observation,
    ObservationContract,
    codec,
    messages,
)
from sequence_ai_ros.protocol import errors as perrors
from sequence_ai_ros.protocol import sequence_ai_pb2 as pb


@pytest.mark.parametrize('array', [
    np.arange(26, dtype=np.float32),
    np.random.default_rng(0).normal(size=(30, 26)).astype(np.float32),
    np.zeros((0, 7), np.float32),
    np.arange(12, dtype=np.uint8).reshape(2, 2, 3),
    np.array([1, 2, 3], np.int64),
])
def test_tensor_round_trip(array):
    back = codec.from_tensor(codec.to_tensor(array))
    assert back.dtype == array.dtype and back.shape == array.shape
    np.testing.assert_array_equal(back, array)


def test_tensor_rejects_bad_payloads():
    t = codec.to_tensor(np.ones((3, 2), np.float32))
    t.data = t.data[:-1]
    with pytest.raises(ContractViolation, match='bytes for shape'):
        codec.from_tensor(t)
    with pytest.raises(ContractViolation, match='not allowed'):
        codec.from_tensor(pb.Tensor(shape=[1], dtype='object', data=b'x'))
    with pytest.raises(ContractViolation, match='cannot go on the wire'):
        codec.to_tensor(np.array(['a']))
    nan = codec.to_tensor(np.array([1.0, np.nan], np.float32))
    with pytest.raises(ContractViolation, match='non-finite'):
        codec.from_tensor(nan, finite=True)


@pytest.mark.parametrize('encoding', ['raw', 'png', 'jpeg'])
def test_image_round_trip(encoding):
    rng = np.random.default_rng(1)
    img = np.repeat(np.repeat(rng.integers(0, 255, (6, 8, 3), dtype=np.uint8), 8, 0), 8, 1)
    msg = codec.encode_image('cam', img, encoding)
    assert (msg.width, msg.height, msg.channels) == (64, 48, 3)
    back = codec.decode_image(msg)
    assert back.shape == img.shape
    tol = 0 if encoding != 'jpeg' else 40
    assert np.abs(back.astype(int) - img.astype(int)).mean() <= tol


def test_encoded_jpeg_passes_through_untouched():
    img = np.full((32, 48, 3), 120, np.uint8)
    jpeg = codec.encode_image('cam', img, 'jpeg').data
    msg = codec.encode_image('cam', jpeg)
    assert msg.data == jpeg and (msg.width, msg.height, msg.encoding) == (48, 32, 'jpeg')


def test_truncated_and_oversized_images_are_contract_violations():
    img = np.full((64, 64, 3), 7, np.uint8)
    msg = codec.encode_image('cam', img, 'jpeg')
    msg.data = msg.data[: len(msg.data) // 2]
    with pytest.raises(ContractViolation, match='cannot decode'):
        codec.decode_image(msg)
    with pytest.raises(ContractViolation, match='exceeds'):
        codec.decode_image(codec.encode_image('cam', img, 'png'), max_pixels=100)
    msg.data = b'not an image at all'               # the same words each time: no buffer's address in them
    words = set()
    for _ in range(2):
        with pytest.raises(ContractViolation, match='not an image Pillow can identify') as info:
            codec.decode_image(msg)
        words.add(str(info.value))
    assert len(words) == 1 and '0x' not in words.pop()


def _contract(history: int = 1) -> Contract:
    return Contract(
        action_space='joint_absolute', action_names=('a', 'b'), dt=0.1, chunk_length=5,
        observation=ObservationContract(cameras=(CameraSpec('cam', 16, 12, 'png'),), state_names=('a', 'b'),
                                        history=history))


def test_contract_round_trip_and_validation():
    c = _contract(history=3).with_names('demo', 2)
    back = Contract.from_proto(c.to_proto(ready=True, eta_seconds=0.0))
    assert back == c
    assert back.covers_seconds == pytest.approx(0.5)
    with pytest.raises(ContractViolation):
        Contract(action_space='joint_absolute', action_names=('a',), dt=0, chunk_length=1)
    with pytest.raises(ValueError, match='expected one of'):
        Contract(action_space='cartesian', action_names=('a',), dt=0.1, chunk_length=1)


def test_observation_request_round_trip_with_history_and_tail():
    c = _contract(history=2)
    img = np.full((12, 16, 3), 200, np.uint8)
    past = Observation(state=[0.0, 1.0], state_names=('a', 'b'), images={'cam': img}, timestamp=1.0)
    now = Observation(state=[0.5, 1.5], state_names=('a', 'b'), images={'cam': img}, timestamp=1.1,
                      instruction='pick', params={'seed': 3})
    tail = np.ones((2, 2), np.float32)
    req = messages.pack_observation(now, c, episode_id='e', request_id=7, history=[past], chunk_tail=tail,
                                    expected_delay_actions=1, last_action=np.zeros(2, np.float32))
    inp = messages.unpack_observation(pb.ObservationRequest.FromString(req.SerializeToString()), c)
    assert [h.timestamp for h in inp.history] == [1.0, 1.1]
    np.testing.assert_array_equal(inp.observation.state, [0.5, 1.5])
    assert inp.observation.images['cam'].shape == (12, 16, 3)
    assert inp.observation.params == {'seed': '3'} and inp.request_id == 7
    np.testing.assert_array_equal(inp.chunk_tail, tail)


def _cameras_contract(history: int) -> Contract:
    cams = (CameraSpec('raw_rgb', 16, 12, 'raw'), CameraSpec('mono', 8, 6, 'raw'), CameraSpec('jpg', 16, 12, 'jpeg'),
            CameraSpec('png', 16, 12, 'png'), CameraSpec('passed', 16, 12, 'jpeg'))
    return Contract(action_space='joint_absolute', action_names=('a', 'b'), dt=0.1, chunk_length=5,
                    observation=ObservationContract(cameras=cams, state_names=('a', 'b'), history=history))


@pytest.mark.parametrize('history, pipelined', [(1, False), (3, True)])
def test_observation_wire_bytes_parse_to_the_packed_message(history, pipelined):
    """The wire bytes built beside protobuf are the message pack_observation builds, for any parser."""
    c = _cameras_contract(history)
    rng = np.random.default_rng(history)
    jpeg = codec.encode_image('x', rng.integers(0, 255, (12, 16, 3), np.uint8), 'jpeg').data

    def obs(t: float) -> Observation:
        rgb = rng.integers(0, 255, (24, 16, 3), np.uint8)[::2]        # not C-contiguous: packed as a copy
        return Observation(state=rng.normal(size=2), state_names=('a', 'b'), timestamp=t, instruction='pick',
                           params={'seed': 3}, images={
                               'raw_rgb': rgb, 'mono': rng.integers(0, 255, (6, 8), np.uint8),
                               'jpg': rng.integers(0, 255, (12, 16, 3), np.uint8),
                               'png': rng.integers(0, 255, (12, 16, 3), np.uint8), 'passed': jpeg,
                               'unused': np.zeros((2, 2, 3), np.uint8)})

    now, past = obs(2.0), [obs(1.0 + i / 10) for i in range(history - 1)]
    kwargs = dict(episode_id='e', request_id=9, history=past, chunk_tail=rng.normal(size=(3, 2)),
                  expected_delay_actions=2, last_action=np.ones(2, np.float32))
    if pipelined:
        kwargs.update(observation_step=40.0, tail_request_id=8)
    want = pb.EpisodeRequest()
    messages.pack_observation(now, c, out=want.observation, **kwargs)
    got = pb.EpisodeRequest.FromString(messages.observation_request_bytes(now, c, **kwargs))
    assert got == want
    assert len(got.observation.history) == history - 1
    assert [i.key for i in got.observation.images][:2] == ['raw_rgb', 'mono']
    inp = messages.unpack_observation(got.observation, c)
    np.testing.assert_array_equal(inp.observation.images['raw_rgb'], now.images['raw_rgb'])
    np.testing.assert_array_equal(inp.observation.images['mono'][:, :, 0], now.images['mono'])
    with pytest.raises(ContractViolation, match="camera 'raw_rgb' required"):
        messages.observation_request_bytes(Observation(state=[0.0, 1.0], images={}), c, episode_id='e',
                                           request_id=1)


@pytest.mark.parametrize('mutate, match', [
    (lambda r: r.state.CopyFrom(codec.to_tensor(np.zeros(3, np.float32))), 'state has 3 values'),
    (lambda r: r.state.CopyFrom(codec.to_tensor(np.zeros(2, np.float64))), 'float32 is required'),
    (lambda r: r.state.CopyFrom(codec.to_tensor(np.array([np.nan, 0], np.float32))), 'non-finite'),
    (lambda r: r.images.append(codec.encode_image('other', np.zeros((12, 16, 3), np.uint8), 'png')),
     'unknown camera'),
    (lambda r: r.images.pop(), 'missing cameras'),
])
def test_malformed_requests_are_contract_violations(mutate, match):
    c = _contract()
    obs = Observation(state=[0.0, 1.0], images={'cam': np.zeros((12, 16, 3), np.uint8)})
    req = messages.pack_observation(obs, c, episode_id='e', request_id=1)
    mutate(req)
    with pytest.raises(ContractViolation, match=match):
        messages.unpack_observation(req, c)


def test_chunk_round_trip_and_validation():
    c = _contract()
    actions = np.arange(10, dtype=np.float32).reshape(5, 2)
    msg = messages.pack_chunk(actions, c, request_id=3, episode_id='e', robot_time_s=2.5, done=True)
    chunk = messages.unpack_chunk(pb.ActionChunk.FromString(msg.SerializeToString()))
    np.testing.assert_array_equal(chunk.actions, actions)
    assert chunk.action_space is ActionSpace.JOINT_ABSOLUTE and chunk.done and chunk.covers_seconds == 0.5
    with pytest.raises(ContractViolation, match=r'\(T, 2\)'):
        messages.pack_chunk(np.zeros((5, 3)), c, request_id=1, episode_id='e', robot_time_s=0)
    with pytest.raises(ContractViolation, match='non-finite'):
        messages.pack_chunk(np.full((5, 2), np.inf), c, request_id=1, episode_id='e', robot_time_s=0)


def test_errors_keep_their_type_across_the_wire():
    err = perrors.to_error(UnknownDeployment('no deployment "x"'), request_id=4)
    back = perrors.from_error(pb.Error.FromString(err.SerializeToString()))
    assert isinstance(back, UnknownDeployment) and 'no deployment' in str(back)
    for retry, kept in ((2.5, 2.5), (0.0, 0.0), (float('nan'), 0.0), (float('inf'), 0.0), (-1.0, 0.0)):
        err = perrors.to_error(NotReady('warming', retry_after_s=retry), request_id=2)
        back = perrors.from_error(pb.Error.FromString(err.SerializeToString()))
        assert isinstance(back, NotReady) and str(back) == 'warming' and back.retry_after_s == kept, retry
    assert perrors.to_error(ContractViolation('bad')).retry_after_s == 0.0
    status, details = perrors.abort_details(ContractViolation('bad shape'))
    assert status.name == 'INVALID_ARGUMENT' and details.startswith('[CONTRACT_VIOLATION]')


def test_observation_coerce_from_dict():
    obs = Observation.coerce({'state': [1, 2], 'instruction': 'go'})
    assert obs.state.dtype == np.float32 and obs.instruction == 'go'
    with pytest.raises(ContractViolation, match='unknown keys'):
        Observation.coerce({'state': [1], 'joints': [1]})
    with pytest.raises(TypeError):
        Observation.coerce([1, 2])
    with pytest.raises(ContractViolation, match='empty name'):
        Observation(state=[1.0], state_names=('',))


def _horizon_contract(chunk_length: int = 4, dim: int = 2) -> Contract:
    return Contract(ActionSpace.JOINT_ABSOLUTE, [f'j{i}' for i in range(dim)], 0.1, chunk_length)


def test_chunks_longer_than_the_horizon_or_the_transport_limit_are_refused():
    c = _horizon_contract(chunk_length=4)
    pack = dict(request_id=1, episode_id='e', robot_time_s=0.0)
    with pytest.raises(ContractViolation, match='chunk_length 4'):
        messages.pack_chunk(np.zeros((5, 2), np.float32), c, **pack)
    assert messages.pack_chunk(np.zeros((3, 2), np.float32), c, **pack).actions.shape == [3, 2]
    assert messages.pack_chunk(np.zeros((4, 2), np.float32), c, **pack).actions.shape == [4, 2]
    wide = _horizon_contract(chunk_length=100, dim=1000)  # 100 x 1000 float32 = 400 kB
    with pytest.raises(ContractViolation, match='transport limit is 262144 bytes'):
        messages.pack_chunk(np.zeros((100, 1000), np.float32), wide, max_bytes=256 << 10, **pack)
    assert messages.pack_chunk(np.zeros((100, 1000), np.float32), wide, **pack).ByteSize() > 400_000
    assert messages.MAX_CHUNK_BYTES == 64 << 20


@pytest.mark.parametrize('kwargs, match', [
    ({'chunk_length': 2.7}, 'integer number of actions'),
    ({'chunk_length': 30.0}, 'integer number of actions'),
    ({'chunk_length': True}, 'integer number of actions'),
    ({'chunk_length': 10_001}, r'1\.\.10000'),
    ({'chunk_length': 0}, r'1\.\.10000'),
    ({'action_names': 'xyz'}, 'not the single string'),
])
def test_contract_refuses_non_integer_absurd_horizons_and_string_names(kwargs, match):
    args = dict(action_space='joint_absolute', action_names=['x', 'y', 'z'], dt=0.1, chunk_length=4) | kwargs
    with pytest.raises(ContractViolation, match=match):
        Contract(**args)
    assert Contract(**dict(args, chunk_length=np.int64(10_000), action_names=('x', 'y', 'z'))).chunk_length == 10_000


def test_observation_contract_refuses_state_names_given_as_a_string():
    with pytest.raises(ContractViolation, match='not the single string'):
        ObservationContract(state_names='abc')


def _png(mode: str, size=(4, 3)) -> bytes:
    import io

    from PIL import Image as PILImage

    buf = io.BytesIO()
    PILImage.new(mode, size).save(buf, format='PNG')
    return buf.getvalue()


def test_zero_size_images_are_contract_violations():
    for w, h in ((0, 0), (0, 2), (2, 0)):
        raw = pb.Image(key='cam', encoding='raw', width=w, height=h, channels=3, data=b'')
        with pytest.raises(ContractViolation, match='width and height must be >= 1'):
            codec.decode_image(raw)
    jpeg = codec.encode_image('cam', np.zeros((2, 2, 3), np.uint8), 'jpeg')
    jpeg.width = 0
    with pytest.raises(ContractViolation, match='width and height must be >= 1'):
        codec.decode_image(jpeg)
    with pytest.raises(ContractViolation, match='empty'):
        codec.encode_image('cam', np.zeros((0, 4, 3), np.uint8), 'raw')


def test_encoded_images_must_hold_the_declared_channels():
    gray = pb.Image(key='cam', encoding='png', width=4, height=3, channels=3, data=_png('L'))
    with pytest.raises(ContractViolation, match='holds 1 channels .* 3 are declared'):
        codec.decode_image(gray)
    rgb = pb.Image(key='cam', encoding='png', width=4, height=3, channels=1, data=_png('RGB'))
    with pytest.raises(ContractViolation, match='holds 3 channels .* 1 are declared'):
        codec.decode_image(rgb)
    rgba = codec.encode_image('cam', _png('RGBA'))  # passed through: the header says 4 channels
    with pytest.raises(ContractViolation, match='4 channels declared'):
        codec.decode_image(rgba)
    assert codec.decode_image(pb.Image(key='cam', encoding='png', width=4, height=3, channels=1,
                                       data=_png('L'))).shape == (3, 4, 1)
    palette = codec.encode_image('cam', _png('P'))
    assert palette.channels == 3 and codec.decode_image(palette).shape == (3, 4, 3)
    no_channels = pb.Image(key='cam', encoding='png', width=4, height=3, channels=0, data=_png('RGB'))
    with pytest.raises(ContractViolation, match='0 channels declared'):
        codec.decode_image(no_channels)


def test_error_messages_do_not_echo_unbounded_client_input():
    c = Contract('joint_absolute', ['x'], 0.1, 2, ObservationContract(cameras=[CameraSpec('cam', 1, 1, 'raw')],
                                                                      state_names=['x']))
    req = pb.ObservationRequest(request_id=1, state=codec.to_tensor(np.zeros(1, np.float32)), state_names=['x'])
    req.images.add(key='k' * 100_000, encoding='raw', width=1, height=1, channels=3, data=bytes(3))
    with pytest.raises(ContractViolation, match='unknown camera') as info:
        messages.unpack_observation(req, c)
    assert len(str(info.value)) < 300
    req = pb.ObservationRequest(request_id=1, state=codec.to_tensor(np.zeros(1, np.float32)),
                                state_names=['y' * 100_000])
    with pytest.raises(ContractViolation, match='names differ') as info:
        messages.unpack_observation(req, c)
    assert len(str(info.value)) < 300
    bad = pb.Image(key='cam', encoding='e' * 100_000, width=1, height=1, channels=3, data=bytes(3))
    with pytest.raises(ContractViolation, match='unknown encoding') as info:
        codec.decode_image(bad)
    assert len(str(info.value)) < 300


def test_tail_splice_slices_equal_row_by_row_overlay():
    """The sliced overlay (whole-step offsets) gives the row-by-row overlay's rows, and the same gaps."""
    from sequence_ai_ros.protocol.pipeline import _overlay, _overlay_rows

    rng = np.random.default_rng(1)
    gaps = 0
    for _ in range(3000):
        tail = rng.standard_normal((int(rng.integers(0, 8)), 3)).astype(np.float32)
        newer = [(float(rng.integers(-6, 12)), 0.0,
                  rng.standard_normal((int(rng.integers(0, 7)), 3)).astype(np.float32))
                 for _ in range(int(rng.integers(1, 4)))]
        sliced = _overlay(tail, [(int(o), c) for o, _, c in newer])
        rows = _overlay_rows(tail, newer, 0.0)
        assert (sliced is None) == (rows is None)
        gaps += sliced is None
        if sliced is not None:
            assert sliced.dtype == np.float32 and np.array_equal(sliced, rows)
    assert 0 < gaps < 3000          # both outcomes were exercised


def _jpeg(shape: tuple[int, ...], mode: str | None = None, **save: object) -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 255, shape, np.uint8), mode).save(buf, 'JPEG', **save)
    return buf.getvalue()


@pytest.mark.parametrize('data', [_jpeg((12, 16, 3)), _jpeg((9, 5)), _jpeg((12, 16, 3), progressive=True),
                                  _jpeg((12, 16, 3), exif=b'Exif\x00\x00' + bytes(20)), _jpeg((8, 8, 4), 'CMYK')])
def test_jpeg_header_probe_reads_what_pillow_reads_for_every_truncation(data):
    """The client's JPEG probe (read from the frame header, not by Pillow) answers or refuses as Pillow does."""
    import io

    from PIL import Image

    for cut in (*range(len(data) if len(data) < 800 else 800), len(data)):
        try:
            with Image.open(io.BytesIO(data[:cut])) as pil:
                want: object = (*pil.size, len(pil.getbands()), 'jpeg')
        except Exception:  # Pillow's several types for a bad header
            want = ContractViolation
        try:
            got: object = codec.probe_encoded(data[:cut])
        except ContractViolation:
            got = ContractViolation
        assert got == want, cut


def _odd_jpegs() -> dict[str, bytes]:
    """Frame headers Pillow refuses (or warns of) although their segments are whole: a break-it review's probes."""
    import struct

    base = _jpeg((12, 16, 3))
    at = 2
    while base[at + 1] not in codec._JPEG_SOF:                        # the frame header's offset
        at += 2 + (base[at + 2] << 8 | base[at + 3])

    def patched(offset: int, raw: bytes) -> bytes:
        return base[:at + offset] + raw + base[at + offset + len(raw):]

    app0 = base.index(b'\xff\xe0')
    end0 = app0 + 2 + (base[app0 + 2] << 8 | base[app0 + 3])
    dqt = base.index(b'\xff\xdb')
    return {
        '12-bit': patched(4, b'\x0c'),
        'huge': patched(5, struct.pack('>HH', 40000, 40000)),           # a decompression bomb to Pillow
        'bomb-warning': patched(5, struct.pack('>HH', 9000, 10000)),   # Pillow warns (and opens it)
        'short JFIF': base[:app0] + b'\xff\xe0\x00\x07JFIF\x00' + base[end0:],
        'short Adobe': base[:app0] + b'\xff\xee\x00\x07Adobe' + base[app0:],
        'cut DQT': base[:dqt + 2] + struct.pack('>H', (base[dqt + 2] << 8 | base[dqt + 3]) - 1) + base[dqt + 4:],
        'cut component list': patched(2, struct.pack('>H', (base[at + 2] << 8 | base[at + 3]) - 1)),
    }


@pytest.mark.parametrize('name', list(_odd_jpegs()))
def test_jpeg_header_probe_answers_odd_headers_as_pillow_and_the_worker_refuses_what_it_did(name):
    """12-bit, bomb-sized, short APP0/APP14, a cut DQT or component list: the probe answers as Pillow.

    The header reader took each as fine (Pillow, the probe before it, refused them); the worker, which decodes
    with Pillow, refuses every one it cannot decode, as before.
    """
    import io
    import warnings

    from PIL import Image

    data = _odd_jpegs()[name]
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        try:
            with Image.open(io.BytesIO(data)) as pil:
                want: object = (*pil.size, len(pil.getbands()), 'jpeg')
        except Exception:
            want = ContractViolation
        try:
            got: object = codec.probe_encoded(data)
        except ContractViolation:
            got = ContractViolation
    assert got == want
    if want is not ContractViolation:
        image = pb.Image(key='cam', encoding='jpeg', width=want[0], height=want[1], channels=want[2], data=data)
        with pytest.raises(ContractViolation, match="image 'cam'"):       # too many pixels, or not decodable
            codec.decode_image(image, max_pixels=1 << 24)


def test_several_encoded_frames_name_the_first_fault_in_order():
    """Of several faults in a request's frames (one that does not decode, an unknown camera), the first is named."""
    cams = (CameraSpec('a', 16, 12, 'jpeg'), CameraSpec('b', 16, 12, 'jpeg'), CameraSpec('c', 16, 12, 'jpeg'))
    c = Contract(action_space='joint_absolute', action_names=('a', 'b'), dt=0.1, chunk_length=5,
                 observation=ObservationContract(cameras=cams))
    good = _jpeg((12, 16, 3))
    req = messages.pack_observation(Observation(state=[0.0, 1.0], images=dict.fromkeys('abc', good)), c,
                                    episode_id='e', request_id=1)
    inp = messages.unpack_observation(req, c)
    assert all(inp.observation.images[k].shape == (12, 16, 3) for k in 'abc')
    req.images[1].data = good[:200]                       # b: truncated
    req.images.append(codec.encode_image('other', np.zeros((12, 16, 3), np.uint8), 'png'))
    with pytest.raises(ContractViolation, match="image 'b': cannot decode"):
        messages.unpack_observation(req, c)
    req.images[0].key = 'zz'                              # a fault before b's: named first
    with pytest.raises(ContractViolation, match="unknown camera 'zz'"):
        messages.unpack_observation(req, c)
