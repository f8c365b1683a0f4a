"""``make rtc-sim``: real-time chunking on drawer-open, a small SmolVLA served with RTC on and off, compute-bound.

Outside CI. Runs in the ROS venv (it drives ``sim_robot`` and ``policy_node``, as check_sim.py does); every
LeRobot step runs in the LeRobot venv (``--venv``), fully offline (``HF_HUB_OFFLINE=1``), one thread:

1. demos: Meta-World's scripted expert on ``train_tasks[0:50]`` of drawer-open-v3 (vla_demos.py: all 43
   ``joint_states`` as ``observation.state``, the 64 px ``corner`` camera as ``observation.image``; LeRobot's
   SmolVLA reads no ``observation.environment_state`` and refuses a batch without a real camera);
2. the SmolVLM backbone built small from its config in a local hub cache (tiny_smolvla.py ``--hub``:
   :data:`BACKBONE`, a WordLevel tokenizer), then ``lerobot-train --policy.type=smolvla`` from scratch
   (:data:`RECIPE`: chunk 20 = 0.25 s at 80 Hz, the VLM trained too, ``load_vlm_weights=false``). Demos,
   backbone and checkpoint are cached under ``<cache>/sim/`` like check-sim's ACTs, keyed by the generator's
   sources, the dataset's hash, the recipe, the backbone and the LeRobot version;
3. the reference: the checkpoint in-process (inprocess.py: LeRobot's own ``select_action``, no delay) on the
   held-out ``test_tasks[0:N]``;
4. ``seq init lerobot`` -> ``seq deploy`` -> ``seq serve`` of the checkpoint three times: RTC off with no added
   delay, and RTC off and on (a copy whose ``rtc_config`` is enabled, ``execution_horizon`` half a chunk) with a
   compute-bound delay: each deployment's policy.py is a harness wrapper (:data:`WRAPPER`) around the
   template's, which pads every inference call to ``--compute-s`` (default 0.125 s, half a chunk) with a
   sleep. The worker answers one episode's requests one at a time, so the delay cannot be pipelined away as a
   link delay can. Then per condition a fresh ``policy_node`` (config/sim_policy_node.yaml, the camera at
   80 Hz) on the same held-out instances (noise seed 0 in every deployment: chunk k of an episode starts
   from the same noise in each condition), one warm-up episode on ``train_tasks[0]`` first.

It prints, per condition: success, median and p90 time to success (from the first commanded action),
underruns, the prefix error of every request (the wrapper's log: the served chunk against ``chunk_tail`` over
the rows the robot runs meanwhile, what RTC in-paints), the seam figures of the node's episode lines
(``max_seam_gap``: the new chunk's row against the old chunk's own row for the same step, where the old chunk
has one; ``max_seam_jump``: the step between the last command and the new chunk's first), the chunk round
trip and the model's own compute time per call. Nothing is judged: it is a measurement (exit 0 unless a step
fails). About 20 minutes on two cores the first time (lerobot-train about 10 of them), 6 from the cache.
"""

from __future__ import annotations

import argparse
import dataclasses
import fcntl
import json
import os
import re
import shutil
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import yaml

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path[:0] = [str(HERE), str(REPO / 'test' / 'lerobot_check'), str(REPO)]

import check_sim as sim  # noqa: E402
from loop import DT, LoadSampler, SimOperator, summarize  # noqa: E402

from sequence_ai_ros.demo.processes import Processes  # noqa: E402
from sequence_ai_ros.sim.task import COMMAND_NAMES, JOINT_NAMES  # noqa: E402

