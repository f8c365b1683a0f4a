"""The schema of limits on every value a robot sends: one definition, checked once at the worker's boundary.

What a robot chooses ends up in paths (camera keys name video files), SQLite, JSON, metric labels and
terminals (``seq policy stats``). Each field therefore has one limit here, and the worker checks each
message against it as it arrives (:func:`check_request`, :func:`check_handshake`, :func:`check_label`;
telemetry frames with :func:`check_frame`), before anything else reads it:

=====================================  ===================================================================
names (camera keys)                    :data:`NAME_PATTERN`: a letter or digit, then letters, digits, ``._-``
                                       (at most :data:`MAX_NAME` characters): safe as a file name
state names, encodings, params keys    printable, at most :data:`MAX_NAME` characters
episode ids, client ids                printable, at most :data:`MAX_ID` characters
instructions, label notes, params      at most :data:`MAX_TEXT` characters, no control characters but
                                       tab and newline
numbers                                finite and within their range (robot time, the step span, the
                                       episode's figures and counts, :data:`MAX_END_COUNT`)
a record's time                        at most :data:`MAX_EPISODE_S` since the episode's first record;
                                       stalls at most :data:`MAX_STALL_S` per episode (rows per record)
EpisodeEnd.reason                      printable, at most :data:`MAX_REASON` characters; one of
                                       :data:`REASONS` is a metric label as it is, any other is kept as
                                       free text (stored, shown escaped) and labelled ``other``
hold_reason                            '' or one of :data:`HOLD_REASONS`
=====================================  ===================================================================

Printable is Python's :meth:`str.isprintable`: no control character, and none of Unicode's line or paragraph
separators, format characters (bidirectional overrides, zero-width characters) or spaces other than ' ', so an
id can neither break a log line into two nor make a terminal show it in another order.

A violation raises :class:`LimitViolation` (a :class:`~sequence_ai_ros.exceptions.ContractViolation`,
CONTRACT_VIOLATION on the wire) naming the field and its limit; :data:`FIELDS` is the bounded set of field
names a violation can carry (a metric label).

:func:`printable` makes any stored string safe for a terminal (control characters escaped), for data
written before these limits existed.
"""

from __future__ import annotations

import math
import re
from typing import Any

from sequence_ai_ros.exceptions import ContractViolation

#: A name that is safe as one path component: starts with a letter or digit (never ``.`` or ``/``).
NAME_PATTERN = re.compile(r'[A-Za-z0-9][A-Za-z0-9._-]*')
#: Longest name (camera key, deployment, state name), characters.
MAX_NAME = 64
#: Longest id (episode id, client id), characters.
MAX_ID = 256
#: Longest free text (instruction, label notes, a params value), characters.
MAX_TEXT = 4096
#: Longest EpisodeEnd reason, characters.
MAX_REASON = 64
#: Most images in one observation or telemetry frame; most history frames; most params entries.
MAX_IMAGES = 32
MAX_HISTORY = 64
MAX_PARAMS = 64
#: Most state names one request may carry.
MAX_STATE_NAMES = 1024
#: Most telemetry frames in one Telemetry message.
MAX_FRAMES = 4096

