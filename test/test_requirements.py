"""Every requirements set resolves with pip, on every Python it claims (needs the package registry).

Each set is resolved by the real interpreter of that Python version (environment markers are evaluated
against the running interpreter, which ``--python-version`` does not change), with
``pip install --dry-run --ignore-installed --only-binary=:all:``: wheels only, as on a robot without a
compiler. A Python that this machine lacks is skipped by name; so is the whole module when the registry
cannot be reached. The LeRobot worker set (torch, several GB of metadata to resolve) runs only where
``SEQ_RESOLVE_LEROBOT=1`` (``make check-lerobot`` sets it).

A set that resolved is remembered in ``~/.cache/sequence_ai/resolved/`` (``SEQ_RESOLVE_CACHE`` moves it), keyed
by the text of the file and of every file it includes, the interpreter's full version, its pip's version and
pip's options: an unchanged set is not resolved again, a changed one (or a cold cache, as on a fresh CI machine)
is. A failure is never remembered.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
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
    'requirements-ros2-tools.txt': ('3.11', '3.12'),
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
#: Where resolved sets are remembered (see the module docstring).
CACHE = Path(os.environ.get('SEQ_RESOLVE_CACHE') or Path.home() / '.cache' / 'sequence_ai' / 'resolved')
INCLUDE = re.compile(r'^\s*(?:-r|--requirement|-c|--constraint)[\s=]+(\S+)', re.M)


def included_texts(path: Path) -> list[str]:
    """Return the text of ``path`` and of every file it includes (``-r``/``-c``, recursively), in order."""
    texts, todo, seen = [], [path], set()
    while todo:
        current = todo.pop(0).resolve()
        if current in seen:
            continue
        seen.add(current)
        text = current.read_text()
        texts.append(f'{current.name}\n{text}')
        todo += [current.parent / m for m in INCLUDE.findall(text)]
    return texts


def resolution_key(python: str, path: Path, options: tuple[str, ...]) -> str:
    """Return the cache key of resolving ``path`` with ``python``: the files, the interpreter, its pip, the options."""
    versions = subprocess.run([python, '-c', 'import sys, pip; print(sys.version); print(pip.__version__)'],
                              capture_output=True, text=True, timeout=60, check=True).stdout
    digest = hashlib.sha256('\0'.join([*included_texts(path), versions, *options]).encode())
    return digest.hexdigest()[:32]


def remember(key: str, record: dict) -> None:
    """Write ``CACHE/<key>.json`` atomically (parallel test workers may write at once)."""
    CACHE.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile('w', dir=CACHE, suffix='.tmp', delete=False) as f:
        json.dump(record, f, indent=1)
    os.replace(f.name, CACHE / f'{key}.json')


@pytest.mark.slow
@pytest.mark.parametrize(('name', 'version'), CASES, ids=[f'{n}-py{v}' for n, v in CASES])
def test_requirements_set_resolves(name: str, version: str, tmp_path: Path):
    if name == 'requirements-lerobot.txt' and os.environ.get('SEQ_RESOLVE_LEROBOT') != '1':
        pytest.skip('the LeRobot set resolves torch (GBs of metadata): run with SEQ_RESOLVE_LEROBOT=1 '
                    '(make check-lerobot does)')
    python = interpreter(version)
    if python is None:
        pytest.skip(f'no Python {version} on this machine (pyenv or PATH)')
    options = ('--dry-run', '--ignore-installed', '--only-binary=:all:', *SOURCE_ONLY)
    key = resolution_key(python, REPO / name, options)
    if (CACHE / f'{key}.json').is_file():
        return                                    # this exact set resolved on this interpreter and pip before
    if not registry_reachable():
        pytest.skip('the package registry is unreachable')
    report = tmp_path / 'report.json'
    done = subprocess.run([python, '-m', 'pip', 'install', *options, '--report', str(report), '-r', str(REPO / name)],
                          capture_output=True, text=True, timeout=TIMEOUT_S, cwd=REPO)
    assert done.returncode == 0, f'{name} on Python {version} does not resolve:\n{done.stderr[-3000:]}'
    assert 'Would install' in done.stdout
    installed = json.loads(report.read_text())['install']
    remember(key, {'file': name, 'python': python, 'resolved_at': time.strftime('%Y-%m-%dT%H:%M:%S%z'),
                   'install': sorted(f"{i['metadata']['name']}=={i['metadata']['version']}" for i in installed)})


def test_every_requirements_file_is_claimed():
    unclaimed = {'requirements-dev.txt', 'requirements-bench.txt', 'requirements-docs.txt'}   # dev/CI only
    files = {p.name for p in REPO.glob('requirements*.txt')} - unclaimed
    assert files == set(SETS), 'a requirements set without the Pythons it claims (add it to SETS)'


def test_a_changed_file_or_an_included_one_is_resolved_again(tmp_path: Path):
    """The cache key follows ``-r`` includes: editing either file, or pip's options, makes a new key."""
    python = interpreter('3.11') or 'python3'
    (tmp_path / 'base.txt').write_text('grpcio==1.85.3\n')
    (tmp_path / 'set.txt').write_text('-r base.txt\nnumpy==2.4.6\n')
    options = ('--dry-run',)
    key = resolution_key(python, tmp_path / 'set.txt', options)
    assert resolution_key(python, tmp_path / 'set.txt', options) == key
    assert resolution_key(python, tmp_path / 'set.txt', ('--dry-run', '--pre')) != key
    (tmp_path / 'base.txt').write_text('grpcio==1.85.2\n')
    changed = resolution_key(python, tmp_path / 'set.txt', options)
    assert changed != key
    (tmp_path / 'set.txt').write_text('-r base.txt\nnumpy==2.4.5\n')
    assert resolution_key(python, tmp_path / 'set.txt', options) not in (key, changed)
