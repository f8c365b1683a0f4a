"""Episodes on the robot side, ROS-free: one at a time, ticked by the control thread.

The runner is the node's only user of the client engine (:mod:`sequence_ai_ros.client`), which holds
all chunk logic. Threads and what they may call:

- the control thread (:class:`.tick.TickThread`) calls :meth:`Runner.tick`, which calls only the
  client's non-blocking ``next_action``/``episode_outcome`` and takes the runner's lock only for
  attribute swaps (never across I/O);
- the session thread (:meth:`Runner.session_step`, ``seq-session``) does the blocking gRPC calls:
  connect, ``ready()``, and ``end_episode`` for episodes that must end;
- service and action callbacks call :meth:`start` (``begin_episode``), :meth:`interrupt`,
  :meth:`request_end`, :meth:`wait` and :meth:`label`.

Hold semantics: nothing is published before the first episode; from a goal's arrival to its episode's
first action the hold is the measured state, also after an earlier episode (what joint_trajectory_controller
does on activation: a robot reset between episodes is not dragged back to the last episode's command);
afterwards, and after the episode ends, it is the last command
(``on_underrun='hold'``) or nothing (``'stop'``). Velocity holds are zeros, never positions; on a rate
interface (velocity, twist) ``'stop'`` sends one zero-rate command first, since the controller keeps
applying its last one.
"""

from __future__ import annotations

import dataclasses
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from sequence_ai_ros.client.settings import EpisodeSettings
from sequence_ai_ros.exceptions import (
    ConfigError,
    ConnectionLost,
    ContractViolation,
    EpisodeStateError,
    NotReady,
    SequenceAIError,
)
from sequence_ai_ros.node.config import NodeConfig
from sequence_ai_ros.node.controller_commands import CommandInterface
from sequence_ai_ros.node.observation import ObservationAssembler, Snapshot
from sequence_ai_ros.node.safety import SafetyFilter
from sequence_ai_ros.node.worker_link import RunnerPolicy, WorkerLink, node_hint
from sequence_ai_ros.protocol.contract import Contract, check_names


class ControlGrid(Protocol):
    """The control thread's deadlines ``start + k * period``, by index k (node/tick.py's TickThread)."""

    def index_at(self, t: float) -> int:
        """The last deadline at or before ``t`` (monotonic s)."""

    def settled_index(self) -> int:
        """The last deadline decided: served, or skipped for good."""

    def current_index(self) -> int:
        """The deadline the running tick serves."""

    def deadline_s(self, k: int) -> float:
        """Deadline ``k``'s time (monotonic s)."""


