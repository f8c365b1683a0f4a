"""What the admin API reports of episodes: live counts of one episode, and totals per deployment version.

:class:`LiveCounts` belongs to one running episode (:class:`~sequence_ai_ros.worker.runtime.ActiveEpisode`):
the requests of it being served now and the underruns its telemetry showed so far. Its writers are the
episode's stream coroutine on the worker's event loop; the admin servicer reads it there too.

:class:`VersionTally` sums the episodes that ended, per (deployment, version), since the worker started:
how many, by end reason, the chunks answered and the underruns. One row per version ever served: a handful.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import threading
from collections.abc import Iterator


class LiveCounts:
    """One running episode's counts so far (written and read on the worker's event loop)."""

    __slots__ = ('in_flight', 'underrun_s', 'underruns')

    def __init__(self) -> None:
        #: observation requests of the episode the worker is serving now (queued for or in inference)
        self.in_flight = 0
        #: underruns its telemetry showed so far
        self.underruns = 0
        #: seconds held in underrun so far (s, on the robot's tick clock)
        self.underrun_s = 0.0

    def underran(self, count: int, seconds: float) -> None:
        """Add ``count`` underruns begun and ``seconds`` held in underrun (one telemetry batch's)."""
        self.underruns += int(count)
        self.underrun_s += float(seconds)

    @contextlib.contextmanager
    def serving(self) -> Iterator[None]:
        """Count one request in flight for the duration of the ``with`` block."""
        self.in_flight += 1
        try:
            yield
        finally:
            self.in_flight -= 1


@dataclasses.dataclass
class EndedEpisodes:
    """The ended episodes of one deployment version: how many, by reason, their requests and underruns."""

    by_reason: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    requests: int = 0
    underruns: int = 0
    underrun_s: float = 0.0

    @property
    def count(self) -> int:
        """Episodes ended."""
        return sum(self.by_reason.values())


class VersionTally:
    """Ended episodes per (deployment, version) since the worker started (any thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._rows: dict[tuple[str, int], EndedEpisodes] = {}

    def ended(self, deployment: str, version: int, reason: str, requests: int, live: LiveCounts) -> None:
        """Count one ended episode of ``deployment`` ``version``.

        :param reason: its end reason (``completed``, ``disconnect``, ``drain_timeout``...).
        :param requests: the chunks it was answered.
        :param live: its counts (underruns).
        """
        with self._lock:
            row = self._rows.setdefault((deployment, version), EndedEpisodes())
            row.by_reason[reason or 'completed'] += 1
            row.requests += int(requests)
            row.underruns += live.underruns
            row.underrun_s += live.underrun_s

    def rows(self) -> dict[tuple[str, int], EndedEpisodes]:
        """A copy of every row, by (deployment, version)."""
        with self._lock:
            return {key: dataclasses.replace(row, by_reason=collections.Counter(row.by_reason))
                    for key, row in self._rows.items()}
