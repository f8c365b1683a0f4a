"""``policy_node`` entry point: ``ros2 run sequence_ai_ros policy_node --ros-args --params-file ...``.

Executors (:mod:`.executors`), split by callback group: a SingleThreadedExecutor in the main thread
serves the observation and reporting groups (joint and camera callbacks, ~/status and /diagnostics
timers); a MultiThreadedExecutor in the thread ``seq-services`` serves the rest: services and the Act
action (reentrant: they block on gRPC or on an episode's end) and the lifecycle services (their own
reentrant group, so a blocking configure stalls nothing). Commands go out from the control thread
``seq-tick``.

With ``autostart`` the thread ``seq-autostart`` configures the node (retrying every second while the
worker is unreachable or its policy does not fit, each failure logged with its cause) and activates
it; without it the node waits, unconfigured, for ``ros2 lifecycle set <node> configure`` and
``activate``. SIGINT and SIGTERM stop the loop; shutdown then goes through the lifecycle: a last
hold, the episode ended ('interrupted'), rclpy shut down, so the arm is left holding.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import rclpy
from rclpy.exceptions import ParameterException
from rclpy.executors import ExternalShutdownException
from rclpy.lifecycle import TransitionCallbackReturn

from sequence_ai_ros.exceptions import ConfigError
from sequence_ai_ros.stop_signals import on_stop_signals

if TYPE_CHECKING:
    from sequence_ai_ros.node.policy_node import PolicyNode

#: GIL switch interval (s) while the node runs: a thread waiting for the GIL waits at most this long,
#: which bounds the control thread's delay behind Python work in callbacks (CPython's default is 5 ms).
SWITCH_INTERVAL_S = 0.001
#: Seconds between two autostart configure attempts.
AUTOSTART_RETRY_S = 1.0
#: Threads of the services executor: an Act goal and a service call may block at once, and the
#: lifecycle services must still answer.
SERVICE_THREADS = 3


def _init(args: Sequence[str] | None) -> rclpy.context.Context:
    argv = None if args is None else list(args)
    context = rclpy.context.Context()
    try:
        from rclpy.signals import SignalHandlerOptions

        rclpy.init(args=argv, context=context, signal_handler_options=SignalHandlerOptions.NO)
    except (ImportError, TypeError):  # older rclpy: its own handlers shut the context down on SIGINT
        rclpy.init(args=argv, context=context)
    return context


def autostart(node: PolicyNode, stop: threading.Event) -> bool:
    """Configure (retrying every :data:`AUTOSTART_RETRY_S` s until ``stop``) and activate ``node``.

    :returns: True once the node is active.
    """
    while not stop.is_set():
        if node.lifecycle_state == 'unconfigured':
            if node.trigger_configure() != TransitionCallbackReturn.SUCCESS:
                stop.wait(AUTOSTART_RETRY_S)
                continue
        if node.lifecycle_state == 'inactive':
            return node.trigger_activate() == TransitionCallbackReturn.SUCCESS
        return node.lifecycle_state == 'active'
    return False


def usage() -> str:
    """Return ``policy_node --help``: how to start it and every parameter of the schema."""
    from sequence_ai_ros.node.parameter_schema import load

    lines = ['usage: policy_node --ros-args [--params-file FILE] [-p NAME:=VALUE ...] [-r __ns:=/NAMESPACE]',
             '', 'The ROS 2 policy node (a lifecycle node). Parameters (defaults: config/policy_node.yaml;',
             'cameras.<name>.* exist for each name in camera_names):', '']
    for spec in load():
        name = spec.name.replace('__map_camera_names', '<name>')
        ro = ', read-only' if spec.read_only else ''
        lines.append(f'  {name}  ({spec.type}{ro}, default {spec.default!r})')
        lines.append(f'      {spec.description}')
    return '\n'.join(lines)


def spin_until(executor: Any, stop: threading.Event, context: Any) -> None:
    """Spin ``executor`` until ``stop`` is set or the context shuts down.

    A lifecycle cleanup destroys subscriptions and publishers from a service callback while another
    executor thread may be building its wait set from them: rclpy then raises ``InvalidHandle`` once
    (seen under load; it killed the services thread, leaving the node unmanageable). The entity is gone
    by then, so the next spin is clean: the loop goes on.
    """
    while not stop.is_set() and context.ok():
        try:
            executor.spin_once(timeout_sec=0.1)
        except ExternalShutdownException:
            return
        except Exception as exc:  # rclpy's InvalidHandle has no public import path across distros
            if type(exc).__name__ != 'InvalidHandle':
                raise


def main(args: Sequence[str] | None = None) -> int:
    """Run the policy node until SIGINT/SIGTERM; return the exit code.

    :returns: 0 after a clean shutdown (or ``--help``); 2 for a bad parameter (the message, on stderr, names it).
    """
    from sequence_ai_ros.node.executors import GroupsExecutor, OtherGroupsExecutor
    from sequence_ai_ros.node.policy_node import PolicyNode, rcl_reason

    argv = list(sys.argv[1:] if args is None else args)
    ros_args = argv.index('--ros-args') if '--ros-args' in argv else len(argv)
    if {'-h', '--help'} & set(argv[:ros_args]):
        print(usage())
        return 0

    sys.setswitchinterval(SWITCH_INTERVAL_S)
    try:
        context = _init(args)
    except Exception as exc:  # rcl refuses a bad remap/namespace (RCLError, no stable import path)
        print(f'policy_node: invalid --ros-args: {rcl_reason(exc)}', file=sys.stderr)
        return 2
    stop = threading.Event()
    on_stop_signals(stop.set)     # the handler takes no lock (see stop_signals)
    try:
        node = PolicyNode(context=context)
    except (ConfigError, ParameterException) as exc:   # rclpy's own refusals are converted; this is a backstop
        print(f'policy_node: {exc}', file=sys.stderr)
        rclpy.try_shutdown(context=context)
        return 2
    inputs = (node.inputs_group, node.reporting_group)
    services = OtherGroupsExecutor(inputs, num_threads=SERVICE_THREADS, context=context)
    services.add_node(node)       # node.executor: the action server's execute tasks run there
    executor = GroupsExecutor(node, inputs, context=context)
    services_done = threading.Event()     # the services spin on until the node has shut down
    services_thread = threading.Thread(target=spin_until, args=(services, services_done, context),
                                       name='seq-services', daemon=True)
    services_thread.start()
    starter = None
    if node.cfg.autostart:
        starter = threading.Thread(target=autostart, args=(node, stop), name='seq-autostart', daemon=True)
        starter.start()
    else:
        node.get_logger().info('autostart is false: waiting for lifecycle transitions (configure, activate)')
    try:
        spin_until(executor, stop, context)
    except KeyboardInterrupt:
        pass
    finally:
        stop.set()
        if starter is not None:
            starter.join(node.cfg.connect_timeout_s + 2.0)
        node.stop()
        services_done.set()
        services.shutdown(timeout_sec=2.0)
        services_thread.join(5.0)
        executor.shutdown(timeout_sec=2.0)
        node.episode_services.destroy()
        node.destroy_node()
        rclpy.try_shutdown(context=context)
    return 0


if __name__ == '__main__':
    sys.exit(main())
