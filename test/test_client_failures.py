"""How act()/run()/next_action() fail, against a real worker on loopback (``test/policies/client_latency.py``).

- A bad observation (whatever raised first: numpy, Observation, the contract) is a ContractViolation: the
  hold fires once and the outcome's reason is 'validate'.
- The caller's own code raising (observe, act, until): the hold fires once, the caller's exception
  propagates unchanged, and the worker is told reason 'error' (checked in the episode it captured).
- A policy that stops answering ends with a PolicyException after the no-chunk deadline, hold first.
- Bools and a zero period are refused before anything moves.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
from doubles import NAMES, CountingRobot

from sequence_ai_ros.capture.settings import CaptureSettings, save_settings
from sequence_ai_ros.capture.store import CaptureStore
from sequence_ai_ros.client import Observation, connect
from sequence_ai_ros.exceptions import ContractViolation, PolicyException
from sequence_ai_ros.worker import serve_policy_file

LATENCY_POLICY = Path(__file__).parent / 'policies' / 'client_latency.py'


@pytest.fixture(scope='module')
def worker(tmp_path_factory):
    """One worker for the module; it captures every episode (rate 1) so the worker's reason can be read."""
    root = tmp_path_factory.mktemp('capture')
    save_settings(root / 'lat', CaptureSettings(rate=1.0, enabled=True, fps=10))
    server = serve_policy_file(LATENCY_POLICY, deployment='lat', host='127.0.0.1', port=0, mean_s=0.002,
                               dt=0.01, chunk_length=20, capture_root=root)
    yield f'127.0.0.1:{server.port}', root / 'lat'
    server.stop(grace=0.5)


@pytest.fixture(scope='module')
def policy(worker):
    with connect('lat', endpoint=worker[0]) as handle:
        handle.wait_until_ready(timeout=30)
        yield handle


def _worker_reason(store_root: Path, episode_id: str) -> str:
    """The reason the worker committed for ``episode_id`` (its capture), polled for up to 5 s."""
    deadline = time.monotonic() + 5.0
    while True:
        found = [e for e in CaptureStore(store_root, deployment='lat').episodes() if e.episode_id == episode_id]
        if found or time.monotonic() > deadline:
            assert found, f'the worker captured no episode {episode_id}'
            return found[0].reason
        time.sleep(0.05)


def _state(state, names=NAMES):
    return lambda: {'state': state, 'state_names': names}


BAD_OBSERVATIONS = {
    'None': lambda: None,
    'a string': lambda: 'frame=0',
    '2-d state': _state(np.zeros((1, 2), np.float32)),
    'NaN state': _state(np.array([np.nan, 0], np.float32)),
    'inf state': _state(np.array([np.inf, 0], np.float32)),
    'non-numeric state': _state('abc', ()),
    'ragged state': _state([[1.0], [2.0, 3.0]], ()),
    'wrong dims': _state(np.zeros(5, np.float32), ()),
    'empty names': _state(np.zeros(2, np.float32), ('', '')),
    # A reordered (or larger) named state is mapped by name now, as the node maps it (test_client_adapter.py);
    # a contract name the robot lacks is still refused.
    'a name missing': _state(np.zeros(2, np.float32), ('request', 'elbow')),
    'unknown key': lambda: {'state': np.zeros(2, np.float32), 'joints': 1},
    'no state': lambda: {'state_names': NAMES},
    'params not a dict': lambda: {'state': np.zeros(2, np.float32), 'params': 3},
}


@pytest.mark.parametrize('case', list(BAD_OBSERVATIONS))
def test_a_bad_observation_is_a_contract_violation_ending_validate_after_one_hold(policy, case):
    robot = CountingRobot()
    out = policy.run(BAD_OBSERVATIONS[case], robot.act, max_actions=50, on_underrun=robot.hold, max_seconds=5)
    assert out.reason == 'validate', out
    assert isinstance(out.error, ContractViolation), repr(out.error)
    assert len(robot.holds) == 1 and robot.actions == []


def test_a_bad_observation_mid_run_ends_validate_after_one_hold(policy):
    robot = CountingRobot()

    def observe():
        obs = robot.observe()
        if robot.observed >= 12:
            obs.state[0] = np.nan                  # the sensor starts reporting NaN (state checked by Observation)
            return {'state': obs.state, 'state_names': NAMES}
        return obs

    out = policy.run(observe, robot.act, max_actions=100, on_underrun=robot.hold, max_seconds=5)
    assert out.reason == 'validate' and isinstance(out.error, ContractViolation) and 'non-finite' in str(out.error)
    assert len(robot.holds) == 1 and 0 < len(robot.actions) < 12


def test_next_action_with_a_bad_observation_raises_a_contract_violation_and_ends_validate(policy):
    policy.begin_episode('pick', max_seconds=5)
    try:
        with pytest.raises(ContractViolation, match='bad observation'):
            policy.next_action(None)
        with pytest.raises(ContractViolation):
            policy.next_action({'state': np.zeros(5, np.float32)})
        assert policy.episode_outcome().reason == 'validate'
        held = policy.next_action(Observation(state=np.zeros(2, np.float32), state_names=NAMES))
        assert held.hold                                   # the episode is over: hold, never a fresh command
    finally:
        policy.end_episode()


class SensorUnplugged(OSError):
    """The caller's own failure, raised from observe()."""


def _observe_raises(robot: CountingRobot):
    def observe():
        if robot.observed >= 15:
            raise SensorUnplugged('sensor unplugged')
        return robot.observe()
    return observe


def _act_raises(robot: CountingRobot):
    def act(action):
        if len(robot.actions) >= 10:
            raise RuntimeError('controller refused')
        robot.act(action)
    return act


