"""Load checkpoints through the product, serve them, time chunks and check RTC's in-painting; one JSON line each.

Written for a GPU machine with the weights in local folders; the same script runs on CPU with the tiny
SmolVLA ``make check-lerobot`` builds (which runs it, so the script itself is checked). In the worker's venv
(``pip install -r requirements-lerobot.txt`` plus the policy's extra, then ``pip install .``), offline::

    python test/gpu/check_policy.py --checkpoint /models/pi05_base --hub-cache ~/hf-hub \
        [--checkpoint /models/act ...] [--template lerobot|pi05-droid] [--device cuda] [--rtc] \
        [--chunks 20] [--delay 5] [--instruction "pick up the cup"] [--timeout 180]

Per checkpoint, through the public commands: ``seq init TEMPLATE`` -> config.yaml (``noise_seed: 0``) ->
``seq deploy --timeout`` (its dry run loads the weights and sends a tail) -> ``seq serve --port 0 --warm``;
then one episode stream with synthetic frames at the contract's camera sizes, ``--chunks`` requests: every
chunk must have the contract's shape and be finite; round trip p50/p95 over the warm ones. With ``--rtc``
(or a checkpoint whose ``rtc_config.enabled`` is true) every later request carries the unexecuted tail of the
previous chunk (half of it ran) and an expected delay ``d``; the check then asserts the in-painting: the
worst ``max |chunk[:d] - tail[:d]|`` (the seam gap, robot units) is at most ``--seam-fraction`` of the
unguided gap, measured on the same stream by a deployment of the same checkpoint with RTC off. ``--rtc`` on
a checkpoint without ``rtc_config`` enables it (a copy of config.json with ``rtc_config.enabled: true``).

Output: one JSON line per checkpoint, ``{"ok": true|false, ...}``, even when a step fails (then with
``step`` and ``error``); the exit status is 1 when any line is not ok. It checks loading, plumbing, RTC's
in-painting and latency, not task success.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / 'lerobot_check'))
from served_vs_inprocess import Stream  # noqa: E402

from sequence_ai_ros.protocol.types import Observation  # noqa: E402

FLOW_MATCHING = ('smolvla', 'pi0', 'pi05')


class Failed(Exception):
    """A step failed: its name and what it said."""

    def __init__(self, step: str, error: str) -> None:
        super().__init__(f'{step}: {error}')
        self.step, self.error = step, error


def _copy_with_rtc(checkpoint: Path, enabled: bool, into: Path) -> Path:
    """A folder of links to ``checkpoint``'s files with config.json's ``rtc_config.enabled`` set."""
    into.mkdir(parents=True)
    for item in checkpoint.iterdir():
        if item.name != 'config.json':
            (into / item.name).symlink_to(item.resolve())
    cfg = json.loads((checkpoint / 'config.json').read_text())
    cfg['rtc_config'] = {**(cfg.get('rtc_config') or {}), 'enabled': enabled}
    (into / 'config.json').write_text(json.dumps(cfg, indent=2))
    return into


def _deploy(args: argparse.Namespace, checkpoint: Path, name: str, tmp: Path, env: dict) -> None:
    pdir = tmp / name
    done = subprocess.run(['seq', 'init', args.template, str(pdir)], env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise Failed('init', done.stderr.strip()[-2000:])
    config = yaml.safe_load((pdir / 'config.yaml').read_text())
    config.update(checkpoint=str(checkpoint), device=args.device)
    if args.template == 'lerobot':
        config.update(hub_cache=args.hub_cache, noise_seed=0,
                      hub_snapshots=dict(item.split('=', 1) for item in args.hub_snapshot))
    (pdir / 'config.yaml').write_text(yaml.safe_dump(config, sort_keys=False))
    done = subprocess.run(['seq', 'deploy', str(pdir / 'policy.py'), '--name', name, '--timeout', str(args.timeout)],
                          env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise Failed('deploy', (done.stdout + done.stderr).strip()[-2000:])


def _serve(args: argparse.Namespace, names: list[str], env: dict, log: Path) -> tuple[subprocess.Popen, str]:
    """Start ``seq serve`` (its output to ``log``, never a pipe that fills); return it and its endpoint."""
    with log.open('w') as out:
        serve = subprocess.Popen(['seq', 'serve', *names, '--port', '0', '--warm', '--load-timeout',
                                  str(args.timeout)], env=env, stdout=out, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + args.timeout
    while time.monotonic() < deadline:
        m = re.search(r'^serving .+ on (\S+:\d+)$', log.read_text(), re.MULTILINE)
        if m:
            return serve, m.group(1)
        if serve.poll() is not None:
            break
        time.sleep(0.2)
    serve.kill()
    serve.wait(30)
    raise Failed('serve', 'seq serve did not start: ' + log.read_text()[-2000:])


def _stream(args: argparse.Namespace, endpoint: str, name: str, rtc: bool) -> dict:
    """``--chunks`` requests on one episode stream; return round trips and the seam gaps."""
    stream = Stream(endpoint, name, args.instruction)
    c = stream.contract
    rng = np.random.default_rng(0)
    rtts, gaps, tail = [], [], None
    try:
        for k in range(args.chunks):
            obs = Observation(state=rng.normal(0, 0.1, c.observation.state_dim).astype(np.float32),
                              state_names=c.observation.state_names, instruction=args.instruction,
                              timestamp=k * c.dt,
                              images={cam.key: rng.integers(0, 255, (cam.height or 224, cam.width or 224, 3),
                                                            np.uint8) for cam in c.observation.cameras})
            delay = min(args.delay, len(tail)) if tail is not None else 0
            chunk, rtt, _ = stream.request([obs], chunk_tail=tail, delay=delay)
            if not np.isfinite(chunk).all() or chunk.shape != (c.chunk_length, c.action_dim):
                raise Failed('chunks', f'chunk {k}: shape {chunk.shape} (contract ({c.chunk_length}, '
                                       f'{c.action_dim})), finite {bool(np.isfinite(chunk).all())}')
            if tail is not None and delay:
                gaps.append(float(np.abs(chunk[:delay] - tail[:delay]).max()))
            if k:   # the first is cold (allocations, caches)
                rtts.append(rtt)
            tail = chunk[c.chunk_length // 2:] if rtc else None
    finally:
        stream.close()
    return {'rtts': rtts or [rtt], 'gaps': gaps, 'shape': list(chunk.shape)}


def check(args: argparse.Namespace, checkpoint: Path, index: int) -> dict:
    """Deploy, serve and stream one checkpoint; the result line (raises :class:`Failed`)."""
    cfg = json.loads((checkpoint / 'config.json').read_text())
    kind = cfg.get('type')
    rtc = kind in FLOW_MATCHING and (args.rtc or bool((cfg.get('rtc_config') or {}).get('enabled')))
    env = dict(os.environ, HF_HUB_OFFLINE='1', HF_DATASETS_OFFLINE='1', TRANSFORMERS_OFFLINE='1')
    with tempfile.TemporaryDirectory(prefix='seq-gpu-') as tmp_name:
        tmp = Path(tmp_name)
        env['SEQ_HOME'] = str(tmp / 'home')
        name = f'check_{index}'
        names = [name]
        t0 = time.monotonic()
        served = _copy_with_rtc(checkpoint, True, tmp / 'rtc_on') if rtc else checkpoint
        _deploy(args, served, name, tmp, env)
        if rtc:   # the unguided reference: the same weights, RTC off
            _deploy(args, _copy_with_rtc(checkpoint, False, tmp / 'rtc_off'), f'{name}_plain', tmp, env)
            names.append(f'{name}_plain')
        deploy_s = time.monotonic() - t0
        serve, endpoint = _serve(args, names, env, tmp / 'serve.log')
        try:
            t1 = time.monotonic()
            got = _stream(args, endpoint, name, rtc)
            ready_s = time.monotonic() - t1
            plain = _stream(args, endpoint, f'{name}_plain', True) if rtc else None
        finally:
            serve.terminate()
            try:
                serve.wait(30)
            except subprocess.TimeoutExpired:
                serve.kill()
    line = {'ok': True, 'template': args.template, 'checkpoint': str(checkpoint), 'policy_type': kind,
            'device': args.device, 'deploy_s': round(deploy_s, 2), 'first_stream_s': round(ready_s, 2),
            'chunk_shape': got['shape'], 'chunks': len(got['rtts']) + 1,
            'latency_p50_ms': round(1e3 * statistics.median(got['rtts']), 2),
            'latency_p95_ms': round(1e3 * float(np.percentile(got['rtts'], 95)), 2), 'rtc': rtc}
    if rtc:
        worst, unguided = max(got['gaps']), float(np.mean(plain['gaps']))
        line.update(delay=args.delay, seam_gap_rtc=worst, seam_gap_unguided=unguided,
                    seam_ratio=worst / max(unguided, 1e-12))
        if not worst <= args.seam_fraction * unguided:
            raise Failed('rtc', f'seam gap with RTC {worst:.4g} > {args.seam_fraction:g} x the unguided '
                                f'{unguided:.4g}: chunk[:d] does not follow the tail[:d] ({json.dumps(line)})')
    return line


def _at_least(low: int):
    """An argparse type: an integer >= ``low`` (a check that needs it would fail after a whole deploy)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = low - 1
        if value < low:
            raise argparse.ArgumentTypeError(f'expected an integer >= {low}, got {text!r}')
        return value
    return parse


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--checkpoint', type=Path, action='append', required=True, help='repeat for several')
    parser.add_argument('--template', default='lerobot', choices=['lerobot', 'pi05-droid'])
    parser.add_argument('--device', default='cuda')
    parser.add_argument('--hub-cache', default='', help='local Hugging Face hub cache with the backbone files')
    parser.add_argument('--hub-snapshot', action='append', default=[], metavar='REPO=DIR')
    parser.add_argument('--rtc', action='store_true', help='enable RTC on flow-matching checkpoints that lack it')
    parser.add_argument('--chunks', type=_at_least(2), default=20,
                        help='requests per episode, >= 2 (latency skips the first; a seam needs a second)')
    parser.add_argument('--delay', type=_at_least(1), default=5,
                        help='expected delay (actions) sent with each tail, >= 1 (the seam gap compares tail[:d])')
    parser.add_argument('--seam-fraction', type=float, default=0.05)
    parser.add_argument('--timeout', type=float, default=180.0, help='seq deploy --timeout and --load-timeout (s)')
    parser.add_argument('--instruction', default='pick up the object')
    args = parser.parse_args()
    failed = 0
    for index, checkpoint in enumerate(args.checkpoint):
        checkpoint = checkpoint.expanduser().resolve()
        try:
            line = check(args, checkpoint, index)
        except Failed as exc:
            line = {'ok': False, 'checkpoint': str(checkpoint), 'step': exc.step, 'error': exc.error}
        except Exception as exc:   # every failure is a line, never a bare traceback
            line = {'ok': False, 'checkpoint': str(checkpoint), 'step': 'check',
                    'error': ''.join(traceback.format_exception_only(type(exc), exc)).strip()[-2000:]}
        failed += not line['ok']
        print(json.dumps(line), flush=True)
    return 1 if failed else 0


if __name__ == '__main__':
    raise SystemExit(main())
