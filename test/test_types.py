"""The type check: mypy, configured by pyproject.toml's ``[tool.mypy]``, finds no error in the package.

Strict on the ROS-free client, the wire protocol and the policy API; the normal checks everywhere else. The
protobuf and gRPC type stubs (``protocol/sequence_ai_pb2*.pyi``) are generated at build time by setup.py.
It runs with the mypy that requirements-dev.txt pins (the dev venv ``make setup`` builds) and skips, saying
why, anywhere else (a robot's distro venv has no mypy). Its incremental cache is ``.mypy_cache/``
(gitignored): a warm run takes about a second, a cold one some 20 s.
"""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PROTOCOL = REPO / 'sequence_ai_ros' / 'protocol'
STRICT_MODULES = ['sequence_ai_ros.client.*', 'sequence_ai_ros.protocol.*', 'sequence_ai_ros.policy.*']


def pinned(name: str) -> str | None:
    """Return the version requirements-dev.txt pins for ``name`` (``name==version``), or None."""
    for line in (REPO / 'requirements-dev.txt').read_text().splitlines():
        found = re.fullmatch(r'([A-Za-z0-9._-]+)==(\S+)', line.split('#')[0].strip())
        if found and found[1].lower().replace('_', '-') == name:
            return found[2]
    return None


def installed(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


@pytest.fixture(scope='module', autouse=True)
def pinned_mypy() -> None:
    """Skip unless this Python has the mypy and mypy-protobuf that requirements-dev.txt pins."""
    for name in ('mypy', 'mypy-protobuf'):
        want, have = pinned(name), installed(name)
        assert want is not None, f'requirements-dev.txt pins no {name}'
        if have is None:
            pytest.skip(f'{name} is not installed here: the type check runs in the dev venv (requirements-dev.txt, '
                        'make setup)')
        if have != want:
            pytest.skip(f'{name} {have} is installed, requirements-dev.txt pins {want}: the type check runs with '
                        'the pinned one (make setup)')


def test_the_build_generated_the_type_stubs():
    """setup.py writes both .pyi beside the generated modules, no older than the .proto (mypy-protobuf is here)."""
    proto = PROTOCOL / 'sequence_ai.proto'
    for stub in ('sequence_ai_pb2.pyi', 'sequence_ai_pb2_grpc.pyi'):
        path = PROTOCOL / stub
        assert path.is_file(), f'{stub} was not generated: run `make build` (setup.py writes it)'
        assert path.stat().st_mtime >= proto.stat().st_mtime, f'{stub} is older than the .proto: run `make build`'


def test_mypy_finds_no_error():
    done = subprocess.run([sys.executable, '-m', 'mypy', '--cache-dir', str(REPO / '.mypy_cache')], cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f'mypy (pyproject.toml [tool.mypy]) found errors:\n{done.stdout}{done.stderr}'
    found = re.search(r'^Success: no issues found in (\d+) source files$', done.stdout, re.MULTILINE)
    assert found, done.stdout + done.stderr
    # the whole package was checked (directories without __init__.py count too, so at least every module)
    assert int(found[1]) >= len(list((REPO / 'sequence_ai_ros').rglob('*.py'))), done.stdout


def test_the_strict_override_turns_on_what_mypy_strict_does():
    """The override plus the global settings set every option ``--strict`` sets, to its value, and nothing more."""
    tomllib = pytest.importorskip('tomllib')
    from mypy.main import process_options

    _, plain = process_options(['--config-file', '', '-c', 'pass'])
    _, strict = process_options(['--config-file', '', '--strict', '-c', 'pass'])
    names = [n for n in dir(plain) if not n.startswith('_') and not callable(getattr(plain, n))]
    wanted = {n: getattr(strict, n) for n in names if getattr(strict, n) != getattr(plain, n)}
    assert {'disallow_untyped_defs', 'warn_return_any', 'implicit_reexport'} <= set(wanted)    # read right

    config = tomllib.loads((REPO / 'pyproject.toml').read_text())['tool']['mypy']
    override = next(o for o in config['overrides'] if o['module'] == STRICT_MODULES)
    options = {k: v for k, v in override.items() if k != 'module'}
    assert set(options) <= set(wanted), f'the strict override sets more than --strict: {set(options) - set(wanted)}'
    merged = {**{k: v for k, v in config.items() if k in wanted}, **options}
    unset = {k: v for k, v in wanted.items() if merged.get(k) != v}
    assert not unset, f'pyproject.toml does not set what --strict sets: {unset}'
