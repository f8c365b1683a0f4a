"""A LeRobot 0.6 Robot driven by ``connect().run()`` through sequence_ai_ros.adapters.lerobot_robot.

Run by ``make check-lerobot`` with the LeRobot venv's python (sequence_ai_ros pip-installed there)::

    python test/lerobot_check/check_robot_adapter.py

1. importing the adapter loads no torch (it imports nothing from LeRobot);
2. ``seq init hold arm`` with the example's motor names, ``seq deploy``, ``seq serve --port 0``;
3. ``examples/lerobot_robot.py arm`` (a ``lerobot.robots.Robot`` subclass) runs 3 s against it: the episode
   ends ``timeout`` with actions executed, and the hold policy leaves every motor where it started.

Prints one line and exits 0 when all hold; the failing step is printed otherwise.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MOTORS = ('shoulder_pan', 'shoulder_lift', 'elbow_flex', 'wrist_flex', 'wrist_roll', 'gripper')


def fail(text: str) -> int:
    print(f'check_robot_adapter: FAILED: {text}')
    return 1


def main() -> int:
    seq = [sys.executable, '-m', 'sequence_ai_ros.cli']
    probe = subprocess.run([sys.executable, '-c', 'import sys, sequence_ai_ros.adapters.lerobot_robot; '
                            'print("torch" in sys.modules)'], capture_output=True, text=True, timeout=120)
    if probe.stdout.strip() != 'False':
        return fail(f'importing the adapter loaded torch (or failed): {probe.stdout} {probe.stderr}')
    with tempfile.TemporaryDirectory(prefix='seq-robot-adapter-') as tmp:
        env = dict(os.environ, SEQ_HOME=str(Path(tmp) / 'home'))
        for argv in (['init', 'hold', 'arm'], None, ['deploy', 'arm/policy.py']):
            if argv is None:       # the hold policy's joints are the arm's motors
                config = Path(tmp) / 'arm' / 'config.yaml'
                config.write_text(config.read_text().replace('joint_names: []', f'joint_names: {list(MOTORS)}'))
                continue
            done = subprocess.run([*seq, *argv], cwd=tmp, env=env, capture_output=True, text=True, timeout=300)
            if done.returncode:
                return fail(f'seq {" ".join(argv)}: {done.stdout} {done.stderr}')
        server = subprocess.Popen([*seq, 'serve', 'arm', '--port', '0'], cwd=tmp, env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
        try:
            match = re.match(r'serving arm on (127\.0\.0\.1:\d+)', server.stdout.readline())
            if not match:
                return fail(f'seq serve did not start: {server.stderr.read() if server.poll() is not None else ""}')
            run = subprocess.run([sys.executable, str(REPO / 'examples' / 'lerobot_robot.py'), 'arm'],
                                 env=dict(env, SEQ_ENDPOINT=match.group(1)), capture_output=True, text=True,
                                 timeout=300)
        finally:
            server.terminate()
            try:
                server.wait(timeout=15)
            except subprocess.TimeoutExpired:
                server.kill()
    out = run.stdout
    outcome = re.search(r'RunOutcome\((\d+) actions over (\d+) chunks in [\d.]+s, (\w+)', out)
    if run.returncode or not outcome:
        return fail(f'examples/lerobot_robot.py exited {run.returncode}: {out} {run.stderr[-2000:]}')
    if outcome.group(3) != 'timeout' or int(outcome.group(1)) < 1:
        return fail(f'the episode ended {outcome.group(3)} after {outcome.group(1)} actions: {out}')
    pose = ast.literal_eval(re.search(r'pose (\{.*\})', out).group(1))
    start = {f'{m}.pos': 10.0 * i for i, m in enumerate(MOTORS)}
    if pose != start:
        return fail(f'the hold policy moved the arm: {pose} (started at {start})')
    print(f'check_robot_adapter: a LeRobot Robot through connect().run(): {outcome.group(1)} actions over '
          f'{outcome.group(2)} chunks, reason timeout, every motor held; no torch imported by the adapter')
    return 0


if __name__ == '__main__':
    raise SystemExit(main())
