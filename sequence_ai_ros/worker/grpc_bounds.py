"""Transport bounds shared by the worker's gRPC listeners: the main port (and proxy socket) and the probe port.

Each listener adds its own message and stream caps (:mod:`~sequence_ai_ros.worker.server`,
:mod:`~sequence_ai_ros.worker.probe`); these are the ones they share.
"""

from __future__ import annotations

KEEPALIVE_OPTIONS = [
    ('grpc.keepalive_time_ms', 20_000),               # ping an idle connection every 20 s
    ('grpc.keepalive_timeout_ms', 10_000),            # drop it when a ping goes unanswered for 10 s
    ('grpc.keepalive_permit_without_calls', 1),
    ('grpc.http2.min_ping_interval_without_data_ms', 5_000),  # accept client pings every >= 5 s
    ('grpc.http2.max_pings_without_data', 0),
]
#: A connection that has not completed its HTTP/2 start within this long is closed (ms): silent TCP
#: connections (half-open floods) cannot hold descriptors for long.
HANDSHAKE_TIMEOUT_MS = 5_000
