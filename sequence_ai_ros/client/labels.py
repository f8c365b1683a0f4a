"""LabelResult: what the worker did with a label, as :meth:`Policy.label` reports it."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class LabelResult:
    """A label the worker stored (true in a condition: a label it did not store raises ``CaptureError``).

    :param episode_id: the episode labelled.
    :param matched: True when the worker that stored the label ran the episode (its store has seen the id).
        False when it did not: behind a balancer, an episode whose replica was stopped when you labelled it
        (the label is kept and joins its episode when the replicas' stores are exported or counted together),
        or an id that no episode has (a mistyped one), which an export then lists as a label matching no
        episode. The client logs a warning for it.
    :param message: the worker's answer, e.g. ``episode 'ab12' labelled success``.
    """

    episode_id: str
    matched: bool
    message: str = ''

    def __bool__(self) -> bool:
        return True
