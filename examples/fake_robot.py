"""Drive a synthetic robot from the policy that ``seq serve`` serves: ``python examples/fake_robot.py [MODEL]``.

MODEL defaults to ``my_policy`` (the quickstart's); the endpoint is ``$SEQ_ENDPOINT``, else 127.0.0.1:50551.
"""
import sys

import numpy as np

import sequence_ai


class FakeRobot:
    """Joints (rad) that move exactly to each commanded position."""

    def __init__(self, joint_names):
        self.names = list(joint_names)
        self.q = np.linspace(-0.2, 0.2, len(self.names), dtype=np.float32)   # the start pose

    def observe(self):
        return sequence_ai.Observation(state=self.q.copy(), state_names=self.names)

    def act(self, action):
        self.q = action.values.copy()


with sequence_ai.connect(model=sys.argv[1] if len(sys.argv) > 1 else 'my_policy') as policy:
    robot = FakeRobot(policy.contract.observation.state_names)   # the joints the policy expects
    policy.wait_until_ready()                                     # warming is not billed
    print(policy.run(robot.observe, robot.act, max_seconds=3.0))
    print('worker', policy.worker_version, 'pose', robot.q.astype(float).round(3).tolist())
