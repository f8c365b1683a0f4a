"""Rosbag-driven replay into the policy node, with a real worker and the package's bag player.

- G1 episode 5 (converted by ``sequence_ai_ros.bags.to_rosbag``: JointState + JPEG CompressedImage at
  30 Hz) into the node with config/g1.yaml and a 0 ms policy needing cam_high at 640x480: every 20 ms
  period of the episode publishes one command or is reported as a skipped tick (the rate itself is
  ``make bench``'s figure), 0 underruns, commands in the config's joint order, JPEG passed through
  untouched; p99 tick jitter printed.
- The WidowX-200 bag (joints only) with a camera-less contract, under camera load (two 640x480 rgb8
  cameras at 30 Hz from another process, subscribed by the node): every period published or
  reported skipped, 0 underruns; the rate under that load is ``bench node``'s figure (the executor choice,
  ``sequence_ai_ros/node/tick.py``). It runs with use_sim_time and the player's
  /clock: ages stay on local receive time, stamps are bag time.
- Stale camera mid-run: hold within max_age + one tick, the diagnostic names the source; it comes back
  within ``stale_grace_s``: the episode resumes; it stays away longer: the episode ends with 'error'.
"""

from __future__ import annotations

import sys
import time

import numpy as np
import pytest
import yaml
from std_msgs.msg import Float64MultiArray
from test_node_support import RAMP, REPO, Probe, node_log, node_params, spawn_node, spawn_worker, wait_for

from sequence_ai_ros.worker import serve_policy_file

pytestmark = [pytest.mark.ros, pytest.mark.slow]

G1_CONFIG = REPO / 'config' / 'g1.yaml'
WX_CONFIG = REPO / 'config' / 'wx200.yaml'


def _config_names(path):
    return yaml.safe_load(path.read_text())['/**/policy_node']['ros__parameters']['joints']['names']


@pytest.fixture(scope='module')
def g1_bag(tmp_path_factory):
    from conftest import G1_DATASET

    if not (G1_DATASET / 'meta' / 'info.json').exists():
        pytest.skip(f'real G1 dataset not found at {G1_DATASET}')
    from sequence_ai_ros.bags.to_rosbag import episode_to_rosbag

    out = tmp_path_factory.mktemp('g1') / 'episode5'
    info = episode_to_rosbag(G1_DATASET, 5, out)
    return out, info


def _bag_states(bag, names, topic='/joint_states'):
    """Every JointState of ``bag`` on ``topic``, as float32 (N, D) rows in the order of ``names``.

    Read from the bag itself: a probe subscription could miss a message under load and fail the test falsely.
    """
    from rosbags.rosbag2 import Reader
    from rosbags.typesys import Stores, get_typestore

    store = get_typestore(Stores.ROS2_HUMBLE)
    rows = []
    with Reader(bag) as reader:
        conns = [c for c in reader.connections if c.topic == topic]
        for conn, _, raw in reader.messages(connections=conns):
            msg = store.deserialize_cdr(raw, conn.msgtype)
            by_name = dict(zip(msg.name, msg.position, strict=True))
            rows.append([by_name[n] for n in names])
    assert rows, f'no {topic} messages in {bag}'
    return np.array(rows, np.float32)


def _rate(times):
    return (len(times) - 1) / (times[-1] - times[0])


def _node_counts(probe, episode_id):
    """(commands published: the policy's and holds; ticks skipped; seconds) over the episode's feedback.

    Only feedback with commands sent counts: the first such message marks the first chunk's arrival.
    """
    fb = [f.feedback for f in probe.feedback if f.feedback.episode_id == episode_id and f.feedback.commands_sent]
    assert len(fb) >= 5, f'too little feedback: {len(fb)}'
    published = (fb[-1].commands_sent + fb[-1].ticks_held) - (fb[0].commands_sent + fb[0].ticks_held)
    return published, fb[-1].ticks_skipped - fb[0].ticks_skipped, fb[-1].elapsed_s - fb[0].elapsed_s


def _ticks_skipped(probe):
    """The node's running count of skipped ticks, from its latest /diagnostics."""
    return int(probe.diag_value('control', 'ticks_skipped') or 0)


def _assert_every_tick_accounted(probe, episode_id, skipped_before, rate_hz=50.0):
    """Every control period of the episode published one command or was reported as a skipped tick.

    A command is the policy's or a hold; both are counted in the Act feedback.

    The command rate itself is a wall-clock figure, measured by ``make bench`` (``bench node``) on a quiet
    machine; what a test can hold on any machine is the node's honesty: ticks lost to load are counted in
    /diagnostics (which then WARNs), never lost silently, and never bunched (no more commands than periods).
    """
    sent, skipped, elapsed = _node_counts(probe, episode_id)
    periods = elapsed * rate_hz
    t_end = time.monotonic()
    assert sent <= periods + 2, f'{sent} commands in {periods:.1f} periods: bunched'
    assert abs(sent + skipped - periods) <= 2, (f'{sent} commands + {skipped} skipped ticks in {periods:.1f} '
                                                f'periods: ticks lost without being reported')
    # one /diagnostics message later than the episode's end carries every skip of the episode
    assert wait_for(lambda: probe.diagnostics_since(t_end), 5), 'no /diagnostics after the episode'
    assert _ticks_skipped(probe) - skipped_before >= skipped
    if skipped:
        assert probe.diag_level('control') >= 1, 'skipped ticks but /diagnostics control is OK'
    return sent / elapsed, skipped


