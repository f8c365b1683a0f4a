"""The policy authoring API: ``@seq.policy``, ``@seq.on_episode``, :class:`Episode`, :class:`Result`, :class:`Batching`.

A ``policy.py`` declares one class::

    import sequence_ai_ros.policy as seq

    @seq.policy(action_space='joint_absolute', action_names=['j0', 'j1'], dt=1 / 30, chunk_length=30,
                observation=seq.ObservationContract(state_names=['j0', 'j1'], history=1))
    class Hold:
        def load(self) -> None: ...                      # optional warm step (not billed)
        def infer(self, inp: seq.PolicyInput, episode: seq.Episode) -> np.ndarray: ...

A policy whose contract depends on its config (``config.yaml`` beside policy.py, passed as constructor
kwargs) adds a cheap classmethod ``configure_contract(cls, contract, config) -> seq.Contract``; the
handshake answers with that contract before the constructor runs.

A policy whose cost per request falls with batch size (a GPU model, a vectorised numpy model) declares
``batching=seq.Batching(max_batch_size=8, max_wait_s=0.005)`` and adds ``infer_batch``::

        def infer_batch(self, inputs: list[seq.PolicyInput], episodes: list[seq.Episode]) -> list[np.ndarray]:
            ...                                          # one (T, D) chunk (or Result) per input, same order
                                                         # (an exception instance fails that request alone)

The worker then gathers pending requests of *different* episodes (each episode has at most one request in
flight) into one ``infer_batch`` call, see :class:`Batching`. ``infer`` stays required: ``seq deploy``'s dry
run and single calls use it (``return self.infer_batch([inp], [episode])[0]`` is a fine body).

The decorator validates the contract at import time, so ``seq deploy`` rejects a bad one before anything
runs. ``frames_per_chunk`` is retired and rejected with a message naming its replacements.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from sequence_ai_ros.exceptions import ConfigError
from sequence_ai_ros.protocol.contract import Contract, ObservationContract
from sequence_ai_ros.protocol.spaces import ActionSpace

#: attribute the decorator sets on the class (a :class:`PolicySpec`).
SPEC_ATTR = '__seq_policy__'
#: attribute ``@seq.on_episode`` sets on the hook function.
HOOK_ATTR = '__seq_on_episode__'

_RETIRED = {
    'frames_per_chunk': ('frames_per_chunk is retired: use chunk_length=<actions per chunk> for the action '
                         'horizon, or observation=seq.ObservationContract(history=N) to receive the last N frames'),
}


#: :attr:`Episode.deployment` of ``seq deploy``'s dry-run episodes (synthetic requests, no robot)
DRY_RUN_DEPLOYMENT = 'dry-run'


@dataclasses.dataclass
class Episode:
    """One episode as a policy sees it; the worker keeps one per ``x-episode-id``.

    :param id: the episode id (from the robot's ``x-episode-id``).
    :param instruction: the task in natural language, as given at EpisodeStart.
    :param state: a dict the policy may use for per-episode state (a streaming policy's memory);
        it belongs to this episode only, so one robot never resets another.
    :param reason: why the episode ended (``completed``, ``disconnect``, ``idle_timeout``...), set before
        the ``@seq.on_episode`` hook runs; None while running.
    :param started: ``time.monotonic()`` at the start (s).
    :param deployment: the deployment serving it (:data:`DRY_RUN_DEPLOYMENT` in ``seq deploy``'s dry run).
    """

    id: str
    instruction: str = ''
    state: dict[str, Any] = dataclasses.field(default_factory=dict)
    reason: str | None = None
    started: float = dataclasses.field(default_factory=time.monotonic)
    deployment: str = ''


@dataclasses.dataclass
class Result:
    """What ``infer`` may return instead of a bare array.

    :param actions: float32 (T, D) action chunk, T >= 1, D = the contract's action dimension.
    :param done: True when the policy considers the task complete (sent as ``ActionChunk.done``).
    """

    actions: np.ndarray
    done: bool = False


@dataclasses.dataclass(frozen=True)
class Batching:
    """How a policy takes batches: ``infer_batch(inputs, episodes)`` gets up to ``max_batch_size`` requests.

    The requests of one batch come from different episodes.

    Gathering: when the inference thread is free it takes the oldest pending request and waits until
    ``max_wait_s`` after that request's arrival for more (it stops waiting once ``max_batch_size`` are
    pending), then calls ``infer_batch`` on the oldest ``max_batch_size`` pending requests. Requests are
    taken in arrival order and each episode has at most one request pending, so no episode starves: a
    waiting request is in one of the next ``ceil(pending / max_batch_size)`` batches. Episode-end hooks
    still run between batches on the same thread; per-episode state (``episode.state``), streaming and
    ``@seq.on_episode`` are exactly as without batching.

    Errors: an exception raised by ``infer_batch`` fails every request of that batch with POLICY_EXCEPTION;
    an exception instance returned in place of a chunk (e.g. ``PolicyException('too few frames')``) fails
    only its own request with POLICY_EXCEPTION; a malformed chunk fails only its own request
    (CONTRACT_VIOLATION); a returned list whose length is not the batch's fails the batch.

    :param max_batch_size: most requests per ``infer_batch`` call, >= 1.
    :param max_wait_s: longest time (s) the oldest request waits for others to join, >= 0; it adds at most
        this much latency when the worker is lightly loaded (0: batch only what is already queued).
    :raises ConfigError: for a size < 1 or a negative or non-finite wait.
    """

    max_batch_size: int = 8
    max_wait_s: float = 0.005

    def __post_init__(self) -> None:
        if not (isinstance(self.max_batch_size, int) and not isinstance(self.max_batch_size, bool)
                and self.max_batch_size >= 1):
            raise ConfigError(f'Batching.max_batch_size must be an integer >= 1, got {self.max_batch_size!r}')
        if not (isinstance(self.max_wait_s, (int, float)) and 0 <= self.max_wait_s < float('inf')):
            raise ConfigError(f'Batching.max_wait_s must be a finite number of seconds >= 0, got {self.max_wait_s!r}')


@dataclasses.dataclass(frozen=True)
class PolicySpec:
    """What ``@seq.policy`` recorded about a class.

    :param contract: the contract declared by the decorator (before per-deployment config).
    :param hook: name of the ``@seq.on_episode`` method, or None.
    :param config_file: optional YAML file (relative to policy.py) with constructor kwargs.
    :param batching: how the policy takes batches (it has ``infer_batch``), or None (one request per call).
    """

    contract: Contract
    hook: str | None = None
    config_file: str | None = None
    batching: Batching | None = None


def on_episode(func: Callable[[Any, Episode], None]) -> Callable[[Any, Episode], None]:
    """Mark the method that runs exactly once when an episode ends (explicit end, disconnect, idle).

    The method receives the ended :class:`Episode` (``episode.reason`` is set). A ``streaming=True``
    policy must have one, to free the episode's state.
    """
    setattr(func, HOOK_ATTR, True)
    return func


def policy(*, action_space: str | ActionSpace, action_names: Sequence[str], dt: float, chunk_length: int,
           observation: ObservationContract | None = None, streaming: bool = False, gripper: str = '',
           config_file: str | None = None, batching: Batching | None = None,
           **retired: Any) -> Callable[[type], type]:
    """Declare a policy class and its contract.

    :param action_space: ``joint_absolute``, ``joint_delta``, ``joint_velocity``, ``ee_absolute`` or
        ``ee_delta``.
    :param action_names: names of the D action dimensions, in order.
    :param dt: action period (s).
    :param chunk_length: actions per chunk T (the action horizon).
    :param observation: cameras, state names and history N the robot must send.
    :param streaming: True for a stateful policy (keeps per-episode state; needs ``@seq.on_episode``).
    :param gripper: how the gripper channel is handled, in words.
    :param config_file: YAML file (relative to the policy file) whose mapping is passed as constructor
        kwargs; default ``config.yaml`` beside the policy file when it exists.
    :param batching: a :class:`Batching` to receive requests of several episodes in one ``infer_batch`` call.
    :raises ConfigError: for a retired or unknown argument (``frames_per_chunk`` names its replacement),
        a class without ``infer``, a batching class without ``infer_batch``, or a streaming policy without
        an ``@seq.on_episode`` hook.
    :raises ContractViolation: for an invalid contract (dt <= 0, duplicate names, ...).
    """
    for key in retired:
        if key in _RETIRED:
            raise ConfigError(_RETIRED[key])
    if retired:
        raise ConfigError(f'seq.policy: unknown arguments {sorted(retired)}; known: action_space, action_names, '
                          'dt, chunk_length, observation, streaming, gripper, config_file, batching')
    if batching is not None and not isinstance(batching, Batching):
        raise ConfigError(f'seq.policy: batching must be a seq.Batching(max_batch_size=..., max_wait_s=...), '
                          f'got {type(batching).__name__}')
    try:
        space = ActionSpace.parse(action_space)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    # action_names and chunk_length go to Contract as given: it refuses a plain string of names and a
    # non-integer horizon (int() here would silently truncate 2.7 to 2).
    contract = Contract(action_space=space, action_names=action_names, dt=float(dt),
                        chunk_length=chunk_length, observation=observation or ObservationContract(),
                        streaming=bool(streaming), gripper=gripper)

    def decorate(cls: type) -> type:
        if not isinstance(cls, type):
            raise ConfigError('@seq.policy decorates a class')
        if not callable(getattr(cls, 'infer', None)):
            raise ConfigError(f'{cls.__name__}: a policy needs an infer(self, inp, episode) method')
        if batching is not None and not callable(getattr(cls, 'infer_batch', None)):
            raise ConfigError(f'{cls.__name__}: batching=seq.Batching(...) needs an '
                              'infer_batch(self, inputs, episodes) method returning one chunk per input')
        hooks = [name for name in dir(cls) if getattr(getattr(cls, name, None), HOOK_ATTR, False)]
        if len(hooks) > 1:
            raise ConfigError(f'{cls.__name__}: more than one @seq.on_episode hook: {hooks}')
        if contract.streaming and not hooks:
            raise ConfigError(f'{cls.__name__}: streaming=True needs a method decorated @seq.on_episode that '
                              "frees the episode's state (it runs exactly once per episode end)")
        setattr(cls, SPEC_ATTR, PolicySpec(contract=contract, hook=hooks[0] if hooks else None,
                                           config_file=config_file, batching=batching))
        return cls

    return decorate


def spec_of(cls: type) -> PolicySpec | None:
    """Return the :class:`PolicySpec` of a ``@seq.policy`` class, or None for any other object."""
    spec = getattr(cls, SPEC_ATTR, None)
    return spec if isinstance(spec, PolicySpec) else None
