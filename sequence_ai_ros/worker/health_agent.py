"""Readiness agent for HAProxy's ``agent-check``: reports the replica's gRPC health in HAProxy's words.

HAProxy's h2 http-check sees only HTTP 200, so a replica whose gRPC health is NOT_SERVING (its policy
still warming, or failed) would stay UP and receive new episodes. The agent closes that gap: HAProxy
connects to ``--agent-port`` every ``agent-inter``, and the agent answers one line (HAProxy 2.6 manual,
"agent-check"):

- ``up ready`` when the standard ``grpc.health.v1.Health/Check`` of every served deployment answers
  SERVING (asked over loopback gRPC, so the answer comes from the real serving path);
- ``drain`` when any answers NOT_SERVING: weight 0, so no new episode is hashed to it while its running
  streams finish;
- ``down`` when the health call fails (the gRPC server does not answer).

A replica that drains (SIGTERM) stops only once the balancer has heard ``drain``: while probes come (one
answered within :data:`POLLED_S`), its drain lasts until two probes were answered ``drain`` (the first tells
HAProxy, which then hashes no new episode to it; by the second, a call it sent before that has arrived and was
refused in the protocol, which the client retries elsewhere), or until no probe came for :data:`QUIET_S` (the
balancer stopped), at most the drain timeout.

With the worker's token (``--token-file``) a probe must first send the token (HAProxy's ``agent-send``,
which ``seq fleet`` sets): one that does not, within the read deadline, gets no answer.

Threads: ``seq-agent``, one :class:`~sequence_ai_ros.worker.bounded_server.BoundedServer` loop for every
connection (idle ones are bounded in number and time, never a thread each); the health call of a probe runs
on that loop's small default executor. Stopped by :meth:`HealthAgent.close` with a timed join.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sequence_ai_ros.protocol import AUTH_METADATA
from sequence_ai_ros.worker.bounded_server import BoundedServer

LOG = logging.getLogger(__name__)
#: Bound (s) of one gRPC health call made for a probe.
CHECK_TIMEOUT_S = 1.0
#: A balancer polls the agent when a probe was answered within this many seconds (HAProxy: every agent-inter).
POLLED_S = 10.0
#: ``drain`` answers a draining replica gives before it stops (see the module docstring).
DRAIN_ANSWERS = 2
#: A draining replica stops waiting for them once no probe came for this many seconds: the balancer stopped
#: polling (the shipped HAProxy config polls every 500 ms).
QUIET_S = 3.0


class HealthAgent:
    """Answer HAProxy agent-check probes with the gRPC health of ``services`` at ``target``.

    :param target: ``host:port`` of the replica's gRPC server.
    :param services: health service names to require SERVING (the deployments), or a callable returning them
        at each probe (the deployments served now: one ``seq delete`` removed is no longer required).
    :param host: bind address of the agent.
    :param port: TCP port; 0 picks a free one (see :attr:`port`).
    :param token: the worker's token, sent with the health calls and required first from every probe.
    :param credentials: channel credentials when the replica serves TLS.
    :raises ConfigError: when the port cannot be bound.
    """

    def __init__(self, target: str, services: Sequence[str] | Callable[[], Sequence[str]], host: str = '127.0.0.1',
                 port: int = 0, token: str | None = None, credentials: grpc.ChannelCredentials | None = None) -> None:
        self._services = services if callable(services) else tuple(services)
        self._metadata = [(AUTH_METADATA, f'Bearer {token}')] if token else None
        self._channel = (grpc.secure_channel(target, credentials) if credentials is not None
                         else grpc.insecure_channel(target))
        self._stub = health_pb2_grpc.HealthStub(self._channel)
        self._expected = token.encode() if token else None
        try:
            self._server = BoundedServer('agent', self._probe, host, port)
        except BaseException:
            self._channel.close()
            raise
        self.port: int = self._server.port
        #: when a probe was last answered (monotonic s; None: never), and how many were answered ``drain``:
        #: a draining replica stops only once the balancer polling it has heard (WorkerServer.drain)
        self.last_answer_s: float | None = None
        self.drain_answers = 0

    async def _probe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Answer one probe: the token first when one is set (HAProxy's agent-send, newline optional)."""
        if self._expected is not None:
            try:
                sent = await asyncio.wait_for(reader.readexactly(len(self._expected)),
                                              timeout=self._server.read_timeout_s)
            except (asyncio.TimeoutError, asyncio.IncompleteReadError):
                return
            if not hmac.compare_digest(sent, self._expected):
                LOG.warning('agent: a probe without the worker\'s token was refused')
                return
        self._server.busy(writer)
        status = await self._server.loop.run_in_executor(None, self.status)
        writer.write((status + '\n').encode())
        await writer.drain()
        self.last_answer_s = time.monotonic()
        if status == 'drain':
            self.drain_answers += 1

    @property
    def services(self) -> list[str]:
        """The health services a probe requires SERVING now."""
        return list(self._services() if callable(self._services) else self._services)

    def status(self) -> str:
        """Return ``up ready``, ``drain`` or ``down`` (see the module docstring)."""
        serving = health_pb2.HealthCheckResponse.SERVING
        try:
            for service in self.services:
                # types-grpcio-health-checking's HealthStub declares no method
                reply: Any = self._stub.Check(health_pb2.HealthCheckRequest(service=service),  # type: ignore[attr-defined]
                                              timeout=CHECK_TIMEOUT_S, metadata=self._metadata)
                if reply.status != serving:
                    return 'drain'
        except grpc.RpcError as exc:
            LOG.warning('agent: gRPC health check failed: %s', exc.code() if hasattr(exc, 'code') else exc)
            return 'down'
        return 'up ready'

    def heard_drain(self) -> Callable[[], bool] | None:
        """Call as a drain begins: a check that the balancer has heard it, or None when no balancer polls the agent.

        :returns: a callable, True once :data:`DRAIN_ANSWERS` probes were answered ``drain`` after this call,
            or once no probe came for :data:`QUIET_S` (the balancer stopped polling).
        """
        start = time.monotonic()
        last = self.last_answer_s
        if last is None or start - last > POLLED_S:
            return None
        mark = self.drain_answers

        def heard() -> bool:
            if self.drain_answers >= mark + DRAIN_ANSWERS:
                return True
            # no probe for QUIET_S: the balancer stopped polling (``seq fleet`` stops HAProxy first)
            return time.monotonic() - max(start, self.last_answer_s or start) > QUIET_S

        return heard

    def close(self) -> None:
        """Stop answering probes and close the channel."""
        self._server.close()
        self._channel.close()
