"""The chunk served over gRPC against LeRobot's own in-process inference, and the policy's action error.

Run by ``make check-lerobot`` with the LeRobot venv's python, beside a running ``seq serve``::

    served_vs_inprocess.py --endpoint 127.0.0.1:PORT --deployment NAME --checkpoint DIR --dataset V21 \
        --episode 5 [--noise-seed S] --out result.json

1. Correctness: for a few frames of the held-out episode (raw images decoded from the dataset's video, sent
   losslessly as PNG), one
   episode stream sends each frame (and, for diffusion, its n_obs_steps - 1 predecessors as history); the
   same frames go through LeRobot 0.6's own path in this process: ``prepare_observation_for_inference`` (one
   frame) or the training layout (1, N, ...) (several), the saved preprocessor, ``predict_action_chunk``
   (diffusion: the same noise, ``torch.Generator().manual_seed(S + k)`` for the k-th chunk of the episode,
   as the template documents), the postprocessor. Max abs difference, in-process inference p50 and
   round-trip p50 are reported, and the transport overhead per chunk: the median over requests of the round
   trip minus the worker's own inference time for that request (``ActionChunk.timings.inference_ms``), which
   two processes' timings sharing two loaded cores would blur.
1b. Batched: ``--robots`` episode streams at once, ``--rounds`` requests each sent together, so the worker
   serves them in shared ``infer_batch`` calls (the lerobot template's batching); every chunk is compared
   with that episode's own single-episode in-process chunk (its frames, its noise ``S + k``). The sizes of
   the calls are read from the replies' inference times (one batch, one time).
2. Action error: MAE over the action horizon (H = the served chunk length) on the held-out episode, for the
   policy (in-process, every ``--stride``-th window) and, on exactly the same windows, ridge trained on the
   training episodes with ``seq train``'s code and its three baselines (models/ridge_training.py).
"""

from __future__ import annotations

import argparse
import json
import queue
import statistics
import threading
import time
from pathlib import Path

import grpc
import numpy as np

from sequence_ai_ros.datasets.lerobot_reader import LeRobotDataset
from sequence_ai_ros.models import ridge_training as training
from sequence_ai_ros.protocol import PROTOCOL_VERSION, codec, messages
from sequence_ai_ros.protocol import sequence_ai_pb2 as pb
from sequence_ai_ros.protocol import sequence_ai_pb2_grpc as pb_grpc
from sequence_ai_ros.protocol.contract import Contract
from sequence_ai_ros.protocol.types import Observation


