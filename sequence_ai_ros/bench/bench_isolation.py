"""Isolation benchmark: the round trip with the policy in a deployment process against in the worker.

Payload: the wire benchmark's (two raw 224x224x3 uint8 frames and a 26-d float32 state up, a float32
(50, 26) chunk down, 0 ms policy ``test/policies/wire.py``), one robot on the client's own episode path
(:class:`~sequence_ai_ros.bench.bench_wire.Ours`). Two workers run side by side, ``--isolation process``
and ``--isolation none``; the modes alternate in blocks, :data:`REPEATS` times, each repeat starting once the
1-minute load average is below 1 (or after :data:`LOAD_WAIT_S`, and the load is reported either way).

Figures per repeat and mode: round trip p50/p99 (ms) and server CPU per request (ms, the worker and its
deployment process together); the cost of isolation is the p50 difference (goal: <= 0.3 ms).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from sequence_ai_ros.bench.bench_client import start_server_process
from sequence_ai_ros.bench.bench_wire import Ours, process_cpu_s

POLICY = Path(__file__).resolve().parents[2] / 'test' / 'policies' / 'wire.py'
REPEATS, BLOCKS, PER_BLOCK = 3, 4, 150
LOAD_WAIT_S = 120.0
#: The goal: isolation adds at most this much to the round trip's p50 (ms).
GOAL_MS = 0.3
MODES = ('process', 'none')

SERVER = (
    'import sys\n'
    'from sequence_ai_ros.worker import serve_policy_file\n'
    "server = serve_policy_file(sys.argv[1], deployment='wire', port=0, isolation=sys.argv[2], warm=True)\n"
    "print(f'serving grpc on 127.0.0.1:{server.port}', flush=True)\n"
    'server.wait()\n')


def wait_for_quiet(limit: float = 1.0, wait_s: float = LOAD_WAIT_S) -> float:
    """Wait until the 1-minute load average is below ``limit`` (at most ``wait_s`` s); return it."""
    deadline = time.monotonic() + wait_s
    while os.getloadavg()[0] >= limit and time.monotonic() < deadline:
        time.sleep(2.0)
    return os.getloadavg()[0]


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values) * 1e3, q))


def main() -> dict:
    """Run the comparison; print each repeat and the median difference; return the figures."""
    servers = {mode: start_server_process(SERVER, str(POLICY), mode) for mode in MODES}
    repeats = []
    try:
        for k in range(REPEATS):
            load = wait_for_quiet()     # before the episodes open: an idle stream is closed after 10 s
            robots = {mode: Ours(int(address.rsplit(':', 1)[-1])) for mode, (_, address) in servers.items()}
            for robot in robots.values():
                for _ in range(20):
                    robot.ask()
            got: dict[str, dict[str, list[float]]] = {mode: {'rtt': [], 'cpu': []} for mode in MODES}
            for _ in range(BLOCKS):
                for mode in MODES:
                    pid = servers[mode][0].pid
                    c0 = process_cpu_s(pid)
                    got[mode]['rtt'] += [robots[mode].ask() for _ in range(PER_BLOCK)]
                    got[mode]['cpu'].append((process_cpu_s(pid) - c0) / PER_BLOCK)
            row: dict[str, Any] = {'load_1min_before': round(load, 2), 'load_1min_after': round(os.getloadavg()[0], 2)}
            for mode in MODES:
                row[mode] = {'rtt_p50_ms': _pct(got[mode]['rtt'], 50), 'rtt_p99_ms': _pct(got[mode]['rtt'], 99),
                             'server_cpu_ms': 1e3 * float(np.median(got[mode]['cpu']))}
            row['added_p50_ms'] = row['process']['rtt_p50_ms'] - row['none']['rtt_p50_ms']
            repeats.append(row)
            for robot in robots.values():
                robot.close()
            print(f"  repeat {k + 1}: load {row['load_1min_before']:.2f}->{row['load_1min_after']:.2f}  "
                  f"p50 process {row['process']['rtt_p50_ms']:.3f} ms, none {row['none']['rtt_p50_ms']:.3f} ms, "
                  f"added {row['added_p50_ms']:+.3f} ms; p99 {row['process']['rtt_p99_ms']:.3f} / "
                  f"{row['none']['rtt_p99_ms']:.3f} ms; server CPU {row['process']['server_cpu_ms']:.3f} / "
                  f"{row['none']['server_cpu_ms']:.3f} ms per request", flush=True)
    finally:
        for proc, _ in servers.values():
            proc.kill()
            proc.wait(10)
    added = float(np.median([r['added_p50_ms'] for r in repeats]))
    print(f'isolation adds {added:+.3f} ms to the round trip p50 (median of {REPEATS} repeats; goal <= {GOAL_MS} ms)'
          f'{"" if added <= GOAL_MS else "  (above the goal)"}')
    return {'repeats': repeats, 'added_p50_ms': added, 'goal_ms': GOAL_MS, 'meets_goal': added <= GOAL_MS}


if __name__ == '__main__':
    print(json.dumps(main(), indent=2))
