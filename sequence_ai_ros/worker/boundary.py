"""The worker's boundary: every message from the wire is checked by :mod:`sequence_ai_ros.protocol.limits`.

The schema lives in the protocol (one definition for the worker, the capture store and the client); this
module counts what the boundary refused, per deployment and field (both bounded sets), for
``seq_boundary_refused_total`` and :func:`refused_counts`.
"""

from __future__ import annotations

import collections
import logging
import threading
from typing import Any

from sequence_ai_ros.protocol.limits import FIELDS, LimitViolation

LOG = logging.getLogger(__name__)
_lock = threading.Lock()
_counts: collections.Counter[tuple[str, str]] = collections.Counter()


def refuse(runtime: Any, exc: LimitViolation) -> LimitViolation:
    """Count a refusal of ``exc.field`` for ``runtime``'s deployment (None: before one is known); return ``exc``."""
    field = exc.field if exc.field in FIELDS else 'other'
    name = getattr(runtime, 'name', '') if runtime is not None else ''
    with _lock:
        _counts[(name, field)] += 1
    metrics = getattr(runtime, 'metrics', None)
    if metrics is not None:
        metrics.refused_value(name, field)
    LOG.info('refused at the boundary (%s): %s', name or '-', exc)
    return exc


def refused_counts() -> dict[tuple[str, str], int]:
    """Return {(deployment, field): values refused} since the process started."""
    with _lock:
        return dict(_counts)
