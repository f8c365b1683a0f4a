"""The policy node's parameter schema: one YAML declares every parameter; the rest is derived (ROS-free).

``policy_node_parameters.yaml`` (beside this module, installed as package data) uses the field names of
generate_parameter_library (``type``, ``default_value``, ``description``, ``read_only``, ``validation``),
after ros2_controllers' ``joint_trajectory_controller_parameters.yaml``. That library generates C++ and
Python from such a file at build time; it is not installable here, so this module is the small in-house
reader that turns the same file into:

- :meth:`Schema.check`, the validation of one value (used by the config dataclasses' ``__post_init__``,
  at declaration and by the node's on-set-parameters callback);
- :meth:`Schema.default`, the config dataclass defaults (no default is typed twice);
- :meth:`Schema.descriptor_fields`, what :mod:`.parameters` puts in each ParameterDescriptor;
- :func:`params_yaml`, the commented ``config/policy_node.yaml``, and :func:`check_params_file`, which
  validates a params file (names, types, bounds) against the schema.

Validators understood (generate_parameter_library spellings): ``bounds<>: [lo, hi]`` (inclusive),
``gt<>``, ``gt_eq<>``, ``lt<>``, ``lt_eq<>``: ``[x]``, ``one_of<>: [[a, b]]``, ``not_empty<>``,
``unique<>``, and the project's ``sequence_ai_ros::all_finite``, ``sequence_ai_ros::all_positive`` and
``sequence_ai_ros::no_empty_strings`` (custom validators are namespaced, as the library requires).
A mapped group ``cameras: __map_camera_names: topic: ...`` declares ``cameras.<name>.topic`` for every
entry of the string array ``camera_names`` (the library's ``__map_`` convention).

Regenerate the shipped defaults file after editing the schema::

    python -m sequence_ai_ros.node.parameter_schema --write-yaml [config/policy_node.yaml]
    python -m sequence_ai_ros.node.parameter_schema --check config/g1.yaml config/wx200.yaml
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import re
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from sequence_ai_ros.exceptions import ConfigError
from sequence_ai_ros.node.launch_parameters import flatten

SCHEMA_PATH = Path(__file__).with_name('policy_node_parameters.yaml')
NODE_NAME = 'policy_node'
TYPES = ('bool', 'int', 'double', 'string', 'bool_array', 'int_array', 'double_array', 'string_array')
MAP_PREFIX = '__map_'
#: The shipped defaults file, relative to the repository root.
DEFAULTS_FILE = Path('config') / 'policy_node.yaml'


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    """One parameter as the schema declares it.

    :param name: dotted name; a mapped group's segment is ``__map_<array>`` (e.g. ``cameras.__map_camera_names.topic``).
    :param type: one of :data:`TYPES`.
    :param default: ``default_value`` (a tuple for arrays).
    :param description: one line.
    :param read_only: True when a change needs a restart.
    :param validation: {validator: arguments}, in schema order.
    """

    name: str
    type: str
    default: Any
    description: str
    read_only: bool = False
    validation: Mapping[str, list] = dataclasses.field(default_factory=dict)

    @property
    def mapped_by(self) -> str:
        """The string array whose entries instantiate this parameter ('' when not mapped)."""
        for part in self.name.split('.'):
            if part.startswith(MAP_PREFIX):
                return part[len(MAP_PREFIX):]
        return ''

    def instance(self, key: str) -> str:
        """The concrete name for mapped entry ``key`` (``cameras.front.topic``)."""
        return '.'.join(key if p.startswith(MAP_PREFIX) else p for p in self.name.split('.'))

    def bounds(self) -> tuple[float, float] | None:
        """The inclusive ``bounds<>`` (lo, hi), or None."""
        b = self.validation.get('bounds<>')
        return (b[0], b[1]) if b else None

    def constraints(self) -> str:
        """The validation in words, for ``ParameterDescriptor.additional_constraints`` and the YAML comments."""
        words = []
        for rule, args in self.validation.items():
            if rule == 'bounds<>':
                words.append(f'within [{args[0]}, {args[1]}]')
            elif rule in _COMPARE:
                words.append(f'{_COMPARE[rule][0]} {args[0]}')
            elif rule == 'one_of<>':
                words.append('one of ' + ' | '.join(map(str, args[0])))
            elif rule == 'not_empty<>':
                words.append('not empty')
            elif rule == 'unique<>':
                words.append('unique')
            else:
                words.append(rule.split('::')[-1].replace('_', ' '))
        return '; '.join(words)

    def check(self, value: Any, name: str | None = None, *, strict: bool = False) -> Any:
        """Validate ``value``; return it normalised (arrays as tuples, ints as floats for doubles).

        :param name: the concrete name for messages (defaults to :attr:`name`).
        :param strict: refuse an int for a double (a ROS params file must write ``50.0``, not ``50``).
        :raises ConfigError: ``parameter <name>: <why>``, for a wrong type or a failed validator.
        """
        name = name or self.name
        value = _typed(name, self.type, value, strict)
        for rule, args in self.validation.items():
            problem = _VALIDATORS[rule](value, *args) if rule in _VALIDATORS else f'unknown validator {rule}'
            if problem:
                raise ConfigError(f'parameter {name}: {problem}')
        return value


def _typed(name: str, kind: str, value: Any, strict: bool) -> Any:
    def bad(expect: str) -> ConfigError:
        hint = ' (write a double with a decimal point, e.g. 50.0)' if expect == 'double' and isinstance(
            value, int) and not isinstance(value, bool) else ''
        return ConfigError(f'parameter {name}: expected {expect}, got {type(value).__name__} {value!r}{hint}')

    base = kind.removesuffix('_array')
    if kind.endswith('_array'):
        if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
            try:
                value = list(value)
            except TypeError:
                raise bad(kind) from None
        return tuple(_scalar(name, base, v, strict, bad) for v in value)
    return _scalar(name, base, value, strict, bad)


def _scalar(name: str, base: str, v: Any, strict: bool, bad: Any) -> Any:
    if base == 'bool':
        if not isinstance(v, bool):
            raise bad('bool')
        return v
    if base == 'int':
        if isinstance(v, bool) or not isinstance(v, int):
            raise bad('int')
        return v
    if base == 'double':
        if isinstance(v, bool) or not isinstance(v, (int, float)) or (strict and isinstance(v, int)):
            raise bad('double')
        try:
            return float(v)
        except OverflowError:           # an int past a double's range
            raise ConfigError(f'parameter {name}: {v!r} is out of a double\'s range') from None
    if not isinstance(v, str):
        raise bad('string')
    return v


def _bounds(v: Any, lo: float, hi: float) -> str:
    values = v if isinstance(v, tuple) else (v,)
    if all(lo <= x <= hi for x in values):      # written so that NaN fails
        return ''
    return f'must be within [{lo}, {hi}], got {v!r}'


_COMPARE = {'gt<>': ('>', lambda a, b: a > b), 'gt_eq<>': ('>=', lambda a, b: a >= b),
            'lt<>': ('<', lambda a, b: a < b), 'lt_eq<>': ('<=', lambda a, b: a <= b)}


def _compare(rule: str) -> Any:
    word, op = _COMPARE[rule]
    return lambda v, x: '' if op(v, x) else f'must be {word} {x}, got {v!r}'


def _finite(v: tuple[float, ...]) -> str:
    bad = [i for i, x in enumerate(v) if not math.isfinite(x)]
    if not bad:
        return ''
    return (f'non-finite values at indices {bad} ({[v[i] for i in bad]}); every limit must be a finite number '
            '(use a large finite value for an unlimited joint)')


_NAME_PART = re.compile(r'^[A-Za-z][A-Za-z0-9_]*$')


def _name_parts(v: tuple[str, ...]) -> str:
    bad = [x for x in v if not _NAME_PART.match(x)]
    if not bad:
        return ''
    return (f'{bad} cannot be part of a parameter name (cameras.<name>.topic): use letters, digits and "_", '
            'starting with a letter')


def _endpoint(v: str) -> str:
    if not v:           # empty: the node reads $SEQ_ENDPOINT, else the default port on 127.0.0.1 (NodeConfig)
        return ''
    host, sep, port = v.rpartition(':')
    if sep and host and port.isdigit() and 1 <= int(port) <= 65535:
        return ''
    return f'must be host:port with a port in [1, 65535] (e.g. 127.0.0.1:50551), got {v!r}'


_VALIDATORS: dict[str, Any] = {
    'bounds<>': _bounds,
    **{rule: _compare(rule) for rule in _COMPARE},
    'one_of<>': lambda v, choices: '' if v in choices else f'{v!r} is not one of {", ".join(map(str, choices))}',
    'not_empty<>': lambda v: '' if len(v) else 'must not be empty',
    'unique<>': lambda v: '' if len(set(v)) == len(v) else f'values must be unique, got {list(v)}',
    'sequence_ai_ros::no_empty_strings': lambda v: '' if all(v) else f'names must be non-empty, got {list(v)}',
    'sequence_ai_ros::all_finite': _finite,
    'sequence_ai_ros::name_parts': _name_parts,
    'sequence_ai_ros::endpoint': _endpoint,
    'sequence_ai_ros::all_positive': lambda v: '' if all(x > 0 for x in v) else
    f'every value must be > 0, got {list(v)}',
}


class Schema:
    """Every parameter of the node, read from the schema YAML.

    :param specs: the parameters, in schema order.
    """

    def __init__(self, specs: Sequence[ParamSpec]) -> None:
        self.specs = {s.name: s for s in specs}

    def __iter__(self) -> Iterator[ParamSpec]:
        return iter(self.specs.values())

    def spec(self, name: str) -> ParamSpec:
        """The spec of a concrete name (``cameras.front.topic`` finds the mapped spec).

        :raises ConfigError: for a name the schema does not declare.
        """
        if name in self.specs:
            return self.specs[name]
        parts = name.split('.')
        for spec in self.specs.values():
            sp = spec.name.split('.')
            if len(sp) == len(parts) and all(a == b or a.startswith(MAP_PREFIX)
                                             for a, b in zip(sp, parts, strict=True)):
                return spec
        raise ConfigError(f'parameter {name}: not a parameter of {NODE_NAME}')

    def default(self, name: str) -> Any:
        """The declared default of ``name`` (a tuple for arrays)."""
        return self.spec(name).default

    def check(self, name: str, value: Any, *, strict: bool = False) -> Any:
        """Validate one value of parameter ``name``; return it normalised (see :meth:`ParamSpec.check`)."""
        return self.spec(name).check(value, name, strict=strict)

    def names(self, mapped: Mapping[str, Sequence[str]] | None = None) -> list[str]:
        """Every concrete parameter name; mapped groups expand over ``mapped`` ({array: entries})."""
        out = []
        for spec in self:
            by = spec.mapped_by
            if by:
                out += [spec.instance(k) for k in (mapped or {}).get(by, ())]
            else:
                out.append(spec.name)
        return out


def _walk(tree: Mapping[str, Any], prefix: str = '') -> Iterator[ParamSpec]:
    for key, value in tree.items():
        name = f'{prefix}{key}'
        if not isinstance(value, Mapping):
            raise ConfigError(f'schema {SCHEMA_PATH.name}: {name} is neither a group nor a parameter')
        if 'type' in value and not isinstance(value['type'], Mapping):
            if value['type'] not in TYPES:
                raise ConfigError(f'schema {SCHEMA_PATH.name}: {name} has type {value["type"]!r}')
            default = value.get('default_value')
            if value['type'].endswith('_array'):
                default = tuple(default or ())
            spec = ParamSpec(name, value['type'], default, str(value.get('description', '')),
                             bool(value.get('read_only', False)), dict(value.get('validation') or {}))
            if not spec.mapped_by:            # a mapped default is a placeholder ('' topic: must be set)
                spec.check(spec.default)     # the schema's own defaults must pass its validation
            yield spec
        else:
            yield from _walk(value, name + '.')


@functools.lru_cache(maxsize=4)
def load(path: Path = SCHEMA_PATH) -> Schema:
    """Read the schema (cached).

    :raises ConfigError: for an unknown type, a malformed entry, or a default its own validation refuses.
    """
    doc = yaml.safe_load(Path(path).read_text())
    return Schema(list(_walk(doc[NODE_NAME])))


# -- the params files ---------------------------------------------------------------------------------

def _yaml_scalar(value: Any) -> str:
    return yaml.safe_dump(list(value) if isinstance(value, tuple) else value, default_flow_style=True,
                          width=10_000).strip().removesuffix('...').strip()


def params_yaml(schema: Schema | None = None) -> str:
    """Return the text of ``config/policy_node.yaml``: every parameter at its default, with its description.

    Arrays whose default is empty are written commented out (a ROS params file cannot spell an empty
    list: an empty YAML sequence has no type), and so is the mapped cameras group.
    """
    schema = schema or load()
    lines = [
        f'# {NODE_NAME} parameters at their defaults. GENERATED from sequence_ai_ros/node/{SCHEMA_PATH.name}',
        '# (the one declaration of every parameter) by',
        '#   python -m sequence_ai_ros.node.parameter_schema --write-yaml',
        '# Edit the schema, not this file; test/test_parameter_schema.py checks that they agree. Use as a template:',
        '# copy it, set model and joints.names (the node refuses to run without them), and run',
        f'#   ros2 run sequence_ai_ros {NODE_NAME} --ros-args --params-file my_robot.yaml',
        '# (restart): read_only, a change needs a restart. Arrays whose default is empty are commented out: a',
        '# ROS params file cannot spell an empty list (an empty YAML sequence has no type).',
        f'# The key /**/{NODE_NAME} matches the node in any namespace (namespace:=robot1, -r __ns:=/robot1).',
        f'/**/{NODE_NAME}:',
        '  ros__parameters:',
    ]
    open_groups: list[str] = []
    for spec in schema:
        parts = spec.name.split('.')
        groups, leaf = parts[:-1], parts[-1]
        # a mapped group (cameras.__map_camera_names.*) is written as a commented example from its parent on
        m = next((i for i, g in enumerate(groups) if g.startswith(MAP_PREFIX)), None)

        def line(depth: int, text: str, commented: bool = False, m: int | None = m) -> str:
            if m is not None and depth >= m - 1:
                return '    ' + '  ' * (m - 1) + '# ' + '  ' * (depth - m + 1) + text
            return '    ' + '  ' * depth + ('# ' if commented else '') + text

        common = 0
        while common < min(len(groups), len(open_groups)) and groups[common] == open_groups[common]:
            common += 1
        for depth in range(common, len(groups)):
            group = groups[depth]
            if group.startswith(MAP_PREFIX):
                lines.append(line(depth, f'cam_high:  # one group per {group[len(MAP_PREFIX):]} entry, e.g. cam_high'))
            else:
                lines.append(line(depth, f'{group}:'))
        open_groups = groups
        note = ' (restart)' if spec.read_only else ''
        limits = spec.constraints()
        lines.append(line(len(groups), f'# {spec.description}{note}' + (f' [{limits}]' if limits else '')))
        empty_array = spec.type.endswith('_array') and not spec.default
        lines.append(line(len(groups), f'{leaf}: {_yaml_scalar(spec.default)}', commented=empty_array))
    return '\n'.join(lines) + '\n'


def node_parameters(doc: Mapping[str, Any]) -> dict[str, Any]:
    """The flat ``ros__parameters`` of the node in a params file's document (``policy_node``, ``/**``...)."""
    out: dict[str, Any] = {}
    for key in ('/**', '/**/' + NODE_NAME, NODE_NAME, '/' + NODE_NAME):
        out.update(flatten(((doc or {}).get(key) or {}).get('ros__parameters') or {}))
    return out


