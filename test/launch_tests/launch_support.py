"""What the launch tests share: a worker whose port decides the rest, and a probe node per test class.

- :func:`serve_then`: ``seq serve <policy> --port 0`` (the package's own ``seq``) and an event handler that, once
  the worker prints the port it bound, adds the actions ``then(endpoint)`` returns (the launch file under test
  with ``endpoint:=127.0.0.1:<port>``), so no port is guessed.
- :class:`ProbeTestCase`: a unittest class whose ``probe`` (test/test_node_support.py's Probe: commands on
  ``COMMANDS``, ~/status, /diagnostics, the node's services and Act action in ``NAMESPACE``) lives in an rclpy
  Context of its own for the class.
"""

from __future__ import annotations

import re
import sys
import unittest
from collections.abc import Callable
from pathlib import Path
from typing import Any

from launch.actions import ExecuteProcess, RegisterEventHandler
from launch.event_handlers import OnProcessIO
from launch_ros.substitutions import FindPackagePrefix

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from test_node_support import Probe  # noqa: E402

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
