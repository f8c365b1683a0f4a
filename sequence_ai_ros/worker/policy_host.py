"""The deployment process: imports, loads and runs one policy for the worker (``--isolation process``).

The worker (:mod:`sequence_ai_ros.worker.policy_process`) starts :func:`main` (``FD PPID MEMORY_MB FLAGS_FD``; from
the worker's own copy of the package, whatever the working directory holds) with one end of a Unix socket pair as
``FD``, and sends it calls in frames (``u32 length``, ``u32 sequence number``, then the payload; :class:`Channel`,
one ``sendmsg`` and usually one ``recvmsg`` each). Up to :data:`PIPELINE_DEPTH` inferences may be in flight at once
(the worker writes the next while this process computes); this process runs its calls one at a time, in the order
sent, and answers each as it returns, so the policy never sees concurrent calls. A reply carries its call's sequence
number; the worker takes nothing but the answer of its oldest call in flight (:class:`ProtocolError`), so bytes that
are no answer (a stray write on the socket) fail the calls in flight and never pass for the answer of another:

- a call's payload: ``i32 segment`` (-1: no arrays), ``u32 flags`` (:data:`COPY`, :data:`NEW_SEGMENT`), ``u64
  segment size``, ``u32 slot`` (its byte in the flags page, :data:`NO_SLOT`: none), ``u32 n`` and ``n`` ``i32``
  ids of segments the worker dropped, then the header: a protocol-5 pickle of ``(command, arguments, ended
  episode ids)`` in which every plain numpy array is a reference ``(offset, dtype, shape, writeable)`` into the
  call's *segment* (:class:`CallPickler`). A segment is shared memory (a ``memfd``) that the worker maps too;
  a new one comes with its call as ``SCM_RIGHTS``. The worker copies the arrays' bytes into the segment once;
  this process hands the policy *views* of them (:class:`Segments`), so observations' images and states are
  neither pickled nor copied here;
- a reply's payload: ``u32 n`` and ``n`` ``i32`` ids of segments the worker may write again, then a plain
  pickle of ``('ok', value)``, ``('err', 'Type: message')`` or ``('dropped', None)``: action chunks are small.

The *flags page* (``FLAGS_FD``, :data:`SLOTS` bytes of shared memory) holds one byte per call in flight: the
worker sets a call's byte once its episode has ended (the robot's EpisodeEnd arrived), and an inference whose
byte is set when its turn comes never starts here: its answer is ``('dropped', None)``. One that started before
is left to finish (its result is discarded by the worker).

A segment is written again only once nothing here references its arrays any more (the policy may keep
them, in an episode's state or anywhere: then its segment stays out of use until they are gone), so what
the policy holds never changes under it. While :data:`MAX_HELD` segments are held, a call's arrays are
copied out instead (``copy``), and its segment is free again at once.

Commands: ``describe`` (import the file; answer what the worker needs without importing it), ``load``
(construct with the config and call ``load()``), ``infer``, ``infer_batch``, ``hook`` (the
``@seq.on_episode`` method), ``dry_run`` (``seq deploy``'s checks). Episodes live here, one
:class:`~sequence_ai_ros.policy.api.Episode` (with its ``state``) per id, dropped when the worker names
them ended.

The process dies with the worker (a watchdog on its parent pid, and at EOF on the socket), so a worker killed
with ``kill -9`` leaves no policy behind; the worker makes it the leader of a process group, and it is a child
subreaper (:mod:`~sequence_ai_ros.worker.descendants`): everything the policy started (``subprocess``,
``multiprocessing``, detached with ``start_new_session=True`` or a double fork and ``setsid``) descends from it
and ends with it. Its stdout and stderr are pipes the worker reads into its log
(:mod:`~sequence_ai_ros.worker.policy_output`). With a memory limit (``policy_host FD PPID MEMORY_MB``, ``seq
serve --deployment-memory-mb``) the watchdog exits with :data:`MEMORY_EXIT_CODE` once the process's resident
memory passes it, ending what the policy started. ``seq deploy``'s dry run runs on the main thread (a policy
may install signal handlers in ``__init__``), its deadline kept by a timer that answers the call and exits.
The socket is this process's alone: programs
the policy starts never inherit it (close-on-exec), a copy the policy forks (``os.fork``, ``multiprocessing``)
closes it at once, and such a copy that returns from the policy's code into this module exits instead of
answering (:func:`serve`). SIGINT and SIGTERM do nothing here: the worker, which drains on them, decides when
its policies stop. Nothing here imports gRPC.
"""

from __future__ import annotations

import array
import collections
import gc
import hashlib
import io
import logging
import mmap
import os
import pickle
import signal
import socket
import struct
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from typing import Any

import numpy as np

from sequence_ai_ros.exceptions import ConfigError
from sequence_ai_ros.policy.api import Episode, Result
from sequence_ai_ros.protocol import tracing
from sequence_ai_ros.worker import descendants

