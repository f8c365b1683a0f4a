"""``make check-lerobot``: real LeRobot 0.6 policies trained, deployed, served and run in closed loop, offline.

Runs in the ROS venv (it drives ``policy_node`` and the bag player, as ``make demo`` does); every LeRobot
step runs in the LeRobot venv given by ``--venv`` (Python >= 3.12, ``requirements-lerobot.txt``, this
clone pip-installed into it), through LeRobot's own tools and the product's public commands:

1. the install paths: ``pip install .`` (wheel) and ``pip install -e .`` (editable) of this clone into fresh
   Python 3.12 venvs give a ``seq`` whose gRPC stubs import; the LeRobot set resolves on 3.12 and 3.13;
2. the G1 dataset (v2.1) copied and converted to v3.0 with LeRobot's own converter;
3. ``lerobot-train`` of a small ACT and a small diffusion (DDIM, 10 inference steps, n_obs_steps 2) on
   episodes 0-4, fully offline (HF_HUB_OFFLINE, no ImageNet backbone weights, no push to the hub);
4. for each: ``seq init lerobot`` -> ``seq deploy`` -> ``seq serve``; the served chunk against LeRobot's
   in-process inference (served_vs_inprocess.py), also with several episodes at once served in batches, each
   equal to its own single-episode in-process result; then (ACT: with capture on, rate 1.0, images) the closed
   loop on episode 5 replayed as a rosbag through ``policy_node`` at 50 Hz with one ``~/act`` goal;
5. an ACT with temporal ensembling deploys (the robot ensembles, ``aggregate: weighted_average``), the same
   in a delta space is refused by ``seq deploy``, and the client's weighted_average equals LeRobot's
   ``ACTTemporalEnsembler`` on the same chunks to 1e-6 (check_ensembler.py);
6. the captured ACT run's field data, through test/lerobot_check/check_field_data.py when it exists;
7. a tiny SmolVLA built from LeRobot's real ``SmolVLAConfig`` (tiny_smolvla.py: a local WordLevel tokenizer, the
   SmolVLM backbone built small from its config in a local hub cache, nothing from the Hub; cached outside
   the clone by what made it), with RTC on and, as a copy, off: ``seq init lerobot`` -> ``seq deploy`` ->
   ``seq serve``; served chunks against LeRobot's in-process ``predict_action_chunk`` with the same noise and
   tail (rtc_vs_inprocess.py, max abs diff <= 1e-5 both ways), the in-painting (RTC's seam gap <= 0.05 x the
   unguided one, a delay above the checkpoint's execution_horizon included), the closed loop through
   ``policy_node`` with RTC on, and test/gpu/check_policy.py run on CPU with it (``--only smolvla`` runs
   this part alone).

Every ``seq deploy`` gets ``--timeout 180`` and every ``seq serve`` ``--load-timeout 180`` (a cold 2-core machine).

It prints one summary (MAE table, latencies, underruns, p95 / covers_seconds, transport overhead, its own
time) and exits non-zero when a check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

from sequence_ai_ros.demo.processes import Processes

REPO = Path(__file__).resolve().parents[2]
#: The closed loop's dry time is judged only below this load average (1 min), as check-sim's times are.
LOAD_JUDGED = 1.5
HZ = 50.0
OFFLINE = {'HF_HUB_OFFLINE': '1', 'HF_DATASETS_OFFLINE': '1', 'TRANSFORMERS_OFFLINE': '1', 'WANDB_MODE': 'disabled',
           'PYTHONUNBUFFERED': '1'}
#: the ROS dev shell's variables that must not leak into the Python 3.12 LeRobot venv
ROS_VARS = ('PYTHONPATH', 'AMENT_PREFIX_PATH', 'CMAKE_PREFIX_PATH', 'COLCON_PREFIX_PATH', 'LD_LIBRARY_PATH',
            'VIRTUAL_ENV', 'PYTHONHOME')
ACT_ARGS = ['--policy.type=act', '--policy.chunk_size=100', '--policy.n_action_steps=100', '--policy.dim_model=256',
            '--policy.dim_feedforward=1024', '--policy.n_encoder_layers=2', '--policy.optimizer_lr=1e-4',
            '--policy.optimizer_lr_backbone=1e-4', '--batch_size=4']
DIFFUSION_ARGS = ['--policy.type=diffusion', '--policy.n_obs_steps=2', '--policy.horizon=64',
                  '--policy.n_action_steps=32', '--policy.drop_n_last_frames=31', '--policy.resize_shape=[96,128]',
                  '--policy.crop_shape=[88,120]',
                  '--policy.down_dims=[64,128,256]', '--policy.use_group_norm=true',
                  '--policy.noise_scheduler_type=DDIM', '--policy.num_inference_steps=10', '--batch_size=8']
#: the deploy dry-run and load bounds every seq deploy / seq serve here gets (s)
BOUND_S = 180
SEAM_FRACTION = 0.05


class Check:
    """Shared state: output folder, environments, children, failures."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.out = args.out.resolve()
        if self.out.exists():
            shutil.rmtree(self.out)
        (self.out / 'logs').mkdir(parents=True)
        self.venv = args.venv.resolve()
        self.lr_env = {k: v for k, v in os.environ.items() if k not in ROS_VARS}
        self.lr_env.update(OFFLINE, PATH=f'{self.venv / "bin"}:{os.environ["PATH"]}')
        self.failures: list[str] = []
        self.t0 = time.monotonic()
        self.timings: dict[str, float] = {}

    def step(self, text: str) -> None:
        print(f'[{time.monotonic() - self.t0:7.1f}s] {text}', flush=True)

    def run(self, name: str, argv: list[str], timeout: float, env: dict | None = None, ok: bool = True) -> str:
        """Run a command to completion, log it, return stdout+stderr; a failure is recorded (or raised)."""
        log = self.out / 'logs' / f'{name}.log'
        t = time.monotonic()
        try:
            done = subprocess.run(argv, capture_output=True, text=True, env=env or self.lr_env, timeout=timeout,
                                  cwd=REPO)
            text, code = done.stdout + done.stderr, done.returncode
        except subprocess.TimeoutExpired:
            text, code = f'timed out after {timeout:.0f}s', -1
        log.write_text(text)
        self.timings[name] = time.monotonic() - t
        if ok and code != 0:
            raise RuntimeError(f'{name} failed ({code}); see {log}: ' + ' | '.join(text.strip().splitlines()[-4:]))
        return text if ok else f'{code}\n{text}'

    def lr(self, tool: str) -> str:
        return str(self.venv / 'bin' / tool)


