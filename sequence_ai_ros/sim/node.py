"""``sim_robot``: a Meta-World task (:class:`~sequence_ai_ros.sim.task.SimTask`) as a ROS 2 robot.

Topics and services (all relative: a namespace moves the whole robot):

- publishes ``joint_states`` (sensor_msgs/JointState: ``ee_x ee_y ee_z gripper`` measured, then ``obs_0 ..
  obs_38``) after every step, ``<camera>/image_raw`` (sensor_msgs/Image rgb8) for each camera at
  ``camera_rate_hz``, ``~/success`` (std_msgs/Bool) after every step, ``~/status``
  (sequence_ai_msgs/SimStatus) at ``status_rate_hz`` and after each reset;
- takes ``<controller>/commands`` (std_msgs/Float64MultiArray, command order) and
  ``<controller>/joint_trajectory`` (trajectory_msgs/JointTrajectory), see :mod:`.commands`;
- serves ``~/reset`` (sequence_ai_msgs/ResetSim): a seeded task instance; it answers once the reset state
  has been published on joint_states and on every camera.

An episode starts at its first command: after a reset (and after start-up) the robot waits, publishing its
reset state on ``joint_states`` every period and its cameras at ``camera_rate_hz`` (so a policy node's
observations stay fresh), but runs no physics and counts no step until a command (forward or trajectory)
arrives. Its ``max_steps`` then count from that command, so a goal sent any time after a reset gets the
whole episode; ``~/status`` says ``steps`` 0 and ``first_command_step`` -1 while it waits, and
``first_command_step`` is 1 once it runs.

Threads: the executor (``main``) runs the subscriptions, the status timer and the reset service; the
stepping thread ``sim-step`` (owned here: :meth:`SimRobot.start`, :meth:`SimRobot.stop` with a timed join)
is the only one that touches MuJoCo: it steps at ``1 / dt * real_time_factor`` Hz on absolute deadlines of
the steady clock, performs resets the service hands it (a one-slot queue, answered through an Event), and
renders. The deadlines start again at a reset and at the first command. A period whose deadline passed by a
whole period before its step could run is an overrun: counted (``~/status``), skipped, never run late in a
burst; while the robot waits for its first command, missed periods are skipped and not counted.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from typing import Any

import numpy as np
from rclpy.node import Node
from rclpy.qos import qos_profile_sensor_data
from sensor_msgs.msg import Image, JointState
from sequence_ai_msgs.msg import SimStatus
from sequence_ai_msgs.srv import ResetSim
from std_msgs.msg import Bool, Float64MultiArray
from trajectory_msgs.msg import JointTrajectory

from sequence_ai_ros.exceptions import ContractViolation, SequenceAIError
from sequence_ai_ros.sim.commands import CommandInput, make_trajectory
from sequence_ai_ros.sim.config import SimConfig, declare_and_read
from sequence_ai_ros.sim.task import COMMAND_NAMES, JOINT_NAMES, SimTask

#: Longest wait (s) of ~/reset for the stepping thread.
RESET_TIMEOUT_S = 30.0


class SimRobot(Node):
    """The simulated robot node (see the module docstring).

    :param context: the rclpy Context.
    :raises ConfigError: for an invalid parameter.
    :raises MissingDependency: without Meta-World/MuJoCo, or with cameras and no EGL.
    """

    def __init__(self, *, context: Any = None, node_name: str = 'sim_robot') -> None:
        super().__init__(node_name, context=context)
        self.cfg: SimConfig = declare_and_read(self)
        cfg = self.cfg
        self.task = SimTask(cfg.task, cfg.benchmark_seed, cfg.max_steps)
        self.period_s = self.task.dt / cfg.real_time_factor
        self.commands = CommandInput(len(COMMAND_NAMES))
        self._joint_pub = self.create_publisher(JointState, cfg.joint_states_topic, 10)
        self._camera_pubs = {c: self.create_publisher(Image, f'{c}/image_raw', qos_profile_sensor_data)
                             for c in cfg.camera_names}
        self._success_pub = self.create_publisher(Bool, '~/success', 10)
        self._status_pub = self.create_publisher(SimStatus, '~/status', 10)
        self.create_subscription(Float64MultiArray, f'{cfg.controller}/commands', self._on_forward, 10)
        self.create_subscription(JointTrajectory, f'{cfg.controller}/joint_trajectory', self._on_trajectory, 10)
        self.create_service(ResetSim, '~/reset', self._on_reset)
        self.create_timer(1.0 / cfg.status_rate_hz, self.publish_status)
        self.episode = 0
        self.total_steps = 0
        self.overruns = 0
        self.total_overruns = 0
        self.success_step = -1
        self.first_command_step = -1
        self._resets: queue.Queue = queue.Queue(maxsize=1)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._status_lock = threading.Lock()
        self._next_frame = 0.0
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        #: set when the stepping thread failed (its error is logged); the entry point then exits
        self.failed = threading.Event()

    # -- lifetime ------------------------------------------------------------------------------------
    def start(self, timeout_s: float = 60.0) -> None:
        """Start the stepping thread ``sim-step``; return once it has reset to the configured instance.

        The first reset renders every camera in that thread (an EGL context belongs to the thread that made it).

        :raises MissingDependency: when a camera cannot render (no EGL).
        :raises ConfigError: for a camera the scene lacks.
        """
        self._thread = threading.Thread(target=self._run, name='sim-step', daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout_s):
            raise RuntimeError(f'sim-step did not reset within {timeout_s} s')
        if self._start_error is not None:
            raise self._start_error
        self.get_logger().info(f'{self.cfg.task}: stepping at {1 / self.period_s:.2f} Hz '
                               f'({self.cfg.real_time_factor:g} x real time), {self.cfg.max_steps} steps from the '
                               f'first command after each reset, cameras {self.cfg.camera_names or "none"}')

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the stepping thread (timed join); it frees the task and its renderers as it ends."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    # -- inputs (executor) ---------------------------------------------------------------------------
    def _on_forward(self, msg: Float64MultiArray) -> None:
        try:
            self.commands.set_forward(np.asarray(msg.data, np.float64))
        except ContractViolation as exc:
            self.get_logger().warning(f'command refused: {exc}', throttle_duration_sec=1.0)

    def _on_trajectory(self, msg: JointTrajectory) -> None:
        now = self._ros_now_s()
        stamp = msg.header.stamp.sec + msg.header.stamp.nanosec * 1e-9
        try:
            traj = make_trajectory(list(msg.joint_names), COMMAND_NAMES, stamp if stamp > 0 else now,
                                   [p.time_from_start.sec + p.time_from_start.nanosec * 1e-9 for p in msg.points],
                                   [list(p.positions) for p in msg.points], now)
        except ContractViolation as exc:
            self.commands.refuse(str(exc))
            self.get_logger().warning(f'trajectory refused: {exc}', throttle_duration_sec=1.0)
            return
        self.commands.set_trajectory(traj)

    def _on_reset(self, request: ResetSim.Request, response: ResetSim.Response) -> ResetSim.Response:
        done = threading.Event()
        slot: dict[str, Any] = {}
        try:
            self._resets.put_nowait((request.split or 'test', int(request.index), done, slot))
        except queue.Full:
            response.success, response.message = False, 'a reset is already pending'
            return response
        if not done.wait(RESET_TIMEOUT_S):
            response.success, response.message = False, f'the stepping thread did not reset within {RESET_TIMEOUT_S} s'
            return response
        error = slot.get('error')
        response.success, response.message = error is None, str(error or '')
        response.episode = self.episode
        response.state = [float(v) for v in slot.get('state', ())]
        return response

    def _ros_now_s(self) -> float:
        return self.get_clock().now().nanoseconds * 1e-9

    # -- stepping thread -----------------------------------------------------------------------------
    def _reset(self, split: str, index: int) -> np.ndarray:
        if self.episode:
            self.get_logger().info(
                f'episode {self.episode} ({self.task.split}[{self.task.index}]) ended: steps {self.task.steps}, '
                f'success {self.task.success} (first at step {self.success_step}), first command at step '
                f'{self.first_command_step}, overruns {self.overruns}, commands {self.commands.received} '
                f'(refused {self.commands.refused})')
        state = self.task.reset(split, index)
        with self._status_lock:
            self.commands.reset(self.task.measured())
            self.episode += 1
            self.overruns = 0
            self.success_step = self.first_command_step = -1
        self._publish_state(state, frames=True)
        self.publish_status()
        others = self.count_publishers(self.cfg.joint_states_topic) - 1
        if others > 0:
            self.get_logger().warning(f'{others} other publisher(s) on {self.cfg.joint_states_topic}: another robot '
                                      'in this ROS domain mixes its joint states in')
        return state

    def _run(self) -> None:
        try:
            self._reset(self.cfg.split, self.cfg.index)
        except (SequenceAIError, RuntimeError) as exc:
            self._start_error = exc
            self._ready.set()
            return
        self._ready.set()
        try:
            self._loop()
        except Exception as exc:
            self.get_logger().error(f'sim-step failed: {type(exc).__name__}: {exc}')
            self.failed.set()
            raise
        finally:
            self.task.close()                       # its renderers' EGL contexts belong to this thread

    def _loop(self) -> None:
        period = self.period_s
        start = time.monotonic()
        k = 0
        waiting = True                              # for the episode's first command (see the module docstring)
        while not self._stop.is_set():
            try:
                split, index, done, slot = self._resets.get_nowait()
            except queue.Empty:
                pass
            else:
                try:
                    slot['state'] = self._reset(split, index)
                except SequenceAIError as exc:
                    slot['error'] = exc
                done.set()
                start, k = time.monotonic(), 0      # a reset is no control period: the grid starts again
                waiting = True
            if waiting and self.commands.received:
                waiting = False                     # the episode's clock starts at its first command
                start, k = time.monotonic(), 0
            now = time.monotonic()
            behind = math.floor((now - (start + k * period)) / period)
            if behind >= 1:                         # whole periods no step served: counted, skipped
                if not waiting:
                    with self._status_lock:
                        self.overruns += behind
                        self.total_overruns += behind
                k += behind
            if waiting:
                self._publish_state(self.task.state(), frames=False)
            else:
                self._step()
            k += 1
            self._stop.wait(max(0.0, start + k * period - time.monotonic()))

    def _step(self) -> None:
        task = self.task
        if task.index < 0 or task.truncated:
            return
        received = self.commands.received
        task.step(self.commands.target(self._ros_now_s()))
        with self._status_lock:
            self.total_steps += 1
            if received and self.first_command_step < 0:
                self.first_command_step = task.steps
            if task.success and self.success_step < 0:
                self.success_step = task.steps
        self._publish_state(task.state(), frames=False)
        self._success_pub.publish(Bool(data=task.success))

    def _publish_state(self, state: np.ndarray, frames: bool) -> None:
        stamp = self.get_clock().now().to_msg()
        msg = JointState(name=list(JOINT_NAMES), position=[float(v) for v in state])
        msg.header.stamp = stamp
        self._joint_pub.publish(msg)
        now = time.monotonic()
        if not self._camera_pubs or (not frames and now < self._next_frame):
            return
        self._next_frame = max(self._next_frame + 1.0 / self.cfg.camera_rate_hz, now)
        w, h = self.cfg.camera_width, self.cfg.camera_height
        for cam, pub in self._camera_pubs.items():
            image = Image(height=h, width=w, encoding='rgb8', step=w * 3)
            image.header.stamp, image.header.frame_id = stamp, cam
            image.data = self.task.render(cam, w, h).tobytes()
            pub.publish(image)

    # -- reporting (executor) ------------------------------------------------------------------------
    def publish_status(self) -> None:
        """Publish ``~/status`` (any thread)."""
        task, commands = self.task, self.commands
        with self._status_lock:
            msg = SimStatus(task=task.task, split=task.split, index=max(task.index, 0), episode=self.episode,
                            steps=task.steps, total_steps=self.total_steps, overruns=self.overruns,
                            total_overruns=self.total_overruns, success=task.success,
                            success_step=self.success_step, first_command_step=self.first_command_step,
                            truncated=task.truncated, commands=commands.received,
                            commands_refused=commands.refused, message=commands.message)
        msg.stamp = self.get_clock().now().to_msg()
        self._status_pub.publish(msg)
