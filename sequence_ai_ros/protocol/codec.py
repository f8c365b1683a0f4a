"""Arrays and images on the wire: numpy <-> ``Tensor``/``Image`` messages, with no pickle.

A ``Tensor`` carries shape, a numpy dtype string and raw little-endian C-order bytes, as openpi's
msgpack_numpy does for the same reason: the schema lives in the message, and decoding runs no code.
Images are JPEG/PNG (Pillow) or raw uint8 (H, W, C).
"""

from __future__ import annotations

import io
import math

import numpy as np
import numpy.typing as npt

from sequence_ai_ros.exceptions import ContractViolation
from sequence_ai_ros.protocol import sequence_ai_pb2 as pb

#: dtypes accepted on the wire; anything else is a contract violation.
ALLOWED_DTYPES = frozenset({'float32', 'float64', 'uint8', 'int32', 'int64', 'bool'})
ENCODINGS = ('jpeg', 'png', 'raw')
#: Per allowed dtype name: (the native dtype, its little-endian wire dtype), built once (a name lookup
#: per tensor, not a dtype parse and byte-order swap).
_DTYPES = {name: (np.dtype(name), np.dtype(name).newbyteorder('<')) for name in ALLOWED_DTYPES}
#: Per native dtype: (its name, its wire dtype), for packing.
_BY_DTYPE = {native: (name, wire) for name, (native, wire) in _DTYPES.items()}
#: Channels of Pillow modes whose band count is not their colour count (a palette holds RGB colours).
_CHANNELS_OF_MODE = {'P': 3, '1': 1, 'I;16': 1, 'I': 1, 'F': 1}


#: numpy dtype kinds of real numbers (signed and unsigned integers, floats): what a numeric field takes.
NUMBER_KINDS = frozenset('iuf')
_KIND_NAMES = {'b': 'bool', 'c': 'complex', 'U': 'string', 'S': 'bytes', 'O': 'object', 'V': 'void',
               'M': 'datetime', 'm': 'timedelta'}


class ValueKindViolation(ContractViolation):
    """Values that are not real numbers (complex, string, bool, object...) where numbers are required.

    ``field`` names the values (``state``, ``actions``, a robot's observation key); ``kind`` says what they were.
    A complex value is never cut to its real part, a bool never becomes 0/1 and a string never a number.
    """

    def __init__(self, field: str, kind: str, message: str = '') -> None:
        self.field = field
        self.kind = kind
        super().__init__(message or f'{_clip(field, 60)}: {kind} values are refused; real numbers (int or float) '
                                    'are required')


def kind_name(dtype: np.dtype) -> str:
    """A dtype's kind in words: ``complex128`` -> 'complex', ``<U3`` -> 'string', ``bool`` -> 'bool'."""
    return _KIND_NAMES.get(dtype.kind, str(dtype))


def numbers(value: npt.ArrayLike, field: str, dtype: str | None = 'float32') -> np.ndarray:
    """Return ``value`` as an array of ``dtype`` (None: as it is) once its values are real numbers.

    Python and numpy ints and floats, of any size, pass; float64 beyond float32 becomes inf (a finite check
    after this refuses it).

    :param field: the values' name, for the error.
    :raises ValueKindViolation: naming ``field``, for complex, string, bytes, bool, object or other non-number
        values (a bool array, ``[1+2j]``, ``['1.5']``, ``[1, None]``), or a value numpy cannot make an array of.
    """
    if isinstance(value, np.ndarray):
        arr = value
    else:
        try:
            arr = np.asarray(value)
        except Exception:  # a ragged list, an object whose __array__ raises
            raise ValueKindViolation(field, f'{type(value).__name__} (not an array)') from None
    if arr.dtype.kind not in NUMBER_KINDS:
        raise ValueKindViolation(field, kind_name(arr.dtype))
    if dtype is None or arr.dtype == dtype:     # astype(copy=False) would return it as it is
        return arr
    with np.errstate(over='ignore', invalid='ignore'):
        return arr.astype(dtype, copy=False)