def install_paths(c: Check) -> None:
    """Wheel and editable installs of this clone in fresh venvs of the LeRobot Python; the LeRobot set resolves."""
    py = str(c.venv / 'bin' / 'python')
    for mode in ('wheel', 'editable'):
        venv = c.out / f'install-{mode}'
        src = c.out / f'src-{mode}'
        files = subprocess.run(['git', 'ls-files', '--cached', '--others', '--exclude-standard'], cwd=REPO,
                               capture_output=True, text=True, check=True).stdout.split()
        for rel in files:   # a fresh copy of the clone: no generated stubs, no build folders
            if (REPO / rel).is_file() and not rel.endswith(('_pb2.py', '_pb2_grpc.py')):
                (src / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(REPO / rel, src / rel)
        base = subprocess.run([py, '-c', 'import sys; print(sys.base_prefix)'], capture_output=True, text=True,
                              env=c.lr_env, check=True).stdout.strip()
        c.run(f'install_{mode}_venv', [f'{base}/bin/python3', '-m', 'venv', str(venv)], 120)
        target = ['-e', str(src)] if mode == 'editable' else [str(src)]
        c.run(f'install_{mode}', [str(venv / 'bin' / 'pip'), 'install', '-q', *target], 900)
        env = dict(c.lr_env, PATH=f'{venv / "bin"}:{c.lr_env["PATH"]}')
        c.run(f'install_{mode}_seq', [str(venv / 'bin' / 'seq'), 'init', '--list'], 120, env=env)
        c.run(f'install_{mode}_stubs', [str(venv / 'bin' / 'python'), '-c',
                                        'import sequence_ai_ros.protocol.sequence_ai_pb2_grpc, sequence_ai\n'
                                        'from sequence_ai_ros.worker.fleet import HAPROXY_CONFIG as cfg\n'
                                        'assert cfg.is_file(), f"seq fleet template missing: {cfg}"'], 120,
              env=env)
        c.step(f'install path {mode}: pip install {" ".join(target)} -> seq, the gRPC stubs and the HAProxy '
               'template')
    env = dict(os.environ, SEQ_RESOLVE_LEROBOT='1')
    out = c.run('resolve_lerobot_set', [sys.executable, '-m', 'pytest', 'test/test_requirements.py', '-q',
                                        '-p', 'no:cacheprovider', '-k', 'lerobot'], 900, env=env, ok=False)
    if not out.startswith('0\n'):
        c.failures.append('requirements-lerobot.txt does not resolve (logs/resolve_lerobot_set.log)')
    c.step('requirements-lerobot.txt resolves on Python 3.12 and 3.13' if out.startswith('0\n') else
           'requirements-lerobot.txt: resolution FAILED')


def dataset_v30(c: Check) -> Path:
    """Copy the v2.1 dataset and convert the copy to v3.0 with LeRobot's converter."""
    root = c.out / 'g1_v30'
    shutil.copytree(c.args.dataset, root)
    for path in [root, *root.rglob('*')]:
        path.chmod(path.stat().st_mode | 0o200)
    c.run('convert', [c.lr('python'), '-m', 'lerobot.scripts.convert_dataset_v21_to_v30', '--repo-id=local/g1',
                      f'--root={root}', '--push-to-hub=false'], 900)
    info = json.loads((root / 'meta' / 'info.json').read_text())
    assert info['codebase_version'] == 'v3.0', info['codebase_version']
    return root


def train(c: Check, kind: str, root: Path, steps: int) -> Path:
    """lerobot-train offline on episodes 0-4; return the checkpoint's pretrained_model directory."""
    out = c.out / f'train_{kind}'
    extra = ACT_ARGS if kind == 'act' else DIFFUSION_ARGS
    c.run(f'train_{kind}', [c.lr('lerobot-train'), *extra, '--policy.device=cpu', '--policy.push_to_hub=false',
                            '--policy.pretrained_backbone_weights=null', '--dataset.repo_id=local/g1',
                            f'--dataset.root={root}', '--dataset.episodes=[0,1,2,3,4]', '--dataset.video_backend=pyav',
                            f'--output_dir={out}', f'--job_name={kind}_g1', f'--steps={steps}', '--num_workers=1',
                            f'--save_freq={steps}', '--log_freq=10', '--wandb.enable=false', '--seed=1'], 3600)
    ckpt = out / 'checkpoints' / 'last' / 'pretrained_model'
    assert (ckpt / 'model.safetensors').is_file(), ckpt
    return ckpt


def deploy(c: Check, kind: str, ckpt: Path, home: Path, ds_info: dict, name: str = '',
           extra: dict | None = None) -> tuple[Path, dict]:
    """Run seq init lerobot, write its config.yaml, run seq deploy; return (policy dir, env with SEQ_HOME)."""
    env = dict(c.lr_env, SEQ_HOME=str(home))
    name = name or f'lerobot_{kind}'
    pdir = c.out / kind / name
    c.run(f'{kind}_init', [c.lr('seq'), 'init', 'lerobot', str(pdir)], 120, env=env)
    config = yaml.safe_load((pdir / 'config.yaml').read_text())
    names = ds_info['features']['observation.state']['names']
    config.update(checkpoint=str(ckpt), device='cpu', fps=float(ds_info['fps']),
                  state_names=list(names[0] if isinstance(names[0], list) else names),
                  action_names=list(names[0] if isinstance(names[0], list) else names),
                  robot_type=ds_info.get('robot_type', ''), noise_seed=0 if kind == 'diffusion' else None)
    config.update(extra or {})
    (pdir / 'config.yaml').write_text(yaml.safe_dump(config, sort_keys=False))
    c.run(f'{name}_deploy', [c.lr('seq'), 'deploy', str(pdir / 'policy.py'), '--name', name,
                             '--timeout', str(BOUND_S)], 600, env=env)
    return pdir, env


def closed_loop(c: Check, kind: str, endpoint: str, bag: Path, duration: float, env: dict) -> dict:
    """policy_node (G1 config, 50 Hz) + the replayed bag + one ~/act goal; return the Act result's figures."""
    import rclpy

    from sequence_ai_ros.demo.pipeline import _node_params
    from sequence_ai_ros.demo.ros_side import Operator

    procs = Processes(c.out / 'logs', dict(os.environ, PYTHONUNBUFFERED='1'))
    try:
        params = _node_params('g1.yaml', f'lerobot_{kind}', endpoint, c.out / kind / 'policy_node.yaml', cameras=True)
        procs.start(f'{kind}_policy_node', [sys.executable, '-m', 'sequence_ai_ros.node.main', '--ros-args',
                                            '--params-file', str(c.out / kind / 'policy_node.yaml')])
        context = rclpy.context.Context()
        rclpy.init(context=context)
        operator = Operator('policy_node', f"/{params['command']['controller']}/commands", context)
        try:
            operator.wait_ready(60)
            player = procs.start(f'{kind}_bag_player', [sys.executable, '-m', 'sequence_ai_ros.bags.player', str(bag),
                                                        '--wait-subscribers', '30', '--duration', f'{duration:.2f}'])
            player.wait_for(r'^playing ', 60)
            started = time.monotonic()
            time.sleep(1.0)
            goal_s = max(1.0, duration - (time.monotonic() - started) - 0.5)
            result = operator.run_goal('pick the bottle', max_seconds=goal_s)
            label = operator.label(True, notes=f'check-lerobot {kind}')
        finally:
            operator.close()
            rclpy.try_shutdown(context=context)
    finally:
        procs.close()
    return {'reason': result.reason, 'message': result.message, 'actions': int(result.actions),
            'chunks': int(result.chunks), 'underruns': int(result.underruns), 'underrun_s': float(result.underrun_s),
            'latency_p50_ms': float(result.latency_p50_ms), 'latency_p95_ms': float(result.latency_p95_ms),
            'max_seam_jump': float(result.max_seam_jump), 'label_ok': bool(label.ok)}


def serve_and_check(c: Check, kind: str, ckpt: Path, bag: Path, ds_info: dict, duration: float) -> dict:
    """Deploy, serve, compare with LeRobot in-process, run the closed loop; return the figures."""
    home = c.out / kind / 'seq_home'
    pdir, env = deploy(c, kind, ckpt, home, ds_info)
    procs = Processes(c.out / 'logs', env)
    try:
        server = procs.start(f'{kind}_serve', [c.lr('seq'), 'serve', f'lerobot_{kind}', '--port', '0', '--warm',
                                               '--load-timeout', str(BOUND_S)])
        endpoint = server.wait_for(r'serving \S+ on (\S+:\d+)', 600).group(1)
        c.step(f'{kind}: seq serve on {endpoint}; served chunk vs LeRobot in-process, then MAE on episode 5')
        seed = ['--noise-seed', '0'] if kind == 'diffusion' else []
        c.run(f'{kind}_compare', [c.lr('python'), str(REPO / 'test' / 'lerobot_check' / 'served_vs_inprocess.py'),
                                  '--endpoint', endpoint, '--deployment', f'lerobot_{kind}', '--checkpoint', str(ckpt),
                                  '--dataset', str(c.args.dataset), '--episode', '5', '--robot-type',
                                  ds_info.get('robot_type', ''), '--out', str(c.out / kind / 'compare.json'), *seed],
              3600, env=env)
        figures = json.loads((c.out / kind / 'compare.json').read_text())
        if kind == 'act':   # capture from here on: the closed-loop episode only (settings are read per episode)
            c.run('act_capture', [c.lr('seq'), 'policy', 'capture', 'lerobot_act', '--rate', '1.0', '--images'], 60,
                  env=env)
        c.step(f'{kind}: closed loop on episode 5 through policy_node at {HZ:.0f} Hz')
        load_before = os.getloadavg()[0]
        figures['loop'] = closed_loop(c, kind, endpoint, bag, duration, env)
        figures['loop_load'] = max(load_before, os.getloadavg()[0])
    finally:
        procs.close()
    figures['covers_seconds'] = figures['chunk_length'] / float(ds_info['fps'])
    figures['p95_over_covers'] = figures['loop']['latency_p95_ms'] / 1e3 / figures['covers_seconds']
    figures['seq_home'] = str(home)
    if figures['max_abs_diff'] > 1e-5:
        c.failures.append(f'{kind}: served chunk differs from LeRobot in-process by {figures["max_abs_diff"]:.2e}')
    if figures['batched_max_abs_diff'] > 1e-5:
        c.failures.append(f'{kind}: a batched chunk differs from its episode\'s single in-process chunk by '
                          f'{figures["batched_max_abs_diff"]:.2e}')
    if max(figures['batched_calls']) < 2:
        c.failures.append(f'{kind}: {figures["batched_robots"]} concurrent episodes were never batched '
                          f'(calls {figures["batched_calls"]})')
    # Below 0.45 the prefetch hides the round trip. A single stall (a loaded machine) can still outlast the
    # prefetch lead, which is max(p95 of past round trips, MIN_LEAD_FRACTION of a chunk): then the arm may run
    # dry for at most the slow round trip's excess over that lead (p95 over a few chunks is about the slowest).
    from sequence_ai_ros.client.records import MIN_LEAD_FRACTION

    loop = figures['loop']
    explained_s = max(0.0, loop['latency_p95_ms'] / 1e3 - MIN_LEAD_FRACTION * figures['covers_seconds']) + 1.0 / HZ
    figures['dry_explained_s'] = explained_s
    # Dry time is judged only on a quiet machine, as check-sim judges time: on a loaded one the bag player, the
    # node or the worker can be descheduled for longer than any lead covers (a stall, not the engine's).
    figures['dry_judged'] = figures['loop_load'] < LOAD_JUDGED
    if figures['p95_over_covers'] < 0.45 and loop['underrun_s'] > explained_s and not figures['dry_judged']:
        c.step(f'{kind}: {loop["underruns"]} underruns ({loop["underrun_s"]:.3f} s dry), more than a stall past the '
               f'prefetch lead explains ({explained_s:.3f} s): not judged (load {figures["loop_load"]:.2f} >= '
               f'{LOAD_JUDGED})')
    elif figures['p95_over_covers'] < 0.45 and loop['underrun_s'] > explained_s:
        c.failures.append(f'{kind}: {loop["underruns"]} underruns ({loop["underrun_s"]:.3f} s dry) with p95/covers '
                          f'{figures["p95_over_covers"]:.2f} < 0.45, more than a stall past the prefetch lead '
                          f'explains ({explained_s:.3f} s)')
    if figures['loop']['reason'] not in ('completed', 'timeout') or figures['loop']['actions'] == 0:
        c.failures.append(f'{kind}: closed loop ended {figures["loop"]["reason"]} ({figures["loop"]["message"]})')
    return figures


def refusal(c: Check, act_ckpt: Path) -> None:
    """An ACT checkpoint with temporal ensembling deploys with ``aggregate: weighted_average``.

    The same in a delta action space is refused by seq deploy, naming type and reason; the client's
    weighted_average equals LeRobot's ACTTemporalEnsembler on the same chunks (check_ensembler.py).
    """
    bad = c.out / 'act_ensembled'
    shutil.copytree(act_ckpt, bad)
    cfg = json.loads((bad / 'config.json').read_text())
    cfg.update(temporal_ensemble_coeff=0.01, n_action_steps=1)
    (bad / 'config.json').write_text(json.dumps(cfg))
    env = dict(c.lr_env, SEQ_HOME=str(c.out / 'refusal_home'))
    pdir = c.out / 'refusal' / 'policy'
    c.run('refusal_init', [c.lr('seq'), 'init', 'lerobot', str(pdir)], 120, env=env)
    config = yaml.safe_load((pdir / 'config.yaml').read_text())
    config.update(checkpoint=str(bad), device='cpu')
    (pdir / 'config.yaml').write_text(yaml.safe_dump(config))
    out = c.run('ensembled_deploy', [c.lr('seq'), 'deploy', str(pdir / 'policy.py'), '--timeout', str(BOUND_S)], 600,
                env=env, ok=False)
    if not out.startswith('0\n'):
        c.failures.append('seq deploy refused an ACT checkpoint with temporal ensembling (logs/ensembled_deploy.log)')
    config.update(action_space='joint_delta')
    (pdir / 'config.yaml').write_text(yaml.safe_dump(config))
    out = c.run('refusal_deploy', [c.lr('seq'), 'deploy', str(pdir / 'policy.py'), '--timeout', str(BOUND_S)],
                300, env=env, ok=False)
    refused = not out.startswith('0\n') and "'act'" in out and 'temporal_ensemble_coeff' in out
    if not refused:
        c.failures.append('seq deploy did not refuse an ensembled ACT in a delta space (logs/refusal_deploy.log)')
    c.step('seq deploy serves ACT with temporal ensembling, refuses it in a delta space' if refused else
           'refusal check FAILED')
    out = c.run('ensembler', [c.lr('python'), str(REPO / 'test' / 'lerobot_check' / 'check_ensembler.py')], 600,
                env=dict(c.lr_env, OMP_NUM_THREADS='1'), ok=False)
    if not out.startswith('0\n'):
        c.failures.append('weighted_average differs from ACTTemporalEnsembler (logs/ensembler.log)')
    c.step('aggregate weighted_average vs ACTTemporalEnsembler: ' + out.strip().splitlines()[-1])


def field_data(c: Check, home: Path) -> str:
    """Run test/lerobot_check/check_field_data.py (issue 12) on the captured ACT run when it exists."""
    script = REPO / 'test' / 'lerobot_check' / 'check_field_data.py'
    if not script.is_file():
        return 'skipped: test/lerobot_check/check_field_data.py does not exist in this clone'
    out = c.run('field_data', [c.lr('python'), str(script), '--home', str(home), '--deployment', 'lerobot_act'],
                3600, env=dict(c.lr_env, SEQ_HOME=str(home)), ok=False)
    if not out.startswith('0\n'):
        c.failures.append('check_field_data.py failed (logs/field_data.log)')
        return 'FAILED (logs/field_data.log)'
    return 'passed: ' + (out.strip().splitlines()[-1] if out.strip() else '')


def tiny_smolvla(c: Check) -> tuple[Path, Path]:
    """Build (once) the tiny SmolVLA; return (checkpoint, hub cache), cached by what made them."""
    import hashlib

    script = REPO / 'test' / 'lerobot_check' / 'tiny_smolvla.py'
    meta = c.args.dataset / 'meta'
    made_by = hashlib.sha256()
    for path in (script, c.venv / 'requirements.txt', meta / 'info.json', meta / 'episodes_stats.jsonl'):
        made_by.update(path.read_bytes() if path.is_file() else path.name.encode())
    cache = c.venv.parent / f'tiny-smolvla-{made_by.hexdigest()[:16]}'
    if not (cache / '.stamp').is_file():
        shutil.rmtree(cache, ignore_errors=True)
        building = cache.with_name(cache.name + '.building')
        shutil.rmtree(building, ignore_errors=True)
        c.run('smolvla_build', [c.lr('python'), str(script), '--dataset', str(c.args.dataset), '--out',
                                str(building)], 600)
        (building / '.stamp').touch()
        building.rename(cache)
    return cache / 'checkpoint', cache / 'hub'


def relative_copy(ckpt: Path, into: Path) -> Path:
    """``ckpt`` with LeRobot's relative-action steps in its pipelines, as pi0.5's ``use_relative_actions`` has them.

    The preprocessor gets ``relative_actions_processor`` before its device step (pi0.5: before normalising),
    the postprocessor ``absolute_actions_processor`` after unnormalising; LeRobot links the two on loading.
    """
    shutil.copytree(ckpt, into)
    pre = json.loads((into / 'policy_preprocessor.json').read_text())
    at = next(i for i, step in enumerate(pre['steps']) if step.get('registry_name') == 'device_processor')
    pre['steps'].insert(at, {'registry_name': 'relative_actions_processor',
                             'config': {'enabled': True, 'exclude_joints': [], 'action_names': None}})
    (into / 'policy_preprocessor.json').write_text(json.dumps(pre, indent=2))
    post = json.loads((into / 'policy_postprocessor.json').read_text())
    at = next(i for i, step in enumerate(post['steps']) if step.get('registry_name') == 'unnormalizer_processor')
    post['steps'].insert(at + 1, {'registry_name': 'absolute_actions_processor', 'config': {'enabled': True}})
    (into / 'policy_postprocessor.json').write_text(json.dumps(post, indent=2))
    return into


def smolvla_check(c: Check, bag: Path, ds_info: dict, duration: float) -> dict:
    """Tiny SmolVLA: deploy with RTC on and off, served vs in-process, in-painting, closed loop, check_policy.py."""
    t0 = time.monotonic()
    ckpt, hub = tiny_smolvla(c)
    c.step(f'smolvla: tiny SmolVLA ready ({ckpt}); deploying it with RTC on and off')
    plain = c.out / 'smolvla' / 'checkpoint_rtc_off'
    shutil.copytree(ckpt, plain)
    cfg = json.loads((plain / 'config.json').read_text())
    cfg['rtc_config']['enabled'] = False
    (plain / 'config.json').write_text(json.dumps(cfg, indent=2))
    relative = relative_copy(ckpt, c.out / 'smolvla' / 'checkpoint_relative')
    home = c.out / 'smolvla' / 'seq_home'
    extra = {'hub_cache': str(hub), 'noise_seed': 0}
    _, env = deploy(c, 'smolvla', ckpt, home, ds_info, extra=extra)
    deploy(c, 'smolvla', plain, home, ds_info, name='lerobot_smolvla_plain', extra=extra)
    deploy(c, 'smolvla', relative, home, ds_info, name='lerobot_smolvla_relative', extra=extra)
    # deploy and serve find the backbone by config.yaml's hub_cache alone; LeRobot's own in-process loading
    # (the reference) by HF_HUB_CACHE
    inprocess_env = dict(env, HF_HUB_CACHE=str(hub))
    procs = Processes(c.out / 'logs', env)
    try:
        server = procs.start('smolvla_serve', [c.lr('seq'), 'serve', 'lerobot_smolvla', 'lerobot_smolvla_plain',
                                               'lerobot_smolvla_relative', '--port', '0', '--warm',
                                               '--load-timeout', str(BOUND_S)])
        endpoint = server.wait_for(r'^serving .+ on (\S+:\d+)$', 600).group(1)
        c.step(f'smolvla: seq serve on {endpoint}; RTC on and off against LeRobot in-process')
        c.run('smolvla_compare', [c.lr('python'), str(REPO / 'test' / 'lerobot_check' / 'rtc_vs_inprocess.py'),
                                  '--endpoint', endpoint, '--rtc', 'lerobot_smolvla', '--plain',
                                  'lerobot_smolvla_plain', '--relative', 'lerobot_smolvla_relative',
                                  '--relative-checkpoint', str(relative), '--checkpoint', str(ckpt), '--dataset',
                                  str(c.args.dataset), '--robot-type', ds_info.get('robot_type', ''),
                                  '--out', str(c.out / 'smolvla' / 'compare.json')], 900, env=inprocess_env)
        figures = json.loads((c.out / 'smolvla' / 'compare.json').read_text())
        c.step(f'smolvla: closed loop on episode 5 through policy_node at {HZ:.0f} Hz, RTC on')
        figures['loop'] = closed_loop(c, 'smolvla', endpoint, bag, duration, env)
    finally:
        procs.close()
    c.step('smolvla: test/gpu/check_policy.py on CPU (--rtc, the checkpoint with RTC off as given)')
    out = c.run('smolvla_check_policy', [c.lr('python'), str(REPO / 'test' / 'gpu' / 'check_policy.py'),
                                         '--checkpoint', str(plain), '--hub-cache', str(hub), '--device', 'cpu',
                                         '--rtc', '--chunks', '8', '--timeout', str(BOUND_S)], 900, env=env,
                ok=False)
    lines = [json.loads(line) for line in out.splitlines() if line.startswith('{')]
    figures['check_policy'] = lines[-1] if lines else {'ok': False, 'error': out[-500:]}
    figures['took_s'] = time.monotonic() - t0
    for mode in ('rtc', 'plain', 'relative'):
        if figures[mode]['max_abs_diff'] > 1e-5:
            c.failures.append(f'smolvla: served chunk (RTC {mode}) differs from LeRobot in-process by '
                              f'{figures[mode]["max_abs_diff"]:.2e}')
    for mode in ('rtc', 'relative'):
        if not figures[mode]['seam_gap_max'] <= SEAM_FRACTION * figures['plain']['seam_gap_mean']:
            c.failures.append(f'smolvla: RTC ({mode}) seam gap {figures[mode]["seam_gap_max"]:.4f} > {SEAM_FRACTION} x '
                              f'the unguided {figures["plain"]["seam_gap_mean"]:.4f}')
    loop = figures['loop']
    if loop['reason'] not in ('completed', 'timeout') or loop['actions'] == 0:
        c.failures.append(f'smolvla: closed loop ended {loop["reason"]} ({loop["message"]})')
    if not figures['check_policy'].get('ok'):
        c.failures.append(f'smolvla: test/gpu/check_policy.py failed: {figures["check_policy"]}')
    return figures


def smolvla_lines(r: dict) -> list[str]:
    loop, cp = r['loop'], r['check_policy']
    return [f'smolvla (tiny, {r["params"]} parameters, real SmolVLAConfig; {r["took_s"]:.0f} s):',
            f'  served == LeRobot in-process, same noise and tail: RTC on max abs diff {r["rtc"]["max_abs_diff"]:.2e}, '
            f'off {r["plain"]["max_abs_diff"]:.2e} over {r["rtc"]["requests"]} chunks each (bound 1e-5)',
            f'  seam gap max|chunk[:d] - tail[:d]| (delays {r["rtc"]["delays"]}): RTC {r["rtc"]["seam_gap_max"]:.4f}, '
            f'unguided mean {r["plain"]["seam_gap_mean"]:.4f} (ratio {r["seam_ratio"]:.4f}, bound {SEAM_FRACTION})',
            f'  relative actions (LeRobot\'s relative/absolute steps added, RTC on, leftover re-anchored): max abs '
            f'diff {r["relative"]["max_abs_diff"]:.2e}, seam gap {r["relative"]["seam_gap_max"]:.4f}',
            f'  closed loop at {HZ:.0f} Hz, RTC on: {loop["actions"]} actions over {loop["chunks"]} chunks, '
            f'{loop["reason"]}; underruns {loop["underruns"]} ({loop["underrun_s"]:.3f} s); latency p50 '
            f'{loop["latency_p50_ms"]:.1f} ms, p95 {loop["latency_p95_ms"]:.1f} ms; max seam jump '
            f'{loop["max_seam_jump"]:.4f} (the largest step between two rows of one chunk: '
            f'{r["rtc"]["row_step_max"]:.4f})',
            f'  test/gpu/check_policy.py on CPU: {json.dumps(cp)}']


def summary(c: Check, results: dict[str, dict], fields: str) -> str:
    lines = ['', '=== make check-lerobot summary (LeRobot 0.6.1, CPU, '
             f'{os.cpu_count()} cores; G1 episodes 0-4 trained, episode 5 held out) ===']
    for kind, r in results.items():
        if kind == 'smolvla':
            lines += smolvla_lines(r)
            continue
        loop = r['loop']
        lines += [f'{kind}: chunk {r["chunk_length"]} actions ({r["covers_seconds"]:.3f} s), history {r["history"]}',
                  f'  served == LeRobot in-process   max abs diff {r["max_abs_diff"]:.2e} over {r["requests"]} chunks '
                  '(bound 1e-5)',
                  f'  batched: {r["batched_robots"]} episodes at once, {r["batched_requests"]} chunks in calls of '
                  f'{r["batched_calls"]}; each == its episode alone in-process, max abs diff '
                  f'{r["batched_max_abs_diff"]:.2e} (bound 1e-5)',
                  f'  inference p50 {r["inference_p50_ms"]:.1f} ms in-process; '
                  f'round trip p50 {r["roundtrip_p50_ms"]:.1f} ms over gRPC (worker inference p50 '
                  f'{r["worker_inference_p50_ms"]:.1f} ms); transport overhead {r["transport_overhead_ms"]:.1f} ms '
                  'per chunk (round trip - worker inference)',
                  f'  closed loop at {HZ:.0f} Hz: {loop["actions"]} actions over {loop["chunks"]} chunks, '
                  f'{loop["reason"]}; underruns {loop["underruns"]} ({loop["underrun_s"]:.3f} s); '
                  f'latency p50 {loop["latency_p50_ms"]:.1f} ms, p95 {loop["latency_p95_ms"]:.1f} ms; '
                  f'p95 / covers_seconds {r["p95_over_covers"]:.2f} '
                  f'(below 0.45 no dry time beyond a stall past the prefetch lead: {r["dry_explained_s"]:.3f} s; '
                  f'load {r["loop_load"]:.2f}, {"judged" if r["dry_judged"] else "not judged"})',
                  f'  MAE over the action horizon (H={r["chunk_length"]}, episode 5, {r["mae_windows"]} windows, every '
                  f'{r["mae_stride"]}th):']
        lines += [f'    {name:18s} {value:.5f}' for name, value in r['mae'].items()]
    lines.append(f'field data (ACT run, SEQ_HOME {results["act"]["seq_home"] if "act" in results else "-"}): {fields}')
    lines.append('step times: ' + ', '.join(f'{k} {v:.0f}s' for k, v in c.timings.items() if v >= 5))
    lines.append(f'check-lerobot took {time.monotonic() - c.t0:.0f} s'
                 + (f'; FAILED: {"; ".join(c.failures)}' if c.failures else '; all checks passed'))
    return '\n'.join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--venv', type=Path, required=True, help='the LeRobot venv (Python >= 3.12)')
    parser.add_argument('--dataset', type=Path, required=True, help='the G1 LeRobot v2.1 dataset (read only)')
    parser.add_argument('--out', type=Path, default=REPO / 'out' / 'check-lerobot')
    parser.add_argument('--act-steps', type=int, default=60)
    parser.add_argument('--diffusion-steps', type=int, default=60)
    parser.add_argument('--act-checkpoint', type=Path, help='development only: skip training ACT, use this')
    parser.add_argument('--diffusion-checkpoint', type=Path, help='development only: skip training diffusion')
    parser.add_argument('--skip-install', action='store_true', help='development only: skip the install paths')
    parser.add_argument('--only', choices=['all', 'smolvla'], default='all',
                        help='development only: smolvla runs the tiny SmolVLA part alone')
    args = parser.parse_args()
    args.dataset = args.dataset.resolve()
    if not (args.dataset / 'meta' / 'info.json').is_file():
        print(f'check-lerobot: no dataset at {args.dataset}')
        return 2
    c = Check(args)
    results: dict[str, dict] = {}
    fields = 'not run'
    everything = args.only == 'all'
    try:
        if everything and not args.skip_install:
            install_paths(c)
        ds_info = json.loads((args.dataset / 'meta' / 'info.json').read_text())
        ckpts = {}
        if everything:
            c.step('converting a copy of the dataset to v3.0 (lerobot.scripts.convert_dataset_v21_to_v30)')
            root = dataset_v30(c)
            for kind, steps, given in (('act', args.act_steps, args.act_checkpoint),
                                       ('diffusion', args.diffusion_steps, args.diffusion_checkpoint)):
                if given:
                    ckpts[kind] = given.resolve()
                    continue
                c.step(f'lerobot-train {kind}: {steps} steps on episodes 0-4, CPU, offline')
                ckpts[kind] = train(c, kind, root, steps)
            refusal(c, ckpts['act'])
        bag = c.out / 'episode_5_bag'
        c.run('to_rosbag', [sys.executable, '-m', 'sequence_ai_ros.cli', 'data', 'to-rosbag', str(args.dataset),
                            '--episode', '5', '--out', str(bag)], 600, env=dict(os.environ))
        from sequence_ai_ros.datasets.lerobot_reader import LeRobotDataset

        duration = LeRobotDataset(args.dataset).length(5) / float(ds_info['fps'])
        for kind in ckpts:
            results[kind] = serve_and_check(c, kind, ckpts[kind], bag, ds_info, duration)
        if 'act' in results:
            fields = field_data(c, Path(results['act']['seq_home']))
        results['smolvla'] = smolvla_check(c, bag, ds_info, duration)
        c.step(c.run('robot_adapter', [c.lr('python'), str(REPO / 'test/lerobot_check/check_robot_adapter.py')], 900))
    except Exception as exc:   # every failure ends in the summary, with its log
        c.failures.append(f'{type(exc).__name__}: {exc}')
    text = summary(c, results, fields)
    print(text)
    (c.out / 'summary.txt').write_text(text + '\n')
    (c.out / 'summary.json').write_text(json.dumps({'results': results, 'failures': c.failures,
                                                    'total_s': time.monotonic() - c.t0}, indent=2) + '\n')
    return 1 if c.failures else 0


if __name__ == '__main__':
    raise SystemExit(main())
