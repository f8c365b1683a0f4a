"""The observation adapter shared by the ROS node and the Python API: one policy contract, any robot.

- **Images** are fitted to the contract camera's size, per camera: ``resize`` (the default, in both the
  node and the Python API; Pillow bilinear) or ``pad`` (keep the aspect ratio: scale to fit, then pad with
  black, as openpi's ``resize_with_pad`` does, to the pixel: its truncated scaled size and its split of
  the padding, see :func:`pad_size`). A frame already at the contract's size, and JPEG bytes of
  that size, pass through untouched (no decode, no copy). A camera whose contract size is 0x0 accepts any.
- **State** is mapped by joint names when the observation names its values: the contract's names are
  picked out of the robot's (a subset, in any order). A name the contract needs and the robot lacks,
  or a name given twice, is a ContractViolation; values are never mapped by position when names exist.

The node calls :func:`fit_image` from its camera callbacks and :class:`NameIndex` from its joint mapper;
the Python API runs :meth:`ObservationAdapter.state` on the caller's thread (cheap) and
:meth:`ObservationAdapter.images` on the episode's sender thread (where images are encoded anyway).
"""

from __future__ import annotations

import collections
import dataclasses
import io
from collections.abc import Mapping, Sequence
from typing import overload

import numpy as np

from sequence_ai_ros.exceptions import ContractViolation
from sequence_ai_ros.protocol import codec
from sequence_ai_ros.protocol.contract import CameraSpec, Contract
from sequence_ai_ros.protocol.types import ImageLike, Observation

#: How a frame of another size is fitted to the contract's camera size.
FITS = ('resize', 'pad')
#: The default fit, the same in the node and the Python API.
DEFAULT_FIT = 'resize'


def check_fit(fit: str | Mapping[str, str] | None) -> dict[str, str] | str:
    """Return ``fit`` checked: one of :data:`FITS`, or a per-camera mapping of them (None: the default).

    :raises ValueError: for an unknown fit.
    """
    if fit is None:
        return DEFAULT_FIT
    values = fit.values() if isinstance(fit, Mapping) else [fit]
    for value in values:
        if value not in FITS:
            raise ValueError(f'image fit {value!r}; expected one of {FITS}')
    return dict(fit) if isinstance(fit, Mapping) else str(fit)


def _to_array(image: ImageLike) -> np.ndarray:
    if isinstance(image, (bytes, bytearray, memoryview)):
        from PIL import Image as PILImage

        try:
            with PILImage.open(io.BytesIO(bytes(image))) as pil:
                pil.load()
                return np.asarray(pil.convert('L' if pil.mode in ('L', '1') else 'RGB'))
        except Exception as exc:  # Pillow raises several types for corrupt data
            raise ContractViolation(f'encoded image cannot be decoded: {exc}') from None
    return np.asarray(image)


def _size(image: ImageLike) -> tuple[int, int]:
    """(width, height) of an array or of JPEG/PNG bytes (from the header)."""
    if isinstance(image, (bytes, bytearray, memoryview)):
        width, height, _, _ = codec.probe_encoded(bytes(image))
        return width, height
    arr = np.asarray(image)
    return int(arr.shape[1]), int(arr.shape[0])


@overload
def fit_image(image: np.ndarray, spec: CameraSpec | None, fit: str = DEFAULT_FIT) -> np.ndarray: ...


@overload
def fit_image(image: ImageLike, spec: CameraSpec | None, fit: str = DEFAULT_FIT) -> ImageLike: ...


