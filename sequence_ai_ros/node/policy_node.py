"""``PolicyNode``: a managed (lifecycle) node with subscriptions, publishers, services and threads wired together.

The node itself only adapts ROS to the parts that do the work: :mod:`.observation` (inputs),
:mod:`.images` (camera conversion), :mod:`.runner` (episodes over the client engine),
:mod:`.controller_commands` (the controller's messages), :mod:`.trajectory` (trajectory mode),
:mod:`.safety` and :mod:`.diagnostics`. Services and the Act action (:mod:`.episode_services`) live on
this node, so ``ros2 node info`` lists them.

Lifecycle (``rclpy.lifecycle``, as ros2_control's controllers):

- configure: parameters (declared and validated at construction, so a bad one fails fast), the
  subscriptions and lifecycle publishers, the connection to the worker and the contract/interface
  agreement (a policy this node cannot feed or command fails the transition, naming the difference);
- activate: the control thread starts, commands go out through lifecycle publishers, goals are accepted;
- deactivate: any episode is interrupted, one last hold is published, commands stop (the controller holds);
- cleanup / shutdown: the episode ends, the connection closes, subscriptions and publishers go.

The lifecycle services run in their own (reentrant) callback group, so a blocking ``on_configure`` (the
worker connect, bounded by ``connect_timeout_s``) stalls neither them nor the other callbacks. With
``autostart`` the node makes its own transitions (:func:`.main.main`); launch_ros's ``autostart=``
exists only from Jazzy on. Topic names are relative (``joint_states``, ``<controller>/commands``,
``~/status``), so a namespace or a remap moves a whole robot; ``/diagnostics`` stays absolute, as the
diagnostic aggregator expects, with statuses named after the node's fully qualified name.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from rcl_interfaces.msg import SetParametersResult
from rclpy.callback_groups import MutuallyExclusiveCallbackGroup, ReentrantCallbackGroup
from rclpy.clock import Clock, ClockType
from rclpy.lifecycle import LifecycleNode, LifecycleNodeMixin, LifecycleState, TransitionCallbackReturn
from rclpy.node import Node
from rclpy.qos import QoSProfile, ReliabilityPolicy, qos_profile_sensor_data
from sensor_msgs.msg import CompressedImage, Image, JointState
from sequence_ai_msgs.msg import RunStatus
from std_msgs.msg import Float64MultiArray

from sequence_ai_ros.exceptions import ConfigError, SequenceAIError
from sequence_ai_ros.node import diagnostics, trajectory
from sequence_ai_ros.node.controller_commands import CommandInterface
from sequence_ai_ros.node.images import ImageConverter
from sequence_ai_ros.node.observation import ObservationAssembler
from sequence_ai_ros.node.parameters import declare_and_read, on_set_check
from sequence_ai_ros.node.runner import Runner
from sequence_ai_ros.node.safety import SafetyFilter
from sequence_ai_ros.node.tick import TickThread
from sequence_ai_ros.protocol.contract import Contract

SUCCESS, FAILURE = TransitionCallbackReturn.SUCCESS, TransitionCallbackReturn.FAILURE

#: While configure keeps failing with the same cause (autostart retries every second), the node logs a
#: reminder this often (s), so a log read later still shows that the node is waiting and why.
CONFIGURE_REMINDER_S = 10.0


def _stamp_s(msg: Any) -> float:
    stamp = getattr(getattr(msg, 'header', None), 'stamp', None)
    if stamp is None or (stamp.sec == 0 and stamp.nanosec == 0):
        return math.nan
    return stamp.sec + stamp.nanosec * 1e-9


def rcl_reason(exc: BaseException) -> str:
    """An rcl error's message without the C source location rcl appends (``..., at src/rcl/x.c:73``)."""
    return str(exc).split(', at ')[0]


