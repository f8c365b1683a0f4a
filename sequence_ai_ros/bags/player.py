"""Play a rosbag2 into ROS 2 at its recorded timing: the replay behind the tests and the demo.

``bag_player BAG [--rate 2.0] [--loop] [--clock] [--remap /from:=/to] [--namespace NS] [--topics T ...]
[--start S] [--duration S]`` (console script), or :class:`BagPlayer` from Python.

A topic whose message type is not installed here (e.g. ``nav_msgs/msg/Odometry`` without nav_msgs) is
skipped, and listed (:attr:`BagPlayer.skipped`, and a line on stdout): the rest of the bag plays. Only a
bag with no playable topic at all is refused. ``--namespace robot1`` moves every recorded topic under
``/robot1`` (after ``--remap``), to feed one of several namespaced robots.

The bag is read with ``rosbags`` (sqlite3 or mcap, any metadata version it reads) and each record is
published as it is stored: ``publisher.publish(serialized_bytes)``, so nothing is deserialised. A message
recorded at bag time t is published at wall time ``start + (t - t_first) / rate`` (``time.monotonic``),
so rate 2.0 plays twice as fast. Publishers are reliable, volatile, depth 10: compatible with both
reliable and best-effort (sensor-data) subscribers. With ``clock``, ``/clock`` (rosgraph_msgs/Clock)
carries the bag time of each message before it is published, for nodes with ``use_sim_time``.

Threads: :meth:`BagPlayer.run` plays in the caller's thread; :meth:`BagPlayer.start` runs it in one named
thread (``bag-player``) owned by the player, stopped by :meth:`BagPlayer.stop` (stop Event, timed join).
This module is a ROS tool and imports rclpy; the capture and export modules never do.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sequence_ai_ros.exceptions import ConfigError, MissingDependency


def message_class(msgtype: str) -> Any:
    """Return the rclpy message class of ``pkg/msg/Name``.

    :raises ConfigError: when the package's Python messages are not installed.
    """
    pkg, _, name = msgtype.partition('/msg/')
    try:
        return getattr(importlib.import_module(f'{pkg}.msg'), name)
    except (ImportError, AttributeError):
        raise ConfigError(f'message type {msgtype} is not installed (no {pkg}.msg.{name}); '
                          f'install its ROS package to play this topic') from None



#: Seconds given to the subscriber side of discovery once this side sees a subscription (s).
MATCH_SETTLE_S = 0.3


class BagPlayer:
    """Publish a bag's messages at their recorded timing.

    :param bag: the rosbag2 directory.
    :param rate: playback speed factor (> 0); 2.0 is twice as fast.
    :param loop: start over at the end until stopped.
    :param clock: publish ``/clock`` with the bag time.
    :param remap: {recorded topic: published topic}.
    :param topics: play only these recorded topics (None: all).
    :param start_s: skip the first ``start_s`` seconds of the bag.
    :param duration_s: play at most this many bag seconds (None: to the end).
    :param context: the rclpy Context (None: the default one, which must be initialised).
    :param namespace: prefix every published topic with ``/<namespace>`` ('' for none).
    :raises ConfigError: for a bad rate, an unreadable bag, unknown topics, or no topic whose message type
        is installed (topics of uninstalled types are skipped and listed in :attr:`skipped`).
    """

    def __init__(self, bag: str | Path, *, rate: float = 1.0, loop: bool = False, clock: bool = False,
                 remap: dict[str, str] | None = None, topics: Sequence[str] | None = None, start_s: float = 0.0,
                 duration_s: float | None = None, context: Any = None, node_name: str = 'bag_player',
                 namespace: str = '') -> None:
        if not rate > 0:
            raise ConfigError(f'rate must be > 0, got {rate}')
        try:
            from rosbags.rosbag2 import Reader
        except ImportError as exc:
            raise MissingDependency(f'playing bags needs rosbags ({exc}); pip install rosbags') from None
        import rclpy
        from rclpy.qos import DurabilityPolicy, QoSProfile, ReliabilityPolicy

        self.bag = Path(bag)
        self.rate, self.loop, self.clock = float(rate), loop, clock
        self.start_s, self.duration_s = float(start_s), duration_s
        self.remap = dict(remap or {})
        self.namespace = namespace.strip('/')
        try:
            self._reader = Reader(self.bag)
            self._reader.open()
        except Exception as exc:  # rosbags raises ReaderError and OSError subclasses
            raise ConfigError(f'cannot read bag {self.bag}: {exc}') from None
        known = {c.topic for c in self._reader.connections}
        if topics is not None and not set(topics) <= known:
            raise ConfigError(f'bag {self.bag} has no topics {sorted(set(topics) - known)} (has {sorted(known)})')
        wanted = [c for c in self._reader.connections if topics is None or c.topic in topics]
        #: {recorded topic: message type} of the topics skipped because their type is not installed here.
        self.skipped: dict[str, str] = {}
        classes: dict[int, Any] = {}
        for conn in wanted:
            try:
                classes[conn.id] = message_class(conn.msgtype)
            except ConfigError:
                self.skipped[conn.topic] = conn.msgtype
        self.connections = [c for c in wanted if c.id in classes]
        if not self.connections:
            self._reader.close()
            raise ConfigError(f'bag {self.bag}: no topic to play; the message types of '
                              f'{sorted(self.skipped.items())} are not installed')
        self.node = rclpy.create_node(node_name, context=context)
        qos = QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE, durability=DurabilityPolicy.VOLATILE)
        self._publishers: dict[int, Any] = {}
        for conn in self.connections:
            self._publishers[conn.id] = self.node.create_publisher(classes[conn.id], self._topic(conn.topic), qos)
        self._clock_pub = None
        self._clock_type = None
        if clock:
            self._clock_type = message_class('rosgraph_msgs/msg/Clock')
            self._clock_pub = self.node.create_publisher(self._clock_type, '/clock', qos)
        self.counts: dict[str, int] = {self._topic(c.topic): 0 for c in self.connections}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def _topic(self, recorded: str) -> str:
        topic = self.remap.get(recorded, recorded)
        if self.namespace:
            topic = f'/{self.namespace}/{topic.lstrip("/")}'
        return topic

    @property
    def topics(self) -> list[str]:
        """The published topic names (after remapping)."""
        return list(self.counts)

    def wait_for_subscribers(self, timeout: float = 5.0, minimum: int = 1) -> bool:
        """Wait until every publisher has ``minimum`` matched subscribers; return False on timeout (s)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not self._stop.is_set():
            if all(p.get_subscription_count() >= minimum for p in self._publishers.values()):
                # Discovery is per side: the subscription may not have matched this publisher yet, and what
                # is published before it has would not reach it.
                self._stop.wait(MATCH_SETTLE_S)
                return True
            time.sleep(0.02)
        return False

    def run(self) -> dict[str, int]:
        """Play (once, or until stopped when looping); return messages published per topic."""
        start = self._reader.start_time + int(self.start_s * 1e9)
        stop = None if self.duration_s is None else start + int(self.duration_s * 1e9)
        while not self._stop.is_set():
            wall0 = time.monotonic()
            for conn, stamp, raw in self._reader.messages(connections=self.connections, start=start, stop=stop):
                delay = wall0 + (stamp - start) / 1e9 / self.rate - time.monotonic()
                if delay > 0 and self._stop.wait(delay):
                    break
                if self._stop.is_set():
                    break
                if self._clock_pub is not None:
                    msg = self._clock_type()
                    msg.clock.sec, msg.clock.nanosec = divmod(stamp, 1_000_000_000)
                    self._clock_pub.publish(msg)
                self._publishers[conn.id].publish(bytes(raw))
                self.counts[self._topic(conn.topic)] += 1
            if not self.loop:
                break
        return dict(self.counts)

    def start(self) -> None:
        """Play in a named background thread (``bag-player``); errors are kept in ``error``."""
        def target() -> None:
            try:
                self.run()
            except BaseException as exc:  # noqa: BLE001  (kept for the owner, never lost)
                self.error = exc

        self._thread = threading.Thread(target=target, name='bag-player', daemon=True)
        self._thread.start()

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the background playback to end; return True if it has."""
        if self._thread is None:
            return True
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _flush(self, timeout: float) -> None:
        """Let reliable subscribers acknowledge the last messages before the publishers go away."""
        from rclpy.duration import Duration

        for pub in list(self._publishers.values()) + ([self._clock_pub] if self._clock_pub is not None else []):
            wait = getattr(pub, 'wait_for_all_acked', None)   # rclpy >= Humble
            if wait is not None:
                wait(Duration(nanoseconds=int(timeout * 1e9)))

    def stop(self, timeout: float = 5.0) -> None:
        """Stop playback (the background thread joins within ``timeout`` s) and destroy the node."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        self._flush(min(timeout, 1.0))
        self.node.destroy_node()
        self._reader.close()


