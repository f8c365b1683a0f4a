"""``seq train ridge``: fit the ``ridge`` template on a LeRobot v2.1 dataset, choose its features by measurement.

Evaluation mimics serving. At frame t of an episode the model sees the measured state s[t], the last
executed action a[t-1] (a[-1] := s[0]: before the first action the robot holds), the previous state
s[t-1] and t * dt, and predicts a[t : t+H]. The error is the mean absolute error over the action horizon:
all H steps, all D dimensions, every t whose window lies inside the episode (t = 0 .. N-H), in the
action's units (G1: rad for arm joints, 0..1 for hands). Three baselines are scored the same way:

- ``hold_state``: repeat s[t] for H steps;
- ``hold_last_action``: repeat a[t-1] for H steps (hard to beat: recorded actions sit close to the previous command);
- ``mean_action``: repeat the training episodes' mean action.

Feature choice: every candidate in :data:`CANDIDATES` is fitted for every lambda in :data:`LAMBDAS`
and scored by leave-one-episode-out cross-validation on the *training* episodes only (a single
training episode is cut into 5 contiguous time blocks instead); the best (lowest CV error) is refitted
on all training episodes. The eval episodes are never used to choose.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from sequence_ai_ros.datasets.lerobot_reader import LeRobotDataset
from sequence_ai_ros.exceptions import ConfigError, ExportError
from sequence_ai_ros.models import ridge
from sequence_ai_ros.templates import TEMPLATES_DIR

TEMPLATE_DIR = TEMPLATES_DIR / 'ridge'
TEMPLATE_FILES = ('policy.py', 'config.yaml', 'README.md')

#: (label, channels, coupled, residual): the feature sets measured on every training run.
CANDIDATES: tuple[tuple[str, tuple[str, ...], bool, bool], ...] = (
    ('coupled absolute: state', ('state',), True, False),
    ('coupled absolute: state + last_action', ('state', 'last_action'), True, False),
    ('coupled residual: state + last_action', ('state', 'last_action'), True, True),
    ('coupled residual: state + last_action + velocity', ('state', 'last_action', 'state_velocity'), True, True),
    ('per-joint residual: tracking_error', ('tracking_error',), False, True),
    ('per-joint residual: tracking_error + velocity', ('tracking_error', 'state_velocity'), False, True),
    ('per-joint residual: tracking_error + velocity + state',
     ('tracking_error', 'state_velocity', 'state'), False, True),
    ('per-joint residual: tracking_error + velocity + time',
     ('tracking_error', 'state_velocity', 'time'), False, True),
)
#: ridge penalties tried (on standardised features).
LAMBDAS = (1e-3, 1e-1, 10.0, 1e3, 1e5)
BASELINES = ('hold_state', 'hold_last_action', 'mean_action')


@dataclasses.dataclass
class _EpisodeWindows:
    """One episode's arrays at every evaluable frame t = 0 .. N-H."""

    x: np.ndarray        # (n, D, len(CHANNELS)) all channels
    targets: np.ndarray  # (n, H, D) a[t : t+H]
    base: np.ndarray     # (n, D) a[t-1]
    state: np.ndarray    # (n, D) s[t]
    actions: np.ndarray  # (N, D) every recorded action of the episode


@dataclasses.dataclass
class TrainResult:
    """What :func:`train` found.

    :param model: the chosen model, refitted on all training episodes.
    :param table: one row per candidate: label, best lambda, cross-validated MAE (and eval MAE).
    :param errors: eval MAE per method (``ridge`` and :data:`BASELINES`), in the action's units.
    :param seconds: wall time of the search and fit (s).
    """

    model: ridge.RidgeModel
    table: list[dict[str, Any]]
    errors: dict[str, float]
    seconds: float


def parse_episodes(text: str) -> list[int]:
    """Parse ``'0-4'``, ``'5'`` or ``'0,2,4-5'`` into sorted unique episode indices.

    :raises ConfigError: for anything else.
    """
    out: set[int] = set()
    for part in (p.strip() for p in str(text).split(',')):
        try:
            if '-' in part:
                lo, hi = (int(v) for v in part.split('-', 1))
                if hi < lo:
                    raise ValueError
                out.update(range(lo, hi + 1))
            else:
                out.add(int(part))
        except ValueError:
            raise ConfigError(f'episodes {text!r}: expected e.g. 0-4, 5 or 0,2,4-5') from None
    if not out or min(out) < 0:
        raise ConfigError(f'episodes {text!r}: no valid (non-negative) episode')
    return sorted(out)


def _prepare(ds: LeRobotDataset, k: int, horizon: int) -> _EpisodeWindows:
    ep = ds.episode(k)
    n = len(ep) - horizon + 1
    if n <= 0:
        raise ConfigError(f'episode {k} has {len(ep)} frames, fewer than the horizon H={horizon}')
    x = ridge.episode_channels(ridge.CHANNELS, ep.state, ep.action, 1.0 / ds.fps)
    return _EpisodeWindows(x=x[:n], targets=ridge.action_windows(ep.action, horizon),
                    base=ridge.last_actions(ep.state, ep.action)[:n], state=ep.state[:n], actions=ep.action)


