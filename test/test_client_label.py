"""label() tells the caller whether the worker that stored the label ran the episode; exports list the strays.

Real workers on loopback with capture on (``test/policies/client_latency.py``). A worker keeps a label for an
episode it never ran on purpose (a fleet whose replica was stopped: the label is merged by episode id when the
replicas' stores are exported together), so such a label is stored, and the caller is told so: a mistyped id
is no longer a silent ok. An export (one store, or several read as one) lists the labels no store ran.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from doubles import CountingRobot

from sequence_ai_ros.capture.settings import CaptureSettings, save_settings
from sequence_ai_ros.capture.store import CaptureStore
from sequence_ai_ros.capture.store_set import StoreSet
from sequence_ai_ros.client import LabelResult, connect
from sequence_ai_ros.datasets.jsonl_writer import export_jsonl
from sequence_ai_ros.exceptions import CaptureError

LAT = dict(isolation='none', mean_s=0.002, dt=0.02, chunk_length=20)


def _capturing(root: Path, serve, **kw) -> str:
    save_settings(root / 'lat', CaptureSettings(rate=1.0, enabled=True))
    return serve(capture_root=root, **LAT, **kw)


def test_a_label_for_an_episode_the_worker_never_ran_is_stored_and_reported_as_unmatched(tmp_path, serve, caplog):
    root = tmp_path / 'capture'
    endpoint = _capturing(root, serve)
    robot = CountingRobot()
    with connect('lat', endpoint=endpoint) as policy:
        out = policy.run(robot.observe, robot.act, max_actions=10)
        ran = policy.label(True, notes='lifted')
        assert isinstance(ran, LabelResult) and ran                   # truthy: stored
        assert (ran.episode_id, ran.matched) == (out.episode_id, True), ran
        assert 'labelled success' in ran.message
        typo = out.episode_id[:-1] + ('0' if out.episode_id[-1] != '0' else '1')
        with caplog.at_level(logging.WARNING, logger='sequence_ai_ros.client'):
            stray = policy.label(False, notes='mistyped', episode_id=typo)
        assert stray and (stray.episode_id, stray.matched) == (typo, False), stray   # stored, but no episode
        assert 'did not run' in stray.message
        warned = [r.getMessage() for r in caplog.records if typo in r.getMessage()]
        assert len(warned) == 1 and 'did not run' in warned[0], warned
    store = CaptureStore(root / 'lat', 'lat')
    assert store.unmatched_labels() == [typo]
    res = export_jsonl(store, tmp_path / 'jsonl', progress=False)
    assert res['unmatched_labels'] == [typo]
    assert any(typo in note and '1 label' in note for note in res['notes']), res['notes']
    rows = [json.loads(line) for line in (tmp_path / 'jsonl' / 'episodes.jsonl').read_text().splitlines()]
    assert [(r['episode_id'], r['label']) for r in rows] == [(out.episode_id, {'success': True, 'notes': 'lifted'})]


def test_a_label_kept_by_another_replica_matches_its_episode_and_only_strays_are_listed(tmp_path, serve):
    """Replica A ran the episode; B (A was stopped) stored its label, and a typo: together only the typo is stray."""
    a, b = tmp_path / 'a', tmp_path / 'b'
    robot = CountingRobot()
    with connect('lat', endpoint=_capturing(a, serve)) as policy:
        out = policy.run(robot.observe, robot.act, max_actions=10)
    with connect('lat', endpoint=_capturing(b, serve)) as other:
        kept = other.label(True, notes='labelled on B', episode_id=out.episode_id)
        stray = other.label(True, episode_id='no-such-episode')
    assert kept and not kept.matched and stray and not stray.matched   # B ran neither: it cannot tell them apart
    both = StoreSet([a / 'lat', b / 'lat'], 'lat')
    assert both.unmatched_labels() == ['no-such-episode']                # A's store ran the first
    res = export_jsonl(both, tmp_path / 'jsonl', progress=False)
    assert res['unmatched_labels'] == ['no-such-episode'] and res['episodes'] == 1
    [row] = [json.loads(line) for line in (tmp_path / 'jsonl' / 'episodes.jsonl').read_text().splitlines()]
    assert row['label'] == {'success': True, 'notes': 'labelled on B'}


def test_a_worker_without_capture_refuses_the_label_with_capture_error(serve):
    with connect('lat', endpoint=serve(**LAT)) as policy:
        policy.run(CountingRobot().observe, CountingRobot().act, max_actions=5)
        with pytest.raises(CaptureError, match='capture is off'):
            policy.label(True)
