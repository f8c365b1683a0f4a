"""Pipelined requests: more than one in flight when the round trip needs it, each with its start step.

A worker on loopback behind a delay proxy (``sequence_ai_ros.bench.delay_proxy``: the network part of
the latency, on the link, +-10 % jitter) serves ``test/policies/inpaint.py``, which copies
``chunk_tail[:expected_delay_actions]`` and then holds its request id. If every request's tail and
delay are right for the step at which its chunk starts, every seam falls inside an in-painted prefix:
the discontinuity at seams (``max_seam_gap``) is 0 at every latency/covers ratio up to 0.9, while the
same policy without in-painting jumps at every seam.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from sequence_ai_ros.bench.delay_proxy import DelayProxy
from sequence_ai_ros.client import Observation, connect
from sequence_ai_ros.worker import serve_policy_file

POLICY = Path(__file__).parent / 'policies' / 'inpaint.py'
DT, T = 0.02, 20                 # covers 0.4 s
COMPUTE = 0.05 * DT * T


def run_at(ratio: float, inpaint: bool = True, actions: int = 120):
    covers = DT * T
    server = serve_policy_file(POLICY, 'inpaint', dt=DT, chunk_length=T, compute_s=COMPUTE, inpaint=inpaint)
    proxy = DelayProxy(server.port, one_way_s=max(0.0, ratio * covers - COMPUTE) / 2, jitter=0.1, seed=7)
    try:
        with connect('inpaint', endpoint=f'127.0.0.1:{proxy.port}') as policy:
            policy.wait_until_ready(timeout=30)
            out = policy.run(lambda: Observation(state=np.zeros(2, np.float32), state_names=('a', 'b')),
                             lambda action: None, max_actions=actions)
    finally:
        proxy.close()
        server.stop(grace=0.5)
    print(f'\nratio {ratio} inpaint={inpaint}: {out} gap={out.max_seam_gap:.3g} jump={out.max_seam_jump:.3g} '
          f'in flight<={out.peak_in_flight} discarded={out.discarded} underruns={out.underruns} '
          f'p50={out.latency_p50_ms:.0f} ms')
    return out


@pytest.mark.slow
@pytest.mark.parametrize('ratio', [0.2, 0.45, 0.8, 0.9])
def test_an_inpainting_policy_has_no_seam_discontinuity_at_any_ratio(ratio):
    out = run_at(ratio)
    assert out.reason == 'completed' and out.chunks >= 4
    assert out.max_seam_gap == 0.0
    if ratio >= 0.8:
        assert out.peak_in_flight >= 2                  # the round trip needed more than one in flight


@pytest.mark.slow
def test_without_inpainting_the_same_seams_jump():
    out = run_at(0.8, inpaint=False)
    assert out.chunks >= 4 and out.max_seam_gap >= 1.0     # the gap measure is not blind


def test_the_worker_splices_answers_the_robot_has_not_received_and_leaves_old_peers_alone():
    from sequence_ai_ros.protocol import codec
    from sequence_ai_ros.protocol import sequence_ai_pb2 as pb
    from sequence_ai_ros.protocol.pipeline import TailSplicer

    splicer = TailSplicer()
    first = pb.ObservationRequest(request_id=2, observation_step=4, expected_delay_actions=3, splice_tail=True,
                                  tail_request_id=1, chunk_tail=codec.to_tensor(np.zeros((4, 1), np.float32)))
    splicer.complete(first, 1)
    splicer.record(first, pb.ActionChunk(actions=codec.to_tensor(np.arange(10, 16, dtype=np.float32)[:, None])))
    # Request 3 was cut from chunk 1 (steps 6..7 known) before chunk 2 (steps 4..9) reached the robot.
    later = pb.ObservationRequest(request_id=3, observation_step=6, expected_delay_actions=3, splice_tail=True,
                                  tail_request_id=1, chunk_tail=codec.to_tensor(np.zeros((2, 1), np.float32)))
    splicer.complete(later, 1)
    assert codec.from_tensor(later.chunk_tail)[:, 0].tolist() == [12.0, 13.0, 14.0, 15.0]
    old_peer = pb.ObservationRequest(request_id=4, chunk_tail=codec.to_tensor(np.zeros((2, 1), np.float32)))
    splicer.complete(old_peer, 1)
    assert codec.from_tensor(old_peer.chunk_tail)[:, 0].tolist() == [0.0, 0.0]
