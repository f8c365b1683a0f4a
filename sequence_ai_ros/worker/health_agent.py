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

Threads: ``seq-agent`` (a :class:`socketserver.ThreadingTCPServer` loop; each HAProxy probe is answered
on a short-lived daemon thread), stopped by :meth:`HealthAgent.close` with a timed join.
"""

from __future__ import annotations

import logging
import socketserver
import threading
from collections.abc import Sequence
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sequence_ai_ros.exceptions import ConfigError
from sequence_ai_ros.protocol import AUTH_METADATA

LOG = logging.getLogger(__name__)
#: Bound (s) of one gRPC health call made for a probe.
CHECK_TIMEOUT_S = 1.0


class HealthAgent:
    """Answer HAProxy agent-check probes with the gRPC health of ``services`` at ``target``.

    :param target: ``host:port`` of the replica's gRPC server.
    :param services: health service names to require SERVING (the deployments).
    :param host: bind address of the agent.
    :param port: TCP port; 0 picks a free one (see :attr:`port`).
    :param token: the worker's token, sent with the health calls.
    :param credentials: channel credentials when the replica serves TLS.
    :raises ConfigError: when the port cannot be bound.
    """

    def __init__(self, target: str, services: Sequence[str], host: str = '127.0.0.1', port: int = 0,
                 token: str | None = None, credentials: grpc.ChannelCredentials | None = None) -> None:
        self.services = list(services)
        self._metadata = [(AUTH_METADATA, f'Bearer {token}')] if token else None
        self._channel = (grpc.secure_channel(target, credentials) if credentials is not None
                         else grpc.insecure_channel(target))
        self._stub = health_pb2_grpc.HealthStub(self._channel)
        agent = self

        class _Probe(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                self.wfile.write((agent.status() + '\n').encode())

        class _Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True

        try:
            self._server = _Server((host, port), _Probe)
        except OSError as exc:
            self._channel.close()
            raise ConfigError(f'cannot serve the health agent on {host}:{port}: {exc}') from None
        self.port: int = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={'poll_interval': 0.2},
                                        name='seq-agent', daemon=True)
        self._thread.start()

    def status(self) -> str:
        """Return ``up ready``, ``drain`` or ``down`` (see the module docstring)."""
        serving = health_pb2.HealthCheckResponse.SERVING
        try:
            for service in self.services:
                reply: Any = self._stub.Check(health_pb2.HealthCheckRequest(service=service),
                                              timeout=CHECK_TIMEOUT_S, metadata=self._metadata)
                if reply.status != serving:
                    return 'drain'
        except grpc.RpcError as exc:
            LOG.warning('agent: gRPC health check failed: %s', exc.code() if hasattr(exc, 'code') else exc)
            return 'down'
        return 'up ready'

    def close(self) -> None:
        """Stop answering probes and close the channel."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5.0)
        self._channel.close()
