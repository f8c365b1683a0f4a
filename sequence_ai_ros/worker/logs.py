"""The worker's logs: text or JSON lines with UTC timestamps, a level, episode lines, rate-limited warnings.

``seq serve --log-format json|text --log-level LEVEL`` calls :func:`configure`: one handler on the root
logger, writing to stderr (stdout carries the lines ``seq fleet`` reads ports from).

- ``text``: ``2026-12-04T01:02:03.456Z INFO sequence_ai_ros.worker.runtime: message key=value ...``
- ``json``: one object per line: ``ts`` (ISO 8601, UTC, ms), ``level``, ``logger``, ``message``, the
  record's fields (below) and ``exc`` (a traceback, when there is one).

Fields: a record's ``extra={'fields': {...}}`` (see :func:`episode_fields`) become keys of the JSON object, and
``key=value`` pairs after a text message. Every episode logs one line when it starts and one when it ends
(:func:`log_episode`), each with ``episode_id``, ``client_id``, ``deployment`` and ``version``.

Warnings and errors go through :class:`RateLimitFilter`: the same message (its logger, level, format string and
first argument, e.g. the deployment, whatever its other arguments) is written at most once per second; the next
one written says how many were left out, and when none comes, the last one left out is written a second later
with that count (a ``seq-log-flush`` timer, alive only while some are held). Nothing here imports gRPC.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, TextIO

#: ``--log-format`` choices, the first the default.
FORMATS = ('text', 'json')
#: ``--log-level`` choices (logging's level names, lower case).
LEVELS = ('debug', 'info', 'warning', 'error')
DEFAULT_LEVEL = 'info'
#: At most one line per distinct warning (logger, level, format string, first argument) per this many seconds.
WARNING_INTERVAL_S = 1.0
#: Distinct warnings the filter remembers at once (the oldest is forgotten first).
MAX_KEYS = 1024
#: Characters of a warning's first argument (its first line) that tell it from another.
KEY_ARG_CHARS = 200


def _utc(created: float) -> str:
    """``created`` (epoch s) as ISO 8601 in UTC with milliseconds and a ``Z``."""
    return time.strftime('%Y-%m-%dT%H:%M:%S', time.gmtime(created)) + f'.{int(created % 1 * 1000):03d}Z'


def _fields(record: logging.LogRecord) -> dict[str, Any]:
    fields = getattr(record, 'fields', None)
    return dict(fields) if isinstance(fields, dict) else {}


class TextFormatter(logging.Formatter):
    """``<UTC time> LEVEL logger: message key=value ...`` (a traceback follows on its own lines)."""

    def format(self, record: logging.LogRecord) -> str:  # noqa: D102 - logging.Formatter's
        line = f'{_utc(record.created)} {record.levelname} {record.name}: {record.getMessage()}'
        fields = _fields(record)
        if fields:
            line += ' ' + ' '.join(f'{k}={json.dumps(v) if isinstance(v, str) and (" " in v or not v) else v}'
                                   for k, v in fields.items())
        if record.exc_info:
            line += '\n' + self.formatException(record.exc_info)
        return line


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ``ts``, ``level``, ``logger``, ``message``, its fields, ``exc``."""

    def format(self, record: logging.LogRecord) -> str:  # noqa: D102 - logging.Formatter's
        out: dict[str, Any] = {'ts': _utc(record.created), 'level': record.levelname, 'logger': record.name,
                               'message': record.getMessage()}
        for key, value in _fields(record).items():
            out.setdefault(key, value)
        if record.exc_info:
            out['exc'] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def warning_key(record: logging.LogRecord) -> tuple[str, int, str, str]:
    """What makes two warnings "the same": logger, level, format string and the first argument's first line.

    The first argument tells one deployment's warning from another's (``'policy %s raised ...'``), and the
    text of a bare ``'%s'``; the others (episode, request) do not count. At most :data:`KEY_ARG_CHARS` of it.
    """
    args = record.args
    first: Any = args[0] if isinstance(args, tuple) and args else ''
    try:
        head = str(first).split('\n', 1)[0][:KEY_ARG_CHARS]
    except Exception:     # an argument whose str() fails: logging reports it when it formats the record
        head = type(first).__name__
    return record.name, record.levelno, str(record.msg), head


class _Seen:
    """One distinct warning: when it was last written, how many were held since, the last one held."""

    __slots__ = ('held', 'last', 'record')

    def __init__(self, last: float) -> None:
        self.last = last
        self.held = 0
        self.record: logging.LogRecord | None = None


