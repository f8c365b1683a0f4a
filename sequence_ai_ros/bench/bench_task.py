"""Task-level benchmark: drawer-open solved by a served LeRobot ACT against link delay.

The same loop as ``make check-sim`` (test/sim_check/check_sim.py: ``sim_robot`` <-> ``policy_node`` <->
delay proxy <-> ``seq serve``), smaller: ``BENCH_TASK_SEEDS`` held-out seeds (default 10) at round trips of
0, 0.5 and 0.8 of the chunk's duration (0, 125, 200 ms), plus the checkpoint in-process with no delay. It
reports success and median / p90 time to success (from the first commanded action), underruns and the
load average per delay, so that a change to the chunk engine shows as task success and time.

It uses only what ``make check-sim`` cached (the LeRobot venv, the demos and the trained checkpoint under
``LEROBOT_CACHE``, default ~/.cache/sequence_ai) and skips, saying why, when any is absent or when the
clone's test/sim_check is not there (an installed package). Bounded: about 2 minutes.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / 'test' / 'sim_check' / 'check_sim.py'
REQUIREMENTS = REPO / 'requirements-lerobot.txt'


def lerobot_venv(cache: Path) -> Path:
    """The venv test/lerobot_check/ensure_venv.sh builds: ``<cache>/lerobot-<sha256(requirements)[:16]>``."""
    return cache / f'lerobot-{hashlib.sha256(REQUIREMENTS.read_bytes()).hexdigest()[:16]}'


def main() -> dict[str, Any]:
    """Print the task table and return it (``{'rows': {...}}``), or ``{'skipped': why}``."""
    if not SCRIPT.is_file() or not REQUIREMENTS.is_file():
        print(f'task: skipped: {SCRIPT} is not in this tree (run from a clone)')
        return {'skipped': 'test/sim_check is not in this tree'}
    cache = Path(os.environ.get('LEROBOT_CACHE') or Path.home() / '.cache' / 'sequence_ai')
    venv = lerobot_venv(cache)
    if not (venv / '.stamp').is_file():
        print(f'task: skipped: no LeRobot venv at {venv} (make check-sim builds it)')
        return {'skipped': f'no LeRobot venv at {venv}'}
    seeds = max(1, int(os.environ.get('BENCH_TASK_SEEDS', '10')))
    with tempfile.TemporaryDirectory(prefix='bench-task-') as tmp:
        out = Path(tmp) / 'out'
        done = subprocess.run([sys.executable, str(SCRIPT), '--venv', str(venv), '--cache', str(cache), '--out',
                               str(out), '--seeds', str(seeds), '--ablation-seeds', '0', '--cached-only',
                               '--no-judge'], capture_output=True, text=True, timeout=1800)
        if done.returncode == 3:
            reason = (done.stdout.strip().splitlines() or ['skipped'])[-1].replace('check-sim: SKIPPED: ', '')
            print(f'task: skipped: {reason}')
            return {'skipped': reason}
        summary = out / 'summary.json'
        if not summary.is_file():
            raise RuntimeError(f'check_sim.py exited {done.returncode}: {done.stdout[-2000:]} {done.stderr[-2000:]}')
        result = json.loads(summary.read_text())
        text = (out / 'summary.txt').read_text()
    print(text, flush=True)
    if result['failures']:
        raise RuntimeError('; '.join(result['failures']))
    return {'seeds': seeds, 'rows': result['rows'], 'total_s': result['total_s']}


if __name__ == '__main__':
    main()
