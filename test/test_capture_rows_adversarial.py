"""Break-it round 3 probes (helper brk3): joint_delta capture, rows, ids across replicas, runs."""
from __future__ import annotations

import time

import numpy as np
import pytest
from test_node_capture_rows import START, _run_node_episode, run_and_export
from test_node_support import RAMP

from sequence_ai_ros.datasets.rows import build_rows
from sequence_ai_ros.protocol.spaces import ActionSpace

NAMES = ('j0', 'j1', 'j2', 'j3')


def _api_delta(tmp_path, *, rate_hz, seconds, limit=None, refuse=(), report_every=False, max_actions=10_000,
               jitter=0.0, late=(), seed=0, report_holds=False):
    """A Python-API joint_delta robot loop: next_action at rate_hz (30 Hz policy), robot clamp on j0 at limit."""
    from sequence_ai_ros.capture.settings import CaptureSettings, save_settings
    from sequence_ai_ros.capture.store import CaptureStore
    from sequence_ai_ros.client import Observation, connect
    from sequence_ai_ros.worker import serve_policy_file

    rng = np.random.default_rng(seed)
    period = 1 / rate_hz
    capture = tmp_path / 'capture'
    save_settings(capture / 'ramp', CaptureSettings(rate=1.0, enabled=True))
    robot = np.array([0.1, 0.2, 0.3, 0.4], np.float32)
    start = robot.copy()
    log = []
    with serve_policy_file(RAMP, 'ramp', capture_root=capture, names=list(NAMES), step=0.001,
                           action_space='joint_delta') as server, \
            connect('ramp', endpoint=f'127.0.0.1:{server.port}') as policy:
        policy.wait_until_ready()
        policy.begin_episode('reach', max_actions=max_actions, control_period=period, prefetch=False)
        t = time.monotonic()
        for i in range(int(seconds * rate_hz)):
            ts = t + (rng.uniform(0, jitter * period) if jitter else 0.0) + (0.7 * period if i in late else 0.0)
            a = policy.next_action(Observation(state=robot, state_names=NAMES, timestamp=ts), now=ts)
            if policy.episode_outcome() is not None:
                break
            if a is None:
                pass
            elif a.hold:
                if report_holds:
                    policy.report_command(robot.copy())     # the robot repeats its last target
            elif i in refuse:
                policy.report_command(None)                  # the robot's own check refused this tick: it held
            else:
                target = np.array(a.values, np.float32)
                clamped = limit is not None and target[0] > limit
                if clamped:
                    target[0] = limit
                if clamped or report_every:
                    policy.report_command(target, clamped=clamped)
                robot = target
            log.append(robot.copy())
            time.sleep(0.003)
            t += period
        policy.end_episode()
    [episode] = CaptureStore(capture / 'ramp', 'ramp').episodes()
    rows = build_rows(episode, 30.0, ActionSpace.JOINT_DELTA, 4, 4, [])
    return rows, start, robot, episode


@pytest.mark.parametrize('kw', [
    dict(rate_hz=50.0, seconds=3.0, limit=np.float32(0.13)),
    dict(rate_hz=50.0, seconds=3.0, limit=np.float32(0.13), refuse=set(range(20, 140, 7))),
    dict(rate_hz=50.0, seconds=3.0, limit=np.float32(0.13), report_every=True, report_holds=True),
    dict(rate_hz=30.0, seconds=3.0, limit=np.float32(0.13), refuse=set(range(10, 80, 5)), max_actions=70),
    dict(rate_hz=47.0, seconds=3.0, limit=np.float32(0.12), jitter=0.3, refuse={30, 31, 32}),
    dict(rate_hz=20.0, seconds=3.0, limit=np.float32(0.13), report_every=True, refuse={15, 16}),
    dict(rate_hz=30.0, seconds=3.0, limit=np.float32(0.13), late={20, 40, 41, 60}),
    dict(rate_hz=50.0, seconds=3.0, limit=np.float32(0.13), max_actions=45, refuse={30, 31}),
    dict(rate_hz=47.0, seconds=3.0, limit=np.float32(0.125), max_actions=37, jitter=0.5, report_every=True),
    dict(rate_hz=100.0, seconds=2.0, limit=np.float32(0.13), max_actions=41, refuse=set(range(50, 60))),
])
def test_api_joint_delta_rows_sum_to_the_robot(tmp_path, kw):
    rows, start, robot, _ = _api_delta(tmp_path, **kw)
    np.testing.assert_allclose(start + rows.action.astype(np.float64).sum(0), robot, atol=1e-5)


