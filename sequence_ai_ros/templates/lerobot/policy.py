"""``lerobot``: serve a LeRobot 0.6 policy checkpoint (ACT, diffusion, SmolVLA, pi0, pi0.5) from a local directory.

The checkpoint directory is what LeRobot's training writes as ``pretrained_model/``: config.json,
model.safetensors and the processor files (policy_preprocessor.json, policy_postprocessor.json and
their .safetensors). It is loaded through LeRobot's own path (sequence_ai_ros/models/lerobot_runtime.py).
The contract (cameras at the checkpoint's sizes, renamed by ``rename_map`` in LeRobot's own form, padded
ones declared; the state joints of ``observation.state`` and of further features such as
``observation.environment_state``; action dimensions; chunk length; diffusion's ``n_obs_steps`` as the
observation history; an ACT's temporal ensembling as the robot's ``aggregate``) comes from the
checkpoint's config.json; names, rate and action space from config.yaml. A checkpoint that cannot be served correctly
is refused at ``seq deploy`` with its policy type and the reason (models/lerobot_checkpoint.py); without
torch, lerobot or a file, deploy names exactly what is missing.

Per episode the worker keeps the chunk count (diffusion noise seeds) and, for RTC-enabled flow-matching
checkpoints, the last chunk's raw model-space rows; ``@seq.on_episode`` frees them.

Batching: the worker gathers up to 8 requests of different robots (waiting at most 5 ms for them) into one
``infer_batch`` call, one ``predict_action_chunk`` on a batch axis of up to 8; each row is exactly what that
episode's single request gives (``make check-lerobot`` compares served batches with LeRobot in-process).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

import sequence_ai_ros.policy as seq
from sequence_ai_ros.exceptions import ConfigError, ContractViolation, PolicyException
from sequence_ai_ros.models import lerobot_checkpoint as checkpoint_files
from sequence_ai_ros.models import lerobot_runtime as runtime
from sequence_ai_ros.models import lerobot_settings
from sequence_ai_ros.policy.api import DRY_RUN_DEPLOYMENT

HERE = Path(__file__).resolve().parent
#: the policy types whose chunks start from noise (``noise_seed``)
SEEDED = ('diffusion', 'smolvla', 'pi0', 'pi05')


def _path(value: str | None) -> Path | None:
    """A path from config.yaml (relative to this file), or None when empty."""
    return runtime.resolve(value, HERE) if value else None


def _serving(config: dict) -> dict:
    """The config.yaml entries that decide how the checkpoint is served (models/lerobot_checkpoint.plan)."""
    return {key: config.get(key) for key in ('rename_map', 'features', 'state_names', 'pad_cameras', 'chunk_length',
                                             'rtc_execution_horizon')}


@seq.policy(action_space='joint_absolute', action_names=['placeholder'], dt=1 / 30, chunk_length=1,
            streaming=True, gripper='as the checkpoint was trained',
            batching=seq.Batching(max_batch_size=8, max_wait_s=0.005))
class LeRobot:
    """A LeRobot checkpoint served as action chunks.

    :param checkpoint: the checkpoint directory (absolute, or relative to this file).
    :param device: torch device (``cuda``, ``cuda:1``, ``cpu``, ``mps``).
    :param fps: the rate the policy was trained at (Hz).
    :param action_space: the meaning of its actions (joint_absolute for LeRobot's usual datasets).
    :param state_names: the D state names, in the order of ``observation.state``.
    :param action_names: the action names, in order.
    :param chunk_length: actions per chunk; default the checkpoint's ``n_action_steps``.
    :param rename_map: LeRobot's rename_map: robot feature key -> checkpoint feature key, e.g.
        ``{observation.images.cam_high: observation.images.top}``.
    :param features: further state features of named robot joints, e.g.
        ``{observation.environment_state: [obs_0, ...]}``.
    :param pad_cameras: checkpoint cameras the robot lacks (padded as LeRobot pads them: smolvla, pi0, pi05).
    :param robot_type: LeRobot's ``robot_type`` passed in the batch.
    :param hub_cache: local Hugging Face hub cache for backbone processors/tokenizers.
    :param hub_snapshots: repo id -> local snapshot directory.
    :param noise_seed: diffusion, SmolVLA, pi0, pi0.5: seed S; chunk k of an episode starts from
        ``Generator().manual_seed(S + k)``; None = torch's global RNG, as LeRobot.
    :param rtc_execution_horizon: RTC: the rows guidance reaches; None = min(chunk_size, max(the checkpoint's
        ``rtc_config.execution_horizon``, the robot's expected delay)).
    """

    def __init__(self, checkpoint: str = '', device: str = 'cuda', fps: float = 30.0,
                 action_space: str = 'joint_absolute', state_names: list[str] | None = None,
                 action_names: list[str] | None = None, chunk_length: int | None = None,
                 rename_map: dict[str, str] | None = None, features: dict[str, list[str]] | None = None,
                 pad_cameras: list[str] | None = None, robot_type: str = '', hub_cache: str = '',
                 hub_snapshots: dict[str, str] | None = None, noise_seed: int | None = None,
                 rtc_execution_horizon: int | None = None) -> None:
        given = lerobot_settings.check({k: v for k, v in locals().items() if k != 'self'})
        path = _path(checkpoint)
        runtime.require(path, 'lerobot')
        assert path is not None
        self.runner = runtime.LeRobotRunner(
            path, given['device'], 'lerobot', robot_type=robot_type, hub_cache=_path(hub_cache),
            hub_snapshots={repo: runtime.resolve(d, HERE) for repo, d in given['hub_snapshots'].items()},
            **_serving(given),
            action_names=given['action_names'])
        self.runner.check_hub_files()
        assert self.runner.plan is not None
        self.steps = self.runner.plan.steps
        self.noise_seed = given['noise_seed']

    @classmethod
    def configure_contract(cls, contract: seq.Contract, config: dict) -> seq.Contract:
        """Return the checkpoint's contract; cheap (reads config.json, imports nothing heavy).

        :raises MissingDependency: when torch, lerobot>=0.4 or the checkpoint files are missing.
        :raises ConfigError: when the checkpoint cannot be served correctly (names its type and why), a
            config.yaml value is outside its range (names the key and what it allows), or ``hub_snapshots`` names
            a repo the checkpoint does not load.
        """
        config = lerobot_settings.check(config)
        path = _path(config.get('checkpoint'))
        if path is None or not all((path / name).is_file() for name in runtime.WEIGHTS):
            runtime.require(path, 'lerobot')     # an incomplete checkpoint: name everything missing at once
        assert path is not None
        cfg = runtime.read_config(path)
        needed = [need.repo_id for need in checkpoint_files.hub_needs(path, cfg)]
        stray = sorted(set(config.get('hub_snapshots') or {}) - set(needed))
        if stray:
            raise ConfigError(f'config.yaml hub_snapshots names {stray}, which this {cfg.get("type")!r} '
                                      f'checkpoint does not load; it loads {needed or "no backbone repo"}')
        # a checkpoint the template cannot serve is refused for what it is before the packages are looked for
        served = runtime.contract_for(contract, cfg, action_space=config.get('action_space', 'joint_absolute'),
                                      fps=config.get('fps', 30.0), action_names=config.get('action_names'),
                                      **_serving(config))
        runtime.require(path, 'lerobot')
        return served

    @classmethod
    def artifacts(cls, config: dict) -> list[Path]:
        """What a deployment version hashes besides policy.py and config.yaml (once, at ``seq deploy``).

        The checkpoint directory and, for each backbone repo it loads, the one snapshot directory that
        loading uses (from ``hub_snapshots`` or ``hub_cache``, as :func:`~.lerobot_checkpoint.locate` finds it;
        never the whole cache), so a changed processor or tokenizer is a new version too.
        """
        config = lerobot_settings.check(config)
        path = _path(config.get('checkpoint'))
        if path is None:
            return []
        paths = [path]
        if (path / 'config.json').is_file():
            cache = _path(config.get('hub_cache')) or runtime.default_hub_cache()
            snapshots = {repo: runtime.resolve(d, HERE) for repo, d in (config.get('hub_snapshots') or {}).items()}
            for need in checkpoint_files.hub_needs(path, runtime.read_config(path)):
                found, _ = checkpoint_files.locate(need, cache, snapshots)
                if found is not None:
                    paths.append(found)
        return paths

    def load(self) -> None:
        """Load the weights onto the device (not billed)."""
        self.runner.load()

    def infer(self, inp: seq.PolicyInput, episode: seq.Episode) -> np.ndarray:
        """Return float32 (T, D): the first T actions of the checkpoint's chunk for this observation.

        :raises PolicyException: when fewer real frames arrive than diffusion's n_obs_steps.
        """
        out = self.infer_batch([inp], [episode])[0]
        if isinstance(out, BaseException):
            raise out
        return out

    def infer_batch(self, inputs: list[seq.PolicyInput],
                    episodes: list[seq.Episode]) -> list[np.ndarray | PolicyException | ContractViolation]:
        """Return one float32 (T, D) chunk per input (requests of different robots), stacked in one forward.

        Each episode keeps its own state exactly as a single request would: its chunk count k (diffusion's
        noise ``S + k``), its observation history (the frames its robot sent, diffusion's n_obs_steps) and,
        for RTC, its last raw chunk. Requests whose RTC arguments differ run in separate forwards
        (:meth:`LeRobotRunner.forward_many`). A request with fewer real frames than the history gets a
        :class:`PolicyException` of its own, one whose ``chunk_tail`` has more rows than the episode's last
        chunk a :class:`ContractViolation` (RTC); the other requests of the batch are served.
        """
        runner = self.runner
        if runner.policy is None:
            self.load()
        out: dict[int, np.ndarray | PolicyException | ContractViolation] = {}     # by input
        live, batches, kwargs = [], [], []
        for i, (inp, episode) in enumerate(zip(inputs, episodes, strict=True)):
            frames = ([(obs.state, obs.images) for obs in inp.history]
                      or [(inp.observation.state, inp.observation.images)])
            try:
                batch = runner.frames_batch(frames, episode.instruction or inp.observation.instruction)
            except PolicyException as exc:
                out[i] = exc
                continue
            runner.dry_run = episode.deployment == DRY_RUN_DEPLOYMENT
            try:
                kw = runner.rtc_kwargs(episode.state.get('raw'), np.asarray(inp.chunk_tail),
                                       inp.expected_delay_actions)
            except ContractViolation as exc:
                out[i] = exc
                continue
            if runner.plan is not None and runner.plan.policy_type in SEEDED and self.noise_seed is not None:
                kw['noise'] = runner.noise(self.noise_seed + episode.state.get('chunks', 0))
            live.append(i)
            batches.append(batch)
            kwargs.append(kw)
        for i, (model, actions) in zip(live, runner.forward_many(batches, kwargs) if live else [], strict=True):
            state = episodes[i].state
            state['chunks'] = state.get('chunks', 0) + 1
            if runner.plan is not None and runner.plan.rtc_horizon is not None:
                state['raw'] = runtime.Raw(model=model, served=self.steps, actions=actions)
            out[i] = actions[:self.steps].astype(np.float32)
        return [out[i] for i in range(len(inputs))]

    @seq.on_episode
    def end(self, episode: seq.Episode) -> None:
        """Free the episode's chunk count and raw chunk."""
        episode.state.clear()
