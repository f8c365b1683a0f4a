"""A slow policy with an end-of-episode hook that keeps, per episode, what the worker asked of it (max_seconds tests).

Rows are client_latency's: row ``i`` answering an observation at ``frame`` ``f`` is ``[f + i, request_id]``,
so :class:`doubles.CountingRobot` drives it. The worker runs in the test's process, so a test reads the
instance (``server.runtimes[name]._instance.policy``):

- ``begun``: {episode id: inferences begun}; ``finished``: {episode id: inferences that returned};
- ``hooks``: ``(episode id, reason, inferences begun)`` per on_episode call, in order.

Config (constructor kwargs): ``latency_s`` per inference (s), default 0.9; ``first_s``: the first inference
of each episode instead (s), default ``latency_s``; ``dt`` (s) and ``chunk_length`` T, default 0.02 and 50.
"""

import dataclasses
import threading
import time

import numpy as np

import sequence_ai_ros.policy as seq

NAMES = ('frame', 'request')


@seq.policy(action_space='joint_absolute', action_names=NAMES, dt=0.02, chunk_length=50,
            observation=seq.ObservationContract(state_names=NAMES))
class SlowEpisodes:
    """Sleep ``latency_s`` (``first_s`` for an episode's first), then return rows ``[frame + i, request_id]``."""

    def __init__(self, latency_s: float = 0.9, first_s: float | None = None, dt: float = 0.02,
                 chunk_length: int = 50) -> None:
        self.latency_s = float(latency_s)
        self.first_s = self.latency_s if first_s is None else float(first_s)
        self.chunk_length = int(chunk_length)
        self.lock = threading.Lock()
        self.begun: dict[str, int] = {}
        self.finished: dict[str, int] = {}
        self.hooks: list[tuple[str, str, int]] = []

    @classmethod
    def configure_contract(cls, contract: seq.Contract, config: dict) -> seq.Contract:
        return dataclasses.replace(contract, dt=float(config.get('dt', 0.02)),
                                   chunk_length=int(config.get('chunk_length', 50)))

    def infer(self, inp: seq.PolicyInput, episode: seq.Episode) -> np.ndarray:
        with self.lock:
            n = self.begun[episode.id] = self.begun.get(episode.id, 0) + 1
        time.sleep(self.first_s if n == 1 else self.latency_s)
        frame = float(inp.observation.state[0])
        rows = np.stack([frame + np.arange(self.chunk_length, dtype=np.float64),
                         np.full(self.chunk_length, inp.request_id, dtype=np.float64)], axis=1)
        with self.lock:
            self.finished[episode.id] = self.finished.get(episode.id, 0) + 1
        return rows.astype(np.float32)

    @seq.on_episode
    def end(self, episode: seq.Episode) -> None:
        with self.lock:
            self.hooks.append((episode.id, str(episode.reason), self.begun.get(episode.id, 0)))
