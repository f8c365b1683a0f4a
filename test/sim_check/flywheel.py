"""``make flywheel``: the field-data loop on a task where the first policy is weak (push-v3).

Runs in the ROS venv (it drives ``sim_robot`` and ``policy_node``); LeRobot steps run in the LeRobot venv
(``--venv``), with LeRobot's tools and the product's public commands only:

1. the first policy: a state-only ACT by ``lerobot-train`` on 50 scripted demos, check-sim's recipe
   (check_sim.artifacts: cached under ``<cache>/sim/`` by generator sources, dataset hash, recipe, LeRobot
   version);
2. ``seq deploy`` it with capture on (``seq policy capture NAME --rate 1``) and ``seq serve`` it;
3. **before**: ``policy_node`` on ``sim_robot`` (task push-v3), the held-out ``test_tasks[0:N]`` of
   ``metaworld.ML1(task, seed=0)``; success is the simulator's;
4. **field data**: episodes on other instances (``test_tasks[0:M]`` of ``ML1(task, seed=1)``, a simulator
   started with ``benchmark_seed: 1``: never an evaluation instance), each labelled on the worker through
   ``/policy_node/label`` with the simulator's success (``label(success=...)``);
5. ``seq policy data export NAME --format lerobot --lerobot-version 3.0 --labelled-only --since <field
   start>``; the export must hold the M labelled episodes with the simulator's outcomes;
6. the fine-tuning set: the demos plus the exported successes (finetune_data.py, LeRobotDataset API);
   ``lerobot-train --policy.path=<first checkpoint>`` fine-tunes on it (:data:`FINETUNE_RECIPE`);
7. **after**: ``seq deploy`` + ``seq serve`` of the fine-tuned checkpoint, the same N held-out instances.

8. **control**: the same fine-tuning on the demos alone, served on the same instances, so that what the
   field data adds is told apart from what more training steps add (``--no-control`` skips it).

It prints success before, after and for the control (and median time to success). :func:`plumbing` is the
loop at CI scale (check-sim runs it on drawer-open with its cached checkpoint): 3 episodes, 5 training steps;
it checks the export's labelled episodes and that the fine-tuned checkpoint deploys and serves.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path[:0] = [str(HERE), str(REPO)]

from check_sim import (  # noqa: E402
    CHUNK,
    DEMO_EPISODES,
    RECIPE,
    Check,
    Condition,
    Skip,
    artifacts,
    deploy,
    dir_hash,
    fmt,
    run_condition,
    train,
)
from demos import INSTRUCTIONS  # noqa: E402
from loop import DT, LoadSampler, SimOperator, summarize  # noqa: E402

from sequence_ai_ros.demo.processes import Processes  # noqa: E402

#: lerobot-train's fine-tuning arguments, over the first checkpoint's config (--policy.path); the
#: step count is appended (--steps).
FINETUNE_RECIPE = ['--batch_size=64', '--seed=2', '--num_workers=0', '--policy.optimizer_lr=1e-4']
PLUMBING_EPISODES = 3                   # check-sim's small loop: captured episodes, training steps
PLUMBING_STEPS = 5


@dataclasses.dataclass
class Loop:
    """The loop's scale."""

    task: str
    eval_seeds: int
    field_episodes: int
    finetune_steps: int
    control: bool = False               # also fine-tune as long on the demos alone, and evaluate that


def json_line(text: str) -> dict:
    """The last JSON object line of a child's output (LeRobot's imports write warnings around it)."""
    return json.loads([line for line in text.splitlines() if line.startswith('{')][-1])


def serve(c: Check, name: str, env: dict, procs: Processes) -> int:
    """``seq serve NAME`` on a free loopback port; return the port."""
    server = procs.start(f'seq_serve_{name}', [c.py(), '-m', 'sequence_ai_ros.cli', 'serve', name, '--host',
                                               '127.0.0.1', '--port', '0', '--warm'])
    return int(server.wait_for(r'serving \S+ on \S+:(\d+)', 600).group(1))


