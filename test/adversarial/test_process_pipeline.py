"""Several requests in flight to one deployment process at once (``--isolation process``): pipelined, in order.

A real worker, real gRPC streams and real deployment processes. The policy holds its first request until a
file exists (a gate), so that the requests sent behind it wait in the process's pipeline: sent from the event
loop, not answered, not started (:attr:`~sequence_ai_ros.worker.scheduler.InferenceScheduler.pipelined`). Then
the answers go to the right episodes, in the order sent; an episode that ends while its request waits there
never starts it; and a crash under a full pipeline fails every request in flight of that deployment, typed,
and nothing of another.
"""

from __future__ import annotations

import textwrap
import time
from pathlib import Path

import pytest
from test_worker_support import Stream, channel, serving, state_request, wait_for, wait_ready

from sequence_ai_ros.protocol import codec
from sequence_ai_ros.protocol import sequence_ai_pb2 as pb
from sequence_ai_ros.protocol import sequence_ai_pb2_grpc as pb_grpc
from sequence_ai_ros.worker import create_server, serve_policy_file
from sequence_ai_ros.worker.registry import deploy

#: Bound of a wait that must stay generous on a loaded 2-core machine (s).
WAIT_S = 60.0

POLICY = textwrap.dedent('''
    import os, time
    import numpy as np
    import sequence_ai_ros.policy as seq

    NAMES = ['a', 'b']

    @seq.policy(action_space='joint_absolute', action_names=NAMES, dt=0.1, chunk_length=4,
                observation=seq.ObservationContract(state_names=NAMES))
    class Gated:
        def infer(self, inp, episode):
            p = inp.observation.params
            if 'log' in p:                       # every inference that starts, in the order it starts
                with open(p['log'], 'a') as out:
                    out.write(f"{episode.id} {int(inp.observation.state[0])}\\n")
            if 'gate' in p:                      # held until the test opens the gate (bounded)
                deadline = time.monotonic() + 60
                while not os.path.exists(p['gate']) and time.monotonic() < deadline:
                    time.sleep(0.005)
            if 'exit' in p:
                os._exit(int(p['exit']))
            episode.state['n'] = episode.state.get('n', 0) + 1
            return np.tile(np.array([inp.observation.state[0], episode.state['n']], np.float32), (4, 1))
''')


def write_policy(root: Path, name: str) -> Path:
    path = root / name / 'policy.py'
    path.parent.mkdir(parents=True)
    path.write_text(POLICY)
    return path


def req(rid: int, value: float, **params: str) -> pb.ObservationRequest:
    return state_request(rid, [value, 0.0], ['a', 'b'], params=params)


def begun(log: Path) -> list[tuple[str, int]]:
    """The inferences the policy started, in order: (episode id, the request's value)."""
    if not log.exists():
        return []
    return [(e, int(v)) for e, v in (line.split() for line in log.read_text().splitlines())]


def first(reply: pb.EpisodeReply) -> tuple[float, float]:
    assert reply is not None and reply.HasField('chunk'), reply
    row = codec.from_tensor(reply.chunk.actions)[0]
    return float(row[0]), float(row[1])


@pytest.fixture
def gated(tmp_path):
    """A worker serving ``gated`` in its deployment process; yields (server, stub, runtime)."""
    with serving(write_policy(tmp_path, 'gated'), 'gated', timeout=WAIT_S, inference_timeout_s=120.0,
                 idle_timeout_s=120) as served:
        yield served


def _open(stub, deployment: str, names: list[str]) -> list[Stream]:
    streams = [Stream(stub, deployment, name) for name in names]
    for stream in streams:
        assert stream.start().HasField('started')
    return streams


