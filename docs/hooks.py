"""MkDocs hooks: the reference pages generated from the definitions they document, at every build.

A page asks for a generated block with an HTML comment on a line of its own; the hook replaces it:

- ``<!-- gen:readme -->``: README.md, the home page (one text for the repository and the site);
- ``<!-- gen:parameters -->``: every ``policy_node`` parameter, from
  ``sequence_ai_ros/node/policy_node_parameters.yaml`` (the schema that declares and validates them, and
  that ``make params-yaml`` turns into ``config/policy_node.yaml``);
- ``<!-- gen:sim-parameters -->``: ``sim_robot``'s parameters, from :class:`sequence_ai_ros.sim.config.SimConfig`;
- ``<!-- gen:cli -->``: ``seq`` and each sub-command's ``--help``, from its argparse parsers
  (:func:`sequence_ai_ros.cli.build_parser`);
- ``<!-- gen:protocol-version -->``: :data:`sequence_ai_ros.protocol.contract.PROTOCOL_VERSION`;
- ``<!-- gen:metrics -->``: the worker's Prometheus series, from the registry
  :class:`sequence_ai_ros.worker.metrics.PrometheusMetrics` builds, labels from its module docstring;
- ``<!-- gen:exceptions -->``: the typed errors of :mod:`sequence_ai_ros.exceptions`, as a table of links to
  their sections.

A definition the page cannot document fails the build (``PluginError``): a metric missing from the
metrics module's docstring, an exception without a ``## Name`` section in troubleshooting.md.
"""

from __future__ import annotations

import argparse
import inspect
import os
import re
import sys
from pathlib import Path

from mkdocs.exceptions import PluginError

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MARKER = re.compile(r'^<!-- gen:([a-z-]+) -->$', re.M)


def _md_escape(text: str) -> str:
    return str(text).replace('|', '\\|').replace('\n', ' ')


def parameters_markdown() -> str:
    """A table per parameter group, in schema order: name, type, default, read-only, constraints, description."""
    from sequence_ai_ros.node import parameter_schema

    groups: dict[str, list[str]] = {}
    for spec in parameter_schema.load():
        group = spec.name.split('.')[0] if '.' in spec.name else 'general'
        name = spec.name.replace(f'{parameter_schema.MAP_PREFIX}{spec.mapped_by}', f'<{spec.mapped_by[:-1]}>') \
            if spec.mapped_by else spec.name
        default = parameter_schema._yaml_scalar(spec.default)
        row = (f'| `{name}` | {spec.type} | `{_md_escape(default)}` | {"yes" if spec.read_only else ""} | '
               f'{_md_escape(spec.constraints())} | {_md_escape(spec.description)} |')
        groups.setdefault(group, []).append(row)
    out = []
    for group, rows in groups.items():
        out += [f'### {group}', '', '| parameter | type | default | read-only | constraints | description |',
                '|---|---|---|---|---|---|', *rows, '']
    return '\n'.join(out)


def _subcommands(parser: argparse.ArgumentParser, prefix: str):
    yield prefix, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _subcommands(sub, f'{prefix} {name}')


def sim_parameters_markdown() -> str:
    """The simulated robot's parameters, from :class:`sequence_ai_ros.sim.config.SimConfig` (one field each)."""
    import dataclasses

    from sequence_ai_ros.sim.config import SimConfig

    rows = ['| parameter | default | description |', '|---|---|---|']
    for field in dataclasses.fields(SimConfig):
        default = field.default_factory() if field.default_factory is not dataclasses.MISSING else field.default
        rows.append(f'| `{field.name}` | `{default!r}` | {_md_escape(field.metadata.get("help", ""))} |')
    return '\n'.join(rows)


def cli_markdown() -> str:
    """``seq --help`` and every sub-command's, at a fixed width of 100 columns."""
    from sequence_ai_ros.cli import build_parser

    old = os.environ.get('COLUMNS')
    os.environ['COLUMNS'] = '100'
    try:
        out = []
        for name, parser in _subcommands(build_parser(), 'seq'):
            parser.prog = name
            out += [f'## `{name}`', '', '```text', parser.format_help().rstrip(), '```', '']
        return '\n'.join(out)
    finally:
        if old is None:
            os.environ.pop('COLUMNS', None)
        else:
            os.environ['COLUMNS'] = old


