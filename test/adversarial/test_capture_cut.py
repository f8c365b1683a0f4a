"""Break-it: capture writes waiting for a thread when the stream is cut lose nothing and keep nothing dropped.

Capture writes run on the worker's ``seq-capture`` threads. With those threads busy on a slow disk (eight captured
robots whose writes wait, inside their recorders, as on a real slow disk), a robot's write or its episode's end
waits for a thread; meanwhile its stream is cut (the robot cancels, the worker stops, a rollout cuts). What was
answered is written once, in order, by the episode's commit if its own write never ran; telemetry too; and an
episode whose robot dropped its capture (``EpisodeEnd.capture_error``) is never kept. Checked in the real
capture store.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from test_end_waits import FRAME, NAMES, _serving, _slow_capture_disk, _started, _stop_then_free_the_disk
from test_worker_support import Stream, state_request, wait_for

from sequence_ai_ros.capture.records import REQUEST
from sequence_ai_ros.capture.settings import CaptureSettings, save_settings
from sequence_ai_ros.capture.store import CaptureStore
from sequence_ai_ros.protocol import sequence_ai_pb2 as pb
from sequence_ai_ros.worker.server import CAPTURE_THREADS

#: log lines that say a future or callback failed unseen, or ran on a closed loop or executor
LEAKS = ('never retrieved', 'cannot schedule new futures', 'exception calling callback', 'Event loop is closed')
DROPPED = pb.EpisodeEnd(reason='completed', capture_error='a record over the message limit')


def _store(seq_home) -> CaptureStore:
    return CaptureStore(seq_home / 'capture' / 'hooked', deployment='hooked')


def _committed(seq_home) -> dict[str, list[int]]:
    """{episode id: the request ids its committed records hold, in file order}."""
    return {ep.episode_id: [r.message.request_id for r in ep.records() if r.kind == REQUEST]
            for ep in _store(seq_home).episodes()}


def _runs(seq_home) -> dict[str, dict]:
    return {r['episode_id']: r for r in _store(seq_home).runs()}


def _leaks(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if any(s in r.getMessage() for s in LEAKS)]


def _queued(server: Any) -> int:
    """Writes waiting for a capture thread."""
    return server.servicer.capture_io._work_queue.qsize()


def _end_begun(held, episode_id: str) -> bool:
    """The episode's end began: its ``@seq.on_episode`` hook runs (and waits while ``held`` exists)."""
    return Path(f'{held}.{episode_id}').exists()


def _fill_the_pool(stub, slow, waiting) -> list[Stream]:
    """CAPTURE_THREADS captured robots whose second request's write waits on the slow disk: the pool is full."""
    busy = [_started(stub, 'hooked', f'captured-{k}') for k in range(CAPTURE_THREADS)]
    slow.write_text('capture writes wait while this file exists')
    for s in busy:
        s.send(observation=state_request(2, [0.0, 0.0], NAMES))
        assert s.recv(timeout=15).HasField('chunk')
    wait_for(lambda: len(waiting) == CAPTURE_THREADS, what='every capture thread to wait')
    return busy


def _leave_then_free_the_disk(victim: Stream, slow, busy: list[Stream], seq_home) -> None:
    """The victim robot cancels its call; then the disk is fast again, the busy robots end, the victim's run is in."""
    victim.cancel()
    time.sleep(0.5)
    slow.unlink()
    for s in busy:
        assert s.end().ended.captured
    wait_for(lambda: 'victim' in _runs(seq_home), what="the victim's run recorded")


def _capturing(seq_home, tmp_path, monkeypatch):
    slow = tmp_path / 'held'
    waiting, _ = _slow_capture_disk(slow, monkeypatch)
    save_settings(seq_home / 'capture' / 'hooked', CaptureSettings(rate=1.0, enabled=True))
    return slow, waiting


def test_a_robot_cancelling_right_after_a_reply_whose_write_waits_keeps_every_request_once_in_order(
        seq_home, tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.DEBUG)
    slow, waiting = _capturing(seq_home, tmp_path, monkeypatch)
    with _serving(seq_home, tmp_path, ['hooked']) as (_, server, stub):
        victim = _started(stub, 'hooked', 'victim')
        assert victim.ask(state_request(2, [0.0, 0.0], NAMES)).HasField('chunk')
        assert victim.ask(state_request(3, [0.0], NAMES[:1])).HasField('error')     # an error reply: captured too
        busy = _fill_the_pool(stub, slow, waiting)
        victim.send(observation=state_request(4, [0.0, 0.0], NAMES))
        assert victim.recv(timeout=15).HasField('chunk')
        wait_for(lambda: _queued(server) > 0, what="the victim's write to wait for a thread")
        _leave_then_free_the_disk(victim, slow, busy, seq_home)
    assert _committed(seq_home).get('victim') == [1, 2, 3, 4]
    assert _runs(seq_home)['victim']['reason'] == 'disconnect'
    assert not _leaks(caplog), _leaks(caplog)


def test_a_worker_stopping_with_writes_waiting_commits_every_answered_request_once_in_order(seq_home, tmp_path,
                                                                                           monkeypatch, caplog):
    caplog.set_level(logging.DEBUG)
    slow, _ = _capturing(seq_home, tmp_path, monkeypatch)
    with _serving(seq_home, tmp_path, ['hooked']) as (_, server, stub):
        robots = [_started(stub, 'hooked', f'captured-{k}') for k in range(CAPTURE_THREADS + 3)]
        slow.write_text('capture writes wait while this file exists')
        for s in robots:               # 8 writes wait on the disk, 3 for a thread
            s.send(observation=state_request(2, [0.0, 0.0], NAMES))
            assert s.recv(timeout=15).HasField('chunk')
        wait_for(lambda: _queued(server) == 3, what='three writes to wait for a thread')
        _stop_then_free_the_disk(server, slow)
    ids = [s.episode_id for s in robots]
    wait_for(lambda: all(e in _runs(seq_home) for e in ids), what='every run recorded')
    committed = _committed(seq_home)
    assert {e: committed.get(e) for e in ids} == {e: [1, 2] for e in ids}
    assert all(_runs(seq_home)[e]['captured'] == 1 for e in ids)
    assert not _leaks(caplog), _leaks(caplog)


