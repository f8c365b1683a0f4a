"""The policy node as a ROS-native node: namespaces, lifecycle transitions, services on the node itself.

Real node processes (rclpy over DDS), a real gRPC worker on 127.0.0.1 port 0 serving
``test/policies/node_ramp.py`` (a ramp from the observed state), probe nodes in the test process.
"""

from __future__ import annotations

import socket
import time

import numpy as np
import pytest
from std_msgs.msg import Float64MultiArray
from test_node_support import RAMP, Probe, node_log, node_params, spawn_node, wait_for

from sequence_ai_ros.worker import serve_policy_file

pytestmark = [pytest.mark.ros, pytest.mark.slow]

NAMES = ['j0', 'j1', 'j2', 'j3']


def _params(tmp_path, port, name='params.yaml', **extra):
    base = {'model': 'ramp', 'endpoint': f'127.0.0.1:{port}', 'joints.names': NAMES, 'command.controller': 'arm',
            'status_rate_hz': 10.0, 'diagnostics_rate_hz': 5.0}
    base.update(extra)
    return node_params(tmp_path, name, node_key='/**/policy_node', **base)


def test_two_namespaced_nodes_drive_two_robots_from_one_worker_without_cross_talk(tmp_path, processes,
                                                                                   rclpy_context):
    probes = {ns: Probe(rclpy_context, Float64MultiArray, f'/{ns}/arm/commands', namespace=ns, name=f'probe_{ns}')
              for ns in ('robot1', 'robot2')}
    base = {'robot1': 0.1, 'robot2': 5.1}        # measured states far apart: a mixed-up command shows
    try:
        with serve_policy_file(RAMP, 'ramp', names=NAMES, step=0.002) as server:
            procs = {ns: spawn_node(processes, tmp_path / f'{ns}.log', _params(tmp_path, server.port, f'{ns}.yaml'),
                                    namespace=ns) for ns in probes}
            for ns, probe in probes.items():
                probe.publish_joints(NAMES, positions=lambda b=base[ns]: b + np.arange(4) * 0.1)
            for ns, probe in probes.items():
                assert probe.wait_connected(), node_log(procs[ns])
            handles = {ns: p.send_goal(instruction=f'reach {ns}', max_seconds=1.5) for ns, p in probes.items()}
            assert all(h.accepted for h in handles.values())
            results = {ns: probes[ns].result(h) for ns, h in handles.items()}
            graph = probes['robot1'].node
            services = {n for n, _ in graph.get_service_names_and_types_by_node('policy_node', '/robot1')}
            publishers = {ns: graph.count_publishers(f'/{ns}/arm/commands') for ns in probes}
            root_publishers = graph.count_publishers('/arm/commands')
    finally:
        values = {ns: np.array([v for _, v in p.values()]) for ns, p in probes.items()}
        for p in probes.values():
            p.close()
    for ns in probes:
        assert results[ns].reason == 'timeout', (ns, results[ns])
        v = values[ns]
        assert len(v) > 30, node_log(procs[ns])
        measured = base[ns] + np.arange(4) * 0.1
        assert np.allclose(v[0], measured), f'{ns}: the hold before the first action is its own measured state'
        assert np.all(np.abs(v - measured) < 1.0), f'{ns} received commands computed from the other robot'
        assert np.any(np.abs(v[-1] - measured) > 1e-3), f'{ns}: the ramp should have moved'
    assert results['robot1'].episode_id != results['robot2'].episode_id
    assert publishers == {'robot1': 1, 'robot2': 1} and root_publishers == 0
    # The services, the Act action and the lifecycle services belong to the node itself.
    for name in ('start_episode', 'end_episode', 'interrupt', 'label', 'act/_action/send_goal', 'get_state',
                 'change_state'):
        assert f'/robot1/policy_node/{name}' in services, sorted(services)


def _lifecycle(probe):
    from lifecycle_msgs.srv import ChangeState, GetState

    node = probe.node
    base = probe.node_path
    change = node.create_client(ChangeState, f'{base}/change_state')
    get = node.create_client(GetState, f'{base}/get_state')
    assert change.wait_for_service(timeout_sec=20) and get.wait_for_service(timeout_sec=20)

    def state():
        fut = get.call_async(GetState.Request())
        assert wait_for(fut.done, 10)
        return fut.result().current_state.label

    def transition(label, timeout=20.0):
        req = ChangeState.Request()
        req.transition.label = label
        fut = change.call_async(req)
        return fut, (lambda: wait_for(fut.done, timeout) and fut.result().success)
    return state, transition


