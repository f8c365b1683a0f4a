"""An episode's requests: when the next one leaves, what it carries, which are in flight, the warming wait.

A request records the executed count when its observation was taken; the chunk that answers has its row 0
at that step (whole steps for delta and velocity spaces, and when aggregating, so that all chunks share one
grid of steps). A new request leaves while fewer than ``max_in_flight`` are in flight and the chunks played
or awaited cover at most the prefetch lead (:meth:`RequestSchedule.lead_s`: an upper estimate of the
connection's round trip, ``EpisodeSettings.prefetch_margin`` deviations above its measured mean, plus one
period; at least :data:`~sequence_ai_ros.client.records.MIN_LEAD_FRACTION` of a chunk); aggregating, one per
tick.

The arithmetic (a tick each period P, a chunk covering C s, answers within r of the tick's deadline): a
request leaves at the first tick whose ``ahead`` (seconds of actions played or awaited) is at most the lead,
so ``ahead`` lies in (lead - P, lead]; its chunk is needed ``ahead`` after that tick's deadline and is read
there when it arrives within ``ahead``. lead = r + P therefore never runs dry while the estimate holds, and
pipelined, each request covers until its own step + C, so the next leaves ``C - ahead`` later: at least
``C - r - P`` apart, against the ideal pipeline's ``C - r`` (one request per chunk needs no pipelining while
r < C - r). A second period of safety is added while requests stay at least :data:`SAFETY_SPACING_PERIODS`
periods apart with it (a round trip a few ms over the window's largest, from the robot's executor or the
link, then finds a chunk still there); with r near C it would send a request every period, twice the
inferences, and is left out. r is measured from the deadline of the tick that sent (paced: a late tick's
lateness is part of it; on the clock and between ticks, from the send), so a loaded caller's lateness raises
the lead as a slow link does.

Warming: while the deployment loads, the worker answers NOT_READY with an estimate of the time left
(:meth:`RequestSchedule.not_ready`); the request is forgotten and a newer observation goes once a share of
that estimate has passed (:func:`~sequence_ai_ros.client.records.ready_poll_s`).
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable

from sequence_ai_ros.client.latency import LatencyWindow, percentile
from sequence_ai_ros.client.player import Player
from sequence_ai_ros.client.records import MAX_IN_FLIGHT, MIN_LEAD_FRACTION, OutRequest, Pending, ready_poll_s
from sequence_ai_ros.client.settings import EpisodeSettings
from sequence_ai_ros.client.tally import Tally
from sequence_ai_ros.exceptions import NotReady
from sequence_ai_ros.protocol.contract import Contract
from sequence_ai_ros.protocol.types import Observation

_EPS = 1e-9
#: The lead keeps a second period of safety (a round trip a little over the window's largest, from the robot's
#: own executor or the link) while the requests it leaves stay at least this many periods apart; with a round
#: trip near the whole chunk it is dropped, as it would send a request every period (twice the inferences).
SAFETY_SPACING_PERIODS = 2.0


class RequestSchedule:
    """One episode's requests to the worker (no I/O but ``send``, which only enqueues).

    :param contract: the policy's contract. :param settings: the episode's settings.
    :param latency: the connection's round-trip window (shared across its episodes).
    :param send: enqueues an :class:`OutRequest`; must not block.
    :param clock: the robot's monotonic clock (s).
    :param whole_steps: row 0 of an answer is a whole step (delta and velocity spaces, aggregating).
    :param per_tick: request at every tick within the in-flight bound (aggregating).
    """

    def __init__(self, contract: Contract, settings: EpisodeSettings, latency: LatencyWindow,
                 send: Callable[[OutRequest], None], clock: Callable[[], float], *, whole_steps: bool,
                 per_tick: bool) -> None:
        self.contract, self.settings, self.latency = contract, settings, latency
        self._send, self._clock = send, clock
        self.whole_steps, self.per_tick = whole_steps, per_tick
        #: requests in flight at most (1: no pipelining)
        self.max_in_flight = MAX_IN_FLIGHT
        #: the most that were in flight at once
        self.peak = 0
        #: requests sent in this episode (each one is an inference on the worker, answered or not)
        self.sent = 0
        self.in_flight: dict[int, Pending] = {}
        self._next_id = 1
        self._latest: tuple[Observation, list[Observation], float, int] | None = None   # obs, history, step, seq
        self._seq = self._used_seq = 0
        self._serve_s: collections.deque[float] = collections.deque(maxlen=16)   # the worker's inference (s)
        #: a chunk said it is the last: nothing more is asked
        self.done = False
        #: the worker's last NOT_READY while the deployment loads, until the first chunk (None: none)
        self.warming: NotReady | None = None
        self._retry_at = 0.0

    def observe(self, obs: Observation, history: list[Observation], executed: float) -> None:
        """Keep the tick's observation (and its history) as the one the next request carries."""
        self._seq += 1
        self._latest = (obs, history, executed, self._seq)

    def answered(self, request_id: int, arrival: float, inference_s: float, tally: Tally) -> Pending | None:
        """Take the answer to ``request_id`` (arrived at ``arrival`` s); None when it is not in flight."""
        pending = self.in_flight.pop(request_id, None)
        if pending is None:
            return None
        self.warming = None       # the deployment serves
        self._serve_s.append(max(0.0, inference_s))
        self.latency.add(arrival - pending.timed_from)     # what the lead must cover (a late tick's lateness too)
        tally.rtts.append(arrival - pending.sent)           # the round trip itself
        return pending

    def not_ready(self, request_id: int, error: NotReady, chunks: int) -> bool:
        """Take a NOT_READY for ``request_id``; True when it is a wait (see the module docstring)."""
        if chunks or request_id not in self.in_flight or not error.retry_after_s > 0:
            return False
        del self.in_flight[request_id]
        self.warming = error
        self._retry_at = self._clock() + ready_poll_s(error.retry_after_s)
        return True

    def overdue(self, timeout_s: float) -> tuple[int, float] | None:
        """The oldest request unanswered for over ``timeout_s`` (s): (its id, the seconds waited), else None."""
        if not self.in_flight:
            return None
        rid, sent = min(((r, p.sent) for r, p in self.in_flight.items()), key=lambda item: item[1])
        waited = self._clock() - sent
        return (rid, waited) if waited > timeout_s else None

    def maybe_send(self, player: Player, period: float, late: float = 0.0) -> None:
        """Send a request for the latest observation when the schedule says one is due.

        :param period: the tick's period (s).
        :param late: the tick's lateness (s; the timeline's ``since_s``; 0 from an arrival between ticks): a
            paced tick that runs late still executes its deadline's step, so the rows ahead are due that much
            sooner than when it sends; the answer is measured from the deadline (``Pending.counted_at``).
        """
        if self.done or self._latest is None or len(self.in_flight) >= max(1, self.max_in_flight):
            return
        obs, history, e_obs, seq = self._latest
        if seq == self._used_seq:
            return
        if self.warming is not None and self._clock() < self._retry_at:
            return   # the deployment loads: a newer observation goes once the worker's estimate has passed
        if len(history) < self.contract.observation.history - 1:
            return   # the first chunk waits for N real frames ((N - 1) * dt): none is invented in their place
        live = player.live
        executed = player.executed
        dt = live.dt if live is not None else self.contract.dt
        remaining = player.left
        # Steps covered ahead of the timeline by the playing chunk and by the chunks awaited.
        cover_end = executed + remaining
        for p in self.in_flight.values():
            cover_end = max(cover_end, p.origin + self.contract.chunk_length)
        ahead = max(0.0, cover_end - executed)
        s = self.settings
        if s.max_actions is not None and executed + ahead >= s.max_actions - _EPS:
            return
        if ahead > _EPS and not self._due(ahead * dt, period, dt):
            return
        # Row 0 of the answer is the step the observation fell in (whole steps for delta and velocity
        # spaces: one grid, so an increment split across a seam runs once; aggregating: whole steps too, so
        # that the chunks folded together share one grid of steps).
        origin = float(math.floor(e_obs + 1e-7)) if self.whole_steps else e_obs
        tail = None
        delay = 0
        if live is not None and remaining > _EPS:
            # Row 0 of the tail is the playing chunk's row nearest the observation step, as row 0 of the answer
            # is that step: an in-painting policy (RTC) aligns the two row by row. On the clock the step is a
            # whole one give or take the tick's jitter (7.003 or 6.997); the next whole row (ceil) would shift
            # every in-painted row by one step whenever a tick ran a little late.
            tail = live.actions[max(0, int(math.floor(origin - live.origin + 0.5))):]
        if live is not None or self.in_flight:
            # An upper estimate (the window's largest warm round trip, with a margin while they are few, the
            # cold one only before any: LatencyWindow.delay_s; + two ticks: a request leaves at a tick and
            # its chunk is read at one), so that a policy in-painting chunk_tail[:delay] covers every step
            # that runs before its chunk is read.
            delay = int(math.ceil((self.latency.delay_s(self.settings.prefetch_margin) + 2 * period) / dt - 1e-9))
            delay = min(delay, self.contract.chunk_length)
        rid = self._next_id
        self._next_id += 1
        self._used_seq = seq
        now = self._clock()
        self.in_flight[rid] = Pending(now, origin, origin + delay, now - late)
        self.peak = max(self.peak, len(self.in_flight))
        self.sent += 1
        self._send(OutRequest(obs=obs, history=history, chunk_tail=tail, expected_delay_actions=delay,
                              last_action=player.last_raw, request_id=rid, observation_step=origin,
                              tail_request_id=live.request_id if live is not None else 0))

    def lead_s(self, period: float, dt: float | None = None) -> float:
        """The prefetch lead (s): a request is due with this much or less played or awaited.

        The connection's upper estimate of the round trip (``prefetch_margin`` mean deviations above the mean,
        never below the largest) plus one ``period`` (s), plus a second period of safety while the requests it
        leaves stay at least :data:`SAFETY_SPACING_PERIODS` periods apart; at least MIN_LEAD_FRACTION of a chunk
        of steps of ``dt`` s (default the contract's).
        """
        dt = self.contract.dt if dt is None else dt
        chunk_s = self.contract.chunk_length * dt
        lead = self.latency.lead_s(period, self.settings.prefetch_margin)
        if chunk_s - (lead + period) >= SAFETY_SPACING_PERIODS * period:
            lead += period        # a second period of safety, while requests stay SAFETY_SPACING_PERIODS apart
        return max(lead, MIN_LEAD_FRACTION * chunk_s)

    def _due(self, ahead_s: float, period: float, dt: float) -> bool:
        """Whether another request is due now, with ``ahead_s`` seconds of actions played or awaited."""
        lead = self.lead_s(period, dt)
        # aggregating: a chunk per tick, as LeRobot runs an ensembled ACT (one inference per step)
        if not self.settings.prefetch or (ahead_s > lead and not self.per_tick):
            return False
        if not self.in_flight:
            return True
        # Never faster than the worker answers one episode's requests (its inference time, as the chunks
        # report it): faster would only queue them there and inflate the round trip. Until a chunk of this
        # episode has reported it, one request at a time. From then on any known round trip times a second
        # one, the connection's cold one included: the first seam of an episode is covered only by a request
        # sent soon after its first chunk arrived (the request sent at that arrival has its observation at
        # step 0 and ends where the first chunk ends), and a warm sample comes a whole round trip later. A
        # cold one longer than the whole chunk waits for a warm one: overlap cannot cover such a link (each
        # chunk would arrive stale), so it is taken for a start-up outlier (JIT, caches) and sets off no
        # burst of requests.
        if not self._serve_s:
            return False
        cold = self.latency.cold_s()
        if not self.latency.samples() and (cold is None or cold >= self.contract.chunk_length * dt):
            return False
        newest = max(p.sent for p in self.in_flight.values())
        spacing = max(period, 1.2 * percentile(list(self._serve_s), 50))
        return self._clock() - newest >= spacing - 1e-6     # 1 us: ticks a float sum of periods apart still send


__all__ = ['SAFETY_SPACING_PERIODS', 'RequestSchedule']
