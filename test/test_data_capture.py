"""The capture store on real files and a real SQLite index, fed with real G1 data as pb messages."""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from test_data_support import FakeClock, feed_g1, make_store

from sequence_ai_ros.capture.records import REQUEST, read_records
from sequence_ai_ros.capture.settings import CaptureSettings, load_settings, sample_value, save_settings
from sequence_ai_ros.capture.store import CaptureStore
from sequence_ai_ros.datasets.lerobot_reader import LeRobotDataset
from sequence_ai_ros.exceptions import CaptureError, ConfigError
from sequence_ai_ros.protocol import codec
from sequence_ai_ros.protocol import sequence_ai_pb2 as pb

REPO = Path(__file__).resolve().parent.parent


def _tiny(store: CaptureStore, episode_id: str, reason: str = 'completed'):
    ep = store.begin(episode_id, 'wave', None)
    if ep is not None:
        ep.add_telemetry([pb.TelemetryFrame(state=codec.to_tensor(np.zeros(2, np.float32)))])
        ep.commit(reason, {})
    return ep


def test_settings_validate_and_round_trip(tmp_path: Path) -> None:
    assert load_settings(tmp_path) == CaptureSettings()  # no file: capture off
    s = CaptureSettings(rate=0.25, images=True, retention_days=7, fps=20, enabled=True, quota_bytes=10)
    save_settings(tmp_path, s)
    assert load_settings(tmp_path) == s
    for bad in ({'rate': 1.5}, {'rate': -0.1}, {'fps': 12.5}, {'fps': 0}, {'retention_days': 0},
                {'quota_bytes': -1}):
        with pytest.raises(ConfigError):
            CaptureSettings(**bad)
    (tmp_path / 'settings.json').write_text('{"rate": 0.5, "colour": 1}')
    with pytest.raises(ConfigError, match='colour'):
        load_settings(tmp_path)


def test_rate_one_keeps_every_episode(tmp_path: Path) -> None:
    store = make_store(tmp_path / 'cap', rate=1.0)
    for i in range(20):
        assert _tiny(store, f'ep-{i}') is not None
    assert sorted(e.episode_id for e in store.episodes()) == sorted(f'ep-{i}' for i in range(20))


def test_rate_tenth_keeps_about_ten_percent_deterministically(tmp_path: Path) -> None:
    store = make_store(tmp_path / 'cap', rate=0.1)
    ids = [f'7f3c{i:04d}-episode' for i in range(200)]
    kept = [i for i in ids if _tiny(store, i) is not None]
    # Binomial(200, 0.1): mean 20, sd 4.2; [6, 34] is beyond 3 sd on both sides.
    assert 6 <= len(kept) <= 34, len(kept)
    assert kept == [i for i in ids if sample_value(i) < 0.1]  # decided from the id alone
    assert {e.episode_id for e in store.episodes()} == set(kept)
    other = make_store(tmp_path / 'again', rate=0.1)  # reproducible in another store
    assert [i for i in ids if other.begin(i) is not None] == kept


def test_off_keeps_nothing_new_and_keeps_what_was_kept(tmp_path: Path) -> None:
    store = make_store(tmp_path / 'cap')
    _tiny(store, 'a')
    save_settings(store.root, CaptureSettings(rate=1.0, enabled=False))
    assert _tiny(store, 'b') is None
    assert store.status()['state'] == 'off'
    assert [e.episode_id for e in store.episodes()] == ['a']
    store.label('b', True)   # seen while capture was off: labelled, still not captured
    assert store.index.pending_label('b')['success'] is True


def test_captured_episode_is_kept_whole_with_images(tmp_path: Path, g1: LeRobotDataset) -> None:
    store = make_store(tmp_path / 'cap', images=True)
    feed_g1(store, 'e1', g1, k=0, frames=10, images=True)
    (ep,) = store.episodes()
    assert (ep.requests, ep.frames, ep.reason, ep.images) == (2, 10, 'completed', True)
    recs = ep.records()
    reqs = [r.message for r in recs if r.kind == REQUEST]
    assert [r.request_id for r in reqs] == [1, 2]
    assert reqs[0].images[0].data[:3] == b'\xff\xd8\xff' and reqs[0].params['seed'] == '0'
    chunks = [r.message for r in recs if r.kind == 2]
    assert codec.from_tensor(chunks[0].actions).shape == (30, 26)
    tel = ep.telemetry()
    np.testing.assert_array_equal(codec.from_tensor(tel[3][1].state), g1.episode(0).state[3])
    assert ep.contract.observation.state_names == g1.state_names


