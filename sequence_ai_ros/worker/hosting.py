"""Where a deployment's policy code runs, as :class:`~sequence_ai_ros.worker.runtime.DeploymentRuntime` sees it.

:class:`PolicyHost` is the one interface the runtime calls on a loaded policy. Two implementations:

- :class:`InProcessHost` (``--isolation none``): the policy object constructed in the worker; every call goes
  straight to it, on the caller's thread (the deployment's inference thread, or its loader thread).
- :class:`~sequence_ai_ros.worker.policy_process.RemotePolicy` (``--isolation process``): the policy lives in
  its deployment process; every call is a round trip, inferences may be started from the worker's event
  loop, several in flight at once (:attr:`PolicyHost.starts_on_loop`, :attr:`PolicyHost.pipeline_depth`), and
  the process can die (:meth:`PolicyHost.exit_reason`), be
  killed and be closed.

:func:`~sequence_ai_ros.worker.policy_process.open_host` constructs the one a definition asks for. This module
imports no other module of the worker, so both sides may name the interface.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Protocol

from sequence_ai_ros.policy.api import Episode
from sequence_ai_ros.protocol.messages import PolicyInput

#: ``done(status, value)`` of an inference started from the event loop: ``('ok', out)``, ``('err', 'Type:
#: message')``, ``('contract', message)``, ``('dropped', None)`` (cancelled before it started), or ``(None,
#: PolicyProcessDied)`` when the deployment process died.
Done = Callable[[str | None, Any], None]


class PolicyHost(Protocol):
    """A constructed policy, wherever its code runs: what the runtime calls on it.

    Calls come one at a time (the runtime's inference thread, or its loader thread before the policy serves),
    except inferences started from the event loop (:meth:`start_infer`): up to :attr:`pipeline_depth` of those
    may be in flight at once, and the host runs them one at a time, in the order started.
    """

    #: True when :meth:`start_infer` can send an inference from the worker's event loop
    starts_on_loop: bool
    #: most inferences :meth:`start_infer` may have in flight at once
    pipeline_depth: int

    def load(self) -> None:
        """Run the policy's ``load()`` (the weights); exceptions propagate (the load failed)."""
        ...

    def infer(self, inp: PolicyInput, episode: Episode) -> Any:
        """The policy's ``infer``: an action chunk ``(T, action_dim)`` or a ``Result``; exceptions propagate.

        :raises PolicyProcessDied: when the deployment process died meanwhile (the runtime restarts it).
        """
        ...

    def infer_batch(self, inputs: list[PolicyInput], episodes: list[Episode]) -> list[Any]:
        """The policy's ``infer_batch``: one chunk (or ``Result``, or a request's own exception) per input."""
        ...

    def start_infer(self, loop: asyncio.AbstractEventLoop, inp: PolicyInput, episode: Episode,
                    done: Done) -> Callable[[], bool] | None:
        """Send :meth:`infer` from ``loop``'s thread without waiting; ``loop`` hands the answer to ``done``.

        ``done`` may also get ``('dropped', None)``: the inference was cancelled before its turn and never started.

        :return: its cancel (any thread; True when it was not answered yet: the host then drops it unless it
            has started); None, having sent nothing, when it cannot (always with :attr:`starts_on_loop`
            False): the inference thread then calls :meth:`infer`.
        """
        ...

    def episode_hook(self, name: str) -> Callable[[Episode], None]:
        """The ``@seq.on_episode`` method called ``name``, bound to the policy (it runs at an episode's end)."""
        ...

    def forget(self, episode_id: str) -> None:
        """The episode ended: the policy's side may drop what it keeps of it (any thread; never blocks)."""
        ...

    def exit_reason(self) -> str | None:
        """None while the policy can answer; else how its process ended (``'exit code 7'``, ``'signal SIGSEGV'``)."""
        ...

    def kill(self, why: str = '') -> None:
        """Stop the policy now (a stuck or failed one), where it can be stopped; never blocks."""
        ...

    def close(self, timeout: float = 2.0) -> None:
        """Let go of the policy (its process exits within ``timeout`` s, or is killed)."""
        ...


class InProcessHost:
    """A policy constructed in the worker's own process (``--isolation none``): calls go straight to it.

    A thread cannot be killed, so :meth:`kill` and :meth:`close` do nothing: a policy stuck in ``infer``
    leaves its deployment failed (the runtime marks it so), and the process lives on.

    :param policy: the constructed policy object (``definition.instantiate()``).
    """

    starts_on_loop = False
    pipeline_depth = 1

    def __init__(self, policy: Any) -> None:
        #: the policy object itself
        self.policy = policy

    def load(self) -> None:
        """Call the policy's ``load()`` when it has one."""
        load = getattr(self.policy, 'load', None)
        if callable(load):
            load()

    def infer(self, inp: PolicyInput, episode: Episode) -> Any:
        """The policy's ``infer``."""
        return self.policy.infer(inp, episode)

    def infer_batch(self, inputs: list[PolicyInput], episodes: list[Episode]) -> list[Any]:
        """The policy's ``infer_batch``."""
        return list(self.policy.infer_batch(inputs, episodes))

    def start_infer(self, loop: asyncio.AbstractEventLoop, inp: PolicyInput, episode: Episode,
                    done: Done) -> Callable[[], bool] | None:
        """Never: an in-process inference runs on the deployment's inference thread."""
        return None

    def episode_hook(self, name: str) -> Callable[[Episode], None]:
        """The policy's method ``name``."""
        hook: Callable[[Episode], None] = getattr(self.policy, name)
        return hook

    def forget(self, episode_id: str) -> None:
        """Nothing: an episode's state lives in its :class:`~sequence_ai_ros.policy.api.Episode`, which ends with it."""

    def exit_reason(self) -> str | None:
        """None: the policy lives as long as the worker."""
        return None

    def kill(self, why: str = '') -> None:
        """Nothing: a thread cannot be stopped from outside."""

    def close(self, timeout: float = 2.0) -> None:
        """Nothing: the object goes with its last reference."""