def _clip(text: object, limit: int = 100) -> str:
    """Return ``str(text)`` cut to ``limit`` characters, for echoing untrusted input in an error."""
    text = str(text)
    return text if len(text) <= limit else f'{text[:limit]}...(+{len(text) - limit} chars)'


def to_tensor(array: npt.ArrayLike, dtype: str | None = None, out: pb.Tensor | None = None, *,
              what: str = 'tensor') -> pb.Tensor:
    """Pack an array into a ``Tensor``.

    :param array: any array-like; converted to ``dtype`` when given.
    :param dtype: numpy dtype name, e.g. ``'float32'``: a numeric dtype takes real numbers only (never a
        complex, string, bool or object array cut or cast to it).
    :param out: fill this message in place (a field of the message being built: no copy of the data
        into a second message); default a new one.
    :param what: the values' name, for errors (``'state'``).
    :raises ValueKindViolation: naming ``what``, for complex, string or object values, or bool values
        converted to a numeric ``dtype``.
    :raises ContractViolation: for another dtype outside :data:`ALLOWED_DTYPES`.
    """
    if dtype is not None and dtype != 'bool':
        arr = numbers(array, what, dtype)
    else:
        arr = np.asarray(array, dtype=dtype)
    entry = _BY_DTYPE.get(arr.dtype)
    if entry is None:                                   # a non-native byte order, or not allowed
        name = arr.dtype.name
        if name not in _DTYPES:
            if arr.dtype.kind in _KIND_NAMES:
                raise ValueKindViolation(what, kind_name(arr.dtype), f'{_clip(what, 60)}: {kind_name(arr.dtype)} '
                                         f'values (dtype {name}) cannot go on the wire; use one of '
                                         f'{sorted(ALLOWED_DTYPES)}')
            raise ContractViolation(f'dtype {name} cannot go on the wire; use one of {sorted(ALLOWED_DTYPES)}')
        entry = name, _DTYPES[name][1]
    name, wire = entry
    arr = np.ascontiguousarray(arr, dtype=wire)
    if out is None:
        return pb.Tensor(shape=arr.shape, dtype=name, data=arr.tobytes())
    out.shape[:] = arr.shape
    out.dtype, out.data = name, arr.tobytes()
    return out


def from_tensor(tensor: pb.Tensor, *, what: str = 'tensor', dtype: str | None = None,
                ndim: int | None = None, finite: bool = False) -> np.ndarray:
    """Unpack a ``Tensor`` into a read-only numpy array, validating it.

    :param what: a name for error messages (e.g. ``'state'``).
    :param dtype: the required dtype name, if any.
    :param ndim: the required number of dimensions, if any.
    :param finite: require every value to be finite (no NaN or inf).
    :raises ContractViolation: for an unknown dtype, a byte count that does not match the shape,
        a wrong dtype or rank, or non-finite values when ``finite``.
    """
    name = tensor.dtype                                 # each read of a string field builds a new str
    if name not in _DTYPES:
        raise ContractViolation(f'{what}: dtype {_clip(name)!r} is not allowed')
    if dtype is not None and name != dtype:
        raise ContractViolation(f'{what}: dtype {name} but {dtype} is required')
    shape = tuple(tensor.shape)
    if ndim is not None and len(shape) != ndim:
        raise ContractViolation(f'{what}: shape {_clip(shape)} has {len(shape)} dims, {ndim} required')
    if shape and min(shape) < 0:
        raise ContractViolation(f'{what}: negative dimension in shape {_clip(shape)}')
    native, wire = _DTYPES[name]
    expected = math.prod(shape) * wire.itemsize        # Python ints: a shape whose size overflows int64 is refused
    data = tensor.data                                  # read once: each read of a bytes field copies it
    if len(data) != expected:
        raise ContractViolation(f'{what}: {len(data)} bytes for shape {shape} {name} ({expected} expected)')
    arr = np.frombuffer(data, dtype=wire).reshape(shape)
    if wire != native:                                  # big-endian hosts only
        arr = arr.astype(native)
    if finite and native.kind == 'f' and not np.isfinite(arr).all():
        raise ContractViolation(f'{what}: non-finite values (NaN or inf)')
    return arr


