"""``seq``: the command line. It only parses arguments and delegates.

Each subpackage registers its own sub-commands through an ``add_parsers(subparsers)`` function that
sets ``func`` on its parsers; ``func(args)`` returns the process exit code:

- :mod:`sequence_ai_ros.cli.serving`: init, deploy, serve, deployments, delete, usage, train.
- :mod:`sequence_ai_ros.cli.field_data`: ``policy capture``, ``policy data export``, ``data to-rosbag``.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from sequence_ai_ros.exceptions import SequenceAIError

_COMMAND_MODULES = ('sequence_ai_ros.cli.serving', 'sequence_ai_ros.cli.field_data')


def build_parser() -> argparse.ArgumentParser:
    """Return the ``seq`` argument parser with every sub-command registered."""
    parser = argparse.ArgumentParser(prog='seq', description='sequence_ai: serve action-chunking '
                                     'policies to robots, capture field data, export datasets.')
    sub = parser.add_subparsers(dest='command', metavar='COMMAND', required=True)
    groups: dict[str, argparse._SubParsersAction] = {}
    for name in _COMMAND_MODULES:
        module = importlib.import_module(name)
        module.add_parsers(sub, groups)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``seq`` console script; returns the exit code."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except SequenceAIError as exc:
        print(f'seq {args.command}: error: {exc}', file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == '__main__':
    sys.exit(main())
