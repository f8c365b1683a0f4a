"""The ``ridge`` model: closed-form ridge regression from (state, last executed action) to an action chunk.

At a request the model sees what the robot sends (:class:`~sequence_ai_ros.protocol.messages.PolicyInput`):
the measured state s[t] (D,), the last executed action a[t-1] (D,), the state one dt earlier s[t-1]
(contract history 2) and the seconds since the episode's first request. It predicts the next H actions
a[t : t+H], float32 (H, D).

Per joint j and frame t the model builds feature *channels* (``CHANNELS``):

- ``last_action``: a_j[t-1]; at t = 0 nothing has been executed and the robot holds: a[-1] := s[0].
- ``tracking_error``: a_j[t-1] - s_j[t], how far the command leads the measured joint.
- ``state_velocity``: (s_j[t] - s_j[t-1]) / dt, units/s; 0 when s[t-1] is unknown.
- ``state``: s_j[t].
- ``time``: t * dt (s), the same for every joint.

With ``residual`` the targets are a_j[t+h] - a_j[t-1] (the model predicts the change from the last
command), otherwise a_j[t+h]. ``coupled=False`` fits one small regression per joint on its own channels
(weights (D, F+1, H)); ``coupled=True`` lets every joint's chunk depend on every joint's channels
(weights (D*F+1, H*D)). Features are standardised, the intercept is not penalised, and the fit is
ridge regression in closed form (Hoerl & Kennard, 1970): ``W = (X'X + lambda I)^-1 X'Y`` on centred data,
solved with :func:`numpy.linalg.solve`. Inference is one small tensor product in numpy.

Serving guards against extrapolation: a closed loop feeds the model its own last command, and when the
arm does not follow (a blocked joint, or a replayed bag whose state ignores the commands) the tracking
error leaves anything seen in training and a residual model would integrate it without bound. So at
serving every feature is clipped to its training range and every predicted action to the training
actions' range widened by half of it on each side (``x_lo``/``x_hi``, ``a_lo``/``a_hi``), except past an end of
travel the recording sits on (:func:`saturated_ends`: the G1's hands fully open at 1.0), which bounds the
prediction as it bounds the robot. Offline evaluation
(``seq train``) scores the guarded model, as served.

The same :func:`channels` builds training rows (whole episodes) and serving rows (one frame), so the
model sees at serving exactly what it was trained on. Weights live in ``model.npz`` (no pickle).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from sequence_ai_ros.exceptions import ConfigError

CHANNELS = ('last_action', 'tracking_error', 'state_velocity', 'state', 'time')
FORMAT_VERSION = 2
#: widening of the training actions' range that bounds predictions, as a fraction of the range: measured on
#: held-out G1 episode 5, 0.5 costs nothing (0.1 raised the MAE from 0.0177 to 0.0206), and it still bounds drift.
ACTION_MARGIN = 0.5
#: frames at a joint's exact extreme action that mark it as the end of the joint's travel (see
#: :func:`saturated_ends`): predictions are not widened past it.
SATURATED_FRAMES = 2


def saturated_ends(action: np.ndarray, frames: int = SATURATED_FRAMES) -> tuple[np.ndarray, np.ndarray]:
    """Return which joints' recorded actions sit on their smallest / largest value: the end of their travel.

    A continuous joint hits its exact extreme value once; a joint commanded at the end of its range (the
    G1's Inspire hands fully open at 1.0 or the thumb rotation at 0.0, a gripper at its stop) repeats it.

    :param action: (N, D) recorded actions, one row per frame.
    :param frames: frames at the exact extreme that make it an end of travel.
    :returns: two bool (D,) arrays: saturated at the minimum, at the maximum.
    """
    a = np.asarray(action)
    if a.shape[0] == 0:
        return np.zeros(a.shape[1], bool), np.zeros(a.shape[1], bool)
    return (a == a.min(axis=0)).sum(axis=0) >= frames, (a == a.max(axis=0)).sum(axis=0) >= frames


def last_actions(state: np.ndarray, action: np.ndarray) -> np.ndarray:
    """Return the last executed action at each frame: a[t-1], with a[-1] := s[0] (hold at the start).

    :param state: float32 (N, D) measured states of one episode.
    :param action: float32 (N, D) recorded actions of the same episode.
    :returns: float32 (N, D).
    """
    out = np.empty(action.shape, dtype=np.float32)
    out[0] = state[0]
    out[1:] = action[:-1]
    return out


def channels(names: Sequence[str], state: np.ndarray, last_action: np.ndarray, prev_state: np.ndarray | None,
             elapsed_s: np.ndarray | float, dt: float) -> np.ndarray:
    """Build per-joint feature channels for N frames.

    :param names: channels, a subset of :data:`CHANNELS`, in the order to stack them.
    :param state: (N, D) measured states s[t].
    :param last_action: (N, D) last executed actions a[t-1].
    :param prev_state: (N, D) states one dt earlier, or None (velocity 0).
    :param elapsed_s: scalar or (N,) seconds since the episode's first request.
    :param dt: action period (s).
    :returns: float64 (N, D, F).
    :raises ConfigError: for an unknown channel name or mismatched shapes.
    """
    s = np.asarray(state, np.float64)
    a = np.asarray(last_action, np.float64)
    if s.ndim != 2 or s.shape != a.shape:
        raise ConfigError(f'ridge: state {s.shape} and last action {a.shape} must both be (N, D)')
    out = []
    for name in names:
        if name == 'last_action':
            out.append(a)
        elif name == 'tracking_error':
            out.append(a - s)
        elif name == 'state_velocity':
            out.append(np.zeros_like(s) if prev_state is None else (s - np.asarray(prev_state, np.float64)) / dt)
        elif name == 'state':
            out.append(s)
        elif name == 'time':
            out.append(np.broadcast_to(np.asarray(elapsed_s, np.float64).reshape(-1, 1), s.shape))
        else:
            raise ConfigError(f'unknown ridge channel {name!r}; known: {", ".join(CHANNELS)}')
    return np.stack(out, axis=2)


def episode_channels(names: Sequence[str], state: np.ndarray, action: np.ndarray, dt: float) -> np.ndarray:
    """Return float64 (N, D, F) channels at every frame of one episode, as serving would build them."""
    prev = np.concatenate([state[:1], state[:-1]], axis=0)
    elapsed = np.arange(state.shape[0]) * dt
    return channels(names, state, last_actions(state, action), prev, elapsed, dt)


def action_windows(action: np.ndarray, horizon: int) -> np.ndarray:
    """Return float32 (N - H + 1, H, D): a[t : t+H] for every t whose window lies inside the episode."""
    n = action.shape[0] - horizon + 1
    if n <= 0:
        return np.zeros((0, horizon, action.shape[1]), np.float32)
    return action[np.arange(n)[:, None] + np.arange(horizon)[None, :]]


def _design(x: np.ndarray, coupled: bool) -> np.ndarray:
    """(N, D, F) channels -> (D, N, F) per-joint designs, or (1, N, D*F) for the coupled model."""
    if coupled:
        return np.ascontiguousarray(x.reshape(x.shape[0], 1, -1).transpose(1, 0, 2))
    return np.ascontiguousarray(x.transpose(1, 0, 2))


@dataclasses.dataclass
class RidgeModel:
    """A fitted ridge model; :meth:`predict` returns one action chunk.

    :param channel_names: the channels used (subset of :data:`CHANNELS`).
    :param coupled: every joint's chunk depends on all joints (True) or on its own channels (False).
    :param residual: predict a[t+h] - a[t-1] (True) or a[t+h] (False).
    :param horizon: H, actions per chunk.
    :param dt: action period (s).
    :param lam: ridge penalty lambda on standardised features.
    :param x_mean: float64 (G, F') feature means per group (G = D, F' = F; coupled: G = 1, F' = D*F).
    :param x_std: float64 (G, F') feature standard deviations (1 where constant).
    :param weights: float64 (G, F'+1, O) with the intercept last (O = H; coupled: O = H*D).
    :param state_names: the D state names, in order.
    :param action_names: the D action names, in order.
    :param x_lo: float64 (G, F') smallest training value of each feature (serving clips to it).
    :param x_hi: float64 (G, F') largest training value of each feature.
    :param a_lo: float64 (D,) lower bound of predicted actions (training min - half the range; the training
        min itself where the recording sits on it, :func:`saturated_ends`).
    :param a_hi: float64 (D,) upper bound of predicted actions (training max + half the range, or the max).
    """

    channel_names: tuple[str, ...]
    coupled: bool
    residual: bool
    horizon: int
    dt: float
    lam: float
    x_mean: np.ndarray
    x_std: np.ndarray
    weights: np.ndarray
    state_names: tuple[str, ...]
    action_names: tuple[str, ...]
    x_lo: np.ndarray
    x_hi: np.ndarray
    a_lo: np.ndarray
    a_hi: np.ndarray

    @property
    def action_dim(self) -> int:
        """D, the number of action dimensions."""
        return len(self.action_names)

    @property
    def history(self) -> int:
        """Frames of history the model needs from the robot: 2 with ``state_velocity``, else 1."""
        return 2 if 'state_velocity' in self.channel_names else 1

    @classmethod
    def fit(cls, x: np.ndarray, targets: np.ndarray, base: np.ndarray, *, channel_names: Sequence[str],
            coupled: bool, residual: bool, dt: float, lam: float, state_names: Sequence[str],
            action_names: Sequence[str]) -> RidgeModel:
        """Fit in closed form.

        :param x: float64 (N, D, F) channels (from :func:`episode_channels`).
        :param targets: float32 (N, H, D) the actions a[t : t+H].
        :param base: float32 (N, D) the last executed actions a[t-1] (subtracted when ``residual``).
        :raises ConfigError: for mismatched shapes, no samples or a negative lambda.
        """
        return cls.fit_path(x, targets, base, channel_names=channel_names, coupled=coupled, residual=residual,
                            dt=dt, lams=(lam,), state_names=state_names, action_names=action_names)[0]

    @classmethod
    def fit_path(cls, x: np.ndarray, targets: np.ndarray, base: np.ndarray, *, channel_names: Sequence[str],
                 coupled: bool, residual: bool, dt: float, lams: Sequence[float], state_names: Sequence[str],
                 action_names: Sequence[str], recorded: np.ndarray | None = None) -> list[RidgeModel]:
        """Fit one model per lambda in ``lams``, sharing X'X and X'Y (as :meth:`fit`, same errors).

        :param recorded: (M, D) every recorded action frame of the training episodes, where
            :func:`saturated_ends` looks for ends of travel; None: the first action of each window (which
            misses an episode's last H-1 frames).
        """
        if x.ndim != 3 or targets.ndim != 3 or not (x.shape[0] == targets.shape[0] == base.shape[0]):
            raise ConfigError(f'ridge fit: shapes x {x.shape}, targets {targets.shape}, base {base.shape} differ')
        if x.shape[0] == 0:
            raise ConfigError('ridge fit: no training samples (are the episodes shorter than the horizon?)')
        if any(lam < 0 for lam in lams):
            raise ConfigError(f'ridge fit: lambda must be >= 0, got {list(lams)}')
        n, h, d = targets.shape
        y = targets.astype(np.float64) - (base[:, None, :] if residual else 0.0)
        y = np.ascontiguousarray(y.reshape(1, n, h * d) if coupled else y.transpose(2, 0, 1))   # (G, N, O)
        design = _design(x, coupled)                                      # (G, N, F')
        x_mean = design.mean(axis=1)
        x_lo, x_hi = design.min(axis=1), design.max(axis=1)
        t_lo, t_hi = targets.min(axis=(0, 1)).astype(np.float64), targets.max(axis=(0, 1)).astype(np.float64)
        margin = ACTION_MARGIN * (t_hi - t_lo)
        sat_lo, sat_hi = saturated_ends(targets[:, 0, :] if recorded is None else recorded)
        x_std = design.std(axis=1)
        x_std[x_std < 1e-9] = 1.0
        xs = (design - x_mean[:, None, :]) / x_std[:, None, :]
        y_mean = y.mean(axis=1)
        xt = np.ascontiguousarray(xs.transpose(0, 2, 1))
        gram = xt @ xs
        xty = xt @ (y - y_mean[:, None, :])
        eye = np.eye(xs.shape[2])
        models = []
        for lam in lams:
            w = np.linalg.solve(gram + lam * eye, xty)
            models.append(cls(channel_names=tuple(channel_names), coupled=bool(coupled), residual=bool(residual),
                              horizon=h, dt=float(dt), lam=float(lam), x_mean=x_mean, x_std=x_std,
                              weights=np.concatenate([w, y_mean[:, None, :]], axis=1),
                              state_names=tuple(state_names), action_names=tuple(action_names),
                              x_lo=x_lo, x_hi=x_hi, a_lo=np.where(sat_lo, t_lo, t_lo - margin),
                              a_hi=np.where(sat_hi, t_hi, t_hi + margin)))
        return models

    def predict_batch(self, x: np.ndarray, base: np.ndarray, *, guard: bool = False) -> np.ndarray:
        """Return float32 (N, H, D) chunks for channels x (N, D, F) and last actions base (N, D).

        :param guard: clip features to the training range and actions to ``[a_lo, a_hi]`` (serving).
        """
        design = _design(x, self.coupled)
        if guard:
            design = np.clip(design, self.x_lo[:, None, :], self.x_hi[:, None, :])
        xs = (design - self.x_mean[:, None, :]) / self.x_std[:, None, :]
        y = xs @ self.weights[:, :-1, :] + self.weights[:, -1:, :]
        n = x.shape[0]
        y = y[0].reshape(n, self.horizon, self.action_dim) if self.coupled else y.transpose(1, 2, 0)
        if self.residual:
            y = y + base[:, None, :]
        if guard:
            y = np.clip(y, self.a_lo, self.a_hi)
        return y.astype(np.float32)

    def predict(self, state: np.ndarray, last_action: np.ndarray | None = None,
                prev_state: np.ndarray | None = None, elapsed_s: float = 0.0) -> np.ndarray:
        """Return the next chunk, float32 (H, D), in the action's units (G1: rad, hands 0..1).

        Serving guards apply: features clipped to the training range, actions to ``[a_lo, a_hi]``.

        :param state: (D,) measured state s[t].
        :param last_action: (D,) last executed action a[t-1]; None (first request) holds: uses the state.
        :param prev_state: (D,) state one dt earlier, or None (velocity taken as 0).
        :param elapsed_s: seconds since the episode's first request.
        :raises ConfigError: when the state or last action does not have D values.
        """
        s = np.asarray(state, np.float64).reshape(1, -1)
        a = s if last_action is None else np.asarray(last_action, np.float64).reshape(1, -1)
        d = len(self.state_names)
        if s.shape[1] != d or a.shape[1] != self.action_dim:
            raise ConfigError(f'ridge: state has {s.shape[1]} values and last action {a.shape[1]}; '
                              f'the model expects {d} and {self.action_dim}')
        prev = None if prev_state is None else np.asarray(prev_state, np.float64).reshape(1, -1)
        x = channels(self.channel_names, s, a, prev, elapsed_s, self.dt)
        return self.predict_batch(x, a, guard=True)[0]

    def predict_many(self, states: np.ndarray, last_actions: np.ndarray, prev_states: np.ndarray,
                     elapsed_s: np.ndarray) -> np.ndarray:
        """Return B chunks at once, float32 (B, H, D), as :meth:`predict` would return each (batched serving).

        :param states: (B, D) measured states s[t].
        :param last_actions: (B, D) last executed actions a[t-1] (the state where none was executed yet).
        :param prev_states: (B, D) states one dt earlier (the state itself where unknown: velocity 0).
        :param elapsed_s: (B,) seconds since each episode's first request.
        :raises ConfigError: when a state or last action does not have D values.
        """
        s = np.asarray(states, np.float64)
        a = np.asarray(last_actions, np.float64)
        if s.ndim != 2 or s.shape[1] != len(self.state_names) or a.shape != (s.shape[0], self.action_dim):
            raise ConfigError(f'ridge: states {s.shape} and last actions {a.shape}; the model expects '
                              f'(B, {len(self.state_names)}) and (B, {self.action_dim})')
        x = channels(self.channel_names, s, a, np.asarray(prev_states, np.float64), elapsed_s, self.dt)
        return self.predict_batch(x, a, guard=True)

    def describe(self) -> str:
        """Return a one-line summary, e.g. ``per-joint residual [tracking_error+state_velocity] lambda=0.001``."""
        kind = ('coupled' if self.coupled else 'per-joint') + (' residual' if self.residual else ' absolute')
        return f'{kind} [{"+".join(self.channel_names)}] lambda={self.lam:g} H={self.horizon}'

    def save(self, path: str | Path) -> Path:
        """Write the model to an ``.npz`` file (arrays plus a JSON header; no pickle)."""
        path = Path(path)
        header = {'format_version': FORMAT_VERSION, 'channel_names': list(self.channel_names),
                  'coupled': self.coupled, 'residual': self.residual, 'horizon': self.horizon, 'dt': self.dt,
                  'lam': self.lam, 'state_names': list(self.state_names), 'action_names': list(self.action_names)}
        with path.open('wb') as f:
            np.savez(f, header=np.array(json.dumps(header)), x_mean=self.x_mean, x_std=self.x_std,
                     weights=self.weights, x_lo=self.x_lo, x_hi=self.x_hi, a_lo=self.a_lo, a_hi=self.a_hi)
        return path

    @classmethod
    def load(cls, path: str | Path) -> RidgeModel:
        """Read a model written by :meth:`save`.

        :raises ConfigError: when the file is missing, unreadable or inconsistent.
        """
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f'ridge model {path} is missing; train one with `seq train ridge`')
        try:
            with np.load(path, allow_pickle=False) as z:
                header = json.loads(str(z['header']))
                arrays = {k: np.asarray(z[k], np.float64)
                          for k in ('x_mean', 'x_std', 'weights', 'x_lo', 'x_hi', 'a_lo', 'a_hi')}
            if header.get('format_version') != FORMAT_VERSION:
                raise ConfigError(f'ridge model {path}: format_version {header.get("format_version")!r}, '
                                  f'expected {FORMAT_VERSION}')
            model = cls(channel_names=tuple(header['channel_names']), coupled=bool(header['coupled']),
                        residual=bool(header['residual']), horizon=int(header['horizon']),
                        dt=float(header['dt']), lam=float(header['lam']),
                        state_names=tuple(header['state_names']), action_names=tuple(header['action_names']),
                        **arrays)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f'ridge model {path} is unreadable: {exc}') from None
        g = 1 if model.coupled else model.action_dim
        f = len(model.channel_names) * (model.action_dim if model.coupled else 1)
        o = model.horizon * (model.action_dim if model.coupled else 1)
        if model.weights.shape != (g, f + 1, o) or model.x_mean.shape != (g, f) or model.x_std.shape != (g, f):
            raise ConfigError(f'ridge model {path}: weights {model.weights.shape} do not match '
                              f'H={model.horizon}, D={model.action_dim}')
        return model
