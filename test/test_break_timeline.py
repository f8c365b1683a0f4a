"""Break-it probes of the one-record-per-tick timeline (helper trial-break).

Each test fails on the code it was written against and names the promise it checks.

Real parts only: the worker (``serve_policy_file``) over a real gRPC Episode stream with hand-built
TelemetryFrames, the real client (``connect``, ``next_action``/``report_command``, ``run``), the real capture
store and ``build_rows``. Exports that could loop or eat memory run in a subprocess under a time and
address-space limit, so a failure is a red test, never a wedged machine.
"""
from __future__ import annotations

import contextlib
import itertools
import math
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from test_data_rows import _contract, _episode, _frame
from test_data_support import make_store
from test_worker_support import POLICIES, Stream, channel, wait_ready

from sequence_ai_ros.capture.settings import CaptureSettings, save_settings
from sequence_ai_ros.capture.store import CaptureStore
from sequence_ai_ros.datasets.rows import build_rows
from sequence_ai_ros.protocol import codec
from sequence_ai_ros.protocol import sequence_ai_pb2 as pb
from sequence_ai_ros.protocol import sequence_ai_pb2_grpc as pb_grpc
from sequence_ai_ros.protocol.spaces import ActionSpace

REPO = Path(__file__).resolve().parent.parent
NAMES = ('j0', 'j1', 'j2', 'j3')
START = np.array([0.1, 0.2, 0.3, 0.4], np.float32)

# A 0 ms policy whose rows vary along the chunk (so a row shifted by a fraction of a step shows): joint_delta
# increments, joint_velocity rates, or (joint_absolute) their running sum; request r's row i is f(i + 7 r).
WAVE = '''
import dataclasses
import numpy as np
import sequence_ai_ros.policy as seq

NAMES = ('j0', 'j1', 'j2', 'j3')


@seq.policy(action_space='joint_delta', action_names=list(NAMES), dt=1 / 30, chunk_length=30,
            observation=seq.ObservationContract(state_names=list(NAMES)))
class Wave:
    def __init__(self, action_space='joint_delta', chunk_length=30):
        self.space = action_space
        self.chunk_length = int(chunk_length)

    @classmethod
    def configure_contract(cls, contract, config):
        return dataclasses.replace(contract, action_space=config.get('action_space', 'joint_delta'),
                                   chunk_length=int(config.get('chunk_length', 30)))

    def infer(self, inp, episode):
        k = np.arange(self.chunk_length, dtype=np.float64)[:, None] + inp.request_id * 7
        rows = 0.001 * np.array([1.0, 2.0, -1.0, 0.5]) * (1.0 + 0.5 * np.sin(0.7 * k))
        if self.space == 'joint_absolute':
            rows = np.cumsum(rows, 0) + 0.1
        return rows.astype(np.float32)
'''


def _wave_rows(n: int, request_id: int = 1) -> np.ndarray:
    """The Wave policy's first chunk (request 1), float32 (n, 4): what each chunk step increments."""
    k = np.arange(n, dtype=np.float64)[:, None] + request_id * 7
    return (0.001 * np.array([1.0, 2.0, -1.0, 0.5]) * (1.0 + 0.5 * np.sin(0.7 * k))).astype(np.float32)


# -- the worker: hand-built telemetry over a real Episode stream -----------------------------------------------

def _tf(i: int, a: float | None = None, b: float | None = None, grid: int | None = None, value: float | None = None,
        **kw) -> pb.TelemetryFrame:
    """Tick ``i`` of a 30 Hz loop against dt = 1/30 s: span [i, i + 1), grid index i, state = action = i."""
    v = codec.to_tensor(np.full(4, float(i) if value is None else value, np.float32))
    return pb.TelemetryFrame(robot_time_s=i / 30, state=v, action=v, grid_index=i if grid is None else grid,
                             step_start=float(i) if a is None else a, step_end=float(i + 1) if b is None else b,
                             **kw)


