"""``make bench-peers``: drawer-open served by this project, openpi-client and LeRobot's async inference, side by side.

The same task benchmark as ``make check-sim``, for three systems on the same footing:

- the same cached state-only ACT (check-sim's checkpoint: chunk 20 at 80 Hz = 0.25 s; built as check-sim
  builds it when absent), on the same held-out seeds (``test_tasks[0:N]``, N = 20), one warm-up episode on
  ``train_tasks[0]`` first per run (not counted);
- the same robot: drawer-open-v3 stepped at 80 Hz real time, holding its last command
  (peers_run.py's ``RealTimeSim``);
- the same delay proxy (sequence_ai_ros/bench/delay_proxy.py, its own process) between each client and its
  server, at round trips of 0, 0.5 and 0.8 of a chunk (0, 125, 200 ms), and a compute-bound condition: each
  inference padded to 125 ms (half a chunk) with no link delay.

Systems (peers_run.py drives the clients, peers_servers.py hosts the peers' servers; docs/comparison.md says
what each does):

- this project: ``seq serve`` of the checkpoint (``seq init lerobot`` + ``seq deploy``, as check-sim deploys
  it; the compute-bound copy is the template's class with its ``infer_batch`` padded), driven through the
  ROS-free client ``sequence_ai.connect(...).next_action()`` at 80 Hz, the engine ``policy_node`` runs;
  its defaults;
- openpi: openpi-client 0.1.2's ``Runtime`` + ``PolicyAgent(ActionChunkBroker(WebsocketClientPolicy, H))``
  against a minimal websocket server with openpi's settings, hosting the checkpoint; H = 10 (half the chunk,
  as openpi's ALOHA examples: 25 of pi0's 50) and, tuned, 20 (the whole chunk: the fewest stalls);
- LeRobot async: LeRobot 0.6.1's ``RobotClient`` (its control loop and action receiver) and ``PolicyServer``
  (lerobot.async_inference); its defaults (``chunk_size_threshold`` 0.5, ``weighted_average``,
  ``actions_per_chunk`` = the chunk, the server's ``inference_latency`` 1/30 s) and, tuned,
  ``chunk_size_threshold`` 0 (an observation only when the queue is empty, so the control loop blocks on
  no send while it has actions).

Per system, setting and condition it prints success out of N, median time to success (from the first
commanded action, successes only), idle control steps per episode (80 Hz steps with no new command: the arm
held), inferences per episode (this project: the requests its client sent, each an inference on the worker;
openpi: the broker's infer calls; LeRobot: the chunks its client received, one per inference), then the
machine and the load average. Nothing
is judged (exit 0 unless a step fails). The peers' client packages (openpi-client, msgpack, websockets,
dm-tree, wrapt; no dependencies of theirs) are installed once with pip into ``<cache>/peers-<hash>`` and put
on the LeRobot venv's PYTHONPATH.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path[:0] = [str(HERE), str(REPO)]

import check_sim as sim  # noqa: E402
from loop import LoadSampler  # noqa: E402

from sequence_ai_ros.demo.processes import Processes  # noqa: E402

#: The peers' client side, pinned; installed --no-deps (openpi-client declares numpy<2, which it does not need).
PEER_PACKAGES = ('openpi-client==0.1.2', 'msgpack==1.1.0', 'websockets==15.0.1', 'dm-tree==0.1.10', 'wrapt==2.5.2')
COMPUTE_S = 0.5 * sim.CHUNK_S           # the compute-bound condition: 125 ms per inference
DEPLOYMENT_COMPUTE = 'sim_act_compute'
#: this project's compute-bound deployment: the lerobot template's class, each inference padded to COMPUTE_S.
WRAPPER = '''"""make bench-peers' wrapper: the lerobot template, each inference padded to {compute_s} s."""

import time

from lerobot_policy import LeRobot


class ComputeBound(LeRobot):
    """The template's policy, whose inference takes at least {compute_s} s."""

    def infer_batch(self, inputs, episodes):
        t0 = time.perf_counter()
        out = super().infer_batch(inputs, episodes)
        time.sleep(max(0.0, {compute_s} - (time.perf_counter() - t0)))
        return out
