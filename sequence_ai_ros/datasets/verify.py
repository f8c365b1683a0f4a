"""Re-read a LeRobot v2.1 export with the project's own reader and compare its schema with a reference.

``make test`` runs this on every export (LeRobot itself, with torch, only runs in ``make check-export``).
It re-reads every episode with :class:`~sequence_ai_ros.datasets.lerobot_reader.LeRobotDataset` and checks:

- the totals of ``meta/info.json`` against the files; lengths against ``episodes.jsonl``;
- ``frame_index`` = 0..N-1, ``timestamp`` = frame_index / fps (to 1e-4 s, LeRobot's tolerance), a
  continuous global ``index``, known ``task_index`` values;
- every video decodes frame-accurately (frame k at pts k / fps), with the declared shape;
- every episode's stats hold every feature with LeRobot 0.6's keys (min, max, mean, std, count, q01, q10,
  q50, q90, q99), every value finite, counts shaped (1,), image stats shaped (3, 1, 1);
- each parquet schema (arrow types and the ``huggingface`` metadata) equals the one the features imply.

With a ``reference`` dataset (one LeRobot wrote), it also checks that info.json has the same keys, each
shared feature the same dtype, rank and layout of names, the default columns the same arrow types and
``huggingface`` metadata, and that the meta files have the same keys (episodes.jsonl may add some).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from sequence_ai_ros.datasets.lerobot_reader import LeRobotDataset
from sequence_ai_ros.datasets.parquet import arrow_schema, hf_features
from sequence_ai_ros.exceptions import ConfigError, ExportError

STAT_KEYS = {'min', 'max', 'mean', 'std', 'count', 'q01', 'q10', 'q50', 'q90', 'q99'}


def _jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding='utf-8').splitlines() if line.strip()]


def _names_layout(names: Any) -> str:
    """Describe how a feature's names are nested: 'null', 'list', 'list[list]', 'dict'."""
    if isinstance(names, list):
        return 'list[list]' if names and isinstance(names[0], list) else 'list'
    return 'null' if names is None else type(names).__name__


def _shape_free(spec: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in spec.items() if k != 'length'}


def verify_export(root: str | Path, reference: str | Path | None = None, *,
                  decode_videos: bool = True) -> dict[str, Any]:
    """Check an export; return a summary ``{'episodes', 'frames', 'videos', 'decoded_frames', 'reference'}``.

    :param root: the exported dataset directory.
    :param reference: a LeRobot-written v2.1 dataset to compare the schema with (None: skip).
    :param decode_videos: decode every frame of every video (slow for large exports).
    :raises ExportError: listing every problem found.
    """
    problems: list[str] = []
    try:
        ds = LeRobotDataset(root)
    except ConfigError as exc:
        raise ExportError(f'export {root} does not read back: {exc}') from None
    info, fps = ds.info, ds.fps
    features = ds.features
    expected_schema = arrow_schema(features)
    stats = {int(s['episode_index']): s['stats'] for s in _jsonl(ds.root / 'meta' / 'episodes_stats.jsonl')}
    total, decoded, next_index = 0, 0, 0
    for meta in ds.episodes:
        k = int(meta['episode_index'])
        try:
            schema = ds.schema(k)
            if not schema.equals(expected_schema, check_metadata=True):
                problems.append(f'episode {k}: parquet schema differs from the features:\n{schema}\n'
                                f'expected:\n{expected_schema}')
            ep = ds.episode(k)
        except ConfigError as exc:
            problems.append(f'episode {k}: {exc}')
            continue
        n = len(ep)
        total += n
        if n != int(meta['length']):
            problems.append(f'episode {k}: {n} rows, episodes.jsonl says {meta["length"]}')
        if not np.array_equal(ep.frame_index, np.arange(n)):
            problems.append(f'episode {k}: frame_index is not 0..{n - 1}')
        if n and np.max(np.abs(ep.timestamp - ep.frame_index / fps)) > 1e-4:
            problems.append(f'episode {k}: timestamps differ from frame_index / fps')
        index = ep.extra.get('index')
        if index is None or not np.array_equal(index, np.arange(next_index, next_index + n)):
            problems.append(f'episode {k}: index is not continuous from {next_index}')
        next_index += n
        if not np.all(ep.extra.get('episode_index', np.array([-1])) == k):
            problems.append(f'episode {k}: episode_index column differs')
        if not set(np.unique(ep.extra.get('task_index', np.array([], np.int64))).tolist()) <= set(ds.tasks):
            problems.append(f'episode {k}: unknown task_index')
        problems += _check_stats(k, stats.get(k), features)
        for key in ds.video_keys:
            if not decode_videos:
                continue
            shape = ds.video_shape(key)
            try:
                count = 0
                for frame in ds.frames(k, key):
                    if frame.shape != shape:
                        problems.append(f'episode {k} {key}: frame {count} is {frame.shape}, declared {shape}')
                        break
                    count += 1
            except ConfigError as exc:
                problems.append(f'episode {k} {key}: {exc}')
                continue
            decoded += count
            if count != n:
                problems.append(f'episode {k} {key}: {count} video frames for {n} rows')
    for key, want in (('total_episodes', len(ds.episodes)), ('total_frames', total),
                      ('total_videos', len(ds.episodes) * len(ds.video_keys)), ('total_tasks', len(ds.tasks))):
        if info.get(key) != want:
            problems.append(f'info.json {key} = {info.get(key)}, the files hold {want}')
    if reference is not None:
        problems += compare_with_reference(ds, LeRobotDataset(reference))
    if problems:
        raise ExportError(f'export {root} failed verification:\n- ' + '\n- '.join(problems))
    return {'episodes': len(ds.episodes), 'frames': total, 'videos': len(ds.episodes) * len(ds.video_keys),
            'decoded_frames': decoded, 'reference': str(reference) if reference else None}


