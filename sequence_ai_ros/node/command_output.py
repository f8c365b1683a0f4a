"""Where the policy node's commands go: one output per ``command.mode``, behind one small interface.

As ros2_controllers has one controller per kind of command, the node has one output per mode, picked once
from the parameters (:func:`command_output`); the node never asks for the mode again:

- :class:`StreamingOutput` (``streaming``): one message per control tick, the command interface's own
  (Float64MultiArray to a forward_command_controller, a one-point JointTrajectory, a JointState, a pose or a
  twist), and the gripper channels to ``command.gripper_topic``;
- :class:`TrajectoryOutput` (``trajectory``): each new chunk's remaining horizon as one multi-point
  JointTrajectory to joint_trajectory_controller, one hold when an episode stops (:mod:`.trajectory`).

Both publish through the lifecycle publishers of :class:`ControllerLink` (made at configure, gone at cleanup):
to the controller, or to ``~/would_command`` in a dry run (``enabled`` false, :class:`DryRunSwitch`). Every
method runs on the control thread, but for :meth:`CommandOutput.last_hold` and :meth:`CommandOutput.forget`
(a lifecycle transition, once the control thread has stopped).
"""

from __future__ import annotations

import abc
from typing import Any

import numpy as np
from rclpy.clock import Clock
from rclpy.lifecycle import LifecycleNode
from std_msgs.msg import Float64MultiArray

from sequence_ai_ros.node import trajectory
from sequence_ai_ros.node.controller_commands import CommandInterface
from sequence_ai_ros.node.runner import Runner
from sequence_ai_ros.node.safety import SafetyFilter


class DryRunSwitch:
    """The ``enabled`` parameter, and what turning it off or on leaves the control thread to do.

    Set from the parameter callback, read by the control thread (plain attribute swaps, as before: one
    reading per tick).

    :param enabled: the parameter's value at start-up.
    """

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        #: enabled turned off on a rate interface or in trajectory mode: stop the controller once (see take_stop)
        self.stop_pending = False
        #: enabled turned on: a step-limit reference for the first enabled tick to take (the 1-tuple of it)
        self.rebase: tuple[np.ndarray | None] | None = None

    def set(self, enabled: bool, output: CommandOutput) -> None:
        """Take a new ``enabled`` value (the parameter callback)."""
        if not enabled and self.enabled and output.stops_on_dry_run:
            self.stop_pending = True     # the control thread stops the controller (see PolicyNode._on_tick)
        if enabled and not self.enabled:
            # The dry run moved the step limit's reference along commands the controller never got: the first
            # enabled tick steps from what the controller last received (or the measured state), so
            # safety.max_step bounds the step the controller sees.
            self.rebase = (output.reference(),)
        self.enabled = enabled

    def take_stop(self) -> bool:
        """True once after a dry run began that must stop the controller (then False until the next one)."""
        pending, self.stop_pending = self.stop_pending, False
        return pending

    def take_rebase(self) -> tuple[np.ndarray | None] | None:
        """The reference left by the last enable, once (None when there is none to take)."""
        rebase, self.rebase = self.rebase, None
        return rebase


class ControllerLink:
    """The lifecycle publishers of the commands: to the controller, to ``~/would_command``, to the gripper.

    :param commands: the command interface (message type and topic).
    :param switch: ``enabled``: a send without an explicit ``enabled`` reads it.
    """

    def __init__(self, commands: CommandInterface, switch: DryRunSwitch) -> None:
        self.commands = commands
        self.switch = switch
        self._cmd: Any = None
        self._dry: Any = None
        self._gripper: Any = None

    def open(self, node: LifecycleNode) -> None:
        """Create the lifecycle publishers on ``node`` (configure)."""
        gripper_topic = self.commands.gripper_topic
        self._cmd = node.create_lifecycle_publisher(self.commands.msg_type, self.commands.topic, 10)
        self._dry = node.create_lifecycle_publisher(self.commands.msg_type, '~/would_command', 10)
        self._gripper = (node.create_lifecycle_publisher(Float64MultiArray, gripper_topic, 10)
                         if gripper_topic else None)

    def close(self, node: LifecycleNode) -> None:
        """Destroy the publishers (cleanup, shutdown); nothing is sent until the next :meth:`open`."""
        for pub in (self._cmd, self._dry, self._gripper):
            if pub is not None:
                node.destroy_lifecycle_publisher(pub)
        self._cmd = self._dry = self._gripper = None

    def send(self, msg: Any, gripper: Any = None, enabled: bool | None = None) -> bool:
        """Publish to the controller, or to ``~/would_command`` in a dry run; True when the controller got it.

        :param enabled: the tick's reading of ``enabled``; None reads it now.
        """
        if self._cmd is None:
            return False
        if not (self.switch.enabled if enabled is None else enabled):
            self._dry.publish(msg)
            return False
        self._cmd.publish(msg)
        if gripper is not None and self._gripper is not None:
            self._gripper.publish(gripper)
        return True


