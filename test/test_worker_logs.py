"""The worker's logs as an operator reads them: ``seq serve --log-format json|text --log-level``.

A real ``seq serve`` (a subprocess) serves one episode whose every request makes the policy raise: its stderr
is one JSON object per line with a UTC timestamp; the episode has one start line and one end line, each
with its episode id, client id, deployment and version; the policy's warning, raised at every request, is
written at most once a second (the rate limit's own bound, counted against the seconds the episode took).
The rate limit itself runs on a fake clock.
"""

from __future__ import annotations

import datetime
import io
import json
import logging
import re
import subprocess
import sys
import time

import pytest
from test_worker_server import ECHO, echo_req
from test_worker_support import Stream, channel, wait_for, wait_ready

from sequence_ai_ros.protocol import sequence_ai_pb2 as pb
from sequence_ai_ros.protocol import sequence_ai_pb2_grpc as pb_grpc
from sequence_ai_ros.worker import logs

REQUESTS = 40


def _serve(processes, *options: str) -> tuple[subprocess.Popen, int]:
    proc = processes.spawn([sys.executable, '-m', 'sequence_ai_ros.cli', 'serve', str(ECHO), '--port', '0',
                            *options])
    line = proc.stdout.readline()   # 'serving worker_echo on 127.0.0.1:PORT'
    match = re.match(r'^serving \S+ on \S+:(\d+)', line)
    assert match, (line, proc.poll())
    return proc, int(match.group(1))


def _episode(port: int, episode_id: str, client_id: str) -> float:
    """Run one episode of REQUESTS requests that all raise in the policy; return the seconds it took."""
    with channel(port) as ch:
        stub = pb_grpc.PolicyServiceStub(ch)
        assert wait_ready(stub, 'worker_echo').ready
        t0 = time.monotonic()
        stream = Stream(stub, 'worker_echo', episode_id)
        stream.send(start=pb.EpisodeStart(episode_id=episode_id, instruction='log', client_id=client_id))
        assert stream.recv().WhichOneof('kind') == 'started'
        for rid in range(1, REQUESTS + 1):
            assert stream.ask(echo_req(rid, params={'raise': 'boom'})).WhichOneof('kind') == 'error'
        assert stream.end().WhichOneof('kind') == 'ended'
        stream.close()
        return time.monotonic() - t0


def _stop(proc: subprocess.Popen) -> str:
    proc.terminate()
    _, err = proc.communicate(timeout=20)
    return err


def test_json_logs_carry_utc_time_episode_lines_and_rate_limited_warnings(processes):
    proc, port = _serve(processes, '--log-format', 'json', '--log-level', 'info')
    took = _episode(port, 'ep-logs-1', 'robot-7')
    lines = _stop(proc).splitlines()
    records = [json.loads(line) for line in lines]             # every line is one JSON object
    for rec in records:
        assert rec['ts'].endswith('Z') and {'level', 'logger', 'message'} <= set(rec), rec
        stamp = datetime.datetime.strptime(rec['ts'], '%Y-%m-%dT%H:%M:%S.%fZ').replace(tzinfo=datetime.timezone.utc)
        assert abs((datetime.datetime.now(datetime.timezone.utc) - stamp).total_seconds()) < 600   # UTC, not local
    episode = [r for r in records if r.get('episode_id') == 'ep-logs-1' and r.get('event', '').startswith('episode')]
    assert [r['event'] for r in episode] == ['episode_started', 'episode_ended'], episode
    for rec in episode:
        assert (rec['client_id'], rec['deployment'], rec['version']) == ('robot-7', 'worker_echo', 0), rec
    assert episode[1]['reason'] == 'completed' and isinstance(episode[1]['requests'], int)
    raised = [r for r in records if r['level'] == 'WARNING' and 'raised on episode' in r['message']]
    # the policy raised REQUESTS times; the same warning is written at most once per second
    assert 1 <= len(raised) <= 1 + int(took / logs.WARNING_INTERVAL_S) + 1, (len(raised), took)
    assert len(raised) < REQUESTS
    for rec in raised[1:]:
        assert re.search(r'\(\d+ more like this in the last [\d.]+ s\)', rec['message']), rec


def test_text_logs_are_utc_and_the_level_flag_drops_info(processes):
    proc, port = _serve(processes, '--log-level', 'warning')
    _episode(port, 'ep-logs-2', 'robot-8')
    lines = [line for line in _stop(proc).splitlines() if line.strip()]
    utc_warning = r'^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z (WARNING|ERROR) '
    assert lines and all(re.match(utc_warning, line) for line in lines), lines
    assert not any('ep-logs-2 started' in line for line in lines)    # info lines are below --log-level warning

    proc, port = _serve(processes)                                    # text, info: the default
    _episode(port, 'ep-logs-3', 'robot-9')
    text = _stop(proc)
    start = next(line for line in text.splitlines() if 'episode ep-logs-3 started' in line)
    assert re.match(r'^\S+Z INFO sequence_ai_ros\.worker\.runtime: ', start)
    assert 'episode_id=ep-logs-3' in start and 'client_id=robot-9' in start and 'deployment=worker_echo' in start
    assert 'version=0' in start and re.search(r'episode ep-logs-3 ended .*reason=completed', text)