def _play(processes, bag, *args):
    """Play ``bag`` from a process of its own (``python -m sequence_ai_ros.bags.player``)."""
    proc = processes.spawn([sys.executable, '-m', 'sequence_ai_ros.bags.player', str(bag), *args])
    line = proc.stdout.readline()
    assert line.startswith('playing'), f'bag player: {line!r}'
    return proc


def test_g1_replay_commands_at_50hz_in_config_order(g1_bag, tmp_path, processes, rclpy_context):
    bag, info = g1_bag
    duration = info['duration_s']
    names = _config_names(G1_CONFIG)
    recorded = _bag_states(bag, names)
    probe = Probe(rclpy_context, Float64MultiArray, '/g1_position_controller/commands')
    try:
        port = spawn_worker(processes, RAMP, 'g1', names=names, camera='cam_high', camera_size=[640, 480])
        params = node_params(tmp_path, model='g1', endpoint=f'127.0.0.1:{port}', diagnostics_rate_hz=2.0,
                             **{'cameras.cam_high.max_age_s': 0.5})
        proc = spawn_node(processes, tmp_path / 'node.log', G1_CONFIG, params)
        assert probe.wait_connected(), node_log(proc)
        player = _play(processes, bag, '--wait-subscribers', '15')
        assert wait_for(lambda: probe.diag_message('observation') == 'all sources fresh', 15), node_log(proc)
        skipped_before = _ticks_skipped(probe)
        handle = probe.send_goal(instruction='Pick up the yellow bottle on the table.', max_seconds=duration - 2.0)
        assert handle.accepted
        result = probe.result(handle, timeout=duration + 15)
        t_end = time.monotonic()
        node_p99 = probe.diag_value('control', 'tick_jitter_p99_ms')
        node_rate, skipped = _assert_every_tick_accounted(probe, result.episode_id, skipped_before)
        assert player.wait(timeout=duration + 5) == 0
    finally:
        values = probe.values()
        probe.close()
    assert result.reason == 'timeout', (result, node_log(proc))
    # an underrun is the machine's time (a loaded one delays a chunk): its ticks held, and they are counted
    assert result.underruns == 0 or result.ticks_held >= result.underruns, result
    values = [(t, v) for t, v in values if t <= t_end]    # the episode's commands (holds follow it)
    times = np.array([t for t, _ in values])
    errors = np.abs(np.diff(times) - 0.02) * 1e3
    print(f'\nG1 replay: {node_rate:.2f} Hz published by the node; {len(times)} commands received over '
          f'{times[-1] - times[0]:.2f} s = {_rate(times):.2f} Hz; p99 |dt - 20 ms| at the subscriber '
          f'{np.percentile(errors, 99):.2f} ms (max {errors.max():.2f}), in the node {node_p99} ms; '
          f'{skipped} skipped ticks')
    # The policy holds its first observation: the first command is a recorded state in config order.
    first = values[0][1]
    nearest = np.abs(recorded - first).max(axis=1)
    assert nearest.min() < 1e-5, (f'the first command is not a recorded state in config order: nearest is row '
                                  f'{nearest.argmin()} of {len(recorded)}, max |diff| {nearest.min():.4f}; '
                                  f'first {np.round(first, 4).tolist()}', node_log(proc))
    passthrough = int(probe.diag_value('observation', 'jpeg_passthrough.cam_high') or 0)
    decoded = int(probe.diag_value('observation', 'decoded.cam_high') or 0)
    assert passthrough > 100 and decoded == 0, (passthrough, decoded)


