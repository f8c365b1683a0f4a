"""``make bench`` part: robots per worker, as the scale-out guide states it (``python -m sequence_ai_ros.bench scale``).

Two ``seq serve`` of a 0 ms policy (3-d state, no image) on this host, one per isolation: ``--isolation
process`` (seq serve's default: the policy in its deployment process) and ``--isolation none`` (the policy in
the worker), started together and driven in turn, run after run (interleaved; the order alternates), so that
both meet the same machine. Robots are threads of this process at 10 requests/s each
(:func:`~sequence_ai_ros.bench.bench_fleet.drive`: own channel, own stream, own phase), for ``--seconds`` per
run and ``--runs`` runs. A reply later than the robot's next 100 ms slot is *late* (its underrun). Each run
waits (at most ``--quiet-wait``, :data:`QUIET_WAIT_S`) for the 1-minute load average to fall below
:data:`QUIET_LOAD` (128 robots at 10 req/s load both cores themselves, so the previous run's load decays first),
and prints the load average before and after it beside the figures: a run that started above it shares the
cores with other work, and says so. Each row gives the CPU time per request of the worker and of its
deployment process (``/proc``) and of the robots (this process's threads), the cores all three kept busy on
average (of :func:`os.cpu_count`: near 2 of 2, replies queue for a core), and each run the default's
throughput as a ratio of ``none``'s in the same run. The workers get ``--max-pending`` and ``--max-streams``
above the robot count, so a queue limit is not what is measured.

Goal (:data:`GOAL`; 2 cores, quiet): 128 robots with 0 late replies in 3 of 3 runs at each isolation, and the
default's throughput within 10 % of ``none``'s in every run.

Defaults: 128 robots, 10 s, 1 run, both isolations (``make bench``'s short form); ``make bench-scale`` runs 3
runs of 30 s (about 10 minutes with the waits).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from sequence_ai_ros.bench.bench_fleet import Worker, drive
from sequence_ai_ros.bench.bench_isolation import wait_for_quiet
from sequence_ai_ros.worker.config import ServerConfig
from sequence_ai_ros.worker.policy_process import ISOLATION_MODES

#: A 0 ms policy with a 3-d state and no camera; its chunk covers one 100 ms slot.
POLICY = '''
import sequence_ai_ros.policy as seq
import numpy as np

NAMES = ['j0', 'j1', 'j2']


@seq.policy(action_space='joint_absolute', action_names=NAMES, dt=0.01, chunk_length=10,
            observation=seq.ObservationContract(state_names=NAMES))
class ZeroMs3:
    def infer(self, inp, episode):
        return np.tile(inp.observation.state, (10, 1))
'''
NAMES = ['j0', 'j1', 'j2']
#: Load average (1 min) below which the machine counts as quiet before a run.
QUIET_LOAD = 0.5
#: How long a run waits for that load average (s); a run that starts above it says "(not quiet)".
QUIET_WAIT_S = 240.0
#: Most the default's throughput may fall below ``none``'s in the same run (a share).
RATIO_GOAL = 0.90
#: What the bench's defaults are to reach on a quiet 2-core machine (the lead's runs in docs/benchmarks.md).
GOAL = (f'goal on 2 quiet cores: 128 robots, 0 late replies in 3 of 3 runs at each isolation, and the default '
        f"--isolation {ServerConfig.isolation}'s throughput >= {RATIO_GOAL:.2f} x none's in each run")


def cpu_s(pid: int) -> float:
    """CPU time (user + system, s) of process ``pid`` so far; 0 when it is gone."""
    try:
        with open(f'/proc/{pid}/stat') as stat:
            fields = stat.read().rsplit(')', 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf('SC_CLK_TCK')


def children(pid: int) -> list[int]:
    """The child processes of ``pid`` (every thread's: a deployment process is started by a loader thread)."""
    kids: list[int] = []
    try:
        tasks = os.listdir(f'/proc/{pid}/task')
    except OSError:
        return kids
    for tid in tasks:
        try:
            with open(f'/proc/{pid}/task/{tid}/children') as f:
                kids.extend(int(k) for k in f.read().split())
        except OSError:
            pass
    return kids


def measure(worker: Worker, robots: int, seconds: float) -> dict:
    """One run against ``worker``: :func:`~.bench_fleet.drive`'s figures, plus CPU ms per request and the load."""
    before = os.getloadavg()[0]
    pids = [worker.proc.pid, *children(worker.proc.pid)]
    start = {pid: cpu_s(pid) for pid in pids}
    robots_cpu = time.process_time()
    fig = drive(worker, robots, seconds, NAMES)
    robots_cpu = time.process_time() - robots_cpu
    pids += [pid for pid in children(worker.proc.pid) if pid not in start]     # a process restarted meanwhile
    spent = {pid: cpu_s(pid) - start.get(pid, 0.0) for pid in pids}
    n = max(1, fig['requests'])
    fig.update(load_before=before, load_after=os.getloadavg()[0], worker_cpu_ms=spent[worker.proc.pid] / n * 1e3,
               process_cpu_ms=sum(v for pid, v in spent.items() if pid != worker.proc.pid) / n * 1e3,
               robots_cpu_ms=robots_cpu / n * 1e3, cores_busy=(sum(spent.values()) + robots_cpu) / seconds)
    return fig


def run(robots: int = 128, seconds: float = 30.0, runs: int = 3, isolations: tuple[str, ...] = ISOLATION_MODES,
        quiet_wait_s: float = QUIET_WAIT_S) -> dict:
    """Serve ``robots`` robots at 10 req/s, ``runs`` times for ``seconds`` each per isolation; print, return figures.

    :param isolations: the workers' ``--isolation`` modes, driven in turn within each run (``process``, seq
        serve's default, and ``none``).
    :param quiet_wait_s: longest wait (s) for a quiet machine before each run of each mode.
    """
    figures: dict[str, list[dict]] = {mode: [] for mode in isolations}
    ratios: list[float] = []
    default = ServerConfig.isolation
    with tempfile.TemporaryDirectory() as tmp:
        policy = Path(tmp) / 'zero3' / 'policy.py'
        policy.parent.mkdir()
        policy.write_text(POLICY)
        limit = str(max(64, 2 * robots))
        workers = {mode: Worker(policy, args=('--max-pending', limit, '--max-streams', limit, '--isolation', mode))
                   for mode in isolations}
        try:
            print(f'{robots} robots at 10 req/s, 0 ms policy, {seconds:g} s per run; isolations {", ".join(isolations)}'
                  f' interleaved; {os.cpu_count()} cores')
            print(f'{"run":>3} {"isolation":<9} {"robots":>6} {"req/s":>7} {"p50 ms":>7} {"p99 ms":>7} {"late":>6} '
                  f'{"worker ms/req":>13} {"process ms/req":>14} {"robots ms/req":>13} {"cores busy":>10} '
                  f'{"load before":>11} {"load after":>10}')
            for k in range(1, runs + 1):
                order = isolations if k % 2 else tuple(reversed(isolations))
                row: dict[str, dict] = {}
                for mode in order:
                    before = wait_for_quiet(QUIET_LOAD, quiet_wait_s)   # the last run's own load decays first
                    fig = measure(workers[mode], robots, seconds)
                    fig.update(run=k, isolation=mode, load_before=before, quiet=before < QUIET_LOAD)
                    figures[mode].append(fig)
                    row[mode] = fig
                    print(f'{k:>3} {mode:<9} {robots:>6} {fig["rate"]:>7.1f} {fig["p50"]:>7.1f} {fig["p99"]:>7.1f} '
                          f'{fig["late"]:>6} {fig["worker_cpu_ms"]:>13.3f} {fig["process_cpu_ms"]:>14.3f} '
                          f'{fig["robots_cpu_ms"]:>13.3f} {fig["cores_busy"]:>10.2f} '
                          f'{before:>11.2f} {fig["load_after"]:>10.2f}' + ('' if fig['quiet'] else '  (not quiet)')
                          + (f'  errors: {fig["errors"]}' if fig['errors'] else ''), flush=True)
                    time.sleep(1.0)
                if default in row and 'none' in row and default != 'none':
                    ratio = row[default]['rate'] / max(1e-9, row['none']['rate'])
                    ratios.append(ratio)
                    print(f'    run {k}: --isolation {default} throughput = {ratio:.3f} x none\'s', flush=True)
        finally:
            for worker in workers.values():
                worker.close()
    summary: dict = {'robots': robots, 'seconds': seconds, 'runs': runs, 'isolations': list(isolations),
                     'ratios': ratios, 'goal': GOAL}
    for mode, figs in figures.items():
        held = sum(1 for f in figs if f['late'] == 0 and not f['errors'])
        quiet = sum(1 for f in figs if f['quiet'])
        summary[mode] = {'runs': figs, 'held': held, 'quiet_runs': quiet}
        print(f'--isolation {mode}: {robots} robots with 0 late replies in {held} of {runs} runs ({quiet} started at '
              f'load < {QUIET_LOAD})', flush=True)
    if ratios:
        print(f'--isolation {default} throughput / none\'s: {", ".join(f"{r:.3f}" for r in ratios)} '
              f'(goal >= {RATIO_GOAL:.2f})')
    print(GOAL, flush=True)
    return summary


def main(argv: list[str] | None = None) -> dict:
    """``make bench``'s short form (one 10 s run of 128 robots per isolation), or the full one by its options."""
    parser = argparse.ArgumentParser(prog='python -m sequence_ai_ros.bench.bench_scale')
    parser.add_argument('--robots', type=int, default=128, help='robots at 10 requests/s each (default %(default)d)')
    parser.add_argument('--seconds', type=float, default=10.0,
                        help='seconds per run (default %(default)g; make bench-scale: 30)')
    parser.add_argument('--runs', type=int, default=1,
                        help='runs per isolation (default %(default)d; make bench-scale: 3)')
    parser.add_argument('--isolation', choices=(*ISOLATION_MODES, 'both'), default='both',
                        help=f"the workers' --isolation: both (default: {ServerConfig.isolation}, seq serve's "
                             'default, and none, interleaved) or one of them')
    parser.add_argument('--quiet-wait', type=float, default=QUIET_WAIT_S,
                        help=f'longest wait (s) before each run for a load average below {QUIET_LOAD} '
                             '(default %(default)g)')
    args = parser.parse_args([] if argv is None else argv)
    modes = ISOLATION_MODES if args.isolation == 'both' else (args.isolation,)
    return run(args.robots, args.seconds, args.runs, modes, args.quiet_wait)


if __name__ == '__main__':
    import sys

    main(sys.argv[1:])