@pytest.mark.ros
@pytest.mark.parametrize('rate_hz,toggle,max_step,stalls', [
    (30.0, set(range(20, 35)), None, None),
    (30.0, set(range(20, 35)), 0.0005, None),
    (50.0, set(range(20, 45)), 0.0005, {60: 0.2}),
    (35.0, set(range(1, 15)), 0.0008, {50: 0.15}),   # dry from the start, then enabled
    (47.0, set(range(30, 50)), None, {20: 0.25, 70: 0.1}),
    (15.0, set(range(10, 14)), 0.0005, {25: 0.3}),
])
def test_node_joint_delta_rows_sum_to_the_controller_with_dry_toggles(tmp_path, rate_hz, toggle, max_step, stalls):
    from sequence_ai_ros.node.config import SafetyConfig
    kw = dict(lower_limits=(-5.0,) * 4, upper_limits=(5.0,) * 4)
    if max_step is not None:
        kw['max_step'] = (max_step,)
    rows, result, tick, sent, _ = _run_node_episode(tmp_path, rate_hz=rate_hz, seconds=3.0, space='joint_delta',
                                                    safety=SafetyConfig(**kw), toggle=toggle, stalls=stalls, step=0.002)
    commands = np.array([v for _, fresh, v, _ in sent if fresh])
    start = np.array([0.1, 0.2, 0.3, 0.4])
    np.testing.assert_allclose(start + rows.action.astype(np.float64).sum(0), commands[-1], atol=1e-5)


def _fast_obs():
    from test_data_worker import NAMES as FNAMES

    from sequence_ai_ros.client import Observation
    return Observation(state=np.zeros(26, np.float32), state_names=FNAMES)


def test_next_action_loop_reused_id_outcome_says_not_captured(tmp_path):
    """next_action() loop under a captured id: episode_outcome() and end_episode() both say it is not kept."""
    from test_data_worker import FAST

    from sequence_ai_ros.capture.settings import CaptureSettings, save_settings
    from sequence_ai_ros.client import connect
    from sequence_ai_ros.worker import serve_policy_file

    root = tmp_path / 'capture'
    save_settings(root / 'fast', CaptureSettings(rate=1.0, enabled=True))
    with serve_policy_file(FAST, 'fast', capture_root=root) as server:
        outs = []
        for _ in range(2):
            with connect('fast', endpoint=f'127.0.0.1:{server.port}') as p:
                p.wait_until_ready()
                p.begin_episode('reach', episode_id='Y', max_actions=10, control_period=1 / 30)
                t = time.monotonic()
                for _ in range(200):
                    p.next_action(_fast_obs(), now=t)
                    if p.episode_outcome() is not None:
                        break
                    time.sleep(1 / 30)
                    t += 1 / 30
                live = p.episode_outcome()
                ended = p.end_episode()
                outs.append((live, ended))
    (l1, e1), (l2, e2) = outs
    assert e1.capture_error == '' and 'already captured' in e2.capture_error, e2
    assert 'already captured' in l2.capture_error, ('episode_outcome() after completion', l2)


def _replica(root, hold_s, reason, q):
    from sequence_ai_ros.capture.store import CaptureStore
    store = CaptureStore(root, 'dep')
    try:
        ep = store.begin('ep-1', 'pick')
    except Exception as exc:     # noqa: BLE001 - the answer under test
        q.put(f'refused: {exc}')
        return
    q.put('captured' if ep is not None else 'none')
    time.sleep(hold_s)
    if ep is not None:
        ep.commit(reason, {'actions': 1})


def test_two_replicas_sharing_a_store_capture_one_id_once(tmp_path):
    """Replicas sharing a store capture one id once (README: 'every episode once').

    Replica A is still capturing ep-1 when the robot's reconnect lands on B: B does not capture it.
    """
    import multiprocessing as mp
    import sqlite3
    import subprocess
    import sys

    from sequence_ai_ros.capture.settings import CaptureSettings, save_settings
    from sequence_ai_ros.capture.store import CaptureStore

    root = tmp_path / 'dep'
    save_settings(root, CaptureSettings(rate=1.0, enabled=True))
    CaptureStore(root, 'dep').status()
    ctx = mp.get_context('spawn')
    q = ctx.Queue()
    a = ctx.Process(target=_replica, args=(root, 3.0, 'completed', q))
    a.start()
    assert q.get(timeout=30) == 'captured'
    b = ctx.Process(target=_replica, args=(root, 0.0, 'interrupted', q))
    b.start()
    second = q.get(timeout=30)
    a.join(30)
    b.join(30)
    dirs = sorted(p.name for p in (root / 'episodes').iterdir())
    before = sqlite3.connect(root / 'store.db').execute('SELECT dir, reason FROM episodes').fetchall()
    subprocess.run([sys.executable, '-c', f'from sequence_ai_ros.capture.store import CaptureStore; '
                    f'CaptureStore({str(root)!r}, "dep").episodes()'], check=True, timeout=60)
    after = sqlite3.connect(root / 'store.db').execute('SELECT dir, reason FROM episodes').fetchall()
    assert before == after, (before, after)      # what the export sees must not change when a process opens it
    assert second != 'captured' and len(dirs) == 1, (second, dirs)


