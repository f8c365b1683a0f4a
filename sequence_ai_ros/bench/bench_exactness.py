"""The exactness table of captured field data (``python -m sequence_ai_ros.bench exactness``).

Real recordings (../shared/data, or $SEQ_DATA_DIR) replayed through a real worker with capture on, driven by
``Policy.act``, ``Policy.run`` and a self-paced ``Policy.next_action`` loop (ticks stamped with their
deadlines; ``next_action_clock``: with the clock when they run) at 1x, 2x and 2.5x the policy rate,
exported as LeRobot v2.1 and read back (:mod:`.exactness` has the sources, the robot and the truth):
joint_delta and ee_delta from the WidowX-200 bag at dt 0.2 s (5, 10, 12.5 Hz control), joint_absolute
from the G1 dataset at dt 1/30 s (30, 60, 75 Hz). Per action space x driver x rate it prints:

- ``exact``: episodes whose rows are all right (count and values within 1e-5, state within 1e-6);
- ``rows ok``: episodes with exactly one row per step executed and no held row (but where no tick started
  in the row's step);
- ``rows/steps``: the row counts seen against the steps executed;
- ``path err``: max abs difference (any row, any channel) between the cumulative sum of the rows' rate
  channels and the robot's commanded path at each row's end (delta spaces);
- ``pos err``: the same against the command in effect at each row's start, for position channels
  (absolute spaces, ee_delta's last channel); ``state err``: against the observation of that tick;
- ``client err``: the robot's executed increments against the recorded ones (0 means the client executed
  the recording exactly, so any error above is the capture's or the export's).

A correctness table, not a speed figure; it takes about 3.5 s an episode (the episodes run in real time).
``BENCH_EXACTNESS_EPISODES`` (default 4, at most 6) sets the episodes per case.

``--disturbed`` (``python -m sequence_ai_ros.bench exactness --disturbed``) prints the disturbed table instead:
the same replays, longer (30 WidowX steps, 90 G1 frames), under each of :data:`~.exactness.DISTURBANCES` (a
latency-shaped worker: the policy sleeps a seeded 0.5-1.2 chunk durations per call; ``seam``: it answers when the
playing chunk runs out, +-0.25 step, for late seams; an overrunning act(): 1 call in 8 takes 1.5-2.5 periods),
driven by act, run and next_action at 1x, 2x and 2.5x. Held rows are allowed
where the robot held (:func:`~.exactness.disturbed_score`). Per action space x driver x rate x disturbance:

- ``exact``: episodes whose rows are all right; ``off``: episodes whose rows not held are not one per step
  executed, or that hold more rows than ticks held or periods skipped, or whose reported steps are not the
  robot's (a tick's increments dropped);
- ``rows``: the rows exported (held included); ``not held/steps``: the rows not held against the steps
  executed; ``held``: held rows, all episodes; ``robot``: episodes whose robot ran other steps than reported;
- ``underruns``, ``skipped``: dry spells and control periods skipped (overruns), all episodes;
- ``path err``, ``pos err``, ``state err``, ``client err``: as above, over the rows not held;
- ``n/a``: episodes not scored (an absolute next_action loop across a dry spell follows the clock).

``BENCH_DISTURBED_EPISODES`` (default 2, at most 6) sets its episodes per case (about 10 s each);
``BENCH_DISTURBANCES`` (comma-separated names, default all) the disturbances.
"""

from __future__ import annotations

import math
import os
import tempfile
from fractions import Fraction
from pathlib import Path
from typing import Any

from sequence_ai_ros.bench import exactness as ex


def _err(x: float) -> str:
    return 'n/a' if math.isinf(x) else f'{x:.2g}'


def _disturbance(d: ex.Disturbance) -> str:
    parts = []
    if d.aim_seam:
        parts.append(f'policy answers when the playing chunk runs out +-{d.aim_seam:g} step')
    if d.latency is not None:
        parts.append(f'policy sleeps U({d.latency[0]:g}, {d.latency[1]:g}) chunk durations a call'
                     + (' without a tail' if d.aim_seam else ''))
    if d.overrun:
        lo, hi = d.overrun_by
        parts.append(f'{d.overrun:g} of act() calls take {1 + lo:g}-{1 + hi:g} periods')
    return ', '.join(parts) + f' (seed {d.seed})'


def _rate(m: Fraction) -> str:
    return f'{float(m):g}x'


