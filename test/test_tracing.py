"""OpenTelemetry tracing (issue: one connected trace per episode, robot -> HAProxy -> worker -> deployment process).

- in one process, with the SDK's in-memory exporter: a robot and a worker whose policy runs in its deployment
  process (``--isolation process``) give one trace whose spans nest as the docs say, in order;
- through a real fleet (``seq fleet``'s HAProxy, the shipped config, one ``seq serve --otlp-endpoint`` replica)
  to a real OTLP/gRPC receiver started here (opentelemetry-proto's TraceService): the robot's and the
  replica's spans arrive there as one trace, so ``traceparent`` passed through the balancer;
- off by default: no tracer, no span, no ``traceparent`` and no ``trace_context`` on the wire.

Skips when the ``[tracing]`` extra (opentelemetry-sdk, the OTLP exporter) is not installed.
"""

from __future__ import annotations

import shutil
import threading
from concurrent import futures
from pathlib import Path

import numpy as np
import pytest
from test_worker_support import wait_for

pytest.importorskip('opentelemetry.sdk.trace', reason='the [tracing] extra (opentelemetry-sdk) is not installed')
pytest.importorskip('opentelemetry.exporter.otlp.proto.grpc.trace_exporter',
                    reason='the [tracing] extra (opentelemetry-exporter-otlp-proto-grpc) is not installed')

import grpc  # noqa: E402
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402

from sequence_ai_ros.client import Observation, connect  # noqa: E402
from sequence_ai_ros.protocol import tracing  # noqa: E402
from sequence_ai_ros.protocol.messages import observation_request_bytes  # noqa: E402

POLICY = Path(__file__).resolve().parent / 'policies' / 'replica_echo.py'
WORKER = ('worker.episode', 'worker.request', 'queue_wait', 'inference', 'chunk_send', 'capture_commit')


@pytest.fixture
def traced():
    """Tracing on in this process for one test (then off again: the default)."""
    yield
    tracing.shutdown()


def drive(endpoint: str, episode_id: str) -> None:
    """One short episode of ReplicaEcho (20-step chunks at 0.05 s): a few requests."""
    with connect('replica_echo', endpoint=endpoint, timeout=10.0) as policy:
        policy.wait_until_ready(timeout=30.0)
        out = policy.run(lambda: Observation(state=np.zeros(2, np.float32), state_names=('a', 'b')),
                         lambda action: None, max_actions=30, episode_id=episode_id)
        assert out.reason == 'completed', out


def check_trace(spans: list[dict], episode_id: str, version: int, deployment_process: bool = False) -> None:
    """One connected trace, each request's spans in time order, the worker's attributes.

    episode > request > worker.request > queue_wait, inference, chunk_send (and, with ``deployment_process``,
    policy.infer from the deployment process); episode > worker.episode > capture_commit.
    """
    assert len({s['trace'] for s in spans}) == 1, {(s['name'], s['trace']) for s in spans}
    by_name: dict[str, list[dict]] = {}
    for s in spans:
        by_name.setdefault(s['name'], []).append(s)
    assert set(by_name) == {'episode', 'request', *WORKER, *(['policy.infer'] if deployment_process else [])}, \
        sorted(by_name)
    (episode,), (worker,), (commit,) = by_name['episode'], by_name['worker.episode'], by_name['capture_commit']
    assert episode['parent'] is None and worker['parent'] == episode['id'] and commit['parent'] == worker['id']
    requests = {s['attrs']['seq.request_id']: s for s in by_name['request']}
    served = by_name['worker.request']
    assert len(requests) >= 2 and len(served) == len(requests)
    children = {name: {s['parent']: s for s in by_name[name]} for name in ('queue_wait', 'inference', 'chunk_send')}
    for w in served:
        robot = requests[w['attrs']['seq.request_id']]
        assert robot['parent'] == episode['id'] and w['parent'] == robot['id']
        wait, infer, send = (children[name][w['id']] for name in ('queue_wait', 'inference', 'chunk_send'))
        # in order: the robot sends, the worker queues it, infers, sends the chunk, the robot receives it
        assert robot['start'] <= w['start'] <= wait['start'] <= wait['end'] <= infer['start'] <= infer['end']
        assert infer['end'] <= send['start'] <= send['end'] <= w['end'] and send['start'] <= robot['end']
        if deployment_process:   # the context crossed into the deployment process: its span under the request's
            (policy,) = [s for s in by_name['policy.infer'] if s['parent'] == w['id']]
            assert infer['start'] <= policy['start'] <= policy['end'] <= infer['end']
            assert policy['attrs']['seq.episode_id'] == episode_id
    assert max(w['end'] for w in served) <= commit['start'] <= commit['end'] <= worker['end'] <= episode['end']
    for s in (worker, commit, *served):
        attrs = s['attrs']
        assert attrs['seq.episode_id'] == episode_id and attrs['seq.deployment'] == 'replica_echo'
        assert attrs['seq.version'] == version and 'seq.robot' in attrs
    assert episode['attrs']['seq.episode_id'] == episode_id


