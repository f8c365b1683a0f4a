"""A fleet whose replicas each keep their own capture store (Kubernetes pods, a volume each) exports as one.

Three real workers (gRPC on 127.0.0.1), each with its own capture store as a pod would have, serve
robots at once; one episode id is run on two replicas (a replica died mid-episode and the robot's next
stream with the same id landed on a survivor). ``seq policy data export NAME --store A --store B --store C``
writes one LeRobot dataset: every episode once, none lost, the duplicate named; ``seq policy stats
--store ...`` counts each run once, with its label.
"""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pyarrow.parquet as pq
import pytest
from test_worker_support import POLICIES

from sequence_ai_ros.capture.settings import CaptureSettings, save_settings
from sequence_ai_ros.capture.store import CaptureStore
from sequence_ai_ros.capture.store_set import StoreSet
from sequence_ai_ros.cli import main as seq_main
from sequence_ai_ros.client import connect
from sequence_ai_ros.exceptions import ConfigError
from sequence_ai_ros.protocol.types import Observation
from sequence_ai_ros.worker import serve_policy_file

NAMES = ('j0', 'j1', 'j2', 'j3')


def _episode(port: int, episode_id: str, steps: int, label: bool | None = None) -> int:
    """Run one episode of ``steps`` control ticks at 30 Hz on the worker at ``port``; return the commands."""
    sent = 0
    with connect('fast', endpoint=f'127.0.0.1:{port}') as policy:
        policy.wait_until_ready()
        policy.begin_episode('reach', episode_id=episode_id)
        t0 = time.monotonic()
        for k in range(steps):
            now = t0 + k / 30
            time.sleep(max(0.0, now - time.monotonic()))
            action = policy.next_action(Observation(state=np.full(4, 0.1 * k, np.float32), state_names=NAMES,
                                                    timestamp=now), now=now)
            sent += action is not None and not action.hold
        policy.end_episode('completed')
        if label is not None:
            assert policy.label(label, episode_id=episode_id)
    return sent


def test_per_replica_stores_export_as_one_dataset(tmp_path, seq_home, capsys):
    roots = [tmp_path / f'pod{i}' / 'capture' for i in range(3)]
    for root in roots:
        save_settings(root / 'fast', CaptureSettings(rate=1.0, enabled=True))
    servers = [serve_policy_file(POLICIES / 'fast.py', 'fast', dim=4, capture_root=root) for root in roots]
    try:
        jobs = [(servers[i % 3].port, f'robot{i}-ep1', 30 + 5 * i, i % 2 == 0 if i < 4 else None) for i in range(6)]
        errors: list[BaseException] = []

        def run(job):
            try:
                _episode(*job)
            except BaseException as exc:   # reported by the main thread
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(job,)) for job in jobs]   # the robots run at once
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors
        _episode(servers[1].port, 'robot0-ep1', 12)        # the same id again, shorter, on another replica
    finally:
        for server in servers:
            server.stop()
    stores = [root / 'fast' for root in roots]
    per_store = [len(CaptureStore(s, 'fast').episodes()) for s in stores]
    assert per_store == [2, 3, 2], per_store               # robot0 is in pod0 and pod1

    out = tmp_path / 'ds'
    argv = ['policy', 'data', 'export', 'fast', '--out', str(out), '--vcodec', 'h264']
    assert seq_main(argv + [a for s in stores for a in ('--store', str(s))]) == 0
    printed = capsys.readouterr().out
    assert '6 episodes' in printed and 'robot0-ep1 is also in' in printed, printed
    meta = [json.loads(line) for line in (out / 'meta' / 'episodes.jsonl').read_text().splitlines()]
    assert len(meta) == 6 and sorted(m['length'] for m in meta)[0] > 12, meta   # robot0's longer copy
    info = json.loads((out / 'meta' / 'info.json').read_text())
    assert info['total_episodes'] == 6
    assert pq.read_table(out / 'data' / 'chunk-000').num_rows == info['total_frames']

    assert seq_main(['policy', 'stats', 'fast', '--json'] + [a for s in stores for a in ('--store', str(s))]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert sum(r['episodes'] for r in rows) == 6, rows
    assert sum(r['labelled'] for r in rows) == 4, rows


def test_a_store_set_refuses_what_is_not_a_store(tmp_path):
    with pytest.raises(ConfigError, match='not a capture store'):
        StoreSet([tmp_path], 'fast')
    with pytest.raises(ConfigError, match='no capture store'):
        StoreSet([], 'fast')