def start_sim(c: Check, procs: Processes, task: str, benchmark_seed: int) -> None:
    params = c.out / f'sim_{benchmark_seed}.yaml'
    params.write_text(yaml.safe_dump({'/**/sim_robot': {'ros__parameters': {
        'task': task, 'benchmark_seed': benchmark_seed, 'camera_names': [''], 'status_rate_hz': 40.0}}}))
    procs.start(f'sim_robot_{benchmark_seed}', [sys.executable, '-m', 'sequence_ai_ros.sim.main', '--ros-args',
                                                '--params-file', str(REPO / 'config' / 'sim_robot.yaml'),
                                                '--params-file', str(params)])


def episodes_on(c: Check, what: str, loop: Loop, name: str, port: int, operator: SimOperator, load: LoadSampler,
                ros_env: dict, seeds: int, benchmark_seed: int, label: bool) -> dict:
    """Run ``seeds`` episodes of ``name`` (served on ``port``) on a fresh simulator; return its summary row."""
    sims = Processes(c.out / 'logs', ros_env)
    try:
        start_sim(c, sims, loop.task, benchmark_seed)
        c.step(f'{what}: {name}, {seeds} episodes on test_tasks of ML1({loop.task}, seed={benchmark_seed})'
               + (', each labelled with the simulator\'s success' if label else ''))
        eps, figures, _ = run_condition(c, Condition(what, 0.0, seeds), port, operator, load, ros_env,
                                        deployment=name, label=label, warm_up=not label)
    finally:
        sims.close()
    row = dict(summarize(eps), **figures, successes=[e.index for e in eps if e.success],
               ids=[f'{what}-test-{e.index}' for e in eps], episodes=[dataclasses.asdict(e) for e in eps])
    c.step(f'  {row["success"]}/{row["n"]} solved, median {fmt(row["median_s"])} s ({figures["wall_s"]:.0f} s)')
    return row


def export(c: Check, name: str, env: dict, since: float, field: dict) -> Path:
    """``seq policy data export`` (v3.0, labelled only, since the field phase); check its labelled episodes."""
    out = c.out / 'export'
    c.run('export', [c.py(), '-m', 'sequence_ai_ros.cli', 'policy', 'data', 'export', name, '--out', str(out),
                     '--format', 'lerobot', '--lerobot-version', '3.0', '--labelled-only', '--since', f'{since:.3f}',
                     '--robot-type', 'metaworld_sawyer', '--strict'], 600, env=env)
    got = c.run('export_read', [c.py(), '-c', (
        'import json, sys\n'
        'from lerobot.datasets.lerobot_dataset import LeRobotDataset\n'
        'd = LeRobotDataset("local/field", root=sys.argv[1])\n'
        'e = d.meta.episodes\n'
        'print(json.dumps({"ids": list(e["episode_id"]), "success": list(e["success"]),'
        ' "frames": d.meta.total_frames}))\n'), str(out)], 300)
    got = json_line(got)
    want = {i: int(i.rsplit('-', 1)[1]) in field['successes'] for i in field['ids']}
    have = dict(zip(got['ids'], got['success'], strict=True))
    if have != want:
        raise RuntimeError(f'the export holds {len(have)} labelled episodes {have}, expected {want}')
    c.step(f'export: {len(have)} labelled episodes ({sum(have.values())} successful), {got["frames"]} frames, '
           f'v3.0, by LeRobot\'s loader')
    return out


def finetune(c: Check, demos: Path, exported: Path, base: Path, steps: int) -> tuple[Path, dict]:
    """The fine-tuning set and lerobot-train from ``base`` into the run's folder (its data is this run's own)."""
    data = c.out / 'finetune_data'
    text = c.run('finetune_data', [c.py(), str(HERE / 'finetune_data.py'), '--demos', str(demos), '--export',
                                   str(exported), '--root', str(data)], 1800)
    info = json_line(text)
    c.step(f'fine-tuning set: {info["demo_episodes"]} demos + {info["field_successes"]} field successes '
           f'({info["frames"]} frames); lerobot-train --policy.path=<first checkpoint>, {steps} steps')
    t = time.monotonic()
    train(c, 'finetune', data, c.out / 'finetune', [f'--policy.path={base}', *FINETUNE_RECIPE, f'--steps={steps}'])
    info.update(finetune_s=time.monotonic() - t, dataset_hash=dir_hash(data))
    ckpt = c.out / 'finetune' / 'checkpoints' / 'last' / 'pretrained_model'
    if not (ckpt / 'model.safetensors').is_file():
        raise RuntimeError(f'no model.safetensors in {ckpt}')
    return ckpt, info


