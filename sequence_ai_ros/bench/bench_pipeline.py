"""Pipelining benchmark: underruns when the round trip nears a whole chunk, pipelined against one in flight.

The overlapping part of the latency is modelled as network delay on the link: a delay proxy on loopback
(:mod:`.delay_proxy`, jitter on each one-way delay) in front of a worker process that serves
``test/policies/inpaint.py`` with a serialized compute of 0.05 x covers_seconds (the worker's inference,
as it is). For each total latency/covers ratio, run() executes ACTIONS chunk steps twice: pipelined
(up to ``Policy.max_in_flight`` requests) and with one request in flight (``max_in_flight = 1``, the
curve before pipelining). Printed: underruns, underrun_s, the most requests in flight, chunks discarded
unused, seam jump (step across a chunk boundary) and seam gap (new chunk against the old one's own row
for the same step; 0 for this in-painting policy when each request's tail and delay are right).

The margin printed beside each row is what an ideal pipeline has left at that ratio:
``covers - (max up + max down + 2 x compute + one tick)`` (s), the largest one-way delays the jitter can
draw, the compute of the request and of one queued ahead of it, and the tick at which an arrival is
noticed. A negative margin means even an ideal pipeline can run dry at a seam.

Inferences: ``requests`` sent per run (each one an inference on the worker) and per executed chunk
(``req/chunk``: requests / (actions / T)), beside an ideal pipeline's per executed chunk (``ideal``): one
request every ``covers - largest round trip``, so ``covers / (covers - largest)``, the largest round trip being
``2 x one-way x (1 + jitter) + compute`` (the longest the proxy draws, plus the inference); none where it
is a whole chunk or more.

Targets (at a load average below 1; a report, not a test): pipelined, 0 underruns at 0.7 (+-20 %,
margin +0.050 s); at 0.8 (+-20 %, margin -0.010 s) at most a tenth of the dry time (underrun_s) of one
request in flight; nothing worse at 0.2 and 0.45; seam jumps do not grow; pipelined, at most
:data:`INFERENCE_RATIO` x the ideal pipeline's inferences per executed chunk at 0.45 and 0.8. 0.9 (+-10 %)
has a negative margin (-0.028 s) and no target. What overlap can cover: a chunk arrives with ``covers - latency`` of it
ahead, which bounds the worker's serialized compute per request (here 0.05 covers).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from sequence_ai_ros.bench.bench_client import worker_process
from sequence_ai_ros.bench.delay_proxy import DelayProxy
from sequence_ai_ros.client import Observation, connect

DT, T, ACTIONS = 0.01, 50, 1000             # covers 0.5 s; 10 s per run
COMPUTE = 0.05
#: (latency/covers, jitter, the pipelined row's target): NONE (0 underruns), TENTH (underrun_s at most a tenth
#: of one request in flight's), or None (no target: the margin is negative).
NONE, TENTH = '0 underruns', 'underrun_s <= single/10'
CASES = ((0.2, 0.2, NONE), (0.45, 0.2, NONE), (0.7, 0.2, NONE), (0.8, 0.2, TENTH), (0.9, 0.1, None))
#: Pipelined inferences per executed chunk at most, against the ideal pipeline's, at these ratios.
INFERENCE_RATIO, INFERENCE_CASES = 1.5, (0.45, 0.8)


def _run(endpoint: str, max_in_flight: int, prefetch_margin: float | None = None) -> dict:
    extra: dict[str, Any] = {} if prefetch_margin is None else {'prefetch_margin': prefetch_margin}
    with connect('lat', endpoint=endpoint) as policy:
        policy.wait_until_ready(timeout=30)
        policy.max_in_flight = max_in_flight
        out = policy.run(lambda: Observation(state=np.zeros(2, np.float32), state_names=('a', 'b')),
                         lambda action: None, max_actions=ACTIONS, max_seconds=ACTIONS * DT * 3 + 5,
                         **extra)
    return {'underruns': out.underruns, 'underrun_s': round(out.underrun_s, 3), 'in_flight': out.peak_in_flight,
            'discarded': out.discarded, 'chunks': out.chunks, 'seam_jump': round(out.max_seam_jump, 3),
            'seam_gap': round(out.max_seam_gap, 3), 'p50_ms': round(out.latency_p50_ms, 1),
            'p95_ms': round(out.latency_p95_ms, 1), 'actions': out.actions, 'reason': out.reason,
            'requests': out.requests, 'per_chunk': round(out.requests / max(out.actions / T, 1e-9), 2)}


def one_way_s(ratio: float) -> float:
    """The proxy's mean one-way delay (s) for a latency/covers ``ratio``: the latency less the compute, halved."""
    return (ratio - COMPUTE) * DT * T / 2


def margin_s(ratio: float, jitter: float) -> float:
    """``covers - (max up + max down + 2 x compute + one tick)`` (s): an ideal pipeline's slack at a seam."""
    covers = DT * T
    return covers - (2 * one_way_s(ratio) * (1 + jitter) + 2 * COMPUTE * covers + DT)


def ideal_per_chunk(ratio: float, jitter: float) -> float | None:
    """An ideal pipeline's requests per executed chunk: ``covers / (covers - largest round trip)``; None if <= 0.

    The largest round trip is ``2 x one-way x (1 + jitter) + compute``: the longest the proxy draws each way
    and the worker's inference (one request every ``covers - largest`` keeps the next chunk in time).
    """
    covers = DT * T
    spare = covers - (2 * one_way_s(ratio) * (1 + jitter) + COMPUTE * covers)
    return covers / spare if spare > 1e-9 else None


