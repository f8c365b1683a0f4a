"""The templates (hold, replay, ridge, lerobot, pi05-droid) served by the real worker on loopback gRPC.

The robot side is the generated stub with the protocol's own packing (pack_observation/unpack_chunk).
lerobot and pi05-droid need torch and lerobot>=0.4, which this venv must not have: they must fail with
MissingDependency naming exactly what is missing.
"""

from __future__ import annotations

import contextlib
import io
import json
import queue
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from sequence_ai_ros import cli
from sequence_ai_ros.datasets.lerobot_reader import LeRobotDataset
from sequence_ai_ros.exceptions import MissingDependency
from sequence_ai_ros.models import ridge
from sequence_ai_ros.models import ridge_training as training
from sequence_ai_ros.models.ridge import RidgeModel
from sequence_ai_ros.policy import load_policy_file
from sequence_ai_ros.protocol import PROTOCOL_VERSION, messages
from sequence_ai_ros.protocol import sequence_ai_pb2 as pb
from sequence_ai_ros.protocol import sequence_ai_pb2_grpc as pb_grpc
from sequence_ai_ros.protocol.contract import Contract
from sequence_ai_ros.protocol.types import Observation
from sequence_ai_ros.templates import TEMPLATES_DIR
from sequence_ai_ros.worker import serve_policy_file

TEMPLATES = TEMPLATES_DIR
ALL = ('hold', 'replay', 'ridge', 'lerobot', 'pi05-droid')


class Robot:
    """One robot on one episode stream: handshake, start, then request chunks one at a time."""

    def __init__(self, port: int, deployment: str, episode_id: str = 'ep-1') -> None:
        self.channel = grpc.insecure_channel(f'127.0.0.1:{port}')
        stub = pb_grpc.PolicyServiceStub(self.channel)
        reply = stub.Handshake(pb.HandshakeRequest(deployment=deployment, protocol_version=PROTOCOL_VERSION),
                               timeout=10)
        self.contract = Contract.from_proto(reply.contract)
        deadline = time.monotonic() + 15
        while not stub.Ready(pb.ReadyRequest(deployment=deployment), timeout=5).ready:
            assert time.monotonic() < deadline, 'policy did not warm within 15 s'
            time.sleep(0.02)
        self.episode_id = episode_id
        self._out: queue.Queue = queue.Queue()
        self._in: queue.Queue = queue.Queue()
        self.call = stub.Episode(self._requests(), metadata=[('x-episode-id', episode_id),
                                                             ('x-deployment', deployment)])
        self._reader = threading.Thread(target=self._read, name=f'test-robot-{episode_id}', daemon=True)
        self._reader.start()
        self._out.put(pb.EpisodeRequest(start=pb.EpisodeStart(episode_id=episode_id, instruction='bring-up')))
        assert self._recv().WhichOneof('kind') == 'started'
        self.request_id = 0

    def _requests(self) -> Iterator[pb.EpisodeRequest]:
        while (item := self._out.get()) is not None:
            yield item

    def _read(self) -> None:
        try:
            for reply in self.call:
                self._in.put(reply)
        except grpc.RpcError:
            pass

    def _recv(self) -> pb.EpisodeReply:
        return self._in.get(timeout=10)

    def request(self, obs: Observation, history: tuple[Observation, ...] = (),
                last_action: np.ndarray | None = None) -> pb.EpisodeReply:
        """Send one observation; return the reply (a chunk or an in-stream error)."""
        self.request_id += 1
        req = messages.pack_observation(obs, self.contract, episode_id=self.episode_id, request_id=self.request_id,
                                        history=history, last_action=last_action)
        self._out.put(pb.EpisodeRequest(observation=req))
        return self._recv()

    def close(self) -> None:
        self._out.put(pb.EpisodeRequest(end=pb.EpisodeEnd(reason='completed')))
        self._out.put(None)
        self._reader.join(timeout=5)
        self.channel.close()


@contextlib.contextmanager
def served(path: Path, **kwargs) -> Iterator[Robot]:
    server = serve_policy_file(path, deployment='tpl', host='127.0.0.1', port=0, warm=True, **kwargs)
    robot = None
    try:
        robot = Robot(server.port, 'tpl')
        yield robot
    finally:
        if robot is not None:
            robot.close()
        server.stop(grace=1.0)


