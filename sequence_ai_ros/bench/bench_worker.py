"""Worker benchmark: chunk round trip on loopback with a 0 ms policy (one 224x224 JPEG camera + 26-d state).

The worker runs in its own process (``seq serve`` on a temporary policy file), as on a real machine; the
robots are threads of this process speaking the raw gRPC stub, each on its own Episode stream. The JPEG is
encoded once up front (robot-side encoding is the client benchmark's business), so the figure is: request
serialisation, loopback, the worker's decode and validation, the queue, the policy call, the reply.

1. One robot, back to back: p50 / p99 of the round trip.
2. 16 robots at 10 requests/s each, concurrently: p99 over all requests.

Targets (issue 3): one robot p50 <= 2 ms and p99 <= 5 ms; 16 robots p99 <= 20 ms. Bounded to < 60 s.
"""

from __future__ import annotations

import queue
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

POLICY = '''
import numpy as np
import sequence_ai_ros.policy as seq

NAMES = [f'j{i}' for i in range(26)]


@seq.policy(action_space='joint_absolute', action_names=NAMES, dt=1 / 30, chunk_length=30,
            observation=seq.ObservationContract(cameras=[seq.CameraSpec('cam_high', 224, 224, 'jpeg')],
                                                state_names=NAMES))
class ZeroMs:
    def infer(self, inp, episode):
        return np.tile(inp.observation.state, (30, 1))
'''
NAMES = [f'j{i}' for i in range(26)]
TARGETS = {'1 robot p50': 2.0, '1 robot p99': 5.0, '16 robots p99': 20.0}


class _Robot:
    """One robot: an Episode stream and a blocking ``ask`` (one request in flight)."""

    def __init__(self, stub, episode_id: str) -> None:
        from sequence_ai_ros.protocol import sequence_ai_pb2 as pb

        self.pb = pb
        self._out: queue.Queue = queue.Queue()
        self._call = stub.Episode(iter(self._out.get, None), metadata=[('x-episode-id', episode_id),
                                                                       ('x-deployment', 'bench_zero')])
        self._out.put(pb.EpisodeRequest(start=pb.EpisodeStart(episode_id=episode_id)))
        reply = next(self._call)
        if not reply.HasField('started'):
            raise RuntimeError(f'episode did not start: {reply}')

    def ask(self, req) -> float:
        t0 = time.perf_counter()
        self._out.put(self.pb.EpisodeRequest(observation=req))
        reply = next(self._call)
        dt = time.perf_counter() - t0
        if not reply.HasField('chunk'):
            raise RuntimeError(f'no chunk: {reply}')
        return dt

    def close(self) -> None:
        self._out.put(self.pb.EpisodeRequest(end=self.pb.EpisodeEnd(reason='completed')))
        for _ in self._call:
            pass
        self._out.put(None)


def _request(rid: int, image):
    from sequence_ai_ros.protocol import codec
    from sequence_ai_ros.protocol import sequence_ai_pb2 as pb

    return pb.ObservationRequest(request_id=rid, robot_time_s=time.monotonic(),
                                 state=codec.to_tensor(np.linspace(0, 1, 26, dtype=np.float32)),
                                 state_names=NAMES, images=[image])


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values) * 1e3, q)) if values else float('nan')


def main(single_requests: int = 1000, robots: int = 16, rate_hz: float = 10.0, seconds: float = 8.0) -> dict:
    """Run the benchmark; print a table; return the figures (ms)."""
    import grpc

    from sequence_ai_ros.protocol import PROTOCOL_VERSION, codec
    from sequence_ai_ros.protocol import sequence_ai_pb2 as pb
    from sequence_ai_ros.protocol import sequence_ai_pb2_grpc as pb_grpc

    rng = np.random.default_rng(0)
    image = codec.encode_image('cam_high', rng.integers(0, 255, (224, 224, 3), dtype=np.uint8), 'jpeg')
    deadline = time.monotonic() + 55.0
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / 'bench_zero.py'
        path.write_text(POLICY)
        proc = subprocess.Popen([sys.executable, '-c', 'import sys; from sequence_ai_ros.cli.serving import main; '
                                 'sys.exit(main())', 'serve', str(path), '--port', '0', '--warm'],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert proc.stdout is not None and proc.stderr is not None     # both piped
        try:
            line = proc.stdout.readline()
            match = re.search(r':(\d+)', line)
            if not match:
                raise RuntimeError(f'worker did not start: {line!r} {proc.stderr.read() if proc.poll() else ""}')
            ch = grpc.insecure_channel(f'127.0.0.1:{match.group(1)}')
            stub = pb_grpc.PolicyServiceStub(ch)
            stub.Handshake(pb.HandshakeRequest(deployment='bench_zero', protocol_version=PROTOCOL_VERSION), timeout=10)
            while not stub.Ready(pb.ReadyRequest(deployment='bench_zero'), timeout=5).ready:
                time.sleep(0.05)
            one = _Robot(stub, 'bench-single')
            for rid in range(1, 51):  # warm-up
                one.ask(_request(rid, image))
            single = [one.ask(_request(50 + i, image)) for i in range(1, single_requests + 1)
                      if time.monotonic() < deadline - 20]
            one.close()

            lat: list[float] = []
            lock = threading.Lock()
            errors: list[str] = []

            def drive(k: int) -> None:
                try:
                    robot = _Robot(stub, f'bench-{k}')
                    period = 1.0 / rate_hz
                    start = time.monotonic() + k * period / robots  # spread the robots over one period
                    n = int(seconds * rate_hz)
                    for i in range(n):
                        delay = start + i * period - time.monotonic()
                        if delay > 0:
                            time.sleep(delay)
                        dt = robot.ask(_request(i + 1, image))
                        with lock:
                            lat.append(dt)
                    robot.close()
                except Exception as exc:  # reported in the table
                    errors.append(f'robot {k}: {exc}')

            threads = [threading.Thread(target=drive, args=(k,), name=f'bench-robot-{k}') for k in range(robots)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=max(1.0, deadline - time.monotonic()))
            ch.close()
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
    figures: dict[str, Any] = {
        '1 robot p50': _pct(single, 50), '1 robot p99': _pct(single, 99), '16 robots p99': _pct(lat, 99),
        '16 robots p50': _pct(lat, 50), 'single_requests': len(single), 'concurrent_requests': len(lat),
        'errors': errors}
    print(f'{"worker chunk round trip (ms)":<30} {"value":>8} {"target":>8}')
    for key in ('1 robot p50', '1 robot p99', '16 robots p50', '16 robots p99'):
        target = TARGETS.get(key)
        mark = '' if target is None else ('ok' if figures[key] <= target else 'MISS')
        print(f'{key:<30} {figures[key]:>8.2f} {target if target else "":>8} {mark}')
    print(f'requests: {len(single)} single, {len(lat)} concurrent ({robots} robots x {rate_hz:g} Hz x {seconds:g} s)'
          + (f'; errors: {errors}' if errors else ''))
    return figures


if __name__ == '__main__':
    main()