class CommandOutput(abc.ABC):
    """The node's commands to one kind of controller (see the module's docstring).

    :param commands: the command interface.
    :param link: the publishers.
    :param clock: the node's ROS clock (messages are stamped with it; sim time under ``use_sim_time``).
    """

    def __init__(self, commands: CommandInterface, link: ControllerLink, clock: Clock) -> None:
        self.commands = commands
        self.link = link
        self.clock = clock

    @property
    @abc.abstractmethod
    def stops_on_dry_run(self) -> bool:
        """True when the controller must be sent one stop as a dry run begins (it would go on moving)."""

    @abc.abstractmethod
    def tick(self, runner: Runner, values: np.ndarray | None, enabled: bool) -> None:
        """Publish what this control tick commands.

        :param values: float64 (D,) the runner's command for the tick (command order), or None for nothing.
        :param enabled: the tick's reading of ``enabled``.
        """

    @abc.abstractmethod
    def stop_controller(self, runner: Runner) -> None:
        """Send the controller (whatever ``enabled`` says) one stop: a zero-rate command, or a hold."""

    @abc.abstractmethod
    def last_hold(self, runner: Runner, on_underrun: str) -> None:
        """The hold published as the node stops commanding (deactivate, shutdown, error)."""

    @abc.abstractmethod
    def reference(self) -> np.ndarray | None:
        """What the controller last received (command order), the step limit's reference after a dry run."""

    @abc.abstractmethod
    def resume(self) -> None:
        """The first enabled tick after a dry run (the control thread)."""

    @abc.abstractmethod
    def forget(self) -> None:
        """Forget what the controller was sent (inactive, the arm may be moved by anything else)."""


class StreamingOutput(CommandOutput):
    """``streaming``: one command per control tick; a hold never zeros a position (see :mod:`.runner`)."""

    def __init__(self, commands: CommandInterface, link: ControllerLink, clock: Clock) -> None:
        super().__init__(commands, link, clock)
        self._last: np.ndarray | None = None     # the last values the controller received

    @property
    def stops_on_dry_run(self) -> bool:
        """A rate controller (velocity, twist) keeps applying its last command through a dry run."""
        return not self.commands.is_position

    def tick(self, runner: Runner, values: np.ndarray | None, enabled: bool) -> None:
        """Publish the tick's command (None: nothing)."""
        if values is not None:
            self.publish(runner, values, enabled)

    def publish(self, runner: Runner, values: np.ndarray, enabled: bool | None = None) -> None:
        """Publish ``values`` (command order); a non-finite value is never published: the run ends 'validate'."""
        if not np.all(np.isfinite(values)):
            # The last gate (the safety filter already refuses non-finite commands): never publish NaN/inf;
            # the run ends with 'validate' and the controller keeps its last finite command.
            runner.request_end('validate', 'a non-finite command reached the publisher; not published')
            return
        msg, gripper = self.commands.build(values, self.clock.now().to_msg())
        if self.link.send(msg, gripper, enabled):
            self._last = np.array(values, dtype=np.float64)

    def stop_controller(self, runner: Runner) -> None:
        """A zero-rate command to a rate controller that received one (a position controller holds by itself)."""
        if self._last is not None and not self.commands.is_position:
            self.publish(runner, self.commands.hold_values(self._last), True)

    def last_hold(self, runner: Runner, on_underrun: str) -> None:
        """A position hold (on_underrun 'hold'), or a zero rate (also for 'stop': the controller keeps its last)."""
        last = runner.last_command
        if last is not None and (on_underrun == 'hold' or not self.commands.is_position):
            self.publish(runner, self.commands.hold_values(last))

    def reference(self) -> np.ndarray | None:
        """The last values the controller received (None before any)."""
        return self._last

    def resume(self) -> None:
        """Nothing to do: the next tick's command goes to the controller."""

    def forget(self) -> None:
        """Forget the controller's last values."""
        self._last = None


