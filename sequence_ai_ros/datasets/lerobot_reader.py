"""Read LeRobot v2.1 datasets from a local directory: metadata, per-episode arrays and camera frames.

The layout is LeRobot's ``CODEBASE_VERSION = "v2.1"`` (huggingface/lerobot ``lerobot/common/datasets/``,
``LeRobotDataset`` and ``utils.py``)::

    meta/info.json               fps, features, data_path / video_path templates, chunks_size
    meta/episodes.jsonl          one {"episode_index", "tasks", "length"} per line
    meta/tasks.jsonl             one {"task_index", "task"} per line
    meta/episodes_stats.jsonl    one {"episode_index", "stats"} per line (optional here)
    data/chunk-XXX/episode_XXXXXX.parquet                 one row per frame (pyarrow)
    videos/chunk-XXX/<video_key>/episode_XXXXXX.mp4       one video per camera and episode (PyAV)

Nothing is downloaded and nothing is cached: each call reads the files. pyarrow and PyAV are imported
lazily, so listing metadata needs neither; a missing one raises :class:`MissingDependency` with the
install hint. Every problem with the directory itself (missing file, wrong codebase_version, bad
JSON, unknown episode or camera) raises :class:`ConfigError` naming the path.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np

from sequence_ai_ros.exceptions import ConfigError, MissingDependency

SUPPORTED_VERSION = 'v2.1'
STATE_KEY = 'observation.state'
ACTION_KEY = 'action'
IMAGE_PREFIX = 'observation.images.'


def _import_pyarrow() -> tuple[Any, Any]:
    """Return ``(pyarrow, pyarrow.parquet)``, or raise MissingDependency with the install hint."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise MissingDependency(f'reading LeRobot parquet files needs pyarrow ({exc}); '
                                f'install it with: pip install pyarrow') from None
    return pa, pq


def _import_av() -> Any:
    try:
        import av
    except ImportError as exc:
        raise MissingDependency(f'decoding LeRobot videos needs PyAV ({exc}); '
                                f'install it with: pip install av') from None
    return av


@dataclasses.dataclass
class EpisodeData:
    """The tabular part of one episode (everything except video frames).

    :param index: episode_index.
    :param state: ``observation.state``, float32 (N, D) (for the G1: rad for arm joints, 0..1 for hands).
    :param action: ``action``, float32 (N, D_action), same units as the state.
    :param timestamp: float32 (N,) seconds from the episode's start (frame_index / fps).
    :param frame_index: int64 (N,), 0..N-1.
    :param task: the episode's task (instruction) text; several tasks are joined with ``' | '``.
    :param extra: the other numeric columns (``index``, ``task_index``, ...), each as an array (N, ...).
    """

    index: int
    state: np.ndarray
    action: np.ndarray
    timestamp: np.ndarray
    frame_index: np.ndarray
    task: str
    extra: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)

    def __len__(self) -> int:
        return int(self.frame_index.shape[0])


def _names(feature: dict[str, Any], dim: int, prefix: str) -> tuple[str, ...]:
    """Flatten a feature's ``names`` (a list, ``[[...]]`` or ``{"motors": [...]}``) to ``dim`` strings."""
    raw = feature.get('names')
    if isinstance(raw, dict):
        raw = [n for v in raw.values() for n in (v if isinstance(v, list) else [v])]
    if isinstance(raw, list) and len(raw) == 1 and isinstance(raw[0], list):
        raw = raw[0]
    if isinstance(raw, list) and len(raw) == dim and all(isinstance(n, str) for n in raw):
        return tuple(raw)
    return tuple(f'{prefix}_{i}' for i in range(dim))


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        raise ConfigError(f'LeRobot dataset: {path} is missing')
    rows = []
    with path.open(encoding='utf-8') as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise ConfigError(f'LeRobot dataset: {path}:{n} is not JSON ({exc})') from None
    return rows