#: Largest |robot_time_s| (s) a message may carry: a monotonic clock (~32 years); beyond is garbage.
MAX_ROBOT_TIME_S = 1e9
#: Longest control period one record may cover (s of the policy's time).
MAX_TICK_S = 10.0
#: Longest stall between two records (s): a larger leap is a bad record (the export fills a stall with rows).
MAX_GAP_S = 300.0
#: Longest episode a record may belong to (s), which bounds an export's rows: a record's ``step_end`` (in the
#: policy's time) and its robot time since the episode's first record, in every action space.
MAX_EPISODE_S = 7200.0
#: Most time (s) an episode's stalls may add in all: each record moves the episode's timeline on (its span's
#: end past the records before it, or its robot time past the previous record's: what a velocity export
#: spans), and what one record moves it past :data:`MAX_TICK_S` is a stall the export fills with held rows
#: (or the last velocity command). So a record adds at most ``MAX_TICK_S`` of rows of its own, and an episode
#: of N records at most ``N * MAX_TICK_S + MAX_STALL_S`` (within :data:`MAX_EPISODE_S`): 24 records 300 s
#: apart no longer make 2 h of held rows. One stall of up to :data:`MAX_GAP_S` still fits.
MAX_STALL_S = 300.0
#: Largest chunk-step position a record may carry (a decade at 1 kHz control against a 1 ms dt).
MAX_STEP = 1e12
#: Largest grid index a record may carry (within a float64's exact integers).
MAX_GRID_INDEX = 2 ** 53
#: Why a tick held instead of executing a fresh policy action ('' when it executed one):
#: ``waiting`` (no chunk yet, or the observation history is filling), ``underrun`` (the chunk buffer ran
#: dry), ``refused`` (the robot's own check refused the command: safety, an invalid observation),
#: ``dry_run`` (the command went to a dry-run topic, not the controller), ``ended`` (the episode had ended).
HOLD_REASONS = ('waiting', 'underrun', 'refused', 'dry_run', 'ended')
#: Largest latency (ms), seam jump and underrun time (s) an EpisodeEnd may report.
MAX_LATENCY_MS = 1e7
MAX_SEAM_JUMP = 1e6
MAX_UNDERRUN_S = MAX_EPISODE_S * 10
#: Most actions, chunks or underruns one EpisodeEnd may report: an episode's ticks at 1 kHz control for
#: :data:`MAX_EPISODE_S` (a larger count, such as 2**32-1, is refused and never reaches a counter).
MAX_END_COUNT = int(MAX_EPISODE_S * 1000)

#: The documented episode-end reasons: the robot's (EpisodeEnd.reason) and the worker's own.
REASONS = ('completed', 'until', 'timeout', 'interrupted', 'validate', 'error',
           'disconnect', 'idle_timeout', 'start_timeout', 'shutdown', 'drain_timeout', 'rollout', 'duplicate')
#: The metric label of any reason outside :data:`REASONS`.
OTHER_REASON = 'other'

#: The fields a violation can name (a bounded set: a metric label).
FIELDS = ('deployment', 'protocol_version', 'client_id', 'token', 'episode_id', 'instruction', 'request_id',
          'robot_time_s', 'observation_step', 'state_names', 'images', 'image.key', 'image.encoding', 'history',
          'params', 'frames', 'grid_index', 'step_span', 'hold_reason', 'reason', 'underrun_s', 'max_seam_jump',
          'latency_p95_ms', 'notes', 'episode_s', 'stall_s', 'actions', 'chunks', 'underruns')

_CONTROL_TEXT = re.compile(r'[\x00-\x08\x0b-\x1f\x7f-\x9f]')


class LimitViolation(ContractViolation):
    """A value from the wire outside its limit; ``field`` (one of :data:`FIELDS`) and ``limit`` name it."""

    def __init__(self, field: str, limit: str, got: str = '') -> None:
        self.field = field
        self.limit = limit
        super().__init__(f'{field}: {got + " " if got else ""}is outside the limit ({limit})')


def _shown(value: Any, n: int = 40) -> str:
    text = printable(value)
    return repr(text if len(text) <= n else f'{text[:n]}...') + (f' ({len(str(value))} chars)'
                                                                 if len(str(value)) > n else '')


def printable(text: Any) -> str:
    r"""Return ``str(text)`` with every character that is not printable escaped: safe for a terminal and a log line.

    ESC becomes ``\x1b``, a line separator ``\u2028`` (see :meth:`str.isprintable`).
    """
    shown = str(text)
    if shown.isprintable():
        return shown
    return ''.join(c if c.isprintable() else f'\\x{ord(c):02x}' if ord(c) < 0x100 else f'\\u{ord(c):04x}'
                   if ord(c) < 0x10000 else f'\\U{ord(c):08x}' for c in shown)