def run_loop(c: Check, loop: Loop, demos: Path, ckpt: Path) -> dict:
    """The loop (module docstring) from the first checkpoint ``ckpt``; return before/after and the figures."""
    import rclpy

    from sequence_ai_ros.demo.pipeline import private_domain

    first, tuned = f'{loop.task.split("-")[0]}_first', f'{loop.task.split("-")[0]}_tuned'
    env = deploy(c, ckpt, first)
    c.run('capture_on', [c.py(), '-m', 'sequence_ai_ros.cli', 'policy', 'capture', first, '--rate', '1'], 120,
          env=env)
    ros_env = dict(os.environ, PYTHONUNBUFFERED='1')
    domain = private_domain(ros_env)
    context = rclpy.context.Context()
    rclpy.init(context=context)
    operator = SimOperator(context, INSTRUCTIONS[loop.task])
    load = LoadSampler()
    out: dict = {'task': loop.task, 'domain': domain}
    try:
        workers = Processes(c.out / 'logs', env)
        try:
            port = serve(c, first, env, workers)
            if loop.eval_seeds:
                out['before'] = episodes_on(c, 'before', loop, first, port, operator, load, ros_env,
                                            loop.eval_seeds, 0, label=False)
            since = time.time()
            out['field'] = episodes_on(c, 'field', loop, first, port, operator, load, ros_env,
                                       loop.field_episodes, 1, label=True)
        finally:
            workers.close()
        exported = export(c, first, env, since, out['field'])
        new, out['finetune'] = finetune(c, demos, exported, ckpt, loop.finetune_steps)
        env = deploy(c, new, tuned)
        workers = Processes(c.out / 'logs', env)
        try:
            port = serve(c, tuned, env, workers)
            out['after'] = episodes_on(c, 'after', loop, tuned, port, operator, load, ros_env,
                                       loop.eval_seeds or 2, 0, label=False)
        finally:
            workers.close()
        if loop.control:
            c.step(f'control: the same fine-tuning on the {loop.task} demos alone, {loop.finetune_steps} steps')
            train(c, 'control', demos, c.out / 'control', [f'--policy.path={ckpt}', *FINETUNE_RECIPE,
                                                           f'--steps={loop.finetune_steps}'])
            control = f'{loop.task.split("-")[0]}_control'
            env = deploy(c, c.out / 'control' / 'checkpoints' / 'last' / 'pretrained_model', control)
            workers = Processes(c.out / 'logs', env)
            try:
                port = serve(c, control, env, workers)
                out['control'] = episodes_on(c, 'control', loop, control, port, operator, load, ros_env,
                                             loop.eval_seeds or 2, 0, label=False)
            finally:
                workers.close()
    finally:
        load.close()
        operator.close()
        rclpy.try_shutdown(context=context)
    return out


