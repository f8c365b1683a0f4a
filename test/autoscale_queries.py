"""The PromQL the shipped autoscalers run, read from deploy/kubernetes (no tests here).

- :func:`keda_triggers`: autoscaling-keda.yaml's Prometheus triggers, by name: query and per-replica threshold.
- :func:`adapter_queries`: autoscaling-hpa.yaml's External metrics as the Prometheus Adapter answers them for an
  HPA in a namespace: its rule's ``metricsQuery`` with ``<<.Series>>`` and ``<<.LabelMatchers>>`` filled in (the
  HPA's selector and, through the rule's ``namespace`` override, the HPA's namespace), and the metric's
  per-replica target.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import NamedTuple

import yaml

KUBERNETES = Path(__file__).resolve().parents[1] / 'deploy' / 'kubernetes'


class Target(NamedTuple):
    """One autoscaler metric: the PromQL that yields its value (a sum over replicas) and the per-replica target."""

    query: str
    per_replica: float


def docs(name: str) -> list[dict]:
    """Return the documents of deploy/kubernetes/``name``."""
    return [d for d in yaml.safe_load_all((KUBERNETES / name).read_text()) if d]


def keda_triggers() -> dict[str, Target]:
    """Return autoscaling-keda.yaml's Prometheus triggers: trigger name -> its query and threshold."""
    scaled, = docs('autoscaling-keda.yaml')
    return {t['name']: Target(t['metadata']['query'], float(t['metadata']['threshold']))
            for t in scaled['spec']['triggers'] if t['type'] == 'prometheus'}


def adapter_rules() -> list[dict]:
    """Return the Prometheus Adapter's externalRules shipped in autoscaling-hpa.yaml's ConfigMap."""
    config = next(d for d in docs('autoscaling-hpa.yaml') if d['kind'] == 'ConfigMap')
    return yaml.safe_load(config['data']['config.yaml'])['externalRules']


def adapter_queries(namespace: str) -> dict[str, Target]:
    """Return the HPA's External metrics: metric name -> the query the adapter runs for it in ``namespace``.

    :raises LookupError: when no rule of the adapter serves a metric the HPA asks for.
    """
    hpa = next(d for d in docs('autoscaling-hpa.yaml') if d['kind'] == 'HorizontalPodAutoscaler')
    rules = adapter_rules()
    out = {}
    for metric in hpa['spec']['metrics']:
        external = metric['external']
        name = external['metric']['name']
        rule = next((r for r in rules if re.fullmatch(r['name']['matches'], name)
                     and r['name'].get('as', name) == name), None)
        if rule is None:
            raise LookupError(f'no externalRule of the adapter serves {name}')
        series = re.search(r'__name__="([^"]+)"', rule['seriesQuery']).group(1)
        matchers = [f'{k}="{v}"' for k, v in sorted(external['metric'].get('selector', {}).get('matchLabels',
                                                                                             {}).items())]
        if 'namespace' in rule.get('resources', {}).get('overrides', {}):
            matchers.append(f'namespace="{namespace}"')
        query = rule['metricsQuery'].replace('<<.Series>>', series).replace('<<.LabelMatchers>>', ','.join(matchers))
        out[name] = Target(query, float(external['target']['averageValue']))
    return out