def encode_image(key: str, image: np.ndarray | bytes, encoding: str = 'jpeg',
                 quality: int = 90, out: pb.Image | None = None) -> pb.Image:
    """Pack a camera frame into an ``Image``.

    :param image: uint8 (H, W, 3) RGB or (H, W) mono array, or already-encoded JPEG/PNG bytes
        (passed through untouched; width and height are read from the header).
    :param encoding: ``jpeg``, ``png`` or ``raw`` for arrays; ignored for bytes.
    :param quality: JPEG quality (1-95, Pillow's scale).
    :param out: fill this message in place (e.g. ``request.images.add()``); default a new one.
    :raises ContractViolation: for a non-uint8 array, a bad shape, unknown encoding or unreadable bytes.
    """
    enc, width, height, channels, data = image_payload(key, image, encoding, quality)
    return _image(out, key, enc, width, height, channels, bytes(data))


def check_frame(key: str, image: object) -> np.ndarray:
    """Return the camera frame ``image`` as an array once it is one the wire can carry.

    :param key: the camera's key (for the message).
    :param image: uint8 (H, W, 3) RGB or (H, W) / (H, W, 1) mono, H and W >= 1.
    :raises ContractViolation: naming the camera, for anything else (another dtype, a CHW or 4-channel
        frame, an empty one, None or a non-array such as a CUDA tensor).
    """
    try:
        arr = np.asarray(image)
    except Exception as exc:  # e.g. torch's TypeError for a CUDA tensor, or any __array__ that raises
        raise ContractViolation(f'image {key!r}: {type(image).__name__} is not an array: {exc}') from None
    if arr.dtype != np.uint8:
        raise ContractViolation(f'image {key!r}: dtype {arr.dtype}, uint8 required')
    if arr.ndim not in (2, 3) or (arr.ndim == 3 and arr.shape[2] not in (1, 3)):
        raise ContractViolation(f'image {key!r}: shape {arr.shape}, (H, W, 3) or (H, W) required')
    if arr.shape[0] == 0 or arr.shape[1] == 0:
        raise ContractViolation(f'image {key!r}: shape {arr.shape} is empty; width and height must be >= 1')
    return arr


def image_payload(key: str, image: np.ndarray | bytes, encoding: str = 'jpeg',
                  quality: int = 90) -> tuple[str, int, int, int, bytes | memoryview]:
    """Encode a camera frame: ``(encoding, width, height, channels, data)``, as :func:`encode_image` packs it.

    ``data`` of a raw frame is a read-only view of the array's C-order bytes (no copy when the array is
    C-contiguous): use it before the array changes. Arguments and errors as :func:`encode_image`.
    """
    if isinstance(image, (bytes, bytearray, memoryview)):
        data = bytes(image)
        width, height, channels, enc = probe_encoded(data)
        return enc, width, height, channels, data
    arr = check_frame(key, image)
    if arr.ndim == 2:
        arr = arr[:, :, None]
    height, width, channels = arr.shape
    if encoding == 'raw':
        view = np.ascontiguousarray(arr).data.cast('B')
        return encoding, width, height, channels, view.toreadonly()
    if encoding in ('jpeg', 'png'):
        from PIL import Image as PILImage

        pil = PILImage.fromarray(arr[:, :, 0] if channels == 1 else arr)
        buf = io.BytesIO()
        if encoding == 'jpeg':
            pil.save(buf, format='JPEG', quality=quality)
        else:
            pil.save(buf, format='PNG', compress_level=1)
        return encoding, width, height, channels, buf.getvalue()
    raise ContractViolation(f'image {key!r}: unknown encoding {encoding!r}; expected {ENCODINGS}')


