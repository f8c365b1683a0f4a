"""Per-episode feature statistics, as LeRobot v2.1 writes them in ``meta/episodes_stats.jsonl``.

The formulas are LeRobot's (huggingface/lerobot ``datasets/compute_stats.py``: ``estimate_num_samples``,
``sample_indices``, ``auto_downsample_height_width``, ``get_feature_stats``, ``compute_episode_stats``),
re-implemented here so exports need neither torch nor LeRobot:

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


def feature_stats(array: np.ndarray) -> dict[str, np.ndarray]:
    """Return min/max/mean/std over axis 0 (keeping the axis for (N,) arrays) and count [N]."""
    keep = array.ndim == 1
    return {'min': np.min(array, axis=0, keepdims=keep), 'max': np.max(array, axis=0, keepdims=keep),
            'mean': np.mean(array, axis=0, keepdims=keep), 'std': np.std(array, axis=0, keepdims=keep),
            'count': np.array([len(array)])}


def image_stats(samples: np.ndarray) -> dict[str, np.ndarray]:
    """Return per-channel stats of uint8 (S, 3, H, W) sampled frames, normalised to 0..1, shaped (3, 1, 1)."""
    axes = (0, 2, 3)
    values = samples.astype(np.float32)  # one conversion (LeRobot reduces uint8 in float64: same to ~1e-7)
    out = {'min': np.min(samples, axis=axes, keepdims=True), 'max': np.max(samples, axis=axes, keepdims=True),
           'mean': np.mean(values, axis=axes, keepdims=True, dtype=np.float64),
           'std': np.std(values, axis=axes, keepdims=True, dtype=np.float64)}
    stats = {k: np.squeeze(v / 255.0, axis=0) for k, v in out.items()}
    stats['count'] = np.array([len(samples)])
    return stats


def to_json(stats: dict[str, dict[str, np.ndarray]]) -> dict[str, dict[str, Any]]:
    """Return the stats with arrays as nested lists (LeRobot's ``serialize_dict``)."""
    return {key: {k: np.asarray(v).tolist() for k, v in s.items()} for key, s in stats.items()}
