"""The worker's logs: text or JSON lines with UTC timestamps, a level, episode lines, rate-limited warnings.

``seq serve --log-format json|text --log-level LEVEL`` calls :func:`configure`: one handler on the root
logger, writing to stderr (stdout carries the lines ``seq fleet`` reads ports from).

- ``text``: ``2026-12-04T01:02:03.456Z INFO sequence_ai_ros.worker.runtime: message key=value ...``
- ``json``: one object per line: ``ts`` (ISO 8601, UTC, ms), ``level``, ``logger``, ``message``, the
  record's fields (below) and ``exc`` (a traceback, when there is one).

Fields: a record's ``extra={'fields': {...}}`` (see :func:`episode_fields`) become keys of the JSON object, and
``key=value`` pairs after a text message. Every episode logs one line when it starts and one when it ends
(:func:`log_episode`), each with ``episode_id``, ``client_id``, ``deployment`` and ``version``.

Warnings and errors go through :class:`RateLimitFilter`: the same message (its logger, level and format string,
whatever its arguments) is written at most once per second; the next one written says how many were left
out. Nothing here imports gRPC.
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
#: At most one line per distinct warning (logger, level, format string) per this many seconds.
WARNING_INTERVAL_S = 1.0
#: Distinct warnings the filter remembers at once (the oldest is forgotten first).
MAX_KEYS = 1024


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


class RateLimitFilter(logging.Filter):
    """Let each distinct warning (logger, level, format string) through at most once per ``interval_s``.

    Records below WARNING always pass. A record let through after others were held back has
    ``(N more like this in the last S s)`` appended to its message. Thread-safe; remembers at most
    :data:`MAX_KEYS` distinct warnings.

    :param interval_s: seconds between two lines of one warning (s).
    :param clock: a monotonic clock (s), for tests.
    """

    def __init__(self, interval_s: float = WARNING_INTERVAL_S, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.interval_s = interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._seen: OrderedDict[tuple[str, int, str], tuple[float, int]] = OrderedDict()  # -> (last written, held)
        #: records held back since start (all warnings together)
        self.suppressed = 0

    def filter(self, record: logging.LogRecord) -> bool:  # noqa: D102 - logging.Filter's
        if record.levelno < logging.WARNING:
            return True
        key = (record.name, record.levelno, str(record.msg))
        now = self._clock()
        with self._lock:
            last, held = self._seen.get(key, (None, 0))
            if last is not None and now - last < self.interval_s:
                self._seen[key] = (last, held + 1)
                self.suppressed += 1
                return False
            self._seen[key] = (now, 0)
            self._seen.move_to_end(key)
            while len(self._seen) > MAX_KEYS:
                self._seen.popitem(last=False)
        if held and last is not None:     # held counts records since a written one (at ``last``)
            record.msg = f'{record.msg} ({held} more like this in the last {now - last:.1f} s)'
        return True


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
    handler.addFilter(RateLimitFilter())
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
