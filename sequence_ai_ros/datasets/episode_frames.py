"""What the LeRobot writers (v2.1 and v3.0) share: selection, features, columns, videos and stats.

The selection, the features, one episode's columns, its camera frames streamed into a video, and its stats.

Selection rules (both versions): every committed episode that matches is tried; one that cannot be
exported (no executed action, no frame of a camera the export includes, a corrupt record file) is
skipped with its reason, and the others are written. Camera video is included whenever the chosen
episodes were captured with frames (``images=None``). No NaN or Inf can reach a row (the rows are
built from checked frames, see :mod:`.rows`) or the stats (checked before writing).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import numpy as np

from sequence_ai_ros.capture.store import CapturedEpisode
from sequence_ai_ros.datasets import stats as lerobot_stats
from sequence_ai_ros.datasets.rows import EpisodeRows, build_rows, row_images, telemetry_frames
from sequence_ai_ros.datasets.video import VCODECS, VideoWriter, video_info
from sequence_ai_ros.exceptions import CaptureError, ContractViolation, ExportError
from sequence_ai_ros.protocol import codec
from sequence_ai_ros.protocol import sequence_ai_pb2 as pb
from sequence_ai_ros.protocol.contract import Contract
from sequence_ai_ros.protocol.limits import MAX_NAME, NAME_PATTERN, printable

IMAGE_PREFIX = 'observation.images.'
DEFAULT_FEATURES = {
    'timestamp': {'dtype': 'float32', 'shape': [1], 'names': None},
    'frame_index': {'dtype': 'int64', 'shape': [1], 'names': None},
    'episode_index': {'dtype': 'int64', 'shape': [1], 'names': None},
    'index': {'dtype': 'int64', 'shape': [1], 'names': None},
    'task_index': {'dtype': 'int64', 'shape': [1], 'names': None},
}


@dataclasses.dataclass
class ExportPlan:
    """The chosen episodes and the dataset's shape: names, fps, cameras.

    :param fps: rows per second (Hz, whole).
    :param camera_keys: cameras written as videos ([] without images).
    """

    episodes: list[CapturedEpisode]
    contract: Contract
    fps: int
    camera_keys: list[str]
    skipped: list[tuple[str, str]]


def plan(chosen: list[CapturedEpisode], fps: float | None, images: bool | None) -> ExportPlan:
    """Check the chosen episodes against one contract and pick fps and cameras.

    :param fps: rows per second; None: the first episode's row rate (the policy's 1/dt by default).
    :param images: True/False, or None for "whenever the episodes were captured with frames".
    :raises ExportError: when no episode carries a contract.
    """
    found = next(((e, e.contract) for e in chosen if e.contract is not None), None)
    if found is None:
        raise ExportError('the captured episodes carry no contract; cannot name the state and action features')
    ref, contract = found
    skipped: list[tuple[str, str]] = []
    keep = []
    for e in chosen:
        c = e.contract
        if c is None or list(c.observation.state_names) != list(contract.observation.state_names) \
                or list(c.action_names) != list(contract.action_names) or c.action_space != contract.action_space:
            skipped.append((e.episode_id, f'its contract (state/action names or action space) differs from '
                                          f'episode {ref.episode_id}\'s; export it separately with --since/--until'))
            continue
        keep.append(e)
    rate = int(round(fps if fps is not None else ref.fps))
    if not 1 <= rate <= 1000:
        raise ExportError(f'fps {rate} out of range')
    with_images = [e for e in keep if e.images]
    keys: list[str] = []
    if images or (images is None and with_images):
        # the first contract's cameras, then every camera any chosen episode has frames of: an episode
        # captured without frames (a robot that sent none) must not hide the others' video
        keys = [c.key for c in contract.observation.cameras]
        for e in with_images:
            try:
                extra = _all_keys(e)
            except CaptureError:
                extra = []
            keys += [k for k in extra if k not in keys]
        # a key names a video file: one that is not a safe name (a store written before the worker checked
        # keys at its boundary) is never made into a path
        unsafe = [k for k in keys if not _safe_key(k)]
        keys = [k for k in keys if _safe_key(k)]
        if unsafe:
            skipped.append(('(cameras)', f'{len(unsafe)} camera keys are not safe names and are not exported: '
                                         f'{[printable(k)[:40] for k in unsafe[:3]]}'))
        if images and not with_images:
            raise ExportError('--images: none of the chosen episodes was captured with images')
    return ExportPlan(keep, contract, rate, keys, skipped)


def _safe_key(key: str) -> bool:
    return len(key) <= MAX_NAME and NAME_PATTERN.fullmatch(key) is not None


def _all_keys(e: CapturedEpisode) -> list[str]:
    keys: list[str] = []
    for i, frame in enumerate(telemetry_frames(e)):
        keys += [im.key for im in frame.images if im.key not in keys]
        if i > 50:
            break
    return keys


def episode_rows(e: CapturedEpisode, p: ExportPlan) -> EpisodeRows:
    """Build an episode's rows, or raise ExportError saying why it is skipped."""
    try:
        rows = build_rows(e, p.fps, p.contract.action_space, len(p.contract.observation.state_names),
                          len(p.contract.action_names), p.camera_keys)
    except CaptureError as exc:
        raise ExportError(f'unreadable: {exc}') from None
    if len(rows) == 0:
        raise ExportError('no executed action (0 rows)' + (f'; {rows.skipped_frames} bad telemetry frames skipped '
                                                           f'({rows.first_problem})' if rows.skipped_frames else ''))
    for key, ticks in rows.frame_ticks.items():
        if not len(ticks) or (ticks < 0).any():
            raise ExportError(f'no {key!r} camera frames (captured without them); a video export skips it, '
                              f'--no-images exports every episode without video')
    return rows


