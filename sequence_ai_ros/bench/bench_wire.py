"""Wire benchmark: our gRPC + protobuf path against openpi's websocket + msgpack pair, same payload, interleaved.

Payload (issue 37's): two 224x224x3 uint8 frames and a 26-d float32 state up; a float32 (30, 26) chunk down from
a 0 ms policy (``test/policies/wire30.py``). Every server runs in its own process on 127.0.0.1; every client
runs in this process, one system at a time.

- ours: the client's own episode path (:class:`~sequence_ai_ros.client.session.EpisodeCall`: packing on
  gRPC's request thread, the Episode stream, ``seq-recv``) against ``seq``'s worker at its default isolation
  (``process``: the policy in its deployment process, as ``seq serve`` runs it). ``ours (none)`` is the same
  worker with ``--isolation none`` (the policy in the worker), an extra row.
- openpi: openpi-client 0.1.2's ``msgpack_numpy`` (imported alone; installed with --no-deps by ``make bench``),
  a minimal websockets server of ours, and openpi's WebsocketClientPolicy settings (sync client,
  ``compression=None``, ``max_size=None``; the server likewise).
- grpc floor: a minimal grpcio pair, the same bytes as one raw bytes message each way, no validation: the
  request is the two frames and the state joined (one copy, as msgpack's), the answer the chunk's bytes.
  ``floor (stream)`` has our client's threading (a bidi stream fed from a queue, replies read on a thread of
  its own, grpc.aio server); ``floor (unary)`` is one blocking unary call per request. Their ratio to openpi
  is what Python gRPC itself costs: a target below it cannot be reached with grpcio.
- grpc floor + hop (``floor + hop``): the stream floor with the least a deployment process costs behind it
  (:data:`FLOOR_HOP_SERVER`: each request's bytes copied into shared memory, a head to a forked child over a
  socket pair, the chunk's bytes back on it). The default isolation cannot be cheaper than this row.

JPEG rows: the same two frames as JPEG bytes (quality 90, encoded once, before the run), the same bytes for
both systems. Ours sends them as encoded frames (they pass through the client untouched, :func:`probe_encoded`
reads their header) and the worker decodes them for the policy; openpi's pair sends them in its msgpack dict
and its server decodes them (Pillow, to RGB arrays), as a policy needs them. Both sides decode, neither client
encodes.

Figures per repeat: round trip p50/p99 with 1 robot (:data:`BLOCKS` alternating blocks of :data:`PER_BLOCK`
round trips per system); p99 with :data:`FLEET` robots at :data:`RATE_HZ` requests/s each (:data:`FLEET_ORDER`: the
grpc floors too, so that the fleet's target has its floor beside it); client and server
CPU per request (process CPU time / requests; ours: the worker and its deployment process together, and
each). :data:`REPEATS` repeats, each alternating the systems' blocks, with the load average before and after.
Ratios are ours / openpi per repeat and their median; the targets are :data:`TARGETS`.

``python -m sequence_ai_ros.bench.bench_wire --profile`` also profiles each process (py-spy, installed into the
venv: ``pip install py-spy``) over :data:`PROFILE_REQUESTS` round trips of each system and prints its top items.
"""

from __future__ import annotations

import argparse
import collections
import functools
import io
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from sequence_ai_ros.bench.bench_client import start_server_process

if TYPE_CHECKING:
    from sequence_ai_ros.protocol import sequence_ai_pb2 as pb

ROOT = Path(__file__).resolve().parents[2]
POLICY = ROOT / 'test' / 'policies' / 'wire30.py'
CHUNK_LENGTH = 30
REPEATS, BLOCKS, PER_BLOCK = 3, 3, 200   # per repeat and system: 600 round trips in 3 alternating blocks
FLEET, RATE_HZ, FLEET_S = 16, 10.0, 4.0
JOINTS = [f'j{i}' for i in range(26)]
JPEG_QUALITY = 90
PROFILE_REQUESTS = 2000
#: Before each repeat, wait up to this long (s) for the 1-minute load average to fall below 1 (it is printed).
QUIET_WAIT_S = 60.0
PROFILE_RATE_HZ = 997     # py-spy's samples per second (prime: no lock-step with a periodic thread)
#: The targets (issue 37), each the largest ratio ours / openpi.
TARGETS = {'p50_raw': 1.3, 'p50_jpeg': 1.3, 'client_cpu': 1.0, 'fleet_p99': 1.3}

