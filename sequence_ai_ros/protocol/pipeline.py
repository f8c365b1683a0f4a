"""Pipelined requests: completing a request's committed prefix on the worker (``splice_tail``).

With more than one request in flight, the robot builds a request's ``chunk_tail`` from the chunk it is
playing, but by the time that request's chunk starts, chunks the robot has not received yet (answers
to its earlier requests) will have taken over. The worker answers one episode's requests in order, so it
knows them: :class:`TailSplicer` overwrites the tail with each newer chunk's rows, in order (the robot
switches to a chunk when it arrives, at the latest at its start step). A policy that in-paints
``chunk_tail[:expected_delay_actions]`` (real-time chunking, Black et al. 2025, arXiv:2506.07339) then
in-paints exactly what the robot will execute.

Steps are the episode's chunk steps (``observation_step``); a chunk's row ``i`` is step ``origin + i`` and
it is used from ``origin + expected_delay_actions`` on.
"""

from __future__ import annotations

import collections
from typing import Any

import numpy as np

from sequence_ai_ros.protocol import codec
from sequence_ai_ros.protocol import sequence_ai_pb2 as pb

#: Answered chunks remembered per episode (more than any in-flight bound).
KEEP = 32


class TailSplicer:
    """One episode's answered chunks, to complete later requests' tails. Not thread-safe (one stream).

    Per request it costs little when nothing is to splice (a robot with one request in flight): a chunk is
    decoded from its message only when a later request needs its rows, and a request whose tail is newer
    than every answered chunk returns at once.
    """

    def __init__(self, keep: int = KEEP) -> None:
        #: request id -> [origin step, start step, the chunk's actions: its Tensor until first used, then the array]
        self._chunks: collections.OrderedDict[int, list[Any]] = collections.OrderedDict()
        self._keep = keep
        self._newest = -1       # the largest request id recorded

    def complete(self, req: pb.ObservationRequest, action_dim: int) -> None:
        """Overwrite ``req.chunk_tail`` in place with the rows of chunks newer than ``req.tail_request_id``.

        A request without ``splice_tail`` is left untouched.

        :raises ContractViolation: for a malformed chunk_tail.
        """
        if not req.splice_tail:
            return
        since = req.tail_request_id
        if self._newest <= since:       # no answer newer than the robot's tail
            return
        rid = req.request_id
        newer = [_decoded(c) for k, c in self._chunks.items() if since < k < rid]
        if not newer:
            return
        tail = (codec.from_tensor(req.chunk_tail, what='chunk_tail', dtype='float32', ndim=2)
                if req.HasField('chunk_tail') else np.zeros((0, action_dim), np.float32))
        if tail.shape[1:] != (action_dim,):
            return
        origin = req.observation_step
        offsets = [c_origin - origin for c_origin, _, _ in newer]
        if all(float(d).is_integer() for d in offsets):
            spliced = _overlay(tail, [(int(d), actions) for d, (_, _, actions) in zip(offsets, newer, strict=True)])
        else:
            spliced = _overlay_rows(tail, newer, origin)
        if spliced is None:      # a gap (should not happen): keep what the robot sent
            return
        req.chunk_tail.CopyFrom(codec.to_tensor(spliced, 'float32'))

    def record(self, req: pb.ObservationRequest, chunk: pb.ActionChunk) -> None:
        """Remember the answer to a spliced request (its rows, origin and start step)."""
        if not req.splice_tail:
            return
        rid, origin = req.request_id, req.observation_step
        self._chunks[rid] = [origin, origin + req.expected_delay_actions, chunk.actions]
        self._newest = max(self._newest, rid)
        while len(self._chunks) > self._keep:
            self._chunks.popitem(last=False)


def _decoded(entry: list[Any]) -> tuple[float, float, np.ndarray]:
    """A recorded chunk as ``(origin, start, actions)``, its actions decoded (once) from its Tensor."""
    actions = entry[2]
    if not isinstance(actions, np.ndarray):
        actions = entry[2] = codec.from_tensor(actions, what='chunk', dtype='float32', ndim=2)
    return entry[0], entry[1], actions


def _overlay(tail: np.ndarray, chunks: list[tuple[int, np.ndarray]]) -> np.ndarray | None:
    """Overlay each chunk (in order) on ``tail`` from row ``offset`` on, as slices; None on a gap.

    The same rows as :func:`_overlay_rows` for whole-step offsets, without a Python step per row.
    """
    spans = sorted((max(offset, 0), offset + actions.shape[0]) for offset, actions in chunks
                   if actions.shape[0] and offset + actions.shape[0] > 0)
    end = tail.shape[0]
    for start, stop in spans:      # the rows covered must be one run from 0
        if start > end:
            return None
        end = max(end, stop)
    out = np.empty((end, tail.shape[1]), np.float32)
    out[:tail.shape[0]] = tail
    for offset, actions in chunks:
        skip = max(0, -offset)
        if skip < actions.shape[0]:
            out[offset + skip:offset + actions.shape[0]] = actions[skip:]
    return out


def _overlay_rows(tail: np.ndarray, newer: list[tuple[float, float, np.ndarray]], origin: float
                  ) -> np.ndarray | None:
    """Row by row, rounding each step (fractional offsets); None on a gap."""
    rows = {i: tail[i] for i in range(tail.shape[0])}
    for c_origin, _, actions in newer:
        # The robot plays a chunk from its arrival on, which can be before its start step: its rows
        # before the start are the plan it in-painted, so overlaying from its row 0 is exact for an
        # in-painting policy and, for any other, what the robot will really play once it arrives.
        for i in range(actions.shape[0]):
            k = int(round(c_origin + i - origin))
            if k >= 0:
                rows[k] = actions[i]
    n = max(rows) + 1 if rows else 0
    if any(k not in rows for k in range(n)):
        return None
    return np.stack([rows[k] for k in range(n)]).astype(np.float32) if n else tail


__all__ = ['KEEP', 'TailSplicer']
