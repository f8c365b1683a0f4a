"""Foundation: real rclpy pub/sub and a custom service call between two processes, over real DDS.

Also checks that the custom interfaces of sequence_ai_msgs carry the fields the node uses.
"""

from __future__ import annotations

import time

import pytest

pytestmark = pytest.mark.ros

TALKER = r'''
import sys, rclpy
from std_msgs.msg import String
rclpy.init()
node = rclpy.create_node('talker')
pub = node.create_publisher(String, 'chatter', 10)
n = 0
def tick():
    global n
    n += 1
    pub.publish(String(data=f'hello {n}'))
node.create_timer(0.05, tick)
try:
    rclpy.spin(node)
except (KeyboardInterrupt, rclpy.executors.ExternalShutdownException):
    pass
'''

LABEL_SERVER = r'''
import rclpy
from sequence_ai_msgs.srv import Label
rclpy.init()
node = rclpy.create_node('label_server')
def handle(req, resp):
    resp.ok = req.success and req.episode_id == 'ep-1'
    resp.message = f'labelled {req.episode_id}: {req.notes}'
    return resp
node.create_service(Label, 'label', handle)
try:
    rclpy.spin(node)
except (KeyboardInterrupt, rclpy.executors.ExternalShutdownException):
    pass
'''


def _spin_until(node, predicate, timeout: float) -> bool:
    from rclpy.executors import SingleThreadedExecutor

    executor = SingleThreadedExecutor(context=node.context)
    executor.add_node(node)
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            executor.spin_once(timeout_sec=0.05)
            if predicate():
                return True
        return False
    finally:
        executor.remove_node(node)
        executor.shutdown()


def test_pubsub_across_processes(processes, rclpy_context):
    import rclpy
    from std_msgs.msg import String

    proc = processes.python(TALKER)
    node = rclpy.create_node('listener', context=rclpy_context)
    got: list[str] = []
    node.create_subscription(String, 'chatter', lambda m: got.append(m.data), 10)
    ok = _spin_until(node, lambda: len(got) >= 3, timeout=30)
    node.destroy_node()
    assert ok, f'no messages from the talker process; its stderr: {proc.poll() and proc.stderr.read()}'
    numbers = [int(s.split()[1]) for s in got]
    assert numbers == sorted(numbers) and all(s.startswith('hello ') for s in got)


def test_custom_service_across_processes(processes, rclpy_context):
    import rclpy
    from sequence_ai_msgs.srv import Label

    processes.python(LABEL_SERVER)
    node = rclpy.create_node('label_client', context=rclpy_context)
    client = node.create_client(Label, 'label')
    assert client.wait_for_service(timeout_sec=30), 'label service never appeared'
    future = client.call_async(Label.Request(success=True, notes='cup in gripper', episode_id='ep-1'))
    assert _spin_until(node, future.done, timeout=15)
    resp = future.result()
    node.destroy_node()
    assert resp.ok is True
    assert resp.message == 'labelled ep-1: cup in gripper'


def test_custom_interfaces_have_the_node_fields():
    from sequence_ai_msgs.action import Act
    from sequence_ai_msgs.msg import RunStatus
    from sequence_ai_msgs.srv import EndEpisode, StartEpisode

    goal = Act.Goal(instruction='pick', max_seconds=3.0)
    assert goal.prefetch is True and goal.max_actions == 0
    assert {'reason', 'underruns', 'underrun_s', 'max_seam_jump'} <= set(Act.Result.get_fields_and_field_types())
    assert 'buffer_s' in Act.Feedback.get_fields_and_field_types()
    assert 'episode_id' in StartEpisode.Response.get_fields_and_field_types()
    assert 'reason' in EndEpisode.Response.get_fields_and_field_types()
    assert 'latency_p95_ms' in RunStatus.get_fields_and_field_types()
