"""Where one request's round trip goes, step by step, on both sides of the wire.

``python -m sequence_ai_ros.bench.wire_timeline [--requests N]``: the wire benchmark's payload and systems
(:mod:`~sequence_ai_ros.bench.bench_wire`), one robot each, ours at the default isolation.

Timestamps are ``time.perf_counter_ns`` (CLOCK_MONOTONIC: one clock for every process on the machine), taken
where the functions below are entered or return, wrapped at start in the client (this process) and in the
worker (its own process, :data:`WORKER`). A request's steps are the differences between its consecutive points;
the table prints each step's median. The deployment process is not instrumented: ``process hop`` runs from
the call's send to the worker's wake on its answer. The wrappers cost about a microsecond a point, so the
instrumented round trip is a little slower than the benchmark's.

The grpc floors (:data:`~sequence_ai_ros.bench.bench_wire.FLOOR_SERVER` and ``FLOOR_HOP_SERVER``) get the client's
points only (:class:`~sequence_ai_ros.bench.bench_wire.FloorStream`'s ``mark``): their servers take the message and
answer it, nothing between.
"""

from __future__ import annotations

import argparse
import bisect
import functools
import importlib
import inspect
import json
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

#: The worker's points: (module, qualified name, point at entry, point at return).
WORKER_POINTS = (
    ('sequence_ai_ros.worker.episode_call', 'EpisodeCallHandler._observe', 'read', 'answer ready'),
    ('sequence_ai_ros.worker.runtime', 'DeploymentRuntime.decode', None, 'decoded'),
    ('sequence_ai_ros.worker.runtime', 'DeploymentRuntime.submit', None, 'sent to the process'),
    ('sequence_ai_ros.worker.policy_process', 'PolicyProcess._on_readable', 'process answered', None),
    ('sequence_ai_ros.worker.runtime', 'DeploymentRuntime.finish', 'chunk back', 'chunk packed'),
)
#: The client's points (ours).
CLIENT_POINTS = (
    ('sequence_ai_ros.client.session', 'EpisodeCall._pack', None, 'packed'),
    ('sequence_ai_ros.protocol.messages', 'unpack_chunk', 'reply read', None),
)
#: Every point of ours in its order in a round trip; ``asked`` and ``done`` are the round trip's own.
OURS_ORDER = ('asked', 'packed', 'arrived', 'read', 'decoded', 'sent to the process', 'process answered',
              'chunk back', 'chunk packed', 'answer ready', 'reply read', 'done')
FLOOR_ORDER = ('asked', 'packed', 'reply read', 'done')
#: The steps from ``packed`` to ``reply read`` together: both transits and the server (the floor's has no others).
WIRE_AND_SERVER = 'wire and server'
#: What each step is, by the point that ends it.
STEP_WORDS = {
    'packed': 'client: the request packed, on the gRPC request thread',
    'arrived': 'transit up: gRPC client to the worker\'s deserializer',
    'read': 'worker: parsed, to the stream\'s consumer (limits check)',
    'decoded': 'worker: decoded against the contract',
    'sent to the process': 'worker: the call pickled, copied to shared memory, sent',
    'process answered': 'process hop: the deployment process runs the policy, the worker wakes',
    'chunk back': 'worker: the answer read, the request\'s future settled',
    'chunk packed': 'worker: the chunk packed (metrics, usage)',
    'answer ready': 'worker: the reply to the stream (splice, capture, metrics)',
    'reply read': 'transit down (ours: from the reply) to the client\'s read thread',
    'done': 'client: the asking thread woken',
    WIRE_AND_SERVER: 'both transits and the server (packed to reply read), together',
}


class Recorder:
    """Points of one process: ``(name, perf_counter_ns)`` in the order taken (any thread)."""

    def __init__(self) -> None:
        self.points: list[tuple[str, int]] = []
        self._lock = threading.Lock()

    def mark(self, name: str) -> None:
        """Take point ``name`` now."""
        t = time.perf_counter_ns()
        with self._lock:
            self.points.append((name, t))

    def wrap(self, module: str, qualname: str, enter: str | None, leave: str | None) -> None:
        """Wrap ``module.qualname`` (a function or a method, sync or async) to take ``enter`` and ``leave``."""
        owner: Any = importlib.import_module(module)
        *path, name = qualname.split('.')
        for part in path:
            owner = getattr(owner, part)
        fn = getattr(owner, name)
        mark = self.mark
        if inspect.iscoroutinefunction(fn):
            @functools.wraps(fn)
            async def wrapped(*args: Any, **kwargs: Any) -> Any:
                if enter:
                    mark(enter)
                out = await fn(*args, **kwargs)
                if leave:
                    mark(leave)
                return out
        else:
            @functools.wraps(fn)
            def wrapped(*args: Any, **kwargs: Any) -> Any:
                if enter:
                    mark(enter)
                out = fn(*args, **kwargs)
                if leave:
                    mark(leave)
                return out
        setattr(owner, name, wrapped)


def instrument_worker(out: str) -> Callable[[], None]:
    """In the worker's process, before it serves: wrap its points; return what writes them to ``out`` (JSON)."""
    rec = Recorder()
    for point in WORKER_POINTS:
        rec.wrap(*point)
    from sequence_ai_ros.worker import episode_call, servicer

    parse = episode_call.parse_request

    def parse_request(data: bytes) -> Any:
        rec.mark('arrived')
        return parse(data)

    servicer.parse_request = parse_request      # the Episode stream's deserializer, looked up when served

    def dump() -> None:
        Path(out).write_text(json.dumps(rec.points))

    return dump


