"""The ROS side of ``make check-sim``: drive episodes on ``sim_robot`` through ``policy_node``, and measure them.

:class:`SimOperator` is one rclpy node (its own executor thread) that does what an operator does: reset the
simulator to a held-out instance (``/sim_robot/reset``), send the node an Act goal, wait for the task's success
(``/sim_robot/status``), end the episode (``/policy_node/end_episode``) and read the Act result. It records
the commands the node publishes (receive times, values) so a missed episode's trace can be shown.

Time to success counts from the first commanded action, in simulator steps: the node runs with
``on_underrun: stop`` (a position controller holds its last command by itself, so nothing is published
before an episode's first action nor between episodes), so the simulator's ``first_command_step`` is the step
of the episode's first action and ``(success_step - first_command_step + 1) * dt`` its time to success. The
simulator waits after a reset and starts counting steps at the first command, so ``first_command_step`` is 1
and the time the goal takes to reach its first action is no part of the episode's steps.
"""

from __future__ import annotations

import dataclasses
import os
import re
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

DT = 1 / 80
INSTRUCTION = 'open the drawer'


@dataclasses.dataclass
class Episode:
    """One served episode's outcome (the simulator's counts and the node's Act result)."""

    condition: str
    index: int
    success: bool
    time_to_success_s: float | None
    reason: str
    actions: int
    chunks: int
    underruns: int
    underrun_s: float
    max_seam_jump: float
    latency_p50_ms: float
    latency_p95_ms: float
    overruns: int
    first_command_step: int
    success_step: int
    max_command_gap_s: float = 0.0      # longest time between two commands the node published (a hold)
    max_target_jump_m: float = 0.0      # largest change of ee_xyz between two commands
    node_line: str = ''                 # the node's per-episode log line
    requests: int = -1                  # requests sent (the worker's inferences), from node_line; -1: unknown


