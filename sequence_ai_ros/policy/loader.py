"""Load a ``policy.py`` by path: import it, find its one ``@seq.policy`` class, read its config.

The deployment's config is ``config.yaml`` beside ``policy.py`` (or the decorator's ``config_file``): a
YAML mapping passed to the class as constructor kwargs, merged under any kwargs given by the caller.
A class whose contract depends on its config (e.g. the action dimension) defines a classmethod
``configure_contract(cls, contract, config) -> Contract``; it must be cheap, because the handshake
answers with the contract before the (possibly slow) constructor runs.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import sys
import traceback
from pathlib import Path
from typing import Any

import yaml

from sequence_ai_ros.exceptions import ConfigError, ContractViolation, DeploymentError
from sequence_ai_ros.policy.api import PolicySpec, spec_of
from sequence_ai_ros.protocol.contract import Contract


def file_sha256(path: str | Path) -> str:
    """Return the hex SHA-256 of a file's bytes."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


@dataclasses.dataclass
class PolicyDefinition:
    """An imported policy file.

    :param path: absolute path of policy.py.
    :param cls: the ``@seq.policy`` class.
    :param spec: what the decorator recorded.
    :param config: constructor kwargs (config file merged with the caller's overrides).
    :param contract: the contract for this config (not yet stamped with deployment name/version).
    :param sha256: hash of policy.py at import.
    """

    path: Path
    cls: type
    spec: PolicySpec
    config: dict[str, Any]
    contract: Contract
    sha256: str

    def instantiate(self) -> Any:
        """Construct the policy with its config (may be slow: weights); exceptions propagate."""
        return self.cls(**self.config)

    @property
    def hook(self) -> str | None:
        """Name of the ``@seq.on_episode`` method, or None."""
        return self.spec.hook


def _import(path: Path) -> Any:
    name = f'seq_policy_{hashlib.sha1(str(path).encode()).hexdigest()[:12]}'
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise DeploymentError(f'{path}: not an importable Python file')
    module = importlib.util.module_from_spec(spec)
    # Sibling modules of policy.py (a template's helpers) are importable while it loads.
    sys.path.insert(0, str(path.parent))
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except (ConfigError, ContractViolation) as exc:
        sys.modules.pop(name, None)
        raise DeploymentError(f'{path}: invalid policy declaration: {exc}') from exc
    except (Exception, SystemExit) as exc:  # sys.exit() at import is a failed import, not our exit
        sys.modules.pop(name, None)
        last = traceback.format_exception_only(type(exc), exc)[-1].strip()
        raise DeploymentError(f'{path}: import failed: {last}') from exc
    finally:
        try:
            sys.path.remove(str(path.parent))
        except ValueError:
            pass
    return module


def read_config(path: Path) -> dict[str, Any]:
    """Read a YAML mapping of constructor kwargs; an absent file is an empty mapping.

    :raises ConfigError: when the file is not valid YAML or not a mapping with string keys.
    """
    if not path.exists():
        return {}
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f'{path}: invalid YAML: {exc}') from None
    if not isinstance(data, dict) or not all(isinstance(k, str) for k in data):
        raise ConfigError(f'{path}: must be a mapping of constructor arguments')
    return data


def load_policy_file(path: str | Path, **overrides: Any) -> PolicyDefinition:
    """Import ``path`` and return its policy definition.

    :param path: a policy.py declaring exactly one ``@seq.policy`` class.
    :param overrides: constructor kwargs that take precedence over the config file.
    :raises DeploymentError: when the file is missing, does not import, declares no or several policy
        classes, has an invalid contract, or its config is invalid.
    """
    path = Path(path).expanduser().resolve()
    if not path.is_file():
        raise DeploymentError(f'{path}: no such policy file')
    sha = file_sha256(path)
    module = _import(path)
    classes = [obj for obj in vars(module).values()
               if isinstance(obj, type) and spec_of(obj) is not None and obj.__module__ == module.__name__]
    if not classes:
        raise DeploymentError(f'{path}: no class decorated with @seq.policy(...)')
    if len(classes) > 1:
        raise DeploymentError(f'{path}: several @seq.policy classes ({[c.__name__ for c in classes]}); '
                              'declare exactly one')
    cls = classes[0]
    spec = spec_of(cls)
    assert spec is not None
    try:
        config = read_config(path.parent / (spec.config_file or 'config.yaml'))
    except ConfigError as exc:
        raise DeploymentError(str(exc)) from None
    config.update(overrides)
    contract = spec.contract
    configure = getattr(cls, 'configure_contract', None)
    if callable(configure):
        try:
            contract = configure(contract, dict(config))
        except (ConfigError, ContractViolation) as exc:
            raise DeploymentError(f'{path}: invalid contract for this config: {exc}') from exc
        if not isinstance(contract, Contract):
            raise DeploymentError(f'{path}: {cls.__name__}.configure_contract must return a Contract')
    return PolicyDefinition(path=path, cls=cls, spec=spec, config=config, contract=contract, sha256=sha)