class PolicyNode(LifecycleNode):
    """The policy node: topics in, fixed-rate commands (or trajectories) out, status and diagnostics.

    Threads: the two executors of :mod:`.executors` (observations and reporting; services, the Act
    action and the lifecycle services), by callback group, the control thread ``seq-tick``
    (:class:`.tick.TickThread`, while active) and the session thread ``seq-session`` (blocking gRPC:
    readiness, reconnects, episode ends; while configured). :meth:`stop` shuts the node down through
    its lifecycle (a last hold, the episode ended).

    :param connect: passed to :class:`.runner.Runner` (default: :func:`sequence_ai_ros.client.connect`).
    :param kwargs: passed to :class:`rclpy.node.Node` (``context``, ``cli_args``, ``parameter_overrides``...).
    :raises ConfigError: when a parameter is invalid, or ``model`` or ``joints.names`` is empty.
    """

    def __init__(self, node_name: str = 'policy_node', *, connect: Callable[..., Any] | None = None,
                 **kwargs: Any) -> None:
        Node.__init__(self, node_name, **kwargs)
        self.lifecycle_group = ReentrantCallbackGroup()
        try:   # what LifecycleNode.__init__ does, with the lifecycle services in a group of their own
            LifecycleNodeMixin.__init__(self, enable_communication_interface=True,
                                        callback_group=self.lifecycle_group)
        except TypeError:   # an rclpy whose mixin takes no group: the services stay in the default group
            LifecycleNodeMixin.__init__(self, enable_communication_interface=True)
        cfg = self.cfg = declare_and_read(self)
        cfg.check_runnable()
        self.enabled = cfg.enabled
        self.on_underrun = cfg.on_underrun
        self.trajectory_mode = cfg.command.mode == 'trajectory'
        self.commands = CommandInterface(cfg.command, cfg.command_joint_names, cfg.period_s)
        self.safety = SafetyFilter(cfg.safety, cfg.command_joint_names, self.commands.is_position)
        self.assembler = ObservationAssembler(
            cfg.joints.names, cfg.joints.max_age_s, {c.key: c.max_age_s for c in cfg.cameras},
            joints_source=self._resolve('joints.topic', cfg.joints.topic),
            camera_sources={c.key: self._resolve(f'cameras.{c.name}.topic', c.topic) for c in cfg.cameras},
            clock=lambda: self.get_clock().now().nanoseconds * 1e-9, stamp_source=cfg.stamp_source)
        self.converters = {c.key: ImageConverter() for c in cfg.cameras}
        self._connect = connect
        self.runner = self._new_runner()
        self.health = diagnostics.Health(cfg.diagnostics)
        self.command_topic = self._resolve('command.topic' if cfg.command.topic else 'command.controller',
                                           self.commands.topic)
        if cfg.command.gripper_topic:
            self._resolve('command.gripper_topic', cfg.command.gripper_topic)
        # Observations and reporting are served by a SingleThreadedExecutor of their own, the rest by a
        # MultiThreadedExecutor (see .executors: one MultiThreadedExecutor for all cost the control thread).
        self.inputs_group = MutuallyExclusiveCallbackGroup()
        self.reporting_group = MutuallyExclusiveCallbackGroup()
        self.services_group = ReentrantCallbackGroup()
        self._status_pub = self.create_publisher(RunStatus, '~/status', 10)
        self._diag_pub = self.create_publisher(diagnostics.DiagnosticArray, '/diagnostics', 10)
        # Reporting runs on the steady clock: with use_sim_time it goes on while /clock stalls (a paused
        # bag); the messages are still stamped with the node's clock. It reports in every lifecycle state.
        steady = Clock(clock_type=ClockType.STEADY_TIME)
        self.create_timer(1.0 / cfg.status_rate_hz, self._publish_status, clock=steady,
                          callback_group=self.reporting_group)
        self.create_timer(1.0 / cfg.diagnostics_rate_hz, self._publish_diagnostics, clock=steady,
                          callback_group=self.reporting_group)
        self.add_on_set_parameters_callback(self._on_set_parameters)
        from sequence_ai_ros.node.episode_services import EpisodeServices

        self.episode_services = EpisodeServices(self, self.services_group)
        self._subscriptions_made: list[Any] = []
        self._cmd_pub: Any = None
        self._dry_pub: Any = None
        self._gripper_pub: Any = None
        self._tick: TickThread | None = None
        self._skipped_before = 0            # ticks skipped by control threads of earlier activations
        self._stopping: TickThread | None = None   # a control thread being stopped (its skips still count)
        self._skips_lock = threading.Lock()  # _skipped_before and _stopping change together
        self._session: threading.Thread | None = None
        self._session_stop = threading.Event()
        self._last_tick_error = 0.0
        self._traj_chunk = -1               # trajectory mode: the chunk last published
        self._traj_held = True              # trajectory mode: the stop of the episode has been held
        self._controller_last: Any = None   # the last values the controller received (streaming mode)
        self._dry_stop = False              # enabled:=false on a rate interface or in trajectory mode: stop the
                                            # controller once (see _on_tick)
        self._traj_ref: Any = None          # trajectory mode: the hold the controller was last sent
        self._rebase: tuple[Any] | None = None   # a step-limit reference for the first enabled tick to take
        self.configure_error = ''
        self._last_info = ''                # the runner's last info line (see _log)
        self._configure_failing_since: float | None = None   # time.monotonic() of the first failed attempt
        self._configure_reported = 0.0                       # when the last 'still failing' line was logged

    def _resolve(self, param: str, topic: str) -> str:
        """Resolve a configured topic name (namespace, remaps); a name rcl refuses is a parameter error.

        :raises ConfigError: naming the parameter, for a name rcl refuses (spaces, '//', empty...).
        """
        try:
            return self.resolve_topic_name(topic)
        except Exception as exc:  # rclpy raises its RCLError (no stable import path across distros)
            raise ConfigError(f'parameter {param}: {topic!r} is no valid ROS topic name '
                              f'({rcl_reason(exc).removeprefix("failed to resolve name: ")})') from None

    def _replace_runner(self) -> None:
        """Close the runner and start a new one; ~/label (no id) and the last result still name the last episode."""
        old = self.runner
        old.close()
        self.runner = self._new_runner()
        self.runner.last_episode_id, self.runner.last_result = old.last_episode_id, old.last_result

    def _new_runner(self) -> Runner:
        runner = Runner(self.cfg, self.commands, self.safety, self.assembler, connect=self._connect,
                        on_contract=self._on_contract, log=self._log)
        runner.on_underrun = self.on_underrun   # a run-time value survives cleanup
        return runner

    @property
    def lifecycle_state(self) -> str:
        """The lifecycle state's label (unconfigured, inactive, active, finalized, or a transition)."""
        return self._state_machine.current_state[1]

    # -- lifecycle transitions ----------------------------------------------------------------------
    def on_configure(self, state: LifecycleState) -> TransitionCallbackReturn:
        """Subscriptions, lifecycle publishers, the worker connection and the contract agreement.

        Any failure, expected (worker unreachable, contract mismatch) or not (an rclpy refusal), is logged
        with its cause, kept in ``configure_error`` for ~/status and /diagnostics, and leaves the node
        unconfigured with nothing half-made (FAILURE; autostart retries).
        """
        try:
            return self._configure()
        except Exception as exc:  # rclpy would send it through on_error in silence
            self._release()
            return self._configure_failed(f'{type(exc).__name__}: {exc}')

    def _configure_failed(self, error: str) -> TransitionCallbackReturn:
        now = time.monotonic()
        if self._configure_failing_since is None:
            self._configure_failing_since = now
        if error != self.configure_error:      # autostart retries every second: say each cause once,
            self.get_logger().error(f'configure failed: {error}')
            self._configure_reported = now
        elif now - self._configure_reported >= CONFIGURE_REMINDER_S:   # and remind while it lasts
            self.get_logger().warning(
                f'still not configured after {now - self._configure_failing_since:.0f} s: {error}')
            self._configure_reported = now
        self.configure_error = error
        return FAILURE

    def _configure(self) -> TransitionCallbackReturn:
        cfg = self.cfg
        if self._configure_failing_since is None:   # the first attempt: say what the node waits for
            self.get_logger().info(f'configuring: connecting to {cfg.model} at {cfg.endpoint} '
                                   f'(timeout {cfg.connect_timeout_s:g} s)')
        error = self.runner.connect_now()
        if not error:
            contract = self.runner.contract
            assert contract is not None     # connect_now() answers '' once connected, contract in hand
            try:
                self.runner.validate(contract)
            except SequenceAIError as exc:
                error = f'the policy does not fit this node: {exc}'
                self._replace_runner()
                self.runner.connection, self.runner.connection_error = 'disconnected', error
        if error:
            return self._configure_failed(error)
        if cfg.qos.reliability == 'best_effort':
            qos = QoSProfile(depth=cfg.qos.depth, reliability=ReliabilityPolicy.BEST_EFFORT,
                             durability=qos_profile_sensor_data.durability, history=qos_profile_sensor_data.history)
        else:
            qos = QoSProfile(depth=cfg.qos.depth, reliability=ReliabilityPolicy.RELIABLE)
        group = self.inputs_group
        subs = [self.create_subscription(JointState, cfg.joints.topic, self._on_joints, qos, callback_group=group)]
        for cam in cfg.cameras:
            kind = CompressedImage if cam.type == 'compressed' else Image
            callback = self._image_callback(cam.key, cam.type == 'compressed')
            subs.append(self.create_subscription(kind, cam.topic, callback, qos, callback_group=group))
        self._subscriptions_made = subs
        self._cmd_pub = self.create_lifecycle_publisher(self.commands.msg_type, self.commands.topic, 10)
        self._dry_pub = self.create_lifecycle_publisher(self.commands.msg_type, '~/would_command', 10)
        self._gripper_pub = (self.create_lifecycle_publisher(Float64MultiArray, cfg.command.gripper_topic, 10)
                             if cfg.command.gripper_topic else None)
        self._session_stop.clear()
        self._session = threading.Thread(target=self._session_loop, name='seq-session', daemon=True)
        self._session.start()
        self.configure_error = ''
        self._configure_failing_since = None
        self.get_logger().info(
            f'configured: {cfg.model} at {cfg.endpoint}, {cfg.control_rate_hz:g} Hz {cfg.command.interface} '
            f'({cfg.command.mode}) on {self.command_topic}')
        return SUCCESS

    def on_activate(self, state: LifecycleState) -> TransitionCallbackReturn:
        """Enable the lifecycle publishers, start the control thread, accept goals."""
        ret = super().on_activate(state)
        if ret != SUCCESS:
            return ret
        self._tick = TickThread(self.cfg.period_s, self._on_tick, on_error=self._on_tick_error, name='seq-tick',
                                priority=self.cfg.thread_priority)
        scheduling = self._tick.start()
        self.runner.grid = self._tick     # episodes count their periods on this thread's grid
        if scheduling.startswith('default ('):      # refused (not merely slow to start: see /diagnostics)
            self.get_logger().warning(f'control thread: {scheduling}; its timing is at the mercy of the default '
                                      'scheduler (grant CAP_SYS_NICE or an rtprio limit, or set thread_priority:=0)')
        self.runner.accepting = True
        self.get_logger().info(f'active: commanding {self.command_topic}'
                               f'{"" if self.enabled else " (dry run: enabled=false)"}')
        return SUCCESS

    def on_deactivate(self, state: LifecycleState) -> TransitionCallbackReturn:
        """Interrupt any episode, publish a last hold, stop the control thread and the publishers."""
        self._hold_and_stop_ticking('deactivate')
        return super().on_deactivate(state)

    def on_cleanup(self, state: LifecycleState) -> TransitionCallbackReturn:
        """End the episode, close the connection, drop subscriptions and publishers."""
        self._release()
        return SUCCESS

    def on_shutdown(self, state: LifecycleState) -> TransitionCallbackReturn:
        """From any state: a last hold when active, then as cleanup."""
        if self._tick is not None:
            self._hold_and_stop_ticking('shutdown')
        self._release()
        return SUCCESS

    def on_error(self, state: LifecycleState) -> TransitionCallbackReturn:
        """Back to unconfigured, holding."""
        if self._tick is not None:
            self._hold_and_stop_ticking('error')
        self._release()
        return SUCCESS

    def _hold_and_stop_ticking(self, transition: str) -> None:
        self.runner.accepting = False
        self.runner.interrupt(f'lifecycle {transition}: the node stopped commanding')
        with self._skips_lock:
            tick, self._tick = self._tick, None
            self._stopping = tick               # /diagnostics goes on counting its skips while it stops
        if tick is not None:
            tick.stop()
            with self._skips_lock:
                self._skipped_before += tick.skipped_now()
                self._stopping = None
        last = self.runner.last_command
        # a position hold, a zero rate (also for 'stop': a rate controller keeps its last command), and in
        # trajectory mode always (publishing nothing lets joint_trajectory_controller play its trajectory out);
        # to the controller itself when a dry run began so recently that its stop was not sent yet
        pending, self._dry_stop = self._dry_stop, False
        if pending:
            self._stop_controller()
        elif last is not None and (self.runner.on_underrun == 'hold' or not self.commands.is_position
                                   or self.trajectory_mode):
            self._publish_hold(self.commands.hold_values(last))
        # Inactive, the arm may be moved by anything else (teleop, another controller): the old command is
        # neither republished on activate nor the step limit's reference; the measured state is.
        self.runner.last_command = None
        self._controller_last = self._traj_ref = None

    def _release(self) -> None:
        self.runner.accepting = False
        self._session_stop.set()
        if self._session is not None and self._session.is_alive():
            self._session.join(5.0)
        self._session = None
        self._replace_runner()
        for sub in self._subscriptions_made:
            self.destroy_subscription(sub)
        self._subscriptions_made = []
        for pub in (self._cmd_pub, self._dry_pub, self._gripper_pub):
            if pub is not None:
                self.destroy_lifecycle_publisher(pub)
        self._cmd_pub = self._dry_pub = self._gripper_pub = None

    def stop(self) -> None:
        """Shut down through the lifecycle: a last hold when active, the episode ended ('interrupted')."""
        if self.lifecycle_state in ('unconfigured', 'inactive', 'active'):
            self.trigger_shutdown()

    # -- inputs (executor) --------------------------------------------------------------------------
    def _on_joints(self, msg: JointState) -> None:
        self.assembler.put_joints(msg, time.monotonic(), _stamp_s(msg))

    def _image_callback(self, key: str, compressed: bool) -> Callable[[Any], None]:
        converter = self.converters[key]

        def callback(msg: Any) -> None:
            convert = (lambda: converter.from_compressed(msg)) if compressed else (lambda: converter.from_image(msg))
            self.assembler.put_image(key, convert, time.monotonic(), _stamp_s(msg))
        return callback

    def _on_contract(self, contract: Contract) -> None:
        for key, converter in self.converters.items():
            converter.spec = contract.observation.camera(key)

    def _on_set_parameters(self, params: list[Any]) -> SetParametersResult:
        checked = on_set_check(params)      # types and validation from the parameter schema
        if not checked.successful:
            return checked
        # diagnostics.* are checked together, as at start-up (a WARN threshold above its ERROR one is refused)
        # and take effect at the next /diagnostics message
        changes = {p.name.split('.', 1)[1]: p.value for p in params if p.name.startswith('diagnostics.')}
        if changes:
            try:
                thresholds = dataclasses.replace(self.health.cfg, **changes)
            except (ConfigError, TypeError) as exc:
                return SetParametersResult(successful=False, reason=str(exc))
            self.health.cfg = thresholds
        for p in params:
            if p.name == 'enabled':
                if not bool(p.value) and self.enabled and (self.trajectory_mode or not self.commands.is_position):
                    self._dry_stop = True     # the control thread stops the controller (see _on_tick)
                if bool(p.value) and not self.enabled:
                    # The dry run moved the step limit's reference along commands the controller never got:
                    # the first enabled tick steps from what the controller last received (or the measured
                    # state), so safety.max_step bounds the step the controller sees.
                    self._rebase = (None if self.trajectory_mode else self._controller_last,)
                self.enabled = bool(p.value)
            elif p.name == 'on_underrun':
                self.on_underrun = self.runner.on_underrun = p.value   # kept for the runner of a later configure
        return SetParametersResult(successful=True)

    # -- control thread ----------------------------------------------------------------------------
    def _on_tick(self, now: float) -> None:
        enabled = self.enabled    # one reading per tick: the reference and the destination agree
        if not enabled and self._dry_stop:
            # A rate controller keeps applying its last command through a dry run, joint_trajectory_controller
            # plays its last trajectory out: one stop (zero rate, or a hold) to the controller first, from
            # this thread, so no command of an earlier tick can follow it.
            self._dry_stop = False
            self._stop_controller()
        if enabled and self._rebase is not None:
            (self.runner.last_command,), self._rebase = self._rebase, None
            self._traj_chunk = -1     # trajectory mode: the playing chunk went to ~/would_command: send it now
        values = self.runner.tick(now, dry=not enabled)   # a dry run's commands go to ~/would_command
        if self.trajectory_mode:
            self._trajectory_tick(values)
        elif values is not None:
            self._publish(values, enabled)

    def _stop_controller(self) -> None:
        """Send the controller (whatever ``enabled`` says) one zero-rate command or, in trajectory mode, a hold."""
        if self.trajectory_mode:
            last = self.runner.last_command
            if last is not None:
                self._publish_hold(self.commands.hold_values(last), enabled=True)
        elif self._controller_last is not None and not self.commands.is_position:
            self._publish(self.commands.hold_values(self._controller_last), True)

    def _publish(self, values: Any, enabled: bool | None = None) -> None:
        if not np.all(np.isfinite(values)):
            # The last gate (the safety filter already refuses non-finite commands): never publish NaN/inf;
            # the run ends with 'validate' and the controller keeps its last finite command.
            self.runner.request_end('validate', 'a non-finite command reached the publisher; not published')
            return
        msg, gripper = self.commands.build(values, self.get_clock().now().to_msg())
        if self._send(msg, gripper, enabled):
            self._controller_last = np.array(values, dtype=np.float64)

    def _send(self, msg: Any, gripper: Any = None, enabled: bool | None = None) -> bool:
        """Publish to the controller, or to ``~/would_command`` in a dry run; True when the controller got it."""
        if self._cmd_pub is None:
            return False
        if not (self.enabled if enabled is None else enabled):
            self._dry_pub.publish(msg)
            return False
        self._cmd_pub.publish(msg)
        if gripper is not None and self._gripper_pub is not None:
            self._gripper_pub.publish(gripper)
        return True

    def _publish_hold(self, values: Any, enabled: bool | None = None) -> None:
        if self.trajectory_mode:
            if self._send(trajectory.hold_message(values, self.commands.joint_names,
                                                  self.get_clock().now().nanoseconds, self.cfg.period_s),
                          None, enabled):
                self._traj_ref = np.array(values, dtype=np.float64)
        else:
            self._publish(values, enabled)

    def _trajectory_tick(self, values: Any) -> None:
        """Trajectory mode: publish each new chunk's remaining horizon once; one hold when an episode stops.

        An invalid observation mid-episode (a stale or missing source) replaces the playing trajectory with
        one hold at once, as streaming mode holds: the controller would otherwise play the old trajectory to
        its end. When the observation is valid again the playing chunk's remaining horizon is published anew.
        """
        runner = self.runner
        action = runner.last_action
        if action is not None:
            horizon = runner.horizon()
            if horizon is not None and horizon[0] != self._traj_chunk:
                number, pos, dt, rows = horizon
                last = runner.last_command
                if self._traj_chunk == -1 and not action.delta:
                    # nothing playing (an episode's start, after a hold): the step limit starts from where the
                    # controller is, the hold it was sent or the measured state, not from this tick's value
                    # (an episode's first chunk: the measured state, the robot may have been reset since)
                    measured = runner.measured_state()
                    ep = runner.episode
                    first = ep is not None and ep.sent <= 1
                    if first and measured is not None:
                        last = measured
                    else:
                        last = self._traj_ref if self._traj_ref is not None else (
                            measured if measured is not None else last)
                plan = trajectory.plan_points(
                    rows, pos, dt, order=self.commands.action_order, delta=action.delta is not None,
                    last=last, safety=self.safety, period_s=self.cfg.period_s)
                self._traj_chunk, self._traj_held = number, False
                if plan.stop:
                    runner.request_end('validate', f'safety: {plan.stop}')
                elif len(plan.ahead_s):
                    if self._send(trajectory.trajectory_message(plan, self.commands.joint_names,
                                                                self.get_clock().now().nanoseconds)):
                        self._traj_ref = None
            return
        ep = runner.episode
        stopped = ep is None or ep.stopped or ep.done.is_set()
        invalid = ep is not None and not stopped and ep.stale_since is not None
        if values is None and runner.last_command is not None:
            # on_underrun 'stop' publishes no per-tick hold, but a stop must still replace the trajectory
            values = self.commands.hold_values(runner.last_command)
        if (stopped or invalid) and not self._traj_held and values is not None:
            self._traj_held = True
            self._publish_hold(values)
        if stopped or invalid:
            self._traj_chunk = -1

    def _on_tick_error(self, exc: BaseException) -> None:
        now = time.monotonic()
        if now - self._last_tick_error > 1.0:   # at most one log line per second
            self._last_tick_error = now
            self.get_logger().error(f'control tick failed: {type(exc).__name__}: {exc}')
        self.runner.request_end('error', f'control tick failed: {exc}')

    # -- session thread ------------------------------------------------------------------------------
    def _session_loop(self) -> None:
        while not self._session_stop.is_set():
            try:
                self.runner.session_step(time.monotonic())
            except Exception as exc:  # keep the session alive; report it
                self.get_logger().error(f'session: {type(exc).__name__}: {exc}')
            self._session_stop.wait(0.02)

    # -- reporting (executor) -------------------------------------------------------------------------
    def _log(self, level: str, message: str) -> None:
        # One call site per severity: rclpy refuses a call site whose severity changes between calls.
        logger = self.get_logger()
        if level == 'info':
            # autostart retries a failing configure every second: its 'connected to ...' once, not each time
            if self.configure_error and message == self._last_info:
                return
            self._last_info = message
        if level == 'error':
            logger.error(message)
        elif level == 'warn':
            logger.warning(message)
        else:
            logger.info(message)

    def report(self) -> diagnostics.Report:
        """Return a snapshot of the node's state for ~/status and /diagnostics."""
        r = self.runner
        stats: dict[str, Any] = {}
        if r.policy is not None:
            try:
                stats = dict(r.policy.stats())
            except Exception as exc:  # stats are best effort; never break reporting
                stats = {'error': str(exc)}
        snap = r.last_snapshot
        ep = r.episode
        last = r.last_result
        message = ''
        if last is not None and (ep is None or ep.done.is_set()):
            message = f'last episode {last.episode_id}: {last.reason} {last.message}'.strip()
        with self._skips_lock:   # never falls: a stopping thread counts until its skips are added up
            tick = self._tick
            skipped = self._skipped_before + sum(t.skipped_now() for t in (tick, self._stopping) if t is not None)
        jitter = tick.jitter_ms(last=int(self.health.cfg.window_s * self.cfg.control_rate_hz)) \
            if tick is not None else (0.0, 0.0, 0.0)
        dropped = r.dropped_telemetry()
        window = self.health.update(time.monotonic(), {
            'ticks_skipped': skipped, 'episode_ticks': r.episode_ticks, 'underrun_ticks': r.underrun_ticks,
            'commands_checked': self.safety.checked, 'commands_clamped': self.safety.clamped_commands,
            'dropped_telemetry': dropped, 'telemetry_rejected': r.telemetry_rejected,
            'episodes_failed': r.episodes_failed})
        control_level, control_reasons = self.health.control(jitter[1], window)
        episode_level, episode_reasons = self.health.episode(window)
        lifecycle = self.lifecycle_state
        connection_error = r.connection_error or self.configure_error
        if lifecycle != 'active' and not connection_error:
            connection_error = f'lifecycle state {lifecycle}: not commanding'
        connection = r.connection
        if r.policy is None and connection == 'connecting' and lifecycle in ('unconfigured', 'finalized'):
            connection = 'not connected'        # nothing is connecting until a configure
        observing = ''
        if tick is None:                        # no control thread: no tick snapshot to report
            if lifecycle == 'inactive':         # configured: the subscriptions are up, so say what they hold
                snap = self.assembler.snapshot(time.monotonic())
            else:
                snap, observing = None, f'not observing (lifecycle state {lifecycle})'
        return diagnostics.Report(
            state=diagnostics.state_of(r), episode_id=ep.id if ep is not None else '', deployment=self.cfg.model,
            endpoint=self.cfg.endpoint, action_space=r.contract.action_space.value if r.contract else '',
            connection=connection, connection_error=connection_error, ready=r.ready, enabled=self.enabled,
            stats=stats, clamps=self.safety.clamps, clamp_counts=self.safety.counts(),
            jitter_ms=jitter, rate_hz=self.cfg.control_rate_hz, ticks_skipped=skipped,
            sent=ep.sent if ep is not None else 0, held=ep.held if ep is not None else 0,
            episode_skipped=ep.skipped if ep is not None else 0,
            episode_elapsed_s=ep.accounted_until - ep.started if ep is not None else 0.0,
            problems=list(snap.problems) if snap else [],
            ages=dict(snap.ages) if snap else {}, message=message, dropped_telemetry=dropped,
            telemetry_rejected=r.telemetry_rejected,
            telemetry_error=last.telemetry_error if last is not None else '',
            images={k: (c.passthrough, c.decoded) for k, c in self.converters.items()}, lifecycle=lifecycle,
            control_level=control_level, control_reasons=control_reasons, episode_level=episode_level,
            episode_reasons=episode_reasons, window=window,
            scheduling=tick.scheduling if tick is not None else f'no control thread (lifecycle state {lifecycle})',
            observing=observing)

    def _diagnostic_name(self) -> str:
        return self.get_fully_qualified_name().lstrip('/')

    def _publish_status(self) -> None:
        self._status_pub.publish(diagnostics.status_message(self.report(), self.get_clock().now().to_msg()))

    def _publish_diagnostics(self) -> None:
        self._diag_pub.publish(diagnostics.diagnostic_array(self.report(), self._diagnostic_name(),
                                                            self.get_clock().now().to_msg()))
