"""Prometheus metrics of a worker, with ``prometheus_client``, on the port ``seq serve --metrics-port`` names.

Operators already scrape Triton, vLLM and Ray Serve this way. Every series is labelled by deployment:

==========================================  =========  ==================================================
``seq_requests_total{deployment,outcome}``  counter    observation requests; outcome ``chunk`` or the
                                                       error code (``NOT_READY``, ``OVERLOADED``...)
``seq_request_seconds{deployment}``         histogram  from a request's arrival to its reply (s), in the
                                                       worker (queue, inference, packing)
``seq_queue_seconds{deployment}``           histogram  time a request waited for its turn at inference (s)
``seq_time_to_first_chunk_seconds{deployment}``  histogram  from EpisodeStart to the episode's first chunk (s)
``seq_inference_seconds{deployment}``       histogram  duration of each policy call (a batch counts once)
``seq_batch_size{deployment}``              histogram  requests per policy call (1 without batching)
``seq_queue_depth{deployment}``             gauge      requests waiting for their turn (queued or pipelined)
``seq_active_episodes{deployment}``         gauge      episodes in progress
``seq_open_streams{deployment}``            gauge      Episode streams open
``seq_streams_refused_total{reason}``       counter    streams refused: ``max_streams``, ``anonymous``,
                                                       ``per_client``, ``draining``
``seq_episodes_ended_total{deployment,reason}``  counter  episodes ended, by reason (EpisodeEnd's, or
                                                       ``disconnect``, ``idle_timeout``, ``start_timeout``,
                                                       ``shutdown``, ``drain_timeout``)
``seq_client_underruns_total{deployment}``  counter    underruns the robots reported at EpisodeEnd
``seq_client_underrun_seconds_total{deployment}``  counter  seconds the robots held, reported at EpisodeEnd
``seq_telemetry_underruns_total{deployment}``  counter  underruns seen live in the robots' telemetry (a
                                                       crashed episode's too; telemetry flows while captured)
``seq_telemetry_underrun_seconds_total{deployment}``  counter  seconds held in underrun, from telemetry
``seq_capture_bytes{deployment}``           gauge      bytes in the deployment's capture store on disk
``seq_rollout_failures_total{deployment}``  counter    versions registered while serving (``seq deploy``
                                                       again) that failed to import, load or pass the dry
                                                       run: the old version kept serving (or, after a
                                                       switch for lack of memory, none does)
``seq_build_info{version,deployment,deployment_version}``  gauge  1: the worker's package version and each
                                                       served deployment's registered version
``process_*``, ``python_*``                 various    prometheus_client's process (CPU, memory, file
                                                       descriptors; Linux) and interpreter collectors
==========================================  =========  ==================================================

``seq_boundary_refused_total{deployment,field}``  counter  values the boundary refused, by field
                                                       (:data:`sequence_ai_ros.protocol.limits.FIELDS`)
``seq_labels_refused_total{deployment,reason}``  counter  Label calls refused: ``anonymous`` (no token),
                                                       ``not_owner`` (another identity ran the episode),
                                                       ``unseen_bound`` (too many labels of episodes the
                                                       worker never saw, from one identity)

Label values come only from bounded sets: the served deployments, the error code names, the documented
episode-end reasons (:data:`~sequence_ai_ros.protocol.limits.REASONS`; any other is ``other``), the
refusals (:data:`~sequence_ai_ros.worker.drain.REFUSALS`), the label refusals
(:data:`~sequence_ai_ros.worker.identity.LABEL_REFUSALS`) and the boundary's fields. Every labelled series
exists at 0 from the start (``rate()``/``increase()`` see its first increment), and every series of a
deployment ``seq delete`` removed goes once the worker unloaded it (:meth:`PrometheusMetrics.forget`). A
non-finite or negative figure a robot reports is not counted.

Each :class:`PrometheusMetrics` has its own registry (several workers may share a process, as in tests).
The endpoint is a :class:`~sequence_ai_ros.worker.bounded_server.BoundedServer` (one thread, a bounded number
of connections, each with a read deadline), bound where gRPC is; with the worker's token it answers only a
scrape sending ``Authorization: Bearer <token>`` (Prometheus ``authorization: credentials_file``; the scheme in
any case, :mod:`~sequence_ai_ros.worker.auth`).
:class:`MetricsSink` is the no-op default that the runtime calls when metrics are off.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
import threading
import time
from collections.abc import Callable
from typing import Any

import sequence_ai_ros
from sequence_ai_ros.exceptions import MissingDependency
from sequence_ai_ros.protocol import sequence_ai_pb2 as pb
from sequence_ai_ros.protocol.limits import FIELDS, OTHER_REASON, REASONS, reason_label
from sequence_ai_ros.worker.auth import authorized
from sequence_ai_ros.worker.bounded_server import BoundedServer
from sequence_ai_ros.worker.drain import REFUSALS
from sequence_ai_ros.worker.identity import LABEL_REFUSALS

#: Seconds a capture-store size is cached (it walks the store's files).
CAPTURE_BYTES_TTL_S = 10.0
INFERENCE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
#: Buckets of the request, queue and first-chunk times (s): from a 0 ms policy's sub-ms to a cold start.
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
#: The ``outcome`` label values of ``seq_requests_total``: a chunk, or an error code name.
OUTCOMES = ('chunk', *(name for name in pb.ErrorCode.keys() if name != 'ERROR_CODE_UNSPECIFIED'))
#: Longest gap (s) between two telemetry frames counted as held time (a robot that stopped sending).
MAX_TELEMETRY_GAP_S = 5.0


def package_version() -> str:
    """Return the worker's package version (``sequence_ai_ros.__version__``, as EpisodeStarted reports it)."""
    return sequence_ai_ros.__version__


