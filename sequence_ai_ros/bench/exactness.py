"""Replays of real recordings through the client, captured by a real worker, exported, checked against the robot.

The harness of ``test/test_capture_exactness.py`` and of :mod:`.bench_exactness` (the exactness table). It
uses the public behaviour only: serve a policy with capture on, drive episodes with ``Policy.act``,
``Policy.run`` or a self-paced ``Policy.next_action`` loop, export the store as a LeRobot v2.1 dataset,
read it back with :class:`~sequence_ai_ros.datasets.lerobot_reader.LeRobotDataset`, and compare each row
with what the robot itself logged.

The sources (real recordings) are in :mod:`.exact_sources`.

The robot's clock is in chunk steps, by the engine's rule: a robot ticking at ``m`` times the policy rate
executes ``1/m`` of a step per action (act/run's fixed step; next_action in delta spaces), or, for
next_action in an absolute space, the time from its action to its next tick over dt (the robot adds the
same floats from its ticks' stamps and reports the result in its state). The next_action loop stamps
each tick with its deadline ``start + i * period``, as the ROS node does, so that timeline is exact too
(``next_action_clock``, for the table: with the clock when the tick runs). The robot logs every tick it
acted on: where its span of steps starts, the observation it gave, what it commanded and its pose. A
tick's start is its step count, exact; in an absolute next_action loop it is the tick's place on the
control grid (its stamp's whole periods since the first action's, times ``1/m``), so with clock stamps a
tick woken a little late still starts its own step at 1x. The truth for row ``k`` (the policy step
``k``, ``0 <= k < N`` for ``N`` steps executed):

- rows: one per step executed (an episode without an underrun after the first chunk), none held but those
  whose step no tick started in (a missed deadline of an absolute next_action loop: the previous command
  stays in effect);
- delta spaces, rate channels: ``sum(rows[:k + 1])`` is the robot's commanded path at the boundary ``k + 1``
  minus its start. At a boundary inside a tick (2.5x: ticks of 0.4 step) the path is the tick's pose before
  plus the part of the recorded steps the tick covers up to the boundary: the policy's own path, since the
  tick's increment is exactly those parts (the client sends them with the tick), so each row is the policy's
  step. (At 1x and 2x every boundary is a tick's end. The log is also checked to hold exactly the recorded
  increments, so a fault there is the client's.)
- position channels (absolute spaces, ee_delta's last channel): the command of the tick in effect at step
  ``k`` (the last tick whose span starts at or before ``k``);
- ``observation.state``: the observation of that same tick (the one the row's step started under).

A tick that runs the end of its chunk covers only the chunk's rows left (the engine emits no more): the
robot counts ``min(1/m, T - index)`` steps for it (``T`` the chunk length, ``index`` the action's position in
its chunk), so across a dry spell its step count is the policy's steps it really ran.

Disturbed replays (:class:`Disturbance`, :data:`DISTURBANCES`; ``python -m sequence_ai_ros.bench exactness
--disturbed``, ``test/test_capture_disturbed.py``): a latency-shaped worker (the replay policy sleeps a seeded
uniform draw of a range of chunk durations per call: late seams, dry spells), or an overrunning ``act()``
callback (a seeded share of the robot's ticks take one period and a fraction more: skipped deadlines worth a
fraction of a step at 2x and 2.5x). The truth is the same log; rows held for a dry spell or a skipped period
are allowed (:func:`disturbed_score`): the rows not held must be one per step executed, each the policy's step.

Nothing here asserts a time: ticks that run late change no expected value (the log, not the clock, is the
reference).
"""

from __future__ import annotations

import dataclasses
import math
import random
import tempfile
import time
from collections.abc import Sequence
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np

from sequence_ai_ros.bench.exact_sources import (
    DATA,
    G1_DATASET,
    G1_STARTS,
    G1_STEPS,
    WX200_BAG,
    WX_STARTS,
    WX_STEPS,
    Source,
    g1_source,
    wx200_source,
)

DEPLOYMENT = 'exact'

