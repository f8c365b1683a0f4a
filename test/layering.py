"""The import layering of sequence_ai_ros, read from the source with :mod:`ast` (no module is imported).

Each top-level subpackage (a *concept*) has a layer; a module may import only concepts of a strictly
lower layer, or its own concept. Lower layers never import higher ones, so no cycle between concepts
can form::

    0  exceptions, home, templates,     errors, the $SEQ_HOME layout, template folders, glibc malloc
       malloc_tuning, stop_signals      tuning, SIGINT/SIGTERM handling (no logic over other concepts)
    1  protocol                         the wire: codec, contract, typed errors
    2  policy, capture                  the authoring API; the worker-side capture store
    3  client, datasets                 the chunk engine; LeRobot read/write, stats, video
    4  worker, models, bags, adapters   the policy worker (hosts policy, capture); ridge, its training and
                                        the LeRobot runtime (what templates import); rosbag tools; a LeRobot
                                        Robot and an openpi-client BasePolicy over the client
    5  node, cli, sim                   the ROS 2 node (over client); ``seq`` (over worker, capture, ...); the
                                        simulated robot (a ROS 2 node over Meta-World, beside the policy node)
    6  bench, demo                      benchmarks and the demo drive everything

So: protocol <- client <- node; protocol <- policy/capture <- worker <- cli; datasets and bags never
import worker or node; the client never imports the worker, nor the worker the client or the node.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

PACKAGE = 'sequence_ai_ros'
LAYERS: dict[str, int] = {
    'exceptions': 0, 'home': 0, 'templates': 0, 'malloc_tuning': 0, 'stop_signals': 0,
    'protocol': 1,
    'policy': 2, 'capture': 2,
    'client': 3, 'datasets': 3,
    'worker': 4, 'models': 4, 'bags': 4, 'adapters': 4,
    'node': 5, 'cli': 5, 'sim': 5,
    'bench': 6, 'demo': 6,
}
#: Deprecated re-exports (issue 10): each aliases one moved module and may import exactly that one, in
#: whatever layer it sits; any other project import in a shim is a violation.
SHIMS: dict[str, frozenset[str]] = {
    'sequence_ai_ros.worker.ridge': frozenset({'sequence_ai_ros.models.ridge'}),
    'sequence_ai_ros.worker.lerobot_runtime': frozenset({'sequence_ai_ros.models.lerobot_runtime'}),
    'sequence_ai_ros.data': frozenset(),
    'sequence_ai_ros.data.lerobot_reader': frozenset({'sequence_ai_ros.datasets.lerobot_reader'}),
}


def module_name(root: Path, path: Path) -> str:
    """Return the dotted name of ``path`` (a .py file below ``root``, the folder holding the package)."""
    parts = list(path.relative_to(root).with_suffix('').parts)
    if parts[-1] == '__init__':
        parts.pop()
    return '.'.join(parts)


def imports_of(source: str, name: str, is_package: bool) -> set[str]:
    """Return every ``sequence_ai_ros...`` module named by an import in ``source``.

    Lazy imports inside functions count, and so does ``importlib.import_module('<literal>')`` (or
    ``__import__``) with a string literal; a name computed at run time cannot be read statically.
    """
    out: set[str] = set()
    base = name.split('.') if is_package else name.split('.')[:-1]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, 'id', '')
            if called in ('import_module', '__import__'):
                out.add(node.args[0].value)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                mod = '.'.join(base[:len(base) - node.level + 1] + ([node.module] if node.module else []))
            else:
                mod = node.module or ''
            out.add(mod)
            out.update(f'{mod}.{a.name}' for a in node.names)
    return {m for m in out if m == PACKAGE or m.startswith(PACKAGE + '.')}


def package_graph(root: Path) -> dict[str, set[str]]:
    """Return module -> imported project modules for every module of the package below ``root``.

    Template folders (``templates/<name>/``) are user code copied by ``seq init``, not modules; the
    generated ``*_pb2*`` stubs import nothing of ours.
    """
    graph: dict[str, set[str]] = {}
    for path in sorted((root / PACKAGE).rglob('*.py')):
        rel = path.relative_to(root / PACKAGE).parts
        if rel[0] == 'templates' and len(rel) > 1 and rel[1] != '__init__.py':
            continue
        name = module_name(root, path)
        graph[name] = imports_of(path.read_text(), name, path.name == '__init__.py')
    return graph


def concept(module: str) -> str | None:
    """Return the top-level subpackage of ``sequence_ai_ros.X...`` (None for the package itself)."""
    parts = module.split('.')
    return parts[1] if len(parts) > 1 else None


def violations(graph: Mapping[str, Iterable[str]], layers: Mapping[str, int] = LAYERS) -> list[str]:
    """Return one line per import that breaks the layering, and one per cycle between concepts.

    An edge is allowed when both ends are in one concept, or the importer's layer is strictly higher.
    An unknown concept is a violation too (a new subpackage must be given a layer here).
    """
    bad: list[str] = []
    edges: dict[str, set[str]] = {}
    for src, targets in graph.items():
        if src in SHIMS:
            bad.extend(f'{src} -> {dst}: a deprecated re-export may import only {sorted(SHIMS[src])}'
                       for dst in sorted(set(targets) - SHIMS[src]))
            continue
        a = concept(src)
        for dst in targets:
            b = concept(dst)
            if a is None or b is None or a == b:
                continue
            for c in (a, b):
                if c not in layers:
                    bad.append(f'{src} -> {dst}: concept {c!r} has no layer')
            if a in layers and b in layers and layers[a] <= layers[b]:
                bad.append(f'{src} -> {dst}: layer {layers[a]} ({a}) imports layer {layers[b]} ({b})')
            edges.setdefault(a, set()).add(b)
    bad.extend(f'cycle between concepts: {" -> ".join(c)}' for c in _cycles(edges))
    return bad


def _cycles(edges: Mapping[str, set[str]]) -> list[list[str]]:
    """Return one cycle per strongly connected group of two or more concepts (iterative DFS)."""
    found: list[list[str]] = []
    done: set[str] = set()
    for start in sorted(edges):
        stack: list[tuple[str, list[str]]] = [(start, [start])]
        while stack:
            node, path = stack.pop()
            for nxt in sorted(edges.get(node, ())):
                if nxt == start and len(path) > 1:
                    cycle = path + [start]
                    if not done.intersection(cycle[:-1]):
                        found.append(cycle)
                        done.update(cycle)
                elif nxt not in path and nxt not in done:
                    stack.append((nxt, path + [nxt]))
    return found