@dataclasses.dataclass
class EpisodeRun:
    """One episode as the node tracks it: its span on the control thread's grid, and how it ends.

    Its tick counts are the client's (the episode's ``StepLedger``, one owner): the node tells the client
    where the episode starts and ends on its grid (``Policy.start_ticks``, ``Policy.end_ticks``) and every
    tick that held without asking for an action (``Policy.hold_tick``), and reads the counts back
    (``Policy.stats()`` live, the outcome at the end; :meth:`Runner.counts`), so every period of the episode
    is a tick counted in ``commands_sent`` or ``ticks_held``, or a skipped one.

    :param id: episode id.  :param instruction: the pinned task.  :param max_seconds: limit (s).
    :param started: ``time.monotonic()`` at begin (s).
    """

    id: str
    instruction: str
    max_seconds: float
    started: float
    goal_at: float = -float('inf')  # ``time.monotonic()`` when the goal arrived (before begin_episode): the
                                    # first request is built from an observation received after it
    requested: bool = False         # the client has been given the episode's first observation
    commanded: bool = False         # a tick has decided one of the policy's actions (sent, or to a dry run)
    first_command: bool = False     # the latest such tick was the episode's first
    end_reason: str = ''          # set when the node (not the client) ends it
    message: str = ''
    stopped: bool = False         # the control thread no longer asks the client for actions
    stale_since: float | None = None
    grid: ControlGrid | None = None   # the control thread's grid the episode started on (Runner.grid)
    first_index: int = -1         # its periods are that grid's deadlines after this index ...
    end_index: int | None = None  # ... and at most this one: what the grid had decided at the stop
    stopped_at: float | None = None   # monotonic time the node stopped asking for actions (s)
    outcome: Any = None           # the client's RunOutcome once ended
    done: threading.Event = dataclasses.field(default_factory=threading.Event)

    def stop(self, now: float | None = None) -> None:
        """Stop asking the client for actions (any thread); the first stop's time ends the episode's periods."""
        if not self.stopped:
            self.stopped_at = time.monotonic() if now is None else now
            if self.grid is not None:
                self.end_index = max(self.first_index,
                                     min(self.grid.index_at(self.stopped_at), self.grid.settled_index()))
            self.stopped = True

    def served_before_stop(self, grid: ControlGrid | None) -> bool:
        """Whether this tick's deadline came before the episode's stop though the tick saw the stop (a race).

        ``grid``: the grid the tick runs on; a tick on another one (the control thread of a later activation)
        is never the episode's. The client counts such a tick once (``Policy.hold_tick`` refuses a deadline it
        already counted).
        """
        if self.grid is None or self.end_index is None or grid is not self.grid:
            return False
        return self.first_index < self.grid.current_index() <= self.end_index

    def elapsed_to(self, grid_index: int | None) -> float:
        """The episode's time (s) from its start to deadline ``grid_index`` (the last one its counts cover).

        Without a grid: to the stop, or to now.
        """
        if self.grid is None:
            return (self.stopped_at if self.stopped_at is not None else time.monotonic()) - self.started
        if grid_index is None:
            return 0.0
        return max(0.0, self.grid.deadline_s(grid_index) - self.started)


@dataclasses.dataclass(frozen=True)
class EpisodeCounts:
    """An episode's tick counts as the client's ledger has them, with the time they cover (~/status, feedback).

    ``commands_sent + ticks_held + ticks_skipped`` = ``elapsed_s`` / the control period, to within one.
    """

    commands_sent: int = 0
    ticks_held: int = 0
    ticks_skipped: int = 0
    elapsed_s: float = 0.0


@dataclasses.dataclass(frozen=True)
class EpisodeReport:
    """How an episode ended, as the node reports it (Act result, EndEpisode response)."""

    episode_id: str
    reason: str
    message: str = ''
    actions: int = 0
    chunks: int = 0
    underruns: int = 0
    underrun_s: float = 0.0
    max_seam_jump: float = 0.0
    elapsed_s: float = 0.0
    latency_p50_ms: float = 0.0
    latency_p95_ms: float = 0.0
    commands_sent: int = 0
    ticks_held: int = 0
    ticks_skipped: int = 0
    dropped_telemetry: int = 0
    telemetry_rejected: int = 0   # capture frames the worker refused (bad shape, NaN, bad image...)
    telemetry_error: str = ''     # the first refusal's reason
    max_seam_gap: float = 0.0     # largest per-dimension discontinuity at a seam (action units)
    peak_in_flight: int = 0       # most requests in flight at once


def episode_line(report: EpisodeReport, outcome: Any = None) -> str:
    """One log line per episode: its outcome and what it cost.

    Always: reason, actions, chunks, underruns and underrun_s, seam jump and gap, peak in flight, the ticks
    (sent, held, skipped) and elapsed_s; with the client's ``outcome``, the requests sent (the worker's
    inferences) and the round-trip latency too.
    """
    line = (f'episode {report.episode_id} ended: {report.reason}; actions {report.actions}, chunks {report.chunks}, '
            f'underruns {report.underruns} ({report.underrun_s:.3f} s), commands_sent {report.commands_sent}, '
            f'ticks_held {report.ticks_held}, ticks_skipped {report.ticks_skipped}, '
            f'max_seam_jump {report.max_seam_jump:.4g}, max_seam_gap {report.max_seam_gap:.4g}, '
            f'peak_in_flight {report.peak_in_flight}, elapsed_s {report.elapsed_s:.3f}')
    if outcome is not None:
        line += (f', requests {outcome.requests}, latency p50/p95 {outcome.latency_p50_ms:.1f}/'
                 f'{outcome.latency_p95_ms:.1f} ms')
    return f'{line}; {report.message}' if report.message else line


