"""A deployment's scoreboard (``seq policy stats NAME``) and the picture of one captured episode.

The picture is ``seq policy data plot NAME --episode ID --out ep.png``.

The scoreboard reads the store's ``runs`` (every episode the worker ran, captured or not; see
:mod:`sequence_ai_ros.capture.index`) and groups them per deployment version and per day (local time):
episodes, how they ended (reason counts), labelled success rate (successes / labelled episodes),
underruns (sum) and the p95 of the per-episode chunk round trip p95 (ms, measured on the robot).

The episode plot shows, per action dimension: each chunk's predicted rows (thin lines on the chunk's
own timeline, from the captured ActionChunk records), the commands executed at each control tick, the
measured state (when the state has that joint's name), with seams (chunk switches, dotted), held ticks
(grey marks) and clamped ticks (red crosses). Plotting uses matplotlib (Agg, no display needed).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from sequence_ai_ros.capture.episode import RECORDS_FILE
from sequence_ai_ros.capture.records import read_records
from sequence_ai_ros.capture.store import CaptureStore
from sequence_ai_ros.exceptions import ContractViolation, ExportError, MissingDependency
from sequence_ai_ros.protocol import codec
from sequence_ai_ros.protocol import sequence_ai_pb2 as pb


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use('Agg')
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise MissingDependency(f'plots need matplotlib ({exc}); install it with: '
                                'pip install "sequence_ai_ros[plot]"') from None
    return plt


def scoreboard(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Group runs per (version, day); return rows sorted by version then day.

    :returns: ``{'version', 'day' (YYYY-MM-DD), 'episodes', 'ended': {reason: n}, 'labelled', 'successes',
        'success_rate' (None when none labelled), 'underruns', 'latency_p95_ms' (None when unmeasured)}``.
    """
    groups: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for r in runs:
        day = dt.datetime.fromtimestamp(r['started_at']).strftime('%Y-%m-%d')
        groups.setdefault((int(r['version']), day), []).append(r)
    out = []
    for (version, day), rs in sorted(groups.items()):
        ended: dict[str, int] = {}
        for r in rs:
            ended[r['reason']] = ended.get(r['reason'], 0) + 1
        labelled = [r for r in rs if r['success'] is not None]
        wins = sum(1 for r in labelled if r['success'])
        lat = [r['latency_p95_ms'] for r in rs if r['latency_p95_ms'] > 0]
        out.append({'version': version, 'day': day, 'episodes': len(rs), 'ended': ended, 'labelled': len(labelled),
                    'successes': wins, 'success_rate': wins / len(labelled) if labelled else None,
                    'underruns': int(sum(r['underruns'] for r in rs)),
                    'latency_p95_ms': float(np.percentile(lat, 95)) if lat else None})
    return out


