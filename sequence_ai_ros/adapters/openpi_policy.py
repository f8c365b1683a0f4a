"""An openpi-client ``BasePolicy`` served by the worker: openpi's runtime, agents and environments, unchanged.

openpi robots run ``Runtime(environment, PolicyAgent(policy), ...)``, where ``policy.infer(obs)`` answers
``{'actions': ...}``; with a remote model the policy is ``ActionChunkBroker(WebsocketClientPolicy(...),
action_horizon)``, which asks the server for a chunk and hands it out one row per step. :class:`SequencePolicy`
takes that place: each ``infer(obs)`` returns the action for this step, ``{'actions': float32 (D,)}``, from the
client's chunk engine, which requests the next chunk while the current one plays (prefetch), skips stale rows
and resamples to the step period, so the runtime never waits on the network after the first chunk.
``reset()`` (the runtime calls it at each episode start) ends the episode; the next ``infer`` opens one.
An episode that fails (the worker lost or erring, a malformed chunk, an observation the contract refuses)
makes ``infer`` raise its typed error at once, before or after its first chunk: the robot keeps its last
command, as openpi's runtime stops on the exception.

The openpi observation dict maps onto the contract: the state from ``obs[state_key]`` (float (D,), the
contract's order), each contract camera from ``obs[images_key][camera]`` or ``obs[camera]`` (uint8, HWC or
openpi's CHW), the instruction from ``obs[prompt_key]``.

Needs ``openpi-client`` (``pip install --no-deps openpi-client==0.1.2``: it declares numpy<2, which this
module does not need); without it, importing this module raises :class:`~sequence_ai_ros.exceptions.MissingDependency`.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from sequence_ai_ros.client.outcome import FAILED_REASONS, RunOutcome
from sequence_ai_ros.client.pacing import ThreadGuard
from sequence_ai_ros.client.policy import Policy
from sequence_ai_ros.client.settings import check_positive
from sequence_ai_ros.exceptions import ContractViolation, MissingDependency, PolicyException, SequenceAIError
from sequence_ai_ros.protocol.codec import ValueKindViolation, numbers
from sequence_ai_ros.protocol.types import Observation

try:
    from openpi_client.base_policy import BasePolicy
except ImportError as exc:  # pragma: no cover - the message is the point
    raise MissingDependency('sequence_ai_ros.adapters.openpi_policy needs openpi-client: '
                            f'pip install --no-deps openpi-client==0.1.2 ({exc})') from None

class _InferGuard(ThreadGuard):
    RULE = ('one thread per SequencePolicy: a second thread called infer()/reset() while {owner!r} is inside it; '
            'openpi runs one agent per robot loop')


def _hwc(image: Any) -> Any:
    """An image as the client takes it: uint8 (H, W, 3) from openpi's CHW (3, H, W); bytes untouched.

    A value numpy cannot convert is handed on as it is: the client refuses it, naming the camera.
    """
    if isinstance(image, (bytes, bytearray)):
        return bytes(image)
    try:
        arr = np.asarray(image)
    except Exception:
        return image
    if arr.ndim == 3 and arr.shape[0] in (1, 3) and arr.shape[-1] not in (1, 3):
        arr = np.transpose(arr, (1, 2, 0))
    return np.ascontiguousarray(arr)


class SequencePolicy(BasePolicy):
    """``BasePolicy.infer(obs) -> {'actions': float32 (D,)}`` from a deployment served by ``seq serve``.

    :param policy: a connected :class:`~sequence_ai_ros.client.Policy` (``sequence_ai.connect(model=...)``); this
        object does not close it.
    :param control_period: the runtime's step period (s), ``1 / max_hz``; the chunk is read at this period.
        None: the chunk's own dt.
    :param state_key: the observation key of the state vector.
    :param images_key: the key of the camera dict; a camera missing there is looked up at the top level.
    :param prompt_key: the key of the instruction.
    :param first_chunk_timeout: how long the first ``infer`` of an episode waits for the first chunk (s).
    :raises TypeError: for a control_period or first_chunk_timeout that is not a number.
    :raises ValueError: for one that is not finite and > 0.

    ``infer`` raises:

    - :class:`ContractViolation` for an observation the contract refuses (not a dict, a missing key, a state
      that is not a finite (D,) vector, ``images`` that is not a dict, a frame that is no uint8 image, a prompt
      that is not text), and for a malformed chunk from the worker;
    - :class:`PolicyException` when no chunk came within ``first_chunk_timeout``, or the policy raised;
    - the episode's own typed error (:class:`~sequence_ai_ros.exceptions.ConnectionLost`,
      :class:`~sequence_ai_ros.exceptions.NotReady`...) once the episode failed, before or after its first chunk;
    - RuntimeError when another thread is inside ``infer``/``reset``.

    An episode whose first ``infer`` raised is ended (reason ``error``): the next ``infer`` opens a new one.
    """

    def __init__(self, policy: Policy, *, control_period: float | None = None, state_key: str = 'state',
                 images_key: str = 'images', prompt_key: str = 'prompt', first_chunk_timeout: float = 30.0) -> None:
        check_positive('control_period', control_period)
        check_positive('first_chunk_timeout', first_chunk_timeout, required=True)
        self._guard = _InferGuard('SequencePolicy')
        self.policy = policy
        self.control_period = control_period
        self.state_key, self.images_key, self.prompt_key = state_key, images_key, prompt_key
        self.first_chunk_timeout = first_chunk_timeout
        self._open = False

    def observation(self, obs: Mapping[str, Any]) -> Observation:
        """The openpi observation ``obs`` as an :class:`~sequence_ai_ros.protocol.types.Observation`.

        :raises ContractViolation: for ``obs`` or its images that are not dicts, a missing state or camera, a
            state that is not a finite (D,) vector of numbers, or a prompt that is not text; a state of complex,
            string, bool or object values is a :class:`~sequence_ai_ros.protocol.codec.ValueKindViolation`
            naming its key.
        """
        contract = self.policy.contract
        if not isinstance(obs, Mapping):
            raise ContractViolation(f'an openpi observation is a dict, not {type(obs).__name__}')
        if self.state_key not in obs:
            raise ContractViolation(f'openpi observation has no {self.state_key!r} (keys: {sorted(map(str, obs))})')
        images_in = obs.get(self.images_key)
        if images_in is None:
            images_in = {}
        elif not isinstance(images_in, Mapping):
            raise ContractViolation(f'openpi observation {self.images_key!r} is a {type(images_in).__name__}; a dict '
                                    '{camera: image} is required')
        images = {}
        for cam in contract.observation.cameras:
            image = images_in.get(cam.key, obs.get(cam.key))
            if image is None:
                raise ContractViolation(f'openpi observation has no image {cam.key!r} in {self.images_key!r} '
                                        'or at the top level')
            images[cam.key] = _hwc(image)
        try:   # complex, string, bool or object values are refused naming the key, never cut or cast to numbers
            state = numbers(obs[self.state_key], self.state_key)
        except ValueKindViolation as exc:
            raise ValueKindViolation(self.state_key, exc.kind, f'openpi observation {self.state_key!r} is not a '
                                     f'vector of numbers: {exc.kind} values are refused') from None
        return Observation(state=state, state_names=contract.observation.state_names, images=images,
                           instruction=self._prompt(obs.get(self.prompt_key)))

    def _prompt(self, value: Any) -> str:
        """The instruction: a str, bytes (UTF-8) or a one-element array of one; '' for None."""
        if isinstance(value, np.ndarray) and value.size == 1:
            value = value.item()
        if value is None:
            return ''
        if isinstance(value, bytes):
            return value.decode('utf-8', errors='replace')
        if not isinstance(value, str):
            raise ContractViolation(f'openpi observation {self.prompt_key!r} is a {type(value).__name__}, not text')
        return value

    def infer(self, obs: dict) -> dict:
        """Return ``{'actions': float32 (D,), 'hold': bool}``: the action for this step (``hold``: an underrun).

        The first call of an episode opens it and waits for its first chunk (the arm has nothing to do
        before it); every later call returns at once. Errors: see the class.
        """
        with self._guard:
            observation = self.observation(obs)
            if not self._open:
                self.policy.begin_episode(observation.instruction, control_period=self.control_period)
                self._open = True
                try:
                    action = self._first(observation)
                except BaseException as exc:     # the worker hears how it ended; the next infer opens a new one
                    self.policy.end_episode('error' if isinstance(exc, Exception) else 'interrupted')
                    self._open = False
                    raise
            else:
                action = self.policy.next_action(observation)
                self._raise_failure()
                if action is None:
                    raise PolicyException('the episode has no action to hold (it ended before its first chunk)')
            return {'actions': np.asarray(action.values, dtype=np.float32), 'hold': bool(action.hold)}

    def _first(self, observation: Observation) -> Any:
        """The first action of the episode: hold at the step period until the first chunk is in, as a robot loop would.

        :raises SequenceAIError: the episode's error when it fails first; PolicyException after ``first_chunk_timeout``.
        """
        period = self.control_period or self.policy.contract.dt
        deadline = time.monotonic() + self.first_chunk_timeout
        action = self.policy.next_action(observation)
        while self.policy.chunk_horizon() is None:
            self._raise_failure()
            if time.monotonic() > deadline:
                raise PolicyException(f'no chunk within {self.first_chunk_timeout:g} s of the episode start')
            time.sleep(period)
            action = self.policy.next_action(observation)
        self._raise_failure()
        if action is None:
            raise PolicyException('the episode ended before its first chunk')
        return action

    def _raise_failure(self) -> None:
        """Raise the episode's typed error when it failed (reason error or validate)."""
        out: RunOutcome | None = self.policy.episode_outcome()
        if out is not None and out.reason in FAILED_REASONS:
            if isinstance(out.error, SequenceAIError):
                raise out.error
            raise PolicyException(f'episode {out.episode_id} ended with reason {out.reason!r}')

    def reset(self) -> None:
        """End the open episode (openpi's runtime calls this at each episode start); the next infer opens one."""
        with self._guard:
            if self._open:
                self.policy.end_episode()
                self._open = False


__all__ = ['SequencePolicy']
