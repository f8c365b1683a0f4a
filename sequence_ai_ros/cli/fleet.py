"""``seq fleet NAME... --replicas N``: a local fleet for development, N ``seq serve`` replicas behind HAProxy.

One command starts it (see :class:`sequence_ai_ros.worker.fleet.Fleet`) and prints where robots dial and
where each replica's metrics are; Ctrl-C (or SIGTERM) stops HAProxy and every replica cleanly.
"""

from __future__ import annotations

import argparse
import shlex
import signal
import threading
from typing import Any


def cmd_fleet(args: argparse.Namespace) -> int:
    """Run the fleet until SIGINT/SIGTERM."""
    from sequence_ai_ros.protocol import DEFAULT_PORT
    from sequence_ai_ros.worker.fleet import Fleet

    serve_args = shlex.split(args.serve_options or '')
    fleet = Fleet(args.names, args.replicas, port=DEFAULT_PORT if args.port is None else args.port,
                  serve_args=serve_args, haproxy_config=args.haproxy_config)
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        print(f'fleet of {len(fleet.replicas)} replicas behind HAProxy on {fleet.address} '
              f'(config and logs in {fleet.run_dir})', flush=True)
        for r in fleet.replicas:
            print(f'  replica{r.index}: gRPC {r.address}, agent {r.agent_port}, '
                  f'metrics http://127.0.0.1:{r.metrics_port}/metrics', flush=True)
        while not stop.wait(timeout=1.0):
            dead = [r.index for r in fleet.replicas if r.process.poll() is not None]
            if dead:
                print(f'replicas {dead} exited; HAProxy routes their episodes to the others', flush=True)
                fleet.replicas = [r for r in fleet.replicas if r.index not in dead]
    finally:
        print('stopping the fleet ...', flush=True)
        fleet.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0


def add_parser(sub: Any) -> None:
    """Register ``seq fleet`` on ``seq``'s subparsers."""
    p = sub.add_parser('fleet', help='development fleet: N seq serve replicas behind HAProxy (sticky episodes)')
    p.add_argument('names', nargs='+', metavar='NAME', help='deployment name(s), or a policy.py')
    p.add_argument('--replicas', type=int, default=3, metavar='N', help='replicas to start (default 3)')
    p.add_argument('--port', type=int, default=None, help='the balancer\'s port (default 50551; 0 picks one)')
    p.add_argument('--haproxy-config', help='HAProxy template (default deploy/haproxy.cfg)')
    p.add_argument('--serve-options', metavar='"OPTIONS"',
                   help='more seq serve options for every replica, quoted (e.g. "--token-file F --idle-timeout 60")')
    p.set_defaults(func=cmd_fleet)
