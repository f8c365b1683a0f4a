"""``make check-sim``: drawer-open solved by a LeRobot ACT served through ``policy_node`` + ``seq serve``, under delay.

Runs in the ROS venv (it drives ``sim_robot`` and ``policy_node``); every LeRobot step runs in the LeRobot venv
(``--venv``), with LeRobot's own tools and the product's public commands:

1. demos: Meta-World's scripted expert on ``train_tasks[0:50]`` of drawer-open-v3, written by LeRobot's
   ``LeRobotDataset`` API (demos.py, state only, 80 fps, the simulator node's coordinates);
2. ``lerobot-train`` of a state-only ACT (chunk 20 = 0.25 s at 80 Hz; :data:`RECIPE`), CPU, one thread,
   offline. Demos and checkpoint are cached under ``<cache>/sim/`` (the LeRobot cache), keyed by the
   generator's sources, the dataset's hash, the recipe and the LeRobot version: a warm run trains nothing;
3. the reference: the same checkpoint in-process (inprocess.py: LeRobot's own ``select_action``), no delay;
4. ``seq init lerobot`` -> ``seq deploy`` -> ``seq serve`` of the checkpoint, then per condition a fresh
   ``policy_node`` (config/sim_policy_node.yaml, ``on_underrun: stop``: see loop.py) whose worker link runs
   through the bench's delay proxy at a round trip of 0, 0.5 and 0.8 of the chunk's duration (0, 125,
   200 ms), on the held-out ``test_tasks[0:N]``; and the ablations at 0.5 and 0.8: ``prefetch=False`` and
   one request in flight (the node's ``max_in_flight: 1``). Each condition first runs one warm-up episode on
   ``train_tasks[0]`` (not counted).

5. the field-data loop at CI scale (flywheel.plumbing, on the cached demos and checkpoint): 3 served episodes
   captured and labelled with the simulator's success, ``seq policy data export --lerobot-version 3.0``
   (its labelled episodes checked by LeRobot's loader), ``lerobot-train`` 5 steps from the checkpoint on the
   demos plus the successes, the new checkpoint deployed and served (``make flywheel`` runs it at scale).

It prints success, median and p90 time to success (from the first commanded action), underruns and
underrun_s per condition, and the inferences: requests sent per episode (``inf/ep``: the node's episode line)
and per executed chunk (``inf/chunk``: requests over executed steps / 20), beside an ideal pipeline's per
executed chunk (``ideal``: one request every 0.25 s - the largest round trip, the median of the condition's
per-episode p95 round trips; :func:`loop.inferences`). Targets: >= 48/50 solved at every delay (fails the
check); median time to success at 0.8 within 1.05x the no-delay median, 0 underruns at 0.5, and inferences per
executed chunk within 1.5x the ideal's at 0.5 and 0.8 (fail the check only when the 1-minute load average
stayed below 1.5 and the simulator counted 0 overruns, else "not judged (load X)").

The image ACT (``make train-image-act``: state and a 64 px corner camera, ``observation.image``,
``pretrained_backbone_weights=None``, ~30-47 min, never trained here) adds one condition, no delay and 20
held-out seeds, whenever it is in the cache; it is printed, not judged.

``--cached-only`` (make bench) uses only cached demos and checkpoint and skips, saying why, when either is
absent (exit 3).
"""

from __future__ import annotations

import argparse
import dataclasses
import fcntl
import hashlib
import json
import math
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path[:0] = [str(HERE), str(REPO / 'test' / 'lerobot_check'), str(REPO)]

import check_lerobot as lerobot_check  # noqa: E402
from loop import (  # noqa: E402
    DT,
    Episode,
    LoadSampler,
    SimOperator,
    inferences,
    node_lines,
    peak_in_flight,
    requests_sent,
    summarize,
)

from sequence_ai_ros.demo.processes import Processes  # noqa: E402
from sequence_ai_ros.sim.task import COMMAND_NAMES, OBS_NAMES  # noqa: E402

