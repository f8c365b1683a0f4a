"""``sim_robot`` entry point: ``ros2 run sequence_ai_ros sim_robot --ros-args --params-file config/sim_robot.yaml``.

A SingleThreadedExecutor in the main thread serves the node's subscriptions, status timer and reset service;
the node's own ``sim-step`` thread steps the physics. SIGINT and SIGTERM stop both.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Sequence

import rclpy
from rclpy.exceptions import ParameterException
from rclpy.executors import ExternalShutdownException, SingleThreadedExecutor

from sequence_ai_ros.exceptions import ConfigError, MissingDependency
from sequence_ai_ros.stop_signals import on_stop_signals


def main(args: Sequence[str] | None = None) -> int:
    """Run the simulated robot until SIGINT/SIGTERM.

    :returns: 0 after a clean stop; 2 for a bad parameter or a missing dependency (the message says which).
    """
    from rclpy.signals import SignalHandlerOptions

    from sequence_ai_ros.sim.node import SimRobot

    context = rclpy.context.Context()
    rclpy.init(args=None if args is None else list(args), context=context,
               signal_handler_options=SignalHandlerOptions.NO)
    stop = threading.Event()
    on_stop_signals(stop.set)
    try:
        node = SimRobot(context=context)
    except (ConfigError, MissingDependency, ParameterException) as exc:
        print(f'sim_robot: {exc}', file=sys.stderr)
        rclpy.try_shutdown(context=context)
        return 2
    executor = SingleThreadedExecutor(context=context)
    executor.add_node(node)
    try:
        node.start()
    except (ConfigError, MissingDependency, RuntimeError) as exc:
        print(f'sim_robot: {exc}', file=sys.stderr)
        node.stop()
        node.destroy_node()
        rclpy.try_shutdown(context=context)
        return 2
    try:
        while not stop.is_set() and context.ok() and not node.failed.is_set():
            executor.spin_once(timeout_sec=0.1)
    except (KeyboardInterrupt, ExternalShutdownException):
        pass
    finally:
        node.stop()
        executor.shutdown(timeout_sec=2.0)
        node.destroy_node()
        rclpy.try_shutdown(context=context)
    return 1 if node.failed.is_set() else 0


if __name__ == '__main__':
    sys.exit(main())
