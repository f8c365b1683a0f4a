"""The admin API of one replica: the gRPC service ``sequence_ai.v1.Admin`` on the worker's own port.

Beside ``PolicyService`` on the same port (and the proxy socket), never on the probe port
(:mod:`~sequence_ai_ros.worker.probe` serves health alone). ``seq admin`` speaks it
(:mod:`sequence_ai_ros.cli.admin`). Calls:

- ``ListEpisodes``: the episodes running here (id, robot, client, deployment, version, age, requests in flight,
  chunks answered, underruns so far), oldest first, at most :data:`MAX_LISTED`;
- ``Stats``: per deployment and version, episodes live and ended (by reason), chunks answered, underruns;
- ``Drain``: drain this replica and stop it, the path SIGTERM takes (``seq serve``: new episodes refused with
  ``draining``, the live ones finish or are cut at ``--drain-timeout``, then the worker stops);
- ``SetLogLevel``: the worker's log level (the root logger's, as ``--log-level`` sets it);
- ``ListVersions``: the deployment versions loaded here (serving, a rollout's new or old one, a deleted one
  finishing its episodes).

Who may call (:class:`AdminAccess`):

- with a token (``--token-file``): a call carrying it, every call; any other is UNAUTHENTICATED (on a worker
  with ``--anonymous-streams`` too, whose token-less callers may hold episode streams, never the admin API);
- without a token and ``--admin-without-token``: every caller that reaches the port;
- without a token (default): the reads (ListEpisodes, Stats, ListVersions) from this host only (a loopback
  peer on the TCP port: a call through the balancer's proxy socket comes from a robot), Drain and SetLogLevel
  from nobody: PERMISSION_DENIED, naming ``--token-file`` and ``--admin-without-token``.

Every admitted call then takes a token from its caller's bucket (:class:`TokenBuckets`, keyed by
:func:`~sequence_ai_ros.worker.identity.identity`): :data:`ADMIN_BURST` calls at once, then
:data:`ADMIN_RATE_PER_S` a second; past that the call is refused RESOURCE_EXHAUSTED (``[OVERLOADED]``, trailing
metadata ``x-refusal: admin_rate``). At most :data:`MAX_IDENTITIES` buckets are kept (least recently used go).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc

from sequence_ai_ros.exceptions import ContractViolation, Overloaded, PermissionDenied, SequenceAIError, Unauthenticated
from sequence_ai_ros.protocol import AUTH_METADATA, errors
from sequence_ai_ros.protocol import sequence_ai_pb2 as pb
from sequence_ai_ros.protocol.contract import clip
from sequence_ai_ros.worker.auth import authorized
from sequence_ai_ros.worker.config import ServerConfig
from sequence_ai_ros.worker.episode_tally import EndedEpisodes
from sequence_ai_ros.worker.identity import identity
from sequence_ai_ros.worker.logs import LEVELS
from sequence_ai_ros.worker.servicer import client_of, peer_host
from sequence_ai_ros.worker.unary import unary_handler

LOG = logging.getLogger(__name__)

#: The service's full name, from the proto (``sequence_ai.v1.Admin``).
ADMIN_SERVICE = pb.DESCRIPTOR.services_by_name['Admin'].full_name
#: Calls that only read; without a token they answer callers on the worker's host.
READS = frozenset({'ListEpisodes', 'Stats', 'ListVersions'})
#: Calls that change the worker; without a token only ``--admin-without-token`` allows them.
MUTATIONS = frozenset({'Drain', 'SetLogLevel'})
#: Admin calls one identity may make at once (its bucket's size).
ADMIN_BURST = 20
#: Admin calls one identity may make per second once its burst is spent (its bucket's refill).
ADMIN_RATE_PER_S = 5.0
#: Buckets kept (identities); the least recently used one goes first.
MAX_IDENTITIES = 1024
#: Most episodes one ListEpisodes reply lists (its ``total`` counts them all).
MAX_LISTED = 1000
#: The refusal (``x-refusal``) of an admin call past its caller's rate.
RATE_REFUSAL = 'admin_rate'
_LOOPBACK = ('127.', '::1', '::ffff:127.')


class TokenBuckets:
    """A token bucket per key: ``burst`` calls at once, then ``rate_per_s`` a second (any thread).

    :param burst: the bucket's size (>= 1).
    :param rate_per_s: its refill (> 0).
    :param max_keys: buckets kept; the least recently used goes when one more is needed.
    :param clock: monotonic seconds (tests give their own).
    """

    def __init__(self, burst: int = ADMIN_BURST, rate_per_s: float = ADMIN_RATE_PER_S,
                 max_keys: int = MAX_IDENTITIES, clock: Callable[[], float] = time.monotonic) -> None:
        if burst < 1 or not rate_per_s > 0 or max_keys < 1:
            raise ValueError(f'burst >= 1, rate_per_s > 0, max_keys >= 1; got {burst}, {rate_per_s}, {max_keys}')
        self.burst, self.rate_per_s, self.max_keys = burst, float(rate_per_s), max_keys
        self._clock = clock
        self._lock = threading.Lock()
        self._buckets: collections.OrderedDict[str, tuple[float, float]] = collections.OrderedDict()

    def take(self, key: str) -> bool:
        """Take one token from ``key``'s bucket; False (nothing taken) when it is empty."""
        now = self._clock()
        with self._lock:
            tokens, then = self._buckets.pop(key, (float(self.burst), now))
            tokens = min(float(self.burst), tokens + (now - then) * self.rate_per_s)
            allowed = tokens >= 1.0
            self._buckets[key] = (tokens - 1.0 if allowed else tokens, now)
            while len(self._buckets) > self.max_keys:
                self._buckets.popitem(last=False)
            return allowed

    def __len__(self) -> int:
        with self._lock:
            return len(self._buckets)


