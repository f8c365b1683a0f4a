"""``PolicyNode``: subscriptions, publishers and the threads of the policy node, wired together.

The node itself only adapts ROS to the parts that do the work: :mod:`.observation` (inputs),
:mod:`.images` (camera conversion), :mod:`.runner` (episodes over the client engine),
:mod:`.commands` (the controller's messages), :mod:`.safety` and :mod:`.diagnostics`.
Services and the Act action live in :mod:`.interface`, on a companion node with its own executor.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from rcl_interfaces.msg import SetParametersResult
from rclpy.clock import Clock, ClockType
from rclpy.node import Node
from rclpy.qos import QoSProfile, ReliabilityPolicy, qos_profile_sensor_data
from sensor_msgs.msg import CompressedImage, Image, JointState
from sequence_ai_msgs.msg import RunStatus
from std_msgs.msg import Float64MultiArray

from sequence_ai_ros.node import diagnostics
from sequence_ai_ros.node.controller_commands import CommandInterface
from sequence_ai_ros.node.images import ImageConverter
from sequence_ai_ros.node.observation import ObservationAssembler
from sequence_ai_ros.node.parameters import declare_and_read, on_set_check
from sequence_ai_ros.node.runner import Runner
from sequence_ai_ros.node.safety import SafetyFilter
from sequence_ai_ros.node.tick import TickThread
from sequence_ai_ros.protocol.contract import Contract


def _stamp_s(msg: Any) -> float:
    stamp = getattr(getattr(msg, 'header', None), 'stamp', None)
    if stamp is None or (stamp.sec == 0 and stamp.nanosec == 0):
        return math.nan
    return stamp.sec + stamp.nanosec * 1e-9


class PolicyNode(Node):
    """The policy node: topics in, fixed-rate commands out, status and diagnostics.

    Threads: the executor that spins this node (subscriptions, status and diagnostics timers), the
    control thread ``seq-tick`` (:class:`.tick.TickThread`) and the session thread ``seq-session``
    (blocking gRPC: connect, readiness, episode ends). :meth:`start` starts both threads and
    :meth:`stop` stops them (timed joins) after publishing a last hold.

    :param connect: passed to :class:`.runner.Runner` (default: :func:`sequence_ai_ros.client.connect`).
    :param kwargs: passed to :class:`rclpy.node.Node` (``context``, ``cli_args``, ``parameter_overrides``...).
    :raises ConfigError: when a parameter is invalid, or ``joints.names`` is empty.
    """

    def __init__(self, node_name: str = 'policy_node', *, connect: Callable[..., Any] | None = None,
                 **kwargs: Any) -> None:
        super().__init__(node_name, **kwargs)
        cfg = self.cfg = declare_and_read(self)
        cfg.check_runnable()
        self.enabled = cfg.enabled
        self.commands = CommandInterface(cfg.command, cfg.command_joint_names, cfg.period_s)
        self.safety = SafetyFilter(cfg.safety, cfg.command_joint_names, self.commands.is_position)
        self.assembler = ObservationAssembler(
            cfg.joints.names, cfg.joints.max_age_s, {c.key: c.max_age_s for c in cfg.cameras},
            joints_source=cfg.joints.topic, camera_sources={c.key: c.topic for c in cfg.cameras},
            clock=lambda: self.get_clock().now().nanoseconds * 1e-9, stamp_source=cfg.stamp_source)
        self.converters = {c.key: ImageConverter() for c in cfg.cameras}
        self.runner = Runner(cfg, self.commands, self.safety, self.assembler, connect=connect,
                             on_contract=self._on_contract, log=self._log)
        if cfg.qos.reliability == 'best_effort':
            qos = QoSProfile(depth=cfg.qos.depth, reliability=ReliabilityPolicy.BEST_EFFORT,
                             durability=qos_profile_sensor_data.durability, history=qos_profile_sensor_data.history)
        else:
            qos = QoSProfile(depth=cfg.qos.depth, reliability=ReliabilityPolicy.RELIABLE)
        self.create_subscription(JointState, cfg.joints.topic, self._on_joints, qos)
        for cam in cfg.cameras:
            if cam.type == 'compressed':
                self.create_subscription(CompressedImage, cam.topic, self._image_callback(cam.key, True), qos)
            else:
                self.create_subscription(Image, cam.topic, self._image_callback(cam.key, False), qos)
        self.command_topic = self.commands.topic
        self._cmd_pub = self.create_publisher(self.commands.msg_type, self.commands.topic, 10)
        self._dry_pub = self.create_publisher(self.commands.msg_type, '~/would_command', 10)
        self._gripper_pub = (self.create_publisher(Float64MultiArray, cfg.command.gripper_topic, 10)
                             if cfg.command.gripper_topic else None)
        self._status_pub = self.create_publisher(RunStatus, '~/status', 10)
        self._diag_pub = self.create_publisher(diagnostics.DiagnosticArray, '/diagnostics', 10)
        # Reporting runs on the steady clock: with use_sim_time it goes on while /clock stalls (a paused
        # bag); the messages are still stamped with the node's clock.
        steady = Clock(clock_type=ClockType.STEADY_TIME)
        self.create_timer(1.0 / cfg.status_rate_hz, self._publish_status, clock=steady)
        self.create_timer(1.0 / cfg.diagnostics_rate_hz, self._publish_diagnostics, clock=steady)
        self.add_on_set_parameters_callback(self._on_set_parameters)
        self._tick = TickThread(cfg.period_s, self._on_tick, on_error=self._on_tick_error, name='seq-tick')
        self._session_stop = threading.Event()
        self._session = threading.Thread(target=self._session_loop, name='seq-session', daemon=True)
        self._last_tick_error = 0.0

    # -- lifecycle -----------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the control and session threads."""
        self._session.start()
        self._tick.start()
        self.get_logger().info(
            f'policy_node: {self.cfg.model or "(no model)"} at {self.cfg.endpoint}, '
            f'{self.cfg.control_rate_hz:g} Hz {self.cfg.command.interface} on {self.command_topic}'
            f'{"" if self.enabled else " (dry run: enabled=false)"}')

    def stop(self) -> None:
        """Stop the control thread, publish a last hold, end any episode and stop the session thread."""
        self._tick.stop()
        last = self.runner.last_command
        if last is not None and self.runner.on_underrun == 'hold':
            self._publish(self.commands.hold_values(last))
        self._session_stop.set()
        if self._session.is_alive():
            self._session.join(5.0)
        self.runner.close()

    # -- inputs (executor thread) -------------------------------------------------------------------
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
        for p in params:
            if p.name == 'enabled':
                self.enabled = bool(p.value)
            elif p.name == 'on_underrun':
                self.runner.on_underrun = p.value
        return SetParametersResult(successful=True)

    # -- control thread ----------------------------------------------------------------------------
    def _on_tick(self, now: float) -> None:
        values = self.runner.tick(now)
        if values is not None:
            self._publish(values)

    def _publish(self, values: Any) -> None:
        if not np.all(np.isfinite(values)):
            # The last gate (the safety filter already refuses non-finite commands): never publish NaN/inf;
            # the run ends with 'validate' and the controller keeps its last finite command.
            self.runner.request_end('validate', 'a non-finite command reached the publisher; not published')
            return
        msg, gripper = self.commands.build(values, self.get_clock().now().to_msg())
        if not self.enabled:
            self._dry_pub.publish(msg)
            return
        self._cmd_pub.publish(msg)
        if gripper is not None and self._gripper_pub is not None:
            self._gripper_pub.publish(gripper)

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

    # -- reporting (executor thread) ------------------------------------------------------------------
    def _log(self, level: str, message: str) -> None:
        # One call site per severity: rclpy refuses a call site whose severity changes between calls.
        logger = self.get_logger()
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
        return diagnostics.Report(
            state=diagnostics.state_of(r), episode_id=ep.id if ep is not None else '', deployment=self.cfg.model,
            endpoint=self.cfg.endpoint, action_space=r.contract.action_space.value if r.contract else '',
            connection=r.connection, connection_error=r.connection_error, ready=r.ready, enabled=self.enabled,
            stats=stats, clamps=self.safety.clamps, clamp_counts=self.safety.counts(),
            jitter_ms=self._tick.jitter_ms(), rate_hz=self.cfg.control_rate_hz, skipped_ticks=self._tick.skipped,
            sent=ep.sent if ep is not None else 0, problems=list(snap.problems) if snap else [],
            ages=dict(snap.ages) if snap else {}, message=message, dropped_telemetry=r.dropped_telemetry(),
            images={k: (c.passthrough, c.decoded) for k, c in self.converters.items()})

    def _publish_status(self) -> None:
        self._status_pub.publish(diagnostics.status_message(self.report(), self.get_clock().now().to_msg()))

    def _publish_diagnostics(self) -> None:
        self._diag_pub.publish(diagnostics.diagnostic_array(self.report(), self.get_name(),
                                                            self.get_clock().now().to_msg()))