SPACES = ('joint_delta', 'ee_delta', 'joint_absolute')
DRIVERS = ('act', 'run', 'next_action')
#: next_action_clock: the next_action loop with each tick stamped by the clock when it runs (the seed's
#: loop), not by its deadline; the table shows it beside the others.
TABLE_DRIVERS = (*DRIVERS, 'next_action_clock')
#: Control rate / policy rate.
MULTIPLES = (Fraction(1), Fraction(2), Fraction(5, 2))
#: Bounds of an exact row: per channel on actions (sums of float32 increments round by ~1e-6 over 40 ticks),
#: and on the state (a copy of an observation).
ACTION_ATOL, STATE_ATOL = 1e-5, 1e-6
#: Slack on positions in chunk steps: by step they are exact fractions; by clock the robot adds the same
#: floats as the engine and snaps them to whole steps within 1e-7 as it does.
STEP_EPS = 1e-9
#: Steps per disturbed episode (three chunks and more: several seams, each a chance of a dry spell).
WX_DISTURBED_STEPS, G1_DISTURBED_STEPS = 30, 90
#: Starts of the disturbed WidowX episodes: :data:`WX_STARTS` with room for 30 steps (490: the shoulder, elbow
#: and wrist move in 510-520).
WX_DISTURBED_STARTS = (490, *WX_STARTS[1:])


class Overrun:
    """An ``act()`` callback's overruns: a seeded share of the calls take one period and a fraction more.

    :param share: probability that a call overruns. :param by: (low, high) the overrun beyond one period, in
        periods (uniform). :param seed: the draws' seed (one sequence per episode).
    """

    def __init__(self, share: float, by: tuple[float, float], seed: int) -> None:
        self.share, self.by = float(share), (float(by[0]), float(by[1]))
        self.rng = random.Random(seed)
        #: the overruns drawn so far, beyond one period (periods); over 1, the call missed a deadline for sure
        self.drawn: list[float] = []

    @property
    def count(self) -> int:
        """Calls that overran."""
        return len(self.drawn)

    def __call__(self, period_s: float) -> None:
        """Sleep as this call's draw says (``period_s``: the control period, s)."""
        if self.rng.random() < self.share:
            self.drawn.append(self.rng.uniform(*self.by))
            time.sleep(period_s * (1.0 + self.drawn[-1]))


@dataclasses.dataclass(frozen=True)
class Disturbance:
    """What disturbs a replay: the policy's latency, the robot's overruns (seeded draws).

    :param name: its name in the table.
    :param latency: (low, high) the policy's sleep per call in chunk durations (``T * dt``), uniform, drawn from
        one seeded sequence per worker; None: no sleep.
    :param aim_seam: (steps; 0: off) the policy answers when the playing chunk runs out, give or take a uniform
        draw of this many steps (from ``chunk_tail`` and the observation's stamp); ``latency`` where there is
        no tail (the first request, a dry spell's).
    :param overrun: the share of ``act()`` calls that overrun (0: none). :param overrun_by: (low, high) by how
        much beyond one period, in periods.
    :param seed: the seed of the draws (the worker's; episode ``n``'s overruns use ``seed + n``).
    """

    name: str
    latency: tuple[float, float] | None = None
    aim_seam: float = 0.0
    overrun: float = 0.0
    overrun_by: tuple[float, float] = (0.5, 1.5)
    seed: int = 7

    def policy_config(self, source: Source) -> dict[str, Any]:
        """The replay policy's config with this latency (``mean_s``, ``jitter``, ``seed``, ``aim_seam``)."""
        config = dict(source.config)
        if self.aim_seam > 0:
            config['aim_seam'] = self.aim_seam
        if self.latency is None:
            return config
        lo, hi = self.latency
        chunk_s = int(source.config['chunk_length']) * source.dt
        return {**config, 'mean_s': chunk_s * (lo + hi) / 2, 'jitter': (hi - lo) / (hi + lo), 'seed': self.seed}

    def overruns(self, episode: int) -> Overrun | None:
        """Episode ``episode``'s overruns (None: none)."""
        return Overrun(self.overrun, self.overrun_by, self.seed + episode) if self.overrun > 0 else None


