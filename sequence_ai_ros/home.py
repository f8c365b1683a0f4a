"""The ``$SEQ_HOME`` layout, owned here and nowhere else.

``$SEQ_HOME`` (default ``~/.local/share/sequence_ai``) holds everything a worker machine keeps::

    $SEQ_HOME/
      deployments.json          the registry (``seq deploy``), see sequence_ai_ros.worker.registry
      .deployments.lock         serialises registry writers
      usage.sqlite              usage metering, see sequence_ai_ros.worker.usage
      capture/<name>/           one deployment's capture store, see sequence_ai_ros.capture

Every other module asks this one for a path; none joins these names itself.
"""

from __future__ import annotations

import os
from pathlib import Path

#: Environment variable naming the folder, and its default.
ENV_VAR = 'SEQ_HOME'
DEFAULT_HOME = '~/.local/share/sequence_ai'
REGISTRY_FILE = 'deployments.json'
USAGE_FILE = 'usage.sqlite'
CAPTURE_DIR = 'capture'


def seq_home(path: str | Path | None = None) -> Path:
    """Return ``path`` (expanded) or ``$SEQ_HOME``, default ``~/.local/share/sequence_ai``."""
    if path is not None:
        return Path(path).expanduser()
    return Path(os.environ.get(ENV_VAR) or DEFAULT_HOME).expanduser()


def registry_file(home: str | Path | None = None) -> Path:
    """Return ``$SEQ_HOME/deployments.json``."""
    return seq_home(home) / REGISTRY_FILE


def usage_file(home: str | Path | None = None) -> Path:
    """Return ``$SEQ_HOME/usage.sqlite``."""
    return seq_home(home) / USAGE_FILE


def capture_parent(home: str | Path | None = None) -> Path:
    """Return ``$SEQ_HOME/capture``, the parent of every deployment's capture store."""
    return seq_home(home) / CAPTURE_DIR


def capture_root(home: str | Path | None, deployment: str) -> Path:
    """Return ``$SEQ_HOME/capture/<deployment>``, one deployment's capture store."""
    return capture_parent(home) / deployment
