"""Admission benchmark: how long a real robot waits for a stream under each flood, at the field's counts.

A worker process with the ``seq serve`` defaults (256 streams, 64 per client, idle limit 10 s, a proxy socket
as ``seq fleet`` gives it), serving the 0 ms ``test/policies/fast.py``. Floods:

- ``idle_streams``: 256 episode streams from 5 addresses (through the proxy socket, x-forwarded-for
  203.0.113.1-5), every slot taken, half of them sending an empty request every 2 s;
- ``silent_tcp``: 1,100 TCP connections that never speak, against a worker started with a soft limit of
  1,024 descriptors;
- ``forged_forwarded``: 256 streams from a local caller on the TCP port, each forging another
  x-forwarded-for.

Figure: seconds from the robot's first try (retrying on OVERLOADED every 0.2 s) to its first chunk, and
the 1-minute load average beside it.
"""

from __future__ import annotations

import json
import os
import queue
import re
import resource
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[2]
POLICY = REPO / 'test' / 'policies' / 'fast.py'
DIM = 26
ROBOT_WAIT_S = 120.0


def _worker(proxy: Path, soft_limit: int | None = None) -> tuple[subprocess.Popen, int]:
    code = ('import resource, sys\n'
            f'limit = {soft_limit!r}\n'
            'if limit:\n'
            '    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))\n'
            f'sys.path.insert(0, {str(REPO)!r})\n'
            'from sequence_ai_ros.cli import main\n'
            'sys.exit(main())\n')
    proc = subprocess.Popen([sys.executable, '-c', code, 'serve', str(POLICY), '--port', '0', '--warm',
                             '--proxy-socket', str(proxy)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True)
    assert proc.stdout is not None     # piped
    match = re.search(r'on 127\.0\.0\.1:(\d+)', proc.stdout.readline())
    if not match:
        proc.kill()
        raise RuntimeError('the worker did not start')
    return proc, int(match.group(1))


class _Held:
    """An episode stream that starts and then idles (optionally sending empty requests every ``beat_s``)."""

    def __init__(self, stub: Any, eid: str, metadata: list, beat_s: float | None) -> None:
        from sequence_ai_ros.protocol import sequence_ai_pb2 as pb

        self.stop = threading.Event()

        def requests():
            yield pb.EpisodeRequest(start=pb.EpisodeStart(episode_id=eid))
            while not self.stop.wait(beat_s or 3600):
                yield pb.EpisodeRequest()

        self.call = stub.Episode(requests(), metadata=[('x-episode-id', eid), ('x-deployment', 'fast'), *metadata])
        self.thread = threading.Thread(target=self._drain, daemon=True)
        self.thread.start()

    def _drain(self) -> None:
        try:
            for _ in self.call:
                pass
        except Exception:   # refused, closed, cancelled: all the same to a flood
            pass

    def close(self) -> None:
        self.stop.set()
        self.call.cancel()


def _robot(stub: Any) -> float:
    """Seconds until a robot's episode starts and its first chunk comes (retrying on OVERLOADED)."""
    import grpc

    from sequence_ai_ros.protocol import codec
    from sequence_ai_ros.protocol import sequence_ai_pb2 as pb

    start = time.monotonic()
    k = 0
    while time.monotonic() - start < ROBOT_WAIT_S:
        k += 1
        out: queue.Queue = queue.Queue()
        names = [f'j{i}' for i in range(DIM)]
        obs = pb.ObservationRequest(request_id=1, state=codec.to_tensor(np.zeros(DIM, np.float32)), state_names=names)

        def requests(k: int = k, obs: Any = obs, out: queue.Queue = out) -> Any:
            yield pb.EpisodeRequest(start=pb.EpisodeStart(episode_id=f'bench-robot-{k}'))
            yield pb.EpisodeRequest(observation=obs)
            out.get(timeout=30)
            yield pb.EpisodeRequest(end=pb.EpisodeEnd(reason='completed'))

        try:
            call = stub.Episode(requests(), metadata=[('x-episode-id', f'bench-robot-{k}'), ('x-deployment', 'fast')],
                                timeout=30)
            for reply in call:
                if reply.HasField('chunk'):
                    out.put(True)
                    waited = time.monotonic() - start
                    for _ in call:
                        pass
                    return waited
        except grpc.RpcError as exc:
            if exc.code() not in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE,
                                  grpc.StatusCode.DEADLINE_EXCEEDED):
                raise
        time.sleep(0.2)
    return float('inf')


def _flood_streams(forged: bool) -> float:
    import grpc

    from sequence_ai_ros.protocol import sequence_ai_pb2_grpc as pb_grpc

    with tempfile.TemporaryDirectory(prefix='seq-bench-adm-') as tmp:
        proxy = Path(tmp) / 'proxy.sock'
        proc, port = _worker(proxy)
        held: list[_Held] = []
        try:
            tcp = grpc.insecure_channel(f'127.0.0.1:{port}')
            lb = grpc.insecure_channel(f'unix:{proxy}')
            attack_stub = pb_grpc.PolicyServiceStub(tcp if forged else lb)
            for i in range(256):
                addr = f'10.9.{i // 200}.{i % 200}' if forged else f'203.0.113.{1 + i % 5}'
                held.append(_Held(attack_stub, f'flood{i}', [('x-forwarded-for', addr)],
                                  beat_s=None if forged or i % 2 else 2.0))
            time.sleep(2.0)        # the flood is in place
            return _robot(pb_grpc.PolicyServiceStub(lb))
        finally:
            for h in held:
                h.close()
            proc.kill()
            proc.wait(10)


def _flood_tcp() -> float:
    import grpc

    from sequence_ai_ros.protocol import sequence_ai_pb2_grpc as pb_grpc

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1400:
        return float('nan')
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    with tempfile.TemporaryDirectory(prefix='seq-bench-adm-') as tmp:
        proc, port = _worker(Path(tmp) / 'proxy.sock', soft_limit=1024)
        silent: list[socket.socket] = []
        try:
            time.sleep(1.0)
            silent = [socket.create_connection(('127.0.0.1', port), timeout=10) for _ in range(1100)]
            return _robot(pb_grpc.PolicyServiceStub(grpc.insecure_channel(f'127.0.0.1:{port}')))
        finally:
            for s in silent:
                s.close()
            proc.kill()
            proc.wait(10)
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def main() -> dict:
    """Run the three floods; print and return the robot's wait under each, with the load."""
    out = {}
    for name, run in (('idle_streams', lambda: _flood_streams(False)), ('silent_tcp', _flood_tcp),
                      ('forged_forwarded', lambda: _flood_streams(True))):
        load = os.getloadavg()[0]
        waited = run()
        out[name] = {'robot_wait_s': waited, 'load_1min': round(load, 2)}
        print(f'  {name:18s} robot got a stream and a chunk after {waited:6.2f} s (load {load:.2f})', flush=True)
    return out


if __name__ == '__main__':
    print(json.dumps(main(), indent=2))