def _pieces(values, share) -> dict:
    return dict(pieces=codec.to_tensor(np.asarray(values, np.float32)), piece_share=list(share))


@contextlib.contextmanager
def _worker(tmp_path: Path, **kw):
    """The fast test policy (4 joints, joint_absolute) served with capture on; yields (server, stub)."""
    from sequence_ai_ros.worker import serve_policy_file
    root = tmp_path / 'capture'
    save_settings(root / 'fast', CaptureSettings(rate=1.0, enabled=True))
    with serve_policy_file(POLICIES / 'fast.py', 'fast', dim=4, capture_root=root, **kw) as server, \
            channel(server.port) as ch:
        stub = pb_grpc.PolicyServiceStub(ch)
        assert wait_ready(stub, 'fast').ready
        yield server, stub


def _stream_episode(stub, eid: str, frames: list[pb.TelemetryFrame]) -> pb.EpisodeEnded:
    s = Stream(stub, 'fast', eid)
    assert s.start('x').started.capture
    s.send(telemetry=pb.Telemetry(frames=frames))
    reply = s.end('completed')
    assert reply is not None and reply.HasField('ended'), reply
    return reply.ended


BAD_AT_THE_WORKER = {
    # one record whose span is hours long: the export would make every row of it (see the export tests below)
    'span_of_hours': [_tf(1, a=1.0, b=1.0 + 30 * 3 * 3600)],
    'span_of_1e12_steps': [_tf(1, a=1.0, b=1e12)],
    # the proto: "step_end > step_start on every frame of this protocol version"
    'zero_width_span': [_tf(1, a=1.0, b=1.0)],
    'legacy_record_among_spanned': [_tf(1, a=0.0, b=0.0, grid=0)],
    'grid_index_goes_back': [_tf(5), _tf(3)],
    'grid_index_repeats': [_tf(1), _tf(1)],
    'span_leaps_two_hours': [_tf(1), _tf(2, a=2.0 + 30 * 7200, b=3.0 + 30 * 7200)],
    # pieces are the parts of the tick's action: these add up to 10 where the tick executed 1
    'pieces_not_the_action': [_tf(1, **_pieces([[5.0] * 4] * 2, [0.5, 0.5]))],
    # a 1-step span crosses at most one chunk-step boundary: 2 parts, never 1000
    'pieces_more_than_the_span_holds': [_tf(1, **_pieces(np.full((1000, 4), 1e-3), [1e-3] * 1000))],
    # a reason to hold on a record that says it did not hold
    'hold_reason_on_an_executed_record': [_tf(1, hold_reason='dry_run')],
}


@pytest.mark.parametrize('case', list(BAD_AT_THE_WORKER))
def test_the_worker_refuses_and_counts_records_the_export_cannot_use(tmp_path, case):
    """The worker refuses and counts records the export cannot use.

    Each of these records is dropped by the export (or corrupts it), yet the worker keeps it and tells the robot
    telemetry_rejected = 0: the refusal must be typed and counted where the robot hears it (EpisodeEnded).
    """
    frames = [_tf(0)] + BAD_AT_THE_WORKER[case] + [_tf(20)]
    with _worker(tmp_path) as (_, stub):
        ended = _stream_episode(stub, case, frames)
    assert ended.captured
    assert ended.telemetry_rejected >= 1 and ended.telemetry_error.startswith('CONTRACT_VIOLATION'), (
        f'{case}: the worker kept it (telemetry_rejected={ended.telemetry_rejected}, '
        f'error={ended.telemetry_error!r})')


HELD_UP_AT_THE_WORKER = {
    'nan_step_start': [_tf(1, a=float('nan'))],
    'inf_step_end': [_tf(1, b=float('inf'))],
    'end_before_start': [_tf(1, a=2.0, b=1.5)],
    'unknown_hold_reason': [_tf(1, hold_reason='napping')],
    'pieces_of_one_part': [_tf(1, **_pieces([[1.0] * 3], [1.0]))],
    'nan_pieces': [_tf(1, **_pieces([[np.nan] * 4] * 2, [0.5, 0.5]))],
    'shares_summing_to_1_1': [_tf(1, **_pieces([[1.0] * 4] * 2, [0.5, 0.6]))],
    'grid_index_2_64_minus_1': [_tf(1, grid=2 ** 64 - 1)],
}