BASELINE_SERVER = '''
import asyncio, io, sys
import numpy as np
from openpi_client import msgpack_numpy
from PIL import Image
from websockets.asyncio.server import serve

def decode(obs):
    for key, value in obs.items():          # JPEG frames: decoded for the policy, as ours are
        if isinstance(value, bytes) and key.startswith('observation/image'):
            with Image.open(io.BytesIO(value)) as pil:
                obs[key] = np.asarray(pil if pil.mode == 'RGB' else pil.convert('RGB'))
    return obs

async def handler(ws):
    packer = msgpack_numpy.Packer()
    await ws.send(packer.pack({}))                      # metadata first, as openpi's server does
    async for message in ws:
        decode(msgpack_numpy.unpackb(message))
        await ws.send(packer.pack({'actions': np.zeros((30, 26), np.float32)}))

async def main():
    async with serve(handler, '127.0.0.1', 0, compression=None, max_size=None) as server:
        print(f"serving ws on 127.0.0.1:{server.sockets[0].getsockname()[1]}", flush=True)
        await asyncio.Future()

asyncio.run(main())
'''

OURS_SERVER = (
    'import sys\n'
    'from sequence_ai_ros.worker import serve_policy_file\n'
    "server = serve_policy_file(sys.argv[1], deployment='wire', port=0, isolation=sys.argv[2], warm=True)\n"
    "print(f'serving grpc on 127.0.0.1:{server.port}', flush=True)\n"
    'server.wait()\n')

#: The end of each floor's ``main()``: a ``grpc.aio`` server of its ``handlers`` on 127.0.0.1, printing the port.
_FLOOR_SERVE = '''    server = grpc.aio.server(options=[('grpc.max_receive_message_length', 64 << 20),
                                      ('grpc.max_send_message_length', 64 << 20)])
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler('floor.Floor', handlers),))
    port = server.add_insecure_port('127.0.0.1:0')
    await server.start()
    print(f'serving grpc on 127.0.0.1:{port}', flush=True)
    await server.wait_for_termination()

asyncio.run(main())
'''

FLOOR_SERVER = '''
import asyncio
import grpc
import numpy as np

REPLY = np.zeros((30, 26), np.float32).tobytes()

async def echo(request, context):
    return REPLY

async def stream(requests, context):
    async for request in requests:
        yield REPLY

async def main():
    handlers = {'Echo': grpc.unary_unary_rpc_method_handler(echo),
                'Stream': grpc.stream_stream_rpc_method_handler(stream)}
''' + _FLOOR_SERVE


#: The grpc floor with a deployment process's minimum behind it: the floor server above, but each request's
#: bytes are copied into shared memory (a slot of an anonymous shared map), a 16-byte head goes over a socket pair
#: to a forked child, which views them as the policy's arrays and answers the chunk's bytes on the socket; the
#: loop reads answers with one reader registered for the server's life. No pickling, no validation, no decode.
FLOOR_HOP_SERVER = '''
import asyncio, collections, mmap, os, socket, struct
import numpy as np

REPLY = np.zeros((30, 26), np.float32).tobytes()
SLOTS, SLOT_BYTES = 32, 1 << 20
HEAD = struct.Struct('<QQ')

def child(sock, shm):
    while True:
        head = sock.recv(HEAD.size, socket.MSG_WAITALL)
        if len(head) < HEAD.size:
            os._exit(0)
        at, n = HEAD.unpack(head)
        frames = np.frombuffer(shm, np.uint8, n, at)      # a view, as a deployment process's arrays are
        del frames
        sock.sendall(REPLY)

parent, other = socket.socketpair()
shm = mmap.mmap(-1, SLOTS * SLOT_BYTES)     # MAP_SHARED: the child sees what the server writes
if os.fork() == 0:                          # before grpc is imported: a fork must not copy its threads
    parent.close()
    child(other, shm)
other.close()

import grpc

async def main():
    loop = asyncio.get_running_loop()
    pending = collections.deque()
    got = bytearray()
    parent.setblocking(False)

    def readable():
        try:
            data = parent.recv(1 << 16)
        except BlockingIOError:             # woken with nothing to read after all
            return
        if not data:
            os._exit(1)
        got.extend(data)
        while len(got) >= len(REPLY) and pending:
            pending.popleft().set_result(bytes(got[:len(REPLY)]))
            del got[:len(REPLY)]

    loop.add_reader(parent.fileno(), readable)
    sent = 0

    async def stream(requests, context):
        nonlocal sent
        async for request in requests:
            at = (sent % SLOTS) * SLOT_BYTES
            sent += 1
            shm[at:at + len(request)] = request
            answer = loop.create_future()
            pending.append(answer)
            parent.send(HEAD.pack(at, len(request)))
            yield await answer

    handlers = {'Stream': grpc.stream_stream_rpc_method_handler(stream)}
''' + _FLOOR_SERVE


class Robot(Protocol):
    """One robot of a system: :meth:`ask` is one round trip (s)."""

    def ask(self) -> float:
        """One round trip (s)."""

    def close(self) -> None:
        """End the robot's connection."""