def _queue_depth(runtime: Any) -> int:
    """``seq_queue_depth`` of a deployment's runtime: its requests waiting for their turn (queued or pipelined)."""
    return runtime.scheduler.queue_depth


def _active_episodes(runtime: Any) -> int:
    """``seq_active_episodes`` of a deployment's runtime: its episodes in progress."""
    return len(runtime.running_episodes())


class MetricsSink:
    """What the worker reports; this base class drops everything (metrics off)."""

    def request(self, deployment: str, outcome: str) -> None:
        """Count one observation request answered with ``outcome`` (``chunk`` or an error code name)."""

    def batch(self, deployment: str, size: int, seconds: float) -> None:
        """Record one policy call of ``size`` requests that took ``seconds`` (s)."""

    def timed(self, deployment: str, request_s: float, queue_s: float | None = None,
              first_chunk_s: float | None = None) -> None:
        """Record one answered request: its time in the worker, its queue wait, the episode's first chunk (s)."""

    def underruns(self, deployment: str, count: int, seconds: float) -> None:
        """Count underruns (and their held seconds) seen live in a robot's telemetry."""

    def track(self, runtime: Any) -> None:
        """Read the gauges and build info of ``runtime``'s deployment from ``runtime`` (a new version) from now on."""

    def episode_ended(self, deployment: str, reason: str, underruns: int = 0, underrun_s: float = 0.0) -> None:
        """Count an ended episode and the underruns its robot reported."""

    def refused(self, reason: str) -> None:
        """Count a refused stream (``max_streams``, ``anonymous`` or ``per_client``)."""

    def refused_value(self, deployment: str, field: str) -> None:
        """Count a value the boundary refused (``field``: one of the schema's fields)."""

    def label_refused(self, deployment: str, reason: str) -> None:
        """Count a refused Label call (``reason``: one of :data:`~sequence_ai_ros.worker.identity.LABEL_REFUSALS`)."""

    def rollout_failed(self, deployment: str) -> None:
        """Count a version of ``deployment`` registered while serving that failed (it is not tried again)."""

    def forget(self, deployment: str) -> None:
        """Drop every series of ``deployment``, which ``seq delete`` removed and the worker unloaded."""

    def close(self) -> None:
        """Stop serving metrics."""


