"""LeRobot episode -> rosbag2 (mcap) with rosbags, and the bag player on real rclpy across processes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from sequence_ai_ros.bags.to_rosbag import episode_to_rosbag
from sequence_ai_ros.cli import main as seq_main
from sequence_ai_ros.datasets.lerobot_reader import LeRobotDataset
from sequence_ai_ros.exceptions import ConfigError, ExportError


def _read_bag(path: Path) -> dict[str, list]:
    from rosbags.rosbag2 import Reader
    from rosbags.typesys import Stores, get_typestore

    store = get_typestore(Stores.ROS2_HUMBLE)
    out: dict[str, list] = {}
    with Reader(path) as reader:
        for conn, stamp, raw in reader.messages():
            out.setdefault(conn.topic, []).append((stamp, store.deserialize_cdr(raw, conn.msgtype)))
    return out


@pytest.mark.slow
def test_g1_episode_5_to_rosbag_keeps_counts_rates_and_values(tmp_path: Path, g1_dataset: Path) -> None:
    ds = LeRobotDataset(g1_dataset)
    bag = tmp_path / 'g1_ep5'
    res = episode_to_rosbag(g1_dataset, 5, bag, joint_topic='/g1/joint_states', start_ns=1_700_000_000_000_000_000)
    n = ds.length(5)
    assert n == 445 and res['counts'] == {'/g1/joint_states': n, '/cam_high/image_raw/compressed': n}
    meta = yaml.safe_load((bag / 'metadata.yaml').read_text())['rosbag2_bagfile_information']
    assert meta['version'] == 8 and meta['storage_identifier'] == 'mcap'
    assert all(isinstance(t['topic_metadata']['offered_qos_profiles'], str) for t in meta['topics_with_message_count'])
    msgs = _read_bag(bag)
    joints, images = msgs['/g1/joint_states'], msgs['/cam_high/image_raw/compressed']
    assert len(joints) == len(images) == n
    stamps = np.array([s for s, _ in joints], np.int64)
    rate = (n - 1) / ((stamps[-1] - stamps[0]) / 1e9)
    assert rate == pytest.approx(30.0, rel=1e-3)  # the recorded rate
    assert stamps[0] == 1_700_000_000_000_000_000
    data = ds.episode(5)
    first = joints[0][1]
    assert list(first.name) == list(ds.state_names)
    np.testing.assert_allclose(np.stack([m.position for _, m in joints]), data.state, rtol=0, atol=1e-6)
    assert first.header.stamp.sec * 10**9 + first.header.stamp.nanosec == stamps[0]
    from io import BytesIO

    from PIL import Image

    img = images[100][1]
    assert img.format == 'jpeg'
    rgb = np.asarray(Image.open(BytesIO(img.data.tobytes())).convert('RGB'))
    frame = next(ds.frames(5, 'cam_high', 100, 101))
    assert rgb.shape == (480, 640, 3) and np.abs(rgb.astype(int) - frame.astype(int)).mean() < 4.0


def test_to_rosbag_cli_joints_only_and_refusals(tmp_path: Path, g1_dataset: Path, capsys) -> None:
    bag = tmp_path / 'joints'
    assert seq_main(['data', 'to-rosbag', str(g1_dataset), '--episode', '1', '--out', str(bag), '--no-cameras',
                     '--joint-topic', '/js']) == 0
    assert 'wrote' in capsys.readouterr().out
    msgs = _read_bag(bag)
    assert list(msgs) == ['/js'] and len(msgs['/js']) == LeRobotDataset(g1_dataset).length(1)
    with pytest.raises(ExportError, match='exists'):
        episode_to_rosbag(g1_dataset, 1, bag)
    with pytest.raises(ConfigError, match='no episode 99'):
        episode_to_rosbag(g1_dataset, 99, tmp_path / 'x')
    with pytest.raises(ConfigError, match='no camera'):
        episode_to_rosbag(g1_dataset, 1, tmp_path / 'y', camera_topics={'wrist': '/wrist'})
    assert not (tmp_path / 'y').exists()


SUBSCRIBER = r'''
import json, sys, time
import rclpy
from rclpy.qos import QoSProfile, ReliabilityPolicy
from sensor_msgs.msg import JointState
topic, window, expected = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
rclpy.init()
node = rclpy.create_node('replay_probe')
got = []
node.create_subscription(JointState, topic, lambda m: got.append((time.monotonic(), list(m.name), m.position[0],
                                                                  m.header.stamp.sec + m.header.stamp.nanosec * 1e-9)),
                         QoSProfile(depth=1000, reliability=ReliabilityPolicy.RELIABLE))  # count every message
print('ready', flush=True)
deadline = time.monotonic() + window
while time.monotonic() < deadline and len(got) < expected:
    rclpy.spin_once(node, timeout_sec=0.05)
print(json.dumps({'n': len(got), 'names': got[0][1] if got else [], 'recv': [g[0] for g in got],
                  'stamps': [g[3] for g in got], 'first': got[0][2] if got else None}), flush=True)
node.destroy_node()
rclpy.shutdown()
'''


@pytest.mark.ros
@pytest.mark.slow
def test_player_replays_widowx_bag_at_recorded_timing_into_another_process(wx200_bag: Path, processes,
                                                                          rclpy_context) -> None:
    from rosbags.rosbag2 import Reader

    from sequence_ai_ros.bags.player import BagPlayer

    with Reader(wx200_bag) as reader:
        start = reader.start_time + int(10e9)
        slice_ = [(s, raw) for _, s, raw in reader.messages(start=start, stop=start + int(2e9))]
    sub = processes.python(SUBSCRIBER, '/replay/joint_states', '15', str(len(slice_)))
    assert sub.stdout.readline().strip() == 'ready'
    player = BagPlayer(wx200_bag, rate=2.0, start_s=10.0, duration_s=2.0, context=rclpy_context,
                       remap={'/wx200/joint_states': '/replay/joint_states'})
    try:
        assert player.wait_for_subscribers(timeout=10.0)
        counts = player.run()
    finally:
        player.stop()
    assert counts == {'/replay/joint_states': len(slice_)} and len(slice_) > 150
    out, err = sub.communicate(timeout=30)
    res = json.loads(out.strip().splitlines()[-1])
    assert res['n'] == len(slice_), (err, res['stamps'][:1], slice_[0][0], res['stamps'][-1:], slice_[-1][0])
    assert res['names'] == ['waist', 'shoulder', 'elbow', 'wrist_angle', 'wrist_rotate', 'gripper',
                            'left_finger', 'right_finger']
    recv = np.array(res['recv'])
    bag_span = (slice_[-1][0] - slice_[0][0]) / 1e9
    wall_span = recv[-1] - recv[0]
    print(f'replayed {res["n"]} messages: bag span {bag_span:.3f} s, wall span {wall_span:.3f} s at rate 2')
    assert wall_span == pytest.approx(bag_span / 2.0, rel=0.1)  # the recorded timing, scaled
    stamps = np.array(res['stamps'])
    assert np.all(np.diff(stamps) >= 0)  # in recorded order


CLOCK_PROBE = r'''
import json, sys, time
import rclpy
from rosgraph_msgs.msg import Clock
from sensor_msgs.msg import JointState
rclpy.init()
node = rclpy.create_node('clock_probe')
clock, joints = [], []
node.create_subscription(Clock, '/clock', lambda m: clock.append(m.clock.sec + m.clock.nanosec * 1e-9), 10)
node.create_subscription(JointState, '/wx200/joint_states', lambda m: joints.append(m.position[0]), 10)
print('ready', flush=True)
deadline = time.monotonic() + float(sys.argv[1])
while time.monotonic() < deadline and len(joints) < int(sys.argv[2]):
    rclpy.spin_once(node, timeout_sec=0.05)
print(json.dumps({'clock': clock, 'joints': len(joints)}), flush=True)
node.destroy_node()
rclpy.shutdown()
'''


@pytest.mark.ros
def test_player_loops_and_publishes_the_bag_clock(wx200_bag: Path, processes, rclpy_context) -> None:
    from rosbags.rosbag2 import Reader

    from sequence_ai_ros.bags.player import BagPlayer

    with Reader(wx200_bag) as reader:
        t0 = reader.start_time
        per_pass = sum(1 for _ in reader.messages(start=t0, stop=t0 + int(0.2e9)))
    probe = processes.python(CLOCK_PROBE, '10', str(3 * per_pass))
    assert probe.stdout.readline().strip() == 'ready'
    player = BagPlayer(wx200_bag, duration_s=0.2, loop=True, clock=True, context=rclpy_context)
    try:
        assert player.wait_for_subscribers(timeout=10.0)
        player.start()  # the owned 'bag-player' thread
        out, err = probe.communicate(timeout=30)
    finally:
        player.stop(timeout=5.0)
    assert player.join(0) and player.error is None
    res = json.loads(out.strip().splitlines()[-1])
    assert res['joints'] >= 3 * per_pass  # looped: more than one pass of the 0.2 s slice
    assert res['clock'] and all(t0 / 1e9 - 1e-6 <= c <= t0 / 1e9 + 0.2 + 1e-6 for c in res['clock']), err