@pytest.mark.parametrize('case', list(HELD_UP_AT_THE_WORKER))
def test_held_up_the_worker_refuses_malformed_timelines_and_keeps_the_rest(tmp_path, case):
    """Held up (a guard): these are refused, typed and counted; the good records of the episode are kept."""
    frames = [_tf(0)] + HELD_UP_AT_THE_WORKER[case] + [_tf(20)]
    with _worker(tmp_path) as (_, stub):
        ended = _stream_episode(stub, case, frames)
    assert ended.captured and ended.telemetry_rejected == 1, ended
    assert ended.telemetry_error.startswith('CONTRACT_VIOLATION'), ended
    [ep] = CaptureStore(tmp_path / 'capture' / 'fast', 'fast').episodes()
    assert ep.frames == 2


# -- the export: bounded in time and memory whatever the store holds ---------------------------------------------

_EXPORT = '''
import resource, sys
resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))
from sequence_ai_ros.capture.store import CaptureStore
from sequence_ai_ros.datasets.rows import build_rows
from sequence_ai_ros.protocol.spaces import ActionSpace
[ep] = CaptureStore(sys.argv[1], 's').episodes()
rows = build_rows(ep, 30.0, ActionSpace(sys.argv[2]), 3, 3, [])
print('rows', len(rows.held), 'skipped', rows.skipped_frames)
'''