def episode_settings(instruction: str, max_seconds: float, *, max_actions: int = 0, smooth_seam: int = 0,
                     prefetch: bool = True) -> EpisodeSettings:
    """Build the settings of an Act goal or StartEpisode request (0 means no max_actions).

    :raises ConfigError: for max_seconds <= 0, a negative max_actions or smooth_seam.
    """
    if not max_seconds > 0:
        raise ConfigError(f'max_seconds is required and must be > 0, got {max_seconds}')
    try:
        return EpisodeSettings(instruction=instruction, max_seconds=max_seconds, max_actions=max_actions or None,
                               smooth_seam=smooth_seam, prefetch=prefetch)
    except (TypeError, ValueError) as exc:
        raise ConfigError(str(exc)) from None


class RunTotals:
    """The runner's counts over every episode, for /diagnostics (its windows take their increments)."""

    def __init__(self) -> None:
        self.episode_ticks = 0      # control ticks of running episodes after their first command
        self.underrun_ticks = 0     # of which held for lack of an action (an underrun)
        self.telemetry_rejected = 0   # capture frames the worker refused, over ended episodes
        self.episodes_failed = 0      # episodes that ended 'error' (/diagnostics episode WARNs)
        self._dropped: dict[str, int] = {}    # capture frames the client could not send, per episode id

    def dropped_telemetry(self, policy: RunnerPolicy | None) -> int:
        """Capture frames the client could not send (its send queue was full), over every episode so far.

        Read from the client's live ``stats()['dropped_telemetry']`` when it reports it, else from the
        episode stream's counter (``Policy._episode.stream.dropped_telemetry``, where the client counts it).
        """
        ep = getattr(policy, '_episode', None)
        if ep is not None and policy is not None:
            stream = getattr(ep, 'stream', None)
            eid = str(getattr(stream, 'episode_id', '') or getattr(ep.engine, 'episode_id', ''))
            n: Any
            try:
                n = policy.stats().get('dropped_telemetry')
            except Exception:  # stats are best effort
                n = None
            if n is None:
                n = getattr(stream, 'dropped_telemetry', 0)
            self._dropped[eid] = max(self._dropped.get(eid, 0), int(n))
        return sum(self._dropped.values())


class SessionThread:
    """The session thread ``seq-session``: the runner's blocking work (:meth:`Runner.session_step`) every 20 ms.

    It runs while the node is configured (from configure to cleanup).

    :param step: called with ``time.monotonic()`` (the node's current runner's ``session_step``).
    :param on_error: called with what ``step`` raised (the loop goes on).
    """

    def __init__(self, step: Callable[[float], None], on_error: Callable[[Exception], None]) -> None:
        self._step = step
        self._on_error = on_error
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the thread."""
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name='seq-session', daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread and join it (up to 5 s: a blocking call it is in may take that long)."""
        self._stop.set()
        if self._thread is not None and self._thread.is_alive():
            self._thread.join(5.0)
        self._thread = None

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._step(time.monotonic())
            except Exception as exc:  # keep the session alive; report it
                self._on_error(exc)
            self._stop.wait(0.02)


