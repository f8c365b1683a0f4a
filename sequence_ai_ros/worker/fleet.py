"""A local fleet for development and tests: N ``seq serve`` replicas behind HAProxy (``seq fleet``).

Each replica is its own process (``python -m sequence_ai_ros.cli serve NAMES --warm``) on its own port,
with its HAProxy agent (``--agent-port``), Prometheus metrics (``--metrics-port``) and a proxy socket
(``--proxy-socket RUN_DIR/replicaK.sock``, owner-only in the fleet's private run directory): HAProxy reaches
each replica through that Unix socket, and only calls through it have their x-forwarded-for read as the
client's address (the per-client stream cap), so a local process forging the header on the TCP port gains
nothing. All replicas
share one ``$SEQ_HOME``: the registry, the usage database (additive SQLite updates) and each deployment's
capture store (SQLite index, per-process staging), so a fleet's field data exports as one dataset and a
label lands in the shared store whichever replica receives it.

HAProxy runs in the foreground (``haproxy -db``) on ``sequence_ai_ros/worker/haproxy.cfg`` rendered for N replicas (the
server lines between its ``# BEGIN SERVERS`` / ``# END SERVERS`` markers) with a stats socket added, so
:meth:`Fleet.balancer_state` can tell which replicas HAProxy sees UP and with what weight.

Processes are owned by :class:`Fleet`: :meth:`Fleet.stop` ends HAProxy, then SIGTERMs every replica (they
end their episodes with reason ``shutdown``) and waits, killing what outlives ``grace``. Its run directory
(``/tmp/seq-fleet-*``: the rendered config, the stats socket, every process's log, ``replicas``: each replica's
gRPC address a line, for ``seq admin --replicas``) is removed on a clean
stop, and kept (with its path in :attr:`Fleet.kept`) when a process crashed, failed to start or had to be
killed, so its logs can be read.

Ports are free ones unless pinned (``replica_ports``, ``agent_ports``, ``metrics_ports``: N ports each, or
one port as the first of N consecutive ones), so a dashboard or a Prometheus scrape config can name them.
A replica binds its free ports itself (port 0) and the fleet reads them from its log (``serving ... on``,
``metrics on``, ``agent on``): a port picked here and bound seconds later by the replica could meanwhile be
taken, e.g. as the source port of a connection. HAProxy cannot bind port 0 and report it: its port is picked
just before it starts, and picked again (up to :data:`BIND_ATTEMPTS` times) when it could not bind it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
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

#: The shipped HAProxy configuration (package data: found in a wheel or colcon install as in a checkout).
HAPROXY_CONFIG = Path(__file__).resolve().with_name('haproxy.cfg')
BEGIN, END = '# BEGIN SERVERS', '# END SERVERS'
#: Connections one source address may hold at the balancer (stick-table sc_conn_cur).
CONN_PER_CLIENT = 64
#: Starts of HAProxy on a free port before a bind failure is reported (a free port can be taken meanwhile).
BIND_ATTEMPTS = 3
#: What ``seq serve`` prints once its ports are bound (cli/serving.py); group 1 is ``host:port``.
#: Read from the replica's stdout alone (its log lines go to stderr) and from whole lines only.
_PORT_LINES = {'port': re.compile(r'^serving .* on (\S+?)(?: \(TLS\))?\n', re.M),
               'metrics_port': re.compile(r'^metrics on http://(\S+)/metrics\n', re.M),
               'agent_port': re.compile(r'^agent on (\S+) .*\n', re.M)}


def free_port(host: str = '127.0.0.1') -> int:
    """Return a TCP port that was free a moment ago (HAProxy cannot bind port 0 and report it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def pinned_ports(what: str, ports: Sequence[int] | None, replicas: int) -> list[int] | None:
    """Return ``replicas`` ports from ``ports`` (N ports, or one: the first of N consecutive), or None.

    :raises ConfigError: for another count or a port outside [1, 65535].
    """
    if ports is None:
        return None
    ports = list(ports)
    if len(ports) == 1:
        ports = [ports[0] + k for k in range(replicas)]
    if len(ports) != replicas:
        raise ConfigError(f'{what}: {len(ports)} ports for {replicas} replicas (give {replicas}, or one: the first '
                          f'of {replicas} consecutive ports)')
    bad = [p for p in ports if not (isinstance(p, int) and 0 < p <= 65535)]
    if bad:
        raise ConfigError(f'{what}: ports must be in [1, 65535], got {bad}')
    return ports


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


def _token_in(serve_args: Sequence[str]) -> str | None:
    """The token of ``--token-file F`` (or ``--token-file=F``) in serve_args, None without one."""
    args = [str(a) for a in serve_args]
    for i, arg in enumerate(args):
        path = arg.split('=', 1)[1] if arg.startswith('--token-file=') else (
            args[i + 1] if arg == '--token-file' and i + 1 < len(args) else None)
        if path is not None:
            try:
                return Path(path).expanduser().read_text().strip() or None
            except OSError as exc:
                raise ConfigError(f'--token-file {path}: {exc}') from None
    return None


def render_config(template: str, replicas: int, agent_send: bool = False) -> str:
    """Return ``template`` with the server lines for ``replicas`` replicas and a stats socket.

    :param agent_send: the replicas need their token from an agent probe: each server line sends it
        (``agent-send "${SEQ_AGENT_SEND}"``, the token in HAProxy's environment, never in the file).

    :raises ConfigError: when the template lacks the server markers or a ``global`` section.
    """
    if BEGIN not in template or END not in template or '\nglobal' not in '\n' + template:
        raise ConfigError(f'the HAProxy template needs a global section and the lines {BEGIN!r} ... {END!r}')
    head, rest = template.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    send = ' agent-send "${SEQ_AGENT_SEND}"' if agent_send else ''
    # the replicas are local: reached through their proxy sockets, their agents on 127.0.0.1
    servers = ''.join(f'    server replica{k} "${{SEQ_REPLICA_{k}}}" agent-port "${{SEQ_AGENT_{k}}}" '
                      f'agent-addr 127.0.0.1{send}\n' for k in range(1, replicas + 1))
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
    :param replica_homes: one $SEQ_HOME per replica instead (N paths: a registry, usage database and capture
        store each, as Kubernetes pods have them); None: every replica uses ``home``.
    :param serve_args: more ``seq serve`` options for every replica (e.g. ``['--token-file', F]``).
    :param haproxy_config: the template (default the shipped ``sequence_ai_ros/worker/haproxy.cfg``).
    :param ready_timeout_s: bound (s) for every replica to be ready and HAProxy to see it UP.
    :param replica_ports: pin the replicas' gRPC ports (N ports, or one: the first of N consecutive ones);
        None: free ones.
    :param agent_ports: pin their HAProxy agent ports, likewise.
    :param metrics_ports: pin their Prometheus ports, likewise.
    :raises MissingDependency: when HAProxy is not installed.
    :raises ConfigError: when a replica or HAProxy fails to start (their output is in the message), for
        pinned ports of the wrong count, out of range or used twice, or for TLS replicas (``--tls-cert`` in
        ``serve_args``, ``seq fleet --serve-options``) behind the shipped plaintext template.
    """

    def __init__(self, names: Sequence[str], replicas: int = 3, *, port: int = 0, home: str | Path | None = None,
                 serve_args: Sequence[str] = (), haproxy_config: str | Path | None = None,
                 ready_timeout_s: float = 60.0, conn_per_client: int = CONN_PER_CLIENT,
                 replica_ports: Sequence[int] | None = None, agent_ports: Sequence[int] | None = None,
                 metrics_ports: Sequence[int] | None = None,
                 replica_homes: Sequence[str | Path] | None = None) -> None:
        if replicas < 1:
            raise ConfigError(f'a fleet needs at least one replica, got {replicas}')
        if replica_homes is not None and len(replica_homes) != replicas:
            raise ConfigError(f'replica_homes: {len(replica_homes)} homes for {replicas} replicas')
        self._replica_homes = [str(h) for h in replica_homes] if replica_homes is not None else None
        pinned = {what: pinned_ports(what, ports, replicas) for what, ports in
                  (('--replica-ports', replica_ports), ('--agent-ports', agent_ports),
                   ('--metrics-ports', metrics_ports))}
        taken = [p for ports in pinned.values() for p in ports or ()] + ([port] if port else [])
        twice = sorted(p for p in set(taken) if taken.count(p) > 1)
        if twice:
            raise ConfigError(f'the fleet\'s pinned ports overlap: {twice} used twice (balancer --port, '
                              '--replica-ports, --agent-ports, --metrics-ports)')
        self._haproxy_bin = haproxy_binary()
        template_path = Path(haproxy_config) if haproxy_config is not None else HAPROXY_CONFIG
        if not template_path.is_file():
            raise ConfigError(f'HAProxy template {template_path} not found (pass --haproxy-config)')
        tls = [a for a in serve_args if str(a).split('=')[0] in ('--tls-cert', '--tls-key')]
        if tls and haproxy_config is None:
            # the shipped template speaks plaintext h2 to the replicas (its health check too): TLS replicas
            # would never come UP, and the fleet would fail only after ready_timeout_s
            raise ConfigError(f'{tls[0]} in the replicas\' seq serve options (seq fleet --serve-options, or '
                              f'serve_args) makes the replicas serve TLS, but the shipped HAProxy template '
                              f'({HAPROXY_CONFIG}) talks plaintext h2 to them and health-checks them so: they '
                              'would never come UP. Terminate TLS at HAProxy instead (a `crt` on its bind line, in '
                              'your own --haproxy-config), or give a template whose server lines use `ssl verify '
                              'required ca-file ...` with `check-ssl`.')
        #: the replicas' token (``--token-file`` in serve_args): their agents answer only a probe sending it
        self._token = _token_in(serve_args)
        self.run_dir = Path(tempfile.mkdtemp(prefix='seq-fleet-'))
        #: the run directory when :meth:`stop` kept it (a process crashed or had to be killed), else None
        self.kept: Path | None = None
        #: the balancer's port (a free one is picked when HAProxy starts, unless pinned)
        self.port = port
        self.replicas: list[Replica] = []
        self.haproxy: subprocess.Popen | None = None
        self._env = dict(os.environ)
        self._killed: set[int] = set()
        self._crashed: list[int] = []
        self._failed = False
        if home is not None:
            self._env['SEQ_HOME'] = str(home)
        self._names, self._serve_args = list(names), list(serve_args)
        try:
            for k in range(1, replicas + 1):
                ports = tuple(None if p is None else p[k - 1] for p in pinned.values())
                self.replicas.append(self._start_replica(k, list(names), list(serve_args), ports))
            self._wait_replicas(ready_timeout_s)
            self.replicas_file.write_text(''.join(f'{r.address}\n' for r in self.replicas))
            config = self.run_dir / 'haproxy.cfg'
            config.write_text(render_config(template_path.read_text(), replicas, agent_send=bool(self._token)))
            self._start_haproxy(config, conn_per_client, pinned=bool(port), timeout_s=ready_timeout_s)
        except BaseException as exc:
            self._failed = True
            self.stop(grace=2.0)
            if isinstance(exc, ConfigError):
                raise ConfigError(f'{exc}\n(the fleet\'s config and logs are kept in {self.kept})') from None
            raise

    @property
    def replicas_file(self) -> Path:
        """The replicas' gRPC addresses, ``HOST:PORT`` a line, for ``seq admin --replicas`` (in the run directory)."""
        return self.run_dir / 'replicas'

    def proxy_socket(self, index: int) -> Path:
        """Replica ``index``'s proxy socket, HAProxy's way in (in the private run directory)."""
        return self.run_dir / f'replica{index}.sock'

    @property
    def stats_socket(self) -> Path:
        """HAProxy's admin socket (``show stat``)."""
        return self.run_dir / 'haproxy.sock'

    @property
    def address(self) -> str:
        """``127.0.0.1:port`` robots dial (``connect(endpoint=...)``)."""
        return f'127.0.0.1:{self.port}'

    def _start_haproxy(self, config: Path, conn_per_client: int, pinned: bool, timeout_s: float) -> None:
        """Start HAProxy on :attr:`port` (a free one unless ``pinned``) and wait until it sees every replica UP.

        :raises ConfigError: when it exits (after :data:`BIND_ATTEMPTS` free ports, if it could not bind) or
            does not see the replicas UP within ``timeout_s``.
        """
        for attempt in range(1, BIND_ATTEMPTS + 1):
            if not pinned:
                self.port = free_port()
            lb_env = dict(self._env, SEQ_LB_BIND=f'127.0.0.1:{self.port}', SEQ_LB_STATS=str(self.stats_socket),
                          SEQ_LB_CONN_PER_CLIENT=str(conn_per_client))
            if self._token:
                lb_env['SEQ_AGENT_SEND'] = self._token + '\n'   # HAProxy sends it verbatim on each probe
            for r in self.replicas:
                lb_env[f'SEQ_REPLICA_{r.index}'] = f'unix@{self.proxy_socket(r.index)}'
                lb_env[f'SEQ_AGENT_{r.index}'] = str(r.agent_port)
            with open(self.run_dir / 'haproxy.log', 'w') as log:
                self.haproxy = subprocess.Popen([self._haproxy_bin, '-db', '-f', str(config)], env=lb_env,
                                                stdout=log, stderr=subprocess.STDOUT)
            try:
                self.wait_balanced(timeout_s)
                return
            except ConfigError:
                taken = self.haproxy.poll() is not None and 'cannot bind' in self.log('haproxy')
                if pinned or not taken or attempt == BIND_ATTEMPTS:
                    raise

    def _start_replica(self, k: int, names: list[str], serve_args: list[str],
                       pinned: tuple[int | None, ...] = (None, None, None), log_mode: str = 'w') -> Replica:
        port, agent, metrics = (p or 0 for p in pinned)    # 0: the replica binds a free one and prints it
        argv = [sys.executable, '-m', 'sequence_ai_ros.cli', 'serve', *names, '--port', str(port), '--warm',
                '--agent-port', str(agent), '--metrics-port', str(metrics), '--proxy-socket',
                str(self.proxy_socket(k)), *serve_args]
        # stdout apart from the log (stderr): with PYTHONUNBUFFERED a log line can land inside a printed one
        with open(self.run_dir / f'replica{k}.out', log_mode) as out, \
                open(self.run_dir / f'replica{k}.log', log_mode) as log:
            env = self._env if self._replica_homes is None else dict(self._env, SEQ_HOME=self._replica_homes[k - 1])
            proc = subprocess.Popen(argv, env=env, stdout=out, stderr=log, start_new_session=True)
        return Replica(k, port, agent, metrics, proc)

    def log(self, name: str) -> str:
        """Return the output so far of ``haproxy`` or ``replicaK`` (a replica's stdout, then its log)."""
        texts = [self._read(f'{name}.out'), self._read(f'{name}.log')]
        return '\n'.join(t for t in texts if t)

    def _read(self, file: str) -> str:
        path = self.run_dir / file
        return path.read_text(errors='replace') if path.exists() else ''

    def agent_status(self, replica: Replica) -> str:
        """Return what the replica's agent answers HAProxy now ('' when it does not answer)."""
        if not replica.agent_port:
            return ''
        try:
            with socket.create_connection(('127.0.0.1', replica.agent_port), timeout=1.0) as s:
                if self._token:
                    s.sendall(self._token.encode() + b'\n')
                return s.recv(64).decode().strip()
        except OSError:
            return ''

    def _wait_replicas(self, timeout_s: float, replicas: Sequence[Replica] | None = None) -> None:
        deadline = time.monotonic() + timeout_s
        for r in self.replicas if replicas is None else replicas:
            while not self._read_ports(r) or self.agent_status(r) != 'up ready':
                if r.process.poll() is not None:
                    raise ConfigError(f'replica {r.index} exited ({r.process.returncode}):\n'
                                      f'{self.log(f"replica{r.index}")}')
                if time.monotonic() > deadline:
                    raise ConfigError(f'replica {r.index} not ready after {timeout_s:g} s:\n'
                                      f'{self.log(f"replica{r.index}")}')
                time.sleep(0.1)

    def _read_ports(self, replica: Replica) -> bool:
        """Fill in ``replica``'s ports from what it printed once bound; return whether all three are known."""
        if replica.port and replica.agent_port and replica.metrics_port:
            return True
        text = self._read(f'replica{replica.index}.out')
        found = {what: line.group(1) for what, line in ((w, rx.search(text)) for w, rx in _PORT_LINES.items())
                 if line is not None}
        if len(found) < len(_PORT_LINES):
            return False
        for what, address in found.items():
            setattr(replica, what, int(address.rsplit(':', 1)[1]))
        return True

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
        """SIGKILL replica ``index`` (1-based), as a crash would (a deliberate kill: :meth:`stop` stays clean)."""
        r = self.replicas[index - 1]
        self._killed.add(r.index)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(r.process.pid, signal.SIGKILL)
        r.process.wait(timeout=10)

    def stop_replica(self, index: int, timeout_s: float = 60.0) -> None:
        """Stop replica ``index`` (1-based) and leave it stopped: SIGTERM, its drain, until HAProxy sees it down.

        New calls then hash to the other replicas; :meth:`restart` starts it again on the same ports.

        :raises ConfigError: when it does not exit, or HAProxy does not mark it DOWN, within ``timeout_s``.
        """
        r = self.replicas[index - 1]
        deadline = time.monotonic() + timeout_s
        self._killed.add(r.index)     # a deliberate stop: stop() stays clean
        if r.process.poll() is None:
            r.process.send_signal(signal.SIGTERM)
        try:
            r.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise ConfigError(f'replica {index} did not stop within {timeout_s:g} s of SIGTERM') from None
        while not self.balancer_state().get(f'replica{index}', ('DOWN', 0))[0].startswith('DOWN'):
            if time.monotonic() > deadline:
                raise ConfigError(f'HAProxy still sees replica {index} up {timeout_s:g} s after it stopped')
            time.sleep(0.1)

    def restart(self, index: int, timeout_s: float = 60.0) -> None:
        """Restart replica ``index`` (1-based) as a rolling update does: SIGTERM, its drain, a new process.

        The replica drains (``seq serve`` on SIGTERM: its agent answers ``drain``, so HAProxy hashes new
        episodes, and a same-id reconnect, to the others; its live episodes finish up to ``--drain-timeout``)
        and exits; a new one starts on the same ports and the call returns once HAProxy sees it UP.

        :raises ConfigError: when the old one does not exit, or the new one is not UP, within ``timeout_s``.
        """
        old = self.replicas[index - 1]
        deadline = time.monotonic() + timeout_s
        if old.process.poll() is None:
            old.process.send_signal(signal.SIGTERM)
        try:
            code = old.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise ConfigError(f'replica {index} did not stop within {timeout_s:g} s of SIGTERM') from None
        if code != 0:
            self._crashed.append(index)
        new = self._start_replica(index, self._names, self._serve_args,
                                  (old.port, old.agent_port, old.metrics_port), log_mode='a')
        self.replicas[index - 1] = new
        self._wait_replicas(max(1.0, deadline - time.monotonic()), [new])
        self.wait_balanced(max(1.0, deadline - time.monotonic()))

    def reap(self) -> list[int]:
        """Return the indices of replicas that exited on their own since the last call, and forget them.

        Such a crash makes :meth:`stop` keep the run directory (their logs are there).
        """
        dead = [r.index for r in self.replicas if r.process.poll() is not None and r.index not in self._killed]
        self._crashed += dead
        self.replicas = [r for r in self.replicas if r.index not in dead]
        return dead

    def stop(self, grace: float = 10.0) -> bool:
        """Stop HAProxy, then every replica (SIGTERM, then SIGKILL after ``grace`` s); idempotent.

        :returns: True when the stop was clean (every process ended on its signal, none crashed before, the
            fleet had started): the run directory is then removed; otherwise it is kept (:attr:`kept`).
        """
        clean = not self._failed and not self._crashed
        if self.haproxy is not None and self.haproxy.poll() is None:
            self.haproxy.terminate()
            try:
                self.haproxy.wait(timeout=5)
            except subprocess.TimeoutExpired:
                clean = False
                self.haproxy.kill()
                self.haproxy.wait(timeout=5)
        running = []
        for r in self.replicas:
            if r.process.poll() is None:
                r.process.send_signal(signal.SIGTERM)
                running.append(r)
            elif r.index not in self._killed and r.process.returncode != 0:
                clean = False   # it had exited on its own, with an error
        deadline = time.monotonic() + grace
        for r in running:
            try:
                clean &= r.process.wait(timeout=max(0.1, deadline - time.monotonic())) == 0
            except subprocess.TimeoutExpired:
                clean = False
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(r.process.pid, signal.SIGKILL)
                r.process.wait(timeout=5)
        if clean:
            shutil.rmtree(self.run_dir, ignore_errors=True)
        elif self.run_dir.exists():
            self.kept = self.run_dir
        return clean

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
