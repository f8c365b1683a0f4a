"""OpenTelemetry tracing of episodes, off unless configured (the ``[tracing]`` extra).

One trace per episode, continued across the robot, the balancer and the worker:

- the robot (:class:`EpisodeTrace`, made by the client's Episode call) starts the trace with an ``episode``
  span, sends its W3C ``traceparent`` as the Episode call's metadata (HAProxy passes it through), and opens
  one ``request`` span per ObservationRequest, whose own ``traceparent`` rides in the request's
  ``trace_context`` field; the span ends when its chunk (or the request's error) arrives.
- the worker (:class:`WorkerTrace`) continues it: ``worker.episode`` under the robot's episode span, and per
  request ``worker.request`` under the robot's request span, with ``queue_wait``, ``inference`` (the
  deployment's inference, in its deployment process under ``--isolation process``, timed by the worker's
  inference thread) and ``chunk_send`` as children, and ``capture_commit`` (the episode's end: hook, capture
  commit, usage) under ``worker.episode``. Worker spans carry ``seq.episode_id``, ``seq.deployment``,
  ``seq.version`` and ``seq.robot`` (EpisodeStart's client id).

:data:`TRACER` is None until :func:`configure` (``seq serve --otlp-endpoint``, or a robot's own call), so
that off, each hook is one ``is None`` test. Spans go over OTLP/gRPC (``opentelemetry-exporter-otlp-proto-grpc``)
in batches; a sampling ratio below 1 keeps that share of new traces, and a worker follows the robot's
decision for a trace the robot started (parent-based sampling).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

from sequence_ai_ros.exceptions import ConfigError

#: the W3C trace-context metadata key (and the carrier key of ``trace_context``)
TRACEPARENT = 'traceparent'

#: the environment that tells a worker's deployment processes to trace (:func:`export_to_children`)
ENDPOINT_ENV = 'SEQ_OTLP_ENDPOINT'
RATIO_ENV = 'SEQ_TRACE_SAMPLE_RATIO'

#: the tracer of this process, or None: tracing is off (the default)
TRACER: Any = None
_provider: Any = None
_lock = threading.Lock()

_MISSING = ('tracing needs the OpenTelemetry SDK and its OTLP exporter: pip install "sequence_ai_ros[tracing]" '
            '(opentelemetry-sdk, opentelemetry-exporter-otlp-proto-grpc)')


def configure(endpoint: str | None = None, ratio: float = 1.0, service: str = 'sequence_ai',
              exporter: Any = None) -> None:
    """Turn tracing on in this process (again: the previous setup is flushed and replaced).

    :param endpoint: the OTLP/gRPC collector, ``host:port`` (plaintext) or ``http(s)://host:port``.
    :param ratio: the share of new traces kept, 0..1 (a trace whose parent came sampled is always kept).
    :param service: the ``service.name`` resource attribute (``sequence_ai-worker``, ``sequence_ai-robot``).
    :param exporter: a span exporter instead of OTLP (tests: the SDK's ``InMemorySpanExporter``); its spans are
        exported as each ends.
    :raises ConfigError: without ``endpoint`` and ``exporter``, for a ratio outside 0..1, or without the SDK.
    """
    global TRACER, _provider
    if not 0.0 <= ratio <= 1.0:
        raise ConfigError(f'trace sampling ratio must be within 0..1, got {ratio}')
    if endpoint is None and exporter is None:
        raise ConfigError('tracing needs an OTLP endpoint (--otlp-endpoint HOST:PORT) or an exporter')
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
    except ImportError:
        raise ConfigError(_MISSING) from None
    import sequence_ai_ros

    provider = TracerProvider(sampler=ParentBased(TraceIdRatioBased(ratio)),
                              resource=Resource.create({'service.name': service,
                                                        'service.version': sequence_ai_ros.__version__}))
    if exporter is None:
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        except ImportError:
            raise ConfigError(_MISSING) from None
        secure = str(endpoint).startswith('https://')
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint, insecure=not secure)))
    else:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    with _lock:
        old, _provider = _provider, provider
        TRACER = provider.get_tracer('sequence_ai_ros', sequence_ai_ros.__version__)
    if old is not None:
        old.shutdown()


def shutdown() -> None:
    """Export what is left and turn tracing off (a worker's stop; idempotent)."""
    global TRACER, _provider
    with _lock:
        old, _provider, TRACER = _provider, None, None
    if old is not None:
        old.shutdown()


def export_to_children(endpoint: str, ratio: float) -> None:
    """Let the processes this one starts from now on (a worker's deployment processes) trace to ``endpoint``."""
    os.environ[ENDPOINT_ENV] = endpoint
    os.environ[RATIO_ENV] = repr(ratio)


def configure_from_env(service: str) -> bool:
    """Trace as the parent said (:func:`export_to_children`); False, doing nothing, when it did not.

    A deployment process's spans go to the worker's collector on their own, under the worker's spans.

    :raises ConfigError: as :func:`configure`.
    """
    endpoint = os.environ.get(ENDPOINT_ENV)
    if not endpoint:
        return False
    configure(endpoint, float(os.environ.get(RATIO_ENV) or 1.0), service=service)
    return True


@contextlib.contextmanager
def policy_span(name: str, traceparents: list[str], attributes: dict[str, Any]) -> Iterator[None]:
    """A span around a policy call in its deployment process, under the worker's ``worker.request``.

    :param traceparents: the ``trace_context`` of each input ('' for an untraced one): the span's parent is the
        first; a batch's other requests are its links. No span when none is set or tracing is off here.
    """
    tracer = TRACER
    traced = [t for t in traceparents if t]
    if tracer is None or not traced:
        yield
        return
    from opentelemetry import trace

    links = [trace.Link(trace.get_current_span(context_of(t)).get_span_context()) for t in traced[1:]]
    span = tracer.start_span(name, context=context_of(traced[0]), links=links, attributes=attributes)
    try:
        yield
    finally:
        span.end()


def flush(timeout_s: float = 5.0) -> bool:
    """Export the spans ended so far; True when done within ``timeout_s`` (s), and when tracing is off.

    Waits at most ``timeout_s``: an exporter whose collector is down or silent may retry for longer than the
    timeout it is given, so the flush runs on a thread of its own, left to finish (or not) behind.
    """
    provider = _provider
    if provider is None:
        return True
    done: list[bool] = []
    thread = threading.Thread(target=lambda: done.append(bool(provider.force_flush(int(timeout_s * 1000)))),
                              name='seq-trace-flush', daemon=True)
    thread.start()
    thread.join(timeout_s)
    return bool(done and done[0])


def traceparent_of(span: Any) -> str:
    """The W3C ``traceparent`` of ``span`` (``00-<trace id>-<span id>-<flags>``), '' for an invalid one."""
    ctx = span.get_span_context()
    if not ctx.is_valid:
        return ''
    return f'00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}'


def context_of(traceparent: str) -> Any:
    """The OpenTelemetry context whose parent is ``traceparent`` (an empty context for '' or a malformed one)."""
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return TraceContextTextMapPropagator().extract({TRACEPARENT: traceparent} if traceparent else {})


class EpisodeTrace:
    """The robot's side of one episode's trace: the ``episode`` span and one ``request`` span per request.

    Thread-safe: requests are opened on gRPC's request thread, chunks close them on ``seq-recv``.

    :param tracer: the tracer (:data:`TRACER`).
    :param episode_id: the episode. :param deployment: its deployment.
    """

    def __init__(self, tracer: Any, episode_id: str, deployment: str) -> None:
        from opentelemetry import trace

        self._tracer = tracer
        self._root = tracer.start_span('episode', kind=trace.SpanKind.CLIENT,
                                       attributes={'seq.episode_id': episode_id, 'seq.deployment': deployment})
        self._context = trace.set_span_in_context(self._root)
        #: the episode span's traceparent: the Episode call's metadata
        self.traceparent = traceparent_of(self._root)
        self._open: dict[int, Any] = {}
        self._lock = threading.Lock()

    def request(self, request_id: int) -> str:
        """Open request ``request_id``'s span; return its traceparent (the request's ``trace_context``)."""
        span = self._tracer.start_span('request', context=self._context, attributes={'seq.request_id': request_id})
        with self._lock:
            self._open[request_id] = span
        return traceparent_of(span)

    def answered(self, request_id: int, error: str = '') -> None:
        """Request ``request_id``'s chunk (or, with ``error``, its error) arrived: its span ends."""
        with self._lock:
            span = self._open.pop(request_id, None)
        if span is not None:
            if error:
                from opentelemetry.trace import Status, StatusCode

                span.set_status(Status(StatusCode.ERROR, error))
            span.end()

    def end(self, reason: str = '') -> None:
        """The episode ended: unanswered requests' spans and the episode span end (idempotent)."""
        with self._lock:
            spans, self._open = list(self._open.values()), {}
        for span in spans:
            span.set_attribute('seq.unanswered', True)
            span.end()
        if self._root.is_recording():
            if reason:
                self._root.set_attribute('seq.reason', reason)
            self._root.end()


class WorkerTrace:
    """The worker's side of one episode's trace (the event loop's thread only, but :meth:`end`).

    :param tracer: the tracer (:data:`TRACER`).
    :param traceparent: the Episode call's ``traceparent`` metadata ('' : a trace of its own).
    :param attributes: the episode's (``seq.episode_id``, ``seq.deployment``, ``seq.version``, ``seq.robot``).
    """

    def __init__(self, tracer: Any, traceparent: str, attributes: dict[str, Any]) -> None:
        from opentelemetry import trace

        self._trace = trace
        self._tracer = tracer
        self._attributes = attributes
        self._root = tracer.start_span('worker.episode', context=context_of(traceparent),
                                       kind=trace.SpanKind.SERVER, attributes=attributes)
        self._context = trace.set_span_in_context(self._root)
        self._sending: tuple[Any, Any] | None = None   # (worker.request, chunk_send or None) of the open request
        self.current = ''

    def arrived(self, trace_context: str, request_id: int, arrived_ns: int) -> str:
        """Request ``request_id`` arrived: open its ``worker.request`` span; return that span's traceparent.

        The returned traceparent goes with the request to the policy (``PolicyInput.trace_context``), so that
        its deployment process continues the trace (:func:`policy_span`).

        :param trace_context: the request's ``trace_context`` (its parent; '' : under ``worker.episode``).
        :param arrived_ns: when it arrived (``time.time_ns()``).
        """
        self.sent()      # a request answered by nothing (the episode's end came first) ends here
        parent = context_of(trace_context) if trace_context else None
        if parent is None or not self._trace.get_current_span(parent).get_span_context().is_valid:
            parent = self._context      # none given, or malformed: the request stays in the episode's trace
        span = self._tracer.start_span('worker.request', context=parent, kind=self._trace.SpanKind.SERVER,
                                       start_time=arrived_ns,
                                       attributes={**self._attributes, 'seq.request_id': request_id})
        self._sending = (span, None)
        #: the traceparent of the open ``worker.request`` span ('' when none)
        self.current = traceparent_of(span)
        return self.current

    def answered(self, queue_wait_ms: float, inference_ms: float, error: str = '') -> None:
        """The open request was answered (its reply about to go out): its spans under ``worker.request``.

        ``queue_wait``, ``inference`` (both timed by the inference thread) and ``chunk_send`` (open until
        :meth:`sent`).

        :param queue_wait_ms: its wait for the inference thread; :param inference_ms: its inference (ms), which
            ended just now (0 and 0 for a request refused before inference).
        :param error: the error answered instead of a chunk.
        """
        if self._sending is None:
            return
        span = self._sending[0]
        inner = self._trace.set_span_in_context(span)
        now = time.time_ns()
        if inference_ms or queue_wait_ms:
            start = span.start_time if getattr(span, 'start_time', None) else 0
            inferred = max(start, now - int(inference_ms * 1e6))
            waited = max(start, inferred - int(queue_wait_ms * 1e6))
            self._tracer.start_span('queue_wait', context=inner, start_time=waited).end(end_time=inferred)
            self._tracer.start_span('inference', context=inner, start_time=inferred).end(end_time=now)
        if error:
            span.set_status(self._trace.Status(self._trace.StatusCode.ERROR, error))
        self._sending = (span, self._tracer.start_span('chunk_send', context=inner))

    def sent(self) -> None:
        """The reply of the open request went out (gRPC took it): its spans end."""
        sending, self._sending = self._sending, None
        self.current = ''
        if sending is not None:
            if sending[1] is not None:
                sending[1].end()
            sending[0].end()

    @contextlib.contextmanager
    def commit(self) -> Iterator[None]:
        """A ``capture_commit`` span around the episode's end (the hook, the capture commit, usage)."""
        span = self._tracer.start_span('capture_commit', context=self._context, attributes=self._attributes)
        try:
            yield
        finally:
            span.end()

    def end(self, reason: str = '') -> None:
        """The episode ended (any thread; idempotent)."""
        self.sent()
        if self._root.is_recording():
            if reason:
                self._root.set_attribute('seq.reason', reason)
            self._root.end()