def features(p: ExportPlan, sizes: dict[str, tuple[int, int]], vcodec: str) -> dict[str, dict[str, Any]]:
    """The dataset's ``features`` (info.json), in LeRobot's form."""
    state_names = list(p.contract.observation.state_names)
    action_names = list(p.contract.action_names)
    feats: dict[str, dict[str, Any]] = {
        'observation.state': {'dtype': 'float32', 'shape': [len(state_names)], 'names': state_names},
        'action': {'dtype': 'float32', 'shape': [len(action_names)], 'names': action_names},
        'action.policy': {'dtype': 'float32', 'shape': [len(action_names)], 'names': action_names},
        'action.clamped': {'dtype': 'bool', 'shape': [1], 'names': None},
        'action.held': {'dtype': 'bool', 'shape': [1], 'names': None},
    }
    for key, (h, w) in sizes.items():
        feats[IMAGE_PREFIX + key] = {'dtype': 'video', 'shape': [h, w, 3], 'names': ['height', 'width', 'channels'],
                                     'info': video_info(VCODECS[vcodec].name, w, h, p.fps)}
    feats['next.success'] = {'dtype': 'bool', 'shape': [1], 'names': None}
    feats.update(json.loads(json.dumps(DEFAULT_FEATURES)))
    return feats


def columns(rows: EpisodeRows, k: int, start: int, task_index: int, fps: int,
            success: bool) -> dict[str, np.ndarray]:
    """The parquet columns of one episode (k) whose first row has global index ``start``."""
    n = len(rows)
    frame_index = np.arange(n, dtype=np.int64)
    done = np.zeros(n, bool)
    if success:
        done[-1] = True
    return {'observation.state': rows.state, 'action': rows.action, 'action.policy': rows.policy_action,
            'action.clamped': rows.clamped, 'action.held': rows.held, 'next.success': done,
            'timestamp': (frame_index / float(fps)).astype(np.float32), 'frame_index': frame_index,
            'episode_index': np.full(n, k, np.int64), 'index': np.arange(start, start + n, dtype=np.int64),
            'task_index': np.full(n, task_index, np.int64)}


def numeric_stats(cols: dict[str, np.ndarray]) -> dict[str, dict[str, np.ndarray]]:
    """The stats of every numeric column (LeRobot's keys, see :mod:`.stats`)."""
    return {key: lerobot_stats.feature_stats(v) for key, v in cols.items()}


def frame_size(e: CapturedEpisode, key: str, ticks: np.ndarray) -> tuple[int, int]:
    """(height, width) of camera ``key`` in this episode (its first used frame's header)."""
    for image, _ in row_images(e, key, ticks[:1]):
        return int(image.height), int(image.width)
    raise ExportError(f'no {key!r} frame')


def _rgb(image: pb.Image) -> np.ndarray:
    arr = codec.decode_image(image)
    return np.repeat(arr, 3, axis=2) if arr.shape[2] == 1 else arr


def write_camera(e: CapturedEpisode, key: str, ticks: np.ndarray, writer: VideoWriter,
                 size: tuple[int, int]) -> tuple[dict[str, np.ndarray], int]:
    """Stream one camera of one episode into ``writer`` (a frame per row); return (image stats, bad frames).

    A frame that cannot be decoded is replaced by the previous good frame (black before one), and counted.

    Frames are decoded in this thread, one at a time, and the stats samples (LeRobot's sampling: ~N**0.75
    frames downsampled to ~150 px) are counted as they pass (:class:`~.stats.ImageStats`): memory stays one
    frame, whatever the episode's length.
    """
    n = len(ticks)
    want = set(lerobot_stats.sample_indices(n))
    acc = lerobot_stats.ImageStats()
    bad = 0
    last = np.zeros((size[0], size[1], 3), np.uint8)
    row = 0
    for image, repeat in row_images(e, key, ticks):
        try:
            rgb = _rgb(image)
            if rgb.shape[:2] != size:
                raise ContractViolation(f'{rgb.shape[1]}x{rgb.shape[0]}, the video is {size[1]}x{size[0]}')
            last = rgb
        except ContractViolation:
            bad += 1
        for _ in range(repeat):
            writer.write(last)
            if row in want:
                acc.add(_sample(last))
            row += 1
    while row < n:   # a frame the records no longer hold: repeat the last
        writer.write(last)
        if row in want:
            acc.add(_sample(last))
        row += 1
    return acc.result(), bad


def _sample(rgb: np.ndarray) -> np.ndarray:
    """Return a stats sample of one (H, W, 3) frame: (3, h, w), downsampled as LeRobot does."""
    return lerobot_stats.downsample(rgb.transpose(2, 0, 1))
