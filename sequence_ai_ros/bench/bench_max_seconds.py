"""max_seconds benchmark: how far past ``max_seconds`` run() returns against a slow policy.

A real worker on loopback (in this process) serves ``test/policies/client_latency.py`` at 0.9 s per chunk
(dt = 20 ms, T = 50: a chunk covers 1 s, so an inference is nearly always running or queued when the time
is up). ``run(max_seconds=3)`` and ``=5`` are timed from the call to its return; the overshoot (returned at
minus max_seconds) is printed against the bound: one control period + 100 ms + one network round trip (a
unary Ready call's median, measured beside it), the EpisodeEnd -> EpisodeEnded exchange, which never waits
for an inference. The worker's end counts (requests dropped, results discarded, inferences started after
an end) come with it. About 20 s.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from sequence_ai_ros.client import Action, Observation, Policy, connect

POLICY = Path(__file__).resolve().parents[2] / 'test' / 'policies' / 'client_latency.py'
INFERENCE_S, DT, T = 0.9, 0.02, 50
LIMITS_S = (3.0, 5.0)
REPEATS = 2


def _rtt_s(policy: Policy, n: int = 20) -> float:
    """Median seconds of one Ready round trip (unary, loopback)."""
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        policy.ready()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> dict:
    """Run each max_seconds REPEATS times, print the overshoots against the bound, return the figures."""
    from sequence_ai_ros.worker import serve_policy_file

    server = serve_policy_file(POLICY, deployment='lat', port=0, mean_s=INFERENCE_S, dt=DT, chunk_length=T)
    rows: list[dict[str, Any]] = []
    try:
        runtime = server.runtimes['lat']
        with connect('lat', endpoint=f'127.0.0.1:{server.port}') as policy:
            policy.wait_until_ready(timeout=30)
            rtt = _rtt_s(policy)
            bound = DT + 0.1 + rtt
            print(f'policy {INFERENCE_S:g} s per chunk, dt {DT * 1e3:.0f} ms (the control period), T {T}; '
                  f'one round trip {rtt * 1e3:.2f} ms; bound = period + 100 ms + round trip = {bound * 1e3:.1f} ms')
            print('  max_seconds  returned_s  overshoot_ms  bound_ms  within  reason   chunks  confirmed')
            for limit in LIMITS_S:
                for _ in range(REPEATS):
                    acted: list[Action] = []

                    def observe(acted: list[Action] = acted) -> Observation:
                        return Observation(state=np.array([len(acted), 0], np.float32))

                    t0 = time.monotonic()
                    out = policy.run(observe, acted.append, max_actions=10**9, max_seconds=limit)
                    returned = time.monotonic() - t0
                    over = returned - limit
                    rows.append({'max_seconds': limit, 'returned_s': round(returned, 4),
                                 'overshoot_ms': round(over * 1e3, 1), 'bound_ms': round(bound * 1e3, 1),
                                 'within_bound': over <= bound, 'reason': out.reason, 'chunks': out.chunks,
                                 'worker_confirmed': out.worker_confirmed})
                    r = rows[-1]
                    print(f"  {limit:11g}  {r['returned_s']:10.3f}  {r['overshoot_ms']:12.1f}  {r['bound_ms']:8.1f}  "
                          f"{'yes' if r['within_bound'] else 'NO':6s}  {r['reason']:7s}  {r['chunks']:6d}  "
                          f"{r['worker_confirmed']}", flush=True)
            # the last inference left running at an end finishes before the counts are read
            deadline = time.monotonic() + 2 * INFERENCE_S + 1
            while runtime.scheduler.inferring and time.monotonic() < deadline:
                time.sleep(0.05)
            ends = runtime.end_stats()
    finally:
        server.stop(grace=0.5)
    worst = max(r['overshoot_ms'] for r in rows)
    print(f'worst overshoot {worst:.1f} ms against a bound of {bound * 1e3:.1f} ms; worker at the ends: {ends}')
    return {'runs': rows, 'rtt_ms': round(rtt * 1e3, 3), 'bound_ms': round(bound * 1e3, 1),
            'worst_overshoot_ms': worst, 'all_within_bound': all(r['within_bound'] for r in rows), 'ends': ends}


if __name__ == '__main__':
    main()
