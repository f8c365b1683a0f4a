"""``seq admin`` against a real fleet: ``seq serve`` replicas (with a token) behind the shipped HAProxy config.

Under 6 robots running short episodes back to back through the balancer, ``seq admin --replicas`` (the file
``seq fleet`` writes) lists each replica's live episodes, and the balancer's own port refuses admin calls
(the robots' side); ``seq admin --endpoint REPLICA drain`` drains one
replica through the API, the path SIGTERM takes: its live episodes finish, new ones go to the other replica,
it exits 0, and no robot loses an episode. The policy's actions are the serving replica's pid. Needs HAProxy.
"""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import pytest
from test_fleet_drain import drive
from test_worker_support import wait_for

from sequence_ai_ros.cli import main as seq_main
from sequence_ai_ros.client import connect

POLICY = Path(__file__).resolve().parent / 'policies' / 'replica_echo.py'
TOKEN = 'fleet-adm1n'
ROBOTS = 6
EPISODE_S = 0.6      # well inside the drain timeout: none may be cut

if shutil.which('haproxy') is None and not Path('/usr/sbin/haproxy').exists():
    pytestmark = pytest.mark.skip(reason='HAProxy is not installed (as root: `make haproxy`); the fleet tests need '
                                         'a real load balancer')
else:
    from sequence_ai_ros.worker.fleet import Fleet


def _admin(capsys, *argv: str) -> list[dict]:
    """Run ``seq admin --json ARGV``; return one answer per replica (exit 0 asserted)."""
    assert seq_main(['admin', '--json', *argv]) == 0, capsys.readouterr().err
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


@pytest.mark.slow
def test_seq_admin_drains_one_replica_of_a_fleet_under_robots_and_no_episode_is_lost(seq_home: Path, tmp_path: Path,
                                                                                    capsys):
    token_file = tmp_path / 'token'
    token_file.write_text(TOKEN + '\n')
    assert seq_main(['deploy', str(POLICY), '--name', 'replica_echo']) == 0
    capsys.readouterr()
    with Fleet(['replica_echo'], 2, home=seq_home,
               serve_args=['--token-file', str(token_file), '--drain-timeout', '10', '--idle-timeout', '30']) as fleet:
        pid_of = {r.index: r.process.pid for r in fleet.replicas}
        auth = ['--token-file', str(token_file)]
        robots = [connect('replica_echo', endpoint=fleet.address, token=TOKEN, timeout=10.0) for _ in range(ROBOTS)]
        stop = threading.Event()
        results: list[list[dict]] = [[] for _ in robots]

        def loop(k: int) -> None:
            n = 0
            while not stop.is_set():
                results[k].append(drive(robots[k], f'robot{k}-ep{n}', EPISODE_S))
                n += 1

        threads = [threading.Thread(target=loop, args=(k,), name=f'robot{k}') for k in range(ROBOTS)]
        try:
            for p in robots:
                p.wait_until_ready(timeout=30.0)
            for t in threads:
                t.start()
            # every replica answers by its own address (the file seq fleet writes); both run episodes
            listed = wait_for(lambda: (a := _admin(capsys, '--replicas', str(fleet.replicas_file), *auth,
                                                   'episodes')) and all(r.get('episodes') for r in a) and a,
                              timeout=30, what='episodes live on both replicas')
            assert [r['endpoint'] for r in listed] == [r.address for r in fleet.replicas]
            for answer, replica in zip(listed, fleet.replicas, strict=True):
                assert f'pid {replica.process.pid}' in answer['replica']
                assert {e['deployment'] for e in answer['episodes']} == {'replica_echo'}
            # without the token the fleet's admin API answers nothing
            assert seq_main(['admin', '--replicas', str(fleet.replicas_file), 'stats']) == 1
            assert capsys.readouterr().err.count(': UNAUTHENTICATED: ') == 2
            # nor, with it, through the balancer robots dial: the admin API is not for robots
            assert seq_main(['admin', '--endpoint', fleet.address, *auth, 'drain']) == 1
            assert ': PERMISSION_DENIED: ' in capsys.readouterr().err

            drained = fleet.replicas[0]
            (reply,) = _admin(capsys, '--endpoint', drained.address, *auth, 'drain')
            assert not reply['already_draining'] and reply['drain_timeout_s'] == 10
            assert drained.process.wait(timeout=45) == 0       # drained, stopped, exited cleanly
            log = fleet.log('replica1')
            assert 'draining (up to 10 s)' in log and 'admin: drain asked' in log   # SIGTERM's path, from the API
            assert 'drain timeout' not in log                                         # nothing cut
            after = {k: len(per_robot) for k, per_robot in enumerate(results)}
            wait_for(lambda: all(len(results[k]) >= after[k] + 2 for k in after), timeout=30,
                     what='two more episodes per robot on the other replica')
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=60)
            for p in robots:
                p.close()
        assert not any(t.is_alive() for t in threads), 'a robot did not finish'
        episodes = [res for per_robot in results for res in per_robot]
        lost = [res for res in episodes if res['error'] is not None or res['outcome'].reason != 'timeout']
        assert not lost, lost[:5]
        later = [res for k, per_robot in enumerate(results) for res in per_robot[after[k] + 1:]]
        assert later and all(res['pids'] == {pid_of[2]} for res in later), later[:3]
        served = {p for res in episodes for p in res['pids']}
        assert served == {pid_of[1], pid_of[2]}
        (stats,) = _admin(capsys, '--endpoint', fleet.replicas[1].address, *auth, 'stats')
        (row,) = stats['versions']
        assert row['deployment'] == 'replica_echo' and int(row['episodes_ended']) > 0
        assert set(row['ended_by_reason']) <= {'timeout', 'disconnect', 'completed'}