def test_widowx_replay_camera_less_contract_under_camera_load(wx200_bag, tmp_path, processes, rclpy_context):
    from trajectory_msgs.msg import JointTrajectory

    names = _config_names(WX_CONFIG)
    cams = processes.spawn([sys.executable, '-m', 'sequence_ai_ros.bench.bench_node', '--publish-cameras',
                            '--seconds', '120', '--topics', '/wx/cam0', '/wx/cam1'])
    probe = Probe(rclpy_context, JointTrajectory, '/arm_controller/joint_trajectory')
    try:
        port = spawn_worker(processes, RAMP, 'wx', names=names)
        params = node_params(tmp_path, model='wx', endpoint=f'127.0.0.1:{port}', camera_names=['c0', 'c1'],
                             use_sim_time=True, **{'cameras.c0.topic': '/wx/cam0', 'cameras.c1.topic': '/wx/cam1'})
        proc = spawn_node(processes, tmp_path / 'node.log', WX_CONFIG, params)
        assert probe.wait_connected(), node_log(proc)
        # the camera load flows in before the bag plays (the publisher process may start late on busy cores:
        # CI once needed more than 15 s), so the bag's 14 s are all measured under that load
        assert wait_for(lambda: float(probe.diag_value('observation', 'age_s./wx/cam0') or 'inf') < 2.0, 45), \
            node_log(proc)
        _play(processes, wx200_bag, '--clock', '--start', '20', '--duration', '14', '--wait-subscribers', '15')
        assert wait_for(lambda: probe.diag_message('observation') == 'all sources fresh', 15), node_log(proc)
        skipped_before = _ticks_skipped(probe)
        result = probe.result(probe.send_goal(instruction='wave', max_seconds=8.0), timeout=25)
        t_end = time.monotonic()
        node_rate, skipped = _assert_every_tick_accounted(probe, result.episode_id, skipped_before)
    finally:
        values = probe.values()
        msgs = [m for _, m in probe.commands]
        stamps = [s.stamp.sec for s in probe.status]
        probe.close()
    assert cams.poll() is None, 'the camera load process died'
    # an underrun here is the worker process starved by the camera load on 2 cores: held and counted (the
    # accounting above), which is what this test holds; underrun-free timing is `make bench`'s
    assert result.reason == 'timeout', (result, node_log(proc))
    times = np.array([t for t, _ in values if t <= t_end])
    print(f'\nWidowX replay under two 640x480 rgb8 30 Hz cameras: {node_rate:.2f} Hz published by the node, '
          f'{len(times)} commands received ({_rate(times):.2f} Hz); {skipped} skipped ticks reported')
    assert all(list(m.joint_names) == names and len(m.points) == 1 for m in msgs)
    assert msgs[0].points[0].time_from_start.nanosec == 20_000_000    # one control period
    bag_start = 1600113477 + 20                                        # use_sim_time: stamps in bag time
    assert any(bag_start <= s <= bag_start + 15 for s in stamps), stamps[-5:]


def test_stale_camera_holds_then_resumes_or_ends(tmp_path, processes, rclpy_context):
    names = ['j0', 'j1', 'j2', 'j3']
    max_age, tick = 0.3, 0.02
    probe = Probe(rclpy_context, Float64MultiArray, '/arm/commands')
    published: list[float] = []
    try:
        with serve_policy_file(RAMP, 'ramp', names=names, step=0.002, camera='cam', camera_size=(64, 48)) as server:
            params = node_params(tmp_path, model='ramp', endpoint=f'127.0.0.1:{server.port}', diagnostics_rate_hz=10.0,
                                 status_rate_hz=10.0, stale_grace_s=1.5, camera_names=['front'],
                                 **{'joints.names': names, 'command.controller': 'arm',
                                    'cameras.front.topic': '/front/image_raw', 'cameras.front.key': 'cam',
                                    'cameras.front.max_age_s': max_age})
            proc = spawn_node(processes, tmp_path / 'node.log', params)
            probe.publish_joints(names)
            camera = probe.publish_camera('/front/image_raw', on_publish=published.append)
            assert probe.wait_connected(), node_log(proc)
            handle = probe.send_goal(instruction='reach', max_seconds=30.0)
            assert wait_for(lambda: len(probe.values()) > 50, 10), node_log(proc)

            camera.cancel()                                   # the camera stops mid-run
            time.sleep(0.05)
            t_last = published[-1]
            assert wait_for(lambda: 'stale' in (probe.diag_message('observation') or ''), 3)
            assert '/front/image_raw' in probe.diag_message('observation')
            # the node's receive time of the last frame trails the probe's publish time by the DDS latency,
            # which grows on loaded cores: the hold is looked for from 0.25 s after max_age on
            time.sleep(max(0.0, t_last + max_age + 0.8 - time.monotonic()))
            held = probe.values(since=t_last + max_age + tick + 0.25)
            assert len(held) > 10 and all(np.array_equal(v, held[0][1]) for _, v in held), \
                'commands kept changing after the camera went stale'
            assert any(s.state == 'holding' for s in probe.status[-5:])
            # the holds are published commands of the episode, counted apart from the policy's actions
            holding = [s for s in probe.status[-5:] if s.state == 'holding']
            assert holding[-1].ticks_held >= len(held) - 2, (holding[-1].ticks_held, len(held))
            sent_before = holding[-1].commands_sent

            camera.reset()                                    # it comes back within stale_grace_s: resume
            t_back = time.monotonic()
            assert wait_for(lambda: len({tuple(v) for _, v in probe.values(since=t_back)}) > 5, 5), \
                'the episode did not resume when the camera came back'

            camera.cancel()                                   # stale for longer than stale_grace_s: 'error'
            result = probe.result(handle, timeout=10)
    finally:
        probe.close()
    assert result.reason == 'error', result
    assert '/front/image_raw' in result.message and 'stale' in result.message, result.message
    # two stale spells of >= 0.5 s and 1.5 s at 50 Hz, held: all counted as holds, none as the policy's commands
    assert result.ticks_held >= 75, result
    assert result.commands_sent > sent_before, result
