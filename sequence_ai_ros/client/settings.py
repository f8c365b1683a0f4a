"""EpisodeSettings: the one definition of how an episode is driven.

act(), run(), begin_episode() (their keyword arguments are the public API), the chunk
engine, the node's runner and the node's ``~/act`` goal all build or take one :class:`EpisodeSettings`;
the options and their checks are written here once.
"""

from __future__ import annotations

import dataclasses
import numbers
import sys
from collections.abc import Callable
from typing import Any

from sequence_ai_ros.client.latency import RTO_DEVIATIONS
from sequence_ai_ros.protocol.limits import MAX_TICK_S
from sequence_ai_ros.protocol.spaces import ActionSpace


def check_positive(name: str, value: object, *, required: bool = False) -> None:
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
    if value != value or value <= 0 or value == float('inf'):     # value != value: NaN
        raise ValueError(f'{name} must be a positive finite number, got {value!r}')


#: Bounds of a caller's control period (s): 10 kHz down to one command every 10 s, the longest tick a captured
#: record may span (the worker's :data:`~sequence_ai_ros.protocol.limits.MAX_TICK_S`).
MIN_CONTROL_PERIOD_S = 1e-4
MAX_CONTROL_PERIOD_S = MAX_TICK_S


def _text(name: str, value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(f'{name} must be a str, got {type(value).__name__}')
    return value


def _limit(name: str, value: Any) -> Any:
    check_positive(name, value)
    return value


def _steps(name: str, value: Any) -> int | None:
    check_positive(name, value)
    if value is None:
        return None
    if not isinstance(value, numbers.Integral) and float(value) != int(value):    # (an int may pass a float's range)
        raise ValueError(f'{name} must be a whole number of chunk steps, got {value!r}')
    return int(value)


def _period(name: str, value: Any) -> Any:
    check_positive(name, value)
    if value is not None and not (MIN_CONTROL_PERIOD_S <= value <= MAX_CONTROL_PERIOD_S):
        raise ValueError(f'{name} must lie in [{MIN_CONTROL_PERIOD_S:g}, {MAX_CONTROL_PERIOD_S:g}] s '
                         f'(10 kHz .. one command every {MAX_CONTROL_PERIOD_S:g} s), got {value!r}')
    return value


def _flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f'{name} must be True or False, got {type(value).__name__} {value!r}')
    return value


def _rows(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f'{name} must be an int (rows), got {type(value).__name__} {value!r}')
    if value < 0:
        raise ValueError(f'{name} must be >= 0, got {value}')
    return int(value)


def check_space(name: str, value: object) -> ActionSpace | None:
    """Return an optional action space as an :class:`ActionSpace`: None, an ActionSpace, or its name.

    :raises TypeError: for anything else.
    :raises ValueError: for an unknown name (the message starts with ``name``).
    """
    if value is None or isinstance(value, ActionSpace):
        return value
    if not isinstance(value, str):
        raise TypeError(f'{name} must be an ActionSpace or its name, got {type(value).__name__} {value!r}')
    try:
        return ActionSpace.parse(value)
    except ValueError as exc:
        raise ValueError(f'{name}: {exc}') from None


def _aggregate(name: str, value: Any) -> str | None:
    from sequence_ai_ros.protocol.contract import AGGREGATES

    if value is None:
        return None
    if value not in AGGREGATES:
        raise ValueError(f'{name} must be one of {", ".join(AGGREGATES)} (or None: as the contract declares), '
                         f'got {value!r}')
    return str(value)


#: Largest ``prefetch_margin`` (mean deviations), as the node's ``prefetch_margin`` parameter bounds it: far past
#: any useful margin (4 is the default), and below one whose lead overflows a float (``math.ceil(inf)`` raised in
#: the request path mid-episode at 1e308).
MAX_PREFETCH_MARGIN = 100.0


def _margin(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f'{name} must be a number (mean deviations), got {type(value).__name__} {value!r}')
    real: Any = value
    if not 0 <= real <= MAX_PREFETCH_MARGIN:      # written so that NaN fails; an int too large for a float too
        raise ValueError(f'{name} must be a number in [0, {MAX_PREFETCH_MARGIN:g}] (mean deviations), got {value!r}')
    return float(value) + 0.0                     # -0.0 as 0.0


def _coeff(name: str, value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f'{name} must be a number, got {type(value).__name__} {value!r}')
    real: Any = value
    if real != real or real in (float('inf'), float('-inf')) or abs(real) > sys.float_info.max:
        raise ValueError(f'{name} must be finite, got {value!r}')       # (the last: an int too large for a float)
    return float(value)


