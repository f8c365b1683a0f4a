"""The demo's summary: one line per figure, with what it means."""

from __future__ import annotations

from typing import Any


def _f(value: Any, fmt: str = '.3f') -> str:
    return 'n/a' if value is None else format(value, fmt)


def format_summary(s: dict[str, Any]) -> str:
    """Return the printed summary of :func:`sequence_ai_ros.demo.pipeline.run`'s result."""
    lines = ['', '=== sequence_ai_ros demo summary ' + ('(SYNTHETIC robot, hold template) ' if s['synthetic'] else
                                                      f"(real G1 data: {s['dataset']}) ") + '===',
             s['run_outcome'],
             f"underruns            {s['underruns']}  (dry spells of the chunk buffer; 0 = never ran out)",
             f"underrun_s           {_f(s['underrun_s'])}  (seconds without a fresh policy action)",
             f"max_seam_jump        {_f(s['max_seam_jump'], '.4f')}  (largest per-joint step across a chunk "
             'boundary, rad or hand units)',
             f"chunk latency        p50 {_f(s['latency_p50_ms'], '.1f')} ms, p95 {_f(s['latency_p95_ms'], '.1f')} ms"
             '  (round trip robot -> worker -> robot, one clock)',
             f"commands sent        {s['commands_sent']} from policy actions + "
             f"{s.get('ticks_held', 0)} holds + {s.get('ticks_skipped', 0)} skipped ticks in the episode; "
             f"{s['commands_received']} received (holds "
             f"included) at {_f(s['command_rate_hz'], '.2f')} Hz  (commands / duration at a subscriber; "
             'target 50 Hz)',
             f"tick jitter p99      {_f(s['tick_jitter_p99_ms'], '.2f')} ms  (|dt - 20 ms| between commands at a "
             'subscriber)',
             f"zero commands        {s['zero_commands']}  (commands that were all zeros; must be 0)"]
    clamps, worst = s.get('clamps') or {}, s.get('control_worst') or {}
    if clamps:
        busiest = ', '.join(f'{j} {n}' for j, n in clamps.get('top', []))
        lines.append(f"safety clamps        {clamps.get('total', 0)} joint values clamped to a limit or max_step"
                     + (f' (most: {busiest})' if busiest else '')
                     + f"; /diagnostics control at worst {worst.get('level', 'n/a')}"
                     + (f": {worst['message']}" if worst.get('message') and worst.get('level') != 'OK' else ''))
        if clamps.get('explained'):
            lines.append(f"  why                {clamps['explained']}")
    err = s.get('action_error')
    if err:
        lines.append('action error on held-out episode (MAE over the action horizon, action units):')
        for name, value in err.items():
            lines.append(f'  {name:<22}{value:.5f}')
    lines += [f"label                {'stored' if s['label_ok'] else 'FAILED'} via ~/label",
              f"export               {s['export']} (LeRobot v2.1), re-read by the project's reader: "
              f"{s['export_reread'].get('episodes')} episode(s), {s['export_reread'].get('frames')} frames; "
              '`make check-export` loads it in LeRobot',
              f"total                {s['total_s']:.1f}s for the whole job"]
    return '\n'.join(lines)