'''


@dataclasses.dataclass(frozen=True)
class Condition:
    name: str
    rtt_s: float            # the proxy's round trip
    compute_s: float        # each inference padded to this (0: the model's own time)


@dataclasses.dataclass(frozen=True)
class Setting:
    system: str             # peers_run.py's --system
    label: str              # as printed
    args: tuple[str, ...] = ()


CONDITIONS = (Condition('rtt 0', 0.0, 0.0), Condition(f'rtt {0.5 * sim.CHUNK_S * 1e3:.0f} ms (0.5 chunk)',
                                                       0.5 * sim.CHUNK_S, 0.0),
              Condition(f'rtt {0.8 * sim.CHUNK_S * 1e3:.0f} ms (0.8 chunk)', 0.8 * sim.CHUNK_S, 0.0),
              Condition(f'compute {COMPUTE_S * 1e3:.0f} ms, rtt 0', 0.0, COMPUTE_S))
SETTINGS = (Setting('product', 'this project: defaults'),
            Setting('openpi', 'openpi: action_horizon=10 (default)', ('--action-horizon', '10')),
            Setting('openpi', 'openpi: action_horizon=20 (tuned)', ('--action-horizon', '20')),
            Setting('lerobot', 'LeRobot async: chunk_size_threshold=0.5 (default)', ('--chunk-size-threshold', '0.5')),
            Setting('lerobot', 'LeRobot async: chunk_size_threshold=0 (tuned)', ('--chunk-size-threshold', '0')))


def peer_packages(c: sim.Check) -> Path:
    """The peers' client packages, installed once into the LeRobot cache (pip --target, --no-deps)."""
    dest = c.args.cache.resolve() / f'peers-{sim.sha16(*PEER_PACKAGES, c.lerobot_version())}'
    sim.build_once(dest, lambda tmp: c.run('pip_peers', [
        str(c.venv / 'bin' / 'pip'), 'install', '-q', '--no-deps', '--target', str(tmp), *PEER_PACKAGES], 900))
    return dest


def deploy_compute_bound(c: sim.Check, ckpt: Path, env: dict) -> None:
    """``seq init lerobot`` + the padded wrapper as policy.py + check-sim's config, ``seq deploy`` it."""
    import yaml

    seq = [c.py(), '-m', 'sequence_ai_ros.cli']
    pdir = c.out / f'policy_{DEPLOYMENT_COMPUTE}'
    c.run(f'seq_init_{DEPLOYMENT_COMPUTE}', [*seq, 'init', 'lerobot', str(pdir)], 120, env=env)
    (pdir / 'policy.py').rename(pdir / 'lerobot_policy.py')
    (pdir / 'policy.py').write_text(WRAPPER.format(compute_s=COMPUTE_S))
    config = yaml.safe_load((c.out / 'policy' / 'config.yaml').read_text())   # the one deploy() wrote
    (pdir / 'config.yaml').write_text(yaml.safe_dump(config, sort_keys=False))
    c.run(f'seq_deploy_{DEPLOYMENT_COMPUTE}', [*seq, 'deploy', str(pdir / 'policy.py'), '--name',
                                               DEPLOYMENT_COMPUTE], 600, env=env)


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path('/proc/cpuinfo').read_text().splitlines():
            if line.startswith('model name'):
                cpu = line.split(':', 1)[1].strip()
                break
    except OSError:
        pass
    return f'{cpu}, {os.cpu_count()} cores, {platform.system()} {platform.release()}'


def summarize(eps: list[dict]) -> dict:
    times = sorted(e['time_to_success_s'] for e in eps if e['success'])
    n = max(1, len(eps))
    return {'n': len(eps), 'success': len(times), 'median_s': statistics.median(times) if times else None,
            'idle_steps': sum(e['idle_steps'] for e in eps) / n, 'inferences': sum(e['inferences'] for e in eps) / n,
            'late_steps': sum(e['late_steps'] for e in eps), 'overwritten': sum(e['overwritten'] for e in eps) / n,
            'stalled': sum(bool(e.get('stalled_must_go_clear')) for e in eps),
            'observations_sent': sum(e.get('observations_sent', 0) for e in eps) / n,
            'reasons': sorted({e['reason'] for e in eps if not e['success']})}


def table(rows: list[dict]) -> list[str]:
    head = (f'{"system: setting":52s} {"condition":28s} {"solved":>6s} {"median s":>8s} {"idle/ep":>7s} '
            f'{"inf/ep":>6s} {"load":>5s}')
    out = [head, '-' * len(head)]
    for r in rows:
        med = '-' if r['median_s'] is None else f'{r["median_s"]:.3f}'
        out.append(f'{r["setting"]:52s} {r["condition"]:28s} {r["success"]:>3d}/{r["n"]:<2d} {med:>8s} '
                   f'{r["idle_steps"]:7.1f} {r["inferences"]:6.1f} {r["load_peak"]:5.2f}')
    return out


def markdown(rows: list[dict]) -> list[str]:
    """The table as docs/benchmarks.md shows it: one row per system and setting, one column per condition."""
    conds = [c.name for c in CONDITIONS]
    out = ['| system: setting | ' + ' | '.join(conds) + ' |', '|---|' + '---|' * len(conds)]
    for s in SETTINGS:
        cells = []
        for cond in conds:
            r = next((r for r in rows if r['setting'] == s.label and r['condition'] == cond), None)
            if r is None:
                cells.append('–')
                continue
            med = '–' if r['median_s'] is None else f'{r["median_s"]:.3f} s'
            cells.append(f'{r["success"]}/{r["n"]}, {med}, {r["idle_steps"]:.0f} idle, {r["inferences"]:.1f} inf')
        out.append(f'| {s.label} | ' + ' | '.join(cells) + ' |')
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--venv', type=Path, required=True, help='the LeRobot venv (Python >= 3.12)')
    parser.add_argument('--cache', type=Path, default=Path.home() / '.cache' / 'sequence_ai')
    parser.add_argument('--out', type=Path, default=REPO / 'out' / 'bench-peers')
    parser.add_argument('--seeds', type=int, default=20, help='held-out seeds per run (test_tasks[0:N])')
    parser.add_argument('--only', nargs='*', default=[], help='development: systems (product, openpi, lerobot)')
    parser.add_argument('--conditions', nargs='*', type=int, default=[],
                        help='development: condition indices (0: rtt 0, 1: 0.5 chunk, 2: 0.8 chunk, 3: compute)')
    parser.add_argument('--cached-only', action='store_true', help='never build demos or train; skip when absent')
    args = parser.parse_args()
    c = sim.Check(args)
    settings = [s for s in SETTINGS if not args.only or s.system in args.only]
    conds = [cond for i, cond in enumerate(CONDITIONS) if not args.conditions or i in args.conditions]
    rows: list[dict] = []
    episodes: list[dict] = []
    load_start = os.getloadavg()
    try:
        if not (c.venv / 'bin' / 'python').is_file():
            raise sim.Skip(f'no LeRobot venv at {c.venv}')
        c.step('checkpoint (check-sim\'s, cached under the LeRobot cache) and the peers\' client packages')
        _, ckpt, built = sim.artifacts(c)
        pkgs = peer_packages(c)
        c.step(f'checkpoint {"trained" if built["checkpoint_built"] else "cached"}: {ckpt}; peers\' packages {pkgs}')
        env = sim.deploy(c, ckpt)
        deploy_compute_bound(c, ckpt, env)
        lr_env = dict(c.lr_env, PYTHONPATH=f'{REPO}:{pkgs}', HF_LEROBOT_HOME=str(c.out / 'hf_lerobot'))
        servers = Processes(c.out / 'logs', dict(env, PYTHONPATH=f'{REPO}:{pkgs}', HF_LEROBOT_HOME=str(
            c.out / 'hf_lerobot')))
        proxies = Processes(c.out / 'logs', dict(os.environ, PYTHONUNBUFFERED='1'))
        load = LoadSampler()
        work = c.out / 'work'
        (work / 'runs').mkdir(parents=True)
        try:
            ports: dict[tuple[str, float], int] = {}
            systems = {s.system for s in settings}
            if 'product' in systems:
                child = servers.start('seq_serve', [c.py(), '-m', 'sequence_ai_ros.cli', 'serve', sim.DEPLOYMENT,
                                                    DEPLOYMENT_COMPUTE, '--host', '127.0.0.1', '--port', '0',
                                                    '--warm'])
                port = int(child.wait_for(r'serving .+ on \S+:(\d+)', 600).group(1))
                ports[('product', 0.0)] = ports[('product', COMPUTE_S)] = port
            for kind in sorted(systems - {'product'}):
                for compute in sorted({cond.compute_s for cond in conds}):
                    child = servers.start(f'{kind}_server_{compute:g}', [
                        c.py(), str(HERE / 'peers_servers.py'), kind, '--checkpoint', str(ckpt), '--compute-s',
                        str(compute), '--workdir', str(work)])
                    ports[(kind, compute)] = int(child.wait_for(r'listening on (\d+)', 300).group(1))
            c.step(f'servers up: {ports}')
            for cond in conds:
                for s in settings:
                    tag = f'{s.label.split(":")[0]}-{s.args[-1] if s.args else "defaults"}-{cond.name}'
                    tag = ''.join(ch if ch.isalnum() or ch in '.-' else '_' for ch in tag)
                    proxy = proxies.start(f'proxy_{tag}', [sys.executable, '-c', sim.PROXY,
                                                           str(ports[(s.system, cond.compute_s)]), str(cond.rtt_s / 2)])
                    proxy_port = int(proxy.wait_for(r'proxy on (\d+)', 30).group(1))
                    result = work / 'runs' / f'{tag}.json'
                    argv = [c.py(), str(HERE / 'peers_run.py'), '--system', s.system, '--port', str(proxy_port),
                            '--seeds', f'0:{args.seeds}', '--out', str(result), *s.args]
                    if s.system == 'product':
                        argv += ['--deployment', DEPLOYMENT_COMPUTE if cond.compute_s else sim.DEPLOYMENT]
                    if s.system == 'lerobot':
                        argv += ['--checkpoint', str(ckpt)]
                    since = time.monotonic()
                    log = c.out / 'logs' / f'run_{tag}.log'
                    with log.open('w') as fh:
                        done = subprocess.run(argv, env=lr_env, stdout=fh, stderr=subprocess.STDOUT, timeout=1800,
                                              cwd=work)
                    proxy.stop()
                    if done.returncode != 0:
                        raise RuntimeError(f'{s.label} at {cond.name} failed ({done.returncode}); see {log}')
                    eps = json.loads(result.read_text())['episodes']
                    r = dict(summarize(eps), setting=s.label, system=s.system, condition=cond.name,
                             rtt_ms=cond.rtt_s * 1e3, compute_ms=cond.compute_s * 1e3, load_peak=load.peak(since),
                             wall_s=time.monotonic() - since)
                    rows.append(r)
                    episodes += [dict(e, setting=s.label, condition=cond.name) for e in eps]
                    med = '-' if r['median_s'] is None else f'{r["median_s"]:.3f} s'
                    c.step(f'{s.label} @ {cond.name}: {r["success"]}/{r["n"]}, median {med}, idle/ep '
                           f'{r["idle_steps"]:.1f}, inferences/ep {r["inferences"]:.1f}, load {r["load_peak"]:.2f}, '
                           f'{r["wall_s"]:.0f} s')
        finally:
            load.close()
            proxies.close()
            servers.close()
    except sim.Skip as exc:
        print(f'bench-peers: SKIPPED: {exc}')
        return 3
    except Exception as exc:   # every failure ends in the summary, with its log
        c.failures.append(f'{type(exc).__name__}: {exc}')
    load_end = os.getloadavg()
    lines = ['', f'=== drawer-open-v3, the same ACT (chunk {sim.CHUNK} at 80 Hz = {sim.CHUNK_S:.2f} s), '
             f'{args.seeds} held-out seeds per row, three systems through the same delay proxy ===',
             f'machine: {machine()}',
             f'load average (1/5/15 min): start {"/".join(f"{v:.2f}" for v in load_start)}, end '
             f'{"/".join(f"{v:.2f}" for v in load_end)}; "load" column: the 1-min peak during the row',
             'median s: time to success from the first commanded action (successes); idle/ep: 80 Hz steps with no '
             'new command (the arm held), per episode; inf/ep: inferences per episode (this project: requests sent; '
             'openpi: infer calls; LeRobot: chunks received)',
             *table(rows)]
    notes = []
    for r in rows:
        if r['system'] == 'lerobot':
            notes.append(f'{r["setting"]} @ {r["condition"]}: observations sent/ep {r["observations_sent"]:.0f} '
                         f'for {r["inferences"]:.1f} inferences; stalled (queue empty, must_go clear) '
                         f'{r["stalled"]}/{r["n"]}')
        if r['success'] < r['n']:
            notes.append(f'{r["setting"]} @ {r["condition"]}: unsolved end as {", ".join(r["reasons"])}')
        if r['late_steps']:
            notes.append(f'{r["setting"]} @ {r["condition"]}: {r["late_steps"]} simulator steps over half a period '
                         'late (a busy machine)')
    lines += notes + ['', 'markdown:', *markdown(rows)]
    lines.append(f'bench-peers took {time.monotonic() - c.t0:.0f} s'
                 + (f'; FAILED: {"; ".join(c.failures)}' if c.failures else ''))
    text = '\n'.join(lines)
    print(text)
    (c.out / 'summary.txt').write_text(text + '\n')
    (c.out / 'summary.json').write_text(json.dumps({'rows': rows, 'episodes': episodes, 'machine': machine(),
                                                    'load_start': load_start, 'load_end': load_end,
                                                    'failures': c.failures}, indent=1, default=str))
    return 1 if c.failures else 0


if __name__ == '__main__':
    raise SystemExit(main())