def _parse_remap(items: Sequence[str]) -> dict[str, str]:
    out = {}
    for item in items:
        src, sep, dst = item.partition(':=')
        if not sep or not src or not dst:
            raise ConfigError(f'--remap {item!r}: expected /from:=/to')
        out[src] = dst
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``bag_player`` console script."""
    import rclpy
    from rclpy.executors import ExternalShutdownException

    args_in = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog='bag_player', description='Publish a rosbag2 at its recorded timing.')
    parser.add_argument('bag', type=Path)
    parser.add_argument('--rate', type=float, default=1.0, help='playback speed factor (default 1.0)')
    parser.add_argument('--loop', action='store_true', help='start over at the end')
    parser.add_argument('--clock', action='store_true', help='publish /clock with the bag time')
    parser.add_argument('--remap', action='append', default=[], metavar='/from:=/to')
    parser.add_argument('--namespace', default='', help='publish every topic under /NAMESPACE (after --remap)')
    parser.add_argument('--topics', nargs='+', default=None, help='recorded topics to play (default: all)')
    parser.add_argument('--start', type=float, default=0.0, help='skip the first S seconds of the bag')
    parser.add_argument('--duration', type=float, default=None, help='play at most S bag seconds')
    parser.add_argument('--wait-subscribers', type=float, default=0.0,
                        help='wait up to S seconds for a subscriber on every topic before playing')
    ros_args = args_in[args_in.index('--ros-args'):] if '--ros-args' in args_in else []
    args = parser.parse_args(args_in[:len(args_in) - len(ros_args)])
    context = rclpy.context.Context()
    rclpy.init(args=['bag_player', *ros_args], context=context)  # Humble's init is no context manager
    try:
        player = BagPlayer(args.bag, rate=args.rate, loop=args.loop, clock=args.clock,
                           remap=_parse_remap(args.remap), topics=args.topics, start_s=args.start,
                           duration_s=args.duration, context=context, namespace=args.namespace)
        if player.skipped:
            print('skipping topics whose message types are not installed: '
                  + ', '.join(f'{t} ({m})' for t, m in sorted(player.skipped.items())), flush=True)
        if args.wait_subscribers > 0:
            player.wait_for_subscribers(args.wait_subscribers)
        print(f'playing {args.bag} at rate {args.rate:g}: {", ".join(player.topics)}', flush=True)
        try:
            counts = player.run()
        finally:
            player.stop()
        print('played ' + ', '.join(f'{t}: {n}' for t, n in counts.items()), flush=True)
    except ConfigError as exc:
        print(f'bag_player: error: {exc}', file=sys.stderr)
        return 2
    except (KeyboardInterrupt, ExternalShutdownException):
        return 130
    finally:
        if context.ok():
            rclpy.shutdown(context=context)
    return 0


if __name__ == '__main__':
    sys.exit(main())
