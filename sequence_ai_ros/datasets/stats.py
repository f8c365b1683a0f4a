"""Per-episode feature statistics, as LeRobot writes them.

Where: v2.1 ``meta/episodes_stats.jsonl``; v3.0 ``meta/episodes/`` columns and ``meta/stats.json``.

The formulas are LeRobot 0.6.1's (huggingface/lerobot ``datasets/compute_stats.py``: ``estimate_num_samples``,
``sample_indices``, ``auto_downsample_height_width``, ``get_feature_stats`` with ``RunningQuantileStats``,
``compute_episode_stats``, ``aggregate_stats``), re-implemented here so exports need neither torch nor LeRobot:

- every feature carries ``min, max, mean, std, count, q01, q10, q50, q90, q99``; values are reduced in
  float32 at least (LeRobot promotes with ``np.result_type(dtype, float32)``); std is
  ``sqrt(max(0, E[x**2] - E[x]**2))``;
- quantiles come from a histogram of 5,000 equal bins spanning ``[min - 1e-10, max + 1e-10]`` per
  dimension: the q-quantile is the bin where the cumulative count first reaches ``q * count``, linearly
  interpolated inside it (so they match LeRobot to within one bin width, (max - min) / 5000, and exactly
  when computed the same way); with fewer than 2 values every quantile is the mean;
- a dataset's stats (``aggregate``) are count-weighted: mean, pooled variance, min of mins, max of maxes,
  and count-weighted quantiles (as LeRobot's ``aggregate_feature_stats``);
- numeric features, arrays (N,) or (N, D): min/max/mean/std over the frames (axis 0); (N,) arrays keep
  their dimension, giving lists of length 1; ``count`` is ``[N]``;
- images and videos: a sample of frames (100 for episodes up to ~500 frames, N**0.75 beyond, at most
  10,000, evenly spaced), each downsampled by striding to about 150 px when its larger side is 300 px or
  more; min/max/mean/std per channel over (sample, H, W), divided by 255, shaped (3, 1, 1); ``count`` is
  the number of sampled frames.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def estimate_num_samples(n: int, min_samples: int = 100, max_samples: int = 10_000, power: float = 0.75) -> int:
    """Return how many frames of an n-frame episode go into its image statistics."""
    if n < min_samples:
        min_samples = n
    return max(min_samples, min(int(n ** power), max_samples))


def sample_indices(n: int) -> list[int]:
    """Return the frame indices sampled for image statistics (evenly spaced, rounded)."""
    return np.round(np.linspace(0, n - 1, estimate_num_samples(n))).astype(int).tolist()


def downsample(chw: np.ndarray, target: int = 150, threshold: int = 300) -> np.ndarray:
    """Stride a (C, H, W) image down to about ``target`` px on its larger side when it is >= ``threshold``."""
    _, height, width = chw.shape
    if max(width, height) < threshold:
        return chw
    factor = int(width / target) if width > height else int(height / target)
    return chw[:, ::factor, ::factor]


QUANTILES = (0.01, 0.10, 0.50, 0.90, 0.99)
QUANTILE_BINS = 5000


def _quantile_keys() -> list[str]:
    return [f'q{int(round(q * 100)):02d}' for q in QUANTILES]


def _vector_stats(rows: np.ndarray) -> dict[str, np.ndarray]:
    """Stats of (N, D) values per dimension (see the module docstring), arrays of shape (D,)."""
    rows = rows.astype(np.result_type(rows.dtype, np.float32), copy=False)
    n = rows.shape[0]
    if n < 2:
        mean = np.mean(rows, axis=0)
        out = {'min': np.min(rows, axis=0), 'max': np.max(rows, axis=0), 'mean': mean, 'std': np.std(rows, axis=0)}
        out.update({k: mean.copy() for k in _quantile_keys()})
        return out
    lo, hi = np.min(rows, axis=0), np.max(rows, axis=0)
    mean = np.mean(rows, axis=0)
    var = np.mean(rows ** 2, axis=0) - mean ** 2
    out = {'min': lo, 'max': hi, 'mean': mean, 'std': np.sqrt(np.maximum(0, var))}
    quantiles = np.zeros((len(QUANTILES), rows.shape[1]))
    for d in range(rows.shape[1]):
        edges = np.linspace(lo[d] - 1e-10, hi[d] + 1e-10, QUANTILE_BINS + 1)
        cum = np.cumsum(np.histogram(rows[:, d], bins=edges)[0])
        for j, q in enumerate(QUANTILES):
            quantiles[j, d] = _from_histogram(cum, edges, q * n)
    out.update({k: quantiles[j] for j, k in enumerate(_quantile_keys())})
    return out


def _from_histogram(cum: np.ndarray, edges: np.ndarray, target: float) -> float:
    """The value below which ``target`` of the counts lie, interpolated in its bin (cum: cumulative counts)."""
    i = int(np.searchsorted(cum, target))
    if i == 0:
        return float(edges[0])
    if i >= len(cum):
        return float(edges[-1])
    before, inside = cum[i - 1], cum[i] - cum[i - 1]
    if inside == 0:
        return float(edges[i])
    return float(edges[i] + (target - before) / inside * (edges[i + 1] - edges[i]))


def feature_stats(array: np.ndarray) -> dict[str, np.ndarray]:
    """Return the stats of an (N,) or (N, D) feature over its N frames; (N,) keeps a length-1 axis.

    :param array: the episode's values of one feature (float, int or bool).
    :returns: ``min, max, mean, std, q01..q99`` of shape (D,) (or (1,)) and ``count`` = [N].
    """
    arr = np.asarray(array)
    rows = arr.reshape(-1, 1) if arr.ndim == 1 else arr
    out = _vector_stats(rows)
    out['count'] = np.array([len(arr)])
    return out


class ImageStats:
    """Per-channel stats of uint8 sampled frames, accumulated one frame at a time in constant memory.

    A uint8 channel takes 256 values, so a per-value count (``np.bincount``) holds everything: min, max,
    mean and mean of squares come from it exactly, and LeRobot's 5,000-bin histogram over
    ``[min - 1e-10, max + 1e-10]`` is the per-value counts placed in those bins (the same counts
    ``np.histogram`` gives on the pixels). LeRobot holds every sampled pixel in float32 at once
    (gigabytes for a long episode); this holds 256 counts per channel.
    """

    def __init__(self) -> None:
        self.frames = 0
        self._counts: np.ndarray | None = None   # (C, 256) int64

    def add(self, chw: np.ndarray) -> None:
        """Count one uint8 (C, H, W) frame (already downsampled as LeRobot samples it)."""
        counts = np.stack([np.bincount(chw[c].reshape(-1), minlength=256) for c in range(chw.shape[0])])
        self._counts = counts if self._counts is None else self._counts + counts
        self.frames += 1

    def result(self) -> dict[str, np.ndarray]:
        """Return min, max, mean, std, q01..q99 divided by 255, shaped (C, 1, 1), and ``count`` = [frames].

        :raises ValueError: before any frame was added.
        """
        counts = self._counts
        if counts is None:
            raise ValueError('image stats of no frame')
        values = np.arange(256, dtype=np.float64)
        out: dict[str, list[float]] = {}
        for c in range(counts.shape[0]):
            n = counts[c].sum()
            present = np.flatnonzero(counts[c])
            lo, hi = float(present[0]), float(present[-1])
            mean = float((values * counts[c]).sum() / n)
            var = float((values ** 2 * counts[c]).sum() / n) - mean ** 2
            row = {'min': lo, 'max': hi, 'mean': mean, 'std': float(np.sqrt(max(0.0, var)))}
            if n < 2:
                row.update({k: mean for k in _quantile_keys()})
            else:
                edges = np.linspace(lo - 1e-10, hi + 1e-10, QUANTILE_BINS + 1)
                cum = np.cumsum(np.histogram(values, bins=edges, weights=counts[c])[0])
                row.update({k: _from_histogram(cum, edges, q * n) for k, q in zip(_quantile_keys(), QUANTILES,
                                                                                    strict=True)})
            for k, v in row.items():
                out.setdefault(k, []).append(v)
        stats = {k: (np.array(v) / 255.0).reshape(-1, 1, 1) for k, v in out.items()}
        stats['count'] = np.array([self.frames])
        return stats


def image_stats(samples: np.ndarray) -> dict[str, np.ndarray]:
    """Return per-channel stats of uint8 (S, 3, H, W) sampled frames, divided by 255, shaped (3, 1, 1).

    ``count`` is S (the number of sampled frames), as LeRobot's. See :class:`ImageStats`.
    """
    acc = ImageStats()
    for chw in samples:
        acc.add(chw)
    return acc.result()


def aggregate(episodes: list[dict[str, dict[str, np.ndarray]]]) -> dict[str, dict[str, np.ndarray]]:
    """Combine per-episode stats into a dataset's (count-weighted; see the module docstring)."""
    out: dict[str, dict[str, np.ndarray]] = {}
    for key in dict.fromkeys(k for ep in episodes for k in ep):
        parts = [ep[key] for ep in episodes if key in ep]
        counts = np.stack([np.asarray(p['count']) for p in parts]).astype(np.float64)
        total = counts.sum(axis=0)
        means = np.stack([p['mean'] for p in parts])
        w = counts.reshape(counts.shape + (1,) * (means.ndim - counts.ndim))
        mean = (means * w).sum(axis=0) / total
        var = ((np.stack([p['std'] for p in parts]) ** 2 + (means - mean) ** 2) * w).sum(axis=0) / total
        agg = {'min': np.min(np.stack([p['min'] for p in parts]), axis=0),
               'max': np.max(np.stack([p['max'] for p in parts]), axis=0),
               'mean': mean, 'std': np.sqrt(var), 'count': total.astype(np.int64)}
        for q in _quantile_keys():
            if all(q in p for p in parts):
                agg[q] = (np.stack([p[q] for p in parts]) * w).sum(axis=0) / total
        out[key] = agg
    return out


def finite(stats: dict[str, dict[str, np.ndarray]]) -> bool:
    """Return True when every stat value is finite (an export refuses to write NaN or Inf)."""
    return all(np.all(np.isfinite(np.asarray(v, np.float64))) for s in stats.values() for v in s.values())


def to_json(stats: dict[str, dict[str, np.ndarray]]) -> dict[str, dict[str, Any]]:
    """Return the stats with arrays as nested lists (LeRobot's ``serialize_dict``)."""
    return {key: {k: np.asarray(v).tolist() for k, v in s.items()} for key, s in stats.items()}