#: A metric family labelled by deployment, with the values of its other labels (one tuple per series).
Labelled = tuple[Any, list[tuple[str, ...]]]


class RequestFamilies:
    """The families of requests and policy calls: counts by outcome, request, queue and first-chunk times, calls.

    :param prom: the ``prometheus_client`` module.
    :param reg: the registry they join.
    """

    def __init__(self, prom: Any, reg: Any) -> None:
        self.requests = prom.Counter('seq_requests', 'Observation requests by outcome', ['deployment', 'outcome'],
                                     registry=reg)
        self.inference = prom.Histogram('seq_inference_seconds', 'Duration of one policy call (s)', ['deployment'],
                                        buckets=INFERENCE_BUCKETS, registry=reg)
        self.batch_size = prom.Histogram('seq_batch_size', 'Requests per policy call', ['deployment'],
                                         buckets=BATCH_BUCKETS, registry=reg)
        self.request_s = prom.Histogram('seq_request_seconds', 'From a request\'s arrival to its reply, in the '
                                        'worker (s)', ['deployment'], buckets=LATENCY_BUCKETS, registry=reg)
        self.queue_s = prom.Histogram('seq_queue_seconds', 'Time a request waited for its turn at inference (s)',
                                      ['deployment'], buckets=LATENCY_BUCKETS, registry=reg)
        self.first_chunk_s = prom.Histogram('seq_time_to_first_chunk_seconds', 'From EpisodeStart to the '
                                            'episode\'s first chunk (s)', ['deployment'], buckets=LATENCY_BUCKETS,
                                            registry=reg)

    def labelled(self) -> list[Labelled]:
        """Each family with the values of its labels besides ``deployment``."""
        outcomes: list[tuple[str, ...]] = [(outcome,) for outcome in OUTCOMES]
        return [(self.requests, outcomes)] + [(family, [()]) for family in (
            self.inference, self.batch_size, self.request_s, self.queue_s, self.first_chunk_s)]

    def request(self, name: str, outcome: str) -> None:
        """Count one request of deployment ``name`` answered with ``outcome``."""
        self.requests.labels(name, outcome).inc()

    def batch(self, name: str, size: int, seconds: float) -> None:
        """Record one policy call of ``size`` requests that took ``seconds``."""
        self.inference.labels(name).observe(seconds)
        self.batch_size.labels(name).observe(size)

    def timed(self, name: str, request_s: float, queue_s: float | None, first_chunk_s: float | None) -> None:
        """Record one answered request's times (s; negative ones as 0); None: not measured."""
        self.request_s.labels(name).observe(max(0.0, request_s))
        if queue_s is not None:
            self.queue_s.labels(name).observe(max(0.0, queue_s))
        if first_chunk_s is not None:
            self.first_chunk_s.labels(name).observe(max(0.0, first_chunk_s))


class EpisodeFamilies:
    """The families of episode ends and underruns: as the robots reported them at EpisodeEnd, and from telemetry.

    :param prom: the ``prometheus_client`` module.
    :param reg: the registry they join.
    """

    def __init__(self, prom: Any, reg: Any) -> None:
        self.ended = prom.Counter('seq_episodes_ended', 'Episodes ended, by reason', ['deployment', 'reason'],
                                  registry=reg)
        self.underruns = prom.Counter('seq_client_underruns', 'Underruns reported by robots at EpisodeEnd',
                                      ['deployment'], registry=reg)
        self.underrun_s = prom.Counter('seq_client_underrun_seconds', 'Seconds robots held, reported at EpisodeEnd',
                                       ['deployment'], registry=reg)
        self.live_underruns = prom.Counter('seq_telemetry_underruns', 'Underruns seen in the robots\' telemetry',
                                           ['deployment'], registry=reg)
        self.live_underrun_s = prom.Counter('seq_telemetry_underrun_seconds', 'Seconds held in underrun, from the '
                                            'robots\' telemetry', ['deployment'], registry=reg)

    def labelled(self) -> list[Labelled]:
        """Each family with the values of its labels besides ``deployment``."""
        reasons: list[tuple[str, ...]] = [(reason,) for reason in (*REASONS, OTHER_REASON)]
        return [(self.ended, reasons)] + [(family, [()]) for family in (
            self.underruns, self.underrun_s, self.live_underruns, self.live_underrun_s)]

    def episode_ended(self, name: str, reason: str, underruns: Any, underrun_s: Any) -> None:
        """Count an ended episode and its reported underruns (a non-finite or negative figure is not counted)."""
        self.ended.labels(name, reason_label(reason)).inc()
        if isinstance(underruns, int) and underruns > 0:
            self.underruns.labels(name).inc(underruns)
        if isinstance(underrun_s, (int, float)) and math.isfinite(underrun_s) and underrun_s > 0:
            self.underrun_s.labels(name).inc(underrun_s)

    def live(self, name: str, count: int, seconds: float) -> None:
        """Count underruns seen live in telemetry."""
        if count > 0:
            self.live_underruns.labels(name).inc(count)
        if math.isfinite(seconds) and seconds > 0:
            self.live_underrun_s.labels(name).inc(seconds)