def test_without_images_no_pixels_are_stored(tmp_path: Path, g1: LeRobotDataset) -> None:
    store = make_store(tmp_path / 'cap', images=False)
    ep = store.begin('e1', 'pick', None)
    jpeg = codec.encode_image('cam_high', np.full((48, 64, 3), 200, np.uint8))
    req = pb.ObservationRequest(episode_id='e1', request_id=1, state=codec.to_tensor(np.ones(3, np.float32)),
                                images=[jpeg], history=[pb.Frame(images=[jpeg])])
    ep.add_request(req, None)
    ep.add_telemetry([pb.TelemetryFrame(state=codec.to_tensor(np.ones(3, np.float32)), images=[jpeg])])
    assert len(req.images) == 1  # the caller's message is untouched
    ep.commit('completed', {})
    (kept,) = store.episodes()
    assert not kept.images
    for rec in read_records(kept.path / 'episode.rec'):
        assert not getattr(rec.message, 'images', [])
        if rec.kind == REQUEST:
            assert not rec.message.history[0].images and rec.message.state.data
    blob = b''.join(p.read_bytes() for p in kept.path.iterdir())
    assert b'\xff\xd8\xff' not in blob and jpeg.data[100:140] not in blob


def test_retention_deletes_exactly_the_older_episodes(tmp_path: Path) -> None:
    clock = FakeClock(1_800_000_000.0)
    store = make_store(tmp_path / 'cap', clock=clock, retention_days=2)
    day = 86400.0
    for i in range(6):  # episodes ending at day 0, 1, ..., 5
        clock.t = 1_800_000_000.0 + i * day
        _tiny(store, f'd{i}')
    clock.t = 1_800_000_000.0 + 5 * day
    store.begin('not-sampled-old', 'x', None).abort()
    assert store.apply_retention(now=1_800_000_000.0 + 4 * day) == 2  # ended before day 2: d0, d1
    assert [e.episode_id for e in store.episodes()] == ['d2', 'd3', 'd4', 'd5']
    assert not (store.root / 'episodes' / 'd0').exists()
    assert store.apply_retention(now=1_800_000_000.0 + 4 * day) == 0
    clock.t = 1_800_000_000.0 + 7 * day + 1  # the injected clock is the default "now"
    assert store.apply_retention() == 4 and store.episodes() == []
    assert store.label('d3', True) is False     # past retention: kept as a label without an episode


def test_a_label_for_an_episode_held_elsewhere_is_kept_as_long_as_an_episode(tmp_path: Path) -> None:
    """A replica that stored a label for another replica's episode keeps it retention_days from the label."""
    clock = FakeClock(1_800_000_000.0)
    store = make_store(tmp_path / 'cap', clock=clock, retention_days=2)
    day = 86400.0
    _tiny(store, 'here')                              # ends at day 0
    clock.t += 0.5 * day
    assert store.label('elsewhere', True, 'its replica was stopped') is False
    assert store.label('here', False) is True
    store.apply_retention(now=clock.t + 1.9 * day)    # the episode here (ended at day 0) is gone ...
    assert store.episodes() == [] and set(store.labels()) == {'elsewhere'}   # ... the label given later is not
    store.apply_retention(now=clock.t + 2.1 * day)
    assert store.labels() == {}


