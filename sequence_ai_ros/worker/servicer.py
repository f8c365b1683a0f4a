"""The gRPC ``PolicyService`` servicer (gRPC asyncio): thin; it resolves the deployment and delegates.

Its coroutines run on the worker's event loop; blocking work (the capture store's SQLite for Label) goes
to the loop's bounded executor.

Fatal errors abort the call with a typed status (``[CODE] message`` details, see
:func:`sequence_ai_ros.protocol.errors.abort_details`); per-request errors travel in-stream
(:mod:`sequence_ai_ros.worker.episode_call`).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import functools
import logging
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from sequence_ai_ros.exceptions import (
    CaptureError,
    Draining,
    Overloaded,
    PermissionDenied,
    ProtocolVersionError,
    Unauthenticated,
    UnknownDeployment,
)
from sequence_ai_ros.protocol import (
    AUTH_METADATA,
    DEPLOYMENT_METADATA,
    DRAINING,
    EPISODE_ID_METADATA,
    LABEL_METADATA,
    LABEL_UNMATCHED,
    errors,
    limits,
    tracing,
)
from sequence_ai_ros.protocol import sequence_ai_pb2 as pb
from sequence_ai_ros.protocol import sequence_ai_pb2_grpc as pb_grpc
from sequence_ai_ros.protocol.contract import PROTOCOL_VERSION, clip
from sequence_ai_ros.worker.auth import authorized
from sequence_ai_ros.worker.boundary import refuse
from sequence_ai_ros.worker.config import ServerConfig
from sequence_ai_ros.worker.drain import Drain, refuse_stream
from sequence_ai_ros.worker.episode_call import EpisodeCallHandler, Undecodable, parse_request
from sequence_ai_ros.worker.episode_tally import VersionTally
from sequence_ai_ros.worker.identity import identity
from sequence_ai_ros.worker.runtime import DeploymentRuntime
from sequence_ai_ros.worker.unary import unary_handler

LOG = logging.getLogger(__name__)


#: metadata a balancer sets to the client's address (HAProxy ``option forwardfor``)
FORWARDED_METADATA = 'x-forwarded-for'


def _metadata(context: grpc.aio.ServicerContext, key: str) -> str:
    for k, v in context.invocation_metadata() or ():
        if k == key and isinstance(v, str):     # bytes only under a ``-bin`` key
            return v
    return ''


def peer_host(peer: str) -> str:
    """Return the address of a gRPC peer string: ``ipv4:1.2.3.4:5`` -> ``1.2.3.4``, ``ipv6:[::1]:5`` -> ``::1``."""
    kind, _, rest = peer.partition(':')
    if kind == 'ipv6' and rest.startswith('['):
        return rest[1:rest.find(']')]
    if kind == 'ipv4':
        return rest.rsplit(':', 1)[0]
    return peer


def client_of(context: grpc.aio.ServicerContext, proxied: bool) -> str:
    """Return the client's address: the last ``x-forwarded-for`` entry of a call through the proxy socket.

    :param proxied: the worker has a proxy socket (``--proxy-socket``); only a call whose peer is a Unix
        socket (it came in through that socket: the TCP port is never one) has its ``x-forwarded-for`` read.
    """
    peer = context.peer() or ''
    if proxied and peer.startswith('unix:'):
        forwarded = _metadata(context, FORWARDED_METADATA).split(',')[-1].strip()
        return forwarded or peer
    return peer_host(peer)


#: The service's full name, from the proto (``sequence_ai.v1.PolicyService``).
SERVICE = pb.DESCRIPTOR.services_by_name['PolicyService'].full_name


def add_to_server(servicer: PolicyServicer, server: grpc.aio.Server) -> None:
    """Register ``servicer`` on ``server``: the generated handlers, except the Episode stream's deserializer.

    Episode requests are parsed by :func:`~sequence_ai_ros.worker.episode_call.parse_request`, which also
    hands over each request's size on the wire, so the contract's size limit costs no re-encoding. A unary
    request body that does not decode gets INVALID_ARGUMENT ([CONTRACT_VIOLATION], :mod:`.unary`), never UNKNOWN.
    """
    handlers: dict[str, grpc.RpcMethodHandler[Any, Any]] = {
        'Handshake': unary_handler(servicer.Handshake, pb.HandshakeRequest, pb.HandshakeReply),
        'Ready': unary_handler(servicer.Ready, pb.ReadyRequest, pb.ReadyReply),
        'Episode': grpc.stream_stream_rpc_method_handler(
            servicer.Episode, request_deserializer=parse_request,
            response_serializer=pb.EpisodeReply.SerializeToString),
        'Label': unary_handler(servicer.Label, pb.LabelRequest, pb.LabelReply),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    server.add_registered_method_handlers(SERVICE, handlers)


class PolicyServicer(pb_grpc.PolicyServiceServicer):
    """Serve the deployments in ``runtimes``.

    :param runtimes: deployment name -> runtime.
    :param config: the worker's settings: ``idle_timeout_s``, ``start_timeout_s``, ``token`` (already
        enforced by the interceptor; a Handshake that also carries one in its body must carry the same),
        ``max_streams`` (one more stream is refused with OVERLOADED at once), ``max_streams_per_client`` and
        ``proxy_socket`` (admission: one client cannot take every slot), ``anonymous_streams`` (with a
        token: the slots callers without it may hold; the rest is headroom kept for token holders).
    """

    def __init__(self, runtimes: dict[str, DeploymentRuntime], config: ServerConfig) -> None:
        self.runtimes = runtimes
        self.config = config
        self.max_streams = config.max_streams
        self.idle_timeout_s = config.idle_timeout_s
        self.token = config.token
        self._streams_lock = threading.Lock()
        self._streams: set[EpisodeCallHandler] = set()
        #: open streams per (client, anonymous): a client's token and token-less streams are capped apart
        self._per_client: collections.Counter[tuple[str, bool]] = collections.Counter()
        self._anonymous = 0
        #: called with the refusal's reason ('max_streams', 'anonymous', 'per_client') when a stream is refused
        self.on_refused: Any = None
        #: called before each lookup: retires deployments deleted from the registry (``seq delete``)
        self.before_lookup: Callable[[], None] | None = None
        #: called (blocking, on the executor) before an episode starts: False when its deployment was deleted
        self.before_start: Callable[[DeploymentRuntime], bool] | None = None
        #: set on SIGTERM: new episodes are refused (``draining``) while the open ones finish
        self.drain = Drain(self.open_streams)
        #: the ended episodes per deployment version, for the admin API (:mod:`~sequence_ai_ros.worker.admin`)
        self.tally = VersionTally()
        #: where the streams decode JPEG/PNG frames (the worker's ``seq-decode``); None: the loop's executor
        self.decoder: concurrent.futures.Executor | None = None
        #: where the streams write capture (the worker's ``seq-capture``); None: the loop's executor
        self.capture_io: concurrent.futures.Executor | None = None

    def _runtime(self, name: str, context: grpc.aio.ServicerContext, body_token: str = '') -> DeploymentRuntime:
        """The runtime serving ``name`` ('' with one deployment: that one).

        :raises UnknownDeployment: naming what is served to a caller with the token (or any caller of a worker
            without one); a caller without it (``--anonymous-streams``) is not told the names.
        """
        if self.before_lookup is not None:
            self.before_lookup()
        if not name and len(self.runtimes) == 1:
            return next(iter(self.runtimes.values()))
        runtime = self.runtimes.get(name)
        if runtime is None:
            if self.token is None or self._authenticated(context) or body_token == self.token:
                raise UnknownDeployment(f'deployment {clip(name)!r} is not served here; serving '
                                        f'{sorted(self.runtimes)}')
            raise UnknownDeployment(f'deployment {clip(name)!r} is not served here (the served names are told to '
                                    'callers with the token)')
        return runtime

    async def Handshake(self, request: pb.HandshakeRequest, context: grpc.aio.ServicerContext) -> pb.HandshakeReply:  # noqa: N802
        """Check version (and body token), name the deployment, start warming, answer the contract.

        A draining replica refuses it: OVERLOADED with the refusal ``draining`` in the trailing metadata (the
        client's :class:`~sequence_ai_ros.exceptions.Draining`, which it retries: a balancer sends the retry
        to another replica); nothing is loaded or counted.
        """
        try:
            if request.protocol_version != PROTOCOL_VERSION:
                raise ProtocolVersionError(f'this worker speaks {PROTOCOL_VERSION}, the client sent '
                                           f'{clip(request.protocol_version) or "(none)"!r}')
            limits.check_handshake(request)
            if self.token is not None and request.token and request.token != self.token:
                raise Unauthenticated('the handshake carries a wrong token')
            runtime = self._runtime(request.deployment, context, request.token)
            draining = self.drain.refusal()
            if draining is not None:
                raise draining
        except Exception as exc:
            if isinstance(exc, limits.LimitViolation):
                refuse(None, exc)
            await context.abort(*errors.abort_details(exc), trailing_metadata=errors.abort_trailers(exc))
        runtime.usage.add(sessions=1)
        runtime.ensure_loading()
        ready, eta, _, _ = runtime.readiness()
        LOG.info('handshake %s from %s (ready=%s)', runtime.name, request.client_id or context.peer(), ready)
        return pb.HandshakeReply(contract=runtime.contract.to_proto(ready=ready, eta_seconds=eta))

    async def Ready(self, request: pb.ReadyRequest, context: grpc.aio.ServicerContext) -> pb.ReadyReply:  # noqa: N802
        """Answer (ready, eta) without blocking; asking while cold starts the load.

        A draining replica answers not ready, state ``draining`` (its message says so): it takes no new episode.
        """
        try:
            runtime = self._runtime(request.deployment, context)
        except (UnknownDeployment, limits.LimitViolation) as exc:
            await context.abort(*errors.abort_details(exc))
        draining = self.drain.refusal()
        if draining is not None:
            return pb.ReadyReply(ready=False, eta_seconds=0.0, state=DRAINING, message=str(draining))
        runtime.ensure_loading()
        ready, eta, state, message = runtime.readiness()
        return pb.ReadyReply(ready=ready, eta_seconds=eta, state=state, message=message)

    async def Episode(self, request_iterator: AsyncIterator[pb.EpisodeRequest],  # noqa: N802
                      context: grpc.aio.ServicerContext) -> AsyncIterator[pb.EpisodeReply]:
        """Serve one episode (see :mod:`sequence_ai_ros.worker.episode_call`)."""
        try:
            runtime = self._runtime(_metadata(context, DEPLOYMENT_METADATA), context)
            limits.check_id(_metadata(context, EPISODE_ID_METADATA), 'episode_id')
        except (UnknownDeployment, limits.LimitViolation) as exc:
            await context.abort(*errors.abort_details(exc))
        client = client_of(context, self.config.proxy_socket is not None)
        anonymous = self.token is not None and not self._authenticated(context)
        stream = EpisodeCallHandler(runtime, _metadata(context, EPISODE_ID_METADATA), self.idle_timeout_s,
                                    self.config.start_timeout_s, client, before_start=self.before_start,
                                    start_refusal=self._start_refusal,
                                    owner=identity(self.token, not anonymous, client),
                                    traceparent=_metadata(context, tracing.TRACEPARENT), decoder=self.decoder,
                                    capture_io=self.capture_io)
        refused = DRAINING if self.drain.draining else self._admit(stream, (client, anonymous))
        if refused:   # a typed refusal in the stream (drain.py: a balancer resets an aborted call)
            if self.on_refused is not None:
                self.on_refused(refused)
            error = self.drain.refusal() or Overloaded(self._refusal(refused, client, anonymous), refusal=refused)
            async for reply in refuse_stream(request_iterator, error, self.config.start_timeout_s):
                yield reply
            return

        try:
            async for reply in stream.replies(request_iterator):
                yield reply
        except Undecodable as exc:   # bytes that are not an EpisodeRequest: the call fails with a status
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f'[CONTRACT_VIOLATION] {exc}')
        finally:
            stream.on_done()
            self._release(stream, (client, anonymous))
            active = stream.active
            if active is not None:   # not ended yet: on_done ends it as a disconnect
                self.tally.ended(runtime.name, runtime.version, active.episode.reason or 'disconnect',
                                 active.requests, active.live)

    def _start_refusal(self) -> Draining | None:
        """The refusal of an EpisodeStart on a stream admitted before the drain began (counted), or None."""
        refusal = self.drain.refusal()
        if refusal is not None and self.on_refused is not None:
            self.on_refused(DRAINING)
        return refusal

    def _authenticated(self, context: grpc.aio.ServicerContext) -> bool:
        """True when the call carries ``authorization: Bearer <token>``.

        The scheme in any case, the token in constant time (:func:`~sequence_ai_ros.worker.auth.authorized`).
        """
        return self.token is not None and authorized(_metadata(context, AUTH_METADATA), self.token)

    def _admit(self, stream: EpisodeCallHandler, key: tuple[str, bool]) -> str:
        """Take a slot for ``stream`` of ``key`` = (client, anonymous); return '' or the refusal's reason.

        Anonymous streams (a token is set, the call does not carry it) hold at most ``anonymous_streams``
        slots, so ``max_streams - anonymous_streams`` stay for token holders; the per-client cap counts a
        client's anonymous and token streams apart.
        """
        cap = self.config.max_streams_per_client
        with self._streams_lock:
            refused = ('max_streams' if len(self._streams) >= self.max_streams else
                       'anonymous' if key[1] and self._anonymous >= self.config.anonymous_streams else
                       'per_client' if cap and self._per_client[key] >= cap else '')
            if not refused:
                self._streams.add(stream)
                self._per_client[key] += 1
                self._anonymous += key[1]
        return refused

    def _release(self, stream: EpisodeCallHandler, key: tuple[str, bool]) -> None:
        with self._streams_lock:
            if stream in self._streams:
                self._streams.discard(stream)
                self._anonymous -= key[1]
                self._per_client[key] -= 1
                if self._per_client[key] <= 0:
                    del self._per_client[key]

    def _refusal(self, reason: str, client: str, anonymous: bool) -> str:
        if reason == 'max_streams':
            return f'this worker already serves {self.max_streams} episode streams (max_streams); retry later'
        if reason == 'anonymous':
            kept = self.max_streams - self.config.anonymous_streams
            return (f'the {self.config.anonymous_streams} episode streams open to callers without the token are '
                    f'taken (anonymous_streams); {kept} are kept for token holders: send metadata '
                    '"authorization: Bearer <token>"')
        return (f'client {clip(client)} already holds {self.config.max_streams_per_client} episode streams'
                f'{" without the token" if anonymous else ""} (max_streams_per_client); end one first')

    async def Label(self, request: pb.LabelRequest, context: grpc.aio.ServicerContext) -> pb.LabelReply:  # noqa: N802
        """Store (success, notes) for an episode in this worker's store; ok=False (why) when it cannot.

        It cannot when capture is off for the deployment or the store cannot be written.

        Only the identity that ran an episode labels it (:mod:`~sequence_ai_ros.worker.identity`: the token's
        with a token, else the client's address): another one is refused PERMISSION_DENIED
        (:class:`~sequence_ai_ros.exceptions.PermissionDenied`), and so is every caller without the token on a
        worker with one (``anonymous_streams``), whose episodes nobody labels.

        An episode this worker never ran is labelled too (its replica was stopped and the balancer sent the
        call here; or a mistyped id), with the labeller's identity: the reply says so, in its message and in the
        trailing metadata ``x-label: unmatched`` (:data:`~sequence_ai_ros.protocol.LABEL_METADATA`), which the
        client reports to its caller; the stores merge labels by episode id at export and stats when the
        episode's owner gave them, and an export lists the labels no store ran. One identity holds at most
        :data:`~sequence_ai_ros.capture.store.UNSEEN_LABELS_PER_OWNER` such labels per store (and as many
        bytes as :data:`~sequence_ai_ros.capture.store.UNSEEN_LABEL_BYTES_PER_OWNER`); past that it is refused
        OVERLOADED (:class:`~sequence_ai_ros.exceptions.Overloaded`, refusal ``unseen_labels``). Each refusal
        counts in ``seq_labels_refused_total{deployment,reason}``.
        """
        try:
            limits.check_label(request)
            runtime = self._runtime(request.deployment, context)
        except (UnknownDeployment, limits.LimitViolation) as exc:
            await context.abort(*errors.abort_details(exc))
        anonymous = self.token is not None and not self._authenticated(context)
        store = runtime.capture_store
        if store is None and not anonymous:
            return pb.LabelReply(ok=False, message=f'capture is off for deployment {runtime.name!r}: episode '
                                                   f'{clip(request.episode_id)!r} was not captured, the label is not '
                                                   'stored')
        try:
            if anonymous or store is None:
                raise PermissionDenied(f'label of episode {clip(request.episode_id)!r} refused: a caller without the '
                                       'token labels no episode; send metadata "authorization: Bearer <token>"')
            owner = identity(self.token, True, client_of(context, self.config.proxy_socket is not None))
            known = await asyncio.get_running_loop().run_in_executor(
                None, functools.partial(store.label, request.episode_id, request.success, request.notes, owner=owner))
        except (PermissionDenied, Overloaded) as exc:
            reason = 'anonymous' if anonymous else 'not_owner' if isinstance(exc, PermissionDenied) else 'unseen_bound'
            runtime.metrics.label_refused(runtime.name, reason)
            LOG.info('label of %s refused (%s): %s', clip(request.episode_id), reason, exc)
            await context.abort(*errors.abort_details(exc), trailing_metadata=errors.abort_trailers(exc))
        except (CaptureError, ValueError) as exc:
            return pb.LabelReply(ok=False, message=f'label of episode {clip(request.episode_id)!r} not stored: '
                                                   f'{clip(str(exc), 300)}')
        what = f'episode {clip(request.episode_id)!r} labelled {"success" if request.success else "failure"}'
        if not known:   # its replica was unreachable (the balancer sent the label to this one), or a wrong id
            what += (' (this worker did not run it: the label is kept here and merged by episode id when the '
                     'replicas\' stores are exported or counted together, --store per store; an export lists '
                     'a label no store ran)')
            context.set_trailing_metadata(((LABEL_METADATA, LABEL_UNMATCHED),))
        return pb.LabelReply(ok=True, message=what)

    def open_streams(self, deployment: str | None = None) -> int:
        """Return the number of Episode streams open now (of ``deployment`` only, when given)."""
        with self._streams_lock:
            if deployment is None:
                return len(self._streams)
            return sum(1 for stream in self._streams if stream.runtime.name == deployment)

    def episode_streams(self) -> list[EpisodeCallHandler]:
        """Return the Episode streams open now (started episodes or not), for the admin API."""
        with self._streams_lock:
            return list(self._streams)

    def shutdown_streams(self, reason: str = 'shutdown', runtime: Any = None) -> int:
        """Tell open episode streams to end (``reason``: ``shutdown``, ``drain_timeout``, ``rollout``) and close.

        :param runtime: only the streams served by this runtime (a deployment's version); None: every stream.
        :returns: how many streams were told.
        """
        with self._streams_lock:
            streams = [s for s in self._streams if runtime is None or s.runtime is runtime]
        for stream in streams:
            stream.shutdown(reason)
        return len(streams)
