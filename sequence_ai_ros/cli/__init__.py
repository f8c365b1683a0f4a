"""``seq``: the command line. It only parses arguments and delegates.

Each subpackage registers its own sub-commands through an ``add_parsers(subparsers)`` function that
sets ``func`` on its parsers; ``func(args)`` returns the process exit code:

- :mod:`sequence_ai_ros.cli.serving`: init, deploy, serve, deployments, delete, usage, train.
- :mod:`sequence_ai_ros.cli.field_data`: ``policy capture``, ``policy data export``, ``data to-rosbag``.
- :mod:`sequence_ai_ros.cli.admin`: ``admin`` (a replica's admin API).

A call in coreutils seq's style (``seq 60``, ``seq -s, 1 3``) is handed over to the system's ``seq``
(:mod:`sequence_ai_ros.cli.coreutils`), so that scripts on a robot where this ``seq`` comes first on PATH
keep working.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

from sequence_ai_ros.exceptions import SequenceAIError

_COMMAND_MODULES = ('sequence_ai_ros.cli.serving', 'sequence_ai_ros.cli.field_data', 'sequence_ai_ros.cli.admin')


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
    """Entry point of the ``seq`` console script; returns the exit code.

    :param argv: the arguments; None: the process's own, and then a coreutils-style call (``seq 60``) is
        handed over to the system's ``seq``, which replaces this process (1 when there is none).
    """
    if argv is None:
        from sequence_ai_ros.cli import coreutils

        if coreutils.is_coreutils_call(sys.argv[1:]):
            return coreutils.hand_over(sys.argv[1:])
    args = build_parser().parse_args(argv)
    try:
        code = int(args.func(args) or 0)
        sys.stdout.flush()   # a closed pipe shows here, not in the interpreter's exit flush
        return code
    except SequenceAIError as exc:
        print(f'seq {args.command}: error: {exc}', file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return _broken_pipe()


def _broken_pipe() -> int:
    """The reader of stdout went away (``seq ... | head -1``): exit quietly with 141 (128 + SIGPIPE).

    stdout is pointed at /dev/null so that the interpreter's last flush cannot raise again (Python's
    documented recipe, ``signal`` module notes on SIGPIPE).
    """
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):   # stdout without a file descriptor (captured): nothing to redirect
        pass
    return 141


if __name__ == '__main__':
    sys.exit(main())
