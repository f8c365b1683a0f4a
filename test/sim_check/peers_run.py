"""``make bench-peers``' robot side: drawer-open at 80 Hz real time, driven by one of three systems' clients.

Runs in the LeRobot venv (``peers.py`` starts it once per system, setting and condition). The robot is the
same for all three: :class:`RealTimeSim`, Meta-World's drawer-open-v3 (:class:`sequence_ai_ros.sim.task.SimTask`,
the task ``sim_robot`` steps in ``make check-sim``) stepped on its own thread every 12.5 ms, a position-controlled
arm that holds its last command. Like ``sim_robot`` it waits after a reset and starts stepping at the first
command (step 1), so time to success is ``success_step * dt`` from the first commanded action. Its grid is
set half a period off the first command, so a client paced at 80 Hz from its first action lands each command
mid-period. A step with no command since the step before is an idle step (the arm held).

The clients, each as its project documents it (see docs/comparison.md):

- ``product``: this project's ROS-free client (``sequence_ai.connect``), a loop that calls
  ``next_action(observation)`` at 80 Hz from its first action (what ``policy_node`` runs on its timer) and
  commands every action that is not a hold;
- ``openpi``: openpi-client's own ``Runtime(environment, PolicyAgent(ActionChunkBroker(WebsocketClientPolicy,
  action_horizon)), max_hz=80)``, one ``Runtime`` per episode, one websocket per condition;
- ``lerobot``: LeRobot's ``RobotClient`` (lerobot.async_inference) with its own ``control_loop`` and
  ``receive_actions`` threads, a fresh client per episode (``start()``: ``Ready`` and
  ``SendPolicyInstructions``), the arm a LeRobot ``Robot`` subclass over :class:`RealTimeSim`.

Usage: ``python peers_run.py --system S --port P [--setting K=V] --seeds 0:20 --out result.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from sequence_ai_ros.sim.task import COMMAND_NAMES, JOINT_NAMES, SimTask  # noqa: E402

TASK = 'drawer-open-v3'
INSTRUCTION = 'open the drawer'
MAX_SECONDS = 6.0           # from the first command (check-sim's bound; Meta-World truncates at 6.25 s)
FIRST_COMMAND_S = 15.0      # an episode with no command within this is a failure ('no command')


@dataclasses.dataclass
class Counts:
    """One episode as the robot saw it."""

    success: bool = False
    time_to_success_s: float | None = None
    steps: int = 0
    idle_steps: int = 0                 # steps with no new command since the step before (the arm held)
    overwritten: int = 0                # commands replaced before a step took them
    late_steps: int = 0                 # steps taken over half a period late (the machine was busy)
    reason: str = ''


class RealTimeSim:
    """SimTask stepped at 1/dt on a thread of its own, holding the last command (see the module docstring)."""

    def __init__(self, task: str = TASK) -> None:
        self.task = SimTask(task, benchmark_seed=0, max_steps=500)
        self.dt = self.task.dt
        self.max_steps = round(MAX_SECONDS / self.dt)
        self._cv = threading.Condition()
        self._command: np.ndarray | None = None
        self._fresh = False
        self._state = np.zeros(len(JOINT_NAMES))
        self.counts = Counts()
        self.done = threading.Event()
        self._thread: threading.Thread | None = None

    def reset(self, split: str, index: int) -> None:
        """Stop stepping, reset to ``split[index]`` and wait for the first command."""
        self.stop()
        with self._cv:
            self._state = self.task.reset(split, index)
            self._command, self._fresh = None, False
            self.counts = Counts()
            self.done = threading.Event()
        self._thread = threading.Thread(target=self._run, name='sim', daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            self.done.set()
            with self._cv:
                self._cv.notify_all()
            self._thread.join(5)
            self._thread = None

    def observe(self) -> np.ndarray:
        """float64 (43,): the measured state then the task observation (``sim_robot``'s joint_states)."""
        with self._cv:
            return self._state.copy()

    def command(self, values: Any) -> None:
        """Command the 4 coordinates (m, effort); the next step takes the latest."""
        with self._cv:
            if self._fresh:
                self.counts.overwritten += 1
            self._command, self._fresh = np.asarray(values, np.float64).copy(), True
            self._cv.notify_all()

    def _step(self) -> None:
        """One step under the lock: the fresh command or the held one."""
        c = self.counts
        if not self._fresh:
            c.idle_steps += 1
        self._fresh = False
        result = self.task.step(self._command)
        self._state = self.task.state()
        c.steps += 1
        if result.success and not c.success:
            c.success, c.time_to_success_s, c.reason = True, c.steps * self.dt, 'success'
        if c.success or c.steps >= self.max_steps:
            c.reason = c.reason or 'timeout'
            self.done.set()

    def _run(self) -> None:
        with self._cv:
            if not self._cv.wait_for(lambda: self._fresh or self.done.is_set(), FIRST_COMMAND_S):
                self.counts.reason = 'no command'
                self.done.set()
            if self.done.is_set():
                return
            t0 = time.monotonic()
            self._step()
        k = 1
        while not self.done.is_set():
            due = t0 + (k + 0.5) * self.dt
            wait = due - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            elif -wait > self.dt / 2:
                self.counts.late_steps += 1
            with self._cv:
                if self.done.is_set():
                    return
                self._step()
            k += 1

    def close(self) -> None:
        self.stop()
        self.task.close()


# -- this project --------------------------------------------------------------------------------------
def run_product(sim: RealTimeSim, args: argparse.Namespace, episodes: list[tuple[str, int]]) -> list[dict]:
    import sequence_ai

    out = []
    with sequence_ai.connect(model=args.deployment, endpoint=f'127.0.0.1:{args.port}', timeout=60) as policy:
        policy.wait_until_ready()
        for split, index in episodes:
            sim.reset(split, index)
            policy.begin_episode(INSTRUCTION, max_seconds=MAX_SECONDS + FIRST_COMMAND_S, control_period=sim.dt)
            started = False
            deadline = time.monotonic()
            while not sim.done.is_set():
                state = sim.observe().astype(np.float32)
                action = policy.next_action(sequence_ai.Observation(state=state, state_names=JOINT_NAMES,
                                                                    instruction=INSTRUCTION))
                now = time.monotonic()
                if not action.hold:
                    sim.command(action.values)
                    if not started:             # the grid of the control loop: 80 Hz from the first action
                        started, deadline = True, now
                deadline += sim.dt
                if deadline > now:
                    sim.done.wait(deadline - now)
                else:
                    deadline = now
            outcome = policy.end_episode()
            out.append(dict(dataclasses.asdict(sim.counts), split=split, index=index,
                            inferences=outcome.requests, chunks=outcome.chunks, discarded=outcome.discarded,
                            peak_in_flight=outcome.peak_in_flight))
    return out


# -- openpi ----------------------------------------------------------------------------------------------
def run_openpi(sim: RealTimeSim, args: argparse.Namespace, episodes: list[tuple[str, int]]) -> list[dict]:
    from openpi_client import action_chunk_broker, websocket_client_policy
    from openpi_client.base_policy import BasePolicy
    from openpi_client.runtime import environment, runtime
    from openpi_client.runtime.agents import policy_agent

    class Counted(BasePolicy):
        """The websocket policy, its infer calls counted (one per chunk)."""

        def __init__(self, inner: BasePolicy) -> None:
            self.inner, self.calls = inner, 0

        def infer(self, obs: dict) -> dict:
            self.calls += 1
            return self.inner.infer(obs)

        def reset(self) -> None:
            self.inner.reset()

    class Env(environment.Environment):
        """The arm as an openpi Runtime environment; the Runtime's final reset after the episode does nothing."""

        def __init__(self, split: str, index: int) -> None:
            self.split, self.index, self.resets = split, index, 0

        def reset(self) -> None:
            if self.resets == 0:
                sim.reset(self.split, self.index)
            self.resets += 1

        def is_episode_complete(self) -> bool:
            return sim.done.is_set()

        def get_observation(self) -> dict:
            return {'state': sim.observe().astype(np.float32), 'prompt': INSTRUCTION}

        def apply_action(self, action: dict) -> None:
            sim.command(action['actions'])

    ws = Counted(websocket_client_policy.WebsocketClientPolicy(host='127.0.0.1', port=args.port))
    out = []
    for split, index in episodes:
        before = ws.calls
        agent = policy_agent.PolicyAgent(action_chunk_broker.ActionChunkBroker(ws, args.action_horizon))
        runtime.Runtime(Env(split, index), agent, [], max_hz=round(1 / sim.dt), num_episodes=1).run()
        out.append(dict(dataclasses.asdict(sim.counts), split=split, index=index, inferences=ws.calls - before))
    return out


# -- LeRobot async ------------------------------------------------------------------------------------
def run_lerobot(sim: RealTimeSim, args: argparse.Namespace, episodes: list[tuple[str, int]]) -> list[dict]:
    from dataclasses import dataclass

    from lerobot.async_inference.configs import RobotClientConfig
    from lerobot.async_inference.robot_client import RobotClient
    from lerobot.robots.config import RobotConfig
    from lerobot.robots.robot import Robot

    @RobotConfig.register_subclass('metaworld_sim')
    @dataclass
    class MetaWorldSimConfig(RobotConfig):
        pass

    class MetaWorldSim(Robot):
        """The arm as a LeRobot Robot: 43 float observations (sim_robot's joint_states), 4 commanded coordinates."""

        config_class = MetaWorldSimConfig
        name = 'metaworld_sim'

        @property
        def observation_features(self) -> dict:
            return dict.fromkeys(JOINT_NAMES, float)

        @property
        def action_features(self) -> dict:
            return dict.fromkeys(COMMAND_NAMES, float)

        @property
        def is_connected(self) -> bool:
            return True

        def connect(self, calibrate: bool = True) -> None:
            pass

        @property
        def is_calibrated(self) -> bool:
            return True

        def calibrate(self) -> None:
            pass

        def configure(self) -> None:
            pass

        def get_observation(self) -> dict:
            return dict(zip(JOINT_NAMES, sim.observe().astype(np.float32).tolist(), strict=True))

        def send_action(self, action: dict) -> dict:
            sim.command([action[n] for n in COMMAND_NAMES])
            return action

        def disconnect(self) -> None:
            pass

    import lerobot.async_inference.robot_client as rc

    rc.make_robot_from_config = lambda config: MetaWorldSim(config)   # a robot of this script's, not LeRobot's

    class Counted(RobotClient):
        """RobotClient as it is, its observations sent (must-go ones apart) and its chunks received counted."""

        def __init__(self, config: RobotClientConfig) -> None:
            super().__init__(config)
            self.sent = self.must_go_sent = self.chunks = 0
            self.last_chunk = time.monotonic()

        def send_observation(self, obs: Any) -> bool:
            self.sent += 1
            self.must_go_sent += bool(obs.must_go)
            return super().send_observation(obs)

        def _aggregate_action_queues(self, incoming_actions: list, aggregate_fn: Any = None) -> None:
            self.chunks += 1
            self.last_chunk = time.monotonic()
            super()._aggregate_action_queues(incoming_actions, aggregate_fn)

    out = []
    for split, index in episodes:
        sim.reset(split, index)
        config = RobotClientConfig(policy_type='act', pretrained_name_or_path=str(args.checkpoint),
                                   robot=MetaWorldSimConfig(id='sim'), actions_per_chunk=args.actions_per_chunk,
                                   task=INSTRUCTION, server_address=f'127.0.0.1:{args.port}',
                                   fps=round(1 / sim.dt), chunk_size_threshold=args.chunk_size_threshold,
                                   aggregate_fn_name=args.aggregate_fn_name)
        client = Counted(config)
        if not client.start():
            raise RuntimeError(f'RobotClient could not reach the PolicyServer on port {args.port}')
        receiver = threading.Thread(target=client.receive_actions, daemon=True)
        control = threading.Thread(target=client.control_loop, args=(INSTRUCTION,), daemon=True)
        receiver.start()
        control.start()
        sim.done.wait()
        # a stalled episode: the queue is empty, must_go is clear (so the server filters every observation) and no
        # chunk came for a second (not one answer still on its way)
        stalled = (client.must_go_sent > 0 and not client.must_go.is_set() and not client.actions_available()
                   and time.monotonic() - client.last_chunk > 1.0)
        client.stop()
        control.join(10)
        receiver.join(10)
        out.append(dict(dataclasses.asdict(sim.counts), split=split, index=index, inferences=client.chunks,
                        observations_sent=client.sent, must_go_sent=client.must_go_sent,
                        stalled_must_go_clear=bool(stalled and not sim.counts.success)))
    return out


RUNNERS = {'product': run_product, 'openpi': run_openpi, 'lerobot': run_lerobot}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--system', choices=sorted(RUNNERS), required=True)
    parser.add_argument('--port', type=int, required=True, help="the server's port (or its delay proxy's)")
    parser.add_argument('--seeds', default='0:20', help='test_tasks indices, START:STOP')
    parser.add_argument('--warm-up', type=int, default=1, help='episodes on train_tasks[0:N] first, not counted')
    parser.add_argument('--out', type=Path, required=True)
    parser.add_argument('--deployment', default='sim_act', help='product: the deployment')
    parser.add_argument('--action-horizon', type=int, default=10, help="openpi: ActionChunkBroker's action_horizon")
    parser.add_argument('--checkpoint', type=Path, help='lerobot: pretrained_name_or_path')
    parser.add_argument('--actions-per-chunk', type=int, default=20)
    parser.add_argument('--chunk-size-threshold', type=float, default=0.5)
    parser.add_argument('--aggregate-fn-name', default='weighted_average')
    args = parser.parse_args()
    args.out = args.out.resolve()
    os.chdir(args.out.parent)          # LeRobot's loggers write logs/ into the working directory
    start, stop = (int(v) for v in args.seeds.split(':'))
    episodes = [('train', i) for i in range(args.warm_up)] + [('test', i) for i in range(start, stop)]
    sim = RealTimeSim()
    t0 = time.monotonic()
    try:
        rows = RUNNERS[args.system](sim, args, episodes)
    finally:
        sim.close()
    rows = [r for r in rows if r['split'] == 'test']
    args.out.write_text(json.dumps({'episodes': rows, 'dt': sim.dt, 'wall_s': time.monotonic() - t0}, indent=1))
    print(f'{args.system}: {sum(r["success"] for r in rows)}/{len(rows)} solved in {time.monotonic() - t0:.1f} s')
    return 0


if __name__ == '__main__':
    raise SystemExit(main())
