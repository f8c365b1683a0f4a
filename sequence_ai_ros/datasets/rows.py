"""From a captured episode's control ticks to dataset rows on an exact ``k / fps`` timeline.

The robot streams one telemetry frame per control tick (state, the command it sent after its safety
filter, the policy's action when that differed, hold and clamp flags) and camera frames at the row rate.
A row ``k`` stands for the time ``t_k = t0 + k / fps`` where ``t0`` is the robot time of the first tick
that commanded a policy action (ticks before it, while the arm waited for the first chunk, make no row).

Which ticks make row k: those with ``round((t - t0) * fps) == k`` (the row's *cell*, half a row period
either side of ``t_k``). Then:

- ``observation.state``: the measured state of the first tick of the cell;
- camera frames: the newest frame received at or before that tick (the first frame when none yet);
- ``action`` in absolute spaces: the command of the cell's first tick, the command in effect at ``t_k``
  (a hold repeats the previous command); in delta spaces: the sum of the cell's commands (a hold adds
  0), so the cumulative sum of the rows reproduces the commanded path; in velocity spaces: the mean
  commanded velocity over the cell (each tick's command weighted by the time to the next tick, divided
  by the row period), so ``sum(action) / fps`` is the commanded displacement;
- ``action.policy``: the same reduction of the policy's actions (before the robot's safety filter; a tick
  the robot did not execute, as in a dry run, keeps its policy action here while its row is held);
- ``action.clamped``: any tick of the cell was clamped; ``action.held``: the row's command is a hold
  (absolute: its first tick held; delta/velocity: no tick of the cell commanded).

50 Hz ticks against a 30 Hz policy (dt = 1/30 s): ticks at 0, 20, 40, 60, 80 ms... fall in cells 0, 1, 1,
2, 2, 3, 4, 4, 5, 5... (row 1 spans [16.7, 50) ms); rows take the ticks at 0, 20, 60, 100, 120, 160 ms...,
each the command in effect at 0, 33.3, 66.7, 100, 133.3, 166.7 ms. A 30 Hz caller against a 30 Hz
policy gives each tick its own row. A cell with no tick (a stall longer than a row) becomes a held row
(previous state and frames; absolute: the previous command, delta/velocity: zero), so the timeline stays
true. Ticks that arrive late (after a stall, one per row) and then share a cell with the next tick move
back one row each, filling the stall's last held row (absolute and delta spaces, at most ``MAX_CATCH_UP``
rows back), so a fixed-step loop that falls behind and catches up loses no executed step. Only a caller
that ticks once per row catches up (the median of its recent tick intervals above ``CATCH_UP_MIN_TICK``
of a row period, and the two ticks sharing the cell not a whole number of those intervals apart, as the
node's deadline-stamped ticks are): a faster caller (50 Hz ticks, 30 Hz rows) shares cells by design, and
after a stall it skips ticks rather than bunching them (the node's tick thread keeps its phase), so its
held rows stay held, each the command in effect at ``t_k``. A caller faster than the rows exports as many
rows as its executed policy steps or one more: its last command gets a whole row although it ran for only
part of one (the engine counts a step as executed at the next tick). Otherwise ticks sharing a cell are
summed (delta, velocity) or the first one is the row's command (absolute). Trailing held rows (after the
last command) are dropped. The ROS node stamps each tick with the control deadline it serves
(node/runner.py), not its wake-up time, so its ticks sit on their cells exactly: a tick woken late (up to
a period; later ones are skipped) keeps its own row. When 1/dt is not a whole number the rows come at
``round(1/dt)`` Hz (see :meth:`CaptureSettings.row_fps`) by the same rule.

Stores written before this rule (``format`` 1: frames sampled at the capture fps) go through the same
mapping: each frame is one tick. Frames are re-checked (:class:`FrameChecker`), so a frame that a
legacy store kept unchecked (wrong shape, NaN...) is skipped and counted, never exported.

The episode is read twice, streaming (bounded memory whatever its length): :func:`build_rows` keeps the
numbers (small) and, per row and camera, the index of the tick whose frame it uses;
:func:`row_images` then streams the frames in row order.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterator

import numpy as np

from sequence_ai_ros.capture.episode import RECORDS_FILE, CapturedEpisode
from sequence_ai_ros.capture.frame_check import FrameChecker
from sequence_ai_ros.capture.records import TELEMETRY, read_records
from sequence_ai_ros.exceptions import ContractViolation
from sequence_ai_ros.protocol import codec
from sequence_ai_ros.protocol import sequence_ai_pb2 as pb
from sequence_ai_ros.protocol.spaces import ActionSpace

#: How many rows back a late tick may be moved to fill a stall's held row (see the module docstring).
MAX_CATCH_UP = 8
#: A late tick is moved back only when the median of the recent fresh-tick intervals exceeds this share of
#: the row period, i.e. the caller ticks once per row (see the module docstring).
CATCH_UP_MIN_TICK = 0.75


@dataclasses.dataclass
class EpisodeRows:
    """The rows of one episode (numbers only) and where their camera frames are.

    :param state: float32 (N, D) measured state.
    :param action: float32 (N, A) commanded action (see the module docstring).
    :param policy_action: float32 (N, A) the policy's action, reduced the same way.
    :param clamped: bool (N,). :param held: bool (N,).
    :param frame_ticks: per camera key, int64 (N,) the tick index whose frame each row uses.
    :param skipped_frames: telemetry frames skipped because they failed the contract check.
    :param first_problem: the first such failure ('' when none).
    """

    state: np.ndarray
    action: np.ndarray
    policy_action: np.ndarray
    clamped: np.ndarray
    held: np.ndarray
    frame_ticks: dict[str, np.ndarray]
    skipped_frames: int = 0
    first_problem: str = ''

    def __len__(self) -> int:
        return len(self.state)


def _frames(episode: CapturedEpisode) -> Iterator[pb.TelemetryFrame]:
    for rec in read_records(episode.path / RECORDS_FILE):
        if rec.kind == TELEMETRY:
            yield rec.message


def _vec(t: pb.Tensor) -> np.ndarray:
    return codec.from_tensor(t, what='action', dtype='float32', ndim=1, finite=True)


def _once_per_row(intervals: collections.deque[float], period: float, gap_s: float) -> bool:
    """True when a tick that shares a cell with the one before, ``gap_s`` (s) after it, may be a catch-up.

    The caller ticks once per row: the median of its recent tick intervals is above ``CATCH_UP_MIN_TICK`` of
    the row period ``period`` (s). Not when the ticks lie on a grid: the gap and every recent interval a
    whole number of median intervals, to float precision, as the ROS node's ticks are (it stamps each with
    its control deadline, so none is late; one a little faster than the rows, 35 Hz ticks against 30 Hz
    rows, shares a cell now and then by design). A late tick breaks that (its own interval is off the grid),
    as does a clock quantised coarser than the period's fraction (33 and 34 ms intervals at 30 Hz).
    """
    if not intervals:
        return True
    median = float(np.median(intervals))
    if median <= CATCH_UP_MIN_TICK * period:
        return False
    return not all(_whole(x / median) for x in (gap_s, *intervals))


def _whole(steps: float) -> bool:
    return round(steps) >= 1 and abs(steps - round(steps)) <= ON_GRID_TOLERANCE


#: A gap between two ticks that is a whole multiple of their median interval to this share of it is a grid's
#: (the node's deadline stamps: float error under 1e-6 of a 30 Hz interval up to ~3 years of uptime).
ON_GRID_TOLERANCE = 1e-5

#: Longest stall (s) between two kept frames that held rows may fill; a larger jump is a bad frame.
MAX_GAP_S = 300.0


def build_rows(episode: CapturedEpisode, fps: float, space: ActionSpace, state_dim: int, action_dim: int,
               camera_keys: list[str]) -> EpisodeRows:
    """Map the episode's ticks to rows at ``fps`` (see the module docstring); streams the records once.

    :raises CaptureError: when the episode's record file is unreadable or corrupt.
    """
    checker = FrameChecker(episode.contract)
    absolute = space.is_absolute
    velocity = not absolute and 'velocity' in space.value
    period = 1.0 / fps
    rows: dict[str, list] = {k: [] for k in ('state', 'action', 'policy', 'clamped', 'held', 'k', 'frames', 'fresh')}
    gap_rows: list[int] = []   # indices of rows a stall left held (a late tick may still claim the last one)
    latest: dict[str, int] = {}
    skipped, problem = 0, ''
    t0: float | None = None
    cell: dict | None = None   # the row being built
    last_cmd = np.zeros(action_dim, np.float32)
    pending_v: tuple[float, np.ndarray, np.ndarray] | None = None   # velocity: the tick awaiting its duration
    intervals: collections.deque[float] = collections.deque(maxlen=15)   # recent fresh-tick intervals (s)
    last_fresh_t: float | None = None

    def close(c: dict, at: int | None = None) -> None:
        values = {'state': c['state'], 'action': c['action'], 'policy': c['policy'], 'clamped': c['clamped'],
                  'held': c['held'], 'k': c['k'], 'frames': c['frames'], 'fresh': c.get('fresh', 0)}
        for name, value in values.items():
            if at is None:
                rows[name].append(value)
            else:
                rows[name][at] = value

    for i, frame in enumerate(_frames(episode)):
        try:
            checker.check(frame)
            state = codec.from_tensor(frame.state, what='state', dtype='float32', ndim=1, finite=True)
            cmd = _vec(frame.action) if frame.HasField('action') else None
            pol = _vec(frame.policy_action) if frame.HasField('policy_action') else cmd
            if (state.shape[0] != state_dim or (cmd is not None and cmd.shape[0] != action_dim)
                    or (pol is not None and pol.shape[0] != action_dim)):
                raise ContractViolation(f'state {state.shape} / action sizes differ from the contract')
        except ContractViolation as exc:
            skipped += 1
            problem = problem or f'telemetry frame {i}: {exc}'
            continue
        for image in frame.images:
            if image.key in camera_keys:
                latest[image.key] = i
        fresh = cmd is not None and not frame.hold
        if t0 is None:
            if not fresh:
                continue
            t0 = frame.robot_time_s
        k = int(np.floor((frame.robot_time_s - t0) * fps + 0.5))
        if k < 0 or (cell is not None and k - cell['k'] > MAX_GAP_S * fps):
            # A clock that runs backwards or leaps (a robot sent 1e300 s) would fill rows without end:
            # the frame is refused like any other bad frame, and the episode keeps its timeline.
            skipped += 1
            problem = problem or (f'telemetry frame {i}: robot_time_s {frame.robot_time_s!r} is before the '
                                  f'episode start or more than {MAX_GAP_S:g} s after the previous frame')
            continue
        if velocity and pending_v is not None:
            t_prev, v_prev, p_prev = pending_v
            w = max(0.0, frame.robot_time_s - t_prev) / period
            cell['action'] += v_prev * w
            cell['policy'] += p_prev * w
            pending_v = None
        if cell is not None and k > cell['k']:
            close(cell)
            prev = cell
            for gap in range(cell['k'] + 1, k):   # a stall: held rows keep the timeline
                hold_cmd = prev['action'] if absolute else np.zeros(action_dim, np.float32)
                close({**prev, 'k': gap, 'action': hold_cmd, 'policy': hold_cmd, 'held': True, 'clamped': False,
                       'fresh': 0})
                gap_rows.append(len(rows['state']) - 1)
            cell = None
        g = gap_rows[-1] if gap_rows else -1
        # Only a caller that ticks at the row rate (or slower) catches up: a faster one (50 Hz ticks against
        # 30 Hz rows) shares cells by design, and its ticks after a stall are on time, not late. The median
        # is taken last, only for a tick that is otherwise a catch-up candidate.
        late = (cell is not None and fresh and not velocity and cell['fresh'] == 1 and g >= 0
                and len(rows['state']) - g <= MAX_CATCH_UP and rows['k'][-1] == cell['k'] - 1
                and all(rows['fresh'][j] == 1 for j in range(g + 1, len(rows['state'])))
                and last_fresh_t is not None
                and _once_per_row(intervals, period, frame.robot_time_s - last_fresh_t))
        if late:
            # The ticks since a stall's last held row were each one late: move them back one row (the
            # held row is filled), and this tick takes the cell, so no executed step is merged away.
            gap_rows.pop()
            for name in rows:
                rows[name][g:-1] = rows[name][g + 1:]
            close({**cell, 'k': cell['k'] - 1}, at=len(rows['state']) - 1)
            for j in range(g, len(rows['state']) - 1):
                rows['k'][j] -= 1
            cell = None
        # a tick the robot did not execute although the policy acted (a dry run, a refused action): its row is
        # held, and the policy's action is kept in action.policy
        dry = cmd is None and pol is not None
        if cell is None or k > cell['k']:
            if absolute:
                a = cmd if fresh else last_cmd
                p = pol if (fresh or dry) else a
            else:
                a = np.zeros(action_dim, np.float32)
                p = np.zeros(action_dim, np.float32)
            cell = {'k': k, 'state': state, 'action': np.array(a, np.float32), 'policy': np.array(p, np.float32),
                    'clamped': bool(frame.clamped), 'held': not fresh, 'fresh': 0,
                    'frames': {key: latest.get(key, -1) for key in camera_keys}}
            if not absolute and fresh:
                cell['held'] = False
        else:
            cell['clamped'] |= bool(frame.clamped)
            if not absolute and fresh:
                cell['held'] = False
        if dry and not absolute and not velocity:
            cell['policy'] += pol
        if fresh:
            if last_fresh_t is not None:
                intervals.append(frame.robot_time_s - last_fresh_t)
            last_fresh_t = frame.robot_time_s
            last_cmd = cmd
            cell['fresh'] += 1
            if not absolute:
                if velocity:
                    pending_v = (frame.robot_time_s, cmd, pol)
                else:
                    cell['action'] += cmd
                    cell['policy'] += pol
    if cell is not None:
        if velocity and pending_v is not None:   # the last tick: one tick period (taken as the row period)
            cell['action'] += pending_v[1]
            cell['policy'] += pending_v[2]
        close(cell)
    n = len(rows['state'])
    while n and rows['held'][n - 1]:
        n -= 1
    frame_ticks = {}
    for key in camera_keys:
        arr = np.array([f.get(key, -1) for f in rows['frames'][:n]], np.int64)
        known = arr[arr >= 0]
        if len(known) and (arr < 0).any():
            arr[arr < 0] = known[0]   # rows before the camera's first frame show that frame
        frame_ticks[key] = arr
    return EpisodeRows(
        state=np.array(rows['state'][:n], np.float32).reshape(n, state_dim),
        action=np.array(rows['action'][:n], np.float32).reshape(n, action_dim),
        policy_action=np.array(rows['policy'][:n], np.float32).reshape(n, action_dim),
        clamped=np.array(rows['clamped'][:n], bool), held=np.array(rows['held'][:n], bool),
        frame_ticks=frame_ticks, skipped_frames=skipped, first_problem=problem)


def row_images(episode: CapturedEpisode, key: str, frame_ticks: np.ndarray) -> Iterator[tuple[pb.Image, int]]:
    """Yield ``(Image, repeat)`` for camera ``key`` in row order.

    Each needed frame comes once, with how many consecutive rows use it (streams the records; one frame in
    memory at a time).
    """
    if not len(frame_ticks):
        return
    needed = np.unique(frame_ticks)
    repeats = {int(t): int(c) for t, c in zip(*np.unique(frame_ticks, return_counts=True), strict=True)}
    want = iter(needed.tolist())
    target = next(want, None)
    for i, frame in enumerate(_frames(episode)):
        if target is None:
            return
        if i == target:
            image = next((im for im in frame.images if im.key == key), None)
            if image is not None:
                yield image, repeats[i]
            target = next(want, None)


def cameras_with_frames(episode: CapturedEpisode, keys: list[str]) -> list[str]:
    """Return the keys of ``keys`` that have at least one frame in the episode (streams the records)."""
    seen: set[str] = set()
    for frame in _frames(episode):
        seen.update(im.key for im in frame.images)
        if seen.issuperset(keys):
            break
    return [k for k in keys if k in seen]
