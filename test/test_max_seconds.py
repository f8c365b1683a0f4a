"""``max_seconds`` is honoured against a slow policy: act()/run() return soon after it, and the worker ends at once.

A real worker on loopback serves ``test/policies/slow_episodes.py`` (seconds per inference, an on_episode
hook, a per-episode count of the inferences begun). At EpisodeEnd the worker drops the episode's queued
requests (never started), leaves a running inference to finish and discards its chunk, and answers
EpisodeEnded without waiting for it: the outcome says the worker confirmed. The waits asserted are generous
bounds; the overshoot itself is a figure of ``make bench`` (bench_max_seconds).
"""

from __future__ import annotations

import threading
import time

import pytest
from doubles import CountingRobot
from test_worker_support import POLICIES, wait_for

from sequence_ai_ros.client import connect
from sequence_ai_ros.exceptions import EpisodeStateError
from sequence_ai_ros.worker import serve_policy_file
from sequence_ai_ros.worker.scheduler import InferenceScheduler

SLOW = POLICIES / 'slow_episodes.py'
#: act()/run() return within this of max_seconds here (s): a generous bound for a loaded machine. Before the
#: worker acted on EpisodeEnd at once, the client waited out its 2 s for EpisodeEnded against these policies:
#: ``worker_confirmed`` (EpisodeEnded within those 2 s) is the assertion that tells.
SLACK_S = 5.0


@pytest.fixture
def slow():
    """``slow(**kw)`` serves slow_episodes.py as 'slow' and returns the server; stopped at teardown."""
    servers = []

    def start(**kwargs):
        server = serve_policy_file(SLOW, deployment='slow', host='127.0.0.1', port=0, isolation='none',  # reads the
                                   **kwargs)                                                            # instance
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop(grace=0.5)


def _timed(fn, *args, **kwargs):
    t0 = time.monotonic()
    out = fn(*args, **kwargs)
    return out, time.monotonic() - t0


@pytest.mark.slow
def test_act_returns_at_max_seconds_while_an_inference_runs_and_its_chunk_is_discarded(slow, tmp_path):
    # The first chunk comes fast and plays 1 s; the next inference takes 4 s and is running at max_seconds.
    server = slow(latency_s=4.0, first_s=0.05, capture_root=tmp_path)
    runtime = server.runtimes['slow']
    endpoint = f'127.0.0.1:{server.port}'
    robot = CountingRobot()
    with connect('slow', endpoint=endpoint) as policy:
        policy.wait_until_ready(timeout=30)
        out, elapsed = _timed(policy.act, 'pick', robot.observe, robot.act, max_seconds=2.0,
                              on_underrun=robot.hold)
        instance = runtime._instance.policy
        assert instance.hooks == []            # EpisodeEnded did not wait for the hook behind the running inference
    assert out.reason == 'timeout' and out.worker_confirmed, out
    assert elapsed <= 2.0 + SLACK_S, elapsed
    assert out.chunks == 1 and out.actions == len(robot.actions) > 0 and robot.misaligned() == []
    # The inference running at the end finishes; its chunk was neither sent nor served; none started after.
    wait_for(lambda: instance.hooks, timeout=10, what='the on_episode hook')
    assert instance.begun == {out.episode_id: 2} and instance.finished == {out.episode_id: 2}
    assert instance.hooks == [(out.episode_id, 'timeout', 2)]
    assert runtime.end_stats() == {'requests_dropped_at_end': 0, 'results_discarded_at_end': 1,
                                   'inferences_started_after_end': 0}
    assert server.usage()['slow'].requests == 1                  # chunks served: the first one only
    # The worker heard the reason and the robot's counts.
    [run] = [r for r in runtime.capture_store.runs() if r['episode_id'] == out.episode_id]
    assert (run['reason'], run['actions'], run['underruns']) == ('timeout', out.actions, out.underruns)


