"""Fleet tests: a 0 ms policy whose every action is the serving replica's process id.

So a robot can tell which replica served each chunk. Two joints, dt 0.05 s, chunks of 20 actions (1 s: a
load spike on a shared test machine does not dry a robot's buffer).
``params['sleep']`` sleeps that many seconds in infer (to push a replica past its inference deadline).
"""

import os
import time

import numpy as np

import sequence_ai_ros.policy as seq

NAMES = ['a', 'b']


@seq.policy(action_space='joint_absolute', action_names=NAMES, dt=0.05, chunk_length=20,
            observation=seq.ObservationContract(state_names=NAMES), gripper='none')
class ReplicaEcho:
    """Return a (20, 2) chunk filled with the replica's pid (exact in float32 below 2**24).

    The replica is the worker process: this process, or its parent when the policy runs in the replica's
    deployment process (``--isolation process``).
    """

    replica_pid = int(os.environ.get('SEQ_DEPLOYMENT_PROCESS') or os.getpid())   # the worker's pid

    def infer(self, inp, episode):
        if 'sleep' in inp.observation.params:
            time.sleep(float(inp.observation.params['sleep']))
        return np.full((20, 2), float(self.replica_pid), np.float32)
