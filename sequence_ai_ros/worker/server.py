"""Server factory: :func:`create_server` (registered deployments) and :func:`serve_policy_file` (one file).

Both take a :class:`~sequence_ai_ros.worker.config.ServerConfig` (or its fields as keywords) and return a
:class:`WorkerServer` with ``.port`` and ``.stop(grace)``. The server binds 127.0.0.1 by
default, serves ``sequence_ai.v1.PolicyService``, the admin API ``sequence_ai.v1.Admin``
(:mod:`~sequence_ai_ros.worker.admin`: its own access rules and rate bound) and the standard
``grpc.health.v1.Health`` service
(``''`` is SERVING while the server runs; each deployment is NOT_SERVING until its policy is ready), sets
the max receive size from the contracts' ``max_message_bytes`` and keepalive options. With a ``token``,
an interceptor fails every call (health included) without ``authorization: Bearer <token>`` metadata
with UNAUTHENTICATED. With ``tls=(cert, key)`` it serves TLS. Health is bounded on every port
(:mod:`~sequence_ai_ros.worker.health_service`: names, Watch streams and their idle limit); a caller without
the token (``anonymous_streams``, the probe port) is told the worker's readiness, never a deployment's own.

Health of a deployment follows its readiness: NOT_SERVING while cold or warming, and for good once its
load or an inference exceeds its deadline (checked on every call and by housekeeping every 10 s).

Threads: ``seq-grpc-loop`` runs the gRPC asyncio server (every call, every open Episode stream: a coroutine
each, no thread per stream); ``seq-io`` is its executor, a fixed pool of :data:`IO_THREADS` for blocking work
(SQLite, episode starts and ends; an episode's hook is awaited on the loop itself); ``seq-capture``, a fixed
pool of :data:`CAPTURE_THREADS`, writes capture files (apart, so that a slow capture disk holds no uncaptured
robot); ``seq-decode``, a fixed pool of :data:`DECODE_THREADS`, decodes JPEG/PNG frames (apart, so that nothing
waiting on ``seq-io`` delays a round trip); the per-deployment threads of
:mod:`sequence_ai_ros.worker.runtime`; ``seq-housekeeping`` (usage flush every 10 s, capture retention at
start and hourly); served from a registry, ``seq-live`` (:mod:`~sequence_ai_ros.worker.live`: which
deployments have episodes running, for ``seq delete``) and, for a deployment ``seq delete`` removed,
``seq-retire-<name>`` until its running episodes ended; with ``agent_port``, ``seq-agent``; with
``metrics_port``, prometheus_client's HTTP thread; after an admin Drain of an embedded worker,
``seq-admin-drain`` (drain, then stop). With ``probe_port``, a second plaintext gRPC server on the same loop
serves the health service alone (:mod:`~sequence_ai_ros.worker.probe`, with its own stream, message and
connection caps), for probes that send no token and no TLS. The thread count does not grow with open streams,
and nothing grown by a burst is kept. All are stopped by :meth:`WorkerServer.stop`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sequence_ai_ros.exceptions import ConfigError, DeploymentError, Unauthenticated
from sequence_ai_ros.home import usage_file
from sequence_ai_ros.malloc_tuning import tune_malloc
from sequence_ai_ros.policy.loader import PolicyDefinition, load_policy_file
from sequence_ai_ros.protocol import AUTH_METADATA, errors, messages
from sequence_ai_ros.protocol.contract import receive_limit
from sequence_ai_ros.worker.admin import AdminHooks, AdminServicer, add_admin_to_server
from sequence_ai_ros.worker.auth import authorized
from sequence_ai_ros.worker.capture_hook import open_store
from sequence_ai_ros.worker.config import ServerConfig, field_names
from sequence_ai_ros.worker.drain import DRAIN_TIMEOUT_REASON, DrainRequest
from sequence_ai_ros.worker.grpc_bounds import HANDSHAKE_TIMEOUT_MS, KEEPALIVE_OPTIONS
from sequence_ai_ros.worker.health_agent import HealthAgent
from sequence_ai_ros.worker.health_service import BoundedHealthServicer, HealthStatuses, Trusted
from sequence_ai_ros.worker.live import LiveFile
from sequence_ai_ros.worker.metrics import MetricsSink, PrometheusMetrics
from sequence_ai_ros.worker.probe import start_probe_server
from sequence_ai_ros.worker.registry import Registry
from sequence_ai_ros.worker.rollout import Rollouts
from sequence_ai_ros.worker.runtime import DeploymentRuntime
from sequence_ai_ros.worker.servicer import PolicyServicer, add_to_server
from sequence_ai_ros.worker.usage import Usage, UsageMeter

LOG = logging.getLogger(__name__)
#: Default idle timeout of an episode (s); kept for importers, defined by :class:`ServerConfig`.
DEFAULT_IDLE_TIMEOUT_S = ServerConfig.idle_timeout_s
USAGE_FLUSH_S = 10.0
#: Bound (s) on the wait for cut episode streams to send their end, after a drain timeout.
CUT_WAIT_S = 2.0
RETENTION_EVERY_S = 3600.0
#: Default cap of concurrently open Episode streams; kept for importers, defined by :class:`ServerConfig`.
DEFAULT_MAX_STREAMS = ServerConfig.max_streams
#: Handler threads kept free of episode streams for unary calls and health (the threaded server of earlier
#: versions; kept for importers: gRPC asyncio needs no headroom).
UNARY_HEADROOM = 16
#: Threads of the event loop's executor (SQLite, episode starts and ends, metrics and health answers): a fixed
#: bound, whatever the number of open streams.
IO_THREADS = 8
#: Threads that write capture (``seq-capture``: each request and telemetry, a captured episode's commit): apart
#: from ``seq-io``, so that a slow capture disk holds only captured robots, never another deployment's episode
#: starts and ends, the metrics endpoint or the balancer's health agent.
CAPTURE_THREADS = 8
#: Threads that decode JPEG/PNG frames (``seq-decode``): apart from ``seq-io``, so that what waits there (a wave
#: of episode ends, a slow capture disk) never holds another robot's frames on the round trip.
DECODE_THREADS = 8


def raise_open_files_limit() -> int:
    """Raise this process's soft RLIMIT_NOFILE to its hard limit (every connection and stream costs one); return it.

    A soft limit of 1,024 (a common default) is exhausted by ~1,000 silent TCP connections; the hard limit
    is usually far higher and needs no privilege to reach.
    """
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:
            LOG.warning('cannot raise the open files limit from %d to %d: %s', soft, target, exc)
    return soft


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """Fail every call whose metadata lacks ``authorization: Bearer <token>`` with UNAUTHENTICATED.

    The scheme is matched in any case, the token in constant time (:func:`~sequence_ai_ros.worker.auth.authorized`).

    :param allow_anonymous: let calls with no ``authorization`` metadata at all pass (the servicer then keeps
        them to ``anonymous_streams`` slots); a wrong token still fails.
    """

    def __init__(self, token: str, *, allow_anonymous: bool = False) -> None:
        if not token:
            raise ConfigError('the token must not be empty')
        self._token = token
        self._allow_anonymous = allow_anonymous

    async def intercept_service(self, continuation: Any, details: grpc.HandlerCallDetails) -> Any:
        """Pass authenticated calls on; answer the others with an aborting handler of the same kind."""
        got = next((v for k, v in details.invocation_metadata or () if k == AUTH_METADATA), '')
        handler = await continuation(details)
        if authorized(got, self._token) or handler is None or (self._allow_anonymous and not got):
            return handler
        status, message = errors.abort_details(Unauthenticated(
            'missing or wrong token: send metadata "authorization: Bearer <token>"' if got else
            'this worker needs a token: send metadata "authorization: Bearer <token>"'))

        async def deny(requests: Any, context: grpc.aio.ServicerContext) -> Any:
            await context.abort(status, message)

        # A request-streaming handler, whatever the method's kind: gRPC calls it before reading any request, so
        # a caller without the token is refused before its message (up to the main port's receive cap) is read
        # and held. The caller sees the same UNAUTHENTICATED either way.
        factory = (grpc.stream_stream_rpc_method_handler if handler.response_streaming
                   else grpc.stream_unary_rpc_method_handler)
        return factory(deny, request_deserializer=handler.request_deserializer,
                       response_serializer=handler.response_serializer)


def _health_trust(token: str | None) -> Trusted:
    """Who sees each deployment's own health on the main port: every caller without a token, else token holders.

    A caller without the token reaches the health service only through ``--anonymous-streams`` (the
    :class:`TokenInterceptor` fails a wrong one); it gets the probe port's tokenless view.
    """
    if token is None:
        return lambda context: True
    expected = token

    def trusted(context: grpc.aio.ServicerContext) -> bool:
        got = next((v for k, v in context.invocation_metadata() or () if k == AUTH_METADATA), '')
        return authorized(got, expected)

    return trusted


def _read_pem(value: str | bytes | Path) -> bytes:
    if isinstance(value, bytes):
        return value
    return Path(value).expanduser().read_bytes()


class WorkerLoop:
    """The worker's event loop, run by the thread ``seq-grpc-loop``, with its executors (``seq-*`` threads).

    Every gRPC call and Episode stream runs on :attr:`loop`; blocking work goes to the loop's executor, a fixed
    pool of :data:`IO_THREADS` threads, capture writes to :attr:`capture` (:data:`CAPTURE_THREADS`) and frame
    decoding to :attr:`decoder` (:data:`DECODE_THREADS`). Started at construction; :meth:`close` stops it and
    sets :attr:`closed`.
    """

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=IO_THREADS, thread_name_prefix='seq-io')
        self.loop.set_default_executor(self._executor)
        #: decodes the robots' JPEG/PNG frames, on the round trip: nothing else runs there
        self.decoder = concurrent.futures.ThreadPoolExecutor(max_workers=DECODE_THREADS,
                                                             thread_name_prefix='seq-decode')
        #: writes capture files: a slow capture disk holds nothing but captured robots
        self.capture = concurrent.futures.ThreadPoolExecutor(max_workers=CAPTURE_THREADS,
                                                             thread_name_prefix='seq-capture')
        self._thread = threading.Thread(target=self.loop.run_forever, name='seq-grpc-loop', daemon=True)
        self._thread.start()
        #: set once the loop is stopped and closed
        self.closed = threading.Event()

    def run(self, coroutine: Any, timeout: float | None = 30.0) -> Any:
        """Run ``coroutine`` on the loop and wait for its result (from any other thread).

        :raises concurrent.futures.TimeoutError: past ``timeout`` s.
        """
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def send(self, coroutine: Any) -> None:
        """Schedule ``coroutine`` on the loop without waiting (applied in order); dropped once the loop is closed."""
        if self.loop.is_closed():
            coroutine.close()
        else:
            asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    def close(self) -> None:
        """Stop the loop (timed join of its thread), close it, let the executor go, set :attr:`closed`."""
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5.0)
        if not self.loop.is_running():
            self.loop.close()
        self._executor.shutdown(wait=False)
        self.decoder.shutdown(wait=False)
        self.capture.shutdown(wait=False)
        self.closed.set()


class RegistryWatch:
    """The $SEQ_HOME registry a worker serves from, and whether deployments.json changed since the last look.

    :param registry: the registry.
    """

    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        self._mtime: int | None = None

    def changed(self) -> dict[str, Any] | None:
        """The registered records by name when deployments.json changed since the last call, else None.

        Cheap when nothing changed (one ``stat``). A file that is gone gives no records; one being rewritten
        (unreadable) gives None and is read again at the next call.
        """
        try:
            mtime = self.registry.file.stat().st_mtime_ns
        except OSError:
            mtime = -1
        if mtime == self._mtime:
            return None
        self._mtime = mtime
        try:
            return {r.name: r for r in self.registry.list()} if mtime != -1 else {}
        except Exception as exc:  # a registry being rewritten: look again at the next lookup
            LOG.debug('registry unreadable: %s', exc)
            self._mtime = None
            return None


class RetiredRuntimes:
    """Deleted deployments' runtimes whose policy is not unloaded yet (their running episodes go on; any thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._runtimes: list[DeploymentRuntime] = []

    def add(self, runtime: DeploymentRuntime) -> None:
        """Hold ``runtime`` until it is taken back."""
        with self._lock:
            self._runtimes.append(runtime)

    def names(self) -> list[str]:
        """The held runtimes' deployment names."""
        with self._lock:
            return [r.name for r in self._runtimes]

    def all(self) -> list[DeploymentRuntime]:
        """The held runtimes."""
        with self._lock:
            return list(self._runtimes)

    def take(self, runtime: DeploymentRuntime) -> bool:
        """Let go of ``runtime``; False when it was not held (already taken)."""
        with self._lock:
            if runtime not in self._runtimes:
                return False
            self._runtimes.remove(runtime)
            return True

    def take_all(self) -> list[DeploymentRuntime]:
        """Let go of every held runtime and return them."""
        with self._lock:
            taken, self._runtimes = self._runtimes, []
            return taken