class TrajectoryOutput(CommandOutput):
    """``trajectory``: each new chunk's remaining horizon once; one hold when an episode stops.

    :param safety: the safety filter (every point is checked, :func:`.trajectory.plan_points`).
    :param period_s: the control period (s).
    """

    def __init__(self, commands: CommandInterface, link: ControllerLink, clock: Clock, safety: SafetyFilter,
                 period_s: float) -> None:
        super().__init__(commands, link, clock)
        self.safety = safety
        self.period_s = period_s
        self._chunk = -1          # the chunk last published (-1: none playing)
        self._held = True         # the stop of the episode has been held
        self._ref: np.ndarray | None = None    # the hold the controller was last sent

    @property
    def stops_on_dry_run(self) -> bool:
        """joint_trajectory_controller plays its last trajectory out: always one hold."""
        return True

    def hold(self, values: np.ndarray, enabled: bool | None = None) -> None:
        """Publish a single-point trajectory holding ``values`` (command order)."""
        msg = trajectory.hold_message(values, self.commands.joint_names, self.clock.now().nanoseconds, self.period_s)
        if self.link.send(msg, None, enabled):
            self._ref = np.array(values, dtype=np.float64)

    def tick(self, runner: Runner, values: np.ndarray | None, enabled: bool) -> None:
        """Publish each new chunk's remaining horizon once; one hold when an episode stops.

        An invalid observation mid-episode (a stale or missing source) replaces the playing trajectory with
        one hold at once, as streaming mode holds: the controller would otherwise play the old trajectory to
        its end. When the observation is valid again the playing chunk's remaining horizon is published anew.
        Sends read ``enabled`` as they go (not the tick's reading).
        """
        action = runner.last_action
        if action is not None:
            horizon = runner.horizon()
            if horizon is not None and horizon[0] != self._chunk:
                number, pos, dt, rows = horizon
                last = runner.last_command
                if self._chunk == -1 and not action.delta:
                    # nothing playing (an episode's start, after a hold): the step limit starts from where the
                    # controller is, the hold it was sent or the measured state, not from this tick's value
                    # (an episode's first chunk: the measured state, the robot may have been reset since)
                    measured = runner.measured_state()
                    ep = runner.episode
                    first = ep is not None and ep.first_command
                    if first and measured is not None:
                        last = measured
                    else:
                        last = self._ref if self._ref is not None else (
                            measured if measured is not None else last)
                plan = trajectory.plan_points(
                    rows, pos, dt, order=self.commands.action_order, delta=action.delta is not None,
                    last=last, safety=self.safety, period_s=self.period_s)
                self._chunk, self._held = number, False
                if plan.stop:
                    runner.request_end('validate', f'safety: {plan.stop}')
                elif len(plan.ahead_s):
                    if self.link.send(trajectory.trajectory_message(plan, self.commands.joint_names,
                                                                    self.clock.now().nanoseconds)):
                        self._ref = None
            return
        ep = runner.episode
        stopped = ep is None or ep.stopped or ep.done.is_set()
        invalid = ep is not None and not stopped and ep.stale_since is not None
        if values is None and runner.last_command is not None:
            # on_underrun 'stop' publishes no per-tick hold, but a stop must still replace the trajectory
            values = self.commands.hold_values(runner.last_command)
        if (stopped or invalid) and not self._held and values is not None:
            self._held = True
            self.hold(values)
        if stopped or invalid:
            self._chunk = -1

    def stop_controller(self, runner: Runner) -> None:
        """A hold of the last command, to the controller itself."""
        last = runner.last_command
        if last is not None:
            self.hold(self.commands.hold_values(last), enabled=True)

    def last_hold(self, runner: Runner, on_underrun: str) -> None:
        """Always a hold (publishing nothing lets joint_trajectory_controller play its trajectory out)."""
        last = runner.last_command
        if last is not None:
            self.hold(self.commands.hold_values(last))

    def reference(self) -> np.ndarray | None:
        """None: the first enabled tick steps from the measured state or the hold (see :meth:`tick`)."""
        return None

    def resume(self) -> None:
        """The playing chunk went to ``~/would_command``: publish it to the controller now."""
        self._chunk = -1

    def forget(self) -> None:
        """Forget the hold the controller was sent."""
        self._ref = None


def command_output(mode: str, commands: CommandInterface, link: ControllerLink, clock: Clock,
                   safety: SafetyFilter, period_s: float) -> CommandOutput:
    """The output of ``command.mode`` (``streaming`` or ``trajectory``)."""
    if mode == 'trajectory':
        return TrajectoryOutput(commands, link, clock, safety, period_s)
    return StreamingOutput(commands, link, clock)