def start_server(code: str, *args: str) -> tuple[subprocess.Popen, int]:
    """Run a server (``python -c code args``) until it says where it serves; return it and its port."""
    proc, address = start_server_process(code, *args)
    return proc, int(address.rsplit(':', 1)[-1])


def _frames() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Two camera-like frames (smooth gradients with some noise: JPEG sizes near a real camera's) and a state."""
    rng = np.random.default_rng(0)
    yy, xx = np.mgrid[0:224, 0:224]
    frames = []
    for phase in (0.0, 1.0):
        base = np.stack([(xx + 40 * phase) % 256, (yy * 1.1) % 256, ((xx + yy) / 2 + 80 * phase) % 256], axis=-1)
        frames.append(np.clip(base + rng.normal(0, 6, base.shape), 0, 255).astype(np.uint8))
    return frames[0], frames[1], rng.standard_normal(26).astype(np.float32)


def jpeg_frames() -> tuple[bytes, bytes]:
    """The two frames as JPEG bytes (quality :data:`JPEG_QUALITY`), as a camera driver hands them over."""
    from PIL import Image

    out = []
    for frame in _frames()[:2]:
        buf = io.BytesIO()
        Image.fromarray(frame).save(buf, format='JPEG', quality=JPEG_QUALITY)
        out.append(buf.getvalue())
    return out[0], out[1]


class Ours:
    """One robot on our episode path; :meth:`ask` is one round trip, sent as the engine sends it.

    In steady state the engine asks for the next chunk while the playing one still has a quarter of its rows
    left (``MIN_LEAD_FRACTION``): each request carries that tail (8 of 30 rows; 12 of 50), the last executed row,
    the step of its observation and ``tail_request_id`` = the request whose chunk the tail was cut from, so the
    worker has nothing newer to splice in. Each reply is decoded to (T, D) actions, as the engine does.

    :param jpeg: send the frames as JPEG bytes (:func:`jpeg_frames`) rather than raw arrays.
    """

    def __init__(self, port: int, jpeg: bool = False) -> None:
        from sequence_ai_ros.client.records import MIN_LEAD_FRACTION
        from sequence_ai_ros.client.session import Connection, EpisodeCall
        from sequence_ai_ros.protocol.contract import Contract
        from sequence_ai_ros.protocol.messages import unpack_chunk
        from sequence_ai_ros.protocol.types import Observation

        self.conn = Connection(f'127.0.0.1:{port}')
        self.contract = Contract.from_proto(self.conn.handshake('wire', 'bench', timeout=30))
        while not self.conn.ready('wire', timeout=5).ready:
            time.sleep(0.05)
        #: rows played of each chunk before the next request (the engine's lead: a quarter of the chunk left)
        self.played = self.contract.chunk_length - round(self.contract.chunk_length * MIN_LEAD_FRACTION)
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
        images: dict[str, np.ndarray | bytes] = {'cam_a': a, 'cam_b': b}
        if jpeg:
            images = dict(zip(('cam_a', 'cam_b'), jpeg_frames(), strict=True))
        self.obs = Observation(state=state, state_names=tuple(JOINTS), images=images)
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
            req = OutRequest(obs=self.obs, history=[], chunk_tail=live[self.played:], expected_delay_actions=3,
                             last_action=live[self.played - 1], request_id=self.rid,
                             observation_step=float((self.rid - 1) * self.played), tail_request_id=self.rid - 1)
        self.call.send_request(req)
        if not self._got.wait(10):
            raise RuntimeError('no chunk within 10 s')
        return time.perf_counter() - start

    def close(self) -> None:
        """End the call and the channel."""
        self.call.close(None, timeout=1.0)
        self.conn.close()


class Baseline:
    """One robot as openpi's WebsocketClientPolicy talks: sync websockets client, msgpack_numpy.

    :param jpeg: send the frames as JPEG bytes (:func:`jpeg_frames`); its server decodes them.
    """

    def __init__(self, port: int, jpeg: bool = False) -> None:
        import websockets.sync.client
        from openpi_client import msgpack_numpy

        self._unpackb = msgpack_numpy.unpackb
        self._packer = msgpack_numpy.Packer()
        self.ws = websockets.sync.client.connect(f'ws://127.0.0.1:{port}', compression=None, max_size=None)
        self._unpackb(self.ws.recv())
        a, b, state = _frames()
        images: tuple[np.ndarray | bytes, ...] = (a, b)
        if jpeg:
            images = jpeg_frames()
        self.obs = {'observation/image_a': images[0], 'observation/image_b': images[1], 'observation/state': state,
                    'prompt': ''}

    def ask(self) -> float:
        """One round trip (s)."""
        start = time.perf_counter()
        self.ws.send(self._packer.pack(self.obs))
        self._unpackb(self.ws.recv())['actions']
        return time.perf_counter() - start

    def close(self) -> None:
        """Close the connection."""
        self.ws.close()


def floor_request() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The floors' request: the two frames and the state, sent joined as one bytes message."""
    return _frames()


class FloorUnary:
    """The grpc floor: one blocking unary call per round trip, raw bytes both ways, no validation."""

    def __init__(self, port: int) -> None:
        import grpc

        self.channel = grpc.insecure_channel(f'127.0.0.1:{port}', options=[
            ('grpc.max_receive_message_length', 64 << 20), ('grpc.max_send_message_length', 64 << 20)])
        self.call: Any = self.channel.unary_unary('/floor.Floor/Echo')
        self.parts = floor_request()

    def ask(self) -> float:
        """One round trip (s)."""
        start = time.perf_counter()
        reply = self.call(b''.join(p.data for p in self.parts))
        np.frombuffer(reply, np.float32).reshape(CHUNK_LENGTH, -1)
        return time.perf_counter() - start

    def close(self) -> None:
        """Close the channel."""
        self.channel.close()


class FloorStream:
    """The grpc floor with our client's threading: a bidi stream fed from a queue, replies read on a thread.

    :param mark: called with ``'packed'`` as gRPC's request thread takes a request and ``'reply read'`` as the
        read thread gets its reply (the timeline's points, :mod:`~sequence_ai_ros.bench.wire_timeline`); None: not.
    """

    def __init__(self, port: int, mark: Callable[[str], None] | None = None) -> None:
        import grpc

        self.channel = grpc.insecure_channel(f'127.0.0.1:{port}', options=[
            ('grpc.max_receive_message_length', 64 << 20), ('grpc.max_send_message_length', 64 << 20)])
        self._outbox: queue.Queue[bytes | None] = queue.Queue()
        self._got = threading.Event()
        self.parts = floor_request()
        stream: Any = self.channel.stream_stream('/floor.Floor/Stream')

        def requests() -> Any:
            for request in iter(self._outbox.get, None):
                if mark is not None:
                    mark('packed')
                yield request

        call: Any = stream(requests())

        def read() -> None:
            for reply in call:
                if mark is not None:
                    mark('reply read')
                np.frombuffer(reply, np.float32).reshape(CHUNK_LENGTH, -1)
                self._got.set()

        self._reader = threading.Thread(target=read, name='floor-recv', daemon=True)
        self._reader.start()

    def ask(self) -> float:
        """One round trip (s)."""
        start = time.perf_counter()
        self._got.clear()
        self._outbox.put(b''.join(p.data for p in self.parts))
        if not self._got.wait(10):
            raise RuntimeError('no reply within 10 s')
        return time.perf_counter() - start

    def close(self) -> None:
        """End the stream and close the channel."""
        self._outbox.put(None)
        self._reader.join(2)
        self.channel.close()


def process_cpu_s(pid: int, *, itself: bool = True, children: bool = True) -> float:
    """CPU seconds (user + system) of process ``pid`` itself and/or of its children (its deployment processes)."""
    import psutil

    proc = psutil.Process(pid)
    total = 0.0
    for p in [*([proc] if itself else []), *(proc.children(recursive=True) if children else [])]:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


class System:
    """One system's server process and how to make its robots.

    :param name: its row's name.
    :param proc: its server process.
    :param make: a new robot of it.
    """

    def __init__(self, name: str, proc: subprocess.Popen, make: Callable[[], Robot]) -> None:
        self.name, self.proc, self.make = name, proc, make

    def single(self, robot: Robot, n: int) -> dict[str, Any]:
        """``n`` round trips of ``robot``: their times (s) and the CPU per request (s) of client and server."""
        pid = self.proc.pid
        c0, s0, d0 = time.process_time(), process_cpu_s(pid, children=False), process_cpu_s(pid, itself=False)
        rtts = [robot.ask() for _ in range(n)]
        return {'rtt': rtts, 'client': (time.process_time() - c0) / n,
                'worker': (process_cpu_s(pid, children=False) - s0) / n,
                'deployment': (process_cpu_s(pid, itself=False) - d0) / n}


def _fleet(make: Callable[[], Robot]) -> list[float]:
    robots = [make() for _ in range(FLEET)]
    rtts: list[float] = []
    lock = threading.Lock()

    def loop(robot: Robot, offset: float) -> None:
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


def _ratio(ours: float, theirs: float) -> float:
    """``ours / theirs``; NaN when ``theirs`` is not positive (a CPU time below the clock's tick)."""
    return ours / theirs if theirs > 0 else float('nan')


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values) * 1e3, q))


