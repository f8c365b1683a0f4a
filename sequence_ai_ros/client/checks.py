"""Checks at the client's edge: the caller's arguments and the observations its ``observe()`` returns.

Arguments (limits, periods) are checked before anything talks to the worker: a bool or a non-number is
a TypeError, a non-finite or non-positive number a ValueError.

Observations. Every problem with one is a :class:`~sequence_ai_ros.exceptions.ContractViolation`,
whatever raised it first (numpy's TypeError/ValueError for a non-numeric state, ``None`` instead of an
Observation, a 2-d or NaN state, empty names, a state whose size or names differ from the contract).
act()/run() turn it into reason ``validate`` after firing hold; next_action() raises it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sequence_ai_ros.client.adapter import ObservationAdapter
from sequence_ai_ros.client.settings import check_positive
from sequence_ai_ros.exceptions import ContractViolation
from sequence_ai_ros.protocol.contract import Contract
from sequence_ai_ros.protocol.messages import check_state
from sequence_ai_ros.protocol.types import Observation

#: Check an optional limit or period (defined once, with EpisodeSettings).
positive = check_positive


def observation(value: Observation | Mapping[str, Any], contract: Contract,
                adapter: ObservationAdapter | None = None) -> Observation:
    """Return ``value`` as an Observation that fits the contract's state.

    :param value: what ``observe()`` returned: an Observation or a dict of its fields.
    :param contract: the policy's contract; its ``observation.state_names`` (when given) fix the state's
        size (D,) and, when the observation names its values, their names and order.
    :param adapter: maps a named state onto the contract's names first (subset, reorder), as the node does.
    :raises ContractViolation: for anything else (None, a non-mapping, unknown keys, a state that is not
        a finite float32 (D,) vector, empty names, a size or names that differ from the contract).
    """
    try:
        obs = Observation.coerce(value)
    except ContractViolation:
        raise
    except (TypeError, ValueError, AttributeError) as exc:
        raise ContractViolation(f'bad observation: {type(exc).__name__}: {exc}') from exc
    if adapter is not None:
        obs = adapter.state(obs)
    check_state(obs, contract)
    return obs


__all__ = ['observation', 'positive']