def test_labels_reach_the_episode_with_clear_errors(tmp_path: Path) -> None:
    store = make_store(tmp_path / 'cap', rate=1.0)
    _tiny(store, 'done')
    store.label('done', True, 'cup in gripper')
    running = store.begin('running', 'x', None)
    store.label('running', False, 'dropped it')  # labelled before its commit: applied at commit
    running.commit('interrupted', {'actions': 3})
    labels = {e.episode_id: (e.label['success'], e.label['notes'], e.reason) for e in store.episodes()}
    assert labels == {'done': (True, 'cup in gripper', 'completed'), 'running': (False, 'dropped it', 'interrupted')}
    assert json.loads((store.root / 'episodes' / 'done' / 'label.json').read_text())['success'] is True
    assert store.label('never-seen', True, 'ran on another replica') is False   # stored all the same
    assert store.labels()['never-seen']['notes'] == 'ran on another replica'
    save_settings(store.root, CaptureSettings(rate=0.0, enabled=True))
    assert store.begin('skipped', 'x', None) is None
    assert store.label('skipped', True, 'seen, not captured')   # every episode the worker saw takes a label
    assert store.index.pending_label('skipped')['notes'] == 'seen, not captured'
    assert 'skipped' not in {e.episode_id for e in store.episodes()}
    assert store.label('never-seen', False) is False    # a later label replaces it
    assert store.labels()['never-seen']['success'] is False
    unconfigured = CaptureStore(tmp_path / 'none', 'none')
    assert unconfigured.begin('x') is None    # capture never configured: not captured, but seen
    assert unconfigured.label('x', False, 'labelled anyway') is True
    assert unconfigured.episodes() == []


def test_duplicate_and_empty_episode_ids_are_refused(tmp_path: Path) -> None:
    store = make_store(tmp_path / 'cap')
    _tiny(store, 'a')
    with pytest.raises(CaptureError, match='already captured'):
        store.begin('a')
    with pytest.raises(CaptureError):
        store.begin('')
    ep = store.begin('we/ird id', 'x', None)  # any id is stored under a safe directory name
    ep.commit('completed', {})
    assert [e.episode_id for e in store.episodes()] == ['a', 'we/ird id']


def test_quota_pauses_capture_and_keeps_what_was_kept(tmp_path: Path, g1: LeRobotDataset) -> None:
    root = tmp_path / 'cap'
    store = make_store(root, images=True)
    feed_g1(store, 'first', g1, frames=10)
    used = store.bytes_used()
    save_settings(root, CaptureSettings(rate=1.0, enabled=True, images=True, quota_bytes=used + 200_000))
    with pytest.raises(CaptureError, match='quota'):
        feed_g1(store, 'second', g1, frames=40)  # ~40 kB a frame: over the quota mid-episode
    status = store.status()
    assert status['state'] == 'paused' and status['kind'] == 'quota' and 'quota' in status['diagnostic']
    assert [e.episode_id for e in store.episodes()] == ['first']  # dropped whole, first intact
    assert not any((root / 'staging').iterdir())
    assert len(store.episodes()[0].telemetry()) == 10
    save_settings(root, CaptureSettings(rate=1.0, enabled=True, images=True, quota_bytes=used))
    assert store.begin('third', 'x', None) is None  # at the quota: stays paused
    store.label('third', True)   # seen while paused: labelled (for the scoreboard), not captured
    save_settings(root, CaptureSettings(rate=1.0, enabled=True, images=True, quota_bytes=used * 10))
    assert feed_g1(store, 'fourth', g1, frames=5) is not None  # room again: capture resumes
    assert store.status()['state'] == 'capturing'
    assert [e.episode_id for e in store.episodes()] == ['first', 'fourth']


