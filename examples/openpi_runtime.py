"""openpi's runtime and agent, unchanged, on a policy that ``seq serve`` serves.

    python examples/openpi_runtime.py [MODEL]

Where an openpi robot has ``PolicyAgent(ActionChunkBroker(WebsocketClientPolicy(host, port), horizon))``, it takes
``PolicyAgent(SequencePolicy(sequence_ai.connect(model=...)))``. The environment here is a synthetic arm;
yours is the openpi ``Environment`` you already have. The endpoint is ``$SEQ_ENDPOINT``, else 127.0.0.1:50551.
"""
import sys

import numpy as np
from openpi_client.runtime import environment, runtime
from openpi_client.runtime.agents import policy_agent

import sequence_ai
from sequence_ai_ros.adapters.openpi_policy import SequencePolicy

STEPS, HZ = 60, 50


class FakeArm(environment.Environment):
    """An openpi Environment whose joints move exactly to each commanded position (rad)."""

    def __init__(self, dim):
        self.q = np.linspace(-0.2, 0.2, dim, dtype=np.float32)
        self.steps = 0

    def reset(self):
        self.steps = 0

    def is_episode_complete(self):
        return self.steps >= STEPS

    def get_observation(self):
        return {'state': self.q.copy(), 'prompt': 'hold still'}

    def apply_action(self, action):
        self.q = np.asarray(action['actions'], dtype=np.float32)
        self.steps += 1


with sequence_ai.connect(model=sys.argv[1] if len(sys.argv) > 1 else 'my_policy') as served:
    served.wait_until_ready()
    policy = SequencePolicy(served, control_period=1 / HZ)
    arm = FakeArm(len(served.contract.observation.state_names))
    runtime.Runtime(environment=arm, agent=policy_agent.PolicyAgent(policy=policy), subscribers=[],
                    max_hz=HZ, num_episodes=2).run()
    print('last episode', served.end_episode())
    print('worker', served.worker_version, 'pose', arm.q.astype(float).round(3).tolist())