def _image(out: pb.Image | None, key: str, encoding: str, width: int, height: int, channels: int,
           data: bytes) -> pb.Image:
    if out is None:
        return pb.Image(key=key, encoding=encoding, width=width, height=height, channels=channels, data=data)
    out.key, out.encoding, out.width, out.height, out.channels, out.data = key, encoding, width, height, channels, data
    return out


#: JPEG start-of-frame markers: baseline, extended, progressive and lossless, Huffman or arithmetic coded.
_JPEG_SOF = frozenset((0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF))


def _jpeg_header(data: bytes) -> tuple[int, int, int] | None:
    """(width, height, channels) of a JPEG from its frame header, or None: Pillow reads it (:func:`probe_encoded`).

    The segments are walked from SOI to the start of scan, each length checked against the data, as Pillow's
    lazy open walks them: a frame header with 1 (L) or 3 (RGB) components and a non-zero size, the only one
    before the scan, gives the answer; anything else (truncated, no scan, CMYK, a second frame header, a height
    left to a DNL marker) goes to Pillow, which reads it or names why not. About 20x cheaper than a Pillow open
    for a camera frame (the client probes every encoded frame it sends); nothing of the pixels is read here or
    there: the worker's decode checks the pixels against these numbers.
    """
    if data[:3] != b'\xff\xd8\xff':
        return None
    size = len(data)
    at, frame = 2, None
    while at + 4 <= size:
        if data[at] != 0xFF:
            return None
        marker = data[at + 1]
        if marker == 0xFF:                  # a fill byte before a marker
            at += 1
            continue
        if marker == 0x01 or 0xD0 <= marker <= 0xD9:   # no length: not expected before the scan
            return None
        length = data[at + 2] << 8 | data[at + 3]
        if length < 2 or at + 2 + length > size:
            return None
        if marker == 0xDA:                  # start of scan (its header whole): the header is over
            return frame
        if marker in _JPEG_SOF:
            # Pillow refuses a precision other than 8 bits and a component list cut inside an entry
            if frame is not None or length < 8 or data[at + 4] != 8 or (length - 8) % 3:
                return None
            height, width, components = data[at + 5] << 8 | data[at + 6], data[at + 7] << 8 | data[at + 8], data[at + 9]
            if components not in (1, 3) or not width or not height or width * height > _PILLOW_WARN_PIXELS:
                return None                 # (past Pillow's decompression-bomb warning: Pillow decides)
            frame = (width, height, components)
        elif marker == 0xDB and not _whole_tables(data, at + 4, at + 2 + length):
            return None
        elif marker in (0xE0, 0xEE) and length < 9 and (data[at + 4:at + 8] == b'JFIF'
                                                         or data[at + 4:at + 9] == b'Adobe'):
            return None                     # Pillow reads a version from both and refuses them short
        at += 2 + length
    return None


#: Pixels past which Pillow warns of a decompression bomb (its default ``Image.MAX_IMAGE_PIXELS``; twice as many
#: it refuses): a frame header claiming more goes to Pillow, which answers as it did before the header reader.
_PILLOW_WARN_PIXELS = 1024 * 1024 * 1024 // 4 // 3


def _whole_tables(data: bytes, at: int, end: int) -> bool:
    """Whether a DQT segment's payload ``data[at:end]`` holds whole quantization tables (Pillow refuses a cut one)."""
    while at < end:
        at += 1 + (64 if data[at] < 16 else 128)
    return at == end


def probe_encoded(data: bytes) -> tuple[int, int, int, str]:
    """Return (width, height, channels, encoding) of JPEG/PNG bytes without decoding pixels.

    A JPEG's frame header is read directly (:func:`_jpeg_header`); any other file, or a JPEG it does not read,
    is opened by Pillow (lazily: the header only).

    :raises ContractViolation: when the bytes are not a readable JPEG or PNG.
    """
    head = _jpeg_header(data)
    if head is not None:
        return head[0], head[1], head[2], 'jpeg'
    from PIL import Image as PILImage

    try:
        with PILImage.open(io.BytesIO(data)) as pil:
            fmt = (pil.format or '').lower()
            channels = _CHANNELS_OF_MODE.get(pil.mode, len(pil.getbands()))
            size = pil.size
    except Exception as exc:  # Pillow raises several types for bad headers
        raise ContractViolation(f'encoded image unreadable: {exc}') from None
    if fmt not in ('jpeg', 'png'):
        raise ContractViolation(f'encoded image format {fmt!r}; jpeg or png required')
    return size[0], size[1], channels, fmt


