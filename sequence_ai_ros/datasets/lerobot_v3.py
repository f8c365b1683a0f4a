"""The LeRobot v3.0 layout of an export (``seq policy data export --lerobot-version 3.0``).

As LeRobot 0.6.1 writes it (huggingface/lerobot ``datasets/utils.py``, ``dataset_metadata.py``,
``dataset_writer.py``; checked by loading our exports with ``LeRobotDataset(repo_id, root=...)``)::

    meta/info.json                                   codebase_version "v3.0", fps, features (flat names),
                                                     data_path/video_path templates, file size limits
    meta/stats.json                                  the dataset's stats (aggregated, see stats.aggregate)
    meta/tasks.parquet                               task_index, indexed by task (pandas metadata)
    meta/episodes/chunk-000/file-000.parquet         one row per episode: episode_index, tasks, length,
                                                     data/chunk_index, data/file_index, dataset_from_index,
                                                     dataset_to_index, videos/<key>/{chunk_index, file_index,
                                                     from_timestamp, to_timestamp}, stats/<feature>/<stat>,
                                                     meta/episodes/{chunk_index, file_index}
                                                     (+ episode_id, reason, success: ours)
    data/chunk-000/file-NNN.parquet                  the rows of many episodes
    videos/<key>/chunk-000/file-NNN.mp4              many episodes' frames back to back

Files roll over to the next ``file-NNN`` past ``data_files_size_in_mb`` / ``video_files_size_in_mb``
(LeRobot's 100 / 200 MB), at episode boundaries, and to the next chunk every 1,000 files. Everything
streams: rows go to an open ``ParquetWriter`` and frames to open video encoders, episode by episode.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from sequence_ai_ros.datasets import stats as lerobot_stats
from sequence_ai_ros.datasets.episode_frames import IMAGE_PREFIX, write_camera
from sequence_ai_ros.datasets.parquet import arrow_schema, import_pyarrow, table
from sequence_ai_ros.datasets.video import VideoWriter

CODEBASE_VERSION = 'v3.0'
CHUNKS_SIZE = 1000
DATA_FILE_MB = 100
VIDEO_FILE_MB = 200
DATA_PATH = 'data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet'
VIDEO_PATH = 'videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4'
EPISODES_PATH = 'meta/episodes/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet'


def _loc(file_number: int) -> tuple[int, int]:
    return file_number // CHUNKS_SIZE, file_number % CHUNKS_SIZE


class V30Layout:
    """Writes the v3.0 files (see the module docstring)."""

    def __init__(self, root: Path, vcodec: str, fps: int) -> None:
        self.root, self.vcodec, self.fps = root, vcodec, fps
        self.episodes: list[dict[str, Any]] = []
        self.all_stats: list[dict[str, dict[str, np.ndarray]]] = []
        self._data_file = 0
        self._data_writer: Any = None
        self._videos: dict[str, tuple[int, VideoWriter]] = {}   # key -> (file number, writer)

    def begin(self, features: dict[str, dict[str, Any]]) -> None:
        """Fix the features (names flat, as v3.0 writes them)."""
        self.features = json.loads(json.dumps(features))
        for ft in self.features.values():
            if ft['dtype'] == 'video':
                ft['names'] = ['height', 'width', 'channels']
        self.schema = arrow_schema(self.features)

    def _data(self) -> tuple[Any, int]:
        _, pq = import_pyarrow()
        path = self.root / DATA_PATH.format(chunk_index=_loc(self._data_file)[0],
                                            file_index=_loc(self._data_file)[1])
        if self._data_writer is not None and path.exists() and path.stat().st_size > DATA_FILE_MB * 1e6:
            self._data_writer.close()
            self._data_writer = None
            self._data_file += 1
            path = self.root / DATA_PATH.format(chunk_index=_loc(self._data_file)[0],
                                                file_index=_loc(self._data_file)[1])
        if self._data_writer is None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._data_writer = pq.ParquetWriter(path, self.schema)
        return self._data_writer, self._data_file

    def _video(self, key: str, size: tuple[int, int]) -> tuple[VideoWriter, int]:
        number, writer = self._videos.get(key, (0, None))
        if writer is not None and writer.path.exists() and writer.path.stat().st_size > VIDEO_FILE_MB * 1e6:
            writer.close()
            number, writer = number + 1, None
        if writer is None:
            chunk, file = _loc(number)
            path = self.root / VIDEO_PATH.format(video_key=IMAGE_PREFIX + key, chunk_index=chunk, file_index=file)
            writer = VideoWriter(path, size[1], size[0], self.fps, self.vcodec)
            self._videos[key] = (number, writer)
        return writer, number

    def add(self, k: int, e: Any, rows: Any, cols: dict[str, np.ndarray], sizes: dict,
            stats: dict[str, dict[str, np.ndarray]], meta: dict[str, Any]) -> int:
        """Append episode k to the open data and video files; return the frames that could not be decoded."""
        writer, number = self._data()
        writer.write_table(table(cols, self.schema))
        chunk, file = _loc(number)
        start = int(cols['index'][0])
        row: dict[str, Any] = {'episode_index': k, 'tasks': meta['tasks'], 'length': meta['length'],
                               'data/chunk_index': chunk, 'data/file_index': file,
                               'dataset_from_index': start, 'dataset_to_index': start + meta['length']}
        bad = 0
        for key, size in sizes.items():
            video, vnumber = self._video(key, size)
            begin = video.count / self.fps
            try:
                stats[IMAGE_PREFIX + key], nbad = write_camera(e, key, rows.frame_ticks[key], video, size)
            except BaseException:
                video.abort()
                self._videos.pop(key, None)
                raise
            bad += nbad
            vchunk, vfile = _loc(vnumber)
            row.update({f'videos/{IMAGE_PREFIX + key}/chunk_index': vchunk,
                        f'videos/{IMAGE_PREFIX + key}/file_index': vfile,
                        f'videos/{IMAGE_PREFIX + key}/from_timestamp': begin,
                        f'videos/{IMAGE_PREFIX + key}/to_timestamp': video.count / self.fps})
        for feature, s in stats.items():
            for name, value in s.items():
                row[f'stats/{feature}/{name}'] = np.asarray(value).tolist()
        row.update({'meta/episodes/chunk_index': 0, 'meta/episodes/file_index': 0,
                    'episode_id': meta['episode_id'], 'reason': meta['reason'], 'success': meta.get('success')})
        self.episodes.append(row)
        self.all_stats.append(stats)
        return bad

    def finish(self, info: dict[str, Any], tasks: dict[str, int]) -> None:
        """Close the open files; write meta/."""
        pa, pq = import_pyarrow()
        if self._data_writer is not None:
            self._data_writer.close()
        for _, video in self._videos.values():
            video.close()
        meta = self.root / 'meta'
        (meta / 'episodes' / 'chunk-000').mkdir(parents=True, exist_ok=True)
        k = info['total_episodes']
        out = {'codebase_version': CODEBASE_VERSION, 'robot_type': info['robot_type'], 'total_episodes': k,
               'total_frames': info['total_frames'], 'total_tasks': len(tasks), 'chunks_size': CHUNKS_SIZE,
               'data_files_size_in_mb': DATA_FILE_MB, 'video_files_size_in_mb': VIDEO_FILE_MB, 'fps': self.fps,
               'splits': {'train': f'0:{k}'}, 'data_path': DATA_PATH,
               'video_path': VIDEO_PATH if self._videos else None, 'features': self.features}
        (meta / 'info.json').write_text(json.dumps(out, indent=4, ensure_ascii=False) + '\n')
        agg = lerobot_stats.aggregate(self.all_stats)
        (meta / 'stats.json').write_text(json.dumps(lerobot_stats.to_json(agg), indent=4) + '\n')
        episodes_path = self.root / EPISODES_PATH.format(chunk_index=0, file_index=0)
        pq.write_table(pa.Table.from_pylist(self.episodes), episodes_path)
        names = list(tasks)
        pandas_meta = {'index_columns': ['task'], 'column_indexes': [
            {'name': None, 'field_name': None, 'pandas_type': 'unicode', 'numpy_type': 'object',
             'metadata': {'encoding': 'UTF-8'}}],
            'columns': [{'name': 'task_index', 'field_name': 'task_index', 'pandas_type': 'int64',
                         'numpy_type': 'int64', 'metadata': None},
                        {'name': 'task', 'field_name': 'task', 'pandas_type': 'unicode', 'numpy_type': 'object',
                         'metadata': None}],
            'attributes': {}, 'creator': {'library': 'pyarrow', 'version': pa.__version__},
            'pandas_version': '2.3.3'}
        tasks_table = pa.table({'task_index': pa.array([tasks[t] for t in names], pa.int64()),
                                'task': pa.array(names, pa.string())})
        tasks_table = tasks_table.replace_schema_metadata({'pandas': json.dumps(pandas_meta)})
        pq.write_table(tasks_table, meta / 'tasks.parquet')
