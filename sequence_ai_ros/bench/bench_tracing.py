"""Tracing benchmark: what OpenTelemetry tracing costs a round trip, off (the default) and on at ratio 1.0.

Payload and path as the wire benchmark's ``ours`` (:class:`~sequence_ai_ros.bench.bench_wire.Ours`: two raw
224x224 frames and a 26-d state up, a (50, 26) chunk down, a 0 ms policy in the worker): one robot against a
worker without tracing, one robot that traces against a worker with ``--otlp-endpoint`` at ratio 1.0, both
exporting to a real OTLP/gRPC receiver here (opentelemetry-proto's TraceService, counting spans). The two
alternate in blocks, so machine load hits both alike.

Figures:

- ``off_guard_ms``: what tracing adds per request when off, measured on the real objects: the client's and the
  worker's ``is None`` tests of a request's round trip (the only tracing code an untraced request runs). The
  target is at most 0.02 ms (p50 over repeats).
- round trip p50 off and on, and their difference (``on_cost_ms``): the spans of a traced request (the robot's
  ``request``, the worker's ``worker.request``, ``queue_wait``, ``inference``, ``chunk_send``) and their batched
  export. Needs the ``[tracing]`` extra.
"""

from __future__ import annotations

import json
import threading
import time
import timeit
from concurrent import futures
from typing import Any

import numpy as np

from sequence_ai_ros.bench.bench_client import start_server_process
from sequence_ai_ros.bench.bench_wire import OURS_SERVER, POLICY, Ours

BLOCKS, PER_BLOCK = 4, 150           # 600 round trips each, in alternating blocks
OFF_TARGET_MS = 0.02

TRACED_SERVER = (
    'import sys\n'
    'from sequence_ai_ros.protocol import tracing\n'
    "tracing.configure(sys.argv[2], 1.0, service='sequence_ai-worker')\n" + OURS_SERVER)


class _Counter:
    """A real OTLP/gRPC trace receiver that counts the spans it is sent."""

    def __init__(self) -> None:
        import grpc
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

        self.spans = 0
        self._lock = threading.Lock()
        counter = self

        class Service(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request: Any, context: Any) -> Any:  # noqa: N802 - the gRPC method's name
                from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

                with counter._lock:
                    counter.spans += sum(len(s.spans) for r in request.resource_spans for s in r.scope_spans)
                return trace_service_pb2.ExportTraceServiceResponse()

        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), self.server)
        self.endpoint = f'127.0.0.1:{self.server.add_insecure_port("127.0.0.1:0")}'
        self.server.start()


def _guard_ms(robot: Ours) -> float:
    """p50 (ms) of the tracing tests an untraced round trip runs: 4 in the client, 5 in the worker."""
    from sequence_ai_ros.protocol import tracing

    call = robot.call
    worker_trace = None      # EpisodeCallHandler._trace of an untraced episode

    def request() -> None:
        if call.trace is not None:        # EpisodeCall._pack, _one_call (chunk), the metadata, close
            pass
        if call.trace is not None:
            pass
        if call.trace is not None:
            pass
        if call.trace is not None:
            pass
        if tracing.TRACER is not None:    # EpisodeCallHandler: _start, _observe (x2), _infer, replies
            pass
        if worker_trace is not None:
            pass
        if worker_trace is not None:
            pass
        if worker_trace is not None:
            pass
        if worker_trace is not None:
            pass

    loops = 10_000
    return float(np.median(timeit.repeat(request, number=loops, repeat=50))) / loops * 1e3


def main(blocks: int = BLOCKS, per_block: int = PER_BLOCK) -> dict:
    """Run the comparison; print the figures; return them."""
    from sequence_ai_ros.protocol import tracing

    try:
        counter = _Counter()
    except ImportError as exc:
        raise RuntimeError(f'{exc}: tracing needs the [tracing] extra (requirements-dev.txt pins it)') from None
    off_proc, off_address = start_server_process(OURS_SERVER, str(POLICY))
    on_proc, on_address = start_server_process(TRACED_SERVER, str(POLICY), counter.endpoint)
    off_port, on_port = (int(address.rsplit(':', 1)[-1]) for address in (off_address, on_address))
    try:
        off = Ours(off_port)                     # tracing off here: its episode has no trace
        tracing.configure(counter.endpoint, 1.0, service='sequence_ai-robot')
        on = Ours(on_port)                       # traced, at ratio 1.0
        guard = _guard_ms(off)
        rtts: dict[str, list[float]] = {'off': [], 'on': []}
        for robot in (off, on):                  # warm
            for _ in range(10):
                robot.ask()
        for _ in range(blocks):
            for name, robot in (('off', off), ('on', on)):
                rtts[name] += [robot.ask() for _ in range(per_block)]
        off.close()
        on.close()
        tracing.flush()
        asked = on.rid                           # 5 spans a request: the robot's and the worker's 4
        deadline = time.monotonic() + 10.0       # the worker's batch goes out within 5 s (the SDK's default)
        while counter.spans < 5 * asked and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        tracing.shutdown()
        for proc in (off_proc, on_proc):
            proc.terminate()
            proc.wait(10)
        counter.server.stop(0)
    p50 = {name: float(np.percentile(np.asarray(v) * 1e3, 50)) for name, v in rtts.items()}
    out = {'off_guard_ms': guard, 'off_target_ms': OFF_TARGET_MS, 'rtt_p50_off_ms': p50['off'],
           'rtt_p50_on_ms': p50['on'], 'on_cost_ms': p50['on'] - p50['off'], 'round_trips': len(rtts['on']),
           'spans_received': counter.spans}
    print('tracing: the wire payload, 0 ms policy in the worker; off and on (ratio 1.0) in alternating blocks')
    flag = '' if guard <= OFF_TARGET_MS else f'  (above the {OFF_TARGET_MS} ms target)'
    print(f"  {'cost per request when off, p50 (ms)':44s} {guard:9.5f}{flag}")
    print(f"  {'round trip p50, tracing off (ms)':44s} {p50['off']:9.3f}")
    print(f"  {'round trip p50, tracing on at 1.0 (ms)':44s} {p50['on']:9.3f}")
    print(f"  {'on - off, p50 (ms)':44s} {out['on_cost_ms']:9.3f}  ({counter.spans} spans exported)", flush=True)
    return out


if __name__ == '__main__':
    print(json.dumps(main(), indent=2))