def test_a_rerun_of_a_captured_id_keeps_the_captured_runs_record(tmp_path):
    """An uncaptured rerun of a captured id keeps the captured run's record (seq policy stats reads it).

    README: 'Every episode the worker ran is recorded (captured or not)'; a label names the id.
    """
    from test_data_rows import _contract

    from sequence_ai_ros.capture.settings import CaptureSettings, save_settings
    from sequence_ai_ros.capture.store import CaptureStore
    from sequence_ai_ros.datasets.scoreboard import scoreboard
    from sequence_ai_ros.worker.capture_hook import EpisodeRecorder

    root = tmp_path / 'dep'
    save_settings(root, CaptureSettings(rate=1.0, enabled=True))
    store = CaptureStore(root, 'dep')
    first = EpisodeRecorder(store, 'trial-1', 'pick', _contract(), version=1)
    assert first.active and first.commit('completed', {'actions': 300, 'latency_p95_ms': 20})
    store.label('trial-1', True)
    again = EpisodeRecorder(store, 'trial-1', 'pick', _contract(), version=2)   # a reconnect, or a reused id
    assert not again.active and 'already captured' in again.not_captured
    again.commit('error', {'actions': 4, 'underruns': 9, 'latency_p95_ms': 900})
    runs = [(r['version'], r['reason'], r['captured'], r['success']) for r in store.runs()]
    assert (1, 'completed', 1, True) in runs, runs
    board = scoreboard(store.runs())
    assert any(r['version'] == 1 and r['successes'] == 1 for r in board), board


@pytest.mark.parametrize('times', [
    [0.0, 0.033, 0.067, 0.1, 0.133, 0.250, 0.283, 0.300, 0.333, 0.367, 0.4],            # 1 ms clock
    [0.0, 0.0333, 0.0667, 0.1, 0.1333, 0.250, 0.2833, 0.300, 0.3333, 0.3667, 0.4],      # 0.1 ms clock
])
def test_a_quantised_clock_never_moves_a_record_off_its_deadline(tmp_path, times):
    """A coarse robot clock (1 ms or 0.1 ms) and late ticks: all 11 executed steps export, one row each.

    The records are placed by the deadline they served: no time is rounded.
    """
    from test_data_rows import _contract, _episode, _frame
    from test_data_support import make_store
    store = make_store(tmp_path / 's')
    frames = [_frame(t, np.full(3, i), np.full(3, 10 + i), span=(i, i, i + 1)) for i, t in enumerate(times)]
    _, ep = _episode(store, 'e', _contract(dt=1 / 30), frames)
    rows = build_rows(ep, 30, ActionSpace.JOINT_ABSOLUTE, 3, 3, [])
    np.testing.assert_array_equal(rows.action[:, 0], np.arange(10, 21))
    assert not rows.held.any()


