"""A test policy that in-paints the committed prefix, as real-time chunking does (Black et al. 2025).

Rows ``[0, expected_delay_actions)`` of its chunk are ``chunk_tail``'s (what the robot will execute
before this chunk starts); the rest is a constant, the request id, on every dimension, so any seam
that does not fall inside the in-painted prefix shows as a jump of at least 1. With ``inpaint=False``
every seam jumps. ``compute_s`` is the (serialized) inference time.
"""

import dataclasses
import time

import numpy as np

import sequence_ai_ros.policy as seq

NAMES = ('a', 'b')


@seq.policy(action_space='joint_absolute', action_names=NAMES, dt=0.02, chunk_length=20,
            observation=seq.ObservationContract(state_names=NAMES))
class Inpaint:
    """Copy chunk_tail[:expected_delay_actions], then hold the request id."""

    def __init__(self, dt: float = 0.02, chunk_length: int = 20, compute_s: float = 0.0,
                 inpaint: bool = True) -> None:
        self.chunk_length, self.compute_s, self.inpaint = int(chunk_length), float(compute_s), bool(inpaint)

    @classmethod
    def configure_contract(cls, contract: seq.Contract, config: dict) -> seq.Contract:
        return dataclasses.replace(contract, dt=float(config.get('dt', 0.02)),
                                   chunk_length=int(config.get('chunk_length', 20)))

    def infer(self, inp: seq.PolicyInput, episode: seq.Episode) -> np.ndarray:
        if self.compute_s > 0:
            time.sleep(self.compute_s)
        rows = np.full((self.chunk_length, len(NAMES)), float(inp.request_id), np.float32)
        k = min(inp.expected_delay_actions, inp.chunk_tail.shape[0], self.chunk_length)
        if self.inpaint and k > 0:
            rows[:k] = inp.chunk_tail[:k]
        return rows