def _systems() -> dict[str, System]:
    """Start every server; return the systems by row name (the caller kills their processes)."""
    systems: dict[str, System] = {}
    for isolation, name in (('process', 'ours'), ('none', 'ours (none)')):
        proc, port = start_server(OURS_SERVER, str(POLICY), isolation)
        systems[name] = System(name, proc, functools.partial(Ours, port))
        systems[f'{name} jpeg'] = System(f'{name} jpeg', proc, functools.partial(Ours, port, jpeg=True))
    proc, port = start_server(BASELINE_SERVER)
    systems['openpi'] = System('openpi', proc, functools.partial(Baseline, port))
    systems['openpi jpeg'] = System('openpi jpeg', proc, functools.partial(Baseline, port, jpeg=True))
    proc, port = start_server(FLOOR_SERVER)
    systems['floor (stream)'] = System('floor (stream)', proc, functools.partial(FloorStream, port))
    systems['floor (unary)'] = System('floor (unary)', proc, functools.partial(FloorUnary, port))
    proc, port = start_server(FLOOR_HOP_SERVER)
    systems['floor + hop'] = System('floor + hop', proc, functools.partial(FloorStream, port))
    return systems


#: Each repeat's single-robot blocks, in this order, :data:`BLOCKS` times (raw, then JPEG).
SINGLE_ORDER = ('ours', 'openpi', 'ours (none)', 'floor (stream)', 'floor (unary)', 'floor + hop', 'ours jpeg',
                'openpi jpeg', 'ours (none) jpeg')
