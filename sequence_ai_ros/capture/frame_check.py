"""Checking one telemetry frame against the deployment's contract before the store keeps it.

A frame is kept only when it could become a dataset row as it is:

- ``state``: dtype float32, shape (D,) with D the contract's state size, every value finite;
- ``action`` and ``policy_action`` (when present): float32 (A,) with A the contract's action size, finite;
- ``robot_time_s``: finite and within :data:`MAX_ROBOT_TIME_S` of 0 (a monotonic clock);
- the timeline (:mod:`sequence_ai_ros.protocol.timeline`), against the episode's records before it: every
  record has a span (``step_end > step_start``) or, in a store of an earlier version, none at all (all three
  0), never a mix; ``grid_index`` grows (by no more deadlines than the spans' gap or the robot time between
  the records holds) and ``step_start`` never falls before the previous record's end (its
  start, in an absolute space: there the latest record starting at a step is the one in effect); one
  span covers at most :data:`MAX_TICK_S` of the policy's time, a gap between two at most
  :data:`MAX_GAP_S`, the episode at most :data:`MAX_EPISODE_S`; ``robot_time_s`` never goes back nor leaps
  more than :data:`MAX_GAP_S`; ``hold_reason`` is '' or one of ``HOLD_REASONS``, and only on a held record;
- the episode's bounds, in every action space (:class:`~sequence_ai_ros.protocol.limits.LimitViolation`
  naming the bound): ``robot_time_s`` at most :data:`MAX_EPISODE_S` after the episode's first record
  (``episode_s``), and the stalls at most :data:`MAX_STALL_S` in all (``stall_s``): each record moves the
  timeline on by its span's end past the records before it or its robot time past the previous record's,
  whichever is more, and what that passes :data:`MAX_TICK_S` is a stall; so a record adds at most
  ``MAX_TICK_S`` of rows of its own and no few records make hours of held rows;
  ``pieces`` only in a delta or velocity space, float32 (P, A) with 2 <= P <= the chunk steps the span
  touches, finite, one positive ``piece_share`` each summing to 1, making up the record's policy action
  (or its action);
- each image: a known encoding (jpeg, png, raw); for jpeg/png the header, read by Pillow's lazy
  ``Image.open`` (no pixel decode), must show the declared format, width, height and channels; a png
  must hold 8-bit samples, greyscale for 1 channel or RGB for 3 (its IHDR: no 16-bit, no palette); a
  raw image must hold width*height*channels bytes; a contract camera with a size must match it; and
  one key keeps one size and one channel count for the whole episode (a video has one layout).

Pixel data is not decoded here (a JPEG whose body is truncated after a good header passes); the
export decodes and replaces such a frame by the camera's previous frame, counted (see
:mod:`sequence_ai_ros.datasets.rows`).
"""

from __future__ import annotations

import io
import math

import numpy as np

from sequence_ai_ros.exceptions import ContractViolation
from sequence_ai_ros.protocol import codec
from sequence_ai_ros.protocol import sequence_ai_pb2 as pb
from sequence_ai_ros.protocol.contract import Contract, clip
from sequence_ai_ros.protocol.limits import (
    MAX_EPISODE_S,
    MAX_GAP_S,
    MAX_ROBOT_TIME_S,
    MAX_STALL_S,
    MAX_TICK_S,
    LimitViolation,
    check_frame,
)
from sequence_ai_ros.protocol.spaces import ActionSpace, position_mask

_MODE_CHANNELS = {'L': 1, 'RGB': 3, 'YCbCr': 3, 'I;16': 1, 'P': 1, 'RGBA': 4, 'CMYK': 4, 'LA': 2, '1': 1}


# The limits (MAX_ROBOT_TIME_S, MAX_TICK_S, MAX_GAP_S, MAX_EPISODE_S, the step span, grid index and hold
# reasons) are the wire schema's: sequence_ai_ros.protocol.limits.
__all__ = ['EpisodeBounds', 'FrameChecker', 'MAX_EPISODE_S', 'MAX_GAP_S', 'MAX_ROBOT_TIME_S', 'MAX_STALL_S',
           'MAX_TICK_S']
#: Slack on span comparisons (chunk steps): spans are sums of floats.
_SLACK = 1e-6

