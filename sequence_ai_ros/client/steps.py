"""One control tick, one record: the :class:`Step` the engine creates and the robot's loop completes once.

Each tick of an episode produces one Step, in one direction:

1. the engine (:meth:`EpisodeEngine.tick`) creates it with the tick's place on the timeline (the control
   deadline it serves and the chunk steps it covers, :mod:`sequence_ai_ros.protocol.timeline`), the
   policy's action and what the engine would command (the hold's reason when it holds);
2. the robot's loop completes it once, after deciding the command: the node after its safety filter
   (``Policy.report_command``), act()/run() after the caller's ``act()`` returned, a plain next_action
   loop by calling next_action again (the command is then the action as returned);
3. :class:`StepLedger` commits it: it turns the command into what the robot executed in the policy's
   action space (a joint_delta target into the increment from the previous target), counts it, feeds
   the committed target back to the engine (joint_delta integrates onto what the robot commanded), and
   hands it to capture, which streams it as one telemetry record.

Nothing is amended after the commit, and no time stamp is rewritten: the export reads rows off the spans.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable

import numpy as np

from sequence_ai_ros.protocol.spaces import ActionSpace
from sequence_ai_ros.protocol.timeline import HOLD_REASONS
from sequence_ai_ros.protocol.types import Observation

LOG = logging.getLogger(__name__)
#: Steps kept while the worker has not yet said whether the episode is captured (its first reply).
MAX_EARLY_STEPS = 1000


@dataclasses.dataclass
class Step:
    """One control tick's record.

    :param grid_index: the control deadline the tick serves, counted from the episode's first (0).
    :param step_start: the first chunk step it covers, on the episode's chunk-step axis (0 at the first
        deadline; the control grid in units of the policy's dt).
    :param step_end: the end of that span (``step_start`` + the control period / dt).
    :param observation: what the tick saw (its state, its camera frames, its robot time).
    :param policy_action: float32 (A,) the policy's action for the tick in the contract's space (joint_delta
        and ee_delta: the increment), or None when the tick held.
    :param command: float32 (A,) what the robot commands, in the contract's order (joint_delta: the absolute
        target), or None when it commands nothing.
    :param hold_reason: '' when the tick executes a fresh policy action, else one of
        :data:`~sequence_ai_ros.protocol.timeline.HOLD_REASONS`.
    :param clamped: True when the robot's safety filter changed the policy's action.
    :param pieces: float32 (P, A), P >= 2, for a tick of a delta or velocity space that spans a chunk-step
        boundary: the policy's action over each part of the span that lies in one chunk step (an increment, or
        a mean velocity), so the export splits the tick exactly at the boundary; None otherwise.
    :param piece_share: float (P,) each part's share of the span (summing to 1), with ``pieces``.
    :param executed: float32 (A,) what the robot executed in the policy's action space, set at the commit
        (joint_delta: this target minus the previous one; a hold: zeros in delta spaces), or None.
    """

    grid_index: int
    step_start: float
    step_end: float
    observation: Observation
    policy_action: np.ndarray | None
    command: np.ndarray | None
    hold_reason: str = ''
    clamped: bool = False
    executed: np.ndarray | None = None
    completed: bool = False
    pieces: np.ndarray | None = None
    piece_share: np.ndarray | None = None
    proposed: np.ndarray | None = None      # the engine's command, before the robot completed the step

    def __post_init__(self) -> None:
        if self.proposed is None and self.command is not None:
            self.proposed = self.command

    @property
    def held(self) -> bool:
        """True when the tick executed no fresh policy action."""
        return bool(self.hold_reason)

    def complete(self, command: np.ndarray | None, *, clamped: bool = False, hold_reason: str = '') -> None:
        """Record what the robot commanded at this tick (once; after its safety filter).

        :param command: float32 (A,) in the contract's order (joint_delta: the absolute target), or None when
            it commanded nothing (its own check refused, or a dry run).
        :param clamped: True when a safety filter changed the policy's action.
        :param hold_reason: why it held ('' keeps the engine's: fresh, or its hold); a None command without
            one is ``refused``.
        :raises ValueError: for a second completion or an unknown reason.
        """
        if self.completed:
            raise ValueError('this tick was already completed: report its command once')
        if hold_reason and hold_reason not in HOLD_REASONS:
            raise ValueError(f'unknown hold_reason {hold_reason!r}; expected one of {HOLD_REASONS}')
        self.command = None if command is None else np.array(command, np.float32)
        self.clamped = bool(clamped)
        if hold_reason:
            self.hold_reason = hold_reason
        elif command is None and not self.hold_reason:
            self.hold_reason = 'refused'
        self.completed = True


@dataclasses.dataclass(frozen=True)
class TickCounts:
    """An episode's control ticks as its :class:`StepLedger` counted them, read at one instant.

    Every control deadline of the episode from its first (the grid's origin, :meth:`StepLedger.start`) to
    ``grid_index`` is counted once: ``commands_sent + ticks_held + ticks_skipped`` = the deadlines in
    ``(origin, grid_index]`` (from the first tick when no origin was set).

    :param commands_sent: ticks that executed a fresh policy action.
    :param ticks_held: ticks that held instead, any reason (a dry run's included: it sent nothing to the robot).
    :param ticks_skipped: control deadlines no tick served (a callback overran the period, or a stall).
    :param grid_index: the last deadline the counts cover, on the caller's grid (the ``grid_index`` its
        ticks gave, else the engine's estimate); None before any tick and without an origin.
    """

    commands_sent: int = 0
    ticks_held: int = 0
    ticks_skipped: int = 0
    grid_index: int | None = None


class StepLedger:
    """Commits an episode's steps in order: executed values, counts, the engine's feedback, capture.

    The ledger is the one owner of the episode's tick counts (:class:`TickCounts`): a tick that asked for an
    action is counted when its step commits; a tick that held without asking (:meth:`hold`) and the deadlines
    no tick served (:meth:`skip_to`, :meth:`end`) are counted here too, on the caller's control grid.

    :param space: the contract's action space.
    :param on_target: called with each committed joint_delta target (float32 (A,)), which the engine
        integrates the next increment onto.
    :param episode_id: for the log line of the first overrun.
    """

    def __init__(self, space: ActionSpace, on_target: Callable[[np.ndarray], None] | None = None,
                 episode_id: str = '') -> None:
        self.space = space
        self.episode_id = episode_id
        self._lock = threading.RLock()     # the control thread ticks and reports; another may end the episode
        self._on_target = on_target
        self.sink: Callable[[Step], None] | None = None
        self._early: list[Step] | None = []        # committed before the capture decision (EpisodeStarted)
        self.pending: Step | None = None
        self._pending_grid = 0                     # the pending step's deadline on the caller's grid
        self.warn_overruns = True                  # the node counts its own skipped ticks and says so
        self._target: np.ndarray | None = None     # joint_delta: the robot's last commanded target
        self._last_grid: int | None = None         # the last deadline counted (served or skipped)
        self._ended = False                        # end(): the deadlines up to the episode's last are counted
        self.commands_sent = 0      # ticks that executed a fresh policy action
        self.ticks_held = 0         # ticks that held instead (any reason)
        self.ticks_skipped = 0      # control deadlines no tick served (a callback overran the period)

    def counts(self) -> TickCounts:
        """The tick counts so far, read together (any thread)."""
        with self._lock:
            return TickCounts(self.commands_sent, self.ticks_held, self.ticks_skipped, self._last_grid)

    def set_sink(self, sink: Callable[[Step], None] | None) -> None:
        """Decide capture (at EpisodeStarted): ``sink`` takes every committed step, those before it included."""
        with self._lock:
            early, self._early = self._early or [], None
            self.sink = sink
            if sink is not None:
                for step in early:
                    sink(step)

    def start(self, grid_index: int) -> None:
        """Make ``grid_index`` the grid's origin: the deadlines after it are the episode's, each a tick or a skip.

        For a caller that begins the episode before its first tick (the node): without it the counts start at
        the first tick. Ignored once a tick was counted.
        """
        with self._lock:
            if self._last_grid is None and not (self.commands_sent or self.ticks_held):
                self._last_grid = int(grid_index)

    def open(self, step: Step | None, grid_index: int | None = None) -> None:
        """Take the engine's new step; the previous one is committed first, as it stands.

        :param grid_index: the deadline the step serves on the caller's grid, which the counts use (None: the
            step's own ``grid_index``).
        """
        with self._lock:
            self.commit()
            self.pending = step
            if step is not None:
                self._pending_grid = step.grid_index if grid_index is None else int(grid_index)

    def drop(self) -> None:
        """Forget the pending step without committing it (a tick after the episode's end)."""
        with self._lock:
            self.pending = None

    def report(self, command: np.ndarray | None, *, clamped: bool = False, hold_reason: str = '') -> bool:
        """Complete the pending step with what the robot commanded and commit it; False when there is none.

        :raises ValueError: for an unknown hold_reason (see :meth:`Step.complete`).
        """
        with self._lock:
            step = self.pending
            if step is None or step.completed:
                return False
            step.complete(command, clamped=clamped, hold_reason=hold_reason)
            self.commit()
            return True

    def hold(self, grid_index: int | None, hold_reason: str) -> bool:
        """Count a tick that held without asking for an action (no step: capture shows its deadline as a gap).

        The pending step is committed first. A deadline already counted (served, or skipped by :meth:`end`)
        is not counted again: return False then.

        :param grid_index: the deadline the tick serves on the caller's grid, or None (counted, no skips).
        :param hold_reason: why, one of :data:`~sequence_ai_ros.protocol.timeline.HOLD_REASONS`.
        :raises ValueError: for an unknown hold_reason.
        """
        if hold_reason not in HOLD_REASONS:
            raise ValueError(f'unknown hold_reason {hold_reason!r}; expected one of {HOLD_REASONS}')
        with self._lock:
            self._commit()
            if grid_index is not None:
                if self._last_grid is not None and grid_index <= self._last_grid:
                    return False
                self._skip(grid_index)
                self._last_grid = grid_index
            self.ticks_held += 1
            return True

    def commit(self) -> Step | None:
        """Commit the pending step (its command as completed, or as the engine made it); return it."""
        with self._lock:
            return self._commit()

    def _commit(self) -> Step | None:
        step, self.pending = self.pending, None
        if step is None:
            return None
        step.completed = True
        step.executed = self._executed(step)
        grid = self._pending_grid
        # after end() a tick at a deadline already counted (it raced the end) is not counted twice
        if not (self._ended and self._last_grid is not None and grid <= self._last_grid):
            self._skip(grid)
            self._last_grid = grid
            if step.held:
                self.ticks_held += 1
            else:
                self.commands_sent += 1
        if self.sink is not None:
            self.sink(step)
        elif self._early is not None and len(self._early) < MAX_EARLY_STEPS:
            self._early.append(step)
        return step

    def skip_to(self, grid_index: int) -> None:
        """Count the deadlines after the last committed tick and before ``grid_index`` as skipped.

        For the end of an episode: ``grid_index`` is the deadline whose period the episode ended in, so the
        periods an overrun of the last tick passed over count, as those between two ticks do.
        """
        with self._lock:
            self._skip(grid_index)
            if self._last_grid is not None:
                self._last_grid = max(self._last_grid, grid_index - 1)

    def end(self, grid_index: int) -> None:
        """Count the deadlines after the last counted one up to ``grid_index`` (included) as skipped: the end.

        ``grid_index`` is the episode's last deadline on the caller's grid (the pending step is committed
        first). A tick after this at a deadline already counted is not counted again.
        """
        with self._lock:
            self._commit()
            self.skip_to(grid_index + 1)
            self._ended = True

    def _skip(self, grid_index: int) -> None:
        if self._last_grid is None:
            return
        missed = max(0, grid_index - self._last_grid - 1)
        if missed and not self.ticks_skipped and self.warn_overruns:
            LOG.warning('episode %s: the control loop overran its period (observe() and act(), or the loop '
                        'around next_action(), took longer): %d period(s) skipped, never bunched; '
                        'RunOutcome.ticks_skipped counts them (logged once per episode)', self.episode_id,
                        missed)
        self.ticks_skipped += missed

    def _target_before(self, step: Step) -> np.ndarray | None:
        """joint_delta: the target the robot had before ``step``, shape ``(action_dim,)``, float32.

        The last executed target; before any, the state the engine integrated the step's increment onto
        (``proposed - policy_action``); None when neither is known.
        """
        if self._target is not None or step.policy_action is None or step.proposed is None:
            return self._target
        start: np.ndarray = (step.proposed - step.policy_action).astype(np.float32)
        return start

    def _executed(self, step: Step) -> np.ndarray | None:
        command = step.command
        if self.space is ActionSpace.JOINT_DELTA and command is None and step.proposed is not None:
            # the robot refused this target (or sent it to a dry run): the next increment integrates onto the
            # target the robot really has, so refused increments are dropped, never caught up in one jump
            kept = self._target_before(step)
            if kept is not None and self._on_target is not None:
                self._on_target(kept)
        if self.space is not ActionSpace.JOINT_DELTA or command is None:
            return command        # a hold's command moves nothing in a rate space: its rates are zero
        # joint_delta: the robot commands absolute targets; it executed this one minus the previous one
        if step.held:
            # a dry run before any executed command: the robot still has the state the engine began from, so
            # its first executed command moves it from there (the dry increments it jumps over included)
            self._target = self._target_before(step)
            return np.zeros_like(command)     # a hold keeps the target the robot already had: it moves nothing
        before = self._target_before(step)
        self._target = command.copy()
        if before is None:
            return np.zeros_like(command)
        if self._on_target is not None and step.proposed is not None and not np.array_equal(command, step.proposed):
            self._on_target(self._target)     # the robot changed the target (a clamp): integrate onto its own
        if not step.clamped and step.policy_action is not None and step.hold_reason == '' \
                and np.array_equal(command, (before + step.policy_action).astype(np.float32)):
            return np.copy(step.policy_action)      # unchanged: the policy's own increment, bit for bit
        return np.asarray(command - before, dtype=np.float32)
