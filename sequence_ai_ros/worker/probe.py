"""The probe port: plaintext ``grpc.health.v1.Health`` and nothing else, for Kubernetes' gRPC probes.

Kubelet's built-in gRPC probe (``readinessProbe.grpc``, ``livenessProbe.grpc``, ``startupProbe.grpc``) sends
neither metadata nor TLS, so against a worker with a token (``--token-file``) it gets UNAUTHENTICATED, and
against a TLS worker it cannot even connect: the pod never becomes Ready. ``seq serve --probe-port PORT``
answers those probes on a second, plaintext listener that serves only the health service (Check and
Watch), sharing the main server's statuses in the tokenless view of
:mod:`~sequence_ai_ros.worker.health_service`: ``''`` is SERVING while the server runs (liveness), and any other
name is the worker's readiness (SERVING once every deployment's policy is ready, NOT_SERVING while one warms or
failed, while draining and once the server stops), whatever the name: a caller without the token cannot tell a
deployment's name from any other. Every other method there is UNIMPLEMENTED: the probe port exposes health and
nothing else, so it needs no token.

It is bounded whatever its callers send (:data:`PROBE_OPTIONS`): a request over :data:`MAX_MESSAGE_BYTES` is
refused by the transport (RESOURCE_EXHAUSTED) with about :data:`WINDOW_BYTES` of it buffered, a name over
:data:`~.health_service.MAX_SERVICE_NAME_BYTES` is INVALID_ARGUMENT, at most :data:`STREAMS_PER_CONNECTION`
calls run on one connection and :data:`MAX_CALLS` on the port (of them at most
:data:`~.health_service.MAX_WATCHES` Watch streams, each ended after
:data:`~.health_service.WATCH_IDLE_S` s without a change), a connection without calls is closed after
:data:`IDLE_CONNECTION_MS` and any connection after :data:`MAX_CONNECTION_AGE_MS`, besides the main port's
handshake timeout and keepalive (:mod:`~sequence_ai_ros.worker.grpc_bounds`).
"""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2_grpc

from sequence_ai_ros.exceptions import ConfigError
from sequence_ai_ros.worker.bounded_server import MAX_REQUEST_BYTES
from sequence_ai_ros.worker.grpc_bounds import HANDSHAKE_TIMEOUT_MS, KEEPALIVE_OPTIONS
from sequence_ai_ros.worker.health_service import MAX_WATCHES, BoundedHealthServicer, HealthStatuses, never

#: Largest request accepted (bytes; the side ports' request bound): a HealthCheckRequest with the longest name
#: answered is ~260 bytes, and a larger one is refused before the server holds it.
MAX_MESSAGE_BYTES = MAX_REQUEST_BYTES
#: Largest metadata (headers) accepted (bytes).
MAX_METADATA_BYTES = 8 << 10
#: Calls open at once on one connection (HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS).
STREAMS_PER_CONNECTION = 8
#: Calls running at once on the port; past it RESOURCE_EXHAUSTED. Watch streams take at most MAX_WATCHES of
#: them, so Check (kubelet's probes) always has room.
MAX_CALLS = 2 * MAX_WATCHES
#: A connection with no call open for this long is closed (ms); kubelet dials anew for each probe.
IDLE_CONNECTION_MS = 30_000
#: Any connection is closed after this long (ms), its calls given MAX_CONNECTION_AGE_GRACE_MS to finish.
MAX_CONNECTION_AGE_MS = 600_000
MAX_CONNECTION_AGE_GRACE_MS = 5_000
#: HTTP/2 flow-control window of a stream (bytes), kept there (no BDP growth): a request over the message cap is
#: refused with about this much of it buffered (with BDP growth, 300 refused 1 MB names kept ~+48 MB, now ~+4 MB).
WINDOW_BYTES = 16 << 10
PROBE_OPTIONS = [
    ('grpc.so_reuseport', 0),
    ('grpc.max_receive_message_length', MAX_MESSAGE_BYTES),
    ('grpc.max_send_message_length', MAX_MESSAGE_BYTES),
    ('grpc.max_metadata_size', MAX_METADATA_BYTES),
    ('grpc.max_concurrent_streams', STREAMS_PER_CONNECTION),
    ('grpc.max_connection_idle_ms', IDLE_CONNECTION_MS),
    ('grpc.max_connection_age_ms', MAX_CONNECTION_AGE_MS),
    ('grpc.max_connection_age_grace_ms', MAX_CONNECTION_AGE_GRACE_MS),
    ('grpc.server_handshake_timeout_ms', HANDSHAKE_TIMEOUT_MS),
    ('grpc.http2.bdp_probe', 0), ('grpc.http2.lookahead_bytes', WINDOW_BYTES),
    *KEEPALIVE_OPTIONS,
]


async def start_probe_server(statuses: HealthStatuses, host: str,
                             port: int) -> tuple[grpc.aio.Server, int]:
    """Start the plaintext, health-only gRPC server over ``statuses``; return it and its bound port.

    Call on the worker's event loop (the statuses are the main server's, set on that loop).

    :param statuses: the main server's health statuses (one set for both ports).
    :param host: bind address (the main server's ``--host``).
    :param port: TCP port; 0 picks a free one.
    :raises ConfigError: when ``host:port`` cannot be bound.
    """
    server = grpc.aio.server(options=PROBE_OPTIONS, maximum_concurrent_rpcs=MAX_CALLS)
    health_pb2_grpc.add_HealthServicer_to_server(BoundedHealthServicer(statuses, trusted=never), server)
    address = f'{host}:{port}'
    try:
        bound = server.add_insecure_port(address)
    except RuntimeError as exc:   # grpc: "Failed to bind to address ..."
        raise ConfigError(f'cannot bind the probe port {address} (--probe-port): {exc}') from None
    if not bound:
        raise ConfigError(f'cannot bind the probe port {address} (--probe-port)')
    await server.start()
    return server, bound