class SimOperator:
    """The operator's node (see the module docstring)."""

    def __init__(self, context: Any, instruction: str = INSTRUCTION) -> None:
        import rclpy
        from rclpy.action import ActionClient
        from rclpy.executors import SingleThreadedExecutor
        from sequence_ai_msgs.action import Act
        from sequence_ai_msgs.msg import RunStatus, SimStatus
        from sequence_ai_msgs.srv import EndEpisode, Label, ResetSim
        from std_msgs.msg import Float64MultiArray

        self.Act, self.ResetSim, self.EndEpisode, self.Label = Act, ResetSim, EndEpisode, Label
        self.instruction = instruction
        self.context = context
        self.node = rclpy.create_node('sim_check_operator', context=context)
        self._lock = threading.Lock()
        self.status: Any = None
        self.commands: list[tuple[float, np.ndarray]] = []
        self.node_status: Any = None
        self.node.create_subscription(SimStatus, '/sim_robot/status', self._on_status, 10)
        self.node.create_subscription(RunStatus, '/policy_node/status', self._on_node_status, 10)
        self.node.create_subscription(Float64MultiArray, '/position_controller/commands', self._on_command, 1000)
        self.reset_client = self.node.create_client(ResetSim, '/sim_robot/reset')
        self.end_client = self.node.create_client(EndEpisode, '/policy_node/end_episode')
        self.label_client = self.node.create_client(Label, '/policy_node/label')
        self.act = ActionClient(self.node, Act, '/policy_node/act')
        self.executor = SingleThreadedExecutor(context=context)
        self.executor.add_node(self.node)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._spin, name='sim-check-operator', daemon=True)
        self._thread.start()

    def _spin(self) -> None:
        while not self._stop.is_set() and self.context.ok():
            self.executor.spin_once(timeout_sec=0.05)

    def _on_status(self, msg: Any) -> None:
        with self._lock:
            self.status = msg

    def _on_node_status(self, msg: Any) -> None:
        with self._lock:
            self.node_status = msg

    def _on_command(self, msg: Any) -> None:
        with self._lock:
            self.commands.append((time.monotonic(), np.asarray(msg.data, np.float64)))

    @staticmethod
    def _wait(future: Any, timeout: float, what: str) -> Any:
        deadline = time.monotonic() + timeout
        while not future.done():
            if time.monotonic() > deadline:
                raise RuntimeError(f'{what}: no answer within {timeout:.0f} s')
            time.sleep(0.005)
        return future.result()

    def publishers(self, topic: str) -> int:
        return self.node.count_publishers(topic)

    def wait_node(self, timeout: float) -> None:
        """Wait for the node's action server, its end_episode service and the simulator's reset service."""
        if not self.act.wait_for_server(timeout_sec=timeout):
            raise RuntimeError('/policy_node/act did not appear')
        for client, name in ((self.end_client, 'end_episode'), (self.label_client, 'label'),
                             (self.reset_client, '/sim_robot/reset')):
            if not client.wait_for_service(timeout_sec=timeout):
                raise RuntimeError(f'{name} did not appear')

    def latest_status(self, episode: int, after: float, timeout: float = 5.0) -> Any:
        """The first ~/status of ``episode`` stamped (received) after ``after`` (monotonic s)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                st = self.status
            if st is not None and st.episode == episode and time.monotonic() > after:
                return st
            time.sleep(0.01)
        raise RuntimeError(f'no ~/status of episode {episode} within {timeout:.0f} s')

    def wait_active(self, timeout: float) -> None:
        """Wait until policy_node is active (it autostarts: configure connects) and its deployment is ready."""
        from lifecycle_msgs.srv import GetState

        with self._lock:
            self.node_status = None

        client = self.node.create_client(GetState, '/policy_node/get_state')
        deadline = time.monotonic() + timeout
        state = ''
        try:
            while time.monotonic() < deadline:
                if client.wait_for_service(timeout_sec=1.0):
                    state = self._wait(client.call_async(GetState.Request()), 10, 'get_state').current_state.label
                    if state == 'active':
                        break
                time.sleep(0.2)
        finally:
            self.node.destroy_client(client)
        while time.monotonic() < deadline:
            with self._lock:
                st = self.node_status
            if state == 'active' and st is not None and st.connected and st.ready:
                return
            time.sleep(0.1)
        raise RuntimeError(f'policy_node was not active and ready within {timeout:.0f} s (lifecycle '
                           f'{state or "unknown"}, ~/status {getattr(self.node_status, "state", "none")})')

    def warm_up(self, prefetch: bool, max_seconds: float) -> Episode:
        """One episode on train_tasks[0] (a demonstration instance, never an evaluation seed), not counted."""
        return self.episode('warm_up', 0, prefetch=prefetch, max_seconds=max_seconds, split='train')[0]

    def label(self, episode_id: str, success: bool) -> None:
        """Label ``episode_id`` on the worker through ``/policy_node/label`` (the simulator's success)."""
        reply = self._wait(self.label_client.call_async(self.Label.Request(success=bool(success),
                                                                           episode_id=episode_id)), 15, 'label')
        if not reply.ok:
            raise RuntimeError(f'label {episode_id}: {reply.message}')

    def episode(self, condition: str, index: int, *, prefetch: bool, max_seconds: float,
                split: str = 'test', label: bool = False) -> tuple[Episode, list]:
        """Run one episode on ``split``'s task ``index``; return its outcome and the commands published in it.

        ``label``: label it on the worker with the simulator's success (``label(success=...)``).
        """
        reply = self._wait(self.reset_client.call_async(self.ResetSim.Request(split=split, index=index)), 30, 'reset')
        if not reply.success:
            raise RuntimeError(f'reset to {split}[{index}] failed: {reply.message}')
        sim_episode = int(reply.episode)
        t_goal = time.monotonic()
        goal = self.Act.Goal(instruction=self.instruction, max_seconds=float(max_seconds), prefetch=bool(prefetch),
                             episode_id=f'{condition}-{split}-{index}')
        handle = self._wait(self.act.send_goal_async(goal), 30, 'Act goal')
        if not handle.accepted:
            raise RuntimeError(f'policy_node rejected the goal of {condition} test[{index}]')
        result_future = handle.get_result_async()
        while not result_future.done():
            with self._lock:
                st = self.status
            if st is not None and st.episode == sim_episode and (st.success or st.truncated):
                break
            time.sleep(0.005)
        if not result_future.done():
            self._wait(self.end_client.call_async(self.EndEpisode.Request()), 15, 'end_episode')
        result = self._wait(result_future, 30, 'Act result').result
        st = self.latest_status(sim_episode, time.monotonic())
        with self._lock:
            trace = [(t, v) for t, v in self.commands if t >= t_goal]
            self.commands = [c for c in self.commands if c[0] >= time.monotonic() - 1.0]
        success = st.success_step > 0 and st.first_command_step > 0
        tts = (st.success_step - st.first_command_step + 1) * DT if success else None
        if label:
            self.label(goal.episode_id, bool(success))
        ep = Episode(condition, index, bool(success), tts, result.reason, int(result.actions), int(result.chunks),
                     int(result.underruns), float(result.underrun_s), float(result.max_seam_jump),
                     float(result.latency_p50_ms), float(result.latency_p95_ms), int(st.overruns),
                     int(st.first_command_step), int(st.success_step))
        if len(trace) > 1:
            times = np.array([t for t, _ in trace])
            values = np.array([v for _, v in trace])
            ep.max_command_gap_s = float(np.diff(times).max())
            ep.max_target_jump_m = float(np.abs(np.diff(values[:, :3], axis=0)).max())
        return ep, [(round(t - t_goal, 4), [round(float(x), 5) for x in v]) for t, v in trace]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.executor.shutdown(timeout_sec=1.0)
        self.node.destroy_node()


class LoadSampler:
    """The 1-minute load average, sampled every second on a thread of its own; :meth:`peak` since a mark."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name='sim-check-load', daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.monotonic(), os.getloadavg()[0]))
            self._stop.wait(1.0)

    def peak(self, since: float) -> float:
        vals = [v for t, v in self.samples if t >= since]
        return max(vals) if vals else os.getloadavg()[0]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)


def node_lines(log: Path) -> dict[str, str]:
    """The node's per-episode lines, by episode id."""
    out = {}
    for line in log.read_text(errors='replace').splitlines():
        m = re.search(r'episode (\S+) ended: (.*)', line)
        if m:
            out[m.group(1)] = m.group(2)
    return out


def peak_in_flight(line: str) -> int:
    m = re.search(r'peak_in_flight (\d+)', line)
    return int(m.group(1)) if m else -1


def requests_sent(line: str) -> int:
    """The requests an episode sent (the worker's inferences), from the node's line; -1 when it has none."""
    m = re.search(r'requests (\d+)', line)
    return int(m.group(1)) if m else -1


def inferences(eps: list[dict], chunk: int, chunk_s: float) -> dict:
    """Inferences per episode and per executed chunk, and an ideal pipeline's, over served episodes ``eps``.

    Per executed chunk: the requests sent over the chunk steps executed / ``chunk``. The ideal pipeline sends one
    request every ``chunk_s`` - (the largest round trip), over the same executed steps: ``chunk_s / (chunk_s -
    largest)`` per executed chunk, the largest round trip being the episodes' median p95 round trip (each
    one's Act result ``latency_p95_ms``: an episode's largest but for its outliers, typical over the episodes;
    a loaded machine's single slow second in one episode does not make the ideal infinite). None where unknown
    (no requests counted, or a round trip of a whole chunk).
    """
    counted = [e for e in eps if e.get('requests', -1) >= 0]
    if not counted:
        return {'requests_per_episode': None, 'per_chunk': None, 'ideal_per_chunk': None, 'vs_ideal': None}
    executed = sum(e['actions'] for e in counted) / chunk
    per_chunk = sum(e['requests'] for e in counted) / executed if executed else None
    largest = statistics.median(e.get('latency_p95_ms', 0.0) for e in counted) / 1000
    ideal = chunk_s / (chunk_s - largest) if largest < chunk_s else None
    return {'requests_per_episode': sum(e['requests'] for e in counted) / len(counted), 'per_chunk': per_chunk,
            'ideal_per_chunk': ideal, 'largest_rtt_ms': largest * 1000,
            'vs_ideal': per_chunk / ideal if per_chunk is not None and ideal else None}


def summarize(episodes: list[Episode] | list[dict]) -> dict:
    """Success count, median and p90 time to success (s, successes only), underruns, underrun_s, overruns."""
    eps = [e if isinstance(e, dict) else dataclasses.asdict(e) for e in episodes]
    times = sorted(e['time_to_success_s'] for e in eps if e['success'])
    return {'n': len(eps), 'success': sum(bool(e['success']) for e in eps),
            'median_s': statistics.median(times) if times else None,
            'p90_s': float(np.percentile(times, 90)) if times else None,
            'underruns': sum(e.get('underruns', 0) for e in eps),
            'underrun_s': sum(e.get('underrun_s', 0.0) for e in eps),
            'episodes_with_underruns': sum(e.get('underruns', 0) > 0 for e in eps),
            'overruns': sum(e.get('overruns', 0) for e in eps)}
