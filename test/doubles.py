"""Robot doubles shared by the client tests.

They stand for the caller's side of act()/run(), not for anything we integrate with: the worker they
talk to is a real gRPC server on loopback.
"""

from __future__ import annotations

import time

import numpy as np

from sequence_ai_ros.protocol.types import Action, Observation

#: State names of :class:`CountingRobot`: ``frame`` is the number of actions executed so far.
NAMES = ('frame', 'request')


class CountingRobot:
    """Executes every action it is given and counts them; ``observe`` reports the executed count.

    ``actions`` (with ``act_times``) and ``holds`` (the monotonic time of each hold) let a test compare
    what ran against what the policy sent (the test policies answer row k with value k).
    """

    def __init__(self) -> None:
        self.actions: list[Action] = []
        self.act_times: list[float] = []
        self.holds: list[float] = []
        self.observed = 0

    def observe(self) -> Observation:
        self.observed += 1
        return Observation(state=np.array([len(self.actions), 0], np.float32), state_names=NAMES)

    def act(self, action: Action) -> None:
        self.actions.append(action)
        self.act_times.append(time.monotonic())

    def hold(self) -> None:
        self.holds.append(time.monotonic())

    def misaligned(self) -> list[int]:
        """Return the indices of executed actions whose first value is not their own index."""
        return [k for k, a in enumerate(self.actions) if a.values[0] != k]