def test_corrupted_index_pauses_capture_and_repair_loses_nothing(tmp_path: Path) -> None:
    root = tmp_path / 'cap'
    store = make_store(root)
    for name in ('a', 'b', 'c'):
        _tiny(store, name)
    store.label('b', True, 'ok')
    db = root / 'store.db'
    size = db.stat().st_size
    with db.open('r+b') as f:  # a truncated file, as a crash or a bad copy leaves it
        f.truncate(size // 2)
    # another replica is capturing into this store (a live claim): no automatic rebuild behind its back
    from sequence_ai_ros.capture import claims

    me = claims.this_process()
    other = root / 'staging' / '.claim-other'
    other.write_text(claims.Holder('replica-2', me.boot_id, 'pid:[4026599997]', 5, 7).to_json())
    fresh = CaptureStore(root, 'cap', clock=FakeClock())  # as the worker after a restart
    assert fresh.begin('d', 'x', None) is None  # serving goes on: no exception
    status = fresh.status()
    assert status['state'] == 'paused' and status['kind'] == 'corrupt'
    assert '--repair' in status['diagnostic'] and 'store.db' in status['diagnostic']
    assert sorted(p.name for p in (root / 'episodes').iterdir()) == ['a', 'b', 'c']  # files untouched
    assert fresh.repair() == 3
    other.unlink()
    kept = {e.episode_id: e.label for e in fresh.episodes()}
    assert set(kept) == {'a', 'b', 'c'} and kept['b']['notes'] == 'ok' and kept['a'] is None
    assert fresh.status()['state'] == 'capturing'
    assert _tiny(fresh, 'd') is not None
    assert list(root.glob('store.db.corrupt-*'))  # the bad index is kept aside, not deleted


def test_truncated_episode_file_is_reported_not_hidden(tmp_path: Path) -> None:
    store = make_store(tmp_path / 'cap')
    _tiny(store, 'a')
    rec = store.episodes()[0].path / 'episode.rec'
    rec.write_bytes(rec.read_bytes()[:-3])
    with pytest.raises(CaptureError, match='truncated'):
        store.episodes()[0].records()


FULL_DISK_CHILD = r'''
import json, resource, sys, numpy as np
from pathlib import Path
from sequence_ai_ros.capture.store import CaptureStore
from sequence_ai_ros.capture.settings import CaptureSettings, save_settings
from sequence_ai_ros.exceptions import CaptureError
from sequence_ai_ros.protocol import codec, sequence_ai_pb2 as pb
root = Path(sys.argv[1])
save_settings(root, CaptureSettings(rate=1.0, enabled=True))
store = CaptureStore(root, 'disk')
frame = pb.TelemetryFrame(state=codec.to_tensor(np.arange(4000, dtype=np.float32)))
ep = store.begin('small'); ep.add_telemetry([frame]); ep.commit('completed', {})
resource.setrlimit(resource.RLIMIT_FSIZE, (256_000, 256_000))  # any file over 256 kB: EFBIG
ep = store.begin('big')
error = ''
try:
    for _ in range(200):
        ep.add_telemetry([frame])
except CaptureError as exc:
    error = str(exc)
status = store.status()
again = store.begin('after')  # still no room: stays paused (1 MiB probe fails)
print(json.dumps({'error': error, 'status': status, 'again': again is not None,
                  'kept': [e.episode_id for e in store.episodes()]}))
'''


def test_full_disk_pauses_capture_via_rlimit_fsize(tmp_path: Path, processes) -> None:
    proc = processes.python(FULL_DISK_CHILD, str(tmp_path / 'cap'), cwd=str(REPO))
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    res = json.loads(out.strip().splitlines()[-1])
    assert 'disk full' in res['error'] and res['status']['kind'] == 'disk'
    assert res['again'] is False and res['kept'] == ['small']
    assert not any((tmp_path / 'cap' / 'staging').iterdir())


KILL_CHILD = r'''
import sys, time, numpy as np
from pathlib import Path
from sequence_ai_ros.capture.store import CaptureStore
from sequence_ai_ros.capture.settings import CaptureSettings, save_settings
from sequence_ai_ros.protocol import codec, sequence_ai_pb2 as pb
from sequence_ai_ros.protocol.contract import Contract, ObservationContract
root = Path(sys.argv[1])
save_settings(root, CaptureSettings(rate=1.0, enabled=True, fps=15))
names = ('waist', 'shoulder', 'elbow')
contract = Contract('joint_absolute', names, 1 / 15, 15, ObservationContract((), names))
store = CaptureStore(root, 'wx')
def frames(n, k):
    return [pb.TelemetryFrame(robot_time_s=i / 15, state=codec.to_tensor(np.full(3, k + i, np.float32)),
                              action=codec.to_tensor(np.full(3, k - i, np.float32))) for i in range(n)]
for k in range(3):
    ep = store.begin(f'done-{k}', 'reach', contract)
    ep.add_request(pb.ObservationRequest(episode_id=f'done-{k}', request_id=1,
                                         state=codec.to_tensor(np.zeros(3, np.float32))), None)
    ep.add_telemetry(frames(30, k))
    ep.commit('completed', {'k': k})
    print('committed', k, flush=True)
ep = store.begin('half', 'reach', contract)
print('writing', flush=True)
while True:
    ep.add_telemetry(frames(5, 9))
'''


@pytest.mark.slow
def test_kill9_during_capture_then_export_loads_every_committed_episode(tmp_path: Path, processes) -> None:
    from sequence_ai_ros.datasets.jsonl_writer import export_jsonl
    from sequence_ai_ros.datasets.lerobot_writer import export_lerobot
    from sequence_ai_ros.datasets.verify import verify_export

    root = tmp_path / 'cap'
    proc = processes.python(KILL_CHILD, str(root), cwd=str(REPO))
    lines = []
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line.strip())
        if line.startswith('writing'):
            break
    assert lines[-1] == 'writing', (lines, proc.stderr.read() if proc.poll() is not None else '')
    time.sleep(0.3)  # mid-episode, records streaming to the staging file
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    assert any((root / 'staging').iterdir())  # the half episode exists only in staging
    store = CaptureStore(root, 'wx', clock=FakeClock())
    assert [e.episode_id for e in store.episodes()] == ['done-0', 'done-1', 'done-2']
    assert not any((root / 'staging').iterdir())  # the dead writer's staging is gone
    store.label('half', True)   # seen (its capture died with the process): the label is kept
    store.label('done-1', True)
    res = export_lerobot(store, tmp_path / 'lerobot', progress=False)
    assert res['episodes'] == 3 and res['frames'] == 90 and res['skipped'] == []
    report = verify_export(tmp_path / 'lerobot')
    assert report['episodes'] == 3
    assert export_jsonl(store, tmp_path / 'jsonl', progress=False)['episodes'] == 3
    assert _tiny(store, 'after-crash') is not None  # capture goes on after the crash


