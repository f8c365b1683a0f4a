"""What the launch tests share: a worker whose port decides the rest, and a probe node per test class.

- :func:`serve_then`: ``seq serve <policy> --port 0`` (the package's own ``seq``) and an event handler that, once
  the worker prints the port it bound, adds the actions ``then(endpoint)`` returns (the launch file under test
  with ``endpoint:=127.0.0.1:<port>``), so no port is guessed.
- :class:`ProbeTestCase`: a unittest class whose ``probe`` (test/test_node_support.py's Probe: commands on
  ``COMMANDS``, ~/status, /diagnostics, the node's services and Act action in ``NAMESPACE``) lives in an rclpy
  Context of its own for the class; :meth:`ProbeTestCase.assert_a_goal_is_counted` runs one goal and checks its
  counts.
"""

from __future__ import annotations

import re
import sys
import time
import unittest
from collections.abc import Callable
from pathlib import Path
from typing import Any

from launch.actions import ExecuteProcess, RegisterEventHandler
from launch.event_handlers import OnProcessIO
from launch_ros.substitutions import FindPackagePrefix

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from test_node_support import Probe, wait_for  # noqa: E402

PACKAGE = 'sequence_ai_ros'


def serve_then(policy: str, then: Callable[[str], list[Any]]) -> list[Any]:
    """Return the actions that serve ``policy`` on a free port, then add ``then('127.0.0.1:<port>')``."""
    worker = ExecuteProcess(cmd=[[FindPackagePrefix(PACKAGE), f'/lib/{PACKAGE}/seq'], 'serve', policy, '--port', '0'],
                            name='seq_serve', output='screen')
    started: list[str] = []

    def on_output(event: Any) -> list[Any] | None:
        match = re.search(r'serving \S+ on (127\.0\.0\.1:\d+)', event.text.decode(errors='replace'))
        if match is None or started:
            return None
        started.append(match.group(1))
        return then(match.group(1))

    return [worker, RegisterEventHandler(OnProcessIO(target_action=worker, on_stdout=on_output))]


class ProbeTestCase(unittest.TestCase):
    """A test class with a probe node (``cls.probe``) for the node in ``NAMESPACE``, recording ``COMMANDS``."""

    COMMANDS = ''
    NAMESPACE = ''

    @classmethod
    def setUpClass(cls) -> None:
        import rclpy
        from std_msgs.msg import Float64MultiArray

        cls.context = rclpy.Context()
        rclpy.init(context=cls.context)
        cls.probe = Probe(cls.context, Float64MultiArray, cls.COMMANDS, namespace=cls.NAMESPACE,
                          name='launch_test_probe')

    @classmethod
    def tearDownClass(cls) -> None:
        import rclpy

        cls.probe.close()
        rclpy.shutdown(context=cls.context)

    def assert_a_goal_is_counted(self, rate_hz: float, wait_s: float, max_seconds: float = 3.0) -> Any:
        """Once the observations are fresh, run a ``max_seconds`` goal; return its Act.Result.

        It must end ``timeout``, count every control period at ``rate_hz`` (commands_sent + ticks_held +
        ticks_skipped = elapsed_s * rate_hz, within two), and commands must reach ``COMMANDS`` meanwhile. There is
        no upper bound from this side: between the episode's end and the result's arrival the node holds, and
        those hold commands fall inside the window too; the node's own counts are the exact claim.
        """
        probe = self.probe
        fresh = wait_for(lambda: probe.diag_message('observation') == 'all sources fresh', wait_s)
        self.assertTrue(fresh, f'observation: {probe.diag_message("observation")}')
        handle = probe.send_goal(instruction='hold still', max_seconds=max_seconds)
        self.assertTrue(handle.accepted)
        t_accepted = time.monotonic()
        result = probe.result(handle, timeout=wait_s)
        t_result = time.monotonic()
        self.assertEqual(result.reason, 'timeout', result.message)
        periods = result.elapsed_s * rate_hz
        counted = result.commands_sent + result.ticks_held + result.ticks_skipped
        self.assertLessEqual(abs(counted - periods), 2.0, f'{counted} ticks counted for {periods:.2f} periods')
        self.assertGreater(result.commands_sent, 0)
        received = [t for t, _ in list(probe.commands) if t_accepted <= t <= t_result]
        self.assertGreater(len(received), 0, f'no command on {self.COMMANDS} during the goal')
        return result
