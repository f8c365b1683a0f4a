"""On a GPU machine with the weights: load a checkpoint through the product, serve it, time chunks, exercise RTC.

Run in the worker's venv (``pip install -r requirements-lerobot.txt`` plus the policy's extra, e.g.
``lerobot[smolvla]`` or ``lerobot[pi]``, then ``pip install .``), fully offline::

    HF_HUB_OFFLINE=1 python test/gpu/check_policy.py --checkpoint /models/pi05_base --hub-cache ~/hf-hub \
        [--template lerobot|pi05-droid] [--device cuda] [--chunks 20] [--instruction "pick up the cup"]

Steps, each through the public commands: ``seq init TEMPLATE`` -> config.yaml -> ``seq deploy`` (its dry run
loads the weights) -> ``seq serve --port 0 --warm``; then one episode stream with synthetic frames at the
contract's camera sizes: the first chunk (shape, finite), round-trip p50/p95 over ``--chunks`` chunks, and,
when the checkpoint enables RTC (``rtc_config.enabled``), every later request carries the unexecuted tail of
the previous chunk and an expected delay, so the worker feeds the previous chunk's raw model-space rows to
``predict_action_chunk(..., inference_delay=d, prev_chunk_left_over=..., execution_horizon=h)``. It prints one
JSON line and exits non-zero on any failure. It checks plumbing and latency, not task success.
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
from pathlib import Path

import numpy as np
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / 'lerobot'))
from served_vs_inprocess import Stream  # noqa: E402

from sequence_ai_ros.protocol.types import Observation  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--checkpoint', type=Path, required=True)
    parser.add_argument('--template', default='lerobot', choices=['lerobot', 'pi05-droid'])
    parser.add_argument('--device', default='cuda')
    parser.add_argument('--hub-cache', default='', help='local Hugging Face hub cache with the backbone files')
    parser.add_argument('--hub-snapshot', action='append', default=[], metavar='REPO=DIR')
    parser.add_argument('--chunks', type=int, default=20)
    parser.add_argument('--instruction', default='pick up the object')
    args = parser.parse_args()
    env = dict(os.environ, HF_HUB_OFFLINE='1', HF_DATASETS_OFFLINE='1', TRANSFORMERS_OFFLINE='1')
    with tempfile.TemporaryDirectory(prefix='seq-gpu-') as tmp:
        env['SEQ_HOME'] = str(Path(tmp) / 'home')
        pdir = Path(tmp) / 'policy'
        subprocess.run(['seq', 'init', args.template, str(pdir)], env=env, check=True, capture_output=True)
        config = yaml.safe_load((pdir / 'config.yaml').read_text())
        config.update(checkpoint=str(args.checkpoint.resolve()), device=args.device)
        if args.template == 'lerobot':
            config.update(hub_cache=args.hub_cache,
                          hub_snapshots=dict(item.split('=', 1) for item in args.hub_snapshot))
        (pdir / 'config.yaml').write_text(yaml.safe_dump(config))
        t0 = time.monotonic()
        deploy = subprocess.run(['seq', 'deploy', str(pdir / 'policy.py'), '--name', 'gpu_check'], env=env,
                                capture_output=True, text=True)
        if deploy.returncode != 0:
            print(json.dumps({'ok': False, 'step': 'deploy', 'error': deploy.stderr.strip()[-2000:]}))
            return 1
        serve = subprocess.Popen(['seq', 'serve', 'gpu_check', '--port', '0', '--warm'], env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            endpoint = None
            for line in serve.stdout:
                m = re.search(r'serving \S+ on (\S+:\d+)', line)
                if m:
                    endpoint = m.group(1)
                    break
            if endpoint is None:
                print(json.dumps({'ok': False, 'step': 'serve', 'error': 'seq serve exited'}))
                return 1
            stream = Stream(endpoint, 'gpu_check', args.instruction)
            load_s = time.monotonic() - t0
            c = stream.contract
            rng = np.random.default_rng(0)
            rtc = json.loads((args.checkpoint / 'config.json').read_text()).get('rtc_config') or {}
            rtts, tail, shapes = [], None, set()
            for k in range(args.chunks):
                obs = Observation(state=np.zeros(c.observation.state_dim, np.float32),
                                  state_names=c.observation.state_names, instruction=args.instruction,
                                  timestamp=k * c.dt,
                                  images={cam.key: rng.integers(0, 255, (cam.height or 224, cam.width or 224, 3),
                                                                np.uint8) for cam in c.observation.cameras})
                chunk, rtt, _ = stream.request([obs], chunk_tail=tail, delay=3 if tail is not None else 0)
                if not np.isfinite(chunk).all() or chunk.shape != (c.chunk_length, c.action_dim):
                    raise RuntimeError(f'chunk {k}: shape {chunk.shape}, finite {np.isfinite(chunk).all()}')
                shapes.add(chunk.shape)
                rtts.append(rtt)
                tail = chunk[c.chunk_length // 2:] if rtc.get('enabled') else None
            stream.close()
        finally:
            serve.terminate()
            serve.wait(30)
    print(json.dumps({'ok': True, 'template': args.template, 'checkpoint': str(args.checkpoint),
                      'policy_type': json.loads((args.checkpoint / 'config.json').read_text()).get('type'),
                      'device': args.device, 'deploy_to_ready_s': load_s, 'chunk_shape': sorted(shapes)[0],
                      'roundtrip_p50_ms': 1e3 * statistics.median(rtts),
                      'roundtrip_p95_ms': 1e3 * float(np.percentile(rtts, 95)),
                      'rtc': bool(rtc.get('enabled')), 'chunks': len(rtts)}))
    return 0


if __name__ == '__main__':
    raise SystemExit(main())
