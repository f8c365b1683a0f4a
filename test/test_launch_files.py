"""Every launch file under launch_testing, run as a ROS engineer runs one: ``launch_test <file>``.

The launch tests themselves are in ``test/launch_tests/`` (one per launch file, named ``<file>_launch.py`` so
that pytest does not collect them a second time); each starts the launch file with real processes (``seq
serve``, ``policy_node``, ``bag_player``, ``sim_robot``), checks the lifecycle state, the parameters in
effect, an episode's commands and counts, and, after launch_testing's Ctrl-C-style shutdown, that every
process exited 0. This module prepares their inputs (a ``hold`` policy from ``seq init``, the G1 episode as a
rosbag from ``seq data to-rosbag``, a params file), runs ``launch_test`` in this test's ROS domain and reads
its JUnit report.

Skipped, saying why, without launch_testing or ros2launch (the dev venv installs them from
../shared/ros2-tools; a sourced distro has them), or without the real G1 data.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import yaml
from conftest import G1_DATASET, REPO
from test_node_support import ros_command

pytestmark = [pytest.mark.ros, pytest.mark.slow]

LAUNCH_TESTS = REPO / 'test' / 'launch_tests'
#: Bound on one launch_test run (s): each run starts its processes twice at most (parametrized), on 2 busy cores.
TIMEOUT_S = 600


def _launch_test() -> str:
    """The ``launch_test`` command; skips, saying why, where the ROS 2 launch tools are not installed."""
    return ros_command('launch_test', ('launch', 'launch_ros', 'launch_testing', 'ros2launch'),
                       'the ROS 2 launch tools')


@pytest.fixture(scope='module')
def g1_inputs(tmp_path_factory) -> dict[str, str]:
    """A ``hold`` policy, the G1 episode 5 as a rosbag, and a params file over config/g1.yaml."""
    if not (G1_DATASET / 'meta' / 'info.json').exists():
        pytest.skip(f'real G1 dataset not found at {G1_DATASET} (set SEQ_DATA_DIR)')
    from sequence_ai_ros.bags.to_rosbag import episode_to_rosbag

    root = tmp_path_factory.mktemp('launch_inputs')
    subprocess.run([sys.executable, '-m', 'sequence_ai_ros.cli', 'init', 'hold', str(root / 'hold')], check=True,
                   capture_output=True, timeout=120)
    episode_to_rosbag(G1_DATASET, 5, root / 'g1_episode5')
    config = yaml.safe_load((REPO / 'config' / 'g1.yaml').read_text())
    config['/**/policy_node']['ros__parameters'].update(
        model='from_file', autostart=False, use_sim_time=True, diagnostics_rate_hz=4.0)
    (root / 'g1_params.yaml').write_text(yaml.safe_dump(config))
    return {'SEQ_LT_POLICY': str(root / 'hold' / 'policy.py'), 'SEQ_LT_BAG': str(root / 'g1_episode5'),
            'SEQ_LT_PARAMS': str(root / 'g1_params.yaml'), 'SEQ_HOME': str(root / 'seq_home')}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def run_launch_test(name: str, tmp_path: Path, env: dict[str, str], *arguments: str) -> list[str]:
    """Run ``launch_test test/launch_tests/<name>``; assert it passed; return its test cases' names."""
    report = tmp_path / 'junit.xml'
    log = tmp_path / 'launch_test.log'
    with open(log, 'w') as out:
        done = subprocess.run([_launch_test(), str(LAUNCH_TESTS / name), '--junit-xml', str(report), *arguments],
                              stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **env}, timeout=TIMEOUT_S,
                              cwd=tmp_path)
    output = log.read_text()
    assert done.returncode == 0, f'launch_test {name} failed ({done.returncode}):\n{output[-12000:]}'
    cases = [c for c in ET.parse(report).getroot().iter('testcase')]
    failed = [c.get('name') for c in cases if c.find('failure') is not None or c.find('error') is not None]
    assert cases and not failed, (failed, output[-12000:])
    print(f'\nlaunch_test {name}: {len(cases)} test cases passed')
    return [c.get('name', '') for c in cases]