#: The disturbances of the table and the test: a worker whose round trip is half a chunk to more than a chunk
#: (dry spells, some of a fraction of a step); one that answers when the playing chunk runs out, +-0.25 step
#: (late seams: a chunk landing just after the tick that ran the old one's end; short dry spells), 0.2-0.5 chunk
#: without a tail; and an act() callback that takes 1.5-2.5 periods at 1 tick in 8: the next tick is late by a
#: fraction of a period, or (past two periods, the pacer's rule) its deadline is skipped: a gap of 1/m of a step.
DISTURBANCES = (Disturbance('latency', latency=(0.5, 1.2)), Disturbance('seam', latency=(0.2, 0.5), aim_seam=0.25),
                Disturbance('overrun', overrun=0.125, overrun_by=(0.5, 1.5)))


@dataclasses.dataclass
class Tick:
    """One control tick the robot acted on.

    :param start: chunk steps executed before it (its span starts here). :param span: steps it covers.
    :param state: float32 the observation it gave. :param command: float32 what it commanded (joint_delta:
        the target; ee_delta: increments and the position channel; absolute: the target).
    :param before: float32 its pose before (delta spaces). :param after: float32 its pose after.
    """

    start: float
    span: float
    state: np.ndarray
    command: np.ndarray
    before: np.ndarray
    after: np.ndarray


class Robot:
    """Executes what it is given at ``multiple`` times the policy rate; logs each tick it acted on.

    Its state is its pose (delta spaces: the path so far; absolute: the recorded observation of its frame)
    and its step counter (``first`` + chunk steps executed), which the replay policies align on. Its clock
    in chunk steps follows the engine's rule: ``1 / multiple`` per action (act/run, and every delta space),
    or, ``by_clock`` (next_action in an absolute space), the time from an action to the next tick over dt,
    never past ``limit``.
    """

    def __init__(self, source: Source, first: int, multiple: Fraction, limit: int, by_clock: bool = False,
                 overrun: Overrun | None = None, capped: bool = True) -> None:
        self.source, self.first, self.span = source, int(first), Fraction(1) / Fraction(multiple)
        self.limit, self.by_clock = int(limit), by_clock
        #: act() overruns (a disturbed replay); capped: the engine cuts the last tick at ``limit`` (max_actions)
        self.overrun, self.capped = overrun, capped
        self.chunk_length = int(source.config.get('chunk_length', 0))
        self._room = math.inf       # by_clock: chunk steps left in the last action's chunk
        self.clock: Fraction | float = Fraction(0)
        self.start = source.path[self.first].astype(np.float32).copy()
        self.pose = self.start.copy()
        self.ticks: list[Tick] = []
        self._state: np.ndarray | None = None
        self._now = 0.0
        self._acted_at: float | None = None   # by_clock: the stamp of the last action, until a tick advances it
        self._first_at: float | None = None   # by_clock: the stamp of the first action (the grid's origin)

    @property
    def steps(self) -> Fraction | float:
        """Chunk steps executed (exact when by step)."""
        return self.clock

    def observe(self, timestamp: float | None = None) -> Any:
        """The observation at this tick (``timestamp``: its stamp, default the clock now)."""
        from sequence_ai_ros.client import Observation

        self._now = time.monotonic() if timestamp is None else timestamp
        if self._acted_at is not None:
            adv = max(0.0, min((self._now - self._acted_at) / self.source.dt, self.limit - float(self.clock),
                               float(self._room)))
            self.ticks[-1].span = adv
            clock = float(self.clock) + adv
            self.clock = float(round(clock)) if abs(clock - round(clock)) < 1e-7 else clock
            self._acted_at = None
        if self.source.states is None:
            body = self.pose
        else:
            body = self.source.states[min(self.first + math.floor(self.clock), len(self.source.states) - 1)]
        self._state = np.append(body, np.float32(self.first + float(self.clock))).astype(np.float32)
        return Observation(state=self._state, state_names=self.source.state_names, timestamp=self._now)

    def act(self, action: Any) -> None:
        """Execute one (non-hold) action and log it."""
        if action.hold:
            raise AssertionError('the robot was handed a hold to execute')
        values = np.asarray(action.values, np.float32)
        before = self.pose.copy()
        if self.source.space == 'ee_delta':
            r = self.source.rate_dims
            self.pose[:r] = (self.pose[:r] + values[:r]).astype(np.float32)
            self.pose[r:] = values[r:]
        else:
            self.pose = values.copy()      # joint_delta: the engine integrated it; absolute: the target
        assert self._state is not None
        start = float(self.clock)
        if self.by_clock:
            if self._first_at is None:
                self._first_at = self._now
            period = self.source.dt * float(self.span)
            start = float(round((self._now - self._first_at) / period) * self.span)
        self.ticks.append(Tick(start, float(self.span), self._state, values.copy(), before, self.pose.copy()))
        if self.by_clock:
            self._acted_at = self._now
            self._room = float(self._left(action.index))
        else:
            ran = min(Fraction(self.span), Fraction(self._left(action.index)))
            if self.capped:
                ran = min(ran, Fraction(self.limit) - Fraction(self.clock))
            self.ticks[-1].span = float(ran)
            self.clock += ran
        if self.overrun is not None:
            self.overrun(self.source.dt * float(self.span))

    def _left(self, index: float) -> Fraction:
        """Chunk steps left in an action's chunk from its ``index`` (the most its tick can run)."""
        if not self.chunk_length:
            return self.span
        return max(Fraction(0), Fraction(self.chunk_length) - Fraction(float(index)).limit_denominator(10_000))