def protocol_version_markdown() -> str:
    """The handshake's protocol version, as code."""
    from sequence_ai_ros.protocol.contract import PROTOCOL_VERSION

    return f'`{PROTOCOL_VERSION}`'


def metrics_markdown() -> str:
    """The registry's series (name, type, help) with the labels the metrics module's docstring gives them."""
    from sequence_ai_ros.worker import metrics

    labels = dict(re.findall(r'``(seq_\w+?)(?:_total)?\{([^}]*)\}``', metrics.__doc__ or ''))
    sink = metrics.PrometheusMetrics({}, lambda name: 0, port=0)
    try:
        families = list(sink.registry.collect())
    finally:
        sink.close()
    rows = []
    for family in families:
        if not family.name.startswith('seq_'):   # prometheus_client's process_* and python_* collectors
            continue
        if family.name not in labels:
            raise PluginError(f'metric {family.name} is not documented in sequence_ai_ros/worker/metrics.py')
        name = family.name + ('_total' if family.type == 'counter' else '')
        rows.append(f'| `{name}` | {family.type} | `{labels[family.name]}` | {_md_escape(family.documentation)} |')
    return '\n'.join(['| series | type | labels | help |', '|---|---|---|---|', *rows])


def exception_classes() -> list[type]:
    """Every exception class defined in :mod:`sequence_ai_ros.exceptions`, in source order."""
    from sequence_ai_ros import exceptions

    found = [c for _, c in inspect.getmembers(exceptions, inspect.isclass)
             if issubclass(c, BaseException) and c.__module__ == exceptions.__name__]
    return sorted(found, key=lambda c: inspect.getsourcelines(c)[1])


def exceptions_markdown() -> str:
    """A table of the typed errors: name (a link to its section), bases, its docstring's first line."""
    rows = ['| error | base | raised when |', '|---|---|---|']
    for cls in exception_classes():
        bases = ', '.join(b.__name__ for b in cls.__bases__)
        doc = (cls.__doc__ or '').strip().splitlines()[0].removeprefix('Raised when ').rstrip('.')
        rows.append(f'| [`{cls.__name__}`](#{cls.__name__.lower()}) | {bases} | {_md_escape(doc)} |')
    return '\n'.join(rows)


def readme_markdown() -> str:
    """README.md as the site's home page: links into docs/ made site-relative, other repository links plain text."""
    text = (ROOT / 'README.md').read_text()
    text = text.replace('[CHANGELOG.md](CHANGELOG.md)', '[the changelog](changelog.md)')

    def relink(match: re.Match) -> str:
        label, target = match.group(1), match.group(2)
        if target.startswith(('http://', 'https://', '#')):
            return match.group(0)
        if target.startswith('docs/') and target != 'docs/':
            return f'[{label}]({target[len("docs/"):]})'
        return label   # a repository file (examples/, docs/ itself): named, not linked

    return re.sub(r'\[([^\]]+)\]\(([^)\s]+)\)', relink, text)


GENERATORS = {
    'readme': readme_markdown,
    'parameters': parameters_markdown,
    'cli': cli_markdown,
    'sim-parameters': sim_parameters_markdown,
    'protocol-version': protocol_version_markdown,
    'metrics': metrics_markdown,
    'exceptions': exceptions_markdown,
}


def undocumented_exceptions(markdown: str) -> list[str]:
    """The exception classes that have no ``## Name`` section in ``markdown`` (troubleshooting.md)."""
    headings = set(re.findall(r'^## `?(\w+)`?\s*$', markdown, re.M))
    return [c.__name__ for c in exception_classes() if c.__name__ not in headings]


def on_page_markdown(markdown: str, page, config, files) -> str:
    """Replace each ``<!-- gen:NAME -->`` line with its generated block; check troubleshooting's coverage."""
    def generate(match: re.Match) -> str:
        name = match.group(1)
        if name not in GENERATORS:
            raise PluginError(f'{page.file.src_path}: unknown generated block {name!r}')
        return GENERATORS[name]()

    if page.file.src_path == 'troubleshooting.md':
        missing = undocumented_exceptions(markdown)
        if missing:
            raise PluginError(f'troubleshooting.md has no section for {", ".join(missing)}')
    return MARKER.sub(generate, markdown)
