"""Playing an episode's chunks: the live chunk, the stale skip, aggregation, seams, holds, the executed count.

``executed`` counts chunk steps really executed. An action emitted at one tick counts as executed at the
next (:meth:`Player.advance`): by step (act/run pacing, and every delta or velocity space) exactly the chunk
steps the emitted action covered, from the chunk that covered them, whichever chunk plays by then; on the
clock, the time since the emission. A chunk that arrives takes its place on that count: its row 0 is the
step its observation fell in, and the rows the robot already executed are skipped by counting
(:meth:`Player.take`), never by estimating from time.
"""

from __future__ import annotations

from typing import Literal

import numpy as np

from sequence_ai_ros.client import aggregate as ensemble
from sequence_ai_ros.client import resample
from sequence_ai_ros.client.records import LiveChunk
from sequence_ai_ros.client.tally import Tally
from sequence_ai_ros.exceptions import ContractViolation
from sequence_ai_ros.protocol.contract import Contract
from sequence_ai_ros.protocol.messages import Chunk
from sequence_ai_ros.protocol.spaces import ActionSpace, position_mask, rest_mask
from sequence_ai_ros.protocol.types import Action, Observation

_EPS = 1e-9


class Player:
    """One episode's playback (no I/O, no clock of its own; the engine's lock is held on every call).

    :param contract: the policy's contract. :param space: the action space expected of every chunk.
    :param smooth_seam: rows cross-faded at a chunk switch (absolute spaces, latest_only).
    :param coeff: the ensembling coefficient (aggregating absolute spaces), or None for latest_only.
    :param by_step: advance by the emitted chunk steps, else by the clock.
    :param tally: where the counts go.
    """

    def __init__(self, contract: Contract, space: ActionSpace, smooth_seam: int, coeff: float | None,
                 by_step: bool, tally: Tally) -> None:
        self.contract, self.space, self.smooth_seam, self.coeff = contract, space, smooth_seam, coeff
        self.by_step, self.tally = by_step, tally
        self.mask = position_mask(space, contract.action_dim)
        self._rest = rest_mask(space, contract.action_dim)
        #: the chunk being played (None before the first)
        self.live: LiveChunk | None = None
        #: chunk steps executed (see the module docstring)
        self.executed = 0.0
        self._emitted: tuple[float, float] | None = None   # the last emission: (when, chunk steps it covered)
        #: the emitted tick's parts (see Step.pieces): (values, shares), or None
        self.pieces: tuple[np.ndarray, np.ndarray] | None = None
        #: the last command (float32 (A,)), None before the first action
        self.last_values: np.ndarray | None = None
        self.last_raw: np.ndarray | None = None          # the last action as read from its chunk
        self._prev: tuple[np.ndarray, float] | None = None   # the rows and origin of the chunk last read
        self._last_number = -1

    # -- the timeline ------------------------------------------------------------------------------

    @property
    def left(self) -> float:
        """Chunk steps the live chunk has left (0 without one)."""
        live = self.live
        return max(0.0, live.length - live.pos) if live is not None else 0.0

    def playing(self) -> bool:
        """True when the live chunk has a row left to read."""
        return self.live is not None and self.live.pos < self.live.length - _EPS

    def pending(self, now: float, to_limit: float) -> float:
        """Chunk steps the last emitted action will have executed by ``now`` (s), never past ``to_limit``."""
        if self._emitted is None or self.live is None:
            return 0.0
        at, ran = self._emitted
        adv = ran if self.by_step else min((now - at) / self.live.dt, self.left)
        return max(0.0, min(adv, to_limit))

    def advance(self, now: float, to_limit: float) -> None:
        """Count the last emitted action as executed (by step: what it covered; on the clock: the time since)."""
        live = self.live
        if self._emitted is not None and live is not None:
            at, ran = self._emitted
            if self.by_step:
                # exactly what the emission covered, from the chunk that covered it: a chunk that arrived since
                # was placed on the count before it, so it moves on by the same steps
                adv = max(0.0, min(ran, to_limit))
            else:
                want = (now - at) / live.dt
                whole = live.length - live.pos
                adv = max(0.0, min(want, whole, to_limit))
                if want > whole + _EPS and whole < to_limit:
                    # the chunk ran out between two ticks: the dry spell began when it did, not at this tick
                    self.tally.dry_begins(at + whole * live.dt)
            live.pos = min(float(live.length), live.pos + adv)
            self.executed = _snap(self.executed + adv)
            live.pos = _snap(live.pos)
        self._emitted = None

    # -- emitting ----------------------------------------------------------------------------------

    def emit(self, obs: Observation, now: float, s: float) -> tuple[Action, float, float]:
        """Read the live chunk for a tick of ``s`` chunk steps; return (action, steps it covers, ``s``).

        :raises ContractViolation: joint_delta without a measured state to integrate the first increment onto.
        """
        live = self.live
        assert live is not None
        if live.seam is not None:
            old, offset = live.seam
            live.actions = resample.blend_seam(live.actions, live.pos, old, offset, self.smooth_seam)
            live.seam = None
        raw = resample.sample(live.actions, live.space, live.pos, s, self.mask)
        self.pieces = None if self.mask.all() else resample.pieces(live.actions, live.space, live.pos, s, self.mask)
        delta = None
        values = raw
        if live.space is ActionSpace.JOINT_DELTA:
            base = self.last_values if self.last_values is not None else self.measured(obs)
            if base is None:
                raise ContractViolation('joint_delta needs the measured state (named like the actions, or of the '
                                        'action dimension) to integrate the first increment onto')
            delta, values = raw, (base.astype(np.float32) + raw).astype(np.float32)
        elif live.space.is_delta:
            delta = raw
        if live.number != self._last_number:
            self.tally.stale += live.pos          # rows of this chunk that will never run (stale at its arrival)
            if self.last_raw is not None:
                self.tally.seam(raw - self.last_raw, self._seam_gap(live, raw, s))
        self._last_number = live.number
        live.read = True
        self._prev = (live.actions, live.origin)
        self.tally.dry_ends(now)
        self.last_raw, self.last_values = raw, values
        ran = min(s, live.length - live.pos) if self.by_step else s
        self._emitted = (now, ran)
        action = Action(values=values, action_space=live.space, names=tuple(self.contract.action_names),
                        chunk=live.number, index=live.pos, hold=False, delta=delta)
        return action, ran, s

    def _seam_gap(self, live: LiveChunk, raw: np.ndarray, s: float) -> np.ndarray | None:
        """The new chunk against the old one's own row for the same step (None past the old one's last row)."""
        prev = self._prev
        if prev is None:
            return None
        p_old = live.origin + live.pos - prev[1]
        if not 0.0 <= p_old <= prev[0].shape[0] - 1 + _EPS:
            return None
        gap: np.ndarray = raw - resample.sample(prev[0], live.space, p_old, s, self.mask)
        return gap

    def measured(self, obs: Observation) -> np.ndarray | None:
        """The observation's state in the action's order (float32 (A,)), or None when it cannot be read so."""
        names = self.contract.action_names
        if obs.state_names and all(n in obs.state_names for n in names):
            idx = [obs.state_names.index(n) for n in names]
            return obs.state[idx].astype(np.float32)
        if obs.state.shape[0] == len(names):
            return obs.state.astype(np.float32)
        return None

    def hold(self, obs: Observation) -> Action | None:
        """The hold: the last command (rates zeroed), or the measured state before any; None with neither."""
        live = self.live
        chunk, index = (live.number, live.pos) if live is not None else (0, 0.0)
        if self.last_values is not None:
            values = self.last_values.copy()
            values[self._rest] = 0.0            # a rate holds by commanding no motion; positions stay
        elif self.space in (ActionSpace.JOINT_ABSOLUTE, ActionSpace.JOINT_DELTA):
            values = self.measured(obs)
            if values is None:
                return None
        else:
            return None
        delta = np.zeros_like(values) if self.space.is_delta else None
        return Action(values=values, action_space=self.space, names=tuple(self.contract.action_names),
                      chunk=chunk, index=index, hold=True, delta=delta)

    # -- chunks ------------------------------------------------------------------------------------

    def take(self, chunk: Chunk, dt: float, origin: float, request_id: int) -> Literal['played', 'stale', 'overtaken']:
        """Play ``chunk`` (row 0 at chunk step ``origin``) from the executed count on; say what became of it.

        ``played``: latest_only replaces the live chunk (a seam to blend at its first read); aggregating folds
        it into the rows still to play. ``stale``: every row was already executed (by step: or will be by the
        action emitted last). ``overtaken`` (latest_only):
        the live chunk answers a later request (pipelined answers may arrive out of order). Both are discarded.
        """
        tally = self.tally
        skip = max(0.0, self.executed - origin)
        length = chunk.actions.shape[0]
        # by step, the action emitted last runs on whichever chunk plays next: a chunk that ends before that
        # action does could not carry it (it would run dry in the middle of a step)
        pending = self._emitted[1] if self.by_step and self._emitted is not None and self.live is not None else 0.0
        if skip + pending >= length - _EPS:
            tally.stale += length
            tally.discarded += 1
            return 'stale'
        old = self.live
        if self.coeff is None and old is not None and request_id < old.request_id:
            # an answer overtaken by a newer one (pipelined requests answered out of order): the newer chunk saw
            # a later observation, and stays
            tally.discarded += 1
            return 'overtaken'
        number = tally.chunks - 1
        if self.coeff is not None:
            self.live = self._folded(old, chunk, dt, skip, origin, request_id, number)
            return 'played'
        if old is not None and not old.read:
            tally.discarded += 1   # replaced before any tick read it
        seam = None
        if old is not None and self.smooth_seam > 0 and self.space.is_absolute:
            if old.read or old.seam is None:
                seam = (old.actions, old.pos - skip)   # blended at its first read, once its start is known
            else:   # the old chunk never played: blend from what did (its own seam's rows), not from it
                seam = (old.seam[0], old.seam[1] + old.pos - skip)
        self.live = LiveChunk(chunk.actions, chunk.action_space, dt, number, chunk.done, skip, seam,
                              origin=origin, request_id=request_id)
        return 'played'

    def _folded(self, old: LiveChunk | None, chunk: Chunk, dt: float, skip: float, origin: float, request_id: int,
                number: int) -> LiveChunk:
        """The playing rows with ``chunk`` folded in (aggregate, coefficient ``coeff``): from its first step on."""
        assert self.coeff is not None
        rows, counts = chunk.actions, np.ones(chunk.actions.shape[0], np.int64)
        if old is not None and old.counts is not None and old.pos < old.length - _EPS:
            offset = int(round(origin - old.origin))          # both whole steps (see RequestSchedule)
            rows, counts = ensemble.merge(old.actions, old.counts, chunk.actions, offset, self.coeff,
                                          extend=not chunk.done)
        return LiveChunk(rows, chunk.action_space, dt, number, chunk.done, skip, None, origin=origin,
                         request_id=request_id, read=False, counts=counts)


def _snap(x: float) -> float:
    """``x`` rounded to a whole step when within float noise of one."""
    return float(round(x)) if abs(x - round(x)) < 1e-7 else x


__all__ = ['Player']