def check_params_file(path: Path, schema: Schema | None = None) -> dict[str, Any]:
    """Validate a params file against the schema: every name declared, every value of its type and bounds.

    ``use_sim_time`` (every node has it) is accepted. Values are checked as a ROS params file gives them
    (strict: ``50`` is no double).

    :returns: the file's flat parameters, normalised.
    :raises ConfigError: naming the file and every parameter that fails.
    """
    schema = schema or load()
    params = node_parameters(yaml.safe_load(Path(path).read_text()))
    if not params:
        raise ConfigError(f'{path}: no {NODE_NAME} ros__parameters')
    cameras = params.get('camera_names', schema.default('camera_names'))
    declared = set(schema.names({'camera_names': cameras if isinstance(cameras, (list, tuple)) else ()}))
    problems, out = [], {}
    for name, value in params.items():
        if name == 'use_sim_time':
            continue
        if name not in declared:
            problems.append(f'parameter {name}: not a parameter of {NODE_NAME}')
            continue
        try:
            out[name] = schema.check(name, value, strict=True)
        except ConfigError as exc:
            problems.append(str(exc))
    if problems:
        raise ConfigError(f'{path}: ' + '; '.join(problems))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m sequence_ai_ros.node.parameter_schema --write-yaml [PATH] | --check FILE...``."""
    parser = argparse.ArgumentParser(prog='python -m sequence_ai_ros.node.parameter_schema',
                                     description='Write config/policy_node.yaml from the schema, '
                                                 'or check params files.')
    parser.add_argument('--write-yaml', nargs='?', const=str(DEFAULTS_FILE), metavar='PATH',
                        help=f'write the defaults file (default {DEFAULTS_FILE})')
    parser.add_argument('--check', nargs='+', default=[], metavar='FILE', help='validate params files')
    args = parser.parse_args(argv)
    if not args.write_yaml and not args.check:
        sys.stdout.write(params_yaml())
        return 0
    if args.write_yaml:
        Path(args.write_yaml).write_text(params_yaml())
        print(f'wrote {args.write_yaml}')
    status = 0
    for path in args.check:
        try:
            check_params_file(Path(path))
            print(f'{path}: ok')
        except ConfigError as exc:
            print(str(exc), file=sys.stderr)
            status = 1
    return status


if __name__ == '__main__':
    sys.exit(main())