def test_a_rollout_cut_while_a_write_waits_commits_it_and_an_uncaptured_episode_keeps_no_files(
        seq_home, tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.DEBUG)
    slow, waiting = _capturing(seq_home, tmp_path, monkeypatch)
    with _serving(seq_home, tmp_path, ['hooked']) as (_, server, stub):
        plain = _started(stub, 'camera', 'plain', [FRAME])           # the camera deployment: capture off
        cut = _started(stub, 'hooked', 'captured-cut')
        slow.write_text('capture writes wait while this file exists')
        cut.send(observation=state_request(2, [0.0, 0.0], NAMES))
        assert cut.recv(timeout=15).HasField('chunk')
        wait_for(lambda: 'captured-cut' in waiting, what='the write to wait')
        assert server.servicer.shutdown_streams('rollout', server.runtimes['hooked']) >= 1
        time.sleep(0.3)
        slow.unlink()
        assert cut.recv(timeout=15).HasField('error')
        ended = cut.recv(timeout=15)
        assert ended.HasField('ended') and ended.ended.captured, ended
        plain.cancel()
    assert _committed(seq_home).get('captured-cut') == [1, 2]
    camera = CaptureStore(seq_home / 'capture' / 'camera', deployment='camera')
    wait_for(lambda: any(r['episode_id'] == 'plain' for r in camera.runs()), what='the uncaptured run recorded')
    assert [(r['reason'], r['captured']) for r in camera.runs() if r['episode_id'] == 'plain'] == [('disconnect', 0)]
    assert not list(camera.episodes())
    assert not _leaks(caplog), _leaks(caplog)


def test_an_episode_whose_robot_dropped_its_capture_is_not_kept_when_the_robot_leaves_while_its_end_waits(
        seq_home, tmp_path, monkeypatch):
    slow, waiting = _capturing(seq_home, tmp_path, monkeypatch)
    with _serving(seq_home, tmp_path, ['hooked']) as (_, server, stub):
        victim = _started(stub, 'hooked', 'victim')          # request 1 answered and written (the disk fast yet)
        busy = _fill_the_pool(stub, slow, waiting)
        victim.send(end=DROPPED)
        wait_for(lambda: _end_begun(slow, 'victim'), what="the victim's end to begin (its hook runs, then waits)")
        _leave_then_free_the_disk(victim, slow, busy, seq_home)     # before EpisodeEnded
    assert 'victim' not in _committed(seq_home)
    assert _runs(seq_home)['victim']['captured'] == 0


def test_an_episode_whose_robot_dropped_its_capture_is_not_kept_when_the_worker_stops_while_its_end_waits(
        seq_home, tmp_path, monkeypatch):
    slow, waiting = _capturing(seq_home, tmp_path, monkeypatch)
    with _serving(seq_home, tmp_path, ['hooked']) as (_, server, stub):
        victim = _started(stub, 'hooked', 'victim')
        _fill_the_pool(stub, slow, waiting)
        victim.send(end=DROPPED)
        wait_for(lambda: _end_begun(slow, 'victim'), what="the victim's end to begin (its hook runs, then waits)")
        _stop_then_free_the_disk(server, slow)
    wait_for(lambda: 'victim' in _runs(seq_home), what="the victim's run recorded")
    assert 'victim' not in _committed(seq_home)


def test_a_dropped_capture_whose_last_answer_waits_to_be_written_keeps_nothing_when_the_robot_leaves(
        seq_home, tmp_path, monkeypatch):
    slow, waiting = _capturing(seq_home, tmp_path, monkeypatch)
    with _serving(seq_home, tmp_path, ['hooked']) as (_, server, stub):
        victim = _started(stub, 'hooked', 'victim')
        busy = _fill_the_pool(stub, slow, waiting)
        assert victim.ask(state_request(2, [0.0, 0.0], NAMES)).HasField('chunk')
        wait_for(lambda: _queued(server) > 0, what="the victim's write to wait for a thread")
        victim.send(end=DROPPED)       # read at once; handled only after the write, which waits
        time.sleep(0.3)
        _leave_then_free_the_disk(victim, slow, busy, seq_home)
    assert 'victim' not in _committed(seq_home)


def test_telemetry_whose_write_waits_for_a_thread_is_kept_when_the_robot_leaves(seq_home, tmp_path, monkeypatch):
    slow, waiting = _capturing(seq_home, tmp_path, monkeypatch)
    with _serving(seq_home, tmp_path, ['hooked']) as (_, server, stub):
        victim = _started(stub, 'hooked', 'victim')
        busy = _fill_the_pool(stub, slow, waiting)
        state = state_request(1, [0.0, 0.0], NAMES).state
        victim.send(telemetry=pb.Telemetry(frames=[pb.TelemetryFrame(robot_time_s=1.0, state=state, action=state)]))
        wait_for(lambda: _queued(server) > 0, what="the victim's telemetry write to wait for a thread")
        _leave_then_free_the_disk(victim, slow, busy, seq_home)
    episodes = {e.episode_id: e for e in _store(seq_home).episodes()}
    assert episodes['victim'].frames == 1
