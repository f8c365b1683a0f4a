"""Round-trip latency over a sliding window: the prefetch lead and the expected delay derived from it.

The first round trip on a connection is the cold one (JIT, caches, a policy's first call); it is kept
apart from the warm ones that follow. The window belongs to the connection (``Policy.latency``), so an
episode starts with what the episodes before it measured. A round trip here is counted from the deadline of
the tick that sent the request when the caller is paced (act/run): a tick that runs late still executes its
deadline's step, so its lateness is time the lead must cover, as the link's is (``Pending.counted_at``);
otherwise from the send.

One upper estimate of the next round trip, :meth:`LatencyWindow.delay_s`, serves two uses:

- *what to tell the policy*: ``expected_delay_actions`` (the rows of ``chunk_tail`` that run before the
  answer is read) is computed from it;
- *when to request* (:meth:`LatencyWindow.lead_s`): the buffered time left at which the next chunk is asked
  for is the estimate plus one caller period. A request that leaves at a tick with ``ahead`` seconds of
  actions played or awaited has its chunk read in time when it arrives within ``ahead`` of the tick's
  deadline (the tick that needs its first row comes ``ahead`` after it; an arrival before is read there); the
  trigger, checked only at ticks, fires at the first tick with ``ahead <= lead``, so ``ahead > lead - period
  >= the estimate``. Each period more is a request sooner: pipelined, requests leave every ``covers - ahead``, so
  over-estimating costs inferences (at a round trip of 0.8 of a chunk, one period is a fifth of the spacing)
  and under-estimating costs an underrun.

How far above the measured round trips the estimate reaches is the caller's trade-off between inferences and
safety: ``deviations`` (``EpisodeSettings.prefetch_margin``, default :data:`RTO_DEVIATIONS`) mean deviations
above the mean, never below the window's largest round trip. 0 times the requests to the largest of the last
:data:`WINDOW` round trips alone (fewest inferences; on a jittery link the next round trip exceeds the largest
of 32 about once in 33 requests, and each one that also eats the period's slack is a dry spell); 4 is RFC
6298's retransmission timeout (SRTT + 4 RTTVAR), above the upper end of a +-20 % link.

Once there are :data:`MIN_SAMPLES` warm round trips the estimate is :func:`upper_s`: the larger of the
window's largest one (:data:`PREFETCH_PERCENTILE` 100: a p95 leaves one round trip in twenty short) and
RFC 6298's retransmission timeout over the window (mean + ``deviations`` mean deviations), because
the largest of a few dozen samples lags a jittery link's upper end. While there are fewer warm ones the
window is not yet an upper bound (one sample of a +-20 % distribution may be its low end), so it is
:data:`EARLY_FACTOR` times the largest warm one; before any warm one, :data:`EARLY_FACTOR` times the cold
one. The cold sample alone times the first seam of a connection, never a later one (a slow cold call in the
estimate would make every buffer look short, make a pipelining engine request at the worker's pace, and
announce the whole chunk as delay). The engine also lets the cold one (:meth:`LatencyWindow.cold_s`) start
pipelining before any warm one exists, when it is shorter than a chunk.
"""

from __future__ import annotations

import collections
import math
import threading

#: Percentile of the window that times the prefetch (nearest rank; 100: its largest round trip).
PREFETCH_PERCENTILE = 100.0
#: Mean deviations above the mean round trip that the lead covers at least by default (RFC 6298's retransmission
#: timeout, SRTT + 4 RTTVAR, over the window): the window's largest sample lags the link's upper end.
#: ``EpisodeSettings.prefetch_margin`` chooses another (0: the window's largest round trip alone).
RTO_DEVIATIONS = 4.0
#: Round trips kept in the window.
WINDOW = 32
#: Warm round trips needed before upper_s is used without margin.
MIN_SAMPLES = 8
#: Margin on the largest warm round trip while there are fewer than MIN_SAMPLES (on the cold one before any).
EARLY_FACTOR = 1.5


def percentile(values: list[float], q: float) -> float:
    """Return the nearest-rank ``q``-th percentile of ``values`` (0 for none).

    Nearest rank (Hyndman & Fan 1996, definition 1): the smallest value with at least q% of the
    samples at or below it; it never interpolates beyond what was measured.
    """
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


class LatencyWindow:
    """Thread-safe sliding window of round trips (s), the cold first one kept apart.

    :param window: warm samples kept (the oldest drop out).
    """

    def __init__(self, window: int = WINDOW) -> None:
        self._lock = threading.Lock()
        self._warm: collections.deque[float] = collections.deque(maxlen=window)
        self._cold: float | None = None

    def add(self, seconds: float) -> None:
        """Record one round trip (s); the first ever recorded is the cold one."""
        with self._lock:
            if self._cold is None:
                self._cold = float(seconds)
            else:
                self._warm.append(float(seconds))

    def samples(self) -> list[float]:
        """The warm samples (s), oldest first; empty before the second round trip."""
        with self._lock:
            return list(self._warm)

    def cold_s(self) -> float | None:
        """The cold (first) round trip (s), or None before any."""
        with self._lock:
            return self._cold

    def quantile(self, q: float) -> float:
        """The ``q``-th percentile (s) of the warm samples; the cold one while there are none; 0 before any."""
        with self._lock:
            if self._warm:
                return percentile(list(self._warm), q)
            return self._cold or 0.0

    def _snapshot(self) -> tuple[list[float], float]:
        with self._lock:
            return list(self._warm), self._cold or 0.0

    def delay_s(self, deviations: float = RTO_DEVIATIONS) -> float:
        """An upper estimate of the next round trip (s), for ``expected_delay_actions``; 0 before any.

        :meth:`upper_s` once there are MIN_SAMPLES warm samples; EARLY_FACTOR times the largest warm one while
        there are fewer; EARLY_FACTOR times the cold one only while there is no warm one.

        :param deviations: mean deviations above the mean that the estimate reaches at least (>= 0; see
            :func:`upper_s`).
        """
        warm, cold = self._snapshot()
        if not warm:
            return EARLY_FACTOR * cold
        return upper_s(warm, deviations) if len(warm) >= MIN_SAMPLES else EARLY_FACTOR * max(warm)

    def lead_s(self, period_s: float, deviations: float = RTO_DEVIATIONS) -> float:
        """Seconds of buffered actions left at which the next chunk is requested (s).

        :meth:`delay_s` (the same upper estimate of the round trip) plus one period: the trigger is checked
        only at ticks, so it fires with up to a period less left than the lead (see the module docstring).

        :param period_s: the caller's control period (s).
        :param deviations: as :meth:`delay_s`'s (``EpisodeSettings.prefetch_margin``).
        """
        return self.delay_s(deviations) + period_s


def upper_s(warm: list[float], deviations: float = RTO_DEVIATIONS) -> float:
    """An upper estimate of the next round trip (s) from warm samples (s; at least one).

    The larger of the window's PREFETCH_PERCENTILE (its largest sample) and RFC 6298's retransmission timeout
    over the window, mean + ``deviations`` x mean absolute deviation: the largest of a few dozen samples lags a
    jittery link's upper end (with +-20 % on each one-way delay, 32 samples left one round trip in about a
    hundred above their largest, and a dry spell where the margin is thin).

    :param deviations: mean deviations above the mean (>= 0; default :data:`RTO_DEVIATIONS`; 0: the largest
        sample alone).
    """
    mean = sum(warm) / len(warm)
    deviation = sum(abs(x - mean) for x in warm) / len(warm)
    return max(percentile(warm, PREFETCH_PERCENTILE), mean + deviations * deviation)
