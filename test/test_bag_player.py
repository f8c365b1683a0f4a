"""bag_player on a real bag with a topic whose message type is not installed here (issue 15).

The bag is written with rosbags (mcap), as ``seq data to-rosbag`` writes bags: ``/joint_states``
(sensor_msgs/JointState, installed) and ``/odom`` (nav_msgs/msg/Odometry: rosbags knows its definition,
but nav_msgs is not installed in this environment, which the test checks first). The player skips and
lists ``/odom`` and plays the rest, into another process's subscriber; a bag with nothing playable is
refused, naming the types.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.ros]

N = 20


def _write_bag(out: Path, topics: tuple[str, ...] = ('/joint_states', '/odom')) -> None:
    from rosbags.rosbag2 import StoragePlugin, Writer
    from rosbags.typesys import Stores, get_typestore

    store = get_typestore(Stores.ROS2_HUMBLE)
    js_t, odom_t = store.types['sensor_msgs/msg/JointState'], store.types['nav_msgs/msg/Odometry']
    header_t, time_t = store.types['std_msgs/msg/Header'], store.types['builtin_interfaces/msg/Time']
    pose_cov = store.types['geometry_msgs/msg/PoseWithCovariance']
    twist_cov = store.types['geometry_msgs/msg/TwistWithCovariance']
    pose_t, twist_t = store.types['geometry_msgs/msg/Pose'], store.types['geometry_msgs/msg/Twist']
    point_t, quat_t = store.types['geometry_msgs/msg/Point'], store.types['geometry_msgs/msg/Quaternion']
    vec_t = store.types['geometry_msgs/msg/Vector3']
    import numpy as np

    with Writer(out, version=8, storage_plugin=StoragePlugin.MCAP) as writer:
        conns = {t: writer.add_connection(t, (js_t if t == '/joint_states' else odom_t).__msgtype__, typestore=store)
                 for t in topics}
        for i in range(N):
            ns = 1_000_000_000 + i * 10_000_000
            header = header_t(stamp=time_t(sec=ns // 10**9, nanosec=ns % 10**9), frame_id='base')
            if '/joint_states' in conns:
                msg = js_t(header=header, name=['a', 'b'], position=np.array([i, -i], float),
                           velocity=np.zeros(0), effort=np.zeros(0))
                writer.write(conns['/joint_states'], ns, store.serialize_cdr(msg, js_t.__msgtype__))
            if '/odom' in conns:
                odom = odom_t(header=header, child_frame_id='base_link',
                              pose=pose_cov(pose=pose_t(position=point_t(x=i, y=0, z=0),
                                                        orientation=quat_t(x=0, y=0, z=0, w=1)),
                                            covariance=np.zeros(36)),
                              twist=twist_cov(twist=twist_t(linear=vec_t(x=0, y=0, z=0), angular=vec_t(x=0, y=0, z=0)),
                                              covariance=np.zeros(36)))
                writer.write(conns['/odom'], ns, store.serialize_cdr(odom, odom_t.__msgtype__))


def test_a_topic_of_an_uninstalled_type_is_skipped_and_listed_the_rest_plays(tmp_path, processes, rclpy_context):
    import rclpy
    from rclpy.executors import SingleThreadedExecutor
    from sensor_msgs.msg import JointState

    assert importlib.util.find_spec('nav_msgs') is None, 'this test needs a type that is not installed'
    bag = tmp_path / 'mixed'
    _write_bag(bag)
    node = rclpy.create_node('bag_probe', context=rclpy_context)
    got: list = []
    node.create_subscription(JointState, '/robot1/joint_states', got.append, 100)
    executor = SingleThreadedExecutor(context=rclpy_context)
    executor.add_node(node)
    proc = processes.spawn([sys.executable, '-m', 'sequence_ai_ros.bags.player', str(bag), '--namespace', 'robot1',
                            '--wait-subscribers', '20'])
    try:
        deadline = time.monotonic() + 60
        while proc.poll() is None and time.monotonic() < deadline:
            executor.spin_once(timeout_sec=0.05)
        end = time.monotonic() + 1.0
        while time.monotonic() < end:
            executor.spin_once(timeout_sec=0.05)
        out, err = proc.communicate(timeout=10)
    finally:
        executor.shutdown()
        node.destroy_node()
    assert proc.returncode == 0, err
    assert 'skipping topics whose message types are not installed: /odom (nav_msgs/msg/Odometry)' in out, out
    assert f'played /robot1/joint_states: {N}' in out, out
    assert [list(m.position) for m in got] == [[float(i), float(-i)] for i in range(N)]


def test_skipped_topics_are_listed_in_python_and_nothing_playable_is_refused(tmp_path, rclpy_context):
    from sequence_ai_ros.bags.player import BagPlayer
    from sequence_ai_ros.exceptions import ConfigError

    bag = tmp_path / 'mixed'
    _write_bag(bag)
    player = BagPlayer(bag, context=rclpy_context)
    try:
        assert player.skipped == {'/odom': 'nav_msgs/msg/Odometry'} and player.topics == ['/joint_states']
    finally:
        player.stop()
    only = tmp_path / 'odom_only'
    _write_bag(only, topics=('/odom',))
    with pytest.raises(ConfigError, match=r"no topic to play.*nav_msgs/msg/Odometry"):
        BagPlayer(only, context=rclpy_context)
    done = subprocess.run([sys.executable, '-m', 'sequence_ai_ros.bags.player', str(only)], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2 and 'nav_msgs/msg/Odometry' in done.stderr, done.stderr


@pytest.mark.parametrize('sig', ['SIGTERM', 'SIGINT'])
def test_a_signal_stops_playback_cleanly_with_what_was_played(tmp_path, processes, sig):
    """SIGTERM (launch, systemd) or SIGINT (Ctrl-C): playback ends, what was played is reported, exit 0."""
    import signal

    bag = tmp_path / 'loop'
    _write_bag(bag, topics=('/joint_states',))
    proc = processes.spawn([sys.executable, '-m', 'sequence_ai_ros.bags.player', str(bag), '--loop',
                            '--namespace', 'sigtest'])
    assert proc.stdout.readline().startswith('playing'), proc.stderr.read() if proc.poll() is not None else ''
    time.sleep(0.5)                                     # a few loops of the 0.2 s bag
    proc.send_signal(getattr(signal, sig))
    out, err = proc.communicate(timeout=20)
    assert proc.returncode == 0, (proc.returncode, err)
    played = int(out.split('played /sigtest/joint_states: ')[1].split()[0])
    assert played >= N, out                             # looped at least once before the stop
