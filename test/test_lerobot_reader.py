"""The LeRobot v2.1 reader on the real G1 dataset (../shared/data/g1_pick_bottle_v21)."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

from sequence_ai_ros.datasets.lerobot_reader import LeRobotDataset
from sequence_ai_ros.exceptions import ConfigError, MissingDependency


def test_metadata_matches_info_json(g1_dataset: Path) -> None:
    ds = LeRobotDataset(g1_dataset)
    info = json.loads((g1_dataset / 'meta' / 'info.json').read_text())
    assert ds.codebase_version == 'v2.1'
    assert ds.fps == 30.0
    assert ds.num_episodes == 6
    assert ds.video_keys == ['observation.images.cam_high']
    assert ds.camera_keys == ['cam_high']
    assert ds.video_shape('cam_high') == (480, 640, 3)
    assert ds.state_names == tuple(info['features']['observation.state']['names'][0])
    assert ds.action_names == ds.state_names
    assert len(ds.state_names) == 26 and ds.state_names[0] == 'kLeftShoulderPitch'
    assert ds.tasks == {0: 'Pick up the yellow bottle on the table.'}
    assert [e['episode_index'] for e in ds.episodes] == list(range(6))
    assert sum(ds.length(k) for k in range(6)) == info['total_frames'] == 2316
    stats = ds.episodes_stats
    assert sorted(stats) == list(range(6)) and len(stats[5]['action']['mean']) == 26


def test_episode_arrays(g1_dataset: Path) -> None:
    ds = LeRobotDataset(g1_dataset)
    ep = ds.episode(5)
    n = ds.length(5)
    assert len(ep) == n == 445
    assert ep.state.shape == (n, 26) and ep.state.dtype == np.float32
    assert ep.action.shape == (n, 26) and ep.action.dtype == np.float32
    assert ep.timestamp.shape == (n,) and ep.timestamp.dtype == np.float32
    assert ep.frame_index.dtype == np.int64
    np.testing.assert_array_equal(ep.frame_index, np.arange(n))
    np.testing.assert_allclose(ep.timestamp, np.arange(n) / 30.0, atol=1e-5)
    np.testing.assert_array_equal(ep.extra['episode_index'], np.full(n, 5))
    assert ep.task == 'Pick up the yellow bottle on the table.'
    assert np.all(np.isfinite(ep.state)) and np.all(np.isfinite(ep.action))
    # hands are normalised 0..1 (the dataset README), arm joints in rad
    assert ep.state[:, 14:].min() >= 0.0 and ep.state[:, 14:].max() <= 1.0
    schema = ds.schema(5)
    assert b'huggingface' in schema.metadata
    assert schema.field('observation.state').type.list_size == 26


def test_frames_are_frame_accurate(g1_dataset: Path) -> None:
    ds = LeRobotDataset(g1_dataset)
    head = list(ds.frames(1, 'cam_high', 0, 12))
    assert len(head) == 12
    assert all(f.shape == (480, 640, 3) and f.dtype == np.uint8 for f in head)
    # consecutive frames differ (the camera moves), so a one-frame shift would be caught below
    assert not np.array_equal(head[9], head[10])
    # a seek into the middle yields exactly the frames a decode from the start yields at those indices
    # (these videos have a keyframe every 2 frames: start 3 lands mid-GOP, start 10 on a keyframe)
    for start in (3, 10):
        seeked = list(ds.frames(1, 'observation.images.cam_high', start, start + 2))
        assert len(seeked) == 2
        for off, frame in enumerate(seeked):
            np.testing.assert_array_equal(frame, head[start + off])
    # the last frame has index length - 1, and the video has exactly `length` frames
    n = ds.length(1)
    tail = list(ds.frames(1, 'cam_high', n - 2))
    assert len(tail) == 2
    assert list(ds.frames(1, 'cam_high', n, n + 5)) == []


def test_bad_directory_and_episode_errors(g1_dataset: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match='not a LeRobot dataset'):
        LeRobotDataset(tmp_path)
    ds = LeRobotDataset(g1_dataset)
    with pytest.raises(ConfigError, match='no episode 6'):
        ds.episode(6)
    with pytest.raises(ConfigError, match="no camera 'cam_low'"):
        next(ds.frames(0, 'cam_low'))
    with pytest.raises(ConfigError, match='bad range'):
        next(ds.frames(0, 'cam_high', 5, 2))


def test_wrong_version_and_missing_files(g1_dataset: Path, tmp_path: Path) -> None:
    copy = tmp_path / 'ds'
    shutil.copytree(g1_dataset / 'meta', copy / 'meta')
    ds = LeRobotDataset(copy)  # metadata alone loads
    assert ds.num_episodes == 6
    with pytest.raises(ConfigError, match=r'episode_000000\.parquet is missing'):
        ds.episode(0)
    with pytest.raises(ConfigError, match=r'episode_000000\.mp4 is missing'):
        next(ds.frames(0, 'cam_high'))
    info = json.loads((copy / 'meta' / 'info.json').read_text())
    info['codebase_version'] = 'v3.0'
    (copy / 'meta' / 'info.json').write_text(json.dumps(info))
    with pytest.raises(ConfigError, match="codebase_version 'v3.0' is not supported"):
        LeRobotDataset(copy)
    (copy / 'meta' / 'info.json').write_text('{not json')
    with pytest.raises(ConfigError, match='is not JSON'):
        LeRobotDataset(copy)


def test_missing_pyav_or_pyarrow_names_the_install(g1_dataset: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ds = LeRobotDataset(g1_dataset)   # metadata needs neither
    monkeypatch.setitem(sys.modules, 'av', None)
    with pytest.raises(MissingDependency, match='pip install av'):
        next(ds.frames(0, 'cam_high'))
    monkeypatch.setitem(sys.modules, 'pyarrow.parquet', None)
    with pytest.raises(MissingDependency, match='pip install pyarrow'):
        ds.episode(0)
