"""The StepLedger's joint_delta bookkeeping: what the robot executed is what the rows sum to.

The ledger is fed the steps a real engine would make (the engine integrates each increment onto its own
target; the robot completes the step with what it really commanded).
"""

from __future__ import annotations

import numpy as np

from sequence_ai_ros.client.steps import Step, StepLedger
from sequence_ai_ros.protocol.spaces import ActionSpace
from sequence_ai_ros.protocol.types import Observation

OBS = Observation(state=np.zeros(2, np.float32))


def _step(g: int, policy, command, hold_reason: str = '') -> Step:
    return Step(grid_index=g, step_start=float(g), step_end=g + 1.0, observation=OBS,
                policy_action=None if policy is None else np.asarray(policy, np.float32),
                command=np.asarray(command, np.float32), hold_reason=hold_reason)


def test_a_refused_tick_then_a_hold_keeps_the_executed_increments_on_the_robots_path() -> None:
    """Refused, then an underrun hold, then fresh: the executed increments sum to where the robot really went.

    The refused tick's robot kept its target, and the engine is told so: the next increment starts from it
    (a refused increment is dropped, never caught up in one jump on the next tick).
    """
    committed: list[Step] = []
    targets: list[np.ndarray] = []
    ledger = StepLedger(ActionSpace.JOINT_DELTA, on_target=targets.append)
    ledger.sink = committed.append
    d = np.float32(0.1)
    robot = np.zeros(2, np.float32)                    # the robot's target
    engine = np.zeros(2, np.float32)                   # the engine's own target
    for g, kind in enumerate(['fresh', 'refused', 'hold', 'fresh', 'clamped', 'hold', 'fresh']):
        if kind == 'hold':
            ledger.open(_step(g, None, engine, hold_reason='underrun'))
            ledger.commit()                            # the robot repeats its own target
            continue
        engine = (engine + d).astype(np.float32)
        ledger.open(_step(g, [d, d], engine))
        if kind == 'refused':
            assert ledger.report(None, hold_reason='refused')
            np.testing.assert_array_equal(targets[-1], robot)   # the engine integrates onto the robot's target
            engine = robot                             # so the refused increment is dropped, never caught up
        elif kind == 'clamped':
            clamped = (robot + np.float32(0.05)).astype(np.float32)
            assert ledger.report(clamped, clamped=True)
            engine = robot = clamped                   # the engine integrates onto the robot's target (fed back)
        else:
            ledger.commit()
            robot = engine
    executed = sum(s.executed for s in committed if s.executed is not None)
    np.testing.assert_allclose(executed, robot, atol=1e-6)
    assert [s.hold_reason for s in committed] == ['', 'refused', 'underrun', '', '', 'underrun', '']
    assert ledger.commands_sent == 4 and ledger.ticks_held == 3 and ledger.ticks_skipped == 0
    assert len(targets) == 2                           # the refusal and the clamp reset the engine's target


def test_missed_deadlines_are_counted_once_and_a_second_report_is_ignored() -> None:
    ledger = StepLedger(ActionSpace.JOINT_ABSOLUTE)
    for g in (0, 1, 4, 5, 9):
        ledger.open(_step(g, [1, 1], [1, 1]))
        assert ledger.report(np.ones(2, np.float32))
        assert not ledger.report(np.zeros(2, np.float32))    # once per tick
    ledger.commit()
    assert ledger.ticks_skipped == 2 + 3 and ledger.commands_sent == 5



def test_the_first_command_clamped_executes_what_the_controller_received() -> None:
    """The first tick clamped by max_step: its increment is the clamped target minus the measured state."""
    committed: list[Step] = []
    ledger = StepLedger(ActionSpace.JOINT_DELTA)
    ledger.set_sink(committed.append)
    measured = np.array([0.1, 0.2], np.float32)
    ledger.open(_step(0, [0.002, 0.002], measured + np.float32(0.002)))
    clamped = (measured + np.float32(0.0005)).astype(np.float32)
    assert ledger.report(clamped, clamped=True)
    np.testing.assert_allclose(committed[0].executed, clamped - measured, atol=1e-7)


def test_the_ledger_counts_every_deadline_from_the_origin_holds_without_a_record_included() -> None:
    """start(), hold(), open() on the caller's grid and end(): sent + held + skipped = the episode's deadlines.

    The caller's grid has its own origin (deadline 40 is the episode's start); a hold without a record (an
    invalid observation, before the first request) is counted but never reaches capture; a dry run's tick
    is held; end() counts the deadlines after the last tick, and a tick racing it is not counted twice.
    """
    committed: list[Step] = []
    ledger = StepLedger(ActionSpace.JOINT_ABSOLUTE)
    ledger.sink = committed.append
    ledger.start(40)
    assert ledger.hold(41, 'waiting') and ledger.hold(42, 'refused')         # before the first request
    ledger.open(_step(0, [0.1, 0.1], [0.1, 0.1]), 43)                         # the engine's own grid starts at 0
    ledger.open(_step(1, [0.2, 0.2], [0.2, 0.2]), 46)                         # 44, 45 skipped; 43 committed
    assert ledger.report(None, hold_reason='dry_run')                         # a dry run sends nothing: held
    counts = ledger.counts()
    assert (counts.commands_sent, counts.ticks_held, counts.ticks_skipped, counts.grid_index) == (1, 3, 2, 46)
    ledger.end(50)                                                            # 47..50 no tick served
    assert not ledger.hold(49, 'ended')                                       # raced the end: counted once
    counts = ledger.counts()
    assert counts.commands_sent + counts.ticks_held + counts.ticks_skipped == 50 - 40, counts
    assert (counts.commands_sent, counts.ticks_held, counts.ticks_skipped) == (1, 3, 6)
    assert [s.hold_reason for s in committed] == ['', 'dry_run']              # the holds made no record
    try:
        ledger.hold(51, 'tired')
    except ValueError:
        pass
    else:
        raise AssertionError('an unknown hold_reason was counted')