def drive(policy: Any, robot: Robot, driver: str, steps: int, episode_id: str, timeout_s: float = 120.0) -> Any:
    """Drive one episode of ``steps`` chunk steps with ``act``, ``run`` or a ``next_action`` loop; its RunOutcome.

    The next_action loop paces itself: one call per control period on absolute deadlines (a missed one is
    skipped, keeping the phase), each tick stamped with its deadline as the ROS node does
    (``next_action_clock``: with the clock when it runs, as the seed's loop does).
    """
    period = robot.source.dt * float(robot.span)
    if driver == 'run':
        return policy.run(robot.observe, robot.act, max_actions=steps, control_period=period, episode_id=episode_id,
                          instruction='replay')
    if driver == 'act':
        return policy.act('replay', robot.observe, robot.act, max_seconds=timeout_s, control_period=period,
                          until=lambda: robot.steps >= steps, episode_id=episode_id)
    if driver not in ('next_action', 'next_action_clock'):
        raise ValueError(f'unknown driver {driver!r}')
    policy.begin_episode('replay', episode_id=episode_id, max_actions=steps, control_period=period)
    start = time.monotonic()
    i = 0
    while policy.episode_outcome() is None and time.monotonic() - start < timeout_s:
        deadline = start + i * period
        wait = deadline - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        now = time.monotonic() if driver == 'next_action_clock' else deadline
        action = policy.next_action(robot.observe(now), now=now)
        if action is not None and not action.hold:
            robot.act(action)
        i = max(i + 1, math.floor((time.monotonic() - start) / period) + 1)
    return policy.end_episode()


@dataclasses.dataclass
class Rows:
    """One exported episode as read back: float32 state (N, Ds), action (N, D), bool held (N,)."""

    state: np.ndarray
    action: np.ndarray
    held: np.ndarray


@dataclasses.dataclass
class Episode:
    """One replayed episode: the robot, its outcome, its exported rows (None, with ``skipped``, if not exported)."""

    robot: Robot
    outcome: Any
    steps: int
    rows: Rows | None
    skipped: str = ''