def sdk_spans(exporter: InMemorySpanExporter) -> list[dict]:
    return [{'name': s.name, 'trace': s.context.trace_id, 'id': s.context.span_id,
             'parent': s.parent.span_id if s.parent is not None else None, 'start': s.start_time,
             'end': s.end_time, 'attrs': dict(s.attributes or {})} for s in exporter.get_finished_spans()]


def test_one_episode_is_one_trace_with_the_in_memory_exporter(traced, seq_home: Path):
    from sequence_ai_ros.worker import serve_policy_file

    exporter = InMemorySpanExporter()
    tracing.configure(exporter=exporter)
    server = serve_policy_file(POLICY, deployment='replica_echo', host='127.0.0.1', port=0, isolation='process',
                               home=None)
    try:
        drive(f'127.0.0.1:{server.port}', 'traced-1')
    finally:
        server.stop(grace=0.5)
    check_trace(sdk_spans(exporter), 'traced-1', 0)   # an unregistered file serves as version 0


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """A real OTLP/gRPC trace receiver: keeps every span it is sent."""

    def __init__(self) -> None:
        self.spans: list[dict] = []
        self.services: set[str] = set()
        self.lock = threading.Lock()

    def Export(self, request, context):  # noqa: N802 - the gRPC method's name
        with self.lock:
            for resource in request.resource_spans:
                service = {a.key: a.value.string_value for a in resource.resource.attributes}.get('service.name')
                self.services.add(service)
                for scope in resource.scope_spans:
                    for s in scope.spans:
                        attrs = {a.key: (a.value.int_value if a.value.HasField('int_value') else a.value.string_value)
                                 for a in s.attributes}
                        self.spans.append({'name': s.name, 'trace': s.trace_id, 'id': s.span_id,
                                           'parent': s.parent_span_id or None, 'start': s.start_time_unix_nano,
                                           'end': s.end_time_unix_nano, 'attrs': attrs})
        return trace_service_pb2.ExportTraceServiceResponse()

    def names(self) -> set[str]:
        with self.lock:
            return {s['name'] for s in self.spans}


@pytest.mark.skipif(shutil.which('haproxy') is None and not Path('/usr/sbin/haproxy').exists(),
                    reason='HAProxy is not installed (as root: `make haproxy`)')
def test_the_trace_crosses_haproxy_to_a_real_otlp_receiver(traced, seq_home: Path, monkeypatch):
    from sequence_ai_ros.cli import main as seq_main
    from sequence_ai_ros.worker.fleet import Fleet

    receiver = Receiver()
    collector = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, collector)
    port = collector.add_insecure_port('127.0.0.1:0')
    collector.start()
    monkeypatch.setenv('OTEL_BSP_SCHEDULE_DELAY', '100')    # the replica exports its batch within 0.1 s
    try:
        assert seq_main(['deploy', str(POLICY), '--name', 'replica_echo']) == 0
        tracing.configure(f'127.0.0.1:{port}', service='sequence_ai-robot')
        with Fleet(['replica_echo'], 1, home=seq_home,
                   serve_args=['--otlp-endpoint', f'127.0.0.1:{port}', '--trace-sample-ratio', '0.5']) as fleet:
            drive(fleet.address, 'traced-2')
            assert tracing.flush()
            wait_for(lambda: receiver.names() >= {'episode', 'request', 'policy.infer', *WORKER}, timeout=20,
                     what="the replica's spans at the receiver")
    finally:
        collector.stop(0)
    assert receiver.services == {'sequence_ai-robot', 'sequence_ai-worker', 'sequence_ai-deployment'}
    # the replica samples at 0.5 but follows the robot's sampled trace: every span came
    check_trace(receiver.spans, 'traced-2', 1, deployment_process=True)


