"""The worker's ``seq`` sub-commands: init, deploy, serve, fleet, deployments, delete, usage, train.

Registered by :func:`add_parsers` (called by :mod:`sequence_ai_ros.cli`); each parser's ``func(args)``
returns the exit code. Errors are :class:`~sequence_ai_ros.exceptions.SequenceAIError` subclasses, which
``seq`` prints as ``seq COMMAND: error: ...`` with exit code 2.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any

from sequence_ai_ros.cli.files import read_file, read_token
from sequence_ai_ros.exceptions import ConfigError, MissingDependency
from sequence_ai_ros.stop_signals import on_stop_signals
from sequence_ai_ros.templates import TEMPLATES_DIR
from sequence_ai_ros.worker.config import DRY_RUN_TIMEOUT_S

TEMPLATES = TEMPLATES_DIR


def _templates() -> dict[str, str]:
    """Return template name -> first line of its README, less the name (or '')."""
    out = {}
    for d in sorted(TEMPLATES.iterdir()) if TEMPLATES.is_dir() else ():
        if d.is_dir() and not d.name.startswith(('_', '.')):
            readme = d / 'README.md'
            first = readme.read_text().strip().splitlines()[0].lstrip('# ').strip() if readme.is_file() else ''
            out[d.name] = first.removeprefix(f'{d.name} — ')   # the README's title repeats the name
    return out


def cmd_init(args: argparse.Namespace) -> int:
    """``seq init TEMPLATE NAME`` copies a template into ./NAME; ``seq init --list`` lists them."""
    templates = _templates()
    if args.list or not args.template:
        if not templates:
            print(f'no templates in {TEMPLATES}')
        width = max(map(len, templates), default=0)
        for name, about in templates.items():
            print(f'{name:<{width}}  {about}')
        return 0
    if args.template not in templates:
        raise ConfigError(f'unknown template {args.template!r}; available: {", ".join(templates) or "none"}')
    if not args.name:
        raise ConfigError('seq init TEMPLATE NAME: NAME (the folder to create) is missing')
    dest = Path(args.name)
    if dest.exists() and any(dest.iterdir()):
        raise ConfigError(f'{dest} exists and is not empty; choose another NAME')
    shutil.copytree(TEMPLATES / args.template, dest, dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns('__pycache__', '*.pyc'))
    files = ', '.join(sorted(p.name for p in dest.iterdir()))
    print(f'created {dest}/ from template {args.template} ({files})')
    edit = f'{dest}/config.yaml (its comments say what to set)' if (dest / 'config.yaml').is_file() else \
        f'{dest}/policy.py'
    print(f'next: edit {edit}, then: seq deploy {dest}/policy.py')
    return 0


def cmd_deploy(args: argparse.Namespace) -> int:
    """``seq deploy NAME/policy.py``: validate (import, contract, dry run) and record; print how to serve.

    A folder whose content is the registered version's is not registered again (``unchanged: NAME version
    N``, exit 0) unless ``--force``.
    """
    from sequence_ai_ros.worker.registry import Registry, deploy, unchanged

    Registry().ensure_home()             # a $SEQ_HOME that cannot be written is named before anything runs
    if not args.force:
        same = unchanged(args.path, name=args.name, timeout_s=args.timeout, isolation=args.isolation)
        if same is not None:
            print(f'unchanged: {same.name} version {same.version} ({same.path}; content sha256 '
                  f'{same.content_sha256[:12]}): nothing registered (--force registers it as a new version)')
            return 0
    print(f'validating {args.path} ...', flush=True)
    rec, figures = deploy(args.path, name=args.name, dry_timeout_s=args.timeout, isolation=args.isolation,
                          force=True)
    print(f'ok: imports, contract {rec.action_space} D={rec.action_dim} T={rec.chunk_length} dt={rec.dt:g} s; '
          f'dry run load {figures.get("load_s", 0):.2f} s, inference {figures.get("infer_s", 0) * 1e3:.1f} ms')
    parts = ['policy.py'] + (['config.yaml'] if rec.config_sha256 else []) + \
        ([f'{len(rec.files)} artifact files'] if rec.files else [])
    print(f'deployed {rec.name} version {rec.version} ({rec.path}; content sha256 {rec.content_sha256[:12]}: '
          f'{", ".join(parts)})')
    print(f'serve it with: seq serve {rec.name} [--host 127.0.0.1] [--port 50551]')
    return 0


#: the longest dry-run bound ``--timeout`` takes (s): a day; a thread join takes no more than threading.TIMEOUT_MAX
MAX_DRY_RUN_TIMEOUT_S = 86400.0


def _dry_run_timeout(text: str) -> float:
    """``--timeout S``: a finite number of seconds, 0 < S <= :data:`MAX_DRY_RUN_TIMEOUT_S`."""
    try:
        value = float(text)
    except ValueError:
        value = float('nan')
    if not 0 < value <= MAX_DRY_RUN_TIMEOUT_S:    # false for nan and inf too
        raise argparse.ArgumentTypeError(f'expected seconds, 0 < S <= {MAX_DRY_RUN_TIMEOUT_S:g}, got {text!r}')
    return value


def cmd_serve(args: argparse.Namespace) -> int:
    """``seq serve NAME``: serve until SIGINT/SIGTERM (or ``seq admin drain``), then stop gracefully."""
    from sequence_ai_ros.protocol import tracing
    from sequence_ai_ros.worker import logs
    from sequence_ai_ros.worker.server import create_server, serve_policy_file

    logs.configure(args.log_format, args.log_level)
    config = server_config(args)
    if args.otlp_endpoint:
        tracing.configure(args.otlp_endpoint, args.trace_sample_ratio, service='sequence_ai-worker')
        tracing.export_to_children(args.otlp_endpoint, args.trace_sample_ratio)   # its deployment processes
    if len(args.names) == 1 and args.names[0].endswith('.py') and Path(args.names[0]).is_file():
        server = serve_policy_file(args.names[0], config=config, home=None)
    else:
        server = create_server(args.names, config)
    stop = threading.Event()
    signals = on_stop_signals(stop.set)     # the handler takes no lock (see stop_signals)
    server.drain_request.handle_with(stop.set)   # seq admin drain: the path SIGTERM takes
    try:
        print(f'serving {" ".join(sorted(server.runtimes))} on {server.host}:{server.port}'
              f'{" (TLS)" if server.tls else ""}', flush=True)
        if server.metrics_port is not None:
            print(f'metrics on http://{server.host}:{server.metrics_port}/metrics', flush=True)
        if server.agent is not None:
            print(f'agent on {server.host}:{server.agent.port} (HAProxy agent-check)', flush=True)
        if server.probe_port is not None:
            print(f'probe on {server.host}:{server.probe_port} (plaintext gRPC health only)', flush=True)
        while not stop.wait(timeout=1.0):
            pass
    finally:
        if stop.is_set():   # a stop signal: drain first (a KeyboardInterrupt or an error stops at once)
            print(f'draining (up to {server.config.drain_timeout_s:g} s) ...', flush=True)
            server.drain()
        print('stopping ...', flush=True)
        server.stop(grace=2.0)
        signals.restore()
        tracing.shutdown()      # export the spans still batched
    return 0


def server_config(args: argparse.Namespace) -> Any:
    """Return the :class:`~sequence_ai_ros.worker.config.ServerConfig` that ``seq serve``'s ``args`` describe.

    :raises ConfigError: for --tls-cert without --tls-key (or the reverse), an empty token file or an invalid
        value.
    """
    from sequence_ai_ros.worker.config import cli_options, from_cli

    if bool(args.tls_cert) != bool(args.tls_key):
        raise ConfigError('--tls-cert and --tls-key go together')
    tls = (args.tls_cert, args.tls_key) if args.tls_cert else None
    if tls is not None:
        read_file(tls[0], '--tls-cert')
        read_file(tls[1], '--tls-key')
    return from_cli({name: getattr(args, name) for name, _, _ in cli_options()}, token=read_token(args.token_file),
                    tls=tls)


def add_server_options(parser: argparse.ArgumentParser) -> None:
    """Add ``seq serve``'s worker options (from :class:`~sequence_ai_ros.worker.config.ServerConfig`) to ``parser``."""
    from sequence_ai_ros.worker.config import cli_options

    options = dict((name, (flag, kwargs)) for name, flag, kwargs in cli_options())
    for name in ('host', 'port'):
        flag, kwargs = options.pop(name)
        parser.add_argument(flag, **kwargs)
    parser.add_argument('--token-file', help='file holding the token every call must carry; required when the '
                                             'worker is reachable from other machines (--host other than '
                                             '127.0.0.1)')
    parser.add_argument('--tls-cert', help='PEM certificate chain, to serve TLS (with --tls-key)')
    parser.add_argument('--tls-key', help='PEM private key')
    for flag, kwargs in options.values():
        parser.add_argument(flag, **kwargs)


