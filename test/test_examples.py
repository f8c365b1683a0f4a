"""The examples in examples/ run as the README says, against a real ``seq serve`` on loopback.

Each example is a script a user copies; these tests run it unchanged in a subprocess (the user's way) and
check what it printed: counts and values, never a rate.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import sequence_ai_ros

REPO = Path(__file__).resolve().parent.parent
SEQ = [sys.executable, '-m', 'sequence_ai_ros.cli']
#: The examples' synthetic arm starts here (26 joints: the hold template's default, the G1's), rounded as printed.
START_POSE = np.linspace(-0.2, 0.2, 26, dtype=np.float32).astype(float).round(3).tolist()


def _seq(*args: str, cwd: Path) -> str:
    done = subprocess.run([*SEQ, *args], cwd=cwd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, (args, done.stdout, done.stderr)
    return done.stdout


@pytest.fixture
def hold_worker(tmp_path: Path, seq_home: Path, processes) -> str:
    """The quickstart's worker: ``seq init hold my_policy``, ``seq deploy``, ``seq serve`` (port 0); its endpoint."""
    _seq('init', 'hold', 'my_policy', cwd=tmp_path)
    _seq('deploy', 'my_policy/policy.py', cwd=tmp_path)
    proc = processes.spawn([*SEQ, 'serve', 'my_policy', '--port', '0'], cwd=tmp_path)
    line = proc.stdout.readline()
    match = re.match(r'serving my_policy on (127\.0\.0\.1:\d+)', line)
    assert match, (line, proc.stderr.read() if proc.poll() is not None else '')
    return match.group(1)


def _example(name: str, *args: str, endpoint: str, timeout: float = 120) -> str:
    env = dict(os.environ, SEQ_ENDPOINT=endpoint, PYTHONPATH=f'{REPO}{os.pathsep}{os.environ.get("PYTHONPATH", "")}')
    done = subprocess.run([sys.executable, str(REPO / 'examples' / name), *args], capture_output=True, text=True,
                          env=env, timeout=timeout)
    assert done.returncode == 0, (done.stdout, done.stderr)
    return done.stdout


@pytest.mark.slow
def test_fake_robot_example_holds_its_pose_under_the_hold_template(hold_worker):
    out = _example('fake_robot.py', 'my_policy', endpoint=hold_worker)
    outcome = re.search(r'RunOutcome\((\d+) actions over (\d+) chunks in [\d.]+s, (\w+)', out)
    assert outcome, out
    actions, chunks, reason = int(outcome.group(1)), int(outcome.group(2)), outcome.group(3)
    assert reason == 'timeout', out                  # max_seconds=3 ends it; hold never says done
    assert actions > 0 and chunks >= 1, out
    assert f'worker {sequence_ai_ros.__version__} ' in out, out   # EpisodeStarted.worker_version
    pose = [float(v) for v in re.search(r'pose \[([^\]]*)\]', out).group(1).split(',')]
    assert pose == START_POSE, out   # hold: the G1's 26 joints stay where they were


def test_openpi_runtime_example_runs_two_episodes_through_openpi_runtime_and_agent(hold_worker):
    pytest.importorskip('openpi_client', reason='openpi-client is installed by make test (make bench installs it too)')
    out = _example('openpi_runtime.py', 'my_policy', endpoint=hold_worker)
    outcome = re.search(r'last episode RunOutcome\((\d+) actions over (\d+) chunks in [\d.]+s, (\w+)', out)
    assert outcome, out
    assert outcome.group(3) == 'completed', out     # reset()/end_episode() end it as the operator's call
    assert int(outcome.group(1)) >= 1, out
    assert f'worker {sequence_ai_ros.__version__} ' in out, out
    pose = [float(v) for v in re.search(r'pose \[([^\]]*)\]', out).group(1).split(',')]
    assert pose == START_POSE, out   # hold held it