class EpisodeBounds:
    """The episode's time bounds over its kept records: robot time since the first, stalls summed.

    :meth:`advance` checks a record and returns what :meth:`keep` then records once the whole record passed.
    """

    def __init__(self) -> None:
        self.first_time: float | None = None   # robot time of the episode's first kept record (s)
        self.end_step = 0.0                    # the furthest step_end of the kept records (chunk steps)
        self.stall_s = 0.0                     # the stalls so far (s)

    def advance(self, frame: pb.TelemetryFrame, last: pb.TelemetryFrame | None, dt: float | None) -> float:
        """Return the episode's stall total with ``frame`` kept.

        :raises LimitViolation: ``episode_s`` when its robot time is more than :data:`MAX_EPISODE_S` after
            the episode's first record; ``stall_s`` when the stalls would pass :data:`MAX_STALL_S`.
        """
        if self.first_time is not None and frame.robot_time_s - self.first_time > MAX_EPISODE_S:
            raise LimitViolation('episode_s', f'robot time at most {MAX_EPISODE_S:g} s after the episode\'s first '
                                              'record (MAX_EPISODE_S)',
                                 f'{frame.robot_time_s - self.first_time:.6g} s after it')
        if last is None:
            return self.stall_s
        moved = frame.robot_time_s - last.robot_time_s
        if dt is not None and frame.step_end > frame.step_start:
            moved = max(moved, (frame.step_end - max(self.end_step, last.step_end)) * dt)
        stall = self.stall_s + max(0.0, moved - MAX_TICK_S)
        if stall > MAX_STALL_S:
            raise LimitViolation('stall_s', f'at most {MAX_STALL_S:g} s of stalls per episode (MAX_STALL_S: the '
                                            f'time records move the episode past {MAX_TICK_S:g} s each, which an '
                                            'export fills with held rows)',
                                 f'{moved:.6g} s on from the previous record, {self.stall_s:.6g} s before it')
        return stall

    def keep(self, frame: pb.TelemetryFrame, stall: float) -> None:
        """Record ``frame`` as kept, with the stall total :meth:`advance` returned for it."""
        if self.first_time is None:
            self.first_time = frame.robot_time_s
        self.end_step = max(self.end_step, frame.step_end)
        self.stall_s = stall


