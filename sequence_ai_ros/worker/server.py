"""Server factory: :func:`create_server` (registered deployments) and :func:`serve_policy_file` (one file).

Both return a :class:`WorkerServer` with ``.port`` and ``.stop(grace)``. The server binds 127.0.0.1 by
default, serves ``sequence_ai.v1.PolicyService`` and the standard ``grpc.health.v1.Health`` service
(``''`` is SERVING while the server runs; each deployment is NOT_SERVING until its policy is ready), sets
the max receive size from the contracts' ``max_message_bytes`` and keepalive options. With a ``token``,
an interceptor fails every call (health included) without ``authorization: Bearer <token>`` metadata
with UNAUTHENTICATED. With ``tls=(cert, key)`` it serves TLS.

Health of a deployment follows its readiness: NOT_SERVING while cold or warming, and for good once its
load or an inference exceeds its deadline (checked on every call and by housekeeping every 10 s).

Threads: gRPC's handler pool (``max_streams + UNARY_HEADROOM`` threads: each open episode stream holds
one, and at most ``max_streams`` streams are open, so Handshake, Ready, Label and health always find a
thread; one stream more is refused with OVERLOADED at once), the per-deployment
threads of :mod:`sequence_ai_ros.worker.runtime`, and ``seq-housekeeping`` (usage flush every 10 s,
capture retention at start and hourly), all stopped by :meth:`WorkerServer.stop`.
"""

from __future__ import annotations

import hmac
import logging
import threading
import time
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from sequence_ai_ros.exceptions import ConfigError, Unauthenticated
from sequence_ai_ros.home import usage_file
from sequence_ai_ros.policy.loader import PolicyDefinition, load_policy_file
from sequence_ai_ros.protocol import AUTH_METADATA, errors, messages
from sequence_ai_ros.protocol import sequence_ai_pb2_grpc as pb_grpc
from sequence_ai_ros.worker.capture_hook import open_store
from sequence_ai_ros.worker.registry import Registry
from sequence_ai_ros.worker.runtime import DEFAULT_INFERENCE_TIMEOUT_S, DEFAULT_LOAD_TIMEOUT_S, DeploymentRuntime
from sequence_ai_ros.worker.servicer import PolicyServicer
from sequence_ai_ros.worker.usage import Usage, UsageMeter

LOG = logging.getLogger(__name__)
#: Default idle timeout of an episode (s): 5 minutes.
DEFAULT_IDLE_TIMEOUT_S = 300.0
USAGE_FLUSH_S = 10.0
RETENTION_EVERY_S = 3600.0
#: Default cap of concurrently open Episode streams.
DEFAULT_MAX_STREAMS = 256
#: Handler threads kept free of episode streams for unary calls and health.
UNARY_HEADROOM = 16
KEEPALIVE_OPTIONS = [
    ('grpc.keepalive_time_ms', 20_000),               # ping an idle connection every 20 s
    ('grpc.keepalive_timeout_ms', 10_000),            # drop it when a ping goes unanswered for 10 s
    ('grpc.keepalive_permit_without_calls', 1),
    ('grpc.http2.min_ping_interval_without_data_ms', 5_000),  # accept client pings every >= 5 s
    ('grpc.http2.max_pings_without_data', 0),
]


class TokenInterceptor(grpc.ServerInterceptor):
    """Fail every call whose metadata lacks ``authorization: Bearer <token>`` with UNAUTHENTICATED.

    The comparison is constant-time (:func:`hmac.compare_digest`).
    """

    def __init__(self, token: str) -> None:
        if not token:
            raise ConfigError('the token must not be empty')
        self._expected = f'Bearer {token}'.encode()

    def intercept_service(self, continuation: Any, details: grpc.HandlerCallDetails) -> Any:
        """Pass authenticated calls on; answer the others with an aborting handler of the same kind."""
        got = next((v for k, v in details.invocation_metadata or () if k == AUTH_METADATA), '')
        got_bytes = got.encode() if isinstance(got, str) else bytes(got)
        handler = continuation(details)
        if hmac.compare_digest(got_bytes, self._expected) or handler is None:
            return handler
        status, message = errors.abort_details(Unauthenticated(
            'missing or wrong token: send metadata "authorization: Bearer <token>"' if got else
            'this worker needs a token: send metadata "authorization: Bearer <token>"'))

        def deny(request: Any, context: grpc.ServicerContext) -> Any:
            context.abort(status, message)

        kind = (handler.request_streaming, handler.response_streaming)
        factory = {(False, False): grpc.unary_unary_rpc_method_handler,
                   (False, True): grpc.unary_stream_rpc_method_handler,
                   (True, False): grpc.stream_unary_rpc_method_handler,
                   (True, True): grpc.stream_stream_rpc_method_handler}[kind]
        return factory(deny, request_deserializer=handler.request_deserializer,
                       response_serializer=handler.response_serializer)