FLEET_ORDER = ('ours', 'openpi', 'ours (none)', 'floor (stream)', 'floor + hop')


def _repeat(systems: dict[str, System], quiet_wait_s: float = 0.0) -> dict[str, Any]:
    """One repeat: single-robot blocks of every system, alternating, then the fleets; its figures.

    :param quiet_wait_s: first wait up to this long (s) for the 1-minute load average to fall below 1.
    """
    deadline = time.monotonic() + quiet_wait_s
    while os.getloadavg()[0] >= 1.0 and time.monotonic() < deadline:
        time.sleep(2.0)
    load_before = os.getloadavg()[0]
    robots = {name: systems[name].make() for name in SINGLE_ORDER}
    got: dict[str, dict[str, list[float]]] = {name: collections.defaultdict(list) for name in SINGLE_ORDER}
    try:
        for robot in robots.values():
            for _ in range(20):         # warm
                robot.ask()
        for _ in range(BLOCKS):
            for name in SINGLE_ORDER:
                block = systems[name].single(robots[name], PER_BLOCK)
                got[name]['rtt'] += block['rtt']
                for key in ('client', 'worker', 'deployment'):
                    got[name][key].append(block[key])
    finally:
        for robot in robots.values():
            robot.close()
    fleet = {name: _fleet(systems[name].make) for name in FLEET_ORDER}
    rows: dict[str, dict[str, float]] = {}
    for name in SINGLE_ORDER:
        g = got[name]
        # CPU per request over all blocks (psutil reads the server's in 10 ms ticks: a block alone is coarse)
        worker, deployment = (1e3 * float(np.mean(g[k])) for k in ('worker', 'deployment'))
        rows[name] = {'rtt_p50_ms': _pct(g['rtt'], 50), 'rtt_p99_ms': _pct(g['rtt'], 99),
                      'client_cpu_ms': 1e3 * float(np.mean(g['client'])), 'server_cpu_ms': worker + deployment,
                      'worker_cpu_ms': worker, 'deployment_cpu_ms': deployment}
        if name in fleet:
            rows[name]['fleet_p99_ms'] = _pct(fleet[name], 99)
    base, base_jpeg = rows['openpi'], rows['openpi jpeg']
    ratios = {'p50_raw': _ratio(rows['ours']['rtt_p50_ms'], base['rtt_p50_ms']),
              'p50_jpeg': _ratio(rows['ours jpeg']['rtt_p50_ms'], base_jpeg['rtt_p50_ms']),
              'p99_raw': _ratio(rows['ours']['rtt_p99_ms'], base['rtt_p99_ms']),
              'fleet_p99': _ratio(rows['ours']['fleet_p99_ms'], base['fleet_p99_ms']),
              'client_cpu': _ratio(rows['ours']['client_cpu_ms'], base['client_cpu_ms']),
              'server_cpu': _ratio(rows['ours']['server_cpu_ms'], base['server_cpu_ms']),
              'none_p50_raw': _ratio(rows['ours (none)']['rtt_p50_ms'], base['rtt_p50_ms']),
              'none_p50_jpeg': _ratio(rows['ours (none) jpeg']['rtt_p50_ms'], base_jpeg['rtt_p50_ms']),
              'floor_stream_p50': _ratio(rows['floor (stream)']['rtt_p50_ms'], base['rtt_p50_ms']),
              'floor_unary_p50': _ratio(rows['floor (unary)']['rtt_p50_ms'], base['rtt_p50_ms']),
              'floor_hop_p50': _ratio(rows['floor + hop']['rtt_p50_ms'], base['rtt_p50_ms']),
              'ours_over_floor_hop_p50': _ratio(rows['ours']['rtt_p50_ms'], rows['floor + hop']['rtt_p50_ms']),
              'floor_stream_fleet_p99': _ratio(rows['floor (stream)']['fleet_p99_ms'], base['fleet_p99_ms']),
              'floor_hop_fleet_p99': _ratio(rows['floor + hop']['fleet_p99_ms'], base['fleet_p99_ms']),
              'ours_over_floor_hop_fleet_p99': _ratio(rows['ours']['fleet_p99_ms'],
                                                      rows['floor + hop']['fleet_p99_ms']),
              'floor_stream_client_cpu': _ratio(rows['floor (stream)']['client_cpu_ms'], base['client_cpu_ms']),
              'floor_unary_client_cpu': _ratio(rows['floor (unary)']['client_cpu_ms'], base['client_cpu_ms']),
              'floor_stream_server_cpu': _ratio(rows['floor (stream)']['server_cpu_ms'], base['server_cpu_ms'])}
    return {'load_before': round(load_before, 2), 'load_after': round(os.getloadavg()[0], 2), 'rows': rows,
            'ratios': ratios}


