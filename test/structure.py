"""The shape of sequence_ai_ros's classes and modules, read from the source with :mod:`ast` (nothing imported).

Three measures, each a target of the design (docs/architecture.md):

- **instance attributes per class**: the distinct ``self.<name>`` a class's own methods assign (properties
  and class attributes not counted). A class past :data:`MAX_ATTRIBUTES` owns too much state: split it
  into parts that own theirs.
- **import circles inside a package**: modules of one subpackage that import each other, directly or
  round a longer loop (lazy imports inside functions and ``if TYPE_CHECKING:`` imports count: a circle of
  types is a circle of concepts too; a Protocol owned by the lower module breaks it).
- **private reach-ins**: a module that imports another module's ``_private`` name, or reads
  ``<imported module>._private`` or ``<object of an imported class>._private``. The last is read only from
  annotations the reader can see: parameters and assignments typed by a project class.

Run it as a script for the table: ``python test/structure.py``.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

from layering import PACKAGE, module_name, package_graph

#: The most instance attributes one class may own.
MAX_ATTRIBUTES = 25


def _modules(root: Path) -> Iterator[tuple[str, Path]]:
    for path in sorted((root / PACKAGE).rglob('*.py')):
        rel = path.relative_to(root / PACKAGE).parts
        if rel[0] == 'templates' and len(rel) > 1 and rel[1] != '__init__.py':
            continue
        if path.name.endswith(('_pb2.py', '_pb2_grpc.py')):
            continue
        yield module_name(root, path), path


def instance_attributes(source: str) -> dict[str, set[str]]:
    """Return class name -> the ``self.X`` names its own methods assign (nested classes apart)."""
    out: dict[str, set[str]] = {}
    for cls in ast.walk(ast.parse(source)):
        if not isinstance(cls, ast.ClassDef):
            continue
        names: set[str] = set()
        for fn in cls.body:
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) or not fn.args.args:
                continue
            me = fn.args.args[0].arg
            for node in ast.walk(fn):
                targets: list[ast.expr] = []
                if isinstance(node, ast.Assign):
                    targets = list(node.targets)
                elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
                    targets = [node.target]
                for t in targets:
                    for leaf in ast.walk(t):
                        if isinstance(leaf, ast.Attribute) and isinstance(leaf.value, ast.Name) \
                                and leaf.value.id == me and isinstance(leaf.ctx, ast.Store):
                            names.add(leaf.attr)
        out[cls.name] = names
    return out


def class_sizes(root: Path) -> list[tuple[int, str]]:
    """Return (instance attributes, 'module:Class') for every class of the package, largest first."""
    rows = []
    for name, path in _modules(root):
        for cls, attrs in instance_attributes(path.read_text()).items():
            rows.append((len(attrs), f'{name.removeprefix(PACKAGE + ".")}:{cls}'))
    return sorted(rows, reverse=True)


def package_circles(root: Path) -> list[list[str]]:
    """Return the strongly connected groups (2+ modules) of imports inside each subpackage."""
    graph = package_graph(root)
    modules = set(graph)
    edges: dict[str, set[str]] = {}
    for src, targets in graph.items():
        pkg = src.rsplit('.', 1)[0]
        for dst in targets:
            if dst not in modules or dst == src:
                continue
            if dst.rsplit('.', 1)[0] == pkg and not dst.endswith('__init__'):
                # a package's __init__ re-exports its modules; the modules importing the package is the circle
                edges.setdefault(src, set()).add(dst)
    # Tarjan's strongly connected components
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on: set[str] = set()
    stack: list[str] = []
    groups: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    sys.setrecursionlimit(10000)
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return sorted(groups)


def private_reach_ins(root: Path) -> list[str]:
    """Return one line per use of another module's private name (see the module's docstring)."""
    found: list[str] = []
    for name, path in _modules(root):
        tree = ast.parse(path.read_text())
        imported_modules: dict[str, str] = {}
        imported_classes: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(PACKAGE):
                for a in node.names:
                    if a.name.startswith('_') and not a.name.startswith('__'):
                        found.append(f'{name}: imports {node.module}.{a.name}')
                    elif a.name[:1].isupper():
                        imported_classes.add(a.asname or a.name)
                    else:
                        imported_modules[a.asname or a.name] = f'{node.module}.{a.name}'
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.startswith(PACKAGE) and a.asname:
                        imported_modules[a.asname] = a.name
        typed: dict[str, str] = {}
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for arg in node.args.args + node.args.kwonlyargs:
                    if arg.annotation is not None:
                        ann = ast.unparse(arg.annotation).replace(' | None', '').strip("'\"")
                        if ann in imported_classes:
                            typed[arg.arg] = ann
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Attribute):
                ann = ast.unparse(node.annotation).replace(' | None', '').strip("'\"")
                if ann in imported_classes:
                    typed[ast.unparse(node.target)] = ann
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute) or not node.attr.startswith('_') or node.attr.startswith('__'):
                continue
            owner = ast.unparse(node.value)
            if owner in imported_modules:
                found.append(f'{name}: reads {imported_modules[owner]}.{node.attr}')
            elif owner in typed:
                found.append(f'{name}: reads {typed[owner]}.{node.attr} (of {owner})')
    return sorted(set(found))


def main() -> None:
    root = Path(__file__).resolve().parent.parent
    sizes = class_sizes(root)
    print(f'classes over {MAX_ATTRIBUTES} instance attributes:')
    for n, cls in sizes:
        if n > MAX_ATTRIBUTES:
            print(f'  {n:3d}  {cls}')
    print('largest within the target:')
    for n, cls in [r for r in sizes if r[0] <= MAX_ATTRIBUTES][:8]:
        print(f'  {n:3d}  {cls}')
    circles = package_circles(root)
    print(f'import circles inside a package: {len(circles)}')
    for group in circles:
        print('  ' + ' <-> '.join(m.removeprefix(PACKAGE + '.') for m in group))
    reach = private_reach_ins(root)
    print(f'private reach-ins across modules: {len(reach)}')
    for line in reach:
        print('  ' + line)


if __name__ == '__main__':
    main()
