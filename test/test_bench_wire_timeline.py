"""The wire timeline (``python -m sequence_ai_ros.bench.wire_timeline``): steps from points, and a short real run.

No figure is checked (a benchmark's numbers live in ``make bench``): only that each step is found, in order.
"""

from __future__ import annotations

import pytest

from sequence_ai_ros.bench import wire_timeline as tl


def test_steps_are_the_medians_between_consecutive_points_and_a_round_missing_one_is_skipped():
    order = ('asked', 'packed', 'reply read', 'done')
    points = [('packed', 110), ('reply read', 150),            # round 1: 100 .. 170
              ('packed', 230), ('reply read', 290),            # round 2: 200 .. 300
              ('packed', 330)]                                 # round 3: 300 .. 400, no reply read: skipped
    rounds = [(100, 170), (200, 300), (300, 400)]
    got = tl.steps(order, points, rounds)
    assert got == {'packed': pytest.approx(0.02), 'reply read': pytest.approx(0.05), 'done': pytest.approx(0.015),
                   tl.WIRE_AND_SERVER: pytest.approx(0.05)}


def test_a_short_run_finds_every_step_of_ours_and_of_the_floors():
    result = tl.run(n=30)
    assert set(result) == {'ours', 'floor (stream)', 'floor + hop'}
    assert set(result['ours']) == {*tl.OURS_ORDER[1:], tl.WIRE_AND_SERVER, 'round trip'}
    for floor in ('floor (stream)', 'floor + hop'):
        assert set(result[floor]) == {'packed', 'done', tl.WIRE_AND_SERVER, 'round trip'}
    assert all(value >= 0 for steps in result.values() for value in steps.values())
