"""Play a rosbag2 into ROS 2 at its recorded timing: the replay behind the tests and the demo.

``bag_player BAG [--rate 2.0] [--loop] [--clock] [--remap /from:=/to] [--namespace NS] [--topics T ...]
[--start S] [--duration S]`` (console script), or :class:`BagPlayer` from Python.

A topic whose message type is not installed here (e.g. ``nav_msgs/msg/Odometry`` without nav_msgs) is
skipped, and listed (:attr:`BagPlayer.skipped`, and a line on stdout): the rest of the bag plays. Only a
bag with no playable topic at all is refused. A type is looked up in the ament index before anything is
imported (:func:`message_class`): a bag's type string cannot make the player import an arbitrary module.
Besides ``pkg/msg/X`` this finds the types ``ros2 bag`` records for services and actions
(``pkg/srv/X_Event``, ``pkg/action/X_FeedbackMessage``...). ``--namespace robot1`` moves every recorded
topic under ``/robot1`` (after ``--remap``), to feed one of several namespaced robots.

A bag corrupt mid-file (a chunk or page that does not decode) ends the playback with a
:class:`~sequence_ai_ros.exceptions.ConfigError` naming the bag, the bag time reached and the messages played
before it, which stay played (``bag_player`` exits 2 with that line, no traceback).

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
import re
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from sequence_ai_ros.exceptions import ConfigError, MissingDependency
from sequence_ai_ros.stop_signals import on_stop_signals

#: The interface kinds of a ROS 2 type string ``pkg/KIND/Name``.
INTERFACE_KINDS = ('msg', 'srv', 'action')
_PACKAGE_NAME = re.compile(r'[a-z][a-z0-9_]*\Z')               # REP 144 package names
_TYPE_NAME = re.compile(r'([A-Z][A-Za-z0-9]*)(_[A-Za-z0-9_]+)?\Z')  # Name, or Name_Suffix (rosidl's derived types)


def interface_index(pkg: str) -> list[str] | None:
    """Return the interfaces (``msg/Name.idl``, ``action/Name.action`` ...) the ament index lists for ``pkg``.

    Looks up the ``rosidl_interfaces`` resource of ``pkg`` (what every ROS interface package installs) with
    ``ament_index_python`` on ``AMENT_PREFIX_PATH``, then under ``sys.prefix``: the ROS 2 PyPI wheels install
    their index into the venv, which a colcon ``local_setup.bash`` does not put on ``AMENT_PREFIX_PATH``.
    Reads files only; imports nothing of ``pkg``.

    :returns: the listed interface files, or None when ``pkg`` is no installed ROS interface package.
    """
    from ament_index_python import get_resource
    from ament_index_python.constants import RESOURCE_INDEX_SUBFOLDER

    if not _PACKAGE_NAME.match(pkg):
        return None
    try:
        content, _ = get_resource('rosidl_interfaces', pkg)
    except (LookupError, OSError):    # not indexed there, or AMENT_PREFIX_PATH unset (EnvironmentError)
        path = Path(sys.prefix, RESOURCE_INDEX_SUBFOLDER, 'rosidl_interfaces', pkg)
        if not path.is_file():
            return None
        content = path.read_text(encoding='utf-8')
    return content.splitlines()


def _nested_class(outer: type, name: str) -> type | None:
    """Find the class called ``name`` among the classes nested in ``outer``, or None.

    rclpy's action and service classes nest their derived types: ``Act.Feedback``,
    ``Act.Impl.FeedbackMessage``, ``Act.Impl.SendGoalService.Request`` ...
    """
    todo, seen = [outer], set()
    while todo:
        cls = todo.pop()
        if cls.__name__ == name:
            return cls
        seen.add(cls)
        todo.extend(v for v in vars(cls).values() if isinstance(v, type) and v not in seen)
    return None


def message_class(msgtype: str) -> Any:
    """Return the rclpy message class of a bag's type string ``pkg/KIND/Name`` (KIND: msg, srv, action).

    Besides plain messages this finds the types rosidl derives from services and actions, as ``ros2 bag``
    records them: ``pkg/srv/X_Event``, ``pkg/action/X_FeedbackMessage``, ``pkg/action/X_SendGoal_Request``...
    The type string comes from a file, so nothing is imported before the ament index says ``pkg`` is an
    installed ROS interface package that has the interface ``KIND/X`` (:func:`interface_index`).

    :raises ConfigError: for a malformed type string, or when the package's Python interfaces are not
        installed (or have no such type).
    """
    parts = msgtype.split('/')
    pkg, kind, name = parts if len(parts) == 3 else ('', '', '')
    match = _TYPE_NAME.match(name)
    if kind not in INTERFACE_KINDS or not match:
        raise ConfigError(f'message type {msgtype!r} is no ROS 2 type string (pkg/msg/Name, pkg/srv/Name_Event, '
                          'pkg/action/Name_FeedbackMessage ...)')
    interfaces = interface_index(pkg)
    base = f'{kind}/{match.group(1)}'
    if interfaces is None:
        raise ConfigError(f'message type {msgtype} is not installed ({pkg} is no ROS interface package in the '
                          f'ament index); install its ROS package to play this topic')
    if not any(entry.rpartition('.')[0] == base for entry in interfaces):
        raise ConfigError(f'message type {msgtype} is not installed (the installed {pkg} has no {base}); '
                          f'install the version of {pkg} the bag was recorded with to play this topic')
    try:
        module = importlib.import_module(f'{pkg}.{kind}')
    except ImportError as exc:
        raise ConfigError(f'message type {msgtype} is not installed ({pkg}.{kind} does not import: {exc}); '
                          f'install its ROS package to play this topic') from None
    cls = getattr(module, name, None)
    if cls is None and kind != 'msg':
        outer = getattr(module, match.group(1), None)
        cls = _nested_class(outer, name) if isinstance(outer, type) else None
    if cls is None:
        raise ConfigError(f'message type {msgtype} is not installed (no {name} in {pkg}.{kind}); '
                          f'install its ROS package to play this topic')
    if any(isinstance(getattr(cls, part, None), type) for part in ('Request', 'Goal')):
        raise ConfigError(f'type {msgtype} is a service or action, not a message type a topic carries')
    return cls


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
        self._clock_type: Any = None     # a message class, as message_class() returns it
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

    def _records(self, start: int, stop: int | None) -> Iterator[tuple[Any, int, bytes]]:
        """Yield the bag's (connection, bag time ns, serialized bytes) in time order.

        :raises ConfigError: when a record cannot be read (a corrupt chunk or page mid-file: rosbags'
            ReaderError, the codec's error such as zstd's, sqlite3's DatabaseError...), naming the bag, the
            bag time reached and how many messages were played before it.
        """
        records = self._reader.messages(connections=self.connections, start=start, stop=stop)
        last: int | None = None
        while True:
            try:
                record = next(records)
            except StopIteration:
                return
            except Exception as exc:  # noqa: BLE001  (a reader or codec error of any type: all mean a bad bag)
                reached = 'at its start' if last is None else \
                    f'after bag time {(last - self._reader.start_time) / 1e9:.3f} s'
                played = ', '.join(f'{t}: {n}' for t, n in self.counts.items())
                raise ConfigError(f'bag {self.bag} cannot be read {reached} (corrupt?): {type(exc).__name__}: {exc}; '
                                  f'played {sum(self.counts.values())} messages before it ({played})') from exc
            last = record[1]
            yield record

    def run(self) -> dict[str, int]:
        """Play (once, or until stopped when looping); return messages published per topic.

        :raises ConfigError: when the bag turns out corrupt mid-file; what was played before stays played
            (and counted in :attr:`counts`).
        """
        start = self._reader.start_time + int(self.start_s * 1e9)
        stop = None if self.duration_s is None else start + int(self.duration_s * 1e9)
        while not self._stop.is_set():
            wall0 = time.monotonic()
            for conn, stamp, raw in self._records(start, stop):
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

    def request_stop(self) -> None:
        """Ask playback (and a wait for subscribers) to stop at the next message; safe from a signal handler."""
        self._stop.set()

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
    player: BagPlayer | None = None
    stopping = threading.Event()

    def on_stop() -> None:
        # SIGINT (Ctrl-C) or SIGTERM (launch, systemd): stop at the next message, report, exit 0
        stopping.set()
        if player is not None:
            player.request_stop()

    on_stop_signals(on_stop)      # the handler takes no lock (see stop_signals)
    try:
        player = BagPlayer(args.bag, rate=args.rate, loop=args.loop, clock=args.clock,
                           remap=_parse_remap(args.remap), topics=args.topics, start_s=args.start,
                           duration_s=args.duration, context=context, namespace=args.namespace)
        if player.skipped:
            print('skipping topics whose message types are not installed: '
                  + ', '.join(f'{t} ({m})' for t, m in sorted(player.skipped.items())), flush=True)
        if stopping.is_set():         # a signal while the bag was opened
            player.request_stop()
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
