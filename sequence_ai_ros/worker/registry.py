"""The local deployment registry under $SEQ_HOME (default ``~/.local/share/sequence_ai``).

``$SEQ_HOME/deployments.json`` maps each name to ``{name, version, path, sha256, deployed_at, action_space,
action_dim, chunk_length, dt, content_sha256, config_sha256, files, artifact_roots}``. It is written
atomically (temp file + rename). ``seq deploy`` validates a policy (import, contract, dry run) before
recording it; a redeploy bumps the version. A version's content is policy.py, config.yaml and the files
its config names (a checkpoint), hashed once at deploy (:mod:`.content`); serving refuses a deployment
whose policy.py or config.yaml hash, or whose artifacts' file list, sizes or modification times, differ
from the record, so a version always names one validated content.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sequence_ai_ros import home as seq_layout
from sequence_ai_ros.exceptions import ConfigError, DeploymentError, UnknownDeployment
from sequence_ai_ros.policy.loader import PolicyDefinition, file_sha256, load_policy_file
from sequence_ai_ros.worker import content
from sequence_ai_ros.worker.config import DRY_RUN_TIMEOUT_S
from sequence_ai_ros.worker.usage import delete_usage

_NAME = re.compile(r'^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$')


def check_name(name: str) -> str:
    """Return ``name`` if it is a valid deployment name.

    :raises ConfigError: unless it is 1-64 characters of letters, digits, ``_ . -``, starting alphanumeric.
    """
    if not _NAME.match(name or ''):
        raise ConfigError(f'deployment name {name!r}: use 1-64 letters, digits, "_", "." or "-", '
                          'starting with a letter or digit')
    return name


@dataclasses.dataclass
class DeploymentRecord:
    """One registered deployment."""

    name: str
    version: int
    path: str
    sha256: str
    deployed_at: float
    action_space: str = ''
    action_dim: int = 0
    chunk_length: int = 0
    dt: float = 0.0
    load_s: float = 0.0          # construct + load() at the deploy's dry run (s); 0: not measured
    content_sha256: str = ''     # policy.py + config.yaml + artifact files (worker/content.py); '': before it
    config_sha256: str = ''
    files: dict[str, list[int]] = dataclasses.field(default_factory=dict)   # artifact -> [size, mtime_ns]
    artifact_roots: list[str] = dataclasses.field(default_factory=list)


class Registry:
    """The deployments of one $SEQ_HOME.

    :param home: the $SEQ_HOME directory (created on first write).
    """

    def __init__(self, home: str | Path | None = None) -> None:
        self.home = seq_layout.seq_home(home)

    @property
    def file(self) -> Path:
        """Path of ``deployments.json``."""
        return seq_layout.registry_file(self.home)

    @property
    def usage_file(self) -> Path:
        """Path of the usage database."""
        return seq_layout.usage_file(self.home)

    def capture_dir(self, name: str) -> Path:
        """Return ``$SEQ_HOME/capture/<name>``."""
        return seq_layout.capture_root(self.home, name)

    def _read(self) -> dict[str, dict[str, Any]]:
        try:
            data = json.loads(self.file.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            raise ConfigError(f'registry {self.file} unreadable: {exc}') from None
        if not isinstance(data, dict):
            raise ConfigError(f'registry {self.file}: a JSON object is required')
        return data

    def ensure_home(self) -> None:
        """Create $SEQ_HOME when it is missing.

        :raises ConfigError: when it cannot be created or written (a folder of another user, a path below a
            file), naming it.
        """
        try:
            self.home.mkdir(parents=True, exist_ok=True)
            if not os.access(self.home, os.W_OK | os.X_OK):
                raise PermissionError(errno.EACCES, 'not writable by this user')
        except OSError as exc:
            raise ConfigError(f'$SEQ_HOME {self.home} cannot be created or written ({exc}): set SEQ_HOME to a '
                              'folder this user may write') from None

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """Serialize read-modify-write of the registry between processes (``flock`` on a lock file)."""
        self.ensure_home()
        with open(self.home / '.deployments.lock', 'w') as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _write(self, data: dict[str, dict[str, Any]]) -> None:
        self.ensure_home()
        fd, tmp = tempfile.mkstemp(prefix='.deployments.', dir=self.home)
        try:
            with os.fdopen(fd, 'w') as f:
                json.dump(data, f, indent=2, sort_keys=True)
                f.write('\n')
            os.replace(tmp, self.file)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def list(self) -> list[DeploymentRecord]:
        """Return every deployment, by name."""
        return [DeploymentRecord(**rec) for _, rec in sorted(self._read().items())]

    def get(self, name: str) -> DeploymentRecord:
        """Return one deployment.

        :raises UnknownDeployment: when ``name`` is not registered (the message lists what is).
        """
        data = self._read()
        if name not in data:
            path = name if name.endswith('.py') else f'{name}/policy.py'   # a file named already, or a folder
            raise UnknownDeployment(f'no deployment {name!r} in {self.file}; deployed: {sorted(data) or "none"} '
                                    f'(deploy with: seq deploy {path})')
        return DeploymentRecord(**data[name])

    def record(self, name: str, definition: PolicyDefinition, load_s: float = 0.0,
               fingerprint: content.Fingerprint | None = None) -> DeploymentRecord:
        """Record a validated deployment; a redeploy bumps the version.

        :param load_s: the measured load time (s), which Ready's eta starts from when serving; 0: unknown.
        :param fingerprint: its content (default: hashed here, :func:`.content.fingerprint`).
        """
        c = definition.contract
        fp = fingerprint or content.fingerprint(definition)
        with self._locked():
            data = self._read()
            prev = data.get(name)
            rec = DeploymentRecord(name=name, version=(prev['version'] + 1) if prev else 1, path=str(definition.path),
                                   sha256=definition.sha256, deployed_at=time.time(),
                                   action_space=c.action_space.value, action_dim=c.action_dim,
                                   chunk_length=c.chunk_length, dt=c.dt, load_s=float(load_s),
                                   content_sha256=fp.content_sha256, config_sha256=fp.config_sha256,
                                   files=fp.files, artifact_roots=fp.roots)
            data[name] = dataclasses.asdict(rec)
            self._write(data)
        return rec

    def delete(self, name: str, keep_data: bool = False) -> DeploymentRecord:
        """Remove a deployment, its capture directory (unless ``keep_data``) and its usage.

        :param keep_data: keep its capture directory (field data), e.g. to export it later.
        :raises UnknownDeployment: when ``name`` is not registered.
        """
        with self._locked():
            rec = self.get(name)
            data = self._read()
            data.pop(name, None)
            self._write(data)
        if not keep_data:
            shutil.rmtree(self.capture_dir(name), ignore_errors=True)
        delete_usage(self.usage_file, name)
        return rec

    def load(self, name: str, importer: Any = None) -> tuple[DeploymentRecord, PolicyDefinition]:
        """Import a registered deployment's policy for serving.

        :param importer: ``importer(path) -> PolicyDefinition`` (default :func:`load_policy_file`, in this
            process; the worker passes one that imports in a deployment process under its load timeout).

        :raises UnknownDeployment: when not registered.
        :raises DeploymentError: when the file is gone or no longer imports, or policy.py, config.yaml or an
            artifact changed since its deploy (never served unvalidated: deploy it again as a new version).
        """
        rec = self.get(name)
        path = Path(rec.path)
        if not path.is_file():
            raise DeploymentError(f'deployment {name!r}: {path} no longer exists; deploy again')
        if file_sha256(path) != rec.sha256:      # before importing it: a changed file's code never runs
            raise DeploymentError(f'deployment {name!r}: {path} changed since version {rec.version} was deployed; '
                                  f'run `seq deploy {path}` again to validate it as a new version')
        definition = (importer or load_policy_file)(path)
        changed = content.changes(definition, rec)
        if changed:
            raise DeploymentError(f'deployment {name!r}: {"; ".join(changed)} since version {rec.version} was '
                                  f'deployed; run `seq deploy {path}` again to validate it as a new version')
        return rec, definition


def _target(path: str | Path, name: str | None) -> tuple[Path, str]:
    """The resolved policy file and the deployment name (default: its folder's, or the file's stem)."""
    path = Path(path).expanduser().resolve()
    return path, check_name(name or (path.parent.name if path.name == 'policy.py' else path.stem))


def unchanged(path: str | Path, name: str | None = None, home: str | Path | None = None, *,
              timeout_s: float = DRY_RUN_TIMEOUT_S, isolation: str = 'process') -> DeploymentRecord | None:
    """Return the registered version of ``name`` when ``path`` holds exactly its content, else None.

    Exactly: the same policy file, and policy.py, the config file and every artifact file hash as the
    version's ``content_sha256`` (its artifacts' sizes and modification times are the recorded ones too, so
    the worker serves it as it is). Nothing of the policy runs unless policy.py is the registered one; then
    it is imported (with ``isolation`` and ``timeout_s``, as :func:`deploy` does) to find its config file and
    artifacts, and those are hashed.

    :raises DeploymentError: when that import fails.
    :raises ConfigError: for an invalid name.
    """
    path, name = _target(path, name)
    try:
        rec = Registry(home).get(name)
    except UnknownDeployment:
        return None
    if (not rec.content_sha256 or Path(rec.path).resolve() != path or not path.is_file()
            or file_sha256(path) != rec.sha256):
        return None
    if isolation == 'process':
        from sequence_ai_ros.worker.policy_process import describe_policy_file

        definition = describe_policy_file(path, name, timeout_s)
    else:
        definition = load_policy_file(path)
    if content.changes(definition, rec) or content.fingerprint(definition).content_sha256 != rec.content_sha256:
        return None
    return rec


def deploy(path: str | Path, name: str | None = None, home: str | Path | None = None,
           dry: bool = True, dry_timeout_s: float = DRY_RUN_TIMEOUT_S,
           isolation: str = 'process', force: bool = False) -> tuple[DeploymentRecord, dict[str, float]]:
    """Validate ``path`` and record it; a content equal to the registered version's is not registered again.

    :param path: the policy file (``NAME/policy.py``).
    :param name: deployment name; default the policy's directory name.
    :param dry: run the dry inference (always on for ``seq deploy``).
    :param dry_timeout_s: bound of the dry run (construct, load, one inference, hook), s; with
        ``isolation='process'`` it bounds the import too (the checks run in a deployment process, killed
        when the bound passes, so a hang at import cannot outlast it).
    :param isolation: ``process``: import and dry-run in a deployment process (a crash or ``os._exit``
        at import is named with its exit code); ``none``: in this process.
    :param force: register a new version even when ``path`` holds the registered version's content
        (:func:`unchanged`); without it that version's record is returned, with no figures, and nothing is
        registered (a worker serving it rolls nothing out).
    :return: the record and the dry run's figures (empty when nothing was registered).
    :raises DeploymentError: when the policy does not import (SystemExit at import included), its contract is
        invalid, or the dry run fails or exceeds ``dry_timeout_s``.
    :raises ConfigError: for an invalid name, or a $SEQ_HOME that cannot be created or written.
    """
    from sequence_ai_ros.worker.validate import fingerprint_and_dry_run

    path, name = _target(path, name)
    Registry(home).ensure_home()              # before the dry run, which may take minutes
    same = None if force else unchanged(path, name, home, timeout_s=dry_timeout_s, isolation=isolation)
    if same is not None:
        return same, {}
    if isolation == 'process' and dry:
        from sequence_ai_ros.worker.policy_process import deploy_check

        if not path.is_file():
            raise DeploymentError(f'{path}: no such policy file')
        definition, fp, figures = deploy_check(path, name, dry_timeout_s)
        return Registry(home).record(name, definition, load_s=figures.get('load_s', 0.0), fingerprint=fp), figures
    definition = load_policy_file(path)
    fp, figures = fingerprint_and_dry_run(definition, timeout_s=dry_timeout_s, dry=dry)
    return Registry(home).record(name, definition, load_s=figures.get('load_s', 0.0), fingerprint=fp), figures
