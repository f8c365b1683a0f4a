"""Refusing an episode stream in the protocol, and draining a replica before it stops.

A refusal (:func:`refuse_stream`) is an in-stream ``Error`` (code OVERLOADED, ``refusal`` set), not a gRPC
status: HAProxy 2.6 resets a stream the server ends while the robot is still sending (before its request
body is complete), so an aborted call reached the robot as a reset, i.e. ConnectionLost, and a robot could
not tell "full, retry later" from "worker dead". So the refusal waits for the robot's EpisodeStart (bounded
by the start timeout), answers with the typed refusal, then waits (bounded by :data:`LINGER_S`) for the
robot to close its side, and only then ends the call.

Drain (:class:`Drain`, :meth:`~sequence_ai_ros.worker.server.WorkerServer.drain`): on SIGTERM the worker
refuses new episodes with ``refusal="draining"`` (the client retries them: :class:`~sequence_ai_ros.exceptions.
Draining`), refuses a Handshake the same way (its trailing metadata) and answers Ready with ``ready=False``,
state ``draining``, turns every deployment's gRPC health NOT_SERVING (so the HAProxy agent answers ``drain``
and a Kubernetes readiness probe fails: a same-id reconnect is hashed to another replica), and lets the live
episodes finish for up to ``drain_timeout_s``; what is still open then is cut with reason ``drain_timeout``.
Behind HAProxy (its agent polled) the drain also lasts until the agent has told it ``drain``
(:meth:`~sequence_ai_ros.worker.health_agent.HealthAgent.heard_drain`): a replica whose episodes ended at
once would otherwise stop while HAProxy still sends it new calls, which then fail as ConnectionLost.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from sequence_ai_ros.exceptions import Draining, Overloaded
from sequence_ai_ros.protocol import DRAINING, errors
from sequence_ai_ros.protocol import sequence_ai_pb2 as pb

LOG = logging.getLogger(__name__)
#: Longest wait (s) for a refused robot to close its side of the call after the refusal was sent.
LINGER_S = 2.0
#: Why a stream may be refused (``Error.refusal``, the ``reason`` label of ``seq_streams_refused_total``).
REFUSALS = ('max_streams', 'anonymous', 'per_client', DRAINING)
#: Episode-end reason of an episode still running when the drain timeout passed.
DRAIN_TIMEOUT_REASON = 'drain_timeout'


async def refuse_stream(requests: AsyncIterator[Any], error: Overloaded, start_timeout_s: float,
                        linger_s: float = LINGER_S) -> AsyncIterator[pb.EpisodeReply]:
    """Yield the refusal of an Episode call once its first message came (or ``start_timeout_s`` passed).

    Then wait up to ``linger_s`` for the robot to close its side; what it sent meanwhile is read and ignored.

    :param requests: the call's request iterator.
    :param error: the refusal (its ``refusal`` names why).
    :param start_timeout_s: bound (s) on the wait for the first message (EpisodeStart).
    :param linger_s: bound (s) on the wait for the robot to half-close after the refusal went out.
    """
    heard = asyncio.Event()     # the first message came, or the robot closed its side
    closed = asyncio.Event()
    got: list[bool] = []

    async def read() -> None:
        try:
            async for _ in requests:
                if not got:
                    got.append(True)
                    heard.set()
        except Exception as exc:   # cancelled, or the peer dropped
            LOG.debug('refused stream: request stream ended: %s', exc)
        finally:
            closed.set()
            heard.set()

    reader = asyncio.ensure_future(read())
    try:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(heard.wait(), start_timeout_s)
        if closed.is_set() and not got:
            return    # closed without a word: nobody to tell
        yield pb.EpisodeReply(error=errors.to_error(error))
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(closed.wait(), linger_s)
    finally:
        reader.cancel()


class Drain:
    """A replica's drain state: refused admissions while set, and the wait for its open streams.

    :param open_streams: returns the number of Episode streams open now.
    """

    def __init__(self, open_streams: Callable[[], int]) -> None:
        self._open_streams = open_streams
        self._started = threading.Event()

    @property
    def draining(self) -> bool:
        """True once :meth:`begin` was called."""
        return self._started.is_set()

    def refusal(self) -> Draining | None:
        """Return the refusal for a new episode while draining, else None."""
        if not self._started.is_set():
            return None
        return Draining('this replica is draining (stopping): no new episodes; open the episode again (a balancer '
                        'sends it to another replica)', refusal=DRAINING)

    def begin(self) -> None:
        """Refuse new episodes from now on (idempotent)."""
        self._started.set()

    def wait(self, timeout_s: float, poll_s: float = 0.05, until: Callable[[], bool] | None = None) -> int:
        """Wait until no episode stream is open (and ``until()`` is True, when given), up to ``timeout_s``.

        :returns: how many episode streams are still open.
        """
        deadline = time.monotonic() + timeout_s
        while ((left := self._open_streams()) or (until is not None and not until())) \
                and time.monotonic() < deadline:
            time.sleep(poll_s)
        return self._open_streams() if left else 0


class DrainRequest:
    """A drain asked through the admin API (``seq admin drain``), taken the path SIGTERM takes; once.

    :param default: what a drain does when no handler was set (an embedded worker: drain, then stop).
    """

    def __init__(self, default: Callable[[], None]) -> None:
        self._lock = threading.Lock()
        self._asked = False
        self._handler = default

    def handle_with(self, handler: Callable[[], None]) -> None:
        """Let ``handler`` do the drain (``seq serve``: the event its SIGTERM handler sets)."""
        with self._lock:
            self._handler = handler

    def ask(self) -> bool:
        """Start the drain (the handler is called once, at once); False when it was asked already."""
        with self._lock:
            if self._asked:
                return False
            self._asked = True
            handler = self._handler
        handler()
        return True