TASK = 'drawer-open-v3'
IMAGE_PX = 64
CAMERA = 'corner'
#: The SmolVLM backbone (tiny_smolvla.Backbone's fields; empty: check-lerobot's tiny one, a 2-layer Llama of width
#: 32 and a 1-layer vision tower of width 16 on 32 px images). With the action expert (width 16) and a 48-wide
#: state projection the policy has 60,800 parameters. In-process on the 50 held-out instances this recipe solved
#: 50/50 (median 1.27 s; 49/50 in another run); development runs with longer schedules, at their step 1,000: the
#: same backbone 50/50 (1.11 s), a 481k one (width 64, 4 layers, expert 48) 50/50 (1.13 s).
BACKBONE: dict = {}
WORDS = 'open drawer'
STEPS = 1000
#: lerobot-train's arguments (part of the checkpoint's cache key).
RECIPE = ['--policy.type=smolvla', f'--policy.chunk_size={sim.CHUNK}', f'--policy.n_action_steps={sim.CHUNK}',
          '--policy.max_state_dim=48', '--policy.resize_imgs_with_padding=[32,32]', '--policy.tokenizer_max_length=16',
          '--policy.load_vlm_weights=false', '--policy.num_vlm_layers=2', '--policy.self_attn_every_n_layers=2',
          '--policy.expert_width_multiplier=0.5', '--policy.train_expert_only=false',
          '--policy.freeze_vision_encoder=false', '--policy.optimizer_lr=3e-4', '--policy.scheduler_warmup_steps=100',
          f'--policy.scheduler_decay_steps={STEPS}', '--batch_size=64', f'--steps={STEPS}', '--seed=1',
          '--num_workers=0']
