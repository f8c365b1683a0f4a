"""``python -m sequence_ai_ros.node.act_goal``: one Act goal (and a label) from a shell without ros2cli.

A real node process in a namespace, a real worker serving ``test/policies/node_ramp.py``, joint states
from a probe node, and the command line as its own process, as a user runs it.
"""

from __future__ import annotations

import signal
import subprocess
import sys

import numpy as np
import pytest
from std_msgs.msg import Float64MultiArray
from test_node_support import RAMP, Probe, node_log, node_params, spawn_node, wait_for

from sequence_ai_ros.worker import serve_policy_file

pytestmark = [pytest.mark.ros, pytest.mark.slow]

NAMES = ['j0', 'j1', 'j2', 'j3']
CLI = [sys.executable, '-m', 'sequence_ai_ros.node.act_goal']


def test_act_goal_runs_an_episode_and_labels_it(tmp_path, processes, rclpy_context):
    probe = Probe(rclpy_context, Float64MultiArray, '/robot1/arm/commands', namespace='robot1')
    try:
        with serve_policy_file(RAMP, 'ramp', names=NAMES, step=0.002) as server:
            params = node_params(tmp_path, node_key='/**/policy_node', model='ramp',
                                 endpoint=f'127.0.0.1:{server.port}', **{'joints.names': NAMES,
                                                                          'command.controller': 'arm'})
            proc = spawn_node(processes, tmp_path / 'node.log', params, namespace='robot1')
            probe.publish_joints(NAMES, positions=lambda: 0.1 + np.arange(4) * 0.1)
            assert probe.wait_connected(), node_log(proc)
            done = subprocess.run(CLI + ['--node', '/robot1/policy_node', '--instruction', 'reach',
                                         '--max-seconds', '1.0', '--episode-id', 'cli-1', '--label', 'success',
                                         '--notes', 'from the shell'],
                                  capture_output=True, text=True, timeout=120)
            # a second robot whose joints never come: the episode fails, and the exit status says so
            quiet = Probe(rclpy_context, namespace='robot2', name='probe_robot2')
            try:
                proc2 = spawn_node(processes, tmp_path / 'node2.log', params, namespace='robot2')
                assert quiet.wait_connected(), node_log(proc2)
                failed = subprocess.run(CLI + ['--node', '/robot2/policy_node', '--max-seconds', '30'],
                                        capture_output=True, text=True, timeout=120)
            finally:
                quiet.close()
            refused = subprocess.run(CLI + ['--node', '/nobody/policy_node', '--max-seconds', '1', '--wait', '1'],
                                     capture_output=True, text=True, timeout=60)
    finally:
        probe.close()
    # the episode ran (exit 0 would follow); the label was refused, so the command says so with 1
    assert done.returncode == 1, done.stdout + done.stderr + node_log(proc)
    lines = dict(line.split(': ', 1) for line in done.stdout.splitlines() if ': ' in line)
    assert lines['reason'] == 'timeout' and lines['episode_id'] == 'cli-1'
    assert int(lines['commands_sent']) > 0 and int(lines['actions']) > 0
    # the label reaches the worker, which says why it stores nothing: this deployment captures no episodes
    assert lines['label'].startswith('refused (capture is off for deployment'), done.stdout
    assert failed.returncode == 2, failed.stdout + failed.stderr
    assert 'reason: error' in failed.stdout and '/joint_states: no message received yet' in failed.stdout
    assert refused.returncode == 1 and 'no /nobody/policy_node/act action server' in refused.stderr


def test_act_goal_refuses_a_missing_bound():
    done = subprocess.run(CLI + ['--max-seconds', '0'], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and '--max-seconds must be > 0' in done.stderr


def _changes(values: list) -> int:
    """How many commands differ from the one before them (a fresh action; a hold repeats its command)."""
    return sum(not np.array_equal(a, b) for (_, a), (_, b) in zip(values, values[1:], strict=False))


def _trailing_run(values: list) -> int:
    """How many commands at the end repeat the last one (the hold)."""
    run = 0
    for _, v in reversed(values):
        if not np.array_equal(v, values[-1][1]):
            break
        run += 1
    return run


@pytest.mark.parametrize('signum', [signal.SIGINT, signal.SIGTERM], ids=['SIGINT', 'SIGTERM'])
def test_ctrl_c_cancels_the_goal_and_the_arm_holds(signum, tmp_path, processes, rclpy_context):
    """SIGINT (Ctrl-C) or SIGTERM (timeout, systemd) mid-episode: the command cancels, prints, exits 0; arm holds.

    The goal's bound is long (120 s): only the cancel can end the episode this soon. After the node's stop
    (the result's commands_sent), at most a couple of fresh commands reach the controller, then the hold repeats.
    """
    probe = Probe(rclpy_context, Float64MultiArray, '/arm/commands')
    try:
        with serve_policy_file(RAMP, 'ramp', names=NAMES, step=0.002) as server:
            params = node_params(tmp_path, model='ramp', endpoint=f'127.0.0.1:{server.port}',
                                 status_rate_hz=10.0, **{'joints.names': NAMES, 'command.controller': 'arm'})
            proc = spawn_node(processes, tmp_path / 'node.log', params)
            probe.publish_joints(NAMES)
            assert probe.wait_connected(), node_log(proc)
            cli = processes.spawn(CLI + ['--instruction', 'reach', '--max-seconds', '120', '--episode-id', 'ctrl-c'])
            assert wait_for(lambda: _changes(probe.values()) > 20, 60), node_log(proc)     # the arm moves
            assert cli.poll() is None, cli.communicate()
            cli.send_signal(signum)
            out, err = cli.communicate(timeout=90)
            # the hold is republished: wait (in order of arrival) until it has repeated for a while
            assert wait_for(lambda: _trailing_run(probe.values()) >= 10, 30), node_log(proc)
            assert wait_for(lambda: any('ctrl-c: interrupted' in s.message for s in probe.status[-3:]), 30), \
                [s.message for s in probe.status[-3:]]
            values = probe.values()
    finally:
        probe.close()
    assert cli.returncode == 0, out + err + node_log(proc)
    lines = dict(line.split(': ', 1) for line in out.splitlines() if ': ' in line)
    assert lines['reason'] == 'interrupted' and lines['episode_id'] == 'ctrl-c', out
    assert 'interrupted: cancelling the goal' in err and 'Traceback' not in err, err
    sent = int(lines['commands_sent'])
    assert sent > 20 and float(lines['elapsed_s']) < 120.0, out
    # every fresh command the controller saw was counted by the episode, give or take a couple in flight
    assert _changes(values) <= sent + 2, (_changes(values), sent)
    assert _trailing_run(values) >= 10