class WorkerServer:
    """A running worker: ``.port``, ``.probe_port`` (None: off), ``.address``, ``.stop(grace)``, ``.usage()``.

    A context manager.

    :param runtimes: deployment name -> runtime (closed here when the server cannot start).
    :param config: how to serve; default :meth:`ServerConfig.embedded`.
    :param registry: the $SEQ_HOME registry the deployments came from: a deployment ``seq delete`` removes
        from it stops being served, metered and captured (None: embedded, nothing to watch).
    :param settings: :class:`ServerConfig` fields overriding ``config``.
    :raises ConfigError: for an invalid setting or a port that cannot be bound.
    """

    def __init__(self, runtimes: dict[str, DeploymentRuntime], config: ServerConfig | None = None, *,
                 registry: Registry | None = None, **settings: Any) -> None:
        tune_malloc()   # per-request image buffers: no mmap/munmap per call (SEQ_MALLOC_TUNING=0: off)
        raise_open_files_limit()
        try:
            config = _config(config, settings)
        except BaseException:
            for runtime in runtimes.values():
                runtime.close(timeout=1.0)
            raise
        self.config = config
        self.runtimes = runtimes
        self._stop = threading.Event()
        self._stopped = False
        self._io = WorkerLoop()
        #: a drain asked through the admin API: by default a thread drains and stops; ``seq serve`` takes it
        #: the SIGTERM path (:meth:`DrainRequest.handle_with`)
        self.drain_request = DrainRequest(self._drain_and_stop)
        #: the admin API (``sequence_ai.v1.Admin``) on the worker's port
        self.admin = AdminServicer(AdminHooks(streams=lambda: self.servicer.episode_streams(),
                                              ended=lambda: self.servicer.tally.rows(),
                                              versions=self.loaded_versions, drain=self.drain_request.ask,
                                              draining=lambda: self.servicer.drain.draining), config)
        try:
            self._server, self.servicer, self.health = self._run(self._build(config))
        except BaseException:
            for runtime in runtimes.values():
                runtime.close(timeout=1.0)
            self._io.close()
            raise
        self.host = config.host
        self.tls = config.tls is not None
        self._watch = RegistryWatch(registry) if registry is not None else None
        self._retire_lock = threading.Lock()   # one look at the registry at a time
        self._retired = RetiredRuntimes()
        self._live: LiveFile | None = None
        self._rollouts: Rollouts | None = None
        if registry is not None:
            self.servicer.before_lookup = self.retire_deleted
        for runtime in runtimes.values():
            runtime.on_state_change = self._on_state
            runtime.loop = self._io.loop
            self._on_state(runtime)
        self.metrics: MetricsSink = MetricsSink()
        self.metrics_port: int | None = None
        if config.metrics_port is not None:
            try:
                self.metrics = PrometheusMetrics(runtimes, self.servicer.open_streams, config.host,
                                                 config.metrics_port, token=config.token)
            except BaseException:
                for runtime in runtimes.values():
                    runtime.close(timeout=1.0)
                self._io.close()
                raise
            self.metrics_port = self.metrics.port
            self.servicer.on_refused = self.metrics.refused
            for runtime in runtimes.values():
                runtime.metrics = self.metrics
        self._run(self._server.start())
        if config.proxy_socket is not None:
            os.chmod(config.proxy_socket, 0o600)
        self._run(self.health.set('', health_pb2.HealthCheckResponse.SERVING))
        self._probe_server: grpc.aio.Server | None = None
        self.probe_port: int | None = None
        if config.probe_port is not None:   # plaintext health only, for kubelet (no metadata, no TLS)
            try:
                self._probe_server, self.probe_port = self._run(start_probe_server(self.health, config.host,
                                                                                   config.probe_port))
            except BaseException:
                self._abandon_start(runtimes.values())
                raise
        self.agent: HealthAgent | None = None
        if config.agent_port is not None:
            local = '127.0.0.1' if config.host in ('0.0.0.0', '::', '') else config.host
            creds = (grpc.ssl_channel_credentials(_read_pem(config.tls[0])) if config.tls is not None else None)
            try:
                self.agent = HealthAgent(f'{local}:{self.port}', lambda: sorted(self.runtimes), config.host,
                                         config.agent_port, token=config.token, credentials=creds)
            except BaseException:
                self._abandon_start(runtimes.values())
                raise
        self._housekeeping = threading.Thread(target=self._housekeep, name='seq-housekeeping', daemon=True)
        self._housekeeping.start()
        if registry is not None:   # seq delete reads which deployments have episodes running
            self._live = LiveFile(registry.home, self._live_names, self.servicer.open_streams)
            self.servicer.before_start = self._before_start
            self._rollouts = Rollouts(self.runtimes, self._load_version, self._next_runtime, self._adopt, self._stop,
                                      mode=config.rollout,
                                      cut=lambda runtime, reason: self.servicer.shutdown_streams(reason, runtime),
                                      held=lambda: self.servicer.drain.draining,
                                      failed=lambda name: self.metrics.rollout_failed(name))
        if config.warm:
            for runtime in runtimes.values():
                runtime.ensure_loading()
        LOG.info('serving %s on %s:%d%s', sorted(runtimes), self.host, self.port, ' (TLS)' if self.tls else '')
        if config.token is None and config.host not in ('127.0.0.1', 'localhost', '::1'):
            LOG.warning('serving on %s without --token-file: anyone who can reach this port may hold streams, '
                        'run the policy and label its data; give the worker a token off-host', config.host)

    def _run(self, coroutine: Any, timeout: float | None = 30.0) -> Any:
        """Run ``coroutine`` on the worker's event loop and wait for its result (from any other thread)."""
        return self._io.run(coroutine, timeout)

    def _abandon_start(self, runtimes: Iterable[DeploymentRuntime]) -> None:
        """Undo a start that failed once the gRPC server was started: the side ports, the server, metrics, runtimes."""
        if self._probe_server is not None:
            self._run(self._probe_server.stop(0))
        self._run(self._server.stop(0))
        self.metrics.close()
        for runtime in runtimes:
            runtime.close(timeout=1.0)
        self._io.close()

    async def _build(self, config: ServerConfig) -> tuple[grpc.aio.Server, PolicyServicer, HealthStatuses]:
        # The transport accepts 4x the largest contract's request, so that an oversized observation gets a
        # typed in-stream CONTRACT_VIOLATION (checked per request against its own contract) instead of a
        # transport error that kills the stream, and at least MIN_RECEIVE_BYTES: the robot packs its telemetry
        # (camera frames of cameras no contract declares) within receive_limit of its contract, never more.
        max_bytes = receive_limit(max(r.max_message_bytes for r in self.runtimes.values()))
        options = [('grpc.max_receive_message_length', max_bytes),
                   ('grpc.max_send_message_length', messages.MAX_CHUNK_BYTES),
                   ('grpc.so_reuseport', 0), ('grpc.server_handshake_timeout_ms', HANDSHAKE_TIMEOUT_MS),
                   *KEEPALIVE_OPTIONS]
        interceptors = ([TokenInterceptor(config.token, allow_anonymous=config.anonymous_streams > 0)]
                        if config.token is not None else [])
        # gRPC asyncio: an open stream costs a coroutine, not a thread. The servicer refuses streams past
        # max_streams (OVERLOADED), and unary calls and health always answer.
        server = grpc.aio.server(options=options, interceptors=interceptors)
        servicer = PolicyServicer(self.runtimes, config)
        servicer.decoder = self._io.decoder
        servicer.capture_io = self._io.capture
        add_to_server(servicer, server)
        add_admin_to_server(self.admin, server)   # the probe port (probe.py) serves health alone
        statuses = HealthStatuses()   # health_service: names bounded, Watch capped and ended when idle
        health_pb2_grpc.add_HealthServicer_to_server(BoundedHealthServicer(statuses, _health_trust(config.token)),
                                                     server)
        address = f'{config.host}:{config.port}'
        try:
            if config.tls is not None:
                creds = grpc.ssl_server_credentials([(_read_pem(config.tls[1]), _read_pem(config.tls[0]))])
                self.port = server.add_secure_port(address, creds)
            else:
                self.port = server.add_insecure_port(address)
        except RuntimeError as exc:   # grpc: "Failed to bind to address ..." (bad host, port in use)
            raise ConfigError(f'cannot bind {address} (--host/--port): {exc}') from None
        if not self.port:
            raise ConfigError(f'cannot bind {address} (--host/--port)')
        self.admin.bound(self.port)
        if config.proxy_socket is not None:
            self._bind_proxy_socket(server, Path(config.proxy_socket))
        return server, servicer, statuses

    @staticmethod
    def _bind_proxy_socket(server: grpc.aio.Server, path: Path) -> None:
        """Listen on the balancer's Unix socket (insecure: it never leaves the host), owner-only."""
        if path.exists() or path.is_symlink():
            if not path.is_socket():
                raise ConfigError(f'--proxy-socket {path}: exists and is not a socket')
            path.unlink()              # a previous worker's
        old = os.umask(0o177)          # created 0600: only this user (and its balancer) may connect
        try:
            if not server.add_insecure_port(f'unix:{path}'):
                raise ConfigError(f'cannot bind the proxy socket {path} (--proxy-socket)')
        except RuntimeError as exc:
            raise ConfigError(f'cannot bind the proxy socket {path} (--proxy-socket): {exc}') from None
        finally:
            os.umask(old)

    @property
    def address(self) -> str:
        """``host:port`` as a client dials it."""
        return f'{self.host}:{self.port}'

    def retire_deleted(self) -> list[str]:
        """Stop serving, metering and capturing the deployments ``seq delete`` removed from the registry.

        Cheap when nothing changed (one ``stat`` of deployments.json); called before each deployment lookup,
        so the next Handshake or episode of a deleted deployment gets UNKNOWN_DEPLOYMENT, and its usage row
        and capture directory are not re-created. A deployment deleted and registered again since the last
        look (its record is not the served one's: a lower version, or the same version deployed at another
        time) was deleted all the same: it is retired too, never served as the new registration's version.
        A retired deployment's policy is unloaded once its running episodes (``seq delete --force``) ended.

        :returns: the names retired by this call.
        """
        if self._watch is None:
            return []
        with self._retire_lock:
            records = self._watch.changed()
            if records is None:
                return []
            gone = [name for name, runtime in list(self.runtimes.items())
                    if name not in records or not _same_lineage(records[name], runtime)]
            for name in gone:
                runtime = self.runtimes.pop(name)
                runtime.on_state_change = None
                runtime.usage.retire()
                if runtime.capture_store is not None:
                    runtime.capture_store.retire()
                self._set_health(name, health_pb2.HealthCheckResponse.SERVICE_UNKNOWN)
                if name in records:
                    LOG.info('deployment %s was deleted and registered again: no longer served (restart the worker '
                             'to serve the new registration)', name)
                else:
                    LOG.info('deployment %s was deleted: no longer served', name)
                self._retire(runtime)
            if self._rollouts is not None:   # a version registered while serving (seq deploy again)
                self._rollouts.check({name: rec.version for name, rec in records.items()})
            return gone

    def loaded_versions(self) -> list[tuple[DeploymentRuntime, str]]:
        """The deployment versions loaded here and their role, for the admin API (any thread).

        ``serving`` (the version robots get), ``rollout_new`` (a version a rollout loads before it serves it),
        ``rollout_old`` (an older version a rollout keeps until its episodes end), ``deleted`` (``seq delete
        --force`` removed it; it finishes its episodes).
        """
        serving = dict(self.runtimes)
        out = [(runtime, 'serving') for runtime in serving.values()]
        for runtime in self._rollouts.held() if self._rollouts is not None else ():
            current = serving.get(runtime.name)
            if runtime is current:     # a switch in progress: served already
                continue
            out.append((runtime, 'rollout_new' if current is None or runtime.version > current.version
                        else 'rollout_old'))
        out += [(runtime, 'deleted') for runtime in self._retired.all()]
        return out

    def _live_names(self) -> list[str]:
        """The deployments the live file counts streams of: the served ones, and deleted ones still running."""
        return [*self.runtimes, *self._retired.names()]

    def _before_start(self, runtime: DeploymentRuntime) -> bool:
        """Before an episode of ``runtime`` starts: list its stream in the live file, then look at the registry.

        In this order, ``seq delete`` either sees the episode (and refuses without ``--force``) or has removed the
        deployment before it starts (False: the start is refused, UNKNOWN_DEPLOYMENT).
        """
        if self._live is not None:
            self._live.update()
        self.retire_deleted()
        return self.runtimes.get(runtime.name) is not None

    def _retire(self, runtime: DeploymentRuntime) -> None:
        """Unload a deleted deployment's policy once its running episodes ended (``seq-retire-<name>``).

        Its metrics go then too, once the episodes of every version of it ended: during a rollout, an old
        version (held by the rollout, unloaded by it) may still run episodes, whose ends count under the
        deployment's name.
        """
        def running() -> bool:
            return bool(runtime.running_episodes()) or (
                self._rollouts is not None and self._rollouts.running_episodes(runtime.name) > 0)

        def close_when_idle() -> None:
            while running():
                if self._stop.wait(0.2):
                    return              # the worker stops: stop() closes it
            if not self._retired.take(runtime):
                return
            runtime.close()
            self.metrics.forget(runtime.name)    # its series go (counters too): it is never served again here
            LOG.info('deployment %s: deleted version %d unloaded', runtime.name, runtime.version)

        self._retired.add(runtime)
        threading.Thread(target=close_when_idle, name=f'seq-retire-{runtime.name}', daemon=True).start()

    def _load_version(self, name: str) -> tuple[Any, PolicyDefinition]:
        """The registry's validated import of ``name``'s current version, as at start (``--isolation``'s importer)."""
        assert self._watch is not None
        return self._watch.registry.load(name, importer(self.config, name))

    def _next_runtime(self, rec: Any, definition: PolicyDefinition, old: DeploymentRuntime) -> DeploymentRuntime:
        """The runtime of a new version of ``old``'s deployment: same usage meter and capture store, cold."""
        runtime = DeploymentRuntime(old.name, rec.version, definition, old.usage, capture_store=old.capture_store,
                                    max_pending=self.config.max_pending,
                                    inference_timeout_s=self.config.inference_timeout_s,
                                    load_timeout_s=self.config.load_timeout_s, eta_hint_s=rec.load_s or None,
                                    record=rec)
        runtime.metrics = self.metrics
        runtime.loop = self._io.loop
        return runtime

    def _adopt(self, runtime: DeploymentRuntime) -> None:
        """Serve ``runtime`` from now on (a rollout's new version): its health, state callbacks and gauges."""
        runtime.on_state_change = self._on_state
        self.metrics.track(runtime)
        self._on_state(runtime)

    def _on_state(self, runtime: DeploymentRuntime) -> None:
        ready = runtime.readiness()[0] and not self.servicer.drain.draining
        status = health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
        self._set_health(runtime.name, status)

    def _set_health(self, service: str, status: int) -> None:
        """Set one service's gRPC health from any thread (the aio servicer's ``set`` is a coroutine of the loop)."""
        self._io.send(self.health.set(service, status))  # applied in order on the loop

    def _housekeep(self) -> None:
        next_retention = time.monotonic()
        while not self._stop.wait(timeout=min(USAGE_FLUSH_S, max(0.0, next_retention - time.monotonic()))):
            self.retire_deleted()
            for runtime in list(self.runtimes.values()):
                runtime.readiness()  # applies the load/inference deadlines, so health turns NOT_SERVING
                try:
                    runtime.usage.flush()
                except Exception as exc:  # a locked or broken database must not stop serving
                    LOG.error('usage flush of %s failed: %s', runtime.name, exc)
            if time.monotonic() >= next_retention:
                next_retention = time.monotonic() + RETENTION_EVERY_S
                for runtime in self.runtimes.values():
                    if runtime.capture_store is not None:
                        try:
                            deleted = runtime.capture_store.apply_retention()
                            if deleted:
                                LOG.info('capture retention of %s: %s episodes deleted', runtime.name, deleted)
                        except Exception as exc:
                            LOG.error('capture retention of %s failed: %s', runtime.name, exc)

    def usage(self) -> dict[str, Usage]:
        """Return this process's usage per deployment since start."""
        return {name: r.usage.snapshot() for name, r in self.runtimes.items()}

    def drain(self, timeout_s: float | None = None) -> int:
        """Drain before a stop (``seq serve`` on SIGTERM): no new episodes, the live ones finish or are cut.

        New episodes are refused in-stream (``refusal="draining"``: the client opens them again, and a
        balancer sends them elsewhere); every deployment's gRPC health turns NOT_SERVING, so the HAProxy agent
        answers ``drain`` and a readiness probe fails, while the server's own health (liveness) stays SERVING.
        Episodes still open after ``timeout_s`` end with reason ``drain_timeout`` (the robot gets NOT_READY
        and EpisodeEnded). While a balancer polls the agent, the drain also lasts until it has heard ``drain``
        (:meth:`~.health_agent.HealthAgent.heard_drain`), within ``timeout_s``: new calls then go elsewhere
        before this replica stops. Call :meth:`stop` afterwards.

        :param timeout_s: how long live episodes may go on (s); default the config's ``drain_timeout_s``.
        :returns: how many episode streams were cut.
        """
        timeout_s = self.config.drain_timeout_s if timeout_s is None else timeout_s
        heard = self.agent.heard_drain() if self.agent is not None else None   # None: no balancer polls it
        self.servicer.drain.begin()
        for name in list(self.runtimes):
            self._set_health(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        open_now = self.servicer.open_streams()
        LOG.info('draining: %d episode streams open; new episodes are refused; waiting up to %g s%s', open_now,
                 timeout_s, ' (and until the balancer has heard the agent answer drain)' if heard else '')
        left = self.servicer.drain.wait(timeout_s, until=heard)
        if left:
            LOG.warning('drain timeout (%g s): cutting %d episode streams (reason %s)', timeout_s, left,
                        DRAIN_TIMEOUT_REASON)
            self.servicer.shutdown_streams(DRAIN_TIMEOUT_REASON)
            self.servicer.drain.wait(CUT_WAIT_S)   # their Error and EpisodeEnded go out before the stop
        return left

    def _drain_and_stop(self) -> None:
        """Drain, then stop, in a thread of its own (``seq-admin-drain``): an embedded worker's admin Drain."""
        def run() -> None:
            self.drain()
            self.stop(grace=2.0)

        threading.Thread(target=run, name='seq-admin-drain', daemon=True).start()

    def stop(self, grace: float = 1.0) -> None:
        """Stop the worker; idempotent.

        Open episodes end with reason ``shutdown`` (their streams are told so), gRPC stops after ``grace``
        s, every thread is stopped with a timed join and usage is flushed.
        """
        if self._stopped:
            return
        self._stopped = True
        self._run(self.health.enter_graceful_shutdown())  # the agent answers drain: no new episodes from a balancer
        self.servicer.shutdown_streams()
        try:
            self._run(self._server.stop(grace), timeout=grace + 5.0)
        except concurrent.futures.TimeoutError:
            LOG.warning('gRPC server did not stop within %.1f s', grace + 5.0)
        if self._probe_server is not None:   # answered NOT_SERVING until here (graceful shutdown above)
            self._run(self._probe_server.stop(0))
        self._stop.set()
        self._housekeeping.join(timeout=5.0)
        if self._rollouts is not None:
            self._rollouts.close()
        if self._live is not None:
            self._live.close()
        for runtime in [*self.runtimes.values(), *self._retired.take_all()]:
            runtime.close()
        self.metrics.close()
        if self.agent is not None:
            self.agent.close()
        self._io.close()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the server terminates (or ``timeout`` s); return True when it did."""
        return self._io.closed.wait(timeout)

    def __enter__(self) -> WorkerServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _same_lineage(record: Any, runtime: DeploymentRuntime) -> bool:
    """True when ``record``, the registry's, is the served runtime's version or a later deploy of it.

    A lower version, or the same version deployed at another time, is a registration made after a ``seq delete``
    (versions start again at 1): another deployment under the same name.
    """
    served = runtime.record
    if served is None or record.version > runtime.version:
        return True
    return record.version == runtime.version and record.deployed_at == served.deployed_at


def _runtime(name: str, version: int, definition: PolicyDefinition, usage_path: Path | None,
             capture_dir: Path | None, config: ServerConfig, load_s: float = 0.0,
             record: Any | None = None) -> DeploymentRuntime:
    store = open_store(capture_dir, name) if capture_dir is not None else None
    return DeploymentRuntime(name, version, definition, UsageMeter(name, usage_path), capture_store=store,
                             max_pending=config.max_pending, inference_timeout_s=config.inference_timeout_s,
                             load_timeout_s=config.load_timeout_s, eta_hint_s=load_s or None, record=record)


def importer(config: ServerConfig, name: str, **overrides: Any) -> Any:
    """``path -> PolicyDefinition`` for ``config.isolation``.

    ``process``: imported in a deployment process under the load timeout
    (:func:`~sequence_ai_ros.worker.policy_process.describe_policy_file`); ``none``: in this process, after
    the same bounded import in a deployment process has succeeded, so that a hang or ``os._exit`` at import
    is reported (naming the deployment and the exit code) instead of hanging or ending the worker; the
    file's module code then runs twice.
    """
    from sequence_ai_ros.worker.policy_process import describe_policy_file

    if config.isolation == 'process':
        return lambda path: describe_policy_file(path, name, config.load_timeout_s,
                                                 memory_limit_mb=config.deployment_memory_mb, **overrides)

    def probed(path: Path) -> PolicyDefinition:
        describe_policy_file(path, name, config.load_timeout_s, **overrides)
        return load_policy_file(path, **overrides)

    return probed


def _config(config: ServerConfig | None, settings: dict[str, Any]) -> ServerConfig:
    return ServerConfig.embedded(**settings) if config is None else config.replace(**settings)


def create_server(deployments: list[str] | None = None, config: ServerConfig | None = None, *,
                  home: str | Path | None = None, **settings: Any) -> WorkerServer:
    """Serve registered deployments from $SEQ_HOME (or ``home``).

    :param deployments: names to serve; default every registered one.
    :param config: how to serve (see :class:`~sequence_ai_ros.worker.config.ServerConfig`); default
        :meth:`ServerConfig.embedded` (the ``seq serve`` defaults on port 0).
    :param home: the $SEQ_HOME holding the registry (default $SEQ_HOME).
    :param settings: :class:`ServerConfig` fields that override ``config`` (``port=0``, ``token=...``,
        ``max_streams=...``).
    :raises ConfigError: for an unknown or invalid setting, or when nothing is deployed.
    :raises UnknownDeployment: for a name that is not registered.
    :raises DeploymentError: for a policy file that is gone, changed since deploy, or does not import.
    """
    config = _config(config, settings)
    registry = Registry(home)
    names = deployments or [r.name for r in registry.list()]
    if not names:
        raise ConfigError(f'nothing to serve: no deployment in {registry.file} (seq deploy NAME/policy.py)')
    runtimes: dict[str, DeploymentRuntime] = {}
    try:
        for name in names:
            rec, definition = registry.load(name, importer(config, name))
            runtimes[name] = _runtime(name, rec.version, definition, registry.usage_file, registry.capture_dir(name),
                                      config, load_s=rec.load_s, record=rec)
    except BaseException:
        for runtime in runtimes.values():
            runtime.close(timeout=1.0)
        raise
    return WorkerServer(runtimes, config, registry=registry)


def serve_policy_file(path: str | Path, deployment: str | None = None, config: ServerConfig | None = None, *,
                      capture_root: str | Path | None = None, home: str | Path | None = None,
                      **kwargs: Any) -> WorkerServer:
    """Serve one policy file without registering it (tests, demos); version 0.

    :param path: the policy.py.
    :param deployment: the name clients use; default the file's directory name (or its stem when the
        file is not called policy.py).
    :param config: how to serve (see :class:`~sequence_ai_ros.worker.config.ServerConfig`); default
        :meth:`ServerConfig.embedded`.
    :param capture_root: parent directory of capture stores (like ``$SEQ_HOME/capture``); the store is
        ``capture_root/<deployment>``. None: no capture.
    :param home: a $SEQ_HOME whose usage database receives this server's usage; None keeps usage in memory.
    :param kwargs: :class:`ServerConfig` fields (``port``, ``token``, ``max_streams``...) override ``config``;
        every other keyword is a constructor kwarg of the policy, over its config.yaml.
    :raises DeploymentError: when the file does not import or its contract is invalid.
    :raises ConfigError: for an invalid setting.
    """
    known = set(field_names())
    config = _config(config, {k: v for k, v in kwargs.items() if k in known})
    path = Path(path).expanduser().resolve()
    name = deployment or (path.parent.name if path.name == 'policy.py' else path.stem)
    if not path.is_file():
        raise DeploymentError(f'{path}: no such policy file')
    definition = importer(config, name, **{k: v for k, v in kwargs.items() if k not in known})(path)
    usage_path = usage_file(home) if home is not None else None
    capture_dir = Path(capture_root) / name if capture_root is not None else None
    return WorkerServer({name: _runtime(name, 0, definition, usage_path, capture_dir, config)}, config)
