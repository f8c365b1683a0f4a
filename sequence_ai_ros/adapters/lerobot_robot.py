"""A LeRobot ``Robot`` as the client's ``observe``/``act``: ``connect(model=...).run(bot.observe, bot.act, ...)``.

LeRobot robots (``lerobot.robots.Robot``: SO-100/101, Koch, LeKiwi, ...) speak flat dicts:
``get_observation()`` returns ``{'shoulder_pan.pos': float, ..., 'front': uint8 (H, W, 3)}`` and
``send_action({'shoulder_pan.pos': float, ...})`` commands them; ``observation_features`` and
``action_features`` describe the keys. :class:`LeRobotRobot` maps those keys onto the policy's contract once,
when it is made, and then converts every observation and action by that map:

- a contract name ``n`` (a state name, an action name) is the key given for it in ``state_keys``/``action_keys``,
  else the robot's key ``n``, else ``n + '.pos'`` (LeRobot's motor position keys);
- a contract camera ``k`` is the key given in ``camera_keys``, else the robot's key ``k``.

A given key must be one of the robot's (it is never silently replaced by a lookalike), a mapping may only name
the contract's names, and no robot key serves two state or action names (a command would be lost).

A hold commands no motion: it sends the last command again, with 0 for its rates (LeRobot's ``.vel`` keys, such
as LeKiwi's base, and the rate channels of a joint_velocity or ee_delta contract).

Nothing from LeRobot is imported here: a robot is used through those two methods and two dicts, so this module
needs no torch, and any object that has them works (a test double, a robot of your own).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from sequence_ai_ros.exceptions import ContractViolation
from sequence_ai_ros.protocol.codec import ValueKindViolation, numbers
from sequence_ai_ros.protocol.contract import Contract, clip
from sequence_ai_ros.protocol.spaces import rest_mask
from sequence_ai_ros.protocol.types import Action, ImageLike, Observation

#: The suffix LeRobot gives a motor's position in its observation and action keys.
POSITION_SUFFIX = '.pos'
#: The suffix LeRobot gives a velocity command (LeKiwi's base: ``x.vel``, ``y.vel``, ``theta.vel``).
VELOCITY_SUFFIX = '.vel'
FLOAT32_MAX = float(np.finfo(np.float32).max)


def _resolve(names: tuple[str, ...], keys: Mapping[str, Any], given: Mapping[str, str], what: str,
             unique: bool = True) -> list[str]:
    """The robot's key for each contract name: ``given[name]``, else ``name``, else ``name + '.pos'``.

    :param unique: refuse a robot key that two names resolve to.
    :raises ContractViolation: naming the ``given`` names that are not contract names, the given keys the robot
        lacks, every contract name the robot has no key for (with the keys it has), or a key two names share.
    """
    arg = what.replace(' ', '_') + 's'
    strangers = sorted(set(given) - set(names))
    if strangers:
        raise ContractViolation(f'{arg} maps {strangers}, which the contract does not name (it names {list(names)})')
    absent = {name: key for name, key in given.items() if key not in keys}
    if absent:
        raise ContractViolation(f'{arg} gives {absent}, which the robot does not have (it has {sorted(keys)})')
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
                                f'{arg}={{contract name: robot key}}')
    shared = {key: [n for n, k in zip(names, out, strict=True) if k == key] for key in out if out.count(key) > 1}
    if unique and shared:
        raise ContractViolation(f'one robot {what} serves several contract names: {shared}; pass {arg}= to '
                                'give each its own')
    return out


def _number(raw: Mapping[str, Any], key: str) -> float:
    """The robot's value ``raw[key]`` as a finite float.

    :raises ContractViolation: naming the key, for a missing, non-numeric or non-finite value; a complex,
        string, bool or object value (never cut to its real part nor read as 0/1 or a parsed number) is a
        :class:`~sequence_ai_ros.protocol.codec.ValueKindViolation` naming it.
    """
    try:
        value = raw[key]
    except KeyError:
        raise ContractViolation(f'the robot observation has no {key!r} (it has {sorted(raw)})') from None
    try:
        arr = numbers(value, key, dtype=None)
    except ValueKindViolation as exc:
        raise ValueKindViolation(key, exc.kind, f'the robot observation {key!r} is {clip(repr(value), 60)} '
                                 f'({type(value).__name__}), not a number: {exc.kind} values are refused') from None
    if arr.size != 1:
        raise ContractViolation(f'the robot observation {key!r} is {clip(repr(value), 60)} ({type(value).__name__}), '
                                'not a number')
    number = float(arr.reshape(()))
    if not abs(number) <= FLOAT32_MAX:      # NaN, inf, or beyond float32's range (inf as float32)
        raise ContractViolation(f'the robot observation {key!r} is {number!r}, not a finite float32')
    return number


class LeRobotRobot:
    """Drive a LeRobot ``Robot`` from a served policy.

    ``observe()`` reads ``robot.get_observation()`` into an :class:`~sequence_ai_ros.protocol.types.Observation`
    in the contract's order; ``act(action)`` sends the action's values by name with ``robot.send_action``;
    ``hold()`` sends the last action again, its rates 0 (for ``on_underrun=``).

    :param robot: a connected LeRobot robot (``get_observation()``, ``send_action(dict)``,
        ``observation_features``, ``action_features``), or any object with them.
    :param contract: the policy's contract, ``Policy.contract``: its ``observation.state_names``,
        ``observation.cameras`` and ``action_names`` are looked up in the robot's features.
    :param state_keys: {contract state name: robot observation key} where the names differ.
    :param action_keys: {contract action name: robot action key} where the names differ.
    :param camera_keys: {contract camera key: robot observation key} where the names differ.
    :param instruction: the task, sent with each observation (``act()`` overwrites it with its own).
    :raises ContractViolation: when the robot lacks a key for a state name, action name or camera; when a
        mapping names a name the contract lacks or a key the robot lacks; when two state or action names
        resolve to one robot key.
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
        self._camera_keys = dict(zip(cams, _resolve(cams, obs_features, camera_keys or {}, 'camera key', unique=False),
                                     strict=True))
        self._action_keys = _resolve(tuple(contract.action_names), dict(robot.action_features), action_keys or {},
                                     'action key')
        rates = rest_mask(contract.action_space, len(self._action_keys))
        #: the robot's action keys a hold commands as 0 (rates: commanding them again would keep moving)
        self.rest_keys = frozenset(key for key, rate in zip(self._action_keys, rates, strict=True)
                                   if rate or key.endswith(VELOCITY_SUFFIX))
        self._last: dict[str, float] | None = None

    def observe(self) -> Observation:
        """Read the robot: its state (float32 (D,), contract order) and camera frames (uint8 (H, W, 3)).

        Frames are handed on as the robot gave them; the client checks them and fits them to the contract's
        size (a frame that is no uint8 (H, W, 3) or (H, W) image ends ``run()`` with reason ``validate``).

        :raises ContractViolation: naming the robot's key, when its observation lacks a mapped key, or a state
            value is not a number or not finite.
        """
        raw = self.robot.get_observation()
        state = np.array([_number(raw, k) for k in self._state_keys], dtype=np.float32)
        images: dict[str, ImageLike] = {}
        for cam, key in self._camera_keys.items():
            if key not in raw:
                raise ContractViolation(f'the robot observation has no {key!r} (it has {sorted(raw)})')
            images[cam] = raw[key]
        return Observation(state=state, state_names=self.state_names, images=images, instruction=self.instruction)

    def act(self, action: Action | None) -> None:
        """Send ``action.values`` (float32 (D,), the contract's action units) to the robot by name.

        None or a hold (``action.hold``: what ``next_action()`` answers when it has nothing new) is :meth:`hold`.

        :raises ContractViolation: for values that are not D finite numbers (complex, string, bool or object
            values: a :class:`~sequence_ai_ros.protocol.codec.ValueKindViolation` naming ``action``); nothing is
            sent then.
        """
        if action is None or action.hold:
            self.hold()
            return
        values = numbers(action.values, 'action')
        if values.shape != (len(self._action_keys),) or not np.isfinite(values).all():
            raise ContractViolation(f'an action of {len(self._action_keys)} finite values is required, got '
                                    f'{values.tolist()}')
        command = {key: float(v) for key, v in zip(self._action_keys, values, strict=True)}
        self._last = command
        self.robot.send_action(command)

    def hold(self) -> None:
        """Command no motion: the last command again, its rates (:attr:`rest_keys`) 0; nothing before the first."""
        if self._last is not None:
            self.robot.send_action({key: 0.0 if key in self.rest_keys else v for key, v in self._last.items()})


__all__ = ['POSITION_SUFFIX', 'VELOCITY_SUFFIX', 'LeRobotRobot']
