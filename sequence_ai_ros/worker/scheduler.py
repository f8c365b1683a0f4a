"""Serialized inference with per-episode fairness: one thread per deployment, round-robin over episodes.

Inference for one model is **serialized** (not batched): every call into the policy object (infer and
the ``@seq.on_episode`` hook) runs on the deployment's single thread ``seq-infer-<name>``, so a policy
never sees concurrent calls. Fairness: each episode may have at most one pending request, and pending
requests are served in arrival order, which with one request per episode is round-robin across robots.
A robot that is slow to send never holds the thread; a slow *policy* delays every robot equally.
Control jobs (episode-end hooks) go first. The queue is bounded: past ``max_pending`` episodes,
:class:`~sequence_ai_ros.exceptions.Overloaded` is raised immediately instead of queueing.

Deadline: a Python thread cannot be killed, so a policy call that never returns would hold the thread
forever. :meth:`InferenceScheduler.expire` (called by the waiting streams) detects a job that has run longer
than its deadline; the scheduler is then *wedged*: the running job and every queued one fail at once with
:class:`~sequence_ai_ros.exceptions.PolicyException`, later submissions fail the same way, and control jobs
stay queued (they run if the policy ever returns) while their waiters are answered at once.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from sequence_ai_ros.exceptions import EpisodeStateError, Overloaded, PolicyException

LOG = logging.getLogger(__name__)


class _Job:
    __slots__ = ('key', 'fn', 'future', 'submitted', 'queue_wait_s', 'started')

    def __init__(self, key: str | None, fn: Callable[[], Any]) -> None:
        self.key = key
        self.fn = fn
        self.future: Future = Future()
        self.submitted = time.monotonic()
        self.queue_wait_s = 0.0
        self.started: float | None = None


class InferenceScheduler:
    """The single inference thread of one deployment.

    :param name: deployment name (the thread is ``seq-infer-<name>``).
    :param max_pending: most episodes that may wait at once; more raise Overloaded.
    """

    def __init__(self, name: str, max_pending: int = 64) -> None:
        self.name = name
        self.max_pending = max_pending
        self._lock = threading.Condition()
        self._jobs: collections.deque[_Job] = collections.deque()
        self._control: collections.deque[_Job] = collections.deque()
        self._pending_keys: set[str] = set()
        self._current: _Job | None = None
        self._wedged: PolicyException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f'seq-infer-{name}', daemon=True)
        self._thread.start()

    @property
    def running(self) -> bool:
        """True until :meth:`stop`."""
        return not self._stop.is_set()

    def submit(self, key: str, fn: Callable[[], Any]) -> Future:
        """Queue ``fn`` for episode ``key``; the future's result is ``(fn(), queue_wait_s)``.

        :raises EpisodeStateError: when ``key`` already has a pending request (one at a time per episode).
        :raises Overloaded: when ``max_pending`` episodes are already waiting, or the scheduler stopped.
        """
        job = _Job(key, fn)
        with self._lock:
            if self._wedged is not None:
                raise PolicyException(str(self._wedged))
            if self._stop.is_set():
                raise Overloaded(f'deployment {self.name!r} is shutting down')
            if key in self._pending_keys:
                raise EpisodeStateError(f'episode {key!r} already has a request in flight; wait for its chunk')
            if len(self._jobs) >= self.max_pending:
                raise Overloaded(f'deployment {self.name!r}: {len(self._jobs)} requests already queued '
                                 f'(max {self.max_pending}); retry later')
            self._pending_keys.add(key)
            self._jobs.append(job)
            self._lock.notify()
        return job.future

    def control(self, fn: Callable[[], Any]) -> Future:
        """Run ``fn`` on the inference thread before any queued request (used for episode-end hooks).

        After :meth:`stop` it runs inline in the caller's thread, so a hook is never lost.
        """
        job = _Job(None, fn)
        with self._lock:
            if not self._stop.is_set():
                self._control.append(job)
                self._lock.notify()
                if self._wedged is not None:  # runs if the policy ever returns; nobody waits for it
                    job.future.set_exception(PolicyException(f'{self._wedged}; the hook is deferred'))
                return job.future
            if self._wedged is not None:  # never call into a policy that may still be running
                job.future.set_exception(PolicyException(f'{self._wedged}; the hook did not run'))
                return job.future
        self._execute(job)
        return job.future

    @property
    def wedged(self) -> PolicyException | None:
        """The error that wedged the scheduler (a call past its deadline), or None."""
        return self._wedged

    def expire(self, deadline_s: float) -> PolicyException | None:
        """Wedge the scheduler when the running job has run for more than ``deadline_s`` (s).

        Fails the running job and every queued request with ``PolicyException('inference exceeded N s')``.

        :return: the error when the scheduler is (now or already) wedged, else None.
        """
        with self._lock:
            if self._wedged is not None:
                return self._wedged
            job = self._current
            if job is None or job.started is None or time.monotonic() - job.started <= deadline_s:
                return None
            self._wedged = PolicyException(f'deployment {self.name!r}: inference exceeded {deadline_s:g} s; '
                                           'the policy is stuck and the deployment is marked failed '
                                           '(restart the worker)')
            stuck = [job, *self._jobs]
            deferred = list(self._control)  # stay queued: they run if the policy ever returns
            self._jobs.clear()
            self._pending_keys.clear()
        for j in stuck:
            _settle(j.future, exception=self._wedged)
        for j in deferred:
            _settle(j.future, exception=PolicyException(f'{self._wedged}; the hook is deferred'))
        LOG.error('%s', self._wedged)
        return self._wedged

    def _execute(self, job: _Job) -> None:
        job.queue_wait_s = time.monotonic() - job.submitted
        job.started = time.monotonic()
        try:
            result = job.fn()
        except BaseException as exc:  # handed to the waiting stream, which types it
            _settle(job.future, exception=exc)
        else:
            _settle(job.future, result=(result, job.queue_wait_s))

    def _run(self) -> None:
        while True:
            with self._lock:
                while not (self._jobs or self._control or self._stop.is_set()):
                    self._lock.wait()
                if self._control:
                    job = self._control.popleft()
                elif self._jobs:
                    job = self._jobs.popleft()
                else:
                    return
                self._current = job
            self._execute(job)
            with self._lock:
                self._current = None
                if job.key is not None:
                    self._pending_keys.discard(job.key)

    def stop(self, timeout: float = 5.0) -> None:
        """Finish queued work, then stop the thread (timed join); later control jobs run inline."""
        with self._lock:
            self._stop.set()
            self._lock.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)
            if self._thread.is_alive():
                LOG.warning('inference thread of %s still busy after %.1f s', self.name, timeout)


def _settle(future: Future, *, result: Any = None, exception: BaseException | None = None) -> None:
    """Set a future's outcome unless it is already set (a job failed by :meth:`InferenceScheduler.expire`)."""
    if future.done():
        return
    try:
        if exception is not None:
            future.set_exception(exception)
        else:
            future.set_result(result)
    except concurrent.futures.InvalidStateError:  # settled concurrently by expire()
        pass
