"""Prometheus metrics of a worker, with ``prometheus_client``, on the port ``seq serve --metrics-port`` names.

Operators already scrape Triton, vLLM and Ray Serve this way. Every series is labelled by deployment:

==========================================  =========  ==================================================
``seq_requests_total{deployment,outcome}``  counter    observation requests; outcome ``chunk`` or the
                                                       error code (``NOT_READY``, ``OVERLOADED``...)
``seq_inference_seconds{deployment}``       histogram  duration of each policy call (a batch counts once)
``seq_batch_size{deployment}``              histogram  requests per policy call (1 without batching)
``seq_queue_depth{deployment}``             gauge      requests waiting for the inference thread
``seq_active_episodes{deployment}``         gauge      episodes in progress
``seq_open_streams{deployment}``            gauge      Episode streams open
``seq_streams_refused_total{reason}``       counter    streams refused: ``max_streams``, ``anonymous``,
                                                       ``per_client``
``seq_episodes_ended_total{deployment,reason}``  counter  episodes ended, by reason (EpisodeEnd's, or
                                                       ``disconnect``, ``idle_timeout``, ``start_timeout``)
``seq_client_underruns_total{deployment}``  counter    underruns the robots reported at EpisodeEnd
``seq_client_underrun_seconds_total{deployment}``  counter  seconds the robots held, reported at EpisodeEnd
``seq_capture_bytes{deployment}``           gauge      bytes in the deployment's capture store on disk
==========================================  =========  ==================================================

``seq_boundary_refused_total{deployment,field}``  counter  values the boundary refused, by field
                                                       (:data:`sequence_ai_ros.protocol.limits.FIELDS`)

Label values come only from bounded sets: the served deployments, the error code names, the documented
episode-end reasons (:data:`~sequence_ai_ros.protocol.limits.REASONS`; any other is ``other``) and the
boundary's fields. A non-finite or negative figure a robot reports is not counted.

Each :class:`PrometheusMetrics` has its own registry (several workers may share a process, as in tests).
The endpoint is a :class:`~sequence_ai_ros.worker.bounded_server.BoundedServer` (one thread, a bounded number
of connections, each with a read deadline), bound where gRPC is; with the worker's token it answers only a
scrape sending ``Authorization: Bearer <token>`` (Prometheus ``authorization: credentials_file``).
:class:`MetricsSink` is the no-op default that the runtime calls when metrics are off.
"""

from __future__ import annotations

import asyncio
import hmac
import math
import threading
import time
from collections.abc import Callable
from typing import Any

from sequence_ai_ros.exceptions import MissingDependency
from sequence_ai_ros.protocol.limits import FIELDS, reason_label
from sequence_ai_ros.worker.bounded_server import BoundedServer

#: Seconds a capture-store size is cached (it walks the store's files).
CAPTURE_BYTES_TTL_S = 10.0
INFERENCE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


class MetricsSink:
    """What the worker reports; this base class drops everything (metrics off)."""

    def request(self, deployment: str, outcome: str) -> None:
        """Count one observation request answered with ``outcome`` (``chunk`` or an error code name)."""

    def batch(self, deployment: str, size: int, seconds: float) -> None:
        """Record one policy call of ``size`` requests that took ``seconds`` (s)."""

    def episode_ended(self, deployment: str, reason: str, underruns: int = 0, underrun_s: float = 0.0) -> None:
        """Count an ended episode and the underruns its robot reported."""

    def refused(self, reason: str) -> None:
        """Count a refused stream (``max_streams``, ``anonymous`` or ``per_client``)."""

    def refused_value(self, deployment: str, field: str) -> None:
        """Count a value the boundary refused (``field``: one of the schema's fields)."""

    def close(self) -> None:
        """Stop serving metrics."""


