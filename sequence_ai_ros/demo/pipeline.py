"""The main job, end to end on real robot data (``make demo``).

Steps, each through the same command a user would type:

1. the real G1 dataset (LeRobot v2.1) from ``--dataset``;
2. ``seq train ridge`` on the training episodes, then ``seq deploy``;
3. ``seq policy capture --rate 1.0 --images`` and ``seq serve`` on 127.0.0.1 (a free port);
4. ``seq data to-rosbag`` of the held-out episode;
5. ``policy_node`` with the G1 config (26 joints, cam_high, forward_command, 50 Hz);
6. the bag replayed at real time (``bag_player``);
7. one ``~/act`` goal for the episode's length; 8. ``~/label``;
9. ``seq policy data export --format lerobot`` into ``out/export``, re-read by the project's reader;
10. a summary, printed and written to ``out/summary.json``.

Without a dataset, the same loop runs on the ``hold`` template with a synthetic robot publisher, and the
summary says so. All children run in their own process groups and are stopped on any exit.

Isolation: the demo runs in a private ROS domain (:func:`private_domain`: a ROS_DOMAIN_ID of its own,
discovery limited to this host; ``SEQ_DEMO_DOMAIN_ID`` picks one), so other ROS processes on the
machine neither feed its node nor add to the commands it counts. It checks the command topic before
and after starting policy_node: it refuses to run while another process publishes there, and requires
exactly one publisher (its node) while it measures.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from sequence_ai_ros.client.outcome import RunOutcome
from sequence_ai_ros.demo.processes import Processes

REPO_CONFIG = Path(__file__).resolve().parents[2] / 'config'
CONTROL_RATE_HZ = 50.0


@dataclass
class DemoArgs:
    """What ``make demo`` runs on.

    :param dataset: LeRobot v2.1 directory, or None for the synthetic fallback.
    :param out: output directory (summary.json, export/, logs/).
    :param train_episodes: episodes ``seq train`` learns from.
    :param episode: the held-out episode that is replayed.
    :param max_seconds: cap on the replayed duration (s); None = the whole episode.
    """

    dataset: Path | None
    out: Path
    train_episodes: str = '0-4'
    episode: int = 5
    max_seconds: float | None = None


def private_domain(env: dict[str, str], domain: int | None = None) -> int:
    """Put the demo (and its children, through ``env``) in a ROS domain of its own, discovery on this host only.

    The domain is ``domain`` when given, else ``SEQ_DEMO_DOMAIN_ID`` when set, else one derived from the
    process id in 1..101: apart from the default domain 0 (and from your shell's ``ROS_DOMAIN_ID``, which
    the demo never joins), and within 0..101, the ids whose DDS ports stay below Linux's ephemeral port
    range (ROS 2 docs, "The ROS_DOMAIN_ID"). Another process that happens to share it is caught by
    :func:`_join_domain`'s publisher check. Set before rclpy loads.

    :returns: the domain id.
    """
    if domain is None:
        domain = int(os.environ.get('SEQ_DEMO_DOMAIN_ID') or 1 + os.getpid() % 101)
    for target in (os.environ, env):
        target.update(ROS_DOMAIN_ID=str(domain), ROS_AUTOMATIC_DISCOVERY_RANGE='LOCALHOST', ROS_LOCALHOST_ONLY='1')
    return domain


#: Derived domains tried, one after the other, while another process publishes on the demo's topics.
DOMAIN_TRIES = 5
#: How long a domain is watched for another publisher before the demo takes it (s): DDS discovery on one host.
DISCOVERY_S = 3.0


def _join_domain(env: dict[str, str], domain: int, command_topic: str) -> tuple[int, Any, Any]:
    """Join ``domain`` and check that nobody else publishes the demo's command topic or /joint_states.

    A derived domain that is taken moves to the next id (up to :data:`DOMAIN_TRIES`); an explicit
    ``SEQ_DEMO_DOMAIN_ID`` is the only one tried.

    :returns: (the domain joined, its rclpy context, the demo's Operator in it).
    :raises RuntimeError: when every domain tried has another publisher on those topics.
    """
    import rclpy

    from sequence_ai_ros.demo.ros_side import Operator

    watched = (command_topic, '/joint_states')
    tries = 1 if os.environ.get('SEQ_DEMO_DOMAIN_ID') else DOMAIN_TRIES
    taken: list[str] = []
    for attempt in range(tries):
        if attempt:
            domain = private_domain(env, 1 + domain % 101)
        context = rclpy.context.Context()
        rclpy.init(context=context)
        operator = Operator('policy_node', command_topic, context)
        seen = time.monotonic() + DISCOVERY_S     # discovery: another publisher already there shows within this
        while time.monotonic() < seen and not any(operator.publishers(t) for t in watched):
            time.sleep(0.1)
        busy = [f'{n} on {t}' for t in watched if (n := operator.publishers(t))]
        if not busy:
            return domain, context, operator
        operator.close()
        rclpy.try_shutdown(context=context)
        taken.append(f'domain {domain} ({", ".join(busy)})')
    raise RuntimeError(f'other ROS publishers on the demo\'s topics in {"; ".join(taken)}: they would mix their '
                       'messages into the run; stop them, or give the demo a free domain with SEQ_DEMO_DOMAIN_ID')


def _seq(*args: str) -> list[str]:
    return [sys.executable, '-m', 'sequence_ai_ros.cli', *args]


def _node_params(base: str, model: str, endpoint: str, path: Path, cameras: bool) -> dict:
    """Write the node's params file (the robot config plus model, endpoint and demo settings) to ``path``.

    :returns: the node's ``ros__parameters`` as written.
    """
    doc = yaml.safe_load((REPO_CONFIG / base).read_text())
    params = next(doc[k] for k in ('/**/policy_node', 'policy_node') if k in doc)['ros__parameters']
    params.update(model=model, endpoint=endpoint, control_rate_hz=CONTROL_RATE_HZ, autostart=True)
    if not cameras:
        params['camera_names'] = []
        params.pop('cameras', None)
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return params


def run(args: DemoArgs) -> dict:
    """Run the whole loop; return the summary (also written to ``out/summary.json``).

    :raises RuntimeError: when any step fails (the message names the step and its log).
    """
    out = args.out.resolve()
    logs = out / 'logs'
    logs.mkdir(parents=True, exist_ok=True)
    home = out / 'seq_home'   # the demo's own registry and capture store, fresh each run
    if home.exists():
        shutil.rmtree(home)
    env = dict(os.environ, SEQ_HOME=str(home), PYTHONUNBUFFERED='1')
    domain = private_domain(env)
    procs = Processes(logs, env)
    synthetic = args.dataset is None
    summary: dict = {'synthetic': synthetic, 'dataset': None if synthetic else str(args.dataset)}
    t_start = time.monotonic()

    def step(name: str) -> None:
        print(f'[{time.monotonic() - t_start:6.1f}s] {name}', flush=True)

    try:
        if args.dataset is None:     # synthetic
            step('no dataset: deploying the hold template with a synthetic robot')
            policy_dir = out / 'hold_g1'
            if not (policy_dir / 'policy.py').exists():
                procs.run('init', _seq('init', 'hold', str(policy_dir)), 60)
            model = 'hold_g1'
            duration = args.max_seconds or 10.0
            instruction = 'hold position (synthetic robot)'
        else:
            from sequence_ai_ros.datasets.lerobot_reader import LeRobotDataset

            ds = LeRobotDataset(args.dataset)
            duration = ds.length(args.episode) / ds.fps
            if args.max_seconds:
                duration = min(duration, args.max_seconds)
            played_s = duration   # the replayed slice of the recording (the goal itself starts a little later)
            instruction = ds.task(args.episode)
            step(f'training ridge on episodes {args.train_episodes} of {args.dataset}')
            policy_dir = out / 'ridge_g1'
            procs.run('train', _seq('train', 'ridge', '--dataset', str(args.dataset), '--episodes',
                                    args.train_episodes, '--eval-episodes', str(args.episode),
                                    '--out', str(policy_dir), '--force'), 300)
            summary['action_error'] = json.loads((policy_dir / 'metrics.json').read_text())['errors']
            model = 'ridge_g1'
        step(f'seq deploy {policy_dir}/policy.py')
        procs.run('deploy', _seq('deploy', str(policy_dir / 'policy.py'), '--name', model), 120)
        procs.run('capture', _seq('policy', 'capture', model, '--rate', '1.0', '--images'), 60)

        step('seq serve on 127.0.0.1')
        server = procs.start('serve', _seq('serve', model, '--port', '0', '--warm'))
        endpoint = server.wait_for(r'serving \S+ on (\S+:\d+)', 120).group(1)

        bag = out / f'episode_{args.episode}_bag'
        if not synthetic:
            step(f'seq data to-rosbag episode {args.episode}')
            if bag.exists():
                shutil.rmtree(bag)
            procs.run('to_rosbag', _seq('data', 'to-rosbag', str(args.dataset), '--episode', str(args.episode),
                                        '--out', str(bag)), 300)

        params_file = out / 'policy_node.yaml'
        g1 = _node_params('g1.yaml', model, endpoint, params_file, cameras=not synthetic)
        joint_names = g1['joints']['names']
        command_topic = f"/{g1['command']['controller']}/commands"

        import rclpy

        domain, context, operator = _join_domain(env, domain, command_topic)
        try:
            step(f'policy_node with the G1 config (forward_command, 50 Hz; ROS domain {domain})')
            node = procs.start('policy_node', [sys.executable, '-m', 'sequence_ai_ros.node.main', '--ros-args',
                                               '--params-file', str(params_file)])
            try:
                operator.wait_ready(60)
            except RuntimeError as exc:
                raise RuntimeError(f'{exc}; see {node.log_path}') from None
            if synthetic:
                safety = g1['safety']   # the synthetic robot moves within the G1's joint ranges
                procs.start('robot', [sys.executable, '-m', 'sequence_ai_ros.demo.synthetic', '--names',
                                      *joint_names, '--lower', *map(str, safety['lower_limits']),
                                      '--upper', *map(str, safety['upper_limits'])]).wait_for('publishing', 30)
            else:
                step('replaying the bag at real time')
                player = procs.start('bag_player', [sys.executable, '-m', 'sequence_ai_ros.bags.player', str(bag),
                                                    '--wait-subscribers', '30', '--duration', f'{duration:.2f}'])
                player.wait_for(r'^playing ', 60)
            played_from = time.monotonic()
            time.sleep(1.0)  # the first joint_states and frames arrive; the node holds until they do
            # the goal ends with the bag (a stale source after it would end the episode with 'error')
            duration = max(1.0, duration - (time.monotonic() - played_from) - 0.5)
            publishers = operator.command_publishers()
            if publishers != 1:
                raise RuntimeError(f'{publishers} publishers on {command_topic} (expected policy_node alone): '
                                   'the command rate and jitter would not be the node\'s')
            step(f'Act goal: "{instruction}" for {duration:.1f}s')
            try:
                result = operator.run_goal(instruction, max_seconds=duration)
            except RuntimeError as exc:
                raise RuntimeError(f'{exc}; see {node.log_path}') from None
            step(f'Act result: {result.reason} ({result.message})' if result.message else
                 f'Act result: {result.reason}')
            success = result.reason in ('completed', 'timeout')
            label = operator.label(success, notes='make demo: replayed episode ' + str(args.episode))
            if not label.ok:
                raise RuntimeError(f'~/label failed: {label.message}')
            step('labelled the episode via ~/label')
            if operator.command_publishers() != 1:
                raise RuntimeError(f'another publisher joined {command_topic} during the run; the figures would '
                                   'mix its commands in')
            commands = operator.commands
            control_worst, control_values = operator.control_worst, dict(operator.control_values)
        finally:
            operator.close()
            rclpy.try_shutdown(context=context)
        procs.close()

        step('seq policy data export --format lerobot')
        export = out / 'export'
        procs.run('export', _seq('policy', 'data', 'export', model, '--out', str(export), '--format', 'lerobot',
                                 '--images', '--force'), 600)
        from sequence_ai_ros.datasets.verify import verify_export

        reference = args.dataset if not synthetic else None
        check = verify_export(export, reference=reference)
        step(f'export re-read: {check}')

        vals = np.asarray(commands.values) if commands.values else np.zeros((0, 0))
        clamps = _clamps(control_values)
        excess = None
        if not synthetic:
            order = [list(ds.action_names).index(n) for n in joint_names]   # the node's joint order
            played = ds.episode(args.episode).action[:int(round(played_s * ds.fps)) + 1, order]
            excess = recorded_excess(played, ds.fps, joint_names, g1)
        clamps['explained'] = explain_clamps(clamps['per_joint'], excess)
        elapsed = float(result.elapsed_s)
        summary.update({
            'run_outcome': str(RunOutcome(result.actions, result.chunks, elapsed, result.reason)),
            'reason': result.reason,
            'message': result.message,
            'episode_id': result.episode_id,
            'actions': int(result.actions),
            'chunks': int(result.chunks),
            'elapsed_s': elapsed,
            'underruns': int(result.underruns),
            'underrun_s': float(result.underrun_s),
            'max_seam_jump': float(result.max_seam_jump),
            'latency_p50_ms': float(result.latency_p50_ms),
            'latency_p95_ms': float(result.latency_p95_ms),
            'commands_sent': int(result.commands_sent),
            'ticks_held': int(result.ticks_held),
            'ticks_skipped': int(result.ticks_skipped),
            'commands_received': len(commands.times),
            'command_rate_hz': commands.rate_hz(),
            'tick_jitter_p99_ms': commands.jitter_p99_ms(1.0 / CONTROL_RATE_HZ),
            'zero_commands': int(np.sum(np.all(vals == 0.0, axis=1))) if vals.size else 0,
            'clamps': clamps,
            'control_worst': {'level': ['OK', 'WARN', 'ERROR', 'STALE'][min(control_worst[0], 3)],
                              'message': control_worst[1]},
            'label_ok': bool(label.ok),
            'export': str(export),
            'export_reread': check,
            'total_s': time.monotonic() - t_start,
        })
        (out / 'summary.json').write_text(json.dumps(summary, indent=2, default=str) + '\n')
        return summary
    finally:
        procs.close()


def _clamps(values: dict[str, str]) -> dict:
    """The safety filter's clamp counts from /diagnostics control values.

    :returns: ``total``, ``top`` (the three busiest joints, [name, count]) and ``per_joint``
        ({name: {'limit': n, 'step': n}} for every joint clamped at least once).
    """
    per_joint: dict[str, dict[str, int]] = {}
    for key, value in values.items():
        parts = key.split('.')
        if len(parts) >= 3 and parts[0] == 'clamps' and parts[-1] in ('limit', 'step') and int(value):
            per_joint.setdefault('.'.join(parts[1:-1]), {'limit': 0, 'step': 0})[parts[-1]] += int(value)
    top = sorted(((j, c['limit'] + c['step']) for j, c in per_joint.items()), key=lambda kv: -kv[1])[:3]
    return {'total': int(values.get('clamps', 0) or 0), 'top': [[j, n] for j, n in top if n],
            'per_joint': per_joint}


def recorded_excess(actions: np.ndarray, fps: float, names: list[str], params: dict) -> dict[str, dict[str, float]]:
    """Where the robot's own recording is outside the node's safety limits, per joint.

    :param actions: (N, D) the replayed episode's recorded actions, in the joints' order ``names``.
    :param fps: the recording's frame rate (Hz); the node resamples it to its control rate, so a frame's
        change spreads over ``control_rate_hz / fps`` ticks.
    :param params: the node's ``ros__parameters`` (``safety`` and ``control_rate_hz``).
    :returns: {joint: {'below': lowest value under its lower limit, 'above': highest over its upper limit,
        'step': largest change per tick over max_step}}, each key only where exceeded.
    """
    safety = params.get('safety') or {}
    a = np.asarray(actions, np.float64)
    lo = safety.get('lower_limits') or []
    hi = safety.get('upper_limits') or []
    step = safety.get('max_step') or []
    per_tick = (np.abs(np.diff(a, axis=0)).max(axis=0) * fps / float(params['control_rate_hz'])
                if a.shape[0] > 1 else np.zeros(a.shape[1]))
    out: dict[str, dict[str, float]] = {}
    for j, name in enumerate(names):
        row: dict[str, float] = {}
        if lo and a[:, j].min() < lo[j]:
            row['below'] = float(a[:, j].min())
        if hi and a[:, j].max() > hi[j]:
            row['above'] = float(a[:, j].max())
        limit = step[0] if len(step) == 1 else (step[j] if step else None)
        if limit is not None and per_tick[j] > limit:
            row['step'] = float(per_tick[j])
        if row:
            out[name] = row
    return out


def explain_clamps(per_joint: dict[str, dict[str, int]], excess: dict[str, dict[str, float]] | None) -> str:
    """One line saying why the safety filter clamped: where the recording itself exceeds the limits, or not.

    :param per_joint: clamp counts per joint and kind (:func:`_clamps`'s ``per_joint``).
    :param excess: :func:`recorded_excess` of the replayed episode; None without a recording (synthetic).
    :returns: '' when nothing was clamped.
    """
    if not per_joint:
        return ''
    own: list[str] = []
    policy: list[str] = []
    for joint, counts in sorted(per_joint.items()):
        rec = (excess or {}).get(joint, {})
        for kind in ('limit', 'step'):
            if not counts[kind]:
                continue
            recorded = ('below' in rec or 'above' in rec) if kind == 'limit' else 'step' in rec
            (own if recorded else policy).append(f'{joint} {kind} {counts[kind]}')
    parts = []
    if own:
        parts.append('the robot\'s own recording exceeds these limits too: ' + ', '.join(own))
    if policy:
        parts.append(('the policy went past limits the recording stays within: ' if excess is not None else
                      'the policy went past the limits: ') + ', '.join(policy))
    return '; '.join(parts)
