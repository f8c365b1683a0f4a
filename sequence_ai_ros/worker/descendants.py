"""Every process a deployment process started, detached or not, ends with it (Linux).

A policy may start programs that leave the deployment process's group and session (``Popen(...,
start_new_session=True)``, a double fork with ``setsid``): killing the group misses them, and once their parent
exits they are orphans (parent pid 1) that outlive the deployment, the worker, and hold whatever the deployment
process's stdout was (``seq deploy ... | tail -1`` then never returns). Two nets catch them:

- the deployment process is a *child subreaper* (:func:`become_subreaper`, ``prctl(PR_SET_CHILD_SUBREAPER)``):
  an orphan among its descendants is reparented to it, not to pid 1, so that :func:`end_descendants` finds every
  one of them by walking parent pids in ``/proc``, kills them and reaps them, whenever the process ends (the
  worker closed it, the worker died, a memory limit);
- each deployment process gets a mark in its environment (:data:`MARK_ENV`, a fresh token), which everything it
  starts inherits: when the deployment process itself was killed (``kill -9``, the kernel's out-of-memory killer),
  so that its orphans went to pid 1, the worker kills what still carries the mark (:func:`end_marked`). A
  program started with an environment of its own (``env={}``) escapes this second net only.

Nothing here imports gRPC; both functions read ``/proc`` and do nothing where there is none.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import time
from collections.abc import Callable

LOG = logging.getLogger(__name__)
#: The environment variable whose value marks every process descending from one deployment process.
MARK_ENV = 'SEQ_DEPLOYMENT_MARK'
#: ``prctl`` option making the caller the reaper of its descendants' orphans (Linux >= 3.4).
PR_SET_CHILD_SUBREAPER = 36
#: Rounds of :func:`end_descendants` (each kills what it finds, then reaps); a fork bomb racing it gets this many.
MAX_ROUNDS = 50


def become_subreaper() -> bool:
    """Make this process the reaper of its descendants' orphans; False where the kernel cannot (not Linux)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _parents() -> dict[int, tuple[int, int]]:
    """``{pid: (parent pid, process group)}`` of every process in ``/proc`` (threads are not listed there)."""
    out: dict[int, tuple[int, int]] = {}
    try:
        entries = os.listdir('/proc')
    except OSError:
        return out
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f'/proc/{entry}/stat', 'rb') as stat:
                fields = stat.read()
            rest = fields[fields.rindex(b')') + 2:].split()      # state, ppid, pgrp, ...
            out[int(entry)] = (int(rest[1]), int(rest[2]))
        except (OSError, ValueError, IndexError):      # gone meanwhile
            pass
    return out


def descendants(pid: int, group: bool = False) -> list[int]:
    """The pids descending from ``pid`` (children, theirs, ...), as ``/proc`` lists them now.

    :param group: also the other members of the process group ``pid`` leads.
    """
    children: dict[int, list[int]] = {}
    table = _parents()
    for child, (parent, _) in table.items():
        children.setdefault(parent, []).append(child)
    out: list[int] = []
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), ()):
            if child != pid:
                out.append(child)
                todo.append(child)
    if group:
        seen = set(out)
        out += [p for p, (_, pgrp) in table.items() if pgrp == pid and p != pid and p not in seen]
    return out


def _reap() -> None:
    """Collect every exited child of this process (orphans reparented here included)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def end_descendants() -> int:
    """SIGKILL every process descending from this one, and this one's group; reap them; return how many were killed.

    Call it in a subreaper (:func:`become_subreaper`) as it ends: orphans among the descendants are its children
    then, so none is missed. Repeats until none is left (a process forking meanwhile), at most
    :data:`MAX_ROUNDS` rounds.
    """
    me = os.getpid()
    # a worker's deployment process leads its group
    killed = _kill_rounds(lambda: descendants(me, group=os.getpgid(0) == me), MAX_ROUNDS, 0.005, reap=True)
    _reap()
    return killed


def _kill_rounds(find: Callable[[], list[int]], rounds: int, pause_s: float, reap: bool = False) -> int:
    """SIGKILL what ``find`` lists, up to ``rounds`` times until it lists nothing; return how many were killed."""
    killed = 0
    for _ in range(rounds):
        pids = find()
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except OSError:         # gone meanwhile
                pass
        time.sleep(pause_s)
        if reap:
            _reap()
    return killed


def marked(mark: str) -> list[int]:
    """The pids whose environment carries ``MARK_ENV=mark`` (this process's own left out)."""
    needle = b'\0' + f'{MARK_ENV}={mark}'.encode() + b'\0'
    me = os.getpid()
    out: list[int] = []
    try:
        entries = os.listdir('/proc')
    except OSError:
        return out
    for entry in entries:
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            with open(f'/proc/{entry}/environ', 'rb') as env:
                if needle in b'\0' + env.read() + b'\0':
                    out.append(int(entry))
        except OSError:             # gone, or not ours to read
            pass
    return out


def end_marked(mark: str) -> int:
    """SIGKILL every process carrying ``mark`` (:func:`marked`), a few rounds; return how many were killed.

    For the worker, once a deployment process is gone: what it left (its orphans, reparented to pid 1 when it was
    killed before it could end them) still carries its mark.
    """
    killed = _kill_rounds(lambda: marked(mark), 5, 0.01)
    if killed:
        LOG.info('killed %d process(es) left by a deployment process (mark %s)', killed, mark)
    return killed
