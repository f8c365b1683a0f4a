"""``python -m sequence_ai_ros.demo``: what ``make demo`` runs."""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

from sequence_ai_ros.demo.pipeline import DemoArgs, run
from sequence_ai_ros.demo.summary import format_summary


def main(argv: list[str] | None = None) -> int:
    """Run the demo; exit code 0 only if every step succeeded."""
    parser = argparse.ArgumentParser(prog='make demo', description=__doc__)
    parser.add_argument('--dataset', type=Path, default=Path('../shared/data/g1_pick_bottle_v21'),
                        help='LeRobot v2.1 dataset (make demo DATASET=...)')
    parser.add_argument('--out', type=Path, default=Path('out'))
    parser.add_argument('--train-episodes', default='0-4')
    parser.add_argument('--episode', type=int, default=5, help='held-out episode to replay')
    parser.add_argument('--max-seconds', type=float, default=None, help='replay at most this long (s)')
    args = parser.parse_args(argv)

    def stop(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt(signal.Signals(signum).name)

    # kill, timeout and a CI cancel send SIGTERM/SIGHUP: unwind as for Ctrl-C, so every child is stopped
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, stop)
    given: Path = args.dataset
    dataset: Path | None = given
    if not (given / 'meta' / 'info.json').exists():
        print(f'No LeRobot v2.1 dataset at {given}. Point the demo at one with\n'
              '    make demo DATASET=/path/to/lerobot_v2.1_dataset\n'
              'Running the full loop now on the `hold` template with a synthetic robot instead.', flush=True)
        dataset = None
    try:
        summary = run(DemoArgs(dataset=dataset, out=args.out, train_episodes=args.train_episodes,
                               episode=args.episode, max_seconds=args.max_seconds))
    except KeyboardInterrupt:
        print('\ndemo interrupted: every process was stopped, the arm was left holding.', file=sys.stderr)
        return 130
    except Exception as exc:
        # every failure names its cause: an exception without a message still says what it is
        cause = str(exc) or f'{type(exc).__name__} (no message)'
        print(f'\ndemo FAILED: {cause}', file=sys.stderr)
        return 1
    print(format_summary(summary))
    print(f'\nsummary written to {args.out / "summary.json"}')
    ok = summary['reason'] in ('completed', 'timeout') and summary['label_ok']
    return 0 if ok else 1


if __name__ == '__main__':
    sys.exit(main())
