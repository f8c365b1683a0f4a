"""Aggregating overlapping chunks for one step: ACT's temporal ensembling, as an online running average.

A chunk answering an observation taken at step ``o`` holds the policy's actions for steps ``o .. o + T - 1``.
When the robot requests at every step, up to T chunks predict the same step. ``latest_only`` keeps the
newest chunk's row (the engine's default: the new chunk replaces the old). ``weighted_average`` is ACT's
temporal ensembling (Zhao et al. 2023, "Learning Fine-Grained Bimanual Manipulation with Low-Cost
Hardware", Algorithm 2; LeRobot's ``ACTTemporalEnsembler``): the step's action is
``sum_i w_i a_i / sum_i w_i`` over its predictions, ``w_i = exp(-m * i)``, ``i = 0`` the oldest (m > 0 weighs
older predictions more; ACT's default m = 0.01). ``average`` is the same with m = 0.

It is computed online, as LeRobot does: each step keeps its running average ``A_n`` and count ``n``; a new
prediction ``a`` makes ``A_{n+1} = (A_n * C_{n-1} + a * w_n) / C_n`` with ``C_k = w_0 + ... + w_k``. The two
factors ``C_{n-1} / C_n`` and ``w_n / C_n`` are computed in log space (``log C_k`` by log-sum-exp), so they lie in
[0, 1] for any finite m: a large negative m (``exp(-m * i)`` overflows float64 from ``-m * i > 709``) weighs the
newest prediction almost alone instead of giving inf / inf = NaN.
"""

from __future__ import annotations

import numpy as np

from sequence_ai_ros.protocol.contract import AGGREGATES


def coefficient(aggregate: str, temporal_ensemble_coeff: float) -> float | None:
    """Return the ensembling coefficient m of ``aggregate``, or None for latest_only (no ensembling).

    :raises ValueError: for an unknown aggregate.
    """
    if aggregate not in AGGREGATES:
        raise ValueError(f'aggregate {aggregate!r}: one of {", ".join(AGGREGATES)}')
    if aggregate == 'latest_only':
        return None
    return float(temporal_ensemble_coeff) if aggregate == 'weighted_average' else 0.0


def _factors(coeff: float, n: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``C_{n-1} / C_n`` and ``w_n / C_n`` for each count n >= 1, float64, stable for any finite m."""
    log_w = -float(coeff) * np.arange(int(n.max()) + 1, dtype=np.float64)
    log_c = np.logaddexp.accumulate(log_w)                   # log C_k = log(w_0 + ... + w_k)
    return np.exp(log_c[n - 1] - log_c[n]), np.exp(log_w[n] - log_c[n])


def merge(old: np.ndarray, old_counts: np.ndarray, new: np.ndarray, offset: int, coeff: float,
          *, extend: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Fold a new chunk into the running ensemble.

    :param old: float32 (T', D) the ensemble so far, row j = step ``old_origin + j``.
    :param old_counts: int (T',) the predictions averaged in each old row (>= 1).
    :param new: float32 (T, D) the new chunk, row i = step ``old_origin + offset + i``.
    :param offset: the new chunk's first step minus the old one's (whole steps; negative for a chunk older
        than the ensemble's start, which then only joins the steps both cover).
    :param coeff: m (weights ``exp(-m * i)``, i = 0 the oldest prediction of a step).
    :param extend: keep the old rows past the new chunk's end (False: the new chunk is the last).
    :returns: (float32 (L, D) rows from the new chunk's first step, int (L,) counts); L = T, or the old
        chunk's end when it reaches further and ``extend``.
    :raises ValueError: when a merged row is not finite (a non-finite input; never from m alone).
    """
    t_new, t_old = new.shape[0], old.shape[0]
    length = max(t_new, t_old - offset) if extend else t_new
    rows = np.empty((length, new.shape[1]), np.float32)
    counts = np.ones(length, np.int64)
    j = np.arange(length) + offset                        # each output row's index in the old ensemble
    both = (np.arange(length) < t_new) & (j >= 0) & (j < t_old)
    only_new = (np.arange(length) < t_new) & ~both
    only_old = ~both & ~only_new
    rows[only_new] = new[np.arange(length)[only_new]]
    rows[only_old] = old[j[only_old]]
    counts[only_old] = old_counts[j[only_old]]
    if both.any():
        n = old_counts[j[both]].astype(np.int64)               # predictions so far: the new one is the n-th
        keep, take = _factors(coeff, n)
        avg = old[j[both]].astype(np.float64) * keep[:, None]
        avg += new[np.arange(length)[both]].astype(np.float64) * take[:, None]
        rows[both] = avg.astype(np.float32)
        counts[both] = n + 1
    if not np.isfinite(rows).all():
        raise ValueError(f'temporal ensembling (m={coeff}) produced non-finite rows from finite chunks')
    return rows, counts


def offline(predictions: list[np.ndarray], coeff: float) -> np.ndarray:
    """ACT's formula for one step, offline: float64 (D,) ``sum_i w_i a_i / sum_i w_i``, oldest first.

    :param predictions: the step's predicted actions, float (D,) each, oldest first.
    """
    log_w = -float(coeff) * np.arange(len(predictions), dtype=np.float64)
    w = np.exp(log_w - log_w.max())                          # scaled by the largest weight: no overflow
    mean: np.ndarray = (w[:, None] * np.stack(predictions).astype(np.float64)).sum(axis=0) / w.sum()
    return mean


__all__ = ['coefficient', 'merge', 'offline']
