"""The ``lerobot`` template's config.yaml settings: one definition each, checked at contract time (no torch).

:data:`SETTINGS` names every key policy.py's constructor takes, with its check and its allowed values in
words; :func:`check` validates a config.yaml mapping against it and returns the normalised values, or raises
:class:`~sequence_ai_ros.exceptions.ConfigError` naming the key and what it allows (never a traceback from
deeper code). ``rtc_execution_horizon``'s range depends on the checkpoint (1 .. chunk_size, RTC on only) and is
checked by :func:`~sequence_ai_ros.models.lerobot_checkpoint.plan`.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Callable
from typing import Any

from sequence_ai_ros.exceptions import ConfigError

#: torch.Generator.manual_seed takes a 64-bit seed; chunk k of an episode is seeded S + k
MAX_NOISE_SEED = 2**63 - 1


@dataclasses.dataclass(frozen=True)
class Setting:
    """One config.yaml key: its check (value -> normalised value, or None when it does not fit) and its range."""

    check: Callable[[Any], Any]
    allowed: str


_BAD = object()


def _text(v: Any) -> Any:
    return v if isinstance(v, str) else _BAD


def _int(v: Any, low: int, high: int | None = None) -> Any:
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        return _BAD
    n = int(v)
    return _BAD if n < low or (high is not None and n > high) else n


def _optional_int(low: int, high: int | None = None) -> Callable[[Any], Any]:
    return lambda v: None if v is None else _int(v, low, high)


def _positive(v: Any) -> Any:
    if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v) or not float(v) > 0:
        return _BAD
    return float(v)


def _names(v: Any) -> Any:
    """A list of non-empty names; a single nested list ``[[a, b]]`` (LeRobot v2.1 info.json's form) is flattened."""
    if v is None:
        return []
    if isinstance(v, (list, tuple)) and len(v) == 1 and isinstance(v[0], (list, tuple)):
        v = v[0]
    if isinstance(v, (list, tuple)) and all(isinstance(n, str) and n for n in v):
        return list(v)
    return _BAD


def _mapping(value_check: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def check(v: Any) -> Any:
        if v is None:
            return {}
        if not isinstance(v, dict) or not all(isinstance(k, str) and k for k in v):
            return _BAD
        out = {k: value_check(x) for k, x in v.items()}
        return _BAD if any(x is _BAD for x in out.values()) else out
    return check


def _non_empty_text(v: Any) -> Any:
    return v if isinstance(v, str) and v else _BAD


def _name_list(v: Any) -> Any:
    out = _names(v)
    return _BAD if out is _BAD else out


SETTINGS: dict[str, Setting] = {
    'checkpoint': Setting(_text, 'a directory path (text)'),
    'device': Setting(_non_empty_text, 'a torch device: cuda, cuda:N, cpu or mps'),
    'fps': Setting(_positive, 'a finite number > 0 (Hz)'),
    'action_space': Setting(_non_empty_text, 'an action space name (joint_absolute, joint_delta, ...)'),
    'state_names': Setting(_names, 'a list of joint names (text)'),
    'action_names': Setting(_names, 'a list of action names (text)'),
    'chunk_length': Setting(_optional_int(1), 'null (the checkpoint\'s n_action_steps) or an integer >= 1'),
    'rename_map': Setting(_mapping(_non_empty_text), 'a mapping robot feature key -> checkpoint feature key'),
    'features': Setting(_mapping(_name_list), 'a mapping feature key -> a list of joint names'),
    'pad_cameras': Setting(_names, 'a list of checkpoint camera names'),
    'robot_type': Setting(_text, 'text'),
    'hub_cache': Setting(_text, 'a directory path (text), or \'\' for the default cache'),
    'hub_snapshots': Setting(_mapping(_non_empty_text), 'a mapping repo id -> a local snapshot directory'),
    'noise_seed': Setting(_optional_int(0, MAX_NOISE_SEED), f'null or an integer 0 .. {MAX_NOISE_SEED}'),
    'rtc_execution_horizon': Setting(_optional_int(1), 'null or an integer 1 .. the checkpoint\'s chunk_size '
                                                       '(RTC checkpoints only)'),
}


def check(config: dict[str, Any]) -> dict[str, Any]:
    """Return ``config`` with each known key checked and normalised (names flattened, numbers typed).

    Unknown keys are left as they are (the constructor refuses them by name).

    :raises ConfigError: naming the first key whose value is outside what :data:`SETTINGS` allows.
    """
    out = dict(config)
    for key, value in config.items():
        setting = SETTINGS.get(key)
        if setting is None:
            continue
        checked = setting.check(value)
        if checked is _BAD:
            shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:80] + '...'
            raise ConfigError(f'config.yaml {key}: {shown} is not {setting.allowed}')
        out[key] = checked
    return out


__all__ = ['MAX_NOISE_SEED', 'SETTINGS', 'Setting', 'check']
