"""Export captured episodes as a LeRobot v2.1 dataset, in the layout LeRobot itself writes.

The layout, keys and dtypes are those of LeRobot's ``CODEBASE_VERSION = "v2.1"`` (huggingface/lerobot
``datasets/lerobot_dataset.py``, ``datasets/utils.py``), checked against ``../shared/data/g1_pick_bottle_v21``
(written by LeRobot tooling)::

    meta/info.json              codebase_version "v2.1", fps (the capture fps), features, templates, totals
    meta/episodes.jsonl         {"episode_index", "tasks", "length"} + "success" when labelled
                                (+ "episode_id", "reason": the capture's id and end reason)
    meta/tasks.jsonl            {"task_index", "task"}: the distinct instructions
    meta/episodes_stats.jsonl   min/max/mean/std/count per feature (see lerobot_stats.py)
    data/chunk-XXX/episode_XXXXXX.parquet                 one row per telemetry frame
    videos/chunk-XXX/observation.images.<key>/episode_XXXXXX.mp4   (with images)

Rows are the telemetry frames, i.e. what the robot actually did at the capture fps: ``observation.state``
is the measured state (float32 (D,), names from the contract), ``action`` the executed action (float32
(A,); before the first action, the measured state for absolute action spaces, zeros otherwise),
``timestamp`` = frame_index / fps (s), and ``next.success`` (bool) is true on the last frame of an
episode labelled successful. Parquet columns carry the ``huggingface`` schema metadata that
``datasets`` writes, so LeRobot's loader reads them with the declared features.
"""

from __future__ import annotations

import json
import shutil
import sys
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from sequence_ai_ros.capture.store import CapturedEpisode, CaptureStore
from sequence_ai_ros.datasets import stats as lerobot_stats
from sequence_ai_ros.datasets.export_common import check_out, finish, select, staging_dir
from sequence_ai_ros.datasets.video import VCODECS, VideoWriter, video_info
from sequence_ai_ros.exceptions import CaptureError, ContractViolation, ExportError, MissingDependency
from sequence_ai_ros.protocol import codec
from sequence_ai_ros.protocol import sequence_ai_pb2 as pb
from sequence_ai_ros.protocol.contract import Contract

CODEBASE_VERSION = 'v2.1'
CHUNKS_SIZE = 1000
DATA_PATH = 'data/chunk-{episode_chunk:03d}/episode_{episode_index:06d}.parquet'
VIDEO_PATH = 'videos/chunk-{episode_chunk:03d}/{video_key}/episode_{episode_index:06d}.mp4'
IMAGE_PREFIX = 'observation.images.'
#: JPEG decoding runs in this many threads ahead of the encoder, at most DECODE_AHEAD frames ahead.
DECODE_THREADS = 2
DECODE_AHEAD = 8
DEFAULT_FEATURES = {
    'timestamp': {'dtype': 'float32', 'shape': [1], 'names': None},
    'frame_index': {'dtype': 'int64', 'shape': [1], 'names': None},
    'episode_index': {'dtype': 'int64', 'shape': [1], 'names': None},
    'index': {'dtype': 'int64', 'shape': [1], 'names': None},
    'task_index': {'dtype': 'int64', 'shape': [1], 'names': None},
}


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


def _camera_keys(contract: Contract, episode: CapturedEpisode) -> list[str]:
    """The cameras to export: the contract's, then any other camera the robot streamed in telemetry.

    A policy may ignore a camera (the ``ridge`` default uses none) while the robot still has it; the
    dataset keeps it, since the next policy trained on the data may need it.
    """
    keys = [c.key for c in contract.observation.cameras]
    for _, frame in episode.telemetry():
        keys += [im.key for im in frame.images if im.key not in keys]
    return keys


