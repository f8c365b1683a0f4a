"""Reading a chunk at any position: resampling to the caller's period, and blending seams.

A chunk is float32 (T, D); row i is the action for chunk step i, which lasts ``dt`` seconds. A caller
ticking at another period reads it at fractional positions ``p`` (in chunk steps):

- position channels (absolute spaces, and the gripper of joint_velocity / ee_delta) are interpolated
  linearly between rows ``floor(p)`` and ``floor(p) + 1``, and held at the last row;
- rate channels (joint_delta and ee_delta increments per step, joint_velocity in rad/s) are
  integrated over the interval ``[p, p + s)`` the tick covers (``s`` = caller period / dt), so the
  motion over a chunk is the recorded one at any caller rate: an increment becomes the sum of the
  covered fractions of rows, a velocity their mean.

At integer positions with ``s == 1`` both return row ``p`` unchanged (byte-identical).

Seams: :func:`blend_seam` cross-fades the first N rows of a new chunk from the old chunk's
continuation, linearly: ``w_k = (k + 1) / (N + 1)`` for the new chunk. The weights are those of a
linear cross-fade; the idea of blending overlapping chunk predictions is ACT's temporal ensembling
(Zhao et al., 2023, "Learning Fine-Grained Bimanual Manipulation with Low-Cost Hardware", sec. IV-B),
and of fading the previous chunk's influence out across the overlap is the soft mask of Real-Time
Chunking (Black et al., 2025, arXiv:2506.07339, eq. 5), whose exponential ramp we replace by a linear
one: for a gap G between the chunks, the largest per-step change the seam adds is G / (N + 1), the
smallest any N-step fade can reach.
"""

from __future__ import annotations

import math

import numpy as np

from sequence_ai_ros.protocol.spaces import ActionSpace, position_mask


def interpolate(actions: np.ndarray, p: float) -> np.ndarray:
    """Return float32 (D,): rows linearly interpolated at position ``p`` (chunk steps), held past the end."""
    last = len(actions) - 1
    if p <= 0:
        return np.copy(actions[0])
    if p >= last:
        return np.copy(actions[last])
    i = int(math.floor(p))
    f = p - i
    if f == 0.0:
        return np.copy(actions[i])
    return np.asarray((1.0 - f) * actions[i].astype(np.float64) + f * actions[i + 1].astype(np.float64),
                      dtype=np.float32)


def integrate(actions: np.ndarray, p: float, s: float) -> np.ndarray:
    """Return float64 (D,): the integral of the piecewise-constant rows over ``[p, min(p + s, T))``, in row-steps.

    :param p: start position (chunk steps), >= 0.
    :param s: length of the interval (chunk steps), > 0.
    """
    t = actions.shape[0]
    end = min(p + s, float(t))
    out = np.zeros(actions.shape[1], dtype=np.float64)
    i = int(math.floor(p))
    while i < t and i < end:
        lo, hi = max(p, float(i)), min(end, float(i + 1))
        if hi > lo:
            out += (hi - lo) * actions[i].astype(np.float64)
        i += 1
    return out


def sample(actions: np.ndarray, space: ActionSpace, p: float, s: float, mask: np.ndarray | None = None) -> np.ndarray:
    """Return float32 (D,): the chunk read at position ``p`` for a tick of ``s`` chunk steps.

    :param actions: float32 (T, D).
    :param space: the chunk's action space.
    :param p: position (chunk steps), 0 <= p < T.
    :param s: the caller's period in chunk steps (period / dt), > 0.
    :param mask: :func:`position_mask` for the chunk (computed when None).
    """
    i = int(math.floor(p))
    if p == i and s == 1.0:
        return np.copy(actions[i])
    mask = position_mask(space, actions.shape[1]) if mask is None else mask
    out = np.empty(actions.shape[1], dtype=np.float32)
    if mask.any():
        out[mask] = interpolate(actions, p)[mask]
    if not mask.all():
        total = integrate(actions, p, s)
        if space is ActionSpace.JOINT_VELOCITY:
            covered = min(p + s, float(actions.shape[0])) - p
            total = total / max(covered, 1e-12)   # mean velocity over the tick (rad/s)
        out[~mask] = total[~mask].astype(np.float32)
    return out


def pieces(actions: np.ndarray, space: ActionSpace, p: float, s: float,
           mask: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """Split a tick of ``s`` chunk steps at ``p`` at the chunk-step boundaries it crosses.

    :returns: ``(values, share)``: float32 (P, D) the tick read over each part (:func:`sample` of the part:
        rate channels integrated or averaged over it, position channels at its start), and float64 (P,) each
        part's share of the tick (summing to 1); None when the tick lies within one chunk step.
    """
    t = actions.shape[0]
    end = min(p + s, float(t))
    cuts = [p] + [float(i) for i in range(int(math.floor(p)) + 1, int(math.ceil(end - 1e-9)))] + [end]
    if len(cuts) <= 2 or end - p <= 1e-12:
        return None
    values = np.stack([sample(actions, space, a, b - a, mask) for a, b in zip(cuts[:-1], cuts[1:], strict=True)])
    share = np.diff(np.asarray(cuts, np.float64)) / (end - p)
    return values.astype(np.float32), share


def blend_seam(new: np.ndarray, start: float, old: np.ndarray, offset: float, n: int) -> np.ndarray:
    """Cross-fade the first ``n`` rows of ``new`` from ``old``'s continuation (absolute spaces only).

    :param new: float32 (T, D) the arriving chunk.
    :param start: position in ``new`` the next tick reads (the stale rows before it are skipped).
    :param old: float32 (T', D) the chunk being replaced.
    :param offset: ``old`` position minus ``new`` position for the same instant; past the end of ``old``
        its last row continues (the arm holds it).
    :param n: rows to blend (N >= 1).
    :returns: a float32 copy of ``new`` whose rows ``floor(start) .. floor(start) + n - 1`` are
        ``(1 - w_k) * old_continuation + w_k * new`` with ``w_k = (k + 1) / (n + 1)``.
    """
    out = np.array(new, dtype=np.float32, copy=True)
    first = int(math.floor(start))
    for k in range(n):
        r = first + k
        if r >= out.shape[0]:
            break
        w = (k + 1) / (n + 1)
        cont = interpolate(old, max(0.0, r + offset)).astype(np.float64)
        out[r] = ((1.0 - w) * cont + w * new[r].astype(np.float64)).astype(np.float32)
    return out
