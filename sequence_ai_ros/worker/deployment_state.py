"""The small parts of a served deployment's state, which its runtime composes.

:class:`~sequence_ai_ros.worker.runtime.DeploymentRuntime` holds its readiness, its restart budget, the load
plan a rollout sets, its running episodes and the counts of what episode ends cut short in these.

Nothing here calls a policy. :class:`Readiness` and :class:`RestartBudget` are not locked themselves: the
runtime reads and changes them under its own lock, together with the policy host they describe.
:class:`EpisodeTable` and :class:`EndCounts` lock themselves (any thread).
"""

from __future__ import annotations

import threading
from typing import Generic, TypeVar

#: A deployment process that dies more than this many times within :data:`RESTART_WINDOW_S` stays failed.
MAX_RESTARTS = 5
RESTART_WINDOW_S = 60.0


class Readiness:
    """Whether the deployment serves: ``cold | warming | ready | failed``, with the message and the load's ETA.

    Guarded by its runtime's lock (see the module's docstring); :attr:`event` is set while it is ready.

    :param eta_hint_s: the expected load time (s); each completed load replaces it with its own.
    """

    def __init__(self, eta_hint_s: float) -> None:
        self.state = 'cold'
        #: why it is warming again or failed ('' otherwise)
        self.message = ''
        #: what the last load (construct, ``load()``, dry run) raised; None while it has not failed, and when it
        #: failed by passing its deadline
        self.load_error: BaseException | None = None
        #: set while the policy is ready (cleared at a restart)
        self.event = threading.Event()
        self._since = 0.0
        self._eta_hint = eta_hint_s

    def warming(self, now: float, message: str = '') -> None:
        """A load starts at ``now`` (``time.monotonic()``); ``message`` says why when it is a restart."""
        self.state, self.message, self._since = 'warming', message, now

    def ready(self, load_s: float) -> None:
        """The load ended well after ``load_s`` s: the next load's ETA starts from it."""
        self.state, self.message = 'ready', ''
        self._eta_hint = load_s
        self.event.set()

    def fail(self, message: str, error: BaseException | None = None) -> bool:
        """Turn failed with ``message`` (``error``: what the load raised); False when it already was."""
        if self.state == 'failed':
            return False
        self.state, self.message = 'failed', message
        if error is not None:
            self.load_error = error
        return True

    def elapsed(self, now: float) -> float:
        """Seconds the running load has taken (0 unless warming)."""
        return now - self._since if self.state == 'warming' else 0.0

    def eta(self, state: str, elapsed: float) -> float:
        """Seconds until ready, estimated for ``state`` after ``elapsed`` s of load (0 when ready or failed)."""
        if state == 'cold':
            return self._eta_hint
        if state == 'warming':
            return max(0.1, self._eta_hint - elapsed)
        return 0.0

    @property
    def eta_hint_s(self) -> float:
        """The expected load time (s): the last completed load's, or the hint given."""
        return self._eta_hint


class RestartBudget:
    """A deployment process's restarts: how many so far, and whether one more fits the budget.

    At most ``limit`` deaths within ``window_s`` s are restarted; the next one leaves the deployment failed.
    Guarded by its runtime's lock.
    """

    def __init__(self, limit: int = MAX_RESTARTS, window_s: float = RESTART_WINDOW_S) -> None:
        self.limit = limit
        self.window_s = window_s
        #: restarts made so far
        self.count = 0
        self._deaths: list[float] = []

    def spend(self, now: float) -> bool:
        """The process died at ``now`` (``time.monotonic()``): True, counting a restart, when one more fits."""
        self._deaths = [t for t in self._deaths if now - t < self.window_s] + [now]
        if len(self._deaths) > self.limit:
            return False
        self.count += 1
        return True


class LoadPlan:
    """How the next load goes, as a rollout sets it: whether it may start yet, and whether it ends with a dry run.

    While held (:meth:`hold`, not yet :meth:`release`), a cold deployment stays cold (robots get NOT_READY): a
    rollout holds a new version so while the old one unloads.
    """

    def __init__(self) -> None:
        self._gate: threading.Event | None = None
        #: run one dry inference after load, before the policy is ready (a rollout's new version serves robots
        #: only once an inference on the synthetic observation of ``seq deploy`` passed)
        self.dry_run = False

    def hold(self) -> None:
        """Keep the load from starting until :meth:`release`."""
        self._gate = threading.Event()

    def release(self) -> None:
        """Let a held load start (the next ``ensure_loading`` starts it)."""
        if self._gate is not None:
            self._gate.set()

    @property
    def may_start(self) -> bool:
        """True unless held."""
        return self._gate is None or self._gate.is_set()


E = TypeVar('E')


class EpisodeTable(Generic[E]):
    """The episodes running on a deployment, by episode id (any thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running: dict[str, E] = {}

    def __contains__(self, episode_id: object) -> bool:
        with self._lock:
            return episode_id in self._running

    def add(self, episode_id: str, episode: E) -> bool:
        """Register ``episode``; False (nothing changed) when one with this id is already running."""
        with self._lock:
            if episode_id in self._running:
                return False
            self._running[episode_id] = episode
            return True

    def remove(self, episode_id: str) -> None:
        """Drop an ended episode (no error when it is not there)."""
        with self._lock:
            self._running.pop(episode_id, None)

    def all(self) -> list[E]:
        """The running episodes."""
        with self._lock:
            return list(self._running.values())


class EndCounts:
    """What episode ends cut short on the stream's side: requests dropped unread, results discarded (any thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._unread_dropped = 0
        self._discarded = 0

    def add(self, dropped: int = 0, discarded: int = 0) -> None:
        """Count ``dropped`` requests never read and ``discarded`` results."""
        with self._lock:
            self._unread_dropped += dropped
            self._discarded += discarded

    def totals(self) -> tuple[int, int]:
        """``(requests dropped unread, results discarded)`` so far."""
        with self._lock:
            return self._unread_dropped, self._discarded
