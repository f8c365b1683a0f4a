"""``~/status`` (sequence_ai_msgs/RunStatus) and ``/diagnostics`` (diagnostic_msgs/DiagnosticArray).

Both are built from one :class:`Report`, read from the runner, the control thread and the client's
live ``stats()`` (which never blocks). Diagnostic statuses, named ``<node>: <part>``:

- ``connection``: disconnected/unconfigured (ERROR), warming (WARN), ready; endpoint, deployment.
- ``episode``: state, episode id, buffer_s, actions, chunks, underruns, underrun_s, latency p50/p95 (ms),
  ``dropped_telemetry`` (capture frames the client could not send, all episodes).
- ``control``: rate, tick jitter p50/p99/max (ms), skipped ticks, enabled (dry run), clamp counts in
  total and per joint (``clamps.<joint>.limit|step``).
- ``observation``: WARN naming every stale or missing source; the age of each source (s); per camera,
  the compressed frames passed through untouched (``jpeg_passthrough.<key>``) and decoded (``decoded.<key>``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus, KeyValue
from sequence_ai_msgs.msg import RunStatus

OK, WARN, ERROR = DiagnosticStatus.OK, DiagnosticStatus.WARN, DiagnosticStatus.ERROR


@dataclasses.dataclass
class Report:
    """A snapshot of everything the node reports."""

    state: str
    episode_id: str
    deployment: str
    endpoint: str
    action_space: str
    connection: str
    connection_error: str
    ready: bool
    enabled: bool
    stats: dict[str, Any]
    clamps: int
    clamp_counts: dict[str, dict[str, int]]
    jitter_ms: tuple[float, float, float]
    rate_hz: float
    skipped_ticks: int
    sent: int
    problems: list[str]
    ages: dict[str, float]
    message: str = ''
    dropped_telemetry: int = 0
    images: dict[str, tuple[int, int]] = dataclasses.field(default_factory=dict)


def state_of(runner: Any) -> str:
    """Return idle | warming | running | holding | error for a :class:`~.runner.Runner`."""
    if runner.connection in ('disconnected', 'unconfigured'):
        return 'error'
    ep = runner.episode
    if ep is not None and not ep.done.is_set():
        if ep.sent == 0:
            return 'warming'
        return 'holding' if runner.holding else 'running'
    return 'holding' if runner.last_command is not None else 'idle'


def _kv(key: str, value: Any) -> KeyValue:
    if isinstance(value, float):
        value = 'inf' if math.isinf(value) else f'{value:.4f}'
    return KeyValue(key=key, value=str(value))


def status_message(r: Report, stamp: Any) -> RunStatus:
    """Return the ``~/status`` message."""
    s = r.stats
    return RunStatus(
        stamp=stamp, state=r.state, episode_id=r.episode_id, deployment=r.deployment,
        action_space=r.action_space, connected=r.connection in ('connected', 'warming', 'ready'), ready=r.ready,
        buffer_s=float(s.get('buffer_s', 0.0)), actions_sent=r.sent, chunks=int(s.get('chunks', 0)),
        underruns=int(s.get('underruns', 0)), underrun_s=float(s.get('underrun_s', 0.0)),
        latency_p50_ms=float(s.get('latency_p50_ms', 0.0)), latency_p95_ms=float(s.get('latency_p95_ms', 0.0)),
        clamps=r.clamps, dropped_telemetry=r.dropped_telemetry,
        message=r.message or '; '.join(r.problems) or r.connection_error)


def diagnostic_array(r: Report, node_name: str, stamp: Any) -> DiagnosticArray:
    """Return the ``/diagnostics`` message (four statuses, see the module docstring)."""
    s = r.stats
    conn_level = ERROR if r.connection in ('disconnected', 'unconfigured') else (
        OK if r.ready else WARN)
    connection = DiagnosticStatus(
        level=conn_level, name=f'{node_name}: connection', hardware_id=r.endpoint,
        message=r.connection_error or r.connection,
        values=[_kv('state', r.connection), _kv('deployment', r.deployment), _kv('endpoint', r.endpoint),
                _kv('ready', r.ready), _kv('action_space', r.action_space)])
    episode = DiagnosticStatus(
        level=WARN if r.state == 'holding' and r.episode_id and r.problems else OK,
        name=f'{node_name}: episode', hardware_id=r.endpoint, message=r.state,
        values=[_kv('state', r.state), _kv('episode_id', r.episode_id), _kv('actions_sent', r.sent)]
        + [_kv(k, float(s.get(k, 0.0))) for k in ('buffer_s', 'underrun_s', 'latency_p50_ms', 'latency_p95_ms')]
        + [_kv(k, int(s.get(k, 0))) for k in ('actions', 'chunks', 'underruns')]
        + [_kv('dropped_telemetry', r.dropped_telemetry)])
    p50, p99, worst = r.jitter_ms
    values = [_kv('rate_hz', r.rate_hz), _kv('tick_jitter_p50_ms', p50), _kv('tick_jitter_p99_ms', p99),
              _kv('tick_jitter_max_ms', worst), _kv('skipped_ticks', r.skipped_ticks), _kv('enabled', r.enabled),
              _kv('clamps', r.clamps)]
    for joint, counts in sorted(r.clamp_counts.items()):
        values += [_kv(f'clamps.{joint}.limit', counts['limit']), _kv(f'clamps.{joint}.step', counts['step'])]
    control = DiagnosticStatus(
        level=WARN if r.clamps else OK, name=f'{node_name}: control', hardware_id=r.endpoint,
        message=(f'{r.clamps} clamped values' if r.clamps else 'ok') + ('' if r.enabled else ' (dry run)'),
        values=values)
    observation = DiagnosticStatus(
        level=WARN if r.problems else OK, name=f'{node_name}: observation', hardware_id=r.endpoint,
        message='; '.join(r.problems) or 'all sources fresh',
        values=[_kv(f'age_s.{source}', age) for source, age in sorted(r.ages.items())]
        + [_kv(f'jpeg_passthrough.{key}', n) for key, (n, _) in sorted(r.images.items())]
        + [_kv(f'decoded.{key}', n) for key, (_, n) in sorted(r.images.items())])
    return DiagnosticArray(header=_header(stamp), status=[connection, episode, control, observation])


def _header(stamp: Any) -> Any:
    from std_msgs.msg import Header

    return Header(stamp=stamp)
