"""The counts of one episode: chunks, underruns and their seconds, seams, stale and discarded rows.

One owner for each count the :class:`~sequence_ai_ros.client.outcome.RunOutcome` reports about the chunks
(the ledger, :class:`~sequence_ai_ros.client.steps.StepLedger`, owns the per-tick counts: commands sent,
ticks held and skipped). The engine's parts add to it; only the engine's front reads it into the outcome.
"""

from __future__ import annotations

import numpy as np

from sequence_ai_ros.client.latency import percentile


class Tally:
    """What one episode's chunks did, counted as it happens (no I/O, no clock of its own).

    :ivar chunks: chunks received (valid ones).
    :ivar underruns: dry spells: the playing chunk ran out after the first action and before the next one.
    :ivar underrun_s: their seconds, on the engine's clock.
    :ivar stale: chunk steps skipped because they were stale at their chunk's arrival (counted by position).
    :ivar discarded: chunks never played (stale on arrival, or replaced before a tick read them).
    :ivar max_seam_jump: the largest change between consecutive emitted actions across a chunk switch.
    :ivar max_seam_gap: the largest difference at a switch between the new chunk and the old one's own row
        for the same step.
    :ivar rtts: every round trip of this episode (s).
    """

    def __init__(self) -> None:
        self.chunks = self.underruns = self.discarded = 0
        self.underrun_s = self.stale = self.max_seam_jump = self.max_seam_gap = 0.0
        self.dry_since: float | None = None
        self.rtts: list[float] = []

    @property
    def dry(self) -> bool:
        """True during a dry spell."""
        return self.dry_since is not None

    def dry_begins(self, at: float) -> None:
        """A dry spell begins at ``at`` (s): counted once, however many ticks it lasts."""
        if self.dry_since is None:
            self.underruns += 1
            self.dry_since = at

    def dry_ends(self, now: float) -> None:
        """The dry spell (if any) ends at ``now`` (s): its seconds are added."""
        if self.dry_since is not None:
            self.underrun_s += max(0.0, now - self.dry_since)
            self.dry_since = None

    def seam(self, jump: np.ndarray, gap: np.ndarray | None) -> None:
        """A chunk switch at an emitted action: ``jump`` against the previous action, ``gap`` against the old chunk."""
        self.max_seam_jump = max(self.max_seam_jump, float(np.max(np.abs(jump))))
        if gap is not None:
            self.max_seam_gap = max(self.max_seam_gap, float(np.max(np.abs(gap))))

    def latency_ms(self, q: float) -> float:
        """The ``q``-th percentile of this episode's round trips (ms; 0 without any)."""
        return 1000 * percentile(self.rtts, q)


__all__ = ['Tally']
