"""An episode's ``@seq.on_episode`` hook sees the state its inferences left, in a deployment process too.

The worker tells a deployment process which episodes ended along with its next call, and the process then drops
their state. An ended episode whose hook is still to run is not told so: its hook's call drops the state once
the hook ran. Here four robots keep the policy busy, so other robots' calls go to the process between an
episode's end and its hook; every hook still sees its episode's count.
"""

from __future__ import annotations

import json
import textwrap
import threading

import pytest
from test_worker_support import Stream, serving, state_request, wait_for

NAMES = ['a', 'b']

POLICY = textwrap.dedent('''
    import json, time
    import numpy as np
    import sequence_ai_ros.policy as seq

    @seq.policy(action_space='joint_absolute', action_names=['a', 'b'], dt=0.05, chunk_length=2,
                observation=seq.ObservationContract(state_names=['a', 'b']))
    class Counted:
        """Counts each episode's inferences in its state; a request may hold it (``sleep``, s)."""

        def __init__(self, hook_log: str = ''):
            self.hook_log = hook_log

        def infer(self, inp, episode):
            time.sleep(float(inp.observation.params.get('sleep', 0)))
            episode.state['n'] = episode.state.get('n', 0) + 1
            return np.zeros((2, 2), np.float32)

        @seq.on_episode
        def ended(self, episode):
            with open(self.hook_log, 'a') as f:
                f.write(json.dumps([episode.id, episode.state.get('n', 0)]) + '\\n')
''')


def _robot(stub, name: str, episodes: int, errors: list) -> None:
    """``episodes`` episodes of 6 requests each; every third request holds the policy 0.2 s (others queue)."""
    for k in range(episodes):
        stream = Stream(stub, 'counted', f'{name}-{k}')
        try:
            assert stream.start().HasField('started')
            for rid in range(1, 7):
                params = {'sleep': '0.2'} if rid % 3 == 0 else None
                reply = stream.ask(state_request(rid, [0, 0], NAMES, params=params))
                if reply is None or not reply.HasField('chunk'):
                    errors.append((name, k, rid, reply))
            assert stream.end().HasField('ended')
        except AssertionError as exc:
            errors.append((name, k, exc))
        finally:
            stream.close()


@pytest.mark.parametrize('isolation', ['process', 'none'])
def test_every_hook_sees_its_episodes_state_while_other_robots_keep_the_policy_busy(tmp_path, isolation):
    path = tmp_path / 'counted.py'
    path.write_text(POLICY)
    log = tmp_path / 'hooks.jsonl'
    with serving(path, 'counted', isolation=isolation, hook_log=str(log)) as (_, stub, _runtime):
        errors: list = []
        robots = [threading.Thread(target=_robot, args=(stub, f'r{k}', 3, errors), name=f'robot-{k}')
                  for k in range(4)]
        for robot in robots:
            robot.start()
        for robot in robots:
            robot.join(120)
        assert not errors, errors[:4]
        wait_for(lambda: log.exists() and len(log.read_text().splitlines()) == 12, what='12 hooks')
    seen = sorted(json.loads(line) for line in log.read_text().splitlines())
    assert seen == [[f'r{k}-{e}', 6] for k in range(4) for e in range(3)]