_U32 = struct.Struct('<I')
_I32 = struct.Struct('<i')
#: A frame's head: the payload's length (bytes) and the sequence number of its call.
_FRAME = struct.Struct('<II')
#: A call's fixed head: segment id (-1: none), flags, segment size (bytes), slot, number of dropped segments.
_CALL = struct.Struct('<iIQII')
#: A call's flag: copy its arrays out of the segment (the segment is free again at once).
COPY = 1
#: A call's flag: its segment is new; its fd came with the call (``SCM_RIGHTS``).
NEW_SEGMENT = 2
#: Bytes of the flags page: the slots of calls in flight (a call's slot is its sequence number modulo SLOTS).
SLOTS = 4096
#: The slot of a call that has none (it cannot be dropped).
NO_SLOT = 0xFFFFFFFF
#: Inferences the worker may have in flight to one deployment process at once (sent, not yet answered). The
#: worker reads answers and sends calls once per pass of its event loop, so this bounds the requests served per
#: pass: at 16, 128 robots at 10 req/s (a 0 ms policy, 2 cores) kept 16 in flight and 50-60 queued behind them
#: through whole runs (p50 5-100 ms); at 64 the queue stays empty but for bursts.
PIPELINE_DEPTH = 64
#: Alignment of each array in a segment (bytes).
ALIGN = 64
#: Segments the policy may hold (by keeping arrays of their calls) before calls' arrays are copied instead.
MAX_HELD = 16
#: The dtype kinds whose arrays travel in a segment (others, e.g. object arrays, are pickled in the header).
_SHARED_KINDS = frozenset('biufcmMSU')
#: Most fds one read takes: a read takes the fds of one write at most (the kernel ends a read there), and the
#: worker writes each call alone, with its new segment's fd if it has one; the room is twice
#: :data:`PIPELINE_DEPTH`, so that even all the calls in flight written at once would fit, under Linux's 253 per
#: message (``SCM_MAX_FD``).
FDS_PER_READ = min(2 * PIPELINE_DEPTH, 253)
_FD_SPACE = socket.CMSG_SPACE(FDS_PER_READ * array.array('i').itemsize)
#: ``socket``'s flags as plain ints: an ``int & socket.MsgFlag`` runs ``enum.Flag``'s Python operators (about 6 %
#: of a deployment process's time per call)
_MSG_DONTWAIT = int(socket.MSG_DONTWAIT)
_MSG_CTRUNC = int(socket.MSG_CTRUNC)
LOG = logging.getLogger('sequence_ai_ros.worker.policy_host')
#: Set in a deployment process to the worker's pid.
DEPLOYMENT_PROCESS_ENV = 'SEQ_DEPLOYMENT_PROCESS'
#: True in a copy of the deployment process that the policy forked (it never answers the worker).
_forked = False
#: Exit status of a deployment process that went over its memory limit (the worker names the limit).
MEMORY_EXIT_CODE = 86
#: Exit status of a deployment process whose copy of this module differs from the worker's (:data:`SOURCE_TAG`).
SKEW_EXIT_CODE = 87


def _source_tag() -> str:
    """A digest of this module's file as this process imported it ('' where it cannot be read)."""
    try:
        with open(__file__, 'rb') as source:
            return hashlib.sha256(source.read()).hexdigest()[:16]
    except OSError:
        return ''


#: This module's digest when it was imported: the worker passes its own to the deployment processes it starts, and
#: one that imported another version (the package changed on disk since the worker started: an upgrade in place, an
#: edit) exits with :data:`SKEW_EXIT_CODE` at once, naming it, instead of reading the worker's calls as garbage.
SOURCE_TAG = _source_tag()
#: Period (s) of the watchdog: the parent pid, and the resident memory when there is a limit.
WATCH_PERIOD_S = 0.1


class ProtocolError(Exception):
    """What arrived on the socket is no frame of the call in flight.

    Another call's sequence number, a length over the bound, or more bytes after the frame: a stray write on
    the socket, or the answer of a copy of the process.
    """


class Channel:
    """Frames over a Unix stream socket: ``u32 length``, ``u32 sequence number``, then the payload.

    Frames may follow each other (the worker pipelines calls: :data:`PIPELINE_DEPTH`): reads go into one
    reusable buffer (grown to the largest frame), which may hold the next frame's first bytes, or several whole
    frames, behind the one read; a payload is valid until the next read. File descriptors (``SCM_RIGHTS``)
    ride with a frame's first bytes and reach :attr:`fds` in the order sent, no later than those bytes (every
    read takes ancillary data). A frame is read whole by :meth:`recv` (blocking), or piecewise by :meth:`poll`
    (never blocking: an event loop's reader), and a frame :meth:`poll` began, :meth:`recv` finishes. Given the
    sequence number it expects, a read checks the frame's head as soon as it has arrived, so that a frame that
    is not the one due fails at once; given ``more=False`` (no later frame is due), bytes after the frame fail
    it too.

    :param sock: a connected ``AF_UNIX`` ``SOCK_STREAM`` socket (blocking).
    :param limit: the largest payload (bytes) taken; None: any.
    :param take_fds: keep the fds received (False: close them at once; the worker takes none from its processes).
    """

    def __init__(self, sock: socket.socket, size: int = 1 << 16, limit: int | None = None,
                 take_fds: bool = True) -> None:
        self.sock = sock
        self.limit = limit
        self.take_fds = take_fds
        #: the sequence number of the last frame read
        self.seq = 0
        #: the file descriptors received and not yet taken, in the order they were sent
        self.fds: collections.deque[int] = collections.deque()
        self._buf = bytearray(size)
        self._at = 0            # where the next frame starts in the buffer
        self._got = 0           # bytes in the buffer (from 0; those before _at are read)

    def send(self, parts: Sequence[bytes | memoryview], fds: Sequence[int] = (), seq: int = 0) -> None:
        """Send one frame of ``parts`` (and ``fds``), in one ``sendmsg`` when the socket takes it all.

        :param seq: its sequence number, ``0 <= seq < 2**32``.
        :raises OSError: when the peer is gone.
        """
        msg = [_FRAME.pack(sum(len(p) for p in parts), seq), *parts]
        anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array('i', fds))] if fds else []
        sent = self.sock.sendmsg(msg, anc)
        total = sum(len(p) for p in msg)
        if sent < total:     # a full socket buffer or a signal: the rest (the fds went with the first bytes)
            self.sock.sendall(memoryview(b''.join(msg))[sent:])

    def recv(self, seq: int | None = None, more: bool = False) -> tuple[memoryview, list[int]]:
        """Read one frame: its payload (a view of the buffer, valid until the next read) and the fds received so far.

        The fds are the caller's (in the order sent): a frame's come no later than its first bytes, so with frames
        pipelined they may be a later frame's.

        :param seq: the sequence number the frame must carry; None: any (:attr:`seq` tells it).
        :param more: later frames may follow it (calls pipelined behind it); False: bytes after it fail it.
        :raises EOFError: when the peer closed the socket.
        :raises OSError: when the socket fails.
        :raises ProtocolError: when the bytes read are not the frame due (``seq``, :attr:`limit`).
        """
        frame = self._frame(seq, more)
        while frame is None:
            self._read(0)
            frame = self._frame(seq, more)
        fds = list(self.fds)
        self.fds.clear()
        return frame, fds

    def poll(self, seq: int | None = None, more: bool = False) -> memoryview | None:
        """Read what has arrived, without blocking; return a frame's payload once it is whole, else None.

        :param seq: :param more: as :meth:`recv`'s.
        :raises EOFError: when the peer closed the socket.
        :raises OSError: when the socket fails.
        :raises ProtocolError: as :meth:`recv`.
        """
        frame = self._frame(seq, more)     # a frame read with the one before it
        if frame is not None:
            return frame
        try:
            self._read(_MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return None
        return self._frame(seq, more)

    def _read(self, flags: int) -> None:
        if self._at:                     # the frames before it are read: the next one's bytes go first
            rest = self._got - self._at
            self._buf[:rest] = self._buf[self._at:self._got]
            self._at, self._got = 0, rest
        if self._got == len(self._buf):
            self._grow(2 * len(self._buf))
        k, anc, msg_flags, _ = self.sock.recvmsg_into([memoryview(self._buf)[self._got:]], _FD_SPACE, flags)
        if anc:
            if self.take_fds:
                self.fds.extend(_fds(anc))
            else:
                _close_fds(_fds(anc))
        if msg_flags & _MSG_CTRUNC and self.take_fds:
            # the kernel closed fds that found no room: a later call would map another call's segment, or none
            # ('pop from an empty deque'), so the channel is done for
            raise ProtocolError(f'file descriptors were lost: one write carried more than {FDS_PER_READ}')
        if not k:
            raise EOFError('the peer closed the connection')
        self._got += k

    def _grow(self, size: int) -> None:
        grown = bytearray(size)
        grown[:self._got - self._at] = memoryview(self._buf)[self._at:self._got]
        self._got -= self._at
        self._at = 0
        self._buf = grown

    def _frame(self, seq: int | None, more: bool) -> memoryview | None:
        head = _FRAME.size
        at, have = self._at, self._got - self._at
        if have < head:
            return None
        n, got_seq = _FRAME.unpack_from(self._buf, at)
        if seq is not None and got_seq != seq:
            raise ProtocolError(f'a frame numbered {got_seq} came where the answer to call {seq} was due')
        if self.limit is not None and n > self.limit:
            raise ProtocolError(f'a frame of {n} bytes came, over the bound of {self.limit}')
        if at + head + n > len(self._buf):
            self._grow(max(head + n, 2 * len(self._buf)))
            at = 0
        if have < head + n:
            return None
        if have > head + n and not more:     # no later frame is due: nothing may follow it
            raise ProtocolError(f'{have - head - n} more bytes came after the frame of call {got_seq}')
        self.seq = got_seq
        self._at = at + head + n
        if self._at == self._got:
            self._at = self._got = 0
        return memoryview(self._buf)[at + head:at + head + n]


def _fds(anc: list[tuple[int, int, bytes]]) -> list[int]:
    fds: list[int] = []
    for level, kind, data in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            ints = array.array('i')
            ints.frombytes(data[:len(data) - len(data) % ints.itemsize])
            fds.extend(ints)
    return fds


def _close_fds(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


def _shared_array(offset: int, dtype: str, shape: tuple[int, ...], writeable: bool) -> np.ndarray:
    """Stand-in for an array in a call's segment: only :class:`CallLoader` builds these."""
    raise pickle.UnpicklingError('a shared-memory array outside a deployment process call')


class CallPickler(pickle.Pickler):
    """Pickle a call with its plain arrays laid out for a segment (:attr:`arrays`, :attr:`spans`, :attr:`size`).

    Each array becomes ``(offset, dtype, shape, writeable)``; its bytes are copied into the segment by the
    caller (:func:`fill`), each :data:`ALIGN`-aligned. A non-contiguous array is made contiguous first.
    """

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=5)
        self.arrays: list[np.ndarray] = []
        self.spans: list[tuple[int, int]] = []
        self.size = 0

    def reducer_override(self, obj: Any) -> Any:
        """A plain array as a reference into the segment; anything else as pickle does it."""
        if type(obj) is not np.ndarray or obj.dtype.kind not in _SHARED_KINDS or obj.dtype.fields is not None:
            return NotImplemented
        flat = np.ascontiguousarray(obj)
        self.arrays.append(flat)
        self.spans.append((self.size, flat.nbytes))
        offset = self.size
        self.size += (flat.nbytes + ALIGN - 1) // ALIGN * ALIGN
        return _shared_array, (offset, obj.dtype.str, obj.shape, bool(obj.flags.writeable))


def encode_call(value: Any) -> tuple[bytes, CallPickler]:
    """Pickle ``value`` with its arrays out of band; return the header and the pickler (its arrays, spans, size)."""
    out = io.BytesIO()
    pickler = CallPickler(out)
    pickler.dump(value)
    return out.getvalue(), pickler


def fill(segment: mmap.mmap, pickler: CallPickler) -> None:
    """Copy the pickled call's arrays into ``segment`` at their offsets."""
    if not pickler.arrays:
        return
    whole = np.frombuffer(segment, np.uint8)
    for arr, (off, n) in zip(pickler.arrays, pickler.spans, strict=True):
        if n:
            whole[off:off + n] = arr.reshape(-1).view(np.uint8)
    del whole


class CallLoader(pickle.Unpickler):
    """Unpickle a call header whose arrays are views of (or, with ``copy``, copies out of) a segment.

    :param header: the pickled call.
    :param segment: the call's segment, or None when it has no arrays.
    :param copy: copy the arrays out (the segment is then free again at once).
    """

    def __init__(self, header: memoryview, segment: mmap.mmap | None, copy: bool) -> None:
        super().__init__(io.BytesIO(header))
        whole = None if segment is None else np.frombuffer(memoryview(segment), np.uint8)
        #: what the call's views keep alive (None: no segment); nothing else references it once they are gone
        self.owner = None if whole is None else whole.base
        self._build = _array_builder(whole, copy)

    def find_class(self, module: str, name: str) -> Any:
        """The segment's array builder for :func:`_shared_array`; any other name as pickle finds it (once).

        A call names the same few classes each time (its input's dataclasses, numpy's): pickle's own lookup
        (an audit hook, the module's import check, a dotted getattr) runs once per name per process.
        """
        if name == '_shared_array' and module == __name__:
            return self._build
        found = _FOUND.get((module, name))
        if found is None:
            found = _FOUND[(module, name)] = super().find_class(module, name)
        return found


def _array_builder(whole: np.ndarray | None, copy: bool) -> Any:
    """``(offset, dtype, shape, writeable) -> array``: a view of ``whole`` (a copy with ``copy``)."""
    def build(offset: int, dtype: str, shape: tuple[int, ...], writeable: bool) -> np.ndarray:
        if whole is None:
            raise pickle.UnpicklingError('an array without a shared-memory segment')
        dt = _DTYPES.get(dtype)
        if dt is None:
            dt = _DTYPES[dtype] = np.dtype(dtype)
        out = np.ndarray(shape, dt, whole, offset)
        if copy:
            out = out.copy()
        if not writeable:
            out.flags.writeable = False
        return out

    return build


_DTYPES: dict[str | bytes, np.dtype] = {}
#: What :meth:`CallLoader.find_class` found, by ``(module, name)``: a deployment process's calls name the same few.
_FOUND: dict[tuple[str, str], Any] = {}


class Segments:
    """The deployment process's side of the shared memory: the segments by id, and which the policy still holds."""

    def __init__(self) -> None:
        self.maps: dict[int, mmap.mmap] = {}
        #: per held segment, the buffer its calls' arrays view (referenced only from here once they are gone)
        self.held: dict[int, Any] = {}
        self._probe: dict[int, Any] = {0: object()}    # a value referenced only from its table, as a free one is

    def parse(self, payload: memoryview, fds: list[int] | collections.deque[int]) -> tuple[Any, int]:
        """Unpickle a call (mapping a new segment, unmapping dropped ones); return its value and its segment id.

        :param fds: the fds received and not yet taken, in the order sent; a call with a new segment takes the
            first (it came with that call's bytes, so it is there).
        """
        seg, flags, size, _, ndropped = _CALL.unpack_from(payload, 0)
        at = _CALL.size
        for k in range(ndropped):
            self._drop(_I32.unpack_from(payload, at + 4 * k)[0])
        at += 4 * ndropped
        if flags & NEW_SEGMENT:
            fd = fds.pop(0) if isinstance(fds, list) else fds.popleft()
            try:
                old = self.maps.pop(seg, None)
                if old is not None:
                    old.close()
                self.maps[seg] = mmap.mmap(fd, size)
            finally:
                os.close(fd)
        copy = bool(flags & COPY)
        loader = CallLoader(payload[at:], self.maps[seg] if seg >= 0 else None, copy)
        value = loader.load()
        if seg >= 0 and not copy:
            self.held[seg] = loader.owner
        return value, seg

    def release(self, seg: int) -> list[int]:
        """After a call of segment ``seg``: the held segments nothing references any more, now free to write again.

        A segment not mapped here (its ``mmap`` failed) is never free: the worker drops it.
        """
        free = [seg] if seg in self.maps and seg not in self.held else []
        if self.held:
            unreferenced = sys.getrefcount(self._probe[0])
            free += [k for k in list(self.held) if sys.getrefcount(self.held[k]) <= unreferenced]
            for k in free:
                self.held.pop(k, None)
        return free

    def _drop(self, seg: int) -> None:
        mapped = self.maps.pop(seg, None)
        self.held.pop(seg, None)
        if mapped is not None:
            try:
                mapped.close()
            except BufferError:   # still viewed (it was never handed back as free): unmapped when collected
                pass


def call_head(segment: int, copy: bool, size: int, dropped: list[int], *, new: bool = False,
              slot: int = NO_SLOT) -> bytes:
    """A call's head: its segment (-1: none), whether to copy its arrays out, the segment's size, dropped segments.

    :param new: the segment is new (its fd goes with the call).
    :param slot: the call's byte in the flags page (:data:`NO_SLOT`: none).
    """
    flags = (COPY if copy else 0) | (NEW_SEGMENT if new else 0)
    return _CALL.pack(segment, flags, size, slot, len(dropped)) + b''.join(_I32.pack(k) for k in dropped)


def call_ids(payload: memoryview) -> tuple[int, int]:
    """A call's segment (-1: none) and slot (:data:`NO_SLOT`: none), read from its head."""
    seg, _, _, slot, _ = _CALL.unpack_from(payload, 0)
    return seg, slot


def parse_reply(payload: memoryview) -> tuple[list[int], tuple[str, Any]]:
    """A reply's released segment ids and its ``(status, value)``.

    A value the worker cannot unpickle (a class it cannot import) is the policy's failure: ``('err', why)``.

    :raises ProtocolError: when the payload is too short for its list of segment ids.
    """
    n = _U32.unpack_from(payload, 0)[0] if len(payload) >= 4 else -1
    if not 0 <= n <= (len(payload) - 4) // 4:
        raise ProtocolError(f'a reply of {len(payload)} bytes that cannot hold its head')
    released = [_I32.unpack_from(payload, 4 + 4 * k)[0] for k in range(n)]
    try:
        body = payload[4 + 4 * n:]
        return released, (_raw_answer(body) if body[:1] == _RAW_MARK else pickle.loads(body))
    except Exception as exc:
        return released, ('err', f'the policy\'s answer cannot be read in the worker: {_describe_safely(exc)}')


def describe_exc(exc: BaseException) -> str:
    """``'Type: message'`` of a policy's exception (the worker shows it to the robot); ours: the message alone."""
    from sequence_ai_ros.exceptions import SequenceAIError

    if isinstance(exc, SequenceAIError):
        return str(exc)
    return ''.join(traceback.format_exception_only(type(exc), exc)).strip()


class Answer:
    """The answer to the call in flight, sent once: by the serve loop, or by a deadline (:meth:`Host.dry_run`).

    :param channel: the socket's :class:`Channel`.
    """

    def __init__(self, channel: Channel) -> None:
        self.channel = channel
        self._lock = threading.Lock()
        self._seq: int | None = None     # the call due an answer; None once answered

    def due(self, seq: int) -> None:
        """The call numbered ``seq`` arrived: it is due one answer."""
        with self._lock:
            self._seq = seq

    def send(self, parts: Sequence[bytes | memoryview]) -> bool:
        """Send the answer of the call due; False when it was answered already (a deadline did).

        :raises OSError: when the worker is gone.
        """
        with self._lock:
            if self._seq is None:
                return False
            seq, self._seq = self._seq, None
            self.channel.send(parts, seq=seq)
        return True


def reply_body(status: str, value: Any) -> bytes:
    """A reply's ``(status, value)``: an ``'ok'`` chunk laid out raw (:func:`_raw_body`), anything else pickled.

    An unpicklable value is the policy's failure (``'err'``).
    """
    if status == 'ok':
        raw = _raw_body(value)
        if raw is not None:
            return raw
    try:
        return pickle.dumps((status, value), protocol=5)
    except Exception as exc:
        return pickle.dumps(('err', _describe_safely(exc)), protocol=5)


#: A reply body's first byte when it is a chunk laid out raw (a pickle's first byte is ``0x80``).
_RAW_MARK = b'R'
#: A raw chunk's head: the mark, a Result (1) or a bare array (0), its ``done``, the dtype (``'<f4'``), ndim.
_RAW_HEAD = struct.Struct('<cBB3sB')
#: The dtype kinds a raw chunk carries (plain numbers; anything else is pickled).
_RAW_KINDS = frozenset('fiub')
_RAW_MAX_NDIM = 4


def _raw_body(value: Any) -> bytes | None:
    """An ``'ok'`` answer of an array or a :class:`Result` of one, as head + shape (u64 each) + bytes; else None.

    Pickling a (30, 26) float32 chunk (and the worker's unpickling, which rebuilds it through numpy's Python
    ``_frombuffer``) cost more than the chunk's bytes: this is the one answer every inference sends.
    """
    result = type(value) is Result
    arr = value.actions if result else value
    if type(arr) is not np.ndarray:
        return None
    dt = arr.dtype
    code = dt.str.encode()
    if dt.kind not in _RAW_KINDS or len(code) != 3 or dt.fields is not None or arr.ndim > _RAW_MAX_NDIM:
        return None
    if result and type(value.done) is not bool:
        return None
    head = _RAW_HEAD.pack(_RAW_MARK, result, result and value.done, code, arr.ndim)
    return b''.join((head, struct.pack(f'<{arr.ndim}Q', *arr.shape), np.ascontiguousarray(arr).tobytes()))


def _raw_answer(body: memoryview) -> tuple[str, Any]:
    """``('ok', value)`` of a :func:`_raw_body`: the array copied out of ``body`` (valid until the next read).

    :raises ValueError: when ``body`` is not one (its sizes disagree).
    """
    _, result, done, code, ndim = _RAW_HEAD.unpack_from(body, 0)
    if ndim > _RAW_MAX_NDIM:
        raise ValueError(f'a raw answer of {ndim} dimensions')
    shape = struct.unpack_from(f'<{ndim}Q', body, _RAW_HEAD.size)
    dt = _DTYPES.get(code)
    if dt is None:
        dt = _DTYPES[code] = np.dtype(code.decode('ascii'))
    at = _RAW_HEAD.size + 8 * ndim
    count = 1
    for n in shape:
        count *= n
    if len(body) - at != count * dt.itemsize:
        raise ValueError(f'a raw answer of shape {shape} {dt} in {len(body) - at} bytes')
    arr = np.frombuffer(body, dt, count, at).reshape(shape).copy() if count else np.empty(shape, dt)
    return 'ok', (Result(arr, bool(done)) if result else arr)


def reply_parts(released: list[int], body: bytes) -> list[bytes]:
    """A reply's parts: the ids of the segments released, then its :func:`reply_body`."""
    return [_U32.pack(len(released)) + b''.join(_I32.pack(k) for k in released), body]


class Host:
    """The policy side: one definition, one instance, the episodes by id.

    :param answer: the serve loop's :class:`Answer` (a dry run's deadline answers through it); None: none.
    """

    def __init__(self, answer: Answer | None = None) -> None:
        self.definition: Any = None
        self.instance: Any = None
        self.episodes: dict[str, Any] = {}
        self.name = ''
        self.answer = answer

    def episode(self, ident: tuple[str, str, str]) -> Any:
        """The Episode of ``(id, instruction, deployment)``, created at its first call."""
        episode = self.episodes.get(ident[0])
        if episode is None:
            episode = self.episodes[ident[0]] = Episode(id=ident[0], instruction=ident[1], deployment=ident[2])
        return episode

    def describe(self, path: str, overrides: dict[str, Any], name: str) -> dict[str, Any]:
        """Import ``path``; return its contract, spec, config, sha256 and artifacts (all picklable)."""
        from sequence_ai_ros.policy.loader import load_policy_file
        from sequence_ai_ros.worker import content

        self.name = name
        self.definition = d = load_policy_file(path, **overrides)
        return {'path': str(d.path), 'spec': d.spec, 'config': d.config, 'contract': d.contract, 'sha256': d.sha256,
                'cls_name': d.cls.__name__, 'artifacts': [str(p) for p in content.artifact_roots(d)]}

    def load(self) -> None:
        """Construct the policy with its config and run its ``load()``; then freeze what exists (:func:`gc.freeze`).

        What a process holds once its policy is loaded (its modules, the model's objects) lives as long as the
        process: frozen, Python's full collections no longer walk it, and they stay a few ms.
        """
        self.instance = self.definition.instantiate()
        load = getattr(self.instance, 'load', None)
        if callable(load):
            load()
        gc.freeze()

    def ping(self) -> None:
        """Answer once the interpreter is up (the worker's deadlines start after it)."""

    def dry_run(self, timeout_s: float | None, said_s: float | None = None) -> dict[str, Any]:
        """``seq deploy``'s fingerprint and dry run (:func:`.validate.fingerprint_and_dry_run`), on this thread.

        The main thread, so that the policy's ``__init__`` and ``load()`` may install signal handlers
        (``signal.signal`` works there only). Past ``timeout_s`` a timer answers the call with the dry run's
        overrun (naming the step that runs) and ends this process, and what the policy started.
        """
        from sequence_ai_ros.worker.validate import fingerprint_and_dry_run

        step = ['constructing the policy']
        timer = None
        if timeout_s is not None and timeout_s > 0 and self.answer is not None:
            timer = threading.Timer(timeout_s, self._overran, args=(step, said_s or timeout_s))
            timer.name = 'seq-dry-run-deadline'
            timer.daemon = True
            timer.start()
        try:
            fp, figures = fingerprint_and_dry_run(self.definition, timeout_s=timeout_s, said_s=said_s, step=step)
        finally:
            if timer is not None:
                timer.cancel()
        return {'figures': figures, 'fingerprint': fp}

    def _overran(self, step: list[str], bound: float) -> None:
        """The dry run's deadline passed: answer with its overrun (unless it just answered), then end."""
        from sequence_ai_ros.worker.validate import overran_words

        assert self.answer is not None
        try:
            self.answer.send(reply_parts([], reply_body('err', overran_words(bound, step[0]))))
        except OSError:
            pass
        _end_and_exit(0)

    def infer(self, inp: Any, ident: tuple[str, str, str]) -> Any:
        """The policy's ``infer`` for one request (a ``policy.infer`` span when the worker traces it)."""
        if tracing.TRACER is None:
            return _plain(self.instance.infer(inp, self.episode(ident)))
        with tracing.policy_span('policy.infer', [getattr(inp, 'trace_context', '')],
                                 {'seq.episode_id': ident[0], 'seq.deployment': ident[2]}):
            return _plain(self.instance.infer(inp, self.episode(ident)))

    def infer_batch(self, inputs: list[Any], idents: list[tuple[str, str, str]]) -> list[Any]:
        """The policy's ``infer_batch``; a request's own failure comes back as a :class:`RemoteFailure`."""
        if tracing.TRACER is None:
            outs = list(self.instance.infer_batch(inputs, [self.episode(i) for i in idents]))
        else:    # one span, under the first traced request, linked to the others
            with tracing.policy_span('policy.infer_batch', [getattr(i, 'trace_context', '') for i in inputs],
                                     {'seq.batch_size': len(inputs), 'seq.deployment': idents[0][2]}):
                outs = list(self.instance.infer_batch(inputs, [self.episode(i) for i in idents]))
        return [RemoteFailure(describe_exc(o)) if isinstance(o, BaseException) else _safe_plain(o) for o in outs]

    def hook(self, method: str, ident: tuple[str, str, str], reason: str) -> None:
        """Run the ``@seq.on_episode`` method for the episode's end; its state is dropped."""
        episode = self.episodes.pop(ident[0], None) or self.episode(ident)
        self.episodes.pop(ident[0], None)   # a hook of an episode never inferred here had none
        episode.reason = reason
        getattr(self.instance, method)(episode)


class RemoteFailure:
    """One request of a batch that failed in the policy process: its ``'Type: message'``."""

    __slots__ = ('text',)

    def __init__(self, text: str) -> None:
        self.text = text

    def __reduce__(self) -> Any:
        return RemoteFailure, (self.text,)


def _plain(out: Any) -> Any:
    """The policy's output as the worker can unpickle it: a Result of arrays, or an array."""
    if isinstance(out, Result):
        return Result(np.asarray(out.actions), bool(out.done))
    return np.asarray(out)


def _safe_plain(out: Any) -> Any:
    try:
        return _plain(out)
    except Exception as exc:
        return RemoteFailure(describe_exc(exc))


def _end_and_exit(code: int) -> None:
    """End every process the policy started (:func:`.descendants.end_descendants`), then exit now with ``code``."""
    descendants.end_descendants()
    os._exit(code)


def resident_bytes(pid: int | str = 'self') -> int:
    """The resident memory of a process (bytes), from ``/proc/<pid>/statm``; 0 where there is none (or it is gone)."""
    try:
        with open(f'/proc/{pid}/statm', 'rb') as statm:
            return int(statm.read().split()[1]) * mmap.PAGESIZE
    except (OSError, ValueError, IndexError):
        return 0


def proportional_bytes(pid: int | str) -> int:
    """A process's proportional set size (bytes), from ``/proc/<pid>/smaps_rollup``; 0 when it is gone.

    Its own pages plus its share of those it shares; its resident memory where the kernel has no rollup.
    """
    try:
        with open(f'/proc/{pid}/smaps_rollup', 'rb') as rollup:
            for line in rollup:
                if line.startswith(b'Pss:'):
                    return int(line.split()[1]) << 10
    except (OSError, ValueError, IndexError):
        pass
    return resident_bytes(pid)


def tree_bytes() -> int:
    """The memory of this process and of every process it started (bytes).

    The sum of their proportional set sizes: pages a forked child shares with its parent count once, and the
    policy's helper processes count too.
    """
    pids: list[int | str] = ['self', *descendants.descendants(os.getpid())]
    return sum(proportional_bytes(pid) for pid in pids)


def _die_with_parent(ppid: int, memory_mb: int = 0) -> None:
    """Exit when the worker is gone (``kill -9`` included), or past ``memory_mb`` of memory (0: no limit).

    The memory is this process's and every process it started (:func:`tree_bytes`). A watchdog thread polls the
    parent pid (and the memory) every :data:`WATCH_PERIOD_S`; either way
    what the policy started ends first. Over the limit, the exit status is :data:`MEMORY_EXIT_CODE`.
    ``PR_SET_PDEATHSIG`` would fire when the worker's *thread* that started this process ends (its loader
    thread), so it is not used.
    """
    limit = memory_mb << 20

    def watch() -> None:
        while os.getppid() == ppid:
            if limit and (rss := tree_bytes()) > limit:
                os.write(2, (f'the deployment process (pid {os.getpid()}) and what it started hold {rss >> 20} MB, '
                             f'over its memory limit of {memory_mb} MB: it exits\n').encode())
                _end_and_exit(MEMORY_EXIT_CODE)
            time.sleep(WATCH_PERIOD_S)
        _end_and_exit(1)

    threading.Thread(target=watch, name='seq-host-watchdog', daemon=True).start()


def _ignore_stop_signals() -> None:
    """SIGINT and SIGTERM do nothing here: the worker ends this process (EOF on its socket, or SIGKILL).

    Ctrl-C in a terminal and a service manager's stop (systemd signals every process of the unit) reach this
    process beside the worker, which then drains: the policy goes on answering until the worker closes it. A
    handler rather than ``SIG_IGN``, so that programs the policy starts get the default actions back.
    """
    def ignore(_signum: int, _frame: object) -> None:
        pass

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, ignore)


def _forget_in_forks(sock: socket.socket) -> None:
    """A copy of this process that the policy forks closes its copy of the socket at once (:func:`serve`).

    So it never reads the worker's calls, nor keeps the socket open once this process has exited (the
    worker would wait for the EOF).
    """
    def forget() -> None:
        global _forked
        _forked = True
        try:
            os.close(sock.detach())
        except OSError:
            pass

    os.register_at_fork(after_in_child=forget)


def _exit_forked() -> None:
    """A forked copy came back from the policy's code: it exits, never answering the worker's call."""
    LOG.warning('a copy of the deployment process forked by the policy (pid %d) returned from the policy; '
                'it exits', os.getpid())
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(0)


def serve(sock: socket.socket, flags: mmap.mmap | None = None) -> None:
    """Answer calls, in the order sent, until the worker closes the socket (a copy forked by the policy answers none).

    :param flags: the flags page (:data:`SLOTS` bytes): an inference whose byte is set is dropped, never started.
    """
    channel = Channel(sock)
    answer = Answer(channel)
    host = Host(answer)
    segments = Segments()
    fds: collections.deque[int] = collections.deque()   # received, each waiting for its call
    while True:
        try:
            payload, more_fds = channel.recv(more=True)
        except ProtocolError as exc:      # the worker's log gets it (stderr): its calls fail as the process ends
            LOG.error('the deployment process stops: what came from the worker is no call: %s', exc)
            return
        except (EOFError, OSError):
            return
        fds.extend(more_fds)
        answer.due(channel.seq)
        seg = -1
        try:
            # the segment is the head's, read before the call is: one that does not unpickle is free again too
            seg, slot = call_ids(payload)
            call, _ = segments.parse(payload, fds)
            command, args, ended = call
            del call
            try:
                if flags is not None and slot < SLOTS and flags[slot]:   # its episode ended: it never starts
                    value, dropped = None, True
                else:
                    value, dropped = getattr(host, command)(*args), False
            finally:       # after the call: a hook is sent along with its own episode's end
                del args
                for eid in ended:
                    host.episodes.pop(eid, None)
            status = 'dropped' if dropped else 'ok'
        except BaseException as exc:      # a policy's failure (SystemExit included) is an answer, not our end
            from sequence_ai_ros.exceptions import ContractViolation

            status = 'contract' if isinstance(exc, ContractViolation) else 'err'   # the robot's fault, typed so
            value = _describe_safely(exc)
        if _forked:                       # a copy the policy forked, back from its code: it answers nothing
            _exit_forked()
        del payload
        body = reply_body(status, value)
        del value                         # before the segments are checked: the answer may view an input
        released = segments.release(seg)
        try:
            answer.send(reply_parts(released, body))
        except OSError:
            return


def _describe_safely(exc: BaseException) -> str:
    try:
        return describe_exc(exc)
    except Exception:
        return f'{type(exc).__name__} (unprintable)'


def main(argv: list[str]) -> int:
    """Entry point: ``policy_host FD PPID [MEMORY_MB [FLAGS_FD [SOURCE_TAG]]]``."""
    if len(argv) > 4 and argv[4] and SOURCE_TAG and argv[4] != SOURCE_TAG:
        os.write(2, (f'this deployment process imported another version of {__file__} than its worker did (the '
                     'package changed on disk since the worker started): restart the worker\n').encode())
        return SKEW_EXIT_CODE
    fd, ppid = int(argv[0]), int(argv[1])
    memory_mb = int(argv[2]) if len(argv) > 2 else 0
    flags = None
    if len(argv) > 3:
        flags_fd = int(argv[3])
        flags = mmap.mmap(flags_fd, SLOTS)
        os.close(flags_fd)
    _ignore_stop_signals()
    descendants.become_subreaper()   # orphans of what the policy starts come here, and end with this process
    _die_with_parent(ppid, memory_mb)
    logging.basicConfig(level=logging.INFO, format='%(asctime)s %(levelname)s [policy %(process)d] %(message)s')
    os.environ.setdefault('OMP_NUM_THREADS', '1')
    os.environ[DEPLOYMENT_PROCESS_ENV] = str(ppid)    # a policy may tell it runs in a deployment process
    os.set_inheritable(fd, False)     # programs the policy starts (os.system included) never hold it
    sock = socket.socket(fileno=fd)
    _forget_in_forks(sock)
    try:
        tracing.configure_from_env('sequence_ai-deployment')   # when the worker traces (seq serve --otlp-endpoint)
    except ConfigError as exc:
        logging.getLogger(__name__).warning('no tracing in this deployment process: %s', exc)
    serve(sock, flags)
    tracing.shutdown()              # the spans still batched
    descendants.end_descendants()   # the worker closed the socket (or died): what the policy started ends too
    return 0


if __name__ == '__main__':     # by its package name, so that what it pickles names this module, not __main__
    from sequence_ai_ros.worker import policy_host

    sys.exit(policy_host.main(sys.argv[1:]))