def _chunk(reply: pb.EpisodeReply) -> messages.Chunk:
    assert reply.WhichOneof('kind') == 'chunk', reply
    return messages.unpack_chunk(reply.chunk)


def test_every_template_has_its_files() -> None:
    for name in ALL:
        assert {'policy.py', 'config.yaml', 'README.md'} <= {p.name for p in (TEMPLATES / name).iterdir()}, name
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert cli.main(['init', '--list']) == 0
    for name in ALL:
        assert name in buf.getvalue()


def test_hold_returns_the_measured_state_for_any_dimension() -> None:
    names = ['waist', 'shoulder', 'elbow', 'wrist_angle', 'wrist_rotate', 'gripper', 'left_finger']
    with served(TEMPLATES / 'hold' / 'policy.py', joint_names=names, chunk_length=10) as robot:
        assert robot.contract.action_names == tuple(names) and robot.contract.observation.state_names == tuple(names)
        state = np.linspace(-0.5, 0.7, 7, dtype=np.float32)
        chunk = _chunk(robot.request(Observation(state=state, state_names=names)))
        assert chunk.actions.shape == (10, 7)
        np.testing.assert_array_equal(chunk.actions, np.tile(state, (10, 1)))


def test_replay_follows_the_robot_clock(g1_dataset: Path) -> None:
    ep = LeRobotDataset(g1_dataset).episode(5)
    with served(TEMPLATES / 'replay' / 'policy.py', dataset=str(g1_dataset), episode=5) as robot:
        c = robot.contract
        assert c.dt == pytest.approx(1 / 30) and c.chunk_length == 30 and c.action_names[0] == 'kLeftShoulderPitch'
        far = ep.state[0].copy()
        far[10] += 0.5
        reply = robot.request(Observation(state=far, timestamp=100.0))
        assert reply.WhichOneof('kind') == 'error' and reply.error.code == pb.POLICY_EXCEPTION
        assert 'kRightElbow' in reply.error.message and 'start pose' in reply.error.message
        # the stream keeps serving; from the start pose the recording plays on the robot's clock
        first = _chunk(robot.request(Observation(state=ep.state[0], timestamp=200.0)))
        np.testing.assert_array_equal(first.actions, ep.action[0:30])
        later = _chunk(robot.request(Observation(state=ep.state[40], timestamp=200.0 + 40 / 30)))
        np.testing.assert_array_equal(later.actions, ep.action[40:70])
        assert not later.done
        end = _chunk(robot.request(Observation(state=ep.state[-1], timestamp=200.0 + 430 / 30)))
        np.testing.assert_array_equal(end.actions[:15], ep.action[430:445])
        np.testing.assert_array_equal(end.actions[15:], np.tile(ep.action[-1], (15, 1)))
        assert end.done


def test_ridge_serves_the_trained_model(g1_dataset: Path, tmp_path: Path) -> None:
    ds = LeRobotDataset(g1_dataset)
    # the configuration seq train chooses, fitted on the training episodes (the search is test_ridge's)
    channels = ('tracking_error', 'state_velocity', 'state')
    xs, ys, bases = [], [], []
    for k in range(5):
        train = ds.episode(k)
        n = len(train) - 30 + 1
        xs.append(ridge.episode_channels(channels, train.state, train.action, 1 / 30)[:n])
        ys.append(ridge.action_windows(train.action, 30))
        bases.append(ridge.last_actions(train.state, train.action)[:n])
    fitted = RidgeModel.fit(np.concatenate(xs), np.concatenate(ys), np.concatenate(bases),
                            channel_names=channels, coupled=False, residual=True, dt=1 / 30, lam=1000.0,
                            state_names=ds.state_names, action_names=ds.action_names)
    out = training.write_deployment(tmp_path / 'g1-ridge', training.TrainResult(fitted, [], {}, 0.0))
    model = RidgeModel.load(out / 'model.npz')
    ep = ds.episode(5)
    with served(out / 'policy.py') as robot:
        c = robot.contract
        assert c.observation.history == model.history
        assert c.action_names == model.action_names and c.chunk_length == model.horizon
        assert c.observation.cameras == ()
        t = 120
        prev = Observation(state=ep.state[t - 1], timestamp=50.0 - model.dt)
        now = Observation(state=ep.state[t], timestamp=50.0)
        chunk = _chunk(robot.request(now, history=(prev,), last_action=ep.action[t - 1]))
        expected = model.predict(ep.state[t], ep.action[t - 1], ep.state[t - 1], 0.0)
        assert chunk.actions.shape == (model.horizon, 26)
        np.testing.assert_allclose(chunk.actions, expected, atol=1e-6)
        # a chunk of the model beats holding the measured state against the recording
        err = np.abs(chunk.actions - ep.action[t:t + model.horizon]).mean()
        hold = np.abs(ep.state[t] - ep.action[t:t + model.horizon]).mean()
        assert err < hold