class CapturedFrames:
    """One captured episode turned into frame arrays (images kept encoded until written)."""

    def __init__(self, ep: CapturedEpisode, state_dim: int, action_dim: int, absolute: bool,
                 camera_keys: list[str]) -> None:
        self.source = ep
        frames = [f for _, f in ep.telemetry()]
        n = len(frames)
        self.state = np.zeros((n, state_dim), np.float32)
        self.action = np.zeros((n, action_dim), np.float32)
        last = None
        for i, frame in enumerate(frames):
            try:
                self.state[i] = codec.from_tensor(frame.state, what='state', dtype='float32', ndim=1)
                if frame.HasField('action'):
                    last = codec.from_tensor(frame.action, what='action', dtype='float32', ndim=1)
            except (ContractViolation, ValueError) as exc:
                raise ExportError(f'episode {ep.episode_id}: telemetry frame {i}: {exc}') from None
            if last is not None:
                self.action[i] = last
            elif absolute and action_dim == state_dim:
                self.action[i] = self.state[i]
        self.images: dict[str, list[pb.Image]] = {}
        for key in camera_keys:
            seq: list[pb.Image | None] = []
            for frame in frames:
                img = next((im for im in frame.images if im.key == key), None)
                seq.append(img if img is not None else (seq[-1] if seq else None))
            first = next((im for im in seq if im is not None), None)
            if first is None:
                raise ExportError(f'episode {ep.episode_id} has no {key!r} frames (captured without images?); '
                                  f'export without --images or select other episodes with --since/--until')
            self.images[key] = [im if im is not None else first for im in seq]

    def __len__(self) -> int:
        return len(self.state)


def _rgb(image: pb.Image) -> np.ndarray:
    arr = codec.decode_image(image)
    return np.repeat(arr, 3, axis=2) if arr.shape[2] == 1 else arr


