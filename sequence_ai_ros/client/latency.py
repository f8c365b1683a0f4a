"""Round-trip latency over a sliding window, and the prefetch lead time derived from it.

The lead is a high percentile (p95, nearest-rank) of the last ``window`` round trips, plus two caller
periods: one because the trigger is checked only at ticks, one because an arrival is noticed only at
the next tick. The first round trip on a connection is the cold one (JIT, caches, a policy's first
call); it is kept apart and used only until a warm sample exists, so a cold spike never inflates later
prefetch timing. While the window holds fewer than :data:`MIN_SAMPLES` warm round trips a percentile
of them is not yet an upper bound (one sample of a +-20 % distribution may be its low end), so the
lead uses the largest seen (the cold one before any warm one) times :data:`EARLY_FACTOR` until then.
"""

from __future__ import annotations

import collections
import math
import threading

#: Percentile of the window that times the prefetch.
PREFETCH_PERCENTILE = 95.0
#: Round trips kept in the window.
WINDOW = 32
#: Warm round trips needed before the percentile alone times the prefetch.
MIN_SAMPLES = 8
#: Margin on the largest warm round trip while there are fewer than MIN_SAMPLES.
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
    """Thread-safe sliding window of round trips (s); the cold first one is excluded.

    :param window: samples kept (the oldest drop out).
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
        """The warm samples (s), oldest first."""
        with self._lock:
            return list(self._warm)

    def quantile(self, q: float) -> float:
        """The ``q``-th percentile (s) of the warm samples; the cold one while there are none; 0 before any."""
        with self._lock:
            if self._warm:
                return percentile(list(self._warm), q)
            return self._cold or 0.0

    def upper_s(self) -> float:
        """An upper estimate of the next round trip (s); 0 before any.

        The largest warm sample once there are MIN_SAMPLES, before that EARLY_FACTOR times the largest seen
        (the cold one included).
        """
        with self._lock:
            warm = list(self._warm)
            cold = self._cold or 0.0
        if len(warm) >= MIN_SAMPLES:
            return max(warm)
        return EARLY_FACTOR * max([cold, *warm])

    def lead_s(self, period_s: float) -> float:
        """Seconds of buffered actions left at which the next chunk is requested.

        :param period_s: the caller's control period (s).
        """
        with self._lock:
            warm = list(self._warm)
            cold = self._cold or 0.0
        if not warm:
            estimate = EARLY_FACTOR * cold
        elif len(warm) < MIN_SAMPLES:
            estimate = EARLY_FACTOR * max(warm)
        else:
            estimate = percentile(warm, PREFETCH_PERCENTILE)
        return estimate + 2.0 * period_s