def test_concurrent_starts_of_one_id_do_not_pause_capture(tmp_path):
    """Two simultaneous starts of one id: one captures, the other is told; the store never pauses.

    Seen through the real worker before (4 of 15 trials: 'paused', 'FileExistsError ... staging/<pid>-<id>').
    """
    import threading

    from test_data_rows import _contract

    from sequence_ai_ros.capture.settings import CaptureSettings, save_settings
    from sequence_ai_ros.capture.store import CaptureStore
    from sequence_ai_ros.worker.capture_hook import EpisodeRecorder

    root = tmp_path / 'dep'
    save_settings(root, CaptureSettings(rate=1.0, enabled=True))
    store = CaptureStore(root, 'dep')
    store.status()
    paused = []
    for trial in range(40):
        barrier = threading.Barrier(2)
        recs = []

        def go(barrier=barrier, recs=recs, trial=trial):
            barrier.wait()
            recs.append(EpisodeRecorder(store, f'Z{trial}', 'pick', _contract()))

        ts = [threading.Thread(target=go) for _ in range(2)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(10)
        for r in recs:
            r.commit('completed', {})
        st = store.status()
        if st['state'] == 'paused':
            paused.append((trial, st['diagnostic']))
    assert not paused, paused[:2]


@pytest.mark.parametrize('space', ['joint_absolute', 'joint_delta'])
@pytest.mark.parametrize('seed', [1, 2, 3])
def test_run_loop_with_overruns_exports_every_act(tmp_path, space, seed):
    """run() at the row rate; act() overruns now and then (0.3 to 2.5 periods): rows == what act() received."""
    rng = np.random.default_rng(seed)
    sleeps = {int(i): float(rng.uniform(0.3, 2.5)) for i in rng.choice(np.arange(5, 85), 10, replace=False)}
    rows, got = run_and_export(tmp_path, space, max_actions=90, overruns=sleeps)
    if space == 'joint_absolute':
        np.testing.assert_array_equal(rows.action[~rows.held], got, err_msg=f'held {np.flatnonzero(rows.held)}')
    else:
        np.testing.assert_allclose(START + np.cumsum(rows.action, 0)[-1], got[-1], atol=1e-5)
        assert (~rows.held).sum() == len(got), ((~rows.held).sum(), len(got), np.flatnonzero(rows.held))


@pytest.mark.parametrize('rate_hz,late_p', [(30.0, 0.0), (30.0, 0.15), (30.0, 0.3), (15.0, 0.2)])
def test_next_action_loop_rows_are_the_commands(tmp_path, rate_hz, late_p):
    """A next_action() loop with some ticks late 0.3-0.95 of a period: every command keeps its rows, in order.

    Its own Pacer-like schedule, time.monotonic() stamps, joint_absolute; the tick after a late one on time.
    Each command covers its period: one row at 30 Hz, two at 15 Hz (a 30 Hz policy's rows).
    """
    from sequence_ai_ros.capture.settings import CaptureSettings, save_settings
    from sequence_ai_ros.capture.store import CaptureStore
    from sequence_ai_ros.client import Observation, connect
    from sequence_ai_ros.worker import serve_policy_file

    rng = np.random.default_rng(7)
    period = 1 / rate_hz
    capture = tmp_path / 'capture'
    save_settings(capture / 'ramp', CaptureSettings(rate=1.0, enabled=True))
    robot = np.array([0.1, 0.2, 0.3, 0.4], np.float32)
    sent = []
    with serve_policy_file(RAMP, 'ramp', capture_root=capture, names=list(NAMES), step=0.001,
                           action_space='joint_absolute') as server, \
            connect('ramp', endpoint=f'127.0.0.1:{server.port}') as policy:
        policy.wait_until_ready()
        policy.begin_episode('reach', max_actions=10_000, control_period=period)
        start = time.monotonic()
        for k in range(int(3 * rate_hz)):
            late = rng.uniform(0.3, 0.95) if (k > 5 and rng.random() < late_p) else 0.0
            deadline = start + (k + late) * period
            while time.monotonic() < deadline:
                time.sleep(0.0005)
            now = time.monotonic()
            a = policy.next_action(Observation(state=robot, state_names=NAMES, timestamp=now), now=now)
            if a is not None and not a.hold:
                robot = np.array(a.values, np.float32)
                sent.append(robot)
        policy.end_episode()
    [episode] = CaptureStore(capture / 'ramp', 'ramp').episodes()
    rows = build_rows(episode, 30.0, ActionSpace.JOINT_ABSOLUTE, 4, 4, [])
    ex = rows.action[~rows.held]
    per = int(round(30.0 / rate_hz))
    want = np.repeat(np.array(sent), per, axis=0)
    assert len(ex) == len(want) and np.array_equal(ex, want), (len(ex), len(want),
                                                               np.flatnonzero(rows.held).tolist())


@pytest.mark.ros
@pytest.mark.parametrize('rate_hz', [15.0, 30.0, 35.0, 47.0, 50.0])
def test_node_rows_with_late_wakeups_and_stalls_are_the_ticks_on_their_deadlines(tmp_path, rate_hz):
    from test_node_capture_rows import _rows_by_span_rule
    rng = np.random.default_rng(int(rate_hz))
    late = {i: float(x) for i, x in enumerate(rng.uniform(0.2, 0.9, 400)) if i % 3 == 0 and i not in (40, 80)}
    stalls = {40: 0.2, 80: 0.12, 100: 0.05}
    rows, result, tick, sent, _ = _run_node_episode(tmp_path, rate_hz=rate_hz, seconds=4.0, stalls=stalls,
                                                    late=late, step=0.01)
    want, want_held = _rows_by_span_rule(sent, rate_hz)
    assert len(rows) == len(want), (len(rows), len(want))
    diff = np.flatnonzero(np.any(rows.action != want, axis=1) | (rows.held != want_held))
    assert diff.size == 0, (f'{rate_hz} Hz: rows {diff.tolist()[:12]} differ (held got '
                            f'{np.flatnonzero(rows.held).tolist()} want {np.flatnonzero(want_held).tolist()})')

