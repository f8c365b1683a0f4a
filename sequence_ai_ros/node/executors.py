"""Two executors over one node, split by callback group: observations apart from blocking callbacks.

rclpy adds a node to one executor, and its MultiThreadedExecutor costs the control thread dearly when it
serves the camera and joint callbacks: measured on this 2-core machine with joint_states at 100 Hz and
nothing else, the node took 51 % of a core on a MultiThreadedExecutor and 14 % on a
SingleThreadedExecutor; under load it fell to 34 Hz with a 214 ms p99 (``make demo``). Yet the
services, the Act action and the lifecycle services must live on the node itself (issue 15) and they
block (gRPC, an episode's end, a configure that connects). So each executor here serves only some of
the node's callback groups (:meth:`can_execute` filters by group; :meth:`get_nodes` names the node):

- :class:`GroupsExecutor`, a SingleThreadedExecutor for the observation and reporting groups, spun by
  the main thread, as the node's camera callbacks always were;
- :class:`OtherGroupsExecutor`, a MultiThreadedExecutor for every other group (services, Act, lifecycle
  services, parameter services), spun by the thread ``seq-services``. The node is added to it, so the
  action server's execute tasks run on it.

Each rebuilds its wait set at every spin, so entities created later (configure's subscriptions) are
picked up at the next wait (the main loop waits at most 0.1 s).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from rclpy.callback_groups import CallbackGroup
from rclpy.executors import MultiThreadedExecutor, SingleThreadedExecutor


class GroupsExecutor(SingleThreadedExecutor):
    """A SingleThreadedExecutor serving only ``groups`` of ``node`` (the node is not added to it).

    :param node: the node.
    :param groups: the callback groups this executor serves.
    :param kwargs: passed to SingleThreadedExecutor (``context``).
    """

    def __init__(self, node: Any, groups: Iterable[CallbackGroup], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._served_node = node
        self._groups = tuple(groups)

    def get_nodes(self) -> list[Any]:
        """The one node whose groups this executor serves."""
        return [self._served_node]

    def can_execute(self, entity: Any) -> bool:
        """Only entities of the served groups (then rclpy's own check)."""
        return any(entity.callback_group is g for g in self._groups) and super().can_execute(entity)


class OtherGroupsExecutor(MultiThreadedExecutor):
    """A MultiThreadedExecutor serving every callback group of its nodes except ``excluded``.

    :param excluded: the groups another executor serves.
    :param kwargs: passed to MultiThreadedExecutor (``num_threads``, ``context``).
    """

    def __init__(self, excluded: Iterable[CallbackGroup], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._excluded = tuple(excluded)

    def can_execute(self, entity: Any) -> bool:
        """Every entity outside the excluded groups (then rclpy's own check)."""
        return not any(entity.callback_group is g for g in self._excluded) and super().can_execute(entity)
