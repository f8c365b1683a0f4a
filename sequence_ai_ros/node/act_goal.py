"""Send one ``~/act`` goal to a running ``policy_node`` and print its result (and label it, if asked).

Where ros2cli is installed, ``ros2 action send_goal`` does the same; this is for a shell without it (the
PyPI-wheel development set-up), and prints the result as ``key: value`` lines::

    python -m sequence_ai_ros.node.act_goal --instruction "pick up the bottle" --max-seconds 10
    python -m sequence_ai_ros.node.act_goal --node /robot1/policy_node --max-seconds 5 --label success

Ctrl-C (also SIGTERM or SIGHUP) cancels the goal, which is an interrupt: the node stops between actions and
the arm holds; the
command waits (up to ``--wait`` s for the cancel, 30 s for the result) and prints the result (``reason:
interrupted``). A second Ctrl-C exits at once, without the result (the node has the cancel if it was sent).
Exit status: 0 when the episode ran and ended (completed, until, timeout, interrupted), 2 when it ended
with ``error`` or ``validate`` (the message says why: e.g. no joint_states received), 1 when the goal was
refused, no node answered in ``--wait`` seconds, the result did not come, or the label was not stored,
130 when Ctrl-C came before a goal was accepted, or twice.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time
from typing import Any

from sequence_ai_ros.client.outcome import FAILED_REASONS


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog='python -m sequence_ai_ros.node.act_goal', description=__doc__.split('\n')[0])
    p.add_argument('--node', default='/policy_node', help='the policy_node (with its namespace)')
    p.add_argument('--instruction', default='', help='the natural-language task, pinned for the episode')
    p.add_argument('--max-seconds', type=float, required=True, help='the episode bound (s, > 0)')
    p.add_argument('--max-actions', type=int, default=0, help='chunk steps to execute; 0: unlimited')
    p.add_argument('--episode-id', default='', help='empty: the node makes one')
    p.add_argument('--label', choices=('success', 'failure'), help='label the episode through ~/label afterwards')
    p.add_argument('--notes', default='', help="the label's notes")
    p.add_argument('--wait', type=float, default=10.0, help='seconds to wait for the node to answer')
    return p


class _Interrupts:
    """A SIGINT/SIGTERM/SIGHUP handler: the first sets :attr:`requested`, a second raises KeyboardInterrupt.

    rclpy's own handler would shut the context down on the first Ctrl-C, before a cancel could be sent;
    this one lets the command cancel its goal and wait for the result.
    """

    def __init__(self) -> None:
        self.requested = threading.Event()

    def __call__(self, signum: int, frame: Any) -> None:
        if self.requested.is_set():
            raise KeyboardInterrupt
        self.requested.set()


def main(argv: list[str] | None = None) -> int:
    """Run the command line; return the exit status (see the module docstring)."""
    args = _parser().parse_args(argv)
    if not args.max_seconds > 0:
        print('--max-seconds must be > 0', file=sys.stderr)
        return 1
    try:
        import rclpy
        import rclpy.action  # noqa: F401  (checked here, used in _run)
        import sequence_ai_msgs.action  # noqa: F401
    except ModuleNotFoundError as exc:
        print(f'{exc.name} is missing: this needs ROS 2 (source its setup file, e.g. '
              '/opt/ros/<distro>/setup.bash, and the workspace\'s install/setup.bash)', file=sys.stderr)
        return 1
    from rclpy.signals import SignalHandlerOptions

    interrupts = _Interrupts()
    # Ctrl-C is ours: it cancels the goal; so do SIGTERM and SIGHUP (timeout, systemd, docker stop, a closed
    # terminal), which would otherwise end the command without a cancel and leave the arm moving
    stop_signals = [signal.SIGINT, signal.SIGTERM] + ([signal.SIGHUP] if hasattr(signal, 'SIGHUP') else [])
    previous = {signum: signal.signal(signum, interrupts) for signum in stop_signals}
    rclpy.init(signal_handler_options=SignalHandlerOptions.NO)
    node = rclpy.create_node('seq_act_goal')
    try:
        return _run(args, node, interrupts)
    except KeyboardInterrupt:
        print('interrupted again: exiting without the result', file=sys.stderr)
        return 130
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        node.destroy_node()
        rclpy.try_shutdown()


def _run(args: argparse.Namespace, node: Any, interrupts: _Interrupts) -> int:
    """Send the goal, wait for its result (cancelling it on Ctrl-C), print it, label it; return the exit status."""
    from rclpy.action import ActionClient
    from sequence_ai_msgs.action import Act
    from sequence_ai_msgs.srv import Label

    client: Any = ActionClient(node, Act, f'{args.node}/act')
    end = time.monotonic() + args.wait
    while not client.server_is_ready() and time.monotonic() < end and not interrupts.requested.is_set():
        time.sleep(0.05)
    if interrupts.requested.is_set():
        print('interrupted before a goal was sent', file=sys.stderr)
        return 130
    if not client.server_is_ready():
        print(f'no {args.node}/act action server within {args.wait:g} s (is policy_node running and '
              'active, in this ROS domain?)', file=sys.stderr)
        return 1
    goal = Act.Goal(instruction=args.instruction, max_seconds=args.max_seconds, max_actions=args.max_actions,
                    prefetch=True, episode_id=args.episode_id)
    # the goal response is awaited even after a Ctrl-C: an accepted goal is then cancelled at once
    handle = _spin(node, client.send_goal_async(goal), args.wait, 'the goal response')
    if handle is None or not handle.accepted:
        print('policy_node refused the goal (not active, or an episode is running)', file=sys.stderr)
        return 1
    result_future = handle.get_result_async()
    wrapped = _spin(node, result_future, args.max_seconds + 30.0, 'the result', stop=interrupts.requested)
    if wrapped is None and interrupts.requested.is_set():
        print('interrupted: cancelling the goal (Ctrl-C again exits at once)', file=sys.stderr, flush=True)
        if _spin(node, handle.cancel_goal_async(), args.wait, 'the cancel') is None:
            return 1
        wrapped = _spin(node, result_future, 30.0, 'the result')
    if wrapped is None:
        return 1
    result = wrapped.result
    for name in Act.Result.get_fields_and_field_types():
        print(f'{name}: {getattr(result, name)}')
    if args.label:
        srv: Any = node.create_client(Label, f'{args.node}/label')
        if not srv.wait_for_service(timeout_sec=args.wait):
            print(f'no {args.node}/label service within {args.wait:g} s', file=sys.stderr)
            return 1
        req = Label.Request(success=args.label == 'success', notes=args.notes, episode_id=result.episode_id)
        answer = _spin(node, srv.call_async(req), args.wait, 'the label')
        if answer is None:
            return 1
        print(f'label: {"stored" if answer.ok else "refused"}' + (f' ({answer.message})' if answer.message else ''))
        if not answer.ok:
            return 1
    return 2 if result.reason in FAILED_REASONS else 0


def _spin(node: Any, future: Any, timeout_s: float, what: str, stop: threading.Event | None = None) -> Any:
    """Spin ``node`` until ``future`` is done, ``timeout_s`` (s) passes or ``stop`` is set.

    :returns: the future's result; None when it is not done (with a message on time-out, none on ``stop``).
    """
    import rclpy

    end = time.monotonic() + timeout_s
    while not future.done() and time.monotonic() < end and not (stop is not None and stop.is_set()):
        # short slices: a Ctrl-C is acted on within one (the handler runs between them)
        rclpy.spin_until_future_complete(node, future, timeout_sec=min(0.1, max(0.0, end - time.monotonic())))
    if not future.done():
        if stop is None or not stop.is_set():
            print(f'no answer for {what} within {timeout_s:g} s', file=sys.stderr)
        return None
    return future.result()


if __name__ == '__main__':
    sys.exit(main())