def decode_image(image: pb.Image, *, max_pixels: int | None = None) -> np.ndarray:
    """Unpack an ``Image`` into uint8 (H, W, C), validating what the header claims.

    :param max_pixels: refuse images larger than this (width * height) before decoding.
    :raises ContractViolation: for an unknown encoding, a zero width or height, channels other than 1 or 3,
        a size over ``max_pixels``, a truncated or corrupt payload, or pixels that disagree with the
        declared width/height/channels (an encoded grayscale image declared with 3 channels, RGBA, ...).
        The size and channels of JPEG/PNG are checked from the header (Pillow's lazy open) before any
        pixel is decoded, so a small file that decodes huge costs only its header.
    """
    what = f'image {_clip(image.key)!r}'
    if image.encoding not in ENCODINGS:
        raise ContractViolation(f'{what}: unknown encoding {_clip(image.encoding)!r}')
    if image.width <= 0 or image.height <= 0:
        raise ContractViolation(f'{what}: size {image.width}x{image.height}; width and height must be >= 1')
    if image.channels not in (1, 3):
        raise ContractViolation(f'{what}: {image.channels} channels declared; 1 (mono) or 3 (RGB) required')
    if max_pixels is not None and image.width * image.height > max_pixels:
        raise ContractViolation(f'{what}: {image.width}x{image.height} exceeds {max_pixels} pixels')
    if image.encoding == 'raw':
        expected = image.width * image.height * image.channels
        data = image.data                               # read once: each read of a bytes field copies it
        if len(data) != expected:
            raise ContractViolation(f'{what}: raw payload of {len(data)} bytes, expected {expected} '
                                    f'for {image.width}x{image.height}x{image.channels}')
        return np.frombuffer(data, np.uint8).reshape(image.height, image.width, image.channels)
    from PIL import Image as PILImage

    try:
        with PILImage.open(io.BytesIO(image.data)) as pil:     # lazy: reads the header, decodes nothing
            if max_pixels is not None and pil.size[0] * pil.size[1] > max_pixels:
                raise ContractViolation(f'{what}: {pil.size} exceeds {max_pixels} pixels')
            if pil.size != (image.width, image.height):
                raise ContractViolation(f'{what}: the {image.encoding} header says {pil.size[0]}x{pil.size[1]} but '
                                        f'{image.width}x{image.height} is declared (refused before decoding)')
            bands = _CHANNELS_OF_MODE.get(pil.mode, len(pil.getbands()))
            if bands != image.channels:
                raise ContractViolation(f'{what}: the {image.encoding} holds {bands} channels ({pil.mode}) but '
                                        f'{image.channels} are declared')
            pil.load()
            mode = 'L' if image.channels == 1 else 'RGB'
            arr = np.asarray(pil if pil.mode == mode else pil.convert(mode))   # convert() to its own mode copies
    except ContractViolation:
        raise
    except PILImage.UnidentifiedImageError:    # its message names the buffer object (an address, new each request)
        raise ContractViolation(f'{what}: cannot decode {image.encoding}: not an image Pillow can identify') from None
    except Exception as exc:  # truncated or corrupt data: Pillow raises OSError and friends
        raise ContractViolation(f'{what}: cannot decode {image.encoding}: {exc}') from None
    if arr.ndim == 2:
        arr = arr[:, :, None]
    if (image.width and arr.shape[1] != image.width) or (image.height and arr.shape[0] != image.height):
        raise ContractViolation(f'{what}: decoded {arr.shape[1]}x{arr.shape[0]} but header says '
                                f'{image.width}x{image.height}')
    return arr