def test_ridge_template_without_a_model_says_to_train(seq_home: Path) -> None:
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert cli.main(['deploy', str(TEMPLATES / 'ridge' / 'policy.py'), '--name', 'untrained']) != 0
    assert 'seq train ridge' in err.getvalue()


@pytest.mark.parametrize('template', ['lerobot', 'pi05-droid'])
def test_heavy_templates_name_what_is_missing(template: str, tmp_path: Path, seq_home: Path) -> None:
    path = TEMPLATES / template / 'policy.py'
    ckpt = tmp_path / 'pretrained_model'
    with pytest.raises(MissingDependency) as info:
        load_policy_file(path, checkpoint=str(ckpt))
    msg = str(info.value)
    assert 'python package torch' in msg and 'lerobot>=0.4' in msg and f'checkpoint directory {ckpt}' in msg
    ckpt.mkdir()
    (ckpt / 'config.json').write_text(json.dumps({'type': 'pi05'}))
    with pytest.raises(MissingDependency, match=r'checkpoint file .*model\.safetensors'):
        load_policy_file(path, checkpoint=str(ckpt))
    # seq deploy of the shipped template (no checkpoint set) fails with one message listing everything
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert cli.main(['deploy', str(path), '--name', template]) != 0
    assert f'the {template} template cannot load: missing python package torch' in err.getvalue()
    assert 'lerobot>=0.4' in err.getvalue() and 'set `checkpoint:` in config.yaml' in err.getvalue()


def test_lerobot_contract_from_a_checkpoint_config() -> None:
    """The contract the lerobot template derives from an ACT-style config.json (pure JSON, no torch)."""
    from sequence_ai_ros.models import lerobot_runtime as runtime

    cfg = {'type': 'act', 'n_action_steps': 50, 'chunk_size': 100,
           'input_features': {'observation.state': {'type': 'STATE', 'shape': [26]},
                              'observation.images.cam_high': {'type': 'VISUAL', 'shape': [3, 480, 640]}},
           'output_features': {'action': {'type': 'ACTION', 'shape': [26]}}}
    base = load_policy_file(TEMPLATES / 'hold' / 'policy.py').contract
    c = runtime.contract_for(base, cfg, action_space='joint_absolute', fps=30, state_names=None,
                             action_names=None, chunk_length=None)
    assert c.chunk_length == 50 and c.action_dim == 26 and c.observation.state_names[0] == 'state_0'
    assert [(cam.key, cam.width, cam.height) for cam in c.observation.cameras] == [('cam_high', 640, 480)]
    with pytest.raises(Exception, match='observation.state has 26 dimensions; config.yaml names 1'):
        runtime.contract_for(base, cfg, action_space='joint_absolute', fps=30, state_names=['a'],
                             action_names=None, chunk_length=None)


LEGACY = Path(__file__).resolve().parent / 'fixtures' / 'legacy_templates'
SHIMS = {'sequence_ai_ros.worker': ('ridge', 'lerobot_runtime'), 'sequence_ai_ros.data': ('lerobot_reader',)}


@pytest.fixture
def fresh_shims(monkeypatch: pytest.MonkeyPatch) -> None:
    """Forget the deprecated paths, so that importing one runs the shim (and warns) again in this test."""
    import importlib
    import sys

    for package, names in SHIMS.items():
        module = importlib.import_module(package)
        for name in names:
            monkeypatch.delitem(sys.modules, f'{package}.{name}', raising=False)
            monkeypatch.delattr(module, name, raising=False)


