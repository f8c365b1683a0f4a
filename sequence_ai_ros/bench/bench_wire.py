"""Wire benchmark: our gRPC + protobuf path against a websocket + msgpack baseline, same payload, interleaved.

Payload: two raw 224x224x3 uint8 frames and a 26-d float32 state up; a float32 (50, 26) chunk down from a
0 ms policy (``test/policies/wire.py``). Both servers run in their own process on 127.0.0.1.

- ours: the client's own episode path (:class:`~sequence_ai_ros.client.session.EpisodeCall`: packing on
  gRPC's request thread, the Episode stream, ``seq-recv``) against ``seq``'s worker, the policy in the worker
  (``isolation='none'``, as the baseline's runs in its server; the ``isolation`` benchmark adds the
  deployment process);
- baseline: openpi-client 0.1.2's ``msgpack_numpy`` (imported alone; installed with --no-deps by
  ``make bench``), a minimal websockets server of ours, and openpi's WebsocketClientPolicy settings
  (sync client, ``compression=None``, ``max_size=None``; the server likewise).

Figures: round trip p50/p99 with 1 robot; p99 with 16 robots at 10 requests/s each; client and server
CPU per request (process CPU time / requests). The two systems alternate in blocks (ours, baseline,
ours, ...), so machine load hits both alike. Ratios are ours / baseline (<= 1.0 is the goal).
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from sequence_ai_ros.bench.bench_client import start_server_process

if TYPE_CHECKING:
    from sequence_ai_ros.protocol import sequence_ai_pb2 as pb

POLICY = Path(__file__).resolve().parents[2] / 'test' / 'policies' / 'wire.py'
BLOCKS, PER_BLOCK = 4, 150            # 1 robot: 600 round trips each, in alternating blocks
FLEET, RATE_HZ, FLEET_S = 16, 10.0, 4.0
JOINTS = [f'j{i}' for i in range(26)]

BASELINE_SERVER = '''
import asyncio, sys
import numpy as np
from openpi_client import msgpack_numpy
from websockets.asyncio.server import serve

async def handler(ws):
    packer = msgpack_numpy.Packer()
    await ws.send(packer.pack({}))                      # metadata first, as openpi's server does
    async for message in ws:
        msgpack_numpy.unpackb(message)
        await ws.send(packer.pack({'actions': np.zeros((50, 26), np.float32)}))

async def main():
    async with serve(handler, '127.0.0.1', 0, compression=None, max_size=None) as server:
        print(f"serving ws on 127.0.0.1:{server.sockets[0].getsockname()[1]}", flush=True)
        await asyncio.Future()

asyncio.run(main())
'''

OURS_SERVER = (
    'import sys\n'
    'from sequence_ai_ros.worker import serve_policy_file\n'
    "server = serve_policy_file(sys.argv[1], deployment='wire', port=0, isolation='none')\n"
    "print(f'serving grpc on 127.0.0.1:{server.port}', flush=True)\n"
    'server.wait()\n')


def _start(code: str, *args: str) -> tuple[subprocess.Popen, int]:
    proc, address = start_server_process(code, *args)
    return proc, int(address.rsplit(':', 1)[-1])


def _frames() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return (rng.integers(0, 255, (224, 224, 3), np.uint8), rng.integers(0, 255, (224, 224, 3), np.uint8),
            rng.standard_normal(26).astype(np.float32))


class Ours:
    """One robot on our episode path; :meth:`ask` is one round trip, sent as the engine sends it.

    In steady state the engine asks for the next chunk while the playing one still has a quarter of its rows
    left (``MIN_LEAD_FRACTION``): each request carries that tail (12 of 50 rows), the last executed row, the
    step of its observation and ``tail_request_id`` = the request whose chunk the tail was cut from, so the
    worker has nothing newer to splice in. Each reply is decoded to (T, D) actions, as the engine does.
    """

    #: rows played of each chunk before the next request (50 rows, a 12-row tail left: the engine's lead)
    PLAYED = 38

    def __init__(self, port: int) -> None:
        from sequence_ai_ros.client.session import Connection, EpisodeCall
        from sequence_ai_ros.protocol.contract import Contract
        from sequence_ai_ros.protocol.messages import unpack_chunk

        self.conn = Connection(f'127.0.0.1:{port}')
        self.contract = Contract.from_proto(self.conn.handshake('wire', 'bench', timeout=30))
        while not self.conn.ready('wire', timeout=5).ready:
            time.sleep(0.05)
        self._got = threading.Event()
        self.actions: np.ndarray | None = None

        def on_chunk(msg: pb.ActionChunk) -> None:
            self.actions = unpack_chunk(msg).actions
            self._got.set()

        self.call = EpisodeCall(self.conn, 'wire', uuid.uuid4().hex, '', self.contract,
                                on_chunk=on_chunk, on_error=lambda exc: print('error', exc),
                                on_started=lambda msg: None)
        self.call.start()
        a, b, state = _frames()
        from sequence_ai_ros.protocol.types import Observation

        self.obs = Observation(state=state, state_names=tuple(JOINTS), images={'cam_a': a, 'cam_b': b})
        self.rid = 0

    def ask(self) -> float:
        """One round trip (s)."""
        from sequence_ai_ros.client.engine import OutRequest

        self.rid += 1
        self._got.clear()
        live = self.actions
        start = time.perf_counter()
        if live is None:    # the first request: nothing plays yet
            req = OutRequest(obs=self.obs, history=[], chunk_tail=None, expected_delay_actions=0, last_action=None,
                             request_id=self.rid)
        else:
            req = OutRequest(obs=self.obs, history=[], chunk_tail=live[self.PLAYED:], expected_delay_actions=3,
                             last_action=live[self.PLAYED - 1], request_id=self.rid,
                             observation_step=float((self.rid - 1) * self.PLAYED), tail_request_id=self.rid - 1)
        self.call.send_request(req)
        if not self._got.wait(10):
            raise RuntimeError('no chunk within 10 s')
        return time.perf_counter() - start

    def close(self) -> None:
        """End the call and the channel."""
        self.call.close(None, timeout=1.0)
        self.conn.close()


class Baseline:
    """One robot as openpi's WebsocketClientPolicy talks: sync websockets client, msgpack_numpy."""

    def __init__(self, port: int) -> None:
        import websockets.sync.client
        from openpi_client import msgpack_numpy

        self._unpackb = msgpack_numpy.unpackb
        self._packer = msgpack_numpy.Packer()
        self.ws = websockets.sync.client.connect(f'ws://127.0.0.1:{port}', compression=None, max_size=None)
        self._unpackb(self.ws.recv())
        a, b, state = _frames()
        self.obs = {'observation/image_a': a, 'observation/image_b': b, 'observation/state': state, 'prompt': ''}

    def ask(self) -> float:
        """One round trip (s)."""
        start = time.perf_counter()
        self.ws.send(self._packer.pack(self.obs))
        self._unpackb(self.ws.recv())
        return time.perf_counter() - start

    def close(self) -> None:
        """Close the connection."""
        self.ws.close()


