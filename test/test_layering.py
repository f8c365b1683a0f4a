"""The import graph of sequence_ai_ros respects its layers (see test/layering.py), and the check bites."""

from __future__ import annotations

from pathlib import Path

import pytest
from layering import LAYERS, imports_of, package_graph, violations

REPO = Path(__file__).resolve().parent.parent


def test_the_package_respects_its_layers() -> None:
    graph = package_graph(REPO)
    assert len(graph) > 60, 'the graph reader found too few modules'
    assert 'sequence_ai_ros.client.policy' in graph['sequence_ai_ros.client']
    assert violations(graph) == []


def test_every_subpackage_has_a_layer() -> None:
    concepts = {p.name for p in (REPO / 'sequence_ai_ros').iterdir()
                if (p.is_dir() and (p / '__init__.py').exists()) or p.suffix == '.py'}
    concepts = {c.removesuffix('.py') for c in concepts} - {'__init__', 'data'}
    assert concepts <= set(LAYERS), f'no layer for {sorted(concepts - set(LAYERS))}'


@pytest.mark.parametrize('graph, expected', [
    ({'sequence_ai_ros.datasets.x': {'sequence_ai_ros.worker.registry'}},
     'layer 3 (datasets) imports layer 4 (worker)'),
    ({'sequence_ai_ros.bags.player': {'sequence_ai_ros.node.policy_node'}}, 'layer 4 (bags) imports layer 5 (node)'),
    ({'sequence_ai_ros.client.engine': {'sequence_ai_ros.worker.server'}}, 'layer 3 (client) imports layer 4'),
    ({'sequence_ai_ros.protocol.codec': {'sequence_ai_ros.client.policy'}}, 'layer 1 (protocol) imports layer 3'),
    ({'sequence_ai_ros.capture.store': {'sequence_ai_ros.datasets.video'}}, 'layer 2 (capture) imports layer 3'),
    ({'sequence_ai_ros.gadgets.x': {'sequence_ai_ros.protocol'}}, "concept 'gadgets' has no layer"),
    ({'sequence_ai_ros.worker.ridge': {'sequence_ai_ros.models.ridge', 'sequence_ai_ros.node.policy_node'}},
     'sequence_ai_ros.worker.ridge -> sequence_ai_ros.node.policy_node: a deprecated re-export'),
])
def test_a_wrong_import_in_a_synthetic_graph_is_rejected(graph: dict, expected: str) -> None:
    found = violations(graph)
    assert any(expected in line for line in found), found


def test_a_cycle_is_rejected_even_where_the_layers_would_allow_each_edge() -> None:
    flat = {'a': 1, 'b': 1, 'c': 1}
    graph = {'sequence_ai_ros.a.m': {'sequence_ai_ros.b.m'}, 'sequence_ai_ros.b.m': {'sequence_ai_ros.c.m'},
             'sequence_ai_ros.c.m': {'sequence_ai_ros.a.m'}}
    found = violations(graph, flat)
    assert any(line.startswith('cycle between concepts: a -> b -> c -> a') for line in found), found
    assert violations({'sequence_ai_ros.a.m': {'sequence_ai_ros.a.n'}}, flat) == []


def test_lazy_and_importlib_imports_are_read() -> None:
    source = ('import importlib\n'
              'def f():\n'
              '    from sequence_ai_ros.worker.registry import Registry\n'
              '    return importlib.import_module("sequence_ai_ros.node.policy_node"), Registry\n')
    found = imports_of(source, 'sequence_ai_ros.datasets.video', False)
    assert {'sequence_ai_ros.worker.registry', 'sequence_ai_ros.node.policy_node'} <= found
    assert imports_of('from . import stats\n', 'sequence_ai_ros.datasets', True) >= {'sequence_ai_ros.datasets.stats'}