#: The served copy with RTC: LeRobot's RTCConfig defaults (linear prefix schedule, guidance weight up to 10) and an
#: execution horizon of half a chunk; the runtime guides max(it, the robot's expected delay) rows.
RTC_CONFIG = {'enabled': True, 'execution_horizon': sim.CHUNK // 2}
COMPUTE_S = 0.5 * sim.CHUNK_S
#: The harness's policy.py: the lerobot template's class (its policy.py, moved beside it as lerobot_policy.py),
#: every inference call padded to COMPUTE_S with a sleep. Each call logs its own compute time and, per request,
#: the prefix error max |chunk[:k] - chunk_tail[:k]| over k = min(tail rows, expected delay) (-1: no tail): the
#: rows the robot runs while the chunk is computed, which RTC in-paints.
WRAPPER = '''"""make rtc-sim's wrapper: the lerobot template, each inference padded to {compute_s} s (compute-bound)."""

import sys
import time

import numpy as np
from lerobot_policy import LeRobot

COMPUTE_S = {compute_s}


class ComputeBound(LeRobot):
    """The template's policy, whose inference takes at least COMPUTE_S."""

    def infer_batch(self, inputs, episodes):
        t0 = time.monotonic()
        out = super().infer_batch(inputs, episodes)
        took = time.monotonic() - t0
        for inp, chunk in zip(inputs, out):
            tail = np.asarray(inp.chunk_tail) if inp.chunk_tail is not None else np.zeros((0, 0))
            k = min(len(tail), int(inp.expected_delay_actions), len(chunk) if hasattr(chunk, '__len__') else 0)
            err = float(np.abs(chunk[:k] - tail[:k]).max()) if k else -1.0
            print(f'rtc-sim compute_ms {{took * 1e3:.1f}} rows {{len(inputs)}} tail {{len(tail)}} '
                  f'delay {{inp.expected_delay_actions}} prefix_err {{err:.5f}}', file=sys.stderr, flush=True)
        time.sleep(max(0.0, COMPUTE_S - took))
        return out
'''


@dataclasses.dataclass(frozen=True)
class Served:
    """One served condition: its deployment, RTC, the compute time each inference is padded to (s)."""

    name: str
    deployment: str
    rtc: bool
    compute_s: float


def conditions(compute_s: float) -> list[Served]:
    return [Served('rtc_off@0', 'sim_smolvla', False, 0.0),
            Served(f'rtc_off@{compute_s:g}s', 'sim_smolvla_delay', False, compute_s),
            Served(f'rtc_on@{compute_s:g}s', 'sim_smolvla_rtc_delay', True, compute_s)]


# -- artifacts ---------------------------------------------------------------------------------------
def artifacts(c: sim.Check, episodes: int = sim.DEMO_EPISODES) -> tuple[Path, Path, Path, dict]:
    """The cached demos, checkpoint and hub cache, built when absent; (demos, checkpoint, hub, what was built)."""
    cache = c.args.cache.resolve() / 'sim'
    cache.mkdir(parents=True, exist_ok=True)
    versions = c.lerobot_version()
    sources = [(HERE / name).read_bytes() for name in ('vla_demos.py', 'demos.py')]
    demos_key = sim.sha16(*sources, (REPO / 'sequence_ai_ros' / 'sim' / 'task.py').read_bytes(), str(episodes),
                          str(IMAGE_PX), versions)
    demos = cache / f'demos-{TASK}-vla{IMAGE_PX}-{demos_key}'
    built: dict = {'versions': versions, 'demos': str(demos)}
    with open(cache / f'.lock-{TASK}-smolvla', 'w') as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        t = time.monotonic()
        built['demos_built'] = sim.build_once(demos, lambda tmp: c.run('demos_vla', [
            c.py(), str(HERE / 'vla_demos.py'), '--root', str(tmp), '--episodes', str(episodes), '--image',
            str(IMAGE_PX)], 1800))
        built['demos_s'] = time.monotonic() - t
        data_hash = sim.dir_hash(demos)
        made_by = (REPO / 'test' / 'lerobot_check' / 'tiny_smolvla.py').read_bytes()
        key = sim.sha16(data_hash, json.dumps(RECIPE), json.dumps(BACKBONE), WORDS, made_by, versions)
        root = cache / f'smolvla-{key}'
        built.update(dataset_hash=data_hash, checkpoint_dir=str(root))
        if not (root / '.complete').is_file():
            c.step(f'lerobot-train: SmolVLA on {episodes} {TASK} demos, {STEPS} steps, CPU, 1 thread, offline '
                   '(~10-15 min)')
        built['checkpoint_built'] = sim.build_once(root, lambda tmp: train(c, demos, tmp))
    built.update(json.loads((root / 'build.json').read_text()))
    ckpt = root / 'train' / 'checkpoints' / 'last' / 'pretrained_model'
    if not (ckpt / 'model.safetensors').is_file():
        raise RuntimeError(f'no model.safetensors in {ckpt}')
    return demos, ckpt, root / 'hub', built


def train(c: sim.Check, demos: Path, out: Path) -> None:
    """The backbone into ``out/hub``, then lerobot-train into ``out/train``; its figures into ``out/build.json``."""
    out.mkdir(parents=True)
    c.run('smolvla_hub', [c.py(), str(REPO / 'test' / 'lerobot_check' / 'tiny_smolvla.py'), '--hub', str(out / 'hub'),
                          '--backbone', json.dumps(BACKBONE), '--words', WORDS], 300)
    env = dict(c.lr_env, HF_HUB_CACHE=str(out / 'hub'))
    t = time.monotonic()
    text = c.run('train_smolvla', [
        str(c.venv / 'bin' / 'lerobot-train'), *RECIPE, '--policy.device=cpu', '--policy.push_to_hub=false',
        f'--dataset.repo_id=local/{demos.name}', f'--dataset.root={demos}', f'--output_dir={out / "train"}',
        '--job_name=smolvla_sim', '--save_freq=100000', '--log_freq=100', '--wandb.enable=false'], 3 * 3600, env=env)
    train_s = time.monotonic() - t
    params = re.search(r'num_total_params=(\d+)', text)
    losses = re.findall(r'step:(\S+) .*? loss:(\S+)', text)
    (out / 'build.json').write_text(json.dumps({
        'train_s': train_s, 'steps': STEPS, 's_per_step': train_s / STEPS, 'params': int(params.group(1)) if params
        else None, 'loss_last': losses[-1][1] if losses else None}))


# -- serving -----------------------------------------------------------------------------------------
def deploy(c: sim.Check, ckpt: Path, hub: Path, served: Served, env: dict) -> None:
    """Run seq init lerobot, put the wrapper in as policy.py, write config.yaml, seq deploy as ``served.deployment``."""
    seq = [c.py(), '-m', 'sequence_ai_ros.cli']
    pdir = c.out / f'policy_{served.deployment}'
    c.run(f'seq_init_{served.deployment}', [*seq, 'init', 'lerobot', str(pdir)], 120, env=env)
    if served.rtc:
        copy = c.out / 'checkpoint_rtc'
        if not copy.is_dir():
            shutil.copytree(ckpt, copy)
            cfg = json.loads((copy / 'config.json').read_text())
            cfg['rtc_config'] = RTC_CONFIG
            (copy / 'config.json').write_text(json.dumps(cfg, indent=2))
        ckpt = copy
    (pdir / 'policy.py').rename(pdir / 'lerobot_policy.py')
    (pdir / 'policy.py').write_text(WRAPPER.format(compute_s=served.compute_s))
    config = yaml.safe_load((pdir / 'config.yaml').read_text())
    config.update(checkpoint=str(ckpt), device='cpu', fps=round(1 / DT), action_space='joint_absolute',
                  state_names=list(JOINT_NAMES), features={}, action_names=list(COMMAND_NAMES),
                  robot_type='metaworld_sawyer', hub_cache=str(hub), noise_seed=0)
    (pdir / 'config.yaml').write_text(yaml.safe_dump(config, sort_keys=False))
    c.run(f'seq_deploy_{served.deployment}', [*seq, 'deploy', str(pdir / 'policy.py'), '--name', served.deployment,
                                              '--timeout', '300'], 900, env=env)


def seam(line: str, key: str) -> float | None:
    m = re.search(rf'{key} (\S+?),', line)
    return float(m.group(1)) if m else None


def wrapper_lines(log: Path) -> list[tuple[float, float]]:
    """(compute ms, prefix error) of every request the wrappers logged, in order (error -1: no tail)."""
    return [(float(a), float(b)) for a, b in re.findall(r'rtc-sim compute_ms (\S+) .*? prefix_err (\S+)',
                                                       log.read_text(errors='replace'))]


def row(eps: list, figures: dict, served: Served, logged: list[tuple[float, float]]) -> dict:
    calls = [ms for ms, _ in logged]
    prefix = [e for _, e in logged if e >= 0]
    r = dict(summarize(eps), **figures, rtc=served.rtc, compute_s=served.compute_s)
    gaps = [g for e in eps if (g := seam(e.node_line, 'max_seam_gap')) is not None]
    jumps = [j for e in eps if (j := seam(e.node_line, 'max_seam_jump')) is not None]
    r.update(seam_gap_median=statistics.median(gaps) if gaps else None, seam_gap_max=max(gaps) if gaps else None,
             seam_jump_median=statistics.median(jumps) if jumps else None,
             seam_jump_max=max(jumps) if jumps else None,
             latency_p50_ms=statistics.median(e.latency_p50_ms for e in eps) if eps else None,
             compute_p50_ms=float(np.percentile(calls, 50)) if calls else None,
             compute_p95_ms=float(np.percentile(calls, 95)) if calls else None,
             compute_over=sum(x > served.compute_s * 1e3 for x in calls) if served.compute_s else 0, calls=len(calls),
             prefix_err_median=statistics.median(prefix) if prefix else None,
             prefix_err_max=max(prefix) if prefix else None)
    return r


def table(rows: dict[str, dict]) -> list[str]:
    head = (f'{"condition":18s} {"RTC":>3s} {"compute":>7s} {"solved":>7s} {"median s":>8s} {"p90 s":>6s} '
            f'{"prefix err med/max":>18s} {"seam gap med/max":>16s} {"seam jump med/max":>17s} {"underruns":>9s} '
            f'{"underrun_s":>10s} '
            f'{"rtt p50":>7s} {"model ms p50/p95":>16s} {"overruns":>8s} {"load":>5s}')
    out = [head, '-' * len(head)]
    f = sim.fmt
    for name, r in rows.items():
        rtc = '-' if r.get('rtc') is None else ('on' if r['rtc'] else 'off')
        compute = f'{r["compute_s"] * 1e3:.0f} ms' if r.get('compute_s') else '-'
        out.append(
            f'{name:18s} {rtc:>3s} {compute:>7s} {r["success"]:>3d}/{r["n"]:<3d} {f(r["median_s"]):>8s} '
            f'{f(r["p90_s"]):>6s} {f(r.get("prefix_err_median"), ".4f"):>8s}/{f(r.get("prefix_err_max"), ".4f"):<9s} '
            f'{f(r.get("seam_gap_median"), ".4f"):>7s}/{f(r.get("seam_gap_max"), ".4f"):<8s} '
            f'{f(r.get("seam_jump_median"), ".4f"):>8s}/{f(r.get("seam_jump_max"), ".4f"):<8s} '
            f'{r["underruns"]:9d} {r["underrun_s"]:10.3f} {f(r.get("latency_p50_ms"), ".1f"):>7s} '
            f'{f(r.get("compute_p50_ms"), ".1f"):>7s}/{f(r.get("compute_p95_ms"), ".1f"):<8s} '
            f'{r.get("overruns", 0):8d} {f(r.get("load_peak"), ".2f"):>5s}')
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--venv', type=Path, required=True, help='the LeRobot venv (Python >= 3.12)')
    parser.add_argument('--cache', type=Path, default=Path.home() / '.cache' / 'sequence_ai')
    parser.add_argument('--out', type=Path, default=REPO / 'out' / 'rtc-sim')
    parser.add_argument('--seeds', type=int, default=50, help='held-out seeds per condition (test_tasks[0:N])')
    parser.add_argument('--inprocess-seeds', type=int, default=50, help='held-out seeds of the in-process reference')
    parser.add_argument('--compute-s', type=float, default=COMPUTE_S,
                        help='each inference call is padded to this (s; default half a chunk)')
    parser.add_argument('--checkpoint', type=Path, help='development only: serve this checkpoint (with --hub)')
    parser.add_argument('--hub', type=Path, help='development only: the hub cache of --checkpoint\'s backbone')
    parser.add_argument('--only', nargs='*', help='run only these conditions (their names as printed)')
    parser.add_argument('--cached-only', action='store_true', help=argparse.SUPPRESS)   # check_sim.Check reads it
    args = parser.parse_args()
    c = sim.Check(args)
    rows: dict[str, dict] = {}
    built: dict = {}
    all_eps: list[dict] = []
    try:
        if not (c.venv / 'bin' / 'python').is_file():
            raise sim.Skip(f'no LeRobot venv at {c.venv}')
        c.step('demos, backbone and SmolVLA checkpoint (cached under the LeRobot cache)')
        if args.checkpoint:
            ckpt, hub = args.checkpoint.resolve(), args.hub.resolve()
            built = {'demos_built': False, 'checkpoint_built': False, 'steps': 0, 'train_s': 0.0}
        else:
            _, ckpt, hub, built = artifacts(c)
        c.step(f'demos {"built" if built["demos_built"] else "cached"}, checkpoint '
               f'{"trained" if built["checkpoint_built"] else "cached"} ({ckpt}; {built.get("params")} parameters, '
               f'{built["steps"]} steps in {built["train_s"]:.0f} s)')
        lr_env = dict(c.lr_env, HF_HUB_CACHE=str(hub))
        if args.inprocess_seeds:
            c.step(f'reference: the checkpoint in-process (LeRobot select_action), '
                   f'test_tasks[0:{args.inprocess_seeds}]')
            c.run('inprocess', [c.py(), str(HERE / 'inprocess.py'), '--checkpoint', str(ckpt), '--seeds',
                                f'0:{args.inprocess_seeds}', '--out', str(c.out / 'inprocess.json')], 3600, env=lr_env)
            ref = json.loads((c.out / 'inprocess.json').read_text())['episodes']
            rows['in-process'] = dict(summarize([dict(e, underruns=0, underrun_s=0.0) for e in ref]), rtc=None)
            all_eps += [dict(e, condition='in-process') for e in ref]
            c.step(f'  {rows["in-process"]["success"]}/{rows["in-process"]["n"]} solved in-process, median '
                   f'{sim.fmt(rows["in-process"]["median_s"])} s')
        todo = [s for s in conditions(args.compute_s) if not args.only or s.name in args.only]
        env = dict(lr_env, SEQ_HOME=str(c.out / 'seq_home'))
        for served in todo:
            deploy(c, ckpt, hub, served, env)
        from sequence_ai_ros.demo.pipeline import private_domain

        ros_env = dict(os.environ, PYTHONUNBUFFERED='1')
        domain = private_domain(ros_env)
        import rclpy

        workers = Processes(c.out / 'logs', env)
        sims = Processes(c.out / 'logs', ros_env)
        context = rclpy.context.Context()
        rclpy.init(context=context)
        operator = SimOperator(context)
        load = LoadSampler()
        try:
            server = workers.start('seq_serve', [c.py(), '-m', 'sequence_ai_ros.cli', 'serve',
                                                 *[s.deployment for s in todo], '--host', '127.0.0.1', '--port', '0',
                                                 '--warm', '--load-timeout', '300'])
            port = int(server.wait_for(r'^serving .+ on \S+:(\d+)$', 900).group(1))
            sim_params = c.out / 'sim.yaml'
            sim_params.write_text(yaml.safe_dump({'/**/sim_robot': {'ros__parameters': {
                'camera_names': [CAMERA], 'camera_width': IMAGE_PX, 'camera_height': IMAGE_PX,
                'camera_rate_hz': 80.0, 'status_rate_hz': 40.0}}}))
            sims.start('sim_robot', [sys.executable, '-m', 'sequence_ai_ros.sim.main', '--ros-args', '--params-file',
                                     str(REPO / 'config' / 'sim_robot.yaml'), '--params-file', str(sim_params)])
            c.step(f'seq serve {" ".join(s.deployment for s in todo)} on 127.0.0.1:{port}; sim_robot in ROS domain '
                   f'{domain}')
            node_params = {'camera_names': [CAMERA], 'cameras': {CAMERA: {
                'topic': f'{CAMERA}/image_raw', 'type': 'image', 'key': 'image'}}}
            for served in todo:
                cond = sim.Condition(served.name, 0.0, args.seeds)
                c.step(f'{served.name}: RTC {"on" if served.rtc else "off"}, inference padded to '
                       f'{served.compute_s * 1e3:.0f} ms, {cond.seeds} held-out seeds')
                before = len(wrapper_lines(server.log_path))
                eps, figures, _ = sim.run_condition(c, cond, port, operator, load, ros_env,
                                                    deployment=served.deployment, node_params=node_params)
                rows[served.name] = row(eps, figures, served, wrapper_lines(server.log_path)[before:])
                all_eps += [dataclasses.asdict(e) for e in eps]
                r = rows[served.name]
                c.step(f'  {r["success"]}/{r["n"]} solved, median {sim.fmt(r["median_s"])} s, seam gap median '
                       f'{sim.fmt(r["seam_gap_median"], ".4f")}, underruns {r["underruns"]}, {figures["wall_s"]:.0f} s')
        finally:
            load.close()
            operator.close()
            rclpy.try_shutdown(context=context)
            sims.close()
            workers.close()
    except sim.Skip as exc:
        print(f'rtc-sim: SKIPPED: {exc}')
        return 3
    except Exception as exc:   # every failure ends in the summary, with its log
        c.failures.append(f'{type(exc).__name__}: {exc}')
    load1, load5, load15 = os.getloadavg()
    lines = ['', f'=== drawer-open-v3, SmolVLA ({built.get("params")} parameters, {built.get("steps")} steps of '
             f'lerobot-train in {built.get("train_s", 0) / 60:.0f} min) through policy_node + seq serve, RTC on and '
             f'off (chunk {sim.CHUNK} at {round(1 / DT)} Hz = {sim.CHUNK_S:.2f} s; {os.cpu_count()} cores; '
             f'{built.get("versions", "")}) ===',
             'time to success: from the first commanded action (s); prefix err: per request, the worker\'s '
             'max |chunk[:k] - chunk_tail[:k]|, k = min(tail rows, expected delay) (action units: m, effort); '
             'seam gap and jump: the per-episode maxima of the node\'s episode lines, their median and largest over '
             'episodes; model ms: each inference call\'s own compute before the padding', *table(rows),
             f'load average at the end: {load1:.2f} {load5:.2f} {load15:.2f}']
    lines.append('step times: ' + ', '.join(f'{k} {v:.0f}s' for k, v in c.timings.items() if v >= 5))
    lines.append(f'rtc-sim took {time.monotonic() - c.t0:.0f} s'
                 + (f'; FAILED: {"; ".join(c.failures)}' if c.failures else ''))
    text = '\n'.join(lines)
    print(text)
    (c.out / 'summary.txt').write_text(text + '\n')
    (c.out / 'summary.json').write_text(json.dumps({'rows': rows, 'built': built, 'failures': c.failures,
                                                    'episodes': all_eps, 'total_s': time.monotonic() - c.t0},
                                                   indent=1, default=str))
    return 1 if c.failures else 0


if __name__ == '__main__':
    raise SystemExit(main())
