"""interrupt() from another thread stops what the handle is doing, or is about to do, in every phase.

A real worker on loopback serves ``test/policies/client_latency.py`` (rows ``[frame + i, request]``; ``load_s``
makes the deployment warm for a while, ``stall_at``/``stall_s`` hang one request). A second thread presses
``interrupt()`` when a phase is reached; the tests then count what the robot was given after ``interrupt()``
returned (an act() already under way when it was pressed is allowed for) and read the reason. They count and
order, never time: how soon the stop lands is the loop's period, which a loaded machine stretches.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest
from doubles import CountingRobot

from sequence_ai_ros.client import connect

#: A deployment that loads for 2 s; the stop is pressed 0.5 s into act()/run() or wait_until_ready().
LOAD_S = 2.0
#: Chunks of 20 rows at 20 ms: a chunk plays for 0.4 s.
DT, T = 0.02, 20


class Interrupter:
    """Presses ``policy.interrupt()`` on its own thread once ``when()`` is true; ``after`` is the time it returned."""

    def __init__(self, policy, when: Callable[[], bool], bound_s: float = 30.0) -> None:
        self.after: float | None = None
        self._policy, self._when, self._bound = policy, when, bound_s
        self._thread = threading.Thread(target=self._run, name='test-interrupter', daemon=True)

    def _run(self) -> None:
        deadline = time.monotonic() + self._bound
        while not self._when() and time.monotonic() < deadline:
            time.sleep(0.002)
        self._policy.interrupt()
        self.after = time.monotonic()

    def __enter__(self) -> Interrupter:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._thread.join(35.0)
        assert self.after is not None, 'the interrupter never pressed'


def _acts_after(robot: CountingRobot, stamp: float | None) -> int:
    """The act() calls that began after ``stamp`` (interrupt() had returned)."""
    assert stamp is not None
    return sum(1 for t in robot.act_times if t > stamp)


def _elapsed(start: float, seconds: float) -> Callable[[], bool]:
    return lambda: time.monotonic() - start >= seconds


# -- act()/run() --------------------------------------------------------------------------------------------


@pytest.mark.parametrize('call', ['run', 'act'])
def test_an_interrupt_while_the_deployment_warms_ends_act_and_run_before_the_arm_moves(serve, call):
    endpoint = serve(isolation='none', load_s=LOAD_S, dt=DT, chunk_length=T)
    robot = CountingRobot()
    with connect('lat', endpoint=endpoint) as policy:
        assert policy.ready()[0] is False                         # the handshake started the 2 s load
        with Interrupter(policy, _elapsed(time.monotonic(), 0.5)) as stop:
            if call == 'run':
                out = policy.run(robot.observe, robot.act, max_actions=None, max_seconds=4.0, on_underrun=robot.hold)
            else:
                out = policy.act('reach', robot.observe, robot.act, max_seconds=4.0, on_underrun=robot.hold)
        assert (out.reason, out.actions, out.error) == ('interrupted', 0, None), out
        assert robot.actions == [] and _acts_after(robot, stop.after) == 0
        assert len(robot.holds) == 1                              # hold fired once, as for any interrupt
        # the stop was the call's own: the next run() on the handle runs its episode in full
        robot = CountingRobot()
        out = policy.run(robot.observe, robot.act, max_actions=10)
        assert (out.reason, out.actions) == ('completed', 10), out


def _phase_run(policy, robot: CountingRobot, phase: str) -> tuple[object, Interrupter]:
    """run() with an interrupt at ``phase``; return (outcome, interrupter)."""
    prefetch = phase != 'no_prefetch'
    when = {
        'mid_chunk': lambda: len(robot.actions) >= T // 2 + 3,
        'between_chunks': lambda: len(robot.actions) >= T,        # the first chunk's last row has run
        'stall': lambda: len(robot.holds) >= 1,                   # an underrun: the hung request
        'no_prefetch': lambda: len(robot.holds) >= 1,             # the closed loop's wait at its first seam
    }[phase]
    with Interrupter(policy, when) as stop:
        out = policy.run(robot.observe, robot.act, max_actions=None, max_seconds=20.0, prefetch=prefetch,
                         on_underrun=robot.hold)
    return out, stop


@pytest.mark.parametrize('phase', ['mid_chunk', 'between_chunks', 'stall', 'no_prefetch'])
def test_an_interrupt_ends_run_in_every_phase_with_no_action_after_it(serve, phase):
    stall = dict(stall_at=2, stall_s=5.0) if phase == 'stall' else {}
    latency = 0.2 if phase == 'no_prefetch' else 0.005                  # the closed loop waits 0.2 s per seam
    endpoint = serve(isolation='none', mean_s=latency, dt=DT, chunk_length=T, **stall)
    robot = CountingRobot()
    with connect('lat', endpoint=endpoint) as policy:
        policy.wait_until_ready(timeout=30)
        policy.max_in_flight = 1
        out, stop = _phase_run(policy, robot, phase)
    assert out.reason == 'interrupted' and out.error is None, out
    assert _acts_after(robot, stop.after) == 0, (robot.act_times, stop.after)
    assert out.actions == len(robot.actions) and robot.misaligned() == []
    if phase in ('mid_chunk', 'between_chunks'):
        assert len(robot.actions) >= T // 2 and len(robot.holds) == 1, (out, robot.holds)
    else:                                       # the arm already held (the underrun): no second hold
        assert len(robot.holds) == 1, (out, robot.holds)


# -- next_action() loops ------------------------------------------------------------------------------------


class Loop:
    """A self-paced loop on the test's thread: next_action() every ``period``; each call's start, action, outcome."""

    def __init__(self, policy, robot: CountingRobot, period: float = DT) -> None:
        self.policy, self.robot, self.period = policy, robot, period
        self.calls: list[tuple[float, object, object]] = []

    def run(self, until: Callable[[], bool], bound_s: float = 30.0) -> None:
        deadline = time.monotonic() + bound_s
        while not until() and time.monotonic() < deadline:
            self.step()
            time.sleep(self.period)

    def step(self):
        started = time.monotonic()
        action = self.policy.next_action(self.robot.observe())
        if action is not None and not action.hold:
            self.robot.act(action)
        self.calls.append((started, action, self.policy.episode_outcome()))
        return action

    def after(self, stamp: float | None) -> list[tuple[float, object, object]]:
        assert stamp is not None
        return [c for c in self.calls if c[0] > stamp]


@pytest.mark.parametrize('phase', ['mid_chunk', 'stall', 'no_prefetch'])
def test_an_interrupt_ends_a_next_action_loops_episode_and_the_next_call_holds(serve, phase):
    stall = dict(stall_at=2, stall_s=5.0) if phase == 'stall' else {}
    endpoint = serve(isolation='none', mean_s=0.2 if phase == 'no_prefetch' else 0.005, dt=DT, chunk_length=T,
                     **stall)
    robot = CountingRobot()
    with connect('lat', endpoint=endpoint) as policy:
        policy.wait_until_ready(timeout=30)
        if phase == 'no_prefetch':
            policy.begin_episode('reach', prefetch=False, control_period=DT)     # begun: the caller's to end
        loop = Loop(policy, robot)
        when = {'mid_chunk': lambda: len(robot.actions) >= T // 2 + 3,
                'stall': lambda: len(robot.actions) >= T and loop.calls[-1][1].hold,
                'no_prefetch': lambda: len(robot.actions) >= T and loop.calls[-1][1].hold}[phase]
        with Interrupter(policy, when) as stop:
            loop.run(lambda: stop.after is not None and len(loop.after(stop.after)) >= 2)
        first, second = loop.after(stop.after)[:2]
        assert first[1] is not None and first[1].hold, first                    # the interrupted episode's hold
        assert first[2] is not None and first[2].reason == 'interrupted', first
        assert _acts_after(robot, stop.after) == 0
        if phase == 'no_prefetch':                     # a begun episode holds until end_episode()
            assert second[1].hold and second[2].reason == 'interrupted'
            assert policy.end_episode().reason == 'interrupted'
        else:                                          # one the loop opened: the call after opens the next
            assert second[2] is None and policy.stats()['episode_id'] != first[2].episode_id


@pytest.mark.parametrize('then', ['next_action', 'end_episode'])
def test_an_interrupt_during_wait_until_ready_ends_the_episode_the_loop_opens_next(serve, then):
    """The stop is kept for the episode the loop opens next; end_episode() drops it instead."""
    endpoint = serve(isolation='none', load_s=LOAD_S, dt=DT, chunk_length=T)
    robot = CountingRobot()
    with connect('lat', endpoint=endpoint) as policy:
        assert policy.ready()[0] is False
        with Interrupter(policy, _elapsed(time.monotonic(), 0.5)) as stop:
            policy.wait_until_ready(timeout=30)          # waits out the load: the stop is for what follows
        assert policy.ready()[0] is True and stop.after is not None
        loop = Loop(policy, robot)
        if then == 'end_episode':
            assert policy.end_episode() is None          # no episode to end; the kept stop is dropped
            out = policy.run(robot.observe, robot.act, max_actions=10)
            assert (out.reason, out.actions) == ('completed', 10), out
            return
        action = loop.step()                             # opens the episode, which the stop ends at once
        out = policy.episode_outcome()
        assert action is not None and action.hold and out is not None, (action, out)
        assert (out.reason, out.actions) == ('interrupted', 0), out
        stopped = out.episode_id
        loop.run(lambda: len(robot.actions) >= 5)        # the next call opens a fresh episode, which runs
        assert policy.episode_outcome() is None and policy.stats()['episode_id'] != stopped
        assert len(robot.actions) >= 5 and robot.actions[0].values[0] == 0.0


# -- a stop with nothing to stop --------------------------------------------------------------------------------


def test_an_interrupt_with_no_loop_and_no_episode_does_nothing_later(serve):
    endpoint = serve(isolation='none', dt=DT, chunk_length=T)
    with connect('lat', endpoint=endpoint) as policy:
        policy.wait_until_ready(timeout=30)
        policy.interrupt()                                 # nothing runs, nothing is under way: a no-op
        robot = CountingRobot()
        out = policy.run(robot.observe, robot.act, max_actions=10)
        assert (out.reason, out.actions) == ('completed', 10), out
        policy.interrupt()                                 # after run() returned: a no-op again
        robot = CountingRobot()
        loop = Loop(policy, robot)
        loop.run(lambda: len(robot.actions) >= 5)
        assert policy.episode_outcome() is None and len(robot.actions) >= 5
        assert all(c[2] is None for c in loop.calls)       # the loop's episode was never stopped
        assert policy.end_episode().reason == 'completed'
