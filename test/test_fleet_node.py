"""The ROS policy node through the fleet: 3 replicas behind HAProxy; every request of an episode on one replica.

Which replica served a request is read from each replica's own Prometheus counter (the node's commands
pass through its safety limits, so the replica's pid in the actions would not survive to the topic).
"""

from __future__ import annotations

import re
import urllib.request
from pathlib import Path

import pytest
from std_msgs.msg import Float64MultiArray
from test_node_support import Probe, node_log, node_params, spawn_node

from sequence_ai_ros.cli import main as seq_main

POLICY = Path(__file__).resolve().parent / 'policies' / 'replica_echo.py'
pytestmark = [pytest.mark.ros, pytest.mark.slow]
Fleet = pytest.importorskip('sequence_ai_ros.worker.fleet').Fleet


def chunk_counts(fleet) -> dict[int, float]:
    out = {}
    for r in fleet.replicas:
        text = urllib.request.urlopen(f'http://127.0.0.1:{r.metrics_port}/metrics', timeout=5).read().decode()
        m = re.search(r'^seq_requests_total\{deployment="replica_echo",outcome="chunk"\} (\S+)$', text, re.M)
        out[r.index] = float(m.group(1)) if m else 0.0
    return out


@pytest.fixture
def probe(rclpy_context):
    p = Probe(rclpy_context, Float64MultiArray, '/arm/commands')
    yield p
    p.close()


def test_a_node_episode_stays_on_one_replica(tmp_path, processes, probe, seq_home):
    try:
        from sequence_ai_ros.worker.fleet import haproxy_binary
        haproxy_binary()
    except Exception as exc:
        pytest.skip(f'{exc}')
    assert seq_main(['deploy', str(POLICY), '--name', 'replica_echo']) == 0
    with Fleet(['replica_echo'], 3, home=seq_home) as fleet:
        params = node_params(tmp_path, model='replica_echo', endpoint=fleet.address, **{
            'joints.names': ['a', 'b'], 'command.controller': 'arm', 'status_rate_hz': 10.0})
        proc = spawn_node(processes, tmp_path / 'node.log', params)
        probe.publish_joints(['a', 'b'])
        assert probe.wait_connected(timeout=90), node_log(proc)
        served = set()
        for k in range(4):
            before = chunk_counts(fleet)
            handle = probe.send_goal(instruction=f'episode {k}', max_seconds=1.5)
            assert handle.accepted
            result = probe.result(handle)
            after = chunk_counts(fleet)
            moved = {i for i in after if after[i] > before[i]}
            assert len(moved) == 1 and result.chunks >= 2, (k, before, after, result, node_log(proc))
            served |= moved
        assert served <= {r.index for r in fleet.replicas}
