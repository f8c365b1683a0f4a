"""Worker tests: a stateless policy that misbehaves on demand, for deadlines and hard failures.

``inp.observation.params`` switches (one per request):

- ``hang``: block until the instance's ``release`` event is set (bounded by that many seconds); ``hanging``
  is set meanwhile;
- ``exit``: ``sys.exit(int(value))`` inside infer;
- ``interrupt``: raise KeyboardInterrupt inside infer;
- ``long``: return ``int(value)`` actions (more than chunk_length breaks the contract).

Config ``hang_load`` (s): ``load()`` blocks on ``release`` for up to that long. Tests release every
instance (``Stuck.instances``) when done, so no thread outlives them for long.
Otherwise it returns the state repeated for chunk_length 4 actions.
"""

import sys
import threading

import numpy as np

import sequence_ai_ros.policy as seq

NAMES = ['a', 'b']


@seq.policy(action_space='joint_absolute', action_names=NAMES, dt=0.1, chunk_length=4,
            observation=seq.ObservationContract(state_names=NAMES))
class Stuck:
    instances: list = []  # every instance, so a test can set ``release`` on each when it is done

    def __init__(self, hang_load: float = 0.0) -> None:
        self.hang_load = float(hang_load)
        self.release = threading.Event()
        self.hanging = threading.Event()   # set once an infer is blocked on ``hang``
        Stuck.instances.append(self)

    def load(self) -> None:
        if self.hang_load:
            self.release.wait(self.hang_load)

    def infer(self, inp: seq.PolicyInput, episode: seq.Episode) -> np.ndarray:
        params = inp.observation.params
        if 'hang' in params:
            self.hanging.set()
            self.release.wait(float(params['hang']))
        if 'exit' in params:
            sys.exit(int(params['exit']))
        if 'interrupt' in params:
            raise KeyboardInterrupt('policy pressed ctrl-c')
        rows = int(params.get('long', 4))
        return np.tile(inp.observation.state, (rows, 1)).astype(np.float32)
