"""A LeRobot ``Robot`` as the client's ``observe``/``act``: ``connect(model=...).run(bot.observe, bot.act, ...)``.

LeRobot robots (``lerobot.robots.Robot``: SO-100/101, Koch, LeKiwi, ...) speak flat dicts:
``get_observation()`` returns ``{'shoulder_pan.pos': float, ..., 'front': uint8 (H, W, 3)}`` and
``send_action({'shoulder_pan.pos': float, ...})`` commands them; ``observation_features`` and
``action_features`` describe the keys. :class:`LeRobotRobot` maps those keys onto the policy's contract once,
when it is made, and then converts every observation and action by that map:

- a contract name ``n`` (a state name, an action name) is the robot's key ``n``, else ``n + '.pos'`` (LeRobot's
  motor position keys), else the name given in ``state_keys``/``action_keys``;
- a contract camera ``k`` is the robot's key ``k``, else the one given in ``camera_keys``.

Nothing from LeRobot is imported here: a robot is used through those two methods and two dicts, so this module
needs no torch, and any object that has them works (a test double, a robot of your own).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from sequence_ai_ros.exceptions import ContractViolation
from sequence_ai_ros.protocol.contract import Contract
from sequence_ai_ros.protocol.types import Action, ImageLike, Observation

#: The suffix LeRobot gives a motor's position in its observation and action keys.
POSITION_SUFFIX = '.pos'


def _resolve(names: tuple[str, ...], keys: Mapping[str, Any], given: Mapping[str, str], what: str) -> list[str]:
    """The robot's key for each contract name: ``given[name]``, else ``name``, else ``name + '.pos'``.

    :raises ContractViolation: naming every contract name the robot has no key for, and the keys it has.
    """
    out, missing = [], []
    for name in names:
        for key in (given.get(name), name, name + POSITION_SUFFIX):
            if key is not None and key in keys:
                out.append(key)
                break
        else:
            missing.append(name)
    if missing:
        raise ContractViolation(f'the robot has no {what} for {missing} (it has {sorted(keys)}); pass '
                                f'{what.replace(" ", "_")}s={{contract name: robot key}}')
    return out


class LeRobotRobot:
    """Drive a LeRobot ``Robot`` from a served policy.

    ``observe()`` reads ``robot.get_observation()`` into an :class:`~sequence_ai_ros.protocol.types.Observation`
    in the contract's order; ``act(action)`` sends the action's values by name with ``robot.send_action``;
    ``hold()`` sends the last action again (for ``on_underrun=``).

    :param robot: a connected LeRobot robot (``get_observation()``, ``send_action(dict)``,
        ``observation_features``, ``action_features``), or any object with them.
    :param contract: the policy's contract, ``Policy.contract``: its ``observation.state_names``,
        ``observation.cameras`` and ``action_names`` are looked up in the robot's features.
    :param state_keys: {contract state name: robot observation key} where the names differ.
    :param action_keys: {contract action name: robot action key} where the names differ.
    :param camera_keys: {contract camera key: robot observation key} where the names differ.
    :param instruction: the task, sent with each observation (``act()`` overwrites it with its own).
    :raises ContractViolation: when the robot lacks a key for a state name, action name or camera.
    """

    def __init__(self, robot: Any, contract: Contract, *, state_keys: Mapping[str, str] | None = None,
                 action_keys: Mapping[str, str] | None = None, camera_keys: Mapping[str, str] | None = None,
                 instruction: str = '') -> None:
        self.robot = robot
        self.contract = contract
        self.instruction = instruction
        obs_features = dict(robot.observation_features)
        self.state_names = tuple(contract.observation.state_names)
        self._state_keys = _resolve(self.state_names, obs_features, state_keys or {}, 'state key')
        cams = tuple(c.key for c in contract.observation.cameras)
        self._camera_keys = dict(zip(cams, _resolve(cams, obs_features, camera_keys or {}, 'camera key'),
                                     strict=True))
        self._action_keys = _resolve(tuple(contract.action_names), dict(robot.action_features), action_keys or {},
                                     'action key')
        self._last: dict[str, float] | None = None

    def observe(self) -> Observation:
        """Read the robot: its state (float32 (D,), contract order) and camera frames (uint8 (H, W, 3)).

        :raises ContractViolation: when the robot's observation lacks a mapped key or has a non-finite value.
        """
        raw = self.robot.get_observation()
        try:
            state = np.array([float(raw[k]) for k in self._state_keys], dtype=np.float32)
            images: dict[str, ImageLike] = {cam: np.asarray(raw[key]) for cam, key in self._camera_keys.items()}
        except KeyError as exc:
            raise ContractViolation(f'the robot observation has no {exc.args[0]!r}') from None
        return Observation(state=state, state_names=self.state_names, images=images, instruction=self.instruction)

    def act(self, action: Action) -> None:
        """Send ``action.values`` (float32 (D,), the contract's action units) to the robot by name."""
        command = {key: float(v) for key, v in zip(self._action_keys, action.values, strict=True)}
        self._last = command
        self.robot.send_action(command)

    def hold(self) -> None:
        """Send the last action again (nothing before the first): the arm stays where it was commanded."""
        if self._last is not None:
            self.robot.send_action(dict(self._last))


__all__ = ['POSITION_SUFFIX', 'LeRobotRobot']
