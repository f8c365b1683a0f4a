"""An episode begun while its deployment warms holds (``waiting``) until the deployment is ready, then runs.

A real worker on loopback serves ``test/policies/client_latency.py`` whose ``load()`` sleeps (``load_s``), in a
deployment process of its own and inside the worker: the handshake starts the load and the episode begins at
once, with no ``wait_until_ready()``. The wait is bounded (the episode's max_seconds: NotReady naming the
worker's state and the wait), and a load that fails ends the episode with a typed error at once.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
from doubles import CountingRobot

from sequence_ai_ros.capture.records import ERROR
from sequence_ai_ros.capture.settings import CaptureSettings, save_settings
from sequence_ai_ros.capture.store import CaptureStore
from sequence_ai_ros.client import connect
from sequence_ai_ros.exceptions import NotReady
from sequence_ai_ros.protocol import sequence_ai_pb2 as pb
from sequence_ai_ros.worker import serve_policy_file

POLICY = Path(__file__).parent / 'policies' / 'client_latency.py'
ISOLATION = pytest.mark.parametrize('isolation', ['process', 'none'])
#: A chunk covers 4 s (200 rows at 0.02 s): the few dozen actions a test runs never wait for a second one.
LONG_CHUNK = {'dt': 0.02, 'chunk_length': 200}


def _loop(policy, robot: CountingRobot, until, bound_s: float = 30.0) -> int:
    """next_action() every 20 ms until ``until()`` (at most ``bound_s``); return the holds before the first action."""
    held_first = 0
    deadline = time.monotonic() + bound_s
    while not until() and time.monotonic() < deadline:
        action = policy.next_action(robot.observe())
        if action is None or action.hold:
            held_first += not robot.actions
        else:
            robot.act(action)
        time.sleep(0.02)
    return held_first


@ISOLATION
def test_a_next_action_loop_begun_while_the_deployment_warms_holds_waiting_then_runs(tmp_path, isolation):
    root = tmp_path / 'capture'
    save_settings(root / 'lat', CaptureSettings(rate=1.0, enabled=True))
    with serve_policy_file(POLICY, 'lat', capture_root=root, isolation=isolation, load_s=1.0, **LONG_CHUNK) \
            as server, connect('lat', endpoint=f'127.0.0.1:{server.port}') as policy:
        assert policy.ready()[0] is False                 # the handshake started a load of 1 s
        policy.begin_episode('reach', max_seconds=30.0, control_period=0.02)
        robot = CountingRobot()
        held_first = _loop(policy, robot, lambda: len(robot.actions) >= 20)
        out = policy.end_episode()
    assert out.reason == 'completed' and out.error is None, out
    assert len(robot.actions) == 20 and out.actions >= 19 and out.chunks >= 1 and held_first >= 1, out
    assert out.underruns == 0 and out.underrun_s == 0.0, out          # the wait for the load is no underrun
    assert robot.actions[0].values[0] == 0.0                          # the first chunk plays from its row 0
    [episode] = CaptureStore(root / 'lat', 'lat').episodes()
    frames = [frame for _, frame in episode.telemetry()]
    first = next(i for i, frame in enumerate(frames) if not frame.hold)
    assert first >= 1 and {f.hold_reason for f in frames[:first]} == {'waiting'}, frames[:first]
    assert 'underrun' not in {f.hold_reason for f in frames}
    refused = [r.message for r in episode.records() if r.kind == ERROR]
    assert refused and all(isinstance(e, pb.Error) and e.code == pb.NOT_READY and e.retry_after_s > 0
                           for e in refused), refused                 # the worker said "warming" at least once


@ISOLATION
def test_act_and_run_begun_while_the_deployment_warms_run_their_episodes(serve, isolation):
    endpoint = serve(isolation=isolation, load_s=1.0, **LONG_CHUNK)
    with connect('lat', endpoint=endpoint) as policy:
        assert policy.ready()[0] is False
        robot = CountingRobot()
        out = policy.run(robot.observe, robot.act, max_actions=12)
        assert (out.reason, out.actions, out.error) == ('completed', 12, None), out
        assert [a.values[0] for a in robot.actions] == list(range(12))
    with connect('lat', endpoint=serve(isolation=isolation, load_s=1.0, **LONG_CHUNK)) as policy:
        assert policy.ready()[0] is False
        robot = CountingRobot()
        out = policy.act('reach', robot.observe, robot.act, max_seconds=30.0, until=lambda: len(robot.actions) >= 5)
        assert (out.reason, out.error) == ('until', None) and out.actions >= 5, out


@ISOLATION
def test_a_deployment_whose_load_fails_ends_the_episode_with_a_typed_error_at_once(serve, isolation):
    endpoint = serve(isolation=isolation, load_s=0.5, load_error='checkpoint file missing', **LONG_CHUNK)
    with connect('lat', endpoint=endpoint) as policy:
        policy.begin_episode('reach', max_seconds=60.0, control_period=0.02)
        robot = CountingRobot()
        _loop(policy, robot, lambda: policy.episode_outcome() is not None)
        out = policy.end_episode()
        assert out.reason == 'error' and isinstance(out.error, NotReady), out
        assert 'failed to load' in str(out.error) and 'checkpoint file missing' in str(out.error)
        assert out.actions == 0 and not robot.actions and out.elapsed_s < 30.0   # not the 60 s of max_seconds
        with pytest.raises(NotReady, match='checkpoint file missing'):           # act()/run() as at once
            policy.run(robot.observe, robot.act, max_actions=5)


@ISOLATION
def test_a_deployment_slower_than_max_seconds_ends_the_episode_with_not_ready(serve, isolation):
    endpoint = serve(isolation=isolation, load_s=3.0, **LONG_CHUNK)
    with connect('lat', endpoint=endpoint) as policy:
        policy.begin_episode('reach', max_seconds=0.5, control_period=0.02)
        robot = CountingRobot()
        held = _loop(policy, robot, lambda: policy.episode_outcome() is not None)
        out = policy.end_episode()
    assert out.reason == 'error' and isinstance(out.error, NotReady), out
    assert (out.actions, out.chunks, out.underruns) == (0, 0, 0) and not robot.actions and held >= 1
    text = str(out.error)
    assert text.startswith("deployment 'lat' not ready within the episode's max_seconds (0.5 s) (waited ")
    assert "policy 'lat' is warming; ready in about" in text, text
    assert np.isfinite(out.elapsed_s) and out.elapsed_s >= 0.5