def _read_pem(value: str | bytes | Path) -> bytes:
    if isinstance(value, bytes):
        return value
    return Path(value).expanduser().read_bytes()


class WorkerServer:
    """A running worker: ``.port``, ``.address``, ``.stop(grace)``, ``.usage()``; a context manager."""

    def __init__(self, runtimes: dict[str, DeploymentRuntime], *, host: str = '127.0.0.1', port: int = 0,
                 token: str | None = None, tls: tuple[Any, Any] | None = None,
                 idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S, max_streams: int = DEFAULT_MAX_STREAMS,
                 warm: bool = False, registry: Registry | None = None) -> None:
        if idle_timeout_s <= 0:
            raise ConfigError(f'idle_timeout_s must be > 0, got {idle_timeout_s}')
        if max_streams < 1:
            raise ConfigError(f'max_streams must be >= 1, got {max_streams}')
        self.runtimes = runtimes
        self._stop = threading.Event()
        self._stopped = False
        try:
            self._server, self.servicer, self.health = self._build(host, port, token, tls, idle_timeout_s, max_streams)
        except BaseException:
            for runtime in runtimes.values():
                runtime.close(timeout=1.0)
            raise
        self.host = host
        self.tls = tls is not None
        self._registry = registry
        self._registry_mtime: float | None = None
        self._retire_lock = threading.Lock()
        if registry is not None:
            self.servicer.before_lookup = self.retire_deleted
        for runtime in runtimes.values():
            runtime.on_state_change = self._on_state
            self._on_state(runtime)
        self._server.start()
        self.health.set('', health_pb2.HealthCheckResponse.SERVING)
        self._housekeeping = threading.Thread(target=self._housekeep, name='seq-housekeeping', daemon=True)
        self._housekeeping.start()
        if warm:
            for runtime in runtimes.values():
                runtime.ensure_loading()
        LOG.info('serving %s on %s:%d%s', sorted(runtimes), host, self.port, ' (TLS)' if self.tls else '')

    def _build(self, host: str, port: int, token: str | None, tls: tuple[Any, Any] | None, idle_timeout_s: float,
               max_streams: int) -> tuple[grpc.Server, PolicyServicer, health.HealthServicer]:
        # The transport accepts 4x the largest contract's request, so that an oversized observation gets a
        # typed in-stream CONTRACT_VIOLATION (checked per request against its own contract) instead of a
        # transport error that kills the stream.
        max_bytes = max(4 << 20, 4 * max(r.max_message_bytes for r in self.runtimes.values()))
        options = [('grpc.max_receive_message_length', max_bytes),
                   ('grpc.max_send_message_length', messages.MAX_CHUNK_BYTES),
                   ('grpc.so_reuseport', 0), *KEEPALIVE_OPTIONS]
        interceptors = [TokenInterceptor(token)] if token is not None else []
        # Each open episode stream holds a handler thread; the servicer refuses streams past max_streams, so
        # UNARY_HEADROOM threads stay for unary calls and health. Beyond max_workers calls, gRPC answers
        # RESOURCE_EXHAUSTED (the client's Overloaded) instead of queueing them silently.
        max_workers = max_streams + UNARY_HEADROOM
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix='seq-grpc'),
                             options=options, interceptors=interceptors, maximum_concurrent_rpcs=max_workers)
        servicer = PolicyServicer(self.runtimes, idle_timeout_s, token, max_streams=max_streams)
        pb_grpc.add_PolicyServiceServicer_to_server(servicer, server)
        health_servicer = health.HealthServicer(experimental_non_blocking=True)
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        address = f'{host}:{port}'
        if tls is not None:
            creds = grpc.ssl_server_credentials([(_read_pem(tls[1]), _read_pem(tls[0]))])
            self.port = server.add_secure_port(address, creds)
        else:
            self.port = server.add_insecure_port(address)
        if not self.port:
            raise ConfigError(f'cannot bind {address}')
        return server, servicer, health_servicer

    @property
    def address(self) -> str:
        """``host:port`` as a client dials it."""
        return f'{self.host}:{self.port}'

    def retire_deleted(self) -> list[str]:
        """Stop serving, metering and capturing the deployments ``seq delete`` removed from the registry.

        Cheap when nothing changed (one ``stat`` of deployments.json); called before each deployment lookup,
        so the next Handshake or episode of a deleted deployment gets UNKNOWN_DEPLOYMENT, and its usage row
        and capture directory are not re-created.

        :returns: the names retired by this call.
        """
        if self._registry is None:
            return []
        with self._retire_lock:
            try:
                mtime = self._registry.file.stat().st_mtime_ns
            except OSError:
                mtime = -1
            if mtime == self._registry_mtime:
                return []
            self._registry_mtime = mtime
            try:
                names = {r.name for r in self._registry.list()} if mtime != -1 else set()
            except Exception as exc:  # a registry being rewritten: look again at the next lookup
                LOG.debug('registry unreadable: %s', exc)
                self._registry_mtime = None
                return []
            gone = [name for name in self.runtimes if name not in names]
            for name in gone:
                runtime = self.runtimes.pop(name)
                runtime.usage.retire()
                if runtime.capture_store is not None:
                    runtime.capture_store.retire()
                self.health.set(name, health_pb2.HealthCheckResponse.SERVICE_UNKNOWN)
                LOG.info('deployment %s was deleted: no longer served', name)
            return gone

    def _on_state(self, runtime: DeploymentRuntime) -> None:
        ready = runtime.readiness()[0]
        status = health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
        self.health.set(runtime.name, status)

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
                            LOG.info('capture retention of %s: %s episodes deleted', runtime.name, deleted)
                        except Exception as exc:
                            LOG.error('capture retention of %s failed: %s', runtime.name, exc)

    def usage(self) -> dict[str, Usage]:
        """Return this process's usage per deployment since start."""
        return {name: r.usage.snapshot() for name, r in self.runtimes.items()}

    def stop(self, grace: float = 1.0) -> None:
        """Stop the worker; idempotent.

        Open episodes end with reason ``shutdown`` (their streams are told so), gRPC stops after ``grace``
        s, every thread is stopped with a timed join and usage is flushed.
        """
        if self._stopped:
            return
        self._stopped = True
        self.health.enter_graceful_shutdown()
        self.servicer.shutdown_streams()
        self._server.stop(grace).wait(grace + 5.0)
        self._stop.set()
        self._housekeeping.join(timeout=5.0)
        for runtime in self.runtimes.values():
            runtime.close()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the server terminates (or ``timeout`` s); return True when it did."""
        return self._server.wait_for_termination(timeout)

    def __enter__(self) -> WorkerServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _runtime(name: str, version: int, definition: PolicyDefinition, usage_path: Path | None,
             capture_dir: Path | None, max_pending: int, timeouts: dict[str, float]) -> DeploymentRuntime:
    store = open_store(capture_dir, name) if capture_dir is not None else None
    return DeploymentRuntime(name, version, definition, UsageMeter(name, usage_path), capture_store=store,
                             max_pending=max_pending, **timeouts)


def create_server(deployments: list[str] | None = None, *, home: str | Path | None = None, host: str = '127.0.0.1',
                  port: int = 0, token: str | None = None, tls: tuple[Any, Any] | None = None,
                  idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S, warm: bool = False,
                  max_streams: int = DEFAULT_MAX_STREAMS, max_pending: int = 64,
                  inference_timeout_s: float = DEFAULT_INFERENCE_TIMEOUT_S,
                  load_timeout_s: float = DEFAULT_LOAD_TIMEOUT_S) -> WorkerServer:
    """Serve registered deployments from $SEQ_HOME (or ``home``).

    :param deployments: names to serve; default every registered one.
    :param host: bind address (127.0.0.1 by default; ``0.0.0.0`` exposes it).
    :param port: TCP port; 0 picks a free one (``.port`` tells which).
    :param token: require ``authorization: Bearer <token>`` on every call.
    :param tls: (certificate chain PEM, private key PEM), as paths or bytes, to serve TLS.
    :param idle_timeout_s: end an episode after this many seconds without a message (s).
    :param warm: start loading every policy at once instead of at the first client.
    :param max_streams: most Episode streams open at once; one more gets OVERLOADED at once (the handler
        pool is ``max_streams + UNARY_HEADROOM`` threads, so unary calls and health always answer).
    :param max_pending: per deployment, episodes that may wait for inference before OVERLOADED.
    :param inference_timeout_s: deadline of one inference (s); past it the request (and those queued behind
        it) get POLICY_EXCEPTION "inference exceeded N s" and that deployment is marked failed.
    :param load_timeout_s: deadline of a policy's construct + load() (s); past it the deployment is failed.
    :raises ConfigError: for a non-positive timeout or max_streams.
    :raises UnknownDeployment: for a name that is not registered.
    :raises DeploymentError: for a policy file that is gone, changed since deploy, or does not import.
    :raises ConfigError: when nothing is deployed.
    """
    timeouts = {'inference_timeout_s': inference_timeout_s, 'load_timeout_s': load_timeout_s}
    registry = Registry(home)
    names = deployments or [r.name for r in registry.list()]
    if not names:
        raise ConfigError(f'nothing to serve: no deployment in {registry.file} (seq deploy NAME/policy.py)')
    runtimes: dict[str, DeploymentRuntime] = {}
    try:
        for name in names:
            rec, definition = registry.load(name)
            runtimes[name] = _runtime(name, rec.version, definition, registry.usage_file, registry.capture_dir(name),
                                      max_pending, timeouts)
    except BaseException:
        for runtime in runtimes.values():
            runtime.close(timeout=1.0)
        raise
    return WorkerServer(runtimes, host=host, port=port, token=token, tls=tls, idle_timeout_s=idle_timeout_s,
                        max_streams=max_streams, warm=warm, registry=registry)


def serve_policy_file(path: str | Path, deployment: str | None = None, *, host: str = '127.0.0.1', port: int = 0,
                      token: str | None = None, tls: tuple[Any, Any] | None = None,
                      idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S, capture_root: str | Path | None = None,
                      home: str | Path | None = None, warm: bool = False,
                      max_streams: int = DEFAULT_MAX_STREAMS, max_pending: int = 64,
                      inference_timeout_s: float = DEFAULT_INFERENCE_TIMEOUT_S,
                      load_timeout_s: float = DEFAULT_LOAD_TIMEOUT_S, **policy_kwargs: Any) -> WorkerServer:
    """Serve one policy file without registering it (tests, demos); version 0.

    :param path: the policy.py.
    :param deployment: the name clients use; default the file's directory name (or its stem when the
        file is not called policy.py).
    :param capture_root: parent directory of capture stores (like ``$SEQ_HOME/capture``); the store is
        ``capture_root/<deployment>``. None: no capture.
    :param home: a $SEQ_HOME whose usage database receives this server's usage; None keeps usage in memory.
    :param max_streams: most Episode streams open at once (see :func:`create_server`).
    :param inference_timeout_s: deadline of one inference (s) (see :func:`create_server`).
    :param load_timeout_s: deadline of construct + load() (s).
    :param policy_kwargs: constructor kwargs, over the policy's config.yaml.
    :raises DeploymentError: when the file does not import or its contract is invalid.
    :raises ConfigError: for a non-positive timeout or max_streams.
    """
    path = Path(path)
    definition = load_policy_file(path, **policy_kwargs)
    name = deployment or (definition.path.parent.name if definition.path.name == 'policy.py' else definition.path.stem)
    usage_path = usage_file(home) if home is not None else None
    capture_dir = Path(capture_root) / name if capture_root is not None else None
    timeouts = {'inference_timeout_s': inference_timeout_s, 'load_timeout_s': load_timeout_s}
    runtimes = {name: _runtime(name, 0, definition, usage_path, capture_dir, max_pending, timeouts)}
    return WorkerServer(runtimes, host=host, port=port, token=token, tls=tls, idle_timeout_s=idle_timeout_s,
                        max_streams=max_streams, warm=warm)
