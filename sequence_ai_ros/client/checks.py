"""Checks at the client's edge: the caller's arguments and the observations its ``observe()`` returns.

Arguments (limits, periods) are checked before anything talks to the worker: a bool or a non-number is
a TypeError, a non-finite or non-positive number a ValueError.

Observations. Every problem with one is a :class:`~sequence_ai_ros.exceptions.ContractViolation`,
whatever raised it first (numpy's TypeError/ValueError for a non-numeric state, ``None`` instead of an
Observation, a 2-d or NaN state, empty names, a state whose size or names differ from the contract).
act()/run() turn it into reason ``validate`` after firing hold; next_action() raises it.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from typing import Any

from sequence_ai_ros.exceptions import ContractViolation
from sequence_ai_ros.protocol.contract import Contract
from sequence_ai_ros.protocol.messages import check_state
from sequence_ai_ros.protocol.types import Observation


def positive(name: str, value: Any, *, required: bool = False) -> None:
    """Check an optional limit or period: None (unless ``required``) or a finite real number > 0.

    :param name: the argument's name, for the message.
    :param value: the value (s, chunk steps...).
    :raises TypeError: for a bool, a non-number, or None when ``required``.
    :raises ValueError: for a non-finite number or one <= 0.
    """
    if value is None and not required:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f'{name} must be a number, got {type(value).__name__} {value!r}')
    if not (value > 0 and value != float('inf')):     # NaN fails the first test
        raise ValueError(f'{name} must be a positive finite number, got {value!r}')


def observation(value: Observation | Mapping[str, Any], contract: Contract) -> Observation:
    """Return ``value`` as an Observation that fits the contract's state.

    :param value: what ``observe()`` returned: an Observation or a dict of its fields.
    :param contract: the policy's contract; its ``observation.state_names`` (when given) fix the state's
        size (D,) and, when the observation names its values, their names and order.
    :raises ContractViolation: for anything else (None, a non-mapping, unknown keys, a state that is not
        a finite float32 (D,) vector, empty names, a size or names that differ from the contract).
    """
    try:
        obs = Observation.coerce(value)
    except ContractViolation:
        raise
    except (TypeError, ValueError, AttributeError) as exc:
        raise ContractViolation(f'bad observation: {type(exc).__name__}: {exc}') from exc
    check_state(obs, contract)
    return obs


__all__ = ['observation', 'positive']
