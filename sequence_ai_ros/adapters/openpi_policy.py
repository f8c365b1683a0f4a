"""An openpi-client ``BasePolicy`` served by the worker: openpi's runtime, agents and environments, unchanged.

openpi robots run ``Runtime(environment, PolicyAgent(policy), ...)``, where ``policy.infer(obs)`` answers
``{'actions': ...}``; with a remote model the policy is ``ActionChunkBroker(WebsocketClientPolicy(...),
action_horizon)``, which asks the server for a chunk and hands it out one row per step. :class:`SequencePolicy`
takes that place: each ``infer(obs)`` returns the action for this step, ``{'actions': float32 (D,)}``, from the
client's chunk engine, which requests the next chunk while the current one plays (prefetch), skips stale rows
and resamples to the step period, so the runtime never waits on the network after the first chunk.
``reset()`` (the runtime calls it at each episode start) ends the episode; the next ``infer`` opens one.

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

from sequence_ai_ros.client.policy import Policy
from sequence_ai_ros.exceptions import ContractViolation, MissingDependency, PolicyException
from sequence_ai_ros.protocol.types import Observation

try:
    from openpi_client.base_policy import BasePolicy
except ImportError as exc:  # pragma: no cover - the message is the point
    raise MissingDependency('sequence_ai_ros.adapters.openpi_policy needs openpi-client: '
                            f'pip install --no-deps openpi-client==0.1.2 ({exc})') from None

def _hwc(image: Any) -> Any:
    """An image as the client takes it: uint8 (H, W, 3) from openpi's CHW (3, H, W); bytes untouched."""
    if isinstance(image, (bytes, bytearray)):
        return bytes(image)
    arr = np.asarray(image)
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
    :raises ContractViolation: from ``infer`` for an observation the contract refuses (a missing key, a wrong size).
    :raises PolicyException: from ``infer`` when no chunk came within ``first_chunk_timeout``.
    """

    def __init__(self, policy: Policy, *, control_period: float | None = None, state_key: str = 'state',
                 images_key: str = 'images', prompt_key: str = 'prompt', first_chunk_timeout: float = 30.0) -> None:
        self.policy = policy
        self.control_period = control_period
        self.state_key, self.images_key, self.prompt_key = state_key, images_key, prompt_key
        self.first_chunk_timeout = first_chunk_timeout
        self._open = False

    def observation(self, obs: Mapping[str, Any]) -> Observation:
        """The openpi observation ``obs`` as an :class:`~sequence_ai_ros.protocol.types.Observation`."""
        contract = self.policy.contract
        if self.state_key not in obs:
            raise ContractViolation(f'openpi observation has no {self.state_key!r} (keys: {sorted(obs)})')
        images_in = obs.get(self.images_key) or {}
        images = {}
        for cam in contract.observation.cameras:
            image = images_in.get(cam.key, obs.get(cam.key))
            if image is None:
                raise ContractViolation(f'openpi observation has no image {cam.key!r} in {self.images_key!r} '
                                        'or at the top level')
            images[cam.key] = _hwc(image)
        return Observation(state=np.asarray(obs[self.state_key], dtype=np.float32),
                           state_names=contract.observation.state_names, images=images,
                           instruction=str(obs.get(self.prompt_key) or ''))

    def infer(self, obs: dict) -> dict:
        """Return ``{'actions': float32 (D,), 'hold': bool}``: the action for this step (``hold``: an underrun).

        The first call of an episode opens it and waits for its first chunk (the arm has nothing to do
        before it); every later call returns at once.
        """
        observation = self.observation(obs)
        if not self._open:
            self.policy.begin_episode(observation.instruction, control_period=self.control_period)
            self._open = True
            # Hold at the step period until the first chunk is in, as a robot loop would: each wait is a held tick.
            period = self.control_period or self.policy.contract.dt
            deadline = time.monotonic() + self.first_chunk_timeout
            action = self.policy.next_action(observation)
            while self.policy.chunk_horizon() is None:
                if time.monotonic() > deadline:
                    raise PolicyException(f'no chunk within {self.first_chunk_timeout:g} s of the episode start')
                time.sleep(period)
                action = self.policy.next_action(observation)
            if action is None:
                raise PolicyException('the episode ended before its first chunk')
        else:
            action = self.policy.next_action(observation)
            if action is None:
                raise PolicyException('the episode has no action to hold (it ended before its first chunk)')
        return {'actions': np.asarray(action.values, dtype=np.float32), 'hold': bool(action.hold)}

    def reset(self) -> None:
        """End the open episode (openpi's runtime calls this at each episode start); the next infer opens one."""
        if self._open:
            self.policy.end_episode()
            self._open = False


__all__ = ['SequencePolicy']
