"""Captured field data is exact: real recordings replayed, captured, exported, compared with what the robot did.

Real data (../shared/data): the WidowX-200 joint-state bag resampled to dt 0.2 s, replayed as joint_delta and
as ee_delta (``test/policies/delta_replay.py``), and the G1 ``g1_pick_bottle_v21`` episode 0 replayed as
joint_absolute at dt 1/30 s (``test/policies/client_replay.py``). A real worker serves them with capture on;
``Policy.act``, ``Policy.run`` and a self-paced ``Policy.next_action`` loop drive them at 1x, 2x and 2.5x the
policy rate; the store is exported as LeRobot v2.1 and read back with the project's reader. The harness
(robot, drivers, truth) is :mod:`sequence_ai_ros.bench.exactness`, shared with the exactness table
(``python -m sequence_ai_ros.bench exactness``).

For every case, each exported episode must hold:

- one row per policy step executed, none held (no underrun after the first chunk in these runs; were one
  to happen on a loaded machine, the rows that are not held must still be one per step); a row may be held
  only where no tick started in its step (an absolute next_action loop that missed a deadline);
- delta spaces: the cumulative sum of the rows' rate channels is the robot's commanded path at each row's
  end, within 1e-5 per channel (the robot moves to each tick's target over the tick's span of chunk steps:
  at 2.5x a row boundary falls inside a tick, which then counts in each row by the share of its span);
- position channels (joint_absolute, ee_delta's last channel): the command of the tick in effect at the
  row's start (the last tick whose span of chunk steps starts at or before the row's step);
- ``observation.state``: the observation the robot gave at that tick.

Everything is compared with the robot's own log of what it commanded at each tick and over which span of
chunk steps, never with the wall clock, so a late tick changes no expected value; no rate or latency is
asserted. Expected to fail on code that maps ticks to rows by robot time (2x and 2.5x).
"""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

from sequence_ai_ros.bench import exactness as ex

pytestmark = pytest.mark.slow

CASES = [(space, driver, m) for space in ex.SPACES for driver in ex.DRIVERS for m in ex.MULTIPLES]
ATOL, STATE_ATOL = ex.ACTION_ATOL, ex.STATE_ATOL


def _id(case: tuple[str, str, Fraction]) -> str:
    space, driver, m = case
    return f'{space}-{driver}-{float(m):g}x'


def _source(space: str, request: pytest.FixtureRequest, tmp_path: Path) -> tuple[ex.Source, int, int]:
    """(source, first recorded step, steps per episode) for ``space``, from the shared real data."""
    if space == 'joint_absolute':
        return ex.g1_source(request.getfixturevalue('g1_dataset')), ex.G1_STARTS[0], ex.G1_STEPS
    return ex.wx200_source(space, tmp_path, request.getfixturevalue('wx200_bag')), ex.WX_STARTS[0], ex.WX_STEPS


def check_exact(episode: ex.Episode) -> None:
    """Assert the module docstring's rules for one replayed, exported episode."""
    out, steps, robot = episode.outcome, episode.steps, episode.robot
    assert out.reason in ('completed', 'until'), out
    assert out.actions == steps == robot.steps, (out, robot.steps)
    want = ex.expected(episode)
    assert want.client_err <= ATOL, (f'the robot did not execute the recorded increments (max error '
                                     f'{want.client_err:.3g}): a client fault, not the capture\'s')
    rows = episode.rows
    assert rows is not None, f'episode {out.episode_id} was not exported: {episode.skipped}'
    n = len(rows.action)
    if out.underruns == 0 and (out.ticks_skipped == 0 or robot.by_clock):
        held = np.flatnonzero(rows.held[:steps] & ~want.gaps[:n]).tolist()
        assert n == steps and not held, (f'{n} rows for {steps} steps executed; held rows {held}; '
                                         f'{ex.score(episode)}')
        rows_of_steps = np.ones(n, bool)
    elif robot.by_clock:   # underruns
        pytest.skip(f'{out.underruns} underruns (a stalled machine): the robot cannot follow the engine\'s clock '
                    'across a dry spell in an absolute next_action loop')
    else:   # a loaded machine: an underrun, or periods the loop overran (held rows of the stall), then every step
        rows_of_steps = ~rows.held
        assert int(rows.held.sum()) <= out.ticks_held + out.ticks_skipped, (rows.held.sum(), out)
        extra = int(rows_of_steps.sum()) - steps
        if 0 < extra <= out.ticks_skipped:
            # A missed period shorter than a row (a tick of 0.5 steps at 2x, 0.4 at 2.5x) shifts the rest of the
            # robot's timeline by that fraction: rows are the robot's time, so absolute rows sample targets off
            # the steps and delta rows split increments across the shift, over one more, partial row.
            pytest.skip(f'{out.ticks_skipped} overran period(s) of a fraction of a row (a loaded machine): the '
                        f'rows follow a timeline shifted by it ({extra} more row)')
        assert extra == 0, f'{int(rows_of_steps.sum())} rows not held (of {n}) for {steps} steps'
    r = robot.source.rate_dims
    if r:
        np.testing.assert_allclose(np.cumsum(rows.action[:, :r].astype(np.float64), 0)[rows_of_steps], want.path,
                                   rtol=0, atol=ATOL,
                                   err_msg='the rows do not sum to the commanded path at each row\'s end')
    if rows.action.shape[1] > r:
        np.testing.assert_allclose(rows.action[rows_of_steps][:, r:], want.positions, rtol=0, atol=ATOL,
                                   err_msg='position channels differ from the command in effect at the row\'s start')
    np.testing.assert_allclose(rows.state[rows_of_steps], want.state, rtol=0, atol=STATE_ATOL,
                               err_msg='state differs from the observation of the tick in effect at the row\'s start')


@pytest.mark.parametrize('space,driver,multiple', CASES, ids=[_id(c) for c in CASES])
def test_exported_rows_are_the_steps_the_robot_executed(space, driver, multiple, request, tmp_path):
    source, first, steps = _source(space, request, tmp_path)
    [episode] = ex.replay(source, driver, multiple, [first], steps, tmp_path / 'replay')
    check_exact(episode)


def test_the_export_holds_the_rows_build_rows_makes_of_the_captured_episode(wx200_bag, tmp_path):
    """The rows read back from the LeRobot export are those build_rows makes of the captured episode.

    So the cases above, read through the export, check build_rows too. ee_delta through run() at 2x: two
    ticks a row, a rate and a position channel.
    """
    from sequence_ai_ros.capture.store import CaptureStore
    from sequence_ai_ros.datasets.rows import build_rows

    source = ex.wx200_source('ee_delta', tmp_path, wx200_bag)
    [episode] = ex.replay(source, 'run', Fraction(2), [ex.WX_STARTS[0]], ex.WX_STEPS, tmp_path / 'replay')
    [captured] = CaptureStore(tmp_path / 'replay' / 'capture' / ex.DEPLOYMENT, ex.DEPLOYMENT).episodes()
    assert captured.episode_id == episode.outcome.episode_id
    c = captured.contract
    built = build_rows(captured, round(1 / c.dt), c.action_space, len(c.observation.state_names),
                       len(c.action_names), [])
    assert episode.rows is not None
    np.testing.assert_array_equal(episode.rows.action, built.action)
    np.testing.assert_array_equal(episode.rows.state, built.state)
    np.testing.assert_array_equal(episode.rows.held, built.held)
