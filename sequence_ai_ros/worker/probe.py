"""The probe port: plaintext ``grpc.health.v1.Health`` and nothing else, for Kubernetes' gRPC probes.

Kubelet's built-in gRPC probe (``readinessProbe.grpc``, ``livenessProbe.grpc``, ``startupProbe.grpc``) sends
neither metadata nor TLS, so against a worker with a token (``--token-file``) it gets UNAUTHENTICATED, and
against a TLS worker it cannot even connect: the pod never becomes Ready. ``seq serve --probe-port PORT``
answers those probes on a second, plaintext listener that serves only the health service (Check and
Watch), sharing the main server's health statuses: ``''`` is SERVING while the server runs, each
deployment NOT_SERVING until its policy is ready, everything NOT_SERVING once the server stops. Every
other method there is UNIMPLEMENTED: the probe port exposes health and nothing else, so it needs no token.
"""

from __future__ import annotations

import grpc
from grpc_health.v1 import health, health_pb2_grpc

from sequence_ai_ros.exceptions import ConfigError


async def start_probe_server(health_servicer: health.aio.HealthServicer, host: str,
                             port: int) -> tuple[grpc.aio.Server, int]:
    """Start a plaintext gRPC server with only ``health_servicer``; return it and its bound port.

    Call on the worker's event loop (the servicer is an asyncio one, shared with the main server).

    :param health_servicer: the main server's health servicer (one set of statuses for both ports).
    :param host: bind address (the main server's ``--host``).
    :param port: TCP port; 0 picks a free one.
    :raises ConfigError: when ``host:port`` cannot be bound.
    """
    server = grpc.aio.server(options=[('grpc.so_reuseport', 0)])
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    address = f'{host}:{port}'
    try:
        bound = server.add_insecure_port(address)
    except RuntimeError as exc:   # grpc: "Failed to bind to address ..."
        raise ConfigError(f'cannot bind the probe port {address} (--probe-port): {exc}') from None
    if not bound:
        raise ConfigError(f'cannot bind the probe port {address} (--probe-port)')
    await server.start()
    return server, bound
