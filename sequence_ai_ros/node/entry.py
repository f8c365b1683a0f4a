"""Console-script entry points of the ROS 2 programs, with one line instead of a traceback without ROS 2.

``policy_node`` and ``bag_player`` run on rclpy and the ROS 2 message packages, which come
from a ROS 2 install (or a sourced workspace), never from pip. Started where those do not import, each
prints one line saying how to get them and exits with :data:`EXIT_NO_ROS`. This module imports nothing
of ROS itself.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

#: Exit status when ROS 2 is missing (as a shell's "command not usable").
EXIT_NO_ROS = 2
#: Top-level modules that come from ROS 2 or the workspace, not from pip.
ROS_MODULES = frozenset({'rclpy', 'rosidl_runtime_py', 'builtin_interfaces', 'sensor_msgs', 'std_msgs', 'std_srvs',
                         'trajectory_msgs', 'geometry_msgs', 'diagnostic_msgs', 'action_msgs', 'lifecycle_msgs',
                         'control_msgs', 'rcl_interfaces', 'sequence_ai_msgs'})


def no_ros_hint(program: str, missing: str) -> str:
    """Return the one line printed when ``missing`` (a ROS 2 module) does not import for ``program``."""
    if missing == 'sequence_ai_msgs':
        how = 'build the workspace and source it (source install/setup.bash)'
    else:
        how = ('install ROS 2 (Humble, Jazzy or Kilted) and source it (source /opt/ros/<distro>/setup.bash), '
               'then your workspace (source install/setup.bash)')
    return f'{program}: needs ROS 2 (no module named {missing!r}): {how}'


def run_with_ros(program: str, load: Callable[[], Callable[[], int | None]]) -> int:
    """Import ``program``'s main with ``load`` and run it; without ROS 2, print one line and return 2.

    :param program: the console script's name, for the message.
    :param load: returns the main function (its import is where a missing rclpy shows).
    :returns: main's exit status, or :data:`EXIT_NO_ROS` when a ROS 2 module does not import.
    :raises ModuleNotFoundError: for a missing module that is not ROS 2's (a broken install says so itself).
    """
    try:
        return load()() or 0
    except ModuleNotFoundError as exc:
        top = (exc.name or '').split('.')[0]
        if top not in ROS_MODULES:
            raise
        print(no_ros_hint(program, top), file=sys.stderr)
        return EXIT_NO_ROS


def _node_main() -> Callable[[], int | None]:
    from sequence_ai_ros.node.main import main

    return main


def _player_main() -> Callable[[], int | None]:
    from sequence_ai_ros.bags.player import main

    return main


def policy_node() -> int:
    """``policy_node``: :func:`sequence_ai_ros.node.main.main`."""
    return run_with_ros('policy_node', _node_main)


def bag_player() -> int:
    """``bag_player``: :func:`sequence_ai_ros.bags.player.main` (rclpy imported when it plays)."""
    return run_with_ros('bag_player', _player_main)
