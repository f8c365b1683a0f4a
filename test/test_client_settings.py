"""EpisodeSettings (one definition of the episode options) and what an episode reports about itself.

Against a real worker on loopback (``test/policies/client_latency.py``, 0 ms).
"""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path

import numpy as np
import pytest
from doubles import CountingRobot

from sequence_ai_ros.client import connect
from sequence_ai_ros.client.sampling import TelemetrySample
from sequence_ai_ros.client.settings import (
    CHECKS,
    MAX_CONTROL_PERIOD_S,
    MAX_PREFETCH_MARGIN,
    MIN_CONTROL_PERIOD_S,
    EpisodeSettings,
)
from sequence_ai_ros.protocol.spaces import ActionSpace
from sequence_ai_ros.worker import serve_policy_file

LATENCY_POLICY = Path(__file__).parent / 'policies' / 'client_latency.py'


@pytest.fixture
def endpoint():
    server = serve_policy_file(LATENCY_POLICY, deployment='lat', host='127.0.0.1', port=0)
    yield f'127.0.0.1:{server.port}'
    server.stop(grace=0.5)


def test_settings_are_validated_once_on_construction():
    s = EpisodeSettings(instruction='pick', max_seconds=2, smooth_seam=3, expect_action_space='joint_delta')
    assert s.expect_action_space is ActionSpace.JOINT_DELTA and s.smooth_seam == 3 and s.prefetch
    with pytest.raises(TypeError, match='max_seconds'):
        EpisodeSettings(max_seconds=True)
    with pytest.raises(TypeError, match='chunk_timeout'):
        EpisodeSettings(chunk_timeout='5')
    for name in ('max_seconds', 'max_actions', 'control_period', 'chunk_timeout'):
        for bad in (0, -1.0, math.inf, math.nan):
            with pytest.raises(ValueError, match=name):
                EpisodeSettings(**{name: bad})
    with pytest.raises(ValueError, match='smooth_seam'):
        EpisodeSettings(smooth_seam=-1)
    with pytest.raises(ValueError, match='unknown action_space'):
        EpisodeSettings(expect_action_space='teleport')
    with pytest.raises(TypeError, match='instruction'):
        EpisodeSettings(instruction=None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.max_seconds = 3


@pytest.mark.parametrize('kwargs, error, match', [
    ({'prefetch': 'false'}, TypeError, 'prefetch must be True or False'),
    ({'prefetch': None}, TypeError, 'prefetch'),
    ({'smooth_seam': -0.5}, TypeError, 'smooth_seam must be an int'),
    ({'smooth_seam': 2.7}, TypeError, 'smooth_seam'), ({'smooth_seam': True}, TypeError, 'smooth_seam'),
    ({'smooth_seam': '3'}, TypeError, 'smooth_seam'), ({'smooth_seam': math.nan}, TypeError, 'smooth_seam'),
    ({'smooth_seam': None}, TypeError, 'smooth_seam'), ({'max_actions': 1.5}, ValueError, 'whole number'),
    ({'expect_action_space': 3}, TypeError, 'expect_action_space must be an ActionSpace or its name'),
    ({'control_period': 1e-9}, ValueError, r'control_period must lie in \[0.0001, 10\] s'),
    ({'control_period': 1e300}, ValueError, 'control_period'),
])
def test_settings_refuse_what_they_would_otherwise_coerce(kwargs, error, match):
    """A break-it review found these silently converted (bool('false') is True, int(-0.5) is 0)."""
    with pytest.raises(error, match=match):
        EpisodeSettings(**kwargs)
    assert EpisodeSettings(max_actions=4.0).max_actions == 4


#: Values just outside each check of :data:`CHECKS` (a new check needs its probes here).
OUTSIDE = {
    'text': [None, 3, b'pick'],
    'limit': [0, -1e-9, math.inf, math.nan, True, '5'],
    'steps': [0, 2.5, math.inf, True],
    'period': [math.nextafter(MIN_CONTROL_PERIOD_S, 0.0), math.nextafter(MAX_CONTROL_PERIOD_S, math.inf), 0, True],
    'flag': ['false', 0, None],
    'rows': [-1, 0.5, True, '3', None],
    'aggregate': ['mean', 3, '', 'Average'],
    'coeff': [math.nan, math.inf, -math.inf, True, '0.01', 10 ** 400],
    'space': [3, 'teleport'],
    'margin': [-1e-9, math.nan, math.inf, True, '4', None, math.nextafter(MAX_PREFETCH_MARGIN, math.inf), 1e308,
               10 ** 400],
}


def test_every_option_is_checked_by_its_fields_check():
    """No option is listed by hand: each field names its check, and a value just outside it is refused naming it."""
    assert set(OUTSIDE) == set(CHECKS)
    for field in dataclasses.fields(EpisodeSettings):
        check = field.metadata['check']          # KeyError: a field declared without a check
        for value in OUTSIDE[check]:
            with pytest.raises((TypeError, ValueError), match=field.name):
                EpisodeSettings(**{field.name: value})
    EpisodeSettings(control_period=MIN_CONTROL_PERIOD_S)                 # the bounds themselves pass
    EpisodeSettings(control_period=MAX_CONTROL_PERIOD_S)
    assert EpisodeSettings(prefetch_margin=0).prefetch_margin == 0.0     # the largest round trip alone
    assert EpisodeSettings(prefetch_margin=MAX_PREFETCH_MARGIN).prefetch_margin == MAX_PREFETCH_MARGIN


def test_prefetch_margin_is_refused_by_act_run_and_begin_episode_before_anything_runs(endpoint):
    """A margin of 1e308 was taken, and its lead overflowed mid-episode (math.ceil(inf) in the request path)."""
    with connect('lat', endpoint=endpoint) as policy:
        robot = CountingRobot()
        for value, error in ((1e308, ValueError), (-1.0, ValueError), (math.nan, ValueError), ('4', TypeError),
                             (True, TypeError)):
            with pytest.raises(error, match='prefetch_margin'):
                policy.begin_episode('pick', prefetch_margin=value)
            with pytest.raises(error, match='prefetch_margin'):
                policy.run(robot.observe, robot.act, max_actions=3, prefetch_margin=value)
            with pytest.raises(error, match='prefetch_margin'):
                policy.act('pick', robot.observe, robot.act, max_seconds=3.0, prefetch_margin=value)
        assert not robot.actions


def test_max_seconds_ends_a_run_whose_control_period_is_longer(endpoint):
    """The pacer never sleeps past max_seconds: a 10 s period with max_seconds=1 ends by 'timeout' then."""
    with connect('lat', endpoint=endpoint) as policy:
        policy.wait_until_ready(timeout=30)
        robot = CountingRobot()
        out = policy.run(robot.observe, robot.act, control_period=10.0, max_seconds=1.0)
    assert out.reason == 'timeout' and out.elapsed_s < 5.0, out     # before: the full 10 s period
    assert len(robot.actions) <= 1


def test_begin_episode_takes_settings_or_the_seed_keywords_never_both(endpoint):
    with connect('lat', endpoint=endpoint) as policy:
        policy.wait_until_ready(timeout=30)
        eid = policy.begin_episode(episode_id='s1', settings=EpisodeSettings(instruction='pick', max_actions=3))
        assert eid == 's1'
        robot = CountingRobot()
        for _ in range(2000):
            action = policy.next_action(robot.observe())
            if policy.episode_outcome() is not None:
                break
            if action is not None and not action.hold:
                robot.act(action)
            time.sleep(0.005)
        out = policy.end_episode()
        assert out.reason == 'completed' and out.actions >= 3     # chunk steps by the clock: a stalled tick counts
        with pytest.raises(TypeError, match='not both'):
            policy.begin_episode('pick', settings=EpisodeSettings(max_actions=3))
        with pytest.raises(ValueError, match='smooth_seam'):
            policy.begin_episode('pick', smooth_seam=-2)


def test_lost_capture_frames_are_reported_in_the_outcome(endpoint):
    """Frames the send queue could not take are counted and reported (RunOutcome.dropped_telemetry)."""
    image = np.random.default_rng(0).integers(0, 255, (480, 640, 3), np.uint8)
    with connect('lat', endpoint=endpoint) as policy:
        policy.wait_until_ready(timeout=30)
        policy.begin_episode('pick', max_seconds=30)
        call = policy._episode.stream
        frame = TelemetrySample(robot_time_s=0.0, state=np.zeros(2, np.float32), action=None, hold=True,
                                images={'cam': image})
        for _ in range(2000):                        # JPEG-encoding each takes far longer than enqueueing
            call.send_telemetry([frame])
        lost = call.dropped_telemetry
        out = policy.end_episode('completed')
    assert lost > 0
    assert out.dropped_telemetry >= lost
    assert str(out).startswith('RunOutcome(')


def test_the_old_name_skipped_reads_stale_actions_with_a_deprecation_warning():
    """RunOutcome.skipped, the name stale_actions had before, still reads it for one release, and warns."""
    from sequence_ai_ros.client import RunOutcome

    out = RunOutcome(actions=30, chunks=2, elapsed_s=1.0, reason='completed', stale_actions=4)
    with pytest.warns(DeprecationWarning, match=r'RunOutcome\.skipped .*stale_actions') as caught:
        assert out.skipped == 4
    assert len(caught) == 1 and caught[0].filename == __file__     # it points at the caller's line
    assert 'skipped' not in {f.name for f in dataclasses.fields(out)}   # not a field: asdict() and == unchanged