def replay(source: Source, driver: str, multiple: Fraction, firsts: Sequence[int], steps: int,
           workdir: Path | None = None, timeout_s: float = 120.0,
           disturbance: Disturbance | None = None) -> list[Episode]:
    """Serve ``source`` with capture on, drive one episode per start in ``firsts``, export, read the rows back.

    :param disturbance: the policy's latency and the robot's overruns (None: neither).
    :raises ExportError: when no episode could be exported at all.
    """
    from sequence_ai_ros.capture.settings import CaptureSettings, save_settings
    from sequence_ai_ros.capture.store import CaptureStore
    from sequence_ai_ros.client import connect
    from sequence_ai_ros.datasets.lerobot_reader import LeRobotDataset
    from sequence_ai_ros.datasets.lerobot_writer import export_lerobot
    from sequence_ai_ros.protocol.spaces import ActionSpace
    from sequence_ai_ros.worker import serve_policy_file

    if workdir is None:
        with tempfile.TemporaryDirectory(prefix='seq-exact-') as tmp:
            return replay(source, driver, multiple, firsts, steps, Path(tmp), timeout_s, disturbance)
    capture = Path(workdir) / 'capture'
    save_settings(capture / DEPLOYMENT, CaptureSettings(rate=1.0, enabled=True))
    done: list[tuple[Robot, Any]] = []
    config = source.config if disturbance is None else disturbance.policy_config(source)
    with serve_policy_file(source.policy, DEPLOYMENT, capture_root=capture, port=0, **config) as server, \
            connect(DEPLOYMENT, endpoint=f'127.0.0.1:{server.port}') as policy:
        policy.wait_until_ready(timeout=60)
        for n, first in enumerate(firsts):
            robot = Robot(source, first, multiple, steps,
                          by_clock=driver.startswith('next_action') and ActionSpace(source.space).is_absolute,
                          overrun=None if disturbance is None else disturbance.overruns(n), capped=driver != 'act')
            done.append((robot, drive(policy, robot, driver, steps, f'{driver}-{n}-{first}', timeout_s)))
    store = CaptureStore(capture / DEPLOYMENT, DEPLOYMENT)
    res = export_lerobot(store, Path(workdir) / 'lerobot', images=False, progress=False)
    skipped = dict(res['skipped'])
    ds = LeRobotDataset(Path(workdir) / 'lerobot')
    index = {str(e['episode_id']): int(e['episode_index']) for e in ds.episodes}
    out = []
    for robot, outcome in done:
        k = index.get(outcome.episode_id)
        rows = None
        if k is not None:
            data = ds.episode(k)
            held = np.asarray(data.extra['action.held']).reshape(-1).astype(bool)
            rows = Rows(data.state, data.action, held)
        out.append(Episode(robot, outcome, steps, rows, skipped.get(outcome.episode_id, '' if rows else 'absent')))
    return out


@dataclasses.dataclass
class Expected:
    """What the rows of one episode must hold (see the module docstring); N = steps executed.

    :param state: float32 (N, Ds). :param path: float64 (N, R) the robot's commanded path of the rate
        channels at each row's end, from its start. :param positions: float32 (N, D - R) the position channels'
        command in effect at each row's start. :param client_err: max abs difference between each tick's
        increments and the recorded increments it covered (0 for absolute spaces).
    :param gaps: bool (N,) rows whose step no tick started in (they may be exported as held).
    """

    state: np.ndarray
    path: np.ndarray
    positions: np.ndarray
    client_err: float
    gaps: np.ndarray


def expected(episode: Episode) -> Expected:
    """The truth for ``episode``'s rows, from its robot's log."""
    robot, n = episode.robot, episode.steps
    src, ticks = robot.source, robot.ticks
    r = src.rate_dims
    starts = np.array([t.start for t in ticks])
    if not len(ticks):
        raise AssertionError('the robot executed nothing')
    eff = [int(np.searchsorted(starts, k + STEP_EPS, side='right')) - 1 for k in range(n)]
    gaps = np.array([not np.any((starts >= k - STEP_EPS) & (starts < k + 1 - STEP_EPS)) for k in range(n)], bool)
    state = np.array([ticks[max(i, 0)].state for i in eff], np.float32)
    positions = np.array([ticks[max(i, 0)].command[r:] for i in eff], np.float32).reshape(n, -1)
    rates = (src.path[1:] - src.path[:-1])[:, :r].astype(np.float64)      # the recorded increment of each step
    client_err = 0.0
    if r:
        for t in ticks:
            want = np.zeros(r)
            for j in range(math.floor(t.start + STEP_EPS), math.ceil(t.start + t.span - STEP_EPS)):
                cover = min(t.start + t.span, j + 1) - max(t.start, j)
                want += cover * rates[robot.first + j]
            got = (t.after[:r].astype(np.float64) - t.before[:r]) if src.space == 'joint_delta' else t.command[:r]
            client_err = max(client_err, float(np.max(np.abs(got - want))))
    path = np.zeros((n, r))
    for k in range(n if r else 0):
        b = k + 1
        i = int(np.searchsorted(starts, b - STEP_EPS, side='left')) - 1   # the tick ending at or straddling b
        t = ticks[i]
        before, after = t.before[:r].astype(np.float64), t.after[:r].astype(np.float64)
        if abs(t.start + t.span - b) <= STEP_EPS or t.start + t.span < b:
            at = after
        else:    # inside the tick: its increment up to b is the part of the recorded steps it covers by then
            at = before.copy()
            for j in range(math.floor(t.start + STEP_EPS), math.ceil(b - STEP_EPS)):
                at += (min(b, j + 1) - max(t.start, j)) * rates[robot.first + j]
        path[k] = at - robot.start[:r]
    return Expected(state, path, positions, client_err, gaps)


