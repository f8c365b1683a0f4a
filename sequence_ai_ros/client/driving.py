"""The paced loop of act() and run(): observe, tick, act, pace; hold and end on every way out.

The loop of :meth:`Policy.act`/:meth:`Policy.run`, kept apart from the handle, which hands it a
:class:`Drivable` for the call. It runs on the caller's control thread; it waits for a warming deployment
(cut short by an interrupt), then only in the pacer (absolute deadlines), which a chunk arriving while
nothing plays, an interrupt or the episode's end wakes early. An interrupt from the call until it returns
stops it (:mod:`~sequence_ai_ros.client.stopping`).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol

from sequence_ai_ros.client import checks
from sequence_ai_ros.client.adapter import ObservationAdapter
from sequence_ai_ros.client.outcome import RunOutcome
from sequence_ai_ros.client.pacing import Pacer
from sequence_ai_ros.client.settings import EpisodeSettings
from sequence_ai_ros.exceptions import ContractViolation, EpisodeStateError
from sequence_ai_ros.protocol.contract import Contract
from sequence_ai_ros.protocol.types import Action, Observation

if TYPE_CHECKING:
    from sequence_ai_ros.client.engine import EpisodeEngine

LOG = logging.getLogger('sequence_ai_ros.client.policy')
#: act()/run()'s ``observe``: returns the current Observation (or a dict that converts to one).
ObserveFn = Callable[[], Observation | Mapping[str, Any]]
#: act()/run()'s ``act``: executes one Action.
ActFn = Callable[[Action], Any]


class Drivable(Protocol):
    """What :func:`drive` needs of the handle whose act()/run() call it runs.

    :class:`~sequence_ai_ros.client.policy.Policy` hands drive() one for the call: its internals for this
    loop, not its public API. Everything runs on the caller's control thread, except that any thread sets
    ``wake``.
    """

    @property
    def contract(self) -> Contract:
        """The deployment's contract: the observation check, the chunk's dt (the default control period)."""
        ...

    @property
    def adapter(self) -> ObservationAdapter:
        """Fits the caller's observations to the contract (image sizes, frames)."""
        ...

    @property
    def wake(self) -> threading.Event:
        """Ends a pacer wait early: set when a chunk arrives while nothing plays, on an interrupt, at the end.

        drive() clears it once it acted on the new chunk.
        """
        ...

    def call(self) -> AbstractContextManager[object]:
        """The call under way, entered for all of it: one control thread per handle.

        An interrupt from its entry on stops the call (:mod:`~sequence_ai_ros.client.stopping`).

        :raises RuntimeError: on entry, when another thread is inside act/run/next_action on the handle.
        """
        ...

    def wait_ready(self, episode_id: str | None) -> None:
        """Wait out a warming deployment before the episode (bounded by ``ready_timeout``).

        Returns at once when an interrupt is kept (the episode then opens already ended).

        :raises NotReady: when the load failed, or it is not ready within the bound.
        :raises Draining: when the replica answering stays draining.
        :raises ConnectionLost: when the worker is unreachable.
        """
        ...

    def open(self, settings: EpisodeSettings, episode_id: str | None) -> EpisodeEngine:
        """Open the call's episode on a fixed step (one chunk step per tick) and return its engine.

        :raises EpisodeStateError: when an episode still runs on the handle, or the handle is closed.
        """
        ...

    def tick(self, obs: Observation, now: float, grid_index: int) -> Action | None:
        """One control tick at ``now`` (``time.monotonic()``, s) serving deadline ``grid_index``.

        :returns: the action to command (None, or ``hold``: nothing new). The tick's record opens; :meth:`commit`
            commits it.
        """
        ...

    def commit(self) -> None:
        """Commit this tick's record as it stands (the caller's act() returned: what it got was executed)."""
        ...

    def skip_to(self, grid_index: int) -> None:
        """Count the deadlines after the last committed tick and before ``grid_index`` as skipped."""
        ...

    def end(self, reason: str) -> RunOutcome | None:
        """End the episode (a finished one keeps its reason) and return its outcome; None when none opened."""
        ...


def drive(policy: Drivable, observe: ObserveFn, act: ActFn, settings: EpisodeSettings, *, pin: bool,
          until: Callable[[], bool] | None, on_underrun: Callable[[], Any] | None,
          episode_id: str | None) -> RunOutcome:
    """Run one act()/run() episode on ``policy``; the failure rules are :meth:`Policy.act`'s."""
    instruction = settings.instruction
    with policy.call():           # an interrupt from here on stops this call
        # warming waited out before the episode (its replica); an interrupt cuts the wait short, and the
        # episode then opens already ended: 'interrupted', 0 actions
        policy.wait_ready(episode_id)
        period = policy.contract.dt if settings.control_period is None else settings.control_period
        engine = policy.open(dataclasses.replace(settings, control_period=period), episode_id)
        holding = False              # set before on_underrun is called, so a raising hold is not repeated
        end_reason = 'interrupted'
        stop_at = None if settings.max_seconds is None else time.monotonic() + settings.max_seconds
        grid = 0                     # the deadline this tick serves, counted from the first (missed ones included)
        try:
            # one grid from the episode's start: every control period up to its end is served or skipped
            pacer = Pacer(period, wake=policy.wake, start_s=engine.started_s)
            while True:
                if until is not None and engine.outcome() is None and until():
                    engine.finish('until')
                out = engine.check(time.monotonic())
                if out is not None:
                    break
                raw = observe()
                try:
                    obs = checks.observation(raw, policy.contract, policy.adapter)
                except ContractViolation as exc:
                    engine.finish('validate', exc)
                    break
                if pin and obs.instruction != instruction:
                    obs = dataclasses.replace(obs, instruction=instruction)   # the caller's object is untouched
                action = policy.tick(obs, time.monotonic(), grid)
                if engine.outcome() is not None:
                    break
                if action is None or action.hold:
                    if not holding and engine.dry:
                        holding = True
                        if on_underrun is not None:
                            on_underrun()
                else:
                    holding = False
                    act(action)
                policy.commit()     # the tick's record: what act() was given is what the robot executed
                missed = pacer.skipped
                pacer.wait(until=stop_at)
                grid += 1 + pacer.skipped - missed      # deadlines an overrun missed are skipped, never bunched
                if policy.wake.is_set() and engine.outcome() is None:
                    # A chunk arrived while nothing played (the first one, or after a dry spell): act on it
                    # at once, for the next deadline served early; the ones after it stay on the grid.
                    policy.wake.clear()
            # The periods between the last tick and the end that no tick served (the last act() overran).
            out = engine.outcome()
            if out is not None:
                policy.skip_to(pacer.index_at(engine.started_s + out.elapsed_s))
            # Hold first, then talk to the worker: the stop unwinds through on_underrun at once.
            if out is not None and out.reason in ('interrupted', 'validate', 'error') and not holding:
                holding = True
                if on_underrun is not None:
                    on_underrun()
        except BaseException as exc:
            # The caller's code (or ours) raised: hold the arm, flag the episode, never swallow the error.
            end_reason = 'error' if isinstance(exc, Exception) else 'interrupted'
            if not holding:
                holding = True
                if on_underrun is not None:
                    try:
                        on_underrun()
                    except Exception:
                        LOG.exception('episode %s: on_underrun() raised while holding after an error',
                                      engine.episode_id)
            raise
        finally:
            out = policy.end(end_reason)
        if out is None:      # end_episode() answers None only when no episode was ever opened
            raise EpisodeStateError('the episode act()/run() opened is gone')
        if out.reason == 'error' and out.error is not None:
            raise out.error
        return out