def check_name(value: str, field: str, limit: int = MAX_NAME, empty: bool = False) -> str:
    """Check a name that may become a path component (:data:`NAME_PATTERN`, at most ``limit`` chars)."""
    if (value == '' and empty) or (len(value) <= limit and NAME_PATTERN.fullmatch(value)):
        return value
    raise LimitViolation(field, f'a letter or digit, then letters, digits or ._-, at most {limit} characters',
                         _shown(value))


def check_id(value: str, field: str, limit: int = MAX_ID) -> str:
    """Check an id or short label: printable (:meth:`str.isprintable`), at most ``limit`` characters."""
    if len(value) > limit or not value.isprintable():
        raise LimitViolation(field, f'printable, at most {limit} characters', _shown(value))
    return value


def check_text(value: str, field: str, limit: int = MAX_TEXT) -> str:
    """Check free text: at most ``limit`` characters, no control characters but tab and newline."""
    if len(value) > limit or _CONTROL_TEXT.search(value):
        raise LimitViolation(field, f'at most {limit} characters, no control characters but tab and newline',
                             _shown(value))
    return value


def check_number(value: float, field: str, low: float, high: float) -> float:
    """Check a number: finite and ``low <= value <= high``."""
    if not (math.isfinite(value) and low <= value <= high):
        raise LimitViolation(field, f'finite, {low:g} <= x <= {high:g}', repr(value))
    return value


def check_count(n: int, field: str, limit: int) -> None:
    """Check how many items a repeated field holds."""
    if n > limit:
        raise LimitViolation(field, f'at most {limit} entries', f'{n} entries')


def reason_label(reason: str) -> str:
    """Return the metric label of an episode-end reason: itself when documented, else :data:`OTHER_REASON`."""
    return reason if reason in REASONS else OTHER_REASON


def _images(images: Any, field: str = 'images') -> None:
    check_count(len(images), field, MAX_IMAGES)
    for image in images:
        check_name(image.key, 'image.key')
        check_id(image.encoding, 'image.encoding', MAX_NAME)


def check_observation(req: Any) -> None:
    """Check an ObservationRequest's strings, counts and scalars (tensors and images are the contract's)."""
    check_id(req.episode_id, 'episode_id')
    check_text(req.instruction, 'instruction')
    check_number(req.robot_time_s, 'robot_time_s', -MAX_ROBOT_TIME_S, MAX_ROBOT_TIME_S)
    check_number(req.observation_step, 'observation_step', -MAX_STEP, MAX_STEP)
    names = req.state_names
    check_count(len(names), 'state_names', MAX_STATE_NAMES)
    # every request names its joints: checked together (the same as name by name), named alone when one fails
    if names and (max(map(len, names)) > MAX_NAME or not ''.join(names).isprintable()):
        for name in names:
            check_id(name, 'state_names', MAX_NAME)
    _images(req.images)
    check_count(len(req.history), 'history', MAX_HISTORY)
    for frame in req.history:
        check_number(frame.robot_time_s, 'robot_time_s', -MAX_ROBOT_TIME_S, MAX_ROBOT_TIME_S)
        _images(frame.images)
    check_count(len(req.params), 'params', MAX_PARAMS)
    for key, value in req.params.items():
        check_id(key, 'params', MAX_NAME)
        check_text(value, 'params', MAX_TEXT)