def _deploy_and_serve_one_chunk(path: Path, obs: Observation, **serve_kwargs) -> messages.Chunk:
    """``seq deploy`` ``path`` (dry run included), then serve it and return one chunk."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(['deploy', str(path), '--name', path.parent.name]) == 0, out.getvalue()
    assert f'deployed {path.parent.name} version 1' in out.getvalue()
    with served(path, **serve_kwargs) as robot:
        return _chunk(robot.request(obs))


def test_policy_files_of_the_previous_layout_still_deploy_and_serve(g1_dataset: Path, tmp_path: Path,
                                                                     seq_home: Path, fresh_shims: None) -> None:
    """Policy files of the previous layout (worker.ridge, data.lerobot_reader) deploy and serve.

    Those module paths re-export the moved modules with a FutureWarning.
    """
    ds = LeRobotDataset(g1_dataset)
    ep = ds.episode(5)
    # hold: the authoring API only
    hold = tmp_path / 'hold'
    hold.mkdir()
    (hold / 'policy.py').write_text((LEGACY / 'hold' / 'policy.py').read_text())
    chunk = _deploy_and_serve_one_chunk(hold / 'policy.py', Observation(state=np.zeros(3, np.float32)),
                                        joint_names=['a', 'b', 'c'])
    assert chunk.actions.shape[1] == 3
    # replay: sequence_ai_ros.data.lerobot_reader
    replay = tmp_path / 'replay'
    replay.mkdir()
    (replay / 'policy.py').write_text((LEGACY / 'replay' / 'policy.py').read_text())
    (replay / 'config.yaml').write_text(f'dataset: {g1_dataset}\nepisode: 5\nchunk_length: 30\nmax_start_error: 0\n')
    with pytest.warns(FutureWarning, match='sequence_ai_ros.datasets.lerobot_reader'):
        load_policy_file(replay / 'policy.py')
    chunk = _deploy_and_serve_one_chunk(replay / 'policy.py', Observation(state=ep.state[0], timestamp=1.0))
    np.testing.assert_array_equal(chunk.actions, ep.action[0:30])
    # ridge: sequence_ai_ros.worker.ridge, next to a model trained by seq train
    xs = ridge.episode_channels(('state',), ds.episode(0).state, ds.episode(0).action, 1 / 30)
    n = len(ds.episode(0)) - 30 + 1
    fitted = RidgeModel.fit(xs[:n], ridge.action_windows(ds.episode(0).action, 30),
                            ridge.last_actions(ds.episode(0).state, ds.episode(0).action)[:n],
                            channel_names=('state',), coupled=False, residual=True, dt=1 / 30, lam=1000.0,
                            state_names=ds.state_names, action_names=ds.action_names)
    out = training.write_deployment(tmp_path / 'ridge', training.TrainResult(fitted, [], {}, 0.0))
    obs = Observation(state=ep.state[10], timestamp=1.0)
    with served(out / 'policy.py') as robot:
        expected = _chunk(robot.request(obs)).actions
    (out / 'policy.py').write_text((LEGACY / 'ridge' / 'policy.py').read_text())
    with pytest.warns(FutureWarning, match='sequence_ai_ros.models.ridge'):
        load_policy_file(out / 'policy.py')
    chunk = _deploy_and_serve_one_chunk(out / 'policy.py', obs)
    assert chunk.actions.shape == (30, 26) and np.isfinite(chunk.actions).all()
    np.testing.assert_array_equal(chunk.actions, expected)


@pytest.mark.parametrize('template', ['lerobot', 'pi05-droid'])
def test_heavy_policy_files_of_the_previous_layout_import_and_name_what_is_missing(template: str, tmp_path: Path,
                                                                                   fresh_shims: None) -> None:
    """Without torch they cannot serve here; they import through the shim and fail as the new ones do."""
    path = tmp_path / template / 'policy.py'
    path.parent.mkdir()
    path.write_text((LEGACY / template / 'policy.py').read_text())
    with pytest.warns(FutureWarning, match='sequence_ai_ros.models.lerobot_runtime'), \
            pytest.raises(MissingDependency, match='python package torch'):
        load_policy_file(path, checkpoint=str(tmp_path / 'ckpt'))
