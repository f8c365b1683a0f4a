"""``make bench`` part: robots per worker, measured as the README states it (``python -m sequence_ai_ros.bench scale``).

One ``seq serve`` of a 0 ms policy (3-d state, no image) on this host, robots as threads of this process at
10 requests/s each (:func:`~sequence_ai_ros.bench.bench_fleet.drive`: own channel, own stream, own phase), for
``--seconds`` per run and ``--runs`` runs. A reply later than the robot's next 100 ms slot is *late* (its
underrun). Each run waits (at most :data:`QUIET_WAIT_S`) for the 1-minute load average to fall below
:data:`QUIET_LOAD` (128 robots at 10 req/s load both cores themselves, so the previous run's load decays first),
and prints the load average before and after it beside the figures: a run that started above it shares the
cores with other work, and says so. The worker gets ``--max-pending``
and ``--max-streams`` above the robot count, so a queue limit is not what is measured.

Goal (2 cores): 128 robots, 0 late replies, in 3 of 3 runs started at a load average below 0.5.

Defaults: 128 robots, 30 s, 3 runs (about 5 minutes with the waits); ``make bench`` runs it with
``--seconds 10 --runs 1``.
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


def run(robots: int = 128, seconds: float = 30.0, runs: int = 3, isolation: str = ServerConfig.isolation) -> dict:
    """Serve ``robots`` robots at 10 req/s, ``runs`` times for ``seconds`` each; print and return the figures.

    :param isolation: the worker's ``--isolation`` (``process``, seq serve's default, or ``none``).
    """
    figures = []
    with tempfile.TemporaryDirectory() as tmp:
        policy = Path(tmp) / 'zero3' / 'policy.py'
        policy.parent.mkdir()
        policy.write_text(POLICY)
        limit = str(max(64, 2 * robots))
        with Worker(policy, args=('--max-pending', limit, '--max-streams', limit, '--isolation', isolation)) as worker:
            print(f'--isolation {isolation}')
            print(f'{"run":>3} {"robots":>6} {"req/s":>7} {"p50 ms":>7} {"p99 ms":>7} {"late":>6} '
                  f'{"load before":>11} {"load after":>10}')
            for k in range(1, runs + 1):
                before = wait_for_quiet(QUIET_LOAD, QUIET_WAIT_S)   # the last run's own load decays first
                fig = drive(worker, robots, seconds, NAMES)
                fig.update(run=k, load_before=before, load_after=os.getloadavg()[0], quiet=before < QUIET_LOAD)
                figures.append(fig)
                print(f'{k:>3} {robots:>6} {fig["rate"]:>7.1f} {fig["p50"]:>7.1f} {fig["p99"]:>7.1f} {fig["late"]:>6} '
                      f'{before:>11.2f} {fig["load_after"]:>10.2f}' + ('' if fig['quiet'] else '  (not quiet)')
                      + (f'  errors: {fig["errors"]}' if fig['errors'] else ''), flush=True)
                time.sleep(1.0)
    held = sum(1 for f in figures if f['late'] == 0 and not f['errors'])
    quiet = sum(1 for f in figures if f['quiet'])
    print(f'{robots} robots with 0 late replies in {held} of {runs} runs ({quiet} started at load < {QUIET_LOAD}); '
          f'goal: 128 robots, 0 late, 3 of 3 quiet runs on 2 cores ({os.cpu_count()} cores here)', flush=True)
    return {'robots': robots, 'seconds': seconds, 'runs': figures, 'held': held, 'quiet_runs': quiet,
            'isolation': isolation}


def main(argv: list[str] | None = None) -> dict:
    """``make bench``'s short form (one 10 s run of 128 robots), or the full one by its options."""
    parser = argparse.ArgumentParser(prog='python -m sequence_ai_ros.bench.bench_scale')
    parser.add_argument('--robots', type=int, default=128)
    parser.add_argument('--seconds', type=float, default=10.0, help='per run (the README figure: 30)')
    parser.add_argument('--runs', type=int, default=1, help='runs (the README figure: 3)')
    parser.add_argument('--isolation', choices=ISOLATION_MODES, default=ServerConfig.isolation,
                        help=f"the worker's --isolation (default: {ServerConfig.isolation}, as seq serve's)")
    args = parser.parse_args([] if argv is None else argv)
    return run(args.robots, args.seconds, args.runs, args.isolation)


if __name__ == '__main__':
    import sys

    main(sys.argv[1:])