def _check_stats(k: int, stats: dict[str, Any] | None, features: dict[str, Any]) -> list[str]:
    if stats is None:
        return [f'episode {k}: no entry in episodes_stats.jsonl']
    out = []
    for key, ft in features.items():
        s = stats.get(key)
        if s is None or set(s) != STAT_KEYS:
            out.append(f'episode {k}: stats of {key!r} missing or incomplete')
            continue
        if not all(np.all(np.isfinite(np.asarray(v, np.float64))) for v in s.values()):
            out.append(f'episode {k}: stats of {key!r} hold NaN or Inf')
        if np.asarray(s['count']).shape != (1,):
            out.append(f'episode {k}: stats {key!r} count is not shaped (1,)')
        shapes = {np.asarray(s[m]).shape for m in STAT_KEYS - {'count'}}
        if ft['dtype'] in ('video', 'image') and shapes != {(3, 1, 1)}:
            out.append(f'episode {k}: image stats of {key!r} are not shaped (3, 1, 1)')
    return out


def compare_with_reference(ds: LeRobotDataset, ref: LeRobotDataset) -> list[str]:
    """Return the schema differences between an export and a LeRobot-written reference dataset."""
    out = []
    if set(ds.info) != set(ref.info):
        out.append(f'info.json keys differ from the reference: {sorted(set(ds.info) ^ set(ref.info))}')
    for key in ('codebase_version', 'chunks_size', 'data_path', 'video_path'):
        if ds.info.get(key) != ref.info.get(key):
            out.append(f'info.json {key} = {ds.info.get(key)!r}, the reference has {ref.info.get(key)!r}')
    for key, rft in ref.features.items():
        ft = ds.features.get(key)
        if ft is None:
            if key.startswith('observation.images.'):
                continue  # cameras are the deployment's own
            out.append(f'feature {key!r} of the reference is missing')
            continue
        if ft['dtype'] != rft['dtype'] or len(ft['shape']) != len(rft['shape']):
            out.append(f'feature {key!r}: dtype/rank {ft["dtype"]}/{len(ft["shape"])}, reference '
                       f'{rft["dtype"]}/{len(rft["shape"])}')
        if _names_layout(ft.get('names')) != _names_layout(rft.get('names')):
            out.append(f'feature {key!r}: names laid out as {_names_layout(ft.get("names"))}, '
                       f'reference {_names_layout(rft.get("names"))}')
        if set(ft.get('info', {})) != set(rft.get('info', {})):
            out.append(f'feature {key!r}: info keys differ from the reference')
    ours, theirs = ds.schema(ds.episodes[0]['episode_index']), ref.schema(ref.episodes[0]['episode_index'])
    meta_ours = json.loads((ours.metadata or {}).get(b'huggingface', b'{}'))
    meta_ref = json.loads((theirs.metadata or {}).get(b'huggingface', b'{}'))
    if set(meta_ours) != set(meta_ref):
        out.append(f'parquet huggingface metadata: top-level keys {sorted(meta_ours)}, reference {sorted(meta_ref)}')
    hf_ours = meta_ours.get('info', {}).get('features', {})
    hf_ref = meta_ref.get('info', {}).get('features', {})
    for field in theirs:
        if field.name not in ours.names:
            continue
        mine = ours.field(field.name).type
        same = mine.equals(field.type) or (hasattr(mine, 'value_field') and hasattr(field.type, 'value_field')
                                           and mine.value_field.equals(field.type.value_field)
                                           and type(mine) is type(field.type))
        if not same:
            out.append(f'parquet column {field.name!r}: {mine}, reference {field.type}')
        if _shape_free(hf_ours.get(field.name, {})) != _shape_free(hf_ref.get(field.name, {})):
            out.append(f'parquet huggingface metadata of {field.name!r}: {hf_ours.get(field.name)}, '
                       f'reference {hf_ref.get(field.name)}')
    if hf_features(ds.features) != hf_ours:
        out.append('parquet huggingface metadata differs from info.json features')
    ref_ep = set(ref.episodes[0])
    if not ref_ep <= set(ds.episodes[0]):
        out.append(f'episodes.jsonl lacks keys {sorted(ref_ep - set(ds.episodes[0]))} of the reference')
    ref_stats = _jsonl(ref.root / 'meta' / 'episodes_stats.jsonl')[0]
    our_stats = _jsonl(ds.root / 'meta' / 'episodes_stats.jsonl')[0]
    if set(ref_stats) != set(our_stats):
        out.append('episodes_stats.jsonl keys differ from the reference')
    for key, s in ref_stats['stats'].items():
        if key in our_stats['stats'] and not set(s) <= set(our_stats['stats'][key]):
            out.append(f'episodes_stats.jsonl {key!r}: lacks the reference\'s stat names')
    return out
