"""``seq deploy``'s dry run: construct, warm and call a policy once on a synthetic observation.

The synthetic observation matches the contract exactly: a zero state of the contract's dimension with its
names, a black frame per camera at the declared size (224x224 when the size is free) in the declared
encoding, and ``history`` frames. It goes through the real wire path (``pack_observation`` then
``unpack_observation``), so what the policy receives at deploy is what it will receive from a robot.
A second request of the same episode carries the unexecuted half of the first chunk as ``chunk_tail`` with an
expected delay, as a streaming robot sends them, so a policy whose in-painting path (RTC) fails is refused here.
"""

from __future__ import annotations

import threading
import time
import traceback
from typing import Any

import numpy as np

from sequence_ai_ros.exceptions import DeploymentError, MissingDependency
from sequence_ai_ros.policy.api import DRY_RUN_DEPLOYMENT, Episode, Result
from sequence_ai_ros.policy.loader import PolicyDefinition
from sequence_ai_ros.protocol import messages
from sequence_ai_ros.protocol.contract import Contract
from sequence_ai_ros.protocol.types import ImageLike, Observation
from sequence_ai_ros.worker import content
from sequence_ai_ros.worker.config import DRY_RUN_TIMEOUT_S
from sequence_ai_ros.worker.content import Fingerprint


def synthetic_observation(contract: Contract, timestamp: float = 0.0) -> Observation:
    """Return an observation that matches ``contract`` (zero state, black frames)."""
    obs = contract.observation
    images: dict[str, ImageLike] = {c.key: np.zeros((c.height or 224, c.width or 224, 3), np.uint8)
                                    for c in obs.cameras}
    dim = obs.state_dim or contract.action_dim
    return Observation(state=np.zeros(dim, np.float32), state_names=obs.state_names, images=images,
                       instruction='seq deploy dry run', timestamp=timestamp)


def synthetic_request(contract: Contract, episode_id: str = 'seq-deploy-dry-run', request_id: int = 1,
                      chunk_tail: np.ndarray | None = None, expected_delay_actions: int = 0) -> Any:
    """Return a ``pb.ObservationRequest`` built from :func:`synthetic_observation` (with history).

    :param chunk_tail: float32 (K, D) the unexecuted rows of the previous chunk, or None.
    :param expected_delay_actions: rows of ``chunk_tail`` the robot runs before the answer is read.
    """
    history = [synthetic_observation(contract, timestamp=-contract.dt * (k + 1))
               for k in reversed(range(contract.observation.history - 1))]
    return messages.pack_observation(synthetic_observation(contract), contract, episode_id=episode_id,
                                     request_id=request_id, history=history, chunk_tail=chunk_tail,
                                     expected_delay_actions=expected_delay_actions)


#: What ``signal.signal`` says off a process's main thread (CPython's words).
_SIGNAL_OFF_MAIN = 'signal only works in main thread'
#: What to do about it: under ``--isolation process`` a policy's calls run on its deployment process's main thread.
SIGNAL_HINT = ('signal.signal() works only on a process\'s main thread, and this policy code ran on a worker '
               'thread (--isolation none): deploy and serve with --isolation process (the default), where '
               '__init__, load(), infer and the episode hook run on the deployment process\'s main thread, or '
               'install signal handlers only when threading.current_thread() is threading.main_thread()')


def signal_words(exc: BaseException) -> str:
    """:data:`SIGNAL_HINT` when ``exc`` is ``signal.signal``'s refusal off the main thread, else ``''``."""
    return SIGNAL_HINT if isinstance(exc, ValueError) and _SIGNAL_OFF_MAIN in str(exc) else ''


def _fail(what: str, exc: BaseException) -> DeploymentError:
    if isinstance(exc, MissingDependency):
        return DeploymentError(f'{what}: missing dependency: {exc}')
    last = ''.join(traceback.format_exception_only(type(exc), exc)).strip()
    hint = signal_words(exc)
    return DeploymentError(f'{what}: {last}' + (f' ({hint})' if hint else ''))


def overran_words(bound_s: float, step: str) -> str:
    """The message of a dry run that ran past ``bound_s`` while ``step`` ran."""
    return (f'dry run exceeded {bound_s:g} s while {step}: the policy hangs or is too slow (raise the bound with '
            'seq deploy --timeout S)')