class Stream:
    """One episode stream on the served deployment: handshake, wait ready, start, then one request at a time."""

    def __init__(self, endpoint: str, deployment: str, instruction: str) -> None:
        self.channel = grpc.insecure_channel(endpoint, options=[('grpc.max_receive_message_length', 64 << 20),
                                                                ('grpc.max_send_message_length', 64 << 20)])
        stub = pb_grpc.PolicyServiceStub(self.channel)
        reply = stub.Handshake(pb.HandshakeRequest(deployment=deployment, protocol_version=PROTOCOL_VERSION),
                               timeout=30)
        self.contract = Contract.from_proto(reply.contract)
        deadline = time.monotonic() + 300
        while not stub.Ready(pb.ReadyRequest(deployment=deployment), timeout=30).ready:
            if time.monotonic() > deadline:
                raise RuntimeError('the deployment did not warm within 300 s')
            time.sleep(0.1)
        self.episode_id = f'check-{time.monotonic_ns()}'
        self._out: queue.Queue = queue.Queue()
        self._in: queue.Queue = queue.Queue()
        self.call = stub.Episode(iter(self._out.get, None), metadata=[('x-episode-id', self.episode_id),
                                                                      ('x-deployment', deployment)])
        threading.Thread(target=self._read, daemon=True).start()
        self._out.put(pb.EpisodeRequest(start=pb.EpisodeStart(episode_id=self.episode_id, instruction=instruction)))
        assert self._in.get(timeout=60).WhichOneof('kind') == 'started'
        self.rid = 0

    def _read(self) -> None:
        try:
            for reply in self.call:
                self._in.put(reply)
        except grpc.RpcError as exc:
            self._in.put(exc)

    def request(self, frames: list[Observation], chunk_tail: np.ndarray | None = None,
                delay: int = 0) -> tuple[np.ndarray, float, float]:
        """Send the last frame with the earlier ones as history.

        :returns: (chunk float32 (T, D), round trip s, the worker's own inference time for it s).

        :param chunk_tail: float32 (K, D) unexecuted rows of the previous chunk (RTC), or None.
        :param delay: actions expected to run before the new chunk starts.
        """
        t0 = self.send(frames, chunk_tail, delay)
        return self.receive(t0)

    def send(self, frames: list[Observation], chunk_tail: np.ndarray | None = None, delay: int = 0) -> float:
        """Send one request (see :meth:`request`) without waiting; return its send time (perf_counter s)."""
        self.rid += 1
        req = messages.pack_observation(frames[-1], self.contract, episode_id=self.episode_id, request_id=self.rid,
                                        history=frames[:-1], chunk_tail=chunk_tail, expected_delay_actions=delay)
        t0 = time.perf_counter()
        self._out.put(pb.EpisodeRequest(observation=req))
        return t0

    def receive(self, t0: float) -> tuple[np.ndarray, float, float]:
        """Wait for the chunk of the request sent at ``t0``: (chunk (T, D), round trip s, worker inference s)."""
        reply = self._in.get(timeout=300)
        rtt = time.perf_counter() - t0
        if isinstance(reply, Exception) or reply.WhichOneof('kind') != 'chunk':
            raise RuntimeError(f'no chunk: {reply}')
        if reply.chunk.request_id != self.rid:
            raise RuntimeError(f'chunk for request {reply.chunk.request_id}, expected {self.rid}')
        return messages.unpack_chunk(reply.chunk).actions, rtt, reply.chunk.timings.inference_ms / 1e3

    def close(self) -> None:
        self._out.put(None)
        self.channel.close()


class InProcess:
    """LeRobot 0.6's own inference on a checkpoint directory (no sequence_ai_ros code on this path)."""

    def __init__(self, checkpoint: Path, robot_type: str) -> None:
        import torch
        from lerobot.configs.policies import PreTrainedConfig
        from lerobot.policies.factory import get_policy_class, make_pre_post_processors

        cfg = PreTrainedConfig.from_pretrained(str(checkpoint), local_files_only=True)
        cfg.pretrained_backbone_weights = None
        cfg.device = 'cpu'
        self.policy = get_policy_class(cfg.type).from_pretrained(str(checkpoint), config=cfg, local_files_only=True)
        self.policy.eval()
        self.pre, self.post = make_pre_post_processors(self.policy.config, pretrained_path=str(checkpoint),
                                                       preprocessor_overrides={'device_processor': {'device': 'cpu'}})
        self.torch, self.robot_type, self.cfg = torch, robot_type, cfg
        self.n_obs = int(getattr(cfg, 'n_obs_steps', 1) or 1) if cfg.type == 'diffusion' else 1

    def noise(self, seed: int):
        gen = self.torch.Generator().manual_seed(int(seed))
        return self.torch.randn((1, self.cfg.horizon, self.cfg.action_feature.shape[0]), generator=gen)

    def chunk(self, states: list[np.ndarray], images: list[dict[str, np.ndarray]], task: str,
              noise_seed: int | None) -> np.ndarray:
        """Return float32 (T, D) for the frames (oldest first)."""
        torch = self.torch
        from lerobot.policies.utils import prepare_observation_for_inference

        if len(states) == 1:
            obs = {'observation.state': np.asarray(states[0], np.float32)}
            obs.update({f'observation.images.{k}': v for k, v in images[0].items()})
            batch = prepare_observation_for_inference(obs, torch.device('cpu'), task, self.robot_type)
        else:   # LeRobot's training layout for n_obs_steps frames: (1, N, D) and (1, N, 3, H, W) in [0, 1]
            batch = {'observation.state': torch.from_numpy(np.stack(states).astype(np.float32))[None]}
            for key in images[0]:
                stack = np.stack([im[key] for im in images])
                batch[f'observation.images.{key}'] = (torch.from_numpy(stack).permute(0, 3, 1, 2).float() / 255)[None]
            batch['task'], batch['robot_type'] = task, self.robot_type
        kwargs = {'noise': self.noise(noise_seed)} if noise_seed is not None else {}
        with torch.inference_mode():
            out = self.post(self.policy.predict_action_chunk(self.pre(batch), **kwargs))
        return out[0].float().numpy()


