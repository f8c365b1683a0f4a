"""One observation adapter for the node and the Python API: images fitted per camera, state mapped by name.

The Python API used to refuse a 640x480 frame the node would resize, and a state in another joint order
the node would map by name. Both now go through :mod:`sequence_ai_ros.client.adapter`.
"""

from __future__ import annotations

import io
import textwrap
import types

import numpy as np
import pytest
from PIL import Image

from sequence_ai_ros.client import Observation, connect
from sequence_ai_ros.client.adapter import DEFAULT_FIT, NameIndex, ObservationAdapter, fit_image, pad_size
from sequence_ai_ros.exceptions import ContractViolation
from sequence_ai_ros.node.images import ImageConverter
from sequence_ai_ros.node.observation import JointMapper
from sequence_ai_ros.protocol.contract import CameraSpec, Contract, ObservationContract
from sequence_ai_ros.worker import serve_policy_file

SPEC = CameraSpec('cam', width=64, height=64)


def frame(width: int = 640, height: int = 480) -> np.ndarray:
    """A frame whose columns ramp 50..250 (a picture with content to see where it lands)."""
    ramp = np.linspace(50, 250, width).astype(np.uint8)
    return np.repeat(np.repeat(ramp[None, :, None], height, axis=0), 3, axis=2)


def test_resize_stretches_and_pad_keeps_the_aspect_ratio_with_black_bars():
    resized = fit_image(frame(), SPEC, 'resize')
    assert resized.shape == (64, 64, 3) and resized.min() >= 45            # no bars: stretched
    padded = fit_image(frame(), SPEC, 'pad')
    assert padded.shape == (64, 64, 3)
    assert np.all(padded[:8] == 0) and np.all(padded[-8:] == 0)          # 640x480 -> 64x48, 8 rows each side
    assert padded[8:56].min() >= 45                                       # the picture, whole
    same = frame(64, 64)
    assert fit_image(same, SPEC) is same                                  # the right size passes through
    jpeg = io.BytesIO()
    Image.fromarray(same).save(jpeg, format='JPEG')
    assert fit_image(jpeg.getvalue(), SPEC) is not None and fit_image(jpeg.getvalue(), SPEC) == jpeg.getvalue()
    assert fit_image(frame(), CameraSpec('any')) .shape == (480, 640, 3)  # 0x0 accepts any size
    with pytest.raises(ValueError, match='fit'):
        fit_image(frame(), SPEC, 'crop')


def openpi_resize_with_pad(image: np.ndarray, height: int, width: int) -> np.ndarray:
    """openpi_client.image_tools.resize_with_pad for one uint8 (H, W, 3) frame, written out from its formula."""
    pil = Image.fromarray(image)
    cur_width, cur_height = pil.size
    if (cur_width, cur_height) == (width, height):
        return image
    ratio = max(cur_width / width, cur_height / height)
    resized_height = int(cur_height / ratio)
    resized_width = int(cur_width / ratio)
    pad_h0, remainder_h = divmod(height - resized_height, 2)
    pad_w0, remainder_w = divmod(width - resized_width, 2)
    out = np.zeros((height, width, 3), np.uint8)
    out[pad_h0:height - (pad_h0 + remainder_h), pad_w0:width - (pad_w0 + remainder_w)] = np.asarray(
        pil.resize((resized_width, resized_height), Image.BILINEAR))
    return out


def lit(image: np.ndarray) -> tuple[int, int, int, int]:
    """(rows above, rows below, columns left, columns right) of black padding around a picture with no black."""
    rows = np.flatnonzero(image.max(axis=(1, 2)))
    cols = np.flatnonzero(image.max(axis=(0, 2)))
    return int(rows[0]), image.shape[0] - 1 - int(rows[-1]), int(cols[0]), image.shape[1] - 1 - int(cols[-1])


@pytest.mark.parametrize('size, target', [
    ((848, 480), (224, 224)),      # openpi: 224x126, 98 rows of padding (rounding gave 127 and 97)
    ((480, 848), (224, 224)),      # the same, standing: 98 columns
    ((640, 480), (224, 224)),
    ((1280, 720), (224, 224)),
    ((300, 200), (224, 224)),      # 224x149: an odd 75 rows, 37 above and 38 below
    ((224, 225), (224, 224)),      # 225 / (225 / 224) truncates to 223 in floats: one black row and column
    ((1920, 1080), (320, 240)),
    ((100, 60), (224, 224)),       # upscaled
])
def test_pad_fits_as_openpis_resize_with_pad(size, target):
    width, height = target
    image = frame(*size)
    padded = fit_image(image, CameraSpec('cam', width=width, height=height), 'pad')
    np.testing.assert_array_equal(padded, openpi_resize_with_pad(image, height, width))
    ratio = max(size[0] / width, size[1] / height)
    scaled = int(size[0] / ratio), int(size[1] / ratio)
    assert pad_size(*size, width, height) == scaled
    (above, extra_h), (left, extra_w) = divmod(height - scaled[1], 2), divmod(width - scaled[0], 2)
    assert lit(padded) == (above, above + extra_h, left, left + extra_w)
    if size == (848, 480):
        assert scaled == (224, 126) and lit(padded) == (49, 49, 0, 0)     # 98 rows of letterbox