def test_several_requests_are_in_flight_at_once_and_each_answer_goes_to_its_episode_in_order(gated, tmp_path):
    server, stub, runtime = gated
    log, gate = tmp_path / 'begun.log', tmp_path / 'gate'
    robots = _open(stub, 'gated', [f'robot-{k}' for k in range(5)])
    robots[0].send(observation=req(1, 100, log=str(log), gate=str(gate)))
    wait_for(lambda: begun(log) == [('robot-0', 100)], WAIT_S, 'the first inference held at the gate')
    for k in range(1, 5):                  # sent behind it, while the process is busy with the first
        robots[k].send(observation=req(1, 100 + k, log=str(log)))
        wait_for(lambda k=k: runtime.scheduler.pipelined == k + 1, WAIT_S, f'request {k + 1} in flight')
    # all five in flight to the process; the four behind the running one wait their turn (seq_queue_depth)
    assert runtime.scheduler.pipelined == 5 and runtime.scheduler.queue_depth == 4
    assert begun(log) == [('robot-0', 100)]                  # sent, and not started: one call at a time there
    gate.touch()
    assert [first(robot.recv()) for robot in robots] == [(100 + k, 1) for k in range(5)]
    assert begun(log) == [(f'robot-{k}', 100 + k) for k in range(5)]      # in the order sent
    assert runtime.scheduler.pipelined == 0
    # A second round, pipelined again: each episode's own state, each robot its own chunk.
    gate.unlink()
    robots[0].send(observation=req(2, 200, log=str(log), gate=str(gate)))
    wait_for(lambda: begun(log)[-1] == ('robot-0', 200), WAIT_S, 'the first inference held at the gate again')
    for k in range(1, 5):
        robots[k].send(observation=req(2, 200 + k, log=str(log)))
        wait_for(lambda k=k: runtime.scheduler.pipelined == k + 1, WAIT_S, f'request {k + 1} in flight again')
    gate.touch()
    assert [first(robot.recv()) for robot in robots] == [(200 + k, 2) for k in range(5)]
    assert begun(log)[5:] == [(f'robot-{k}', 200 + k) for k in range(5)]
    for robot in robots:
        assert robot.end().HasField('ended')
    assert runtime.end_stats() == {'requests_dropped_at_end': 0, 'results_discarded_at_end': 0,
                                   'inferences_started_after_end': 0}
    assert runtime.restarts == 0


def test_an_episode_ended_while_its_request_waits_in_the_pipeline_never_starts_it(gated, tmp_path):
    server, stub, runtime = gated
    log, gate = tmp_path / 'begun.log', tmp_path / 'gate'
    held, ending, after = _open(stub, 'gated', ['robot-held', 'robot-ending', 'robot-after'])
    held.send(observation=req(1, 1, log=str(log), gate=str(gate)))
    wait_for(lambda: begun(log) == [('robot-held', 1)], WAIT_S, 'the first inference held at the gate')
    ending.send(observation=req(1, 2, log=str(log)))
    wait_for(lambda: runtime.scheduler.pipelined == 2, WAIT_S, "the ending robot's request in flight")
    after.send(observation=req(1, 3, log=str(log)))
    wait_for(lambda: runtime.scheduler.pipelined == 3, WAIT_S, 'a request behind it in flight')
    reply = ending.end()                    # EpisodeEnded at once: it never waits for the request in flight
    assert reply.HasField('ended'), reply
    gate.touch()
    assert first(held.recv()) == (1, 1)
    assert first(after.recv()) == (3, 1)   # the one behind the dropped request is answered, its own
    assert ending.recv() is None            # the ended episode got no chunk: the stream closed
    assert begun(log) == [('robot-held', 1), ('robot-after', 3)]        # the ended episode's request never started
    wait_for(lambda: runtime.scheduler.pipelined == 0, WAIT_S, 'the pipeline empty')
    assert runtime.end_stats() == {'requests_dropped_at_end': 1, 'results_discarded_at_end': 0,
                                   'inferences_started_after_end': 0}
    assert first(after.ask(req(2, 4))) == (4, 2)
    assert held.end().HasField('ended') and after.end().HasField('ended')