class ScrapeGauges:
    """The gauges read from each deployment's runtime at scrape time: queue depth, episodes, streams, capture bytes.

    A capture store's size is cached :attr:`capture_bytes_ttl_s` s (it walks the store's files).

    :param prom: the ``prometheus_client`` module.
    :param reg: the registry they join.
    :param open_streams: the number of open Episode streams of a deployment (its name).
    """

    def __init__(self, prom: Any, reg: Any, open_streams: Callable[[str], int]) -> None:
        self.queue = prom.Gauge('seq_queue_depth', 'Requests waiting for their turn at inference (queued, or pipelined '
                                'to a deployment process behind the running call)', ['deployment'], registry=reg)
        self.active = prom.Gauge('seq_active_episodes', 'Episodes in progress', ['deployment'], registry=reg)
        self.streams = prom.Gauge('seq_open_streams', 'Episode streams open', ['deployment'], registry=reg)
        self.capture = prom.Gauge('seq_capture_bytes', 'Bytes in the capture store', ['deployment'], registry=reg)
        self._open_streams = open_streams
        #: seconds a capture-store size is reused before the store is walked again
        self.capture_bytes_ttl_s = CAPTURE_BYTES_TTL_S
        self._lock = threading.Lock()
        self._capture_cache: dict[str, tuple[float, int]] = {}

    def add(self, name: str, runtime: Any) -> None:
        """Read deployment ``name``'s gauges from ``runtime`` and the server's open streams."""
        self.track(name, runtime)
        self.streams.labels(name).set_function(functools.partial(self._open_streams, name))
        if runtime.capture_store is not None:
            self.capture.labels(name).set_function(functools.partial(self._capture_bytes, name, runtime))

    def track(self, name: str, runtime: Any) -> None:
        """Read the queue depth and episodes of ``name`` from ``runtime`` (a new version) from now on."""
        self.queue.labels(name).set_function(functools.partial(_queue_depth, runtime))
        self.active.labels(name).set_function(functools.partial(_active_episodes, runtime))

    def forget(self, name: str) -> None:
        """Remove ``name``'s gauges."""
        for gauge in (self.queue, self.active, self.streams, self.capture):
            with contextlib.suppress(KeyError):
                gauge.remove(name)
        with self._lock:
            self._capture_cache.pop(name, None)

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


