"""Rows that are what happened, frames checked before they are kept, stats as LeRobot computes them.

Real capture stores (real files, SQLite, record files), real parquet and video exports; the ticks are
built here with known trajectories so every row can be checked exactly.
"""

from __future__ import annotations

import importlib.util
import io
import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from PIL import Image
from test_data_support import FakeClock, make_store

from sequence_ai_ros.capture.store import CaptureStore
from sequence_ai_ros.cli import main as seq_main
from sequence_ai_ros.client.resample import pieces, position_mask, sample
from sequence_ai_ros.datasets import stats as lerobot_stats
from sequence_ai_ros.datasets.lerobot_writer import export_lerobot
from sequence_ai_ros.datasets.rows import build_rows
from sequence_ai_ros.exceptions import ExportError
from sequence_ai_ros.protocol import codec
from sequence_ai_ros.protocol import sequence_ai_pb2 as pb
from sequence_ai_ros.protocol.contract import CameraSpec, Contract, ObservationContract
from sequence_ai_ros.protocol.spaces import ActionSpace

FIXTURES = Path(__file__).parent / 'fixtures'
NAMES = ('j0', 'j1', 'j2')


def _contract(space: str = 'joint_absolute', dt: float = 1 / 30, camera: bool = False) -> Contract:
    cams = (CameraSpec('cam', 32, 24, 'jpeg'),) if camera else ()
    return Contract(space, NAMES, dt, 10, ObservationContract(cams, NAMES), deployment='arm')


def _jpeg(value: int, size: tuple[int, int] = (32, 24), fmt: str = 'JPEG') -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.full((size[1], size[0], 3), value, np.uint8)).save(buf, format=fmt)
    return buf.getvalue()