#: The instrumented worker: ``python -c WORKER policy.py isolation out.json``; it writes its points when
#: ``out.json.dump`` appears (and removes that file).
WORKER = (
    'import os, sys, time\n'
    'from sequence_ai_ros.bench.wire_timeline import instrument_worker\n'
    'dump = instrument_worker(sys.argv[3])\n'
    'from sequence_ai_ros.worker import serve_policy_file\n'
    "server = serve_policy_file(sys.argv[1], deployment='wire', port=0, isolation=sys.argv[2], warm=True)\n"
    "print(f'serving grpc on 127.0.0.1:{server.port}', flush=True)\n"
    'while not server.wait(0.05):\n'
    "    if os.path.exists(sys.argv[3] + '.dump'):\n"
    '        dump()\n'
    "        os.remove(sys.argv[3] + '.dump')\n")


def steps(order: tuple[str, ...], points: list[tuple[str, int]], rounds: list[tuple[int, int]]) -> dict[str, float]:
    """Each step's median (µs) over ``rounds`` (``(asked, done)`` ns), named by the point that ends it.

    A round's point is the first of its name at or after the previous point; a round missing one is skipped.
    """
    by_name: dict[str, list[int]] = {}
    for name, t in points:
        by_name.setdefault(name, []).append(t)
    for times in by_name.values():
        times.sort()
    got: dict[str, list[float]] = {name: [] for name in order[1:]}
    for asked, done in rounds:
        row = [asked]
        for name in order[1:-1]:
            times = by_name.get(name, [])
            i = bisect.bisect_left(times, row[-1])
            if i == len(times) or times[i] > done:
                break
            row.append(times[i])
        else:
            row.append(done)
            for name, a, b in zip(order[1:], row[:-1], row[1:], strict=True):
                got[name].append((b - a) / 1e3)
            got.setdefault(WIRE_AND_SERVER, []).append((row[-2] - row[1]) / 1e3)
    return {name: statistics.median(v) for name, v in got.items() if v}


def run(n: int = 1500, isolation: str = 'process') -> dict[str, dict[str, float]]:
    """The timeline of ``n`` round trips each of ours (at ``isolation``), the grpc floor and the floor + hop."""
    from sequence_ai_ros.bench import bench_wire as bw

    work = Path(os.environ.get('TMPDIR', '/tmp')) / f'seq-wire-timeline-{os.getpid()}'
    work.mkdir(parents=True, exist_ok=True)
    out = work / 'worker.json'
    result: dict[str, dict[str, float]] = {}
    client = Recorder()
    for point in CLIENT_POINTS:
        client.wrap(*point)
    proc, port = bw.start_server(WORKER, str(bw.POLICY), isolation, str(out))
    try:
        robot: Any = bw.Ours(port)
        try:
            result['ours'] = _rounds(robot, client, n, OURS_ORDER, lambda: _worker_points(out))
        finally:
            robot.close()
    finally:
        proc.kill()
        proc.wait(10)
    for name, code in (('floor (stream)', bw.FLOOR_SERVER), ('floor + hop', bw.FLOOR_HOP_SERVER)):
        proc, port = bw.start_server(code)
        try:
            robot = bw.FloorStream(port, mark=client.mark)
            try:
                result[name] = _rounds(robot, client, n, FLOOR_ORDER, list)
            finally:
                robot.close()
            result[name].pop('reply read', None)       # both transits and the server: WIRE_AND_SERVER
        finally:
            proc.kill()
            proc.wait(10)
    return result


def _worker_points(out: Path) -> list[tuple[str, int]]:
    trigger = Path(f'{out}.dump')
    trigger.touch()
    deadline = time.monotonic() + 30
    while trigger.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return [tuple(p) for p in json.loads(out.read_text())] if out.exists() else []


def _rounds(robot: Any, client: Recorder, n: int, order: tuple[str, ...],
            server_points: Callable[[], list[tuple[str, int]]]) -> dict[str, float]:
    for _ in range(100):         # warm
        robot.ask()
    client.points.clear()
    rounds = []
    for _ in range(n):
        asked = time.perf_counter_ns()
        robot.ask()
        rounds.append((asked, time.perf_counter_ns()))
    got = steps(order, client.points + server_points(), rounds)
    got['round trip'] = statistics.median((b - a) / 1e3 for a, b in rounds)
    return got


def print_timeline(result: dict[str, dict[str, float]]) -> None:
    """Print each system's steps (median µs) side by side."""
    names = list(result)
    print('\ntimeline of one round trip, median µs per step (points wrapped: a little slower than unwrapped)')
    print(f"  {'step':72s}" + ''.join(f'{n:>16s}' for n in names))
    for point in (*OURS_ORDER[1:], WIRE_AND_SERVER):
        cells = ''.join(f'{result[n][point]:16.1f}' if point in result[n] else f"{'':16s}" for n in names)
        print(f'  {STEP_WORDS[point]:72s}{cells}')
    print(f"  {'round trip':72s}" + ''.join(f"{result[n]['round trip']:16.1f}" for n in names), flush=True)


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    """Run the timeline and print it; return its steps."""
    parser = argparse.ArgumentParser(prog='python -m sequence_ai_ros.bench.wire_timeline')
    parser.add_argument('--requests', type=int, default=1500, metavar='N',
                        help='round trips per system (default %(default)d)')
    args = parser.parse_args(argv)
    print(f'wire timeline: the wire benchmark\'s payload, one robot, {args.requests} round trips per system, '
          f'{os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}')
    result = run(args.requests)
    print_timeline(result)
    return result


if __name__ == '__main__':
    main(sys.argv[1:])
