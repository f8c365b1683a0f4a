"""``seq`` hands coreutils-style calls over to the system's ``seq``, so robot scripts (``$(seq 60)``) keep working.

Every call runs as a real process: the installed console script (the one the development shell puts first
on PATH) and ``python -m sequence_ai_ros.cli``, compared byte for byte (stdout, stderr, exit status) with
the system's ``seq`` run directly under the name a shell gives it (``seq``). Our own sub-commands keep
working; without a system ``seq`` the call fails saying so.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from sequence_ai_ros.cli import coreutils

REPO = Path(__file__).resolve().parent.parent
#: The console scripts the development shell may put first on PATH (colcon's install, the venv's).
SCRIPTS = [p for p in (REPO / 'install' / 'sequence_ai_ros' / 'lib' / 'sequence_ai_ros' / 'seq',
                       REPO / '.venv' / 'bin' / 'seq') if p.is_file()]
MODULE = [sys.executable, '-m', 'sequence_ai_ros.cli']
#: The environment of a process started here: this checkout's package first, as in the development shell.
ENV = {**os.environ, 'PYTHONPATH': os.pathsep.join([str(REPO), os.environ.get('PYTHONPATH', '')])}

CALLS = [['3'], ['2', '5'], ['-s,', '1', '3'], ['-w', '8', '10'], ['1', '0.5', '2'], ['-f', '%.1f', '1', '2'],
         ['5', '1'], ['1', 'x'], ['-3', '-1'], ['1e3', '1001'], ['--separator=:', '1', '3'], ['-ws', ' ', '9', '11'],
         ['--format', '%g', '1'], ['--', '1', '2']]


@pytest.fixture(scope='module')
def system_seq() -> str:
    found = coreutils.find_coreutils_seq()
    if found is None:
        pytest.skip('no coreutils seq on PATH, /usr/bin or /bin')
    return found


def _run(argv: list[str], **kw) -> tuple[bytes, bytes, int]:
    done = subprocess.run(argv, capture_output=True, timeout=60, env=kw.pop('env', ENV), **kw)
    return done.stdout, done.stderr, done.returncode


@pytest.mark.parametrize('args', CALLS, ids=[' '.join(c) for c in CALLS])
def test_a_coreutils_call_answers_as_coreutils_seq(args: list[str], system_seq: str) -> None:
    assert not coreutils._is_this_program(system_seq)
    expected = _run(['seq', *args], executable=system_seq)
    if args in (['5', '1'], ['1', 'x']):             # the empty output, and coreutils' own error
        assert expected[:1] == (b'',) and expected[2] == (0 if args == ['5', '1'] else 1), expected
    for program in [[str(s)] for s in SCRIPTS] + [MODULE]:
        assert _run(program + args) == expected, program


def test_a_pipe_closed_early_ends_the_handed_over_seq_as_it_ends_coreutils_seq(system_seq: str) -> None:
    """``seq 1000000 | head -1``: coreutils' seq dies quietly by SIGPIPE; handed over, it must too.

    Python ignores SIGPIPE, and an exec would keep that: a 'write error: Broken pipe' and status 1.
    """
    script = 'set -o pipefail; "$@" 1000000 | head -1; echo "status $?"'
    expected = _run(['bash', '-c', script, 'bash', system_seq])
    assert expected == (b'1\nstatus 141\n', b'', 0), expected
    for program in [[str(s)] for s in SCRIPTS] + [MODULE]:
        assert _run(['bash', '-c', script, 'bash', *program]) == expected, program


def test_a_shell_loop_over_seq_works_with_the_development_shells_path(system_seq: str) -> None:
    if not SCRIPTS:
        pytest.skip('no installed seq console script (colcon build or pip install -e)')
    path = os.pathsep.join([str(s.parent) for s in SCRIPTS] + [os.environ.get('PATH', '')])
    which = _run(['bash', '-c', 'type -P seq'], env={**ENV, 'PATH': path})[0].decode().strip()
    assert which == str(SCRIPTS[0]), which                   # ours comes first, as in the development shell
    out = _run(['bash', '-c', 'for i in $(seq 3); do echo $i; done'], env={**ENV, 'PATH': path})
    assert out == (b'1\n2\n3\n', b'', 0), out


@pytest.mark.parametrize('program', [[str(s)] for s in SCRIPTS] + [MODULE], ids=lambda p: Path(p[-1]).name)
def test_our_sub_commands_and_help_stay_ours(program: list[str], tmp_path: Path) -> None:
    out, err, code = _run(program + ['--help'])
    assert code == 0 and out.startswith(b'usage: seq') and b'COMMAND' in out, (out, err)
    out, err, code = _run(program + ['init', 'hold', 'my_policy'], cwd=tmp_path)
    assert code == 0 and (tmp_path / 'my_policy' / 'policy.py').is_file(), (out, err)
    out, err, code = _run(program + ['-w'])                  # no number: not a seq call, so our usage error
    assert code == 2 and b'usage: seq' in err, (out, err)


@pytest.mark.parametrize('argv', [
    ['3'], ['-3', '1'], ['.5', '2'], ['1e3'], ['0x10'], ['1', 'x'], ['-s,', '1', '3'], ['-s', ',', '1'],
    ['-w', '8', '10'], ['-ws,', '1', '3'], ['-wf%g', '1'], ['-f', '%.1f', '-1', '2'], ['--format=%g', '1'],
    ['--format', '%g', '1'], ['--sep=,', '1', '3'], ['--equal-width', '1', '2'], ['--eq', '1'], ['--', '1'],
    ['-s', '-', '1'],
])
def test_coreutils_style_calls_are_recognised(argv: list[str]) -> None:
    assert coreutils.is_coreutils_call(argv)


@pytest.mark.parametrize('argv', [
    [], ['serve', 'my_policy'], ['init', 'hold', '1'], ['--help'], ['-h'], ['--version'], ['--he'],
    ['-w', '--help', '3'], ['-w', '--version', '1'], ['-w'], ['-s', ','], ['-f'], ['-x', '1'], ['-wx', '1'],
    ['--frobnicate', '1'], ['--equal-width=1', '2'], ['-w', 'serve'], ['-', '1'], ['x'], ['1x'], ['--', 'serve'],
    ['--s', '1'],   # --s: --separator, whose argument is 1: no number follows
])
def test_everything_else_stays_ours(argv: list[str]) -> None:
    assert not coreutils.is_coreutils_call(argv)


def _script(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_the_system_seq_is_the_first_on_path_that_is_not_this_program(tmp_path: Path) -> None:
    """Copies of our console script anywhere on PATH are passed over (a hand-over never reaches itself)."""
    ours = _script(tmp_path / 'venv' / 'seq', "#!/usr/bin/python3\n# EASY-INSTALL-ENTRY-SCRIPT: 'sequence-ai-ros',"
                   "'console_scripts','seq'\n")
    wrapper = _script(tmp_path / 'wrap' / 'seq', '#!/bin/sh\nexec python3 -m sequence_ai_ros.cli "$@"\n')
    other = _script(tmp_path / 'busybox' / 'seq', '#!/bin/sh\necho "$@"\n')
    path = os.pathsep.join(str(p.parent) for p in (ours, wrapper, other))
    assert coreutils.find_coreutils_seq(path, fallbacks=()) == str(other)
    assert coreutils.find_coreutils_seq(os.pathsep.join([str(ours.parent), str(wrapper.parent)]),
                                        fallbacks=(str(tmp_path / 'none'), str(other))) == str(other)
    assert coreutils.find_coreutils_seq(str(ours.parent), fallbacks=(str(tmp_path / 'none'),)) is None


NO_SYSTEM_SEQ = '''
import sys
from sequence_ai_ros.cli import coreutils, main
coreutils.FALLBACKS = ('/nonexistent/bin/seq',)
sys.argv = ['seq', *sys.argv[1:]]
sys.exit(main())
'''


def test_without_a_system_seq_the_call_fails_saying_so(tmp_path: Path) -> None:
    ours = _script(tmp_path / 'bin' / 'seq', '#!/bin/sh\nexec python3 -m sequence_ai_ros.cli "$@"\n')
    out, err, code = _run([sys.executable, '-c', NO_SYSTEM_SEQ, '1', '3'], env={**ENV, 'PATH': str(ours.parent)})
    assert (out, code) == (b'', 1), (out, err)
    assert b'no coreutils seq was found' in err and b'python -m sequence_ai_ros.cli' in err, err


def test_a_hand_over_that_comes_back_to_this_program_stops(system_seq: str) -> None:
    out, err, code = _run(MODULE + ['1', '3'], env={**ENV, coreutils.GUARD: '1'})
    assert (out, code) == (b'', 1) and b'reached again' in err, (out, err)
