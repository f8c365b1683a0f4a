"""Support for the policy node tests: a real node process, a real worker, and a probe node.

- :func:`node_params` writes a params file; :func:`spawn_node` starts ``python -m sequence_ai_ros.node.main``
  in its own process (real rclpy over DDS), as ``ros2 run`` would.
- :class:`Probe` is an rclpy node in the test process, spun by its own executor thread: it records the
  commands the node publishes (with receive times), /diagnostics and ~/status, publishes joint states
  and camera frames on demand, and calls the node's services and Act action.
- The worker is the real one (:func:`sequence_ai_ros.worker.serve_policy_file`, 127.0.0.1 port 0) serving
  ``test/policies/node_ramp.py``.
"""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import yaml

REPO = Path(__file__).resolve().parent.parent
POLICIES = REPO / 'test' / 'policies'
RAMP = POLICIES / 'node_ramp.py'
NODE = '/policy_node'


def node_params(tmp_path: Path, name: str = 'params.yaml', *, node_key: str = 'policy_node', **params: Any) -> Path:
    """Write ``{policy_node: {ros__parameters: params}}``; dotted keys become nested mappings.

    ``autostart`` defaults to true here (the node then configures and activates itself, as the launch files
    make it do). ``node_key`` is the node key (``/**/policy_node`` matches the node in any namespace).
    """
    params.setdefault('autostart', True)
    nested: dict[str, Any] = {}
    for key, value in params.items():
        parts = key.split('.')
        d = nested
        for p in parts[:-1]:
            d = d.setdefault(p, {})
        d[parts[-1]] = value
    path = tmp_path / name
    path.write_text(yaml.safe_dump({node_key: {'ros__parameters': nested}}))
    return path


def spawn_node(processes: Any, log: Path, *param_files: Path, namespace: str = '') -> Any:
    """Start the policy node in its own process with ``param_files`` (later files override earlier).

    Its output goes to the file ``log`` (a pipe could fill up and stall the node); ``proc.log`` names it.
    ``namespace`` runs it as ``ros2 run ... --ros-args -r __ns:=/<namespace>`` does.
    """
    argv = [sys.executable, '-m', 'sequence_ai_ros.node.main', '--ros-args']
    if namespace:
        argv += ['-r', f'__ns:=/{namespace.strip("/")}']
    for f in param_files:
        argv += ['--params-file', str(f)]
    out = open(log, 'w')  # noqa: SIM115  (closed by the OS when the test process ends)
    proc = processes.spawn(argv, stdout=out, stderr=subprocess.STDOUT)
    proc.log = log
    return proc


WORKER = r'''
import json, sys, signal, threading
from sequence_ai_ros.worker import serve_policy_file
path, name, kwargs = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
server = serve_policy_file(path, name, **kwargs)
print(server.port, flush=True)
done = threading.Event()
signal.signal(signal.SIGTERM, lambda *a: done.set())
done.wait()
server.stop(grace=0.5)
'''


def spawn_worker(processes: Any, policy: Path, name: str, **kwargs: Any) -> int:
    """Serve ``policy`` as ``name`` from a worker process of its own (apart from the test's GIL); return its port."""
    import json

    proc = processes.python(WORKER, str(policy), name, json.dumps(kwargs))
    line = proc.stdout.readline()
    assert line.strip().isdigit(), f'worker did not start: {line!r} {proc.stderr.read() if proc.poll() else ""}'
    return int(line)


def ros_command(command: str, modules: tuple[str, ...], what: str) -> str:
    """Return the path of the ROS tool ``command``; skip the test, saying why, where it or ``modules`` are missing.

    :param what: the tools' name in the message (e.g. 'ros2cli', 'the ROS 2 launch tools').
    """
    import importlib.util
    import shutil

    import pytest

    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f'{", ".join(missing)} not installed: {what} come from a sourced distro, or from '
                    '../shared/ros2-tools into .venv (make setup)')
    found = shutil.which(command)
    if found is None:
        pytest.skip(f'no {command} command on PATH')
    return found


