"""The simulated robot's command input, ROS-free: forward commands and joint trajectories, sampled per step.

Two ways in, after ros2_controllers:

- forward_command_controller: a vector in command order replaces the target at once and is held until
  the next command;
- joint_trajectory_controller: a trajectory (points in command order, times from its start) replaces the
  one playing from its start time. Until then the old one (or the held target) goes on; from then the
  target moves linearly from where the old one was at the start time to point 0 at ``start +
  time_from_start[0]``, then point to point, and holds the last point. A trajectory that ends before it is
  received is refused, as the controller refuses one.

:class:`CommandInput` is written by ROS callbacks and read by the stepping thread under one lock, held
only for attribute swaps.
"""

from __future__ import annotations

import dataclasses
import threading

import numpy as np
import numpy.typing as npt

from sequence_ai_ros.exceptions import ContractViolation


@dataclasses.dataclass(frozen=True)
class Trajectory:
    """A trajectory in command order.

    :param start_s: its start time (s, on the clock the sampler is given).
    :param times_s: float64 (K,) each point's time from the start (s), increasing, >= 0.
    :param positions: float64 (K, D) the points.
    """

    start_s: float
    times_s: np.ndarray
    positions: np.ndarray

    def sample(self, t: float, anchor: np.ndarray) -> np.ndarray:
        """The position at ``t``: from ``anchor`` at the start to point 0, then point to point; the last after."""
        times = np.concatenate([[0.0], self.times_s]) + self.start_s
        points = np.vstack([anchor[None, :], self.positions])
        return np.array([np.interp(t, times, points[:, j]) for j in range(points.shape[1])])

    @property
    def end_s(self) -> float:
        """When its last point is due (s)."""
        return self.start_s + float(self.times_s[-1])


def check_vector(values: npt.ArrayLike, dim: int) -> np.ndarray:
    """Return ``values`` as float64 (dim,).

    :raises ContractViolation: for another size or a non-finite value.
    """
    v = np.asarray(values, np.float64).reshape(-1)
    if v.shape != (dim,):
        raise ContractViolation(f'a command has {v.shape[0]} values; the robot takes {dim} (command order)')
    if not np.all(np.isfinite(v)):
        raise ContractViolation(f'a command has non-finite values: {v.tolist()}')
    return v


def make_trajectory(names: list[str], command_names: tuple[str, ...], start_s: float, times_s: list[float],
                    positions: list[list[float]], now_s: float) -> Trajectory:
    """Build a :class:`Trajectory` in command order from a message's joint names and points.

    :raises ContractViolation: for names that are not the commanded coordinates (each once), no point, a
        point of another size or non-finite, times not increasing, or a trajectory that ends before ``now_s``.
    """
    if sorted(names) != sorted(command_names) or len(set(names)) != len(names):
        raise ContractViolation(f'a trajectory names {list(names)}; the robot takes each of {list(command_names)} once')
    if not positions:
        raise ContractViolation('a trajectory without points')
    order = [list(names).index(n) for n in command_names]
    rows = np.array([check_vector(p, len(names))[order] for p in positions])
    times = np.asarray(times_s, np.float64)
    if np.any(times < 0) or np.any(np.diff(times) <= 0):
        raise ContractViolation(f'trajectory point times must be >= 0 and increasing, got {times.tolist()}')
    traj = Trajectory(float(start_s), times, rows)
    if traj.end_s < now_s:
        raise ContractViolation(f'a trajectory that ended {now_s - traj.end_s:.3f} s ago')
    return traj


class CommandInput:
    """The latest command of either kind; :meth:`target` gives the target at a step.

    :param dim: the command size.
    """

    def __init__(self, dim: int) -> None:
        self.dim = dim
        self._lock = threading.Lock()
        self._held = np.zeros(dim)
        self._active: Trajectory | None = None
        self._anchor = np.zeros(dim)
        self._pending: Trajectory | None = None
        self.received = 0          # commands taken since the reset
        self.refused = 0           # commands refused since the reset
        self.message = ''          # the latest refusal

    def reset(self, hold: np.ndarray) -> None:
        """Drop every command and trajectory; hold ``hold`` (float64 (dim,))."""
        with self._lock:
            self._held = np.asarray(hold, np.float64).copy()
            self._active = self._pending = None
            self.received = self.refused = 0
            self.message = ''

    def set_forward(self, values: np.ndarray) -> None:
        """A forward command: it replaces the target (and any trajectory) at once.

        :raises ContractViolation: as :func:`check_vector` (counted in ``refused``).
        """
        try:
            v = check_vector(values, self.dim)
        except ContractViolation as exc:
            self._refuse(str(exc))
            raise
        with self._lock:
            self._held, self._active, self._pending = v, None, None
            self.received += 1

    def set_trajectory(self, traj: Trajectory) -> None:
        """A trajectory: it replaces the one playing from its start time (a pending one at once)."""
        with self._lock:
            self._pending = traj
            self.received += 1

    def refuse(self, message: str) -> None:
        """Count a command refused before it got here (a malformed trajectory message)."""
        self._refuse(message)

    def _refuse(self, message: str) -> None:
        with self._lock:
            self.refused += 1
            self.message = message

    def target(self, t: float) -> np.ndarray:
        """The target at ``t`` (s, on the trajectories' clock), float64 (dim,)."""
        with self._lock:
            current = self._sample(t)
            pending = self._pending
            if pending is not None and t >= pending.start_s:
                # the new trajectory starts from where the old one is at its start time
                anchor = self._sample(pending.start_s) if self._active is not None else self._held
                self._active, self._anchor, self._pending = pending, anchor, None
                current = self._sample(t)
            return current

    def _sample(self, t: float) -> np.ndarray:
        if self._active is None:
            return self._held.copy()
        return self._active.sample(t, self._anchor)
