"""Observation <-> ``ObservationRequest`` and ``ActionChunk`` <-> numpy, for both sides of the wire.

The robot packs with :func:`pack_observation`; the worker unpacks and validates against the contract
with :func:`unpack_observation`, which raises :class:`ContractViolation` for anything malformed
(wrong shape or dtype, unknown or missing camera, oversized or truncated image, NaN state).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from sequence_ai_ros.exceptions import ContractViolation
from sequence_ai_ros.protocol import codec
from sequence_ai_ros.protocol import sequence_ai_pb2 as pb
from sequence_ai_ros.protocol.contract import Contract, check_names, clip
from sequence_ai_ros.protocol.spaces import ActionSpace
from sequence_ai_ros.protocol.types import ImageLike, Observation

#: Largest packed ``ActionChunk`` (bytes): the worker's ``grpc.max_send_message_length`` and the client's
#: receive limit (``sequence_ai_ros.client.session.MAX_MESSAGE_BYTES``), 64 MiB.
MAX_CHUNK_BYTES = 64 << 20
#: Bytes of an ActionChunk besides the action data (ids, timings, framing), an upper bound for the early check.
_CHUNK_OVERHEAD = 4096


def pack_images(obs: Observation, contract: Contract, out: Any = None) -> list[pb.Image]:
    """Encode the observation's images in the contract's wire encodings.

    Already-encoded JPEG/PNG bytes pass through untouched. Arrays are encoded as the contract's
    CameraSpec asks (jpeg by default). Cameras the contract does not name are not sent.

    :param out: a repeated Image field to fill in place (no second copy of the pixels); default a new list.
    :raises ContractViolation: when a camera the contract needs is missing, or an image is invalid.
    """
    images = [] if out is None else out
    for cam in contract.observation.cameras:
        if cam.key not in obs.images:
            raise ContractViolation(f'camera {cam.key!r} required by the contract is missing '
                                    f'(observation has {sorted(obs.images)})')
        target = None if out is None else out.add()
        image = codec.encode_image(cam.key, obs.images[cam.key], cam.encoding, out=target)
        if out is None:
            images.append(image)
    return images


def check_state(obs: Observation, contract: Contract) -> None:
    """Check the observation's state against the contract's state names (size, and names when given).

    :raises ContractViolation: when the size or the names (or their order) differ from the contract.
    """
    names = contract.observation.state_names
    if names:
        if obs.state_names:
            check_names(obs.state_names, names, 'state')
        if obs.state.shape[0] != len(names):
            raise ContractViolation(f'state has {obs.state.shape[0]} values, the contract names {len(names)}')


def pack_observation(obs: Observation, contract: Contract, *, episode_id: str, request_id: int,
                     history: Sequence[Observation] = (), chunk_tail: np.ndarray | None = None,
                     expected_delay_actions: int = 0, last_action: np.ndarray | None = None,
                     observation_step: float | None = None, tail_request_id: int = 0,
                     out: pb.ObservationRequest | None = None) -> pb.ObservationRequest:
    """Build the request for one chunk.

    :param obs: the current observation (its images may be arrays or encoded bytes).
    :param history: earlier observations, oldest first (history N-1 of them at most), sampled at dt.
    :param chunk_tail: float32 (K, D), the not-yet-executed actions of the current chunk.
    :param expected_delay_actions: actions expected to execute before the new chunk can start.
    :param last_action: float32 (D,), the last executed action.
    :param observation_step: the episode's chunk step of the observation (row 0 of tail and answer); when
        given, the worker completes the tail with chunks newer than ``tail_request_id`` (pipelining, see
        :mod:`~sequence_ai_ros.protocol.pipeline`).
    :param tail_request_id: the request whose chunk the tail was cut from (0: none).
    :param out: an empty ObservationRequest to fill in place (``EpisodeRequest().observation``: no copy).
    :raises ContractViolation: when the state does not match the contract or a camera is missing.
    """
    req = pb.ObservationRequest() if out is None else out
    # Built in place, field by field: constructing messages and copying them in copies every image twice.
    _pack_fields(obs, contract, req, episode_id=episode_id, request_id=request_id, chunk_tail=chunk_tail,
                 expected_delay_actions=expected_delay_actions, last_action=last_action,
                 observation_step=observation_step, tail_request_id=tail_request_id)
    pack_images(obs, contract, out=req.images)
    for past in history:
        frame = req.history.add()
        frame.robot_time_s = past.timestamp
        codec.to_tensor(past.state, 'float32', out=frame.state)
        pack_images(past, contract, out=frame.images)
    return req


def _pack_fields(obs: Observation, contract: Contract, req: pb.ObservationRequest, *, episode_id: str,
                 request_id: int, chunk_tail: np.ndarray | None, expected_delay_actions: int,
                 last_action: np.ndarray | None, observation_step: float | None, tail_request_id: int,
                 with_names: bool = True) -> None:
    """Fill every field of ``req`` but ``images`` and ``history`` (see :func:`pack_observation`).

    :param with_names: fill ``state_names`` too; False leaves them to the caller (:func:`_names_bytes`).
    """
    check_state(obs, contract)
    req.episode_id, req.request_id, req.instruction = episode_id, request_id, obs.instruction
    req.robot_time_s, req.expected_delay_actions = obs.timestamp, int(expected_delay_actions)
    codec.to_tensor(obs.state, 'float32', out=req.state, what='state')
    if with_names:
        req.state_names.extend(obs.state_names or contract.observation.state_names)
    if obs.params:
        req.params.update(obs.params)
    if chunk_tail is not None:
        codec.to_tensor(codec.numbers(chunk_tail, 'chunk_tail').reshape(-1, contract.action_dim),
                        out=req.chunk_tail)
    if last_action is not None:
        codec.to_tensor(last_action, 'float32', out=req.last_action, what='last_action')
    if observation_step is not None:
        req.observation_step, req.tail_request_id, req.splice_tail = observation_step, tail_request_id, True


# Protobuf wire format (https://protobuf.dev/programming-guides/encoding/): a length-delimited field is
# its key (field number << 3 | 2) as a varint, the length as a varint, then the bytes.
_EPISODE_OBSERVATION, _OBSERVATION_IMAGES, _OBSERVATION_HISTORY, _FRAME_IMAGES, _IMAGE_DATA = 2, 7, 8, 3, 6


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


@functools.lru_cache(maxsize=1024)
def _field(number: int, size: int) -> bytes:
    """The key and length of length-delimited field ``number`` holding ``size`` bytes (a raw frame's: cached)."""
    return _varint(number << 3 | 2) + _varint(size)


@functools.lru_cache(maxsize=64)
def _names_bytes(names: tuple[str, ...]) -> bytes:
    """The wire bytes of ObservationRequest's ``state_names`` holding ``names`` (the same each request: cached).

    Appended after the other fields' bytes: a parser reads the fields of a message in any order, and a repeated
    field's entries in the order they come.
    """
    return pb.ObservationRequest(state_names=names).SerializeToString()


@functools.lru_cache(maxsize=256)
def _image_fields(key: str, encoding: str, width: int, height: int, channels: int) -> bytes:
    """The wire bytes of an Image's fields but ``data`` (the same for each frame of a camera: cached)."""
    return pb.Image(key=key, encoding=encoding, width=width, height=height, channels=channels).SerializeToString()


def _image_pieces(obs: Observation, contract: Contract, field: int, pieces: list[bytes | memoryview]) -> int:
    """Append the wire pieces of ``obs``'s images (repeated Image ``field``) to ``pieces``; return their size."""
    total = 0
    for cam in contract.observation.cameras:
        if cam.key not in obs.images:
            raise ContractViolation(f'camera {cam.key!r} required by the contract is missing '
                                    f'(observation has {sorted(obs.images)})')
        enc, width, height, channels, data = codec.image_payload(cam.key, obs.images[cam.key], cam.encoding)
        size = len(data) if isinstance(data, bytes) else data.nbytes
        head = _image_fields(cam.key, enc, width, height, channels) + _field(_IMAGE_DATA, size)
        key = _field(field, len(head) + size)
        pieces += (key, head, data)
        total += len(key) + len(head) + size
    return total


def observation_request_bytes(obs: Observation, contract: Contract, *, episode_id: str, request_id: int,
                              history: Sequence[Observation] = (), chunk_tail: np.ndarray | None = None,
                              expected_delay_actions: int = 0, last_action: np.ndarray | None = None,
                              observation_step: float | None = None, tail_request_id: int = 0,
                              trace_context: str = '') -> bytes:
    """The wire bytes of ``EpisodeRequest(observation=pack_observation(...))``, with the same arguments.

    ``trace_context``: the W3C traceparent of the robot's span of this request ('' when not tracing;
    :mod:`~sequence_ai_ros.protocol.tracing`).

    The same message for any protobuf parser (``EpisodeRequest.FromString`` gives what
    :func:`pack_observation` builds), but each frame's pixels are copied once, straight into the wire
    bytes: the small fields are serialized by protobuf, and every Image is written as its header fields
    plus its ``data`` field from the array's own buffer (a raw frame is not first copied into a bytes
    object, then into the message, then into its serialization). What is the same on every request of an
    episode (the state names, each camera's Image header fields) is serialized once and reused.

    :raises ContractViolation: as :func:`pack_observation`.
    """
    req = pb.ObservationRequest()
    _pack_fields(obs, contract, req, episode_id=episode_id, request_id=request_id, chunk_tail=chunk_tail,
                 expected_delay_actions=expected_delay_actions, last_action=last_action,
                 observation_step=observation_step, tail_request_id=tail_request_id, with_names=False)
    if trace_context:
        req.trace_context = trace_context
    small = req.SerializeToString() + _names_bytes(tuple(obs.state_names or contract.observation.state_names))
    pieces: list[bytes | memoryview] = [b'', small]
    size = len(small) + _image_pieces(obs, contract, _OBSERVATION_IMAGES, pieces)
    for past in history:
        frame = pb.Frame(robot_time_s=past.timestamp)
        codec.to_tensor(past.state, 'float32', out=frame.state)
        head = frame.SerializeToString()
        at = len(pieces)
        pieces += (b'', head)
        frame_size = len(head) + _image_pieces(past, contract, _FRAME_IMAGES, pieces)
        pieces[at] = _field(_OBSERVATION_HISTORY, frame_size)
        size += len(pieces[at]) + frame_size
    pieces[0] = _field(_EPISODE_OBSERVATION, size)
    return b''.join(pieces)


@dataclasses.dataclass
class PolicyInput:
    """A validated request as the worker's policy sees it.

    :param observation: the current observation; images decoded to uint8 (H, W, C).
    :param history: the last N observations, oldest first, ending with ``observation``
        (length = the contract's history, or fewer at the start of an episode).
    :param chunk_tail: float32 (K, D) not-yet-executed actions of the current chunk (K may be 0).
    :param expected_delay_actions: actions expected to run before the new chunk starts.
    :param last_action: float32 (D,) last executed action, or None before the first.
    :param request_id: the request's id.
    :param episode_id: the episode's id.
    :param trace_context: when the worker traces (``seq serve --otlp-endpoint``), the W3C traceparent of its
        span of this request, under which a policy may start spans of its own; '' otherwise.
    """

    observation: Observation
    history: list[Observation]
    chunk_tail: np.ndarray
    expected_delay_actions: int
    last_action: np.ndarray | None
    request_id: int
    episode_id: str
    trace_context: str = ''


#: The largest frame a request may carry (width * height): a 4K camera's.
MAX_PIXELS = 3840 * 2160


def _unpack_images(images: Sequence[pb.Image], contract: Contract, max_pixels: int | None, what: str,
                   decode: Callable[[pb.Image], Any] | None = None) -> dict[str, ImageLike]:
    out: dict[str, ImageLike] = {}
    for img in images:
        spec = contract.observation.camera(img.key)
        if spec is None:
            known = [c.key for c in contract.observation.cameras]
            raise ContractViolation(f'{what}: unknown camera {clip(img.key)!r}; the contract names {known}')
        if img.key in out:
            raise ContractViolation(f'{what}: camera {img.key!r} sent twice')
        if spec.width and spec.height and (img.width, img.height) != (spec.width, spec.height):
            raise ContractViolation(f'{what}: camera {img.key!r} is {img.width}x{img.height}, '
                                    f'the contract says {spec.width}x{spec.height}')
        if decode is not None and img.encoding != 'raw':
            out[img.key] = decode(img)
        else:
            out[img.key] = codec.decode_image(img, max_pixels=max_pixels)
    missing = [c.key for c in contract.observation.cameras if c.key not in out]
    if missing:
        raise ContractViolation(f'{what}: missing cameras {missing}')
    return out


def _unpack_state(tensor: pb.Tensor, contract: Contract, what: str) -> np.ndarray:
    if not tensor.dtype:
        raise ContractViolation(f'{what}: state is missing')
    state = codec.from_tensor(tensor, what=f'{what} state', dtype='float32', ndim=1, finite=True)
    dim = contract.observation.state_dim
    if dim and state.shape[0] != dim:
        raise ContractViolation(f'{what}: state has {state.shape[0]} values, the contract needs {dim}')
    return state


def unpack_observation(req: pb.ObservationRequest, contract: Contract, *, max_pixels: int | None = MAX_PIXELS,
                       decode: Callable[[pb.Image], Any] | None = None) -> PolicyInput:
    """Validate a request against the contract and decode it for the policy.

    :param decode: what stands in for each JPEG/PNG image that passed the contract's checks (raw ones are always
        unpacked here): by default :func:`~sequence_ai_ros.protocol.codec.decode_image` with ``max_pixels``; a
        caller may return a placeholder, check the whole request first, and decode the pixels afterwards.

    :raises ContractViolation: for a wrong state shape/dtype, NaN, unknown/missing camera, an image
        over ``max_pixels`` or not the contract's size, a truncated image, too much history, or a
        chunk tail whose width is not the action dimension.
    """
    what = f'request {req.request_id}'
    names = contract.observation.state_names
    if names and req.state_names:
        check_names(req.state_names, names, f'{what} state')
    state = _unpack_state(req.state, contract, what)
    images = _unpack_images(req.images, contract, max_pixels, what, decode)
    obs = Observation(state=state, state_names=tuple(req.state_names or names), images=images,
                      instruction=req.instruction, timestamp=req.robot_time_s, params=dict(req.params))
    want = contract.observation.history
    if len(req.history) > want - 1:
        raise ContractViolation(f'{what}: {len(req.history)} history frames, the contract allows {want - 1}')
    history = []
    for i, frame in enumerate(req.history):
        fwhat = f'{what} history[{i}]'
        history.append(Observation(
            state=_unpack_state(frame.state, contract, fwhat), state_names=obs.state_names,
            images=_unpack_images(frame.images, contract, max_pixels, fwhat, decode),
            instruction=req.instruction, timestamp=frame.robot_time_s))
    history.append(obs)
    d = contract.action_dim
    tail = np.zeros((0, d), np.float32)
    if req.chunk_tail.dtype:
        tail = codec.from_tensor(req.chunk_tail, what=f'{what} chunk_tail', dtype='float32', ndim=2, finite=True)
        if tail.shape[1] != d:
            raise ContractViolation(f'{what}: chunk_tail has {tail.shape[1]} columns, action_dim is {d}')
    last = None
    if req.last_action.dtype:
        last = codec.from_tensor(req.last_action, what=f'{what} last_action', dtype='float32', ndim=1,
                                 finite=True)
        if last.shape[0] != d:
            raise ContractViolation(f'{what}: last_action has {last.shape[0]} values, action_dim is {d}')
    return PolicyInput(observation=obs, history=history, chunk_tail=tail,
                       expected_delay_actions=int(req.expected_delay_actions), last_action=last,
                       request_id=req.request_id, episode_id=req.episode_id)


def pack_chunk(actions: np.ndarray, contract: Contract, *, request_id: int, episode_id: str,
               robot_time_s: float, done: bool = False, queue_wait_ms: float = 0.0,
               inference_ms: float = 0.0, max_bytes: int = MAX_CHUNK_BYTES) -> pb.ActionChunk:
    """Build an ``ActionChunk`` from float32 (T, D) actions.

    :param actions: (T, D) actions, 1 <= T <= contract.chunk_length (the declared action horizon; a
        shorter chunk is fine), D = contract.action_dim.
    :param max_bytes: the transport limit of one message (bytes), :data:`MAX_CHUNK_BYTES` by default.
    :raises ContractViolation: when actions are not (T, D) with D = action_dim and 1 <= T <= chunk_length,
        are not finite, or the packed chunk would exceed ``max_bytes``;
        :class:`~sequence_ai_ros.protocol.codec.ValueKindViolation` (field ``actions``) when they are not
        real numbers (complex, string, bool, object: never cut to a real part nor cast to 0/1).
    """
    arr = codec.numbers(actions, 'actions')   # float64 beyond float32 becomes inf, refused below
    if arr.ndim != 2 or arr.shape[0] < 1 or arr.shape[1] != contract.action_dim:
        raise ContractViolation(f'policy returned actions of shape {arr.shape}; (T, {contract.action_dim}) '
                                'with T >= 1 is required')
    if arr.shape[0] > contract.chunk_length:
        raise ContractViolation(f'policy returned {arr.shape[0]} actions; its contract declares chunk_length '
                                f'{contract.chunk_length} (the action horizon), so T <= {contract.chunk_length}')
    if arr.nbytes + _CHUNK_OVERHEAD > max_bytes:
        raise ContractViolation(f'a chunk of shape {arr.shape} is {arr.nbytes} bytes; the transport limit is '
                                f'{max_bytes} bytes per message')
    if not np.isfinite(arr).all():
        raise ContractViolation('policy returned non-finite actions (NaN or inf)')
    msg = pb.ActionChunk(
        request_id=request_id, episode_id=episode_id, actions=codec.to_tensor(arr),
        action_space=contract.action_space.to_proto(), dt=contract.dt,
        covers_seconds=arr.shape[0] * contract.dt, done=done, robot_time_s=robot_time_s,
        timings=pb.Timings(queue_wait_ms=queue_wait_ms, inference_ms=inference_ms))
    # ByteSize() encodes the message to measure it: only when ids and framing could pass the limit
    if arr.nbytes + 4 * len(episode_id) + _CHUNK_OVERHEAD > max_bytes and msg.ByteSize() > max_bytes:
        raise ContractViolation(f'the packed chunk is {msg.ByteSize()} bytes; the transport limit is '
                                f'{max_bytes} bytes per message')
    return msg


@dataclasses.dataclass(frozen=True)
class Chunk:
    """An action chunk as the client holds it.

    :param actions: float32 (T, D).
    :param action_space: the space of every row.
    :param dt: action period (s).
    :param request_id: the request it answers.
    :param done: the policy marked the task complete.
    :param inference_ms: the worker's inference time (ms), for diagnostics.
    :param queue_wait_ms: the worker's queue wait (ms).
    """

    actions: np.ndarray
    action_space: ActionSpace
    dt: float
    request_id: int
    done: bool = False
    inference_ms: float = 0.0
    queue_wait_ms: float = 0.0

    @property
    def covers_seconds(self) -> float:
        """T * dt (s)."""
        return len(self.actions) * self.dt


def unpack_chunk(msg: pb.ActionChunk) -> Chunk:
    """Decode a reply. Validation of dimension, space and finiteness is the client's (reason 'validate').

    :raises ContractViolation: when the tensor is malformed (bytes vs shape) or the space is unspecified.
    """
    actions = codec.from_tensor(msg.actions, what='chunk actions', dtype='float32', ndim=2)
    try:
        space = ActionSpace.from_proto(msg.action_space)
    except ValueError as exc:
        raise ContractViolation(f'chunk {msg.request_id}: {exc}') from None
    return Chunk(actions=actions, action_space=space, dt=msg.dt, request_id=msg.request_id, done=msg.done,
                 inference_ms=msg.timings.inference_ms, queue_wait_ms=msg.timings.queue_wait_ms)