def test_a_crash_under_a_full_pipeline_fails_each_request_in_flight_typed_and_no_other_deployment(seq_home,
                                                                                                   tmp_path):
    for name in ('crashy', 'steady'):
        deploy(write_policy(tmp_path, name), home=seq_home, dry_timeout_s=60)
    server = create_server(['crashy', 'steady'], home=seq_home, inference_timeout_s=120.0, idle_timeout_s=120,
                           isolation='process')
    ch = channel(server.port)
    try:
        stub = pb_grpc.PolicyServiceStub(ch)
        for name in ('crashy', 'steady'):
            assert wait_ready(stub, name, timeout=WAIT_S).ready
        crashy, steady = server.runtimes['crashy'], server.runtimes['steady']
        log, gate, steady_log = tmp_path / 'begun.log', tmp_path / 'gate', tmp_path / 'steady.log'
        robots = _open(stub, 'crashy', [f'crash-{k}' for k in range(4)])
        others = _open(stub, 'steady', [f'steady-{k}' for k in range(2)])
        robots[0].send(observation=req(1, 1, log=str(log), gate=str(gate), exit='3'))
        wait_for(lambda: begun(log) == [('crash-0', 1)], WAIT_S, 'the crashing inference held at the gate')
        for k in range(1, 4):
            robots[k].send(observation=req(1, 1 + k, log=str(log)))
            wait_for(lambda k=k: crashy.scheduler.pipelined == k + 1, WAIT_S, f'request {k + 1} in flight')
        for k, other in enumerate(others):      # the other deployment serves meanwhile
            assert first(other.ask(req(1, 50 + k, log=str(steady_log)))) == (50 + k, 1)
        gate.touch()                            # the process exits (code 3) with 4 requests in flight
        for robot in robots:
            reply = robot.recv()
            assert reply is not None and reply.error.code == pb.POLICY_EXCEPTION, reply
            assert "deployment 'crashy'" in reply.error.message and 'exit code 3' in reply.error.message, reply
        assert begun(log) == [('crash-0', 1)]   # none behind it ran
        for k, other in enumerate(others):
            assert first(other.ask(req(2, 60 + k, log=str(steady_log)))) == (60 + k, 2)   # its episodes' state kept
        assert steady.restarts == 0 and steady.scheduler.pipelined == 0
        wait_for(lambda: crashy.restarts == 1, WAIT_S, 'crashy restarted')
        deadline = time.monotonic() + WAIT_S
        rid = 1
        while True:                             # crashy comes back: NOT_READY while it restarts, then chunks
            rid += 1
            reply = robots[1].ask(req(rid, 9))
            if reply.HasField('chunk'):
                break
            assert reply.error.code == pb.NOT_READY and time.monotonic() < deadline, reply
            time.sleep(0.05)
        for stream in (*robots, *others):
            assert stream.end().HasField('ended')
    finally:
        ch.close()
        server.stop(grace=0.5)



def test_requests_waiting_in_the_pipeline_count_against_max_pending(tmp_path):
    """A request pipelined behind the running one waits as a queued one does: max_pending bounds both."""
    server = serve_policy_file(write_policy(tmp_path, 'gated'), deployment='gated', host='127.0.0.1', port=0,
                               isolation='process', inference_timeout_s=120.0, idle_timeout_s=120, max_pending=2)
    gate, log = tmp_path / 'gate', tmp_path / 'log'
    try:
        with channel(server.port) as ch:
            stub = pb_grpc.PolicyServiceStub(ch)
            assert wait_ready(stub, 'gated', timeout=WAIT_S).ready
            runtime = server.runtimes['gated']
            robots = _open(stub, 'gated', [f'robot-{k}' for k in range(4)])
            robots[0].send(observation=req(1, 100, gate=str(gate), log=str(log)))
            wait_for(lambda: begun(log) == [('robot-0', 100)], WAIT_S, 'the first inference held at the gate')
            for k in (1, 2):           # two wait their turn behind it: max_pending reached
                robots[k].send(observation=req(1, 100 + k, log=str(log)))
                wait_for(lambda k=k: runtime.scheduler.queue_depth == k, WAIT_S, f'request {k + 1} waiting')
            refused = robots[3].ask(req(1, 103, log=str(log)))
            assert refused.error.code == pb.OVERLOADED and 'max 2' in refused.error.message, refused
            gate.touch()
            assert [first(robots[k].recv())[0] for k in range(3)] == [100.0, 101.0, 102.0]
            assert first(robots[3].ask(req(2, 104, log=str(log))))[0] == 104.0   # served once there is room
            assert begun(log) == [('robot-0', 100), ('robot-1', 101), ('robot-2', 102), ('robot-3', 104)]
            for r in robots:
                r.end()
    finally:
        server.stop(grace=0.5)
