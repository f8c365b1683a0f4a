"""Validate a custom resource against its vendored CRD's OpenAPI v3 schema, offline (no tests here).

The CRDs live in ``test/fixtures/crds`` (versions in its README). Validation is strict as ``kubectl apply
--validate=strict`` is: a field the schema does not declare fails, unless the schema keeps unknown fields
(``x-kubernetes-preserve-unknown-fields``) or declares ``additionalProperties``. CEL rules
(``x-kubernetes-validations``) are not evaluated.
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

if TYPE_CHECKING:       # imported where it is used: a venv without jsonschema still collects test_fleet_deploy
    import jsonschema

CRDS = Path(__file__).resolve().parent / 'fixtures' / 'crds'


@functools.cache
def _crds() -> dict[tuple[str, str], dict]:
    """Return (apiVersion, kind) -> the served version's openAPIV3Schema, for every vendored CRD."""
    out = {}
    for path in sorted(CRDS.glob('*.yaml')):
        for crd in yaml.safe_load_all(path.read_text()):
            if not crd or crd.get('kind') != 'CustomResourceDefinition':
                continue
            group, kind = crd['spec']['group'], crd['spec']['names']['kind']
            for version in crd['spec']['versions']:
                if version.get('served'):
                    out[(f'{group}/{version["name"]}', kind)] = version['schema']['openAPIV3Schema']
    return out


def _strict(schema: Any) -> Any:
    """Return ``schema`` with ``additionalProperties: false`` on every object that lists its properties."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _strict(v) if k in ('properties', 'items', 'anyOf', 'allOf', 'oneOf', 'not',
                                  'additionalProperties') else v for k, v in schema.items()}
    if 'properties' in out:
        out['properties'] = {name: _strict(s) for name, s in schema['properties'].items()}
        if 'additionalProperties' not in out and not out.get('x-kubernetes-preserve-unknown-fields'):
            out['additionalProperties'] = False
    return out


@functools.cache
def _validator(api_version: str, kind: str) -> jsonschema.Draft7Validator:
    try:
        schema = copy.deepcopy(_crds()[(api_version, kind)])
    except KeyError:
        raise LookupError(f'no vendored CRD serves {kind} {api_version} (test/fixtures/crds: '
                          f'{sorted(_crds())})') from None
    schema = _strict(schema)
    schema['properties']['metadata'] = {   # what the API server requires of a manifest's metadata
        'type': 'object', 'required': ['name'],
        'properties': {'name': {'type': 'string', 'pattern': r'^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$'},
                       'namespace': {'type': 'string'}, 'labels': {'type': 'object'},
                       'annotations': {'type': 'object'}},
        'additionalProperties': False}
    schema['properties'].update(apiVersion={'const': api_version}, kind={'const': kind})
    schema.setdefault('required', [])
    schema['required'] = sorted({*schema['required'], 'apiVersion', 'kind', 'metadata'})
    import jsonschema

    return jsonschema.Draft7Validator(schema)


def validate(resource: dict) -> None:
    """Raise :class:`jsonschema.ValidationError` when ``resource`` does not fit its CRD.

    :raises LookupError: when no vendored CRD serves its apiVersion and kind.
    """
    _validator(resource['apiVersion'], resource['kind']).validate(resource)


def schema_of(api_version: str, kind: str) -> dict:
    """Return the served schema of ``kind`` ``api_version`` as vendored (not strict)."""
    return _crds()[(api_version, kind)]
