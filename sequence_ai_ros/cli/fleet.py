"""``seq fleet NAME... --replicas N``: a local fleet for development, N ``seq serve`` replicas behind HAProxy.

One command starts it (see :class:`sequence_ai_ros.worker.fleet.Fleet`) and prints where robots dial and
where each replica's metrics are; Ctrl-C (or SIGTERM) stops HAProxy and every replica cleanly and removes
the fleet's run directory (kept, and named, when a process crashed or had to be killed). ``--replica-ports``,
``--agent-ports`` and ``--metrics-ports`` pin the replicas' ports (default: free ones).
"""

from __future__ import annotations

import argparse
import shlex
import threading
from typing import Any


def cmd_fleet(args: argparse.Namespace) -> int:
    """Run the fleet until SIGINT/SIGTERM."""
    from sequence_ai_ros.protocol import DEFAULT_PORT
    from sequence_ai_ros.stop_signals import on_stop_signals
    from sequence_ai_ros.worker.fleet import Fleet

    serve_args = shlex.split(args.serve_options or '')
    stop = threading.Event()
    # before the replicas start (they run in sessions of their own: a SIGTERM during start-up reaches only
    # this process, which then stops them like any other time); the handler takes no lock (stop_signals)
    signals = on_stop_signals(stop.set)
    try:
        fleet = Fleet(args.names, args.replicas, port=DEFAULT_PORT if args.port is None else args.port,
                      serve_args=serve_args, haproxy_config=args.haproxy_config, replica_ports=args.replica_ports,
                      agent_ports=args.agent_ports, metrics_ports=args.metrics_ports)
    except BaseException:
        signals.restore()
        raise
    try:
        print(f'fleet of {len(fleet.replicas)} replicas behind HAProxy on {fleet.address} '
              f'(config and logs in {fleet.run_dir})', flush=True)
        for r in fleet.replicas:
            print(f'  replica{r.index}: gRPC {r.address}, agent {r.agent_port}, '
                  f'metrics http://127.0.0.1:{r.metrics_port}/metrics', flush=True)
        print(f'admin: seq admin --replicas {fleet.replicas_file} [--token-file F] episodes|stats|versions; '
              'seq admin --endpoint REPLICA drain', flush=True)
        while not stop.wait(timeout=1.0):
            dead = fleet.reap()
            if dead:
                print(f'replicas {dead} exited; HAProxy routes their episodes to the others', flush=True)
    finally:
        print('stopping the fleet ...', flush=True)
        clean = fleet.stop()
        print(f'stopped; removed {fleet.run_dir}' if clean else f'stopped; logs kept in {fleet.kept}', flush=True)
        signals.restore()
    return 0


def _ports(text: str) -> list[int]:
    """``P1,P2,...`` (one per replica) or ``P`` (the first of N consecutive) -> ports, for argparse."""
    try:
        return [int(p) for p in text.split(',') if p.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f'expected ports as P or P1,P2,..., got {text!r}') from None


def add_parser(sub: Any) -> None:
    """Register ``seq fleet`` on ``seq``'s subparsers."""
    p = sub.add_parser('fleet', help='development fleet: N seq serve replicas behind HAProxy (sticky episodes)')
    p.add_argument('names', nargs='+', metavar='NAME', help='deployment name(s), or a policy.py')
    p.add_argument('--replicas', type=int, default=3, metavar='N', help='replicas to start (default 3)')
    p.add_argument('--port', type=int, default=None, help='the balancer\'s port (default 50551; 0 picks one)')
    for kind, what in (('replica', "the replicas' gRPC ports"), ('agent', "their HAProxy agent ports"),
                       ('metrics', "their Prometheus /metrics ports")):
        p.add_argument(f'--{kind}-ports', type=_ports, metavar='P[,P...]',
                       help=f'pin {what}: one per replica, or one port as the first of N consecutive '
                            '(default: free ones)')
    p.add_argument('--haproxy-config', help='HAProxy template (default the shipped sequence_ai_ros/worker/haproxy.cfg)')
    p.add_argument('--serve-options', metavar='"OPTIONS"',
                   help='more seq serve options for every replica, quoted (e.g. "--token-file F --idle-timeout 60")')
    p.set_defaults(func=cmd_fleet)
