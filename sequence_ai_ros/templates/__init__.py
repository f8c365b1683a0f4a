"""``seq init`` templates: one folder per template (``policy.py``, ``config.yaml``, ``README.md``).

Each template's ``policy.py`` imports the authoring API (:mod:`sequence_ai_ros.policy`) and, where it
wraps a model, :mod:`sequence_ai_ros.models`. The folders are copied, never imported from here.
"""

from __future__ import annotations

from pathlib import Path

#: The folder that holds one sub-folder per template.
TEMPLATES_DIR = Path(__file__).resolve().parent
