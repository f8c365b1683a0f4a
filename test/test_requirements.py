"""Every requirements set resolves with pip, on every Python it claims (needs the package registry).

Each set is resolved by the real interpreter of that Python version (environment markers are evaluated
against the running interpreter, which ``--python-version`` does not change), with
``pip install --dry-run --ignore-installed --only-binary=:all:``: wheels only, as on a robot without a
compiler. A Python that this machine lacks is skipped by name; so is the whole module when the registry
cannot be reached. The LeRobot worker set (torch, several GB of metadata to resolve) runs only where
``SEQ_RESOLVE_LEROBOT=1`` (``make check-lerobot`` sets it).
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
TIMEOUT_S = 300

#: requirements file -> the Python versions it claims.
SETS = {
    'requirements.txt': ('3.10', '3.11', '3.12', '3.13'),
    'requirements-humble.txt': ('3.10',),
    'requirements-jazzy.txt': ('3.12',),
    'requirements-kilted.txt': ('3.11', '3.12'),
    'requirements-lerobot.txt': ('3.12', '3.13'),
    'requirements-worker.txt': ('3.12',),
}


@functools.cache
def interpreter(version: str) -> str | None:
    """Return a python executable of ``version`` (pyenv's first, then PATH), or None."""
    if shutil.which('pyenv'):
        bare = subprocess.run(['pyenv', 'versions', '--bare'], capture_output=True, text=True, timeout=30).stdout
        for full in bare.split():
            if full == version or full.startswith(version + '.'):
                found = subprocess.run(['pyenv', 'which', f'python{version}'], capture_output=True, text=True,
                                       env=dict(os.environ, PYENV_VERSION=full), timeout=30)
                if found.returncode == 0:
                    return found.stdout.strip()
    return shutil.which(f'python{version}')


@functools.cache
def registry_reachable() -> bool:
    """True when pip can list a package's versions within 60 s."""
    try:
        done = subprocess.run([interpreter('3.11') or 'python3', '-m', 'pip', 'index', 'versions', 'grpcio'],
                              capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        return False
    return done.returncode == 0


CASES = [(name, version) for name, versions in SETS.items() for version in versions]
#: Pure-Python packages published as source only, which pip builds without a compiler: docopt, which
#: num2words (SmolVLA's processor, lerobot[smolvla]) needs.
SOURCE_ONLY = ('--no-binary=docopt',)


@pytest.mark.parametrize(('name', 'version'), CASES, ids=[f'{n}-py{v}' for n, v in CASES])
def test_requirements_set_resolves(name: str, version: str, tmp_path: Path):
    if name == 'requirements-lerobot.txt' and os.environ.get('SEQ_RESOLVE_LEROBOT') != '1':
        pytest.skip('the LeRobot set resolves torch (GBs of metadata): run with SEQ_RESOLVE_LEROBOT=1 '
                    '(make check-lerobot does)')
    python = interpreter(version)
    if python is None:
        pytest.skip(f'no Python {version} on this machine (pyenv or PATH)')
    if not registry_reachable():
        pytest.skip('the package registry is unreachable')
    done = subprocess.run([python, '-m', 'pip', 'install', '--dry-run', '--ignore-installed', '--only-binary=:all:',
                           *SOURCE_ONLY, '--report', str(tmp_path / 'report.json'), '-r', str(REPO / name)],
                          capture_output=True, text=True, timeout=TIMEOUT_S, cwd=REPO)
    assert done.returncode == 0, f'{name} on Python {version} does not resolve:\n{done.stderr[-3000:]}'
    assert 'Would install' in done.stdout


def test_every_requirements_file_is_claimed():
    unclaimed = {'requirements-dev.txt', 'requirements-bench.txt', 'requirements-docs.txt'}   # dev/CI only
    files = {p.name for p in REPO.glob('requirements*.txt')} - unclaimed
    assert files == set(SETS), 'a requirements set without the Pythons it claims (add it to SETS)'