def test_off_by_default_nothing_traced_and_nothing_on_the_wire(seq_home: Path):
    from sequence_ai_ros.protocol import sequence_ai_pb2 as pb
    from sequence_ai_ros.worker import serve_policy_file

    assert tracing.TRACER is None
    seen: list[tuple] = []
    server = serve_policy_file(POLICY, deployment='replica_echo', host='127.0.0.1', port=0, isolation='none',
                               home=None)
    try:
        with connect('replica_echo', endpoint=f'127.0.0.1:{server.port}', timeout=10.0) as policy:
            policy.wait_until_ready(timeout=30.0)
            contract = policy.contract
            out = policy.run(lambda: Observation(state=np.zeros(2, np.float32), state_names=('a', 'b')),
                             lambda action: seen.append(action), max_actions=5)
            assert out.reason == 'completed'
    finally:
        server.stop(grace=0.5)
    wire = observation_request_bytes(Observation(state=np.zeros(2, np.float32), state_names=('a', 'b')), contract,
                                     episode_id='e', request_id=1)
    assert pb.EpisodeRequest.FromString(wire).observation.trace_context == ''
    traced = observation_request_bytes(Observation(state=np.zeros(2, np.float32), state_names=('a', 'b')), contract,
                                       episode_id='e', request_id=1, trace_context='00-' + '1' * 32 + '-' + '2' * 16
                                       + '-01')
    assert pb.EpisodeRequest.FromString(traced).observation.trace_context.endswith('-01')


def test_the_shipped_haproxy_config_passes_traceparent_through():
    """HTTP mode forwards request headers as they came; the config must never drop the trace context."""
    cfg = (Path(__file__).resolve().parents[1] / 'sequence_ai_ros' / 'worker' / 'haproxy.cfg').read_text()
    lines = [line.split('#', 1)[0].strip() for line in cfg.splitlines()]
    assert 'mode http' in lines
    assert not [line for line in lines if 'traceparent' in line and ('del-header' in line or 'set-header' in line)]
    assert not [line for line in lines if line.startswith('http-request del-header') and 'x-forwarded-for' not in line]


def test_ratio_and_endpoint_are_checked():
    from sequence_ai_ros.exceptions import ConfigError

    with pytest.raises(ConfigError, match='0..1'):
        tracing.configure('127.0.0.1:4317', ratio=1.5)
    with pytest.raises(ConfigError, match='--otlp-endpoint'):
        tracing.configure()
    assert tracing.TRACER is None


def test_a_malformed_trace_context_keeps_the_request_in_the_episodes_trace():
    """A hostile or broken client's trace_context never splits the worker's trace.

    The request goes under worker.episode, as with none.
    """
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    worker = tracing.WorkerTrace(provider.get_tracer('test'), '', {'seq.episode_id': 'e'})
    for rid, bad in enumerate(['garbage', '00-' + '0' * 32 + '-' + '0' * 16 + '-01', 'ff-' + 'a' * 32 + '-'
                               + 'b' * 16 + '-01', 'x' * 200_000], start=1):
        worker.arrived(bad, rid, 0)
        worker.sent()
    worker.end()
    spans = sdk_spans(exporter)
    (root,) = [s for s in spans if s['name'] == 'worker.episode']
    requests = [s for s in spans if s['name'] == 'worker.request']
    assert len(requests) == 4 and all(s['parent'] == root['id'] and s['trace'] == root['trace'] for s in requests)
