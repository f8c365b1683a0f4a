"""The demo's own ROS 2 node: it plays the operator (Act goal, label) and watches the commands.

It subscribes to the controller's command topic and stamps every command on arrival (the receive
side of tick jitter), sends one ``~/act`` goal and calls
``~/label``. It runs a SingleThreadedExecutor in a named thread of its own.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import rclpy
from rclpy.action import ActionClient
from rclpy.executors import SingleThreadedExecutor
from rclpy.qos import QoSProfile, ReliabilityPolicy
from sequence_ai_msgs.action import Act
from sequence_ai_msgs.srv import Label
from std_msgs.msg import Float64MultiArray

if TYPE_CHECKING:
    from rclpy.client import Client


@dataclass
class CommandLog:
    """Commands seen on the controller topic: arrival times (monotonic s) and values (n, D)."""

    times: list[float] = field(default_factory=list)
    values: list[list[float]] = field(default_factory=list)

    def rate_hz(self) -> float:
        """Commands / duration (Hz) between the first and the last arrival."""
        if len(self.times) < 2:
            return 0.0
        return (len(self.times) - 1) / (self.times[-1] - self.times[0])

    def jitter_p99_ms(self, period_s: float) -> float:
        """p99 of |dt - period| between arrivals (ms)."""
        if len(self.times) < 3:
            return float('nan')
        dt = np.diff(np.asarray(self.times))
        return float(np.percentile(np.abs(dt - period_s), 99) * 1e3)


class Operator:
    """A small rclpy node that drives ``policy_node`` through its action and services."""

    def __init__(self, node_name: str, command_topic: str, context: rclpy.context.Context) -> None:
        self.context = context
        self.node = rclpy.create_node('seq_demo_operator', context=context)
        base = f'/{node_name}'
        self.command_topic = command_topic
        self.commands = CommandLog()
        self._lock = threading.Lock()
        self.node.create_subscription(Float64MultiArray, command_topic, self._on_command,
                                      QoSProfile(depth=100, reliability=ReliabilityPolicy.RELIABLE))
        from diagnostic_msgs.msg import DiagnosticArray

        self._control_name = f'{node_name}: control'
        self.control_worst: tuple[int, str] = (0, '')          # worst /diagnostics control level seen, its message
        self.control_values: dict[str, str] = {}               # the latest control status's values
        self.node.create_subscription(DiagnosticArray, '/diagnostics', self._on_diagnostics, 10)
        # the message types are untyped (rosidl writes no stubs), so are the clients' type parameters
        self.act: ActionClient[Any, Any, Any] = ActionClient(self.node, Act, f'{base}/act')
        self.label_client: Client[Any, Any] = self.node.create_client(Label, f'{base}/label')
        from lifecycle_msgs.srv import GetState

        self.get_state: Client[Any, Any] = self.node.create_client(GetState, f'{base}/get_state')
        self.executor = SingleThreadedExecutor(context=context)
        self.executor.add_node(self.node)
        self._thread = threading.Thread(target=self._spin, name='demo-operator', daemon=True)
        self._stop = threading.Event()
        self._thread.start()

    def _spin(self) -> None:
        while not self._stop.is_set() and self.context.ok():
            self.executor.spin_once(timeout_sec=0.05)

    def _on_command(self, msg: Float64MultiArray) -> None:
        with self._lock:
            self.commands.times.append(time.monotonic())
            self.commands.values.append(list(msg.data))

    def _on_diagnostics(self, msg: Any) -> None:     # a diagnostic_msgs DiagnosticArray
        for status in msg.status:
            if status.name == self._control_name:
                level = int.from_bytes(status.level, 'little') if isinstance(status.level, bytes) else int(status.level)
                with self._lock:
                    self.control_values = {kv.key: kv.value for kv in status.values}
                    if level > self.control_worst[0]:
                        self.control_worst = (level, status.message)

    @staticmethod
    def _wait(future: rclpy.task.Future, timeout: float, what: str) -> Any:    # an untyped ROS message
        deadline = time.monotonic() + timeout
        while not future.done():
            if time.monotonic() > deadline:
                raise RuntimeError(f'{what}: no answer within {timeout:.0f}s')
            time.sleep(0.01)
        return future.result()

    def wait_ready(self, timeout: float) -> None:
        """Wait until the node's action server and label service are up.

        :raises RuntimeError: when they do not appear within ``timeout`` (s).
        """
        if not self.act.wait_for_server(timeout_sec=timeout):
            raise RuntimeError('policy_node ~/act did not appear')
        if not self.label_client.wait_for_service(timeout_sec=timeout):
            raise RuntimeError('policy_node ~/label did not appear')
        from lifecycle_msgs.srv import GetState

        # policy_node is a lifecycle node: goals are accepted once it is active (it autostarts)
        deadline = time.monotonic() + timeout
        state = ''
        while time.monotonic() < deadline:
            if self.get_state.wait_for_service(timeout_sec=1.0):
                state = self._wait(self.get_state.call_async(GetState.Request()), 10.0, 'get_state').current_state.label
                if state == 'active':
                    return
            time.sleep(0.2)
        raise RuntimeError(f'policy_node did not become active within {timeout:.0f}s (lifecycle state '
                           f'{state or "unknown"}: configure failed? the worker unreachable, or its policy does '
                           'not fit the G1 config)')

    def publishers(self, topic: str) -> int:
        """The number of publishers on ``topic``."""
        return self.node.count_publishers(topic)

    def command_publishers(self) -> int:
        """The number of publishers on the command topic (the demo's policy_node must be the only one)."""
        return self.node.count_publishers(self.command_topic)

    def run_goal(self, instruction: str, max_seconds: float, max_actions: int = 0) -> Act.Result:
        """Send one Act goal and wait for its result (bounded by max_seconds + 30 s).

        :raises RuntimeError: naming the cause when the goal is rejected, no result comes, or the goal
            ended without a reason (policy_node failed inside it: the goal status says how).
        """
        from action_msgs.msg import GoalStatus

        goal = Act.Goal(instruction=instruction, max_seconds=float(max_seconds), max_actions=int(max_actions),
                        prefetch=True)
        handle = self._wait(self.act.send_goal_async(goal), 30.0, 'Act goal')
        if not handle.accepted:
            raise RuntimeError('policy_node rejected the Act goal (not active, or an episode was running)')
        wrapped = self._wait(handle.get_result_async(), max_seconds + 30.0, 'Act result')
        result = wrapped.result
        if not result.reason:
            status = {v: k for k, v in vars(GoalStatus).items() if k.startswith('STATUS_')}.get(
                wrapped.status, str(wrapped.status))
            raise RuntimeError(f'the Act goal ended with {status} and no reason: policy_node failed inside the '
                               f'goal{f" ({result.message})" if result.message else ""}')
        return result

    def label(self, success: bool, notes: str, episode_id: str = '') -> Label.Response:
        """Call ``~/label`` and return the response."""
        req = Label.Request(success=success, notes=notes, episode_id=episode_id)
        return self._wait(self.label_client.call_async(req), 30.0, 'label')

    def close(self) -> None:
        """Stop spinning and destroy the node."""
        self._stop.set()
        self._thread.join(2.0)
        self.executor.shutdown(timeout_sec=1.0)
        self.node.destroy_node()
