"""The main job end to end (``make demo``) on a slice of the real G1 episode, asserting the summary.

Same pipeline as ``make demo``: seq train -> seq deploy -> seq serve (capture 1.0, images) -> seq data
to-rosbag -> policy_node (G1 config, forward_command, 50 Hz) -> bag replay -> Act goal -> ~/label ->
export LeRobot v2.1 -> re-read with the project's reader against the reference schema.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.ros, pytest.mark.slow]


def test_demo_pipeline_on_real_g1_data(g1_dataset: Path, tmp_path: Path) -> None:
    out = tmp_path / 'out'
    # the demo's private domain is this test process's own (conftest: no other test or worker of this run uses it)
    env = dict(os.environ, SEQ_DEMO_DOMAIN_ID=os.environ['ROS_DOMAIN_ID'])
    done = subprocess.run([sys.executable, '-m', 'sequence_ai_ros.demo', '--dataset', str(g1_dataset),
                           '--out', str(out), '--max-seconds', '6'], capture_output=True, text=True, timeout=420,
                          env=env)
    print(done.stdout[-4000:])
    assert done.returncode == 0, done.stderr[-4000:]
    s = json.loads((out / 'summary.json').read_text())
    assert s['synthetic'] is False
    assert s['reason'] in ('completed', 'timeout')
    assert s['underruns'] == 0, s
    assert s['commands_sent'] > 150, s
    # every control period is a command, a hold or a reported skipped tick (the rate itself is `make bench`'s
    # figure: on loaded cores it drops, honestly reported); never more commands than periods
    periods = s['elapsed_s'] * 50.0
    accounted = s['commands_sent'] + s['ticks_held'] + s['ticks_skipped']
    assert abs(accounted - periods) <= 3, (accounted, periods, s)
    assert s['zero_commands'] == 0
    # the G1 config's limits are the robot's joint ranges and the ridge stops where the recording does (the
    # right hand fully open at 1.0): nothing is clamped, unless the recording itself exceeds a limit, and
    # then the summary says so in one line
    clamps = s['clamps']
    assert clamps['total'] == sum(c['limit'] + c['step'] for c in clamps['per_joint'].values()), clamps
    if clamps['total']:
        assert clamps['explained'].startswith("the robot's own recording exceeds"), clamps
        assert 'the policy went past' not in clamps['explained'], clamps
        assert f"  why                {clamps['explained']}" in done.stdout
    else:
        assert clamps['explained'] == '' and '  why ' not in done.stdout
    assert s['control_worst']['level'] != 'ERROR', s['control_worst']
    assert 'safety clamps' in done.stdout and 'ERROR' not in done.stdout
    err = s['action_error']
    assert err['ridge'] < err['hold_state'] and err['ridge'] < err['mean_action'], err
    assert s['label_ok'] is True
    reread = s['export_reread']
    assert reread['episodes'] == 1 and reread['frames'] > 0
    assert reread['reference'] == str(g1_dataset)
    assert (out / 'export' / 'meta' / 'info.json').exists()
    assert 'RunOutcome(' in done.stdout and 'underruns' in done.stdout
