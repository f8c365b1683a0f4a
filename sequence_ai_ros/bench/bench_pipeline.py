"""Pipelining benchmark: underruns when the round trip nears a whole chunk, pipelined against one in flight.

The overlapping part of the latency is modelled as network delay on the link: a delay proxy on loopback
(:mod:`.delay_proxy`, jitter on each one-way delay) in front of a worker process that serves
``test/policies/inpaint.py`` with a serialized compute of 0.05 x covers_seconds (the worker's inference,
as it is). For each total latency/covers ratio, run() executes ACTIONS chunk steps twice: pipelined
(up to ``Policy.max_in_flight`` requests) and with one request in flight (``max_in_flight = 1``, the
curve before pipelining). Printed: underruns, underrun_s, the most requests in flight, chunks discarded
unused, seam jump (step across a chunk boundary) and seam gap (new chunk against the old one's own row
for the same step; 0 for this in-painting policy when each request's tail and delay are right).

Targets (issue 13): pipelined, 0 underruns at 0.8 (+-20 %) and 0.9 (+-10 %); nothing worse at 0.2 and
0.45; seam jumps do not grow. What overlap can cover: a chunk arrives with ``covers - latency`` of it
ahead, which bounds the worker's serialized compute per request (here 0.05 covers).
"""

from __future__ import annotations

import numpy as np

from sequence_ai_ros.bench.bench_client import _worker_process
from sequence_ai_ros.bench.delay_proxy import DelayProxy
from sequence_ai_ros.client import Observation, connect

DT, T, ACTIONS = 0.01, 50, 1000             # covers 0.5 s; 10 s per run
COMPUTE = 0.05
CASES = ((0.2, 0.2), (0.45, 0.2), (0.8, 0.2), (0.9, 0.1))


def _run(endpoint: str, max_in_flight: int) -> dict:
    with connect('lat', endpoint=endpoint) as policy:
        policy.wait_until_ready(timeout=30)
        policy.max_in_flight = max_in_flight
        out = policy.run(lambda: Observation(state=np.zeros(2, np.float32), state_names=('a', 'b')),
                         lambda action: None, max_actions=ACTIONS, max_seconds=ACTIONS * DT * 3 + 5)
    return {'underruns': out.underruns, 'underrun_s': round(out.underrun_s, 3), 'in_flight': out.peak_in_flight,
            'discarded': out.discarded, 'chunks': out.chunks, 'seam_jump': round(out.max_seam_jump, 3),
            'seam_gap': round(out.max_seam_gap, 3), 'p50_ms': round(out.latency_p50_ms, 1),
            'p95_ms': round(out.latency_p95_ms, 1), 'actions': out.actions, 'reason': out.reason}


def main() -> dict:
    """Run every case pipelined and single, print the table, return the rows."""
    from pathlib import Path

    covers = DT * T
    policy = Path(__file__).resolve().parents[2] / 'test' / 'policies' / 'inpaint.py'
    print(f'pipelining: dt={DT * 1e3:.0f} ms, T={T} (covers {covers:.2f} s), compute {COMPUTE} covers, '
          f'network delay on a loopback proxy, {ACTIONS} actions per run')
    print('  ratio  jitter  mode       underruns  underrun_s  in_flight  discarded  chunks  seam_jump  seam_gap  '
          'p50_ms')
    rows = []
    for ratio, jitter in CASES:
        proc, endpoint = _worker_process(policy, dt=DT, chunk_length=T, compute_s=COMPUTE * covers)
        port = endpoint.rsplit(':', 1)[-1]
        proxy = DelayProxy(int(port), one_way_s=(ratio - COMPUTE) * covers / 2, jitter=jitter, seed=11)
        try:
            for mode, bound in (('pipelined', 16), ('single', 1)):
                row = {'ratio': ratio, 'jitter': jitter, 'mode': mode, **_run(f'127.0.0.1:{proxy.port}', bound)}
                rows.append(row)
                print(f"  {ratio:5.2f}  +-{jitter:.0%}  {mode:9s}  {row['underruns']:9d}  {row['underrun_s']:10.3f}  "
                      f"{row['in_flight']:9d}  {row['discarded']:9d}  {row['chunks']:6d}  {row['seam_jump']:9.3f}  "
                      f"{row['seam_gap']:8.3f}  {row['p50_ms']:6.1f}", flush=True)
        finally:
            proxy.close()
            proc.kill()
            proc.wait(10)
    return {'rows': rows}


if __name__ == '__main__':
    main()