@dataclasses.dataclass
class Score:
    """How one exported episode compares (errors over the rows both have; inf when nothing was exported)."""

    rows: int
    steps: int
    held: int           # held rows whose step a tick started in (a gap row may be held)
    underruns: int
    path_err: float
    position_err: float
    state_err: float
    client_err: float
    skipped: str = ''

    @property
    def count_ok(self) -> bool:
        """One row per step executed, none held but gap rows."""
        return self.rows == self.steps and self.held == 0

    @property
    def exact(self) -> bool:
        """The right rows with the right values (within :data:`ACTION_ATOL`, :data:`STATE_ATOL`)."""
        return (self.count_ok and self.path_err <= ACTION_ATOL and self.position_err <= ACTION_ATOL
                and self.state_err <= STATE_ATOL)


def score(episode: Episode) -> Score:
    """Compare ``episode``'s rows with :func:`expected`."""
    want = expected(episode)
    under = int(episode.outcome.underruns)
    executed = int(episode.outcome.actions)
    rows = episode.rows
    if rows is None:
        return Score(0, executed, 0, under, math.inf, math.inf, math.inf, want.client_err, episode.skipped)
    r = episode.robot.source.rate_dims
    m = min(len(rows.action), episode.steps)
    path_err = pos_err = 0.0
    if r and m:
        got = np.cumsum(rows.action[:, :r].astype(np.float64), 0)[:m]
        path_err = float(np.max(np.abs(got - want.path[:m])))
    if rows.action.shape[1] > r and m:
        pos_err = float(np.max(np.abs(rows.action[:m, r:].astype(np.float64) - want.positions[:m])))
    state_err = float(np.max(np.abs(rows.state[:m].astype(np.float64) - want.state[:m]))) if m else math.inf
    gaps = np.zeros(len(rows.held), bool)
    gaps[:m] = want.gaps[:m]
    return Score(len(rows.action), executed, int((rows.held & ~gaps).sum()), under, path_err, pos_err, state_err,
                 want.client_err)


@dataclasses.dataclass
class DisturbedScore:
    """How one disturbed episode compares: its rows not held against the steps executed (see :func:`disturbed_score`).

    Errors are over the rows both have (inf when nothing was exported); ``skipped``: why it was not scored.
    """

    rows: int
    steps: int            # steps the client reported executed (RunOutcome.actions)
    robot_steps: float    # steps the robot ran (its clock)
    held: int             # rows flagged held (gap rows of an absolute next_action loop not counted)
    held_bound: int       # ticks that held or periods skipped (RunOutcome.ticks_held + ticks_skipped)
    underruns: int
    periods_skipped: int
    path_err: float
    position_err: float
    state_err: float
    client_err: float
    skipped: str = ''

    @property
    def steps_ok(self) -> bool:
        """The client reported the steps the robot ran (whole steps: act's last tick may end inside one)."""
        return math.floor(self.robot_steps + STEP_EPS) == self.steps

    @property
    def count_ok(self) -> bool:
        """One row not held per step executed, no more held rows than ticks that held or periods skipped."""
        return self.steps_ok and self.rows - self.held == self.steps and self.held <= self.held_bound

    @property
    def exact(self) -> bool:
        """The right rows with the right values (within :data:`ACTION_ATOL`, :data:`STATE_ATOL`)."""
        return (self.count_ok and self.path_err <= ACTION_ATOL and self.position_err <= ACTION_ATOL
                and self.state_err <= STATE_ATOL and self.client_err <= ACTION_ATOL)