def add_tracing_options(parser: argparse.ArgumentParser) -> None:
    """Add ``--otlp-endpoint`` and ``--trace-sample-ratio`` (OpenTelemetry tracing, off by default)."""
    parser.add_argument('--otlp-endpoint', metavar='HOST:PORT',
                        help='trace episodes with OpenTelemetry and export the spans over OTLP/gRPC to this '
                             'collector (plaintext; https://HOST:PORT for TLS); needs the [tracing] extra '
                             '(default: no tracing)')
    parser.add_argument('--trace-sample-ratio', type=float, default=1.0, metavar='R',
                        help='with --otlp-endpoint: the share of episodes traced that no robot traced first, 0..1; '
                             "an episode whose robot sent a trace follows the robot's choice (default 1.0)")


def cmd_deployments(args: argparse.Namespace) -> int:
    """``seq deployments``: list the registry."""
    from sequence_ai_ros.worker.registry import Registry

    registry = Registry()
    records = registry.list()
    if not records:
        print(f'no deployments in {registry.file}')
        return 0
    print(f'{"NAME":<20} {"VER":>4} {"ACTION SPACE":<15} {"D":>3} {"T":>4} {"DT(s)":>8}  {"DEPLOYED":<19} PATH')
    for r in records:
        when = time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(r.deployed_at))
        print(f'{r.name:<20} {r.version:>4} {r.action_space:<15} {r.action_dim:>3} {r.chunk_length:>4} '
              f'{r.dt:>8.4f}  {when:<19} {r.path}')
    return 0


