"""Worker tests: a streaming policy that records calls, with history 3, a camera, and failure switches.

- The chunk's first row is the current state; every row carries the request id in column 0 + 1000*episode
  counter, so tests can tell which episode a chunk came from.
- ``inp.observation.params['raise']`` makes infer raise ValueError with that text.
- ``inp.observation.params['sleep']`` sleeps that many seconds.
- ``inp.observation.params['bad_shape']`` returns a (T, D+1) chunk.
- ``done`` is set when the instruction is 'finish'.
- The on_episode hook appends (episode id, reason) to the file named by config ``hook_log``.
"""

import json
import time
from pathlib import Path

import numpy as np

import sequence_ai_ros.policy as seq

NAMES = ['a', 'b', 'c']


@seq.policy(action_space='joint_absolute', action_names=NAMES, dt=0.1, chunk_length=5, streaming=True,
            observation=seq.ObservationContract(cameras=[seq.CameraSpec('cam', 32, 24, 'png')],
                                                state_names=NAMES, history=3), gripper='none')
class Echo:
    def __init__(self, hook_log: str = '', load_s: float = 0.0) -> None:
        self.hook_log = Path(hook_log) if hook_log else None
        self.load_s = float(load_s)
        self.loaded = False

    def load(self) -> None:
        time.sleep(self.load_s)
        self.loaded = True

    def infer(self, inp: seq.PolicyInput, episode: seq.Episode):
        params = inp.observation.params
        if 'raise' in params:
            raise ValueError(params['raise'])
        if 'sleep' in params:
            time.sleep(float(params['sleep']))
        calls = episode.state.setdefault('calls', [])
        calls.append(inp.request_id)
        history = [float(o.state[0]) for o in inp.history]
        out = np.tile(inp.observation.state, (5, 1)).astype(np.float32)
        out[:, 1] = len(calls)  # requests seen by this episode's own state
        out[1, 0] = len(history)
        out[2:2 + len(history), 2] = history
        if 'bad_shape' in params:
            return np.zeros((5, 4), np.float32)
        return seq.Result(actions=out, done=inp.observation.instruction == 'finish')

    @seq.on_episode
    def end(self, episode: seq.Episode) -> None:
        if self.hook_log is not None:
            with self.hook_log.open('a') as f:
                f.write(json.dumps([episode.id, episode.reason, len(episode.state.get('calls', []))]) + '\n')