def _png(width: int, height: int, depth: int, colour: int) -> bytes:
    """A valid PNG of zeros with the given IHDR bit depth and colour type (Pillow cannot write 16-bit RGB)."""
    import struct
    import zlib

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack('>I', len(body)) + kind + body + struct.pack('>I', zlib.crc32(kind + body))

    samples = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}[colour]
    raw = b''.join(b'\0' + bytes(width * samples * depth // 8) for _ in range(height))
    return (b'\x89PNG\r\n\x1a\n' + chunk(b'IHDR', struct.pack('>IIBBBBB', width, height, depth, colour, 0, 0, 0))
            + chunk(b'IDAT', zlib.compress(raw)) + chunk(b'IEND', b''))


def _frame(t: float, state, action=None, hold: bool = False, clamped: bool = False, policy=None,
           image: pb.Image | None = None, span: tuple[int, float, float] | None = None) -> pb.TelemetryFrame:
    """One telemetry record.

    ``span`` = (grid_index, step_start, step_end) as the client sends it (None: a record of a store written
    before spans existed).
    """
    f = pb.TelemetryFrame(robot_time_s=t, state=codec.to_tensor(np.asarray(state, np.float32)), hold=hold,
                          clamped=clamped)
    if span is not None:
        f.grid_index, f.step_start, f.step_end = span
    if action is not None:
        f.action.CopyFrom(codec.to_tensor(np.asarray(action, np.float32)))
    if policy is not None:
        f.policy_action.CopyFrom(codec.to_tensor(np.asarray(policy, np.float32)))
    if image is not None:
        f.images.append(image)
    return f


def _episode(store: CaptureStore, eid: str, contract: Contract, frames: list[pb.TelemetryFrame]):
    ep = store.begin(eid, 'reach', contract)
    refused = ep.add_telemetry(frames)
    ep.commit('completed', {'actions': len(frames)})
    return refused, next(e for e in store.episodes() if e.episode_id == eid)


def q(t: float) -> np.ndarray:
    return np.array([np.sin(t), np.cos(2 * t), 0.1 * t], np.float32)


def test_a_span_estimated_past_the_next_tick_ends_there(tmp_path: Path) -> None:
    """On the clock without a fixed period a record spans the measured period, an estimate (here 1.4 steps).

    The next tick, a hold, came one step on: its row is held, the overlap of the estimate does not make it an
    executed row repeating the command (a loaded run: an extra executed row after an underrun past a stall).
    """
    store = make_store(tmp_path / 'arm')
    a = [np.full(3, v, np.float32) for v in (0.1, 0.2, 0.3, 0.4)]
    frames = [_frame(0 / 30, a[0], a[0], span=(0, 0.0, 1.0)),
              _frame(1 / 30, a[1], a[1], span=(1, 1.0, 2.4)),        # the period estimate, still high
              _frame(2 / 30, a[1], a[1], hold=True, span=(2, 2.0, 3.0)),
              _frame(3 / 30, a[3], a[3], span=(3, 3.0, 4.0))]
    _, ep = _episode(store, 'overlap', _contract(), frames)
    rows = build_rows(ep, 30, ActionSpace.JOINT_ABSOLUTE, 3, 3, [])
    assert rows.held.tolist() == [False, False, True, False]
    np.testing.assert_array_equal(rows.action, np.array([a[0], a[1], a[1], a[3]]))


def test_50hz_node_ticks_map_to_30hz_rows_as_documented(tmp_path: Path) -> None:
    """A 50 Hz node replays q(t); row k (t_k = k/30) holds the command in effect at t_k."""
    store = make_store(tmp_path / 'arm')
    ticks = [i * 0.02 for i in range(101)]   # 2 s at 50 Hz, from robot time 0
    frames = [_frame(t, q(t) * 0.9, q(t)) for t in ticks]
    _, ep = _episode(store, 'replay', _contract(), frames)
    rows = build_rows(ep, 30, ActionSpace.JOINT_ABSOLUTE, 3, 3, [])
    assert len(rows) == 61   # t = 0 .. 2 s inclusive at 30 Hz
    for k in range(61):
        tk = k / 30
        in_effect = max(t for t in ticks if t <= tk + 1e-9)
        np.testing.assert_array_equal(rows.action[k], q(in_effect))
        np.testing.assert_array_equal(rows.state[k], q(in_effect) * 0.9)
    # the pattern the docs state: rows take the ticks at 0, 20, 60, 100, 120, 160 ms
    firsts = [int(round(float(np.arcsin(rows.action[k][0])) * 1000)) for k in range(6)]
    assert firsts == [0, 20, 60, 100, 120, 160]
    assert not rows.held.any() and not rows.clamped.any()


def test_a_50hz_node_that_stalls_keeps_each_row_on_the_command_in_effect(tmp_path: Path) -> None:
    """A 50 Hz node skips four ticks (a stall of 100 ms, phase kept): the ticks after it stay on their rows.

    Its ticks share 30 Hz cells by design, so they are not late ticks catching up: moving them back one row
    (as for a fixed-step loop) would put the command of t = 0.5 s on the row of t = 0.433 s.
    """
    store = make_store(tmp_path / 'arm')
    ticks = [i * 0.02 for i in range(101) if not 20 < i < 25]   # 0.42 .. 0.48 s skipped, resumes at 0.50 s
    frames = [_frame(t, q(t) * 0.9, q(t)) for t in ticks]
    _, ep = _episode(store, 'stall', _contract(), frames)
    rows = build_rows(ep, 30, ActionSpace.JOINT_ABSOLUTE, 3, 3, [])
    assert len(rows) == 61
    for k in range(61):
        in_effect = max(t for t in ticks if t <= k / 30 + 1e-9)
        np.testing.assert_array_equal(rows.action[k], q(in_effect), err_msg=f'row {k}')
        np.testing.assert_array_equal(rows.state[k], q(in_effect) * 0.9, err_msg=f'row {k}')
    # rows 13 and 14 (0.433, 0.467 s) fall in the stall: held on the command of 0.40 s
    assert rows.held.tolist()[12:16] == [False, True, True, False]


def test_5hz_delta_policy_exports_every_executed_step(tmp_path: Path) -> None:
    """Ten executed 5 Hz ee_delta steps (with jitter) -> ten rows at k/5 s whose actions are the steps."""
    store = make_store(tmp_path / 'wx')
    contract = Contract('ee_delta', ('x', 'y', 'z', 'roll', 'pitch', 'yaw', 'grip'), 0.2, 4,
                        ObservationContract((), NAMES), deployment='wx')
    rng = np.random.default_rng(3)
    steps = rng.normal(0, 0.01, (10, 7)).astype(np.float32)
    jitter = [0.0, 0.004, 0.019, 0.001, 0.03, 0.0, 0.012, 0.05, 0.002, 0.0]
    frames = [_frame(3.0, np.zeros(3), None, hold=True)]   # waiting for the first chunk: no row
    frames += [_frame(3.1 + 0.2 * i + jitter[i], np.full(3, i), steps[i]) for i in range(10)]
    _episode(store, 'bridge', contract, frames)
    for version in ('2.1', '3.0'):
        out = tmp_path / f'out{version}'
        res = export_lerobot(store, out, lerobot_version=version, progress=False)
        assert (res['episodes'], res['frames'], res['fps']) == (1, 10, 5)
        data = next(out.glob('data/chunk-000/*.parquet'))
        t = pq.read_table(data).to_pydict()
        np.testing.assert_array_equal(np.array(t['action'], np.float32), steps)
        np.testing.assert_allclose(t['timestamp'], np.arange(10) / 5, atol=1e-7)
        np.testing.assert_array_equal(np.array(t['observation.state'])[:, 0], np.arange(10))
        assert json.loads((out / 'meta/info.json').read_text())['fps'] == 5


def test_a_loop_that_falls_behind_keeps_every_tick_on_the_deadline_it_served(tmp_path: Path) -> None:
    """A 5 Hz fixed-step loop: tick 3 wakes 0.15 s late, tick 4 on time; each serves its own deadline.

    Its records carry their place on the timeline (grid index, step span), so the lateness of a wake-up
    never moves a row: ten rows, ten steps, each its own tick's command and state.
    """
    store = make_store(tmp_path / 'late')
    times = [0.2 * i for i in range(10)]
    times[3] += 0.15
    frames = [_frame(t, np.full(3, i), np.full(3, 10 + i), span=(i, i, i + 1)) for i, t in enumerate(times)]
    _, ep = _episode(store, 'late', _contract(dt=0.2), frames)
    rows = build_rows(ep, 5, ActionSpace.JOINT_ABSOLUTE, 3, 3, [])
    assert len(rows) == 10 and not rows.held.any()
    np.testing.assert_array_equal(rows.action[:, 0], np.arange(10, 20))
    np.testing.assert_array_equal(rows.state[:, 0], np.arange(10))


def test_missed_deadlines_are_held_rows_and_the_rest_keep_their_steps(tmp_path: Path) -> None:
    """Deadlines 3 and 4 got no tick (a stall): two held rows on the command in effect; the rest are exact."""
    store = make_store(tmp_path / 'late2')
    served = [0, 1, 2, 5, 6, 7, 8, 9]
    frames = [_frame(0.2 * g + 0.01, np.full(3, g), np.full(3, 10 + g), span=(g, g, g + 1)) for g in served]
    _, ep = _episode(store, 'late2', _contract(dt=0.2), frames)
    rows = build_rows(ep, 5, ActionSpace.JOINT_ABSOLUTE, 3, 3, [])
    assert len(rows) == 10
    np.testing.assert_array_equal(rows.action[:, 0], [10, 11, 12, 12, 12, 15, 16, 17, 18, 19])
    np.testing.assert_array_equal(rows.state[:, 0], [0, 1, 2, 2, 2, 5, 6, 7, 8, 9])
    assert rows.held.tolist() == [False] * 3 + [True] * 2 + [False] * 5


def test_50hz_records_against_a_30hz_policy_take_the_tick_in_effect_at_each_row(tmp_path: Path) -> None:
    """Records of a 50 Hz node (spans of 0.6 steps, a stall of four deadlines): rows take the tick in effect.

    Each row is the command in effect at its step, whatever time the ticks woke (here 0..40 % of a period late).
    """
    store = make_store(tmp_path / 'arm')
    rng = np.random.default_rng(1)
    served = [g for g in range(101) if not 20 < g < 25]
    frames = [_frame(g * 0.02 + rng.uniform(0, 0.008), q(g * 0.02) * 0.9, q(g * 0.02),
                     span=(g, g * 0.6, (g + 1) * 0.6)) for g in served]
    _, ep = _episode(store, 'stall50', _contract(), frames)
    rows = build_rows(ep, 30, ActionSpace.JOINT_ABSOLUTE, 3, 3, [])
    assert len(rows) == 61
    for k in range(61):
        g = max(x for x in served if x * 0.6 <= k + 1e-9)
        np.testing.assert_array_equal(rows.action[k], q(g * 0.02), err_msg=f'row {k}')
    assert rows.held.tolist()[12:16] == [False, True, True, False]


def test_delta_records_straddling_rows_are_split_by_the_share_of_their_span(tmp_path: Path) -> None:
    """ee_delta at dt 0.2 s driven at 12.5 Hz (2.5x: spans of 0.4 steps): each row is the policy's own step.

    Each row sums exactly the increments executed within it (a tick across a step boundary carries its parts,
    so it splits there exactly); the gripper is a target.
    """
    store = make_store(tmp_path / 'wx')
    contract = Contract('ee_delta', ('x', 'y', 'z', 'roll', 'pitch', 'yaw', 'grip'), 0.2, 4,
                        ObservationContract((), NAMES), deployment='wx')
    rng = np.random.default_rng(7)
    per_step = rng.normal(0, 0.01, (10, 7)).astype(np.float32)
    per_step[:, 6] = np.linspace(0, 1, 10)
    mask = position_mask(ActionSpace.EE_DELTA, 7)
    frames = []
    for g in range(25):
        a, b = 0.4 * g, 0.4 * (g + 1)
        inc = sample(per_step, ActionSpace.EE_DELTA, a, 0.4, mask)    # as the client reads the chunk
        f = _frame(g * 0.08, np.full(3, g), inc, span=(g, a, b))
        parts = pieces(per_step, ActionSpace.EE_DELTA, a, 0.4, mask)  # the tick across a step boundary
        if parts is not None:
            f.pieces.CopyFrom(codec.to_tensor(parts[0]))
            f.piece_share.extend(parts[1].tolist())
        frames.append(f)
    _episode(store, 'bridge', contract, frames)
    ep = next(e for e in store.episodes() if e.episode_id == 'bridge')
    rows = build_rows(ep, 5, ActionSpace.EE_DELTA, 3, 7, [])
    assert len(rows) == 10 and not rows.held.any()
    np.testing.assert_allclose(rows.action[:, :6], per_step[:, :6], atol=1e-6)
    # the gripper, a position: the target the robot commanded in effect at each row (the tick starting at or
    # before it, which read the chunk at its own start)
    in_effect = [sample(per_step, ActionSpace.EE_DELTA, 0.4 * int(np.floor(k / 0.4 + 1e-9)), 0.4, mask)[6]
                 for k in range(10)]
    np.testing.assert_array_equal(rows.action[:, 6], np.array(in_effect, np.float32))


def test_delta_rows_sum_the_ticks_so_the_commanded_path_is_kept(tmp_path: Path) -> None:
    store = make_store(tmp_path / 'd')
    rng = np.random.default_rng(5)
    inc = rng.normal(0, 0.01, (100, 3)).astype(np.float32)
    frames = [_frame(i * 0.02, np.zeros(3), inc[i], hold=(i % 17 == 5)) for i in range(100)]
    _, ep = _episode(store, 'dl', _contract('joint_delta'), frames)
    rows = build_rows(ep, 30, ActionSpace.JOINT_DELTA, 3, 3, [])
    executed = inc[[i for i in range(100) if i % 17 != 5]].sum(0)
    np.testing.assert_allclose(rows.action.sum(0), executed, atol=1e-5)
    assert rows.state.shape == (len(rows), 3) and len(rows) == 60


def test_safety_clamps_and_holds_are_the_rows(tmp_path: Path) -> None:
    """The row's action is what reached the controller; the policy's output is kept beside it."""
    store = make_store(tmp_path / 'c')
    frames = [_frame(0.0, [0, 0, 0], [0.5, 0.5, 0.5]),
              _frame(1 / 30, [0, 0, 0], [1.0, 0.5, 0.5], clamped=True, policy=[1.38, 0.5, 0.5]),
              _frame(2 / 30, [0, 0, 0], None, hold=True),
              _frame(3 / 30, [0, 0, 0], [0.9, 0.5, 0.5])]
    _, ep = _episode(store, 'clamp', _contract(), frames)
    rows = build_rows(ep, 30, ActionSpace.JOINT_ABSOLUTE, 3, 3, [])
    # the hold repeats the command
    np.testing.assert_array_equal(rows.action[:, 0], np.array([0.5, 1.0, 1.0, 0.9], np.float32))
    np.testing.assert_array_equal(rows.policy_action[:, 0], np.array([0.5, 1.38, 1.0, 0.9], np.float32))
    assert rows.clamped.tolist() == [False, True, False, False] and rows.held.tolist() == [False, False, True, False]


@pytest.mark.parametrize('kind', ['state_shape', 'object_dtype', 'nan_state', 'inf_action', 'bad_jpeg',
                                  'header_size', 'contract_size', 'format', 'action_shape', 'absurd_time',
                                  'png_16bit_rgb', 'png_palette', 'channels_change'])
def test_each_bad_frame_kind_is_refused_counted_and_never_exported(tmp_path: Path, kind: str) -> None:
    store = make_store(tmp_path / 'bad', images=True)
    contract = _contract(camera=True)
    good = [_frame(i / 30, q(i / 30), q(i / 30), image=codec.encode_image('cam', _jpeg(10 * i))) for i in range(6)]
    bad = _frame(0.5, q(0.5), q(0.5), image=codec.encode_image('cam', _jpeg(99)))
    if kind == 'state_shape':
        bad.state.CopyFrom(codec.to_tensor(np.zeros(4, np.float32)))
    elif kind == 'object_dtype':
        bad.state.CopyFrom(pb.Tensor(shape=[3], dtype='object', data=b'\0' * 24))
    elif kind == 'nan_state':
        bad.state.CopyFrom(codec.to_tensor(np.array([0, np.nan, 0], np.float32)))
    elif kind == 'inf_action':
        bad.action.CopyFrom(codec.to_tensor(np.array([0, np.inf, 0], np.float32)))
    elif kind == 'action_shape':
        bad.action.CopyFrom(codec.to_tensor(np.zeros((1, 3), np.float32)))
    elif kind == 'bad_jpeg':
        bad.images[0].data = b'\xff\xd8 not a jpeg at all'
    elif kind == 'header_size':
        bad.images[0].width = 64   # the JPEG header says 32
    elif kind == 'contract_size':
        bad.images[0].CopyFrom(codec.encode_image('cam', _jpeg(5, size=(64, 48))))
    elif kind == 'format':
        bad.images[0].CopyFrom(codec.encode_image('cam', _jpeg(5, fmt='PNG')))
        bad.images[0].encoding = 'jpeg'
    elif kind == 'absurd_time':
        bad.robot_time_s = 1e300   # a break-it review: held rows up to it exhausted the machine's memory
    elif kind == 'png_16bit_rgb':   # Pillow opens it as 'RGB': only the IHDR tells it is not uint8 x 3
        bad.images[0].CopyFrom(pb.Image(key='cam', encoding='png', width=32, height=24, channels=3,
                                        data=_png(32, 24, depth=16, colour=2)))
    elif kind == 'png_palette':     # one palette index per pixel, declared as one grey channel
        buf = io.BytesIO()
        Image.fromarray(np.full((24, 32, 3), 50, np.uint8)).convert('P').save(buf, format='PNG')
        bad.images[0].CopyFrom(pb.Image(key='cam', encoding='png', width=32, height=24, channels=1,
                                        data=buf.getvalue()))
    elif kind == 'channels_change':  # a grey frame in an RGB episode: a video has one layout
        buf = io.BytesIO()
        Image.fromarray(np.full((24, 32), 50, np.uint8)).save(buf, format='JPEG')
        bad.images[0].CopyFrom(pb.Image(key='cam', encoding='jpeg', width=32, height=24, channels=1,
                                        data=buf.getvalue()))
    refused, ep = _episode(store, f'ep-{kind}', contract, good[:3] + [bad] + good[3:])
    assert refused == 1 and ep.frames == 6   # the episode is kept without the bad frame
    assert ep.stats['telemetry_rejected'] == 1 and ep.stats['telemetry_error'].startswith('CONTRACT_VIOLATION')
    res = export_lerobot(store, tmp_path / 'out', vcodec='h264', progress=False)
    assert res['episodes'] == 1 and res['frames'] == 6 and res['videos'] == 1
    t = pq.read_table(tmp_path / 'out/data/chunk-000/episode_000000.parquet').to_pydict()
    assert np.isfinite(np.array(t['observation.state'])).all() and np.isfinite(np.array(t['action'])).all()
    assert 'NaN' not in (tmp_path / 'out/meta/episodes_stats.jsonl').read_text()


def test_a_store_with_unchecked_bad_frames_still_exports_every_good_episode(tmp_path: Path) -> None:
    """Frames kept without a check (an older store) are skipped at export, counted, never a NaN row."""
    store = make_store(tmp_path / 'old')
    _episode(store, 'good', _contract(), [_frame(i / 30, q(i / 30), q(i / 30)) for i in range(5)])
    ep = store.begin('poisoned', 'reach', _contract())
    ep._checker.check = lambda frame: None   # simulate the pre-check store writing anything it got
    ep.add_telemetry([_frame(0, q(0), q(0)), _frame(1 / 30, [np.nan, 0, 0], q(0)),
                      _frame(2 / 30, np.zeros(5), q(0)), _frame(3 / 30, q(0), q(0))])
    ep.commit('completed', {})
    _episode(store, 'empty', _contract(), [_frame(0, q(0), None, hold=True)])
    res = export_lerobot(store, tmp_path / 'x', lerobot_version='3.0', progress=False)
    assert res['episodes'] == 2 and res['frames'] == 5 + 4   # the two bad ticks' rows are held rows
    assert [eid for eid, _ in res['skipped']] == ['empty']
    assert any('poisoned' in n and '2 telemetry frames' in n for n in res['notes'])
    assert 'NaN' not in (tmp_path / 'x/meta/stats.json').read_text()


def test_stats_match_lerobot_compute_stats_on_the_same_frames() -> None:
    """reference.json was written by LeRobot 0.6.1's own compute_stats (see make_reference.py)."""
    spec = importlib.util.spec_from_file_location('make_reference', FIXTURES / 'lerobot_stats/make_reference.py')
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    ref = json.loads((FIXTURES / 'lerobot_stats/reference.json').read_text())
    for key, arr in mod.frames().items():
        if key.startswith('observation.images'):
            ours = lerobot_stats.image_stats(arr[lerobot_stats.sample_indices(len(arr))])
        else:
            ours = lerobot_stats.feature_stats(arr)
        assert set(ours) == set(ref[key])
        width = (np.asarray(ref[key]['max']) - np.asarray(ref[key]['min'])) / lerobot_stats.QUANTILE_BINS
        for stat, value in ref[key].items():
            tol = max(float(np.max(width)), 1e-6) if stat.startswith('q') else 1e-6   # one histogram bin
            # LeRobot reduces pixels in float32 (E[x^2] - E[x]^2): its image std is off by ~1e-4 relative;
            # ours comes from exact per-value counts (ImageStats)
            rtol = 1e-3 if key.startswith('observation.images') and stat == 'std' else 1e-6
            np.testing.assert_allclose(np.asarray(ours[stat], np.float64), np.asarray(value, np.float64),
                                       atol=tol, rtol=rtol, err_msg=f'{key} {stat}')


def test_a_store_written_before_this_change_still_exports(tmp_path: Path, capsys) -> None:
    root = tmp_path / 'capture' / 'arm4'
    shutil.copytree(FIXTURES / 'legacy_store' / 'arm4', root)
    store = CaptureStore(root, 'arm4', clock=FakeClock())
    res = export_lerobot(store, tmp_path / 'v21', vcodec='h264', progress=False)
    assert (res['episodes'], res['frames'], res['videos'], res['fps']) == (2, 18, 2, 10)
    assert res['skipped'] == [('ep-three', 'no executed action (0 rows)')]
    t = pq.read_table(tmp_path / 'v21/data/chunk-000/episode_000000.parquet').to_pydict()
    np.testing.assert_array_equal(np.array(t['action'][0], np.float32), (0.1 * np.sin(0.2 + np.arange(4))).astype(
        np.float32))   # frame 1 of ep-one commanded q(0.2)
    res = export_lerobot(store, tmp_path / 'v30', lerobot_version='3.0', vcodec='h264', progress=False)
    assert res['frames'] == 18 and (tmp_path / 'v30/meta/tasks.parquet').exists()
    assert len(list((tmp_path / 'v30/videos/observation.images.wrist').rglob('*.mp4'))) == 1


def test_cli_export_says_what_it_skipped_and_strict_fails(tmp_path: Path, seq_home: Path, capsys) -> None:
    root = seq_home / 'capture' / 'arm4'
    shutil.copytree(FIXTURES / 'legacy_store' / 'arm4', root)
    assert seq_main(['policy', 'data', 'export', 'arm4', '--out', str(tmp_path / 'o'), '--vcodec', 'h264']) == 3
    out = capsys.readouterr().out
    assert 'skipped ep-three: no executed action' in out and 'videos' in out
    assert json.loads((tmp_path / 'o/meta/info.json').read_text())['total_videos'] == 2   # video by default
    assert seq_main(['policy', 'data', 'export', 'arm4', '--out', str(tmp_path / 's'), '--strict']) == 2
    assert not (tmp_path / 's').exists()
    assert seq_main(['policy', 'data', 'export', 'arm4', '--out', str(tmp_path / 'v3'), '--lerobot-version', '3.0',
                     '--vcodec', 'h264', '--since', '1790000000', '--until', '1790000001.5']) == 0


def test_capture_names_are_checked_even_with_force(tmp_path: Path, seq_home: Path) -> None:
    assert seq_main(['policy', 'capture', '../../escape', '--rate', '1', '--force']) == 2
    assert seq_main(['policy', 'capture', 'a/b', '--force']) == 2
    assert not (seq_home.parent / 'escape').exists() and not (seq_home / 'capture').exists()
    assert seq_main(['policy', 'capture', 'ok-name', '--rate', '1', '--force']) == 0


def test_episode_dirs_never_collide_whatever_the_client_sends(tmp_path: Path) -> None:
    from sequence_ai_ros.capture.episode import episode_dir_name

    store = make_store(tmp_path / 'cap')
    weird = 'we/ird'
    hashed = episode_dir_name(weird)
    assert hashed.startswith('_h-')
    (store.root / 'episodes' / 'ep-0123').mkdir(parents=True)   # a legacy or stray directory
    for eid in (weird, hashed[1:], 'ep-0123', hashed.replace('_h-', 'ep-')):
        _episode(store, eid, _contract(), [_frame(0, q(0), q(0))])
    kept = {e.episode_id: e.path.name for e in store.episodes()}
    assert len(kept) == 4 and len(set(kept.values())) == 4 and kept['ep-0123'] == 'ep-0123~1'


def test_paused_capture_shows_in_another_process(tmp_path: Path, seq_home: Path, capsys) -> None:
    from sequence_ai_ros.capture.settings import CaptureSettings, save_settings

    root = seq_home / 'capture' / 'q'
    save_settings(root, CaptureSettings(rate=1.0, enabled=True, quota_bytes=10))
    worker_side = CaptureStore(root, 'q')
    assert worker_side.begin('e1', 'x', None) is None   # over the quota: paused
    assert seq_main(['policy', 'capture', 'q', '--force']) == 0
    out = capsys.readouterr().out
    assert 'capture q: paused' in out and 'quota' in out
    save_settings(root, CaptureSettings(rate=1.0, enabled=True))
    assert worker_side.begin('e2', 'x', None) is not None   # the pause lifts, for every process
    assert seq_main(['policy', 'capture', 'q', '--force']) == 0
    assert 'capture q: capturing' in capsys.readouterr().out


def test_usage_counts_survive_a_failed_flush(tmp_path: Path) -> None:
    from sequence_ai_ros.worker.usage import UsageMeter, read_usage

    blocker = tmp_path / 'not-a-dir'
    blocker.write_text('x')
    meter = UsageMeter('d', blocker / 'usage.sqlite')   # cannot be written (as a full disk)
    meter.add(episodes=3, requests=7)
    with pytest.raises(OSError):
        meter.flush()
    meter.path = tmp_path / 'usage.sqlite'   # room again
    meter.add(episodes=1)
    meter.flush()
    assert read_usage(meter.path)['d'].episodes == 4 and read_usage(meter.path)['d'].requests == 7
    meter.retire()
    meter.add(episodes=1)
    meter.flush()
    assert read_usage(meter.path)['d'].episodes == 4


def test_usage_of_a_process_gone_before_its_write_is_written_by_the_next_meters_first_flush(tmp_path: Path) -> None:
    """A gone worker's unwritten usage is written by the next meter's first flush, before any count of its own.

    The worker could not write it (the database unreachable) and exited: it was left in its pending record, and
    the next meter of the deployment adopts it.
    """
    import sqlite3
    import subprocess
    import sys

    from sequence_ai_ros.worker.usage import UsageMeter

    path = tmp_path / 'usage.sqlite'
    path.mkdir()                                  # no database can be opened there
    gone = ("import sys; from sequence_ai_ros.worker.usage import UsageMeter\n"
            "m = UsageMeter('d', sys.argv[1]); m.add(episodes=3, requests=7)\n"
            "try:\n    m.flush()\nexcept Exception:\n    print('kept')\n")
    done = subprocess.run([sys.executable, '-c', gone, str(path)], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == 'kept', done.stderr
    path.rmdir()
    meter = UsageMeter('d', path)
    meter.flush()
    with sqlite3.connect(str(path)) as conn:
        row = conn.execute("SELECT episodes, requests FROM usage WHERE deployment = 'd'").fetchone()
    assert row == (3, 7)


def test_a_usage_flush_waiting_for_another_when_its_deployment_is_deleted_writes_nothing(tmp_path: Path) -> None:
    """``seq delete`` (retire) while a flush waits behind another's write: it must not re-create the deleted row."""
    import threading

    from sequence_ai_ros.worker.usage import Usage, UsageMeter

    writing, release = threading.Event(), threading.Event()
    after_retire: list[int] = []

    class Held(UsageMeter):
        def _write(self, pending: Usage) -> None:
            if self.retired:
                after_retire.append(pending.episodes)
            writing.set()
            assert release.wait(30)
            super()._write(pending)

    meter = Held('d', tmp_path / 'usage.sqlite')
    meter.add(episodes=1)
    first = threading.Thread(target=meter.flush)
    first.start()
    assert writing.wait(30)
    meter.add(episodes=1)
    second = threading.Thread(target=meter.flush)
    second.start()
    second.join(0.5)                   # past its first look at retired, waiting for the write
    meter.retire()
    release.set()
    first.join(30)
    second.join(30)
    assert after_retire == []


def test_usage_flushes_called_together_share_one_write(tmp_path: Path) -> None:
    """Eight episode ends flushing at once: two transactions (the first, then one for the seven that waited).

    Each flush returns with its own counts in the database; before group commit each wrote its own
    transaction, and 128 at once on 8 threads left one in SQLite's busy wait for 184 ms.
    """
    import threading
    import time

    from sequence_ai_ros.worker.usage import Usage, UsageMeter, read_usage

    class Held(UsageMeter):
        def __init__(self, *args: object) -> None:
            super().__init__(*args)
            self.writes: list[int] = []
            self.release = threading.Event()
            self.added = threading.Semaphore(0)

        def add(self, **counts: float) -> None:
            super().add(**counts)
            self.added.release()

        def _write(self, pending: Usage) -> None:
            self.writes.append(pending.episodes)
            assert self.release.wait(30)
            super()._write(pending)

    meter = Held('d', tmp_path / 'usage.sqlite')
    done: list[int] = []

    def end(k: int) -> None:
        meter.add(episodes=1)
        meter.flush()
        done.append(k)

    threads = [threading.Thread(target=end, args=(k,)) for k in range(8)]
    threads[0].start()
    assert meter.added.acquire(timeout=30)
    deadline = time.monotonic() + 30
    while not meter.writes and time.monotonic() < deadline:   # the first flush is writing, held
        time.sleep(0.01)
    assert meter.writes == [1]
    for t in threads[1:]:
        t.start()
    for _ in range(7):
        assert meter.added.acquire(timeout=30)
    meter.release.set()
    for t in threads:
        t.join(30)
    assert sorted(done) == list(range(8))
    assert meter.writes == [1, 7]
    assert read_usage(meter.path)['d'].episodes == 8


def test_export_refuses_an_unknown_version(tmp_path: Path) -> None:
    store = make_store(tmp_path / 'v')
    _episode(store, 'a', _contract(), [_frame(0, q(0), q(0))])
    with pytest.raises(ExportError, match='2.1 or 3.0'):
        export_lerobot(store, tmp_path / 'o', lerobot_version='4.0', progress=False)


def test_a_clock_that_leaps_is_a_bad_frame_at_export_not_a_memory_exhaustion(tmp_path: Path) -> None:
    """A frame 10^8 s after the previous one is refused, not filled with held rows; the frames after it stay.

    Capture refuses it (robot time leaping more than 300 s) and counts it; the export, which re-checks every
    record, refuses it too in a store written before capture checked it (export used to fill the gap and run
    out of memory).
    """
    store = make_store(tmp_path / 'leap')
    frames = [_frame(i / 30, q(i / 30), q(i / 30)) for i in range(5)]
    frames.insert(3, _frame(1e8, q(0.1), q(0.1)))
    refused, ep = _episode(store, 'leap', _contract(), frames)
    assert refused == 1 and ep.frames == 5
    rows = build_rows(ep, 30.0, ActionSpace.JOINT_ABSOLUTE, 3, 3, [])
    assert len(rows.action) == 5 and rows.skipped_frames == 0


@pytest.mark.parametrize('args', [['policy', 'stats', 'arm'], ['policy', 'data', 'export', 'arm', '--format', 'jsonl']])
def test_a_closed_stdout_pipe_exits_141_without_a_traceback(tmp_path: Path, seq_home: Path, args: list) -> None:
    """``seq policy stats arm | head -1``: the reader has gone; seq exits quietly with 128 + SIGPIPE."""
    import os
    import subprocess
    import sys

    store = make_store(seq_home / 'capture' / 'arm')
    _episode(store, 'e1', _contract(), [_frame(i / 30, np.zeros(3), np.full(3, i)) for i in range(10)])
    if 'export' in args:
        args = [*args, '--out', str(tmp_path / 'out')]
    read, write = os.pipe()
    os.close(read)                      # the reader went away before seq wrote its first line
    try:
        done = subprocess.run([sys.executable, '-m', 'sequence_ai_ros.cli', *args], stdout=write,
                              stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write)
    assert done.returncode == 141 and 'Traceback' not in done.stderr and 'BrokenPipe' not in done.stderr, done.stderr