def cmd_delete(args: argparse.Namespace) -> int:
    """``seq delete NAME``: remove a deployment and its usage, and its captured data once confirmed.

    Refused (exit 2) while a worker of this ``$SEQ_HOME`` runs episodes of it, unless ``--force``; captured
    data is removed only with ``--yes`` or a "y" at the prompt (a terminal), and kept with ``--keep-data``.
    The running episodes are looked at again after the prompt, just before the deletion: one a robot started
    while the question was asked is seen.
    """
    from sequence_ai_ros.worker.registry import Registry

    registry = Registry()
    rec = registry.get(args.name)
    if _refuse_running(registry, rec.name, args.force):
        return 2
    stored = _capture_bytes(registry.home).get(rec.name, 0)
    keep = args.keep_data
    if stored and not keep and not args.yes:
        question = (f'{rec.name} has {stored} bytes of captured field data in {registry.capture_dir(rec.name)}; '
                    'remove it too? [y/N] ')
        if not sys.stdin.isatty():
            print(f'seq delete: error: {question.split(";")[0]}: pass --yes to remove it with the deployment, or '
                  '--keep-data to keep it', file=sys.stderr)
            return 2
        if input(question).strip().lower() not in ('y', 'yes'):
            keep = True
        if _refuse_running(registry, rec.name, args.force):   # an episode may have started while we asked
            return 2
    rec = registry.delete(args.name, keep_data=keep)
    data = (f'its captured data kept in {registry.capture_dir(rec.name)}' if keep and stored else
            'its capture' if stored else 'no captured data')
    print(f'deleted {rec.name} (version {rec.version}) with its usage, {data}; {rec.path} is left as is')
    return 0


def _refuse_running(registry: Any, name: str, force: bool) -> bool:
    """Print why and return True when a worker of ``registry``'s home runs episodes of ``name`` (and not ``force``)."""
    from sequence_ai_ros.worker.live import running_episodes

    running = running_episodes(registry.home).get(name, {})
    if running and not force:
        where = ', '.join(f'{n} on seq serve pid {pid}' for pid, n in sorted(running.items()))
        print(f'seq delete: error: {name} has episodes running ({where}): deleting it now would lose their '
              'capture. Wait for them to end, or pass --force', file=sys.stderr)
        return True
    return False


def _capture_bytes(home: Path) -> dict[str, int]:
    root = home / 'capture'
    if not root.is_dir():
        return {}
    try:
        from sequence_ai_ros.capture.store import CaptureStore
    except ImportError:
        return {}
    stored = {d.name: CaptureStore(root=d, deployment=d.name).captured_bytes() for d in sorted(root.iterdir())
              if d.is_dir()}
    return {name: nbytes for name, nbytes in stored.items() if nbytes}   # never captured: nothing to bill