CHUNK = 20
CHUNK_S = CHUNK * DT                    # 0.25 s
DEMO_EPISODES = 50
#: lerobot-train's arguments (the recipe: part of the checkpoint's cache key). 1.08 M parameters.
RECIPE = ['--policy.type=act', f'--policy.chunk_size={CHUNK}', f'--policy.n_action_steps={CHUNK}',
          '--policy.dim_model=128', '--policy.dim_feedforward=512', '--policy.n_encoder_layers=2',
          '--policy.n_vae_encoder_layers=2', '--policy.optimizer_lr=1e-4', '--batch_size=64', '--steps=1800',
          '--seed=1', '--num_workers=0']
DEPLOYMENT = 'sim_act'
#: The image ACT (make train-image-act; check-sim serves it only when it is cached): state and one camera.
IMAGE_PX = 64
IMAGE_RECIPE = RECIPE
IMAGE_DEPLOYMENT = 'sim_act_image'
IMAGE_SEEDS = 20
MAX_SECONDS = 6.0                       # Meta-World's episode is 500 steps (6.25 s); the expert needs ~1.1 s
SUCCESS_SHARE = 0.96                    # 48/50
TIME_RATIO = 1.05
LOAD_LIMIT = 1.5
#: Inferences per executed chunk at most, against an ideal pipeline's (loop.inferences), at 0.5 and 0.8.
INFERENCE_RATIO = 1.5


@dataclasses.dataclass(frozen=True)
class Condition:
    name: str
    fraction: float                     # round trip / chunk duration
    seeds: int
    prefetch: bool = True
    one_in_flight: bool = False

    @property
    def rtt_s(self) -> float:
        return self.fraction * CHUNK_S


def conditions(seeds: int, ablation_seeds: int) -> list[Condition]:
    out = [Condition(f'product@{f:g}', f, seeds) for f in (0.0, 0.5, 0.8)]
    if ablation_seeds:
        out += [Condition(f'no_prefetch@{f:g}', f, ablation_seeds, prefetch=False) for f in (0.5, 0.8)]
        out += [Condition(f'one_in_flight@{f:g}', f, ablation_seeds, one_in_flight=True) for f in (0.5, 0.8)]
    return out


# -- cache -------------------------------------------------------------------------------------------
def sha16(*parts: str | bytes) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p if isinstance(p, bytes) else p.encode())
        h.update(b'\0')
    return h.hexdigest()[:16]


def dir_hash(root: Path) -> str:
    """sha256 of every file's relative path and content under ``root`` (the stamp excluded).

    JSON files count by their parsed content (LeRobot's meta/stats.json is written in no fixed key order).
    """
    def content(p: Path) -> bytes:
        if p.suffix == '.json':
            return json.dumps(json.loads(p.read_text()), sort_keys=True).encode()
        return p.read_bytes()

    files = sorted(p for p in root.rglob('*') if p.is_file() and p.name != '.complete')
    return sha16(*[x for p in files for x in (str(p.relative_to(root)), content(p))])


def build_once(dest: Path, make: Callable[[Path], None]) -> bool:
    """Make ``dest`` with ``make(tmp)`` unless complete; stamp it only when done. Return True when built."""
    if (dest / '.complete').is_file():
        return False
    tmp = dest.with_name(f'{dest.name}.tmp-{os.getpid()}')
    shutil.rmtree(tmp, ignore_errors=True)
    make(tmp)
    (tmp / '.complete').write_text(time.strftime('%Y-%m-%d %H:%M:%S\n'))
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    return True


class Check(lerobot_check.Check):
    """check-lerobot's shared state and runner, with the sim's environment (this tree on PYTHONPATH, one thread)."""

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(args)
        self.lr_env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS='1')
        self.notes: list[str] = []

    def py(self) -> str:
        return self.lr('python')

    def lerobot_version(self) -> str:
        return self.run('lerobot_version', [self.py(), '-c', 'import importlib.metadata as m; '
                                            'print(m.version("lerobot"), m.version("metaworld"), m.version("mujoco"))'],
                        120).strip()


def artifacts(c: Check, task: str = 'drawer-open-v3', image: int = 0,
              cached_only: bool | None = None, episodes: int = DEMO_EPISODES) -> tuple[Path, Path, dict]:
    """The cached demos and checkpoint of ``task``, built when absent (unless cached only), and what was built.

    ``image`` > 0: the image ACT's (state and an ``image`` px camera, :data:`IMAGE_RECIPE`).
    ``episodes``: scripted demos to write (a different count is its own cache entry).
    :raises Skip: when cached only (default: --cached-only) and either is absent.
    """
    cached_only = c.args.cached_only if cached_only is None else cached_only
    recipe = IMAGE_RECIPE if image else RECIPE
    kind = f'image-{image}px ACT' if image else 'state-only ACT'
    cache = c.args.cache.resolve() / 'sim'
    cache.mkdir(parents=True, exist_ok=True)
    versions = c.lerobot_version()
    # drawer-open-v3's key predates the task argument (its cached demos and checkpoint stay valid)
    demos_key = sha16((HERE / 'demos.py').read_bytes(), (REPO / 'sequence_ai_ros' / 'sim' / 'task.py').read_bytes(),
                      str(episodes), versions, *([] if task == 'drawer-open-v3' else [task]),
                      *([f'image{image}'] if image else []))
    demos = cache / (f'demos-{task}{f"-image{image}" if image else ""}'
                     f'{"" if episodes == DEMO_EPISODES else f"-{episodes}ep"}-{demos_key}')
    built = {'versions': versions, 'demos': str(demos)}
    # one lock per task and kind: training the image ACT (tens of minutes) never stalls the state ACT's check
    with open(cache / f'.lock-{task}{"-image" if image else ""}', 'w') as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | (fcntl.LOCK_NB if cached_only else 0))
        except BlockingIOError:
            raise Skip(f'another run is building the cache under {cache}') from None
        if cached_only and not (demos / '.complete').is_file():
            raise Skip(f'no cached demos at {demos} ({"make train-image-act" if image else "make check-sim"} '
                       'builds them)')
        t = time.monotonic()
        built['demos_built'] = build_once(demos, lambda tmp: c.run(f'demos_{task}', [
            c.py(), str(HERE / 'demos.py'), '--root', str(tmp), '--episodes', str(episodes), '--task', task,
            '--image', str(image)], 1800))
        built['demos_s'] = time.monotonic() - t
        data_hash = dir_hash(demos)
        ckpt_dir = cache / f'act-{"image-" if image else ""}{sha16(data_hash, json.dumps(recipe), versions)}'
        built.update(dataset_hash=data_hash, checkpoint_dir=str(ckpt_dir))
        if cached_only and not (ckpt_dir / '.complete').is_file():
            raise Skip(f'no cached checkpoint at {ckpt_dir} ({"make train-image-act" if image else "make check-sim"} '
                       'trains it)')
        if not (ckpt_dir / '.complete').is_file():
            c.step(f'lerobot-train: {kind} on {episodes} {task} demos, {recipe[-3]}, CPU, 1 thread, '
                   f'offline ({"~30-47" if image else "~8-11"} min)')
        t = time.monotonic()
        built['checkpoint_built'] = build_once(ckpt_dir, lambda tmp: train(
            c, f'train_{task}{"_image" if image else ""}', demos, tmp, recipe))
        built['train_s'] = time.monotonic() - t
    ckpt = ckpt_dir / 'checkpoints' / 'last' / 'pretrained_model'
    if not (ckpt / 'model.safetensors').is_file():
        raise RuntimeError(f'no model.safetensors in {ckpt}')
    return demos, ckpt, built


def train(c: Check, name: str, dataset: Path, out: Path, recipe: list[str], *extra: str) -> str:
    """``lerobot-train`` on ``dataset`` into ``out`` (CPU, offline, no Hub, no wandb); ``extra`` args last."""
    return c.run(name, [
        str(c.venv / 'bin' / 'lerobot-train'), *recipe, '--policy.device=cpu', '--policy.push_to_hub=false',
        '--policy.pretrained_backbone_weights=null', f'--dataset.repo_id=local/{dataset.name}',
        f'--dataset.root={dataset}', f'--output_dir={out}', f'--job_name={name}', '--save_freq=100000',
        '--log_freq=100', '--wandb.enable=false', *extra], 5400)


class Skip(Exception):
    """A prerequisite is absent (--cached-only)."""


def deploy(c: Check, ckpt: Path, name: str = DEPLOYMENT, image: bool = False) -> dict:
    """Run seq init lerobot, write config.yaml, run seq deploy as ``name``; return the worker env (SEQ_HOME)."""
    env = dict(c.lr_env, SEQ_HOME=str(c.out / 'seq_home'))
    seq = [c.py(), '-m', 'sequence_ai_ros.cli']
    pdir = c.out / ('policy' if name == DEPLOYMENT else f'policy_{name}')
    c.run(f'seq_init_{name}', [*seq, 'init', 'lerobot', str(pdir)], 120, env=env)
    config = yaml.safe_load((pdir / 'config.yaml').read_text())
    config.update(checkpoint=str(ckpt), device='cpu', fps=round(1 / DT), action_space='joint_absolute',
                  state_names=list(COMMAND_NAMES),
                  features={} if image else {'observation.environment_state': list(OBS_NAMES)},
                  action_names=list(COMMAND_NAMES), robot_type='metaworld_sawyer')
    (pdir / 'config.yaml').write_text(yaml.safe_dump(config, sort_keys=False))
    c.run(f'seq_deploy_{name}', [*seq, 'deploy', str(pdir / 'policy.py'), '--name', name], 600, env=env)
    return env


PROXY = ('import sys, threading\n'
         'from sequence_ai_ros.bench.delay_proxy import DelayProxy\n'
         'p = DelayProxy(int(sys.argv[1]), float(sys.argv[2]))\n'
         'print("proxy on", p.port, flush=True)\n'
         'try:\n    threading.Event().wait()\nexcept KeyboardInterrupt:\n    p.close()\n')


def run_condition(c: Check, cond: Condition, worker_port: int, operator: SimOperator, load: LoadSampler,
                  ros_env: dict, deployment: str = DEPLOYMENT, label: bool = False, warm_up: bool = True,
                  node_params: dict | None = None) -> tuple[list[Episode], dict, dict[str, list]]:
    """A fresh proxy and policy_node for ``cond``; its episodes, its load and overrun figures, traces of misses.

    ``label``: each episode is labelled on the worker with the simulator's success.
    """
    procs = Processes(c.out / 'logs', ros_env)
    tag = cond.name.replace('@', '_')
    try:
        proxy = procs.start(f'proxy_{tag}', [sys.executable, '-c', PROXY, str(worker_port), str(cond.rtt_s / 2)])
        port = int(proxy.wait_for(r'proxy on (\d+)', 30).group(1))
        params = c.out / f'node_{tag}.yaml'
        params.write_text(yaml.safe_dump({'/**/policy_node': {'ros__parameters': {
            'autostart': True, 'model': deployment, 'endpoint': f'127.0.0.1:{port}', 'on_underrun': 'stop',
            'status_rate_hz': 2.0, **({'max_in_flight': 1} if cond.one_in_flight else {}), **(node_params or {})}}}))
        node = procs.start(f'node_{tag}', [sys.executable, '-m', 'sequence_ai_ros.node.main', '--ros-args',
                                           '--params-file', str(REPO / 'config' / 'sim_policy_node.yaml'),
                                           '--params-file', str(params)])
        operator.wait_node(60)
        operator.wait_active(60)
        if operator.publishers('/position_controller/commands') != 1:
            raise RuntimeError('another process publishes on /position_controller/commands in this ROS domain')
        if warm_up:
            operator.warm_up(cond.prefetch, MAX_SECONDS)
        since = time.monotonic()
        episodes, traces = [], {}
        for index in range(cond.seeds):
            ep, trace = operator.episode(cond.name, index, prefetch=cond.prefetch, max_seconds=MAX_SECONDS,
                                         label=label)
            episodes.append(ep)
            if not ep.success:
                traces[f'{cond.name}-{index}'] = trace
        figures = {'load_peak': load.peak(since), 'wall_s': time.monotonic() - since}
    finally:
        procs.close()
    lines = node_lines(node.log_path)
    for ep in episodes:
        ep.node_line = lines.get(f'{cond.name}-test-{ep.index}', '')
        ep.requests = requests_sent(ep.node_line)
    peaks = [peak_in_flight(ep.node_line) for ep in episodes]
    figures['peak_in_flight'] = max(peaks) if peaks else -1
    figures.update(inferences([dataclasses.asdict(ep) for ep in episodes], CHUNK, CHUNK_S))
    if cond.one_in_flight and figures['peak_in_flight'] != 1:
        c.failures.append(f'{cond.name}: peak in flight {figures["peak_in_flight"]}, not 1: the ablation did not '
                          'take effect')
    return episodes, figures, traces


