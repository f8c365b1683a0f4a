"""A new version registered while serving (``seq deploy`` again): the worker switches to it, without a cut.

:class:`Rollouts` compares each served deployment's version with the registry's (checked when the registry
file changes: before a lookup and by housekeeping). For a new version, a ``seq-rollout-<name>`` thread:

1. imports it (the registry's checks: a file changed since its deploy is never served; under ``--isolation
   process`` in a deployment process, as at start), then loads it beside the running one and runs one dry
   inference on it (the synthetic observation of ``seq deploy``), all in the background, off the serving
   path: robots keep being served by the old version meanwhile;
2. once it is ready, new episodes get it (the served runtime is swapped); episodes already running finish on
   the old one, which is then unloaded (its inference thread stopped; under ``--isolation process`` its
   deployment process ends);
3. when it cannot load beside the old one, i.e. its load or dry run ran out of memory (:func:`out_of_memory`:
   two versions need twice the model's memory), the worker says so in its log and, with ``seq serve
   --rollout wait`` (the default), keeps serving the old version and switches when the old version's
   episodes have ended; with ``--rollout cut`` it switches at once and cuts the old version's live episodes
   with reason ``rollout`` (the robot gets the retryable NotReady, as for a drain cut). Either way the old
   version is unloaded before the new one loads: new episodes meanwhile get NOT_READY and wait, as at a
   cold start. A load that fails again then leaves the deployment failed (health NOT_SERVING), as a failed
   load at start does;
4. any other failure (the import, an exception in ``__init__``/``load()``, a dry run that raises, returns
   a chunk outside the contract or passes ``--load-timeout``) marks that version failed: the old version
   keeps serving, untouched, the worker logs an error naming the version and why, counts it
   (``seq_rollout_failures_total``), and does not try that version again; a newer ``seq deploy`` is tried.

A draining worker (SIGTERM: it stops once its episodes end) starts no rollout, and one in progress gives up
(the new version is closed): a drain's episodes are never cut for a rollout, nor a new version loaded by a
worker about to exit. Both versions share the deployment's usage meter and capture store.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from sequence_ai_ros.worker.config import ROLLOUT_MODES
from sequence_ai_ros.worker.policy_process import PolicyProcessDied, RemoteError
from sequence_ai_ros.worker.runtime import DeploymentRuntime, describe

LOG = logging.getLogger(__name__)
#: How often (s) a rollout checks whether the old version's episodes have ended.
POLL_S = 0.2
#: With ``--rollout cut``: how long (s) the cut episodes may take to end (their end hook, capture commit, the
#: inference still running when the cut came) before the old version is unloaded anyway (which ends what is
#: left with reason ``shutdown``).
CUT_WAIT_S = 10.0
#: Exception types that ran out of memory, matched by name so that the worker never imports torch: Python's
#: ``MemoryError`` and torch's ``OutOfMemoryError`` (``torch.OutOfMemoryError``, ``torch.cuda.OutOfMemoryError``).
OOM_TYPES = frozenset({'MemoryError', 'OutOfMemoryError'})
#: What an error that ran out of memory says, in lower case (torch's RuntimeErrors: CUDA's, its CPU allocator's).
OOM_WORDS = ('out of memory', "can't allocate memory")


def out_of_memory(exc: BaseException | None) -> bool:
    """True when a load failed for lack of memory: the new version cannot load beside the old one.

    ``exc``, or an exception it was raised from, is a ``MemoryError`` or an ``OutOfMemoryError`` of any module,
    or says it ran out of memory (:data:`OOM_WORDS`: torch's RuntimeErrors). Raised in a deployment process
    (``--isolation process``), it arrives as a :class:`~sequence_ai_ros.worker.policy_process.RemoteError`
    whose text is ``'Type: message'``, read the same way; a deployment process that died of SIGKILL while
    loading counts too (the kernel's out-of-memory killer; the worker's own kill at the load timeout reads
    "was stopped"). Anything else, and None (the load passed ``load_timeout_s``), is a failure of the version.
    """
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        text = str(exc)
        if isinstance(exc, PolicyProcessDied):
            if ' died while ' in text and text.endswith('signal SIGKILL'):
                return True
        else:
            names = ({text.partition(':')[0].strip().rsplit('.', 1)[-1]} if isinstance(exc, RemoteError)
                     else {cls.__name__ for cls in type(exc).__mro__})
            if names & OOM_TYPES or any(words in text.lower() for words in OOM_WORDS):
                return True
        exc = exc.__cause__ or exc.__context__
    return False


class Rollouts:
    """Switch served deployments to versions registered while serving.

    :param runtimes: the served deployments (name -> runtime), swapped in place.
    :param load: ``name -> (record, definition)``: the registry's validated import of its current version.
    :param make: ``(record, definition, old runtime) -> new runtime`` sharing the old one's usage and store.
    :param adopt: called with a runtime that starts to be served (state callbacks, metrics, health).
    :param stopping: set when the worker stops: rollouts give up.
    :param held: returns True while no rollout may start or go on (the worker drains before it stops): no new
        version is loaded, switched to, or cuts the episodes the drain lets finish.
    :param mode: ``wait`` or ``cut``: what to do when the new version cannot load beside the old one
        (see the module docstring; ``seq serve --rollout``).
    :param cut: ``(runtime, reason) -> n``: cut the live episode streams of ``runtime`` with ``reason``; the
        number cut (needed for ``mode='cut'``).
    :param failed: called with the deployment's name when one of its versions failed (metrics).
    :raises ValueError: for another mode, or ``cut`` mode without ``cut``.
    """

    def __init__(self, runtimes: dict[str, DeploymentRuntime], load: Callable[[str], tuple[Any, Any]],
                 make: Callable[[Any, Any, DeploymentRuntime], DeploymentRuntime],
                 adopt: Callable[[DeploymentRuntime], None], stopping: threading.Event, *, mode: str = 'wait',
                 cut: Callable[[DeploymentRuntime, str], int] | None = None,
                 held: Callable[[], bool] = lambda: False,
                 failed: Callable[[str], None] = lambda name: None) -> None:
        if mode not in ROLLOUT_MODES or (mode == 'cut' and cut is None):
            raise ValueError(f'rollout mode must be one of {ROLLOUT_MODES} (cut needs a cut callable), got {mode!r}')
        self._runtimes, self._load, self._make, self._adopt = runtimes, load, make, adopt
        self._stopping = stopping
        self._held_now = held
        self.mode = mode
        self._cut = cut
        self._on_failed = failed
        self._lock = threading.Lock()
        self._threads: dict[str, threading.Thread] = {}   # name -> its rollout thread, while it runs
        self._wanted: dict[str, int] = {}                 # name -> the version registered when last checked
        self._failed: dict[str, int] = {}                 # name -> its version that failed: not tried again
        #: name -> what its rollout does now: ``loading``, ``waiting`` (for the old version's episodes),
        #: ``cutting`` (the old version's episodes), ``switched``, ``failed``; for tests and logs
        self.state: dict[str, str] = {}
        #: (name, old version, new version) of each completed switch, in order
        self.switched: list[tuple[str, int, int]] = []
        #: (name, version) of each version unloaded after a switch, in order
        self.unloaded: list[tuple[str, int]] = []
        #: (name, version, episodes) of each cut of a version's live episodes (``mode='cut'``), in order
        self.cuts: list[tuple[str, int, int]] = []
        #: (name, version, why) of each version that failed (it is not tried again), in order
        self.failures: list[tuple[str, int, str]] = []
        self._held: set[DeploymentRuntime] = set()   # runtimes a rollout holds that are not (or no longer) served

    def check(self, versions: dict[str, int]) -> None:
        """Start a rollout for each served deployment whose registered version (``versions``) is another.

        A deployment already rolling out is not started twice: its rollout looks at the registered version
        again when it ends, and rolls out again when another one was registered meanwhile (``seq deploy``
        twice in a row: the second version is not left unserved). A version that failed is not tried again.
        """
        if self._giving_up():
            return
        for name, runtime in list(self._runtimes.items()):
            version = versions.get(name)
            if version is None:
                continue
            with self._lock:
                self._wanted[name] = version
                if version in (runtime.version, self._failed.get(name)) or name in self._threads:
                    continue
                thread = threading.Thread(target=self._rolls, args=(name,), name=f'seq-rollout-{name}', daemon=True)
                self._threads[name] = thread
            thread.start()

    def _rolls(self, name: str) -> None:
        """Roll ``name`` out until no other version was registered while its last rollout ran."""
        while True:
            with self._lock:
                target = self._wanted.get(name)
            try:
                self._roll(name)
            finally:
                with self._lock:
                    again = not self._giving_up() and self._wanted.get(name) not in (target, self._failed.get(name))
                    if not again:
                        self._threads.pop(name, None)
            if not again:
                return

    def _roll(self, name: str) -> None:
        old = self._runtimes.get(name)
        if old is None:
            return
        try:
            rec, definition = self._load(name)
        except Exception as exc:   # a file changed since its deploy, an import error: keep serving
            with self._lock:
                wanted = self._wanted.get(name, old.version)
            self._fail(name, wanted, old, f'it cannot be imported: {describe(exc)}')
            return
        if rec.version in (old.version, self._failed.get(name)):
            return
        LOG.info('deployment %s: version %d registered while serving version %d; loading it beside', name,
                 rec.version, old.version)
        self.state[name] = 'loading'
        new = self._new(rec, definition, old)
        new.ensure_loading()            # its load and dry run: in seq-load-<name>, beside the old version
        if self._ready(new):
            if self._switch(name, old, new):
                self._unload_when_idle(old)
            return
        if self._giving_up():   # the worker drains or stops: not a version that cannot load beside the old one
            new.close(timeout=1.0)
            self._held.discard(new)
            return
        why = new.readiness()[3]
        beside = out_of_memory(new.load_error)
        new.close(timeout=1.0)
        self._held.discard(new)
        if not beside:          # the version itself fails (an exception, a dry run that failed or hung)
            self._fail(name, rec.version, old, why)
            return
        new = self._new(rec, definition, old)
        new.load_plan.hold()     # it loads once the old version is unloaded
        if self.mode == 'cut':
            self.state[name] = 'cutting'
            LOG.warning('deployment %s: version %d cannot load beside version %d (%s); --rollout cut: switching at '
                        'once, cutting the %d running episodes of version %d', name, rec.version, old.version, why,
                        len(old.running_episodes()), old.version)
            if not self._switch(name, old, new, cutting=True):
                return
            assert self._cut is not None
            cut = self._cut(old, 'rollout')
            self.cuts.append((name, old.version, cut))
            # the cut episodes end at once; their end hooks run behind the inference still running: both first
            self._wait_idle(old, CUT_WAIT_S, work=True)
            self._unload(old)
        else:
            self.state[name] = 'waiting'
            LOG.warning('deployment %s: version %d cannot load beside version %d (%s); serving version %d and '
                        'switching when its episodes have ended', name, rec.version, old.version, why, old.version)
            if not self._wait_idle(old):
                new.close(timeout=1.0)
                self._held.discard(new)
                return
            if not self._switch(name, old, new):   # new episodes wait for it (NOT_READY) while it loads
                return
            self._unload_when_idle(old)            # any episode that started meanwhile ends first
        if self._giving_up():                      # the worker stops: it closes the served runtime
            return
        new.load_plan.release()
        new.ensure_loading()
        if not self._ready(new) and not self._giving_up() and self._runtimes.get(name) is new:
            self._fail(name, rec.version, None, new.readiness()[3])   # alone, it fails too: the deployment is failed

    def _fail(self, name: str, version: int, old: DeploymentRuntime | None, why: str) -> None:
        """Version ``version`` of ``name`` failed: log it, count it, never try it again; ``old`` serves on.

        :param old: the version that keeps serving, or None when none does (the new one was switched to and
            failed alone: the deployment is failed until a version that loads is deployed).
        """
        self.state[name] = 'failed'
        self._failed[name] = version
        self.failures.append((name, version, why))
        if old is not None:
            LOG.error('deployment %s: version %d failed; version %d keeps serving, and version %d is not tried again '
                      '(seq deploy a fixed version): %s', name, version, old.version, version, why)
        else:
            LOG.error('deployment %s: version %d failed to load once the old version was unloaded; the deployment is '
                      'failed until a version that loads is deployed: %s', name, version, why)
        self._on_failed(name)

    def held(self) -> list[DeploymentRuntime]:
        """The runtimes a rollout holds that are not served: a new version loading, an old one finishing."""
        return list(self._held)

    def running_episodes(self, name: str) -> int:
        """Episodes still running on the versions of ``name`` this rollout holds (an old version finishing its own).

        A deployment ``seq delete --force`` removed during a rollout keeps its metrics until these ended too.
        """
        return sum(len(r.running_episodes()) for r in list(self._held) if r.name == name)

    def _giving_up(self) -> bool:
        """True once the worker drains or stops: rollouts start nothing more."""
        return self._stopping.is_set() or self._held_now()

    def _new(self, rec: Any, definition: Any, old: DeploymentRuntime) -> DeploymentRuntime:
        """A cold runtime of the new version, held by the rollout, that passes a dry run before it is ready."""
        new = self._make(rec, definition, old)
        new.load_plan.dry_run = True
        self._held.add(new)
        return new

    def _ready(self, runtime: DeploymentRuntime) -> bool:
        deadline = time.monotonic() + runtime.load_timeout_s + 1.0
        while not self._giving_up() and time.monotonic() < deadline:
            state = runtime.readiness()[2]
            if state in ('ready', 'failed'):
                return state == 'ready'
            runtime.ready_event.wait(POLL_S)
        return False

    def _switch(self, name: str, old: DeploymentRuntime, new: DeploymentRuntime, cutting: bool = False) -> bool:
        """Serve ``new`` in place of ``old``; False (``new`` closed) when the deployment was deleted meanwhile.

        :param cutting: ``--rollout cut`` is about to cut ``old``'s running episodes (the log says so).
        """
        if self._runtimes.get(name) is not old or self._giving_up():
            new.close(timeout=1.0)
            self._held.discard(new)
            self.state[name] = 'failed'
            return False
        old.on_state_change = None       # its state no longer sets the deployment's health
        self._adopt(new)
        self._runtimes[name] = new
        self._held.discard(new)
        self._held.add(old)
        self.state[name] = 'switched'
        self.switched.append((name, old.version, new.version))
        then = ('its %d running episodes on version %d are cut (--rollout cut)' if cutting else
                '%d running episodes finish on version %d')
        LOG.info('deployment %s: new episodes get version %d; ' + then, name, new.version,
                 len(old.running_episodes()), old.version)
        return True

    def _wait_idle(self, runtime: DeploymentRuntime, timeout_s: float = float('inf'), work: bool = False) -> bool:
        """Wait until ``runtime`` runs no episode; False when the worker stops or ``timeout_s`` passes first.

        :param work: also until its policy has nothing to run (an inference, an ended episode's hook).
        """
        deadline = time.monotonic() + timeout_s
        while runtime.running_episodes() or (work and not runtime.scheduler.idle):
            if self._stopping.wait(POLL_S) or self._held_now() or time.monotonic() > deadline:
                return False
        return True

    def _unload_when_idle(self, old: DeploymentRuntime) -> None:
        if self._wait_idle(old):
            self._unload(old)

    def _unload(self, old: DeploymentRuntime) -> None:
        old.close()       # ends what still runs on it (shutdown); under --isolation process its process ends
        self._held.discard(old)
        self.unloaded.append((old.name, old.version))
        LOG.info('deployment %s: version %d unloaded', old.name, old.version)

    def close(self, timeout: float = 5.0) -> None:
        """After ``stopping`` is set: wait for the rollout threads, then close the runtimes they still held."""
        with self._lock:
            threads = list(self._threads.values())
        for thread in threads:
            thread.join(timeout)
        for runtime in list(self._held):
            runtime.close(timeout=1.0)
        self._held.clear()
