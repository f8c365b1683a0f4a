"""The parquet side of a LeRobot export: pyarrow on demand, the column schema, an episode's table.

Shared by the v2.1 (:mod:`.lerobot_writer`) and v3.0 (:mod:`.lerobot_v3`) layouts and the checks of
:mod:`.verify`: the ``datasets`` feature spec and the arrow schema (with the ``huggingface`` metadata)
of the columns, and a table of an episode's columns in that schema.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from sequence_ai_ros.exceptions import MissingDependency


def import_pyarrow() -> tuple[Any, Any]:
    """Return ``(pyarrow, pyarrow.parquet)``, or raise MissingDependency with the install hint."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise MissingDependency(f'a LeRobot export needs pyarrow ({exc}); install it with: pip install pyarrow') \
            from None
    return pa, pq


def hf_features(features: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Return the ``datasets`` feature spec of the parquet columns (LeRobot's get_hf_features_from_features)."""
    out: dict[str, Any] = {}
    for key, ft in features.items():
        if ft['dtype'] in ('video', 'image'):
            continue
        if list(ft['shape']) == [1]:
            out[key] = {'dtype': ft['dtype'], '_type': 'Value'}
        else:
            out[key] = {'feature': {'dtype': ft['dtype'], '_type': 'Value'}, 'length': int(ft['shape'][0]),
                        '_type': 'Sequence'}
    return out


def arrow_schema(features: dict[str, dict[str, Any]]) -> Any:
    """Return the pyarrow schema of an episode's parquet file, with the ``huggingface`` metadata."""
    pa, _ = import_pyarrow()
    types = {'float32': pa.float32(), 'float64': pa.float64(), 'int64': pa.int64(), 'bool': pa.bool_()}
    fields = []
    for key, spec in hf_features(features).items():
        if spec['_type'] == 'Value':
            fields.append(pa.field(key, types[spec['dtype']]))
        else:
            item = pa.field('element', types[spec['feature']['dtype']])
            fields.append(pa.field(key, pa.list_(item, spec['length'])))
    meta = {'huggingface': json.dumps({'info': {'features': hf_features(features)}})}
    return pa.schema(fields, metadata=meta)


def table(cols: dict[str, np.ndarray], schema: Any) -> Any:
    """Return a pyarrow Table of the columns, in ``schema``'s order and types."""
    pa, _ = import_pyarrow()
    arrays = []
    for field in schema:
        data = cols[field.name]
        if data.ndim == 2:
            arrays.append(pa.FixedSizeListArray.from_arrays(pa.array(data.reshape(-1)), type=field.type))
        else:
            arrays.append(pa.array(data, type=field.type))
    return pa.Table.from_arrays(arrays, schema=schema)
