"""The gRPC ``PolicyService`` servicer: thin; it resolves the deployment and delegates.

Fatal errors abort the call with a typed status (``[CODE] message`` details, see
:func:`sequence_ai_ros.protocol.errors.abort_details`); per-request errors travel in-stream
(:mod:`sequence_ai_ros.worker.episode_stream`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator

import grpc

from sequence_ai_ros.exceptions import (
    CaptureError,
    Overloaded,
    ProtocolVersionError,
    Unauthenticated,
    UnknownDeployment,
)
from sequence_ai_ros.protocol import DEPLOYMENT_METADATA, EPISODE_ID_METADATA, errors
from sequence_ai_ros.protocol import sequence_ai_pb2 as pb
from sequence_ai_ros.protocol import sequence_ai_pb2_grpc as pb_grpc
from sequence_ai_ros.protocol.contract import PROTOCOL_VERSION, clip
from sequence_ai_ros.worker.episode_stream import EpisodeStream
from sequence_ai_ros.worker.runtime import DeploymentRuntime

LOG = logging.getLogger(__name__)


def _metadata(context: grpc.ServicerContext, key: str) -> str:
    for k, v in context.invocation_metadata() or ():
        if k == key:
            return v
    return ''


class PolicyServicer(pb_grpc.PolicyServiceServicer):
    """Serve the deployments in ``runtimes``.

    :param runtimes: deployment name -> runtime.
    :param idle_timeout_s: an episode with no message for this long ends (s).
    :param token: the worker's token (already enforced by the interceptor); a Handshake that also
        carries one in its body must carry the same.
    :param max_streams: most Episode streams open at once; one more is refused with OVERLOADED at once,
        so that the handler pool keeps threads for Handshake, Ready, Label and health.
    """

    def __init__(self, runtimes: dict[str, DeploymentRuntime], idle_timeout_s: float,
                 token: str | None = None, max_streams: int = 256) -> None:
        self.runtimes = runtimes
        self.max_streams = max_streams
        self.idle_timeout_s = idle_timeout_s
        self.token = token
        self._streams_lock = threading.Lock()
        self._streams: set[EpisodeStream] = set()
        #: called before each lookup: retires deployments deleted from the registry (``seq delete``)
        self.before_lookup: Callable[[], None] | None = None

    def _runtime(self, name: str) -> DeploymentRuntime:
        if self.before_lookup is not None:
            self.before_lookup()
        if not name and len(self.runtimes) == 1:
            return next(iter(self.runtimes.values()))
        runtime = self.runtimes.get(name)
        if runtime is None:
            raise UnknownDeployment(f'deployment {clip(name)!r} is not served here; serving {sorted(self.runtimes)}')
        return runtime

    def Handshake(self, request: pb.HandshakeRequest, context: grpc.ServicerContext) -> pb.HandshakeReply:  # noqa: N802
        """Check version (and body token), name the deployment, start warming, answer the contract."""
        try:
            if request.protocol_version != PROTOCOL_VERSION:
                raise ProtocolVersionError(f'this worker speaks {PROTOCOL_VERSION}, the client sent '
                                           f'{clip(request.protocol_version) or "(none)"!r}')
            if self.token is not None and request.token and request.token != self.token:
                raise Unauthenticated('the handshake carries a wrong token')
            runtime = self._runtime(request.deployment)
        except Exception as exc:
            context.abort(*errors.abort_details(exc))
        runtime.usage.add(sessions=1)
        runtime.ensure_loading()
        ready, eta, _, _ = runtime.readiness()
        LOG.info('handshake %s from %s (ready=%s)', runtime.name, request.client_id or context.peer(), ready)
        return pb.HandshakeReply(contract=runtime.contract.to_proto(ready=ready, eta_seconds=eta))

    def Ready(self, request: pb.ReadyRequest, context: grpc.ServicerContext) -> pb.ReadyReply:  # noqa: N802
        """Answer (ready, eta) without blocking; asking while cold starts the load."""
        try:
            runtime = self._runtime(request.deployment)
        except UnknownDeployment as exc:
            context.abort(*errors.abort_details(exc))
        runtime.ensure_loading()
        ready, eta, state, message = runtime.readiness()
        return pb.ReadyReply(ready=ready, eta_seconds=eta, state=state, message=message)

    def Episode(self, request_iterator: Iterator[pb.EpisodeRequest],  # noqa: N802
                context: grpc.ServicerContext) -> Iterator[pb.EpisodeReply]:
        """Serve one episode (see :mod:`sequence_ai_ros.worker.episode_stream`)."""
        try:
            runtime = self._runtime(_metadata(context, DEPLOYMENT_METADATA))
        except UnknownDeployment as exc:
            context.abort(*errors.abort_details(exc))
        stream = EpisodeStream(runtime, _metadata(context, EPISODE_ID_METADATA), self.idle_timeout_s)
        with self._streams_lock:
            full = len(self._streams) >= self.max_streams
            if not full:
                self._streams.add(stream)
        if full:
            context.abort(*errors.abort_details(Overloaded(
                f'this worker already serves {self.max_streams} episode streams (max_streams); retry later')))

        def done() -> None:
            stream.on_done()
            with self._streams_lock:
                self._streams.discard(stream)

        context.add_callback(done)
        yield from stream.replies(request_iterator)

    def Label(self, request: pb.LabelRequest, context: grpc.ServicerContext) -> pb.LabelReply:  # noqa: N802
        """Store (success, notes) with a captured episode; ok=False with the reason otherwise."""
        try:
            runtime = self._runtime(request.deployment)
        except UnknownDeployment as exc:
            context.abort(*errors.abort_details(exc))
        store = runtime.capture_store
        if store is None:
            return pb.LabelReply(ok=False, message=f'capture is off for deployment {runtime.name!r}: episode '
                                                   f'{clip(request.episode_id)!r} was not captured, the label is not '
                                                   'stored')
        try:
            store.label(request.episode_id, request.success, request.notes)
        except (LookupError, CaptureError, ValueError) as exc:
            return pb.LabelReply(ok=False, message=f'label of episode {clip(request.episode_id)!r} not stored: '
                                                   f'{clip(str(exc), 300)}')
        return pb.LabelReply(ok=True, message=f'episode {clip(request.episode_id)!r} labelled '
                                              f'{"success" if request.success else "failure"}')

    def shutdown_streams(self) -> None:
        """Tell every open episode stream to end (reason ``shutdown``) and close."""
        with self._streams_lock:
            streams = list(self._streams)
        for stream in streams:
            stream.shutdown()