def fit_image(image: ImageLike, spec: CameraSpec | None, fit: str = DEFAULT_FIT) -> ImageLike:
    """Return ``image`` at the contract camera's size.

    :param image: uint8 (H, W, 3) RGB or (H, W) mono, or JPEG/PNG bytes.
    :param spec: the contract's camera; None or a 0x0 size accepts any size (returned untouched).
    :param fit: ``resize`` (stretch to the size) or ``pad`` (keep the aspect ratio, pad with black).
    :returns: the same object when its size already matches, else uint8 (height, width[, 3]).
    :raises ContractViolation: for undecodable bytes, or an array that is not such a frame (another dtype,
        CHW, 4 channels, empty), naming the camera: never resized into a black or garbled one.
    :raises ValueError: for an unknown fit.
    """
    if fit not in FITS:
        raise ValueError(f'image fit {fit!r}; expected one of {FITS}')
    if spec is None or not (spec.width and spec.height):
        return image
    if not isinstance(image, (bytes, bytearray, memoryview)):
        codec.check_frame(spec.key, image)
    if _size(image) == (spec.width, spec.height):
        return image
    from PIL import Image as PILImage

    arr = _to_array(image)
    mono = arr.ndim == 2 or arr.shape[2] == 1
    pil = PILImage.fromarray(arr.reshape(arr.shape[0], arr.shape[1]) if mono else arr)
    bilinear = PILImage.BILINEAR  # type: ignore[attr-defined]  # set at run time; Humble's Pillow 9.0 lacks Resampling
    if fit == 'resize':
        return np.asarray(pil.resize((spec.width, spec.height), bilinear))
    w, h = pad_size(pil.width, pil.height, spec.width, spec.height)
    canvas = PILImage.new(pil.mode, (spec.width, spec.height))
    canvas.paste(pil.resize((w, h), bilinear), ((spec.width - w) // 2, (spec.height - h) // 2))
    return np.asarray(canvas)


def pad_size(cur_width: int, cur_height: int, width: int, height: int) -> tuple[int, int]:
    """The (width, height) a ``pad`` fit scales a frame to before padding, as openpi's ``resize_with_pad``.

    openpi truncates (``int(cur / ratio)`` with ``ratio = max(cur_width / width, cur_height / height)``),
    so 848x480 into 224x224 scales to 224x126 and pads 98 rows (49 above, 49 below); rounding would give
    127 rows and 97 of padding. The padding is ``divmod(size - scaled, 2)``: the odd row or column goes
    below or right. A side that would truncate to 0 (an extreme aspect ratio) keeps 1 pixel.

    :param cur_width: the frame's width (px).  :param cur_height: its height (px).
    :param width: the contract's width (px).  :param height: its height (px).
    """
    ratio = max(cur_width / width, cur_height / height)
    return max(1, int(cur_width / ratio)), max(1, int(cur_height / ratio))


class NameIndex:
    """Pick ``names`` out of a named vector, by name (cached per incoming name tuple).

    :param names: the wanted names, in the wanted order.
    :param what: the vector's name in messages (``state``, ``joint_states``).
    :param noun: what the names are, in messages (``joints``), or ''.
    """

    def __init__(self, names: Sequence[str], what: str = 'state', noun: str = '') -> None:
        self.names = tuple(names)
        self.what, self._noun = what, f'{noun} ' if noun else ''
        self._key: tuple[str, ...] | None = None
        self._index: np.ndarray | None = None

    def check_unique(self, given: tuple[str, ...]) -> None:
        """Check that ``given`` names every value once (the names only, not which of them are wanted).

        :raises ContractViolation: for no names, an empty name, or a name given twice.
        """
        what, noun = self.what, self._noun
        if not given or any(not n for n in given):
            raise ContractViolation(f'{what} has an empty name field; {noun or "values "}are mapped by name and '
                                    'are never mapped by position')
        if len(set(given)) != len(given):
            dups = sorted(n for n, count in collections.Counter(given).items() if count > 1)
            raise ContractViolation(f'{what} names {noun}{dups} more than once (names {list(given)}); a '
                                    'duplicated name has no unambiguous position')

    def index(self, given: Sequence[str]) -> np.ndarray:
        """Return intp (len(names),): where each wanted name sits in ``given``.

        :raises ContractViolation: for an empty name, a name given twice, or a wanted name missing.
        """
        key = tuple(given)
        if key != self._key:
            what, noun = self.what, self._noun
            self.check_unique(key)
            lookup = {n: i for i, n in enumerate(key)}
            missing = [n for n in self.names if n not in lookup]
            if missing:
                raise ContractViolation(f'{what} lacks {noun}{missing} (names {list(key)})')
            self._index, self._key = np.array([lookup[n] for n in self.names], dtype=np.intp), key
        assert self._index is not None
        return self._index


class ObservationAdapter:
    """Fit observations to one contract (see the module docstring).

    :param contract: the policy's contract.
    :param fit: ``resize`` or ``pad`` for every camera, or ``{camera key: fit}`` (others: the default).
    :raises ValueError: for an unknown fit.
    """

    def __init__(self, contract: Contract, fit: str | Mapping[str, str] | None = None) -> None:
        self.contract = contract
        checked = check_fit(fit)
        self.fits = {c.key: (checked.get(c.key, DEFAULT_FIT) if isinstance(checked, dict) else checked)
                     for c in contract.observation.cameras}
        names = contract.observation.state_names
        self._state = NameIndex(names) if names else None

    def state(self, obs: Observation) -> Observation:
        """Return ``obs`` with its state mapped to the contract's names (subset, reorder); same object if it fits.

        :raises ContractViolation: when a named state lacks a contract name or names one twice.
        """
        index = self._state
        if index is None or not obs.state_names or tuple(obs.state_names) == index.names:
            return obs
        picked = index.index(obs.state_names)
        return dataclasses.replace(obs, state=np.ascontiguousarray(obs.state[picked]), state_names=index.names)

    def images(self, obs: Observation) -> Observation:
        """Return ``obs`` with each contract camera's image fitted to its size (others untouched).

        :raises ContractViolation: for an undecodable image.
        """
        fitted = self.fit_frames(obs.images)
        return obs if fitted is obs.images else dataclasses.replace(obs, images=dict(fitted))

    def fit_frames(self, images: Mapping[str, ImageLike]) -> Mapping[str, ImageLike]:
        """Return ``images`` with each contract camera's frame fitted to its size (the same mapping when all fit).

        Requests and capture telemetry both go through it, so a captured frame is the frame the policy saw.

        :raises ContractViolation: for an undecodable image.
        """
        changed = {}
        for cam in self.contract.observation.cameras:
            image = images.get(cam.key)
            if image is not None:
                fitted = fit_image(image, cam, self.fits[cam.key])
                if fitted is not image:
                    changed[cam.key] = fitted
        if not changed:
            return images
        return {**images, **changed}


__all__ = ['DEFAULT_FIT', 'FITS', 'NameIndex', 'ObservationAdapter', 'check_fit', 'fit_image', 'pad_size']
