"""next_action() as the seed writes it: the first call opens the episode; close/interrupt/idle timeout end it.

Against a real worker on loopback (``test/policies/client_latency.py``: rows ``[frame + i, request]``).
"""

from __future__ import annotations

import time

import pytest
from doubles import CountingRobot

from sequence_ai_ros.client import connect
from sequence_ai_ros.exceptions import EpisodeStateError


def loop(policy, robot: CountingRobot, ticks: int, period: float = 0.01) -> None:
    """The seed's loop, verbatim but bounded: ``robot.act(policy.next_action(observe()))``."""
    for _ in range(ticks):
        action = policy.next_action(robot.observe())
        if action is not None and not action.hold:
            robot.act(action)
        time.sleep(period)


def test_the_seed_loop_runs_as_written_and_close_ends_its_episode(serve):
    endpoint = serve(dt=0.01, chunk_length=20)
    robot = CountingRobot()
    policy = connect('lat', endpoint=endpoint)
    policy.wait_until_ready(timeout=30)
    loop(policy, robot, 60)                            # no begin_episode(): the first call opened one
    stats = policy.stats()
    assert stats['chunks'] >= 1 and len(robot.actions) > 10
    assert policy.episode_outcome() is None            # still running
    policy.close()
    out = policy.episode_outcome()
    assert out is not None and out.reason == 'interrupted' and out.episode_id == stats['episode_id']
    with pytest.raises(EpisodeStateError, match='closed'):
        policy.next_action(robot.observe())


def test_interrupt_ends_the_implicit_episode_and_the_next_call_opens_another(serve):
    endpoint = serve(dt=0.01, chunk_length=20)
    with connect('lat', endpoint=endpoint) as policy:
        policy.wait_until_ready(timeout=30)
        robot = CountingRobot()
        loop(policy, robot, 30)
        first = policy.stats()['episode_id']
        policy.interrupt()
        assert policy.episode_outcome().reason == 'interrupted'
        robot2 = CountingRobot()
        loop(policy, robot2, 30)
        second = policy.stats()['episode_id']
        assert second != first and policy.episode_outcome() is None and len(robot2.actions) > 5
        assert robot2.actions[0].values[0] == 0.0     # a fresh timeline: the new episode starts at row 0
        # end_episode() ends it too; the next call opens a third one.
        assert policy.end_episode().reason == 'completed'
        loop(policy, CountingRobot(), 5)
        assert policy.stats()['episode_id'] not in (first, second)


def test_the_workers_idle_timeout_ends_it_and_the_loop_goes_on(serve):
    endpoint = serve(dt=0.01, chunk_length=20, idle_timeout_s=0.4)
    with connect('lat', endpoint=endpoint) as policy:
        policy.wait_until_ready(timeout=30)
        loop(policy, CountingRobot(), 20)
        first = policy.stats()['episode_id']
        deadline = time.monotonic() + 10
        while policy.episode_outcome() is None and time.monotonic() < deadline:
            time.sleep(0.05)                          # the robot pauses: no message reaches the worker
        out = policy.episode_outcome()
        assert out is not None and out.reason == 'error' and 'idle_timeout' in str(out.error)
        robot = CountingRobot()
        loop(policy, robot, 30)
        assert policy.stats()['episode_id'] != first and len(robot.actions) > 5


def test_an_episode_begun_explicitly_keeps_holding_once_finished(serve):
    endpoint = serve(dt=0.01, chunk_length=20)
    with connect('lat', endpoint=endpoint) as policy:
        policy.wait_until_ready(timeout=30)
        eid = policy.begin_episode('pick', max_actions=5)
        robot = CountingRobot()
        loop(policy, robot, 40)
        out = policy.episode_outcome()              # max_actions counts chunk steps on the clock
        assert out.reason == 'completed' and out.actions >= 5 and 1 <= len(robot.actions) <= 5
        assert policy.stats()['episode_id'] == eid     # no new episode: the caller ends it
        held = policy.next_action(robot.observe())
        assert held is not None and held.hold


def test_the_round_trips_carry_over_to_the_next_implicit_episode(serve):
    """One round-trip window per connection: every episode next_action() opens measures into it and starts from it."""
    endpoint = serve(mean_s=0.05, dt=0.01, chunk_length=20)
    with connect('lat', endpoint=endpoint) as policy:
        policy.wait_until_ready(timeout=30)
        robot = CountingRobot()
        deadline = time.monotonic() + 20
        while len(policy.latency.samples()) < 2 and time.monotonic() < deadline:
            loop(policy, robot, 1)                      # the first call opened the episode
        first = policy.end_episode()
        assert first.chunks >= 3
        policy.next_action(CountingRobot().observe())   # opens the next one, its first request just sent
        stats = policy.stats()
        # Its round-trip figures are the first episode's (warm ones: a fresh window would report none
        # before two of its own answers, 0.1 s away).
        assert stats['episode_id'] != first.episode_id and stats['latency_p50_ms'] > 0
        robot = CountingRobot()
        deadline = time.monotonic() + 20
        while policy.stats()['chunks'] < 2 and time.monotonic() < deadline:
            loop(policy, robot, 1)
        second = policy.end_episode()
        assert second.chunks >= 2
        # Every answer of both episodes is in the one window; only the connection's first was the cold one.
        assert len(policy.latency.samples()) == first.chunks + second.chunks - 1


def test_a_loop_on_its_own_grid_reads_its_counts_from_the_ledger(serve):
    """start_ticks/hold_tick/end_ticks and stats(): the ledger counts every deadline, the node's way.

    The loop begins the episode at deadline 100 of its own grid, holds twice without asking (before its
    first request), asks at every other deadline (a dry run's tick is held: it commanded nothing), skips
    three, and ends at deadline 150: the live counts and the outcome's cover the 50 deadlines once.
    """
    endpoint = serve(dt=0.01, chunk_length=20)
    with connect('lat', endpoint=endpoint) as policy:
        policy.wait_until_ready(timeout=30)
        policy.begin_episode('pick', max_seconds=30)
        policy.start_ticks(100)
        robot = CountingRobot()
        assert policy.hold_tick(101, 'waiting') and policy.hold_tick(102, 'waiting')
        dry = 0
        for k in [*range(103, 120), *range(123, 140)]:
            action = policy.next_action(robot.observe(), grid_index=k)
            if action is not None and not action.hold and k % 2:
                policy.report_command(None, hold_reason='dry_run')
                dry += 1
            time.sleep(0.01)
        live = policy.stats()
        through = live['ticks_grid_index']                    # a hold the tick did not report commits at the next
        assert through in (138, 139), live
        assert live['commands_sent'] + live['ticks_held'] + live['ticks_skipped'] == through - 100, live
        assert live['ticks_skipped'] == 3 and live['ticks_held'] >= 2 + dry, live
        policy.end_ticks(150)
        assert not policy.hold_tick(145, 'ended')             # counted already (skipped): not twice
        out = policy.end_episode()
        assert out.commands_sent + out.ticks_held + out.ticks_skipped == 50, out
        assert out.ticks_skipped == 3 + 11 and dry > 0 and out.commands_sent > 0, out
        assert not policy.hold_tick(151, 'ended')             # the episode is over: nothing to count
