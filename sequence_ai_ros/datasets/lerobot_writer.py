"""Export captured episodes as a LeRobot dataset: v2.1 (the default) or v3.0 (:mod:`.lerobot_v3`).

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

Rows are what the robot saw and did on an exact ``k / fps`` timeline (fps = the policy's 1/dt by default),
built by :mod:`sequence_ai_ros.datasets.rows`: ``observation.state`` (float32 (D,)), ``action`` the command
that reached the controller (float32 (A,), after the robot's safety filter), ``action.policy`` the
policy's action, ``action.clamped`` / ``action.held`` (bool), ``timestamp`` = frame_index / fps (s), and
``next.success`` (bool) true on the last row of an episode labelled successful. Parquet columns carry
the ``huggingface`` schema metadata that ``datasets`` writes, so LeRobot's loader reads them with the
declared features. Episodes that cannot be exported are skipped with their reason (see
:mod:`.episode_frames`); the export streams, one episode's numbers and one or two frames in memory.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from sequence_ai_ros.capture.store import CapturedEpisode, CaptureStore
from sequence_ai_ros.datasets import stats as lerobot_stats
from sequence_ai_ros.datasets.episode_frames import (
    IMAGE_PREFIX,
    columns,
    episode_rows,
    features,
    frame_size,
    numeric_stats,
    plan,
    write_camera,
)
from sequence_ai_ros.datasets.export_common import check_out, finish, select, staging_dir, unmatched_labels
from sequence_ai_ros.datasets.parquet import arrow_schema, import_pyarrow, table
from sequence_ai_ros.datasets.video import VCODECS, VideoWriter
from sequence_ai_ros.exceptions import ExportError
from sequence_ai_ros.protocol.limits import json_safe

CODEBASE_VERSION = 'v2.1'
CHUNKS_SIZE = 1000
DATA_PATH = 'data/chunk-{episode_chunk:03d}/episode_{episode_index:06d}.parquet'
VIDEO_PATH = 'videos/chunk-{episode_chunk:03d}/{video_key}/episode_{episode_index:06d}.mp4'


class V21Layout:
    """Writes the v2.1 files: a parquet file and a video per episode, JSON Lines metadata."""

    def __init__(self, root: Path, vcodec: str, fps: int) -> None:
        self.root, self.vcodec, self.fps = root, vcodec, fps
        self.schema: Any = None
        self.episodes: list[dict[str, Any]] = []
        self.stats: list[dict[str, Any]] = []

    def begin(self, features: dict[str, dict[str, Any]]) -> None:
        """Fix the features (names as LeRobot v2.1 nests them: ``[names]``)."""
        self.features = json.loads(json.dumps(features))
        for ft in self.features.values():
            if ft['names'] and ft['dtype'] != 'video':
                ft['names'] = [ft['names']]
            if ft['dtype'] == 'video':
                ft['names'] = ['height', 'width', 'channel']
        self.schema = arrow_schema(self.features)

    def add(self, k: int, e: CapturedEpisode, rows: Any, cols: dict[str, np.ndarray], sizes: dict,
            stats: dict[str, dict[str, np.ndarray]], meta: dict[str, Any]) -> int:
        """Write episode k; return the frames that could not be decoded."""
        _, pq = import_pyarrow()
        path = self.root / DATA_PATH.format(episode_chunk=k // CHUNKS_SIZE, episode_index=k)
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(table(cols, self.schema), path)
        bad = 0
        for key, size in sizes.items():
            video_key = IMAGE_PREFIX + key
            vpath = self.root / VIDEO_PATH.format(episode_chunk=k // CHUNKS_SIZE, video_key=video_key, episode_index=k)
            writer = VideoWriter(vpath, size[1], size[0], self.fps, self.vcodec)
            try:
                stats[video_key], nbad = write_camera(e, key, rows.frame_ticks[key], writer, size)
                writer.close()
            except BaseException:
                writer.abort()
                raise
            bad += nbad
        self.episodes.append(meta)
        self.stats.append({'episode_index': k, 'stats': lerobot_stats.to_json(stats)})
        return bad

    def finish(self, info: dict[str, Any], tasks: dict[str, int]) -> None:
        """Write meta/."""
        k = info['total_episodes']
        info = {'codebase_version': CODEBASE_VERSION, 'robot_type': info['robot_type'], 'total_episodes': k,
                'total_frames': info['total_frames'], 'total_tasks': len(tasks),
                'total_videos': info['total_videos'], 'total_chunks': (k - 1) // CHUNKS_SIZE + 1,
                'chunks_size': CHUNKS_SIZE, 'fps': self.fps, 'splits': {'train': f'0:{k}'},
                'data_path': DATA_PATH, 'video_path': VIDEO_PATH, 'features': self.features}
        (self.root / 'meta').mkdir(exist_ok=True)
        (self.root / 'meta' / 'info.json').write_text(json.dumps(info, indent=4, ensure_ascii=False) + '\n')
        _jsonl(self.root / 'meta' / 'episodes.jsonl', self.episodes)
        _jsonl(self.root / 'meta' / 'tasks.jsonl', [{'task_index': i, 'task': t} for t, i in tasks.items()])
        _jsonl(self.root / 'meta' / 'episodes_stats.jsonl', self.stats)


def export_lerobot(store: CaptureStore, out: str | Path, *, since: float | None = None, until: float | None = None,
                   labelled_only: bool = False, images: bool | None = None, vcodec: str = 'av1',
                   force: bool = False, robot_type: str | None = None, progress: bool | None = None,
                   fps: float | None = None, lerobot_version: str = '2.1') -> dict[str, Any]:
    """Write the store's committed episodes as a LeRobot dataset at ``out``.

    :param since: episodes started at or after this wall time (s since the epoch).
    :param until: episodes started before this wall time.
    :param labelled_only: labelled episodes only.
    :param images: camera videos: None (default) whenever the episodes were captured with frames.
    :param vcodec: ``av1`` (libsvtav1, LeRobot's default settings) or ``h264`` (libx264, ultrafast).
    :param force: replace an earlier export at ``out``.
    :param robot_type: info.json's ``robot_type`` (null when None).
    :param progress: show a tqdm bar (None: only on a terminal).
    :param fps: rows per second (Hz); None: the episodes' row rate (the policy's 1/dt unless capture set one).
    :param lerobot_version: ``2.1`` (LeRobot <= 0.3) or ``3.0`` (LeRobot >= 0.4).
    :returns: ``{'out', 'episodes', 'frames', 'skipped': [(episode_id, why)], 'notes': [...], 'videos',
        'fps', 'vcodec', 'version', 'unmatched_labels': [ids of labels matching no episode the store saw]}``.
    :raises ExportError: for a non-empty ``out`` without ``force``, no matching or no exportable episode,
        or videos that cannot be encoded.
    """
    if vcodec not in VCODECS:
        raise ExportError(f'unknown --vcodec {vcodec!r}; choose one of {sorted(VCODECS)}')
    if lerobot_version not in ('2.1', '3.0'):
        raise ExportError(f'unknown LeRobot dataset version {lerobot_version!r}; choose 2.1 or 3.0')
    out = check_out(out, force)
    import_pyarrow()  # fail early, before any work, when pyarrow is missing
    p = plan(select(store, since, until, labelled_only), fps, images)
    skipped, notes = list(p.skipped), []
    tasks: dict[str, int] = {}
    tmp = staging_dir(out)
    try:
        from tqdm import tqdm

        if lerobot_version == '3.0':
            from sequence_ai_ros.datasets.lerobot_v3 import V30Layout
            layout: Any = V30Layout(tmp, vcodec, p.fps)
        else:
            layout = V21Layout(tmp, vcodec, p.fps)
        bar = tqdm(total=len(p.episodes), unit='episode', desc=f'export {store.deployment}',
                   disable=(None if progress is None else not progress))
        index = k = 0
        sizes: dict[str, tuple[int, int]] | None = None
        for e in p.episodes:   # one episode's numbers in memory at a time
            bar.update(1)
            try:
                rows = episode_rows(e, p)
                mine = {key: frame_size(e, key, rows.frame_ticks[key]) for key in p.camera_keys}
                if sizes is not None and mine != sizes:
                    raise ExportError(f'camera sizes {mine} differ from the first episode\'s {sizes}')
            except ExportError as exc:
                skipped.append((e.episode_id, str(exc)))
                continue
            if sizes is None:
                sizes = mine
                layout.begin(features(p, sizes, vcodec))
            if rows.skipped_frames:
                notes.append(f'episode {e.episode_id}: {rows.skipped_frames} telemetry frames failed the contract '
                             f'check and were left out ({rows.first_problem})')
            if rows.stopped:
                notes.append(f'episode {e.episode_id}: {rows.stopped}')
            task_index = tasks.setdefault(e.instruction, len(tasks))
            success = bool(e.label is not None and e.label['success'])
            cols = columns(rows, k, index, task_index, p.fps, success)
            stats = numeric_stats(cols)
            meta: dict[str, Any] = {'episode_index': k, 'tasks': [e.instruction], 'length': len(rows)}
            if e.label is not None:
                meta['success'] = bool(e.label['success'])
            meta.update({'episode_id': e.episode_id, 'reason': e.reason})
            bad = layout.add(k, e, rows, cols, sizes, stats, meta)
            if bad:
                notes.append(f'episode {e.episode_id}: {bad} camera frames could not be decoded and repeat the '
                             f'previous frame')
            if not lerobot_stats.finite(stats):   # unreachable by construction; never write NaN
                raise ExportError(f'episode {e.episode_id}: non-finite statistics')
            index += len(rows)
            k += 1
        bar.close()
        if k == 0:
            raise ExportError(f'no exportable episodes (skipped: {skipped})')
        layout.finish({'robot_type': robot_type, 'total_episodes': k, 'total_frames': index,
                       'total_videos': k * len(p.camera_keys)}, tasks)
        finish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    stray, stray_notes = unmatched_labels(store)
    return {'out': str(out), 'episodes': k, 'frames': index, 'skipped': skipped, 'notes': notes + stray_notes,
            'videos': k * len(p.camera_keys), 'fps': p.fps, 'vcodec': vcodec if p.camera_keys else None,
            'version': lerobot_version, 'unmatched_labels': stray}


def _jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    with path.open('w', encoding='utf-8') as f:
        for row in rows:
            f.write(json.dumps(json_safe(row), ensure_ascii=False, allow_nan=False) + '\n')
