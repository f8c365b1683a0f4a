"""Drain (SIGTERM) races: a stream a robot opened just before the drain began starts no episode there.

The drain refuses a new episode when its stream opens; a stream admitted a moment before the drain began,
whose EpisodeStart came after, started its episode on the draining replica (to be cut at the drain timeout,
where a refusal sends it to another replica).
"""

from __future__ import annotations

import threading

import pytest
from test_worker_support import POLICIES, Stream, channel, wait_for, wait_ready

from sequence_ai_ros.exceptions import Draining
from sequence_ai_ros.protocol import errors as perrors
from sequence_ai_ros.protocol import sequence_ai_pb2_grpc as pb_grpc
from sequence_ai_ros.worker import serve_policy_file

FAST = POLICIES / 'fast.py'


def test_an_episode_start_on_a_stream_opened_before_the_drain_is_refused_as_draining():
    pytest.importorskip('prometheus_client', reason='prometheus_client is not installed (the [metrics] extra)')
    with serve_policy_file(FAST, 'fast', dim=2, metrics_port=0) as server, channel(server.port) as ch:
        stub = pb_grpc.PolicyServiceStub(ch)
        assert wait_ready(stub, 'fast').ready
        early = Stream(stub, 'fast', 'early')              # opened before SIGTERM; its EpisodeStart comes after
        wait_for(lambda: server.servicer.open_streams() == 1, what='the stream to be admitted')
        left: list[int] = []
        drainer = threading.Thread(target=lambda: left.append(server.drain(30.0)), name='drain')
        drainer.start()
        wait_for(lambda: server.servicer.drain.draining, what='the drain to begin')
        reply = early.start()
        error = perrors.from_error(reply.error)
        assert isinstance(error, Draining) and error.refusal == 'draining', reply
        assert server.runtimes['fast'].running_episodes() == []
        early.close()
        assert early.recv(timeout=10) is None and early.error is None   # ended once the robot closed
        drainer.join(timeout=20)
        assert left == [0]                                  # nothing left to cut
        refused = {s.labels['reason']: s.value for family in server.metrics.registry.collect()
                   if family.name == 'seq_streams_refused' for s in family.samples if s.name.endswith('_total')}
        assert refused['draining'] == 1
