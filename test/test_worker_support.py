"""Helpers for the worker tests (no tests here): a raw gRPC episode stream on the generated stub."""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from pathlib import Path

import grpc
import numpy as np

from sequence_ai_ros.protocol import PROTOCOL_VERSION, codec
from sequence_ai_ros.protocol import sequence_ai_pb2 as pb
from sequence_ai_ros.protocol import sequence_ai_pb2_grpc as pb_grpc

POLICIES = Path(__file__).resolve().parent / 'policies'
_END = object()


def channel(port: int) -> grpc.Channel:
    return grpc.insecure_channel(f'127.0.0.1:{port}')


def handshake(stub: pb_grpc.PolicyServiceStub, deployment: str, *, version: str = PROTOCOL_VERSION,
              metadata=None) -> pb.Contract:
    return stub.Handshake(pb.HandshakeRequest(deployment=deployment, protocol_version=version, client_id='test'),
                          metadata=metadata, timeout=5).contract


def wait_ready(stub: pb_grpc.PolicyServiceStub, deployment: str, timeout: float = 10.0, metadata=None) -> pb.ReadyReply:
    deadline = time.monotonic() + timeout
    while True:
        reply = stub.Ready(pb.ReadyRequest(deployment=deployment), metadata=metadata, timeout=5)
        if reply.ready or reply.state == 'failed' or time.monotonic() > deadline:
            return reply
        time.sleep(0.02)


class Stream:
    """One Episode stream: ``send`` requests, ``recv`` replies with a timeout; ``cancel`` drops it."""

    def __init__(self, stub: pb_grpc.PolicyServiceStub, deployment: str, episode_id: str, metadata=()) -> None:
        self._out: queue.Queue = queue.Queue()
        self._in: queue.Queue = queue.Queue()
        md = [('x-episode-id', episode_id), ('x-deployment', deployment), *metadata]
        self.call = stub.Episode(self._requests(), metadata=md)
        self.episode_id = episode_id
        self.error: grpc.RpcError | None = None
        self._thread = threading.Thread(target=self._read, name=f'test-stream-{episode_id}', daemon=True)
        self._thread.start()

    def _requests(self):
        while True:
            item = self._out.get()
            if item is _END:
                return
            yield item

    def _read(self) -> None:
        try:
            for reply in self.call:
                self._in.put(reply)
        except grpc.RpcError as exc:
            self.error = exc
        finally:
            self._in.put(_END)

    def send(self, **kind) -> None:
        self._out.put(pb.EpisodeRequest(**kind))

    def recv(self, timeout: float = 30.0):
        """Return the next reply, or None when the stream ended (bounded: generous for a loaded machine)."""
        item = self._in.get(timeout=timeout)
        return None if item is _END else item

    def start(self, instruction: str = 'test') -> pb.EpisodeReply:
        self.send(start=pb.EpisodeStart(episode_id=self.episode_id, instruction=instruction))
        return self.recv()

    def ask(self, req: pb.ObservationRequest) -> pb.EpisodeReply:
        self.send(observation=req)
        return self.recv()

    def end(self, reason: str = 'completed') -> pb.EpisodeReply:
        self.send(end=pb.EpisodeEnd(reason=reason))
        return self.recv()

    def close(self) -> None:
        self._out.put(_END)

    def cancel(self) -> None:
        self.call.cancel()
        self._thread.join(timeout=5)


def state_request(request_id: int, state, names, *, episode_id: str = '', images=(), history=(), params=None,
                  instruction: str = '') -> pb.ObservationRequest:
    return pb.ObservationRequest(
        episode_id=episode_id, request_id=request_id, instruction=instruction, robot_time_s=time.monotonic(),
        state=codec.to_tensor(np.asarray(state, np.float32)), state_names=list(names), images=list(images),
        history=list(history), params=params or {})


def wait_for(predicate, timeout: float = 30.0, what: str = 'condition'):
    """Return ``predicate()`` once truthy; AssertionError after ``timeout`` s (generous: a loaded machine)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f'timed out after {timeout} s waiting for {what}')


@contextlib.contextmanager
def serving(path, deployment: str, *, isolation: str = 'process', timeout: float = 60.0, **config):
    """A worker serving ``path`` as ``deployment`` on 127.0.0.1 (a free port), ready; yields (server, stub, runtime).

    ``config``: further :func:`~sequence_ai_ros.worker.serve_policy_file` settings (``inference_timeout_s``, ...).
    """
    from sequence_ai_ros.worker import serve_policy_file

    server = serve_policy_file(path, deployment=deployment, host='127.0.0.1', port=0, isolation=isolation, **config)
    ch = channel(server.port)
    try:
        stub = pb_grpc.PolicyServiceStub(ch)
        assert wait_ready(stub, deployment, timeout=timeout).ready
        yield server, stub, server.runtimes[deployment]
    finally:
        ch.close()
        server.stop(grace=0.5)
