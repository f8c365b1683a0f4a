"""A local fleet for development and tests: N ``seq serve`` replicas behind HAProxy (``seq fleet``).

Each replica is its own process (``python -m sequence_ai_ros.cli serve NAMES --warm``) on its own port,
with its HAProxy agent (``--agent-port``), Prometheus metrics (``--metrics-port``) and
``--trusted-proxy 127.0.0.1`` (the per-client stream cap reads HAProxy's x-forwarded-for). All replicas
share one ``$SEQ_HOME``: the registry, the usage database (additive SQLite updates) and each deployment's
capture store (SQLite index, per-process staging), so a fleet's field data exports as one dataset and a
label lands in the shared store whichever replica receives it.

HAProxy runs in the foreground (``haproxy -db``) on ``deploy/haproxy.cfg`` rendered for N replicas (the
server lines between its ``# BEGIN SERVERS`` / ``# END SERVERS`` markers) with a stats socket added, so
:meth:`Fleet.balancer_state` can tell which replicas HAProxy sees UP and with what weight.

Processes are owned by :class:`Fleet`: :meth:`Fleet.stop` ends HAProxy, then SIGTERMs every replica (they
end their episodes with reason ``shutdown``) and waits, killing what outlives ``grace``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from sequence_ai_ros.exceptions import ConfigError, MissingDependency

#: The shipped HAProxy configuration (a repository file; pass ``haproxy_config`` elsewhere).
HAPROXY_CONFIG = Path(__file__).resolve().parents[2] / 'deploy' / 'haproxy.cfg'
BEGIN, END = '# BEGIN SERVERS', '# END SERVERS'
#: Connections one source address may hold at the balancer (stick-table sc_conn_cur).
CONN_PER_CLIENT = 64


def free_port(host: str = '127.0.0.1') -> int:
    """Return a TCP port that was free a moment ago (HAProxy cannot bind port 0 and report it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def haproxy_binary() -> str:
    """Return the path of ``haproxy``.

    :raises MissingDependency: when it is not installed (``make haproxy`` installs Debian's as root).
    """
    path = shutil.which('haproxy') or next((p for p in ('/usr/sbin/haproxy', '/usr/local/sbin/haproxy')
                                            if os.access(p, os.X_OK)), None)
    if path is None:
        raise MissingDependency('the fleet needs HAProxy (>= 2.6): `sudo apt-get install haproxy` on Debian/Ubuntu, '
                                'or `make haproxy` as root')
    return path


def render_config(template: str, replicas: int) -> str:
    """Return ``template`` with the server lines for ``replicas`` replicas and a stats socket.

    :raises ConfigError: when the template lacks the server markers or a ``global`` section.
    """
    if BEGIN not in template or END not in template or '\nglobal' not in '\n' + template:
        raise ConfigError(f'the HAProxy template needs a global section and the lines {BEGIN!r} ... {END!r}')
    head, rest = template.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    servers = ''.join(f'    server replica{k} "${{SEQ_REPLICA_{k}}}" agent-port "${{SEQ_AGENT_{k}}}"\n'
                      for k in range(1, replicas + 1))
    out = f'{head}{BEGIN}\n{servers}    {END}{tail}'
    return out.replace('\nglobal\n', '\nglobal\n    stats socket "${SEQ_LB_STATS}" mode 600 level admin\n', 1)


@dataclasses.dataclass
class Replica:
    """One replica process: its gRPC, agent and metrics ports, and the process."""

    index: int
    port: int
    agent_port: int
    metrics_port: int
    process: subprocess.Popen

    @property
    def address(self) -> str:
        """``127.0.0.1:port`` of its gRPC server."""
        return f'127.0.0.1:{self.port}'


class Fleet:
    """Start ``replicas`` workers serving ``names`` and HAProxy in front of them; a context manager.

    :param names: deployment names (or one policy.py), as ``seq serve`` takes them.
    :param replicas: how many replicas, >= 1.
    :param port: the balancer's port robots dial (0: a free one, see :attr:`port`).
    :param home: the shared $SEQ_HOME (default the environment's).
    :param serve_args: more ``seq serve`` options for every replica (e.g. ``['--token-file', F]``).
    :param haproxy_config: the template (default the shipped ``deploy/haproxy.cfg``).
    :param ready_timeout_s: bound (s) for every replica to be ready and HAProxy to see it UP.
    :raises MissingDependency: when HAProxy is not installed.
    :raises ConfigError: when a replica or HAProxy fails to start (their output is in the message).
    """

    def __init__(self, names: Sequence[str], replicas: int = 3, *, port: int = 0, home: str | Path | None = None,
                 serve_args: Sequence[str] = (), haproxy_config: str | Path | None = None,
                 ready_timeout_s: float = 60.0, conn_per_client: int = CONN_PER_CLIENT) -> None:
        if replicas < 1:
            raise ConfigError(f'a fleet needs at least one replica, got {replicas}')
        self._haproxy_bin = haproxy_binary()
        template_path = Path(haproxy_config) if haproxy_config is not None else HAPROXY_CONFIG
        if not template_path.is_file():
            raise ConfigError(f'HAProxy template {template_path} not found (pass --haproxy-config)')
        self.run_dir = Path(tempfile.mkdtemp(prefix='seq-fleet-'))
        self.port = port or free_port()
        self.replicas: list[Replica] = []
        self.haproxy: subprocess.Popen | None = None
        self._env = dict(os.environ)
        if home is not None:
            self._env['SEQ_HOME'] = str(home)
        try:
            for k in range(1, replicas + 1):
                self.replicas.append(self._start_replica(k, list(names), list(serve_args)))
            self._wait_replicas(ready_timeout_s)
            config = self.run_dir / 'haproxy.cfg'
            config.write_text(render_config(template_path.read_text(), replicas))
            lb_env = dict(self._env, SEQ_LB_BIND=f'127.0.0.1:{self.port}', SEQ_LB_STATS=str(self.stats_socket),
                          SEQ_LB_CONN_PER_CLIENT=str(conn_per_client))
            for r in self.replicas:
                lb_env[f'SEQ_REPLICA_{r.index}'] = r.address
                lb_env[f'SEQ_AGENT_{r.index}'] = str(r.agent_port)
            self.haproxy = subprocess.Popen([self._haproxy_bin, '-db', '-f', str(config)], env=lb_env,
                                            stdout=open(self.run_dir / 'haproxy.log', 'w'), stderr=subprocess.STDOUT)
            self.wait_balanced(ready_timeout_s)
        except BaseException:
            self.stop(grace=2.0)
            raise

    @property
    def stats_socket(self) -> Path:
        """HAProxy's admin socket (``show stat``)."""
        return self.run_dir / 'haproxy.sock'

    @property
    def address(self) -> str:
        """``127.0.0.1:port`` robots dial (``connect(endpoint=...)``)."""
        return f'127.0.0.1:{self.port}'

    def _start_replica(self, k: int, names: list[str], serve_args: list[str]) -> Replica:
        port, agent, metrics = free_port(), free_port(), free_port()
        argv = [sys.executable, '-m', 'sequence_ai_ros.cli', 'serve', *names, '--port', str(port), '--warm',
                '--agent-port', str(agent), '--metrics-port', str(metrics), '--trusted-proxy', '127.0.0.1',
                *serve_args]
        log = open(self.run_dir / f'replica{k}.log', 'w')
        proc = subprocess.Popen(argv, env=self._env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        return Replica(k, port, agent, metrics, proc)

    def log(self, name: str) -> str:
        """Return the output so far of ``haproxy`` or ``replicaK``."""
        path = self.run_dir / f'{name}.log'
        return path.read_text(errors='replace') if path.exists() else ''

    def agent_status(self, replica: Replica) -> str:
        """Return what the replica's agent answers HAProxy now ('' when it does not answer)."""
        try:
            with socket.create_connection(('127.0.0.1', replica.agent_port), timeout=1.0) as s:
                return s.recv(64).decode().strip()
        except OSError:
            return ''

    def _wait_replicas(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for r in self.replicas:
            while self.agent_status(r) != 'up ready':
                if r.process.poll() is not None:
                    raise ConfigError(f'replica {r.index} exited ({r.process.returncode}):\n'
                                      f'{self.log(f"replica{r.index}")}')
                if time.monotonic() > deadline:
                    raise ConfigError(f'replica {r.index} not ready after {timeout_s:g} s:\n'
                                      f'{self.log(f"replica{r.index}")}')
                time.sleep(0.1)

    def balancer_state(self) -> dict[str, tuple[str, int]]:
        """Return ``{replicaK: (status, weight)}`` as HAProxy sees its servers (``show stat``)."""
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(2.0)
                s.connect(str(self.stats_socket))
                s.sendall(b'show stat\n')
                data = b''
                while chunk := s.recv(65536):
                    data += chunk
        except OSError:
            return {}
        lines = data.decode().splitlines()
        if not lines:
            return {}
        header = lines[0].lstrip('# ').split(',')
        out = {}
        for line in lines[1:]:
            row = dict(zip(header, line.split(','), strict=False))
            if row.get('pxname') == 'replicas' and row.get('svname', '').startswith('replica'):
                out[row['svname']] = (row.get('status', ''), int(row.get('weight') or 0))
        return out

    def wait_balanced(self, timeout_s: float = 30.0, up: set[int] | None = None) -> None:
        """Wait until HAProxy sees replicas ``up`` (default all running ones) UP with weight > 0.

        :raises ConfigError: when HAProxy exits or the wait exceeds ``timeout_s``.
        """
        want = up if up is not None else {r.index for r in self.replicas if r.process.poll() is None}
        deadline = time.monotonic() + timeout_s
        while True:
            if self.haproxy is not None and self.haproxy.poll() is not None:
                raise ConfigError(f'haproxy exited ({self.haproxy.returncode}):\n{self.log("haproxy")}')
            state = self.balancer_state()
            if state and all(state.get(f'replica{k}', ('', 0))[0] == 'UP' and state[f'replica{k}'][1] > 0
                             for k in want):
                return
            if time.monotonic() > deadline:
                raise ConfigError(f'HAProxy does not see replicas {sorted(want)} up after {timeout_s:g} s: {state}\n'
                                  f'{self.log("haproxy")}')
            time.sleep(0.1)

    def kill(self, index: int) -> None:
        """SIGKILL replica ``index`` (1-based), as a crash would."""
        r = self.replicas[index - 1]
        with contextlib.suppress(ProcessLookupError):
            os.killpg(r.process.pid, signal.SIGKILL)
        r.process.wait(timeout=10)

    def stop(self, grace: float = 10.0) -> None:
        """Stop HAProxy, then every replica (SIGTERM, then SIGKILL after ``grace`` s); idempotent."""
        if self.haproxy is not None and self.haproxy.poll() is None:
            self.haproxy.terminate()
            try:
                self.haproxy.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.haproxy.kill()
                self.haproxy.wait(timeout=5)
        for r in self.replicas:
            if r.process.poll() is None:
                r.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for r in self.replicas:
            try:
                r.process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(r.process.pid, signal.SIGKILL)
                r.process.wait(timeout=5)

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