@pytest.mark.parametrize('where', ['observe', 'act', 'until', 'act-first'])
def test_the_callers_exception_propagates_after_one_hold_and_the_worker_records_error(policy, worker, where):
    robot = CountingRobot()
    observe, act, until = robot.observe, robot.act, None
    expected: type[BaseException] = RuntimeError
    if where == 'observe':
        observe, expected = _observe_raises(robot), SensorUnplugged
    elif where == 'act':
        act = _act_raises(robot)
    elif where == 'act-first':
        def act(action):
            raise RuntimeError('controller refused')
    else:
        def until():
            if len(robot.actions) >= 10:
                raise ZeroDivisionError('until() bug')
            return False
        expected = ZeroDivisionError
    with pytest.raises(expected):
        policy.act('pick', observe, act, max_seconds=5, until=until, on_underrun=robot.hold)
    out = policy.episode_outcome()
    assert len(robot.holds) == 1, where                         # the arm holds before the exception leaves act()
    assert out.reason == 'error' and out.error is None     # the caller's exception is raised, not wrapped
    assert _worker_reason(worker[1], out.episode_id) == 'error'
    robot = CountingRobot()                                        # the handle is usable again at once
    assert policy.run(robot.observe, robot.act, max_actions=5).reason == 'completed'


def test_a_keyboard_interrupt_holds_once_and_ends_interrupted(policy, worker):
    robot = CountingRobot()

    def act(action):
        if len(robot.actions) >= 5:
            raise KeyboardInterrupt
        robot.act(action)

    with pytest.raises(KeyboardInterrupt):
        policy.run(robot.observe, act, max_actions=50, on_underrun=robot.hold)
    out = policy.episode_outcome()
    assert len(robot.holds) == 1 and out.reason == 'interrupted'
    assert _worker_reason(worker[1], out.episode_id) == 'interrupted'


def test_a_raising_hold_does_not_hide_the_callers_exception(policy):
    robot = CountingRobot()
    calls = []

    def hold():
        calls.append(1)
        raise OSError('hold failed too')

    def act(action):
        raise RuntimeError('controller refused')

    with pytest.raises(RuntimeError, match='controller refused'):
        policy.run(robot.observe, act, max_actions=50, on_underrun=hold)
    assert calls == [1]


@pytest.mark.parametrize('stall_at', [1, 3], ids=['first-request', 'mid-run'])
def test_a_hung_policy_ends_with_error_after_the_chunk_timeout_hold_first(tmp_path, stall_at):
    save_settings(tmp_path / 'lat', CaptureSettings(rate=1.0, enabled=True, fps=10))
    server = serve_policy_file(LATENCY_POLICY, deployment='lat', host='127.0.0.1', port=0, mean_s=0.002,
                               dt=0.01, chunk_length=20, stall_at=stall_at, stall_s=1.5, capture_root=tmp_path)
    try:
        with connect('lat', endpoint=f'127.0.0.1:{server.port}') as policy:
            robot = CountingRobot()
            holds: list[float] = []

            def hold():
                holds.append(time.monotonic())
                robot.hold()

            start = time.monotonic()
            with pytest.raises(PolicyException, match='no action chunk for request') as err:
                policy.run(robot.observe, robot.act, max_actions=10_000, on_underrun=hold, chunk_timeout=0.4)
            raised = time.monotonic()
            out = policy.episode_outcome()
            print(f'\nhung at request {stall_at}: {len(robot.actions)} actions, hold after '
                  f'{holds[0] - start:.2f} s, raised after {raised - start:.2f} s: {err.value}')
            assert len(robot.holds) == 1 and out.reason == 'error' and out.error is err.value
            assert holds[0] <= raised
            assert (len(robot.actions) > 0) == (stall_at > 1)
            assert raised - start < 0.4 + 0.2 * stall_at + 2.5      # bounded by the deadline, not by max_actions
            assert _worker_reason(tmp_path / 'lat', out.episode_id) == 'error'
    finally:
        server.stop(grace=0.5)


def test_limits_refuse_bools_and_a_zero_period_before_anything_moves(policy):
    robot = CountingRobot()
    before = policy.stats().get('episode_id')
    with pytest.raises(TypeError, match='max_seconds'):
        policy.act('pick', robot.observe, robot.act, max_seconds=True)
    with pytest.raises(TypeError, match='max_actions'):
        policy.run(robot.observe, robot.act, max_actions=True)
    with pytest.raises(TypeError, match='max_seconds'):
        policy.run(robot.observe, robot.act, max_seconds='5')
    with pytest.raises(ValueError, match='control_period'):
        policy.run(robot.observe, robot.act, max_actions=5, control_period=0)
    with pytest.raises(ValueError, match='control_period'):
        policy.act('pick', robot.observe, robot.act, max_seconds=1, control_period=0.0)
    with pytest.raises(ValueError, match='chunk_timeout'):
        policy.run(robot.observe, robot.act, max_actions=5, chunk_timeout=0)
    with pytest.raises(ValueError, match='max_seconds'):
        policy.act('pick', robot.observe, robot.act, max_seconds=float('inf'))
    with pytest.raises(ValueError, match='control_period'):
        policy.begin_episode('pick', control_period=0)
    with pytest.raises(TypeError, match='max_actions'):
        policy.begin_episode('pick', max_actions=False)
    assert robot.actions == [] and len(robot.holds) == 0 and robot.observed == 0
    assert policy.stats().get('episode_id') == before                 # none of them opened an episode
    assert policy.run(robot.observe, robot.act, max_actions=5, control_period=0.01).actions == 5