class RateLimitFilter(logging.Filter):
    """Let each distinct warning (:func:`warning_key`) through at most once per ``interval_s``.

    Records below WARNING always pass. A record let through after others were held back has
    ``(N more like this in the last S s)`` appended to its message. When no record of a warning comes for
    ``interval_s`` after some were held (a burst ended), :meth:`flush` writes the last one held, with the count
    of the others, through ``emit``; with ``emit``, a ``seq-log-flush`` timer calls it ``interval_s`` after a
    record was held (one timer at a time, none while nothing is held). Thread-safe; remembers at most
    :data:`MAX_KEYS` distinct warnings, and one record of each.

    :param interval_s: seconds between two lines of one warning (s).
    :param clock: a monotonic clock (s), for tests.
    :param emit: writes a record :meth:`flush` releases (``handler.handle``); None: call :meth:`flush` yourself.
    """

    def __init__(self, interval_s: float = WARNING_INTERVAL_S, clock: Callable[[], float] = time.monotonic,
                 emit: Callable[[logging.LogRecord], Any] | None = None) -> None:
        super().__init__()
        self.interval_s = interval_s
        self._clock = clock
        self._emit = emit
        self._lock = threading.Lock()
        self._seen: OrderedDict[tuple[str, int, str, str], _Seen] = OrderedDict()
        self._timer: threading.Timer | None = None
        #: records held back since start (all warnings together)
        self.suppressed = 0

    def filter(self, record: logging.LogRecord) -> bool:  # noqa: D102 - logging.Filter's
        if record.levelno < logging.WARNING or getattr(record, 'seq_released', False):
            return True
        key = warning_key(record)
        now = self._clock()
        with self._lock:
            seen = self._seen.get(key)
            if seen is not None and now - seen.last < self.interval_s:
                seen.held += 1
                seen.record = record
                self.suppressed += 1
                self._arm()
                return False
            held, last = (seen.held, seen.last) if seen is not None else (0, now)
            self._seen[key] = _Seen(now)
            self._seen.move_to_end(key)
            while len(self._seen) > MAX_KEYS:
                self._seen.popitem(last=False)
        if held:     # held counts records since a written one (at ``last``)
            record.msg = f'{record.msg} ({held} more like this in the last {now - last:.1f} s)'
        return True

    def flush(self) -> list[logging.LogRecord]:
        """Release the held count of every burst that ended: the last record held, with how many others were.

        A burst ended when nothing of it was written for ``interval_s``. Each released record is passed to
        ``emit`` (marked so that this filter lets it through) and returned, oldest warning first.
        """
        now = self._clock()
        out = []
        with self._lock:
            for seen in self._seen.values():
                if not seen.held or seen.record is None or now - seen.last < self.interval_s:
                    continue
                record = logging.makeLogRecord(seen.record.__dict__)
                others = seen.held - 1
                if others:
                    try:
                        text = record.getMessage()
                    except Exception:    # arguments that do not fit the format: logging says so when it writes
                        text = str(record.msg)
                    record.msg = f'{text} ({others} more like this in the last {now - seen.last:.1f} s)'
                    record.args = None
                record.seq_released = True
                seen.last, seen.held, seen.record = now, 0, None
                out.append(record)
        if self._emit is not None:
            for record in out:
                self._emit(record)
        return out

    def _arm(self) -> None:
        """Start the flush timer if none is pending (with the lock held; only with ``emit``)."""
        if self._emit is None or self._timer is not None:
            return
        self._timer = threading.Timer(self.interval_s, self._tick)
        self._timer.name = 'seq-log-flush'
        self._timer.daemon = True
        self._timer.start()

    def _tick(self) -> None:
        with self._lock:
            self._timer = None
        self.flush()
        with self._lock:
            if any(seen.held for seen in self._seen.values()):
                self._arm()

    def close(self) -> None:
        """Cancel a pending flush timer (the held counts it would have written are dropped)."""
        with self._lock:
            timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()


def configure(fmt: str = FORMATS[0], level: str = DEFAULT_LEVEL, stream: TextIO | None = None) -> logging.Handler:
    """Send every log record to ``stream`` (default stderr) as ``fmt``, from ``level`` up; return the handler.

    Replaces the root logger's handlers (a process serves with one log format).

    :raises ValueError: for a format not in :data:`FORMATS` or a level not in :data:`LEVELS`.
    """
    if fmt not in FORMATS:
        raise ValueError(f'log format must be one of {", ".join(FORMATS)}, got {fmt!r}')
    if level.lower() not in LEVELS:
        raise ValueError(f'log level must be one of {", ".join(LEVELS)}, got {level!r}')
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == 'json' else TextFormatter())
    handler.addFilter(RateLimitFilter(emit=handler.handle))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    return handler


def add_log_options(parser: Any) -> None:
    """Add ``--log-format`` and ``--log-level`` to an argparse parser."""
    parser.add_argument('--log-format', choices=FORMATS, default=FORMATS[0],
                        help=f'log lines as text or JSON objects, UTC timestamps, on stderr (default {FORMATS[0]})')
    parser.add_argument('--log-level', choices=LEVELS, default=DEFAULT_LEVEL,
                        help=f'least severe level logged (default {DEFAULT_LEVEL})')


def episode_fields(episode_id: str, client_id: str, deployment: str, version: int, **more: Any) -> dict[str, Any]:
    """The fields every episode line carries (one list, for the start and the end line)."""
    return {'episode_id': episode_id, 'client_id': client_id, 'deployment': deployment, 'version': version, **more}


def log_episode(logger: logging.Logger, event: str, fields: dict[str, Any], message: str = '') -> None:
    """Log the ``event`` (``started`` / ``ended``) line of an episode with its :func:`episode_fields`."""
    text = (f'episode {fields["episode_id"]} {event} on {fields["deployment"]} v{fields["version"]} '
            f'(client {fields["client_id"] or "?"})')
    logger.info(text + (f': {message}' if message else ''), extra={'fields': {'event': f'episode_{event}',
                                                                              **fields}})
