"""``PolicyNode``: a managed (lifecycle) node with subscriptions, publishers, services and threads wired together.

The node itself only adapts ROS to the parts that do the work: :mod:`.observation` (inputs),
:mod:`.images` (camera conversion), :mod:`.runner` (episodes over the client engine),
:mod:`.controller_commands` (the controller's messages), :mod:`.command_output` (where they go),
:mod:`.trajectory` (trajectory mode),
:mod:`.safety` and :mod:`.diagnostics`. Services and the Act action (:mod:`.episode_services`) live on
this node, so ``ros2 node info`` lists them.

The commands go out through one output per ``command.mode`` (:mod:`.command_output`: streaming or
trajectory), picked once from the parameters; the node never asks for the mode again.

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
import time
from collections.abc import Callable
from typing import Any

from rcl_interfaces.msg import SetParametersResult
from rclpy.callback_groups import MutuallyExclusiveCallbackGroup, ReentrantCallbackGroup
from rclpy.clock import Clock, ClockType
from rclpy.lifecycle import LifecycleNode, LifecycleNodeMixin, LifecycleState, TransitionCallbackReturn
from rclpy.node import Node
from rclpy.qos import QoSProfile, ReliabilityPolicy, qos_profile_sensor_data
from sensor_msgs.msg import CompressedImage, Image, JointState
from sequence_ai_msgs.msg import RunStatus

from sequence_ai_ros.exceptions import ConfigError, SequenceAIError
from sequence_ai_ros.node import diagnostics
from sequence_ai_ros.node.command_output import ControllerLink, DryRunSwitch, command_output
from sequence_ai_ros.node.controller_commands import CommandInterface
from sequence_ai_ros.node.episode_services import EpisodeServices
from sequence_ai_ros.node.images import ImageConverter
from sequence_ai_ros.node.observation import ObservationAssembler
from sequence_ai_ros.node.parameters import declare_and_read, on_set_check
from sequence_ai_ros.node.runner import Runner, SessionThread
from sequence_ai_ros.node.safety import SafetyFilter
from sequence_ai_ros.node.tick import ControlThreads
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


class ConfigureAttempts:
    """Configure's failures as the log tells them: each cause once, and a reminder while it lasts.

    autostart retries a failing configure every second; the log says each cause once, then every
    :data:`CONFIGURE_REMINDER_S` that the node still waits, and the runner's 'connected to ...' once.

    :param log: the node's logger.
    """

    def __init__(self, log: Any) -> None:
        self._logger = log
        #: the last failure's cause ('' once configured), for ~/status and /diagnostics
        self.error = ''
        self.failing_since: float | None = None   # time.monotonic() of the first failed attempt
        self._reported = 0.0                      # when the last 'still failing' line was logged
        self._last_info = ''                      # the runner's last info line (see repeated)

    def failed(self, error: str) -> None:
        """Log a failed attempt's ``error`` (a new cause at once, the same one as a reminder) and keep it."""
        now = time.monotonic()
        if self.failing_since is None:
            self.failing_since = now
        if error != self.error:      # autostart retries every second: say each cause once,
            self._logger.error(f'configure failed: {error}')
            self._reported = now
        elif now - self._reported >= CONFIGURE_REMINDER_S:   # and remind while it lasts
            self._logger.warning(f'still not configured after {now - self.failing_since:.0f} s: {error}')
            self._reported = now
        self.error = error

    def succeeded(self) -> None:
        """The node is configured: no error, and the next failure is a first attempt's again."""
        self.error = ''
        self.failing_since = None

    def repeated(self, info: str) -> bool:
        """True for an info line said already while configure keeps failing (it is logged once)."""
        if self.error and info == self._last_info:
            return True
        self._last_info = info
        return False


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
        self.switch = DryRunSwitch(cfg.enabled)
        self.on_underrun = cfg.on_underrun
        self.commands = CommandInterface(cfg.command, cfg.command_joint_names, cfg.period_s)
        self.safety = SafetyFilter(cfg.safety, cfg.command_joint_names, self.commands.is_position)
        # the output of command.mode, picked once: nothing below asks for the mode again
        self.output = command_output(cfg.command.mode, self.commands, ControllerLink(self.commands, self.switch),
                                     self.get_clock(), self.safety, cfg.period_s)
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
        self.episode_services = EpisodeServices(self, self, self.services_group)
        self._subscriptions_made: list[Any] = []
        self.control = ControlThreads(cfg.period_s, cfg.thread_priority)
        self._last_tick_error = 0.0
        self.session = SessionThread(lambda now: self.runner.session_step(now), self._on_session_error)
        self.attempts = ConfigureAttempts(self.get_logger())

    @property
    def enabled(self) -> bool:
        """The ``enabled`` parameter: False is a dry run (commands go to ``~/would_command``)."""
        return self.switch.enabled

    @property
    def configure_error(self) -> str:
        """Why the last configure failed ('' once configured), for ~/status and /diagnostics."""
        return self.attempts.error

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
        self.attempts.failed(error)
        return FAILURE

    def _configure(self) -> TransitionCallbackReturn:
        cfg = self.cfg
        if self.attempts.failing_since is None:   # the first attempt: say what the node waits for
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
                self.runner.link.refused(error)
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
        self.output.link.open(self)
        self.session.start()
        self.attempts.succeeded()
        self.get_logger().info(
            f'configured: {cfg.model} at {cfg.endpoint}, {cfg.control_rate_hz:g} Hz {cfg.command.interface} '
            f'({cfg.command.mode}) on {self.command_topic}')
        return SUCCESS

    def on_activate(self, state: LifecycleState) -> TransitionCallbackReturn:
        """Enable the lifecycle publishers, start the control thread, accept goals."""
        ret = super().on_activate(state)
        if ret != SUCCESS:
            return ret
        tick = self.control.start(self._on_tick, self._on_tick_error)
        scheduling = tick.scheduling
        self.runner.grid = tick     # episodes count their periods on this thread's grid
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
        if self.control.current is not None:
            self._hold_and_stop_ticking('shutdown')
        self._release()
        return SUCCESS

    def on_error(self, state: LifecycleState) -> TransitionCallbackReturn:
        """Back to unconfigured, holding."""
        if self.control.current is not None:
            self._hold_and_stop_ticking('error')
        self._release()
        return SUCCESS

    def _hold_and_stop_ticking(self, transition: str) -> None:
        self.runner.accepting = False
        self.runner.interrupt(f'lifecycle {transition}: the node stopped commanding')
        self.control.stop()
        # a position hold, a zero rate (also for 'stop': a rate controller keeps its last command), and in
        # trajectory mode always (publishing nothing lets joint_trajectory_controller play its trajectory out);
        # to the controller itself when a dry run began so recently that its stop was not sent yet
        if self.switch.take_stop():
            self.output.stop_controller(self.runner)
        else:
            self.output.last_hold(self.runner, self.runner.on_underrun)
        # Inactive, the arm may be moved by anything else (teleop, another controller): the old command is
        # neither republished on activate nor the step limit's reference; the measured state is.
        self.runner.last_command = None
        self.output.forget()

    def _release(self) -> None:
        self.runner.accepting = False
        self.session.stop()
        self._replace_runner()
        for sub in self._subscriptions_made:
            self.destroy_subscription(sub)
        self._subscriptions_made = []
        self.output.link.close(self)

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
                self.switch.set(bool(p.value), self.output)   # what the control thread then does: see _on_tick
            elif p.name == 'on_underrun':
                self.on_underrun = self.runner.on_underrun = p.value   # kept for the runner of a later configure
        return SetParametersResult(successful=True)

    # -- control thread ----------------------------------------------------------------------------
    def _on_tick(self, now: float) -> None:
        switch = self.switch
        enabled = switch.enabled    # one reading per tick: the reference and the destination agree
        if not enabled and switch.take_stop():
            # A rate controller keeps applying its last command through a dry run, joint_trajectory_controller
            # plays its last trajectory out: one stop (zero rate, or a hold) to the controller first, from
            # this thread, so no command of an earlier tick can follow it.
            self.output.stop_controller(self.runner)
        if enabled:
            rebase = switch.take_rebase()
            if rebase is not None:
                (self.runner.last_command,) = rebase
                self.output.resume()    # trajectory mode: the playing chunk went to ~/would_command: send it now
        values = self.runner.tick(now, dry=not enabled)   # a dry run's commands go to ~/would_command
        self.output.tick(self.runner, values, enabled)

    def _on_tick_error(self, exc: BaseException) -> None:
        now = time.monotonic()
        if now - self._last_tick_error > 1.0:   # at most one log line per second
            self._last_tick_error = now
            self.get_logger().error(f'control tick failed: {type(exc).__name__}: {exc}')
        self.runner.request_end('error', f'control tick failed: {exc}')

    # -- session thread ------------------------------------------------------------------------------
    def _on_session_error(self, exc: Exception) -> None:
        self.get_logger().error(f'session: {type(exc).__name__}: {exc}')

    # -- reporting (executor) -------------------------------------------------------------------------
    def _log(self, level: str, message: str) -> None:
        # One call site per severity: rclpy refuses a call site whose severity changes between calls.
        logger = self.get_logger()
        if level == 'info' and self.attempts.repeated(message):
            # autostart retries a failing configure every second: its 'connected to ...' once, not each time
            return
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
        counts = r.counts()     # the client's (its ledger owns them), live or the ended episode's
        last = r.last_result
        message = ''
        if last is not None and (ep is None or ep.done.is_set()):
            message = f'last episode {last.episode_id}: {last.reason} {last.message}'.strip()
        tick, skipped = self.control.skipped()   # never falls: a stopping thread counts until its skips are added
        jitter = tick.jitter_ms(last=int(self.health.cfg.window_s * self.cfg.control_rate_hz)) \
            if tick is not None else (0.0, 0.0, 0.0)
        dropped = r.dropped_telemetry()
        window = self.health.update(time.monotonic(), {
            'ticks_skipped': skipped, 'episode_ticks': r.totals.episode_ticks,
            'underrun_ticks': r.totals.underrun_ticks,
            'commands_checked': self.safety.checked, 'commands_clamped': self.safety.clamped_commands,
            'dropped_telemetry': dropped, 'telemetry_rejected': r.totals.telemetry_rejected,
            'episodes_failed': r.totals.episodes_failed})
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
            sent=counts.commands_sent, held=counts.ticks_held, episode_skipped=counts.ticks_skipped,
            episode_elapsed_s=counts.elapsed_s,
            problems=list(snap.problems) if snap else [],
            ages=dict(snap.ages) if snap else {}, message=message, dropped_telemetry=dropped,
            telemetry_rejected=r.totals.telemetry_rejected,
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
