"""Hand coreutils-style calls of ``seq`` over to the system's ``seq`` (coreutils), so shell scripts keep working.

This package's command line is named ``seq``, like coreutils' number printer that robot bring-up scripts use
(``for i in $(seq 60)``). Where this ``seq`` comes first on PATH (the development shell, a system-wide
``pip install``), a call that can only be meant for coreutils is handed over: the process is replaced
(``os.execv``) by the first ``seq`` on PATH that is not this program, else ``/usr/bin/seq`` or ``/bin/seq``,
with the same arguments, so its output, errors and exit status are coreutils' own.

A call is coreutils-style, and never one of ours, when its first argument is

- a number (``1``, ``-3``, ``0.5``, ``1e3``, ``0x10``): no sub-command of ours is a number; or
- one of coreutils seq's options, ``-f FORMAT``/``--format=FORMAT``, ``-s STRING``/``--separator=STRING``,
  ``-w``/``--equal-width`` (also clustered, ``-ws,``, or abbreviated, ``--sep=,``), and the options, parsed as
  coreutils parses them, are followed by a number.

``--help`` and ``--version`` stay ours (``seq --help`` is this program's help), as does everything else.
``python -m sequence_ai_ros.cli`` is the unambiguous name of this program. Only the standard library is
imported here: ``$(seq 60)`` must not pay for more.
"""

from __future__ import annotations

import os
import re
import signal
import sys
from collections.abc import Sequence

#: Where coreutils' seq is looked for after PATH.
FALLBACKS: tuple[str, ...] = ('/usr/bin/seq', '/bin/seq')
#: Set in the environment of the handed-over process: finding this program again there is a loop, refused.
GUARD = 'SEQ_COREUTILS_HANDOVER'

_NUMBER = re.compile(r'[+-]?(?:(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?'
                     r'|0[xX](?:[0-9a-fA-F]+\.?[0-9a-fA-F]*|\.[0-9a-fA-F]+)(?:[pP][+-]?\d+)?)')
#: coreutils seq's long options: (name, takes an argument). getopt_long takes any unambiguous prefix.
_LONG = (('format', True), ('separator', True), ('equal-width', False), ('help', False), ('version', False))
#: Marks of this program in a script's first bytes (a console script, or a wrapper calling the module).
_OURS = (b'sequence_ai_ros', b'sequence-ai-ros')


def is_number(arg: str) -> bool:
    """True for a decimal or hexadecimal number as coreutils seq reads one (``1``, ``-3``, ``0.5``, ``1e3``)."""
    return _NUMBER.fullmatch(arg) is not None


def _long_option(arg: str) -> tuple[str, bool, bool] | None:
    """``(name, takes_argument, argument_attached)`` of ``--name[=value]``, prefixes resolved; None if unknown."""
    name, eq, _ = arg[2:].partition('=')
    matches = [(n, takes) for n, takes in _LONG if n.startswith(name)] if name else []
    exact = [m for m in matches if m[0] == name]
    if len(exact) == 1 or len(matches) == 1:
        n, takes = (exact or matches)[0]
        return n, takes, bool(eq)
    return None


def is_coreutils_call(argv: Sequence[str]) -> bool:
    """True when ``argv`` (without the program name) can only be a call of coreutils seq (module docstring).

    Options are parsed as coreutils seq parses them (getopt ``+f:s:w`` and its long options): an argument
    that starts with ``-`` and a digit or ``.`` is a negative number and ends the options, as does ``--``.
    """
    if not argv:
        return False
    if is_number(argv[0]):
        return True
    i = 0
    seen_option = False
    while i < len(argv):
        arg = argv[i]
        if arg == '--':                             # the end of the options: operands follow
            return i + 1 < len(argv) and is_number(argv[i + 1])
        if not arg.startswith('-') or arg == '-' or (len(arg) > 1 and (arg[1] == '.' or arg[1].isdigit())):
            break                                   # the first operand
        if arg.startswith('--'):
            option = _long_option(arg)
            if option is None or option[0] in ('help', 'version'):
                return False                        # not seq's, or ours to answer
            name, takes, attached = option
            if name == 'equal-width' and attached:
                return False                        # getopt refuses an argument there
            i += 2 if takes and not attached else 1
        else:
            cluster = arg[1:]
            for k, letter in enumerate(cluster):
                if letter == 'w':
                    continue
                if letter in 'fs':
                    i += 0 if cluster[k + 1:] else 1   # the rest of the cluster, else the next argument
                    break
                return False                        # an option coreutils seq does not have
            i += 1
        seen_option = True
    return seen_option and i < len(argv) and is_number(argv[i])


def _is_this_program(path: str) -> bool:
    """True when ``path`` is this program: the running script, or a script of this package (any copy)."""
    try:
        if sys.argv and os.path.samefile(path, sys.argv[0]):
            return True
    except OSError:         # argv[0] names no file ('-c'), or path went away: read it
        pass
    try:
        with open(path, 'rb') as f:
            head = f.read(4096)
    except OSError:
        return False
    return head.startswith(b'#!') and any(mark in head for mark in _OURS)


def find_coreutils_seq(path_env: str | None = None, fallbacks: Sequence[str] | None = None) -> str | None:
    """The system's ``seq``: the first on ``path_env`` (default $PATH) that is not this program, else a fallback.

    :param fallbacks: tried after PATH, in order (default :data:`FALLBACKS`).
    :returns: its path, or None when there is none (no executable file that is not this program).
    """
    path_env = os.environ.get('PATH', '') if path_env is None else path_env
    fallbacks = FALLBACKS if fallbacks is None else fallbacks
    candidates = [os.path.join(d, 'seq') for d in path_env.split(os.pathsep) if d] + list(fallbacks)
    for path in candidates:
        if os.path.isfile(path) and os.access(path, os.X_OK) and not _is_this_program(path):
            return path
    return None


def hand_over(argv: Sequence[str]) -> int:
    """Replace this process by the system's ``seq`` with ``argv`` (its output and exit status are coreutils').

    :param argv: the arguments, without the program name.
    :returns: only when it cannot hand over: 1, after saying why on stderr (no system ``seq``, or a loop).
    """
    if os.environ.get(GUARD):
        print(f'seq: {sys.argv[0] if sys.argv else "seq"} was reached again when handing a coreutils-style call '
              'over to the system\'s seq; call coreutils by its path (/usr/bin/seq)', file=sys.stderr)
        return 1
    target = find_coreutils_seq()
    if target is None:
        print(f'seq: {" ".join(argv)!r} is a call of coreutils seq (numbers), but no coreutils seq was found on '
              f'PATH, {" or ".join(FALLBACKS)}; install coreutils. This seq is sequence_ai\'s command line '
              '(seq --help; also python -m sequence_ai_ros.cli)', file=sys.stderr)
        return 1
    sys.stdout.flush()
    sys.stderr.flush()
    os.environ[GUARD] = '1'
    # Python ignores SIGPIPE (and SIGXFSZ); an exec keeps that, and `seq 1000000 | head -1` would then end with
    # coreutils' 'write error: Broken pipe' and status 1 instead of dying quietly by SIGPIPE as it does alone
    for name in ('SIGPIPE', 'SIGXFSZ'):
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), signal.SIG_DFL)
    os.execv(target, ['seq', *argv])        # argv[0] 'seq', as a shell passes it: coreutils' messages say seq:
