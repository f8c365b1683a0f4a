"""The deployment process: imports, loads and runs one policy for the worker (``--isolation process``).

The worker (:mod:`sequence_ai_ros.worker.policy_process`) starts ``python -m sequence_ai_ros.worker.policy_host
FD PPID`` with one end of a Unix socket pair as ``FD``, and talks to it one call at a time:

- a call is a frame: ``u32 length`` then ``u32 header length``, the header (a protocol-5 pickle of
  ``(command, arguments, ended episode ids)`` whose arrays are *out of band*), ``u32 n`` and ``n`` pairs
  ``(u64 offset, u64 length)`` locating each array's bytes in the shared memory (a ``memfd`` the worker
  maps too and hands over with ``SCM_RIGHTS`` when it grows). Observations' images and states are
  therefore never pickled: the worker copies their bytes into the shared memory once, this process
  copies them out once (the policy may keep them);
- a reply is a frame holding a plain pickle of ``('ok', value)`` or ``('err', 'Type: message')``:
  action chunks are small.

Commands: ``describe`` (import the file; answer what the worker needs without importing it), ``load``
(construct with the config and call ``load()``), ``infer``, ``infer_batch``, ``hook`` (the
``@seq.on_episode`` method), ``dry_run`` (``seq deploy``'s checks). Episodes live here, one
:class:`~sequence_ai_ros.policy.api.Episode` (with its ``state``) per id, dropped when the worker names
them ended.

The process dies with the worker (a watchdog on its parent pid, and at EOF on the socket), so a worker killed
with ``kill -9`` leaves no policy behind. Nothing here imports gRPC.
"""

from __future__ import annotations

import logging
import mmap
import os
import pickle
import socket
import struct
import sys
import traceback
from typing import Any

_U32 = struct.Struct('<I')
_PAIR = struct.Struct('<QQ')
#: Alignment of each array in the shared memory (bytes).
ALIGN = 64
LOG = logging.getLogger('sequence_ai_ros.worker.policy_host')
#: Set in a deployment process to the worker's pid.
DEPLOYMENT_PROCESS_ENV = 'SEQ_DEPLOYMENT_PROCESS'


def recv_exact(sock: socket.socket, n: int, into: bytearray | None = None) -> bytearray:
    """Read exactly ``n`` bytes from ``sock``.

    :raises EOFError: when the peer closed first.
    """
    buf = into if into is not None else bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:n])
        if not k:
            raise EOFError('the peer closed the connection')
        got += k
    return buf


def send_frame(sock: socket.socket, payload: bytes) -> None:
    """Send one frame: its length (u32), then ``payload``."""
    sock.sendall(_U32.pack(len(payload)) + payload)


def recv_frame(sock: socket.socket) -> bytearray:
    """Read one frame's payload (see :func:`send_frame`)."""
    (n,) = _U32.unpack(recv_exact(sock, 4))
    return recv_exact(sock, n)


def encode_call(value: Any) -> tuple[bytes, list[pickle.PickleBuffer]]:
    """Pickle ``value`` with its (contiguous) arrays out of band; return the header and the buffers."""
    buffers: list[pickle.PickleBuffer] = []
    header = pickle.dumps(value, protocol=5, buffer_callback=buffers.append)
    return header, buffers


def layout(buffers: list[pickle.PickleBuffer]) -> tuple[list[tuple[int, int]], int]:
    """Offsets and lengths of ``buffers`` laid out in the shared memory (each :data:`ALIGN`-aligned), and the size."""
    spans, at = [], 0
    for b in buffers:
        n = b.raw().nbytes
        spans.append((at, n))
        at += (n + ALIGN - 1) // ALIGN * ALIGN
    return spans, at


def call_frame(header: bytes, spans: list[tuple[int, int]]) -> bytes:
    """The frame payload of a call: header length, header, the spans."""
    return b''.join((_U32.pack(len(header)), header, _U32.pack(len(spans)), *(_PAIR.pack(*s) for s in spans)))


def parse_call(payload: bytearray, shm: mmap.mmap | None) -> Any:
    """Unpickle a call, its arrays copied out of the shared memory (writable, owned by this process)."""
    (hlen,) = _U32.unpack_from(payload, 0)
    header = memoryview(payload)[4:4 + hlen]
    (n,) = _U32.unpack_from(payload, 4 + hlen)
    at = 8 + hlen
    view = memoryview(shm) if shm is not None and n else None
    buffers = []
    for k in range(n):
        off, length = _PAIR.unpack_from(payload, at + k * _PAIR.size)
        assert view is not None
        buffers.append(bytearray(view[off:off + length]))
    return pickle.loads(header, buffers=buffers)


def describe_exc(exc: BaseException) -> str:
    """``'Type: message'`` of a policy's exception (the worker shows it to the robot); ours: the message alone."""
    from sequence_ai_ros.exceptions import SequenceAIError

    if isinstance(exc, SequenceAIError):
        return str(exc)
    return ''.join(traceback.format_exception_only(type(exc), exc)).strip()