def batched_episodes(args: argparse.Namespace, *, stream_args: tuple[str, str, str], local: InProcess,
                     frames_at, length: int, steps: int, fps: float) -> dict:
    """``--robots`` concurrent episode streams, ``--rounds`` requests each, sent all at once per round.

    Robot r's k-th request is the frame at its own position (the robots start spread over the episode). The
    worker's reply carries its inference time, which is the batch's: requests answered with one
    ``inference_ms`` in a round went through one ``infer_batch`` call.

    :returns: ``batched_max_abs_diff`` (served vs that episode's single in-process chunk, every request),
        ``batched_requests`` and ``batched_calls`` (the sizes of the calls seen: how many requests shared
        each inference time).
    """
    robots = [Stream(*stream_args) for _ in range(args.robots)]
    names = robots[0].contract.observation.state_names
    n = local.n_obs
    spread = np.linspace(n - 1, length - steps - 1, args.robots * args.rounds).astype(int)
    diffs: list[float] = []
    calls: list[int] = []
    try:
        for k in range(args.rounds):
            sent = []
            for r, robot in enumerate(robots):
                t = int(spread[r * args.rounds + k])
                states, images = frames_at(t)
                png = [{key: codec.encode_image(key, v, 'png').data for key, v in im.items()} for im in images]
                obs = [Observation(state=st, images=im, state_names=names, instruction=stream_args[2],
                                   timestamp=float(i) / fps)
                       for i, (st, im) in enumerate(zip(states, png, strict=True))]
                sent.append((robot.send(obs), states, images))
            got = [robot.receive(t0) for robot, (t0, _, _) in zip(robots, sent, strict=True)]
            for (served, _, _), (_, states, images) in zip(got, sent, strict=True):
                seed = None if args.noise_seed is None else args.noise_seed + k   # episode-local chunk k
                mine = local.chunk(states, images, stream_args[2], seed)[:steps]
                diffs.append(float(np.abs(served - mine).max()))
            sizes: dict[float, int] = {}
            for _, _, worker_s in got:
                sizes[worker_s] = sizes.get(worker_s, 0) + 1
            calls += sorted(sizes.values(), reverse=True)
    finally:
        for robot in robots:
            robot.close()
    return {'batched_robots': args.robots, 'batched_requests': len(diffs), 'batched_calls': calls,
            'batched_max_abs_diff': max(diffs)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--endpoint', required=True)
    parser.add_argument('--deployment', required=True)
    parser.add_argument('--checkpoint', type=Path, required=True)
    parser.add_argument('--dataset', type=Path, required=True)
    parser.add_argument('--episode', type=int, default=5)
    parser.add_argument('--train-episodes', default='0-4')
    parser.add_argument('--noise-seed', type=int, default=None)
    parser.add_argument('--robot-type', default='')
    parser.add_argument('--requests', type=int, default=16)
    parser.add_argument('--stride', type=int, default=6)
    parser.add_argument('--robots', type=int, default=3, help='concurrent episodes served batched')
    parser.add_argument('--rounds', type=int, default=3, help='requests per concurrent episode')
    parser.add_argument('--out', type=Path, required=True)
    args = parser.parse_args()

    ds = LeRobotDataset(args.dataset)
    ep = ds.episode(args.episode)
    task = ds.task(args.episode)
    cams = {key.removeprefix('observation.images.'): list(ds.frames(args.episode, key)) for key in ds.camera_keys}
    local = InProcess(args.checkpoint, args.robot_type)
    n = local.n_obs

    def frames_at(t: int) -> tuple[list[np.ndarray], list[dict[str, np.ndarray]]]:
        idx = range(t - n + 1, t + 1)
        return [ep.state[i] for i in idx], [{k: v[i] for k, v in cams.items()} for i in idx]

    # 1. served == in-process, same frames, same noise
    stream = Stream(args.endpoint, args.deployment, task)
    steps = stream.contract.chunk_length
    diffs, rtts, inproc, overhead = [], [], [], []
    starts = np.linspace(n - 1, len(ep) - steps - 1, args.requests).astype(int)
    for k, t in enumerate(starts):
        states, images = frames_at(int(t))
        # PNG bytes pass through the client untouched and decode to exactly these pixels (the contract's
        # default JPEG would not): the worker sees the raw frames LeRobot sees here
        png = [{k: codec.encode_image(k, v, 'png').data for k, v in im.items()} for im in images]
        obs = [Observation(state=s, images=im, state_names=stream.contract.observation.state_names,
                           instruction=task, timestamp=float(i) / ds.fps)
               for i, (s, im) in enumerate(zip(states, png, strict=True))]
        served, rtt, worker_s = stream.request(obs)
        overhead.append(rtt - worker_s)
        seed = None if args.noise_seed is None else args.noise_seed + k
        t0 = time.perf_counter()
        mine = local.chunk(states, images, task, seed)[:steps]
        inproc.append(time.perf_counter() - t0)
        rtts.append(rtt)
        diffs.append(float(np.abs(served - mine).max()))
    stream.close()

    # 1b. several robots at once: the worker batches their requests (one predict_action_chunk for several
    # episodes); each episode's chunk k must equal its own single-episode in-process chunk k (its own frames,
    # its own noise S + k), so no row is mixed up with another episode's and no per-episode state is shared
    batched = batched_episodes(args, stream_args=(args.endpoint, args.deployment, task), local=local,
                               frames_at=frames_at, length=len(ep), steps=steps, fps=ds.fps)

    # 2. MAE over the action horizon on the same windows for the policy, ridge and the baselines
    train_eps = training.parse_episodes(args.train_episodes)
    fit = training.train(args.dataset, train_eps, [args.episode], horizon=steps)
    prepared = training._prepare(ds, args.episode, steps)
    windows = np.arange(n - 1, len(prepared.state), args.stride)
    sub = training._EpisodeWindows(x=prepared.x[windows], targets=prepared.targets[windows],
                                   base=prepared.base[windows],
                                   state=prepared.state[windows], actions=prepared.actions)
    preds = []
    for j, t in enumerate(windows):
        states, images = frames_at(int(t))
        seed = None if args.noise_seed is None else 10_000 + j
        preds.append(local.chunk(states, images, task, seed)[:steps])
    mae = {'policy': float(np.abs(np.stack(preds) - sub.targets).mean()),
           'ridge': training.model_error(fit.model, [sub]),
           **training.baseline_errors([training._prepare(ds, k, steps) for k in train_eps], [sub])}
    result = {
        'policy_type': local.cfg.type, 'chunk_length': steps, 'history': n, 'requests': len(diffs),
        'max_abs_diff': max(diffs), 'inference_p50_ms': 1e3 * statistics.median(inproc),
        'roundtrip_p50_ms': 1e3 * statistics.median(rtts),
        'worker_inference_p50_ms': 1e3 * statistics.median(r - o for r, o in zip(rtts, overhead, strict=True)),
        'transport_overhead_ms': 1e3 * statistics.median(overhead),
        **batched,
        'mae_windows': len(windows), 'mae_stride': args.stride, 'mae': mae,
    }
    args.out.write_text(json.dumps(result, indent=2) + '\n')
    print(json.dumps(result))
    return 0


if __name__ == '__main__':
    raise SystemExit(main())