def export_lerobot(store: CaptureStore, out: str | Path, *, since: float | None = None, until: float | None = None,
                   labelled_only: bool = False, images: bool = False, vcodec: str = 'av1', force: bool = False,
                   robot_type: str | None = None, progress: bool | None = None) -> dict[str, Any]:
    """Write the store's committed episodes as a LeRobot v2.1 dataset at ``out``.

    :param since: episodes started at or after this wall time (s since the epoch).
    :param until: episodes started before this wall time.
    :param labelled_only: labelled episodes only.
    :param images: write camera videos (episodes must have been captured with images).
    :param vcodec: ``av1`` (libsvtav1, LeRobot's default settings) or ``h264`` (libx264, ultrafast).
    :param force: replace an earlier export at ``out``.
    :param robot_type: info.json's ``robot_type`` (null when None).
    :param progress: show a tqdm bar (None: only on a terminal).
    :returns: ``{'out', 'episodes', 'frames', 'skipped': [(episode_id, why)], 'videos', 'fps'}``.
    :raises ExportError: for a non-empty ``out`` without ``force``, no matching episodes, episodes whose
        contracts, fps or camera sizes differ, or videos that cannot be encoded.
    """
    if vcodec not in VCODECS:
        raise ExportError(f'unknown --vcodec {vcodec!r}; choose one of {sorted(VCODECS)}')
    out = check_out(out, force)
    import_pyarrow()  # fail early, before any work, when pyarrow is missing
    chosen = select(store, since, until, labelled_only)
    ref = next((e for e in chosen if e.contract is not None), None)
    if ref is None:
        raise ExportError('the captured episodes carry no contract; cannot name the state and action features')
    contract = ref.contract
    state_names = list(contract.observation.state_names)
    action_names = list(contract.action_names)
    camera_keys = _camera_keys(contract, ref) if images else []
    fps = ref.fps
    for e in chosen:
        c = e.contract
        if c is None or list(c.observation.state_names) != state_names or list(c.action_names) != action_names:
            raise ExportError(f'episode {e.episode_id} has a different contract (state/action names) than '
                              f'episode {ref.episode_id}; export them separately with --since/--until')
        if e.fps != fps:
            raise ExportError(f'episode {e.episode_id} was captured at {e.fps:g} fps, episode {ref.episode_id} '
                              f'at {fps:g}; a dataset has one fps: export them separately with --since/--until')
        if images and not e.images:
            raise ExportError(f'episode {e.episode_id} was captured without images; export without --images '
                              f'or select other episodes with --since/--until')
    skipped: list[tuple[str, str]] = []
    tasks: dict[str, int] = {}
    tmp = staging_dir(out)
    try:
        from tqdm import tqdm

        bar = tqdm(total=sum(e.frames for e in chosen), unit='frame', desc=f'export {store.deployment}',
                   disable=(None if progress is None else not progress))
        index = k = 0
        episodes_meta, stats_meta = [], []
        sizes: dict[str, tuple[int, int]] = {}
        schema = features = None
        for e in chosen:  # one episode in memory at a time
            try:
                ep = CapturedFrames(e, len(state_names), len(action_names), contract.action_space.is_absolute, camera_keys)
            except CaptureError as exc:
                skipped.append((e.episode_id, str(exc)))
                print(f'warning: skipping episode {e.episode_id}: {exc}', file=sys.stderr)
                bar.update(e.frames)
                continue
            if len(ep) == 0:
                skipped.append((e.episode_id, 'no telemetry frames'))
                continue
            if features is None:
                sizes = {key: tuple(_rgb(ep.images[key][0]).shape[:2]) for key in camera_keys}
                features = _features(state_names, action_names, sizes, int(fps), vcodec)
                schema = arrow_schema(features)
            task_index = tasks.setdefault(ep.source.instruction, len(tasks))
            meta, stats = _write_episode(tmp, k, ep, index, task_index, schema, sizes, int(fps), vcodec, bar)
            episodes_meta.append(meta)
            stats_meta.append({'episode_index': k, 'stats': lerobot_stats.to_json(stats)})
            index += len(ep)
            k += 1
        bar.close()
        if k == 0:
            raise ExportError(f'no exportable episodes (skipped: {skipped})')
        info = {'codebase_version': CODEBASE_VERSION, 'robot_type': robot_type, 'total_episodes': k,
                'total_frames': index, 'total_tasks': len(tasks), 'total_videos': k * len(camera_keys),
                'total_chunks': (k - 1) // CHUNKS_SIZE + 1, 'chunks_size': CHUNKS_SIZE, 'fps': int(fps),
                'splits': {'train': f'0:{k}'}, 'data_path': DATA_PATH, 'video_path': VIDEO_PATH,
                'features': features}
        (tmp / 'meta').mkdir()
        (tmp / 'meta' / 'info.json').write_text(json.dumps(info, indent=4, ensure_ascii=False) + '\n')
        _jsonl(tmp / 'meta' / 'episodes.jsonl', episodes_meta)
        _jsonl(tmp / 'meta' / 'tasks.jsonl', [{'task_index': i, 'task': t} for t, i in tasks.items()])
        _jsonl(tmp / 'meta' / 'episodes_stats.jsonl', stats_meta)
        finish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {'out': str(out), 'episodes': k, 'frames': index, 'skipped': skipped,
            'videos': k * len(camera_keys), 'fps': int(fps), 'vcodec': vcodec if camera_keys else None}