class Host:
    """The policy side: one definition, one instance, the episodes by id."""

    def __init__(self) -> None:
        self.definition: Any = None
        self.instance: Any = None
        self.episodes: dict[str, Any] = {}
        self.name = ''

    def episode(self, ident: tuple[str, str, str]) -> Any:
        """The Episode of ``(id, instruction, deployment)``, created at its first call."""
        from sequence_ai_ros.policy.api import Episode

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
        """Construct the policy with its config and run its ``load()``."""
        self.instance = self.definition.instantiate()
        load = getattr(self.instance, 'load', None)
        if callable(load):
            load()

    def ping(self) -> None:
        """Answer once the interpreter is up (the worker's deadlines start after it)."""

    def dry_run(self, timeout_s: float | None, said_s: float | None = None) -> dict[str, Any]:
        """``seq deploy``'s fingerprint and dry run (:func:`~sequence_ai_ros.worker.validate.dry_run`)."""
        from sequence_ai_ros.exceptions import DeploymentError
        from sequence_ai_ros.worker import content
        from sequence_ai_ros.worker.registry import _blank
        from sequence_ai_ros.worker.validate import dry_run

        d = self.definition
        fp = content.fingerprint(d)        # before the dry run: what it validates is what is recorded
        figures = dry_run(d, timeout_s=timeout_s, said_s=said_s)
        blank = _blank(d)
        blank.content_sha256, blank.config_sha256, blank.files, blank.artifact_roots = (
            fp.content_sha256, fp.config_sha256, fp.files, fp.roots)
        if content.changes(d, blank):
            raise DeploymentError(f'{d.path}: its files changed during the dry run; deploy again')
        return {'figures': figures, 'fingerprint': fp}

    def infer(self, inp: Any, ident: tuple[str, str, str]) -> Any:
        """The policy's ``infer`` for one request."""
        return _plain(self.instance.infer(inp, self.episode(ident)))

    def infer_batch(self, inputs: list[Any], idents: list[tuple[str, str, str]]) -> list[Any]:
        """The policy's ``infer_batch``; a request's own failure comes back as a :class:`RemoteFailure`."""
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
    import numpy as np

    from sequence_ai_ros.policy.api import Result

    if isinstance(out, Result):
        return Result(np.asarray(out.actions), bool(out.done))
    return np.asarray(out)


def _safe_plain(out: Any) -> Any:
    try:
        return _plain(out)
    except Exception as exc:
        return RemoteFailure(describe_exc(exc))


def _die_with_parent(ppid: int) -> None:
    """Exit when the worker is gone (``kill -9`` included): a watchdog thread polls the parent pid.

    ``PR_SET_PDEATHSIG`` would fire when the worker's *thread* that started this process ends (its loader
    thread), so it is not used.
    """
    import threading
    import time

    def watch() -> None:
        while os.getppid() == ppid:
            time.sleep(0.25)
        os._exit(1)

    threading.Thread(target=watch, name='seq-host-watchdog', daemon=True).start()


def serve(sock: socket.socket) -> None:
    """Answer calls until the worker closes the socket."""
    host = Host()
    shm: mmap.mmap | None = None
    while True:
        try:
            first, fds, _, _ = socket.recv_fds(sock, 4, 1)
        except OSError:
            return
        if not first:
            return
        if fds:                           # the shared memory (re)mapped: a grown segment
            if shm is not None:
                shm.close()
            shm = mmap.mmap(fds[0], os.fstat(fds[0]).st_size)
            os.close(fds[0])
        try:
            head = recv_exact(sock, 4 - len(first), bytearray(4 - len(first))) if len(first) < 4 else bytearray()
            (n,) = _U32.unpack(bytes(first) + bytes(head))
            payload = recv_exact(sock, n)
        except EOFError:
            return
        if n == 0:                        # a bare shared-memory hand-over
            continue
        try:
            command, args, ended = parse_call(payload, shm)
            try:
                value = getattr(host, command)(*args)
            finally:       # after the call: a hook is sent along with its own episode's end
                for eid in ended:
                    host.episodes.pop(eid, None)
            reply = pickle.dumps(('ok', value), protocol=5)
        except BaseException as exc:      # a policy's failure (SystemExit included) is an answer, not our end
            from sequence_ai_ros.exceptions import ContractViolation

            status = 'contract' if isinstance(exc, ContractViolation) else 'err'   # the robot's fault, typed so
            try:
                reply = pickle.dumps((status, describe_exc(exc)), protocol=5)
            except Exception:
                reply = pickle.dumps(('err', f'{type(exc).__name__} (unprintable)'), protocol=5)
        try:
            send_frame(sock, reply)
        except OSError:
            return


def main(argv: list[str]) -> int:
    """Entry point: ``policy_host FD PPID``."""
    fd, ppid = int(argv[0]), int(argv[1])
    _die_with_parent(ppid)
    logging.basicConfig(level=logging.INFO, format='%(asctime)s %(levelname)s [policy %(process)d] %(message)s')
    os.environ.setdefault('OMP_NUM_THREADS', '1')
    os.environ[DEPLOYMENT_PROCESS_ENV] = str(ppid)    # a policy may tell it runs in a deployment process
    sock = socket.socket(fileno=fd)
    serve(sock)
    return 0


if __name__ == '__main__':     # by its package name, so that what it pickles names this module, not __main__
    from sequence_ai_ros.worker import policy_host

    sys.exit(policy_host.main(sys.argv[1:]))