def test_commit_is_one_rename_so_readers_never_see_half(tmp_path: Path) -> None:
    store = make_store(tmp_path / 'cap')
    ep = store.begin('live', 'x', None)
    ep.add_telemetry([pb.TelemetryFrame(state=codec.to_tensor(np.zeros(2, np.float32)))] * 10)
    reader = CaptureStore(tmp_path / 'cap', 'cap')  # e.g. `seq policy capture NAME` while the worker runs
    assert reader.episodes() == []
    assert reader.summary()['episodes'] == 0
    assert (store.root / 'staging').iterdir()  # a live writer's staging survives another process's open
    ep.commit('timeout', {'underruns': 2})
    (kept,) = reader.episodes()
    assert (kept.reason, kept.frames, kept.stats) == ('timeout', 10, {'underruns': 2})


def test_summary_counts_what_is_kept(tmp_path: Path) -> None:
    clock = FakeClock(1_800_000_000.0)
    store = make_store(tmp_path / 'cap', clock=clock)
    for i in range(3):
        clock.t += 60
        _tiny(store, f'e{i}')
    store.label('e1', False)
    s = store.summary()
    assert (s['episodes'], s['frames'], s['labelled'], s['unlabelled']) == (3, 3, 1, 2)
    assert s['oldest'] == 1_800_000_060.0 and s['newest'] == 1_800_000_180.0
    assert s['bytes_on_disk'] == store.bytes_used() > s['bytes'] > 0
    assert s['settings']['rate'] == 1.0 and s['status']['state'] == 'capturing'


def test_concurrent_episodes_from_worker_threads_stay_apart(tmp_path: Path) -> None:
    import threading

    store = make_store(tmp_path / 'cap')
    errors: list[BaseException] = []

    def run(k: int) -> None:
        try:
            ep = store.begin(f'thread-{k}', f'task {k}', None)
            for i in range(50):
                ep.add_telemetry([pb.TelemetryFrame(robot_time_s=i, state=codec.to_tensor(np.full(2, k, np.float32)))])
            ep.commit('completed', {'k': k})
            store.label(f'thread-{k}', k % 2 == 0)
        except BaseException as exc:  # noqa: BLE001  (reported below)
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(k,), name=f'test-capture-{k}') for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not errors and not any(t.is_alive() for t in threads)
    for ep in store.episodes():
        k = int(ep.episode_id.split('-')[1])
        states = {float(codec.from_tensor(f.state)[0]) for _, f in ep.telemetry()}
        assert states == {float(k)} and ep.frames == 50 and ep.label['success'] is (k % 2 == 0)
    assert len(store.episodes()) == 4


if __name__ == '__main__':
    sys.exit(pytest.main([__file__, '-q']))
