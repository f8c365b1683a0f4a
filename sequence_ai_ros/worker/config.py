"""``ServerConfig``: every setting of a worker, defined once; its defaults are ``seq serve``'s defaults.

:func:`~sequence_ai_ros.worker.server.create_server`, :func:`~sequence_ai_ros.worker.server.serve_policy_file`
and :class:`~sequence_ai_ros.worker.server.WorkerServer` take one; ``seq serve`` builds its options from the
fields (flag, help and default come from each field's metadata, see :func:`cli_options`), so no default is
typed twice. Embedding the worker in Python (tests, demos) uses :meth:`ServerConfig.embedded`, which differs
only by binding port 0 (a free port).

This module imports no gRPC, so ``seq --help`` stays fast.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

from sequence_ai_ros.exceptions import ConfigError
from sequence_ai_ros.protocol import DEFAULT_PORT

#: Port of an embedded worker (tests, demos): 0 picks a free one, read back from ``WorkerServer.port``.
EMBEDDED_PORT = 0
#: Default bound (s) of ``seq deploy``'s dry run (construct, load, inferences, hook) and of a served policy's
#: load (``--load-timeout``): a cold load of a LeRobot checkpoint on a 2-core machine takes over a minute.
DRY_RUN_TIMEOUT_S = 180.0


#: What a worker does when a version registered while serving cannot load beside the running one: ``wait``
#: (keep serving the old version and switch when its episodes have ended) or ``cut`` (cut them, with reason
#: ``rollout``, and switch at once).
ROLLOUT_MODES = ('wait', 'cut')


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _port(value: Any) -> bool:
    return _integer(value) and 0 <= value <= 65535


class Rule(NamedTuple):
    """How one setting is checked: ``ok(value)``, and what the message says when it is not."""

    ok: Callable[[Any], bool]
    words: str
    echo: bool = True            # False: the message leaves the value out (a token)


#: Every rule a :class:`ServerConfig` field names in its metadata (``rule``); a field cannot be declared
#: without one, so every setting is checked (checks across settings follow in ``__post_init__``).
RULES: dict[str, Rule] = {
    'address': Rule(lambda v: isinstance(v, str) and bool(v.strip()), 'must name an address (e.g. 127.0.0.1)'),
    'port': Rule(_port, 'must be in [0, 65535]'),
    'optional_port': Rule(lambda v: v is None or _port(v), 'must be in [0, 65535] (or None: off)'),
    'seconds': Rule(lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < math.inf,
                    'must be a finite number of seconds > 0'),
    'count': Rule(lambda v: _integer(v) and v >= 1, 'must be an integer >= 1'),
    'count_or_0': Rule(lambda v: _integer(v) and v >= 0, 'must be an integer >= 0'),
    'flag': Rule(lambda v: isinstance(v, bool), 'must be True or False'),
    'token': Rule(lambda v: v is None or (isinstance(v, str) and bool(v)),
                  'must not be empty (a string, or None for no token)', echo=False),
    'tls': Rule(lambda v: v is None or (isinstance(v, (tuple, list)) and len(v) == 2),
                'is (certificate chain PEM, private key PEM), as paths or bytes'),
    'isolation': Rule(lambda v: v in ('process', 'none'), "must be 'process' or 'none'"),
    'rollout': Rule(lambda v: v in ROLLOUT_MODES, "must be 'wait' or 'cut'"),
    'optional_path': Rule(lambda v: v is None or (isinstance(v, str) and bool(v.strip()) and '\0' not in v),
                          'must be a file path (or None: off)'),
}


def _opt(default: Any, flag: str | None = None, help: str = '', metavar: str | None = None, *,  # noqa: A002
         rule: str) -> Any:
    """A field checked by :data:`RULES` ``[rule]`` whose ``seq serve`` option is ``flag`` (None: not a plain option)."""
    if rule not in RULES:
        raise ValueError(f'unknown rule {rule!r}; one of {", ".join(RULES)}')
    return dataclasses.field(default=default, metadata={'flag': flag, 'help': help, 'metavar': metavar, 'rule': rule})


def _named(name: str) -> str:
    """``name`` with its ``seq serve`` flag, e.g. ``idle_timeout_s (--idle-timeout)``."""
    flag = next((f.metadata.get('flag') for f in dataclasses.fields(ServerConfig) if f.name == name), None)
    return f'{name} ({flag})' if flag else name


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    """How a worker serves; validated at construction.

    :param host: bind address; ``0.0.0.0`` exposes the worker beyond this machine.
    :param port: TCP port; 0 picks a free one (``WorkerServer.port`` tells which).
    :param token: when set, every call must carry ``authorization: Bearer <token>`` metadata
        (``seq serve --token-file``).
    :param tls: (certificate chain PEM, private key PEM), as paths or bytes, to serve TLS
        (``seq serve --tls-cert/--tls-key``).
    :param idle_timeout_s: an episode stream without episode activity (EpisodeStart, observations, telemetry,
        EpisodeEnd, or the reply to one) for this long ends with ``idle_timeout`` and closes (s); empty
        messages do not count, so an idle stream cannot keep its slot. The client (``connect()``) opens
        a new stream for its next episode.
    :param warm: load every policy at start instead of at the first client.
    :param max_streams: most Episode streams open at once; one more gets OVERLOADED at once.
    :param max_pending: per deployment, requests that may wait for their turn at inference (queued, or pipelined
        to its deployment process) before OVERLOADED.
    :param inference_timeout_s: deadline of one inference (s); past it the request gets POLICY_EXCEPTION
        and the deployment is marked failed.
    :param load_timeout_s: deadline of a policy's construct + ``load()`` (s); past it the deployment is failed.
    :param drain_timeout_s: on SIGTERM (:meth:`~sequence_ai_ros.worker.server.WorkerServer.drain`), how long
        live episodes may finish (s) while new ones are refused; the rest end with ``drain_timeout``.
    :param start_timeout_s: an Episode stream that sends no EpisodeStart within this long is closed (s), so
        idle streams cannot hold the worker's ``max_streams`` slots.
    :param max_streams_per_client: most Episode streams one client may hold at once (0: no per-client cap).
        A client is its address: the ``x-forwarded-for`` metadata of a call that came through
        ``proxy_socket`` (the balancer's own way in), else the TCP peer's address (a forged
        ``x-forwarded-for`` on the TCP port is ignored). Streams with
        and without the token are capped apart, so token-less streams from an address never take that
        address's slots from token holders (e.g. robots behind the same NAT or balancer).
    :param anonymous_streams: with a ``token``: how many Episode streams callers *without* the token may hold
        in total (they may then also handshake, ask readiness and label the episodes this worker ran; a *wrong*
        token is still UNAUTHENTICATED). The other ``max_streams - anonymous_streams`` slots are kept for streams
        carrying the token, so an anonymous flood gets OVERLOADED while token holders keep that headroom.
        0 (default): a caller without the token gets nothing (UNAUTHENTICATED).
    :param proxy_socket: a Unix socket path the worker also listens on, for a balancer in front of it (``seq
        fleet``'s HAProxy): only calls that come in through it have their ``x-forwarded-for`` read as the
        client's address. Any local process can connect from 127.0.0.1, so a TCP peer is never trusted; the
        socket is made owner-only (mode 0600): keep it in a directory only the balancer's user can reach.
    :param metrics_port: serve Prometheus metrics on ``http://host:metrics_port/metrics`` (0: a free port,
        see ``WorkerServer.metrics_port``); None: no metrics endpoint.
    :param isolation: ``process`` (default): each deployment's policy code (import, load, infer, hook) runs in
        its own process, so a crash, ``os._exit``, segfault or hang fails only that deployment's robots (with a
        typed error) and the worker restarts it; observations reach it through shared memory, which adds a
        fraction of a millisecond to a round trip (``make bench``: isolation). ``none``: every policy runs
        inside the worker process (its import is first tried, bounded, in a deployment process, so a hang or
        exit at import is reported); a crash there ends the worker and every deployment's robots.
    :param deployment_memory_mb: with ``isolation='process'``: a deployment process whose resident memory
        passes this many MB is ended (with what its policy started) and restarted; the call in flight gets
        :class:`~sequence_ai_ros.worker.policy_process.MemoryLimitExceeded` naming the limit, other deployments
        go on. 0 (default): no limit.
    :param rollout: when a version registered while serving (``seq deploy`` again) cannot load beside the
        running one (its load ran out of memory: two versions need twice the model's memory): ``wait``
        (default) keeps serving the old version and switches when its episodes have ended; ``cut`` cuts the
        old version's live episodes (reason ``rollout``: the robot gets the retryable NotReady) and switches
        at once. A version that loads beside the old one is switched to without a cut either way; one that
        fails otherwise is never switched to (:mod:`~sequence_ai_ros.worker.rollout`).
    :param agent_port: answer HAProxy ``agent-check`` probes on this port with the gRPC health of the served
        deployments (:mod:`~sequence_ai_ros.worker.health_agent`); None: no agent.
    :param probe_port: serve ``grpc.health.v1.Health`` alone, in plaintext and without the token, on this port
        (0: a free one, see ``WorkerServer.probe_port``), for Kubernetes' gRPC probes, which send neither
        metadata nor TLS (:mod:`~sequence_ai_ros.worker.probe`); None: no probe port.
    :param admin_without_token: without a ``token``, let every caller that reaches the port use the admin API
        (:mod:`~sequence_ai_ros.worker.admin`), Drain and SetLogLevel included; False (default): without a
        token, its reads answer callers on this host only and Drain and SetLogLevel nobody. Refused with a token
        (the admin API then needs it from every caller).
    :raises ConfigError: for a value its field's rule (:data:`RULES`) refuses: an empty host, a timeout that
        is not finite and > 0, ``max_streams`` or ``max_pending`` < 1, a port outside [0, 65535], a bool
        where a number belongs, an empty token, a ``tls`` that is not a pair; or for ``anonymous_streams``
        > 0 without a token or not below ``max_streams``. The message names the ``seq serve`` flag where
        there is one.
    """

    host: str = _opt('127.0.0.1', '--host', 'bind address (default {default}; 0.0.0.0 exposes it)', rule='address')
    port: int = _opt(DEFAULT_PORT, '--port', 'TCP port (default {default}; 0 picks a free one)', rule='port')
    token: str | None = _opt(None, rule='token')
    tls: tuple[Any, Any] | None = _opt(None, rule='tls')
    idle_timeout_s: float = _opt(10.0, '--idle-timeout', 'close an episode stream with no episode activity '
                                 '(start, observations, telemetry, end; empty messages do not count) for S '
                                 'seconds (default {default:g})', 'S', rule='seconds')
    warm: bool = _opt(False, '--warm', 'load the policies now instead of at the first client', rule='flag')
    max_streams: int = _opt(256, '--max-streams', 'most episode streams open at once; more get OVERLOADED '
                                                  '(default {default})', 'N', rule='count')
    max_pending: int = _opt(64, '--max-pending', 'per deployment, requests that may wait for their turn at inference '
                            '(queued, or pipelined to its deployment process); more get OVERLOADED (default '
                            '{default})', 'N', rule='count')
    inference_timeout_s: float = _opt(30.0, '--inference-timeout', 'an inference over S seconds gets '
                                      'POLICY_EXCEPTION and marks the deployment failed (default {default:g})', 'S',
                                      rule='seconds')
    load_timeout_s: float = _opt(DRY_RUN_TIMEOUT_S, '--load-timeout', 'a policy load over S seconds marks the '
                                 'deployment failed (default {default:g})', 'S', rule='seconds')
    drain_timeout_s: float = _opt(25.0, '--drain-timeout', 'on SIGTERM, refuse new episodes and let live ones '
                                  'finish for up to S seconds, then cut them (default {default:g}; keep it below the '
                                  "pod's grace period)", 'S', rule='seconds')
    start_timeout_s: float = _opt(5.0, '--start-timeout', 'close an episode stream that sends no EpisodeStart '
                                  'within S seconds (default {default:g})', 'S', rule='seconds')
    max_streams_per_client: int = _opt(64, '--max-streams-per-client', 'most episode streams one client address '
                                       'may hold; more get OVERLOADED; 0: no cap (default {default})', 'N',
                                       rule='count_or_0')
    anonymous_streams: int = _opt(0, '--anonymous-streams', 'with --token-file: episode streams callers without '
                                  'the token may hold in total; the other max-streams slots are kept for token '
                                  'holders (default {default}: no access without the token)', 'N',
                                  rule='count_or_0')
    proxy_socket: str | None = _opt(None, '--proxy-socket', 'also listen on this Unix socket, for a balancer '
                                    '(seq fleet\'s HAProxy): only calls through it have their x-forwarded-for '
                                    'read as the client address (default: off)', 'PATH', rule='optional_path')
    isolation: str = _opt('process', '--isolation', "where policy code runs: 'process' (each deployment in its "
                          "own process, restarted when it crashes or hangs) or 'none' "
                          '(inside the worker) (default {default})', 'MODE', rule='isolation')
    deployment_memory_mb: int = _opt(0, '--deployment-memory-mb', 'with --isolation process: end and restart a '
                                     'deployment process whose resident memory passes N MB; its robots get an '
                                     'error naming the limit (default {default}: no limit)', 'N', rule='count_or_0')
    rollout: str = _opt('wait', '--rollout', "when a new version registered while serving cannot load beside the "
                        "running one (out of memory): 'wait' (serve the old one until its episodes end, then "
                        "switch) or 'cut' (cut its episodes, reason rollout, and switch at once) (default {default})",
                        'MODE',
                        rule='rollout')
    metrics_port: int | None = _opt(None, '--metrics-port', 'serve Prometheus metrics on this port at /metrics '
                                    '(default: off; 0 picks a free one)', 'PORT', rule='optional_port')
    agent_port: int | None = _opt(None, '--agent-port', 'answer HAProxy agent-check probes on this port with the '
                                  "replica's gRPC health (default: off; see worker/haproxy.cfg)", 'PORT',
                                  rule='optional_port')
    admin_without_token: bool = _opt(False, '--admin-without-token', 'without --token-file, let every caller that '
                                     'reaches the port use the admin API (seq admin), drain and log level included '
                                     '(default: without a token, only reads, and only from this host)',
                                     rule='flag')
    probe_port: int | None = _opt(None, '--probe-port', 'serve only the gRPC health service on this port, in '
                                  'plaintext and without the token, for Kubernetes gRPC probes (default: off; '
                                  '0 picks a free one)', 'PORT', rule='optional_port')

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):          # each setting by its field's rule: none is listed by hand
            rule, value = RULES[f.metadata['rule']], getattr(self, f.name)
            if not rule.ok(value):
                raise ConfigError(f'{_named(f.name)} {rule.words}' + (f', got {value!r}' if rule.echo else ''))
        if self.anonymous_streams and self.token is None:
            raise ConfigError(f'{_named("anonymous_streams")} needs a token (--token-file): without one every '
                              'stream is anonymous and max_streams is the only cap')
        if self.admin_without_token and self.token is not None:
            raise ConfigError(f'{_named("admin_without_token")} goes without a token: with --token-file every admin '
                              'call needs the token')
        if self.deployment_memory_mb and self.isolation != 'process':
            raise ConfigError(f'{_named("deployment_memory_mb")} needs isolation \'process\' (--isolation process): '
                              'a policy inside the worker has no process of its own to limit')
        if self.anonymous_streams >= self.max_streams:
            raise ConfigError(f'{_named("anonymous_streams")} ({self.anonymous_streams}) must be below max_streams '
                              f'({self.max_streams}): the difference is the headroom kept for token holders')

    @classmethod
    def embedded(cls, **settings: Any) -> ServerConfig:
        """Return the config of a worker embedded in Python: the CLI defaults, but port 0 unless given.

        :raises ConfigError: for an unknown setting or an invalid value.
        """
        return cls.build({'port': EMBEDDED_PORT, **settings})

    @classmethod
    def build(cls, settings: dict[str, Any]) -> ServerConfig:
        """Return ``ServerConfig(**settings)``, naming the known settings when one is unknown.

        :raises ConfigError: for an unknown setting or an invalid value.
        """
        unknown = sorted(set(settings) - set(field_names()))
        if unknown:
            raise ConfigError(f'unknown server settings {unknown}; known: {", ".join(field_names())}')
        return cls(**settings)

    def replace(self, **settings: Any) -> ServerConfig:
        """Return a copy with ``settings`` changed (validated again).

        :raises ConfigError: for an unknown setting or an invalid value.
        """
        return self.build({**dataclasses.asdict(self), **settings})


def from_cli(values: dict[str, Any], **extra: Any) -> ServerConfig:
    """Return the config for parsed ``seq serve`` option values (field name -> value) plus ``extra`` fields.

    :raises ConfigError: for an invalid value.
    """
    defaults = {f.name: f.default for f in dataclasses.fields(ServerConfig)}
    out = {name: (defaults[name] if value is None else tuple(value)) if isinstance(defaults[name], tuple) else value
           for name, value in values.items()}
    return ServerConfig.build({**out, **extra})


def field_names() -> tuple[str, ...]:
    """Return the names of the :class:`ServerConfig` fields."""
    return tuple(f.name for f in dataclasses.fields(ServerConfig))


def cli_options() -> Iterator[tuple[str, str, dict[str, Any]]]:
    """Yield ``(field name, flag, argparse kwargs)`` for every field that is a plain ``seq serve`` option.

    The default, type and help text come from the field, so the CLI never re-types them. A tuple field is
    a repeatable flag whose parsed value is None or a list (:func:`from_cli` turns it into the tuple).
    """
    for f in dataclasses.fields(ServerConfig):
        flag = f.metadata.get('flag')
        if flag is None:
            continue
        kwargs: dict[str, Any] = {'dest': f.name, 'default': f.default,
                                  'help': f.metadata['help'].format(default=f.default)}
        if isinstance(f.default, bool):
            kwargs['action'] = 'store_true'
        elif isinstance(f.default, tuple):
            kwargs.update(action='append', default=None, type=str, metavar=f.metadata['metavar'])
        else:
            if f.default is None:                # None: an optional port, or an optional path
                kwargs['type'] = str if f.metadata['rule'] == 'optional_path' else int
            else:
                kwargs['type'] = type(f.default)
            if f.metadata.get('metavar'):
                kwargs['metavar'] = f.metadata['metavar']
        yield f.name, flag, kwargs
