"""The autoscalers' PromQL against a real Prometheus scraping real workers (deploy/kubernetes/autoscaling-*.yaml).

Prometheus (Debian 12's 2.42: ``make prometheus`` as root) scrapes two live workers every second as the
ServiceMonitor would (job ``seq-worker``, a ``namespace`` label). KEDA's trigger queries and the HPA's External
metrics, rendered as the Prometheus Adapter renders them, are asked of it through its HTTP API while robots come
and go over real gRPC: both values rise with the robots (episodes in progress; requests waiting while the policy
is held) and fall back to 0 once they leave, by EpisodeEnd or by dropping the stream. Counts only, bounded waits.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import subprocess
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import autoscale_queries
import numpy as np
import pytest
import yaml
from test_worker_support import Stream, channel, handshake, state_request, wait_for, wait_ready

from sequence_ai_ros.protocol import sequence_ai_pb2_grpc as pb_grpc
from sequence_ai_ros.worker import serve_policy_file

PROMETHEUS = shutil.which('prometheus') or '/usr/bin/prometheus'
STUCK = Path(__file__).resolve().parent / 'policies' / 'worker_stuck.py'
NAMESPACE = 'seq'
NAMES = ['a', 'b']

pytest.importorskip('prometheus_client', reason='prometheus_client is not installed')
if not Path(PROMETHEUS).exists():
    pytestmark = pytest.mark.skip(reason='Prometheus is not installed (as root: `make prometheus`); the autoscaler '
                                         'queries are checked against a real one')


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


class Prometheus:
    """A Prometheus process scraping ``targets`` (host:port) as job seq-worker; :meth:`value` runs a query."""

    def __init__(self, tmp_path: Path, targets: list[str]) -> None:
        config = {'global': {'scrape_interval': '1s', 'scrape_timeout': '1s', 'evaluation_interval': '1s'},
                  'scrape_configs': [{'job_name': 'seq-worker', 'static_configs': [
                      {'targets': targets, 'labels': {'namespace': NAMESPACE}}]}]}
        (tmp_path / 'prometheus.yml').write_text(yaml.safe_dump(config))
        self.url = f'http://127.0.0.1:{_free_port()}'
        self.log = (tmp_path / 'prometheus.log').open('wb')
        self.proc = subprocess.Popen(
            [PROMETHEUS, f'--config.file={tmp_path / "prometheus.yml"}', f'--storage.tsdb.path={tmp_path / "tsdb"}',
             f'--web.listen-address={self.url.removeprefix("http://")}', '--log.level=warn'],
            stdout=self.log, stderr=subprocess.STDOUT)
        self.log_path = tmp_path / 'prometheus.log'

    def get(self, path: str, **params: str) -> dict:
        url = f'{self.url}{path}?{urllib.parse.urlencode(params)}' if params else f'{self.url}{path}'
        with urllib.request.urlopen(url, timeout=5) as reply:
            return json.loads(reply.read())

    def ready(self) -> bool:
        assert self.proc.poll() is None, self.log_path.read_text()
        with contextlib.suppress(OSError):
            urllib.request.urlopen(f'{self.url}/-/ready', timeout=2).close()
            return True
        return False

    def value(self, query: str) -> float | None:
        """Return the instant value of ``query`` (one series, as the autoscalers' sums give), None when empty."""
        reply = self.get('/api/v1/query', query=query)
        assert reply['status'] == 'success', reply
        result = reply['data']['result']
        assert len(result) <= 1, (query, result)
        return float(result[0]['value'][1]) if result else None

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.log.close()


@contextlib.contextmanager
def _workers(count: int) -> Iterator[list]:
    """``count`` in-process workers of the stuck policy (in the worker, so a test can hold and release it)."""
    with contextlib.ExitStack() as stack:
        servers = []
        for _ in range(count):
            server = serve_policy_file(STUCK, 'stuck', metrics_port=0, isolation='none')
            stack.callback(server.stop, grace=0.5)
            stack.callback(_release, server)
            servers.append(server)
        yield servers


def _release(server) -> None:
    for instance in getattr(server.runtimes['stuck'].definition.cls, 'instances', ()):
        instance.release.set()


def test_the_autoscaler_queries_rise_with_robots_and_fall_after_they_leave(tmp_path):
    keda = autoscale_queries.keda_triggers()
    adapter = autoscale_queries.adapter_queries(NAMESPACE)
    active = [keda['active-episodes'].query, adapter['seq_active_episodes'].query]
    queued = [keda['queue-depth'].query, adapter['seq_queue_depth'].query]

    def values(queries: list[str]) -> set:
        return {prom.value(q) for q in queries}

    with _workers(2) as (one, two), contextlib.ExitStack() as stack:
        prom = Prometheus(tmp_path, [f'127.0.0.1:{one.metrics_port}', f'127.0.0.1:{two.metrics_port}'])
        stack.callback(prom.close)
        wait_for(prom.ready, 30, 'Prometheus ready')
        up = 'sum(up{job="seq-worker"})'
        wait_for(lambda: prom.value(up) == 2, 30, 'Prometheus scraping both workers')
        # before any robot: both sums are there and 0 (every replica reports its gauges at 0)
        wait_for(lambda: values(active) == {0.0} and values(queued) == {0.0}, 15, 'both sums at 0')
        stubs = []
        for server in (one, two):
            ch = channel(server.port)
            stack.callback(ch.close)
            stub = pb_grpc.PolicyServiceStub(ch)
            handshake(stub, 'stuck')
            assert wait_ready(stub, 'stuck').ready
            stubs.append(stub)
        robots = [Stream(stubs[0], 'stuck', f'one-{k}') for k in range(3)] + [Stream(stubs[1], 'stuck', 'two-0')]
        for robot in robots:
            stack.callback(robot.close)
            assert robot.start().HasField('started')
        # one's policy is held by its first robot's request: the next two robots' requests wait for it
        robots[0].send(observation=state_request(1, [0.5, -0.5], NAMES, params={'hang': '25'}))
        instances = one.runtimes['stuck'].definition.cls.instances
        wait_for(lambda: any(i.hanging.is_set() for i in instances), 15, 'the policy held')
        for robot in robots[1:3]:
            robot.send(observation=state_request(1, np.array([0.1, 0.2]), NAMES))
        wait_for(lambda: values(active) == {4.0} and values(queued) == {2.0}, 15,
                 f'4 episodes and 2 requests waiting, summed over the replicas: {values(active)} {values(queued)}')
        _release(one)
        for robot in robots[:3]:
            assert robot.recv().HasField('chunk')
        wait_for(lambda: values(queued) == {0.0}, 15, 'the queue drained')
        assert values(active) == {4.0}          # the robots are still running
        for robot in robots[:3]:               # three end their episodes, one drops its stream
            assert robot.end().HasField('ended')
        robots[3].cancel()
        wait_for(lambda: values(active) == {0.0} and values(queued) == {0.0}, 20, 'both sums back at 0')
