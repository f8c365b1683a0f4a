"""RunOutcome: how an episode ended, and what it cost, as act()/run()/end_episode() report it."""

from __future__ import annotations

import dataclasses
import warnings

from sequence_ai_ros.exceptions import SequenceAIError

#: Why an episode ends. ``error`` (a lost connection, a worker error or refusal, no chunk within the no-chunk deadline)
#: is raised by act()/run() after the hold fires; loops that call next_action() themselves read it from
#: :meth:`Policy.episode_outcome`. ``error`` is also the reason the worker is told when the caller's own
#: code (observe, act, until, on_underrun) raised; act()/run() then re-raise the caller's exception.
REASONS = ('completed', 'until', 'timeout', 'interrupted', 'validate', 'error')
#: The reasons of an episode that failed (the others ran and ended as asked).
FAILED_REASONS = ('error', 'validate')


@dataclasses.dataclass(frozen=True)
class RunOutcome:
    """The result of one episode.

    :param actions: actions executed, in chunk steps (a 50 Hz caller against dt=1/30 s executes 30 per s).
        On the clock (next_action without a fixed period, absolute spaces) it is the timeline's position:
        steps that passed while the caller stalled count, though the robot held its last command.
    :param chunks: action chunks received and accepted.
    :param elapsed_s: seconds from the episode's start to its end (robot monotonic clock).
    :param reason: one of :data:`REASONS`.
    :param underruns: dry spells (the buffer was empty after the first action; each fired hold once).
    :param underrun_s: seconds the arm had no fresh command, summed over the dry spells.
    :param max_seam_jump: the largest per-dimension step across a chunk boundary, in the action's units
        (for delta and velocity spaces, in the chunk's own per-step units).
    :param latency_p50_ms: median chunk round trip (ms), measured on the robot; 0 when unmeasured.
    :param latency_p95_ms: 95th percentile chunk round trip (ms).
    :param episode_id: the episode's id.
    :param stale_actions: stale actions skipped at chunk switches, in chunk steps (counted, never estimated):
        rows of a chunk that were already past when it arrived.
    :param smooth_seam_ignored: True when smooth_seam > 0 was asked on a delta or velocity space (a no-op).
    :param dropped_telemetry: capture frames (telemetry) lost on the robot because the send queue was full
        (0 when nothing was lost or the episode was not captured).
    :param max_seam_gap: the largest per-dimension discontinuity at a seam: the new chunk's row against the
        old chunk's own row for the same step, over the seams where the old chunk has one (up to its last row)
        (0 for a policy that in-paints the committed prefix, RTC).
    :param peak_in_flight: the most requests that were in flight at once (pipelining; 1 without).
    :param discarded: chunks received but never played (stale on arrival, or replaced before a tick read them).
    :param requests: requests sent in the episode: each one an inference on the worker, answered or not (those
        still in flight at the end included); ``chunks`` counts the answers accepted.
    :param telemetry_rejected: capture telemetry frames the worker refused (wrong shape or dtype, NaN,
        an image whose header disagrees with its size or format); the episode was kept without them.
    :param telemetry_error: the first refusal, ``"CONTRACT_VIOLATION: <why>"``; '' when none.
    :param commands_sent: control ticks that commanded one of the policy's actions (the node's Act result and
        ``~/status`` use the same name).
    :param ticks_held: control ticks that held instead: before the first chunk, during an underrun, a command
        the robot refused or sent to a dry run.
    :param ticks_skipped: control periods no tick served because the caller's own code (``observe()``,
        ``act()``) or its loop overran the period: commands_sent + ticks_held + ticks_skipped = the episode's
        control periods (``elapsed_s / period``, to within one; act()/run() count on one grid from the
        episode's start, the periods after its last tick included). act()/run() never burst to catch up: a
        missed period is skipped, counted here and logged once per episode; every chunk step still runs once
        (the export shows the missed periods as held rows).
    :param capture_error: capture is on for the deployment but this episode is not kept, and why: its id
        was already captured, or is being captured by another worker sharing the store (a reconnect or a
        reused id); a capture record was over the worker's message limit (its size and the limit: the robot
        stopped the capture, the run went on); a write to the worker's store failed (the worker said so at
        the end: the deployment deleted meanwhile, a full disk); '' otherwise (a paused or full store is
        reported by the worker's diagnostics).
    :param error: the typed exception behind reason ``validate`` or ``error``; None otherwise, and for an
        ``error`` that the caller's own code raised (that exception propagates from act()/run()). An episode
        the worker refused (:class:`~sequence_ai_ros.exceptions.Draining`, ``Overloaded``) and never started
        has reason ``error`` and the refusal here, also when its ``max_seconds`` ran out during the retries.
    :param worker_confirmed: True when the worker answered the episode's end (EpisodeEnded): it heard the
        reason and these counts, and closed the episode. False when it did not answer within 2 s, the stream
        had already failed, or the end went out on a background thread (next_action opening the next episode).
    """

    actions: int
    chunks: int
    elapsed_s: float
    reason: str
    underruns: int = 0
    underrun_s: float = 0.0
    max_seam_jump: float = 0.0
    latency_p50_ms: float = 0.0
    latency_p95_ms: float = 0.0
    episode_id: str = ''
    stale_actions: int = 0
    smooth_seam_ignored: bool = False
    error: SequenceAIError | None = None
    dropped_telemetry: int = 0
    peak_in_flight: int = 0
    discarded: int = 0
    max_seam_gap: float = 0.0
    telemetry_rejected: int = 0
    telemetry_error: str = ''
    capture_error: str = ''
    commands_sent: int = 0
    ticks_held: int = 0
    ticks_skipped: int = 0
    worker_confirmed: bool = False
    requests: int = 0

    @property
    def skipped(self) -> int:
        """Deprecated: the earlier name of :attr:`stale_actions` (removed in the next release).

        :returns: :attr:`stale_actions`, after a DeprecationWarning.
        """
        warnings.warn('RunOutcome.skipped is deprecated and will be removed in the next release: read '
                      'RunOutcome.stale_actions (stale chunk steps skipped; ticks_skipped counts missed control '
                      'periods)', DeprecationWarning, stacklevel=2)
        return self.stale_actions

    def __post_init__(self) -> None:
        if self.reason not in REASONS:
            raise ValueError(f'unknown reason {self.reason!r}; expected one of {REASONS}')

    def __str__(self) -> str:
        notes = []
        if self.underruns:
            notes.append(f'{self.underruns} underruns ({self.underrun_s:.2f} s)')
        if self.ticks_skipped:
            notes.append(f'{self.ticks_skipped} control periods skipped (overruns)')
        if self.telemetry_rejected:
            notes.append(f'{self.telemetry_rejected} capture frames refused: {self.telemetry_error}')
        if self.dropped_telemetry:
            notes.append(f'{self.dropped_telemetry} capture frames dropped')
        if self.capture_error:
            notes.append(f'not captured: {self.capture_error}')
        tail = ''.join(f'; {n}' for n in notes)
        why = f' ({type(self.error).__name__}: {self.error})' if self.error is not None else ''
        return (f'RunOutcome({self.actions} actions over {self.chunks} chunks in {self.elapsed_s:.1f}s, '
                f'{self.reason}{why}{tail})')
