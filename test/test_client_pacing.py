"""The act()/run() pacer keeps one grid from the episode's start: every control period is served or skipped.

The identity the node keeps and ``RunOutcome`` reports: commands_sent + ticks_held + ticks_skipped = the
episode's control periods. A :class:`Pacer` given a scripted clock is driven through overruns of fractional
periods and its counts are checked exactly; a real run() whose act() overruns checks the identity on the
outcome (a count against the episode's own elapsed time, never a rate).
"""

from __future__ import annotations

import math
import random
import time

import pytest
from doubles import CountingRobot

from sequence_ai_ros.client import connect
from sequence_ai_ros.client.pacing import Pacer


class ScriptedClock:
    """A monotonic clock that moves only when the code under test sleeps or the test says work took time."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += max(0.0, seconds)

    def work(self, seconds: float) -> None:
        self.now += seconds


def _pacer(period: float, clock: ScriptedClock) -> Pacer:
    return Pacer(period, spin=False, clock=clock, sleep=clock.sleep)


def test_overruns_of_fractional_periods_are_skipped_on_the_grid_and_counted_exactly():
    """Period 0.25 s; each tick's work in s (exact binary fractions), then the deadline the next tick serves."""
    clock = ScriptedClock()
    pacer = _pacer(0.25, clock)
    start = clock.now
    script = [            # work after the tick (s), the index of the deadline the next tick serves, skipped so far
        (0.125, 1, 0),    # on time: sleeps to deadline 1
        (0.3125, 2, 0),   # 0.0625 s late for deadline 2 (less than a period): fires at once, nothing skipped
        (0.625, 4, 1),    # 0.4375 s past deadline 3: skips it, fires at once for deadline 4 (0.1875 s old)
        (0.0625, 5, 1),   # back on the grid: deadline 5 comes as the work ends
        (1.125, 9, 4),    # past 6, 7 and 8: three skipped, the tick serves 9
        (0.1875, 10, 4),  # 0.0625 s late for 10
        (0.5625, 12, 5),  # past 11, 0.125 s into 12's period
    ]
    served = [0]
    for work, index, skipped in script:
        clock.work(work)
        woke = pacer.wait()
        served.append(pacer.served_k)
        assert (pacer.served_k, pacer.skipped) == (index, skipped), (work, served)
        assert woke == start + index * 0.25 <= clock.now                # the deadline served, never ahead of time
        assert pacer.index_at(clock.now) == index                       # the tick is in its own period
    assert pacer.ticks == len(script)                                   # every wait served one deadline
    # the identity: served (the first tick included) + skipped = the deadlines up to the last one served
    assert len(served) + pacer.skipped == served[-1] + 1 == 13
    assert clock.now - start == 3.125                                   # 12.5 periods: the 13th is under way


@pytest.mark.parametrize('rate_hz, work_s', [(30.0, 0.120), (50.0, 0.030), (100.0, 0.0137), (15.0, 0.0701)])
def test_a_steady_overrun_counts_every_period_at_every_rate(rate_hz, work_s):
    """A callback slower than the period at every tick: ticks + skipped = the periods elapsed, within one."""
    period = 1.0 / rate_hz
    clock = ScriptedClock()
    pacer = _pacer(period, clock)
    start = clock.now
    ticks = 1
    for _ in range(200):
        clock.work(work_s)
        pacer.wait()
        ticks += 1
        elapsed_periods = (clock.now - start) / period
        assert abs(ticks + pacer.skipped - elapsed_periods) < 1.0 + 1e-9, (ticks, pacer.skipped, elapsed_periods)
        assert ticks + pacer.skipped == pacer.served_k + 1
    # 120 ms at 30 Hz is 3.6 periods: 200 ticks span 720 periods (the re-anchoring pacer counted 600)
    assert ticks + pacer.skipped == pytest.approx(1 + 200 * work_s / period, abs=1.0)


def test_random_work_never_bunches_and_never_loses_a_period():
    """Random work from 0 to 3.5 periods (seeded): each tick serves a later deadline, none is lost or doubled."""
    rng = random.Random(7)
    period = 0.02
    clock = ScriptedClock()
    pacer = _pacer(period, clock)
    start = clock.now
    served = [0]
    for _ in range(2000):
        clock.work(rng.uniform(0.0, 3.5) * period)
        pacer.wait()
        served.append(pacer.served_k)
        assert served[-1] > served[-2]                                  # one tick per deadline, in order
        assert clock.now - (start + served[-1] * period) < period + 1e-9  # never a deadline a period old
    assert len(served) + pacer.skipped == served[-1] + 1
    assert abs(len(served) + pacer.skipped - (clock.now - start) / period) < 1.0


def test_a_wake_serves_the_next_deadline_early_and_the_grid_stays():
    """A wake (a chunk arriving while nothing plays) ends a wait early, for the next deadline.

    The deadline after it keeps its place on the grid, so the early tick adds no period.
    """
    import threading

    clock = ScriptedClock()
    wake = threading.Event()

    arrived = []

    def sleep(seconds: float) -> None:
        clock.sleep(min(seconds, 0.004))
        if clock.now >= start + 0.013 and not arrived:
            arrived.append(clock.now)
            wake.set()                     # the chunk arrives some 13 ms into the first 20 ms period

    start = clock.now
    pacer = Pacer(0.02, wake=wake, spin=False, clock=clock, sleep=sleep)
    woke = pacer.wait()
    assert woke == arrived[0] < start + 0.02 and pacer.ticks == 0 and pacer.served_k == -1   # early: none served
    wake.clear()
    assert pacer.wait() == pytest.approx(start + 0.04, abs=1e-12)                # deadline 2, on the grid
    assert pacer.skipped == 0 and pacer.served_k == 2


def test_run_with_an_overrunning_act_accounts_for_every_period(serve):
    """A real run() whose act() takes 1.7 control periods: commands + held + skipped = its periods, within one."""
    period = 0.02
    endpoint = serve(isolation='none', mean_s=0.002, dt=period, chunk_length=50)
    robot = CountingRobot()

    def act(action) -> None:
        robot.act(action)
        time.sleep(1.7 * period)

    with connect('lat', endpoint=endpoint) as policy:
        policy.wait_until_ready(timeout=30)
        out = policy.run(robot.observe, act, max_actions=40)
    assert out.reason == 'completed' and out.actions == 40 == len(robot.actions), out
    assert out.commands_sent == 40 and out.ticks_skipped >= 20, out      # each act() missed at least one period
    counted = out.commands_sent + out.ticks_held + out.ticks_skipped
    periods = out.elapsed_s / period
    assert abs(counted - periods) <= 1.0, (counted, periods, out)
    assert math.isfinite(periods)
