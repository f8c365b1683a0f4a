"""The client against a real worker on loopback: prefetch, cold start, reasons, interrupt, threads, history.

The worker serves ``test/policies/client_latency.py`` (a latency drawn from a configured distribution).
Its rows are ``[frame + i, request]`` for an observation at ``frame``; the robot below reports in
``frame`` how many actions it executed, so ``action.values[0] == index of that action`` checks that stale
rows are skipped by counting, on every action of every run.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from doubles import CountingRobot

from sequence_ai_ros.client import Observation, connect
from sequence_ai_ros.exceptions import (
    CaptureError,
    ConnectionLost,
    Unauthenticated,
    UnknownDeployment,
)


@pytest.mark.slow
def test_prefetch_keeps_the_buffer_full_and_closed_loop_underruns_every_chunk(serve):
    dt, t = 0.01, 100                                         # covers 1 s: a loaded machine's ~50 ms stalls stay small
    covers = dt * t
    mean = 0.35 * covers                                      # <= 40 % of covers_seconds, +-20 % jitter
    endpoint = serve(mean_s=mean, jitter=0.2, dt=dt, chunk_length=t, seed=1)
    results = {}
    with connect('lat', endpoint=endpoint) as policy:
        policy.wait_until_ready(timeout=30)
        for prefetch in (True, False):
            robot = CountingRobot()
            out = policy.run(robot.observe, robot.act, max_actions=500, prefetch=prefetch, on_underrun=robot.hold)
            results[prefetch] = out
            assert out.reason == 'completed' and out.actions == 500 == len(robot.actions)
            assert robot.misaligned() == []
            assert len(robot.holds) == out.underruns
    on, off = results[True], results[False]
    print(f'\nmean latency {mean * 1e3:.0f} ms = 0.35 covers_seconds (+-20 %), 500 actions:'
          f'\n  prefetch on : {on}  underruns={on.underruns} underrun_s={on.underrun_s:.3f} '
          f'p50={on.latency_p50_ms:.0f} ms p95={on.latency_p95_ms:.0f} ms stale={on.stale_actions}'
          f'\n  prefetch off: {off}  underruns={off.underruns} underrun_s={off.underrun_s:.3f}')
    # prefetch hides the round trip; a loaded machine may stretch one past the buffer (seen beside two CPU hogs:
    # one 46 ms hold), never into the closed loop's stall per chunk. Zero underruns here is make bench's figure.
    assert on.underruns <= off.underruns // 2 and on.underrun_s <= 0.25 * off.underrun_s
    assert off.underruns >= off.chunks - 1 and off.underruns >= 4   # one stall per chunk after the first
    assert off.underrun_s >= 0.8 * off.underruns * mean


def test_cold_start_runs_chunk_row_zero_and_a_cold_spike_does_not_inflate_prefetch(serve):
    endpoint = serve(mean_s=0.02, jitter=0.2, first_s=0.8, dt=0.01, chunk_length=25)
    robot = CountingRobot()
    with connect('lat', endpoint=endpoint) as policy:
        policy.max_in_flight = 1      # the prefetch lead of one request at a time (pipelining: test_client_pipeline)
        out = policy.run(robot.observe, robot.act, max_actions=150)
        stats = policy.stats()
    first = robot.actions[0]
    assert first.index == 0 and first.values.tolist() == [0.0, 1.0]  # chunk[0] of request 1, nothing skipped
    assert robot.misaligned() == []
    # An inflated lead (0.8 s > covers 0.25 s) would re-request at every arrival: ~2 actions per chunk (75
    # chunks); a healthy one uses most of each 25-action chunk. With fewer than 20 round trips the
    # nearest-rank p95 is their maximum, the cold one.
    assert out.chunks <= 19, out
    assert out.latency_p95_ms >= 800                                 # the spike is in the episode's numbers...
    assert stats['latency_p95_ms'] < 800                             # ...but not in the prefetch window
    assert stats['prefetch_lead_s'] < 0.8                            # nor in the lead it sets


def test_reasons_completed_until_timeout_validate_and_act_arguments(serve):
    endpoint = serve(mean_s=0.005, dt=0.01, chunk_length=20, done_after=3)
    with connect('lat', endpoint=endpoint) as policy:
        robot = CountingRobot()
        done = policy.act('pick', robot.observe, robot.act, max_seconds=10)
        assert done.reason == 'completed' and robot.misaligned() == []
        assert done.actions == len(robot.actions) and done.chunks == 3
        robot = CountingRobot()
        out = policy.run(robot.observe, robot.act, max_actions=30)
        assert out.reason == 'completed' and out.actions == 30
        robot = CountingRobot()
        until = policy.act('pick', robot.observe, robot.act, max_seconds=10, until=lambda: len(robot.actions) >= 7)
        assert until.reason == 'until' and len(robot.actions) == 7
        robot = CountingRobot()
        bad = policy.run(robot.observe, robot.act, max_actions=30, expect_action_space='joint_delta',
                         on_underrun=robot.hold)
        assert bad.reason == 'validate' and robot.actions == [] and len(robot.holds) == 1
        assert 'joint_absolute' in str(bad.error)
        with pytest.raises(TypeError):
            policy.act('pick', robot.observe, robot.act)             # max_seconds is required
        with pytest.raises(ValueError):
            policy.act('pick', robot.observe, robot.act, max_seconds=0)
        with pytest.raises(CaptureError, match='captur'):             # capture is off: a clear answer, not ok
            policy.label(True)
    endpoint = serve(mean_s=0.005, dt=0.01, chunk_length=20)
    with connect('lat', endpoint=endpoint) as policy:
        robot = CountingRobot()
        out = policy.act('pick', robot.observe, robot.act, max_seconds=0.3)
        assert out.reason == 'timeout' and 0.3 <= out.elapsed_s < 10.0 and robot.misaligned() == []   # ended by it
        assert policy.episode_outcome() is out                       # act() closed its episode


def test_act_pins_the_instruction_and_history_is_sent_at_dt(serve):
    endpoint = serve(mean_s=0.003, dt=0.01, chunk_length=10, history=3)
    robot = CountingRobot()
    with connect('lat', endpoint=endpoint) as policy:
        assert policy.contract.observation.history == 3
        out = policy.run(robot.observe, robot.act, max_actions=60, instruction='stack the cups')
    assert out.reason == 'completed'
    # Column 1 is how many frames the policy received: the full history of 3 from the first chunk on (the
    # first request waits for 3 real frames rather than sending fewer).
    counts = [int(a.values[1]) for a in robot.actions]
    assert counts[0] == 3 and counts[-1] == 3


def test_interrupt_from_another_thread_holds_before_its_next_action(serve):
    dt = 0.05
    endpoint = serve(mean_s=0.005, dt=dt, chunk_length=20)
    robot = CountingRobot()
    with connect('lat', endpoint=endpoint) as policy:
        stamp = {}

        def stop():
            # after a few actions: run() first waits for the deployment's load (its own process), however long
            deadline = time.monotonic() + 30
            while len(robot.actions) < 6 and time.monotonic() < deadline:
                time.sleep(0.01)
            stamp['t'] = time.monotonic()
            policy.interrupt()

        thread = threading.Thread(target=stop, name='test-interrupter')
        thread.start()
        out = policy.run(robot.observe, robot.act, max_actions=1000, on_underrun=robot.hold)
        thread.join(5)
    assert out.reason == 'interrupted' and out.actions >= 5
    # the next tick holds: one hold after the stop, no action after it (how soon is the loop's period, which a
    # loaded machine stretches; the test counts, never times)
    assert len(robot.holds) == 1 and robot.holds[0] > stamp['t'], (robot.holds, stamp)
    assert sum(1 for t in robot.act_times if t > stamp['t']) == 0      # no action after the stop


def test_two_threads_on_one_handle_raise_and_two_handles_both_work(serve):
    endpoint = serve(mean_s=0.005, dt=0.01, chunk_length=20)
    with connect('lat', endpoint=endpoint) as policy:
        robot = CountingRobot()
        errors: list[BaseException] = []
        inside = threading.Event()

        def act(action):
            inside.set()
            robot.act(action)

        runner = threading.Thread(target=lambda: policy.run(robot.observe, act, max_actions=150),
                                  name='test-loop-1')
        runner.start()
        assert inside.wait(10)
        with pytest.raises(RuntimeError, match='one Policy per control loop'):
            policy.run(CountingRobot().observe, CountingRobot().act, max_actions=5)
        with pytest.raises(RuntimeError, match='one Policy per control loop'):
            policy.next_action(robot.observe())
        runner.join(10)
        assert len(robot.actions) == 150 and not errors

    robots = [CountingRobot(), CountingRobot()]
    outcomes: dict[int, object] = {}

    def loop(i):
        with connect('lat', endpoint=endpoint) as p:
            outcomes[i] = p.run(robots[i].observe, robots[i].act, max_actions=120)

    threads = [threading.Thread(target=loop, args=(i,), name=f'test-robot-{i}') for i in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(20)
    assert [outcomes[i].reason for i in range(2)] == ['completed', 'completed']
    assert all(r.misaligned() == [] and len(r.actions) == 120 for r in robots)


def test_next_action_at_50hz_plays_a_30hz_policy_at_its_recorded_speed(serve):
    """A 50 Hz next_action loop on a 30 Hz chunk commands, at every tick, the row of the robot's place on the timeline.

    The loop passes its own clock as ``now``, 0.02 s a tick (a robot on simulated time), so the timeline moves
    0.6 rows a tick however late a loaded machine runs the ticks. The robot reports its place: 3.0 plus the
    rows it ran, 0.6 for each tick that played a row. A chunk answers a report ``place`` with rows
    ``place + i``; read at the rows that ran since that report (stale rows skipped by counting, never by
    estimating from time), it commands exactly the place the robot reports at each tick (past the chunk's
    last row: that row, held), through every seam: 30 rows per second of the caller's clock. A tick that would
    run past the playing chunk's end first waits (bounded) for the next chunk, so that the robot knows which
    chunk it ran; the underrun path is other tests'. (The speed of the loop itself is ``make bench``'s.)
    """
    dt, length, period = 1 / 30, 30, 0.02
    step = period / dt                                        # 0.6 rows a tick
    endpoint = serve(mean_s=0.08, jitter=0.5, dt=dt, chunk_length=length)     # 2 to 6 ticks: stale rows
    ticks: list[tuple[float, object]] = []                  # (the place the robot reported, the action)
    with connect('lat', endpoint=endpoint) as policy:
        policy.wait_until_ready(timeout=30)
        policy.begin_episode('pick', max_seconds=120.0, control_period=period)
        place, now = 3.0, time.monotonic()                   # it starts at 3.0, measured
        deadline = time.monotonic() + 60                     # bounded: three chunks and 60 actions, however slow
        while True:
            fresh = [a for _, a in ticks if not a.hold]
            if len(fresh) >= 60 and fresh[-1].chunk >= 2:
                break
            assert time.monotonic() < deadline, f'{len(fresh)} actions in 60 s: {policy.stats()}'
            prev = ticks[-1][1] if ticks else None
            if prev is not None and not prev.hold:
                place += step
                if prev.index + step > length - 1e-6:        # it would run out: wait for the next chunk
                    while policy.stats()['chunks'] <= prev.chunk + 1:
                        assert time.monotonic() < deadline, f'no chunk after chunk {prev.chunk}: {policy.stats()}'
                        time.sleep(0.005)
            a = policy.next_action(Observation(state=np.array([place, 0.0], np.float32)), now=now)
            ticks.append((place, a))
            now += period
            time.sleep(period)
        stats = policy.stats()
        out = policy.end_episode('interrupted')
        assert policy.end_episode() is out                               # idempotent
    first = ticks[0][1]
    assert first.hold and first.values.tolist() == [3.0, 0.0]           # holds the measured state, not zeros
    started = next(i for i, (_, a) in enumerate(ticks) if not a.hold)
    played = ticks[started:]
    assert not any(a.hold for _, a in played)                           # holds only before the first chunk
    commanded = np.array([a.values[0] for _, a in played])
    expected = [place - max(0.0, a.index - (length - 1)) for place, a in played]     # held past row T - 1
    np.testing.assert_allclose(commanded, expected, rtol=0, atol=1e-4)
    np.testing.assert_allclose(np.diff([place for place, _ in played]), step, rtol=0, atol=1e-9)
    chunks = [a.chunk for _, a in played]
    assert chunks == sorted(chunks) and chunks[-1] >= 2                  # a newer chunk replaces an older one only
    assert np.all(np.diff(commanded) >= 0)                              # never back, not even at a seam
    assert stats['chunks'] >= 3 and stats['underruns'] == 0 and out.reason == 'interrupted'
    assert out.actions >= int(played[-1][0] - 3.0)                      # every row the robot reached ran


def test_captured_episode_rows_are_the_executed_actions_and_it_takes_a_label(serve, tmp_path):
    """Capture at rate 1, default row rate (1/dt): one row per executed action, at k/fps, as act() got it.

    Plus the label, the scoreboard and the episode picture.
    """
    import pyarrow.parquet as pq

    from sequence_ai_ros.capture.settings import CaptureSettings, save_settings
    from sequence_ai_ros.capture.store import CaptureStore
    from sequence_ai_ros.datasets.lerobot_writer import export_lerobot
    from sequence_ai_ros.datasets.scoreboard import plot_episode, scoreboard

    save_settings(tmp_path / 'lat', CaptureSettings(rate=1.0, enabled=True))
    endpoint = serve(mean_s=0.003, dt=0.05, chunk_length=20, capture_root=tmp_path)
    robot = CountingRobot()
    with connect('lat', endpoint=endpoint) as policy:
        out = policy.run(robot.observe, robot.act, max_actions=60, instruction='wipe')
        assert policy.label(True, notes='clean').matched             # stored with the captured episode
        assert out.telemetry_rejected == 0
    store = CaptureStore(tmp_path / 'lat', deployment='lat')
    [episode] = store.episodes()
    assert episode.episode_id == out.episode_id and episode.instruction == 'wipe'
    assert episode.label['success'] is True and episode.stats['actions'] == 60 and episode.fps == 20
    res = export_lerobot(store, tmp_path / 'ds', lerobot_version='3.0', progress=False)
    rows = pq.read_table(tmp_path / 'ds/data/chunk-000/file-000.parquet').to_pydict()
    held = np.array(rows['action.held'])
    executed = np.array([a.values for a in robot.actions], np.float32)
    assert res['fps'] == 20 and res['frames'] == len(robot.actions) + int(held.sum()) == out.actions + int(held.sum())
    np.testing.assert_array_equal(np.array(rows['action'], np.float32)[~held], executed)
    np.testing.assert_allclose(rows['timestamp'], np.arange(res['frames']) / 20, atol=1e-6)
    [row] = scoreboard(store.runs())
    assert (row['episodes'], row['successes'], row['labelled']) == (1, 1, 1) and row['ended'] == {'completed': 1}
    assert row['latency_p95_ms'] and row['latency_p95_ms'] > 0
    png = plot_episode(store, out.episode_id, tmp_path / 'ep.png')
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b'\x89PNG'


def test_connect_endpoint_token_and_typed_errors(serve, monkeypatch):
    endpoint = serve(mean_s=0.0, dt=0.01, chunk_length=10, token='s3cret')
    monkeypatch.setenv('SEQ_ENDPOINT', endpoint)
    with connect('lat', token='s3cret') as policy:                  # endpoint from $SEQ_ENDPOINT
        assert policy.endpoint == endpoint and policy.contract.chunk_length == 10
        robot = CountingRobot()
        assert policy.run(robot.observe, robot.act, max_actions=12).actions == 12
        assert policy.ready() == (True, 0.0)
    with pytest.raises(Unauthenticated):
        connect('lat', token='wrong')
    with pytest.raises(UnknownDeployment):
        connect('nope', token='s3cret')
    start = time.monotonic()
    with pytest.raises(ConnectionLost):
        connect('lat', endpoint='127.0.0.1:9', timeout=0.5)         # nothing listens: bounded, typed
    assert time.monotonic() - start < 5


def test_run_at_a_caller_period_resamples_and_counts_chunk_steps(serve):
    endpoint = serve(mean_s=0.005, dt=1 / 30, chunk_length=30)
    commanded: list[float] = []

    def observe() -> Observation:
        return Observation(state=np.array([commanded[-1] if commanded else 0.0, 0.0], np.float32))

    with connect('lat', endpoint=endpoint) as policy:
        out = policy.run(observe, lambda a: commanded.append(float(a.values[0])), max_actions=60,
                         control_period=0.02)
    assert out.reason == 'completed' and out.actions == 60
    assert len(commanded) == 100                                       # 60 chunk steps at 0.6 steps per call
    steps = np.diff(commanded)
    assert steps.min() > -1e-3 and steps.max() < 0.6 + 1e-3           # interpolated: 0.6 rows per 20 ms call
    assert out.elapsed_s >= 99 * 0.02                                  # paced at the caller's period


def test_tls_with_a_root_certificate(serve, tmp_path):
    import shutil
    import subprocess

    if shutil.which('openssl') is None:
        pytest.skip('openssl CLI not found (needed to make a self-signed certificate)')
    cert, key = tmp_path / 'cert.pem', tmp_path / 'key.pem'
    subprocess.run(['openssl', 'req', '-x509', '-newkey', 'rsa:2048', '-nodes', '-days', '1', '-subj', '/CN=localhost',
                    '-addext', 'subjectAltName=DNS:localhost', '-keyout', str(key), '-out', str(cert)],
                   check=True, capture_output=True, timeout=60)
    endpoint = serve(mean_s=0.0, dt=0.01, chunk_length=10, tls=(cert, key))
    port = endpoint.rsplit(':', 1)[1]
    with connect('lat', endpoint=f'localhost:{port}', tls=cert) as policy:   # a PEM path as root certificate
        robot = CountingRobot()
        assert policy.run(robot.observe, robot.act, max_actions=15).actions == 15
    with pytest.raises(ConnectionLost):
        connect('lat', endpoint=f'localhost:{port}', timeout=1.0)            # plaintext to a TLS worker


def test_a_stall_across_max_actions_never_counts_steps_past_the_limit(serve):
    """A stall of 10 periods just before max_actions ends the episode at max_actions exactly.

    The stale rows are skipped, but the rows past the limit are never executed, so they are never counted
    (the node's field-data test once saw 76 of max_actions 75 after a long stall).
    """
    endpoint = serve(mean_s=0.005, dt=0.02, chunk_length=50)
    with connect('lat', endpoint=endpoint) as policy:
        policy.begin_episode('reach', max_actions=30, max_seconds=10, control_period=0.02)
        obs = Observation(state=np.zeros(2, np.float32))
        indices = []
        while policy.episode_outcome() is None:
            action = policy.next_action(obs)
            if action is not None and not action.hold:
                indices.append(action.index)
            time.sleep(0.2 if len(indices) == 25 else 0.02)     # the stall, 5 steps before the limit
        out = policy.end_episode()
    assert out.reason == 'completed' and out.actions == 30, out
    assert max(indices) < 30 and len(indices) < 30, indices         # the stall skipped rows, none past the limit