class FrameChecker:
    """Check the telemetry frames of one episode (it remembers each camera's size).

    :param contract: the deployment's contract (state and action sizes, camera sizes); None checks only
        dtypes, ranks and finiteness.
    """

    def __init__(self, contract: Contract | None) -> None:
        self.contract = contract
        self._last: pb.TelemetryFrame | None = None   # the last record kept (the timeline's checks)
        self.bounds = EpisodeBounds()
        self.sizes: dict[str, tuple[int, int]] = {}
        self.channels: dict[str, int] = {}   # per camera key: the channel count of its first frame
        if contract is not None:
            for cam in contract.observation.cameras:
                if cam.width and cam.height:
                    self.sizes[cam.key] = (cam.width, cam.height)

    def check(self, frame: pb.TelemetryFrame) -> None:
        """Check one frame.

        :raises ContractViolation: naming the first problem (the frame must not be kept).
        """
        check_frame(frame)   # its own fields, by the wire schema
        self._order(frame)
        stall = self.bounds.advance(frame, self._last, self._dt())
        c = self.contract
        state_dim = len(c.observation.state_names) if c is not None and c.observation.state_names else None
        _vector(frame.state, 'state', state_dim)
        action_dim = len(c.action_names) if c is not None and c.action_names else None
        if frame.HasField('action'):
            _vector(frame.action, 'action', action_dim)
        if frame.HasField('policy_action'):
            _vector(frame.policy_action, 'policy_action', action_dim)
        self._pieces(frame, action_dim)
        sizes: dict[str, tuple[int, int]] = {}
        for image in frame.images:
            key = clip(image.key, 60)
            size = _image_size(image, key)
            expected = self.sizes.get(image.key) or sizes.get(image.key)
            if expected is not None and size != expected:
                raise ContractViolation(f'image {key!r}: {size[0]}x{size[1]}, this episode\'s {key!r} frames are '
                                        f'{expected[0]}x{expected[1]}')
            sizes[image.key] = size
            channels = self.channels.get(image.key)
            if channels is not None and image.channels != channels:
                raise ContractViolation(f'image {key!r}: {image.channels} channels, this episode\'s {key!r} frames '
                                        f'have {channels}')
        for key, size in sizes.items():
            self.sizes.setdefault(key, size)
        for image in frame.images:
            self.channels.setdefault(image.key, image.channels)
        self.bounds.keep(frame, stall)
        self._last = frame

    def _dt(self) -> float | None:
        """The contract's dt (s), None when unknown."""
        return self.contract.dt if self.contract is not None and self.contract.dt > 0 else None

    def _order(self, frame: pb.TelemetryFrame) -> None:
        """The record against the episode's records before it (see the module docstring)."""
        if frame.hold_reason and not frame.hold:
            raise ContractViolation(f'hold_reason {clip(frame.hold_reason, 40)!r} on a record that did not hold')
        spanned = frame.step_end > frame.step_start
        if not spanned and (frame.step_end or frame.step_start or frame.grid_index):
            raise ContractViolation(f'step span [{frame.step_start!r}, {frame.step_end!r}) is empty: a record of this '
                                    'protocol covers at least part of a chunk step')
        dt = self._dt()
        last = self._last
        if spanned and dt is not None:
            if (frame.step_end - frame.step_start) * dt > MAX_TICK_S:
                raise ContractViolation(f'step span of {frame.step_end - frame.step_start:g} chunk steps covers more '
                                        f'than {MAX_TICK_S:g} s: no control period is that long')
            if frame.step_end * dt > MAX_EPISODE_S:
                raise LimitViolation('episode_s', f'step_end at most {MAX_EPISODE_S:g} s into the episode '
                                                  '(MAX_EPISODE_S)', f'step_end {frame.step_end!r}')
        if last is None:
            return
        if spanned != (last.step_end > last.step_start):
            raise ContractViolation('a record with a chunk-step span among records without one (or the reverse)')
        if frame.robot_time_s < last.robot_time_s - 1e-6 or frame.robot_time_s - last.robot_time_s > MAX_GAP_S:
            raise ContractViolation(f'robot_time_s {frame.robot_time_s!r} goes back from, or leaps more than '
                                    f'{MAX_GAP_S:g} s past, the previous record\'s {last.robot_time_s!r}')
        if not spanned:
            return
        # absolute spaces may overlap (a loop on the clock without a fixed period only estimates its ticks'
        # length; the latest record starting at a step is the one in effect); increments never do
        floor = last.step_start if self.contract is None or self.contract.action_space.is_absolute \
            else last.step_end
        if frame.grid_index <= last.grid_index or frame.step_start < floor - _SLACK:
            raise ContractViolation(f'record at grid index {frame.grid_index}, steps [{frame.step_start!r}, '
                                    f'{frame.step_end!r}) does not follow the previous one (grid index '
                                    f'{last.grid_index}, ending at step {last.step_end!r})')
        gap = max(0.0, frame.step_start - last.step_end)
        period = last.step_end - last.step_start
        if dt is not None and gap * dt > MAX_GAP_S:
            raise ContractViolation(f'record starts {gap * dt:g} s after the previous one ends (more than '
                                    f'{MAX_GAP_S:g} s)')
        # deadlines a stalled loop missed: a gap in the spans, or (a skip mid-step, whose held time the client
        # pays at the next step boundary) the robot time between the records
        missed_by_time = 2 * (frame.robot_time_s - last.robot_time_s) / (period * dt) if dt is not None else 0.0
        if frame.grid_index - last.grid_index - 1 > max(2 * gap / period, missed_by_time) + 2:
            raise ContractViolation(f'grid index {frame.grid_index} leaps {frame.grid_index - last.grid_index} '
                                    f'deadlines past the previous record\'s, its span {gap:g} steps')

    def _pieces(self, frame: pb.TelemetryFrame, dim: int | None) -> None:
        share = list(frame.piece_share)
        if not frame.HasField('pieces'):
            if share:
                raise ContractViolation('piece_share without pieces')
            return
        space = self.contract.action_space if self.contract is not None else None
        if space is not None and space.is_absolute:
            raise ContractViolation(f'pieces in an {space.value} space: only delta and velocity ticks have parts')
        arr = codec.from_tensor(frame.pieces, what='pieces', dtype='float32', ndim=2, finite=True)
        touched = math.ceil(frame.step_end - _SLACK) - math.floor(frame.step_start + _SLACK)
        if (arr.shape[0] < 2 or arr.shape[0] != len(share) or arr.shape[0] > max(2, touched)
                or (dim is not None and arr.shape[1] != dim)):
            raise ContractViolation(f'pieces of shape {arr.shape} with {len(share)} shares; (P, {dim or "A"}) with '
                                    f'2 <= P <= {max(2, touched)} (the chunk steps the span touches) and one share '
                                    f'each is required')
        if not all(math.isfinite(x) and x > 0 for x in share) or abs(sum(share) - 1.0) > 1e-6:
            raise ContractViolation('piece_share must be positive and sum to 1')
        ref_t = frame.policy_action if frame.HasField('policy_action') else (
            frame.action if frame.HasField('action') else None)
        if ref_t is None:
            return
        ref = codec.from_tensor(ref_t, what='action', dtype='float32', ndim=1, finite=True).astype(np.float64)
        w = np.asarray(share, np.float64)[:, None]
        total = (w * arr).sum(0) if space is ActionSpace.JOINT_VELOCITY else arr.astype(np.float64).sum(0)
        rate = ~position_mask(space, arr.shape[1]) if space is not None else np.ones(arr.shape[1], bool)
        if ref.shape == total.shape and not np.allclose(total[rate], ref[rate], rtol=1e-3, atol=1e-5):
            raise ContractViolation('pieces do not make up the record\'s policy action (their sum differs)')