def _dry_batch(instance: Any, contract: Contract, inp: Any, step: list[str], tail: bool) -> None:
    """Call ``infer_batch`` with the synthetic request of two episodes; each result must be a valid chunk.

    :param tail: the single pass sent a chunk tail: a second batched call then carries each episode's own
        tail (the unexecuted half of its first chunk, as in the single pass), so a batched in-painting path
        that fails is refused too.
    """
    episodes = [Episode(id=f'dry-run-{k}', instruction='seq deploy dry run', deployment=DRY_RUN_DEPLOYMENT)
                for k in (1, 2)]
    what = 'dry batched inference'
    outs = _batch_pass(instance, contract, [inp, inp], episodes, what, step)
    if not tail:
        return
    inputs, rows = [], 0
    for out in outs:
        chunk = np.asarray(out.actions if isinstance(out, Result) else out, np.float32).reshape(-1, contract.action_dim)
        rest = chunk[len(chunk) // 2:]
        rows, delay = len(rest), max(1, len(rest) // 2)
        inputs.append(messages.unpack_observation(synthetic_request(contract, request_id=2, chunk_tail=rest,
                                                                    expected_delay_actions=delay), contract))
    if rows:
        _batch_pass(instance, contract, inputs, episodes, f'dry batched inference with a chunk tail ({rows} rows)',
                    step)


def _batch_pass(instance: Any, contract: Contract, inputs: list[Any], episodes: list[Episode], what: str,
                step: list[str]) -> list[Any]:
    step[0] = f'running the {what} (infer_batch of {len(inputs)})'
    try:
        outs = list(instance.infer_batch(inputs, episodes))
    except BaseException as exc:
        raise _fail(f'{what} failed', exc) from exc
    if len(outs) != len(inputs):
        raise _fail(f'{what} failed', ValueError(f'infer_batch returned {len(outs)} chunks for {len(inputs)} '
                                                 'inputs'))
    for k, out in enumerate(outs):
        if isinstance(out, BaseException):
            raise _fail(f'{what} failed', out)
        try:
            messages.pack_chunk(np.asarray(out.actions if isinstance(out, Result) else out), contract,
                                request_id=1, episode_id=episodes[k].id, robot_time_s=0.0)
        except Exception as exc:
            raise _fail(f'{what} returned a bad chunk', exc) from exc
    return outs


def dry_run(definition: PolicyDefinition, timeout_s: float | None = DRY_RUN_TIMEOUT_S,
            said_s: float | None = None, step: list[str] | None = None) -> dict[str, float]:
    """Construct, load and call the policy once; check its chunk; all within ``timeout_s``.

    The steps run in the thread ``seq-dry-run``, joined with ``timeout_s``. A policy that hangs cannot be
    interrupted (Python threads cannot be killed): the thread is a daemon, left behind, and the caller
    (``seq deploy``, a short-lived process) gets the error at once. Given ``step``, they run on the calling
    thread instead, unbounded (a deployment process's main thread, whose deadline ends the process), and
    ``step[0]`` names the step running, for the caller's overrun message (:func:`overran_words`).

    :param timeout_s: bound of the whole dry run (s); None waits forever.
    :param said_s: the bound the message names (default ``timeout_s``): the whole deploy's, when the
        import already took part of it.
    :return: ``{'load_s': ..., 'infer_s': ..., 'chunk_length': T}``.
    :raises DeploymentError: naming the step that failed (construct, load, infer, chunk, on_episode),
        with the missing dependency when that is the cause, or the step that was running when
        ``timeout_s`` passed.
    """
    if timeout_s is not None and not timeout_s > 0:
        raise DeploymentError(f'the dry run timeout must be > 0 s, got {timeout_s}')
    if step is not None:
        step[0] = 'constructing the policy'
        try:
            return _dry_run(definition, step)
        except DeploymentError:
            raise
        except BaseException as exc:
            raise _fail(f'dry run failed while {step[0]}', exc) from exc
    step = ['constructing the policy']
    outcome: dict[str, Any] = {}

    def work() -> None:
        try:
            outcome['figures'] = _dry_run(definition, step)
        except BaseException as exc:  # handed to the caller below
            outcome['error'] = exc

    thread = threading.Thread(target=work, name='seq-dry-run', daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise DeploymentError(overran_words(said_s or timeout_s or 0.0, step[0]))
    if 'error' in outcome:
        error = outcome['error']
        if isinstance(error, DeploymentError):
            raise error
        raise _fail(f'dry run failed while {step[0]}', error) from error
    return outcome['figures']


def fingerprint_and_dry_run(definition: PolicyDefinition, timeout_s: float | None = DRY_RUN_TIMEOUT_S,
                            said_s: float | None = None, dry: bool = True,
                            step: list[str] | None = None) -> tuple[Fingerprint, dict[str, float]]:
    """``seq deploy``'s checks of an imported policy: its content's fingerprint, then :func:`dry_run`.

    The fingerprint is taken before the dry run, and the files are checked unchanged after it
    (:func:`~sequence_ai_ros.worker.content.changes_since`), so that what the dry run validated is what is
    recorded.

    :param dry: run the dry run (else only the fingerprint; the figures are then empty).
    :param step: run it on the calling thread, naming its step there (:func:`dry_run`).
    :return: the :class:`~sequence_ai_ros.worker.content.Fingerprint` and the dry run's figures.
    :raises DeploymentError: as :func:`dry_run`, or when the policy's files changed during the dry run.
    """
    fp = content.fingerprint(definition)
    figures = dry_run(definition, timeout_s=timeout_s, said_s=said_s, step=step) if dry else {}
    if content.changes_since(definition, fp):
        raise DeploymentError(f'{definition.path}: its files changed during the dry run; deploy again')
    return fp, figures


def _dry_run(definition: PolicyDefinition, step: list[str]) -> dict[str, float]:
    contract = definition.contract
    start = time.monotonic()
    try:
        instance = definition.instantiate()
    except BaseException as exc:
        raise _fail('constructing the policy failed', exc) from exc
    load = getattr(instance, 'load', None)
    step[0] = 'running load()'
    try:
        if callable(load):
            load()
    except BaseException as exc:
        raise _fail('load() failed', exc) from exc
    load_s = time.monotonic() - start
    step[0] = 'building the synthetic observation'
    inp = messages.unpack_observation(synthetic_request(contract), contract)
    episode = Episode(id=inp.episode_id, instruction='seq deploy dry run', deployment=DRY_RUN_DEPLOYMENT)
    start = time.monotonic()
    step[0] = 'running the dry inference'
    try:
        out = instance.infer(inp, episode)
    except BaseException as exc:
        raise _fail('dry inference failed', exc) from exc
    infer_s = time.monotonic() - start
    actions = out.actions if isinstance(out, Result) else out
    try:
        chunk = messages.pack_chunk(np.asarray(actions), contract, request_id=1, episode_id=episode.id,
                                    robot_time_s=0.0)
    except Exception as exc:
        raise _fail('dry inference returned a bad chunk', exc) from exc
    rows = np.asarray(actions, np.float32).reshape(-1, contract.action_dim)
    tail = rows[len(rows) // 2:]
    if len(tail):
        step[0] = 'running the dry inference with a chunk tail (the in-painting path, RTC)'
        delay = max(1, len(tail) // 2)
        second = messages.unpack_observation(synthetic_request(contract, request_id=2, chunk_tail=tail,
                                                               expected_delay_actions=delay), contract)
        try:
            out = instance.infer(second, episode)
        except BaseException as exc:
            raise _fail(f'dry inference with a chunk tail ({len(tail)} rows, expected delay {delay}) failed',
                        exc) from exc
        try:
            messages.pack_chunk(np.asarray(out.actions if isinstance(out, Result) else out), contract,
                                request_id=2, episode_id=episode.id, robot_time_s=0.0)
        except Exception as exc:
            raise _fail('dry inference with a chunk tail returned a bad chunk', exc) from exc
    if definition.spec.batching is not None:
        _dry_batch(instance, contract, inp, step, tail=len(tail) > 0)
    if definition.hook is not None:
        episode.reason = 'completed'
        step[0] = 'running the @seq.on_episode hook'
        try:
            getattr(instance, definition.hook)(episode)
        except BaseException as exc:
            raise _fail('the @seq.on_episode hook failed', exc) from exc
    return {'load_s': load_s, 'infer_s': infer_s, 'chunk_length': float(chunk.actions.shape[0])}
