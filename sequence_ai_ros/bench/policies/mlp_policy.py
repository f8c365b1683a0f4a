"""A compute-bound, torch-free policy for the batching bench and tests: an iterative numpy MLP with batches.

Like a flow-matching or diffusion action head (pi0 integrates 10 steps, Diffusion Policy up to 100), the
chunk is refined over ``steps`` passes of a small MLP (width ``hidden``) conditioned on the state. On a CPU
each pass costs a fixed amount of dispatch and memory traffic whatever the batch, so a batch of 8 costs
far less than 8 single calls (measured on 2 cores: about 1.8x a single call), the way a GPU batch does.
The thread is busy the whole time: the policy is compute-bound, not sleeping.

``infer`` and ``infer_batch`` return the same chunk for the same state, and it is deterministic: the chunk
is ``state + 0.01 * refined``. ``batch_sizes`` records the size of every call; ``episode.state['requests']``
counts each episode's requests (so tests see per-episode state survive batching).

``SEQ_MLP_SERIAL=1`` in the worker's environment declares it without batching (the bench's serialized mode).
Config (constructor kwargs): ``steps`` (default 1500), ``hidden`` (default 64), ``seed`` (default 0).
"""

import os

import numpy as np

import sequence_ai_ros.policy as seq

NAMES = [f'j{i}' for i in range(14)]
T = 20


@seq.policy(action_space='joint_absolute', action_names=NAMES, dt=0.05, chunk_length=T,
            observation=seq.ObservationContract(state_names=NAMES), gripper='none', streaming=True,
            batching=None if os.environ.get('SEQ_MLP_SERIAL') else seq.Batching(max_batch_size=8, max_wait_s=0.010))
class NumpyMLP:
    """Chunk = state + 0.01 * (``steps`` MLP refinements of a zero chunk); see the module docstring."""

    def __init__(self, steps: int = 1500, hidden: int = 64, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        d, out = len(NAMES), T * len(NAMES)
        self.steps = int(steps)
        self.w_in = (rng.standard_normal((out + d, hidden)) / np.sqrt(out + d)).astype(np.float32)
        self.w_mid = (rng.standard_normal((hidden, hidden)) / np.sqrt(hidden)).astype(np.float32)
        self.w_out = (rng.standard_normal((hidden, out)) / np.sqrt(hidden)).astype(np.float32)
        self.batch_sizes: list[int] = []

    def forward(self, states: np.ndarray) -> np.ndarray:
        """(B, D) states -> (B, T, D) float32 chunks."""
        s = np.asarray(states, np.float32)
        a = np.zeros((len(s), self.w_out.shape[1]), np.float32)
        for _ in range(self.steps):
            h = np.tanh(np.concatenate([a, s], axis=1) @ self.w_in)
            a = a - np.float32(0.1) * (np.tanh(h @ self.w_mid) @ self.w_out)
        return s[:, None, :] + np.float32(0.01) * a.reshape(len(s), T, len(NAMES))

    def infer(self, inp: seq.PolicyInput, episode: seq.Episode) -> np.ndarray:
        """Return float32 (T, D): the chunk of one request (a batch of one)."""
        return self.infer_batch([inp], [episode])[0]

    def infer_batch(self, inputs: list, episodes: list) -> list:
        """Return one float32 (T, D) chunk per input, in one pass; count requests in ``episode.state``."""
        self.batch_sizes.append(len(inputs))
        for episode in episodes:
            episode.state['requests'] = episode.state.get('requests', 0) + 1
        return list(self.forward(np.stack([inp.observation.state for inp in inputs])))

    @seq.on_episode
    def done(self, episode: seq.Episode) -> None:
        """Free the episode's counter."""
        episode.state.clear()
