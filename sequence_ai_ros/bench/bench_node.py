"""Policy node timing at 50 Hz under camera load: streaming jitter, trajectory messages (``make bench``).

Set-up, all real and on loopback: a camera process publishes two 640x480 rgb8 sensor_msgs/Image at
30 Hz (this module with ``--publish-cameras``); the node (``python -m sequence_ai_ros.node.main``, own
process) subscribes to both, observes joint states the camera process publishes at 100 Hz, and drives an episode
against a real worker (own process) serving the ``hold`` template, commanding through the ``joint_state`` interface
so every command carries the node's stamp. Reported, over the steady part of the episode:

- p50/p99/max of |dt - 20 ms| from the command stamps (stamped in the node, at publish time), at a
  subscriber in this process (``at_subscriber``: its middleware's reception time, rmw ``received_timestamp``,
  what a C++ controller's subscription sees) and in that subscriber's Python callback
  (``subscriber_callback``, which adds the Python executor's own wake-up);
- the command rate (commands / duration), the node's own jitter figures from /diagnostics;
- the node process's CPU% (psutil, over the window; 100% = one core) and RSS (MB).

Targets: issue 15, streaming mode p99 at a subscriber <= 2 ms on a quiet machine (issue 5: <= 5 ms);
RSS <= 200 MB. The machine's load average is printed with the figures: on a shared machine they say
more about the neighbours than about the node.

Trajectory mode (``bench_trajectory``, :func:`run` with ``mode='trajectory'``): the same set-up with
the node publishing each chunk's horizon as one JointTrajectory; reported are messages/s, points per
message, the intervals between messages, and the first point's lead: ``header.stamp`` minus the
arrival time at the subscriber (how far ahead the trajectory starts; a negative lead would make the
controller skip points).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

RATE_HZ = 50.0
CAMERA_TOPICS = ('/bench/cam0/image_raw', '/bench/cam1/image_raw')
JOINTS = tuple(f'joint{i}' for i in range(7))
EPISODE_S = 20.0
WARMUP_S = 3.0
# The worker runs in its own process, as on a robot: in this process its gRPC threads and frame decoding
# would share the probe's GIL and show up as the subscriber's receive jitter.
WORKER = (
    'import json, sys\n'
    'from sequence_ai_ros.worker import serve_policy_file\n'
    "server = serve_policy_file(sys.argv[1], 'bench', port=0, joint_names=json.loads(sys.argv[2]))\n"
    "print(f'serving bench on 127.0.0.1:{server.port}', flush=True)\n"
    'server.wait()\n')


def publish_cameras(seconds: float, topics: tuple[str, ...] = CAMERA_TOPICS, width: int = 640, height: int = 480,
                    rate_hz: float = 30.0, joints_topic: str = '') -> int:
    """Publish rgb8 Images on ``topics`` at ``rate_hz`` for ``seconds`` (s); return frames published.

    :param joints_topic: also publish JointState (:data:`JOINTS`) there at 100 Hz, the robot's side of the
        set-up, so the measuring subscriber's process does nothing but receive.
    """
    import rclpy
    from rclpy.executors import SingleThreadedExecutor
    from rclpy.qos import qos_profile_sensor_data
    from sensor_msgs.msg import Image, JointState

    context = rclpy.context.Context()
    rclpy.init(context=context)
    node = rclpy.create_node('bench_cameras', context=context)
    pubs = [node.create_publisher(Image, t, qos_profile_sensor_data) for t in topics]
    msg = Image(height=height, width=width, encoding='rgb8', step=width * 3)
    msg.data = np.random.default_rng(0).integers(0, 255, (height, width, 3), np.uint8).tobytes()
    count = 0

    def tick() -> None:
        nonlocal count
        msg.header.stamp = node.get_clock().now().to_msg()
        for p in pubs:
            p.publish(msg)
            count += 1

    node.create_timer(1.0 / rate_hz, tick)
    if joints_topic:
        joint_pub = node.create_publisher(JointState, joints_topic, 10)
        joints = JointState(name=list(JOINTS), position=[0.1] * len(JOINTS))
        node.create_timer(0.01, lambda: joint_pub.publish(joints))
    executor = SingleThreadedExecutor(context=context)
    executor.add_node(node)
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline and context.ok():
            executor.spin_once(timeout_sec=0.1)
    except KeyboardInterrupt:
        pass
    finally:
        executor.shutdown()
        node.destroy_node()
        rclpy.try_shutdown(context=context)
    return count


def _stats_ms(times: np.ndarray, period: float) -> dict[str, float]:
    err = np.abs(np.diff(times) - period) * 1e3
    return {'p50_ms': float(np.percentile(err, 50)), 'p99_ms': float(np.percentile(err, 99)),
            'max_ms': float(err.max())}


def _write_params(path: Path, port: int, mode: str = 'streaming') -> None:
    import yaml

    command = ({'interface': 'joint_state', 'topic': '/bench/command'} if mode == 'streaming' else
               {'interface': 'joint_trajectory', 'mode': 'trajectory', 'topic': '/bench/command'})
    params = {'autostart': True, 'model': 'bench', 'endpoint': f'127.0.0.1:{port}', 'control_rate_hz': RATE_HZ,
              'joints': {'topic': '/bench/joint_states', 'names': list(JOINTS)},
              'camera_names': ['cam0', 'cam1'],
              'cameras': {f'cam{i}': {'topic': t, 'type': 'image'} for i, t in enumerate(CAMERA_TOPICS)},
              'command': command, 'diagnostics_rate_hz': 2.0}
    path.write_text(yaml.safe_dump({'policy_node': {'ros__parameters': params}}))


def _spin_until(executor: Any, predicate: Any, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        executor.spin_once(timeout_sec=0.05)
        if predicate():
            return True
    return False


def _wait_active(node: Any, executor: Any, timeout: float) -> bool:
    """Wait until the lifecycle node ``/policy_node`` is active (it autostarts; goals wait for it)."""
    from lifecycle_msgs.srv import GetState

    client = node.create_client(GetState, '/policy_node/get_state')
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if client.wait_for_service(timeout_sec=1.0):
            future = client.call_async(GetState.Request())
            if _spin_until(executor, future.done, 5) and future.result().current_state.label == 'active':
                return True
        _spin_until(executor, lambda: False, 0.2)
    return False


def _isolate() -> None:
    """Keep the bench's DDS traffic on this host and off other sessions' domain (children inherit it)."""
    os.environ.setdefault('ROS_AUTOMATIC_DISCOVERY_RANGE', 'LOCALHOST')
    os.environ.setdefault('ROS_LOCALHOST_ONLY', '1')
    if 'ROS_DOMAIN_ID' not in os.environ:
        os.environ['ROS_DOMAIN_ID'] = str(1 + os.getpid() % 101)   # 0..101: DDS ports below the ephemeral range


def main() -> dict[str, Any]:
    """Run the streaming-mode benchmark; print a table and return the figures."""
    return run('streaming')


def run(mode: str = 'streaming') -> dict[str, Any]:
    """Run the node in ``mode`` (streaming or trajectory) under camera load; print and return the figures."""
    import psutil
    import rclpy
    from diagnostic_msgs.msg import DiagnosticArray
    from rclpy.action import ActionClient
    from rclpy.executors import SingleThreadedExecutor
    from sensor_msgs.msg import JointState
    from sequence_ai_msgs.action import Act

    from sequence_ai_ros.bench.bench_client import start_server_process

    _isolate()
    from sequence_ai_ros.templates import TEMPLATES_DIR

    hold = TEMPLATES_DIR / 'hold' / 'policy.py'
    procs: list[subprocess.Popen] = []
    context = rclpy.context.Context()
    rclpy.init(context=context)
    node = rclpy.create_node('bench_probe', context=context)
    executor = SingleThreadedExecutor(context=context)
    executor.add_node(node)
    stamps: list[float] = []
    received: list[float] = []
    delivered: list[float] = []     # the subscriber's middleware reception time (rmw received_timestamp)
    arrival_wall: list[float] = []
    points: list[int] = []
    diags: list[Any] = []

    def on_command(msg: Any, info: Any) -> None:
        received.append(time.monotonic())
        delivered.append(info['received_timestamp'] * 1e-9)
        arrival_wall.append(time.time())
        stamps.append(msg.header.stamp.sec + msg.header.stamp.nanosec * 1e-9)
        points.append(len(getattr(msg, 'points', ())) or 1)

    if mode == 'trajectory':
        from trajectory_msgs.msg import JointTrajectory

        node.create_subscription(JointTrajectory, '/bench/command', on_command, 100)
    else:
        node.create_subscription(JointState, '/bench/command', on_command, 100)
    node.create_subscription(DiagnosticArray, '/diagnostics', diags.append, 10)
    act: ActionClient[Any, Any, Any] = ActionClient(node, Act, '/policy_node/act')   # untyped messages
    try:
        with tempfile.TemporaryDirectory() as tmp:
            worker, endpoint = start_server_process(WORKER, str(hold), json.dumps(list(JOINTS)))
            procs.append(worker)
            params = Path(tmp) / 'params.yaml'
            _write_params(params, int(endpoint.rsplit(':', 1)[-1]), mode)
            cams = subprocess.Popen([sys.executable, '-m', 'sequence_ai_ros.bench.bench_node', '--publish-cameras',
                                     '--seconds', str(EPISODE_S + 20), '--joints', '/bench/joint_states'])
            procs.append(cams)
            log = open(Path(tmp) / 'node.log', 'w')  # noqa: SIM115  (closed with the directory's process)
            node_proc = subprocess.Popen([sys.executable, '-m', 'sequence_ai_ros.node.main', '--ros-args',
                                          '--params-file', str(params)], stdout=log, stderr=subprocess.STDOUT)
            procs.append(node_proc)
            if not act.wait_for_server(timeout_sec=20) or not _wait_active(node, executor, 30):
                raise RuntimeError('the node did not come up: ' + (Path(tmp) / 'node.log').read_text()[-2000:])
            ps = psutil.Process(node_proc.pid)
            goal_future = act.send_goal_async(Act.Goal(instruction='hold', max_seconds=EPISODE_S))
            handle = goal_future.result() if _spin_until(executor, goal_future.done, 30) else None
            if handle is None or not handle.accepted:
                raise RuntimeError('goal not accepted')
            result_future = handle.get_result_async()
            _spin_until(executor, lambda: len(received) > 0, 15)
            t0 = time.monotonic()
            _spin_until(executor, lambda: time.monotonic() - t0 > WARMUP_S, WARMUP_S + 1)
            ps.cpu_percent(None)
            n0 = len(received)
            _spin_until(executor, result_future.done, EPISODE_S + 15)
            cpu = ps.cpu_percent(None)
            rss_mb = ps.memory_info().rss / 2 ** 20
            window = slice(n0, max(n0, len(received) - 5))
            done = result_future.result() if result_future.done() else None
            result = done.result if done is not None else None
            if len(received) < 2:
                raise RuntimeError(f'no commands received (result {result}); node output: '
                                   + (Path(tmp) / 'node.log').read_text()[-2000:])
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
        act.destroy()
        executor.shutdown()
        node.destroy_node()
        rclpy.try_shutdown(context=context)
    if mode == 'trajectory':
        return _trajectory_figures(np.array(received), np.array(arrival_wall), np.array(stamps), np.array(points),
                                   result, float(cpu), float(rss_mb))
    rcv, stm = np.array(received[window]), np.array(stamps[window])
    dlv = np.array(delivered[window])
    if not np.all(dlv > 0):
        dlv = np.array([])    # an rmw that does not stamp reception
    period = 1.0 / RATE_HZ
    node_diag: dict[str, str] = {}
    for arr in diags[-1:]:
        for st in arr.status:
            if st.name.endswith(': control'):
                node_diag = {kv.key: kv.value for kv in st.values}
    out: dict[str, Any] = {
        'rate_hz': float((len(rcv) - 1) / (rcv[-1] - rcv[0])) if len(rcv) > 1 else 0.0,
        'commands': int(len(rcv)),
        'stamped_in_node': _stats_ms(stm, period) if len(stm) > 2 else {},
        'at_subscriber': _stats_ms(dlv, period) if len(dlv) > 2 else {},
        'subscriber_callback': _stats_ms(rcv, period) if len(rcv) > 2 else {},
        'node_reported_p50_ms': float(node_diag.get('tick_jitter_p50_ms', 'nan')),
        'node_reported_p99_ms': float(node_diag.get('tick_jitter_p99_ms', 'nan')),
        'node_cpu_percent': float(cpu), 'node_rss_mb': float(rss_mb),
        'underruns': int(result.underruns) if result is not None else -1,
        'scheduling': node_diag.get('scheduling', ''),
        'cores': os.cpu_count(), 'load_average': os.getloadavg(),
    }
    print(f"node tick at {RATE_HZ:g} Hz, two 640x480 rgb8 cameras at 30 Hz: {out['commands']} commands, "
          f"{out['rate_hz']:.2f} Hz; control thread {out['scheduling'] or 'scheduling not reported'}")
    print(f"{'':24}{'p50 ms':>8}{'p99 ms':>8}{'max ms':>8}")
    for name in ('stamped_in_node', 'at_subscriber', 'subscriber_callback'):
        s = out[name]
        if s:
            print(f"{name:24}{s['p50_ms']:8.2f}{s['p99_ms']:8.2f}{s['max_ms']:8.2f}")
    print(f"node CPU {out['node_cpu_percent']:.0f}% of one core, RSS {out['node_rss_mb']:.0f} MB "
          f"(targets: p99 at a subscriber <= 2 ms on a quiet machine; RSS <= 200 MB); load average "
          f"{out['load_average'][0]:.1f} on {out['cores']} cores")
    return out


def _trajectory_figures(received: np.ndarray, wall: np.ndarray, stamps: np.ndarray, points: np.ndarray,
                        result: Any, cpu: float, rss_mb: float) -> dict[str, Any]:
    """Messages/s, points per message, intervals and the first point's lead of trajectory mode."""
    multi = points > 1                         # chunk horizons (the single-point ones are holds)
    rcv, lead = received[multi], (stamps - wall)[multi] * 1e3
    gaps = np.diff(rcv) * 1e3 if len(rcv) > 1 else np.zeros(0)
    out: dict[str, Any] = {
        'messages': int(multi.sum()), 'holds': int((~multi).sum()),
        'messages_per_s': float((len(rcv) - 1) / (rcv[-1] - rcv[0])) if len(rcv) > 1 else 0.0,
        'points_per_message_mean': float(points[multi].mean()) if multi.any() else 0.0,
        'interval_ms': {'p50': float(np.percentile(gaps, 50)), 'p99': float(np.percentile(gaps, 99)),
                        'max': float(gaps.max())} if len(gaps) else {},
        'first_point_lead_ms': {'min': float(lead.min()), 'p50': float(np.percentile(lead, 50)),
                                'max': float(lead.max())} if len(lead) else {},
        'chunks': int(result.chunks) if result is not None else -1,
        'underruns': int(result.underruns) if result is not None else -1,
        'node_cpu_percent': cpu, 'node_rss_mb': rss_mb, 'cores': os.cpu_count(), 'load_average': os.getloadavg(),
    }
    print(f"trajectory mode, two 640x480 rgb8 cameras at 30 Hz: {out['messages']} JointTrajectory messages "
          f"({out['messages_per_s']:.2f}/s, {out['points_per_message_mean']:.1f} points each) for {out['chunks']} "
          f"chunks, {out['holds']} hold(s)")
    if out['interval_ms']:
        i, lead_ms = out['interval_ms'], out['first_point_lead_ms']
        print(f"interval between messages p50 {i['p50']:.1f} ms, p99 {i['p99']:.1f} ms, max {i['max']:.1f} ms; "
              f"first point due {lead_ms['min']:.1f} / {lead_ms['p50']:.1f} / {lead_ms['max']:.1f} ms "
              '(min / p50 / max) after arrival')
    print(f"node CPU {cpu:.0f}% of one core, RSS {rss_mb:.0f} MB; load average {out['load_average'][0]:.1f} on "
          f"{out['cores']} cores")
    return out


if __name__ == '__main__':
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--publish-cameras', action='store_true', help='only publish the two camera streams')
    parser.add_argument('--seconds', type=float, default=30.0)
    parser.add_argument('--topics', nargs='+', default=list(CAMERA_TOPICS))
    parser.add_argument('--joints', default='', help='with --publish-cameras: also publish JointState here at 100 Hz')
    args = parser.parse_args()
    if args.publish_cameras:
        publish_cameras(args.seconds, tuple(args.topics), joints_topic=args.joints)
    else:
        main()
