"""Encode camera frames into the mp4 files of a LeRobot v2.1 dataset, with PyAV.

Settings follow LeRobot's ``encode_video_frames`` (huggingface/lerobot ``lerobot/datasets/video_utils.py``,
v2.1 era): codec ``libsvtav1``, ``pix_fmt`` yuv420p, ``g=2`` (a keyframe every 2 frames, for fast random
access), ``crf=30``. ``h264`` is offered for speed: ``libx264`` with the same ``g`` and ``crf`` at the
``ultrafast`` preset. Which encoders exist depends on the FFmpeg PyAV was built with; PyAV 18's wheels
carry libsvtav1 (encode), libdav1d (AV1 decode) and libx264.

Each frame's pts is its frame_index in a 1/fps time base, so a decoder finds frame k at exactly
``k / fps`` s (the timestamp LeRobot's loader asks for).
"""

from __future__ import annotations

import dataclasses
import os
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np

from sequence_ai_ros.exceptions import ExportError, MissingDependency


@dataclasses.dataclass(frozen=True)
class VideoCodec:
    """An encoder and its options.

    :param name: LeRobot's ``video.codec`` value (``av1``, ``h264``).
    :param encoder: the FFmpeg encoder (``libsvtav1``, ``libx264``).
    :param options: encoder options (strings, FFmpeg's names).
    """

    name: str
    encoder: str
    options: dict[str, str]


VCODECS = {
    'av1': VideoCodec('av1', 'libsvtav1', {'g': '2', 'crf': '30'}),
    'h264': VideoCodec('h264', 'libx264', {'g': '2', 'crf': '30', 'preset': 'ultrafast'}),
}
PIX_FMT = 'yuv420p'


def import_av() -> Any:
    """Return the ``av`` module, or raise MissingDependency with the install hint."""
    try:
        import av
    except ImportError as exc:
        raise MissingDependency(f'writing videos needs PyAV ({exc}); install it with: pip install av') from None
    return av


def _thread_policies() -> dict[int, int]:
    """Return {thread id: scheduling policy} of this process's threads (Linux /proc; {} elsewhere)."""
    out: dict[int, int] = {}
    if not hasattr(os, 'sched_getscheduler'):
        return out
    try:
        tids = [int(name) for name in os.listdir('/proc/self/task')]
    except OSError:
        return out
    for tid in tids:
        try:
            out[tid] = os.sched_getscheduler(tid)
        except OSError:       # the thread ended meanwhile
            pass
    return out


def _undo_realtime(before: dict[int, int]) -> None:
    """Put back on SCHED_OTHER every thread that turned real-time since ``before`` (:func:`_thread_policies`).

    SVT-AV1 (3.x, through PyAV), when it may (root, CAP_SYS_NICE), puts the thread that opens the encoder and
    its own workers on SCHED_FIFO 99. Beside a robot's control thread (SCHED_FIFO 50) an export would then run
    above it, and every thread or process the exporting thread starts later would inherit FIFO 99.
    """
    realtime = (getattr(os, 'SCHED_FIFO', -1), getattr(os, 'SCHED_RR', -1))
    for tid, policy in _thread_policies().items():
        if policy in realtime and before.get(tid, 0) not in realtime:
            try:
                os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
            except OSError:
                pass


class VideoWriter:
    """Write RGB frames of one camera and episode to an mp4.

    :param path: the output file (its directory is created).
    :param width: frame width (px), even for yuv420p.
    :param height: frame height (px), even for yuv420p.
    :param fps: frames per second (a whole number, Hz).
    :param vcodec: a key of :data:`VCODECS`.
    :raises ExportError: for an unknown codec, an encoder missing from PyAV's FFmpeg, or odd sizes.
    """

    def __init__(self, path: Path, width: int, height: int, fps: int, vcodec: str = 'av1') -> None:
        av = import_av()
        if vcodec not in VCODECS:
            raise ExportError(f'unknown video codec {vcodec!r}; choose one of {sorted(VCODECS)}')
        if width % 2 or height % 2:
            raise ExportError(f'{path.name}: {width}x{height} frames cannot be encoded as {PIX_FMT} (odd size)')
        self.codec = VCODECS[vcodec]
        try:
            av.codec.Codec(self.codec.encoder, 'w')
        except Exception:  # av.codec.codec.UnknownCodecError
            raise ExportError(f'PyAV {av.__version__} has no {self.codec.encoder} encoder; '
                              f'use --vcodec {"h264" if vcodec == "av1" else "av1"}') from None
        os.environ.setdefault('SVT_LOG', '1')  # SVT-AV1 logs errors only (its banner goes to stderr otherwise)
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.size = (width, height)
        self.count = 0
        self._av = av
        self._container = av.open(str(path), 'w')
        self._stream = self._container.add_stream(self.codec.encoder, rate=int(fps),
                                                  options=dict(self.codec.options))
        self._stream.width, self._stream.height = width, height
        self._stream.pix_fmt = PIX_FMT
        self._stream.codec_context.time_base = Fraction(1, int(fps))

    def write(self, rgb: np.ndarray) -> None:
        """Append one uint8 (H, W, 3) RGB frame.

        :raises ExportError: when its size differs from the video's.
        """
        if rgb.shape[1::-1] != self.size or rgb.ndim != 3 or rgb.shape[2] != 3:
            raise ExportError(f'{self.path}: frame {self.count} is {rgb.shape}, the video is '
                              f'{self.size[1]}x{self.size[0]}x3')
        frame = self._av.VideoFrame.from_ndarray(np.ascontiguousarray(rgb), format='rgb24')
        frame.pts = self.count
        frame.time_base = self._stream.codec_context.time_base
        before = _thread_policies() if self.count == 0 else None    # the first frame opens the encoder
        for packet in self._stream.encode(frame):
            self._container.mux(packet)
        if before is not None:
            _undo_realtime(before)
        self.count += 1

    def close(self) -> None:
        """Flush the encoder and close the file."""
        for packet in self._stream.encode():
            self._container.mux(packet)
        self._container.close()

    def abort(self) -> None:
        """Close without flushing (the file is left for the caller to remove)."""
        try:
            self._container.close()
        except Exception:  # noqa: BLE001  (best effort on an error path)
            pass


def video_info(codec: str, width: int, height: int, fps: int) -> dict[str, Any]:
    """Return a video feature's ``info`` block, as LeRobot v2.1 writes it in meta/info.json."""
    return {'video.height': height, 'video.width': width, 'video.codec': codec, 'video.pix_fmt': PIX_FMT,
            'video.is_depth_map': False, 'video.fps': fps, 'video.channels': 3, 'has_audio': False}