class Runner:
    """Run episodes against a worker for one node.

    :param cfg: the node configuration.
    :param commands: the command interface (its ``bind`` checks contracts).
    :param safety: the safety filter.
    :param assembler: observation assembly.
    :param connect: ``connect(model, endpoint=, token=, timeout=)`` returning a client ``Policy``
        (:class:`.worker_link.RunnerPolicy`); defaults to :func:`sequence_ai_ros.client.connect`.
    :param on_contract: called with the contract once connected (the node configures camera converters).
    :param log: ``log(level, message)``.
    """

    def __init__(self, cfg: NodeConfig, commands: CommandInterface, safety: SafetyFilter,
                 assembler: ObservationAssembler, *, connect: Callable[..., RunnerPolicy] | None = None,
                 on_contract: Callable[[Contract], None] | None = None,
                 log: Callable[[str, str], None] | None = None) -> None:
        self.cfg = cfg
        self.commands = commands
        self.safety = safety
        self.assembler = assembler
        self._on_contract = on_contract
        self._log = log or (lambda level, msg: None)
        #: the connection to the worker (its Policy, contract, state; :class:`.worker_link.WorkerLink`)
        self.link = WorkerLink(cfg, connect, self._connected, self._log)
        self.on_underrun = cfg.on_underrun
        self.episode: EpisodeRun | None = None
        self.last_episode_id = ''
        self.last_result: EpisodeReport | None = None
        self.last_command: np.ndarray | None = None   # command order, float64
        self.last_snapshot: Snapshot | None = None
        self.holding = False
        self.accepting = False      # the lifecycle node sets it while active: episodes may start
        self.last_action: Any = None  # the client's Action of the last tick (None when it held without one)
        #: counts over every episode, for /diagnostics
        self.totals = RunTotals()
        #: the control thread's grid (its :class:`~sequence_ai_ros.node.tick.TickThread`); the node sets it on
        #: activate; None before any control thread
        self.grid: ControlGrid | None = None
        self._lock = threading.Lock()
        self._starting = False
        names = list(cfg.joints.names)
        cmd = cfg.command_joint_names
        self._measured_index = (np.array([names.index(n) for n in cmd], np.intp)
                                if cmd and all(n in names for n in cmd) else None)

    @property
    def policy(self) -> RunnerPolicy | None:
        """The client's Policy once connected, else None."""
        return self.link.policy

    @property
    def contract(self) -> Contract | None:
        """The deployment's contract once connected, else None."""
        return self.link.contract

    @property
    def connection(self) -> str:
        """The connection's state (see :class:`.worker_link.WorkerLink`)."""
        return self.link.state

    @property
    def connection_error(self) -> str:
        """Why the connection is not up ('' when it is)."""
        return self.link.error

    @property
    def ready(self) -> bool:
        """The deployment answered ready at the last poll."""
        return self.link.ready

    @property
    def telemetry_rejected(self) -> int:
        """Capture frames the worker refused, over ended episodes (:attr:`totals`)."""
        return self.totals.telemetry_rejected

    def _connected(self, contract: Contract) -> None:
        self.assembler.required_cameras = tuple(c.key for c in contract.observation.cameras)
        if self._on_contract is not None:
            self._on_contract(contract)

    # -- session thread ------------------------------------------------------------------------------
    def session_step(self, now: float) -> None:
        """Do the blocking work due at ``now`` (s, monotonic): connect, poll readiness, end episodes."""
        ep = self.episode
        if ep is not None and not ep.done.is_set():
            if ep.end_reason or ep.stopped:
                self._end(ep, ep.end_reason or 'completed')
            elif now - ep.started > ep.max_seconds + 2.0:   # backstop behind the client's own limit
                ep.end_reason, ep.message = 'timeout', f'max_seconds {ep.max_seconds} s reached'
                self._end(ep, 'timeout')
        self.link.poll(now)

    def connect_now(self) -> str:
        """Connect to the worker now (blocking, bounded by ``connect_timeout_s``); return '' or the error."""
        return self.link.connect_now()

    def _end(self, ep: EpisodeRun, reason: str) -> None:
        outcome = None
        ep.stop()   # first: the control thread stops asking the client for actions
        policy = self.policy
        assert policy is not None     # an episode runs only on a connected runner, which keeps its Policy
        if ep.end_index is not None:
            # the episode's periods run from its start to the node's stop (which the client's own finish may
            # trail, when its session thread was busy): the client counts those no tick served as skipped
            policy.end_ticks(ep.end_index)
        try:
            outcome = policy.end_episode(reason=reason)
        except SequenceAIError as exc:
            ep.message = ep.message or node_hint(str(exc))
            ep.end_reason = ep.end_reason or 'error'
        ep.stop()
        ep.outcome = outcome
        counts = self._counts(ep, policy, outcome)
        final = ep.end_reason or (outcome.reason if outcome is not None else reason)
        if final == 'error':
            self.totals.episodes_failed += 1
        if outcome is not None and outcome.error is not None and not ep.message:
            ep.message = node_hint(str(outcome.error))
        if outcome is not None and outcome.capture_error:
            note = f'not captured: {outcome.capture_error}'
            ep.message = f'{ep.message}; {note}' if ep.message else note
            self._log('warning', f'episode {ep.id} {note}')
        report = EpisodeReport(ep.id, final, ep.message, commands_sent=counts.commands_sent,
                               ticks_held=counts.ticks_held, ticks_skipped=counts.ticks_skipped)
        if outcome is not None:
            report = dataclasses.replace(
                report, actions=outcome.actions, chunks=outcome.chunks, underruns=outcome.underruns,
                underrun_s=outcome.underrun_s, max_seam_jump=outcome.max_seam_jump, elapsed_s=counts.elapsed_s,
                latency_p50_ms=outcome.latency_p50_ms, latency_p95_ms=outcome.latency_p95_ms,
                dropped_telemetry=outcome.dropped_telemetry, telemetry_rejected=outcome.telemetry_rejected,
                telemetry_error=outcome.telemetry_error, max_seam_gap=outcome.max_seam_gap,
                peak_in_flight=outcome.peak_in_flight)
        self.last_result = report
        self._log('info', episode_line(self.last_result, outcome))
        if self.last_result.telemetry_rejected:
            self.totals.telemetry_rejected += self.last_result.telemetry_rejected
            self._log('warning', f'episode {ep.id}: the worker refused {self.last_result.telemetry_rejected} '
                                 f'capture frames (kept without them); first: {self.last_result.telemetry_error}')
        ep.done.set()

    def _counts(self, ep: EpisodeRun, policy: RunnerPolicy, outcome: Any = None) -> EpisodeCounts:
        """``ep``'s tick counts from the client: its ``outcome``'s when given, else its live ``stats()``.

        Zeros when the client's current episode is another one (or its stats fail: they are best effort).
        """
        try:
            stats = policy.stats()
        except Exception:  # noqa: BLE001  (stats are best effort)
            stats = {}
        if stats.get('episode_id') != ep.id:
            stats = {}
        through = stats.get('ticks_grid_index')
        if through is None and outcome is not None:
            through = ep.end_index
        if outcome is not None:
            sent, held, skipped = outcome.commands_sent, outcome.ticks_held, outcome.ticks_skipped
        else:
            sent, held, skipped = (int(stats.get(k, 0)) for k in ('commands_sent', 'ticks_held', 'ticks_skipped'))
        return EpisodeCounts(sent, held, skipped, ep.elapsed_to(through))

    def counts(self) -> EpisodeCounts:
        """The running (or last) episode's tick counts and the time they cover, read from the client (any thread).

        Live while it runs (``Policy.stats()``); once it ended, its result's.
        """
        ep, policy, last = self.episode, self.policy, self.last_result
        if ep is None:
            return EpisodeCounts()
        if ep.done.is_set() and last is not None and last.episode_id == ep.id:
            return EpisodeCounts(last.commands_sent, last.ticks_held, last.ticks_skipped, last.elapsed_s)
        return self._counts(ep, policy) if policy is not None else EpisodeCounts()

    # -- services ------------------------------------------------------------------------------------
    def validate(self, contract: Contract) -> None:
        """Check that this node can feed and command the policy.

        :raises ContractViolation: (or ActionSpaceMismatch) naming what differs: a camera the policy
            needs that no ``cameras.<name>.key`` provides, state names that are not ``joints.names``,
            or an action space / joint set the command interface cannot take.
        """
        keys = [c.key for c in self.cfg.cameras]
        for cam in contract.observation.cameras:
            if cam.key not in keys:
                raise ContractViolation(
                    f'the policy needs camera {cam.key!r} but no camera topic is configured for it '
                    f'(configured keys: {keys or "none"}); add it to camera_names and cameras.<name>.key')
        names = contract.observation.state_names
        if names:
            check_names(self.cfg.joints.names, names, 'joints.names vs policy state')
        elif contract.observation.state_dim and contract.observation.state_dim != len(self.cfg.joints.names):
            raise ContractViolation(f'policy state has {contract.observation.state_dim} values, joints.names '
                                    f'has {len(self.cfg.joints.names)}')
        self.commands.bind(contract)

    def start(self, settings: EpisodeSettings, episode_id: str = '') -> str:
        """Begin an episode (blocking gRPC; call from a service thread); return its id.

        :param settings: how to drive it (:func:`episode_settings` builds them from a goal or request);
            max_seconds is required; the node fills in its action space and control period.
        :param episode_id: its id ('' makes one).
        :raises EpisodeStateError: when an episode is running.
        :raises NotReady: when the node is not active (lifecycle), or not connected.
        :raises ConfigError: for a missing max_seconds.
        :raises NotReady: (or ConnectionLost) when the worker is not connected.
        :raises ContractViolation: when :meth:`validate` refuses (reason 'validate').
        """
        if not self.accepting:
            raise NotReady('the node is not active (lifecycle): activate it first (autostart:=true, or '
                           '`ros2 lifecycle set <node> activate`)')
        max_seconds = settings.max_seconds
        if max_seconds is None:
            raise ConfigError('max_seconds is required and must be > 0')
        goal_at = time.monotonic()
        with self._lock:
            running = self.episode
            if self._starting or (running is not None and not running.done.is_set()):
                busy = ('an episode is starting' if self._starting or running is None
                        else f'episode {running.id} is running')
                raise EpisodeStateError(f'{busy}; one episode at a time per node')
            policy, contract = self.policy, self.contract
            if policy is None or contract is None:
                raise ConnectionLost(f'not connected to {self.cfg.model!r} at {self.cfg.endpoint}: '
                                     f'{self.link.not_connected()}')
            self._starting = True
        try:
            self.validate(contract)
            settings = dataclasses.replace(settings, expect_action_space=contract.action_space,
                                           control_period=self.cfg.period_s,
                                           aggregate=self.cfg.aggregate or settings.aggregate,
                                           prefetch_margin=self.cfg.prefetch_margin)
            eid = policy.begin_episode(episode_id=episode_id or f'ep-{uuid.uuid4().hex[:12]}', settings=settings)
        finally:
            with self._lock:
                self._starting = False
        started = time.monotonic()
        ep = EpisodeRun(str(eid), settings.instruction, max_seconds, started, goal_at=goal_at, grid=self.grid)
        if ep.grid is not None:
            ep.first_index = ep.grid.index_at(started)
            policy.start_ticks(ep.first_index)    # the episode's periods: the client counts each one
        with self._lock:
            self._starting = False
            self.episode = ep
            self.last_episode_id = ep.id
            self.holding = False
        self._log('info', f'episode {ep.id} started: {contract.action_space.value} at {1.0 / self.cfg.period_s:g} Hz, '
                          f'aggregate {settings.aggregate or contract.aggregate}, max_seconds {settings.max_seconds:g}')
        return ep.id

    def interrupt(self, message: str = '') -> str:
        """Stop the running episode between two actions (thread-safe); return its id ('' if none).

        The next tick publishes the hold; the session thread ends the episode with 'interrupted'.

        :param message: why, for the episode's result (e.g. a lifecycle deactivate); '' for a caller's interrupt.
        """
        ep = self.episode
        if ep is None or ep.done.is_set():
            return ''
        ep.stop()
        if not ep.end_reason:
            ep.end_reason, ep.message = 'interrupted', ep.message or message
        try:
            if self.policy is not None:
                self.policy.interrupt()
        except SequenceAIError as exc:  # the hold has already fired; the end path reports the rest
            self._log('warn', f'interrupt: {exc}')
        return ep.id

    def request_end(self, reason: str = 'completed', message: str = '') -> str:
        """Ask the session thread to end the running episode with ``reason``; return its id ('' if none)."""
        ep = self.episode
        if ep is None or ep.done.is_set():
            return ''
        if not ep.end_reason:
            ep.end_reason, ep.message = reason, message
        ep.stop()
        return ep.id

    def wait(self, episode_id: str, timeout: float) -> EpisodeReport | None:
        """Wait up to ``timeout`` s for the episode to end; return its result or None."""
        ep = self.episode
        if ep is None or ep.id != episode_id:
            last = self.last_result
            return last if last is not None and last.episode_id == episode_id else None
        if ep.done.wait(timeout):
            return self.last_result
        return None

    def label(self, success: bool, notes: str = '', episode_id: str = '') -> tuple[str, bool]:
        """Store a label for an episode on the worker (blocking RPC).

        :returns: (episode id, True) once the worker stored the label.
        :raises EpisodeStateError: when no episode was run and none is named.
        :raises SequenceAIError: what the worker answers when it does not store it (CaptureError with its
            message: unknown episode, not captured, capture off) or a connection error.
        """
        eid = episode_id or self.last_episode_id
        if not eid:
            raise EpisodeStateError('no episode to label: none has run on this node and none was named')
        policy = self.policy
        if policy is None:
            raise NotReady(f'not connected to {self.cfg.model!r}')
        return eid, bool(policy.label(success, notes=notes, episode_id=eid))

    def dropped_telemetry(self) -> int:
        """Capture frames the client could not send (its send queue was full), over every episode so far."""
        return self.totals.dropped_telemetry(self.policy)

    def horizon(self) -> tuple[int, float, float, np.ndarray] | None:
        """The playing chunk of the running episode (see ``Policy.chunk_horizon``), or None."""
        ep, policy = self.episode, self.policy
        if ep is None or ep.stopped or ep.done.is_set() or policy is None:
            return None
        return policy.chunk_horizon()

    def close(self) -> None:
        """End any running episode and close the client (blocking; call at shutdown)."""
        ep = self.episode
        if ep is not None and not ep.done.is_set() and self.policy is not None:
            ep.end_reason = ep.end_reason or 'interrupted'
            ep.stop()
            self._end(ep, ep.end_reason)
        self.link.close()

    # -- control thread --------------------------------------------------------------------------------
    def measured_state(self) -> np.ndarray | None:
        """The latest measured joint positions, float64 (D,) in command order (rad or m).

        None on an interface that is not joint positions, or before any joint_states.
        """
        snap = self.last_snapshot
        return self._measured(snap) if snap is not None else None

    def _measured(self, snap: Snapshot) -> np.ndarray | None:
        commands = self.commands
        if snap.state is None or self._measured_index is None or not (commands.is_joint and commands.is_position):
            return None
        return snap.state.astype(np.float64)[self._measured_index]

    def _fresh(self) -> bool:
        """True from a goal's arrival until its episode's first command (any thread; attribute reads only)."""
        ep = self.episode
        return self._starting or (ep is not None and not ep.stopped and not ep.done.is_set() and not ep.commanded)

    def _hold(self, snap: Snapshot) -> np.ndarray | None:
        self.holding = True
        if self.on_underrun == 'stop':
            if self.last_command is not None and not self.commands.is_position:
                # a rate controller (velocity, twist) keeps applying its last command: 'stop' sends it one
                # zero-rate command, then nothing
                stop = self.commands.hold_values(self.last_command)
                if not np.array_equal(stop, self.last_command):
                    self.last_command = stop
                    return stop
            return None
        measured = self._measured(snap)
        if self.last_command is not None and (measured is None or not self._fresh()):
            return self.commands.hold_values(self.last_command)
        if measured is not None:
            return measured     # before the first command, or a new goal's (the robot may have been reset)
        if self.commands.is_joint and not self.commands.is_position and self._measured_index is not None:
            return np.zeros(len(self._measured_index))   # a joint velocity hold before any command: stand still
        return None

    def _episode_hold(self, ep: EpisodeRun, snap: Snapshot, hold_reason: str) -> np.ndarray | None:
        """Hold during ``ep`` without asking the client for an action.

        The client counts the tick in ``ticks_held`` (``Policy.hold_tick``), also when nothing is published
        ('stop'); not once ``ep`` is done (the client's episode may then be another one).
        """
        policy, grid = self.policy, self.grid
        if policy is not None and not ep.done.is_set():
            policy.hold_tick(grid.current_index() if grid is not None else None, hold_reason)
        return self._hold(snap)

    def tick(self, now: float, dry: bool = False) -> np.ndarray | None:
        """Return the command to publish at ``now`` (command order, float64), or None to publish nothing.

        Never blocks: reads the latest observation and the client's buffer.

        :param dry: a dry run (``enabled`` false): the command goes to ``~/would_command``, not the controller,
            so the tick's record holds (reason ``dry_run``) with the policy's action kept beside it; a dry run
            never exports as executed (an episode dry throughout has no executed action and is skipped by the
            export, named).
        """
        ep = self.episode
        snap = self.assembler.snapshot(now, ep.instruction if ep is not None else '')
        self.last_snapshot = snap
        self.last_action = None
        if ep is not None and ep.stopped and ep.served_before_stop(self.grid):
            return self._episode_hold(ep, snap, 'ended')    # its deadline is the episode's: this tick holds for it
        if ep is None or ep.stopped or ep.done.is_set():
            # between episodes: the last command held, or nothing when there is none (before the first goal,
            # after a re-activate, after an episode that never commanded)
            return None if self.last_command is None else self._hold(snap)
        if snap.observation is None:
            if ep.stale_since is None:
                ep.stale_since = now
                self._log('warn', f'observation invalid, holding: {"; ".join(snap.problems)}')
            elif now - ep.stale_since > self.cfg.stale_grace_s:
                self.request_end('error', f'observation invalid for over {self.cfg.stale_grace_s} s: '
                                          f'{"; ".join(snap.problems)}')
            return self._episode_hold(ep, snap, 'refused')
        if ep.stale_since is not None:
            self._log('info', 'observation valid again; resuming')
            ep.stale_since = None
        if not ep.requested:
            if snap.received <= ep.goal_at:
                # the first request is built from an observation newer than the goal: one taken before it may
                # show the robot before a reset
                return self._episode_hold(ep, snap, 'waiting')
            ep.requested = True
        policy = self.policy
        assert policy is not None     # an episode runs only on a connected runner
        grid = self.grid
        try:
            # the tick's record is placed on the episode's timeline by the deadline it serves (capture's rows)
            action = policy.next_action(snap.observation, now=now,
                                        grid_index=grid.current_index() if grid is not None else None)
        except EpisodeStateError:   # the session thread ended the episode between our checks
            ep.stop(now)
            return self._episode_hold(ep, snap, 'ended')    # the episode's last period: this tick holds
        if policy.episode_outcome() is not None:
            ep.stop(now)          # the client dropped this tick's record (after the end): the tick holds
            return self._episode_hold(ep, snap, 'ended')
        if ep.commanded:
            self.totals.episode_ticks += 1
        if action is None or action.hold:
            # the client counts this tick (its record: waiting or underrun) as held
            if action is not None and ep.commanded:
                self.totals.underrun_ticks += 1
            return self._hold(snap)
        self.last_action = action
        values = self.commands.order(action.values)
        # the step limit's reference: the last command, or the measured state for an episode's first command
        last = self._measured(snap) if not ep.commanded else None
        if last is None:
            last = self.last_command if self.last_command is not None else self._measured(snap)
        # trajectory mode publishes the chunk's points (checked there), not this per-tick value
        checked = self.safety.check(values, last, count=self.cfg.command.mode != 'trajectory')
        if checked.values is None:
            policy.report_command(None, hold_reason='refused')   # this tick held: the policy's action was refused
            self.request_end('validate', f'safety: {checked.stop}')
            return self._hold(snap)     # the client counted the refused tick as held
        # the tick's record: what reaches the controller, and the policy's action beside it when clamped
        if dry:
            policy.report_command(None, hold_reason='dry_run')
        else:
            policy.report_command(self.commands.unorder(checked.values), clamped=checked.clamped > 0)
        self.holding = False
        self.last_command = checked.values
        ep.first_command, ep.commanded = not ep.commanded, True
        return checked.values