def _print_repeat(k: int, rep: dict[str, Any]) -> None:
    print(f"repeat {k}: load average {rep['load_before']:.2f} -> {rep['load_after']:.2f}")
    print(f"  {'system':18s} {'p50':>7s} {'p99':>7s} {'16x10 p99':>10s} {'client':>7s} {'server':>7s} "
          f"{'(worker':>8s} {'+ depl.)':>8s}   ms")
    for name, row in rep['rows'].items():
        fleet = f"{row['fleet_p99_ms']:10.3f}" if 'fleet_p99_ms' in row else f"{'':10s}"
        split = (f"{row['worker_cpu_ms']:8.3f} {row['deployment_cpu_ms']:8.3f}" if row['deployment_cpu_ms'] > 0
                 else f"{'':17s}")
        print(f"  {name:18s} {row['rtt_p50_ms']:7.3f} {row['rtt_p99_ms']:7.3f} {fleet} {row['client_cpu_ms']:7.3f} "
              f"{row['server_cpu_ms']:7.3f} {split}")
    print('  ratios / openpi: ' + ', '.join(f'{key} x{value:.2f}' for key, value in rep['ratios'].items()),
          flush=True)


RATIO_LABELS = {'p50_raw': 'round trip p50, raw', 'p50_jpeg': 'round trip p50, JPEG (same bytes)',
                'p99_raw': 'round trip p99, raw', 'fleet_p99': f'p99, {FLEET} robots x {RATE_HZ:g} req/s',
                'client_cpu': 'client CPU per request', 'server_cpu': 'server CPU per request',
                'none_p50_raw': 'p50 raw, --isolation none', 'none_p50_jpeg': 'p50 JPEG, --isolation none',
                'floor_stream_p50': 'grpc floor / openpi: p50 (stream)',
                'floor_unary_p50': 'grpc floor / openpi: p50 (unary)',
                'floor_hop_p50': 'grpc floor + process hop / openpi: p50',
                'ours_over_floor_hop_p50': 'ours / (grpc floor + process hop): p50',
                'floor_stream_fleet_p99': f'grpc floor / openpi: p99, {FLEET} robots (stream)',
                'floor_hop_fleet_p99': f'grpc floor + process hop / openpi: p99, {FLEET} robots',
                'ours_over_floor_hop_fleet_p99': f'ours / (grpc floor + process hop): p99, {FLEET} robots',
                'floor_stream_client_cpu': 'grpc floor / openpi: client CPU (stream)',
                'floor_unary_client_cpu': 'grpc floor / openpi: client CPU (unary)',
                'floor_stream_server_cpu': 'grpc floor / openpi: server CPU (stream)'}


def measure(repeats: int = REPEATS, quiet_wait_s: float = QUIET_WAIT_S) -> dict[str, Any]:
    """Run ``repeats`` repeats; print each and the ratios' medians against the targets; return the figures.

    :param quiet_wait_s: before each repeat, wait up to this long (s) for the load average to fall below 1.
    """
    systems = _systems()
    reps = []
    try:
        for k in range(1, repeats + 1):
            rep = _repeat(systems, quiet_wait_s)
            _print_repeat(k, rep)
            reps.append(rep)
    finally:
        for proc in {id(s.proc): s.proc for s in systems.values()}.values():
            proc.kill()
            proc.wait(10)
    medians = {key: float(np.median([r['ratios'][key] for r in reps])) for key in reps[0]['ratios']}
    print(f'\nours / openpi ({repeats} repeats; ours at the default isolation, the deployment process):')
    for key, label in RATIO_LABELS.items():
        each = ' / '.join(f"{r['ratios'][key]:.2f}" for r in reps)
        target = TARGETS.get(key)
        met = target is not None and medians[key] <= target
        verdict = '' if target is None else f'  target <= {target:.1f}: {"met" if met else "NOT met"}'
        print(f'  {label:42s} x{each}  median x{medians[key]:.2f}{verdict}')
    print('  load average per repeat: ' + ', '.join(f"{r['load_before']:.2f}->{r['load_after']:.2f}" for r in reps),
          flush=True)
    return {'repeats': reps, 'median_ratios': medians, 'targets': TARGETS,
            'met': {key: medians[key] <= target for key, target in TARGETS.items()}}


