"""``sequence_ai``: the documented import name, an alias of sequence_ai_ros's public client API.

``import sequence_ai`` then ``sequence_ai.connect(model=...)`` runs the seed's snippets unchanged.
"""

from __future__ import annotations

from typing import Any

import sequence_ai_ros as _impl

__all__ = list(_impl.__all__)


def __getattr__(name: str) -> Any:
    return getattr(_impl, name)


def __dir__() -> list[str]:
    return sorted(__all__)