def _fit(eps: Sequence[_EpisodeWindows], candidate: tuple[str, tuple[str, ...], bool, bool], lams: Sequence[float],
         dt: float, ds: LeRobotDataset) -> list[ridge.RidgeModel]:
    """Fit ``candidate`` on ``eps`` for every lambda in ``lams``."""
    _, chans, coupled, residual = candidate
    idx = [ridge.CHANNELS.index(c) for c in chans]
    return ridge.RidgeModel.fit_path(np.concatenate([e.x[:, :, idx] for e in eps]),
                                     np.concatenate([e.targets for e in eps]), np.concatenate([e.base for e in eps]),
                                     channel_names=chans, coupled=coupled, residual=residual, dt=dt, lams=lams,
                                     state_names=ds.state_names, action_names=ds.action_names,
                                     recorded=np.concatenate([e.actions for e in eps]))


def _folds(eps: list[_EpisodeWindows], blocks: int = 5) -> list[tuple[list[_EpisodeWindows], list[_EpisodeWindows]]]:
    """Cross-validation folds: leave one episode out; a single episode is cut into contiguous time blocks."""
    if len(eps) > 1:
        return [(eps[:i] + eps[i + 1:], [eps[i]]) for i in range(len(eps))]
    ep = eps[0]
    edges = np.linspace(0, len(ep.state), blocks + 1).astype(int)
    parts = [_EpisodeWindows(x=ep.x[a:b], targets=ep.targets[a:b], base=ep.base[a:b], state=ep.state[a:b],
                      actions=ep.actions) for a, b in zip(edges[:-1], edges[1:], strict=True) if b > a]
    return [(parts[:i] + parts[i + 1:], [parts[i]]) for i in range(len(parts))]


def _mae(pred: np.ndarray, eps: Sequence[_EpisodeWindows]) -> float:
    """Mean absolute error over all windows, steps and dims of ``eps`` (pred: (n, H, D) concatenated)."""
    targets = np.concatenate([e.targets for e in eps])
    return float(np.abs(pred - targets).mean())


def model_error(model: ridge.RidgeModel, eps: Sequence[_EpisodeWindows]) -> float:
    """Return the model's MAE on prepared episodes."""
    idx = [ridge.CHANNELS.index(c) for c in model.channel_names]
    pred = np.concatenate([model.predict_batch(e.x[:, :, idx], e.base, guard=True) for e in eps])
    return _mae(pred, eps)


def baseline_errors(train: Sequence[_EpisodeWindows], test: Sequence[_EpisodeWindows]) -> dict[str, float]:
    """Return the MAE of each of :data:`BASELINES` on ``test`` (mean action from ``train``)."""
    h = test[0].targets.shape[1]
    mean = np.concatenate([e.actions for e in train]).mean(axis=0)
    return {
        'hold_state': _mae(np.concatenate([np.repeat(e.state[:, None], h, 1) for e in test]), test),
        'hold_last_action': _mae(np.concatenate([np.repeat(e.base[:, None], h, 1) for e in test]), test),
        'mean_action': _mae(np.broadcast_to(mean, (sum(len(e.state) for e in test), h, mean.shape[0])), test),
    }


def train(dataset: str | Path, episodes: Sequence[int], eval_episodes: Sequence[int] = (), *,
          horizon: int = 30) -> TrainResult:
    """Choose features by cross-validation on ``episodes``, fit, and evaluate on ``eval_episodes``.

    :param dataset: a LeRobot v2.1 directory.
    :param episodes: training episode indices.
    :param eval_episodes: held-out episode indices (may be empty: no evaluation).
    :param horizon: H, actions per chunk (H * dt seconds).
    :raises ConfigError: for a bad dataset, unknown or overlapping episodes, or episodes shorter than H.
    """
    start = time.monotonic()
    if horizon < 1:
        raise ConfigError(f'horizon must be >= 1, got {horizon}')
    if set(episodes) & set(eval_episodes):
        raise ConfigError(f'episodes {sorted(set(episodes) & set(eval_episodes))} are both train and eval')
    if not episodes:
        raise ConfigError('no training episodes')
    ds = LeRobotDataset(dataset)
    if ds.state_dim != ds.action_dim:
        raise ConfigError(f'ridge predicts actions around the state: state has {ds.state_dim} dims, '
                          f'action {ds.action_dim}')
    dt = 1.0 / ds.fps
    tr = [_prepare(ds, k, horizon) for k in episodes]
    te = [_prepare(ds, k, horizon) for k in eval_episodes]
    folds = _folds(tr)
    table = []
    best: tuple[float, tuple, float] | None = None
    for cand in CANDIDATES:
        scores = np.mean([[model_error(m, held) for m in _fit(fit_on, cand, LAMBDAS, dt, ds)]
                          for fit_on, held in folds], axis=0)
        i = int(np.argmin(scores))
        row: dict[str, Any] = {'features': cand[0], 'lambda': LAMBDAS[i], 'cv_mae': float(scores[i])}
        table.append(row)
        if best is None or row['cv_mae'] < best[0]:
            best = (row['cv_mae'], cand, row['lambda'])
    assert best is not None
    model = _fit(tr, best[1], [best[2]], dt, ds)[0]
    errors: dict[str, float] = {}
    if te:
        for row, cand in zip(table, CANDIDATES, strict=True):
            row['eval_mae'] = model_error(_fit(tr, cand, [row['lambda']], dt, ds)[0], te)
        errors = {'ridge': model_error(model, te), **baseline_errors(tr, te)}
        cv_hold = [baseline_errors(fit_on, held)['hold_last_action'] for fit_on, held in folds]
        table.append({'features': 'baseline: hold_last_action', 'lambda': None,
                      'cv_mae': float(np.mean(cv_hold)), 'eval_mae': errors['hold_last_action']})
    return TrainResult(model=model, table=table, errors=errors, seconds=time.monotonic() - start)