def test_policy_launch(g1_inputs, tmp_path):
    """policy.launch.py: arguments over the params file; lifecycle; an episode's counts; Ctrl-C exits 0."""
    (Path(g1_inputs['SEQ_HOME'])).mkdir(exist_ok=True)
    names = run_launch_test('policy_launch.py', tmp_path, g1_inputs)
    # both modes ran every test, the shutdown check included
    for mode in ('given', 'file'):
        assert sum(n.endswith(f'[{mode}]') for n in names) == 3, names


def test_replay_launch(g1_inputs, tmp_path):
    """replay.launch.py in a namespace: worker, node and player; an episode's counts; Ctrl-C exits 0."""
    names = run_launch_test('replay_launch.py', tmp_path, {**g1_inputs, 'SEQ_LT_PORT': str(_free_port())})
    assert len(names) == 2, names


def test_sim_launch(tmp_path):
    """sim.launch.py: the scripted expert solves a reset sent before the goal; Ctrl-C exits 0."""
    pytest.importorskip('metaworld', reason='Meta-World is not installed (pip install ".[sim]")')
    subprocess.run([sys.executable, '-m', 'sequence_ai_ros.cli', 'init', 'metaworld-expert', str(tmp_path / 'expert')],
                   check=True, capture_output=True, timeout=120)
    env = {'SEQ_LT_EXPERT': str(tmp_path / 'expert' / 'policy.py'), 'SEQ_HOME': str(tmp_path / 'seq_home'),
           'MUJOCO_GL': os.environ.get('MUJOCO_GL', 'egl')}
    names = run_launch_test('sim_launch.py', tmp_path, env)
    assert len(names) == 2, names


def test_replay_launch_shuts_down_when_its_worker_cannot_start(g1_inputs, tmp_path):
    """A taken port: the launch's worker exits, and the launch ends with it.

    Without that, the node would stay up on whatever else answers on that port (the Quickstart's own worker on 50551).
    """
    import signal

    ros2 = ros_command('ros2', ('ros2cli', 'ros2launch'), 'ros2cli and ros2launch')
    with socket.socket() as taken:
        taken.bind(('127.0.0.1', 0))
        taken.listen()
        port = taken.getsockname()[1]
        bag, policy = g1_inputs['SEQ_LT_BAG'], g1_inputs['SEQ_LT_POLICY']
        proc = subprocess.Popen([ros2, 'launch', 'sequence_ai_ros', 'replay.launch.py', f'bag:={bag}',
                                 f'policy:={policy}', 'model:=hold', f'port:={port}',
                                 f'params_file:={REPO / "config" / "g1.yaml"}'],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, **g1_inputs}, start_new_session=True)
        try:
            output, _ = proc.communicate(timeout=90)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
    assert f'cannot bind 127.0.0.1:{port}' in output, output[-4000:]
    assert '[ERROR] [seq-1]: process has died' in output, output[-4000:]     # and the launch ended with it


def test_policy_launch_ends_when_the_node_refuses_its_parameters(tmp_path):
    """A params file with an unknown parameter: policy_node exits 2 naming it, and the launch ends with it."""
    ros2 = ros_command('ros2', ('ros2cli', 'ros2launch'), 'ros2cli and ros2launch')
    params = tmp_path / 'typo.yaml'
    params.write_text(yaml.safe_dump({'/**/policy_node': {'ros__parameters': {'modell': 'hold'}}}))
    done = subprocess.run([ros2, 'launch', 'sequence_ai_ros', 'policy.launch.py', 'model:=hold',
                           f'params_file:={params}'], capture_output=True, text=True, timeout=90,
                          start_new_session=True)
    output = done.stdout + done.stderr
    assert 'modell' in output and 'process has died' in output, output[-4000:]
