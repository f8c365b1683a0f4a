"""Captured field data stays exact under disturbance: real recordings replayed late, dry and overrun.

The replays of ``test/test_capture_exactness.py`` (the WidowX-200 bag as joint_delta and ee_delta at dt 0.2 s,
the G1 dataset as joint_absolute at dt 1/30 s; a real worker with capture on, exported as LeRobot v2.1 and read
back), disturbed (:data:`sequence_ai_ros.bench.exactness.DISTURBANCES`, seeded draws):

- ``latency``: a latency-shaped worker, the replay policy sleeps 0.5-1.2 chunk durations per call: chunks land
  late and the arm runs dry, for a fraction of a step or more;
- ``seam``: the worker answers when the playing chunk runs out, +-0.25 step: late seams (a chunk landing just
  after the tick that ran the old one's end, at 12.5 Hz a tick crosses it) and short dry spells;
- ``overrun``: an overrunning ``act()`` callback, 1 call in 8 takes 1.5-2.5 control periods: the next tick is
  late, or its deadline is skipped (a gap of half a step at 2x, 0.4 at 2.5x).

For every exported episode (see :func:`sequence_ai_ros.bench.exactness.disturbed_score`):

- the client reports the steps the robot ran (no tick's increments dropped), and the robot ran the recorded
  increments;
- one row not held per step executed, in order, and no more held rows than ticks that held or periods
  skipped (held rows stand where the robot held: a dry spell, a skipped deadline);
- delta spaces: the cumulative sum of all rows' rate channels (a held row adds nothing) at each step's row is
  the robot's commanded path at that step's end, within 1e-5; position channels and ``observation.state``:
  those of the tick in effect at the step's start.

The reference is the robot's own log, never the clock: no rate or latency is asserted. Every case at 2x and
2.5x failed on the engine before its timeline kept spans on the executed steps (a delta fragment dropped at a
late seam; rows slipping after a gap worth a fraction of a step).
"""

from __future__ import annotations

import math
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

from sequence_ai_ros.bench import exactness as ex

pytestmark = pytest.mark.slow

ATOL, STATE_ATOL = ex.ACTION_ATOL, ex.STATE_ATOL
EPISODES = 2
DISTURBANCES = {d.name: d for d in ex.DISTURBANCES}
#: An absolute chunk starts at its observation's step, which may lie between two row boundaries (its rows are
#: targets on its own grid of steps). When it runs dry there, the step it ends in is split around the held
#: rows: one more row that is not held than steps executed; the rows after it stay on the policy's steps.
ABSOLUTE_DRY_MID_STEP = pytest.mark.xfail(strict=False, reason='an absolute chunk that runs dry between two row '
                                                               'boundaries splits that step around its held rows')


def _case(space: str, driver: str, m: Fraction, disturbance: str, *marks: pytest.MarkDecorator) -> object:
    return pytest.param(space, driver, m, disturbance, marks=marks,
                        id=f'{space}-{driver}-{float(m):g}x-{disturbance}')


CASES = [
    # whole-step gaps (1x): a dry spell or a skipped period is whole steps, held rows of their own
    _case('joint_delta', 'run', Fraction(1), 'latency'),
    _case('ee_delta', 'act', Fraction(1), 'overrun'),
    # gaps worth a fraction of a step (10 Hz, 12.5 Hz), late seams (12.5 Hz)
    _case('joint_delta', 'act', Fraction(2), 'overrun'),
    _case('ee_delta', 'next_action', Fraction(2), 'latency'),
    _case('ee_delta', 'run', Fraction(5, 2), 'seam'),
    _case('joint_delta', 'next_action', Fraction(5, 2), 'seam'),
    _case('joint_absolute', 'run', Fraction(2), 'overrun'),
    _case('joint_absolute', 'act', Fraction(5, 2), 'latency', ABSOLUTE_DRY_MID_STEP),
]


def _source(space: str, request: pytest.FixtureRequest, tmp_path: Path) -> tuple[ex.Source, tuple[int, ...], int]:
    """(source, first recorded steps, steps per episode) for ``space``, from the shared real data."""
    if space == 'joint_absolute':
        return ex.g1_source(request.getfixturevalue('g1_dataset')), ex.G1_STARTS, ex.G1_DISTURBED_STEPS
    source = ex.wx200_source(space, tmp_path, request.getfixturevalue('wx200_bag'))
    return source, ex.WX_DISTURBED_STARTS, ex.WX_DISTURBED_STEPS


