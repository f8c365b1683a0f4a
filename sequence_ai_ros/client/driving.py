"""The paced loop of act() and run(): observe, tick, act, pace; hold and end on every way out.

The loop of :meth:`Policy.act`/:meth:`Policy.run`, kept apart from the handle. It runs on the caller's
control thread; it waits for a warming deployment (cut short by an interrupt), then only in the pacer
(absolute deadlines), which a chunk arriving while nothing plays, an interrupt or the episode's end wakes
early. An interrupt from the call until it returns stops it (:mod:`~sequence_ai_ros.client.stopping`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from sequence_ai_ros.client import checks
from sequence_ai_ros.client.outcome import RunOutcome
from sequence_ai_ros.client.pacing import Pacer
from sequence_ai_ros.client.settings import EpisodeSettings
from sequence_ai_ros.exceptions import ContractViolation, EpisodeStateError

if TYPE_CHECKING:
    from sequence_ai_ros.client.policy import ActFn, ObserveFn, Policy

LOG = logging.getLogger('sequence_ai_ros.client.policy')


def drive(policy: Policy, observe: ObserveFn, act: ActFn, settings: EpisodeSettings, *, pin: bool,
          until: Callable[[], bool] | None, on_underrun: Callable[[], Any] | None,
          episode_id: str | None) -> RunOutcome:
    """Run one act()/run() episode on ``policy``; the failure rules are :meth:`Policy.act`'s."""
    instruction = settings.instruction
    with policy._guard, policy._stop.call():           # an interrupt from here on stops this call
        # warming waited out before the episode (its replica); an interrupt cuts the wait short, and the
        # episode then opens already ended: 'interrupted', 0 actions
        policy._wait_ready(None, episode_id, stoppable=True)
        period = policy.contract.dt if settings.control_period is None else settings.control_period
        engine = policy._open(dataclasses.replace(settings, control_period=period), episode_id, fixed_step=True).engine
        holding = False              # set before on_underrun is called, so a raising hold is not repeated
        end_reason = 'interrupted'
        stop_at = None if settings.max_seconds is None else time.monotonic() + settings.max_seconds
        grid = 0                     # the deadline this tick serves, counted from the first (missed ones included)
        try:
            # one grid from the episode's start: every control period up to its end is served or skipped
            pacer = Pacer(period, wake=policy._wake, start_s=engine.started_s)
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
                action = policy._tick(obs, time.monotonic(), grid)
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
                policy._commit()     # the tick's record: what act() was given is what the robot executed
                missed = pacer.skipped
                pacer.wait(until=stop_at)
                grid += 1 + pacer.skipped - missed      # deadlines an overrun missed are skipped, never bunched
                if policy._wake.is_set() and engine.outcome() is None:
                    # A chunk arrived while nothing played (the first one, or after a dry spell): act on it
                    # at once, for the next deadline served early; the ones after it stay on the grid.
                    policy._wake.clear()
            # The periods between the last tick and the end that no tick served (the last act() overran).
            out = engine.outcome()
            if out is not None:
                policy._skip_to(pacer.index_at(engine.started_s + out.elapsed_s))
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
            out = policy.end_episode(end_reason)
        if out is None:      # end_episode() answers None only when no episode was ever opened
            raise EpisodeStateError('the episode act()/run() opened is gone')
        if out.reason == 'error' and out.error is not None:
            raise out.error
        return out