def _metadata(context: grpc.aio.ServicerContext, key: str) -> str:
    return next((v for k, v in context.invocation_metadata() or () if k == key and isinstance(v, str)), '')


class AdminAccess:
    """Who may make which admin call (see the module's docstring); the caller's identity for its bucket.

    :param config: the worker's settings: ``token``, ``admin_without_token``, ``proxy_socket``.
    """

    def __init__(self, config: ServerConfig) -> None:
        self._token = config.token
        self._open = config.admin_without_token
        self._proxied = config.proxy_socket is not None

    def check(self, method: str, context: grpc.aio.ServicerContext) -> str:
        """Return the caller's identity when it may call ``method``.

        :raises Unauthenticated: with a token, for a call without it.
        :raises PermissionDenied: without a token, for a mutation (unless ``admin_without_token``) or a read
            from another host.
        """
        client = client_of(context, self._proxied)
        if self._token is not None:
            if not authorized(_metadata(context, AUTH_METADATA), self._token):
                raise Unauthenticated(f'the admin API ({method}) needs the worker\'s token: send metadata '
                                      '"authorization: Bearer <token>" (seq admin --token-file)')
            return identity(self._token, True, client)
        if self._open:
            return identity(None, False, client)
        if method in MUTATIONS:
            raise PermissionDenied(f'{method} refused: this worker has no token, so nobody may drain it or change '
                                   'its log level through the admin API; give it --token-file (and seq admin the '
                                   'same file), or run it with --admin-without-token')
        peer = context.peer() or ''
        if peer.startswith('unix:') or not peer_host(peer).startswith(_LOOPBACK):
            raise PermissionDenied(f'{method} refused: this worker has no token, so its admin API answers callers '
                                   f'on its own host only, not {clip(client)}; give it --token-file, or run it with '
                                   '--admin-without-token')
        return identity(None, False, client)


@dataclasses.dataclass
class AdminHooks:
    """What the admin servicer reads and asks of the worker (:class:`~sequence_ai_ros.worker.server.WorkerServer`).

    :param streams: the Episode streams open now (:class:`~sequence_ai_ros.worker.episode_call.EpisodeCallHandler`).
    :param ended: the ended episodes per (deployment, version)
        (:meth:`~sequence_ai_ros.worker.episode_tally.VersionTally.rows`).
    :param versions: the loaded runtimes and their role (``serving``, ``rollout_new``, ``rollout_old``,
        ``deleted``).
    :param drain: ask for a drain and stop as on SIGTERM; False when one was asked already.
    :param draining: True once the worker drains (an admin call or SIGTERM).
    """

    streams: Callable[[], list[Any]]
    ended: Callable[[], dict[tuple[str, int], EndedEpisodes]]
    versions: Callable[[], list[tuple[Any, str]]]
    drain: Callable[[], bool]
    draining: Callable[[], bool]