def fmt(v: float | None, spec: str = '.3f') -> str:
    return '-' if v is None else format(v, spec)


def judge(c: Check, rows: dict[str, dict]) -> list[str]:
    """The targets; success counts fail, time and underrun targets only on an unloaded, overrun-free run."""
    lines = []
    for name in ('product@0', 'product@0.5', 'product@0.8'):
        r = rows.get(name)
        if r is None:
            continue
        need = math.ceil(SUCCESS_SHARE * r['n'])
        ok = r['success'] >= need
        lines.append(f'{name}: {r["success"]}/{r["n"]} solved, target >= {need}: '
                     + ('met' if ok else f'MISSED by {need - r["success"]}'))
        if not ok:
            c.failures.append(f'{name}: {r["success"]}/{r["n"]} solved, {need - r["success"]} short of {need}')

    def gate(*names: str) -> str:
        load = max(rows[n]['load_peak'] for n in names)
        overruns = sum(rows[n]['overruns'] for n in names)
        return '' if load < LOAD_LIMIT and overruns == 0 else f'not judged (load {load:.2f}, overruns {overruns})'

    a, b = rows.get('product@0'), rows.get('product@0.8')
    if a and b and a['median_s'] and b['median_s']:
        ratio = b['median_s'] / a['median_s']
        why = gate('product@0', 'product@0.8')
        text = (f'median time to success at 0.8 / at 0: {b["median_s"]:.3f} / {a["median_s"]:.3f} s = {ratio:.3f}, '
                f'target <= {TIME_RATIO}: ')
        lines.append(text + _ratio_verdict(ratio, TIME_RATIO, why, c.failures,
                                           f'median time to success at 0.8 is {ratio:.3f}x the no-delay median '
                                           f'(target {TIME_RATIO})'))
    for name in ('product@0.5', 'product@0.8'):
        r = rows.get(name)
        if not r or r.get('vs_ideal') is None:
            continue
        why = gate(name)
        text = (f'inferences per executed chunk at {name.split("@")[1]}: {r["per_chunk"]:.2f}, ideal pipeline '
                f'{r["ideal_per_chunk"]:.2f} (median p95 round trip {r["largest_rtt_ms"]:.0f} ms) = '
                f'{r["vs_ideal"]:.2f}x, target <= {INFERENCE_RATIO}x: ')
        lines.append(text + _ratio_verdict(r['vs_ideal'], INFERENCE_RATIO, why, c.failures,
                                           f'{name}: {r["vs_ideal"]:.2f}x the ideal pipeline\'s inferences '
                                           f'(target {INFERENCE_RATIO}x)'))
    m = rows.get('product@0.5')
    if m:
        why = gate('product@0.5')
        text = f'underruns at 0.5: {m["underruns"]} ({m["underrun_s"]:.3f} s), target 0: '
        if why:
            text += why
        elif m['underruns'] == 0:
            text += 'met'
        else:
            text += f'MISSED by {m["underruns"]}'
            c.failures.append(f'{m["underruns"]} underruns ({m["underrun_s"]:.3f} s) at 0.5 of a chunk (target 0)')
        lines.append(text)
    return lines


def _ratio_verdict(ratio: float, target: float, why: str, failures: list[str], failure: str) -> str:
    """A ratio target's verdict: ``met``, ``MISSED by X%`` (``failure`` appended to ``failures``), or its gate's reason.

    ``why``: the load gate's reason when the run is not judged (then what the verdict would have been follows).
    """
    if why:
        return why + (' (would be met)' if ratio <= target else f' (would miss by {ratio / target - 1:.1%})')
    if ratio <= target:
        return 'met'
    failures.append(failure)
    return f'MISSED by {ratio / target - 1:.1%}'