def _cpu(pid: int) -> float:
    import psutil

    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


def _single(robot: Callable[[], float], n: int, server_pid: int) -> tuple[list[float], float, float]:
    for _ in range(10):                      # warm
        robot()
    c0, s0 = time.process_time(), _cpu(server_pid)
    rtts = [robot() for _ in range(n)]
    return rtts, (time.process_time() - c0) / n, (_cpu(server_pid) - s0) / n


def _fleet(make: Callable[[], Ours | Baseline]) -> list[float]:
    robots = [make() for _ in range(FLEET)]
    rtts: list[float] = []
    lock = threading.Lock()

    def loop(robot: Ours | Baseline, offset: float) -> None:
        start = time.monotonic() + offset
        k = 0
        while True:
            due = start + k / RATE_HZ
            if due - start > FLEET_S:
                return
            time.sleep(max(0.0, due - time.monotonic()))
            rtt = robot.ask()
            with lock:
                rtts.append(rtt)
            k += 1

    threads = [threading.Thread(target=loop, args=(r, i / (FLEET * RATE_HZ)), name=f'bench-robot-{i}')
               for i, r in enumerate(robots)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(FLEET_S + 30)
    for r in robots:
        r.close()
    return rtts


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values) * 1e3, q))


def main() -> dict:
    """Run the comparison; print the table and the ratios; return the figures."""
    try:
        import openpi_client.msgpack_numpy  # noqa: F401
        import websockets  # noqa: F401
    except ImportError as exc:
        raise RuntimeError(f'{exc}: install the bench requirements (make bench does: requirements-bench.txt and '
                           'pip install --no-deps openpi-client==0.1.2)') from None
    ours_proc, ours_port = _start(OURS_SERVER, str(POLICY))
    base_proc, base_port = _start(BASELINE_SERVER)
    try:
        ours, base = Ours(ours_port), Baseline(base_port)
        got: dict[str, dict[str, list[float]]] = {'ours': {'rtt': [], 'client': [], 'server': []},
                                                  'baseline': {'rtt': [], 'client': [], 'server': []}}
        for _ in range(BLOCKS):
            for name, robot, pid in (('ours', ours, ours_proc.pid), ('baseline', base, base_proc.pid)):
                rtts, client, server = _single(robot.ask, PER_BLOCK, pid)
                got[name]['rtt'] += rtts
                got[name]['client'].append(client)
                got[name]['server'].append(server)
        ours.close()
        base.close()
        fleet: dict[str, list[float]] = {'ours': [], 'baseline': []}
        for _ in range(2):
            fleet['ours'] += _fleet(lambda: Ours(ours_port))
            fleet['baseline'] += _fleet(lambda: Baseline(base_port))
    finally:
        for proc in (ours_proc, base_proc):
            proc.kill()
            proc.wait(10)
    rows = {}
    for name in ('ours', 'baseline'):
        g = got[name]
        rows[name] = {'rtt_p50_ms': _pct(g['rtt'], 50), 'rtt_p99_ms': _pct(g['rtt'], 99),
                      'fleet_p99_ms': _pct(fleet[name], 99), 'fleet_requests': len(fleet[name]),
                      'client_cpu_ms': 1e3 * float(np.median(g['client'])),
                      'server_cpu_ms': 1e3 * float(np.median(g['server']))}
    labels = {'rtt_p50_ms': 'round trip p50, 1 robot (ms)', 'rtt_p99_ms': 'round trip p99, 1 robot (ms)',
              'fleet_p99_ms': f'p99, {FLEET} robots x {RATE_HZ:g} req/s (ms)',
              'client_cpu_ms': 'client CPU per request (ms)', 'server_cpu_ms': 'server CPU per request (ms)'}
    print('wire: 2 raw 224x224 frames + 26-d state up, (50, 26) float32 down, 0 ms policy; interleaved blocks')
    print(f"  {'':40s} {'baseline':>9s} {'ours':>9s} {'ours/baseline':>14s}")
    ratios = {}
    for key, label in labels.items():
        b, o = rows['baseline'][key], rows['ours'][key]
        ratios[key] = o / b if b > 0 else float('inf')
        flag = '' if ratios[key] <= 1.0 else '  (above 1.0)'
        print(f'  {label:40s} {b:9.3f} {o:9.3f} {ratios[key]:14.2f}{flag}', flush=True)
    return {'rows': rows, 'ratios': ratios}


if __name__ == '__main__':
    print(json.dumps(main(), indent=2))