def test_lifecycle_transitions_configure_activate_deactivate_cleanup_shutdown(tmp_path, processes, rclpy_context):
    probe = Probe(rclpy_context, Float64MultiArray, '/arm/commands')
    try:
        with serve_policy_file(RAMP, 'ramp', names=NAMES, step=0.002) as server:
            proc = spawn_node(processes, tmp_path / 'node.log', _params(tmp_path, server.port, autostart=False))
            probe.publish_joints(NAMES)
            state, transition = _lifecycle(probe)
            assert state() == 'unconfigured'
            # /diagnostics says what an unconfigured node is: not connecting, not observing, no control thread
            assert wait_for(lambda: probe.diag_value('connection', 'state') == 'not connected', 10), node_log(proc)
            assert probe.diag_message('observation') == 'not observing (lifecycle state unconfigured)'
            assert probe.diag_value('control', 'scheduling') == 'no control thread (lifecycle state unconfigured)'
            assert not probe.send_goal(instruction='reach', max_seconds=5.0).accepted   # not active: rejected
            assert transition('configure')[1](), node_log(proc)
            assert state() == 'inactive'
            assert probe.wait_connected(active=False), node_log(proc)
            # configured: the subscriptions are up, so the observation reports what they hold
            assert wait_for(lambda: probe.diag_message('observation') == 'all sources fresh', 10), node_log(proc)
            assert probe.diag_value('control', 'scheduling') == 'no control thread (lifecycle state inactive)'
            resp = probe.call('start_episode', instruction='reach', max_seconds=5.0)
            assert not resp.accepted and 'not active' in resp.message
            time.sleep(0.3)
            assert not probe.commands, 'an inactive node published commands'
            assert transition('activate')[1](), node_log(proc)
            assert state() == 'active'
            handle = probe.send_goal(instruction='reach', max_seconds=20.0)
            assert handle.accepted
            assert wait_for(lambda: len(probe.values()) > 30, 10), node_log(proc)
            assert transition('deactivate')[1](), node_log(proc)    # deactivate: hold
            result = probe.result(handle)
            assert result.reason == 'interrupted' and result.message.startswith('lifecycle deactivate'), result
            time.sleep(0.3)
            n = len(probe.commands)
            time.sleep(0.4)
            assert len(probe.commands) == n, 'commands went on after deactivate'
            last = [v for _, v in probe.values()][-2:]
            assert all(np.array_equal(v, last[0]) for v in last), 'deactivate leaves the last command held'
            assert not np.allclose(last[-1], 0.0)
            assert transition('cleanup')[1](), node_log(proc)
            assert state() == 'unconfigured'
            assert transition('configure')[1]() and transition('activate')[1](), node_log(proc)
            handle = probe.send_goal(instruction='reach again', max_seconds=1.0)
            assert handle.accepted and probe.result(handle).reason == 'timeout'
            assert transition('shutdown')[1](), node_log(proc)
            assert state() == 'finalized'
    finally:
        probe.close()


def test_lifecycle_services_answer_while_configure_blocks_on_the_worker(tmp_path, processes, rclpy_context):
    """A worker that accepts TCP and never answers: configure blocks up to connect_timeout_s; get_state does not."""
    hang = socket.socket()
    hang.bind(('127.0.0.1', 0))
    hang.listen(8)
    port = hang.getsockname()[1]
    probe = Probe(rclpy_context)
    try:
        proc = spawn_node(processes, tmp_path / 'node.log',
                          _params(tmp_path, port, autostart=False, connect_timeout_s=8.0))
        state, transition = _lifecycle(probe)
        future, done = transition('configure', timeout=30.0)
        time.sleep(0.5)                              # configure is now inside the connect
        assert state() in ('configuring', 'unconfigured')
        assert not future.done(), 'get_state answered only after configure returned'
        assert done() is False, 'configure against a silent worker must fail'
        assert state() == 'unconfigured'
        assert wait_for(lambda: probe.status and probe.status[-1].message, 10)
        assert 'configure failed' in node_log(proc)
    finally:
        probe.close()
        hang.close()


def test_autostart_says_what_it_waits_for_while_the_worker_is_unreachable(tmp_path, processes, rclpy_context):
    """No silence while the worker is away, and the node activates once it appears.

    The first attempt names model and endpoint, the failure its cause, and a reminder follows while it
    lasts (every CONFIGURE_REMINDER_S).
    """
    from sequence_ai_ros.node.policy_node import CONFIGURE_REMINDER_S

    free = socket.socket()
    free.bind(('127.0.0.1', 0))
    port = free.getsockname()[1]
    free.close()                                  # nothing listens there (yet)
    proc = spawn_node(processes, tmp_path / 'node.log', _params(tmp_path, port, autostart=True, connect_timeout_s=1.0))
    assert wait_for(lambda: f'configuring: connecting to ramp at 127.0.0.1:{port}' in node_log(proc), 10), \
        node_log(proc)
    assert wait_for(lambda: 'configure failed' in node_log(proc), 10), node_log(proc)
    assert wait_for(lambda: 'still not configured after' in node_log(proc), CONFIGURE_REMINDER_S + 10), node_log(proc)
    assert node_log(proc).count('configure failed') == 1, 'the same cause was logged again instead of a reminder'
    # the hint names the node's own knobs (its parameter, and $SEQ_ENDPOINT, which it reads when that is empty),
    # not the Python API's connect()
    log = node_log(proc)
    assert '-p endpoint:=HOST:PORT' in log and '$SEQ_ENDPOINT' in log and 'connect(' not in log, log
    with serve_policy_file(RAMP, 'ramp', names=NAMES, step=0.002, port=port):
        assert wait_for(lambda: 'active: commanding' in node_log(proc), 20), node_log(proc)