def _export_in_a_box(root: Path, space: str, timeout: float = 25.0) -> str:
    """build_rows in a subprocess (3 GB of address space, ``timeout`` s); its output, or the failure."""
    import os
    env = {**os.environ, 'PYTHONPATH': f'{REPO}:{os.environ.get("PYTHONPATH", "")}'}
    try:
        done = subprocess.run([sys.executable, '-c', _EXPORT, str(root), space], capture_output=True, text=True,
                              timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        done = None
    if done is None:
        pytest.fail(f'build_rows did not finish within {timeout:g} s')
    assert done.returncode == 0, f'build_rows failed: {done.stderr[-600:]}'
    return done.stdout


def test_export_of_a_record_spanning_1e12_steps_terminates(tmp_path):
    """Export of a record spanning 1e12 steps terminates.

    A record may carry a span up to MAX_STEP = 1e12 steps (frame_check); build_rows makes one row per step
    of it (1.5 s and ~40 MB per 10^5 rows): a 1e8-step span is a MemoryError, 1e12 never ends.
    """
    store = make_store(tmp_path / 's')
    frames = [_frame(0.0, np.zeros(3), np.ones(3), span=(0, 0.0, 1.0)),
              _frame(1 / 30, np.zeros(3), np.ones(3), span=(1, 1.0, 1e12))]
    refused, _ = _episode(store, 'e', _contract(), frames)
    out = _export_in_a_box(tmp_path / 's', 'joint_absolute')
    assert refused or 'skipped 1' in out, out


def test_export_of_chained_299_s_gaps_is_bounded(tmp_path):
    """Export of chained 299 s gaps is bounded.

    Each gap is under MAX_GAP_S = 300 s, so each is filled with held rows: 2000 records (~180 KB on the wire)
    make 18 million rows (~7 GB). The export must bound what a store can make it allocate.
    """
    store = make_store(tmp_path / 's')
    frames, a = [], 0.0
    for i in range(2000):
        frames.append(_frame(i * 299.0, np.zeros(3), np.ones(3), span=(i, a, a + 1.0)))
        a += 299 * 30
    _episode(store, 'e', _contract(), frames)
    _export_in_a_box(tmp_path / 's', 'joint_absolute')


def test_velocity_export_of_a_robot_time_leap_is_bounded(tmp_path):
    """Velocity export of a robot time leap is bounded.

    Velocity spans come from robot_time_s (allowed up to 1e9 s), never checked against MAX_GAP_S: a record a
    day later makes a day of rows (2.6 million) commanding the last velocity all day.
    """
    store = make_store(tmp_path / 's')
    frames = [_frame(0.0, np.zeros(3), np.ones(3), span=(0, 0.0, 1.0)),
              _frame(1 / 30, np.zeros(3), np.ones(3), span=(1, 1.0, 2.0)),
              _frame(86400.0, np.zeros(3), np.ones(3), span=(2, 2.0, 3.0))]
    _episode(store, 'e', _contract('joint_velocity'), frames)
    out = _export_in_a_box(tmp_path / 's', 'joint_velocity')
    assert int(out.split()[1]) < 100, out


def test_velocity_export_refuses_a_robot_time_that_goes_back(tmp_path):
    """Velocity export refuses a robot time that goes back.

    Velocity rows weight each command by its robot time to the next one; a record whose robot time goes back
    zeroes its predecessor's span: command 3 vanishes from the rows (3 -> 4) and nothing is counted as skipped.
    The legacy path refuses such a record ('robot_time_s ... is before the previous record').
    """
    store = make_store(tmp_path / 's')
    times = [0, 1 / 30, 2 / 30, 0.0, 4 / 30, 5 / 30]
    frames = [_frame(t, np.zeros(3), np.array([1.0, 1.0, 0.0]) * (i + 1), span=(i, i, i + 1))
              for i, t in enumerate(times)]
    refused, ep = _episode(store, 'e', _contract('joint_velocity'), frames)
    rows = build_rows(ep, 30, ActionSpace.JOINT_VELOCITY, 3, 3, [])
    assert refused or rows.skipped_frames, (rows.action[:, 0].tolist(), rows.skipped_frames)


def test_one_record_with_a_far_grid_index_does_not_drop_the_rest_of_the_episode(tmp_path):
    """One record with a far grid index does not drop the rest of the episode.

    The worker keeps a record with grid_index 2**52 (below MAX_GRID_INDEX); the export then refuses every
    later record ('before the previous one'): one bad record loses the rest of the episode.
    """
    store = make_store(tmp_path / 's')
    frames = [_frame(i / 30, np.zeros(3), np.full(3, i), span=(i, i, i + 1)) for i in range(10)]
    frames.insert(5, _frame(5 / 30, np.zeros(3), np.full(3, 99), span=(2 ** 52, 5, 5.5)))
    refused, ep = _episode(store, 'g', _contract(), frames)
    rows = build_rows(ep, 30, ActionSpace.JOINT_ABSOLUTE, 3, 3, [])
    assert rows.skipped_frames + refused <= 1, (rows.action[:, 0].tolist(), rows.skipped_frames, rows.first_problem)


def test_delta_rows_never_sum_to_more_than_the_record_executed(tmp_path):
    """Delta rows never sum to more than the record executed.

    A joint_delta record executed 0.01 per joint; its pieces (kept by the worker) say 5 + 5: the rows sum to
    the pieces, so the dataset says the arm moved 10 rad. Rows must sum to the executed path within 1e-5.
    """
    store = make_store(tmp_path / 's')
    frames = [_frame(i / 50, np.zeros(3), np.full(3, 0.01), span=(i, i * 0.6, i * 0.6 + 0.6)) for i in range(5)]
    frames[1].pieces.CopyFrom(codec.to_tensor(np.full((2, 3), 5.0, np.float32)))   # span [0.6, 1.2) crosses 1
    frames[1].piece_share.extend([2 / 3, 1 / 3])
    refused, ep = _episode(store, 'p', _contract('joint_delta'), frames)
    rows = build_rows(ep, 30, ActionSpace.JOINT_DELTA, 3, 3, [])
    kept = 5 - rows.skipped_frames - refused     # refused at capture (pieces not the action) or at export
    np.testing.assert_allclose(rows.action.astype(np.float64).sum(0), np.full(3, 0.01 * kept), atol=1e-5)


# -- the real client: what the robot commanded against what the export says ----------------------------------------

def _loop(tmp_path: Path, *, space: str = 'joint_delta', rate_hz: float = 30.0, n: int = 60, robot=None,
          begin: dict | None = None, times=None, chunk_length: int = 30):
    """A next_action() robot loop on the Wave policy; what it commanded and what the export made of it.

    A next_action() robot loop on the Wave policy, ticks every 1/rate_hz from 1 s on until ``n`` of them
    played a row (the holds before the first chunk, and any a loaded machine adds, do not count: when the
    first chunk comes is the worker's and the machine's time, not the loop's), or at ``times`` when given;
    each tick's ``now`` and observation time are its scheduled time, so the engine sees an exact schedule.
    The loop also stops when the episode ends, and fails after 60 s.

    ``robot(i, action, policy, target)`` returns the new commanded target (None: unchanged) and may call
    report_command; by default every fresh action is commanded as returned.
    Returns (rows, log of (i, action, target), outcome, final target, episode).
    """
    from sequence_ai_ros.client import Observation, connect
    from sequence_ai_ros.worker import serve_policy_file

    wave = tmp_path / 'wave.py'
    wave.write_text(WAVE)
    capture = tmp_path / 'capture'
    save_settings(capture / 'wave', CaptureSettings(rate=1.0, enabled=True))
    target = START.copy()
    log = []
    with serve_policy_file(wave, 'wave', capture_root=capture, action_space=space, chunk_length=chunk_length) \
            as server, connect('wave', endpoint=f'127.0.0.1:{server.port}') as policy:
        policy.wait_until_ready()
        policy.begin_episode('x', **(begin or {}))
        t0 = time.monotonic() + 1.0
        deadline = t0 + 60.0
        schedule = (t0 + i / rate_hz for i in itertools.count()) if times is None else (t0 + t for t in times)
        played = 0
        for i, ts in enumerate(schedule):
            if times is None and played >= n:
                break
            assert time.monotonic() < deadline, f'{played} of {n} ticks played a row in 60 s: {policy.stats()}'
            while time.monotonic() < ts:
                time.sleep(0.0005)
            a = policy.next_action(Observation(state=target, state_names=NAMES, timestamp=ts), now=ts)
            if policy.episode_outcome() is not None:
                break
            played += a is not None and not a.hold
            if robot is not None:
                new = robot(i, a, policy, target)
            else:
                new = None if a is None or a.hold else a.values
            if new is not None:
                target = np.array(new, np.float32)
            log.append((i, a, target.copy()))
        out = policy.end_episode()
    [episode] = CaptureStore(capture / 'wave', 'wave').episodes()
    rows = build_rows(episode, 30.0, ActionSpace(space), 4, 4, [])
    return rows, log, out, target, episode


def _fresh(log):
    return [(i, a) for i, a, _ in log if a is not None and not a.hold]


def test_measured_period_absolute_rows_are_the_target_in_effect_at_each_step(tmp_path):
    """control_period None (begin_episode's default, and every implicit next_action episode): an exact 50 Hz loop.

    The record spans add up the period *estimate* (an EMA from dt = 1/30 s), the chunk plays by the clock: the
    records land 2 chunk steps after the steps they executed, so row k holds the target of step k - 2.
    """
    rows, log, out, _, _ = _loop(tmp_path, space='joint_absolute', rate_hz=50.0, n=150, chunk_length=300,
                                 begin=dict(max_actions=80))
    fresh = [(a.index, np.array(a.values, np.float32)) for _, a in _fresh(log)]
    base = fresh[0][0]
    want = np.array([[v for x, v in fresh if x - base <= k + 1e-6][-1] for k in range(len(rows))])
    bad = np.flatnonzero(np.any(rows.action != want, axis=1))
    assert bad.size == 0, (f'{bad.size} of {len(rows)} rows are not the target in effect at their step '
                           f'(first {bad[:8].tolist()})')


def test_measured_period_delta_rows_are_the_policys_steps(tmp_path):
    """Measured period delta rows are the policys steps.

    control_period None, an exact 50 Hz joint_delta loop, one chunk, nothing clamped: each row must be the
    policy's own step (rows.py: 'the rows ... are the policy's own steps when nothing was changed'). The spans
    use the period estimate before each tick's update, the increments the one after: every row is off by up to
    27 % of a step (a permanent phase shift), though the total is right.
    """
    rows, _, out, target, _ = _loop(tmp_path, space='joint_delta', rate_hz=50.0, n=150, chunk_length=300,
                                    begin=dict(max_actions=80))
    want = _wave_rows(80)
    np.testing.assert_allclose(START + rows.action.astype(np.float64).sum(0), target, atol=1e-5)
    m = min(len(rows), 79)
    err = np.abs(rows.action[:m].astype(np.float64) - want[:m]).max(1)
    assert err.max() < 1e-6, (f'rows off their policy step by up to {err.max():.2e} '
                              f'(rows {np.flatnonzero(err > 1e-6)[:8]})')


def test_measured_period_with_jitter_skips_no_deadline(tmp_path):
    """Measured period with jitter skips no deadline.

    control_period None, a 50 Hz loop whose ticks come within +-30 % of a period of their deadlines (none is
    missed): the grid estimate (previous tick + the measured period, rounded) counts a late-then-early pair as a
    missed deadline and never gives it back: ticks_skipped 9 and 5 extra rows over 3 s.
    """
    rng = np.random.default_rng(0)
    times = [i / 50 + rng.uniform(-0.3, 0.3) / 50 for i in range(150)]
    rows, _, out, _, _ = _loop(tmp_path, space='joint_delta', times=times)
    assert out.ticks_skipped == 0, f'ticks_skipped {out.ticks_skipped} though no deadline was missed'


@pytest.mark.slow
def test_measured_period_after_a_stall_each_command_keeps_its_row(tmp_path):
    """Measured period after a stall each command keeps its row.

    control_period None, a 30 Hz joint_absolute loop that stalls 1 s once: the period estimate jumps to
    ~0.23 s, so the next ticks each cover ~7 chunk steps: the rows repeat each of them (~100 rows for 58 commands).
    """
    times = [i / 30 + (1.0 if i >= 40 else 0.0) for i in range(90)]
    rows, log, out, _, _ = _loop(tmp_path, space='joint_absolute', times=times)
    sent = np.array([np.array(a.values, np.float32) for _, a in _fresh(log)])
    ex = rows.action[~rows.held]
    # on the clock without a fixed period the last command's span is the measured period: it may take one row
    # more than the steps it ran (its end is not known until a next tick)
    assert len(ex) - len(sent) in (0, 1), (f'{len(ex)} executed rows for {len(sent)} commands '
                                           f'(held {int(rows.held.sum())})')
    np.testing.assert_array_equal(ex[:len(sent)], sent)


@pytest.mark.parametrize('space', ['joint_delta', 'joint_absolute', 'joint_velocity'])
def test_max_actions_ending_mid_tick_makes_one_row_per_executed_step(tmp_path, space):
    """Max actions ending mid tick makes one row per executed step.

    next_action at 2.5x the policy's rate (0.4 steps a tick), max_actions 3: the last tick executes 0.2 of a
    step but its record spans 0.4, so the export makes a 4th row (delta: the last increment split across rows 2 and
    3, so row 2 is not the policy's step 2). One row per policy step executed: 3.
    """
    rows, log, out, target, _ = _loop(tmp_path, space=space, rate_hz=75.0, n=200,
                                      begin=dict(control_period=1 / 75, max_actions=3))
    assert out.reason == 'completed' and out.actions == 3, out
    assert len(rows) == 3, (len(rows), rows.action[:, 0].tolist())
    if space == 'joint_delta':
        np.testing.assert_allclose(rows.action, _wave_rows(3), atol=1e-6)


def test_run_with_max_actions_ending_mid_tick_makes_one_row_per_executed_step(tmp_path):
    """run() at 45 Hz (2/3 of a step a tick) with max_actions 7: 8 rows; rows 6 and 7 split the last increment."""
    from sequence_ai_ros.client import Observation, connect
    from sequence_ai_ros.worker import serve_policy_file

    wave = tmp_path / 'wave.py'
    wave.write_text(WAVE)
    capture = tmp_path / 'capture'
    save_settings(capture / 'wave', CaptureSettings(rate=1.0, enabled=True))
    robot = [START.copy()]

    def observe():
        return Observation(state=robot[0], state_names=NAMES, timestamp=time.monotonic())

    def act(a):
        robot[0] = np.array(a.values, np.float32)

    with serve_policy_file(wave, 'wave', capture_root=capture, action_space='joint_delta', chunk_length=300) \
            as server, connect('wave', endpoint=f'127.0.0.1:{server.port}') as policy:
        out = policy.run(observe, act, max_actions=7, control_period=1 / 45)
    if out.ticks_skipped:
        pytest.skip(f'the loaded machine overran {out.ticks_skipped} period(s): rows have gaps by design')
    [episode] = CaptureStore(capture / 'wave', 'wave').episodes()
    rows = build_rows(episode, 30.0, ActionSpace.JOINT_DELTA, 4, 4, [])
    assert out.actions == 7, out
    np.testing.assert_allclose(START + rows.action.astype(np.float64).sum(0), robot[0], atol=1e-5)
    assert len(rows) == 7, (len(rows), rows.action[:, 0].tolist())


def test_joint_delta_first_executed_tick_clamped_after_uncommanded_waits(tmp_path):
    """Joint delta first executed tick clamped after uncommanded waits.

    The robot commands nothing while waiting (report_command(None, hold_reason='waiting')), then clamps its
    first executed target (j0 held at 0.1): it never moved j0, but the ledger takes 'before' as the clamped
    target minus the policy's increment, so row 0 says j0 moved the whole increment (+5e-4).
    """
    limit = np.float32(0.1)

    def robot(i, a, policy, target):
        if a is None:
            return None
        if a.hold:
            policy.report_command(None, hold_reason='waiting')
            return None
        t = np.array(a.values, np.float32)
        clamped = bool(t[0] > limit)
        t[0] = min(t[0], limit)
        policy.report_command(t, clamped=clamped)
        return t

    rows, _, out, target, _ = _loop(tmp_path, robot=robot, n=40, begin=dict(control_period=1 / 30))
    np.testing.assert_allclose(START + rows.action.astype(np.float64).sum(0), target, atol=1e-5)


@pytest.mark.parametrize('dry', [range(10, 20), range(0, 3)], ids=['mid-episode', 'from-the-first-action'])
def test_joint_delta_dry_run_reported_with_its_values_keeps_rows_on_the_real_path(tmp_path, dry):
    """Joint delta dry run reported with its values keeps rows on the real path.

    report_command(values, hold_reason='dry_run') for the 10th to 19th actions (the command went to a dry-run
    topic, the controller got nothing): the ledger adopted each dry target as the robot's, so the rows missed
    the jump the robot makes when it goes live (rows sum 0.025 where the controller moved 0.035). A dry run
    from the episode's first action (a robot that begins disabled): the ledger took the last dry target for
    the robot's at its first executed command, and the rows missed the dry increments it jumps over (seen under
    load, when the first chunk came during the dry ticks).
    """
    fresh = [0]

    def robot(i, a, policy, target):
        if a is None or a.hold:
            return None
        fresh[0] += 1
        if fresh[0] - 1 in dry:
            policy.report_command(np.array(a.values), hold_reason='dry_run')
            return None
        return a.values

    rows, _, out, target, _ = _loop(tmp_path, robot=robot, n=40, begin=dict(control_period=1 / 30))
    assert fresh[0] > max(dry) + 1, (fresh[0], out)        # it went live after the dry run
    np.testing.assert_allclose(START + rows.action.astype(np.float64).sum(0), target, atol=1e-5)


@pytest.mark.parametrize('how', ['refused', 'dry_run'])
def test_joint_delta_after_an_uncommanded_tick_the_next_target_is_one_increment_on(tmp_path, how):
    """Joint delta after an uncommanded tick the next target is one increment on.

    report_command(None) on the 5th and 6th executed ticks (the robot's check refused them / a dry run): the
    robot's target stays; the next increment must be integrated onto it ('In joint_delta the next increment is
    integrated onto this target'). The engine integrates onto the refused targets instead, so the 7th tick jumps
    d5 + d6 + d7 (3x a step).
    """
    moves = []

    def robot(i, a, policy, target):
        if a is None or a.hold:
            return None
        moves.append((np.array(a.values, np.float64) - target, np.array(a.delta, np.float64)))
        if len(moves) in (5, 6):
            policy.report_command(None, hold_reason=how)
            return None
        return a.values

    _loop(tmp_path, robot=robot, n=30, begin=dict(control_period=1 / 30))
    jump, delta = moves[6]
    np.testing.assert_allclose(jump, delta, atol=1e-6,
                               err_msg='the 7th tick moves the robot by more than its increment')


@pytest.mark.parametrize('bad', ['nan', 'short'])
def test_joint_delta_report_command_refuses_a_bad_command(tmp_path, bad):
    """Joint delta report command refuses a bad command.

    report_command with a NaN target (or 3 values for 4 joints) is taken as is and fed back to the engine: the
    next next_action() returns NaN targets to the robot (or raises a bare numpy broadcasting ValueError on every
    later tick). A bad command must be refused when reported (a typed error), never integrated.
    """
    command = {'nan': [np.nan] * 4, 'short': [0.1, 0.2, 0.3]}[bad]
    seen, refused = [], []

    def robot(i, a, policy, target):
        if a is None or a.hold:
            return None
        seen.append(np.array(a.values, np.float64))
        if len(seen) == 5:
            try:
                policy.report_command(command)
            except Exception as exc:     # noqa: BLE001 - any refusal will do
                refused.append(exc)
            return None
        return a.values if np.isfinite(a.values).all() else None

    try:
        rows, log, out, target, _ = _loop(tmp_path, robot=robot, n=30, begin=dict(control_period=1 / 30))
    except ValueError as exc:
        pytest.fail(f'next_action() raised after report_command({command}) was accepted: {exc!r}')
    assert all(np.isfinite(v).all() for v in seen), (f'refused: {refused}; next_action returned',
                                                     [v[:2].tolist() for v in seen[3:8]])
    assert len(seen) > 6 and np.isfinite(rows.action).all(), (len(seen), out)


def test_the_legacy_fixture_still_exports(tmp_path):
    """Held up: a store written before spans existed still maps by round((t - t0) * fps) (kept as a guard)."""
    import shutil
    root = tmp_path / 'arm4'
    shutil.copytree(REPO / 'test' / 'fixtures' / 'legacy_store' / 'arm4', root)
    eps = {e.episode_id: e for e in CaptureStore(root, 'arm4').episodes()}
    rows = build_rows(eps['ep-one'], 10.0, ActionSpace.JOINT_ABSOLUTE, 4, 4, ['wrist'])
    assert len(rows) == 11 and not rows.skipped_frames
    np.testing.assert_array_equal(rows.action[0], (0.1 * np.sin(0.2 + np.arange(4))).astype(np.float32))
    assert math.isfinite(float(rows.action.sum()))
