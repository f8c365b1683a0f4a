"""The parameters the launch files give their nodes: params files read as rcl reads them, then the arguments given.

``launch/*.launch.py`` read their YAML files here and hand each node one flat dict of parameters
(``joints.names``, not nested), so a ``namespace`` does not break the files' keys and every launch file
applies one rule, parameter by parameter, each layer over the one before:

1. the node's defaults file: ``config/policy_node.yaml`` (every parameter at the node's own default) or
   ``config/sim_robot.yaml``;
2. the launch file's own defaults: for ``policy_node``, ``autostart: true`` (:data:`POLICY_LAUNCH_DEFAULTS`;
   a launch file starts the node, where the node on its own waits for a lifecycle manager);
3. the params files of the launch, in order: a shipped one (``config/sim_policy_node.yaml``), then the
   user's (``params_file``, ``sim_params_file``);
4. each launch argument that is given. A launch argument declared with an empty default is not given until
   the command line (or an including launch file) gives it a value, so it never overrides a file.

ROS-free (PyYAML only): the launch files import it in the launch process.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import yaml

from sequence_ai_ros.exceptions import ConfigError

#: What a launch file sets for ``policy_node`` over config/policy_node.yaml, under every params file.
POLICY_LAUNCH_DEFAULTS: dict[str, Any] = {'autostart': True}

#: The types a launch argument's text is read as (``list``: camera names, see :func:`argument_value`).
KINDS = (str, int, float, bool, list)


def _matches(pattern: list[str], name: list[str]) -> bool:
    if not pattern:
        return not name
    if pattern[0] == '**':
        return any(_matches(pattern[1:], name[i:]) for i in range(len(name) + 1))
    return bool(name) and pattern[0] in ('*', name[0]) and _matches(pattern[1:], name[1:])


def flatten(section: Mapping[str, Any], prefix: str = '') -> dict[str, Any]:
    """Return ``section``'s parameters with nested names joined by dots (``joints: {names: x}``: ``joints.names``)."""
    out: dict[str, Any] = {}
    for key, value in section.items():
        if isinstance(value, Mapping):
            out.update(flatten(value, f'{prefix}{key}.'))
        else:
            out[f'{prefix}{key}'] = value
    return out


def node_parameters(path: str, node_name: str, namespace: str = '') -> dict[str, Any]:
    """Return the ``ros__parameters`` a params file gives ``node_name`` in ``namespace``, as rcl applies them.

    rcl's rules for a node's fully qualified name (``/robot1/policy_node``): a key is a name pattern, ``*``
    one name token, ``**`` any number of them, a key without a leading ``/`` is absolute all the same
    (``policy_node`` is ``/policy_node``: the root namespace's node); every matching key applies, in the
    file's order, later ones overriding earlier ones parameter by parameter. The shipped configs use
    ``/**/<node>``.

    :param path: the YAML params file.
    :param node_name: the node's name (``policy_node``, ``sim_robot``).
    :param namespace: the node's namespace (``robot1``, ``/robot1`` or empty).
    :returns: the parameters, flat (see :func:`flatten`).
    :raises ConfigError: for a file that is not a params file's shape, naming it.
    """
    with open(path) as f:
        data = yaml.safe_load(f) or {}
    if not isinstance(data, Mapping):
        raise ConfigError(f'params file {path}: expected a mapping of node names to sections, '
                          f'got a {type(data).__name__}')
    fqn = [t for t in namespace.split('/') if t] + [node_name]
    out: dict[str, Any] = {}
    for key, section in data.items():
        if isinstance(key, str) and _matches([t for t in key.split('/') if t], fqn):
            params = (section or {}).get('ros__parameters', {}) if isinstance(section, Mapping) else section
            if not isinstance(params or {}, Mapping):
                raise ConfigError(f'params file {path}: {key}: expected {{ros__parameters: {{name: value}}}}, '
                                  f'got {section!r:.80}')
            out.update(flatten(params or {}))
    return out