def _vector(tensor: pb.Tensor, what: str, dim: int | None) -> np.ndarray:
    arr = codec.from_tensor(tensor, what=what, dtype='float32', ndim=1, finite=True)
    if dim is not None and arr.shape[0] != dim:
        raise ContractViolation(f'{what}: {arr.shape[0]} values, the contract has {dim}')
    return arr


def _image_size(image: pb.Image, key: str) -> tuple[int, int]:
    """Return (width, height) after checking the header against the declaration (no pixel decode)."""
    if image.width <= 0 or image.height <= 0 or image.channels not in (1, 3):
        raise ContractViolation(f'image {key!r}: declared {image.width}x{image.height}x{image.channels}; '
                                f'width, height >= 1 and 1 or 3 channels required')
    if image.encoding == 'raw':
        expected = image.width * image.height * image.channels
        if len(image.data) != expected:
            raise ContractViolation(f'image {key!r}: raw payload of {len(image.data)} bytes, {expected} expected')
        return image.width, image.height
    if image.encoding not in ('jpeg', 'png'):
        raise ContractViolation(f'image {key!r}: unknown encoding {clip(image.encoding, 40)!r}')
    from PIL import Image as PILImage

    try:
        with PILImage.open(io.BytesIO(image.data)) as pil:   # reads the header only
            fmt, size, mode = (pil.format or '').lower(), pil.size, pil.mode
    except Exception as exc:  # Pillow raises several types for unreadable headers
        raise ContractViolation(f'image {key!r}: {image.encoding} header unreadable ({exc})') from None
    if fmt != image.encoding:
        raise ContractViolation(f'image {key!r}: declared {image.encoding}, the bytes are {fmt or "unknown"}')
    if size != (image.width, image.height):
        raise ContractViolation(f'image {key!r}: declared {image.width}x{image.height}, the {fmt} header says '
                                f'{size[0]}x{size[1]}')
    if fmt == 'png':
        _png_layout(image, key)
    channels = _MODE_CHANNELS.get(mode)
    if channels != image.channels:
        raise ContractViolation(f'image {key!r}: declared {image.channels} channels, the {fmt} holds {mode}')
    return image.width, image.height


#: PNG colour types (IHDR byte 25) that hold ``channels`` 8-bit samples per pixel: 0 grey, 2 RGB.
_PNG_COLOUR_TYPES = {1: 0, 3: 2}


def _png_layout(image: pb.Image, key: str) -> None:
    """Check the PNG's IHDR: 8-bit samples, greyscale for 1 channel or truecolour for 3 (no palette).

    Pillow's mode does not tell a 16-bit PNG from an 8-bit one (both open as 'RGB' or 'I;16'/'L'), and a
    palette PNG opens as 'P' (one index per pixel): neither is the declared uint8 H x W x C.
    """
    data = image.data
    if len(data) < 26 or data[12:16] != b'IHDR':
        raise ContractViolation(f'image {key!r}: png without an IHDR header')
    depth, colour = data[24], data[25]
    want = _PNG_COLOUR_TYPES.get(image.channels)
    if depth != 8 or colour != want:
        names = {0: 'greyscale', 2: 'RGB', 3: 'palette', 4: 'greyscale+alpha', 6: 'RGBA'}
        raise ContractViolation(f'image {key!r}: declared 8-bit x {image.channels} channels, the png holds '
                                f'{depth}-bit {names.get(colour, f"colour type {colour}")}')
