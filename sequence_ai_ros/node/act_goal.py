"""Send one ``~/act`` goal to a running ``policy_node`` and print its result (and label it, if asked).

Where ros2cli is installed, ``ros2 action send_goal`` does the same; this is for a shell without it (the
PyPI-wheel development set-up), and prints the result as ``key: value`` lines::

    python -m sequence_ai_ros.node.act_goal --instruction "pick up the bottle" --max-seconds 10
    python -m sequence_ai_ros.node.act_goal --node /robot1/policy_node --max-seconds 5 --label success

Ctrl-C cancels the goal, which is an interrupt: the node stops between actions and the arm holds.
Exit status: 0 when the episode ran and ended (completed, until, timeout, interrupted), 2 when it ended
with ``error`` or ``validate`` (the message says why: e.g. no joint_states received), 1 when the goal was
refused, no node answered in ``--wait`` seconds, the result did not come, or the label was not stored.
"""

from __future__ import annotations

import argparse
import sys
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


def main(argv: list[str] | None = None) -> int:
    """Run the command line; return the exit status."""
    args = _parser().parse_args(argv)
    if not args.max_seconds > 0:
        print('--max-seconds must be > 0', file=sys.stderr)
        return 1
    try:
        import rclpy
        from rclpy.action import ActionClient
        from sequence_ai_msgs.action import Act
        from sequence_ai_msgs.srv import Label
    except ModuleNotFoundError as exc:
        print(f'{exc.name} is missing: this needs ROS 2 (source its setup file, e.g. '
              '/opt/ros/<distro>/setup.bash, and the workspace\'s install/setup.bash)', file=sys.stderr)
        return 1
    rclpy.init()
    node = rclpy.create_node('seq_act_goal')
    try:
        client: Any = ActionClient(node, Act, f'{args.node}/act')
        if not client.wait_for_server(timeout_sec=args.wait):
            print(f'no {args.node}/act action server within {args.wait:g} s (is policy_node running and '
                  'active, in this ROS domain?)', file=sys.stderr)
            return 1
        goal = Act.Goal(instruction=args.instruction, max_seconds=args.max_seconds, max_actions=args.max_actions,
                        prefetch=True, episode_id=args.episode_id)
        handle = _spin(node, client.send_goal_async(goal), args.wait, 'the goal response')
        if handle is None or not handle.accepted:
            print('policy_node refused the goal (not active, or an episode is running)', file=sys.stderr)
            return 1
        try:
            wrapped = _spin(node, handle.get_result_async(), args.max_seconds + 30.0, 'the result')
        except KeyboardInterrupt:
            _spin(node, handle.cancel_goal_async(), 10.0, 'the cancel')
            wrapped = _spin(node, handle.get_result_async(), 30.0, 'the result')
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
    finally:
        node.destroy_node()
        rclpy.try_shutdown()


def _spin(node: Any, future: Any, timeout_s: float, what: str) -> Any:
    """Spin ``node`` until ``future`` is done or ``timeout_s`` passes; None (and a message) on time-out."""
    import rclpy

    end = time.monotonic() + timeout_s
    while not future.done() and time.monotonic() < end:
        rclpy.spin_until_future_complete(node, future, timeout_sec=min(0.5, max(0.0, end - time.monotonic())))
    if not future.done():
        print(f'no answer for {what} within {timeout_s:g} s', file=sys.stderr)
        return None
    return future.result()


if __name__ == '__main__':
    sys.exit(main())
