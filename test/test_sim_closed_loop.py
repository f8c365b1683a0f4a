"""The closed loop on a simulated robot: sim_robot + policy_node + ``seq serve`` of Meta-World's scripted expert.

Three processes as a user starts them (the simulator, the node, the worker from ``seq init metaworld-expert``),
real rclpy over DDS in this test's own ROS domain, real gRPC on loopback; the test resets the simulator to
held-out instances, sends Act goals and ends each episode when ``~/success`` says so. It asserts counts:
episodes solved, one log line per episode, and that a new goal holds the reset robot where it is instead of
dragging it back to the previous episode's last command.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from test_node_support import REPO, node_log, node_params, spawn_node, wait_for

pytest.importorskip('metaworld', reason='the simulated robot needs metaworld (requirements-dev.txt)')

pytestmark = [pytest.mark.ros, pytest.mark.slow]

EPISODES = 3
MAX_SECONDS = 5.0       # the expert solves drawer-open in ~90 steps (1.1 s); Meta-World allows 500 (6.25 s)


def _serve(processes, tmp_path: Path) -> str:
    """``seq init metaworld-expert`` then ``seq serve`` it on a free port; return host:port."""
    seq = [sys.executable, '-m', 'sequence_ai_ros.cli']
    subprocess.run([*seq, 'init', 'metaworld-expert', str(tmp_path / 'expert')], check=True, capture_output=True)
    proc = processes.spawn([*seq, 'serve', str(tmp_path / 'expert' / 'policy.py'), '--host', '127.0.0.1',
                            '--port', '0'])
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        match = re.search(r'serving .* on (127\.0\.0\.1:\d+)', line)
        if match:
            return match.group(1)
        assert line or proc.poll() is None, f'seq serve exited: {proc.stderr.read()}'
    raise AssertionError('seq serve did not start within 60 s')


class SimProbe:
    """The operator's side: ~/reset, ~/success and ~/status of sim_robot, the commands policy_node sends."""

    def __init__(self, context) -> None:
        import rclpy
        from rclpy.executors import SingleThreadedExecutor
        from sequence_ai_msgs.msg import SimStatus
        from sequence_ai_msgs.srv import ResetSim
        from std_msgs.msg import Bool, Float64MultiArray

        self.node = rclpy.create_node('sim_probe', context=context)
        self.success: list[tuple[float, bool]] = []
        self.status: list = []
        self.commands: list[tuple[float, np.ndarray]] = []
        self.node.create_subscription(Bool, '/sim_robot/success', lambda m: self.success.append(
            (time.monotonic(), m.data)), 100)
        self.node.create_subscription(SimStatus, '/sim_robot/status', self.status.append, 10)
        self.node.create_subscription(Float64MultiArray, '/position_controller/commands',
                                      lambda m: self.commands.append((time.monotonic(), np.array(m.data))), 1000)
        self.reset_client = self.node.create_client(ResetSim, '/sim_robot/reset')
        self.ResetSim = ResetSim
        self.executor = SingleThreadedExecutor(context=context)
        self.executor.add_node(self.node)
        import threading

        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._spin, name='sim-probe-spin', daemon=True)
        self._thread.start()

    def _spin(self) -> None:
        while not self._stop.is_set():
            self.executor.spin_once(timeout_sec=0.05)

    def reset(self, index: int) -> object:
        assert self.reset_client.wait_for_service(timeout_sec=60), '/sim_robot/reset never appeared'
        future = self.reset_client.call_async(self.ResetSim.Request(split='test', index=index))
        assert wait_for(future.done, 30), 'reset did not answer'
        return future.result()

    def publishers(self, topic: str) -> int:
        return self.node.count_publishers(topic)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.executor.shutdown(timeout_sec=1.0)
        self.node.destroy_node()


def test_the_scripted_expert_served_through_the_node_solves_held_out_drawers(tmp_path, processes, rclpy_context):
    from test_node_support import Probe

    sim = SimProbe(rclpy_context)
    probe = Probe(rclpy_context)
    try:
        # isolation: this test's own ROS domain (conftest); nobody else publishes on the robot's topics
        time.sleep(1.0)
        own = {'/joint_states': 1, '/position_controller/commands': 0}     # the probe's unused joint publisher
        for topic, n in own.items():
            assert sim.publishers(topic) == n, f'another process publishes on {topic} in this ROS domain'
        endpoint = _serve(processes, tmp_path)
        (tmp_path / 'sim.yaml').write_text("sim_robot:\n  ros__parameters:\n    camera_names: ['']\n")
        sim_log = tmp_path / 'sim.log'
        sim_proc = processes.spawn([sys.executable, '-m', 'sequence_ai_ros.sim.main', '--ros-args',
                                    '--params-file', str(REPO / 'config' / 'sim_robot.yaml'),
                                    '--params-file', str(tmp_path / 'sim.yaml')],
                                   stdout=open(sim_log, 'w'), stderr=subprocess.STDOUT)  # noqa: SIM115
        node = spawn_node(processes, tmp_path / 'node.log', REPO / 'config' / 'sim_policy_node.yaml',
                          node_params(tmp_path, model='expert', endpoint=endpoint, status_rate_hz=10.0))
        assert probe.wait_connected(60), node_log(node)
        assert wait_for(lambda: sim.status, 30), sim_log.read_text()
        assert sim.publishers('/joint_states') == 2 and sim.publishers('/position_controller/commands') == 1

        solved, last_command, checked = 0, None, 0
        for index in range(EPISODES):
            reply = sim.reset(index)
            assert reply.success, reply.message
            reset_ee = np.array(reply.state[:3])
            handle = probe.send_goal(instruction='open the drawer', max_seconds=MAX_SECONDS)
            assert handle.accepted, node_log(node)
            # from the goal's acceptance on (not from its sending: a loaded machine delays the answer while the
            # node still holds the last episode's command, as it should between goals)
            t_goal = time.monotonic()
            ok = wait_for(lambda t=t_goal: any(s for t_s, s in sim.success if t_s > t), MAX_SECONDS + 2)
            probe.call('end_episode')
            result = probe.result(handle)
            solved += bool(ok) and result.reason == 'completed'
            if last_command is not None and np.abs(last_command[:3] - reset_ee).max() > 0.03:
                # a new goal holds the measured (reset) state, never the last episode's command
                after = [v for t, v in sim.commands if t > t_goal]
                fresh = [v for v in after if not np.allclose(v, last_command)]
                assert len(after) - len(fresh) <= 3, "the new goal republished the last episode's command"
                assert fresh and np.abs(fresh[0][:3] - reset_ee).max() < 0.02, (fresh[:1], reset_ee)
                checked += 1
            time.sleep(0.1)
            last_command = sim.commands[-1][1]
        assert solved == EPISODES, f'{solved}/{EPISODES} solved; {node_log(node)}'
        assert checked == EPISODES - 1, 'every later episode started far from the last command'
        lines = re.findall(r'episode \S+ ended: .*', Path(node.log).read_text())
        assert len(lines) == EPISODES, lines
        for line in lines:
            assert all(k in line for k in ('actions', 'chunks', 'underruns', 'max_seam_jump', 'max_seam_gap',
                                           'peak_in_flight')), line
        status = sim.status[-1]
        assert status.episode == EPISODES + 1 and status.success and status.success_step > 0
        assert sim_proc.poll() is None, sim_log.read_text()
    finally:
        probe.close()
        sim.close()
