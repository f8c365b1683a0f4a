"""``seq admin``: the admin API (``sequence_ai.v1.Admin``) of one replica or of each replica of a fleet.

``seq admin [--endpoint HOST:PORT]... [--replicas FILE] [--token-file F] COMMAND`` asks every endpoint named,
one after the other, and prints each one's answer under the replica that gave it:

- ``episodes``: the episodes running (id, robot, deployment, version, age, in flight, underruns so far);
- ``stats``: per deployment and version, episodes live and ended (by reason), chunks answered, underruns;
- ``versions``: the deployment versions loaded (serving, a rollout's, a deleted one finishing);
- ``log-level LEVEL``: set the worker's log level;
- ``drain``: drain the replica and stop it, as SIGTERM does (one endpoint at a time, unless ``--all``).

A fleet's replicas are reached by their own addresses (``--endpoint`` again, or ``--replicas FILE`` with one
``HOST:PORT`` a line: ``seq fleet`` writes ``RUN_DIR/replicas``); the shipped HAProxy config refuses admin calls
on the robots' port (PERMISSION_DENIED). Each answer names its replica. ``--json`` prints one JSON object a line per
replica. The exit code is 0 when every endpoint answered, 1 when one did not (its error on stderr), 2 for a
usage error.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from sequence_ai_ros.cli.files import read_file, read_token
from sequence_ai_ros.exceptions import ConfigError


def _seconds(text: str) -> float:
    """A per-call deadline (s): finite and in (0, 3600]."""
    try:
        value = float(text)
    except ValueError:
        value = float('nan')
    if not 0 < value <= 3600:    # false for nan and inf too
        raise argparse.ArgumentTypeError(f'expected seconds, 0 < S <= 3600, got {text!r}')
    return value


def endpoints(args: argparse.Namespace) -> list[str]:
    """The endpoints ``args`` name (``--endpoint``, then ``--replicas``' lines), each once; default the local port.

    :raises ConfigError: for a replicas file that cannot be read or names nothing, or an endpoint that is not
        HOST:PORT with a port in 1..65535 (gRPC would wrap a larger one onto another port).
    """
    from sequence_ai_ros.protocol import DEFAULT_PORT

    named = list(args.endpoint or [])
    if args.replicas:
        try:
            lines = Path(args.replicas).expanduser().read_text().splitlines()
        except OSError as exc:
            raise ConfigError(f'--replicas {args.replicas}: {exc.strerror or exc}') from None
        listed = [line.split('#')[0].strip() for line in lines]
        if not any(listed):
            raise ConfigError(f'--replicas {args.replicas}: no HOST:PORT in it (one a line)')
        named += [line for line in listed if line]
    for endpoint in named:
        host, sep, port = endpoint.rpartition(':')
        if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
            raise ConfigError(f'endpoint {endpoint!r}: expected HOST:PORT with a port in 1..65535')
    return list(dict.fromkeys(named)) or [f'127.0.0.1:{DEFAULT_PORT}']


def _call(stub: Any, command: str, args: argparse.Namespace, metadata: list[tuple[str, str]]) -> Any:
    from sequence_ai_ros.protocol import sequence_ai_pb2 as pb

    calls = {'episodes': lambda: stub.ListEpisodes(pb.ListEpisodesRequest(deployment=args.deployment or '',
                                                                          limit=args.limit or 0),
                                                   metadata=metadata, timeout=args.timeout),
             'stats': lambda: stub.Stats(pb.StatsRequest(deployment=args.deployment or ''), metadata=metadata,
                                         timeout=args.timeout),
             'versions': lambda: stub.ListVersions(pb.ListVersionsRequest(), metadata=metadata, timeout=args.timeout),
             'log-level': lambda: stub.SetLogLevel(pb.SetLogLevelRequest(level=args.level), metadata=metadata,
                                                   timeout=args.timeout),
             'drain': lambda: stub.Drain(pb.DrainRequest(), metadata=metadata, timeout=args.timeout)}
    return calls[command]()


def render(command: str, reply: Any) -> list[str]:
    """The lines ``seq admin COMMAND`` prints for one replica's ``reply`` (after its header line)."""
    if command == 'episodes':
        lines = [f'{"EPISODE":<28} {"ROBOT":<16} {"DEPLOYMENT":<18} {"VER":>4} {"AGE s":>8} {"IN FLIGHT":>9} '
                 f'{"REQUESTS":>9} {"UNDERRUNS":>9} {"UNDERRUN s":>10}']
        lines += [f'{e.episode_id:<28} {e.robot or e.client or "?":<16} {e.deployment:<18} {e.version:>4} '
                  f'{e.age_s:>8.1f} {e.in_flight:>9} {e.requests:>9} {e.underruns:>9} {e.underrun_s:>10.2f}'
                  for e in reply.episodes]
        more = reply.total - len(reply.episodes)
        return lines + ([f'... and {more} more (--limit)'] if more > 0 else [])
    if command == 'stats':
        lines = [f'{"DEPLOYMENT":<18} {"VER":>4} {"LIVE":>5} {"ENDED":>7} {"REQUESTS":>9} {"UNDERRUNS":>9} '
                 f'{"UNDERRUN s":>10}  ENDED BY REASON']
        for v in reply.versions:
            reasons = ', '.join(f'{k} {n}' for k, n in sorted(v.ended_by_reason.items()))
            lines.append(f'{v.deployment:<18} {v.version:>4} {v.live_episodes:>5} {v.episodes_ended:>7} '
                         f'{v.requests:>9} {v.underruns:>9} {v.underrun_s:>10.2f}  {reasons or "-"}')
        return lines
    if command == 'versions':
        lines = [f'{"DEPLOYMENT":<18} {"VER":>4} {"ROLE":<12} {"STATE":<10} {"LIVE":>5}  CONTENT']
        lines += [f'{v.deployment:<18} {v.version:>4} {v.role:<12} {v.state:<10} {v.live_episodes:>5}  '
                  f'{v.content_sha256[:12] or "-"}' for v in reply.versions]
        return lines
    if command == 'log-level':
        return [f'log level {reply.level} (was {reply.previous})']
    return [('already draining' if reply.already_draining else 'draining') +
            f': {reply.open_streams} episode streams open; they may go on for up to {reply.drain_timeout_s:g} s, '
            'then the replica stops']


def _as_dict(reply: Any) -> dict[str, Any]:
    """``reply`` as JSON-ready fields, zero values included (protobuf's two spellings of that option)."""
    from google.protobuf import json_format

    try:
        return json_format.MessageToDict(reply, preserving_proto_field_name=True,
                                         always_print_fields_with_no_presence=True)
    except TypeError:   # protobuf < 5.26 (Ubuntu's for Humble and Jazzy) names the option so
        older: dict[str, Any] = {'including_default_value_fields': True}
        return json_format.MessageToDict(reply, preserving_proto_field_name=True, **older)


def _header(endpoint: str, reply: Any) -> str:
    draining = ' (draining)' if getattr(reply, 'draining', False) else ''
    return f'== {endpoint}: {reply.replica}{draining}'


def cmd_admin(args: argparse.Namespace) -> int:
    """Ask every endpoint; print each answer (or error); 0 when all answered, 1 when one did not."""
    import grpc

    from sequence_ai_ros.protocol import sequence_ai_pb2_grpc as pb_grpc

    targets = endpoints(args)
    if args.admin_command == 'drain' and len(targets) > 1 and not args.all:
        raise ConfigError(f'drain names {len(targets)} replicas ({", ".join(targets)}): draining them all stops '
                          'the fleet; name one --endpoint, or pass --all')
    token = read_token(args.token_file)
    metadata = [('authorization', f'Bearer {token}')] if token is not None else []
    creds = grpc.ssl_channel_credentials(read_file(args.tls_ca, '--tls-ca')) if args.tls_ca else None
    failed = 0
    for endpoint in targets:
        channel = grpc.secure_channel(endpoint, creds) if creds is not None else grpc.insecure_channel(endpoint)
        try:
            reply = _call(pb_grpc.AdminStub(channel), args.admin_command, args, metadata)
        except grpc.RpcError as exc:
            failed += 1
            print(f'seq admin: {endpoint}: {exc.code().name}: {exc.details()}', file=sys.stderr)
            continue
        finally:
            channel.close()
        if args.json:
            print(json.dumps({'endpoint': endpoint, **_as_dict(reply)}), flush=True)
        else:
            print('\n'.join([_header(endpoint, reply), *render(args.admin_command, reply)]), flush=True)
    return 1 if failed else 0


def add_parsers(sub: Any, groups: dict[str, Any]) -> None:
    """Register ``seq admin`` on ``seq``'s subparsers."""
    p = sub.add_parser('admin', help="a replica's admin API: live episodes, statistics, versions, log level, drain",
                       description='Speak the admin API (sequence_ai.v1.Admin) of each endpoint named: a replica\'s '
                                   'gRPC address (the shipped HAProxy config refuses admin calls on the robots\' '
                                   'port: name each replica).')
    p.add_argument('--endpoint', action='append', metavar='HOST:PORT',
                   help='a replica\'s gRPC address; repeat for several (default 127.0.0.1:50551)')
    p.add_argument('--replicas', metavar='FILE',
                   help='a file of replica addresses, HOST:PORT a line (seq fleet writes RUN_DIR/replicas)')
    p.add_argument('--token-file', help='file holding the workers\' token (needed when they have one)')
    p.add_argument('--tls-ca', metavar='PEM', help='CA certificate of workers that serve TLS')
    p.add_argument('--timeout', type=_seconds, default=10.0, metavar='S', help='per call, 0 < S <= 3600 (default 10)')
    p.add_argument('--json', action='store_true', help='one JSON object a line per replica')
    cmds = p.add_subparsers(dest='admin_command', metavar='COMMAND', required=True)
    q = cmds.add_parser('episodes', help='the episodes running: id, robot, deployment, version, age, in flight, '
                                         'underruns so far')
    q.add_argument('--deployment', help='only this deployment\'s')
    q.add_argument('--limit', type=int, default=0, metavar='N', help='at most N a replica, oldest first '
                                                                    '(default and most 1000)')
    q = cmds.add_parser('stats', help='per deployment and version: episodes live and ended (by reason), chunks '
                                      'answered, underruns')
    q.add_argument('--deployment', help='only this deployment\'s')
    cmds.add_parser('versions', help='the deployment versions loaded: serving, a rollout\'s, a deleted one finishing')
    q = cmds.add_parser('log-level', help='set the worker\'s log level')
    q.add_argument('level', choices=('debug', 'info', 'warning', 'error'))
    q = cmds.add_parser('drain', help='drain the replica and stop it, as SIGTERM does (its live episodes finish '
                                      'within its --drain-timeout; new ones go to the other replicas)')
    q.add_argument('--all', action='store_true', help='drain every endpoint named (the whole fleet)')
    p.set_defaults(func=cmd_admin)
