"""A served request leaves no reference cycle behind: its arrays go when it is answered, not at a collection.

Each request through a deployment process once made a cycle (the scheduler's job, its cancel, the call in
flight, the answer's callback, the job again) of 38 objects holding the request's decoded observation: Python's
cycle collector freed them, and on a worker serving 128 robots its collections took 5-40 ms of the event loop,
each a burst of late replies. Counted with the collector off and ``gc.DEBUG_SAVEALL`` on: what a collection
then finds is exactly what only a collection would have freed.
"""

from __future__ import annotations

import collections
import gc
import textwrap

import pytest
from test_worker_support import Stream, channel, state_request, wait_ready

from sequence_ai_ros.protocol import sequence_ai_pb2_grpc as pb_grpc
from sequence_ai_ros.worker import serve_policy_file

POLICY = textwrap.dedent('''
    import numpy as np
    import sequence_ai_ros.policy as seq

    @seq.policy(action_space='joint_absolute', action_names=['a', 'b'], dt=0.1, chunk_length=4,
                observation=seq.ObservationContract(state_names=['a', 'b']))
    class Echo:
        def infer(self, inp, episode):
            return np.tile(inp.observation.state, (4, 1))
''')
ROBOTS, REQUESTS = 4, 100


@pytest.mark.parametrize('isolation', ['process', 'none'])
def test_requests_answered_leave_no_cyclic_garbage(tmp_path, isolation):
    path = tmp_path / 'echo' / 'policy.py'
    path.parent.mkdir()
    path.write_text(POLICY)
    server = serve_policy_file(path, deployment='echo', host='127.0.0.1', port=0, isolation=isolation,
                               idle_timeout_s=120)
    ch = channel(server.port)
    robots: list[Stream] = []
    try:
        stub = pb_grpc.PolicyServiceStub(ch)
        assert wait_ready(stub, 'echo', timeout=60).ready
        if isolation == 'process':       # what the worker holds once loaded is frozen: full collections skip it
            assert gc.get_freeze_count() > 0
        robots = [Stream(stub, 'echo', f'robot-{k}') for k in range(ROBOTS)]
        for robot in robots:
            assert robot.start().HasField('started')
            assert robot.ask(state_request(1, [0.0, 0.0], ['a', 'b'])).HasField('chunk')   # warm
        gc.collect()
        gc.disable()
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            for rid in range(2, REQUESTS + 2):
                for k, robot in enumerate(robots):
                    reply = robot.ask(state_request(rid, [float(k), float(rid)], ['a', 'b']))
                    assert reply.HasField('chunk'), reply
            gc.collect()
            found = collections.Counter(type(o).__name__ for o in gc.garbage)
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
            gc.enable()
        # a cycle per request would leave at least ROBOTS * REQUESTS objects; a few one-off cycles may come
        # from the machinery (a thread, a logger), never one per request
        assert sum(found.values()) < ROBOTS * REQUESTS / 4, found.most_common(10)
        assert not found['PolicyInput'] and not found['ndarray'], found.most_common(10)
        for robot in robots:
            assert robot.end().HasField('ended')
    finally:
        for robot in robots:
            robot.close()
        ch.close()
        server.stop(grace=0.5)