#: The check of each kind of option, by the name a field gives in its metadata (``check``): each takes
#: ``(option name, value)`` and returns the value normalised, or raises TypeError/ValueError naming the option.
CHECKS: dict[str, Callable[[str, Any], Any]] = {
    'text': _text, 'limit': _limit, 'steps': _steps, 'period': _period, 'flag': _flag, 'rows': _rows,
    'space': check_space, 'aggregate': _aggregate, 'coeff': _coeff, 'margin': _margin,
}


def _option(default: Any, check: str) -> Any:
    """A field checked (and normalised) by :data:`CHECKS` ``[check]`` in ``__post_init__``."""
    if check not in CHECKS:
        raise ValueError(f'unknown check {check!r}; one of {", ".join(CHECKS)}')
    return dataclasses.field(default=default, metadata={'check': check})


@dataclasses.dataclass(frozen=True)
class EpisodeSettings:
    """How one episode is driven (validated on construction: every field by its own check, none listed by hand).

    :param instruction: the task, pinned for the episode (act/run overwrite each observation's with it).
    :param max_seconds: end with 'timeout' after this many seconds (s), or None.
    :param max_actions: end with 'completed' after this many chunk steps, or None.
    :param prefetch: request the next chunk while the current one plays; False requests only when empty
        (the stall counts as an underrun).
    :param smooth_seam: rows cross-faded at each seam (absolute spaces, never the first chunk; a reported
        no-op for delta and velocity spaces).
    :param expect_action_space: the space the caller commands (an :class:`ActionSpace` or its name);
        chunks in another space end the episode with 'validate'.
    :param control_period: the caller's period (s), to resample chunks; None measures it from the ticks.
    :param chunk_timeout: the no-chunk deadline (s): a request unanswered this long ends the episode with
        'error' and a PolicyException; None: ``max(10 s, 10 * covers_seconds)``
        (:data:`~sequence_ai_ros.client.engine.CHUNK_TIMEOUT_MIN_S`, ``CHUNK_TIMEOUT_COVERS``).
    :param aggregate: how overlapping chunks combine for one step (absolute spaces): ``latest_only`` (the
        newest chunk replaces the others), ``weighted_average`` (ACT's temporal ensembling, a request at
        every tick), ``average``; None: as the contract declares (client/aggregate.py).
    :param temporal_ensemble_coeff: weighted_average's coefficient m (weights ``exp(-m * i)``, i = 0 the
        oldest prediction); None: the contract's, else ACT's 0.01.
    :param prefetch_margin: how far above the measured round trips the next request is timed, in mean
        deviations of the connection's last 32 round trips above their mean, never below their largest
        (client/latency.py): the trade-off between inferences and safety. 4 (the default, RFC 6298's
        retransmission timeout) covers a +-20 % link's upper end; 0 times requests to the largest measured
        round trip alone (fewest inferences; on a jittery link the next one exceeds it now and then, and the
        arm may run dry for a few ms). Also sizes ``expected_delay_actions``.
    :raises TypeError: for a bool or a non-number as a limit, period, chunk_timeout or prefetch_margin, a
        non-str instruction, a non-bool prefetch, a non-int smooth_seam, or an action space that is neither an
        ActionSpace nor a name.
    :raises ValueError: for a non-finite or non-positive limit, period or chunk_timeout, a fractional
        max_actions, a control_period outside [1e-4, 10] s, a negative smooth_seam, an unknown action
        space or aggregate, a non-finite temporal_ensemble_coeff (an int too large for a float included), or a
        prefetch_margin outside [0, 100] (:data:`MAX_PREFETCH_MARGIN`) or NaN.
    """

    instruction: str = _option('', 'text')
    max_seconds: float | None = _option(None, 'limit')
    max_actions: float | None = _option(None, 'steps')
    prefetch: bool = _option(True, 'flag')
    smooth_seam: int = _option(0, 'rows')
    expect_action_space: ActionSpace | None = _option(None, 'space')
    control_period: float | None = _option(None, 'period')
    chunk_timeout: float | None = _option(None, 'limit')
    aggregate: str | None = _option(None, 'aggregate')
    temporal_ensemble_coeff: float | None = _option(None, 'coeff')
    prefetch_margin: float = _option(RTO_DEVIATIONS, 'margin')

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            check = CHECKS[field.metadata['check']]
            object.__setattr__(self, field.name, check(field.name, getattr(self, field.name)))


__all__ = ['CHECKS', 'MAX_CONTROL_PERIOD_S', 'MAX_PREFETCH_MARGIN', 'MIN_CONTROL_PERIOD_S', 'EpisodeSettings',
           'check_positive', 'check_space']