def format_report(result: TrainResult, eval_episodes: Sequence[int]) -> str:
    """Return the feature table and the evaluation as printable text."""
    lines = ['feature selection (cross-validation on the training episodes, leaving one out; MAE over the horizon):',
             f'  {"features":58s} {"lambda":>8s} {"cv_mae":>9s} {"eval_mae":>9s}']
    for row in result.table:
        lam = '' if row['lambda'] is None else f'{row["lambda"]:g}'
        ev = f'{row["eval_mae"]:.5f}' if 'eval_mae' in row else ''
        lines.append(f'  {row["features"]:58s} {lam:>8s} {row["cv_mae"]:9.5f} {ev:>9s}')
    lines.append(f'chosen: {result.model.describe()} (history {result.model.history})')
    if result.errors:
        lines.append(f'evaluation on episodes {list(eval_episodes)} (MAE over H={result.model.horizon} actions, '
                     "all dims, in the action's units):")
        for name in ('ridge', *BASELINES):
            lines.append(f'  {name:18s} {result.errors[name]:.5f}')
        e = result.errors
        verdict = [f'ridge {"beats" if e["ridge"] < e[b] else "does NOT beat"} {b}' for b in BASELINES]
        lines.append('  ' + '; '.join(verdict))
    lines.append(f'trained in {result.seconds:.1f} s')
    return '\n'.join(lines)


def write_deployment(out: str | Path, result: TrainResult, *, force: bool = False,
                     extra: dict[str, Any] | None = None) -> Path:
    """Copy the ridge template into ``out`` and write ``model.npz`` and ``metrics.json`` beside it.

    :raises ExportError: when ``out`` already holds a model and ``force`` is False.
    """
    out = Path(out)
    if (out / 'model.npz').exists() and not force:
        raise ExportError(f'{out / "model.npz"} exists; pass --force to overwrite')
    out.mkdir(parents=True, exist_ok=True)
    for name in TEMPLATE_FILES:
        shutil.copyfile(TEMPLATE_DIR / name, out / name)
    result.model.save(out / 'model.npz')
    metrics = {'model': result.model.describe(), 'errors': result.errors, 'table': result.table,
               'seconds': result.seconds, **(extra or {})}
    (out / 'metrics.json').write_text(json.dumps(metrics, indent=2) + '\n')
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``seq train`` arguments: ``ridge --dataset DIR --episodes 0-4 [--eval-episodes 5] --out NAME/``."""
    parser.add_argument('model', choices=['ridge'], help='the model to train (the embedded ridge template)')
    parser.add_argument('--dataset', required=True, help='a LeRobot v2.1 dataset directory')
    parser.add_argument('--episodes', required=True, help='training episodes, e.g. 0-4 or 0,2,4-5')
    parser.add_argument('--eval-episodes', default='', help='held-out episodes to evaluate on, e.g. 5')
    parser.add_argument('--out', required=True, help='deployment folder to write (policy.py, config.yaml, '
                        'README.md, model.npz, metrics.json)')
    parser.add_argument('--horizon', type=int, default=30, help='actions per chunk H (default 30 = 1 s at 30 fps)')
    parser.add_argument('--force', action='store_true', help='overwrite an existing model in --out')


def main(args: argparse.Namespace) -> int:
    """Run ``seq train``; prints the feature table and the evaluation; returns 0 on success.

    :raises ConfigError: for a bad dataset or episode selection.
    :raises ExportError: when --out already holds a model (without --force).
    """
    episodes = parse_episodes(args.episodes)
    eval_episodes = parse_episodes(args.eval_episodes) if args.eval_episodes else []
    result = train(args.dataset, episodes, eval_episodes, horizon=args.horizon)
    print(format_report(result, eval_episodes), flush=True)
    out = write_deployment(args.out, result, force=args.force,
                           extra={'dataset': str(Path(args.dataset).resolve()), 'episodes': episodes,
                                  'eval_episodes': eval_episodes})
    print(f'wrote {out}/ (policy.py, config.yaml, README.md, model.npz, metrics.json); '
          f'deploy with: seq deploy {out}/policy.py', flush=True)
    return 0