def wait_for(predicate: Callable[[], Any], timeout: float, step: float = 0.02) -> Any:
    """Poll ``predicate`` until it returns a truthy value (returned) or ``timeout`` s pass (None)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(step)
    return None


class Probe:
    """The test's side of the ROS graph (see the module docstring).

    :param context: the test's rclpy Context.
    :param command_type: the message type of the command topic.
    :param command_topic: the topic to record.
    :param namespace: the policy node's namespace ('' for the root): its services, status and diagnostic
        names, and the joint_states topic published here, are looked up in it.
    :param act_client: make an Act action client (``send_goal``); False: none, as for a test of what the node
        does when a goal's own client leaves the graph.
    """

    def __init__(self, context: Any, command_type: Any = None, command_topic: str = '', namespace: str = '',
                 name: str = 'probe', act_client: bool = True) -> None:
        import rclpy
        from diagnostic_msgs.msg import DiagnosticArray
        from rclpy.action import ActionClient
        from rclpy.executors import SingleThreadedExecutor
        from sensor_msgs.msg import Image, JointState
        from sequence_ai_msgs.action import Act
        from sequence_ai_msgs.msg import RunStatus
        from sequence_ai_msgs.srv import EndEpisode, Label, StartEpisode
        from std_srvs.srv import Trigger

        ns = namespace.strip('/')
        NODE = f'/{ns}/policy_node' if ns else '/policy_node'   # noqa: N806  (shadows the module default)
        self.node_path, self.diag_prefix = NODE, NODE.lstrip('/')
        self._get_state: Any = None
        self.node = rclpy.create_node(name, context=context)
        self.commands: list[tuple[float, Any]] = []
        self.diagnostics: list[Any] = []
        self.status: list[Any] = []
        self.feedback: list[Any] = []
        if command_type is not None:
            self.node.create_subscription(command_type, command_topic,
                                          lambda m: self.commands.append((time.monotonic(), m)), 1000)
        self.diagnostics_received: list[float] = []       # time.monotonic() of each /diagnostics message
        self.node.create_subscription(DiagnosticArray, '/diagnostics', self._on_diagnostics, 10)
        self.node.create_subscription(RunStatus, f'{NODE}/status', self.status.append, 10)
        # act_client=False: no Act client (an action client is a subscriber of the goal's feedback, which the node
        # watches to tell whether a goal's client is still there)
        self.act = ActionClient(self.node, Act, f'{NODE}/act') if act_client else None
        self.Act = Act
        self.clients = {
            'start_episode': self.node.create_client(StartEpisode, f'{NODE}/start_episode'),
            'end_episode': self.node.create_client(EndEpisode, f'{NODE}/end_episode'),
            'interrupt': self.node.create_client(Trigger, f'{NODE}/interrupt'),
            'label': self.node.create_client(Label, f'{NODE}/label'),
        }
        self.types = {'start_episode': StartEpisode, 'end_episode': EndEpisode, 'interrupt': Trigger,
                      'label': Label}
        self.joint_topic = f'/{ns}/joint_states' if ns else '/joint_states'
        self.joint_pub = self.node.create_publisher(JointState, self.joint_topic, 10)
        self.JointState, self.Image = JointState, Image
        self._timers: list[Any] = []
        self.executor = SingleThreadedExecutor(context=context)
        self.executor.add_node(self.node)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._spin, name='probe-spin', daemon=True)
        self._thread.start()

    def _spin(self) -> None:
        while not self._stop.is_set():
            self.executor.spin_once(timeout_sec=0.05)

    def close(self) -> None:
        """Stop spinning (timed join) and destroy the node."""
        self._stop.set()
        self._thread.join(5.0)
        if self.act is not None:
            self.act.destroy()
        self.executor.shutdown(timeout_sec=1.0)
        self.node.destroy_node()

    # -- publishing ----------------------------------------------------------------------------------
    def publish_joints(self, names: list[str], rate_hz: float = 100.0, positions: Callable[[], Any] | None = None,
                       topic: str = '/joint_states') -> Any:
        """Publish JointState at ``rate_hz`` from a timer; returns the timer (cancel() stops it)."""
        pub = self.joint_pub if topic == '/joint_states' else self.node.create_publisher(self.JointState, topic, 10)
        value = positions or (lambda: np.linspace(0.1, 0.4, len(names)))

        def tick() -> None:
            msg = self.JointState(name=list(names), position=[float(v) for v in value()])
            msg.header.stamp = self.node.get_clock().now().to_msg()
            pub.publish(msg)
        timer = self.node.create_timer(1.0 / rate_hz, tick)
        self._timers.append(timer)
        return timer

    def publish_camera(self, topic: str, width: int = 64, height: int = 48, rate_hz: float = 30.0,
                       on_publish: Callable[[float], Any] | None = None) -> Any:
        """Publish rgb8 Images at ``rate_hz`` (sensor-data QoS); returns the timer (cancel()/reset()).

        :param on_publish: called with ``time.monotonic()`` after each publish.
        """
        from rclpy.qos import qos_profile_sensor_data

        pub = self.node.create_publisher(self.Image, topic, qos_profile_sensor_data)
        msg = self.Image(height=height, width=width, encoding='rgb8', step=width * 3)
        msg.data = np.full((height, width, 3), 90, np.uint8).tobytes()
        def tick() -> None:
            pub.publish(msg)
            if on_publish is not None:
                on_publish(time.monotonic())
        timer = self.node.create_timer(1.0 / rate_hz, tick)
        self._timers.append(timer)
        return timer

    # -- calls ---------------------------------------------------------------------------------------
    def call(self, name: str, timeout: float = 15.0, **fields: Any) -> Any:
        """Call one of the node's services; return the response (AssertionError on timeout)."""
        client = self.clients[name]
        assert client.wait_for_service(timeout_sec=timeout), f'{self.node_path}/{name} never appeared'
        future = client.call_async(self.types[name].Request(**fields))
        assert wait_for(future.done, timeout), f'{name} did not answer within {timeout} s'
        return future.result()

    def send_goal(self, timeout: float = 15.0, **fields: Any) -> Any:
        """Send an Act goal; return its goal handle (accepted or not)."""
        assert self.act.wait_for_server(timeout_sec=timeout), f'{self.node_path}/act never appeared'
        future = self.act.send_goal_async(self.Act.Goal(**fields), feedback_callback=self.feedback.append)
        assert wait_for(future.done, timeout), 'goal not answered'
        return future.result()

    def result(self, handle: Any, timeout: float = 30.0) -> Any:
        """Wait for a goal's result; return the Act.Result."""
        future = handle.get_result_async()
        assert wait_for(future.done, timeout), f'no result within {timeout} s'
        return future.result().result

    # -- reading -------------------------------------------------------------------------------------
    def values(self, since: float = 0.0) -> list[tuple[float, np.ndarray]]:
        """Recorded Float64MultiArray/JointTrajectory commands received after ``since`` (monotonic s)."""
        out = []
        for t, m in list(self.commands):
            if t < since:
                continue
            if hasattr(m, 'points'):
                out.append((t, np.array(m.points[0].positions)))
            elif hasattr(m, 'data'):
                out.append((t, np.array(m.data)))
            else:
                out.append((t, np.array(m.position)))
        return out

    def diag_value(self, part: str, key: str) -> str | None:
        """The latest /diagnostics value ``key`` of status ``policy_node: part``."""
        for arr in reversed(list(self.diagnostics)):
            for st in arr.status:
                if st.name == f'{self.diag_prefix}: {part}':
                    for kv in st.values:
                        if kv.key == key:
                            return kv.value
        return None

    def _on_diagnostics(self, msg: Any) -> None:
        self.diagnostics_received.append(time.monotonic())
        self.diagnostics.append(msg)

    def diagnostics_since(self, t: float) -> bool:
        """True once a /diagnostics message arrived after ``t`` (time.monotonic())."""
        return bool(self.diagnostics_received) and self.diagnostics_received[-1] > t

    def diag_level(self, part: str) -> int | None:
        """The latest /diagnostics level (0 OK, 1 WARN, 2 ERROR, 3 STALE) of status ``policy_node: part``."""
        for arr in reversed(list(self.diagnostics)):
            for st in arr.status:
                if st.name == f'{self.diag_prefix}: {part}':
                    return int.from_bytes(st.level, 'little') if isinstance(st.level, bytes) else int(st.level)
        return None

    def diag_message(self, part: str) -> str | None:
        """The latest /diagnostics message of status ``policy_node: part``."""
        for arr in reversed(list(self.diagnostics)):
            for st in arr.status:
                if st.name == f'{self.diag_prefix}: {part}':
                    return st.message
        return None

    def wait_connected(self, timeout: float = 30.0, active: bool = True) -> Any:
        """Wait for a ~/status saying connected and ready and, with ``active``, for the lifecycle state active.

        The node reports connected while it is still configuring; a goal sent then is rejected (not active).
        """
        deadline = time.monotonic() + timeout
        if not wait_for(lambda: any(s.connected and s.ready for s in self.status[-3:]), timeout):
            return False
        return not active or wait_for(lambda: self.lifecycle_state() == 'active',
                                      max(0.5, deadline - time.monotonic()), step=0.05)

    def lifecycle_state(self, timeout: float = 5.0) -> str:
        """The node's lifecycle state label (``~/get_state``), '' when it does not answer."""
        from lifecycle_msgs.srv import GetState

        if self._get_state is None:
            self._get_state = self.node.create_client(GetState, f'{self.node_path}/get_state')
        if not self._get_state.wait_for_service(timeout_sec=timeout):
            return ''
        future = self._get_state.call_async(GetState.Request())
        return future.result().current_state.label if wait_for(future.done, timeout) else ''


def observation_refusals(proc: Any) -> tuple[list[str], list[str]]:
    """The node's 'observation invalid' reasons so far, split into (staleness, every other reason).

    A source going stale names the test process's publisher thread starving on a loaded machine (CI shares its
    cores), not what a test sends; every other reason (a missing, duplicated or malformed joint) is the node
    refusing what it was sent.
    """
    stale: list[str] = []
    other: list[str] = []
    for line in Path(proc.log).read_text().splitlines():
        _, found, reasons = line.partition('observation invalid, holding: ')
        for reason in reasons.split('; ') if found else ():
            (stale if re.search(r': stale \(', reason) else other).append(reason)
    return stale, other


def node_log(proc: Any) -> str:
    """The node's output so far (last 4000 characters), for assertion messages."""
    return 'node output:\n' + Path(proc.log).read_text()[-4000:]