def test_the_rate_limit_writes_one_warning_a_second_and_counts_the_rest():
    now = [100.0]
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(logs.TextFormatter())
    limit = logs.RateLimitFilter(clock=lambda: now[0])
    handler.addFilter(limit)
    log = logging.getLogger('test_worker_logs.rate')
    log.propagate = False
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    try:
        for k in range(10):
            log.warning('queue full for %s: %s', 'arm', f'robot{k}')   # one message, whatever its later arguments
            log.info('info %d', k)                           # below WARNING: never limited
        log.warning('another warning')                       # another message: its own budget
        now[0] += 0.99
        log.warning('queue full for %s: %s', 'arm', 'robot10')
        now[0] += 0.02                                       # 1.01 s after the first
        log.warning('queue full for %s: %s', 'arm', 'robot11')
    finally:
        log.removeHandler(handler)
    lines = out.getvalue().splitlines()
    full = [line for line in lines if 'queue full' in line]
    assert len(full) == 2 and 'robot0' in full[0] and 'robot11' in full[1], full
    assert '(10 more like this in the last 1.0 s)' in full[1]
    assert sum('info' in line for line in lines) == 10 and sum('another warning' in line for line in lines) == 1
    assert limit.suppressed == 10


def _limited(limit: logs.RateLimitFilter, name: str) -> tuple[logging.Logger, io.StringIO, logging.Handler]:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(logs.TextFormatter())
    handler.addFilter(limit)
    log = logging.getLogger(name)
    log.propagate = False
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    return log, out, handler


def test_one_deployments_warnings_never_hide_anothers():
    """The first argument is part of what makes a warning the same: a bare '%s' too."""
    now = [100.0]
    limit = logs.RateLimitFilter(clock=lambda: now[0])
    log, out, handler = _limited(limit, 'test_worker_logs.keys')
    try:
        for _ in range(3):
            log.error('%s', "deployment 'arm' failed: its policy process died")
            log.error('%s', "deployment 'hand' failed: its policy process died")
            log.warning('policy %s raised on episode %s: %s', 'arm', 'e1', 'boom')
            log.warning('policy %s raised on episode %s: %s', 'hand', 'e2', 'boom')
            log.warning('policy %s raised on episode %s: %s', 'hand', 'e3', 'boom')   # another episode: the same
        log.error('%s', 'x' * 5000 + 'a')          # only the first 200 characters count
        log.error('%s', 'x' * 5000 + 'b')
    finally:
        log.removeHandler(handler)
    lines = out.getvalue().splitlines()
    assert sum("'arm' failed" in line for line in lines) == 1 and sum("'hand' failed" in line for line in lines) == 1
    assert [line.split(': ', 1)[1] for line in lines if 'raised on episode' in line] == [
        'policy arm raised on episode e1: boom', 'policy hand raised on episode e2: boom']
    assert sum('xxx' in line for line in lines) == 1
    assert limit.suppressed == 3 * 5 - 4 + 1


def test_a_burst_that_ended_has_its_count_written_by_flush():
    now = [100.0]
    limit = logs.RateLimitFilter(clock=lambda: now[0])
    log, out, handler = _limited(limit, 'test_worker_logs.flush')
    try:
        for k in range(4):
            log.warning('queue full for %s: %s', 'arm', f'robot{k}')   # the first written, three held
        now[0] += 0.5
        assert limit.flush() == []                       # the burst may go on: nothing yet
        now[0] += 0.6                                    # 1.1 s after the written one, and nothing came
        [released] = limit.flush()
        assert released.getMessage() == 'queue full for arm: robot3 (2 more like this in the last 1.1 s)'
        assert limit.flush() == []                       # written once
        log.warning('queue full for %s: %s', 'arm', 'robot4')   # within 1 s of the released one: held
        now[0] += 1.0
        assert [r.getMessage() for r in limit.flush()] == ['queue full for arm: robot4']   # alone: as it was
    finally:
        log.removeHandler(handler)
    assert sum('queue full' in line for line in out.getvalue().splitlines()) == 1   # flush() returned the rest


def test_configure_writes_the_count_of_a_burst_that_ended_by_itself():
    """No later warning comes: the worker's handler writes the held count on its own, about a second later."""
    out = io.StringIO()
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    handler = logs.configure('text', 'info', stream=out)
    try:
        log = logging.getLogger('test_worker_logs.burst')
        for k in range(5):
            log.warning('queue full for %s: %s', 'arm', f'robot{k}')
        wait_for(lambda: 'more like this' in out.getvalue(), timeout=10, what='the burst\'s count to be written')
    finally:
        for f in handler.filters:
            f.close()
        root.removeHandler(handler)
        for h in saved[0]:
            root.addHandler(h)
        root.setLevel(saved[1])
    lines = [line for line in out.getvalue().splitlines() if 'queue full' in line]
    assert len(lines) == 2 and lines[0].endswith('queue full for arm: robot0'), lines
    assert re.search(r'queue full for arm: robot4 \(3 more like this in the last [\d.]+ s\)$', lines[1]), lines


def test_configure_refuses_unknown_formats_and_levels():
    with pytest.raises(ValueError, match='json'):
        logs.configure('xml')
    with pytest.raises(ValueError, match='debug'):
        logs.configure('json', 'loud')
