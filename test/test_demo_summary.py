"""The demo's account of safety clamps and its synthetic robot's motion, on the shipped G1 config (no ROS graph)."""

from __future__ import annotations

import numpy as np
import yaml

from sequence_ai_ros.demo.pipeline import REPO_CONFIG, _clamps, explain_clamps, recorded_excess
from sequence_ai_ros.demo.summary import format_summary
from sequence_ai_ros.demo.synthetic import AMPLITUDE, motion


def _g1() -> dict:
    return yaml.safe_load((REPO_CONFIG / 'g1.yaml').read_text())['/**/policy_node']['ros__parameters']


def test_the_g1_limits_are_the_robots_joint_ranges_and_hold_its_recording(g1_dataset) -> None:
    from sequence_ai_ros.datasets.lerobot_reader import LeRobotDataset

    g1 = _g1()
    names, safety = g1['joints']['names'], g1['safety']
    assert len(safety['lower_limits']) == len(safety['upper_limits']) == len(names) == 26
    lower = dict(zip(names, safety['lower_limits'], strict=True))
    upper = dict(zip(names, safety['upper_limits'], strict=True))
    # Unitree's G1 29-DoF URDF (rad) and the Inspire hands' normalised 0..1 command range
    assert (lower['kLeftElbow'], upper['kLeftElbow']) == (-1.0472, 2.0944)
    assert (lower['kRightShoulderRoll'], upper['kRightShoulderRoll']) == (-2.2515, 1.5882)
    assert all((lower[n], upper[n]) == (0.0, 1.0) for n in names if 'Hand' in n)
    ds = LeRobotDataset(g1_dataset)
    order = [list(ds.action_names).index(n) for n in names]
    excess = {k: recorded_excess(ds.episode(k).action[:, order], ds.fps, names, g1) for k in range(6)}
    # every recorded action is within the joint ranges; the teleoperator's hand moves pass max_step (0.1 per
    # 20 ms tick) in some training episodes, never in episode 5, the one `make demo` replays
    assert all('below' not in r and 'above' not in r for ex in excess.values() for r in ex.values()), excess
    assert excess[5] == {}
    assert {name for ex in excess.values() for name in ex} <= {n for n in names if 'Hand' in n}, excess


def test_recorded_excess_names_each_kind_of_limit_the_recording_passes() -> None:
    params = {'control_rate_hz': 50.0, 'safety': {'lower_limits': [0.0, 0.0, -1.0], 'upper_limits': [1.0, 1.0, 1.0],
                                                  'max_step': [0.1]}}
    actions = np.array([[0.5, -0.2, 0.0], [0.6, 0.3, 0.1], [1.2, 0.3, 0.2]])   # 30 fps: x 0.6 per tick
    excess = recorded_excess(actions, 30.0, ['a', 'b', 'c'], params)
    assert excess == {'a': {'above': 1.2, 'step': 0.6 * 0.6}, 'b': {'below': -0.2, 'step': 0.5 * 0.6}}


def test_clamps_are_explained_in_one_line_by_whose_values_passed_the_limit() -> None:
    values = {'clamps': '7', 'clamps.a.limit': '3', 'clamps.a.step': '0', 'clamps.b.step': '4', 'clamps.c.limit': '0'}
    clamps = _clamps(values)
    assert clamps['total'] == 7 and clamps['per_joint'] == {'a': {'limit': 3, 'step': 0}, 'b': {'limit': 0, 'step': 4}}
    assert clamps['top'] == [['b', 4], ['a', 3]]
    excess = {'a': {'above': 1.2}}
    line = explain_clamps(clamps['per_joint'], excess)
    assert line == ("the robot's own recording exceeds these limits too: a limit 3; "
                    'the policy went past limits the recording stays within: b step 4')
    assert explain_clamps(clamps['per_joint'], None) == 'the policy went past the limits: a limit 3, b step 4'
    assert explain_clamps({}, excess) == ''
    summary = {'synthetic': False, 'dataset': 'd', 'run_outcome': 'RunOutcome()', 'underruns': 0,
               'underrun_s': 0.0, 'max_seam_jump': 0.0, 'latency_p50_ms': 1.0, 'latency_p95_ms': 1.0,
               'commands_sent': 1, 'commands_received': 1, 'command_rate_hz': 50.0, 'tick_jitter_p99_ms': 1.0,
               'zero_commands': 0, 'clamps': dict(clamps, explained=line),
               'control_worst': {'level': 'WARN', 'message': '2% of commands clamped'}, 'label_ok': True,
               'export': 'e', 'export_reread': {}, 'total_s': 1.0}
    printed = format_summary(summary).splitlines()
    at = next(i for i, text in enumerate(printed) if text.startswith('safety clamps'))
    assert printed[at + 1] == f'  why                {line}'


def test_the_synthetic_robot_swings_inside_every_g1_joint_range() -> None:
    g1 = _g1()
    lower, upper = g1['safety']['lower_limits'], g1['safety']['upper_limits']
    center, amplitude = motion(len(lower), lower, upper)
    assert center is not None
    c, a = np.array(center), np.array(amplitude)
    assert np.all(c - a >= np.array(lower)) and np.all(c + a <= np.array(upper))
    assert np.all(a == AMPLITUDE)   # the G1's narrowest range (a hand, 0..1) still takes the full swing
    assert motion(2, None, None) == ([0.0, 0.0], [AMPLITUDE, AMPLITUDE])
    assert motion(2, [0.0], [1.0, 1.0])[0] is None and motion(1, [1.0], [0.0])[0] is None
