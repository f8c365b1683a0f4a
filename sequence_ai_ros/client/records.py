"""The chunk engine's records and constants: requests out, requests in flight, the chunk being played.

Kept apart from :mod:`.engine` (the timeline logic) so that each stays small; the engine re-exports them.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from sequence_ai_ros.protocol.contract import Contract
from sequence_ai_ros.protocol.spaces import ActionSpace
from sequence_ai_ros.protocol.types import Observation

#: The prefetch lead is never less than this share of the playing chunk's covers_seconds: a stall of the
#: robot's own process (GC, a loaded core) between two ticks must not eat the whole measured margin. With
#: a 0 ms policy the measured lead alone is ~2 ticks; the floor costs only more, earlier requests.
MIN_LEAD_FRACTION = 0.25
#: The no-chunk deadline: a request unanswered for longer than
#: ``max(CHUNK_TIMEOUT_MIN_S, CHUNK_TIMEOUT_COVERS * covers_seconds)`` (s) ends the episode with reason
#: 'error' and a :class:`~sequence_ai_ros.exceptions.PolicyException` (a hung inference must not leave
#: the arm in one endless underrun). Overridden per episode by ``chunk_timeout``.
CHUNK_TIMEOUT_MIN_S = 10.0
CHUNK_TIMEOUT_COVERS = 10.0
#: Requests in flight at most (pipelining). A new request leaves while fewer are in flight and the chunks
#: played or awaited cover less than the prefetch lead; with a round trip under about half a chunk that
#: is never more than one (the single-request behaviour). ``Policy.max_in_flight`` overrides it (1: off).
MAX_IN_FLIGHT = 16
#: While a deployment loads, readiness is asked again after a quarter of the worker's estimate of the time
#: left, within [READY_POLL_MIN_S, READY_POLL_MAX_S] (s): ``Policy.wait_until_ready``'s Ready calls, and an
#: episode's request the worker refused while it warms (:func:`ready_poll_s`).
READY_POLL_MIN_S = 0.02
READY_POLL_MAX_S = 0.2


def chunk_timeout_s(contract: Contract, chunk_timeout: float | None = None) -> float:
    """The no-chunk deadline (s): ``chunk_timeout`` when given, else the default from the contract."""
    if chunk_timeout is not None:
        return float(chunk_timeout)
    return max(CHUNK_TIMEOUT_MIN_S, CHUNK_TIMEOUT_COVERS * contract.covers_seconds)


def ready_poll_s(eta_s: float) -> float:
    """The pause (s) before readiness is asked again, for a deployment the worker expects ready in ``eta_s`` s."""
    return min(READY_POLL_MAX_S, max(READY_POLL_MIN_S, eta_s / 4))


@dataclasses.dataclass
class OutRequest:
    """A request the engine wants sent (packed on gRPC's request thread, never on the control thread).

    :param obs: the observation. :param history: earlier frames, oldest first.
    :param chunk_tail: float32 (K, D) not-yet-executed rows, or None. :param expected_delay_actions: steps.
    :param last_action: float32 (D,) the last executed row, or None. :param request_id: the id.
    :param observation_step: the episode's chunk step of chunk_tail's row 0 and of the answer's row 0.
    :param tail_request_id: the request whose chunk the tail comes from (0: none); the worker splices in
        the newer chunks the robot has not received (pipelining).
    """

    obs: Observation
    history: list[Observation]
    chunk_tail: np.ndarray | None
    expected_delay_actions: int
    last_action: np.ndarray | None
    request_id: int
    observation_step: float = 0.0
    tail_request_id: int = 0


@dataclasses.dataclass(frozen=True)
class Pending:
    """A request in flight: when it left, the step of its chunk's row 0 (origin) and where it will start.

    ``counted_at``: when the executed count it was timed from was current (s): the deadline of the tick it left
    at when paced (a late tick still executes its deadline's step), else when it left (None: ``sent``). The
    prefetch window measures each answer from there, so a late tick's lateness is part of what the lead covers.
    """

    sent: float
    origin: float
    start: float
    counted_at: float | None = None

    @property
    def timed_from(self) -> float:
        """``counted_at``, or ``sent`` without one (s)."""
        return self.sent if self.counted_at is None else self.counted_at


@dataclasses.dataclass
class LiveChunk:
    """The chunk being played, on the episode's timeline of chunk steps."""

    actions: np.ndarray          # float32 (T, D), seam-blended
    space: ActionSpace
    dt: float
    number: int
    done: bool
    pos: float                   # position the next tick reads (chunk steps)
    seam: tuple[np.ndarray, float] | None = None   # (old rows, old pos - new pos) to blend at the first read
    origin: float = 0.0          # the episode's chunk step of row 0
    request_id: int = 0
    read: bool = False           # a tick has read it (else, replaced, it was discarded unused)
    counts: np.ndarray | None = None   # aggregating: int (T,) the predictions averaged in each row

    @property
    def length(self) -> int:
        """Rows (T)."""
        return len(self.actions)


__all__ = ['CHUNK_TIMEOUT_COVERS', 'CHUNK_TIMEOUT_MIN_S', 'MAX_IN_FLIGHT', 'MIN_LEAD_FRACTION', 'READY_POLL_MAX_S',
           'READY_POLL_MIN_S', 'LiveChunk', 'OutRequest', 'Pending', 'chunk_timeout_s', 'ready_poll_s']
