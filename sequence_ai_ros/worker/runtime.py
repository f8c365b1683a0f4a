"""One served deployment: its policy object, warming, episodes, inference and usage.

Threads owned here:

- ``seq-load-<name>``: constructs and warms the policy (``__init__`` then ``load()``) the first time a
  client asks (handshake, Ready or an episode), without blocking the caller. Loading is not billed.
- ``seq-infer-<name>``: the :class:`~sequence_ai_ros.worker.scheduler.InferenceScheduler`; every call into
  the policy object after loading (``infer``, or ``infer_batch`` for a policy declaring
  :class:`~sequence_ai_ros.policy.api.Batching`, and the ``@seq.on_episode`` hook) runs there, except that a
  deployment process's inferences are sent from the worker's event loop while nothing waits for this thread,
  several in flight at once, in the thread's slots (:meth:`DeploymentRuntime.submit`; the process runs them one
  at a time, in order).

Episodes are keyed by episode id: each has its own :class:`~sequence_ai_ros.policy.Episode` (with its
``state`` dict), so one robot never resets another, and an episode ends exactly once (:meth:`ActiveEpisode.end`).

At an episode's end no inference of it starts any more (:attr:`ActiveEpisode.ending`, set the moment the
robot's EpisodeEnd arrives): its queued requests are dropped, one already running finishes and its result
is discarded, and EpisodeEnded never waits for an inference (:meth:`DeploymentRuntime.end_stats` counts). One in
a deployment process's pipeline (sent, its turn not come) is dropped there, never started.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import logging
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np

from sequence_ai_ros.exceptions import (
    ConfigError,
    ContractViolation,
    DeploymentError,
    EpisodeStateError,
    NotReady,
    PolicyException,
)
from sequence_ai_ros.policy.api import Batching, Episode, Result
from sequence_ai_ros.policy.loader import PolicyDefinition
from sequence_ai_ros.protocol import messages
from sequence_ai_ros.protocol import sequence_ai_pb2 as pb
from sequence_ai_ros.protocol.contract import Contract, clip
from sequence_ai_ros.worker import content
from sequence_ai_ros.worker.capture_hook import EpisodeRecorder
from sequence_ai_ros.worker.config import ServerConfig
from sequence_ai_ros.worker.deployment_state import (
    EndCounts,
    EpisodeTable,
    LoadPlan,
    Readiness,
    RestartBudget,
)
from sequence_ai_ros.worker.episode_tally import LiveCounts
from sequence_ai_ros.worker.hosting import PolicyHost
from sequence_ai_ros.worker.logs import episode_fields, log_episode
from sequence_ai_ros.worker.metrics import MetricsSink
from sequence_ai_ros.worker.policy_process import PolicyProcessDied, RemoteError, open_host, runs_isolated
from sequence_ai_ros.worker.scheduler import InferenceScheduler
from sequence_ai_ros.worker.usage import UsageMeter
from sequence_ai_ros.worker.validate import signal_words

LOG = logging.getLogger(__name__)
#: ETA (s) announced for a first load whose duration is unknown.
DEFAULT_LOAD_ETA_S = 10.0
#: Longest wait (s) for an episode-end hook before EpisodeEnded is sent anyway.
HOOK_WAIT_S = 30.0
#: Default deadline (s) of one inference call; past it the deployment is marked failed (from ServerConfig).
DEFAULT_INFERENCE_TIMEOUT_S = ServerConfig.inference_timeout_s
#: Default deadline (s) of construct + load(); past it the deployment is marked failed (from ServerConfig).
DEFAULT_LOAD_TIMEOUT_S = ServerConfig.load_timeout_s
#: The episode id of the dry inference a restarted deployment process, or a rollout's new version, passes
#: before it serves robots.
DRY_RUN_EPISODE = 'seq-dry-run'


def describe(exc: BaseException) -> str:
    """Return ``'Type: message'`` for a policy's exception (a deployment process's: its own words).

    ``signal.signal`` refused off the main thread (``--isolation none``) says what to do
    (:func:`~sequence_ai_ros.worker.validate.signal_words`).
    """
    if isinstance(exc, (RemoteError, PolicyProcessDied)):
        return str(exc)
    text = ''.join(traceback.format_exception_only(type(exc), exc)).strip()
    hint = signal_words(exc)
    return f'{text} ({hint})' if hint else text


class ActiveEpisode:
    """An episode in progress on one stream; :meth:`end` runs its hook and commits capture exactly once."""

    def __init__(self, runtime: DeploymentRuntime, episode: Episode, recorder: EpisodeRecorder) -> None:
        self.runtime = runtime
        self.episode = episode
        self.recorder = recorder
        self.last_request_id = 0
        self.requests = 0
        self._lock = threading.Lock()
        self._ended = False
        self._finished = False
        #: True once the episode's end has arrived (the robot's EpisodeEnd read off the stream, or :meth:`end`):
        #: from then on none of its requests starts (the scheduler drops them)
        self.ending = False
        self.captured = False
        #: the robot's EpisodeStart.client_id ('' when it sent none), for the episode's log lines
        self.client_id = ''
        #: its requests in flight and underruns so far, for the admin API (:mod:`~sequence_ai_ros.worker.admin`)
        self.live = LiveCounts()

    @property
    def ended(self) -> bool:
        """True once its end began (:meth:`end`, :meth:`begin_end`, :meth:`settle`)."""
        return self._ended

    @property
    def finished(self) -> bool:
        """True once its end is done: capture committed, counted, usage flushed (:meth:`finish_end`)."""
        return self._finished

    def end_arrived(self) -> int:
        """The episode's end has arrived: no request of it starts any more; return how many were dropped or cancelled.

        Dropped: queued; cancelled: in a deployment process's pipeline (counted once its answer comes). Cheap and
        never blocks (the event loop calls it as EpisodeEnd comes in); :meth:`end` follows.
        """
        self.ending = True
        return self.runtime.scheduler.drop(self.episode.id)

    def end(self, reason: str, stats: dict[str, Any] | None = None, wait: bool = True) -> bool:
        """End the episode: set ``episode.reason``, run the hook on the inference thread, commit capture (blocking).

        Idempotent: only the first call does anything; later ones return False. The episode's queued
        requests are dropped first (:meth:`end_arrived`). :meth:`begin_end`, the wait for the hook, then
        :meth:`finish_end`; the worker's streams run the three apart and await the hook on the event loop.

        :param reason: ``completed``, ``disconnect``, ``idle_timeout``, ``shutdown``... (from EpisodeEnd).
        :param stats: the robot's episode statistics, stored with the capture.
        :param wait: wait (up to :data:`HOOK_WAIT_S`) for the hook, e.g. before answering EpisodeEnded, when it
            runs at once (:meth:`begin_end`).
        :return: True for the call that ended it.
        """
        first, hook = self.begin_end(reason, wait)
        if not first:
            return False
        if hook is not None:
            try:
                hook.result(timeout=HOOK_WAIT_S)
            except Exception as exc:  # the hook's own failure is logged in _run_hook
                LOG.debug('hook wait for %s: %s', self.episode.id, exc)
        self.finish_end(reason, stats)
        return True

    def begin_end(self, reason: str, wait: bool = True) -> tuple[bool, concurrent.futures.Future | None]:
        """End the episode's requests and queue its hook; return (whether this call ended it, what to wait for).

        Never blocks on the policy (any thread but the event loop's: after the scheduler stopped, the hook runs
        in the caller). What to wait for is the hook's future with ``wait`` when the hook runs at once, else
        None: behind an inference (this episode's last, or another robot's) or other episodes' hooks, the hook
        runs right after them and nobody waits for it. So at most one end per deployment waits on a hook, and
        robots ending together behind a slow hook never wait hook after hook. :meth:`finish_end` follows.
        """
        with self._lock:
            if self._ended:
                return False, None
            self._ended = True
        self.end_arrived()
        self.episode.reason = reason
        rt = self.runtime
        hook = rt.hook_callable()
        # with a hook, the hook's own call drops the episode's state in a deployment process, once it ran: told
        # to forget it now, any call sent before the hook (another robot's) would, and the hook would find it empty
        rt.forget(self.episode.id, policy_side=hook is None)
        if hook is None:
            return True, None
        future = rt.scheduler.control(lambda: self._run_hook(hook))
        return True, future if wait and rt.scheduler.runs_next(future) else None

    def settle(self, reason: str, stats: dict[str, Any] | None = None) -> None:
        """End the episode, unless its end began, and finish it, unless that was done; never waits for the hook.

        For an end cut short (its stream cancelled, the robot gone): whatever of it had not run runs now, once.
        """
        self.begin_end(reason, wait=False)
        self.finish_end(self.episode.reason or reason, stats)

    def finish_end(self, reason: str, stats: dict[str, Any] | None = None) -> None:
        """After :meth:`begin_end` (and the wait for the hook): commit capture, count, flush usage, log (blocking).

        Idempotent: only the first call does anything.
        """
        with self._lock:
            if self._finished:
                return
            self._finished = True
        self.captured = self.recorder.commit(reason, dict(stats or {}, requests=self.requests))
        stats = stats or {}
        rt = self.runtime
        rt.metrics.episode_ended(rt.name, reason, int(stats.get('underruns', 0)), float(stats.get('underrun_s', 0.0)))
        rt.usage.flush()
        log_episode(LOG, 'ended', self.fields(reason=reason, requests=self.requests,
                                              captured=self.captured), reason)

    def fields(self, **more: Any) -> dict[str, Any]:
        """Return the episode's log fields (:func:`~sequence_ai_ros.worker.logs.episode_fields`) and ``more``."""
        rt = self.runtime
        return episode_fields(self.episode.id, self.client_id, rt.name, rt.version, **more)

    def _run_hook(self, hook: Any) -> None:
        try:
            hook(self.episode)
        except BaseException as exc:  # SystemExit/KeyboardInterrupt from a policy must not kill the thread
            LOG.error('on_episode hook of %s raised for episode %s: %s', self.runtime.name, self.episode.id,
                      describe(exc))