def run_table(episodes: int = 4) -> list[dict[str, Any]]:
    """Run every case with ``episodes`` episodes; return one dict per case (see the module docstring)."""
    out = []
    with tempfile.TemporaryDirectory(prefix='seq-exact-') as tmp:
        root = Path(tmp)
        for space in ex.SPACES:
            if space == 'joint_absolute':
                source, starts, steps = ex.g1_source(), ex.G1_STARTS, ex.G1_STEPS
            else:
                source, starts, steps = ex.wx200_source(space, root), ex.WX_STARTS, ex.WX_STEPS
            for driver in ex.TABLE_DRIVERS:
                for m in ex.MULTIPLES:
                    work = root / f'{space}-{driver}-{float(m):g}'
                    work.mkdir()
                    scores = [ex.score(e) for e in ex.replay(source, driver, m, starts[:episodes], steps, work)]
                    case = {'space': space, 'driver': driver, 'multiple': float(m),
                            'control_hz': round(float(m) / source.dt, 3), 'episodes': len(scores),
                            'rows_ok': sum(s.count_ok for s in scores), 'exact': sum(s.exact for s in scores),
                            'rows': sorted({s.rows for s in scores}), 'steps': sorted({s.steps for s in scores}),
                            'held': sum(s.held for s in scores), 'underruns': sum(s.underruns for s in scores),
                            'path_err': max(s.path_err for s in scores) if source.rate_dims else None,
                            'pos_err': (max(s.position_err for s in scores)
                                        if len(source.config['names']) > source.rate_dims else None),
                            'state_err': max(s.state_err for s in scores),
                            'client_err': max(s.client_err for s in scores),
                            'skipped': [s.skipped for s in scores if s.skipped]}
                    print(_line(case), flush=True)
                    out.append(case)
    return out


HEADER = (f'{"space":<15}{"driver":<19}{"rate":<14}{"episodes":>8}{"exact":>7}{"rows ok":>9}{"rows/steps":>13}'
          f'{"path err":>10}{"pos err":>10}{"state err":>11}{"client err":>12}{"underruns":>11}')


def _line(c: dict[str, Any]) -> str:
    lo, hi = c['rows'][0], c['rows'][-1]
    rows = str(lo) if lo == hi else f'{lo}-{hi}'
    steps = '/'.join(str(s) for s in c['steps'])
    rate = f'{_rate(Fraction(c["multiple"]))} ({c["control_hz"]:g} Hz)'
    path = '-' if c['path_err'] is None else _err(c['path_err'])
    pos = '-' if c['pos_err'] is None else _err(c['pos_err'])
    return (f'{c["space"]:<15}{c["driver"]:<19}{rate:<14}{c["episodes"]:>8}{c["exact"]:>5}/{c["episodes"]:<1}'
            f'{c["rows_ok"]:>7}/{c["episodes"]:<1}'
            f'{rows + "/" + steps:>13}{path:>10}{pos:>10}{_err(c["state_err"]):>11}{_err(c["client_err"]):>12}'
            f'{c["underruns"]:>11}')


def _span(values: list[int] | list[float]) -> str:
    lo, hi = min(values, default=0), max(values, default=0)
    return f'{lo:g}' if lo == hi else f'{lo:g}-{hi:g}'


def run_disturbed(episodes: int = 2, spaces: tuple[str, ...] = ex.SPACES, drivers: tuple[str, ...] = ex.DRIVERS,
                  multiples: tuple[Fraction, ...] = ex.MULTIPLES,
                  disturbances: tuple[ex.Disturbance, ...] = ex.DISTURBANCES) -> list[dict[str, Any]]:
    """Run every disturbed case with ``episodes`` episodes; return one dict per case (see the module docstring)."""
    out = []
    with tempfile.TemporaryDirectory(prefix='seq-disturbed-') as tmp:
        root = Path(tmp)
        for space in spaces:
            if space == 'joint_absolute':
                source, starts, steps = ex.g1_source(), ex.G1_STARTS, ex.G1_DISTURBED_STEPS
            else:
                source, starts, steps = ex.wx200_source(space, root), ex.WX_DISTURBED_STARTS, ex.WX_DISTURBED_STEPS
            for driver in drivers:
                for m in multiples:
                    for dist in disturbances:
                        work = root / f'{space}-{driver}-{float(m):g}-{dist.name}'
                        work.mkdir()
                        eps = ex.replay(source, driver, m, starts[:episodes], steps, work, disturbance=dist)
                        case = disturbed_case(space, driver, m, dist.name, source, [ex.disturbed_score(e) for e in eps])
                        print(_disturbed_line(case), flush=True)
                        out.append(case)
    return out