def table(rows: dict[str, dict]) -> list[str]:
    head = (f'{"condition":22s} {"rtt ms":>6s} {"solved":>7s} {"median s":>8s} {"p90 s":>6s} {"underruns":>9s} '
            f'{"underrun_s":>10s} {"eps dry":>7s} {"overruns":>8s} {"load":>5s} {"in flight":>9s} {"inf/ep":>6s} '
            f'{"inf/chunk":>9s} {"ideal":>5s} {"x ideal":>7s}')
    out = [head, '-' * len(head)]
    for name, r in rows.items():
        out.append(f'{name:22s} {r.get("rtt_ms", 0):6.0f} {r["success"]:>3d}/{r["n"]:<3d} {fmt(r["median_s"]):>8s} '
                   f'{fmt(r["p90_s"]):>6s} {r["underruns"]:9d} {r["underrun_s"]:10.3f} '
                   f'{r["episodes_with_underruns"]:7d} {r["overruns"]:8d} {fmt(r.get("load_peak"), ".2f"):>5s} '
                   f'{r.get("peak_in_flight", "-")!s:>9s} {fmt(r.get("requests_per_episode"), ".1f"):>6s} '
                   f'{fmt(r.get("per_chunk"), ".2f"):>9s} {fmt(r.get("ideal_per_chunk"), ".2f"):>5s} '
                   f'{fmt(r.get("vs_ideal"), ".2f"):>7s}')
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--venv', type=Path, required=True, help='the LeRobot venv (Python >= 3.12)')
    parser.add_argument('--cache', type=Path, default=Path.home() / '.cache' / 'sequence_ai')
    parser.add_argument('--out', type=Path, default=REPO / 'out' / 'check-sim')
    parser.add_argument('--seeds', type=int, default=50, help='held-out seeds per delay (test_tasks[0:N])')
    parser.add_argument('--ablation-seeds', type=int, default=20, help='seeds per ablation condition (0: none)')
    parser.add_argument('--cached-only', action='store_true', help='never build demos or train; skip when absent')
    parser.add_argument('--checkpoint', type=Path, help='development only: skip demos and training, use this')
    parser.add_argument('--no-judge', action='store_true', help='print the table, judge no target (make bench)')
    parser.add_argument('--no-image', dest='image', action='store_false',
                        help='never serve the image ACT (by default it is served when it is cached)')
    parser.add_argument('--image-seeds', type=int, default=IMAGE_SEEDS, help='held-out seeds of the image ACT')
    parser.add_argument('--image-checkpoint', type=Path, help='development only: serve this image ACT')
    parser.add_argument('--train-image-act', action='store_true',
                        help='build the image ACT\'s demos and checkpoint into the cache, then exit')
    parser.add_argument('--no-field-loop', dest='field_loop', action='store_false',
                        help='skip the small field-data loop (capture, label, export, fine-tune, deploy)')
    args = parser.parse_args()
    c = Check(args)
    rows: dict[str, dict] = {}
    built: dict = {}
    all_eps: list[dict] = []
    traces: dict[str, list] = {}
    verdict: list[str] = []
    field_lines: list[str] = []
    try:
        if not (c.venv / 'bin' / 'python').is_file():
            raise Skip(f'no LeRobot venv at {c.venv}')
        if args.train_image_act:
            c.step(f'the image ACT ({IMAGE_PX} px): demos and checkpoint, cached under the LeRobot cache')
            _, image_ckpt, built = artifacts(c, image=IMAGE_PX)
            c.step(f'image ACT {"trained" if built["checkpoint_built"] else "cached"}: {image_ckpt} '
                   f'({built.get("train_s", 0):.0f} s)')
            return 0
        c.step('demos and checkpoint (cached under the LeRobot cache)')
        if args.checkpoint:
            demos, ckpt, built = None, args.checkpoint.resolve(), {'demos_built': False, 'checkpoint_built': False,
                                                                   'demos': 'not used (--checkpoint)'}
        else:
            demos, ckpt, built = artifacts(c)
        c.step(f'demos {"built" if built["demos_built"] else "cached"} ({built["demos"]}), checkpoint '
               f'{"trained" if built["checkpoint_built"] else "cached"} ({ckpt})')
        c.step(f'reference: the checkpoint in-process (LeRobot select_action), test_tasks[0:{args.seeds}], no delay')
        c.run('inprocess', [c.py(), str(HERE / 'inprocess.py'), '--checkpoint', str(ckpt), '--seeds',
                            f'0:{args.seeds}', '--out', str(c.out / 'inprocess.json')], 1800)
        ref = json.loads((c.out / 'inprocess.json').read_text())['episodes']
        rows['in-process (LeRobot)'] = dict(summarize([dict(e, underruns=0, underrun_s=0.0) for e in ref]),
                                            rtt_ms=0.0)
        all_eps += [dict(e, condition='in-process') for e in ref]
        image_ckpt = args.image_checkpoint.resolve() if args.image_checkpoint else None
        if image_ckpt is None and not args.checkpoint and args.image:
            try:
                _, image_ckpt, _ = artifacts(c, image=IMAGE_PX, cached_only=True)
            except Skip as exc:
                c.notes.append(f'image ACT not served: {exc}')
        env = deploy(c, ckpt)
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
            server = workers.start('seq_serve', [c.py(), '-m', 'sequence_ai_ros.cli', 'serve', DEPLOYMENT, '--host',
                                                 '127.0.0.1', '--port', '0', '--warm'])
            worker_port = int(server.wait_for(r'serving \S+ on \S+:(\d+)', 600).group(1))
            sim_params = c.out / 'sim.yaml'
            sim_params.write_text(yaml.safe_dump({'/**/sim_robot': {'ros__parameters': {
                'camera_names': [''], 'status_rate_hz': 40.0}}}))
            sims.start('sim_robot', [sys.executable, '-m', 'sequence_ai_ros.sim.main', '--ros-args', '--params-file',
                                     str(REPO / 'config' / 'sim_robot.yaml'), '--params-file', str(sim_params)])
            c.step(f'seq serve {DEPLOYMENT} on 127.0.0.1:{worker_port}; sim_robot in ROS domain {domain}')
            for cond in conditions(args.seeds, args.ablation_seeds):
                c.step(f'{cond.name}: round trip {cond.rtt_s * 1e3:.0f} ms, {cond.seeds} held-out seeds, prefetch '
                       f'{cond.prefetch}, {"one request" if cond.one_in_flight else "pipelined requests"} in flight')
                eps, figures, tr = run_condition(c, cond, worker_port, operator, load, ros_env)
                rows[cond.name] = dict(summarize(eps), rtt_ms=cond.rtt_s * 1e3, **figures)
                all_eps += [dataclasses.asdict(e) for e in eps]
                traces.update(tr)
                r = rows[cond.name]
                c.step(f'  {r["success"]}/{r["n"]} solved, median {fmt(r["median_s"])} s, underruns {r["underruns"]}, '
                       f'overruns {r["overruns"]}, load peak {r["load_peak"]:.2f}, {figures["wall_s"]:.0f} s')
            if image_ckpt is not None:
                deploy(c, image_ckpt, IMAGE_DEPLOYMENT, image=True)
                image_port = int(workers.start('seq_serve_image', [
                    c.py(), '-m', 'sequence_ai_ros.cli', 'serve', IMAGE_DEPLOYMENT, '--host', '127.0.0.1', '--port',
                    '0', '--warm']).wait_for(r'serving \S+ on \S+:(\d+)', 600).group(1))
                sims.close()       # the image condition's simulator renders its camera at every step
                sim_params.write_text(yaml.safe_dump({'/**/sim_robot': {'ros__parameters': {
                    'camera_names': ['corner'], 'camera_width': IMAGE_PX, 'camera_height': IMAGE_PX,
                    'camera_rate_hz': 80.0, 'status_rate_hz': 40.0}}}))
                sims = Processes(c.out / 'logs', ros_env)
                sims.start('sim_robot_camera', [sys.executable, '-m', 'sequence_ai_ros.sim.main', '--ros-args',
                                                '--params-file', str(REPO / 'config' / 'sim_robot.yaml'),
                                                '--params-file', str(sim_params)])
                cond = Condition('image@0', 0.0, args.image_seeds)
                c.step(f'{cond.name}: the image ACT ({IMAGE_PX} px corner camera and the state), no delay, '
                       f'{cond.seeds} held-out seeds')
                eps, figures, tr = run_condition(c, cond, image_port, operator, load, ros_env,
                                                 deployment=IMAGE_DEPLOYMENT, node_params={
                                                     'joints': {'names': list(COMMAND_NAMES)},
                                                     'camera_names': ['corner'], 'cameras': {'corner': {
                                                         'topic': 'corner/image_raw', 'type': 'image',
                                                         'key': 'image'}}})
                rows[cond.name] = dict(summarize(eps), rtt_ms=0.0, **figures)
                all_eps += [dataclasses.asdict(e) for e in eps]
                traces.update(tr)
                r = rows[cond.name]
                c.step(f'  {r["success"]}/{r["n"]} solved, median {fmt(r["median_s"])} s, overruns {r["overruns"]}')
        finally:
            load.close()
            operator.close()
            rclpy.try_shutdown(context=context)
            sims.close()
            workers.close()
        if not args.no_judge:
            verdict = judge(c, rows)
        if demos is not None and not args.no_judge and args.field_loop:
            from flywheel import PLUMBING_EPISODES, PLUMBING_STEPS, plumbing

            c.step(f'field-data loop at CI scale: {PLUMBING_EPISODES} episodes captured and labelled, exported, '
                   f'{PLUMBING_STEPS} training steps, the new checkpoint deployed and served (make flywheel: at scale)')
            t = time.monotonic()
            field_lines = plumbing(c, demos, ckpt)
            c.timings['field_loop'] = time.monotonic() - t
    except Skip as exc:
        print(f'check-sim: SKIPPED: {exc}')
        return 3
    except Exception as exc:   # every failure ends in the summary, with its log
        c.failures.append(f'{type(exc).__name__}: {exc}')
    lines = ['', f'=== drawer-open-v3 through policy_node + seq serve (state-only ACT, chunk {CHUNK} at '
             f'{round(1 / DT)} Hz = {CHUNK_S:.2f} s; {os.cpu_count()} cores; {built.get("versions", "")}) ===',
             'time to success: from the first commanded action to the simulator\'s success (s)', *table(rows)]
    misses = [e for e in all_eps if not e['success'] and e['condition'] != 'in-process']
    for e in misses[:10]:
        lines.append(f'missed {e["condition"]} test[{e["index"]}]: {e["reason"]}, {e["actions"]} actions, '
                     f'{e["chunks"]} chunks, underruns {e["underruns"]} ({e["underrun_s"]:.3f} s), longest command '
                     f'gap {e["max_command_gap_s"] * 1e3:.0f} ms, largest target jump '
                     f'{e["max_target_jump_m"] * 100:.2f} cm, seam jump {e["max_seam_jump"]:.4f}')
    lines += verdict + field_lines + c.notes
    lines.append('cache: demos ' + ('built' if built.get('demos_built') else 'cached') + ', checkpoint '
                 + ('trained' if built.get('checkpoint_built') else 'cached'))
    lines.append('step times: ' + ', '.join(f'{k} {v:.0f}s' for k, v in c.timings.items() if v >= 5))
    lines.append(f'check-sim took {time.monotonic() - c.t0:.0f} s'
                 + (f'; FAILED: {"; ".join(c.failures)}' if c.failures else '; all checks passed'))
    text = '\n'.join(lines)
    print(text)
    (c.out / 'summary.txt').write_text(text + '\n')
    (c.out / 'summary.json').write_text(json.dumps({'rows': rows, 'built': built, 'failures': c.failures,
                                                    'verdict': verdict, 'episodes': all_eps,
                                                    'total_s': time.monotonic() - c.t0}, indent=1, default=str))
    (c.out / 'traces.json').write_text(json.dumps(traces))
    return 1 if c.failures else 0


if __name__ == '__main__':
    raise SystemExit(main())