def cmd_usage(args: argparse.Namespace) -> int:
    """``seq usage``: per deployment, billed inference seconds, unbilled warming, sessions, episodes; capture bytes."""
    from sequence_ai_ros.worker.registry import Registry
    from sequence_ai_ros.worker.usage import Usage, read_usage

    registry = Registry()
    usage = read_usage(registry.usage_file)
    for rec in registry.list():
        usage.setdefault(rec.name, Usage())
    captured = _capture_bytes(registry.home)
    if not usage and not captured:
        print(f'no usage recorded in {registry.usage_file}')
        return 0
    print(f'{"DEPLOYMENT":<24} {"INFERENCE s (billed)":>21} {"WARMING s (not billed)":>23} {"SESSIONS":>9} '
          f'{"EPISODES":>9} {"REQUESTS":>9}')
    for name, u in sorted(usage.items()):
        print(f'{name:<24} {u.inference_s:>21.3f} {u.warming_s:>23.3f} {u.sessions:>9} {u.episodes:>9} '
              f'{u.requests:>9}')
    for name, nbytes in captured.items():
        print(f'{"capture:" + name:<24} {nbytes:>21} bytes stored')
    return 0


def _training_parser(sub: Any) -> None:
    parser = sub.add_parser('train', help='train an embedded model (ridge) into a deployment folder')
    try:
        from sequence_ai_ros.models import ridge_training as training
    except ImportError as exc:
        err = str(exc)

        def unavailable(args: argparse.Namespace) -> int:
            raise MissingDependency(f'seq train is unavailable: {err}')

        parser.set_defaults(func=unavailable)
        return
    training.add_arguments(parser)
    parser.set_defaults(func=training.main)


def add_parsers(sub: Any, groups: dict[str, Any]) -> None:
    """Register the worker's sub-commands on ``seq``'s subparsers."""
    p = sub.add_parser('init', help='copy a policy template into ./NAME (seq init --list)')
    p.add_argument('template', nargs='?', help='template name (see --list)')
    p.add_argument('name', nargs='?', help='folder to create')
    p.add_argument('--list', action='store_true', help='list the templates')
    p.set_defaults(func=cmd_init)

    p = sub.add_parser('deploy', help='validate a policy.py (import, contract, dry run) and register it')
    p.add_argument('path', help='NAME/policy.py')
    p.add_argument('--name', help='deployment name (default: the policy folder name)')
    p.add_argument('--timeout', type=_dry_run_timeout, default=DRY_RUN_TIMEOUT_S, metavar='S',
                   help=f'fail when the dry run (construct, load, one inference) takes over S seconds '
                        f'(default {DRY_RUN_TIMEOUT_S:g})')
    p.add_argument('--isolation', choices=('process', 'none'), default='process',
                   help="where the checks run: 'process' (a deployment process, killed when the bound passes; "
                        "default) or 'none' (this process)")
    p.add_argument('--force', action='store_true',
                   help="register a new version even when the folder's content (policy.py, config.yaml, the "
                        "artifacts) is the registered version's (default: 'unchanged', nothing registered)")
    p.set_defaults(func=cmd_deploy)

    p = sub.add_parser('serve', help='serve deployments to robots over gRPC')
    p.add_argument('names', nargs='+', metavar='NAME', help='deployment name(s), or a policy.py to serve unregistered')
    add_server_options(p)
    from sequence_ai_ros.worker.logs import add_log_options

    add_log_options(p)
    add_tracing_options(p)
    p.set_defaults(func=cmd_serve)

    from sequence_ai_ros.cli import fleet

    fleet.add_parser(sub)
    p = sub.add_parser('deployments', help='list deployments')
    p.set_defaults(func=cmd_deployments)
    p = sub.add_parser('delete', help='delete a deployment (its captured data once confirmed)')
    p.add_argument('name')
    p.add_argument('--force', action='store_true', help='delete even while a worker runs episodes of it')
    p.add_argument('--yes', action='store_true', help='remove its captured field data without asking')
    p.add_argument('--keep-data', action='store_true', help='keep its captured field data on disk')
    p.set_defaults(func=cmd_delete)
    p = sub.add_parser('usage', help='usage per deployment: inference (billed), warming, sessions, episodes')
    p.set_defaults(func=cmd_usage)
    _training_parser(sub)


def main(argv: list[str] | None = None) -> int:
    """Run the worker's sub-commands alone (``python -m sequence_ai_ros.cli.serving``); ``seq`` is the usual way."""
    from sequence_ai_ros.exceptions import SequenceAIError

    parser = argparse.ArgumentParser(prog='seq')
    add_parsers(parser.add_subparsers(dest='command', metavar='COMMAND', required=True), {})
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except SequenceAIError as exc:
        print(f'seq {args.command}: error: {exc}', file=sys.stderr)
        return 2


if __name__ == '__main__':
    sys.exit(main())