class PrometheusMetrics(MetricsSink):
    """Serve a worker's metrics over HTTP at ``http://host:port/metrics``.

    :param runtimes: deployment name -> :class:`~sequence_ai_ros.worker.runtime.DeploymentRuntime` (read for
        the queue depth, active episodes and capture bytes gauges at scrape time).
    :param open_streams: returns the number of open Episode streams of a deployment (its name).
    :param host: bind address (the worker's).
    :param port: TCP port; 0 picks a free one (see :attr:`port`).
    :param token: the worker's token: a scrape without ``Authorization: Bearer <token>`` gets 401.
    :raises MissingDependency: when ``prometheus_client`` is not installed.
    :raises ConfigError: when the port cannot be bound.
    """

    def __init__(self, runtimes: dict[str, Any], open_streams: Callable[[str], int], host: str = '127.0.0.1',
                 port: int = 0, token: str | None = None) -> None:
        try:
            import prometheus_client as prom
        except ImportError as exc:
            raise MissingDependency(f'--metrics-port needs the python package prometheus_client '
                                    f'(pip install "sequence_ai_ros[metrics]"): {exc}') from None
        self.registry = reg = prom.CollectorRegistry(auto_describe=True)
        self._requests = prom.Counter('seq_requests', 'Observation requests by outcome', ['deployment', 'outcome'],
                                      registry=reg)
        self._inference = prom.Histogram('seq_inference_seconds', 'Duration of one policy call (s)', ['deployment'],
                                         buckets=INFERENCE_BUCKETS, registry=reg)
        self._batch = prom.Histogram('seq_batch_size', 'Requests per policy call', ['deployment'],
                                     buckets=BATCH_BUCKETS, registry=reg)
        self._ended = prom.Counter('seq_episodes_ended', 'Episodes ended, by reason', ['deployment', 'reason'],
                                   registry=reg)
        self._underruns = prom.Counter('seq_client_underruns', 'Underruns reported by robots at EpisodeEnd',
                                       ['deployment'], registry=reg)
        self._underrun_s = prom.Counter('seq_client_underrun_seconds', 'Seconds robots held, reported at EpisodeEnd',
                                        ['deployment'], registry=reg)
        self._refused = prom.Counter('seq_streams_refused', 'Episode streams refused', ['reason'], registry=reg)
        self._boundary = prom.Counter('seq_boundary_refused', 'Values from the wire refused at the boundary',
                                      ['deployment', 'field'], registry=reg)
        self._served = frozenset(runtimes)
        self._expected = f'Bearer {token}'.encode() if token else None
        self._generate = prom.generate_latest
        queue = prom.Gauge('seq_queue_depth', 'Requests waiting for inference', ['deployment'], registry=reg)
        active = prom.Gauge('seq_active_episodes', 'Episodes in progress', ['deployment'], registry=reg)
        capture = prom.Gauge('seq_capture_bytes', 'Bytes in the capture store', ['deployment'], registry=reg)
        streams = prom.Gauge('seq_open_streams', 'Episode streams open', ['deployment'], registry=reg)
        self._capture_cache: dict[str, tuple[float, int]] = {}
        #: seconds a capture-store size is reused before the store is walked again
        self.capture_bytes_ttl_s = CAPTURE_BYTES_TTL_S
        self._lock = threading.Lock()
        for name, runtime in runtimes.items():
            self._requests.labels(name, 'chunk')
            self._underruns.labels(name)
            queue.labels(name).set_function(lambda r=runtime: r.scheduler.queue_depth)
            active.labels(name).set_function(lambda r=runtime: len(r.running_episodes()))
            streams.labels(name).set_function(lambda n=name: open_streams(n))
            if runtime.capture_store is not None:
                capture.labels(name).set_function(lambda n=name, r=runtime: self._capture_bytes(n, r))
        self._server = BoundedServer('metrics', self._serve, host, port)
        self.port: int = self._server.port

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Answer one HTTP/1.x request: GET /metrics (token checked), 404 or 401 otherwise; then close."""
        request = (await self._server.read_line(reader)).split()
        auth = b''
        for _ in range(100):   # headers, up to the blank line
            line = await self._server.read_line(reader)
            if line in (b'\r\n', b'\n', b''):
                break
            name, _, value = line.partition(b':')
            if name.strip().lower() == b'authorization':
                auth = value.strip()
        self._server.busy(writer)
        if len(request) < 2 or request[0] not in (b'GET', b'HEAD'):
            status, body = b'405 Method Not Allowed', b'GET /metrics\n'
        elif self._expected is not None and not hmac.compare_digest(auth, self._expected):
            status, body = b'401 Unauthorized', b'this worker needs its token: Authorization: Bearer <token>\n'
        elif request[1].split(b'?')[0] not in (b'/metrics', b'/'):
            status, body = b'404 Not Found', b'GET /metrics\n'
        else:
            status = b'200 OK'
            body = await self._server.loop.run_in_executor(None, self._generate, self.registry)
        head = (b'HTTP/1.1 ' + status + b'\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\n'
                b'Content-Length: ' + str(len(body)).encode() + b'\r\nConnection: close\r\n\r\n')
        writer.write(head if request[:1] == [b'HEAD'] else head + body)
        await writer.drain()

    def _capture_bytes(self, name: str, runtime: Any) -> int:
        with self._lock:
            at, value = self._capture_cache.get(name, (float('-inf'), 0))
            if time.monotonic() - at >= self.capture_bytes_ttl_s:
                try:
                    value = runtime.capture_store.bytes_used()
                except OSError:
                    pass
                self._capture_cache[name] = (time.monotonic(), value)
            return value

    def _deployment(self, name: str) -> str:
        return name if name in self._served else ''

    def request(self, deployment: str, outcome: str) -> None:
        """Count one observation request answered with ``outcome`` (``chunk`` or an ErrorCode name)."""
        self._requests.labels(self._deployment(deployment), outcome).inc()

    def batch(self, deployment: str, size: int, seconds: float) -> None:
        """Record one policy call."""
        self._inference.labels(self._deployment(deployment)).observe(seconds)
        self._batch.labels(self._deployment(deployment)).observe(size)

    def episode_ended(self, deployment: str, reason: str, underruns: int = 0, underrun_s: float = 0.0) -> None:
        """Count an ended episode (its reason's label: documented, else ``other``) and its reported underruns.

        A non-finite or negative figure is not counted (one ``inf`` would leave the counter at +Inf for good).
        """
        name = self._deployment(deployment)
        self._ended.labels(name, reason_label(reason)).inc()
        if isinstance(underruns, int) and underruns > 0:
            self._underruns.labels(name).inc(underruns)
        if isinstance(underrun_s, (int, float)) and math.isfinite(underrun_s) and underrun_s > 0:
            self._underrun_s.labels(name).inc(underrun_s)

    def refused(self, reason: str) -> None:
        """Count a refused stream."""
        self._refused.labels(reason).inc()

    def refused_value(self, deployment: str, field: str) -> None:
        """Count a value the boundary refused."""
        self._boundary.labels(self._deployment(deployment), field if field in FIELDS else 'other').inc()

    def close(self) -> None:
        """Shut the HTTP endpoint down (timed join)."""
        self._server.close()