class LeRobotDataset:
    """A LeRobot v2.1 dataset on disk, read-only.

    :param root: the dataset directory (holding ``meta/info.json``).
    :raises ConfigError: when ``root`` is not a LeRobot dataset, its ``codebase_version`` is not v2.1,
        or its metadata files are missing or malformed.
    """

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).expanduser()
        info_path = self.root / 'meta' / 'info.json'
        if not info_path.is_file():
            raise ConfigError(f'{self.root} is not a LeRobot dataset: {info_path} is missing')
        try:
            self.info: dict[str, Any] = json.loads(info_path.read_text(encoding='utf-8'))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f'LeRobot dataset: {info_path} is not JSON ({exc})') from None
        version = self.info.get('codebase_version')
        if version != SUPPORTED_VERSION:
            raise ConfigError(f'LeRobot dataset {self.root}: codebase_version {version!r} is not supported; '
                              f'this reader reads {SUPPORTED_VERSION!r}')
        for key in ('fps', 'features', 'data_path'):
            if key not in self.info:
                raise ConfigError(f'LeRobot dataset: {info_path} has no {key!r}')
        for key in (STATE_KEY, ACTION_KEY):
            if key not in self.info['features']:
                raise ConfigError(f'LeRobot dataset: {info_path} has no {key!r} feature')
        self.episodes: list[dict[str, Any]] = sorted(_read_jsonl(self.root / 'meta' / 'episodes.jsonl'),
                                                     key=lambda e: int(e['episode_index']))
        self.tasks: dict[int, str] = {int(t['task_index']): str(t['task'])
                                      for t in _read_jsonl(self.root / 'meta' / 'tasks.jsonl')}
        self._by_index = {int(e['episode_index']): e for e in self.episodes}

    # ----------------------------------------------------------------- metadata
    @property
    def codebase_version(self) -> str:
        """The format version, ``'v2.1'``."""
        return str(self.info['codebase_version'])

    @property
    def fps(self) -> float:
        """Frames per second of the data and videos (Hz); 1/fps is the action period dt (s)."""
        return float(self.info['fps'])

    @property
    def features(self) -> dict[str, dict[str, Any]]:
        """The ``features`` mapping of ``meta/info.json`` (dtype, shape, names per key)."""
        return self.info['features']

    @property
    def state_dim(self) -> int:
        """Length D of ``observation.state``."""
        return int(np.prod(self.features[STATE_KEY]['shape']))

    @property
    def action_dim(self) -> int:
        """Length of ``action``."""
        return int(np.prod(self.features[ACTION_KEY]['shape']))

    @property
    def state_names(self) -> tuple[str, ...]:
        """Names of the state dimensions (``state_<i>`` where the dataset names none)."""
        return _names(self.features[STATE_KEY], self.state_dim, 'state')

    @property
    def action_names(self) -> tuple[str, ...]:
        """Names of the action dimensions (``action_<i>`` where the dataset names none)."""
        return _names(self.features[ACTION_KEY], self.action_dim, 'action')

    @property
    def video_keys(self) -> list[str]:
        """Full feature keys of the video cameras, e.g. ``['observation.images.cam_high']``."""
        return [k for k, f in self.features.items() if f.get('dtype') == 'video']

    @property
    def camera_keys(self) -> list[str]:
        """Short camera keys, e.g. ``['cam_high']`` (the video key without ``observation.images.``)."""
        return [k.removeprefix(IMAGE_PREFIX) for k in self.video_keys]

    @property
    def num_episodes(self) -> int:
        """Number of episodes listed in ``meta/episodes.jsonl``."""
        return len(self.episodes)

    @property
    def episodes_stats(self) -> dict[int, dict[str, Any]]:
        """Per-episode feature statistics from ``meta/episodes_stats.jsonl`` ({} when the file is absent).

        :raises ConfigError: when the file is not JSON lines.
        """
        path = self.root / 'meta' / 'episodes_stats.jsonl'
        if not path.is_file():
            return {}
        return {int(row['episode_index']): row.get('stats', {}) for row in _read_jsonl(path)}

    def video_shape(self, camera_key: str) -> tuple[int, int, int]:
        """Return the declared (H, W, C) of a camera's frames.

        :raises ConfigError: for an unknown camera.
        """
        shape = self.features[self._video_key(camera_key)]['shape']
        return int(shape[0]), int(shape[1]), int(shape[2])

    def length(self, k: int) -> int:
        """Return the number of frames of episode ``k`` from ``episodes.jsonl``.

        :raises ConfigError: for an unknown episode.
        """
        return int(self._episode_meta(k)['length'])

    def task(self, k: int) -> str:
        """Return episode ``k``'s task text (several tasks joined with ``' | '``).

        :raises ConfigError: for an unknown episode.
        """
        return ' | '.join(str(t) for t in self._episode_meta(k).get('tasks', []))

    def data_path(self, k: int) -> Path:
        """Return the parquet file of episode ``k`` (from info.json's ``data_path`` template)."""
        self._episode_meta(k)
        chunk = k // int(self.info.get('chunks_size', 1000))
        return self.root / self.info['data_path'].format(episode_chunk=chunk, episode_index=k)

    def video_path(self, k: int, camera_key: str) -> Path:
        """Return the mp4 of episode ``k`` for a camera (short or full key).

        :raises ConfigError: for an unknown episode or camera, or a dataset without videos.
        """
        self._episode_meta(k)
        key = self._video_key(camera_key)
        if 'video_path' not in self.info:
            raise ConfigError(f'LeRobot dataset {self.root}: info.json has no video_path')
        chunk = k // int(self.info.get('chunks_size', 1000))
        return self.root / self.info['video_path'].format(episode_chunk=chunk, video_key=key, episode_index=k)

    # ----------------------------------------------------------------- data
    def schema(self, k: int) -> Any:
        """Return the ``pyarrow.Schema`` of episode ``k``'s parquet file, with its metadata.

        :raises ConfigError: when the file is missing.
        :raises MissingDependency: without pyarrow.
        """
        _, pq = _import_pyarrow()
        return pq.read_schema(self._existing(self.data_path(k)))

    def table(self, k: int) -> Any:
        """Return episode ``k``'s parquet file as a ``pyarrow.Table``.

        :raises ConfigError: when the file is missing.
        :raises MissingDependency: without pyarrow.
        """
        _, pq = _import_pyarrow()
        return pq.read_table(self._existing(self.data_path(k)))

    def episode(self, k: int) -> EpisodeData:
        """Return the arrays of episode ``k``.

        :raises ConfigError: for an unknown episode, a missing file, or columns whose shape differs
            from info.json.
        :raises MissingDependency: without pyarrow.
        """
        table = self.table(k)
        cols = {name: table.column(name) for name in table.column_names}
        missing = [c for c in (STATE_KEY, ACTION_KEY, 'timestamp', 'frame_index') if c not in cols]
        if missing:
            raise ConfigError(f'LeRobot dataset: {self.data_path(k)} lacks columns {missing}')
        state = self._matrix(cols.pop(STATE_KEY), self.state_dim, k, STATE_KEY)
        action = self._matrix(cols.pop(ACTION_KEY), self.action_dim, k, ACTION_KEY)
        timestamp = cols.pop('timestamp').to_numpy().astype(np.float32)
        frame_index = cols.pop('frame_index').to_numpy().astype(np.int64)
        extra = {}
        for name, col in cols.items():
            try:
                extra[name] = self._column(col)
            except (TypeError, ValueError):
                continue
        return EpisodeData(index=k, state=state, action=action, timestamp=timestamp,
                           frame_index=frame_index, task=self.task(k), extra=extra)

    def frames(self, k: int, camera_key: str, start: int = 0, stop: int | None = None) -> Iterator[np.ndarray]:
        """Decode episode ``k``'s frames ``start <= frame_index < stop`` of a camera, in order.

        Frame-accurate: each frame's index comes from its presentation time (pts * time_base * fps,
        rounded), so the n-th frame yielded is ``frame_index`` start + n. A seek lands on the keyframe
        before ``start`` and decodes forward from there.

        :param camera_key: short (``'cam_high'``) or full (``'observation.images.cam_high'``) key.
        :param start: first frame_index (>= 0).
        :param stop: one past the last frame_index; None = to the end of the video.
        :returns: uint8 (H, W, 3) RGB arrays.
        :raises ConfigError: for an unknown episode or camera, a missing video, or a video whose frames
            skip an index.
        :raises MissingDependency: without PyAV.
        """
        if start < 0 or (stop is not None and stop < start):
            raise ConfigError(f'frames: bad range start={start} stop={stop}')
        path = self._existing(self.video_path(k, camera_key))
        av = _import_av()
        fps = Fraction(self.info['fps']).limit_denominator(1001)
        with av.open(str(path)) as container:
            stream = container.streams.video[0]
            stream.thread_type = 'AUTO'
            tb = stream.time_base
            t0 = stream.start_time or 0
            if start > 0:
                container.seek(t0 + int(Fraction(start) / fps / tb), stream=stream, backward=True, any_frame=False)
            expected = None
            for frame in container.decode(stream):
                if frame.pts is None:
                    raise ConfigError(f'{path}: a frame has no timestamp; cannot index frames')
                index = round((frame.pts - t0) * tb * fps)
                if index < start:
                    continue
                if stop is not None and index >= stop:
                    return
                if expected is not None and index != expected:
                    raise ConfigError(f'{path}: frame {expected} is missing (next decoded frame is {index})')
                if expected is None and index != start:
                    raise ConfigError(f'{path}: frame {start} not found (first decoded frame is {index})')
                expected = index + 1
                yield frame.to_ndarray(format='rgb24')

    # ----------------------------------------------------------------- helpers
    def _episode_meta(self, k: int) -> dict[str, Any]:
        try:
            return self._by_index[int(k)]
        except KeyError:
            raise ConfigError(f'LeRobot dataset {self.root}: no episode {k} '
                              f'(has {sorted(self._by_index)})') from None

    def _video_key(self, camera_key: str) -> str:
        keys = self.video_keys
        for key in (camera_key, IMAGE_PREFIX + camera_key):
            if key in keys:
                return key
        raise ConfigError(f'LeRobot dataset {self.root}: no camera {camera_key!r} (has {self.camera_keys})')

    @staticmethod
    def _existing(path: Path) -> Path:
        if not path.is_file():
            raise ConfigError(f'LeRobot dataset: {path} is missing')
        return path

    @staticmethod
    def _column(col: Any) -> np.ndarray:
        arr = col.combine_chunks() if hasattr(col, 'combine_chunks') else col
        try:
            return arr.to_numpy(zero_copy_only=False)
        except TypeError:
            return np.asarray(arr.to_pylist())

    def _matrix(self, col: Any, dim: int, k: int, key: str) -> np.ndarray:
        pa, _ = _import_pyarrow()
        arr = col.combine_chunks()
        if isinstance(arr.type, (pa.FixedSizeListType, pa.ListType, pa.LargeListType)):
            flat = arr.flatten().to_numpy(zero_copy_only=False)
            out = flat.reshape(len(arr), -1) if len(arr) else np.zeros((0, dim))
        else:
            out = np.asarray(arr.to_pylist())
        if out.ndim != 2 or out.shape[1] != dim:
            raise ConfigError(f'LeRobot dataset: episode {k} column {key!r} has shape {out.shape}, '
                              f'info.json says (N, {dim})')
        return np.ascontiguousarray(out, dtype=np.float32)