class BuildInfo:
    """``seq_build_info``: 1 for the worker's package version and each served deployment's registered version.

    :param prom: the ``prometheus_client`` module.
    :param reg: the registry it joins.
    """

    def __init__(self, prom: Any, reg: Any) -> None:
        self.gauge = prom.Gauge('seq_build_info', 'The worker\'s version and each deployment\'s registered version '
                                '(1)', ['version', 'deployment', 'deployment_version'], registry=reg)
        self._versions: dict[str, str] = {}

    def serving(self, name: str, version: Any) -> None:
        """Deployment ``name`` serves ``version`` now (its previous version's series goes)."""
        self.forget(name)
        self._versions[name] = str(version)
        self.gauge.labels(package_version(), name, self._versions[name]).set(1)

    def forget(self, name: str) -> None:
        """Remove ``name``'s series."""
        version = self._versions.pop(name, None)
        if version is not None:
            with contextlib.suppress(KeyError):
                self.gauge.remove(package_version(), name, version)


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
        self._requests = RequestFamilies(prom, reg)
        self._episodes = EpisodeFamilies(prom, reg)
        self._refused = prom.Counter('seq_streams_refused', 'Episode streams refused', ['reason'], registry=reg)
        self._build = BuildInfo(prom, reg)
        prom.ProcessCollector(registry=reg)     # process_cpu_seconds_total, process_resident_memory_bytes, fds
        prom.PlatformCollector(registry=reg)    # python_info
        prom.GCCollector(registry=reg)          # python_gc_*
        self._boundary = prom.Counter('seq_boundary_refused', 'Values from the wire refused at the boundary',
                                      ['deployment', 'field'], registry=reg)
        self._labels_refused = prom.Counter('seq_labels_refused', 'Label calls refused: without the token, of an '
                                            "episode another identity ran, or past one identity's bound of labels "
                                            'of episodes the worker never saw', ['deployment', 'reason'], registry=reg)
        self._rollout_failures = prom.Counter('seq_rollout_failures', 'Versions registered while serving that '
                                              'failed to import, load or pass the dry run', ['deployment'],
                                              registry=reg)
        self._gauges = ScrapeGauges(prom, reg, open_streams)     # read from the runtime at scrape time
        self._served = set(runtimes)
        self._token = token or None
        self._generate = prom.generate_latest
        #: every family labelled by deployment, with the values of its other labels: each series exists at 0
        #: from the start, and :meth:`forget` removes them all
        self._by_deployment: list[Labelled] = [
            *self._requests.labelled(), *self._episodes.labelled(),
            (self._boundary, [(field,) for field in (*FIELDS, 'other')]), (self._rollout_failures, [()]),
            (self._labels_refused, [(reason,) for reason in LABEL_REFUSALS])]
        for reason in REFUSALS:
            self._refused.labels(reason)
        for name, runtime in runtimes.items():   # every labelled series, at 0 from the start
            for family, rest in self._by_deployment:
                for values in rest:
                    family.labels(name, *values)
            self._build.serving(name, getattr(runtime, 'version', ''))
            self._gauges.add(name, runtime)
        self._server = BoundedServer('metrics', self._serve, host, port)
        self.port: int = self._server.port

    @property
    def capture_bytes_ttl_s(self) -> float:
        """Seconds a capture-store size is reused before the store is walked again."""
        return self._gauges.capture_bytes_ttl_s

    @capture_bytes_ttl_s.setter
    def capture_bytes_ttl_s(self, seconds: float) -> None:
        self._gauges.capture_bytes_ttl_s = seconds

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
        elif self._token is not None and not authorized(auth, self._token):
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

    def _deployment(self, name: str) -> str:
        return name if name in self._served else ''

    def request(self, deployment: str, outcome: str) -> None:
        """Count one observation request answered with ``outcome`` (``chunk`` or an ErrorCode name)."""
        self._requests.request(self._deployment(deployment), outcome)

    def batch(self, deployment: str, size: int, seconds: float) -> None:
        """Record one policy call."""
        self._requests.batch(self._deployment(deployment), size, seconds)

    def track(self, runtime: Any) -> None:
        """Read ``runtime``'s queue depth and episodes from now on, and name its version in ``seq_build_info``."""
        name = runtime.name
        if name not in self._served:
            return
        self._gauges.track(name, runtime)
        self._build.serving(name, runtime.version)

    def timed(self, deployment: str, request_s: float, queue_s: float | None = None,
              first_chunk_s: float | None = None) -> None:
        """Record one answered request's times (s); None: not measured (no chunk, not the first)."""
        self._requests.timed(self._deployment(deployment), request_s, queue_s, first_chunk_s)

    def underruns(self, deployment: str, count: int, seconds: float) -> None:
        """Count underruns seen live in telemetry (see :class:`UnderrunWatch`)."""
        self._episodes.live(self._deployment(deployment), count, seconds)

    def episode_ended(self, deployment: str, reason: str, underruns: int = 0, underrun_s: float = 0.0) -> None:
        """Count an ended episode (its reason's label: documented, else ``other``) and its reported underruns.

        A non-finite or negative figure is not counted (one ``inf`` would leave the counter at +Inf for good).
        """
        self._episodes.episode_ended(self._deployment(deployment), reason, underruns, underrun_s)

    def refused(self, reason: str) -> None:
        """Count a refused stream."""
        self._refused.labels(reason).inc()

    def refused_value(self, deployment: str, field: str) -> None:
        """Count a value the boundary refused."""
        self._boundary.labels(self._deployment(deployment), field if field in FIELDS else 'other').inc()

    def label_refused(self, deployment: str, reason: str) -> None:
        """Count a refused Label call."""
        self._labels_refused.labels(self._deployment(deployment), reason if reason in LABEL_REFUSALS else 'other').inc()

    def rollout_failed(self, deployment: str) -> None:
        """Count a version that failed to roll out."""
        self._rollout_failures.labels(self._deployment(deployment)).inc()

    def forget(self, deployment: str) -> None:
        """Remove every series of ``deployment`` (``seq delete``: it is no longer served), counters included.

        Later reports naming it count under ``deployment=""``, as for a name never served.
        """
        if deployment not in self._served:
            return
        self._served.discard(deployment)
        for family, rest in self._by_deployment:
            for values in rest:
                with contextlib.suppress(KeyError):
                    family.remove(deployment, *values)
        self._gauges.forget(deployment)
        self._build.forget(deployment)

    def close(self) -> None:
        """Shut the HTTP endpoint down (timed join)."""
        self._server.close()


