"""Inference with per-episode fairness: one thread per deployment, round-robin over episodes, batched on request.

Every call into the policy object (infer, infer_batch and the ``@seq.on_episode`` hook) runs on the
deployment's single thread ``seq-infer-<name>``, or in its slot (a borrowed slot, below), so a policy never
sees concurrent calls. A policy without
:class:`~sequence_ai_ros.policy.api.Batching` gets one request per call (serialized). A batching policy gets
up to ``max_batch_size`` pending requests (of different episodes, oldest first) in one call; the thread waits
until ``max_wait_s`` after the oldest pending request's arrival for the batch to fill, never longer.
Fairness: each episode may have at most one pending request, and pending
requests are served in arrival order, which with one request per episode is round-robin across robots.
A robot that is slow to send never holds the thread; a slow *policy* delays every robot equally.
Control jobs (episode-end hooks) go first. The queue is bounded: past ``max_pending`` episodes,
:class:`~sequence_ai_ros.exceptions.Overloaded` is raised immediately instead of queueing.

Episode end: a request submitted with ``ended`` (its episode's "the end has arrived" flag) never starts once
that flag is up: :meth:`InferenceScheduler.drop` takes an ended episode's queued requests out at once, and
the thread skips any it still finds. A request already running is left to finish (a thread cannot be
stopped); its caller discards the result. :meth:`InferenceScheduler.stats` counts both sides:
``requests_dropped_at_end`` and ``inferences_started_after_end`` (0 unless this rule is broken).

Borrowed slots (pipelined): a request whose deployment process can be asked straight from the event loop runs
there (:meth:`InferenceScheduler.borrow`) while nothing waits for the thread: up to :attr:`pipeline_depth` such
requests are in flight at once, the process running them one at a time in the order sent. They hold the
thread's slot, so the queue, the deadline and the episode rules apply to them as to a request the thread runs,
and the thread starts nothing until all are given back (:meth:`InferenceScheduler.give_back`). As each is given
back, the queued requests (oldest first) take the free slots from the event loop (:attr:`pump`), so that a
burst that queued is pipelined too. The oldest borrowed request counts as running from when the one before it
was answered (the deadline applies to it alone). An episode's end cancels its borrowed request (the process
then drops it unless its turn has come; :meth:`InferenceScheduler.drop`), and its outcome is counted when the
answer comes (dropped, or discarded).

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
    __slots__ = ('key', 'fn', 'payload', 'ended', 'future', 'submitted', 'queue_wait_s', 'started', 'cancel',
                 'cancelled')

    def __init__(self, key: str | None, fn: Callable[[], Any], payload: Any = None,
                 ended: Callable[[], bool] | None = None, future: Future | None = None) -> None:
        self.key = key
        self.fn = fn
        self.payload = payload
        self.ended = ended
        self.future: Future = Future() if future is None else future
        self.submitted = time.monotonic()
        self.queue_wait_s = 0.0
        self.started: float | None = None
        #: a borrowed request's cancel (its deployment process drops it unless started); True when it was in time
        self.cancel: Callable[[], bool] | None = None
        #: its episode ended while it was borrowed, and its cancel was in time: the answer tells its fate
        self.cancelled = False


class LoopFuture(Future):
    """The future of a request run from the event loop (:meth:`InferenceScheduler.borrow`): settled there."""


#: ``batch_call(payloads) -> results``: one result per payload, in order; an exception instance as a
#: result fails only that request.
BatchCall = Callable[[list[Any]], list[Any]]


class InferenceScheduler:
    """The single inference thread of one deployment.

    :param name: deployment name (the thread is ``seq-infer-<name>``).
    :param max_pending: most episodes that may wait at once; more raise Overloaded.
    :param batching: ``(max_batch_size, max_wait_s, batch_call)`` to run requests in batches (the jobs'
        payloads go to ``batch_call``), or None to run each job's ``fn`` alone.
    :param on_batch: called on the inference thread after every request call with ``(batch size, seconds)``
        (metrics); its exceptions are logged and ignored.
    """

    def __init__(self, name: str, max_pending: int = 64,
                 batching: tuple[int, float, BatchCall] | None = None,
                 on_batch: Callable[[int, float], None] | None = None) -> None:
        self.name = name
        self.max_pending = max_pending
        self.batching = batching
        self.on_batch = on_batch
        #: what the error of a call past its deadline tells the robot happens next
        self.stuck_words = 'the policy is stuck and the deployment is marked failed (restart the worker)'
        self._lock = threading.Condition()
        self._jobs: collections.deque[_Job] = collections.deque()
        self._control: collections.deque[_Job] = collections.deque()
        self._pending_keys: set[str] = set()
        self._current: list[_Job] = []
        self._borrowed: list[_Job] = []     # in the order sent; the first is the one running
        #: most requests borrowed at once (:meth:`borrow`; a deployment process's pipeline depth)
        self.pipeline_depth = 1
        #: ``pump(job) -> bool``: start a queued request in a free borrowed slot (the event loop's thread); False
        #: when it cannot (the thread then runs it). None: queued requests wait for the thread.
        self.pump: Callable[[_Job], bool] | None = None
        self._wedged: PolicyException | None = None
        self._dropped_at_end = 0
        self._started_after_end = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f'seq-infer-{name}', daemon=True)
        self._thread.start()

    @property
    def running(self) -> bool:
        """True until :meth:`stop`."""
        return not self._stop.is_set()

    @property
    def queue_depth(self) -> int:
        """Requests waiting for their turn: queued, and pipelined to a deployment process behind the running call."""
        with self._lock:
            return self._waiting()

    @property
    def pipelined(self) -> int:
        """Requests borrowed (sent to a deployment process from the event loop, not answered yet)."""
        with self._lock:
            return len(self._borrowed)

    @property
    def inferring(self) -> bool:
        """True while the thread runs a request (``fn`` or a batch), False while it is idle or runs a control job."""
        with self._lock:
            return bool(self._borrowed) or (bool(self._current) and self._current[0].key is not None)

    @property
    def idle(self) -> bool:
        """True when nothing runs, is pipelined or waits: no request, batch or control job (an episode's end hook)."""
        with self._lock:
            return not (self._current or self._borrowed or self._jobs or self._control)

    def runs_next(self, future: Future) -> bool:
        """True when ``future``'s control job (from :meth:`control`) ran, runs, or is the next to run.

        The next: nothing runs (no request, no batch, no other control job) and it heads the control queue.
        """
        with self._lock:
            if future.done():
                return True
            if self._current:
                return self._current[0].future is future
            return not self._borrowed and bool(self._control) and self._control[0].future is future

    def stats(self) -> dict[str, int]:
        """Counts of requests whose episode ended before they were served.

        ``requests_dropped_at_end``: queued requests that never started because their episode ended
        (:meth:`drop`, or found ended by the thread); ``inferences_started_after_end``: requests the thread
        started although their episode's end had already arrived (0: the thread never does).
        """
        with self._lock:
            return {'requests_dropped_at_end': self._dropped_at_end,
                    'inferences_started_after_end': self._started_after_end}

    def submit(self, key: str, fn: Callable[[], Any], payload: Any = None,
               ended: Callable[[], bool] | None = None) -> Future:
        """Queue ``fn`` for episode ``key``; the future's result is ``(fn(), queue_wait_s)``.

        With batching, ``payload`` goes to ``batch_call`` instead and the future's result is
        ``(its result for this payload, queue_wait_s)``.

        :param ended: True once the episode's end has arrived (called under the scheduler's lock; must be
            cheap and never block): from then on the request is dropped, never started, and its future
            fails with EpisodeStateError.
        :raises EpisodeStateError: when ``key`` already has a pending request (one at a time per episode).
        :raises Overloaded: when ``max_pending`` episodes are already waiting, or the scheduler stopped.
        """
        job = _Job(key, fn, payload, ended)
        with self._lock:
            if self._wedged is not None:
                raise PolicyException(str(self._wedged))
            if self._stop.is_set():
                raise Overloaded(f'deployment {self.name!r} is shutting down')
            if key in self._pending_keys:
                raise EpisodeStateError(f'episode {key!r} already has a request in flight; wait for its chunk')
            waiting = self._waiting()
            if waiting >= self.max_pending:
                raise Overloaded(f'deployment {self.name!r}: {waiting} requests already waiting '
                                 f'(max {self.max_pending}); retry later')
            self._pending_keys.add(key)
            self._jobs.append(job)
            self._wake_thread()
        return job.future

    def drop(self, key: str) -> int:
        """Take episode ``key``'s queued (not yet started) requests out at once; return how many.

        Their futures fail with EpisodeStateError. A request of ``key`` already running is left to finish. A
        borrowed one (in a deployment process's pipeline) is cancelled: the process drops it unless its turn has
        come, and the answer counts it (:meth:`give_back`); it is counted in the return value too, as it is
        accounted for here.
        """
        with self._lock:
            cancelled = 0
            for job in self._borrowed:
                if job.key == key and not job.cancelled and job.cancel is not None and job.cancel():
                    job.cancelled = True
                    cancelled += 1
            dropped = [job for job in self._jobs if job.key == key]
            if not dropped:
                return cancelled
            self._jobs = collections.deque(job for job in self._jobs if job.key != key)
            self._pending_keys.discard(key)
            self._dropped_at_end += len(dropped)
        for job in dropped:
            _settle(job.future, exception=_ended_error(job))
        return len(dropped) + cancelled

    def control(self, fn: Callable[[], Any]) -> Future:
        """Run ``fn`` on the inference thread before any queued request (used for episode-end hooks).

        After :meth:`stop` it runs inline in the caller's thread, so a hook is never lost.
        """
        job = _Job(None, fn)
        with self._lock:
            if not self._stop.is_set():
                self._control.append(job)
                self._wake_thread()
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
            running = self._current or self._borrowed
            job = running[0] if running else None
            if job is None or job.started is None or time.monotonic() - job.started <= deadline_s:
                return None
            self._wedged = PolicyException(f'deployment {self.name!r}: inference exceeded {deadline_s:g} s; '
                                           f'{self.stuck_words}')
            stuck = [*self._current, *self._borrowed, *self._jobs]
            deferred = list(self._control)  # stay queued: they run if the policy ever returns
            self._jobs.clear()
            self._pending_keys.clear()
        for j in stuck:
            _settle(j.future, exception=self._wedged)
        for j in deferred:
            _settle(j.future, exception=PolicyException(f'{self._wedged}; the hook is deferred'))
        LOG.error('%s', self._wedged)
        return self._wedged

    def unwedge(self) -> None:
        """Serve again after a wedge whose stuck call has returned (its deployment process was restarted)."""
        with self._lock:
            self._wedged = None

    def borrow(self, key: str) -> _Job | None:
        """Take a slot for episode ``key``'s request, run elsewhere (the event loop), when nothing waits; else None.

        Possible while the thread runs nothing, nothing is queued (control jobs included), fewer than
        :attr:`pipeline_depth` requests are borrowed, not wedged, not stopping, and ``key`` has no request
        pending. The job's future is a :class:`LoopFuture`; until :meth:`give_back` the request counts as
        running (:attr:`inferring`, :meth:`expire`) and the thread waits.
        """
        with self._lock:
            if (self._current or self._jobs or self._control or len(self._borrowed) >= self.pipeline_depth
                    or len(self._borrowed) > self.max_pending
                    or self._wedged is not None or self._stop.is_set() or key in self._pending_keys):
                return None
            job = _Job(key, _borrowed_fn, future=LoopFuture())
            job.started = job.submitted
            self._pending_keys.add(key)
            self._borrowed.append(job)
            return job

    def give_back(self, job: _Job, seconds: float | None = None, *, result: Any = None,
                  exception: BaseException | None = None, dropped: bool = False) -> None:
        """Return a borrowed slot (any thread); settle its future with ``(result, queue wait)`` or ``exception``.

        Then, on the event loop's thread, queued requests take the free slots (:attr:`pump`).

        :param seconds: how long the request ran (reported to ``on_batch`` as a batch of one); None when it
            never started.
        :param dropped: its deployment process dropped it, never started (its episode ended): counted in
            ``requests_dropped_at_end``, and its future fails with EpisodeStateError.
        """
        with self._lock:
            if job not in self._borrowed:
                return
            head = self._borrowed[0] is job
            self._borrowed.remove(job)
            if head and self._borrowed:       # the next one's turn in the process came now
                now = time.monotonic()
                nxt = self._borrowed[0]
                nxt.started = now if nxt.started is None else max(nxt.started, now)
                nxt.queue_wait_s = max(nxt.queue_wait_s, now - nxt.submitted)   # it waited in the pipeline
            self._pending_keys.discard(job.key)
            if dropped:
                self._dropped_at_end += 1
            pumped = self._pumped()
            self._wake_thread()
        if dropped:
            _settle(job.future, exception=_ended_error(job))
        elif exception is not None:
            _settle(job.future, exception=exception)
        else:
            _settle(job.future, result=(result, job.queue_wait_s))
        if seconds is not None and self.on_batch is not None:
            try:
                self.on_batch(1, seconds)
            except Exception as exc:
                LOG.warning('on_batch of %s failed: %s', self.name, exc)
        self._start_pumped(pumped)

    def _waiting(self) -> int:
        """Under the lock: requests waiting for their turn: queued, and pipelined behind the one running."""
        return len(self._jobs) + max(0, len(self._borrowed) - 1)

    def _wake_thread(self) -> None:
        """Under the lock: wake the thread when it has something to do (a wake-up per pipelined answer costs)."""
        if not self._borrowed and (self._jobs or self._control):
            self._lock.notify()

    def _pumped(self) -> list[_Job]:
        """Under the lock: queued requests that take free borrowed slots now (oldest first; ended ones dropped)."""
        if (self.pump is None or not self._jobs or self._control or self._current or self._wedged is not None
                or self._stop.is_set()):
            return []
        self._skip_ended()
        room = self.pipeline_depth - len(self._borrowed)
        taken = []
        now = time.monotonic()
        while self._jobs and room > 0:
            job = self._jobs.popleft()
            job.queue_wait_s = now - job.submitted
            job.started = now
            self._borrowed.append(job)
            taken.append(job)
            room -= 1
        return self._started(taken)

    def _start_pumped(self, jobs: list[_Job]) -> None:
        """Start the requests :meth:`_pumped` took; one that cannot start goes back to the queue's front."""
        back = []
        for job in jobs:
            try:
                ok = self.pump is not None and self.pump(job)
            except Exception as exc:
                LOG.warning('a queued request of %s could not be pipelined: %s', self.name, exc)
                ok = False
            if not ok:
                back.append(job)
        if back:
            with self._lock:
                for job in reversed(back):
                    if job in self._borrowed:
                        self._borrowed.remove(job)
                        job.started = None
                        self._jobs.appendleft(job)
                self._wake_thread()

    def _release(self, job: _Job) -> None:
        """Let the job's episode submit again: before its future settles, as its robot may answer at once."""
        if job.key is not None:
            with self._lock:
                self._pending_keys.discard(job.key)

    def _returned(self) -> None:
        """The policy call returned: nothing runs any more (read by :attr:`inferring`), before its futures settle."""
        if threading.current_thread() is self._thread:
            with self._lock:
                self._current = []

    def _execute(self, job: _Job) -> None:
        job.queue_wait_s = time.monotonic() - job.submitted
        job.started = time.monotonic()
        try:
            result = job.fn()
        except BaseException as exc:  # handed to the waiting stream, which types it
            self._returned()
            self._release(job)
            _settle(job.future, exception=exc)
        else:
            self._returned()
            self._release(job)
            _settle(job.future, result=(result, job.queue_wait_s))

    def _execute_batch(self, jobs: list[_Job]) -> None:
        assert self.batching is not None
        now = time.monotonic()
        for job in jobs:
            job.queue_wait_s, job.started = now - job.submitted, now
        try:
            results = self.batching[2]([job.payload for job in jobs])
        except BaseException as exc:  # a batch_call bug fails its batch, typed by the waiting streams
            results = [exc] * len(jobs)
        self._returned()
        if len(results) != len(jobs):
            results = [PolicyException(f'deployment {self.name!r}: {len(results)} results for {len(jobs)} '
                                       'requests')] * len(jobs)
        for job in jobs:
            self._release(job)
        for job, result in zip(jobs, results, strict=True):
            if isinstance(result, BaseException):
                _settle(job.future, exception=result)
            else:
                _settle(job.future, result=(result, job.queue_wait_s))

    def _take(self) -> list[_Job] | None:
        """Under the lock: wait for work and return the next control job or request batch; None: stop."""
        while True:
            # borrowed slots run requests elsewhere: nothing starts beside them
            while not self._stop.is_set() and (self._borrowed or not (self._jobs or self._control)):
                self._lock.wait()
            if self._control:
                return [self._control.popleft()]
            self._skip_ended()
            if not self._jobs:
                if self._stop.is_set():
                    return None
                continue
            if self.batching is None:
                return self._started([self._jobs.popleft()])
            size, wait_s, _ = self.batching
            fill_by = self._jobs[0].submitted + wait_s
            if len(self._jobs) < size and not self._stop.is_set() and time.monotonic() < fill_by:
                self._lock.wait(timeout=max(0.0, fill_by - time.monotonic()))
                continue  # re-check: a control job, a stop, an episode's end or more requests may have come
            return self._started([self._jobs.popleft() for _ in range(min(size, len(self._jobs)))])

    def _skip_ended(self) -> None:
        """Under the lock: drop the queued requests whose episode has ended (their futures fail)."""
        ended = [job for job in self._jobs if job.ended is not None and job.ended()]
        if not ended:
            return
        self._jobs = collections.deque(job for job in self._jobs if job not in ended)
        for job in ended:
            if job.key is not None:
                self._pending_keys.discard(job.key)
            _settle(job.future, exception=_ended_error(job))
        self._dropped_at_end += len(ended)

    def _started(self, jobs: list[_Job]) -> list[_Job]:
        """Under the lock: count the requests starting although their episode's end has arrived (never: see _take)."""
        self._started_after_end += sum(1 for job in jobs if job.ended is not None and job.ended())
        return jobs

    def _run(self) -> None:
        while True:
            with self._lock:
                jobs = self._take()
                if jobs is None:
                    return
                self._current = jobs
            start = time.perf_counter()
            if jobs[0].key is None or self.batching is None:
                self._execute(jobs[0])
            else:
                self._execute_batch(jobs)
            if jobs[0].key is not None and self.on_batch is not None:
                try:
                    self.on_batch(len(jobs), time.perf_counter() - start)
                except Exception as exc:
                    LOG.warning('on_batch of %s failed: %s', self.name, exc)
            with self._lock:
                self._current = []

    def stop(self, timeout: float = 5.0) -> None:
        """Finish queued work, then stop the thread (timed join); later control jobs run inline."""
        with self._lock:
            self._stop.set()
            self._lock.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)
            if self._thread.is_alive():
                LOG.warning('inference thread of %s still busy after %.1f s', self.name, timeout)


def _borrowed_fn() -> None:
    raise RuntimeError('a borrowed request runs outside the inference thread')


def _ended_error(job: _Job) -> EpisodeStateError:
    return EpisodeStateError(f'episode {job.key!r} ended before its request was served; the request was dropped')


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
