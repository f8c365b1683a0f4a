"""Who holds a capture claim, and whether that holder is still alive, across hosts and containers.

Replicas may share one store: processes on one host, containers sharing a volume (each its own pid
namespace, usually its own hostname), or hosts sharing a network filesystem. A claim
(``staging/.claim-<dir>``, see :meth:`~sequence_ai_ros.capture.store.CaptureStore._claim`) names its
holder by host name, boot id (``/proc/sys/kernel/random/boot_id``), pid namespace
(``/proc/self/ns/pid``), pid and the process's start time (``/proc/<pid>/stat`` field 22), as JSON.

A holder is judged alive as follows:

- same host, boot and pid namespace: its pid exists and started at the recorded time (a pid reused by
  another process after the holder died does not keep the claim);
- same host, another boot: dead (the machine restarted);
- another host or pid namespace (a pid means nothing here): alive while the holder keeps refreshing the
  claim (its modification time, touched at least every :data:`REFRESH_S` while the episode is written),
  dead once it is older than :data:`STALE_S`. So a container's live claim is never taken for dead by
  another container, and a dead one's is taken over after :data:`STALE_S`.

A claim written by an older version holds only a pid: it is alive while that pid exists and the claim
is fresher than :data:`STALE_S`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import socket
import time
from pathlib import Path

#: A holder refreshes its claim's modification time at least this often (s) while it writes the episode.
REFRESH_S = 30.0
#: A claim of another host or pid namespace not refreshed for this long (s) is taken for dead.
STALE_S = 600.0


@dataclasses.dataclass(frozen=True)
class Holder:
    """The process that holds a claim. Empty strings (and start None) when unknown (an old claim)."""

    host: str
    boot_id: str
    pid_ns: str
    pid: int
    start: int | None

    def to_json(self) -> str:
        """The claim file's content."""
        return json.dumps(dataclasses.asdict(self), sort_keys=True)


def _read(path: str) -> str:
    try:
        with open(path, encoding='ascii') as f:
            return f.read().strip()
    except OSError:
        return ''


@functools.lru_cache(maxsize=1)
def _machine() -> tuple[str, str, str]:
    try:
        pid_ns = os.readlink('/proc/self/ns/pid')
    except OSError:
        pid_ns = ''
    return socket.gethostname(), _read('/proc/sys/kernel/random/boot_id'), pid_ns


def start_time(pid: int) -> int | None:
    """Return the start time of process ``pid`` (clock ticks since boot), None when it does not exist."""
    stat = _read(f'/proc/{pid}/stat')
    if not stat:
        return None
    try:
        return int(stat.rsplit(')', 1)[1].split()[19])
    except (IndexError, ValueError):
        return None


def this_process() -> Holder:
    """The :class:`Holder` of this process."""
    host, boot_id, pid_ns = _machine()
    pid = os.getpid()
    return Holder(host, boot_id, pid_ns, pid, start_time(pid))


def read_holder(path: Path) -> Holder | None:
    """Return the holder written in a claim file, None when it is unreadable or empty (being written)."""
    try:
        text = path.read_text(encoding='utf-8').strip()
    except OSError:
        return None
    if not text:
        return None
    if text.isdigit():   # an older version's claim: a pid alone
        return Holder('', '', '', int(text), None)
    try:
        d = json.loads(text)
        return Holder(str(d['host']), str(d['boot_id']), str(d['pid_ns']), int(d['pid']),
                      None if d.get('start') is None else int(d['start']))
    except (ValueError, KeyError, TypeError):
        return None


def pid_alive(pid: int) -> bool:
    """Return True when a process with this pid exists in this pid namespace."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def is_mine(holder: Holder) -> bool:
    """True when ``holder`` is this very process."""
    return holder == this_process()


def alive(holder: Holder, path: Path, now: float | None = None) -> bool:
    """Return True when the claim at ``path`` held by ``holder`` must be respected (see the module docstring)."""
    me = this_process()
    fresh = _fresh(path, now)
    if not holder.host:   # an old claim (pid alone)
        return fresh and (holder.pid == me.pid or pid_alive(holder.pid))
    if holder.host == me.host and holder.boot_id and holder.boot_id != me.boot_id:
        return False   # this machine restarted since
    if (holder.host, holder.boot_id, holder.pid_ns) != (me.host, me.boot_id, me.pid_ns):
        return fresh   # a pid of another host or namespace means nothing here: its refreshes tell
    if holder.pid == me.pid:
        return holder.start is None or holder.start == me.start
    started = start_time(holder.pid)
    if started is None:
        return pid_alive(holder.pid) and holder.start is None
    return holder.start is None or started == holder.start


def _fresh(path: Path, now: float | None) -> bool:
    try:
        age = (time.time() if now is None else now) - path.stat().st_mtime
    except OSError:
        return False
    return age < STALE_S
