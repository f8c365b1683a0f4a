"""Run a command beside CPU-bound processes: the test suite's proof that no test depends on an idle machine.

``python test/load/cpu_hogs.py [--hogs 2] [--runs 1] -- make test`` starts ``--hogs`` processes that spin on
the CPU at the command's own priority, runs the command ``--runs`` times while they spin, stops them, and
exits 0 only when every run exited 0. Each run prints its exit status, its wall time and the load average
before and after it (``os.getloadavg``), so a reader sees how loaded the machine was. ``make test-under-load``
runs ``make test`` this way.

The hogs die with this process (``PR_SET_PDEATHSIG`` on Linux, and a ``finally`` everywhere): a run killed by
its caller leaves no spinning process behind.

:raises SystemExit: with 2 when no command follows ``--``.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import subprocess
import sys
import time

#: Linux's prctl option asking the kernel to signal a child when its parent dies.
PR_SET_PDEATHSIG = 1
SPIN = 'while True: pass'


def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL when this script's process ends (Linux; a no-op elsewhere)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def start_hogs(count: int) -> list[subprocess.Popen]:
    """Start ``count`` Python processes that each keep one core busy until stopped."""
    return [subprocess.Popen([sys.executable, '-c', SPIN], preexec_fn=_die_with_parent,
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for _ in range(count)]


def stop_hogs(hogs: list[subprocess.Popen]) -> None:
    """Kill the hogs and reap them."""
    for hog in hogs:
        if hog.poll() is None:
            hog.kill()
    for hog in hogs:
        hog.wait(timeout=10)


def _load() -> str:
    return ' '.join(f'{x:.2f}' for x in os.getloadavg())


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv``, run the command beside the hogs; return 0 when every run passed, else the last failure's code."""
    argv = sys.argv[1:] if argv is None else argv
    if '--' in argv:
        split = argv.index('--')
        own, command = argv[:split], argv[split + 1:]
    else:
        own, command = argv, []
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--hogs', type=int, default=2, help='CPU-bound processes beside the command (default 2)')
    parser.add_argument('--runs', type=int, default=1, help='times to run the command (default 1)')
    args = parser.parse_args(own)
    if not command:
        parser.error('no command: cpu_hogs.py [--hogs N] [--runs N] -- COMMAND ...')
    print(f'cpu_hogs: {args.hogs} CPU-bound processes beside {" ".join(command)!r}, {args.runs} run(s); '
          f'{os.cpu_count()} CPUs, load average {_load()}', flush=True)
    hogs = start_hogs(args.hogs)
    failures, last_failure = 0, 0
    try:
        for run in range(1, args.runs + 1):
            before, start = _load(), time.monotonic()
            code = subprocess.call(command)
            print(f'cpu_hogs: run {run}/{args.runs} exit {code} in {time.monotonic() - start:.0f} s, '
                  f'load average before {before}, after {_load()}', flush=True)
            if code != 0:
                failures, last_failure = failures + 1, code
    finally:
        stop_hogs(hogs)
    print(f'cpu_hogs: {args.runs - failures} of {args.runs} run(s) passed beside {args.hogs} CPU hog(s)', flush=True)
    return last_failure


if __name__ == '__main__':
    sys.exit(main())
