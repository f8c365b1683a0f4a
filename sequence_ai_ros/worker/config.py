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
from collections.abc import Iterator
from typing import Any

from sequence_ai_ros.exceptions import ConfigError
from sequence_ai_ros.protocol import DEFAULT_PORT

#: Port of an embedded worker (tests, demos): 0 picks a free one, read back from ``WorkerServer.port``.
EMBEDDED_PORT = 0


def _opt(default: Any, flag: str | None = None, help: str = '', metavar: str | None = None) -> Any:  # noqa: A002
    """A field whose ``seq serve`` option is ``flag`` (None: not a plain option)."""
    return dataclasses.field(default=default, metadata={'flag': flag, 'help': help, 'metavar': metavar})


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    """How a worker serves; validated at construction.

    :param host: bind address; ``0.0.0.0`` exposes the worker beyond this machine.
    :param port: TCP port; 0 picks a free one (``WorkerServer.port`` tells which).
    :param token: when set, every call must carry ``authorization: Bearer <token>`` metadata
        (``seq serve --token-file``).
    :param tls: (certificate chain PEM, private key PEM), as paths or bytes, to serve TLS
        (``seq serve --tls-cert/--tls-key``).
    :param idle_timeout_s: an episode with no message for this long ends with ``idle_timeout`` (s).
    :param warm: load every policy at start instead of at the first client.
    :param max_streams: most Episode streams open at once; one more gets OVERLOADED at once.
    :param max_pending: per deployment, requests that may wait for inference before OVERLOADED.
    :param inference_timeout_s: deadline of one inference (s); past it the request gets POLICY_EXCEPTION
        and the deployment is marked failed.
    :param load_timeout_s: deadline of a policy's construct + ``load()`` (s); past it the deployment is failed.
    :raises ConfigError: for a non-positive timeout, ``max_streams`` or ``max_pending`` < 1, a port outside
        [0, 65535] or an empty token.
    """

    host: str = _opt('127.0.0.1', '--host', 'bind address (default {default}; 0.0.0.0 exposes it)')
    port: int = _opt(DEFAULT_PORT, '--port', 'TCP port (default {default}; 0 picks a free one)')
    token: str | None = _opt(None)
    tls: tuple[Any, Any] | None = _opt(None)
    idle_timeout_s: float = _opt(300.0, '--idle-timeout', 'end an idle episode after S seconds (default {default:g})',
                                 'S')
    warm: bool = _opt(False, '--warm', 'load the policies now instead of at the first client')
    max_streams: int = _opt(256, '--max-streams', 'most episode streams open at once; more get OVERLOADED '
                                                  '(default {default})', 'N')
    max_pending: int = _opt(64)
    inference_timeout_s: float = _opt(30.0, '--inference-timeout', 'an inference over S seconds gets '
                                      'POLICY_EXCEPTION and marks the deployment failed (default {default:g})', 'S')
    load_timeout_s: float = _opt(600.0, '--load-timeout', 'a policy load over S seconds marks the deployment '
                                 'failed (default {default:g})', 'S')

    def __post_init__(self) -> None:
        for name in ('idle_timeout_s', 'inference_timeout_s', 'load_timeout_s'):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and value > 0):
                raise ConfigError(f'{name} must be > 0 s, got {value!r}')
        for name in ('max_streams', 'max_pending'):
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= 1):
                raise ConfigError(f'{name} must be an integer >= 1, got {value!r}')
        if not (isinstance(self.port, int) and 0 <= self.port <= 65535):
            raise ConfigError(f'port must be in [0, 65535], got {self.port!r}')
        if self.token is not None and not self.token:
            raise ConfigError('the token must not be empty')
        if self.tls is not None and len(self.tls) != 2:
            raise ConfigError('tls is (certificate chain PEM, private key PEM)')

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


def field_names() -> tuple[str, ...]:
    """Return the names of the :class:`ServerConfig` fields."""
    return tuple(f.name for f in dataclasses.fields(ServerConfig))


def cli_options() -> Iterator[tuple[str, str, dict[str, Any]]]:
    """Yield ``(field name, flag, argparse kwargs)`` for every field that is a plain ``seq serve`` option.

    The default, type and help text come from the field, so the CLI never re-types them.
    """
    for f in dataclasses.fields(ServerConfig):
        flag = f.metadata.get('flag')
        if flag is None:
            continue
        kwargs: dict[str, Any] = {'dest': f.name, 'default': f.default,
                                  'help': f.metadata['help'].format(default=f.default)}
        if isinstance(f.default, bool):
            kwargs['action'] = 'store_true'
        else:
            kwargs['type'] = type(f.default)
            if f.metadata.get('metavar'):
                kwargs['metavar'] = f.metadata['metavar']
        yield f.name, flag, kwargs