class DeploymentRuntime:
    """A deployment being served.

    Its policy runs behind one :class:`~sequence_ai_ros.worker.hosting.PolicyHost`: in the worker, or in a
    deployment process (``--isolation process``, which a crash, exit or hang restarts).

    :param name: deployment name.
    :param version: deployment version (from the registry; 0 when ad hoc).
    :param definition: the imported policy file.
    :param usage: its usage meter.
    :param capture_store: its CaptureStore, or None when capture is off.
    :param max_pending: bound of the inference queue (episodes waiting); beyond it requests get OVERLOADED.
    :param eta_hint_s: expected load time (s) when known (the deploy's measured dry-run load); Ready's
        eta counts down from it; each completed load replaces it with its own measured time.
    :param inference_timeout_s: deadline of one ``infer`` call (s). Past it, that request and those queued
        behind it get POLICY_EXCEPTION "inference exceeded N s" and the deployment is marked failed
        (health NOT_SERVING, Ready ``failed`` with the reason); a stuck thread cannot be reclaimed.
    :param load_timeout_s: deadline of construct + ``load()`` (s); past it the deployment is marked failed.
    :param record: the registry's record of the deployed version (None when ad hoc): the load checks again,
        just before constructing the policy, that policy.py, config.yaml and the artifacts' file list, sizes and
        modification times are still the validated ones (:func:`~sequence_ai_ros.worker.content.changes`; a
        checkpoint swapped after ``seq serve`` started is refused, never served as the validated version).
    :raises ConfigError: for a non-positive timeout.
    """

    def __init__(self, name: str, version: int, definition: PolicyDefinition, usage: UsageMeter,
                 capture_store: Any | None = None, max_pending: int = ServerConfig.max_pending,
                 eta_hint_s: float | None = None,
                 inference_timeout_s: float = DEFAULT_INFERENCE_TIMEOUT_S,
                 load_timeout_s: float = DEFAULT_LOAD_TIMEOUT_S, record: Any | None = None) -> None:
        for what, value in (('inference_timeout_s', inference_timeout_s), ('load_timeout_s', load_timeout_s)):
            if not value > 0:
                raise ConfigError(f'{what} must be > 0 s, got {value}')
        self.inference_timeout_s = float(inference_timeout_s)
        self.load_timeout_s = float(load_timeout_s)
        self.name = name
        self.version = version
        self.definition = definition
        self.record = record
        self.contract: Contract = definition.contract.with_names(name, version)
        self.max_message_bytes = self.contract.max_message_bytes()
        self.usage = usage
        self.capture_store = capture_store
        batching = definition.spec.batching
        plan = None if batching is None else (batching.max_batch_size, batching.max_wait_s, self._call_batch)
        self.scheduler = InferenceScheduler(name, max_pending=max_pending, batching=plan,
                                            on_batch=self._on_batch)
        #: True when the policy runs in a deployment process (``--isolation process``)
        self.isolated = runs_isolated(definition)
        if self.isolated:
            self.scheduler.stuck_words = 'the policy is stuck: its process is killed and restarted'
            if batching is None:      # inferences pipelined from the event loop (:meth:`_send`)
                self.scheduler.pipeline_depth = int(getattr(definition.cls, 'pipeline_depth', 1))
                self.scheduler.pump = self._pump
        #: where requests, batches and episode ends are reported (Prometheus when ``--metrics-port`` is set)
        self.metrics: MetricsSink = MetricsSink()
        #: guards :attr:`_status`, :attr:`_instance` and :attr:`_restarts` together
        self._lock = threading.Lock()
        self._status = Readiness(eta_hint_s if eta_hint_s is not None else DEFAULT_LOAD_ETA_S)
        #: the policy serving robots (None until loaded, and while a deployment process restarts)
        self._instance: PolicyHost | None = None
        #: the policy the last load constructed (a load past its deadline is killed through it)
        self._instance_loading: PolicyHost | None = None
        self._loader: threading.Thread | None = None
        self._restarts = RestartBudget()
        self._episodes: EpisodeTable[ActiveEpisode] = EpisodeTable()
        self._ends = EndCounts()
        self.on_state_change: Any = None
        self._closing = False
        #: how the next load goes: held by a rollout while the old version unloads, or ending with a dry run
        self.load_plan = LoadPlan()
        #: the worker's event loop (set by the server): a request submitted there while the inference thread is
        #: idle goes to the deployment process from the loop, which also reads the answer (:meth:`submit`)
        self.loop: asyncio.AbstractEventLoop | None = None

    @property
    def batching(self) -> Batching | None:
        """The policy's :class:`~sequence_ai_ros.policy.api.Batching`, or None when it infers one request a call."""
        return self.definition.spec.batching

    @property
    def ready_event(self) -> threading.Event:
        """Set while the policy is ready (cleared while a deployment process restarts)."""
        return self._status.event

    @property
    def restarts(self) -> int:
        """Times the deployment process was restarted after a crash, exit or hang (``--isolation process``)."""
        return self._restarts.count

    @property
    def load_error(self) -> BaseException | None:
        """What the last load (construct, ``load()``, dry run) raised.

        None while it has not failed, and when it failed by passing ``load_timeout_s`` (a rollout tells an
        out-of-memory failure from the others).
        """
        return self._status.load_error

    # -- warming ------------------------------------------------------------------------------------------
    def ensure_loading(self) -> None:
        """Start loading in ``seq-load-<name>`` if the policy is cold (and :attr:`load_plan` lets it); never blocks."""
        with self._lock:
            if self._status.state != 'cold' or not self.load_plan.may_start:
                return
            self._status.warming(time.monotonic())
            self._status.load_error = None
            self._loader = threading.Thread(target=self._load, name=f'seq-load-{self.name}', daemon=True)
            self._loader.start()
        self._notify()

    def _load(self) -> None:
        start = time.monotonic()
        try:
            if self.record is not None:     # the weights load now, maybe long after seq serve checked them
                changed = content.changes(self.definition, self.record)
                if changed:
                    raise DeploymentError(f'{"; ".join(changed)} since version {self.version} was deployed; run '
                                          f'`seq deploy {self.definition.path}` again to validate it as a new version')
            host = open_host(self.definition)
            self._instance_loading = host
            host.load()
            if self.load_plan.dry_run or self.restarts:
                self._dry_run(host)      # a restarted process or a new version serves after a good dry run
        except BaseException as exc:  # SystemExit/KeyboardInterrupt inside a policy are its failure too
            msg = f'policy {self.name!r} failed to load: {describe(exc)}'
            LOG.error('%s\n%s', msg, traceback.format_exc())
            loading = self._instance_loading
            if loading is not None:
                loading.close(timeout=0.5)
            with self._lock:
                if self._status.state == 'warming':
                    self._status.fail(msg, exc)
        else:
            with self._lock:
                late = self._status.state != 'warming'  # the load deadline passed: stay failed
                if not late:
                    self._instance = host
                    self._status.ready(time.monotonic() - start)     # a later (re)load is timed from this one
                    if self.isolated:
                        # What the worker holds now (its modules, grpc's, numpy's) lives as long as it: frozen,
                        # Python's full collections no longer walk it. Unfrozen, one every ~2 s at 128 robots took
                        # 25-40 ms of the event loop (measured: 5-7 ms frozen), each a burst of late replies. Not
                        # with the policy in the worker: a frozen model would outlive its version's rollout.
                        gc.freeze()
            if late:
                LOG.error('policy %s finished loading after its deadline; it stays failed', self.name)
                host.close(timeout=0.5)
            else:
                LOG.info('policy %s ready after %.2f s', self.name, self._status.eta_hint_s)
        self._notify()           # health follows Ready at once; the usage row's disk write comes after
        self.usage.add(warming_s=time.monotonic() - start)
        try:
            self.usage.flush()
        except Exception as exc:  # a full disk: the counts wait in memory for the next flush
            LOG.error('usage of %s not written (kept for the next flush): %s', self.name, exc)

    def _dry_run(self, host: PolicyHost) -> None:
        """One inference on the synthetic observation of ``seq deploy``; its chunk must fit the contract."""
        from sequence_ai_ros.worker.validate import synthetic_request

        inp = messages.unpack_observation(synthetic_request(self.contract), self.contract)
        episode = Episode(id=DRY_RUN_EPISODE, instruction='dry run before serving', deployment=self.name)
        out = host.infer(inp, episode)
        host.forget(episode.id)
        actions = out.actions if isinstance(out, Result) else out
        messages.pack_chunk(np.asarray(actions), self.contract, request_id=1, episode_id=episode.id, robot_time_s=0.0)

    def _on_wedged(self, wedged: PolicyException) -> None:
        """An inference passed its deadline: restart a deployment process; in the worker, mark the deployment failed."""
        host = self._instance
        if not self.isolated:
            self.mark_failed(str(wedged))
        elif host is not None:   # None: already restarting
            self.restart(host, str(wedged))

    def restart(self, host: PolicyHost, why: str) -> None:
        """Kill ``host``'s deployment process and load a new one (``seq-load-<name>``); returns at once.

        Until the new process has loaded and passed the dry run, requests get NOT_READY naming ``why``
        (health NOT_SERVING). More than :data:`~.deployment_state.MAX_RESTARTS` restarts within
        :data:`~.deployment_state.RESTART_WINDOW_S` mark the deployment failed instead. Only the first call for
        a given host acts.
        """
        with self._lock:
            if self._closing or self._instance is not host or self._status.state != 'ready':
                return
            now = time.monotonic()
            self._instance = None
            self._status.event.clear()
            if self._restarts.spend(now):
                self._status.warming(now, f'deployment {self.name!r} is restarting: {why}')
            else:
                budget = self._restarts
                self._status.fail(f'deployment {self.name!r} failed: its policy process died {budget.limit + 1} '
                                  f'times within {budget.window_s:g} s; last: {why}')
            state, message = self._status.state, self._status.message
        host.kill(why)
        LOG.error('%s', message)
        self._notify()
        if state == 'warming':
            self._loader = threading.Thread(target=self._reload, args=(host,), name=f'seq-load-{self.name}',
                                            daemon=True)
            self._loader.start()

    def _reload(self, old: PolicyHost) -> None:
        deadline = time.monotonic() + 10.0
        while self.scheduler.inferring and time.monotonic() < deadline:   # the killed call returns at once
            time.sleep(0.005)
        self.scheduler.unwedge()
        old.close(timeout=0.5)
        self._load()

    def _notify(self) -> None:
        if self.on_state_change is not None:
            self.on_state_change(self)

    def mark_failed(self, message: str) -> None:
        """Mark the deployment failed (health NOT_SERVING; Ready answers ``failed`` with ``message``)."""
        with self._lock:
            if not self._status.fail(message):
                return
        LOG.error('deployment %s marked failed: %s', self.name, message)
        self._notify()

    def readiness(self) -> tuple[bool, float, str, str]:
        """Return (ready, eta_seconds, state, message); ``state`` is cold | warming | ready | failed.

        A load running longer than ``load_timeout_s``, or an inference longer than ``inference_timeout_s``,
        turns the state to ``failed`` here (also when no robot is waiting for that inference).
        """
        with self._lock:
            state = self._status.state
            elapsed = self._status.elapsed(time.monotonic())
            host = self._instance
        if state == 'warming' and elapsed > self.load_timeout_s:
            self.mark_failed(f'policy {self.name!r} failed to load: load exceeded {self.load_timeout_s:g} s')
            loading = self._instance_loading
            if loading is not None:   # a busy loop in a deployment process's load() stops burning a core
                loading.kill(f'load exceeded {self.load_timeout_s:g} s')
        elif state == 'ready':
            wedged = self.scheduler.expire(self.inference_timeout_s)
            if wedged is not None:
                self._on_wedged(wedged)
            elif host is not None and (ended := host.exit_reason()) is not None:
                self.restart(host, f'the policy process of deployment {self.name!r} exited ({ended})')
        with self._lock:
            state, message = self._status.state, self._status.message
        return state == 'ready', self._status.eta(state, elapsed), state, message

    def hook_callable(self) -> Callable[[Episode], None] | None:
        """Return the bound ``@seq.on_episode`` method, or None (no hook, or never loaded)."""
        host = self._instance
        if self.definition.hook is None or host is None:
            return None
        return host.episode_hook(self.definition.hook)

    # -- episodes -----------------------------------------------------------------------------------------
    def start_episode(self, episode_id: str, instruction: str, client_id: str = '', owner: str = '') -> ActiveEpisode:
        """Register a new episode and log its start line (with ``client_id``, the robot's EpisodeStart's).

        :param owner: the caller's identity (:mod:`sequence_ai_ros.worker.identity`): the capture store records
            it as the episode's owner, from whom alone its labels, outcome and telemetry are accepted.

        :raises EpisodeStateError: when an episode with this id is already running on this worker.
        """
        if episode_id in self._episodes:   # refused before its capture is touched (a second start never disturbs
            raise self._already_running(episode_id)     # the first's)
        recorder = EpisodeRecorder(self.capture_store, episode_id, instruction, self.contract, version=self.version,
                                   owner=owner)
        active = ActiveEpisode(self, Episode(id=episode_id, instruction=instruction, deployment=self.name),
                               recorder)
        if not self._episodes.add(episode_id, active):   # a start that raced the check above
            recorder.commit('duplicate', {})
            raise self._already_running(episode_id)
        active.client_id = client_id
        self.usage.add(episodes=1)
        log_episode(LOG, 'started', active.fields(captured=recorder.active))
        return active

    def _already_running(self, episode_id: str) -> EpisodeStateError:
        return EpisodeStateError(f'episode {clip(episode_id)!r} is already running on {self.name!r}; '
                                 'every robot needs its own episode id')

    def forget(self, episode_id: str, *, policy_side: bool = True) -> None:
        """Drop an ended episode from the running set, and with ``policy_side`` from its deployment process."""
        self._episodes.remove(episode_id)
        host = self._instance
        if host is not None and policy_side:
            host.forget(episode_id)

    def running_episodes(self) -> list[ActiveEpisode]:
        """Return the episodes in progress."""
        return self._episodes.all()

    def count_at_end(self, dropped: int = 0, discarded: int = 0) -> None:
        """Count requests a stream dropped unread at its episode's end, and results it discarded (any thread)."""
        self._ends.add(dropped, discarded)

    def end_stats(self) -> dict[str, int]:
        """Return the counts of what episode ends cut short, since the worker started.

        - ``requests_dropped_at_end``: observation requests never started because their episode ended first
          (queued for the inference thread, or still unread on the stream behind the EpisodeEnd or the worker's
          cut, or sent after the cut);
        - ``results_discarded_at_end``: inferences running when their episode ended: left to finish, their
          chunk never sent nor captured;
        - ``inferences_started_after_end``: inferences started for an episode whose end had arrived (0).
        """
        sched = self.scheduler.stats()
        unread_dropped, discarded = self._ends.totals()
        return {'requests_dropped_at_end': sched['requests_dropped_at_end'] + unread_dropped,
                'results_discarded_at_end': discarded,
                'inferences_started_after_end': sched['inferences_started_after_end']}

    # -- inference ----------------------------------------------------------------------------------------
    def submit(self, active: ActiveEpisode, req: pb.ObservationRequest,
               inp: messages.PolicyInput | None = None) -> concurrent.futures.Future:
        """Validate ``req`` and queue it for the inference thread; return the scheduler's future.

        :param inp: ``req`` already decoded (:meth:`decode`), or None to decode it here.
        :raises ContractViolation: for a malformed request (the robot's fault).
        :raises NotReady: while cold or warming (with ``retry_after_s``), or after a failed load
            (:meth:`check_ready`).
        :raises Overloaded: when the inference queue is full.
        :raises EpisodeStateError: when the episode's end has arrived (:attr:`ActiveEpisode.ending`).
        """
        self.check_ready()
        if active.ending:
            raise EpisodeStateError(f'request {req.request_id}: episode {active.episode.id!r} has ended')
        if inp is None:
            inp = self.decode(req)
        episode = active.episode
        host = self._instance
        if host is not None and host.starts_on_loop and self.batching is None:
            future = self._start(host, inp, episode)
            if future is not None:
                return future
        return self.scheduler.submit(episode.id, lambda: self._call(host, inp, episode), payload=(inp, episode),
                                     ended=lambda: active.ending)

    def check_ready(self) -> None:
        """Return when the deployment serves; else start a cold one's load and raise NotReady (never blocks).

        :raises NotReady: while it is cold or warming, with ``retry_after_s`` the estimated time left (s, at
            least 0.1): the robot may send a newer observation then; after a failed load (or past the load
            deadline), with ``retry_after_s`` 0 and the reason.
        """
        ready, eta, state, message = self.readiness()
        if ready:
            return
        self.ensure_loading()
        loading = state in ('cold', 'warming')
        raise NotReady(message or f'policy {self.name!r} is {state}; ready in about {eta:.1f} s',
                       retry_after_s=eta if loading else 0.0)

    def _start(self, host: PolicyHost, inp: messages.PolicyInput,
               episode: Episode) -> concurrent.futures.Future | None:
        """On the event loop, with nothing waiting for the inference thread: send the request to the process from here.

        It goes behind those in flight (up to the pipeline's depth). The loop reads the answer and settles the future (a
        :class:`~sequence_ai_ros.worker.scheduler.LoopFuture`) as :meth:`_call` would; the request holds one of
        the inference thread's slots meanwhile. None: the thread runs it (not on the loop, requests queued, the
        pipeline full, or a thread's call running).
        """
        if not self._on_loop() or episode.reason is not None:
            return None
        job = self.scheduler.borrow(episode.id)
        if job is None:
            return None
        if self._send(host, job, inp, episode):
            return job.future
        self.scheduler.give_back(job)
        return None

    def _on_loop(self) -> bool:
        loop = self.loop
        if loop is None:
            return False
        try:
            return asyncio.get_running_loop() is loop
        except RuntimeError:
            return False

    def _pump(self, job: Any) -> bool:
        """Start a queued request in a free pipeline slot (the scheduler's :attr:`~.scheduler.InferenceScheduler.pump`).

        False when it cannot here (off the loop, no host): the inference thread then runs it.
        """
        host = self._instance
        if host is None or not self._on_loop():
            return False
        if job.ended is not None and job.ended():      # its episode ended as it was taken: it never starts
            self.scheduler.give_back(job, dropped=True)
            return True
        inp, episode = job.payload
        return self._send(host, job, inp, episode)

    def _send(self, host: PolicyHost, job: Any, inp: messages.PolicyInput, episode: Episode) -> bool:
        """Send a borrowed request to the deployment process (loop thread); its answer gives the slot back."""
        assert self.loop is not None

        def done(status: str | None, value: Any) -> None:
            # job -> its cancel -> the call in flight -> this closure -> job: a cycle holding the request's arrays
            # until Python's cycle collector ran (38 objects per request, collections of 5-7 ms at 128 robots)
            job.cancel = None
            # its own turn in the process (from the previous answer, or from its send), not the ones before it
            elapsed = time.monotonic() - (job.started or job.submitted)
            self.usage.add(inference_s=elapsed)
            if job.cancelled and status != 'dropped':         # its episode ended: no stream counts it any more
                self.count_at_end(discarded=1)
            if status == 'ok':
                self.scheduler.give_back(job, elapsed, result=(value, elapsed))
            elif status == 'dropped':           # its episode ended before its turn: it never started
                self.scheduler.give_back(job, dropped=True)
            elif status is None:                # died (a thread of its own): this deployment restarts
                self.restart(host, str(value))
                self.scheduler.give_back(job, elapsed, exception=PolicyException(str(value)))
            elif status == 'contract':
                LOG.warning('policy %s refused episode %s request %d: %s', self.name, episode.id, inp.request_id,
                            value)
                self.scheduler.give_back(job, elapsed, exception=ContractViolation(value))
            else:
                LOG.warning('policy %s raised on episode %s request %d: %s', self.name, episode.id,
                            inp.request_id, value)
                self.scheduler.give_back(job, elapsed, exception=PolicyException(value))

        cancel = host.start_infer(self.loop, inp, episode, done)
        if cancel is None:
            return False
        job.cancel = cancel
        return True

    def decode(self, req: pb.ObservationRequest, nbytes: int | None = None,
               decode: Callable[[pb.Image], Any] | None = None) -> messages.PolicyInput:
        """Check the request's size and decode it against the contract (images decoded: the costly part).

        :param nbytes: the request's size on the wire (bytes) when known (the Episode stream's deserializer
            gives it); None measures it with ``ByteSize()``, which in upb re-encodes the whole message.
        :param decode: what stands in for each JPEG/PNG image
            (:func:`~sequence_ai_ros.protocol.messages.unpack_observation`).
        :raises ContractViolation: for a request over the contract's size or a malformed one.
        """
        size = req.ByteSize() if nbytes is None else nbytes
        if size > self.max_message_bytes:
            raise ContractViolation(f'request {req.request_id}: {size} bytes exceeds the contract\'s '
                                    f'{self.max_message_bytes}')
        return messages.unpack_observation(req, self.contract, decode=decode)

    @property
    def wait_slice_s(self) -> float:
        """Slice (s) in which a waiting stream re-checks the inference deadline and its episode."""
        return min(0.5, max(0.02, self.inference_timeout_s / 5))

    def check_wait(self, active: ActiveEpisode, req: pb.ObservationRequest) -> bool:
        """Called when a wait slice passes: apply the inference deadline; True when the future now holds an error.

        :raises EpisodeStateError: when the episode ended while its request waited.
        """
        wedged = self.scheduler.expire(self.inference_timeout_s)
        if wedged is not None:
            self._on_wedged(wedged)
            return True
        if active.ended:
            raise EpisodeStateError(f'episode {active.episode.id!r} ended while request {req.request_id} '
                                    'waited for inference') from None
        return False

    def on_failure(self, exc: BaseException) -> None:
        """Mark the deployment failed when ``exc`` came from a wedged scheduler."""
        if isinstance(exc, PolicyException) and self.scheduler.wedged is not None:
            self._on_wedged(self.scheduler.wedged)

    def finish(self, active: ActiveEpisode, req: pb.ObservationRequest, result: Any) -> pb.ActionChunk:
        """Turn the scheduler's result ``((out, inference_s), queue_wait_s)`` into the ActionChunk.

        :raises ContractViolation: when the policy returned a chunk that breaks its contract (shape, NaN).
        """
        (out, inference_s), queue_wait_s = result
        actions, done = (out.actions, out.done) if isinstance(out, Result) else (out, False)
        try:
            chunk = messages.pack_chunk(np.asarray(actions), self.contract, request_id=req.request_id,
                                        episode_id=active.episode.id, robot_time_s=req.robot_time_s,
                                        done=bool(done), queue_wait_ms=queue_wait_s * 1e3,
                                        inference_ms=inference_s * 1e3)
        except (ContractViolation, TypeError, ValueError) as exc:
            raise ContractViolation(f'policy {self.name!r} returned a malformed chunk: {exc}') from None
        self.usage.add(requests=1)
        return chunk

    def infer(self, active: ActiveEpisode, req: pb.ObservationRequest) -> pb.ActionChunk:
        """Validate ``req``, run the policy on the inference thread, wait for it, return the chunk (blocking).

        The worker's event loop uses :meth:`submit` / :meth:`finish` and awaits instead; this blocking form
        is for callers on their own thread.

        :raises ContractViolation: for a malformed request (the robot's fault), or a chunk that breaks the
            contract (shape, NaN): the robot ends the episode with 'validate'.
        :raises NotReady: while warming, or after a failed load.
        :raises PolicyException: when the policy raises (any BaseException, SystemExit included), or its
            call exceeds ``inference_timeout_s`` (then the deployment is marked failed).
        :raises Overloaded: when the inference queue is full.
        """
        future = self.submit(active, req)
        while True:  # wait in slices: give up when the robot has gone; enforce the deadline
            try:
                result = future.result(timeout=self.wait_slice_s)
                break
            except PolicyException as exc:
                self.on_failure(exc)
                raise
            except concurrent.futures.TimeoutError:
                self.check_wait(active, req)
        return self.finish(active, req, result)

    def _call(self, host: PolicyHost | None, inp: messages.PolicyInput, episode: Episode) -> tuple[Any, float]:
        if episode.reason is not None:
            raise EpisodeStateError(f'episode {episode.id!r} already ended ({episode.reason})')
        start = time.perf_counter()
        try:
            if host is None:
                raise PolicyProcessDied(f'deployment {self.name!r} is restarting')
            out = host.infer(inp, episode)
        except PolicyProcessDied as exc:   # a crash, os._exit or kill: this deployment restarts
            if host is not None:
                self.restart(host, str(exc))
            raise PolicyException(str(exc)) from exc
        except ContractViolation as exc:   # the policy found the request malformed: the robot's fault, typed so
            LOG.warning('policy %s refused episode %s request %d: %s', self.name, episode.id, inp.request_id, exc)
            raise
        except BaseException as exc:  # SystemExit/KeyboardInterrupt inside a policy become POLICY_EXCEPTION
            LOG.warning('policy %s raised on episode %s request %d: %s', self.name, episode.id, inp.request_id,
                        describe(exc))
            raise PolicyException(describe(exc)) from exc
        finally:
            self.usage.add(inference_s=time.perf_counter() - start)
        return out, time.perf_counter() - start

    def _call_batch(self, items: list[tuple[messages.PolicyInput, Episode]]) -> list[Any]:
        """Run ``infer_batch`` on the live requests of ``items``; one ``(out, seconds)`` or exception per item."""
        results: list[Any] = [None] * len(items)
        live = []
        for i, (_, episode) in enumerate(items):
            if episode.reason is not None:
                results[i] = EpisodeStateError(f'episode {episode.id!r} already ended ({episode.reason})')
            else:
                live.append(i)
        if not live:
            return results
        start = time.perf_counter()
        host = self._instance
        try:
            if host is None:
                raise PolicyProcessDied(f'deployment {self.name!r} is restarting')
            outs = list(host.infer_batch([items[i][0] for i in live], [items[i][1] for i in live]))
            if len(outs) != len(live):
                raise ValueError(f'infer_batch returned {len(outs)} chunks for {len(live)} inputs')
        except BaseException as exc:  # SystemExit/KeyboardInterrupt inside a policy become POLICY_EXCEPTION
            if isinstance(exc, PolicyProcessDied) and host is not None:
                self.restart(host, str(exc))
            LOG.warning('policy %s raised on a batch of %d (episodes %s): %s', self.name, len(live),
                        [items[i][1].id for i in live], describe(exc))
            err = PolicyException(describe(exc))
            for i in live:
                results[i] = err
            return results
        finally:
            elapsed = time.perf_counter() - start
            self.usage.add(inference_s=elapsed)
        for i, out in zip(live, outs, strict=True):
            if isinstance(out, BaseException):   # that request alone failed; the others of the batch are served
                LOG.warning('policy %s failed episode %s request %d in a batch: %s', self.name, items[i][1].id,
                            items[i][0].request_id, describe(out))
                results[i] = (out if isinstance(out, ContractViolation)    # typed as the single path types it
                              else PolicyException(describe(out)))
            else:
                results[i] = (out, elapsed)
        return results

    def _on_batch(self, size: int, seconds: float) -> None:
        self.metrics.batch(self.name, size, seconds)

    def close(self, timeout: float = 5.0) -> None:
        """End running episodes (reason ``shutdown``), stop the inference thread, flush usage."""
        for active in self.running_episodes():
            active.end('shutdown', wait=True)
        self._closing = True
        stuck = self.readiness()[2] == 'failed'  # a policy past its deadline will not return: do not wait
        self.scheduler.stop(0.1 if self.scheduler.wedged is not None else timeout)
        if self._loader is not None:
            self._loader.join(0.1 if stuck else timeout)
        for host in (self._instance, self._instance_loading):
            if host is not None:
                host.close(timeout=0.1 if stuck else min(timeout, 2.0))
        try:
            self.usage.flush()
        except Exception as exc:  # stopping goes on; the counts that could not be written are named
            LOG.error('usage of %s not written at stop (%s): %s', self.name, exc, self.usage.snapshot())

