"""EpisodeSettings: the one definition of how an episode is driven.

act(), run(), begin_episode() (their keyword arguments are the seed API and stay as they are), the chunk
engine, the node's runner and the node's ``~/act`` goal all build or take one :class:`EpisodeSettings`;
the options and their checks are written here once.
"""

from __future__ import annotations

import dataclasses
import numbers

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
    if not (value > 0 and value != float('inf')):     # NaN fails the first test
        raise ValueError(f'{name} must be a positive finite number, got {value!r}')


#: Bounds of a caller's control period (s): 10 kHz down to one command a minute.
MIN_CONTROL_PERIOD_S = 1e-4
MAX_CONTROL_PERIOD_S = 60.0


@dataclasses.dataclass(frozen=True)
class EpisodeSettings:
    """How one episode is driven (validated on construction).

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
    :raises TypeError: for a bool or a non-number as a limit, period or chunk_timeout, a non-str
        instruction, a non-bool prefetch, a non-int smooth_seam, or an action space that is neither an
        ActionSpace nor a name.
    :raises ValueError: for a non-finite or non-positive limit, period or chunk_timeout, a fractional
        max_actions, a control_period outside [1e-4, 60] s, a negative smooth_seam, or an unknown action
        space.
    """

    instruction: str = ''
    max_seconds: float | None = None
    max_actions: float | None = None
    prefetch: bool = True
    smooth_seam: int = 0
    expect_action_space: ActionSpace | None = None
    control_period: float | None = None
    chunk_timeout: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.instruction, str):
            raise TypeError(f'instruction must be a str, got {type(self.instruction).__name__}')
        for name in ('max_seconds', 'max_actions', 'control_period', 'chunk_timeout'):
            check_positive(name, getattr(self, name))
        if self.max_actions is not None:
            if float(self.max_actions) != int(self.max_actions):
                raise ValueError(f'max_actions must be a whole number of chunk steps, got {self.max_actions!r}')
            object.__setattr__(self, 'max_actions', int(self.max_actions))
        if self.control_period is not None and not (MIN_CONTROL_PERIOD_S <= self.control_period
                                                    <= MAX_CONTROL_PERIOD_S):
            raise ValueError(f'control_period must lie in [{MIN_CONTROL_PERIOD_S:g}, {MAX_CONTROL_PERIOD_S:g}] s '
                             f'(10 kHz .. one command a minute), got {self.control_period!r}')
        if isinstance(self.smooth_seam, bool) or not isinstance(self.smooth_seam, numbers.Integral):
            raise TypeError(f'smooth_seam must be an int (rows), got {type(self.smooth_seam).__name__} '
                            f'{self.smooth_seam!r}')
        if self.smooth_seam < 0:
            raise ValueError(f'smooth_seam must be >= 0, got {self.smooth_seam}')
        object.__setattr__(self, 'smooth_seam', int(self.smooth_seam))
        if not isinstance(self.prefetch, bool):
            raise TypeError(f'prefetch must be True or False, got {type(self.prefetch).__name__} {self.prefetch!r}')
        if self.expect_action_space is not None and not isinstance(self.expect_action_space, ActionSpace):
            if not isinstance(self.expect_action_space, str):
                raise TypeError('expect_action_space must be an ActionSpace or its name, got '
                                f'{type(self.expect_action_space).__name__} {self.expect_action_space!r}')
            object.__setattr__(self, 'expect_action_space', ActionSpace.parse(self.expect_action_space))


__all__ = ['MAX_CONTROL_PERIOD_S', 'MIN_CONTROL_PERIOD_S', 'EpisodeSettings', 'check_positive']