class AdminServicer:
    """Serve ``sequence_ai.v1.Admin`` (see the module's docstring); its coroutines run on the worker's loop.

    :param hooks: what it reads and asks of the worker.
    :param config: the worker's settings (who may call; ``drain_timeout_s``).
    :param buckets: the per-identity rate bound (default :data:`ADMIN_BURST` / :data:`ADMIN_RATE_PER_S`).
    """

    def __init__(self, hooks: AdminHooks, config: ServerConfig, buckets: TokenBuckets | None = None) -> None:
        self.hooks = hooks
        self.config = config
        self.access = AdminAccess(config)
        self.buckets = buckets if buckets is not None else TokenBuckets()
        #: who answers, ``<host>:<port> pid <pid>`` (the port is set once bound)
        self.replica = f'{socket.gethostname()} pid {os.getpid()}'
        self._started = time.monotonic()

    def bound(self, port: int) -> None:
        """Name the replica by its host, ``port`` and pid in every reply."""
        self.replica = f'{socket.gethostname()}:{port} pid {os.getpid()}'

    async def _admit(self, method: str, context: grpc.aio.ServicerContext) -> None:
        """Abort the call unless its caller may make it (:class:`AdminAccess`) and is within its rate."""
        try:
            who = self.access.check(method, context)
            if not self.buckets.take(who):
                raise Overloaded(f'too many admin calls: at most {self.buckets.burst} at once, then '
                                 f'{self.buckets.rate_per_s:g} a second; retry later', refusal=RATE_REFUSAL)
        except SequenceAIError as exc:
            LOG.debug('admin %s refused: %s', method, exc)
            await context.abort(*errors.abort_details(exc), trailing_metadata=errors.abort_trailers(exc))
        LOG.debug('admin %s from %s', method, who)

    async def ListEpisodes(self, request: pb.ListEpisodesRequest,  # noqa: N802
                           context: grpc.aio.ServicerContext) -> pb.ListEpisodesReply:
        """The episodes running here (of ``request.deployment``), oldest first."""
        await self._admit('ListEpisodes', context)
        now = time.monotonic()
        rows = []
        for stream in self.hooks.streams():
            active = stream.active
            if active is None or active.ended or (request.deployment and stream.runtime.name != request.deployment):
                continue
            rows.append(pb.LiveEpisode(
                episode_id=active.episode.id, robot=active.client_id, client=stream.client,
                deployment=stream.runtime.name, version=max(0, stream.runtime.version),
                age_s=max(0.0, now - active.episode.started), in_flight=active.live.in_flight,
                requests=active.requests, underruns=active.live.underruns, underrun_s=active.live.underrun_s))
        rows.sort(key=lambda row: -row.age_s)
        limit = min(request.limit or MAX_LISTED, MAX_LISTED)
        return pb.ListEpisodesReply(replica=self.replica, episodes=rows[:limit], total=len(rows),
                                    draining=self.hooks.draining())

    async def Stats(self, request: pb.StatsRequest, context: grpc.aio.ServicerContext) -> pb.StatsReply:  # noqa: N802
        """Per deployment and version: episodes live and ended (by reason), chunks answered, underruns."""
        await self._admit('Stats', context)
        versions = await asyncio.get_running_loop().run_in_executor(None, self.hooks.versions)
        rows: dict[tuple[str, int], pb.VersionStats] = {}

        def row(deployment: str, version: int) -> pb.VersionStats:
            if (deployment, version) not in rows:
                rows[(deployment, version)] = pb.VersionStats(deployment=deployment, version=max(0, version))
            return rows[(deployment, version)]

        for runtime, _ in versions:
            row(runtime.name, runtime.version)
        for (deployment, version), ended in self.hooks.ended().items():
            out = row(deployment, version)
            out.episodes_ended = ended.count
            out.ended_by_reason.update(ended.by_reason)
            out.requests += ended.requests
            out.underruns += ended.underruns
            out.underrun_s += ended.underrun_s
        streams = self.hooks.streams()
        for stream in streams:
            active = stream.active
            if active is None or active.ended:
                continue
            out = row(stream.runtime.name, stream.runtime.version)
            out.live_episodes += 1
            out.requests += active.requests
            out.underruns += active.live.underruns
            out.underrun_s += active.live.underrun_s
        listed = [rows[key] for key in sorted(rows) if not request.deployment or key[0] == request.deployment]
        return pb.StatsReply(replica=self.replica, versions=listed, open_streams=len(streams),
                             draining=self.hooks.draining(), uptime_s=time.monotonic() - self._started)

    async def Drain(self, request: pb.DrainRequest, context: grpc.aio.ServicerContext) -> pb.DrainReply:  # noqa: N802
        """Drain this replica and stop it, as SIGTERM does; answers at once."""
        await self._admit('Drain', context)
        already = self.hooks.draining()
        open_now = len(self.hooks.streams())
        asked = self.hooks.drain()
        if asked:
            LOG.warning('admin: drain asked (%d episode streams open): refusing new episodes, then stopping within '
                        '%g s', open_now, self.config.drain_timeout_s)
        return pb.DrainReply(replica=self.replica, already_draining=already or not asked, open_streams=open_now,
                             drain_timeout_s=self.config.drain_timeout_s)

    async def SetLogLevel(self, request: pb.SetLogLevelRequest,  # noqa: N802
                          context: grpc.aio.ServicerContext) -> pb.SetLogLevelReply:
        """Set the root logger's level (``debug``, ``info``, ``warning``, ``error``)."""
        await self._admit('SetLogLevel', context)
        level = request.level.strip().lower()
        if level not in LEVELS:
            exc = ContractViolation(f'log level must be one of {", ".join(LEVELS)}, got {clip(request.level)!r}')
            await context.abort(*errors.abort_details(exc))
        root = logging.getLogger()
        previous = logging.getLevelName(root.level).lower()
        root.setLevel(level.upper())
        LOG.warning('admin: log level %s (was %s)', level, previous)
        return pb.SetLogLevelReply(replica=self.replica, previous=previous, level=level)

    async def ListVersions(self, request: pb.ListVersionsRequest,  # noqa: N802
                           context: grpc.aio.ServicerContext) -> pb.ListVersionsReply:
        """The deployment versions loaded here, with their role, state and running episodes."""
        await self._admit('ListVersions', context)

        def describe() -> list[pb.LoadedVersion]:
            out = []
            for runtime, role in self.hooks.versions():
                ready, _, state, _ = runtime.readiness()
                record = runtime.record
                out.append(pb.LoadedVersion(deployment=runtime.name, version=max(0, runtime.version), role=role,
                                            state=state, ready=ready,
                                            content_sha256=getattr(record, 'content_sha256', '') or '',
                                            live_episodes=len(runtime.running_episodes())))
            return sorted(out, key=lambda v: (v.deployment, v.version))

        versions = await asyncio.get_running_loop().run_in_executor(None, describe)
        return pb.ListVersionsReply(replica=self.replica, versions=versions)


def add_admin_to_server(servicer: AdminServicer, server: grpc.aio.Server) -> None:
    """Register ``servicer`` on ``server`` (a request body that does not decode gets INVALID_ARGUMENT)."""
    handlers: dict[str, grpc.RpcMethodHandler[Any, Any]] = {
        'ListEpisodes': unary_handler(servicer.ListEpisodes, pb.ListEpisodesRequest, pb.ListEpisodesReply),
        'Stats': unary_handler(servicer.Stats, pb.StatsRequest, pb.StatsReply),
        'Drain': unary_handler(servicer.Drain, pb.DrainRequest, pb.DrainReply),
        'SetLogLevel': unary_handler(servicer.SetLogLevel, pb.SetLogLevelRequest, pb.SetLogLevelReply),
        'ListVersions': unary_handler(servicer.ListVersions, pb.ListVersionsRequest, pb.ListVersionsReply),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(ADMIN_SERVICE, handlers),))
    server.add_registered_method_handlers(ADMIN_SERVICE, handlers)