def disturbed_case(space: str, driver: str, m: Fraction, disturbance: str, source: ex.Source,
                   scores: list[ex.DisturbedScore]) -> dict[str, Any]:
    """One row of the disturbed table from its episodes' scores."""
    scored = [s for s in scores if not s.skipped]

    def worst(attr: str) -> float | None:
        return max((getattr(s, attr) for s in scored), default=math.inf)

    return {'space': space, 'driver': driver, 'multiple': float(m), 'control_hz': round(float(m) / source.dt, 3),
            'disturbance': disturbance, 'episodes': len(scores), 'scored': len(scored),
            'exact': sum(s.exact for s in scored), 'off': sum(not s.count_ok for s in scored),
            'rows': [s.rows for s in scores], 'not_held': [s.rows - s.held for s in scored],
            'steps': [s.steps for s in scores], 'robot_steps': [s.robot_steps for s in scores],
            'robot_off': sum(not s.steps_ok for s in scores), 'held': sum(s.held for s in scored),
            'underruns': sum(s.underruns for s in scores), 'periods_skipped': sum(s.periods_skipped for s in scores),
            'path_err': worst('path_err') if source.rate_dims else None,
            'pos_err': worst('position_err') if len(source.config['names']) > source.rate_dims else None,
            'state_err': worst('state_err'), 'client_err': worst('client_err'),
            'skipped': [s.skipped for s in scores if s.skipped]}


DISTURBED_HEADER = (f'{"space":<15}{"driver":<12}{"rate":<16}{"disturbance":<12}{"episodes":>8}{"exact":>7}'
                    f'{"off":>5}{"rows":>8}{"not held/steps":>16}{"held":>6}{"robot":>6}{"underruns":>10}'
                    f'{"skipped":>8}{"path err":>10}{"pos err":>9}{"state err":>10}{"client err":>11}{"n/a":>5}')


def _disturbed_line(c: dict[str, Any]) -> str:
    rate = f'{_rate(Fraction(c["multiple"]))} ({c["control_hz"]:g} Hz)'
    path = '-' if c['path_err'] is None else _err(c['path_err'])
    pos = '-' if c['pos_err'] is None else _err(c['pos_err'])
    counts = f'{_span(c["not_held"])}/{_span(c["steps"])}' if c['scored'] else f'-/{_span(c["steps"])}'
    return (f'{c["space"]:<15}{c["driver"]:<12}{rate:<16}{c["disturbance"]:<12}{c["episodes"]:>8}'
            f'{c["exact"]:>5}/{c["scored"]:<1}{c["off"]:>5}{_span(c["rows"]):>8}{counts:>16}{c["held"]:>6}'
            f'{c["robot_off"]:>6}{c["underruns"]:>10}{c["periods_skipped"]:>8}{path:>10}{pos:>9}'
            f'{_err(c["state_err"]):>10}{_err(c["client_err"]):>11}{c["episodes"] - c["scored"]:>5}')


def main(disturbed: bool = False) -> dict[str, Any]:
    """Print the exactness table (``disturbed``: the disturbed one) and return it; skips without the real data."""
    missing = [p for p in (ex.WX200_BAG / 'metadata.yaml', ex.G1_DATASET / 'meta' / 'info.json') if not p.exists()]
    if missing:
        print(f'exactness: real data not found ({", ".join(map(str, missing))}); set SEQ_DATA_DIR')
        return {'skipped': f'no real data at {ex.DATA}'}
    if disturbed:
        episodes = max(1, min(6, int(os.environ.get('BENCH_DISTURBED_EPISODES', '2'))))
        names = [n for n in os.environ.get('BENCH_DISTURBANCES', '').split(',') if n]
        chosen = tuple(d for d in ex.DISTURBANCES if not names or d.name in names)
        print(f'exactness of captured rows under disturbance, LeRobot v2.1 export read back; {episodes} episodes '
              f'per case; ' + '; '.join(f'{d.name}: {_disturbance(d)}' for d in chosen))
        print(DISTURBED_HEADER, flush=True)
        return {'episodes_per_case': episodes, 'disturbed': run_disturbed(episodes, disturbances=chosen)}
    episodes = max(1, min(6, int(os.environ.get('BENCH_EXACTNESS_EPISODES', '4'))))
    print(f'exactness of captured rows, LeRobot v2.1 export read back; {episodes} episodes per case')
    print(HEADER, flush=True)
    cases = run_table(episodes)
    return {'episodes_per_case': episodes, 'cases': cases}


if __name__ == '__main__':
    main()