def plot_scoreboard(rows: Sequence[dict[str, Any]], out: Path, title: str) -> Path:
    """Draw success rate, episodes and latency p95 per day, one line per version; write a PNG."""
    plt = _pyplot()
    fig, axes = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
    days = sorted({r['day'] for r in rows})
    x = {d: i for i, d in enumerate(days)}
    for version in sorted({r['version'] for r in rows}):
        rs = [r for r in rows if r['version'] == version]
        xs = [x[r['day']] for r in rs]
        rate = [np.nan if r['success_rate'] is None else 100 * r['success_rate'] for r in rs]
        axes[0].plot(xs, rate, 'o-', label=f'v{version}')
        axes[1].bar(np.array(xs) + 0.1 * version, [r['episodes'] for r in rs], width=0.1, label=f'v{version}')
        axes[2].plot(xs, [np.nan if r['latency_p95_ms'] is None else r['latency_p95_ms'] for r in rs], 's-')
    axes[0].set_ylabel('labelled success (%)')
    axes[0].set_ylim(-5, 105)
    axes[0].legend(loc='best')
    axes[1].set_ylabel('episodes')
    axes[2].set_ylabel('latency p95 (ms)')
    axes[2].set_xticks(range(len(days)), days, rotation=30)
    fig.suptitle(title)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def plot_episode(store: CaptureStore, episode_id: str, out: Path, max_dims: int = 8) -> Path:
    """Draw one captured episode (see the module docstring); write a PNG.

    :param max_dims: plot at most this many action dimensions (the first ones).
    :raises ExportError: when the episode is not captured in this store or holds no telemetry.
    """
    found = [e for e in store.episodes() if e.episode_id == episode_id]
    if not found:
        raise ExportError(f'deployment {store.deployment}: episode {episode_id!r} is not captured in {store.root}')
    e = found[0]
    contract = e.contract
    names = list(contract.action_names) if contract is not None else []
    state_names = list(contract.observation.state_names) if contract is not None else []
    t0 = None
    ticks: list[tuple[float, np.ndarray | None, np.ndarray | None, bool, bool]] = []
    chunks: list[tuple[float, float, np.ndarray]] = []   # (robot time of its request, dt, (T, A) rows)
    pending_t = 0.0
    for rec in read_records(e.path / RECORDS_FILE):
        msg = rec.message
        try:
            if isinstance(msg, pb.TelemetryFrame):
                state = codec.from_tensor(msg.state, what='state') if msg.HasField('state') else None
                cmd = codec.from_tensor(msg.action, what='action') if msg.HasField('action') else None
                ticks.append((msg.robot_time_s, state, cmd, bool(msg.hold), bool(msg.clamped)))
            elif isinstance(msg, pb.ObservationRequest):
                pending_t = msg.robot_time_s
            elif isinstance(msg, pb.ActionChunk) and msg.HasField('actions'):
                chunks.append((pending_t, msg.dt or (contract.dt if contract else 0.1),
                               codec.from_tensor(msg.actions, what='actions')))
        except ContractViolation:
            continue   # a frame that failed its check is not drawn
    if not ticks:
        raise ExportError(f'episode {episode_id!r} holds no telemetry to plot')
    t0 = ticks[0][0]
    dims = min(max_dims, max((len(c) for _, _, c, _, _ in ticks if c is not None), default=len(names)) or 1)
    plt = _pyplot()
    fig, axes = plt.subplots(dims, 1, figsize=(11, 2.0 * dims + 1), sharex=True, squeeze=False)
    t = np.array([tk[0] - t0 for tk in ticks])
    for d in range(dims):
        ax = axes[d, 0]
        name = names[d] if d < len(names) else f'a{d}'
        for i, (tr, step, rows) in enumerate(chunks):
            if rows.ndim == 2 and rows.shape[1] > d:
                ts = tr - t0 + step * np.arange(len(rows))
                ax.plot(ts, rows[:, d], '-', lw=0.8, alpha=0.45, color=f'C{i % 10}',
                        label='chunk predictions' if i == 0 else None)
                ax.axvline(tr - t0, ls=':', lw=0.6, color='k', alpha=0.4)
        cmd = np.array([np.nan if c is None or len(c) <= d else c[d] for _, _, c, _, _ in ticks])
        ax.step(t, cmd, where='post', lw=1.6, color='k', label='executed command')
        if name in state_names:
            j = state_names.index(name)
            st = np.array([np.nan if s is None or len(s) <= j else s[j] for _, s, _, _, _ in ticks])
            ax.plot(t, st, lw=1.2, color='tab:green', label='measured state')
        held = np.array([h for *_, h, _ in ticks])
        clamped = np.array([c for *_, c in ticks])
        if held.any():
            ax.plot(t[held], cmd[held], '|', color='grey', ms=8, label='held')
        if clamped.any():
            ax.plot(t[clamped], cmd[clamped], 'x', color='red', ms=5, label='clamped')
        ax.set_ylabel(name, fontsize=8)
        if d == 0:
            ax.legend(loc='upper right', fontsize=7, ncol=5)
    axes[-1, 0].set_xlabel('robot time since the first tick (s); dotted: chunk requests (seams)')
    fig.suptitle(f'{store.deployment} episode {episode_id} ({e.reason}, {len(ticks)} ticks, {len(chunks)} chunks)')
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out
