"""``~/status`` (sequence_ai_msgs/RunStatus) and ``/diagnostics`` (diagnostic_msgs/DiagnosticArray).

Both are built from one :class:`Report`, read from the runner, the control thread and the client's
live ``stats()`` (which never blocks). Diagnostic statuses, named ``<node>: <part>``:

- ``connection``: disconnected/unconfigured (ERROR), warming (WARN), ready; endpoint, deployment.
- ``episode``: state, episode id, buffer_s, actions, chunks, underruns, underrun_s, latency p50/p95 (ms),
  ``dropped_telemetry`` (capture frames the client could not send, all episodes), ``telemetry_rejected``
  (capture frames the worker refused: wrong shape, NaN, an image unlike the contract; counted when the
  episode ends, the first reason in ``telemetry_error``).
- ``control``: rate, tick jitter p50/p99/max (ms), skipped ticks, enabled (dry run), clamp counts in
  total and per joint (``clamps.<joint>.limit|step``), and the control thread's ``scheduling``
  (``SCHED_FIFO <thread_priority>``, or ``default`` with the reason the OS refused it).

Levels tell the truth about the trailing window ``diagnostics.window_s`` (:class:`Health`, thresholds
from the ``diagnostics.*`` parameters): ``control`` is WARN/ERROR on tick jitter p99 (over the window's
ticks), skipped ticks and the share of clamped commands; ``episode`` is WARN/ERROR on the share of
control ticks held for lack of an action (underruns, after an episode's first command) and on capture
frames lost (dropped by the client, or refused by the worker; the same thresholds), and WARN while an
episode that ended 'error' (a lost worker, an invalid observation for too long) is in the window. The
message names every threshold crossed.
- ``observation``: WARN naming every stale or missing source; the age of each source (s); per camera,
  the compressed frames passed through untouched (``jpeg_passthrough.<key>``) and decoded (``decoded.<key>``).
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus, KeyValue
from sequence_ai_msgs.msg import RunStatus

from sequence_ai_ros.node.config import DiagnosticsConfig

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
    ticks_skipped: int
    sent: int
    problems: list[str]
    ages: dict[str, float]
    message: str = ''
    dropped_telemetry: int = 0
    telemetry_rejected: int = 0
    telemetry_error: str = ''
    held: int = 0
    images: dict[str, tuple[int, int]] = dataclasses.field(default_factory=dict)
    lifecycle: str = ''
    control_level: int = OK
    control_reasons: list[str] = dataclasses.field(default_factory=list)
    episode_level: int = OK
    episode_reasons: list[str] = dataclasses.field(default_factory=list)
    window: dict[str, float] = dataclasses.field(default_factory=dict)
    scheduling: str = ''          # the control thread's scheduler ('SCHED_FIFO 50', 'default (... refused ...)')
    observing: str = ''           # why there is no observation to report (not configured), else ''
    episode_skipped: int = 0      # control periods of the episode skipped
    episode_elapsed_s: float = 0.0   # the episode's start to the latest deadline its counts cover (s)


#: The cumulative counters :class:`Health` takes the window's differences of.
COUNTERS = ('ticks_skipped', 'episode_ticks', 'underrun_ticks', 'commands_checked', 'commands_clamped',
            'dropped_telemetry', 'telemetry_rejected', 'episodes_failed')


class Health:
    """WARN/ERROR levels from the trailing window of cumulative counters (see the module docstring).

    :param cfg: the thresholds (``diagnostics.*`` parameters).
    """

    def __init__(self, cfg: DiagnosticsConfig) -> None:
        self.cfg = cfg
        self._samples: collections.deque[tuple[float, dict[str, float]]] = collections.deque()
        self._totals: dict[str, float] = dict.fromkeys(COUNTERS, 0.0)
        self._last: dict[str, float] = {}

    def update(self, now: float, counters: Mapping[str, float]) -> dict[str, float]:
        """Add a sample of the cumulative ``counters`` at ``now`` (monotonic s); return the window's increments.

        A counter that went down was reset (a new control thread or client after a lifecycle cleanup):
        its new value counts as the increment. ``span_s`` is the time the window covers (s).
        """
        for key in COUNTERS:
            value = float(counters.get(key, 0))
            last = self._last.get(key, 0.0)
            self._totals[key] += value - last if value >= last else value
            self._last[key] = value
        self._samples.append((now, dict(self._totals)))
        while len(self._samples) > 1 and self._samples[1][0] <= now - self.cfg.window_s:
            self._samples.popleft()
        t0, base = self._samples[0]
        out = {k: self._totals[k] - base[k] for k in COUNTERS}
        out['span_s'] = now - t0
        return out

    @staticmethod
    def _grade(value: float, warn: float, error: float, text: str, reasons: list[str], *,
               inclusive: bool = False) -> int:
        over = (lambda limit: value >= limit) if inclusive else (lambda limit: value > limit)
        if over(error):
            reasons.append(f'{text} (ERROR above {error:g})' if not inclusive else f'{text} (ERROR at {error:g})')
            return ERROR
        if over(warn):
            reasons.append(f'{text} (WARN above {warn:g})' if not inclusive else f'{text} (WARN at {warn:g})')
            return WARN
        return OK

    def control(self, jitter_p99_ms: float, window: Mapping[str, float]) -> tuple[int, list[str]]:
        """Level and reasons of the control status: tick jitter, skipped ticks, clamp share."""
        c = self.cfg
        reasons: list[str] = []
        levels = [self._grade(jitter_p99_ms, c.jitter_warn_ms, c.jitter_error_ms,
                              f'tick jitter p99 {jitter_p99_ms:.1f} ms', reasons)]
        skipped = window.get('ticks_skipped', 0)
        levels.append(self._grade(skipped, c.ticks_skipped_warn, c.ticks_skipped_error,
                                  f'{skipped:.0f} skipped ticks in {c.window_s:g} s', reasons, inclusive=True))
        checked = window.get('commands_checked', 0)
        if checked:
            share = window.get('commands_clamped', 0) / checked
            levels.append(self._grade(share, c.clamp_warn, c.clamp_error,
                                      f'{share:.0%} of commands clamped in {c.window_s:g} s', reasons))
        return max(levels), reasons

    def episode(self, window: Mapping[str, float]) -> tuple[int, list[str]]:
        """Level and reasons of the episode status: underrun share, dropped telemetry, episodes ended 'error'."""
        c, reasons, levels = self.cfg, [], [OK]
        failed = window.get('episodes_failed', 0)
        if failed:   # the arm held; a monitor should still see it (the result's message says why)
            levels.append(WARN)
            reasons.append(f"{failed:.0f} episode{'s' if failed > 1 else ''} ended 'error' in {c.window_s:g} s")
        ticks = window.get('episode_ticks', 0)
        if ticks:
            share = window.get('underrun_ticks', 0) / ticks
            levels.append(self._grade(share, c.underrun_warn, c.underrun_error,
                                      f'{share:.0%} of control ticks in underrun in {c.window_s:g} s', reasons))
        dropped = window.get('dropped_telemetry', 0)
        levels.append(self._grade(dropped, c.dropped_telemetry_warn, c.dropped_telemetry_error,
                                  f'{dropped:.0f} capture frames dropped in {c.window_s:g} s', reasons,
                                  inclusive=True))
        refused = window.get('telemetry_rejected', 0)
        levels.append(self._grade(refused, c.dropped_telemetry_warn, c.dropped_telemetry_error,
                                  f'{refused:.0f} capture frames refused by the worker in {c.window_s:g} s',
                                  reasons, inclusive=True))
        return max(levels), reasons


def state_of(runner: Any) -> str:
    """Return idle | warming | running | holding | error for a :class:`~.runner.Runner`."""
    if runner.connection in ('disconnected', 'unconfigured'):
        return 'error'
    ep = runner.episode
    if ep is not None and not ep.done.is_set():
        if not ep.commanded:
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
        buffer_s=float(s.get('buffer_s', 0.0)), commands_sent=r.sent, ticks_held=r.held,
        ticks_skipped=r.episode_skipped, elapsed_s=r.episode_elapsed_s, chunks=int(s.get('chunks', 0)),
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
                _kv('ready', r.ready), _kv('action_space', r.action_space), _kv('lifecycle', r.lifecycle)])
    held = WARN if r.state == 'holding' and r.episode_id and r.problems else OK
    w = r.window
    episode = DiagnosticStatus(
        level=max(held, r.episode_level),
        name=f'{node_name}: episode', hardware_id=r.endpoint, message='; '.join(r.episode_reasons) or r.state,
        values=[_kv('state', r.state), _kv('episode_id', r.episode_id), _kv('commands_sent', r.sent),
                _kv('ticks_held', r.held)]
        + [_kv(k, float(s.get(k, 0.0))) for k in ('buffer_s', 'underrun_s', 'latency_p50_ms', 'latency_p95_ms')]
        + [_kv(k, int(s.get(k, 0))) for k in ('actions', 'chunks', 'underruns')]
        + [_kv('dropped_telemetry', r.dropped_telemetry), _kv('telemetry_rejected', r.telemetry_rejected),
           _kv('telemetry_error', r.telemetry_error)]
        + [_kv(f'window.{k}', int(w.get(k, 0)))
           for k in ('episode_ticks', 'underrun_ticks', 'dropped_telemetry', 'telemetry_rejected')])
    p50, p99, worst = r.jitter_ms
    values = [_kv('rate_hz', r.rate_hz), _kv('tick_jitter_p50_ms', p50), _kv('tick_jitter_p99_ms', p99),
              _kv('tick_jitter_max_ms', worst), _kv('ticks_skipped', r.ticks_skipped), _kv('enabled', r.enabled),
              _kv('clamps', r.clamps), _kv('scheduling', r.scheduling)]
    values += [_kv(f'window.{k}', int(w.get(k, 0))) for k in ('ticks_skipped', 'commands_checked', 'commands_clamped')]
    for joint, counts in sorted(r.clamp_counts.items()):
        values += [_kv(f'clamps.{joint}.limit', counts['limit']), _kv(f'clamps.{joint}.step', counts['step'])]
    control = DiagnosticStatus(
        level=r.control_level, name=f'{node_name}: control', hardware_id=r.endpoint,
        message=('; '.join(r.control_reasons) or 'ok') + ('' if r.enabled else ' (dry run)')
        + ('; control thread on the default scheduler' if r.scheduling.startswith('default (') else ''),
        values=values)
    observation = DiagnosticStatus(
        level=WARN if r.problems else OK, name=f'{node_name}: observation', hardware_id=r.endpoint,
        message=r.observing or '; '.join(r.problems) or 'all sources fresh',
        values=[_kv(f'age_s.{source}', age) for source, age in sorted(r.ages.items())]
        + [_kv(f'jpeg_passthrough.{key}', n) for key, (n, _) in sorted(r.images.items())]
        + [_kv(f'decoded.{key}', n) for key, (_, n) in sorted(r.images.items())])
    return DiagnosticArray(header=_header(stamp), status=[connection, episode, control, observation])


def _header(stamp: Any) -> Any:
    from std_msgs.msg import Header

    return Header(stamp=stamp)