def test_a_queued_request_of_an_ended_episode_never_starts(slow):
    # One inference thread, 3 s per call: robot B's first request queues behind robot A's and B ends first.
    server = slow(latency_s=3.0)
    runtime = server.runtimes['slow']
    endpoint = f'127.0.0.1:{server.port}'
    results: dict[str, tuple] = {}
    robot_a, robot_b = CountingRobot(), CountingRobot()
    with connect('slow', endpoint=endpoint) as policy_a, connect('slow', endpoint=endpoint) as policy_b:
        policy_a.wait_until_ready(timeout=30)
        instance = runtime._instance.policy
        driver = threading.Thread(target=lambda: results.update(a=_timed(
            policy_a.run, robot_a.observe, robot_a.act, max_seconds=1.5, episode_id='robot-a')))
        driver.start()
        try:
            wait_for(lambda: instance.begun.get('robot-a'), what="robot A's inference")
            results['b'] = _timed(policy_b.act, 'pick', robot_b.observe, robot_b.act, max_seconds=0.5,
                                  episode_id='robot-b')
        finally:
            driver.join(timeout=10)
    for name, max_s in (('a', 1.5), ('b', 0.5)):
        out, elapsed = results[name]
        assert out.reason == 'timeout' and out.worker_confirmed and out.chunks == 0, out
        assert elapsed <= max_s + SLACK_S, (name, elapsed)
    wait_for(lambda: len(instance.hooks) == 2, timeout=10, what='both hooks')
    assert instance.begun == {'robot-a': 1}                   # B's queued request was dropped, never started
    assert sorted(instance.hooks) == [('robot-a', 'timeout', 1), ('robot-b', 'timeout', 0)]
    assert runtime.end_stats() == {'requests_dropped_at_end': 1, 'results_discarded_at_end': 1,
                                   'inferences_started_after_end': 0}


def test_scheduler_drops_an_ended_episodes_queued_requests_and_lets_the_running_one_finish():
    gate = threading.Event()
    begun: list[str] = []

    def call(name):
        def fn():
            begun.append(name)
            gate.wait(5)
            return name
        return fn

    ended = {'a': False, 'b': False}
    sched = InferenceScheduler('t')
    try:
        running = sched.submit('a', call('a'), ended=lambda: ended['a'])
        wait_for(lambda: begun == ['a'], what='a running')
        queued = sched.submit('b', call('b'), ended=lambda: ended['b'])
        skipped = sched.submit('c', call('c'), ended=lambda: True)    # its end came before the thread got to it
        ended['a'] = ended['b'] = True
        assert sched.drop('b') == 1 and sched.drop('a') == 0 and sched.inferring
        with pytest.raises(EpisodeStateError, match='dropped'):
            queued.result(5)
        gate.set()
        assert running.result(5)[0] == 'a'                      # left to finish (its caller discards it)
        with pytest.raises(EpisodeStateError, match='dropped'):
            skipped.result(5)
        assert sched.submit('b', call('b2')).result(5)[0] == 'b2'   # the key is free again (a new episode)
    finally:
        sched.stop()
    assert begun == ['a', 'b2']
    assert sched.stats() == {'requests_dropped_at_end': 2, 'inferences_started_after_end': 0}


def test_a_batch_leaves_out_a_request_whose_episode_ended_while_it_filled():
    batches: list[list[str]] = []

    def batch_call(payloads):
        batches.append(list(payloads))
        return payloads

    ended = {'a': False, 'b': False}
    sched = InferenceScheduler('t', batching=(4, 0.3, batch_call))
    try:
        fa = sched.submit('a', lambda: None, payload='a', ended=lambda: ended['a'])
        fb = sched.submit('b', lambda: None, payload='b', ended=lambda: ended['b'])
        ended['b'] = True                                       # b's end arrives while the batch fills
        assert fa.result(5)[0] == 'a'
        with pytest.raises(EpisodeStateError, match='dropped'):
            fb.result(5)
    finally:
        sched.stop()
    assert batches == [['a']]
    assert sched.stats() == {'requests_dropped_at_end': 1, 'inferences_started_after_end': 0}