def argument_value(name: str, text: str, kind: type) -> Any:
    """Read launch argument ``name``'s text as ``kind``.

    ``bool``: ``true``/``false`` (or ``1``/``0``, any case), as launch's conditions read them; ``list``: camera
    names, comma-separated (``corner,gripper``) or a YAML list (``[corner, gripper]``), and ``none`` (or
    ``[]``) for no camera, given as ``['']`` (a ROS params file cannot spell an empty list).

    :raises ConfigError: for text that is not a ``kind`` (the message names the argument).
    """
    text = text.strip()
    try:
        if kind is bool:
            word = text.lower()
            if word not in ('true', 'false', '1', '0'):
                raise ValueError('expected true or false')
            return word in ('true', '1')
        if kind is int:
            return int(text)
        if kind is float:
            value = float(text)
            if not math.isfinite(value):
                raise ValueError('expected a finite number')
            return value
        if kind is list:
            items = yaml.safe_load(text) if text.startswith('[') else text.split(',')
            if not isinstance(items, list):
                raise ValueError('expected a comma-separated list')
            names = [str(v).strip() for v in items if str(v).strip()]
            if names in ([], ['none']):
                return ['']
            return names
        return text
    except (ValueError, yaml.YAMLError) as exc:
        raise ConfigError(f'launch argument {name}:={text!r}: {exc}') from None


def given_arguments(arguments: Mapping[str, tuple[str, type]]) -> dict[str, Any]:
    """Return the launch arguments that were given (non-empty text), each read as its kind.

    :param arguments: parameter name -> (the argument's text, its kind, one of :data:`KINDS`).
    :raises ConfigError: as :func:`argument_value`.
    """
    return {name: argument_value(name, text, kind) for name, (text, kind) in arguments.items() if text.strip()}


def layered(node_name: str, namespace: str, defaults_file: str, *, launch_defaults: Mapping[str, Any] | None = None,
            files: Iterable[str] = (), given: Mapping[str, tuple[str, type]] | None = None) -> dict[str, Any]:
    """Return a node's parameters by the rule of the module docstring.

    :param node_name: the node's name.
    :param namespace: its namespace.
    :param defaults_file: the node's defaults file.
    :param launch_defaults: what the launch file sets over the defaults file.
    :param files: params files over those, in order; an empty path is skipped (an argument not given).
    :param given: the launch arguments (see :func:`given_arguments`); only those given apply.
    :raises ConfigError: for a launch argument of the wrong kind.
    :raises OSError: for a params file that cannot be read.
    """
    params = node_parameters(defaults_file, node_name, namespace)
    params.update(launch_defaults or {})
    for path in files:
        if path:
            params.update(node_parameters(path, node_name, namespace))
    params.update(given_arguments(given or {}))
    return params


def policy_node_parameters(share: str, namespace: str, params_file: str = '', *, shipped_file: str = '',
                           model: str = '', endpoint: str = '', use_sim_time: str = '',
                           autostart: str = '') -> dict[str, Any]:
    """Return ``policy_node``'s parameters as a launch file gives them (the rule of the module docstring).

    :param share: the package's share folder (``config/policy_node.yaml`` is read from it).
    :param namespace: the node's namespace.
    :param params_file: the user's params file ('' for none).
    :param shipped_file: a shipped params file under the user's (``config/sim_policy_node.yaml``).
    :param model: the launch arguments' texts, '' where not given.
    :raises ConfigError: for ``use_sim_time`` or ``autostart`` other than true or false.
    """
    return layered('policy_node', namespace, f'{share}/config/policy_node.yaml',
                   launch_defaults=POLICY_LAUNCH_DEFAULTS, files=(shipped_file, params_file),
                   given={'model': (model, str), 'endpoint': (endpoint, str),
                          'use_sim_time': (use_sim_time, bool), 'autostart': (autostart, bool)})
