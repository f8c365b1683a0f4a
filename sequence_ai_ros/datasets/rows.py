"""From a captured episode's control-tick records to dataset rows, by each record's chunk-step span.

The robot streams one telemetry record per control tick (protocol ``sequence_ai.v1.2``): the measured
state, what it executed after its safety filter (in the policy's action space: a joint_delta tick's
increment), the policy's action when that differed, hold and clamp flags, why it held, camera frames on
the ticks where a row starts, and the tick's place on the episode's timeline: the control deadline it
served (``grid_index``) and the chunk steps it covers, ``[step_start, step_end)`` (the control grid in
units of the policy's dt, 0 at the episode's first deadline). Rows are never placed by rounding a
wall-clock time: they are read off those spans.

Row ``k`` stands for the point ``u0 + k`` on that axis, in rows (a chunk step is ``fps * dt`` rows, 1
when the rows come at the policy's rate), where ``u0`` is the start of the first record that executed a
policy action (records before it, while the arm waited for the first chunk, make no row). LeRobot's row
convention holds: the row's state at its time, its action over ``[t, t + 1 / fps)``.

- ``observation.state``: the state of the record in effect at the row's point (the latest record starting
  at or before it): the observation at the row's start;
- camera frames: the newest frame at or before that record (the camera's first frame for rows before it);
- ``action`` in absolute spaces (and the position channels of joint_velocity and ee_delta, the gripper):
  the target of the record in effect at the row's point (a hold repeats the previous target);
- ``action`` in delta spaces: the sum of the increments executed within the row's span; a record whose
  span crosses a chunk-step boundary carries the policy's action over each part (``pieces``), so it is split
  there exactly (by the policy's own parts, each taking its share of what a clamp changed), and within
  one chunk step by the share of its span: the rows sum to the executed path at every row boundary, and are
  the policy's own steps when nothing was changed; in velocity spaces: the mean commanded velocity over the
  row, each command weighted by the time it was in effect (from its publication, the record's robot time,
  to the next one: a rate controller keeps applying the last), so ``sum(action) / fps`` is the commanded
  displacement;
- ``action.policy``: the same reduction of the policy's actions (a tick the robot did not execute, as in
  a dry run or a refused command, keeps its policy action here while its row is held);
- ``action.clamped``: a record the row covers was clamped (absolute: the record in effect);
  ``action.held``: no record within the row's span executed a fresh policy action (an underrun, a dry run,
  deadlines a stalled loop missed).

A record's span ends where the next record's begins, at the latest: without a fixed control period a tick
on the clock spans the measured period, an estimate, and the next tick replaces its command when it comes.
Control deadlines no tick served (a stalled control loop: the next record's ``grid_index`` jumps) leave
a gap in the spans; rows in it are held (the previous state and frames; absolute: the previous target,
delta/velocity: zero), so the timeline stays true. Trailing held rows (after the last executed action)
are dropped. 50 Hz ticks against a 30 Hz policy cover 0.6 steps each: rows take the ticks in effect at
0, 1, 2... steps, and a delta row sums one and two thirds of the ticks in it.

Stores written before the spans existed (records without them, or ``format`` 1: frames sampled at the
capture fps) are mapped by the rule of their time: a tick belongs to row ``round((t - t0) * fps)``; the
row's state and absolute action are its first tick's, delta rows sum the ticks in it, velocity rows weight
each command by the time to the next tick. Records are re-checked (:class:`FrameChecker`), so a frame
that a store kept unchecked (wrong shape, NaN...) is skipped and counted, never exported.

The episode is read twice, streaming its records (the images stay on disk): :func:`build_rows` keeps the
numbers and, per row and camera, the index of the record whose frame it uses; :func:`row_images` then
streams the frames in row order.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator

import numpy as np

from sequence_ai_ros.capture.episode import RECORDS_FILE, CapturedEpisode
from sequence_ai_ros.capture.frame_check import FrameChecker
from sequence_ai_ros.capture.records import read_records
from sequence_ai_ros.exceptions import ContractViolation
from sequence_ai_ros.protocol import codec
from sequence_ai_ros.protocol import sequence_ai_pb2 as pb
from sequence_ai_ros.protocol.limits import MAX_EPISODE_S, MAX_STALL_S, MAX_TICK_S
from sequence_ai_ros.protocol.spaces import ActionSpace, position_mask

#: Float slack on the row axis (rows): spans are sums of control periods in dt units.
SPAN_SLACK = 1e-6
#: Most rows one episode exports at any fps (a backstop: :func:`row_budget` is the episode's own bound).
MAX_ROWS = 2_000_000


def row_budget(fps: float, records: int) -> int:
    """The most rows an episode of ``records`` checked records can make at ``fps`` (Hz).

    The checker (:class:`FrameChecker`) bounds each record's time since the episode's first to
    ``MAX_EPISODE_S`` and the stalls to ``MAX_STALL_S``, each record adding at most ``MAX_TICK_S`` of its own
    (a velocity record spans to the next one's robot time, the last its own length): rows past this bound
    are not the episode's.
    """
    seconds = min(MAX_EPISODE_S + MAX_TICK_S, records * MAX_TICK_S + MAX_STALL_S)
    return min(MAX_ROWS, math.ceil(seconds * fps) + 1)


@dataclasses.dataclass
class EpisodeRows:
    """The rows of one episode (numbers only) and where their camera frames are.

    :param state: float32 (N, D) measured state.
    :param action: float32 (N, A) executed action (see the module docstring).
    :param policy_action: float32 (N, A) the policy's action, reduced the same way.
    :param clamped: bool (N,). :param held: bool (N,).
    :param frame_ticks: per camera key, int64 (N,) the record index whose frame each row uses.
    :param skipped_frames: telemetry records skipped because they failed the contract check.
    :param first_problem: the first such failure ('' when none).
    :param stopped: why the rows stop before the records' end ('' when they do not): the episode's bounded
        duration (:func:`row_budget`) was reached.
    """

    state: np.ndarray
    action: np.ndarray
    policy_action: np.ndarray
    clamped: np.ndarray
    held: np.ndarray
    frame_ticks: dict[str, np.ndarray]
    skipped_frames: int = 0
    first_problem: str = ''
    stopped: str = ''

    def __len__(self) -> int:
        return len(self.state)


@dataclasses.dataclass
class _Record:
    """One checked telemetry record, on the row axis (``a``..``b`` in rows from the episode's origin)."""

    i: int                       # its index among the episode's telemetry records (for its frames)
    a: float
    b: float
    grid: int
    state: np.ndarray
    cmd: np.ndarray | None       # executed (None: nothing commanded)
    pol: np.ndarray | None       # the policy's action (cmd when the same)
    fresh: bool
    clamped: bool
    share: float = 0.0           # legacy velocity: the tick's time to the next one, in rows
    parts: list[tuple[float, float, np.ndarray | None, np.ndarray]] | None = None
    # a span across chunk-step boundaries: (start, end, executed, policy's) of each part (rows)
    t: float = 0.0               # robot time (s)
    raw_parts: tuple[np.ndarray, list[float]] | None = None


def telemetry_frames(episode: CapturedEpisode) -> Iterator[pb.TelemetryFrame]:
    """Yield the episode's telemetry frames in arrival order, read one record at a time (unchecked).

    :raises CaptureError: when the episode's file is missing, truncated or corrupt (at the bad record).
    """
    for rec in read_records(episode.path / RECORDS_FILE):
        if isinstance(rec.message, pb.TelemetryFrame):
            yield rec.message


def _vec(t: pb.Tensor) -> np.ndarray:
    return codec.from_tensor(t, what='action', dtype='float32', ndim=1, finite=True)


def has_span(frame: pb.TelemetryFrame) -> bool:
    """True for a record of protocol v1.2 or later: it carries its chunk-step span."""
    return frame.step_end > frame.step_start


def _read(episode: CapturedEpisode, state_dim: int, action_dim: int, camera_keys: list[str],
          fps: float, rows_per_step: float) -> tuple[list[_Record], dict[str, list[tuple[int, int]]], int, str, bool]:
    """Check and parse the records: (records, per camera the (record, tick) of each frame, skipped, problem, legacy)."""
    checker = FrameChecker(episode.contract)
    records: list[_Record] = []
    frames: dict[str, list[tuple[int, int]]] = {k: [] for k in camera_keys}
    skipped, problem = 0, ''
    velocity = episode.contract is not None and episode.contract.action_space is ActionSpace.JOINT_VELOCITY
    legacy: bool | None = None
    for i, frame in enumerate(telemetry_frames(episode)):
        try:
            checker.check(frame)
            state = codec.from_tensor(frame.state, what='state', dtype='float32', ndim=1, finite=True)
            cmd = _vec(frame.action) if frame.HasField('action') else None
            pol = _vec(frame.policy_action) if frame.HasField('policy_action') else cmd
            if (state.shape[0] != state_dim or (cmd is not None and cmd.shape[0] != action_dim)
                    or (pol is not None and pol.shape[0] != action_dim)):
                raise ContractViolation(f'state {state.shape} / action sizes differ from the contract')
            # the checker refused a mix of spanned and unspanned records, records out of order, leaps
            if legacy is None:
                legacy = not has_span(frame)
            a, b = ((frame.robot_time_s,) * 2 if legacy
                    else (frame.step_start * rows_per_step, frame.step_end * rows_per_step))
        except ContractViolation as exc:
            skipped += 1
            problem = problem or f'telemetry frame {i}: {exc}'
            continue
        n = len(records)
        for image in frame.images:
            if image.key in frames:
                frames[image.key].append((n, i))
        rec = _Record(i, a, b, int(frame.grid_index), state, cmd, pol, fresh=cmd is not None and not frame.hold,
                      clamped=bool(frame.clamped), t=frame.robot_time_s)
        if not legacy and frame.HasField('pieces'):
            rec.raw_parts = (codec.from_tensor(frame.pieces, what='pieces', dtype='float32', ndim=2),
                             list(frame.piece_share))
        records.append(rec)
    if velocity and not legacy:
        _velocity_spans(records, fps)
    elif not legacy:
        _end_at_next(records)
    for rec in records:
        if rec.raw_parts is not None:
            rec.parts = _parts(rec, *rec.raw_parts, velocity)
    return records, frames, skipped, problem, bool(legacy)


def _parts(rec: _Record, pieces: np.ndarray, share: list[float],
           velocity: bool) -> list[tuple[float, float, np.ndarray | None, np.ndarray]]:
    """The record's span cut where it crosses chunk steps: (start, end, executed, policy's) of each part (rows).

    Unchanged by the robot, the parts are the policy's own; otherwise (a clamp) each part takes its share of
    the difference, so the parts make up exactly what was executed.
    """
    weights = np.asarray(share, np.float64)
    values = pieces.astype(np.float64)
    # the tick's value the parts make up: increments add up, mean velocities average by share
    total = (weights[:, None] * values).sum(0) if velocity else values.sum(0)
    out = []
    x, length = rec.a, rec.b - rec.a
    for j, w in enumerate(weights):
        y = rec.b if j == len(weights) - 1 else x + w * length
        pol = values[j]
        ex: np.ndarray | None
        if rec.cmd is None:
            ex = None
        else:
            # the policy's part, corrected by the part's share of what the robot executed differently (a clamp):
            # the parts then make up exactly what was executed, and are the policy's own when nothing changed
            diff = rec.cmd.astype(np.float64) - total
            ex = pol + (diff if velocity else diff * w)
        out.append((x, y, ex, pol))
        x = y
    return out


def _end_at_next(records: list[_Record]) -> None:
    """End each record's span where the next record's begins, at the latest: the next tick replaced its command.

    A tick on the clock without a fixed control period spans the measured period, an estimate: when the next
    tick came sooner (the estimate still high after a stall), the span overlapped it, and a row that only that
    overlap reached counted as executed (repeating the command) though the tick in effect there held.
    """
    for r, nxt in zip(records, records[1:], strict=False):
        if r.a < nxt.a < r.b:
            r.b = nxt.a


def _velocity_spans(records: list[_Record], fps: float) -> None:
    """Velocity spaces: span each record from its robot time to the next record's (the last: its own length).

    A velocity command is in effect from its publication to the next one: a rate controller keeps applying it.
    """
    for j, r in enumerate(records):
        length = r.b - r.a
        r.a = r.t * fps
        r.b = records[j + 1].t * fps if j + 1 < len(records) else r.a + length
        if j + 1 < len(records):
            r.b = max(r.a, r.b)


def _legacy_spans(records: list[_Record], fps: float) -> None:
    """Give records without spans the cells of their times: row ``round((t - t0) * fps)``, one row wide."""
    t0 = next((r.a for r in records if r.fresh), None)
    if t0 is None:
        return
    for j, r in enumerate(records):
        cell = math.floor((r.a - t0) * fps + 0.5)
        nxt = records[j + 1].a if j + 1 < len(records) else None
        r.share = 1.0 if nxt is None else max(0.0, nxt - r.a) * fps
        r.a, r.b, r.grid = float(cell), float(cell + 1), cell


def build_rows(episode: CapturedEpisode, fps: float, space: ActionSpace, state_dim: int, action_dim: int,
               camera_keys: list[str]) -> EpisodeRows:
    """Map the episode's records to rows at ``fps`` (Hz; see the module docstring); streams the records once.

    :raises CaptureError: when the episode's record file is unreadable or corrupt.
    """
    contract = episode.contract
    dt = contract.dt if contract is not None and contract.dt > 0 else 1.0 / fps
    records, frames, skipped, problem, legacy = _read(episode, state_dim, action_dim, camera_keys, fps, fps * dt)
    if legacy:
        _legacy_spans(records, fps)
    first = next((j for j, r in enumerate(records) if r.fresh), None)
    empty = EpisodeRows(np.zeros((0, state_dim), np.float32), np.zeros((0, action_dim), np.float32),
                        np.zeros((0, action_dim), np.float32), np.zeros(0, bool), np.zeros(0, bool),
                        {k: np.zeros(0, np.int64) for k in camera_keys}, skipped, problem)
    if first is None:
        return empty
    budget = row_budget(fps, len(records))
    rows, cut = _reduce(records, first, space, action_dim, legacy, budget)
    n = len(rows['held'])
    stopped = (f'stopped at {budget} rows: the most the episode\'s {len(records)} records can make at {fps:g} fps '
               f'(its bounded duration)') if cut else ''
    while n and rows['held'][n - 1]:
        n -= 1
    frame_ticks = {}
    for key in camera_keys:
        seen = frames[key]
        arr = np.full(n, -1, np.int64)
        q = 0
        latest = -1
        for k, j in enumerate(rows['record'][:n]):
            while q < len(seen) and seen[q][0] <= j:
                latest = seen[q][1]
                q += 1
            arr[k] = latest
        if seen and (arr < 0).any():
            arr[arr < 0] = seen[0][1]     # rows before the camera's first frame show that frame
        frame_ticks[key] = arr
    return EpisodeRows(
        state=np.array(rows['state'][:n], np.float32).reshape(n, state_dim),
        action=np.array(rows['action'][:n], np.float32).reshape(n, action_dim),
        policy_action=np.array(rows['policy'][:n], np.float32).reshape(n, action_dim),
        clamped=np.array(rows['clamped'][:n], bool), held=np.array(rows['held'][:n], bool),
        frame_ticks=frame_ticks, skipped_frames=skipped, first_problem=problem, stopped=stopped)


def _reduce(records: list[_Record], first: int, space: ActionSpace, action_dim: int, legacy: bool,
            budget: int = MAX_ROWS) -> tuple[dict, bool]:
    """The rows' numbers, from the first executed record to the end of the last record's span.

    At most ``budget`` rows; the flag is True when the records went on past them (the rows stop there).
    """
    mask = position_mask(space, action_dim)      # channels sampled as targets; the others are summed/averaged
    velocity = space is ActionSpace.JOINT_VELOCITY
    n_rec = len(records)
    prev_fresh = [-1] * n_rec                    # the latest record at or before q that executed
    latest = -1
    for q, r in enumerate(records):
        if r.fresh:
            latest = q
        prev_fresh[q] = latest
    u0 = records[first].a
    end = max(r.b for r in records[first:])
    out: dict[str, list] = {k: [] for k in ('state', 'action', 'policy', 'clamped', 'held', 'record')}
    cut = False
    scan, j_latest, lo, k = first, first, first, 0
    while True:
        p = u0 + k
        if p >= end - SPAN_SLACK:
            break
        if k >= budget:
            cut = True
            break
        j_cell = -1
        while scan < n_rec and records[scan].a <= p + SPAN_SLACK:
            if legacy and j_cell < 0 and records[scan].a == p:
                j_cell = scan                    # legacy: the first tick of the row's cell
            j_latest = scan
            scan += 1
        # the record in effect at p: the latest starting at or before it (legacy: the first of its cell)
        j = j_cell if j_cell >= 0 else j_latest
        rec = records[j]
        in_gap = p >= rec.b - SPAN_SLACK          # no record covers p: deadlines no tick served (a stall)
        last = records[prev_fresh[j]]
        while lo < n_rec and records[lo].b <= p + SPAN_SLACK:
            lo += 1
        action = np.zeros(action_dim, np.float64)
        policy = np.zeros(action_dim, np.float64)
        fresh_any = clamped_any = False
        q = lo
        while q < n_rec and records[q].a < p + 1 - SPAN_SLACK:
            r = records[q]
            q += 1
            if legacy:
                if r.a != p:
                    continue
                w = r.share if velocity else 1.0
            elif r.parts is not None:
                hit = False
                for x, y, ex, pol in r.parts:
                    overlap = min(y, p + 1) - max(x, p)
                    if overlap <= SPAN_SLACK:
                        continue
                    hit = True
                    w = overlap if velocity else overlap / (y - x)
                    if r.fresh and ex is not None:
                        action += w * ex
                    if r.fresh or r.cmd is None:
                        policy += w * pol
                if hit:
                    clamped_any |= r.clamped
                    fresh_any |= r.fresh
                continue
            else:
                overlap = min(r.b, p + 1) - max(r.a, p)
                if overlap <= SPAN_SLACK:
                    continue
                w = overlap if velocity else overlap / (r.b - r.a)
            clamped_any |= r.clamped
            if r.fresh and r.cmd is not None:      # fresh: a command that was not a hold
                fresh_any = True
                action += w * r.cmd
            if r.pol is not None and (r.fresh or r.cmd is None):   # a dry or refused tick keeps the policy's
                policy += w * r.pol
        # the target in effect (absolute spaces, position channels): the record's own when it executed, else
        # the last executed one (a hold repeats it); the policy's: the record's own when it acted
        own = rec.fresh and not in_gap
        target = np.asarray(rec.cmd if own else last.cmd, np.float64)
        acted = not in_gap and rec.pol is not None and (rec.fresh or rec.cmd is None)
        policy_target = np.asarray(rec.pol if acted else target, np.float64)
        if space.is_absolute:
            # held: nothing fresh was commanded within the row's span (legacy: its cell's first tick held)
            held, a_row, p_row = (not own) if legacy else not fresh_any, target, policy_target
            clamped = clamped_any if legacy else (rec.clamped and not in_gap)
        else:
            held, a_row, p_row = not fresh_any, action, policy
            a_row[mask] = target[mask]
            p_row[mask] = policy_target[mask]
            clamped = clamped_any
        out['state'].append(rec.state)
        out['action'].append(a_row.astype(np.float32))
        out['policy'].append(p_row.astype(np.float32))
        out['clamped'].append(bool(clamped))
        out['held'].append(bool(held))
        out['record'].append(j)
        k += 1
    return out, cut


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
    for i, frame in enumerate(telemetry_frames(episode)):
        if target is None:
            return
        if i == target:
            image = next((im for im in frame.images if im.key == key), None)
            if image is not None:
                yield image, repeats[i]
            target = next(want, None)


