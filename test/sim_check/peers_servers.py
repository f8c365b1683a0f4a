"""``make bench-peers``' peer servers, each hosting the same LeRobot ACT checkpoint; runs in the LeRobot venv.

- ``openpi``: a minimal websocket policy server with the settings of openpi's ``WebsocketPolicyServer``
  (``websockets.asyncio.server.serve(..., compression=None, max_size=None)``; on connect it sends its metadata,
  then per message: msgpack_numpy-unpack the observation, infer in the event loop, send the packed result).
  Its policy: ``{'state': float32 (43,), 'prompt'}`` (``sim_robot``'s joint_states) -> the checkpoint's
  ``observation.state`` (4) and ``observation.environment_state`` (39) -> LeRobot's preprocessor ->
  ``predict_action_chunk`` -> the postprocessor -> ``{'actions': float32 (20, 4)}``.
- ``lerobot``: LeRobot 0.6.1's own ``PolicyServer`` (lerobot.async_inference) on a gRPC server with its
  settings (4 worker threads), its defaults otherwise (``inference_latency`` 1/30 s, ``obs_queue_timeout``
  2 s) and ``fps`` 80. One adapter: RobotClient sends every float feature of the robot as one
  ``observation.state`` (43 here), which this checkpoint reads as ``observation.state`` (4) and
  ``observation.environment_state`` (39), so the observation is split after LeRobot's own conversion. Its
  similarity filter sees the 43 floats as sent.

``--compute-s S`` pads each inference (the model's call) to S seconds with a sleep: the compute-bound
condition. The server prints ``listening on PORT`` once it accepts connections.

Usage: ``python peers_servers.py {openpi,lerobot} --checkpoint DIR [--compute-s 0.125]``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from sequence_ai_ros.sim.task import COMMAND_NAMES  # noqa: E402

STATE = len(COMMAND_NAMES)          # observation.state: the measured coordinates; the rest is the task's
ROBOT_TYPE = 'metaworld_sawyer'


def padded(call: Any, compute_s: float) -> Any:
    """``call`` made to take at least ``compute_s`` seconds (a sleep after it)."""
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        out = call(*args, **kwargs)
        time.sleep(max(0.0, compute_s - (time.perf_counter() - t0)))
        return out
    return wrapper


def serve_openpi(args: argparse.Namespace) -> None:
    import asyncio
    import traceback

    import torch
    import websockets.asyncio.server
    import websockets.exceptions
    import websockets.frames
    from lerobot.configs.policies import PreTrainedConfig
    from lerobot.policies.factory import get_policy_class, make_pre_post_processors
    from lerobot.policies.utils import prepare_observation_for_inference
    from openpi_client import msgpack_numpy

    ckpt = str(args.checkpoint)
    cfg = PreTrainedConfig.from_pretrained(ckpt, local_files_only=True)
    cfg.device = 'cpu'
    policy = get_policy_class(cfg.type).from_pretrained(ckpt, config=cfg, local_files_only=True)
    policy.eval()
    pre, post = make_pre_post_processors(policy.config, pretrained_path=ckpt,
                                         preprocessor_overrides={'device_processor': {'device': 'cpu'}})

    def chunk(obs: dict) -> dict:
        state = np.asarray(obs['state'], np.float32)
        batch = prepare_observation_for_inference(
            {'observation.state': state[:STATE].copy(), 'observation.environment_state': state[STATE:].copy()},
            torch.device('cpu'), obs.get('prompt', ''), ROBOT_TYPE)
        with torch.inference_mode():
            actions = policy.predict_action_chunk(pre(batch))[0]      # (T, D), normalized
            actions = post(actions)
        return {'actions': np.asarray(actions, np.float32)}

    infer = padded(chunk, args.compute_s) if args.compute_s > 0 else chunk

    async def handler(ws: Any) -> None:
        packer = msgpack_numpy.Packer()
        await ws.send(packer.pack({'checkpoint': ckpt}))
        while True:
            try:
                obs = msgpack_numpy.unpackb(await ws.recv())
                await ws.send(packer.pack(infer(obs)))
            except websockets.exceptions.ConnectionClosed:
                break
            except Exception:
                await ws.send(traceback.format_exc())
                await ws.close(code=websockets.frames.CloseCode.INTERNAL_ERROR, reason='internal server error')
                raise

    async def main() -> None:
        async with websockets.asyncio.server.serve(handler, '127.0.0.1', 0, compression=None,
                                                   max_size=None) as server:
            print(f'listening on {server.sockets[0].getsockname()[1]}', flush=True)
            await server.serve_forever()

    chunk({'state': np.zeros(STATE + 39, np.float32), 'prompt': ''})     # warm, as the product's --warm
    asyncio.run(main())


def serve_lerobot(args: argparse.Namespace) -> None:
    from concurrent import futures

    import grpc
    from lerobot.async_inference import policy_server as ps
    from lerobot.async_inference.configs import PolicyServerConfig
    from lerobot.transport import services_pb2_grpc

    convert = ps.raw_observation_to_observation

    def split_state(raw: Any, features: Any, image_features: Any) -> dict:
        obs = convert(raw, features, image_features)
        state = obs['observation.state']
        obs['observation.state'], obs['observation.environment_state'] = state[:, :STATE], state[:, STATE:]
        return obs

    ps.raw_observation_to_observation = split_state

    class Server(ps.PolicyServer):
        """PolicyServer as it is; its model call padded to --compute-s when given."""

        def _get_action_chunk(self, observation: dict) -> Any:
            if args.compute_s > 0:
                return padded(super()._get_action_chunk, args.compute_s)(observation)
            return super()._get_action_chunk(observation)

    config = PolicyServerConfig(host='127.0.0.1', port=8080, fps=80)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    services_pb2_grpc.add_AsyncInferenceServicer_to_server(Server(config), server)
    port = server.add_insecure_port('127.0.0.1:0')
    server.start()
    print(f'listening on {port}', flush=True)
    server.wait_for_termination()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('kind', choices=('openpi', 'lerobot'))
    parser.add_argument('--checkpoint', type=Path, required=True, help='the pretrained_model directory')
    parser.add_argument('--compute-s', type=float, default=0.0, help='pad each inference to this (s)')
    parser.add_argument('--workdir', type=Path, default=Path.cwd(), help="LeRobot's loggers write logs/ here")
    args = parser.parse_args()
    os.chdir(args.workdir)
    (serve_openpi if args.kind == 'openpi' else serve_lerobot)(args)
    return 0


if __name__ == '__main__':
    raise SystemExit(main())
