"""Run the benchmarks: ``python -m sequence_ai_ros.bench [worker client node export exactness ...]``."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import sys
import time
from pathlib import Path

BENCHES = ('worker', 'client', 'max_seconds', 'pipeline', 'wire', 'node', 'trajectory', 'export', 'batching',
           'transport', 'scale', 'exactness', 'task', 'isolation', 'admission', 'tracing')


def main(argv: list[str] | None = None) -> int:
    """Run the named benchmarks (all by default); return 1 if any of them failed to run."""
    parser = argparse.ArgumentParser(prog='python -m sequence_ai_ros.bench')
    parser.add_argument('names', nargs='*', metavar='NAME', help=f'any of {", ".join(BENCHES)} (default: all)')
    parser.add_argument('--out', type=Path, default=Path('out/bench.json'))
    parser.add_argument('--disturbed', action='store_true',
                        help='exactness: the disturbed table (a latency-shaped worker, an overrunning act())')
    args = parser.parse_args(argv)
    unknown = sorted(set(args.names) - set(BENCHES))
    if unknown:
        parser.error(f'unknown benchmarks {unknown}; choose from {BENCHES}')
    machine = {'cores': os.cpu_count(), 'python': platform.python_version(), 'machine': platform.machine(),
               'date': time.strftime('%Y-%m-%d %H:%M:%S')}
    print(f"benchmarks on {machine['cores']} cores, Python {machine['python']} ({machine['machine']})", flush=True)
    results: dict = {'machine': machine}
    failed = False
    names = [_key(name, args.disturbed) for name in args.names or BENCHES]
    for name in args.names or BENCHES:
        key = _key(name, args.disturbed)
        print(f'\n== {key} ==', flush=True)
        try:
            module = importlib.import_module(f'sequence_ai_ros.bench.bench_{name}')
            results[key] = module.main(disturbed=True) if key != name else module.main()
        except Exception as exc:  # report and go on: one broken bench must not hide the others
            failed = True
            results[key] = {'error': f'{type(exc).__name__}: {exc}'}
            print(f'{key}: FAILED: {exc}', file=sys.stderr, flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.names and args.out.is_file():
        # a partial run replaces its own entries and keeps the others' (each entry says when it ran)
        try:
            kept = json.loads(args.out.read_text())
        except ValueError:
            kept = {}
        if isinstance(kept, dict):
            results = {**kept, **results}
    for name in names:
        if isinstance(results.get(name), dict):
            results[name]['ran'] = machine['date']
    args.out.write_text(json.dumps(results, indent=2, default=str))
    print(f'\nwrote {args.out}')
    return 1 if failed else 0


def _key(name: str, disturbed: bool) -> str:
    """The results entry of bench ``name``: ``exactness_disturbed`` for the disturbed exactness table."""
    return f'{name}_disturbed' if disturbed and name == 'exactness' else name


if __name__ == '__main__':
    sys.exit(main())
