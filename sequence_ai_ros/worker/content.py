"""What a deployment version is made of: policy.py, its config file and the files its config names.

``seq deploy`` hashes them once (:func:`fingerprint`): the version's ``content_sha256`` covers policy.py, the
config file (config.yaml) and every file of the policy's artifacts (a LeRobot checkpoint directory, its
backbone snapshots), whose sizes and modification times it also records. Serving never re-hashes the
artifacts (GBs): :func:`changes` hashes policy.py and config.yaml (small) and compares the artifacts' file
list, sizes and modification times with the record; any difference means the files are no longer the
validated version, which ``seq deploy`` must validate again as a new one.

A policy class names its artifacts with an optional classmethod ``artifacts(config) -> list[Path]``
(files or directories; missing ones are skipped, as the dry run has already checked what it needs).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from sequence_ai_ros.policy.loader import PolicyDefinition, file_sha256

_BLOCK = 1 << 20


@dataclasses.dataclass(frozen=True)
class Fingerprint:
    """A deployment's content.

    :param content_sha256: sha256 over policy.py, the config file and each artifact file (path, size, sha256).
    :param config_sha256: sha256 of the config file ('' when there is none).
    :param files: each artifact file (absolute path) -> [size (bytes), mtime_ns].
    :param roots: the artifact paths the policy named (absolute).
    """

    content_sha256: str
    config_sha256: str
    files: dict[str, list[int]]
    roots: list[str]


def config_path(definition: PolicyDefinition) -> Path:
    """The config file beside policy.py (``config.yaml`` unless the policy names another)."""
    return definition.path.parent / (definition.spec.config_file or 'config.yaml')


def artifact_roots(definition: PolicyDefinition) -> list[Path]:
    """The files and directories the policy's ``artifacts(config)`` names (resolved, existing, in order)."""
    named = getattr(definition.cls, 'artifacts', None)
    out: list[Path] = []
    for path in (named(dict(definition.config)) if callable(named) else []) or []:
        path = Path(path).expanduser().resolve()
        if path.exists() and path not in out:
            out.append(path)
    return out


def _walk(roots: Iterable[Path]) -> list[Path]:
    files: list[Path] = []
    for root in roots:
        if root.is_file():
            files.append(root)
            continue
        for folder, dirs, names in os.walk(root):
            dirs.sort()
            files += [Path(folder) / n for n in sorted(names)]
    return sorted(dict.fromkeys(files))


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, 'rb') as f:
        while block := f.read(_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def fingerprint(definition: PolicyDefinition) -> Fingerprint:
    """Hash policy.py, the config file and every artifact file (once, at deploy: reads them all)."""
    config = config_path(definition)
    config_sha = file_sha256(config) if config.is_file() else ''
    digest = hashlib.sha256()
    digest.update(f'policy.py {definition.sha256}\nconfig {config_sha}\n'.encode())
    roots = artifact_roots(definition)
    files: dict[str, list[int]] = {}
    for path in _walk(roots):
        st = path.stat()
        files[str(path)] = [st.st_size, st.st_mtime_ns]
        digest.update(f'{path} {st.st_size} {_sha256(path)}\n'.encode())
    return Fingerprint(content_sha256=digest.hexdigest(), config_sha256=config_sha, files=files,
                       roots=[str(r) for r in roots])


def changes(definition: PolicyDefinition, record: Any) -> list[str]:
    """What differs from the deployed version (empty when nothing): never re-hashes an artifact.

    :param record: the registry's record (``sha256``, ``content_sha256``, ``config_sha256``, ``files``,
        ``artifact_roots``); a record from before content hashing (``content_sha256`` empty) has its config
        file not compared.
    """
    return _differences(definition, record.sha256, record.config_sha256 if record.content_sha256 else None,
                        record.artifact_roots, record.files)


def changes_since(definition: PolicyDefinition, taken: Fingerprint) -> list[str]:
    """What differs from ``taken``, this definition's own :func:`fingerprint` of a moment ago (empty when nothing).

    ``seq deploy`` takes the fingerprint before the dry run and checks with this after it that what it
    validated is what it records. Never re-hashes an artifact.
    """
    return _differences(definition, definition.sha256, taken.config_sha256, taken.roots, taken.files)


def _differences(definition: PolicyDefinition, sha256: str, config_sha256: str | None, roots: Iterable[str],
                 files: dict[str, list[int]]) -> list[str]:
    """What differs from the given content (empty when nothing).

    :param sha256: policy.py's.
    :param config_sha256: the config file's (None: not compared).
    :param roots: the artifact paths named.
    :param files: each artifact file -> ``[size, mtime_ns]``.
    """
    out = []
    if definition.sha256 != sha256:
        out.append(f'{definition.path} changed')
    config = config_path(definition)
    now = file_sha256(config) if config.is_file() else ''
    if config_sha256 is not None and now != config_sha256:
        out.append(f'{config} changed')
    roots = list(roots)
    if [str(r) for r in artifact_roots(definition)] != roots:
        out.append(f'the artifacts it names changed (now {[str(r) for r in artifact_roots(definition)]})')
        return out
    present = {str(p) for p in _walk(Path(r) for r in roots)}
    recorded = dict(files)
    for gone in sorted(set(recorded) - present)[:3]:
        out.append(f'{gone} is gone')
    for new in sorted(present - set(recorded))[:3]:
        out.append(f'{new} is new')
    for path in sorted(set(recorded) & present):
        st = os.stat(path)
        if [st.st_size, st.st_mtime_ns] != list(recorded[path]):
            out.append(f'{path} changed (size or modification time)')
            if len(out) > 5:
                break
    return out


__all__ = ['Fingerprint', 'artifact_roots', 'changes', 'changes_since', 'config_path', 'fingerprint']