def check_disturbed(episode: ex.Episode) -> None:
    """Assert the module docstring's rules for one disturbed, exported episode."""
    out, robot = episode.outcome, episode.robot
    assert out.reason in ('completed', 'until'), out
    assert robot.ticks, f'the robot executed nothing: {out}'
    if robot.by_clock and out.underruns:
        pytest.skip(f'{out.underruns} underruns: an absolute next_action loop follows the clock across a dry spell')
    assert out.actions >= episode.steps, out
    assert math.floor(float(robot.steps) + ex.STEP_EPS) == out.actions, (
        f'the client reported {out.actions} steps executed, the robot ran {float(robot.steps):g}: a tick\'s '
        'increments were dropped or counted twice')
    want = ex.expected(episode)
    assert want.client_err <= ATOL, (f'the robot did not execute the recorded increments (max error '
                                     f'{want.client_err:.3g}): a client fault, not the capture\'s')
    rows = episode.rows
    assert rows is not None, f'episode {out.episode_id} was not exported: {episode.skipped}'
    steps = ex.step_rows(episode)
    extra = rows.held & ~steps
    score = ex.disturbed_score(episode)
    assert int(steps.sum()) == out.actions, (
        f'{int(steps.sum())} rows not held (of {len(rows.held)}) for {out.actions} steps executed; '
        f'{int(extra.sum())} held; {score}')
    bound = out.ticks_held + out.ticks_skipped
    assert int(extra.sum()) <= bound, (f'{int(extra.sum())} held rows for {out.ticks_held} ticks held and '
                                       f'{out.ticks_skipped} periods skipped; {score}')
    n = min(int(steps.sum()), episode.steps)
    r = robot.source.rate_dims
    if r:
        got = np.cumsum(rows.action[:, :r].astype(np.float64), 0)[steps][:n]
        np.testing.assert_allclose(got, want.path[:n], rtol=0, atol=ATOL,
                                   err_msg='the rows do not sum to the commanded path at each step\'s end')
    if rows.action.shape[1] > r:
        np.testing.assert_allclose(rows.action[steps][:n, r:], want.positions[:n], rtol=0, atol=ATOL,
                                   err_msg='position channels differ from the command in effect at the step\'s start')
    np.testing.assert_allclose(rows.state[steps][:n], want.state[:n], rtol=0, atol=STATE_ATOL,
                               err_msg='state differs from the observation of the tick in effect at the step\'s start')


@pytest.mark.parametrize('space,driver,multiple,disturbance', CASES)
def test_disturbed_rows_are_the_steps_the_robot_executed(space, driver, multiple, disturbance, request, tmp_path):
    source, starts, steps = _source(space, request, tmp_path)
    episodes = ex.replay(source, driver, multiple, starts[:EPISODES], steps, tmp_path / 'replay',
                         disturbance=DISTURBANCES[disturbance])
    for episode in episodes:
        check_disturbed(episode)


def test_the_disturbances_disturb(wx200_bag, tmp_path):
    """The latency-shaped worker runs the arm dry and the overrunning act() skips deadlines (counts only).

    A round trip of 0.5-1.2 chunk durations outruns the prefetch at least once in 30 steps; a call drawn over two
    periods skips a deadline. So a disturbed case that passes has been disturbed. ee_delta through run() at 2x,
    one episode each.
    """
    source = ex.wx200_source('ee_delta', tmp_path, wx200_bag)
    first = ex.WX_DISTURBED_STARTS[:1]
    [dry] = ex.replay(source, 'run', Fraction(2), first, ex.WX_DISTURBED_STEPS, tmp_path / 'latency',
                      disturbance=DISTURBANCES['latency'])
    [late] = ex.replay(source, 'run', Fraction(2), first, ex.WX_DISTURBED_STEPS, tmp_path / 'overrun',
                       disturbance=DISTURBANCES['overrun'])
    assert dry.outcome.underruns >= 1, dry.outcome
    overrun = late.robot.overrun
    assert overrun is not None and overrun.count >= 1
    # a call that took over two periods let a whole deadline's period pass: skipped, whatever the machine's load
    missed = sum(1 for u in overrun.drawn if u > 1.0)
    assert missed >= 1 and late.outcome.ticks_skipped >= missed, (overrun.drawn, late.outcome)