def check_frame(frame: Any) -> None:
    """Check one TelemetryFrame's own fields: robot time, the step span, grid index, hold reason, image keys.

    The checks against the episode's earlier records (order, gaps, pieces) are
    :class:`~sequence_ai_ros.capture.frame_check.FrameChecker`'s, with the limits defined here.
    """
    check_number(frame.robot_time_s, 'robot_time_s', -MAX_ROBOT_TIME_S, MAX_ROBOT_TIME_S)
    if frame.grid_index >= MAX_GRID_INDEX:
        raise LimitViolation('grid_index', 'a control deadline, < 2**53', str(frame.grid_index))
    a, b = frame.step_start, frame.step_end
    if not (math.isfinite(a) and math.isfinite(b) and abs(a) <= MAX_STEP and abs(b) <= MAX_STEP and b >= a):
        raise LimitViolation('step_span', f'finite, within {MAX_STEP:g}, end >= start', f'[{a!r}, {b!r})')
    if frame.hold_reason and frame.hold_reason not in HOLD_REASONS:
        raise LimitViolation('hold_reason', f"'' or one of {', '.join(HOLD_REASONS)}", _shown(frame.hold_reason))
    _images(frame.images)


def check_end(end: Any) -> list[LimitViolation]:
    """Check an EpisodeEnd; return its violations (the episode still ends, without the refused values)."""
    out = []
    for name, high in (('underrun_s', MAX_UNDERRUN_S), ('max_seam_jump', MAX_SEAM_JUMP),
                       ('latency_p95_ms', MAX_LATENCY_MS), ('actions', MAX_END_COUNT), ('chunks', MAX_END_COUNT),
                       ('underruns', MAX_END_COUNT)):
        try:
            check_number(getattr(end, name), name, 0.0, high)
        except LimitViolation as exc:
            out.append(exc)
    try:
        check_id(end.reason, 'reason', MAX_REASON)
    except LimitViolation as exc:
        out.append(exc)
    return out


def end_stats(end: Any) -> tuple[str, dict[str, Any], list[LimitViolation]]:
    """Return (reason, stats, violations) of an EpisodeEnd, every value within its limit.

    A refused number is left out of ``stats`` (a count over :data:`MAX_END_COUNT` moves no counter); a
    refused reason becomes ``error``.
    """
    bad = check_end(end)
    refused = {v.field for v in bad}
    stats: dict[str, Any] = {name: int(getattr(end, name)) for name in ('actions', 'chunks', 'underruns')
                             if name not in refused}
    for name in ('underrun_s', 'max_seam_jump', 'latency_p95_ms'):
        if name not in refused:
            stats[name] = float(getattr(end, name))
    reason = 'error' if 'reason' in refused else (end.reason or 'completed')
    return reason, stats, bad


def check_start(start: Any) -> None:
    """Check an EpisodeStart."""
    check_id(start.episode_id, 'episode_id')
    check_text(start.instruction, 'instruction')
    check_id(start.client_id, 'client_id')


def check_request(req: Any) -> None:
    """Check one EpisodeRequest at the boundary (Telemetry: its count; its frames by :func:`check_frame`).

    EpisodeEnd is checked by :func:`end_stats` (its episode ends whatever it holds).

    :raises LimitViolation: naming the field and its limit.
    """
    kind = req.WhichOneof('kind')
    if kind == 'observation':
        check_observation(req.observation)
    elif kind == 'start':
        check_start(req.start)
    elif kind == 'telemetry':
        check_count(len(req.telemetry.frames), 'frames', MAX_FRAMES)


def check_handshake(req: Any) -> None:
    """Check a HandshakeRequest (its deployment is looked up among the served ones: never a path)."""
    check_id(req.protocol_version, 'protocol_version', MAX_NAME)
    check_id(req.client_id, 'client_id')
    check_id(req.token, 'token', MAX_TEXT)


def check_label(req: Any) -> None:
    """Check a LabelRequest (its deployment is looked up among the served ones); it names an episode."""
    if not req.episode_id:
        raise LimitViolation('episode_id', 'not empty: the episode the label is for')
    check_id(req.episode_id, 'episode_id')
    check_text(req.notes, 'notes')


def json_safe(value: Any) -> Any:
    """Return ``value`` with every non-finite float replaced by None: strict JSON (no bare ``NaN``/``Infinity``).

    For what a store held before these limits existed; values checked here are finite already.
    """
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value
