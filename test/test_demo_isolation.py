"""The demo isolates itself: a private ROS domain, a refusal while another process publishes its commands.

The real demo (``python -m sequence_ai_ros.demo``, synthetic robot: no dataset needed) against a real
foreign publisher process on the G1 command topic, in the domain the demo is told to use. And every
failure names its cause, even an exception without a message.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

pytestmark = [pytest.mark.ros, pytest.mark.slow]

FOREIGN = r'''
import sys, time, rclpy
from std_msgs.msg import Float64MultiArray
rclpy.init()
node = rclpy.create_node('foreign_controller_client')
pub = node.create_publisher(Float64MultiArray, '/g1_position_controller/commands', 10)
print('publishing', flush=True)
end = time.monotonic() + float(sys.argv[1])
while time.monotonic() < end:
    pub.publish(Float64MultiArray(data=[0.0] * 26))
    time.sleep(0.05)
'''


def test_demo_refuses_while_another_process_publishes_on_its_command_topic(tmp_path, processes):
    domain = str(150 + os.getpid() % 50)
    env = dict(os.environ, ROS_DOMAIN_ID=domain, SEQ_DEMO_DOMAIN_ID=domain)
    foreign = processes.python(FOREIGN, '240', env=env)
    assert foreign.stdout.readline().strip() == 'publishing'
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, '-m', 'sequence_ai_ros.demo', '--dataset', str(tmp_path / 'none'),
                           '--out', str(tmp_path / 'out'), '--max-seconds', '2'], capture_output=True, text=True,
                          timeout=240, env=env)
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    # refused before starting its node (or, should discovery be slow, when it counts the publishers)
    before = f'in domain {domain} (1 on /g1_position_controller/commands)'
    after = 'publishers on /g1_position_controller/commands (expected policy_node alone)'
    assert before in done.stderr or after in done.stderr, done.stderr[-2000:]
    assert time.monotonic() - t0 < 240


def test_a_derived_domain_that_is_taken_moves_to_the_next(monkeypatch, processes):
    """Without SEQ_DEMO_DOMAIN_ID, a foreign publisher on /joint_states sends the demo to another domain."""
    import rclpy

    from sequence_ai_ros.demo import pipeline
    from sequence_ai_ros.demo.pipeline import _join_domain, private_domain

    # discovery takes over the demo's 3 s on loaded cores (CI): a taken domain then looked free
    monkeypatch.setattr(pipeline, 'DISCOVERY_S', 15.0)
    own = int(os.environ['ROS_DOMAIN_ID'])    # this test process's private domain
    for key in ('ROS_DOMAIN_ID', 'ROS_AUTOMATIC_DISCOVERY_RANGE', 'ROS_LOCALHOST_ONLY'):
        monkeypatch.setenv(key, os.environ.get(key, ''))   # restored after the test
    monkeypatch.delenv('SEQ_DEMO_DOMAIN_ID', raising=False)
    foreign = processes.python(FOREIGN.replace('/g1_position_controller/commands', '/joint_states'), '120',
                               env=dict(os.environ))
    assert foreign.stdout.readline().strip() == 'publishing'
    env: dict[str, str] = {}
    private_domain(env, own)
    domain, context, operator = _join_domain(env, own, '/g1_position_controller/commands')
    try:
        assert domain != own and env['ROS_DOMAIN_ID'] == str(domain)
        assert operator.publishers('/joint_states') == 0
    finally:
        operator.close()
        rclpy.try_shutdown(context=context)


def test_demo_uses_a_private_domain_by_default(monkeypatch):
    from sequence_ai_ros.demo.pipeline import private_domain

    monkeypatch.delenv('SEQ_DEMO_DOMAIN_ID', raising=False)
    monkeypatch.setenv('ROS_DOMAIN_ID', '0')
    env: dict[str, str] = {}
    domain = private_domain(env)
    assert 1 <= domain <= 101 and env['ROS_DOMAIN_ID'] == os.environ['ROS_DOMAIN_ID'] == str(domain)
    assert env['ROS_AUTOMATIC_DISCOVERY_RANGE'] == 'LOCALHOST'


def test_a_failure_without_a_message_still_names_its_cause(monkeypatch, tmp_path, capsys):
    """The 'demo FAILED: unknown reason' path: the message always says what failed."""
    import sequence_ai_ros.demo.__main__ as demo_main

    def fails(_args):
        raise TimeoutError()
    monkeypatch.setattr(demo_main, 'run', fails)
    assert demo_main.main(['--dataset', str(tmp_path), '--out', str(tmp_path / 'out')]) == 1
    err = capsys.readouterr().err
    assert 'demo FAILED: TimeoutError (no message)' in err
