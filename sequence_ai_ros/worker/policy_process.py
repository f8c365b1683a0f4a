"""The worker's side of a deployment process (``--isolation process``).

Each deployment's policy code (import, construct, ``load()``, ``infer``, ``infer_batch``, the episode hook)
runs in its own process, :mod:`sequence_ai_ros.worker.policy_host`, so that a crash, ``os._exit``, a
segfault or a hang in one policy fails only that deployment's robots; the worker restarts it
(:class:`~sequence_ai_ros.worker.runtime.DeploymentRuntime`) and every other deployment goes on.

- :func:`describe_policy_file`: import a policy file in a short-lived deployment process, under a deadline,
  and return a :class:`~sequence_ai_ros.policy.loader.PolicyDefinition` whose ``instantiate()`` starts the
  deployment process (:class:`RemotePolicy`) instead of constructing the class here.
- :func:`deploy_check`: ``seq deploy``'s import, fingerprint and dry run in a deployment process under one
  deadline (a busy loop or ``sleep`` at import cannot outlast it; ``os._exit(7)`` is named).
- :func:`open_host`: construct a definition's policy as the runtime's
  :class:`~sequence_ai_ros.worker.hosting.PolicyHost`: a :class:`RemotePolicy` for a remote definition, the
  in-worker :class:`~sequence_ai_ros.worker.hosting.InProcessHost` otherwise (:func:`runs_isolated` tells which).
- :class:`RemotePolicy`: the policy object as the runtime and scheduler see it. A call is made by the calling
  thread (:meth:`PolicyProcess.call`, one round trip, alone on the socket) or, for an inference, straight
  from the worker's event loop (:meth:`PolicyProcess.start`): up to :data:`~.policy_host.PIPELINE_DEPTH`
  inferences are then in flight at once, the loop writing the next while the process computes and reading
  the answers, in order, as they come; no hop through the inference thread, and no wait for the previous
  answer before the next request goes. The process runs them one at a time, in the order sent. An
  inference in flight whose episode ends before its turn is dropped there (:meth:`PolicyProcess.start`'s
  cancel). Arrays travel through shared memory (``memfd`` segments, reused once the policy no longer
  references a call's arrays), never pickled; the policy gets views of them
  (:mod:`~sequence_ai_ros.worker.policy_host`).

Every process the policy starts, detached or not, ends with its deployment process (a child subreaper; and when
the deployment process itself was killed, the worker kills what carries its mark:
:mod:`~sequence_ai_ros.worker.descendants`). Its stdout and stderr are pipes read into the worker's log, cut and
bounded per deployment process (:mod:`~sequence_ai_ros.worker.policy_output`). An optional memory limit
(``memory_limit_mb``, ``seq serve --deployment-memory-mb``) ends a process whose resident memory passes it:
its call raises :class:`MemoryLimitExceeded`, naming the limit, and the runtime restarts it.

Errors: a policy's exception comes back as :class:`RemoteError` (its text is the policy's own
``Type: message``); a process that dies or is killed raises :class:`PolicyProcessDied`, naming the
deployment, the step and the exit code or signal; every call in flight fails so. Its exit is noticed at once,
also while something the policy started still holds its end of the socket. A process whose socket carries
anything but the answer to its oldest call in flight (each answer echoes its call's sequence number) is
stopped, and the calls in flight raise :class:`PolicyProcessDied` saying so: an answer is never taken for
another call's.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import mmap
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sequence_ai_ros.exceptions import ContractViolation, DeploymentError, PolicyException
from sequence_ai_ros.policy.loader import PolicyDefinition
from sequence_ai_ros.worker import descendants
from sequence_ai_ros.worker import policy_host as wire
from sequence_ai_ros.worker.hosting import InProcessHost, PolicyHost
from sequence_ai_ros.worker.policy_output import OutputBudget, OutputRelay

LOG = logging.getLogger(__name__)
#: The isolation modes: ``process`` (each deployment in its own process) and ``none`` (in the worker).
ISOLATION_MODES = ('process', 'none')
#: Smallest size of a shared-memory segment (bytes); a larger call gets a segment of its own size.
SHM_START_BYTES = 1 << 20
#: Bound of a deployment process's interpreter start-up (s), before the policy's own deadlines start.
START_TIMEOUT_S = 60.0
#: Largest answer taken from a deployment process (bytes), four times the largest action chunk
#: (:data:`~sequence_ai_ros.protocol.messages.MAX_CHUNK_BYTES`); a frame claiming more is no answer.
MAX_REPLY_BYTES = 256 << 20
#: Longest wait (s) at close for the last lines of a deployment process's stdout and stderr.
OUTPUT_JOIN_S = 1.0
#: The send buffer asked for on the worker's end of a deployment process's socket (bytes); the kernel caps it at
#: ``net.core.wmem_max`` (doubled: 416 KB by default), and the pipeline's budget is sized from what it gave.
SOCKET_SEND_BUFFER_BYTES = 4 << 20
#: What the kernel may charge a write beyond its bytes (an ``sk_buff``, rounding), counted against the budget.
SEND_OVERHEAD_BYTES = 2048
#: Most array bytes of the calls in flight from the event loop at once (their shared memory): past it a call
#: waits in the deployment's queue until answers come (a pipeline of large frames stays within it).
PIPELINED_ARRAY_BYTES = 64 << 20
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])
#: A deployment process's start: this worker's copy of the package first on its path, then
#: :func:`~.policy_host.main`. ``python -m`` put the working directory first, so that a checkout there (another
#: version of the package) served the worker's calls: a wire that differs reads as garbage.
_BOOT = ('import sys; sys.path.insert(0, sys.argv.pop(1)); from sequence_ai_ros.worker import policy_host; '
         'sys.exit(policy_host.main(sys.argv[1:]))')


class RemoteError(PolicyException):
    """The policy raised in its deployment process; ``str()`` is its ``Type: message``."""


class PolicyProcessDied(PolicyException):
    """The deployment process exited, was killed or stopped answering; the message names how."""


class MemoryLimitExceeded(PolicyProcessDied):
    """The deployment process went over its memory limit (``seq serve --deployment-memory-mb``) and was ended.

    The message names the deployment, the limit (MB) and the step that ran; the runtime restarts the process.
    """


def memory_words(limit_mb: int) -> str:
    """How a deployment process over its memory limit ended, for messages."""
    return (f'it went over its memory limit of {limit_mb} MB, with what it started (seq serve --deployment-memory-mb '
            f'{limit_mb}) and was stopped')


def exit_words(code: int | None) -> str:
    """``'exit code 7'``, ``'signal SIGSEGV'`` or ``'no exit status yet'`` for a Popen return code."""
    if code is None:
        return 'no exit status yet'
    if code == wire.SKEW_EXIT_CODE:
        return (f'exit code {code}: its sequence_ai_ros differs from the worker\'s (the package changed on disk since '
                'the worker started): restart the worker')
    if code < 0:
        try:
            return f'signal {signal.Signals(-code).name}'
        except ValueError:
            return f'signal {-code}'
    return f'exit code {code}'


class _Sent:
    """A call started from the event loop, in flight (:meth:`PolicyProcess.start`)."""

    __slots__ = ('seq', 'seg', 'new', 'done', 'answered', 'array_bytes', 'wire_bytes')

    def __init__(self, seq: int, seg: int, done: Callable[[str | None, Any], None], array_bytes: int = 0,
                 wire_bytes: int = 0) -> None:
        self.seq = seq
        self.seg = seg
        self.new = False                  # its segment is new (mapped by the process with this call)
        self.done = done
        self.answered = False
        self.array_bytes = array_bytes    # its arrays' bytes in shared memory
        self.wire_bytes = wire_bytes      # its bytes on the socket, with the kernel's overhead (estimated)


class _InFlight:
    """The calls started from the event loop and not answered yet, in the order sent, and what they hold.

    :param send_budget: bytes of calls that may sit unread in the socket at once (estimated with the kernel's
        overhead, :data:`SEND_OVERHEAD_BYTES`).
    """

    __slots__ = ('array_bytes', 'calls', 'send_budget', 'wire_bytes')

    def __init__(self, send_budget: int) -> None:
        self.calls: collections.deque[_Sent] = collections.deque()
        self.array_bytes = 0        # their arrays' bytes in shared memory (:data:`PIPELINED_ARRAY_BYTES`)
        self.wire_bytes = 0         # their bytes sent on the socket
        self.send_budget = send_budget

    def __len__(self) -> int:
        return len(self.calls)

    def fits(self, array_bytes: int, wire_bytes: int) -> bool:
        """Whether a call of these sizes may go behind the ones in flight (neither bound passed)."""
        return (self.wire_bytes + wire_bytes <= self.send_budget
                and self.array_bytes + array_bytes <= PIPELINED_ARRAY_BYTES)

    def add(self, sent: _Sent) -> None:
        self.calls.append(sent)
        self.array_bytes += sent.array_bytes
        self.wire_bytes += sent.wire_bytes

    def pop(self) -> _Sent:
        """Take the oldest call (answered)."""
        sent = self.calls.popleft()
        self.array_bytes -= sent.array_bytes
        self.wire_bytes -= sent.wire_bytes
        return sent

    def take_all(self) -> list[_Sent]:
        """Take every call (the loop stops reading, or the process failed)."""
        calls = list(self.calls)
        self.calls.clear()
        self.array_bytes = self.wire_bytes = 0
        return calls


class PolicyProcess:
    """One deployment process and the socket to it.

    A thread's call (:meth:`call`) has the socket to itself (a lock serializes callers, and it waits for the
    calls in flight from the event loop); calls started from the event loop (:meth:`start`) are pipelined, up to
    :attr:`depth` in flight. The process runs every call alone, in the order sent.

    Its stdout and stderr are read into the worker's log (:class:`~.policy_output.OutputRelay`, bounded by one
    :class:`~.policy_output.OutputBudget`); its environment carries a fresh mark
    (:data:`~.descendants.MARK_ENV`), by which what it started is found once it is gone.

    :param name: the deployment (for messages and the process title).
    :param memory_limit_mb: end the process once its resident memory passes this many MB (0: no limit).
    :raises DeploymentError: when the process cannot be started.
    """

    def __init__(self, name: str, memory_limit_mb: int = 0) -> None:
        self.name = name
        self.memory_limit_mb = memory_limit_mb
        #: the value of :data:`~.descendants.MARK_ENV` in this process's environment, and its descendants'
        self.mark = uuid.uuid4().hex
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        flags_fd = os.memfd_create(f'seq_flags-{name}', os.MFD_CLOEXEC)
        os.ftruncate(flags_fd, wire.SLOTS)
        #: one byte per call in flight (its slot): set once the call's episode ended (the process drops it)
        self._flags = mmap.mmap(flags_fd, wire.SLOTS)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (_PACKAGE_ROOT, os.environ.get('PYTHONPATH'))
                                                          if p))
        env.setdefault('OMP_NUM_THREADS', '1')       # before numpy's import there
        env[descendants.MARK_ENV] = self.mark
        pipes = [os.pipe2(os.O_CLOEXEC) for _ in range(2)]     # stdout, stderr: (read end, write end)
        try:
            self.process = subprocess.Popen(
                [sys.executable, '-c', _BOOT, _PACKAGE_ROOT, str(theirs.fileno()), str(os.getpid()),
                 str(memory_limit_mb), str(flags_fd), wire.SOURCE_TAG],
                pass_fds=(theirs.fileno(), flags_fd), stdin=subprocess.DEVNULL, stdout=pipes[0][1], stderr=pipes[1][1],
                env=env, start_new_session=True)     # its group: what the policy starts ends with it (_end, kill)
        except OSError as exc:
            ours.close()
            self._flags.close()
            for fd in (*pipes[0], *pipes[1]):
                os.close(fd)
            raise DeploymentError(f'deployment {name!r}: cannot start its policy process: {exc}') from None
        finally:
            theirs.close()
            os.close(flags_fd)
        for _, write_end in pipes:
            os.close(write_end)
        budget = OutputBudget()
        #: the relays of its stdout and stderr into the log
        self.output = [OutputRelay(pipes[k][0], name, stream, self.process.pid, budget)
                       for k, stream in enumerate(('stdout', 'stderr'))]
        self._sock = ours
        try:
            ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_SEND_BUFFER_BYTES)
        except OSError:          # the kernel's default then
            pass
        # Calls that may sit in the socket unread at once: half its send buffer (a call that would pass it waits
        # in the deployment's queue). The process reads its next call only once it answered the one running, so
        # a blocking send past the buffer froze the worker's event loop for an inference's length, and with a
        # large answer the process could not write, for good: both sides blocked in a send.
        send_budget = ours.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) // 2
        self._sock_lock = threading.Lock()        # the exit watch's shutdown against close()
        self._channel = wire.Channel(ours, limit=MAX_REPLY_BYTES, take_fds=False)
        self._seq = 0                              # the sequence number of the last call sent
        self._lock = threading.Lock()              # a thread's call, or the calls in flight from the loop
        self._segments: dict[int, mmap.mmap] = {}   # shared memory by id: free, in flight or held by the policy
        self._free: list[int] = []
        self._busy: set[int] = set()               # segments of calls sent and not answered yet
        #: most calls started from the event loop in flight at once
        self.depth = wire.PIPELINE_DEPTH
        self._dropped: list[int] = []                # closed here; the process unmaps them with the next call
        self._next_segment = 0
        self._dead: str | None = None
        self._watched = False       # a thread watches the process's pidfd ...
        self._gone = False          # ... and saw it exit (no waitid per request while it runs)
        self.step = 'starting'
        #: while calls started from an event loop are in flight: that loop (it reads the answers), and the calls
        self._reading: asyncio.AbstractEventLoop | None = None
        #: the loop with the socket's reader registered: it stays between calls (an add and a remove per call cost
        #: two epoll_ctl and ~30 µs of a robot's round trip), and goes at the first wake with none in flight (the
        #: answer of a thread's call, which that thread reads) or before the socket closes (:meth:`_let_go`)
        self._watching: asyncio.AbstractEventLoop | None = None
        self._inflight = _InFlight(send_budget)
        try:                       # before anyone may reap it: the pid names this process
            pidfd = os.pidfd_open(self.process.pid)
        except OSError:            # a kernel without pidfds (< 5.3): the EOF alone tells its exit
            LOG.debug('no pidfd for the policy process of %r: its exit is seen at EOF on its socket', name)
        else:
            self._watched = True
            threading.Thread(target=self._watch_exit, args=(pidfd,), name=f'seq-exit-{name}', daemon=True).start()

    @property
    def pid(self) -> int:
        """The process id."""
        return self.process.pid

    def alive(self) -> bool:
        """True while the process runs and has not failed a call."""
        if self._dead is not None:
            return False
        if self._watched and not self._gone:
            return True
        return self.exit_status() is None

    def exit_words(self) -> str:
        """How the process ended (:func:`exit_words`; over its memory limit: :func:`memory_words`)."""
        code = self.exit_status()
        if self.over_memory(code):
            return memory_words(self.memory_limit_mb)
        return exit_words(code)

    def over_memory(self, code: int | None) -> bool:
        """True when exit status ``code`` says the process went over its memory limit."""
        return bool(self.memory_limit_mb) and code == wire.MEMORY_EXIT_CODE

    def exit_status(self) -> int | None:
        """The exit status as Popen's ``returncode`` gives it (-N: signal N); None while it runs. Never reaps it."""
        if self.process.returncode is not None:
            return self.process.returncode
        try:
            info = os.waitid(os.P_PID, self.process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:        # reaped meanwhile (Popen in another thread)
            return self.process.poll()
        if info is None:
            return None
        return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status

    def _watch_exit(self, pidfd: int) -> None:
        """Shut the socket once the process has exited, so that a call waiting for its answer ends at once.

        The EOF would tell it, but only once every copy of the process's end is closed, and a program or a
        forked copy the policy started may hold one.
        """
        try:
            poller = select.poll()
            poller.register(pidfd, select.POLLIN)
            while not poller.poll():
                pass
        finally:
            os.close(pidfd)
        self._gone = True
        with self._sock_lock:
            if self._sock.fileno() >= 0:
                try:
                    self._sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def _next_seq(self) -> int:
        self._seq = (self._seq + 1) & 0xFFFFFFFF
        return self._seq

    def call(self, command: str, *args: Any, ended: tuple[str, ...] = (), step: str = '') -> Any:
        """Run ``command(*args)`` in the process and return its value.

        :param ended: episode ids the process may forget (sent along, no extra round trip).
        :param step: what the call does, for messages (``importing``, ``loading``, ``infer``...).
        :raises RemoteError: when the policy raised.
        :raises ContractViolation: when the policy raised ContractViolation (the request was malformed).
        :raises PolicyProcessDied: when the process is dead, dies during the call, was killed, or sent what is
            no answer to the call (it is then stopped).
        """
        with self._lock:
            if self._dead is not None:
                raise PolicyProcessDied(self._dead)
            self.step = step or command
            header, pickler = wire.encode_call((command, args, ended))
            fds: list[int] = []
            try:
                seq = self._next_seq()
                head, fds, seg = self._place(pickler, wire.NO_SLOT)
                new = bool(fds)
                self._channel.send([head, header], fds, seq)
                payload, _ = self._channel.recv(seq)
                released, (status, value) = wire.parse_reply(payload)
                del payload
            except (OSError, EOFError, wire.ProtocolError) as exc:
                raise self._died(self.step, exc) from None
            finally:
                for fd in fds:         # the process has its own copy now (or never will)
                    os.close(fd)
            self._answered(seg, released, failed_new=new and status == 'err')
        if status == 'err':
            raise RemoteError(value)
        if status == 'contract':        # the policy found the request malformed (ContractViolation)
            raise ContractViolation(value)
        return value

    def start(self, loop: asyncio.AbstractEventLoop, done: Callable[[str | None, Any], None], command: str,
              *args: Any, ended: tuple[str, ...] = (), step: str = '') -> Callable[[], bool] | None:
        """Send ``command(*args)`` from ``loop``'s thread without waiting; ``done`` gets the answer.

        Up to :attr:`depth` such calls are in flight at once (pipelined: sent before the previous ones are
        answered); the process runs them one at a time, in the order sent. ``loop`` reads the answers as they
        arrive and calls ``done(status, value)`` there, in the order sent: ``('ok', value)``, ``('err', 'Type:
        message')``, ``('contract', message)`` or ``('dropped', None)`` (cancelled before its turn: it never
        started). When the process dies meanwhile, every call in flight gets ``done(None, PolicyProcessDied)``,
        from a thread of its own, once the exit status is known.

        :return: the call's cancel (any thread): it marks the call dropped, unless it was answered (then it
            returns False); None, having sent nothing, when a thread's call runs, :attr:`depth` calls (or
            :data:`PIPELINED_ARRAY_BYTES` of arrays, or half the socket's send buffer) are in flight,
            the process is dead or the arguments do not pickle (:meth:`call` then answers as usual).
        """
        first = not self._inflight
        watching = self._watching
        if watching is not None and (watching is not loop or watching.is_closed()):
            if watching.is_running():        # another loop reads the socket: never two
                return None
            self._unwatch()                  # a stopped or closed loop's reader goes
        if first:
            if not self._lock.acquire(blocking=False):
                return None
        elif self._reading is not loop or len(self._inflight) >= self.depth:
            return None
        try:
            if self._dead is not None:
                raise _NotSent
            header, pickler = wire.encode_call((command, args, ended))
            sent_bytes = len(header) + SEND_OVERHEAD_BYTES + 4 * len(self._dropped) + 64    # with its heads
            if not first and not self._inflight.fits(pickler.size, sent_bytes):    # a send that could block
                raise _NotSent
        except Exception:
            if first:
                self._lock.release()
            return None
        self.step = step or command
        fds: list[int] = []
        seq = self._next_seq()
        slot = seq % wire.SLOTS
        self._flags[slot] = 0
        sent = _Sent(seq, -1, done, pickler.size, sent_bytes)
        self._inflight.add(sent)
        try:
            head, fds, sent.seg = self._place(pickler, slot)
            sent.new = bool(fds)
            if first:
                self._reading = loop
                if self._watching is None:
                    fd = self._sock.fileno()
                    # an entry the loop may keep for this fd number from a socket closed before its reader went
                    # (a close that could not wait for a stalled loop): asyncio would take it for this one's
                    loop.remove_reader(fd)
                    loop.add_reader(fd, self._on_readable)
                    self._watching = loop
            # at once, behind busy ones too: gathered into one write at the end of the loop's pass, a call waited
            # for that pass (p99 9 ms, up to 22 ms at 128 robots; 0.4 ms sent at once)
            self._channel.send([head, header], fds, seq)
        except Exception as exc:   # any failure to send (a closed loop, no memory): the calls in flight fail now
            self._fail_started(exc)
        finally:
            for fd in fds:
                os.close(fd)
        return lambda: self._cancel(sent, slot)

    def _cancel(self, sent: _Sent, slot: int) -> bool:
        """Mark a call in flight dropped: the process never starts it if its turn has not come (any thread)."""
        if sent.answered:
            return False
        try:
            self._flags[slot] = 1
        except ValueError:        # closed: the process is gone
            return False
        return True

    def _on_readable(self) -> None:
        """The loop's reader: hand the answers of calls started there on, in order (loop thread).

        With none in flight the socket is not the loop's to read (a thread's call waits for its answer there, or
        the process ended): the reader goes, and comes back with the loop's next call.
        """
        if not self._inflight:
            self._unwatch()
            return
        while self._inflight:
            oldest = self._inflight.calls[0]
            try:
                payload = self._channel.poll(oldest.seq, more=len(self._inflight) > 1)
                if payload is None:
                    return
                released, (status, value) = wire.parse_reply(payload)
                del payload
            except Exception as exc:    # the process ended, or sent what is no answer: it is done for
                self._fail_started(exc)
                return
            self._inflight.pop()
            oldest.answered = True
            self._answered(oldest.seg, released, failed_new=oldest.new and status == 'err')
            if not self._inflight:
                self._end_started()
                self._lock.release()
            try:
                oldest.done(status, value)
            except Exception:       # its caller's bug: the other answers are still handed on
                LOG.exception('the answer of a call to the policy process of %r was not taken', self.name)

    def _answered(self, seg: int, released: list[int], failed_new: bool = False) -> None:
        """A call of segment ``seg`` was answered; the process released segments ``released``.

        :param failed_new: the call failed and brought ``seg`` new: the process may never have mapped it (its
            ``mmap`` failed, or the call's head did not parse), so it is dropped on both sides, never reused.
        """
        self._busy.discard(seg)
        self._free.extend(k for k in released if k in self._segments and k not in self._free)
        if failed_new and seg in self._segments:
            if seg in self._free:
                self._free.remove(seg)
            self._segments.pop(seg).close()
            self._dropped.append(seg)      # the process unmaps it (if it mapped it) with the next call

    def _end_started(self) -> list[_Sent]:
        """The loop stops reading answers (its reader stays registered); return the calls in flight (now none)."""
        self._reading = None
        return self._inflight.take_all()

    def _unwatch(self) -> None:
        """The loop's reader of the socket goes (the loop's thread, or with the loop not running)."""
        loop, self._watching = self._watching, None
        if loop is not None and not loop.is_closed():
            try:
                loop.remove_reader(self._sock.fileno())
            except (ValueError, OSError, RuntimeError):       # the socket is already closed
                pass

    def _fail_started(self, exc: BaseException) -> None:
        """The process died under calls in flight: name how (its exit status, off the loop), then tell each ``done``."""
        sent = self._end_started()
        self._unwatch()

        def settle() -> None:
            try:
                died = self._died(self.step, exc)
            finally:
                self._lock.release()
            for call in sent:
                call.answered = True
                call.done(None, died)

        threading.Thread(target=settle, name=f'seq-died-{self.name}', daemon=True).start()

    def _close_socket(self) -> None:
        with self._sock_lock:
            self._sock.close()

    def _let_go(self) -> asyncio.AbstractEventLoop | None:
        """Before the socket closes: the loop watching it stops (an fd number is reused); calls in flight fail.

        :returns: None once done; the loop, when it did not run the removal within 2 s (it is queued there).
        """
        loop = self._watching
        if loop is None or loop.is_closed():
            return None

        def stop() -> None:
            if self._reading is loop:
                self._fail_started(EOFError('closed'))        # its reader goes too
            else:
                self._unwatch()

        if not loop.is_running():        # nobody reads it any more: a call in flight fails here
            stop()
            return None
        try:
            here = asyncio.get_running_loop() is loop
        except RuntimeError:
            here = False
        if here:
            stop()
            return None
        done = threading.Event()

        def remove() -> None:
            try:
                if self._watching is loop:
                    stop()
            finally:
                done.set()

        try:
            loop.call_soon_threadsafe(remove)
        except RuntimeError:
            return None
        return None if done.wait(2.0) else loop

    def _place(self, pickler: wire.CallPickler, slot: int) -> tuple[bytes, list[int], int]:
        """Copy the call's arrays into a free segment (a new one when none fits); return the call's head, fds, segment.

        The fds (a new segment's) go with the call; the caller closes them once sent. The segment counts as in
        flight until the call's answer (:meth:`_answered`).
        """
        fds: list[int] = []
        if not pickler.arrays:
            seg, copy, size = -1, False, 0
        else:
            fit = [k for k in self._free if len(self._segments[k]) >= pickler.size]
            if fit:
                seg = min(fit, key=lambda k: len(self._segments[k]))
                self._free.remove(seg)
            else:
                seg, fd = self._new_segment(pickler.size)
                fds = [fd]
            wire.fill(self._segments[seg], pickler)
            size = len(self._segments[seg])
            held = len(self._segments) - len(self._free) - len(self._busy) - 1   # by the policy, besides in flight
            copy = held >= wire.MAX_HELD        # the policy keeps many calls' arrays: this call's are copied out
            self._busy.add(seg)
        dropped, self._dropped = self._dropped, []
        return wire.call_head(seg, copy, size, dropped, new=bool(fds), slot=slot), fds, seg

    def _new_segment(self, size: int) -> tuple[int, int]:
        """Map a new segment of at least ``size`` bytes; free ones too small for it are dropped (both sides)."""
        size = max(size, SHM_START_BYTES)
        size = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE * mmap.PAGESIZE
        for k in [k for k in self._free if len(self._segments[k]) < size]:
            self._free.remove(k)
            self._segments.pop(k).close()
            self._dropped.append(k)
        seg, self._next_segment = self._next_segment, self._next_segment + 1
        fd = os.memfd_create(f'seq-{self.name}-{seg}', os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            self._segments[seg] = mmap.mmap(fd, size)
        except OSError:
            os.close(fd)
            raise
        return seg, fd

    def _died(self, step: str, exc: BaseException | None = None) -> PolicyProcessDied:
        """The call of ``step`` failed with ``exc``: end the process (at once when it sent what is no answer)."""
        broke = isinstance(exc, wire.ProtocolError)
        code = self._end(0.0 if broke else 2.0)
        if broke and self._dead is None:
            self._dead = (f'the socket of the policy process of deployment {self.name!r} (pid {self.pid}) carried '
                          f'what is no answer while {step} ({exc}): the process was stopped')
        over = self._dead is None and self.over_memory(code)
        how = self._dead or (f'the policy process of deployment {self.name!r} (pid {self.pid}) died while {step}: '
                             f'{memory_words(self.memory_limit_mb) if over else exit_words(code)}')
        self._dead = how
        LOG.error('%s', how)
        return MemoryLimitExceeded(how) if over else PolicyProcessDied(how)

    def kill(self, why: str = '') -> None:
        """Kill the process now (SIGKILL; a call in flight then fails with PolicyProcessDied); never blocks."""
        if self._dead is None:
            self._dead = (f'the policy process of deployment {self.name!r} (pid {self.pid}) was stopped while '
                          f'{self.step}' + (f': {why}' if why else ''))
        self._kill_group()
        try:   # wake a caller blocked on the socket (the kernel closes the peer's end only once reaped)
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def close(self, timeout: float = 2.0) -> None:
        """Ask the process to exit (EOF on its socket), then kill it after ``timeout`` s; reap it."""
        if self._dead is None:
            self._dead = f'the policy process of deployment {self.name!r} was closed'
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._end(timeout)
        for relay in self.output:      # its last lines into the log (the pipes end with the process's descendants)
            relay.join(OUTPUT_JOIN_S)
        stalled = self._let_go()
        if stalled is None:
            self._close_socket()
        else:       # behind the reader's removal on that loop: a number freed while registered is another's to watch
            try:
                stalled.call_soon_threadsafe(self._close_socket)
            except RuntimeError:          # the loop closed meanwhile (its selector with it)
                self._close_socket()
        for segment in self._segments.values():
            try:
                segment.close()
            except BufferError:   # a call still fills it (it fails): unmapped once that view is gone
                pass
        self._segments.clear()
        self._free.clear()
        self._flags.close()


    def _end(self, timeout: float) -> int:
        """Wait up to ``timeout`` s for the process to exit, SIGKILL its group, reap it; return its exit status.

        The group (the process's session) holds what the policy started (``subprocess``, ``multiprocessing``):
        it is killed while the process, exited or not, is unreaped, so that its pid still names that group.
        The process, a subreaper, ends everything else it started as it exits; in case it could not (killed, or
        ended by the policy's ``os._exit``), what still carries its mark is killed here
        (:func:`~.descendants.end_marked`, a read of ``/proc``).
        """
        if self.process.returncode is None:
            deadline = time.monotonic() + timeout
            pause = 0.001
            while self.exit_status() is None and time.monotonic() < deadline:
                time.sleep(pause)
                pause = min(0.05, 2 * pause)
            self._kill_group()
            self.process.wait()
            descendants.end_marked(self.mark)
        return self.process.wait()

    def _kill_group(self) -> None:
        """SIGKILL the process and its group, unless it was reaped (its pid may name another group then)."""
        if self.process.returncode is not None:
            return
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except OSError:                  # the group is empty (ESRCH), or not ours any more
            pass


class _NotSent(Exception):
    """A call :meth:`PolicyProcess.start` does not send."""


def _ident(episode: Any) -> tuple[str, str, str]:
    return (episode.id, episode.instruction, episode.deployment)


class RemotePolicy:
    """A policy instance living in its deployment process (the :class:`.hosting.PolicyHost` of ``--isolation process``).

    Constructed by a remote definition's ``instantiate()`` (the runtime's loader thread, :func:`open_host`):
    starts the process; ``load()`` imports the file there, constructs the policy and runs its ``load()``, so
    that the runtime can kill the process (:meth:`kill`) when the load deadline passes at any of these steps.
    """

    #: an inference may be sent from the worker's event loop (:meth:`start_infer`)
    starts_on_loop = True
    #: inferences that may be in flight at once from the event loop
    pipeline_depth = wire.PIPELINE_DEPTH
    _path = ''
    _name = ''
    _hook = ''

    _memory_limit_mb = 0

    def __init__(self, **config: Any) -> None:
        self._ended: collections.deque[str] = collections.deque()
        self._config = config
        self.process = PolicyProcess(self._name, self._memory_limit_mb)

    def load(self) -> None:
        """Import the file, construct the policy and run its ``load()`` in the process.

        :raises PolicyProcessDied: when the process dies (or is killed) meanwhile.
        :raises RemoteError: when the import, the constructor or ``load()`` raises.
        """
        self.process.call('describe', self._path, self._config, self._name, step='importing the policy file')
        self.process.call('load', step='constructing and loading the policy')

    def infer(self, inp: Any, episode: Any) -> Any:
        """One chunk for ``inp`` (the policy's ``infer`` in the process)."""
        return self.process.call('infer', inp, _ident(episode), ended=self._take_ended(), step='inferring')

    def start_infer(self, loop: asyncio.AbstractEventLoop, inp: Any, episode: Any,
                    done: Callable[[str | None, Any], None]) -> Callable[[], bool] | None:
        """Start :meth:`infer` from ``loop``'s thread; ``done`` gets the answer (:meth:`PolicyProcess.start`).

        :return: its cancel (:meth:`PolicyProcess.start`), or None when it was not sent.
        """
        ended = self._take_ended()
        cancel = self.process.start(loop, done, 'infer', inp, _ident(episode), ended=ended, step='inferring')
        if cancel is None:
            self._ended.extendleft(reversed(ended))    # not sent: the next call takes them
        return cancel

    def infer_batch(self, inputs: list[Any], episodes: list[Any]) -> list[Any]:
        """One chunk (or a :class:`RemoteError`) per input (the policy's ``infer_batch`` in the process)."""
        outs = self.process.call('infer_batch', inputs, [_ident(e) for e in episodes], ended=self._take_ended(),
                                 step='inferring a batch')
        return [RemoteError(o.text) if isinstance(o, wire.RemoteFailure) else o for o in outs]

    def forget(self, episode_id: str) -> None:
        """The episode ended: the process drops its state with the next call (any thread)."""
        self._ended.append(episode_id)

    def _take_ended(self) -> tuple[str, ...]:
        taken = []
        while self._ended:                # appended from any thread: popleft never loses one
            taken.append(self._ended.popleft())
        return tuple(taken)

    def episode_hook(self, name: str) -> Callable[[Any], None]:
        """The ``@seq.on_episode`` method ``name``, run in the process for an episode's end (its state is dropped)."""
        def hook(episode: Any) -> None:
            self.process.call('hook', name, _ident(episode), episode.reason or '', ended=self._take_ended(),
                              step='running the episode hook')
        return hook

    def alive(self) -> bool:
        """True while the process runs."""
        return self.process.alive()

    def exit_reason(self) -> str | None:
        """None while the process runs and answers; else how it ended (:func:`exit_words`)."""
        return None if self.alive() else self.process.exit_words()

    def kill(self, why: str = '') -> None:
        """Kill the process (a stuck or failed policy); never blocks."""
        self.process.kill(why)

    def close(self, timeout: float = 2.0) -> None:
        """Stop the process."""
        self.process.close(timeout)


def runs_isolated(definition: PolicyDefinition) -> bool:
    """True when ``definition`` is remote (:func:`describe_policy_file`): its policy runs in a deployment process."""
    return isinstance(definition.cls, type) and issubclass(definition.cls, RemotePolicy)


def open_host(definition: PolicyDefinition) -> PolicyHost:
    """Construct the policy of ``definition`` (``instantiate()``) and return its host (not loaded yet).

    A remote definition's construction starts its deployment process (:class:`RemotePolicy`); any other's
    constructs the class here, in the worker (:class:`~sequence_ai_ros.worker.hosting.InProcessHost`).
    Exceptions of the constructor propagate.
    """
    policy = definition.instantiate()
    return policy if isinstance(policy, RemotePolicy) else InProcessHost(policy)


def _remote_class(name: str, described: dict[str, Any], memory_limit_mb: int = 0) -> type:
    artifacts = [Path(p) for p in described['artifacts']]
    return type(f'Remote{described["cls_name"]}', (RemotePolicy,), {
        '_path': described['path'], '_name': name, '_hook': described['spec'].hook or '',
        '_memory_limit_mb': memory_limit_mb,
        'artifacts': classmethod(lambda cls, config: list(artifacts)),
        '__module__': __name__})


def _bounded(process: PolicyProcess, timeout_s: float, what: str, command: str, *args: Any) -> Any:
    """Run one call with a deadline: past it the process is killed and DeploymentError names the step."""
    timer = threading.Timer(timeout_s, process.kill, kwargs={'why': f'{what} exceeded {timeout_s:g} s'})
    timer.daemon = True
    timer.start()
    try:
        return process.call(command, *args, step=what)
    finally:
        timer.cancel()


def describe_policy_file(path: str | Path, name: str, timeout_s: float, *, memory_limit_mb: int = 0,
                         **overrides: Any) -> PolicyDefinition:
    """Import ``path`` in a deployment process within ``timeout_s`` s; return its (remote) definition.

    The returned definition's ``instantiate()`` starts the deployment process that serves it
    (:class:`RemotePolicy`); its ``cls.artifacts(config)`` answers what the file's class named.

    :param memory_limit_mb: the memory limit of this deployment's processes (MB; 0: none), the importing one
        included (:class:`PolicyProcess`).

    :raises DeploymentError: naming the deployment: the file does not import (its error), the import
        exceeded ``timeout_s``, or the process died while importing (with its exit code or signal).
    """
    process = PolicyProcess(name, memory_limit_mb)
    start = time.monotonic()
    try:
        _bounded(process, START_TIMEOUT_S, 'starting', 'ping')
        start = time.monotonic()
        described = _bounded(process, timeout_s, 'importing the policy file', 'describe', str(path), overrides, name)
    except RemoteError as exc:
        raise DeploymentError(str(exc)) from None     # load_policy_file's own DeploymentError, already worded
    except PolicyProcessDied as exc:
        raise DeploymentError(f'{path}: {_timed_out(exc, start, timeout_s)}') from None
    finally:
        process.close()
    return PolicyDefinition(path=Path(described['path']), cls=_remote_class(name, described, memory_limit_mb),
                            spec=described['spec'],
                            config=described['config'], contract=described['contract'], sha256=described['sha256'])


def _timed_out(exc: PolicyProcessDied, start: float, timeout_s: float) -> str:
    if time.monotonic() - start >= timeout_s:
        return f'{exc} (the bound is {timeout_s:g} s)'
    return str(exc)


def deploy_check(path: str | Path, name: str, timeout_s: float) -> tuple[PolicyDefinition, Any, dict[str, float]]:
    """``seq deploy``'s checks in a deployment process: import, fingerprint, dry run, all within ``timeout_s``.

    :return: the (remote) definition, its :class:`~sequence_ai_ros.worker.content.Fingerprint` and the
        dry run's figures.
    :raises DeploymentError: as :func:`~sequence_ai_ros.worker.validate.dry_run`, or naming the deployment
        and the exit code or signal when the process dies, or the step running when ``timeout_s`` passed.
    """
    process = PolicyProcess(name)
    try:
        _bounded(process, START_TIMEOUT_S, 'starting', 'ping')
        start = time.monotonic()
        described = _bounded(process, timeout_s, 'importing the policy file', 'describe', str(path), {}, name)
        left = max(0.05, timeout_s - (time.monotonic() - start))
        checked = _bounded(process, left + 1.0, 'running the dry run', 'dry_run', left, timeout_s)
    except RemoteError as exc:
        raise DeploymentError(str(exc)) from None
    except PolicyProcessDied as exc:
        raise DeploymentError(f'{path}: {_timed_out(exc, start, timeout_s)}') from None
    finally:
        process.close()
    definition = PolicyDefinition(path=Path(described['path']), cls=_remote_class(name, described),
                                  spec=described['spec'], config=described['config'],
                                  contract=described['contract'], sha256=described['sha256'])
    return definition, checked['fingerprint'], checked['figures']