def _write_episode(root: Path, k: int, ep: CapturedFrames, index: int, task_index: int, schema: Any,
                   sizes: dict[str, tuple[int, int]], fps: int, vcodec: str, bar: Any) -> tuple[dict, dict]:
    """Write episode k's parquet file and videos; return its episodes.jsonl entry and its stats (arrays)."""
    pa, pq = import_pyarrow()
    n = len(ep)
    label = ep.source.label
    success = np.zeros(n, bool)
    if label is not None and label['success']:
        success[-1] = True
    frame_index = np.arange(n, dtype=np.int64)
    timestamp = frame_index / float(fps)
    columns = {'observation.state': ep.state, 'action': ep.action, 'next.success': success,
               'timestamp': timestamp.astype(np.float32), 'frame_index': frame_index,
               'episode_index': np.full(n, k, np.int64), 'index': np.arange(index, index + n, dtype=np.int64),
               'task_index': np.full(n, task_index, np.int64)}
    arrays = []
    for field in schema:
        data = columns[field.name]
        if data.ndim == 2:
            arrays.append(pa.FixedSizeListArray.from_arrays(pa.array(data.reshape(-1)), type=field.type))
        else:
            arrays.append(pa.array(data, type=field.type))
    path = root / DATA_PATH.format(episode_chunk=k // CHUNKS_SIZE, episode_index=k)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_arrays(arrays, schema=schema), path)
    stats = {'observation.state': lerobot_stats.feature_stats(ep.state),
             'action': lerobot_stats.feature_stats(ep.action)}
    for j, key in enumerate(sizes):
        stats[IMAGE_PREFIX + key] = _write_video(root, k, key, ep.images[key], fps, vcodec, sizes[key],
                                                 bar if j == 0 else None)
    if not sizes:
        bar.update(n)
    stats.update({'next.success': lerobot_stats.feature_stats(success),
                  'timestamp': lerobot_stats.feature_stats(timestamp)})
    stats.update({key: lerobot_stats.feature_stats(columns[key])
                  for key in ('frame_index', 'episode_index', 'index', 'task_index')})
    meta: dict[str, Any] = {'episode_index': k, 'tasks': [ep.source.instruction], 'length': n}
    if label is not None:
        meta['success'] = bool(label['success'])
    meta.update({'episode_id': ep.source.episode_id, 'reason': ep.source.reason})
    return meta, stats


def _features(state_names: list[str], action_names: list[str], sizes: dict[str, tuple[int, int]], fps: int,
              vcodec: str) -> dict[str, dict[str, Any]]:
    feats: dict[str, dict[str, Any]] = {
        'observation.state': {'dtype': 'float32', 'shape': [len(state_names)], 'names': [state_names]},
        'action': {'dtype': 'float32', 'shape': [len(action_names)], 'names': [action_names]},
    }
    for key, (h, w) in sizes.items():
        feats[IMAGE_PREFIX + key] = {'dtype': 'video', 'shape': [h, w, 3], 'names': ['height', 'width', 'channel'],
                                     'info': video_info(VCODECS[vcodec].name, w, h, fps)}
    feats['next.success'] = {'dtype': 'bool', 'shape': [1], 'names': None}
    feats.update(json.loads(json.dumps(DEFAULT_FEATURES)))
    return feats


def _write_video(root: Path, k: int, key: str, images: list[pb.Image], fps: float, vcodec: str,
                 size: tuple[int, int], bar: Any) -> dict[str, np.ndarray]:
    """Encode one camera of one episode; return its image stats (sampled as LeRobot samples)."""
    video_key = IMAGE_PREFIX + key
    path = root / VIDEO_PATH.format(episode_chunk=k // CHUNKS_SIZE, video_key=video_key, episode_index=k)
    height, width = size
    writer = VideoWriter(path, width, height, int(fps), vcodec)
    wanted = lerobot_stats.sample_indices(len(images))
    want = set(wanted)
    samples: dict[int, np.ndarray] = {}
    try:
        for i, rgb in enumerate(_decoded(images, video_key, k)):
            writer.write(rgb)
            if i in want:
                samples[i] = lerobot_stats.downsample(rgb.transpose(2, 0, 1))
            if bar is not None:
                bar.update(1)
        writer.close()
    except BaseException:
        writer.abort()
        raise
    return lerobot_stats.image_stats(np.stack([samples[i] for i in wanted]))


def _decode(image: pb.Image, video_key: str, k: int, i: int) -> np.ndarray:
    try:
        return _rgb(image)
    except ContractViolation as exc:
        raise ExportError(f'{video_key} frame {i} of episode {k}: {exc}') from None


def _decoded(images: list[pb.Image], video_key: str, k: int) -> Iterator[np.ndarray]:
    """Yield the frames as RGB, in order, decoded ahead by DECODE_THREADS named threads (Pillow frees the GIL).

    At most DECODE_AHEAD frames are decoded ahead, bounding memory; the pool is joined when this ends.
    """
    with ThreadPoolExecutor(max_workers=DECODE_THREADS, thread_name_prefix='export-decode') as pool:
        ahead: deque[Future] = deque()
        try:
            for i, image in enumerate(images):
                ahead.append(pool.submit(_decode, image, video_key, k, i))
                if len(ahead) >= DECODE_AHEAD:
                    yield ahead.popleft().result()
            while ahead:
                yield ahead.popleft().result()
        finally:
            for fut in ahead:
                fut.cancel()


def _jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    with path.open('w', encoding='utf-8') as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + '\n')
