"""Camera messages -> observation images, without cv_bridge.

- ``sensor_msgs/Image`` with encodings rgb8, bgr8, rgba8, bgra8 (alpha dropped) and mono8 becomes uint8
  (H, W, 3) RGB or (H, W) mono. Row padding (``step`` > width * channels) is removed. Encoding names
  and layouts follow REP 104 / sensor_msgs ``image_encodings.hpp``.
- ``sensor_msgs/CompressedImage`` whose ``format`` names jpeg or png: a JPEG whose size matches the
  contract's camera (or whose contract camera accepts any size) and whose wire encoding is jpeg passes
  through as the original bytes: no decode and re-encode. Anything else is decoded with Pillow.
- When the contract gives a size and the frame differs, it is fitted by the adapter the Python API uses
  too (:func:`sequence_ai_ros.client.adapter.fit_image`): resized (the default) or padded to keep the
  aspect ratio, per camera.

Messages are duck-typed (only their fields are read), so this module does not import rclpy.
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np

from sequence_ai_ros.client.adapter import DEFAULT_FIT, fit_image
from sequence_ai_ros.exceptions import ContractViolation
from sequence_ai_ros.protocol import codec
from sequence_ai_ros.protocol.contract import CameraSpec

#: Raw encodings accepted: encoding -> (channels, channel order to RGB or None for mono).
RAW_ENCODINGS: dict[str, tuple[int, tuple[int, ...] | None]] = {
    'rgb8': (3, (0, 1, 2)),
    'bgr8': (3, (2, 1, 0)),
    'rgba8': (4, (0, 1, 2)),
    'bgra8': (4, (2, 1, 0)),
    'mono8': (1, None),
}


def image_to_array(msg: Any) -> np.ndarray:
    """Convert a ``sensor_msgs/Image`` into a uint8 array.

    :param msg: the message (``height``, ``width``, ``encoding``, ``step``, ``data``).
    :returns: uint8 (H, W, 3) RGB, or (H, W) for mono8. RGB input is a read-only view of the message
        data when rows carry no padding; other encodings are copied.
    :raises ContractViolation: for an unsupported encoding or a data size that disagrees with
        height, step and width.
    """
    enc = str(msg.encoding).lower()
    if enc not in RAW_ENCODINGS:
        raise ContractViolation(f'image encoding {msg.encoding!r} unsupported; use one of {sorted(RAW_ENCODINGS)}')
    channels, order = RAW_ENCODINGS[enc]
    height, width = int(msg.height), int(msg.width)
    row = width * channels
    step = int(msg.step) or row
    buf = np.frombuffer(memoryview(msg.data), dtype=np.uint8)
    if step < row or buf.size < step * height or height == 0 or width == 0:
        raise ContractViolation(f'image {width}x{height} {enc}: {buf.size} bytes with step {step} '
                                f'(at least {row * height} expected)')
    arr = buf[:step * height].reshape(height, step)[:, :row].reshape(height, width, channels)
    if order is None:
        return arr[:, :, 0]
    if order == (0, 1, 2) and channels == 3:
        return arr
    return np.ascontiguousarray(arr[:, :, list(order)])


def compressed_format(fmt: str) -> str:
    """Return ``jpeg`` or ``png`` for a CompressedImage ``format`` field.

    image_transport writes e.g. ``jpeg``, ``png`` or ``rgb8; jpeg compressed bgr8``.

    :raises ContractViolation: when the format names neither.
    """
    text = str(fmt).lower()
    if 'png' in text:
        return 'png'
    if 'jpeg' in text or 'jpg' in text:
        return 'jpeg'
    raise ContractViolation(f'compressed image format {fmt!r}: only jpeg and png are supported')


def _decode(data: bytes) -> np.ndarray:
    from PIL import Image as PILImage

    try:
        with PILImage.open(io.BytesIO(data)) as pil:
            pil.load()
            return np.asarray(pil.convert('L' if pil.mode in ('L', '1') else 'RGB'))
    except Exception as exc:  # Pillow raises several types for corrupt data
        raise ContractViolation(f'compressed image cannot be decoded: {exc}') from None


class ImageConverter:
    """Convert one camera's messages for its contract spec.

    :param spec: the contract's camera, or None before the contract is known (no resize; JPEG passes
        through).
    :param fit: ``resize`` or ``pad`` (:data:`~sequence_ai_ros.client.adapter.FITS`), same default as the
        Python API.
    """

    def __init__(self, spec: CameraSpec | None = None, fit: str = DEFAULT_FIT) -> None:
        self.spec = spec
        self.fit = fit
        #: frames passed through as original JPEG bytes, and frames decoded (for diagnostics and tests).
        self.passthrough = 0
        self.decoded = 0

    def _fit(self, arr: np.ndarray) -> np.ndarray:
        return fit_image(arr, self.spec, self.fit)

    def from_image(self, msg: Any) -> np.ndarray:
        """Convert a ``sensor_msgs/Image`` (see :func:`image_to_array`), resized to the contract's size.

        :raises ContractViolation: for an unsupported encoding or inconsistent size.
        """
        return self._fit(image_to_array(msg))

    def from_compressed(self, msg: Any) -> np.ndarray | bytes:
        """Convert a ``sensor_msgs/CompressedImage``.

        :returns: the original JPEG bytes when they can pass through, else uint8 (H, W, 3) or (H, W).
        :raises ContractViolation: for an unsupported format or undecodable data.
        """
        fmt = compressed_format(msg.format)
        data = bytes(msg.data)
        spec = self.spec
        if fmt == 'jpeg' and (spec is None or spec.encoding == 'jpeg'):
            width, height, _, probed = codec.probe_encoded(data)
            if probed == 'jpeg' and (spec is None or not (spec.width and spec.height)
                                     or (width, height) == (spec.width, spec.height)):
                self.passthrough += 1
                return data
        self.decoded += 1
        return self._fit(_decode(data))