class UnderrunWatch:
    """Underruns of one episode as its telemetry shows them, batch by batch (not only at EpisodeEnd).

    An underrun starts at a frame whose ``hold_reason`` is ``underrun`` after one that was not; its held time
    is the time from the frame before it to the last frame in underrun, each gap bounded by
    :data:`MAX_TELEMETRY_GAP_S`, on the robot's tick clock: a frame's ``step_start`` (its control deadline on
    the chunk-step axis) times the policy's ``dt``. A robot that stamps every tick with the same time (one
    ``Observation`` object reused) still ticks. Frames without a step span (an older client) fall back to
    their ``robot_time_s``. Frames come at the capture rate, so the seconds are as fine as that rate.

    :param dt: the policy's action period (s): one chunk step.
    """

    __slots__ = ('_dt', '_in_underrun', '_last')

    def __init__(self, dt: float = 0.0) -> None:
        self._dt = float(dt) if math.isfinite(dt) and dt > 0 else 0.0
        self._in_underrun = False
        self._last: tuple[bool, float] | None = None   # (on the tick clock, the time), of the frame before

    def _clock(self, frame: Any) -> tuple[bool, float]:
        """(True, its tick time) for a frame with a step span (when dt is known), else (False, its robot time)."""
        if self._dt and frame.step_end > frame.step_start:
            return True, frame.step_start * self._dt
        return False, frame.robot_time_s

    def observe(self, frames: Any) -> tuple[int, float]:
        """Return (underruns begun, seconds held in underrun) in ``frames`` (TelemetryFrame messages, in order)."""
        count, seconds = 0, 0.0
        for frame in frames:
            ticked, t = self._clock(frame)
            under = frame.hold_reason == 'underrun'
            if under and not self._in_underrun:
                count += 1
            last = self._last
            if under and last is not None and last[0] == ticked and math.isfinite(t) and t > last[1]:
                seconds += min(t - last[1], MAX_TELEMETRY_GAP_S)
            self._in_underrun = under
            if math.isfinite(t):
                self._last = (ticked, t)
        return count, seconds
