"""``policy_node`` entry point: ``ros2 run sequence_ai_ros policy_node --ros-args --params-file ...``.

Executors: the policy node spins on a SingleThreadedExecutor in the main thread (camera and joint
callbacks, status and diagnostics timers); its companion interface node (services, Act) spins on a
MultiThreadedExecutor in the thread ``seq-services``; commands go out from the control thread
``seq-tick``. SIGINT and SIGTERM stop the loop; shutdown then publishes a last hold, ends any episode
('interrupted') and shuts rclpy down, so the arm is left holding.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Sequence

import rclpy
from rclpy.exceptions import ParameterException
from rclpy.executors import ExternalShutdownException, MultiThreadedExecutor, SingleThreadedExecutor

from sequence_ai_ros.exceptions import ConfigError

#: GIL switch interval (s) while the node runs: a thread waiting for the GIL waits at most this long,
#: which bounds the control thread's delay behind Python work in callbacks (CPython's default is 5 ms).
SWITCH_INTERVAL_S = 0.001


def _init(args: Sequence[str] | None) -> rclpy.context.Context:
    context = rclpy.context.Context()
    try:
        from rclpy.signals import SignalHandlerOptions

        rclpy.init(args=args, context=context, signal_handler_options=SignalHandlerOptions.NO)
    except (ImportError, TypeError):  # older rclpy: its own handlers shut the context down on SIGINT
        rclpy.init(args=args, context=context)
    return context


def main(args: Sequence[str] | None = None) -> int:
    """Run the policy node until SIGINT/SIGTERM; return the exit code.

    :returns: 0 after a clean shutdown; 2 for a bad parameter (the message, on stderr, names it).
    """
    from sequence_ai_ros.node.episode_services import PolicyInterface
    from sequence_ai_ros.node.policy_node import PolicyNode

    sys.setswitchinterval(SWITCH_INTERVAL_S)
    context = _init(args)
    stop = threading.Event()

    def on_signal(_signum: int, _frame: object) -> None:
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    try:
        node = PolicyNode(context=context)
    except (ConfigError, ParameterException) as exc:   # rclpy's own refusals are converted; this is a backstop
        print(f'policy_node: {exc}', file=sys.stderr)
        rclpy.try_shutdown(context=context)
        return 2
    interface = PolicyInterface(node, context=context)
    executor = SingleThreadedExecutor(context=context)
    executor.add_node(node)
    services = MultiThreadedExecutor(num_threads=3, context=context)
    services.add_node(interface)
    services_thread = threading.Thread(target=services.spin, name='seq-services', daemon=True)
    services_thread.start()
    node.start()
    try:
        while not stop.is_set() and context.ok():
            executor.spin_once(timeout_sec=0.1)
    except (KeyboardInterrupt, ExternalShutdownException):
        pass
    finally:
        node.stop()
        services.shutdown(timeout_sec=2.0)
        services_thread.join(5.0)
        executor.shutdown(timeout_sec=2.0)
        interface.destroy_node()
        node.destroy_node()
        rclpy.try_shutdown(context=context)
    return 0


if __name__ == '__main__':
    sys.exit(main())