# -- profile ------------------------------------------------------------------------------------------------

CLIENTS: dict[str, Callable[[int], Robot]] = {
    'ours': Ours, 'ours-jpeg': lambda port: Ours(port, jpeg=True), 'openpi': Baseline,
    'openpi-jpeg': lambda port: Baseline(port, jpeg=True), 'floor-stream': FloorStream}


def _client_main(kind: str, port: int, n: int, out: str) -> None:
    """A profiled client process: a ``kind`` robot warms up, then py-spy records ``n`` round trips into ``out``."""
    robot = CLIENTS[kind](port)
    for _ in range(50):
        robot.ask()
    spy = _spy(Path(out), os.getpid(), native=bool(os.environ.get('SEQ_WIRE_NATIVE')))
    c0 = time.process_time()
    rtts = [robot.ask() for _ in range(n)]
    cpu = time.process_time() - c0
    _stop(spy)
    print(json.dumps({'p50_ms': _pct(rtts, 50), 'client_cpu_ms': 1e3 * cpu / n}), flush=True)
    robot.close()


def _py_spy() -> str:
    found = shutil.which('py-spy') or str(Path(sys.executable).with_name('py-spy'))
    if not Path(found).exists():
        raise RuntimeError('--profile needs py-spy: pip install py-spy (into the venv)')
    return found


def _spy(out: Path, pid: int, native: bool) -> subprocess.Popen:
    """Start py-spy recording process ``pid`` into ``out`` (the thread holding the GIL, raw); return once attached.

    ``--gil``: only the thread that runs Python at each sample counts, so a thread blocked in a call (a socket
    read, a condition wait) never does; native work done without the GIL (gRPC's core, socket writes) is not
    seen.
    """
    cmd = [_py_spy(), 'record', '--format', 'raw', '--rate', str(PROFILE_RATE_HZ), '--output', str(out), '--gil',
           *(['--native'] if native else ['--nonblocking']), '--pid', str(pid)]
    spy = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1.0)
    return spy


def _stop(spy: subprocess.Popen) -> None:
    """Stop py-spy: it writes its file and ends."""
    spy.send_signal(signal.SIGINT)
    try:
        spy.wait(30)
    except subprocess.TimeoutExpired:
        spy.kill()


def _top(raw: Path, n_requests: int, top: int = 8) -> dict[str, Any]:
    """A py-spy raw file's active time per request (ms) and top items: self (leaf functions) and ours, inclusive."""
    leaves: collections.Counter[str] = collections.Counter()
    ours: collections.Counter[str] = collections.Counter()
    if raw.is_file():
        for line in raw.read_text(errors='replace').splitlines():
            stack, _, count = line.rpartition(' ')
            if not count.isdigit() or not stack.strip():
                continue
            frames = stack.split(';')
            leaves[_short(frames[-1])] += int(count)
            for f in dict.fromkeys(_short(f) for f in frames if 'sequence_ai_ros' in f and 'bench' not in f):
                ours[f] += int(count)
    total = max(1, sum(leaves.values()))
    return {'active_ms_per_request': 1e3 * sum(leaves.values()) / PROFILE_RATE_HZ / n_requests,
            'self': [(f, c / total) for f, c in leaves.most_common(top)],
            'ours_inclusive': [(f, c / total) for f, c in ours.most_common(top)]}


def _short(frame: str) -> str:
    """``func (/a/b/c/file.py:12)`` -> ``func (c/file.py)``."""
    name, _, where = frame.partition(' (')
    path = where.rstrip(')').rsplit(':', 1)[0]
    return f"{name} ({'/'.join(Path(path).parts[-2:])})" if path else name