def met(goal: str | None, pipelined: dict, single: dict) -> str:
    """'met' or 'MISSED' for a pipelined row against its target ``goal`` ('' without one)."""
    if goal is None:
        return ''
    if goal == NONE:
        ok = pipelined['underruns'] == 0
    else:
        ok = pipelined['underrun_s'] <= single['underrun_s'] / 10 + 1e-9
    return 'met' if ok else 'MISSED'


def _fmt(value: float | None, width: int) -> str:
    return ('-' if value is None else f'{value:.2f}').rjust(width)


def _loadavg() -> str:
    try:
        with open('/proc/loadavg') as f:
            return ' '.join(f.read().split()[:3])
    except OSError:
        return 'unknown'


def main(prefetch_margin: float | None = None, ratios: tuple[float, ...] | None = None) -> dict:
    """Run every case pipelined and single, print the table (with each case's margin and target), return the rows.

    :param prefetch_margin: the episodes' ``prefetch_margin`` (None: the default).
    :param ratios: only the cases of these latency/covers ratios (None: all).
    """
    from pathlib import Path

    covers = DT * T
    policy = Path(__file__).resolve().parents[2] / 'test' / 'policies' / 'inpaint.py'
    load_before = _loadavg()
    print(f'pipelining: dt={DT * 1e3:.0f} ms, T={T} (covers {covers:.2f} s), compute {COMPUTE} covers, '
          f'network delay on a loopback proxy, {ACTIONS} actions per run, prefetch_margin '
          f"{'default' if prefetch_margin is None else prefetch_margin}; load average {load_before}")
    print('  ratio  jitter  margin_s  mode       underruns  underrun_s  in_flight  discarded  chunks  seam_jump  '
          'seam_gap  p50_ms  requests  req/chunk  ideal  x_ideal  target')
    rows = []
    for ratio, jitter, goal in CASES:
        if ratios is not None and ratio not in ratios:
            continue
        proc, endpoint = worker_process(policy, dt=DT, chunk_length=T, compute_s=COMPUTE * covers)
        port = endpoint.rsplit(':', 1)[-1]
        proxy = DelayProxy(int(port), one_way_s=one_way_s(ratio), jitter=jitter, seed=11)
        margin = margin_s(ratio, jitter)
        ideal = ideal_per_chunk(ratio, jitter)
        try:
            case = {}
            for mode, bound in (('pipelined', 16), ('single', 1)):
                row = {'ratio': ratio, 'jitter': jitter, 'margin_s': round(margin, 3), 'mode': mode,
                       **_run(f'127.0.0.1:{proxy.port}', bound, prefetch_margin)}
                row.update(ideal_per_chunk=None if ideal is None else round(ideal, 2),
                           vs_ideal=None if ideal is None else round(row['per_chunk'] / ideal, 2))
                case[mode] = row
                rows.append(row)
                if mode == 'pipelined':
                    note = goal or 'no target: margin < 0'
                    if ratio in INFERENCE_CASES and row['vs_ideal'] is not None:
                        verdict = 'met' if row['vs_ideal'] <= INFERENCE_RATIO else 'MISSED'
                        row['inferences_met'] = verdict
                        note += f'; inferences <= {INFERENCE_RATIO}x ideal: {verdict}'
                else:
                    verdict = met(goal, case['pipelined'], row)
                    case['pipelined'].update(target=goal or '', met=verdict)
                    note = f'(pipelined: {verdict})' if verdict else ''
                print(f"  {ratio:5.2f}  +-{jitter:.0%}  {margin:+8.3f}  {mode:9s}  {row['underruns']:9d}  "
                      f"{row['underrun_s']:10.3f}  {row['in_flight']:9d}  {row['discarded']:9d}  {row['chunks']:6d}  "
                      f"{row['seam_jump']:9.3f}  {row['seam_gap']:8.3f}  {row['p50_ms']:6.1f}  {row['requests']:8d}  "
                      f"{row['per_chunk']:9.2f}  {_fmt(ideal, 5)}  {_fmt(row['vs_ideal'], 7)}  {note}", flush=True)
        finally:
            proxy.close()
            proc.kill()
            proc.wait(10)
    load_after = _loadavg()
    print(f'  load average before {load_before}, after {load_after} (targets hold at a load average below 1)')
    return {'rows': rows, 'loadavg_before': load_before, 'loadavg_after': load_after}


if __name__ == '__main__':
    import argparse

    parser = argparse.ArgumentParser(prog='python -m sequence_ai_ros.bench.bench_pipeline',
                                     description='Underruns and inferences under latency, pipelined and one in flight.')
    parser.add_argument('--prefetch-margin', type=float, default=None,
                        help="the episodes' prefetch_margin (mean deviations; default: the client's, 4)")
    parser.add_argument('--ratios', type=float, nargs='+', default=None, metavar='R',
                        help=f'only these latency/covers ratios (default: all of {[c[0] for c in CASES]})')
    args = parser.parse_args()
    main(args.prefetch_margin, None if args.ratios is None else tuple(args.ratios))
