"""Capture stores under attack: foreign and broken stores in an export, writes by readers, --force, claims.

Real stores on disk (SQLite index, episode files), the real ``seq`` command line and exports.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import time
from pathlib import Path

import numpy as np
import pytest

from sequence_ai_ros.capture import claims
from sequence_ai_ros.capture.settings import CaptureSettings, save_settings
from sequence_ai_ros.capture.store import CaptureStore
from sequence_ai_ros.cli import main as seq_main
from sequence_ai_ros.cli.field_data import EXIT_SKIPPED
from sequence_ai_ros.protocol import codec
from sequence_ai_ros.protocol import sequence_ai_pb2 as pb
from sequence_ai_ros.protocol.contract import Contract, ObservationContract

NAMES = ('j0', 'j1', 'j2')


def _contract(deployment: str = 'fast', names: tuple[str, ...] = NAMES) -> Contract:
    return Contract('joint_absolute', names, 1 / 30, 8, ObservationContract((), names), deployment=deployment)


def _fill(root: Path, ids: list[str], deployment: str = 'fast', names: tuple[str, ...] = NAMES) -> CaptureStore:
    """A store at ``root`` with one committed 12-tick episode per id."""
    save_settings(root, CaptureSettings(rate=1.0, enabled=True, fps=30.0))
    store = CaptureStore(root, deployment=root.name)
    for eid in ids:
        _run(store, eid, deployment, names)
    store.close()
    return store


def _run(store: CaptureStore, eid: str, deployment: str = 'fast', names: tuple[str, ...] = NAMES) -> None:
    """Capture one 12-tick episode into ``store`` and record its run."""
    ep = store.begin(eid, 'reach', _contract(deployment, names))
    assert ep is not None, store.refusal()
    for i in range(12):
        state = codec.to_tensor(np.full(len(names), 0.1 * i, np.float32))
        if i % 4 == 0:
            ep.add_request(pb.ObservationRequest(episode_id=eid, request_id=i // 4 + 1, robot_time_s=i / 30,
                                                 state=state, state_names=list(names)),
                           pb.ActionChunk(request_id=i // 4 + 1, episode_id=eid, dt=1 / 30,
                                          actions=codec.to_tensor(np.zeros((8, len(names)), np.float32)),
                                          action_space=pb.JOINT_ABSOLUTE))
        frame = pb.TelemetryFrame(robot_time_s=i / 30, state=state, hold=(i == 0))
        if i:
            frame.action.CopyFrom(state)
        ep.add_telemetry([frame])
    ep.commit('completed', {'actions': 12})
    store.record_run({'episode_id': eid, 'started_at': ep.started_at, 'ended_at': time.time(),
                      'reason': 'completed', 'actions': 12, 'captured': 1})


def _snapshot(root: Path) -> dict[str, tuple[int, str]]:
    """Every path under ``root`` with its mode and content hash (files) — what a write would change."""
    out = {}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            p = Path(dirpath) / name
            st = p.lstat()
            digest = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else ''
            out[str(p.relative_to(root))] = (st.st_mode, digest, st.st_mtime_ns if p.is_file() else 0)
    return out


def _export(name, out, stores=(), *extra):
    argv = ['policy', 'data', 'export', name, '--out', str(out), '--vcodec', 'h264', *extra]
    return seq_main(argv + [a for s in stores for a in ('--store', str(s))])


def test_export_and_stats_never_write_to_a_store(tmp_path, seq_home, capsys):
    """The review: the export, documented read-only, wrote pause.json, deleted stale staging, dropped rows."""
    root = tmp_path / 'pod0' / 'fast'
    _fill(root, ['ep-1', 'ep-2', 'ep-3'])
    (root / 'staging' / '999999-ep-9').mkdir()                  # a dead writer's staging
    (root / 'staging' / '.claim-ep-9').write_text('999999')      # and its claim
    gone = next(p for p in (root / 'episodes').iterdir() if p.name == 'ep-3')
    for f in gone.iterdir():                                      # an index row whose directory is gone
        f.unlink()
    gone.rmdir()
    before = _snapshot(root)
    assert _export('fast', tmp_path / 'ds', [root]) == 0
    assert _export('fast', tmp_path / 'js', [root], '--format', 'jsonl') == 0
    assert seq_main(['policy', 'stats', 'fast', '--json', '--store', str(root)]) == 0
    assert _snapshot(root) == before
    assert 'exported fast' in capsys.readouterr().out

    (root / 'store.db').write_bytes(b'this is not a database' * 100)   # now broken: still nothing written
    before = _snapshot(root)
    assert _export('fast', tmp_path / 'ds2', [root]) == 2
    assert 'is corrupt' in capsys.readouterr().err
    assert _snapshot(root) == before and not (root / 'pause.json').exists()


def test_a_bad_or_foreign_store_is_skipped_and_named_and_the_rest_export(tmp_path, seq_home, capsys):
    good = _fill(tmp_path / 'pod0' / 'fast', ['a-1', 'a-2']).root
    corrupt = _fill(tmp_path / 'pod1' / 'fast', ['b-1']).root
    (corrupt / 'store.db').write_bytes(b'\0garbage' * 512)
    other = _fill(tmp_path / 'pod2' / 'fast', ['c-1'], deployment='slow').root     # another deployment's store
    shape = _fill(tmp_path / 'pod3' / 'fast', ['d-1'], names=('x', 'y', 'z')).root  # another contract
    out = tmp_path / 'ds'
    assert _export('fast', out, [good, corrupt, other, shape]) == EXIT_SKIPPED
    printed = capsys.readouterr().out
    assert 'LeRobot v2.1, 2 episodes' in printed, printed
    lines = {ln.split(':', 1)[0].strip(): ln for ln in printed.splitlines() if 'skipped store' in ln}
    assert f'skipped store {corrupt}' in lines and f'--repair --store {corrupt}' in lines[f'skipped store {corrupt}']
    assert "deployment 'slow'" in lines[f'skipped store {other}']
    assert 'contract' in lines[f'skipped store {shape}']
    info = json.loads((out / 'meta' / 'info.json').read_text())
    assert info['total_episodes'] == 2
    assert _export('fast', tmp_path / 'strict', [good, corrupt], '--strict') == 2
    assert f'store {corrupt} would be skipped' in capsys.readouterr().err
    assert not (tmp_path / 'strict').exists()

    # the hint repairs THAT store, not $SEQ_HOME's
    assert seq_main(['policy', 'capture', 'fast', '--repair', '--store', str(corrupt)]) == 0
    assert 'index rebuilt, 1 episodes' in capsys.readouterr().out
    assert not (seq_home / 'capture' / 'fast').exists()
    assert seq_main(['policy', 'capture', 'fast', '--repair', '--store', str(tmp_path / 'typo')]) == 2
    assert 'is not a capture store' in capsys.readouterr().err and not (tmp_path / 'typo').exists()
    assert _export('fast', tmp_path / 'ds3', [good, corrupt]) == 0
    assert '3 episodes' in capsys.readouterr().out


def test_force_replaces_only_an_export_of_ours(tmp_path, seq_home, capsys):
    root = _fill(tmp_path / 'pod0' / 'fast', ['a-1']).root
    out = tmp_path / 'ds'
    assert _export('fast', out, [root]) == 0
    assert _export('fast', out, [root], '--force') == 0                  # our own export: replaced
    assert not list(tmp_path.glob('.ds.*')) and (out / '.seq-export.json').is_file()
    (out / 'videos').mkdir(exist_ok=True)
    (out / 'videos' / 'mine.mp4').write_bytes(b'a video someone added')
    assert _export('fast', out, [root], '--force') == 2
    assert 'did not write' in capsys.readouterr().err
    assert (out / 'videos' / 'mine.mp4').read_bytes() == b'a video someone added'

    foreign = tmp_path / 'recorded'                                       # a LeRobot dataset recorded elsewhere
    (foreign / 'meta').mkdir(parents=True)
    (foreign / 'meta' / 'info.json').write_text('{"codebase_version": "v2.1"}')
    (foreign / 'videos' / 'chunk-000').mkdir(parents=True)
    (foreign / 'videos' / 'chunk-000' / 'episode_000000.mp4').write_bytes(b'their video')
    before = _snapshot(foreign)
    assert _export('fast', foreign, [root], '--force') == 2
    assert _export('fast', foreign, [root], '--force', '--format', 'jsonl') == 2
    assert capsys.readouterr().err.count('not written by seq policy data export') == 2
    assert _snapshot(foreign) == before


def _claim(root: Path, eid: str, holder: claims.Holder, age_s: float = 0.0) -> Path:
    path = root / 'staging' / f'.claim-{eid}'
    path.write_text(holder.to_json())
    (root / 'staging' / f'{holder.pid}-{eid}').mkdir(exist_ok=True)    # its episode being written
    then = time.time() - age_s
    os.utime(path, (then, then))
    return path


def test_a_container_claim_is_never_taken_for_dead_and_a_reused_pid_does_not_block(tmp_path):
    root = _fill(tmp_path / 'fast', ['x-0']).root
    me = claims.this_process()
    # a container sharing the volume: another pid namespace, another hostname; its pid 1 means nothing here
    container = claims.Holder('robot-pod-7', me.boot_id, 'pid:[4026599999]', 1, 12345)
    _claim(root, 'live', container)
    store = CaptureStore(root, deployment='fast')
    with pytest.raises(Exception, match='another worker process'):
        store.begin('live', 'reach', _contract())
    assert (root / 'staging' / '1-live').is_dir()            # its staging survives our recovery
    CaptureStore(root, deployment='fast').recover()
    assert (root / 'staging' / '1-live').is_dir() and (root / 'staging' / '.claim-live').exists()

    # the same container, silent for longer than STALE_S: dead, its claim and staging go
    _claim(root, 'gone', container, age_s=claims.STALE_S + 5)
    ep = CaptureStore(root, deployment='fast').begin('gone', 'reach', _contract())
    assert ep is not None
    ep.abort()
    assert not (root / 'staging' / '1-gone').exists()

    # a live pid of this namespace that is not the holder (the holder died, its pid was reused)
    reused = claims.Holder(me.host, me.boot_id, me.pid_ns, os.getppid(), 1)
    assert claims.pid_alive(reused.pid) and claims.start_time(reused.pid) != 1
    _claim(root, 'reused', reused)
    ep = CaptureStore(root, deployment='fast').begin('reused', 'reach', _contract())
    assert ep is not None
    ep.abort()
    # an old plain-pid claim of a live pid left for longer than STALE_S does not block the id for good
    path = root / 'staging' / '.claim-old'
    path.write_text(str(os.getppid()))
    os.utime(path, (time.time() - claims.STALE_S - 5,) * 2)
    ep = CaptureStore(root, deployment='fast').begin('old', 'reach', _contract())
    assert ep is not None
    ep.abort()
    # a claim of this host from before a reboot is dead at once
    _claim(root, 'boot', claims.Holder(me.host, 'another-boot', me.pid_ns, os.getppid(), None))
    assert CaptureStore(root, deployment='fast').begin('boot', 'reach', _contract()) is not None
    assert socket.gethostname() == me.host


def test_a_corrupt_index_is_rebuilt_at_start_when_no_one_else_captures(tmp_path, caplog):
    root = _fill(tmp_path / 'fast', ['a-1', 'a-2']).root
    (root / 'store.db').write_bytes(b'\0garbage' * 512)
    store = CaptureStore(root, deployment='fast')
    ep = store.begin('a-3', 'reach', _contract())            # the worker's first episode after the start
    assert ep is not None, store.refusal()
    ep.commit('completed')
    assert [e.episode_id for e in store.episodes()] == ['a-1', 'a-2', 'a-3']
    assert list(root.glob('store.db.corrupt-*')), 'the bad index is kept aside'
    assert 'rebuilding it from the episode files' in caplog.text
    store.close()

    # another live replica captures into the store: not rebuilt behind its back; the hint names the store
    me = claims.this_process()
    _claim(root, 'busy', claims.Holder('replica-2', me.boot_id, 'pid:[4026599998]', 5, 7))
    for f in root.glob('store.db*'):
        f.unlink()
    (root / 'store.db').write_bytes(b'\0garbage' * 512)
    store = CaptureStore(root, deployment='fast')
    assert store.begin('a-4', 'reach', _contract()) is None
    assert f'--repair --store {root}' in store.refusal()
    assert store.status()['state'] == 'paused'


def test_an_export_beside_a_live_worker_creates_nothing_in_its_store(tmp_path, seq_home):
    """While a worker holds the index open (its WAL live), the reader uses it as it is: no file is added."""
    root = tmp_path / 'fast'
    _fill(root, ['a-1'])
    live = CaptureStore(root, deployment='fast')
    _run(live, 'a-2')                                      # the worker's connection stays open
    assert (root / 'store.db-wal').exists()
    names = sorted(str(p.relative_to(root)) for p in root.rglob('*'))
    before = {k: v for k, v in _snapshot(root).items() if not k.endswith('-shm')}   # SQLite's shared memory
    assert _export('fast', tmp_path / 'ds', [root]) == 0
    assert sorted(str(p.relative_to(root)) for p in root.rglob('*')) == names
    assert {k: v for k, v in _snapshot(root).items() if not k.endswith('-shm')} == before
    assert json.loads((tmp_path / 'ds' / 'meta' / 'info.json').read_text())['total_episodes'] == 2
    live.close()


def test_an_index_corrupted_while_serving_is_rebuilt_at_the_next_episode(tmp_path):
    root = _fill(tmp_path / 'fast', ['a-1']).root
    store = CaptureStore(root, deployment='fast')
    _run(store, 'a-2')
    store.close()
    (root / 'store.db').write_bytes(b'\0garbage' * 512)    # corrupted under the running worker
    for f in root.glob('store.db-*'):
        f.unlink()
    with pytest.raises(Exception, match='corrupt'):
        store.label('a-1', True)
    assert store.status()['kind'] == 'corrupt'
    _run(store, 'a-3')                                     # the next episode start rebuilds it (no one else)
    assert [e.episode_id for e in store.episodes()] == ['a-1', 'a-2', 'a-3']
    assert store.status()['state'] == 'capturing'