def test_state_is_mapped_by_name_subset_and_reorder():
    contract = Contract(action_space='joint_absolute', action_names=('a', 'b'), dt=0.1, chunk_length=2,
                        observation=ObservationContract(state_names=('a', 'b')))
    adapter = ObservationAdapter(contract)
    obs = Observation(state=np.array([3.0, 2.0, 1.0], np.float32), state_names=('c', 'b', 'a'))
    mapped = adapter.state(obs)
    assert mapped.state.tolist() == [1.0, 2.0] and mapped.state_names == ('a', 'b')
    with pytest.raises(ContractViolation, match=r"lacks \['a'\]"):
        adapter.state(Observation(state=np.zeros(2, np.float32), state_names=('b', 'c')))
    with pytest.raises(ContractViolation, match='more than once'):
        adapter.state(Observation(state=np.zeros(3, np.float32), state_names=('a', 'b', 'a')))
    unnamed = Observation(state=np.zeros(2, np.float32))
    assert adapter.state(unnamed) is unnamed                              # nothing to map by: positional D


def test_the_node_and_the_python_api_fit_the_same_way_by_default():
    arr = frame()
    msg = types.SimpleNamespace(height=480, width=640, encoding='rgb8', step=640 * 3, data=arr.tobytes())
    node = ImageConverter(SPEC).from_image(msg)
    assert ImageConverter().fit == DEFAULT_FIT == 'resize'
    np.testing.assert_array_equal(node, fit_image(arr, SPEC))
    padded = ImageConverter(SPEC, fit='pad').from_image(msg)
    np.testing.assert_array_equal(padded, fit_image(arr, SPEC, 'pad'))
    joints = types.SimpleNamespace(name=['c', 'b', 'a'], position=[3.0, 2.0, 1.0])
    contract = Contract(action_space='joint_absolute', action_names=('a', 'b'), dt=0.1, chunk_length=2,
                        observation=ObservationContract(state_names=('a', 'b')))
    api = ObservationAdapter(contract).state(Observation(state=np.array([3.0, 2.0, 1.0], np.float32),
                                                         state_names=('c', 'b', 'a')))
    assert JointMapper(('a', 'b')).map(joints).tolist() == api.state.tolist() == [1.0, 2.0]
    assert NameIndex(('a', 'b')).index(('c', 'b', 'a')).tolist() == [2, 1]


POLICY = textwrap.dedent('''
    import numpy as np
    import sequence_ai_ros.policy as seq

    @seq.policy(action_space='joint_absolute', action_names=['a', 'b', 'h', 'w', 'top'], dt=0.05, chunk_length=4,
                observation=seq.ObservationContract(cameras=[seq.CameraSpec('cam', 64, 64, 'png')],
                                                    state_names=['a', 'b']))
    class Echo:
        """Answers rows [a, b, image height, width, mean of the top row] of what it received."""

        def infer(self, inp, episode):
            img = inp.observation.images['cam']
            s = inp.observation.state
            row = [s[0], s[1], img.shape[0], img.shape[1], img[0].mean()]
            return np.tile(np.asarray(row, np.float32), (4, 1))
''')


@pytest.mark.parametrize('fit', ['resize', 'pad'])
def test_the_python_api_accepts_what_the_node_would(tmp_path, fit):
    path = tmp_path / 'echo.py'
    path.write_text(POLICY)
    server = serve_policy_file(path, 'echo')
    try:
        with connect('echo', endpoint=f'127.0.0.1:{server.port}', image_fit={'cam': fit}) as policy:
            policy.wait_until_ready(timeout=30)
            seen = []

            def observe() -> Observation:                 # a 640x480 camera, joints in the robot's own order
                return Observation(state=np.array([9.0, 2.0, 1.0], np.float32), state_names=('c', 'b', 'a'),
                                   images={'cam': frame()})

            out = policy.run(observe, lambda action: seen.append(action.values), max_actions=4)
        assert out.reason == 'completed' and seen
        a, b, h, w, top = seen[0]
        assert (a, b, h, w) == (1.0, 2.0, 64.0, 64.0)
        assert (top == 0.0) == (fit == 'pad')             # padding leaves the top row black
    finally:
        server.stop(grace=0.5)
    with pytest.raises(ValueError, match='fit'):
        connect('echo', endpoint='127.0.0.1:1', image_fit='stretch')
