"""Drain and typed refusals on a real fleet: ``seq serve`` replicas behind the shipped HAProxy 2.6 config.

- A rolling restart (SIGTERM, drain, a new process on the same ports, one replica at a time) under 12 robots
  running short episodes back to back loses none of them; an episode longer than ``--drain-timeout`` is cut
  with a typed reason; a same-id reconnect while its replica drains lands on another replica.
- A worker that is full refuses a new episode in the protocol, so through HAProxy the robot gets the typed,
  retryable Overloaded, not ConnectionLost (HAProxy 2.6 resets a call the server aborts while the robot sends).

The policy's actions are the pid of the replica that served them. Needs HAProxy (``make haproxy`` as root).
"""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from test_worker_support import wait_for

from sequence_ai_ros.cli import main as seq_main
from sequence_ai_ros.client import connect
from sequence_ai_ros.exceptions import ConnectionLost, NotReady, Overloaded, SequenceAIError
from sequence_ai_ros.protocol.types import Observation

POLICY = Path(__file__).resolve().parent / 'policies' / 'replica_echo.py'
ROBOTS = 12
DRAIN_S = 6.0     # the long episode keeps its replica draining this long: the reconnect's window
EPISODE_S = 0.8      # shorter than the drain timeout: none of these may be lost

if shutil.which('haproxy') is None and not Path('/usr/sbin/haproxy').exists():
    pytestmark = pytest.mark.skip(reason='HAProxy is not installed (as root: `make haproxy`); the fleet tests need '
                                         'a real load balancer')
else:
    from sequence_ai_ros.worker.fleet import Fleet


def drive(policy, episode_id: str, seconds: float, pids: set[int] | None = None,
          until: Callable[[], bool] | None = None) -> dict:
    """Run one episode (to ``until()`` when given); return its outcome or typed error and the pids that served it."""
    pids = set() if pids is None else pids

    def observe() -> Observation:
        return Observation(state=np.zeros(2, np.float32), state_names=('a', 'b'))

    def act(action) -> None:
        if not action.hold:
            pids.add(int(round(float(action.values[0]))))

    try:
        outcome = policy.act('drain test', observe, act, max_seconds=seconds, episode_id=episode_id, until=until)
        return {'id': episode_id, 'pids': pids, 'outcome': outcome, 'error': None}
    except SequenceAIError as exc:
        return {'id': episode_id, 'pids': pids, 'outcome': None, 'error': exc}


@pytest.mark.slow
def test_a_rolling_restart_loses_no_episode_shorter_than_the_drain_timeout(seq_home: Path):
    assert seq_main(['deploy', str(POLICY), '--name', 'replica_echo']) == 0
    with Fleet(['replica_echo'], 3, home=seq_home,
               serve_args=['--drain-timeout', f'{DRAIN_S:g}', '--idle-timeout', '30']) as fleet:
        index_of = {r.process.pid: r.index for r in fleet.replicas}
        robots = [connect('replica_echo', endpoint=fleet.address, timeout=10.0) for _ in range(ROBOTS)]
        long_robot = connect('replica_echo', endpoint=fleet.address, timeout=10.0)
        again = connect('replica_echo', endpoint=fleet.address, timeout=10.0)
        stop = threading.Event()
        results: list[list[dict]] = [[] for _ in robots]

        def loop(k: int) -> None:
            n = 0
            while not stop.is_set():
                results[k].append(drive(robots[k], f'robot{k:02d}-ep{n}', EPISODE_S))
                n += 1

        try:
            for p in (*robots, long_robot, again):
                p.wait_until_ready(timeout=30.0)
            threads = [threading.Thread(target=loop, args=(k,), name=f'robot{k}') for k in range(ROBOTS)]
            for t in threads:
                t.start()
            # an episode longer than the drain timeout, on the replica restarted first
            long_pids: set[int] = set()
            long_result: dict = {}
            runner = threading.Thread(target=lambda: long_result.update(
                drive(long_robot, 'long-episode', 60.0, long_pids)), name='long-robot')
            runner.start()
            wait_for(lambda: bool(long_pids), timeout=20, what='the long episode to be served')
            first = index_of[next(iter(long_pids))]
            order = [first, *(k for k in (1, 2, 3) if k != first)]

            restarter = threading.Thread(target=fleet.restart, args=(first,), name='restart-first')
            restarter.start()
            # a same-id reconnect while its replica drains goes to another replica, and is served (HAProxy
            # reads the agent every 500 ms: until it does, the draining replica refuses it and the client
            # retries); it runs until its first action, bounded well inside the drain (DRAIN_S)
            draining = fleet.replicas[first - 1]
            wait_for(lambda: fleet.agent_status(draining) == 'drain', timeout=20, what='the replica to drain')
            moved_pids: set[int] = set()
            moved = drive(again, 'long-episode', DRAIN_S - 1.0, moved_pids, until=lambda: bool(moved_pids))
            seen = {p: index_of.get(p, 'a restarted replica') for p in moved['pids']}
            assert moved['error'] is None and moved['outcome'].reason == 'until', (moved, seen, fleet.balancer_state())
            assert seen and first not in seen.values() and 'a restarted replica' not in seen.values(), \
                (moved, seen, fleet.balancer_state())
            runner.join(timeout=DRAIN_S + 30)
            restarter.join(timeout=90)
            assert not restarter.is_alive()
            # the long episode was cut at the drain timeout with a typed, named reason
            assert isinstance(long_result['error'], NotReady) and 'drain_timeout' in str(long_result['error']), \
                long_result
            for k in order[1:]:
                fleet.restart(k)
            time.sleep(2 * EPISODE_S)
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=60)
            for p in (*robots, long_robot, again):
                p.close()
        assert not any(t.is_alive() for t in threads), 'a robot did not finish'
        new_pids = {r.process.pid for r in fleet.replicas}
        assert not new_pids & set(index_of), 'every replica was restarted'
        episodes = [res for per_robot in results for res in per_robot]
        lost = [res for res in episodes if res['error'] is not None or res['outcome'].reason != 'timeout']
        assert not lost, lost[:5]
        served = {p for res in episodes for p in res['pids']}
        assert served & new_pids and served & set(index_of)    # robots ran across the restarts
        assert len(episodes) >= 3 * ROBOTS


@pytest.mark.slow
def test_a_full_worker_refuses_through_haproxy_with_a_typed_overloaded(seq_home: Path):
    assert seq_main(['deploy', str(POLICY), '--name', 'replica_echo']) == 0
    with Fleet(['replica_echo'], 1, home=seq_home, serve_args=['--max-streams', '1']) as fleet:
        holder = connect('replica_echo', endpoint=fleet.address, timeout=10.0)
        robot = connect('replica_echo', endpoint=fleet.address, timeout=10.0)
        try:
            holder.wait_until_ready(timeout=30.0)
            held: set[int] = set()
            runner = threading.Thread(target=drive, args=(holder, 'holder', 6.0, held), name='holder')
            runner.start()
            wait_for(lambda: bool(held), timeout=20, what='the first episode to be served')
            for n in range(3):   # each time: the typed refusal, never a reset read as ConnectionLost
                res = drive(robot, f'refused-{n}', 1.0)
                assert isinstance(res['error'], Overloaded) and not isinstance(res['error'], ConnectionLost), res
                assert res['error'].refusal == 'max_streams' and 'max_streams' in str(res['error'])
            runner.join(timeout=30)
            res = drive(robot, 'after', 1.0)    # once the slot is free, the same robot is served
            assert res['error'] is None and res['outcome'].reason == 'timeout', res
        finally:
            holder.close()
            robot.close()