def plumbing(c: Check, demos: Path, ckpt: Path) -> list[str]:
    """check-sim's small loop on drawer-open: capture -> label -> export -> train a few steps -> deploy and serve.

    :returns: the summary lines; failures go to ``c.failures``.
    """
    loop = Loop('drawer-open-v3', eval_seeds=0, field_episodes=PLUMBING_EPISODES, finetune_steps=PLUMBING_STEPS)
    t = time.monotonic()
    res = run_loop(c, loop, demos, ckpt)
    f, a = res['field'], res['after']
    served = [e for e in a['episodes'] if e['actions'] > 0 and e['chunks'] > 0]
    if len(served) != a['n']:
        c.failures.append(f'field-data loop: the fine-tuned checkpoint served {len(served)}/{a["n"]} episodes')
    return [f'field-data loop (drawer-open-v3): {f["n"]} captured episodes labelled ({f["success"]} successful), '
            f'exported v3.0 with their labels, {res["finetune"]["demo_episodes"]} demos + '
            f'{res["finetune"]["field_successes"]} successes fine-tuned {PLUMBING_STEPS} steps, the new checkpoint '
            f'deployed and served {len(served)}/{a["n"]} episodes ({a["success"]} solved) in '
            f'{time.monotonic() - t:.0f} s']


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--venv', type=Path, required=True, help='the LeRobot venv (Python >= 3.12)')
    parser.add_argument('--cache', type=Path, default=Path.home() / '.cache' / 'sequence_ai')
    parser.add_argument('--out', type=Path, default=REPO / 'out' / 'flywheel')
    parser.add_argument('--task', default='push-v3', choices=sorted(INSTRUCTIONS))
    parser.add_argument('--seeds', type=int, default=50, help='held-out instances before and after')
    parser.add_argument('--field-episodes', type=int, default=50, help='captured, labelled episodes')
    parser.add_argument('--finetune-steps', type=int, default=900)
    parser.add_argument('--demos', type=int, default=DEMO_EPISODES,
                        help='scripted demos the first policy is trained on (fewer: a policy weak from scarce '
                             'data rather than from short training)')
    parser.add_argument('--no-control', dest='control', action='store_false',
                        help='skip the control (the same fine-tuning on the demos alone, no field data, evaluated '
                             'on the same instances: what the field data adds beyond more training steps)')
    parser.add_argument('--first', type=Path, nargs=2, metavar=('DEMOS', 'CHECKPOINT'),
                        help='development only: these demos and first checkpoint, never built')
    args = parser.parse_args()
    args.cached_only = False
    c = Check(args)
    loop = Loop(args.task, args.seeds, args.field_episodes, args.finetune_steps, args.control)
    try:
        if not (c.venv / 'bin' / 'python').is_file():
            raise Skip(f'no LeRobot venv at {c.venv}')
        c.step(f'the first policy: state-only ACT on {args.demos} {args.task} demos, check-sim\'s recipe (cached)')
        if args.first:
            (demos, ckpt), built = args.first, {'demos_built': False, 'checkpoint_built': False,
                                                'versions': c.lerobot_version()}
        else:
            demos, ckpt, built = artifacts(c, args.task, episodes=args.demos)
        c.step(f'demos {"built" if built["demos_built"] else "cached"}, checkpoint '
               f'{"trained" if built["checkpoint_built"] else "cached"} ({ckpt})')
        res = run_loop(c, loop, demos, ckpt)
    except Skip as exc:
        print(f'flywheel: SKIPPED: {exc}')
        return 3
    b, f, a, ft = res.get('before'), res['field'], res['after'], res['finetune']
    lines = ['', f'=== field-data loop on {args.task} (state-only ACT, chunk {CHUNK} at {round(1 / DT)} Hz, served '
             f'through policy_node + seq serve; {os.cpu_count()} cores; {built["versions"]}) ===',
             f'first policy: {RECIPE[-3][2:]} on {args.demos} scripted demos']
    if b:
        lines.append(f'before: {b["success"]}/{b["n"]} held-out instances solved, median time to success '
                     f'{fmt(b["median_s"])} s')
    lines += [f'field:  {f["success"]}/{f["n"]} captured episodes succeeded (labelled by the simulator), exported '
              'v3.0',
              f'fine-tune: {ft["demo_episodes"]} demos + {ft["field_successes"]} successes, {args.finetune_steps} '
              f'steps from the first checkpoint ({ft["finetune_s"]:.0f} s)',
              f'after:  {a["success"]}/{a["n"]} held-out instances solved, median time to success '
              f'{fmt(a["median_s"])} s',
              *([f'control: {res["control"]["success"]}/{res["control"]["n"]} solved after the same fine-tuning on '
                 f'the demos alone'] if 'control' in res else []),
              'step times: ' + ', '.join(f'{k} {v:.0f}s' for k, v in c.timings.items() if v >= 5),
              f'flywheel took {time.monotonic() - c.t0:.0f} s']
    text = '\n'.join(lines)
    print(text)
    (c.out / 'summary.txt').write_text(text + '\n')
    (c.out / 'summary.json').write_text(json.dumps(res, indent=1, default=str))
    return 0


if __name__ == '__main__':
    raise SystemExit(main())