def profile(native: bool = False, n: int = PROFILE_REQUESTS, only: tuple[str, ...] = ()) -> dict[str, Any]:
    """Profile every process of each system over ``n`` round trips, one system at a time; print the top items.

    The processes: the client, and the server (ours: the worker and its deployment process), each sampled by
    py-spy (:func:`_spy`). ``only``: these kinds (of :data:`CLIENTS`) alone.
    """
    import psutil

    _py_spy()
    work = Path(os.environ.get('TMPDIR', '/tmp')) / f'seq-wire-profile-{os.getpid()}'   # the raw files stay
    work.mkdir(parents=True, exist_ok=True)
    servers = {'ours': start_server(OURS_SERVER, str(POLICY), 'process'), 'openpi': start_server(BASELINE_SERVER),
               'floor': start_server(FLOOR_SERVER)}
    kinds = {'ours': 'ours', 'openpi': 'openpi', 'ours-jpeg': 'ours', 'openpi-jpeg': 'openpi',
             'floor-stream': 'floor'}
    kinds = {kind: server for kind, server in kinds.items() if not only or kind in only}
    results: dict[str, Any] = {}
    try:
        for kind, server in kinds.items():
            proc, port = servers[server]
            pids = {'server' if server != 'ours' else 'worker': proc.pid}
            for child in psutil.Process(proc.pid).children(recursive=True):
                pids['deployment process'] = child.pid
            spies = {who: _spy(work / f'{kind}-{who}.txt', pid, native) for who, pid in pids.items()}
            client = subprocess.run([sys.executable, '-m', 'sequence_ai_ros.bench.bench_wire', '--client', kind,
                                     str(port), str(n), str(work / f'{kind}-client.txt')],
                                    capture_output=True, text=True, timeout=600, cwd=ROOT,
                                    env=dict(os.environ, SEQ_WIRE_NATIVE='1' if native else ''))
            for spy in spies.values():
                _stop(spy)
            lines = [x for x in client.stdout.splitlines() if x.startswith('{')]
            figures = json.loads(lines[-1]) if lines else {'error': client.stderr[-500:]}
            results[kind] = {'client': figures,
                             'processes': {who: _top(work / f'{kind}-{who}.txt', n) for who in ('client', *spies)}}
            _print_profile(kind, results[kind])
    finally:
        for proc, _ in servers.values():
            proc.kill()
            proc.wait(10)
    return results


def _print_profile(kind: str, res: dict[str, Any]) -> None:
    fig = res['client']
    print(f"\nprofile: {kind}  (under the profiler: p50 {fig.get('p50_ms', float('nan')):.3f} ms, client CPU "
          f"{fig.get('client_cpu_ms', float('nan')):.3f} ms per request){fig.get('error', '')}")
    for who, got in res['processes'].items():
        print(f"  {who}: {got['active_ms_per_request']:.3f} ms holding the GIL (sampled) per request; top self items:")
        for f, share in got['self']:
            print(f'    {100 * share:5.1f}%  {f}')
        if got['ours_inclusive']:
            print('    ours, inclusive: ' + '; '.join(f'{f} {100 * s:.0f}%' for f, s in got['ours_inclusive']))
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> dict:
    """Run the comparison (and with ``--profile`` the profile); print the tables and ratios; return the figures."""
    parser = argparse.ArgumentParser(prog='python -m sequence_ai_ros.bench.bench_wire')
    parser.add_argument('--repeats', type=int, default=REPEATS, metavar='N',
                        help='repeats, each the systems in alternating blocks; the ratios are their median '
                             '(default %(default)d)')
    parser.add_argument('--quiet-wait', type=float, default=QUIET_WAIT_S, metavar='S',
                        help='before each repeat, wait up to S seconds for the load average to fall below 1 '
                             '(default %(default)g)')
    parser.add_argument('--profile', action='store_true', help='also profile every process (py-spy)')
    parser.add_argument('--profile-only', action='store_true', help='only the profile')
    parser.add_argument('--native', action='store_true', help='profile native frames too (py-spy --native)')
    parser.add_argument('--profile-kinds', default='', metavar='K,K',
                        help=f"profile only these (of {', '.join(CLIENTS)}; default all)")
    parser.add_argument('--client', nargs=4, metavar=('KIND', 'PORT', 'N', 'OUT'), help=argparse.SUPPRESS)
    args = parser.parse_args([] if argv is None else argv)
    if args.client:
        _client_main(args.client[0], int(args.client[1]), int(args.client[2]), args.client[3])
        return {}
    try:
        import openpi_client.msgpack_numpy  # noqa: F401
        import websockets  # noqa: F401
    except ImportError as exc:
        raise RuntimeError(f'{exc}: install the bench requirements (make bench does: requirements-bench.txt and '
                           'pip install --no-deps openpi-client==0.1.2)') from None
    print('wire: 2 224x224x3 uint8 frames + 26-d state up, (30, 26) float32 down, 0 ms policy; '
          f'{os.cpu_count()} cores; systems alternate in blocks')
    result: dict[str, Any] = {}
    if not args.profile_only:
        result = measure(args.repeats, args.quiet_wait)
    if args.profile or args.profile_only:
        result['profile'] = profile(native=args.native,
                                    only=tuple(k for k in args.profile_kinds.split(',') if k))
    return result


if __name__ == '__main__':
    out = main(sys.argv[1:])
    if out.get('repeats'):
        print(json.dumps({key: value for key, value in out.items() if key != 'profile'}, default=str))