def step_rows(episode: Episode) -> np.ndarray:
    """The exported rows that stand for the policy's steps: bool (rows,).

    Those not held; in an absolute next_action loop the gap rows too (no tick started in their step: the previous
    command stays in effect there).
    """
    assert episode.rows is not None
    rows = ~episode.rows.held
    if episode.robot.by_clock:
        gaps = expected(episode).gaps
        m = min(len(rows), len(gaps))
        rows[:m] |= gaps[:m]
    return rows


def disturbed_score(episode: Episode) -> DisturbedScore:
    """Compare a disturbed ``episode``'s rows with :func:`expected`: held rows allowed where the robot held.

    The rows not held (:func:`step_rows`) must be one per step executed, in order: delta spaces, the cumulative
    sum of all rows (a held row adds nothing) at each is the commanded path at the step's end; position channels
    and the state, those of the tick in effect at its start. An absolute next_action loop (the robot follows the
    clock) is not scored across a dry spell (``skipped``): its rows are the control grid's, which a dry spell
    moves off the steps.
    """
    out, robot = episode.outcome, episode.robot
    if not robot.ticks:
        return DisturbedScore(0, int(out.actions), 0.0, 0, 0, int(out.underruns), 0, math.inf, math.inf, math.inf,
                              math.inf, f'the robot executed nothing ({out.reason})')
    want = expected(episode)
    bound = int(getattr(out, 'ticks_held', 0)) + int(getattr(out, 'ticks_skipped', 0))
    base: dict[str, Any] = dict(steps=int(out.actions), robot_steps=float(robot.steps), held_bound=bound,
                                underruns=int(out.underruns), periods_skipped=int(getattr(out, 'ticks_skipped', 0)),
                                client_err=want.client_err)
    rows = episode.rows
    why = episode.skipped or ('' if out.reason in ('completed', 'until') else f'ended: {out.reason}')
    if rows is None or why:
        return DisturbedScore(0 if rows is None else len(rows.action), held=0, path_err=math.inf,
                              position_err=math.inf, state_err=math.inf, skipped=why or 'absent', **base)
    if robot.by_clock and out.underruns:
        return DisturbedScore(len(rows.action), held=int(rows.held.sum()), path_err=math.nan, position_err=math.nan,
                              state_err=math.nan, skipped='by clock across a dry spell', **base)
    sel = step_rows(episode)
    r = robot.source.rate_dims
    m = min(int(sel.sum()), episode.steps, len(want.state))
    path_err = pos_err = 0.0
    if r and m:
        got = np.cumsum(rows.action[:, :r].astype(np.float64), 0)[sel][:m]
        path_err = float(np.max(np.abs(got - want.path[:m])))
    if rows.action.shape[1] > r and m:
        pos_err = float(np.max(np.abs(rows.action[sel][:m, r:].astype(np.float64) - want.positions[:m])))
    state_err = float(np.max(np.abs(rows.state[sel][:m].astype(np.float64) - want.state[:m]))) if m else math.inf
    return DisturbedScore(len(rows.action), held=int((rows.held & ~sel).sum()),
                          path_err=path_err, position_err=pos_err, state_err=state_err, **base)


__all__ = ['ACTION_ATOL', 'DATA', 'DISTURBANCES', 'DRIVERS', 'G1_DATASET', 'G1_DISTURBED_STEPS', 'G1_STARTS',
           'G1_STEPS', 'MULTIPLES', 'SPACES', 'STATE_ATOL', 'TABLE_DRIVERS', 'WX200_BAG', 'WX_DISTURBED_STARTS',
           'WX_DISTURBED_STEPS', 'WX_STARTS', 'WX_STEPS', 'Disturbance', 'DisturbedScore', 'Episode', 'Expected',
           'Overrun', 'Robot', 'Rows', 'Score', 'Source', 'Tick', 'disturbed_score', 'drive', 'expected', 'g1_source',
           'replay', 'score', 'step_rows', 'wx200_source']
