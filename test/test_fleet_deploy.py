"""The shipped deployment files, checked statically: HAProxy config, Kubernetes manifests, Grafana dashboard."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import crd_schema
import pytest
import yaml

from sequence_ai_ros.cli import build_parser
from sequence_ai_ros.worker import fleet as fleet_mod
from sequence_ai_ros.worker.config import ServerConfig

DEPLOY = Path(__file__).resolve().parents[1] / 'deploy'
K8S_VERSION = '1.30.0'


def docs(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((DEPLOY / 'kubernetes' / name).read_text()) if d]


def test_core_kubernetes_resources_validate_against_the_schema():
    kv = pytest.importorskip('kubernetes_validate', reason='kubernetes-validate is not installed '
                                                           '(pip install -r requirements-dev.txt)')
    resources = docs('worker.yaml')
    assert [r['kind'] for r in resources] == ['Deployment', 'Service', 'PodDisruptionBudget']
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
    deployment, service, _ = docs('worker.yaml')
    pod, same = sts['spec']['template'], deployment['spec']['template']
    assert pod['spec']['containers'] == same['spec']['containers']     # one pod, two ways to run it
    assert {k: v for k, v in pod['spec'].items() if k != 'volumes'} == \
        {k: v for k, v in same['spec'].items() if k != 'volumes'}
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
    deployment, service, _ = docs('worker.yaml')
    pod = deployment['spec']['template']
    assert deployment['spec']['selector']['matchLabels'].items() <= pod['metadata']['labels'].items()
    assert service['spec']['selector'].items() <= pod['metadata']['labels'].items()
    container = pod['spec']['containers'][0]
    args = container['args']
    assert args[:2] == ['seq', 'serve']
    parsed = build_parser().parse_args(args[1:])  # every flag is a real seq serve flag
    ports = {p['name']: p['containerPort'] for p in container['ports']}
    assert parsed.port == ports['grpc'] and parsed.metrics_port == ports['metrics'] and parsed.warm
    # kubelet's gRPC probes send no token and no TLS: they ask the plaintext, health-only probe port
    assert parsed.probe_port == ports['probe'] and parsed.token_file
    # robots reach the pods through a gateway or a sidecar: the worker sees its address, one for every robot, so
    # a per-address cap would cap the pod; admission is the token and --max-streams
    assert parsed.max_streams_per_client == 0
    assert container['readinessProbe']['grpc'] == {'port': ports['probe'], 'service': parsed.names[0]}
    assert container['startupProbe']['grpc'] == {'port': ports['probe'], 'service': parsed.names[0]}
    assert container['livenessProbe']['grpc'] == {'port': ports['probe']}
    assert 'probe' not in {p['name'] for p in service['spec']['ports']}   # kubelet only: not in the Service
    grpc_port = next(p for p in service['spec']['ports'] if p['name'] == 'grpc')
    assert grpc_port['appProtocol'] == 'kubernetes.io/h2c' and grpc_port['targetPort'] == 'grpc'
    envoy = {d['kind']: d for d in docs('gateway-envoy.yaml')}
    policy = envoy['BackendTrafficPolicy']
    assert policy['apiVersion'] == 'gateway.envoyproxy.io/v1alpha1'
    # `headers` (a list), not the deprecated `header`; the CRD's CEL rule: type Headers <=> headers is set
    assert policy['spec']['loadBalancer'] == {'type': 'ConsistentHash',
                                              'consistentHash': {'type': 'Headers',
                                                                 'headers': [{'name': 'x-episode-id'}]}}
    hashing = crd_schema.schema_of(policy['apiVersion'], 'BackendTrafficPolicy')['properties']['spec'][
        'properties']['loadBalancer']['properties']['consistentHash']
    assert 'Deprecated' in hashing['properties']['header']['description'] and 'headers' in hashing['properties']
    assert any("self.type == 'Headers' ? has(self.headers)" in rule['rule']
               for rule in hashing['x-kubernetes-validations'])
    assert policy['spec']['targetRefs'][0]['name'] == envoy['GRPCRoute']['metadata']['name']
    assert envoy['GRPCRoute']['spec']['rules'][0]['backendRefs'][0] == {'name': service['metadata']['name'],
                                                                       'port': grpc_port['port']}
    istio, = docs('istio-destinationrule.yaml')
    assert istio['spec']['host'] == service['metadata']['name']
    assert istio['spec']['trafficPolicy']['loadBalancer']['consistentHash'] == {'httpHeaderName': 'x-episode-id'}


CUSTOM = ('gateway-envoy.yaml', 'istio-destinationrule.yaml', 'istio-gateway.yaml', 'servicemonitor.yaml')


def test_custom_resources_validate_against_their_vendored_crds():
    pytest.importorskip('jsonschema', reason='jsonschema is not installed (pip install -r requirements-dev.txt)')
    import jsonschema

    kinds = []
    for name in CUSTOM:
        for resource in docs(name):
            crd_schema.validate(resource)       # strict: a field its CRD does not declare fails
            kinds.append((resource['apiVersion'], resource['kind']))
    assert set(kinds) == {('gateway.networking.k8s.io/v1', 'Gateway'), ('gateway.networking.k8s.io/v1', 'GRPCRoute'),
                          ('gateway.envoyproxy.io/v1alpha1', 'BackendTrafficPolicy'),
                          ('networking.istio.io/v1', 'DestinationRule'), ('networking.istio.io/v1', 'Gateway'),
                          ('networking.istio.io/v1', 'VirtualService'), ('monitoring.coreos.com/v1', 'ServiceMonitor')}
    monitor, = docs('servicemonitor.yaml')
    for broken, why in ((('spec', 'endpoints', 0), 'prot'), (('spec',), 'selectors')):
        resource = json.loads(json.dumps(monitor))
        target = resource
        for key in broken:
            target = target[key]
        target[why] = 'x'
        with pytest.raises(jsonschema.ValidationError, match=why):
            crd_schema.validate(resource)
    # every vendored CRD file is named, with its version, in the fixtures' README
    readme = (crd_schema.CRDS / 'README.md').read_text()
    for path in crd_schema.CRDS.glob('*.yaml'):
        row = next(line for line in readme.splitlines() if f'`{path.name}`' in line)
        assert re.search(r'\| v?\d+\.\d+\.\d+ \|', row), row


def test_the_custom_resources_route_and_scrape_the_worker_service():
    deployment, service, _ = docs('worker.yaml')
    pod_labels = deployment['spec']['template']['metadata']['labels']
    monitor, = docs('servicemonitor.yaml')
    assert monitor['spec']['selector']['matchLabels'].items() <= service['metadata']['labels'].items()
    assert {e['port'] for e in monitor['spec']['endpoints']} == {'metrics'}
    assert 'metrics' in {p['name'] for p in service['spec']['ports']}
    assert service['spec']['selector'].items() <= pod_labels.items()
    gateway, virtual = docs('istio-gateway.yaml')
    assert virtual['spec']['gateways'] == [gateway['metadata']['name']]
    assert set(virtual['spec']['hosts']) <= {h for s in gateway['spec']['servers'] for h in s['hosts']}
    assert all(s['tls']['mode'] == 'SIMPLE' for s in gateway['spec']['servers'])   # robots outside: TLS
    envoy = {d['kind']: d for d in docs('gateway-envoy.yaml')}     # and through Envoy Gateway: their token in TLS
    assert all(ln['protocol'] == 'HTTPS' and ln['tls']['mode'] == 'Terminate' and ln['tls']['certificateRefs']
               for ln in envoy['Gateway']['spec']['listeners'])
    grpc_port = next(p['port'] for p in service['spec']['ports'] if p['name'] == 'grpc')
    prefixes = {m['uri']['prefix'] for r in virtual['spec']['http'] for m in r['match']}
    assert prefixes == {'/sequence_ai.v1.PolicyService/', '/grpc.health.v1.Health/'}
    for route in virtual['spec']['http']:
        assert route['route'] == [{'destination': {'host': service['metadata']['name'],
                                                   'port': {'number': grpc_port}}}]
    rule, = docs('istio-destinationrule.yaml')
    assert rule['spec']['host'] == service['metadata']['name']    # the sticky hash covers the gateway's calls


def _pods() -> dict[str, dict]:
    deployment = docs('worker.yaml')[0]
    sts = docs('worker-statefulset.yaml')[0]
    return {'Deployment': deployment['spec']['template'], 'StatefulSet': sts['spec']['template']}


@pytest.mark.parametrize('kind', ['Deployment', 'StatefulSet'])
def test_pods_run_unprivileged_read_only_with_limits(kind):
    pod = _pods()[kind]['spec']
    assert pod['securityContext']['runAsNonRoot'] is True and pod['securityContext']['runAsUser'] > 0
    assert pod['securityContext']['seccompProfile'] == {'type': 'RuntimeDefault'}
    assert pod['automountServiceAccountToken'] is False
    volumes = {v['name'] for v in pod['volumes']} | ({'capture'} if kind == 'StatefulSet' else set())
    for container in pod['initContainers'] + pod['containers']:
        ctx = container['securityContext']
        assert ctx['readOnlyRootFilesystem'] is True and ctx['allowPrivilegeEscalation'] is False, container['name']
        assert ctx['capabilities'] == {'drop': ['ALL']}, container['name']
        resources = container['resources']
        assert {'cpu', 'memory'} <= set(resources['requests']) and 'memory' in resources['limits']
        assert {m['name'] for m in container['volumeMounts']} <= volumes
    worker, = pod['containers']
    home = next(e['value'] for e in worker['env'] if e['name'] == 'SEQ_HOME')
    writable = {m['mountPath'] for m in worker['volumeMounts'] if not m.get('readOnly')}
    assert {home, f'{home}/capture', '/tmp'} <= writable     # usage database, capture store, temp files
    init, = pod['initContainers']
    assert init['image'] == worker['image'] and init['command'][-1].rstrip('/') == home
    assert {m['mountPath'] for m in init['volumeMounts']} == {home}


def test_shutdown_fits_the_grace_period_and_one_pod_at_a_time_may_go():
    deployment, _, budget = docs('worker.yaml')
    pod = deployment['spec']['template']
    grace = pod['spec']['terminationGracePeriodSeconds']
    worker, = pod['spec']['containers']
    pre_stop = worker['lifecycle']['preStop']['sleep']['seconds']
    # SIGTERM comes after the preStop: the worker's drain (its default, or none yet) and its stop must fit after it
    drain = getattr(ServerConfig, 'drain_timeout_s', 0.0)
    stop_grace = 2.0   # seq serve's gRPC stop grace (cli/serving.py)
    assert 0 < pre_stop and pre_stop + drain + stop_grace + 5 <= grace, (pre_stop, drain, grace)
    assert budget['spec']['selector'] == deployment['spec']['selector'] and budget['spec']['maxUnavailable'] == 1
    assert deployment['spec']['strategy']['rollingUpdate'] == {'maxUnavailable': 0, 'maxSurge': 1}
    assert deployment['spec']['replicas'] > budget['spec']['maxUnavailable']



def test_the_autoscalers_validate_against_keda_s_crd_and_the_kubernetes_schema():
    kv = pytest.importorskip('kubernetes_validate', reason='kubernetes-validate is not installed '
                                                           '(pip install -r requirements-dev.txt)')
    pytest.importorskip('jsonschema', reason='jsonschema is not installed (pip install -r requirements-dev.txt)')
    import jsonschema

    scaled, = docs('autoscaling-keda.yaml')
    crd_schema.validate(scaled)          # strict: a field KEDA's ScaledObject does not declare fails
    assert (scaled['apiVersion'], scaled['kind']) == ('keda.sh/v1alpha1', 'ScaledObject')
    broken = json.loads(json.dumps(scaled))
    broken['spec']['triggers'][0]['metadata']['threshold'] = 64      # trigger metadata are strings
    with pytest.raises(jsonschema.ValidationError):
        crd_schema.validate(broken)
    broken = json.loads(json.dumps(scaled))
    broken['spec']['advanced']['horizontalPodAutoscalerConfig']['behavior']['scaleDown']['window'] = 300
    with pytest.raises(jsonschema.ValidationError, match='window'):
        crd_schema.validate(broken)
    resources = docs('autoscaling-hpa.yaml')
    assert [r['kind'] for r in resources] == ['ConfigMap', 'HorizontalPodAutoscaler']
    for resource in resources:
        kv.validate(resource, K8S_VERSION, strict=True)
    hpa = json.loads(json.dumps(resources[1]))
    hpa['spec']['behavior']['scaleDown']['window'] = 300      # strict: not a field of HPAScalingRules
    with pytest.raises(kv.ValidationError):
        kv.validate(hpa, K8S_VERSION, strict=True)


def test_the_autoscalers_scale_down_slower_than_a_pod_drains():
    deployment, _, budget = docs('worker.yaml')
    pod = deployment['spec']['template']['spec']
    worker, = pod['containers']
    pre_stop = worker['lifecycle']['preStop']['sleep']['seconds']
    drain = build_parser().parse_args(worker['args'][1:]).drain_timeout_s   # --drain-timeout, or its default
    grace = pod['terminationGracePeriodSeconds']
    assert pre_stop + drain <= grace
    scaled, = docs('autoscaling-keda.yaml')
    hpa = docs('autoscaling-hpa.yaml')[1]
    behaviours = {'KEDA': scaled['spec']['advanced']['horizontalPodAutoscalerConfig']['behavior'],
                  'HPA': hpa['spec']['behavior']}
    assert behaviours['KEDA'] == behaviours['HPA']
    for who, behaviour in behaviours.items():
        down = behaviour['scaleDown']
        # a dip while robots of a draining pod reconnect elsewhere must not remove the next pod
        assert down['stabilizationWindowSeconds'] > pre_stop + drain, who
        # one pod per period, and a period no shorter than a pod's whole shutdown: one drain at a time
        assert down['policies'] == [{'type': 'Pods', 'value': 1, 'periodSeconds': down['policies'][0]['periodSeconds']}]
        assert down['policies'][0]['periodSeconds'] >= grace, who
    for ref in (scaled['spec']['scaleTargetRef'], hpa['spec']['scaleTargetRef']):
        assert ref == {'apiVersion': deployment['apiVersion'], 'kind': 'Deployment',
                       'name': deployment['metadata']['name']}
    # never below the Deployment's own count, and always above what the PDB lets go at once
    assert scaled['spec']['minReplicaCount'] == hpa['spec']['minReplicas'] == deployment['spec']['replicas']
    assert hpa['spec']['minReplicas'] > budget['spec']['maxUnavailable']
    assert scaled['spec']['maxReplicaCount'] == hpa['spec']['maxReplicas'] > hpa['spec']['minReplicas']
    assert {t['metricType'] for t in scaled['spec']['triggers']} == {'AverageValue'}   # a per-replica target
    assert {m['external']['target']['type'] for m in hpa['spec']['metrics']} == {'AverageValue'}


def test_the_autoscalers_query_the_worker_s_gauges_with_the_same_targets():
    import autoscale_queries

    keda = autoscale_queries.keda_triggers()
    adapter = autoscale_queries.adapter_queries('seq')
    assert set(keda) == {'active-episodes', 'queue-depth'} and set(adapter) == {'seq_active_episodes',
                                                                                'seq_queue_depth'}
    for trigger, metric in (('active-episodes', 'seq_active_episodes'), ('queue-depth', 'seq_queue_depth')):
        # the adapter's query is KEDA's, in the HPA's namespace
        assert keda[trigger].query == f'sum({metric}{{job="seq-worker"}})'
        assert adapter[metric].query == f'sum({metric}{{job="seq-worker",namespace="seq"}})'
        assert keda[trigger].per_replica == adapter[metric].per_replica > 0
    # the job is the Service the ServiceMonitor scrapes (the Operator names the job after it)
    _, service, _ = docs('worker.yaml')
    assert service['metadata']['name'] == 'seq-worker'
    # gauges the worker exports (none added for the autoscalers), targets below the bounds where it refuses
    pytest.importorskip('prometheus_client', reason='prometheus_client is not installed')
    from sequence_ai_ros.worker.metrics import PrometheusMetrics

    metrics = PrometheusMetrics({}, lambda name: 0)
    try:
        gauges = {m.name for m in metrics.registry.collect() if m.type == 'gauge'}
    finally:
        metrics.close()
    assert {'seq_active_episodes', 'seq_queue_depth'} <= gauges
    container = docs('worker.yaml')[0]['spec']['template']['spec']['containers'][0]
    args = build_parser().parse_args(container['args'][1:])
    assert keda['queue-depth'].per_replica < args.max_pending
    assert keda['active-episodes'].per_replica < args.max_streams


@pytest.mark.parametrize('kind', ['Deployment', 'StatefulSet'])
def test_pods_spread_over_zones_and_nodes(kind):
    template = _pods()[kind]
    constraints = template['spec']['topologySpreadConstraints']
    assert {c['topologyKey'] for c in constraints} == {'topology.kubernetes.io/zone', 'kubernetes.io/hostname'}
    for c in constraints:
        assert c['maxSkew'] == 1 and c['labelSelector']['matchLabels'].items() <= template['metadata']['labels'].items()
        # never DoNotSchedule: a pod the autoscaler or a rollout asks for is not left pending by the spread
        assert c['whenUnsatisfiable'] == 'ScheduleAnyway'


def test_the_dockerfile_builds_the_image_the_pods_expect():
    text = (DEPLOY / 'Dockerfile').read_text()
    lines = [ln.strip() for ln in re.sub(r'\\\n', ' ', text).splitlines() if ln.strip() and not ln.startswith('#')]
    user = [ln.split()[1] for ln in lines if ln.startswith('USER ')]
    pod = _pods()['Deployment']['spec']
    # a numeric non-root user (runAsNonRoot needs a number to check) that the pod's runAsUser names
    assert user and user[-1] == f"{pod['securityContext']['runAsUser']}:{pod['securityContext']['runAsGroup']}"
    worker, = pod['containers']
    init, = pod['initContainers']
    envs = re.findall(r'SEQ_HOME=(\S+)', text)
    assert envs[0] == init['command'][2].rstrip('/.') and envs[-1] == next(
        e['value'] for e in worker['env'] if e['name'] == 'SEQ_HOME')   # deployed at build, copied at start
    # `seq deploy` runs as that user and writes the build-time $SEQ_HOME: a root-owned /opt would refuse it
    deploy_at = next(i for i, ln in enumerate(lines) if 'seq deploy' in ln)
    owned = [m.groups() for ln in lines[:deploy_at] for m in re.finditer(r'install -d -o (\d+) -g (\d+) (\S+)', ln)]
    assert (*user[-1].split(':'), envs[0]) in owned, owned
    exposed = {int(p) for ln in lines if ln.startswith('EXPOSE ') for p in ln.split()[1:]}
    assert {p['containerPort'] for p in worker['ports']} == exposed
    root = DEPLOY.parent
    for ln in lines:
        if ln.startswith('COPY ') and '--from=' not in ln:
            for src in ln.split()[1:-1]:
                if not src.startswith(('--', '$')):
                    assert (root / src).exists(), src
    policy_dir = re.search(r'ARG POLICY_DIR=(\S+)', text).group(1)
    assert (root / policy_dir / 'policy.py').is_file()
    assert 'requirements-worker.txt' in text and 'seq deploy' in text
    ignored = (root / '.dockerignore').read_text().split()
    assert {'.venv', 'install', 'build', 'log', '.git'} <= set(ignored)


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


def test_the_hand_run_recipe_in_the_haproxy_template_passes_haproxys_check(tmp_path):
    """The template's own recipe for a hand-run fleet of three passes HAProxy's check.

    With exactly the variables it names (replica 1's pattern repeated for 2 and 3), HAProxy accepts the
    shipped file as it is.
    """
    from sequence_ai_ros.worker.fleet import HAPROXY_CONFIG

    template = HAPROXY_CONFIG.read_text()
    comment = re.sub(r'\\\n#', ' ', template)       # the recipe's lines continued with a backslash, joined
    recipe = next(ln for ln in comment.splitlines() if ln.startswith('#') and 'haproxy -f haproxy.cfg' in ln)
    env = dict(kv.split('=', 1) for kv in recipe.lstrip('# ').split() if '=' in kv)
    for k in (2, 3):
        env |= {name.replace('_1', f'_{k}'): value for name, value in env.items() if name.endswith('_1')}
    assert {'SEQ_LB_BIND', 'SEQ_REPLICA_3', 'SEQ_AGENT_3'} <= set(env), recipe
    haproxy = shutil.which('haproxy') or ('/usr/sbin/haproxy' if Path('/usr/sbin/haproxy').exists() else None)
    if haproxy is None:
        pytest.skip('HAProxy is not installed (as root: make haproxy): the config syntax check needs it')
    (tmp_path / 'haproxy.cfg').write_text(template)
    check = subprocess.run([haproxy, '-c', '-f', str(tmp_path / 'haproxy.cfg')], env=env, capture_output=True,
                           text=True, timeout=30)
    assert check.returncode == 0, (env, check.stdout + check.stderr)


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
    exprs = [t['expr'] for p in dashboard['panels'] for t in p.get('targets', ())]   # a row has none
    used = {m for e in exprs for m in re.findall(r'\b(seq_[a-z_]+)', e)}
    assert used and used <= exported, used - exported
    assert {'seq_requests_total', 'seq_inference_seconds_bucket', 'seq_batch_size_sum', 'seq_queue_depth',
            'seq_active_episodes', 'seq_client_underruns_total', 'seq_capture_bytes', 'seq_open_streams'} <= used
    # every per-deployment metric is filtered by the dashboard's deployment variable
    per_deployment = ('seq_requests_total', 'seq_inference_seconds_bucket', 'seq_batch_size', 'seq_queue_depth',
                      'seq_active_episodes', 'seq_open_streams', 'seq_client_underruns_total',
                      'seq_episodes_ended_total', 'seq_capture_bytes', 'seq_request_seconds', 'seq_queue_seconds',
                      'seq_time_to_first_chunk_seconds', 'seq_telemetry_underrun_seconds_total')
    # rows per replica (a row repeated for each scraped instance) and the held time the robots see
    rows = [p for p in dashboard['panels'] if p['type'] == 'row']
    assert any(r.get('repeat') == 'instance' for r in rows)
    assert {v['name'] for v in dashboard['templating']['list']} >= {'deployment', 'instance'}
    assert {'seq_telemetry_underrun_seconds_total', 'seq_client_underrun_seconds_total'} <= used
    for expr in exprs:
        for name in per_deployment:
            for use in re.findall(rf'\b{name}[a-z_]*(\{{[^}}]*\}})?', expr):
                assert 'deployment=~"$deployment"' in use, (name, expr)
