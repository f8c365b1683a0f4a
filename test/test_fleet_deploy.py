"""The shipped deployment files, checked statically: HAProxy config, Kubernetes manifests, Grafana dashboard."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from sequence_ai_ros.cli import build_parser
from sequence_ai_ros.worker import fleet as fleet_mod

DEPLOY = Path(__file__).resolve().parents[1] / 'deploy'
K8S_VERSION = '1.30.0'


def docs(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((DEPLOY / 'kubernetes' / name).read_text()) if d]


def test_core_kubernetes_resources_validate_against_the_schema():
    kv = pytest.importorskip('kubernetes_validate', reason='kubernetes-validate is not installed '
                                                           '(pip install -r requirements-dev.txt)')
    resources = docs('worker.yaml')
    assert [r['kind'] for r in resources] == ['Deployment', 'Service']
    for resource in resources:
        kv.validate(resource, K8S_VERSION, strict=True)
    broken = json.loads(json.dumps(resources[0]))
    broken['spec']['replicas'] = 'three'
    with pytest.raises(kv.ValidationError):
        kv.validate(broken, K8S_VERSION, strict=True)


def test_the_statefulset_runs_the_same_pod_with_a_volume_per_pod_for_its_store():
    kv = pytest.importorskip('kubernetes_validate', reason='kubernetes-validate is not installed '
                                                           '(pip install -r requirements-dev.txt)')
    sts, headless = docs('worker-statefulset.yaml')
    for resource in (sts, headless):
        kv.validate(resource, K8S_VERSION, strict=True)
    deployment, service = docs('worker.yaml')
    pod, same = sts['spec']['template'], deployment['spec']['template']
    assert pod['spec']['containers'] == same['spec']['containers']     # one pod, two ways to run it
    assert sts['spec']['selector'] == deployment['spec']['selector']
    assert service['spec']['selector'].items() <= pod['metadata']['labels'].items()
    assert sts['spec']['serviceName'] == headless['metadata']['name'] and headless['spec']['clusterIP'] == 'None'
    claim, = sts['spec']['volumeClaimTemplates']
    container = pod['spec']['containers'][0]
    mount = next(m for m in container['volumeMounts'] if m['name'] == claim['metadata']['name'])
    home = next(e['value'] for e in container['env'] if e['name'] == 'SEQ_HOME')
    assert mount['mountPath'] == f'{home}/capture'                     # the stores live on the claim
    assert all(v['name'] != 'capture' for v in pod['spec']['volumes'])


def test_manifests_agree_with_the_worker():
    deployment, service = docs('worker.yaml')
    pod = deployment['spec']['template']
    assert deployment['spec']['selector']['matchLabels'].items() <= pod['metadata']['labels'].items()
    assert service['spec']['selector'].items() <= pod['metadata']['labels'].items()
    container = pod['spec']['containers'][0]
    args = container['args']
    assert args[:2] == ['seq', 'serve']
    parsed = build_parser().parse_args(args[1:])  # every flag is a real seq serve flag
    ports = {p['name']: p['containerPort'] for p in container['ports']}
    assert parsed.port == ports['grpc'] and parsed.metrics_port == ports['metrics'] and parsed.warm
    assert container['readinessProbe']['grpc'] == {'port': ports['grpc'], 'service': parsed.names[0]}
    grpc_port = next(p for p in service['spec']['ports'] if p['name'] == 'grpc')
    assert grpc_port['appProtocol'] == 'kubernetes.io/h2c' and grpc_port['targetPort'] == 'grpc'
    envoy = {d['kind']: d for d in docs('gateway-envoy.yaml')}
    policy = envoy['BackendTrafficPolicy']
    assert policy['apiVersion'] == 'gateway.envoyproxy.io/v1alpha1'
    assert policy['spec']['loadBalancer'] == {'type': 'ConsistentHash',
                                              'consistentHash': {'type': 'Header', 'header': {'name': 'x-episode-id'}}}
    assert policy['spec']['targetRefs'][0]['name'] == envoy['GRPCRoute']['metadata']['name']
    assert envoy['GRPCRoute']['spec']['rules'][0]['backendRefs'][0] == {'name': service['metadata']['name'],
                                                                       'port': grpc_port['port']}
    istio, = docs('istio-destinationrule.yaml')
    assert istio['spec']['host'] == service['metadata']['name']
    assert istio['spec']['trafficPolicy']['loadBalancer']['consistentHash'] == {'httpHeaderName': 'x-episode-id'}


def test_haproxy_config_renders_and_haproxy_accepts_it(tmp_path):
    from sequence_ai_ros.worker.fleet import HAPROXY_CONFIG

    template = HAPROXY_CONFIG.read_text()   # the shipped template (package data)
    for needle in ('balance hdr(x-episode-id)', 'hash-type consistent', 'proto h2', 'http-check connect proto h2',
                   'http-check expect status 200',
                   'hdr host', 'agent-check', 'sc0_conn_cur', 'option forwardfor'):
        assert needle in template
    rendered = fleet_mod.render_config(template, 5)
    assert len(re.findall(r'^\s+server replica\d', rendered, re.M)) == 5 and 'stats socket' in rendered
    with pytest.raises(Exception, match='BEGIN SERVERS'):
        fleet_mod.render_config('global\n', 2)
    haproxy = shutil.which('haproxy') or ('/usr/sbin/haproxy' if Path('/usr/sbin/haproxy').exists() else None)
    if haproxy is None:
        pytest.skip('HAProxy is not installed (as root: make haproxy): the config syntax check needs it')
    (tmp_path / 'h.cfg').write_text(rendered)
    env = {'SEQ_LB_BIND': '127.0.0.1:1', 'SEQ_LB_STATS': str(tmp_path / 's'), 'SEQ_LB_CONN_PER_CLIENT': '8',
           **{f'SEQ_REPLICA_{k}': f'127.0.0.1:{k + 1}' for k in range(1, 6)},
           **{f'SEQ_AGENT_{k}': str(k + 100) for k in range(1, 6)}}
    check = subprocess.run([haproxy, '-c', '-f', str(tmp_path / 'h.cfg')], env=env, capture_output=True, text=True,
                           timeout=30)
    assert check.returncode == 0, check.stdout + check.stderr
    env.pop('SEQ_LB_CONN_PER_CLIENT')
    assert subprocess.run([haproxy, '-c', '-f', str(tmp_path / 'h.cfg')], env=env, capture_output=True,
                          timeout=30).returncode != 0, shlex.join([haproxy, '-c'])


def test_grafana_dashboard_queries_only_metrics_the_worker_exports():
    pytest.importorskip('prometheus_client', reason='prometheus_client is not installed')
    from sequence_ai_ros.worker.metrics import PrometheusMetrics

    metrics = PrometheusMetrics({}, lambda name: 0)
    try:
        names = {m.name for m in metrics.registry.collect()}
    finally:
        metrics.close()
    exported = set()
    for name in names:  # counters are exposed as NAME_total, histograms as NAME_bucket/_sum/_count
        exported |= {name, f'{name}_total', f'{name}_bucket', f'{name}_sum', f'{name}_count'}
    dashboard = json.loads((DEPLOY / 'grafana-dashboard.json').read_text())
    exprs = [t['expr'] for p in dashboard['panels'] for t in p['targets']]
    used = {m for e in exprs for m in re.findall(r'\b(seq_[a-z_]+)', e)}
    assert used and used <= exported, used - exported
    assert {'seq_requests_total', 'seq_inference_seconds_bucket', 'seq_batch_size_sum', 'seq_queue_depth',
            'seq_active_episodes', 'seq_client_underruns_total', 'seq_capture_bytes', 'seq_open_streams'} <= used
    # every per-deployment metric is filtered by the dashboard's deployment variable
    per_deployment = ('seq_requests_total', 'seq_inference_seconds_bucket', 'seq_batch_size', 'seq_queue_depth',
                      'seq_active_episodes', 'seq_open_streams', 'seq_client_underruns_total',
                      'seq_episodes_ended_total', 'seq_capture_bytes')
    for expr in exprs:
        for name in per_deployment:
            for use in re.findall(rf'\b{name}[a-z_]*(\{{[^}}]*\}})?', expr):
                assert 'deployment=~"$deployment"' in use, (name, expr)
