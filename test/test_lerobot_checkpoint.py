"""What the lerobot template decides from a checkpoint's files alone: refusals, history, cameras, backbone files.

Pure JSON (no torch here): the configs are LeRobot 0.6 ``config.json`` shapes as ``lerobot-train`` writes them
(``make check-lerobot`` serves real ones).
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest

from sequence_ai_ros import cli
from sequence_ai_ros.exceptions import ConfigError
from sequence_ai_ros.models import lerobot_checkpoint as ck
from sequence_ai_ros.policy import load_policy_file
from sequence_ai_ros.templates import TEMPLATES_DIR

HOLD = Path(TEMPLATES_DIR) / 'hold' / 'policy.py'


def config(kind: str = 'act', **extra) -> dict:
    cfg = {'type': kind, 'n_obs_steps': 1, 'chunk_size': 30, 'n_action_steps': 30,
           'input_features': {'observation.state': {'type': 'STATE', 'shape': [26]},
                              'observation.images.cam_high': {'type': 'VISUAL', 'shape': [3, 480, 640]}},
           'output_features': {'action': {'type': 'ACTION', 'shape': [26]}}}
    cfg.update(extra)
    return cfg


def test_act_with_temporal_ensembling_is_served_whole_and_ensembled_on_the_robot():
    how = ck.plan(config(temporal_ensemble_coeff=0.01, n_action_steps=1))
    assert (how.steps, how.aggregate, how.temporal_ensemble_coeff) == (30, 'weighted_average', 0.01)
    base = load_policy_file(HOLD).contract
    c = ck.contract_for(base, config(temporal_ensemble_coeff=0.01, n_action_steps=1), action_space='joint_absolute',
                        fps=30, state_names=None, action_names=None, chunk_length=None)
    assert (c.chunk_length, c.aggregate, c.temporal_ensemble_coeff) == (30, 'weighted_average', 0.01)
    with pytest.raises(ConfigError, match=r"'act' checkpoint.*temporal ensembling averages absolute targets"):
        ck.contract_for(base, config(temporal_ensemble_coeff=0.01, n_action_steps=1), action_space='joint_delta',
                        fps=30, state_names=None, action_names=None, chunk_length=None)
    plain = ck.plan(config(temporal_ensemble_coeff=None))
    assert (plain.steps, plain.aggregate) == (30, 'latest_only')


def test_unserved_types_and_unsent_inputs_are_refused():
    with pytest.raises(ConfigError, match=r"'vqbet' checkpoint.*only act, diffusion, smolvla, pi0, pi05"):
        ck.plan(config('vqbet'))
    env = config('diffusion', n_obs_steps=2, horizon=32, n_action_steps=16)
    env['input_features']['observation.environment_state'] = {'type': 'ENV', 'shape': [10]}
    with pytest.raises(ConfigError, match=r"'diffusion'.*observation.environment_state, which the robot does not "
                                          r"send: name the 10 joints of observation.environment_state in "
                                          r"config.yaml \(features:"):
        ck.plan(env)
    with pytest.raises(ConfigError, match='n_action_steps=30 > horizon - n_obs_steps'):
        ck.plan(config('diffusion', n_obs_steps=2, horizon=16, n_action_steps=30))


def test_environment_state_comes_from_named_joints():
    """A state-based sim policy: observation.state and observation.environment_state from one joint state."""
    cfg = config(input_features={'observation.state': {'type': 'STATE', 'shape': [4]},
                                 'observation.environment_state': {'type': 'ENV', 'shape': [3]}},
                 output_features={'action': {'type': 'ACTION', 'shape': [4]}})
    joints, env = ['ee_x', 'ee_y', 'ee_z', 'gripper'], ['obs_0', 'obs_1', 'obs_2']
    how = ck.plan(cfg, state_names=joints, features={'observation.environment_state': env})
    assert how.state_names == tuple(joints + env) and how.cameras == {}
    assert how.state_index == {'observation.state': (0, 1, 2, 3), 'observation.environment_state': (4, 5, 6)}
    # the same joint may feed both features; the contract lists it once
    both = ck.plan(cfg, state_names=joints, features={'observation.environment_state': ['ee_x', 'obs_0', 'obs_1']})
    assert both.state_names == tuple(joints + ['obs_0', 'obs_1'])
    assert both.state_index['observation.environment_state'] == (0, 4, 5)
    with pytest.raises(ConfigError, match=r"environment_state has 3 dimensions; config.yaml names 2"):
        ck.plan(cfg, state_names=joints, features={'observation.environment_state': env[:2]})
    with pytest.raises(ConfigError, match=r"sets features\['observation.extra'\], which feed none"):
        ck.plan(cfg, state_names=joints, features={'observation.environment_state': env, 'observation.extra': ['x']})
    # LeRobot's rename_map form for a state feature the robot names otherwise
    renamed = ck.plan(cfg, state_names=joints, features={'observation.task': env},
                      rename_map={'observation.task': 'observation.environment_state'})
    assert renamed.state['observation.environment_state'] == tuple(env)
    base = load_policy_file(HOLD).contract
    c = ck.contract_for(base, cfg, action_space='ee_absolute', fps=80, state_names=joints,
                        action_names=['ee_x', 'ee_y', 'ee_z', 'gripper'], chunk_length=None,
                        features={'observation.environment_state': env})
    assert c.observation.state_names == tuple(joints + env) and c.observation.cameras == ()


def test_singular_observation_image_is_the_robot_camera_image():
    cfg = config()
    cfg['input_features'] = {'observation.state': {'type': 'STATE', 'shape': [26]},
                             'observation.image': {'type': 'VISUAL', 'shape': [3, 96, 96]}}
    how = ck.plan(cfg)
    assert how.cameras == {'image': 'observation.image'} and how.sizes == {'observation.image': (96, 96)}
    moved = ck.plan(cfg, rename_map={'observation.images.front': 'observation.image'})
    assert moved.cameras == {'front': 'observation.image'}


def test_camera_rename_map_keeps_the_checkpoint_size_and_its_own_cameras():
    cfg = config()
    cfg['input_features']['observation.images.wrist'] = {'type': 'VISUAL', 'shape': [3, 96, 128]}
    rename = {'observation.images.head_rgb': 'observation.images.cam_high'}
    how = ck.plan(cfg, rename_map=rename)
    assert how.cameras == {'head_rgb': 'observation.images.cam_high', 'wrist': 'observation.images.wrist'}
    base = load_policy_file(HOLD).contract
    c = ck.contract_for(base, cfg, action_space='joint_absolute', fps=30, state_names=None, action_names=None,
                        chunk_length=None, rename_map=rename)
    assert [(cam.key, cam.width, cam.height) for cam in c.observation.cameras] == [('head_rgb', 640, 480),
                                                                                  ('wrist', 128, 96)]
    # a rename onto one checkpoint camera from the robot camera named like another: that other one is left
    # without a robot camera; ACT pads nothing, so it is refused by name (never silently dropped)
    with pytest.raises(ConfigError, match=r"'act'.*cameras \['observation.images.cam_high'\].*does not pad"):
        ck.plan(cfg, rename_map={'observation.images.cam_high': 'observation.images.wrist'})
    # a swap keeps both
    swap = ck.plan(cfg, rename_map={'observation.images.cam_high': 'observation.images.wrist',
                                    'observation.images.wrist': 'observation.images.cam_high'})
    assert swap.cameras == {'wrist': 'observation.images.cam_high', 'cam_high': 'observation.images.wrist'}
    with pytest.raises(ConfigError, match=r"onto 'observation.images.top'.*does not take"):
        ck.plan(cfg, rename_map={'observation.images.head_rgb': 'observation.images.top'})
    with pytest.raises(ConfigError, match='a camera maps onto a camera'):
        ck.plan(cfg, rename_map={'observation.images.head_rgb': 'observation.state'})


def smolvla(empty: int = 1) -> dict:
    feats = {'observation.state': {'type': 'STATE', 'shape': [6]},
             'observation.images.top': {'type': 'VISUAL', 'shape': [3, 256, 256]},
             'observation.images.wrist': {'type': 'VISUAL', 'shape': [3, 256, 256]}}
    for i in range(empty):     # what SmolVLAConfig.validate_features adds and lerobot-train saves
        feats[f'observation.images.empty_camera_{i}'] = {'type': 'VISUAL', 'shape': [3, 480, 640]}
    return config('smolvla', chunk_size=50, n_action_steps=50, empty_cameras=empty, input_features=feats,
                  output_features={'action': {'type': 'ACTION', 'shape': [6]}})


def test_missing_cameras_are_padded_as_lerobot_pads_them_and_declared():
    base = load_policy_file(HOLD).contract
    c = ck.contract_for(base, smolvla(1), action_space='joint_absolute', fps=30, state_names=None, action_names=None,
                        chunk_length=None)
    assert [cam.key for cam in c.observation.cameras] == ['top', 'wrist']          # never the 640x480 pad
    assert c.observation.padded_cameras == ('observation.images.empty_camera_0',)
    back = type(c).from_proto(c.to_proto())
    assert back.observation.padded_cameras == c.observation.padded_cameras
    # SmolVLA pads at most empty_cameras missing ones, and its own empty_camera_<i> already take them all:
    # a real camera the robot lacks would leave the model one image short of its training
    with pytest.raises(ConfigError, match=r"'smolvla'.*2 cameras would be padded.*empty_cameras=1"):
        ck.plan(smolvla(1), pad_cameras=['wrist'])
    pi0 = dict(smolvla(0), type='pi0')
    assert ck.plan(pi0, pad_cameras=['observation.images.wrist']).padded == ('observation.images.wrist',)
    with pytest.raises(ConfigError, match=r"'pi0'.*every camera would be padded"):
        ck.plan(pi0, pad_cameras=['wrist', 'top'])
    with pytest.raises(ConfigError, match=r"'act'.*does not pad"):
        ck.plan(config(), pad_cameras=['cam_high'])
    with pytest.raises(ConfigError, match=r"pad_cameras names \['observation.images.side'\]"):
        ck.plan(pi0, pad_cameras=['side'])


def test_backbone_files_are_found_offline_or_named_with_how_to_place_them(tmp_path: Path):
    ckpt = tmp_path / 'pi05'
    ckpt.mkdir()
    (ckpt / 'policy_preprocessor.json').write_text(json.dumps({'steps': [
        {'registry_name': 'tokenizer_processor', 'config': {'tokenizer_name': 'google/paligemma-3b-pt-224'}}]}))
    needs = ck.hub_needs(ckpt, {'type': 'pi05'})
    assert [n.repo_id for n in needs] == ['google/paligemma-3b-pt-224']
    cache = tmp_path / 'hub'
    gone = ck.missing_hub_files(needs, cache, {})
    assert len(gone) == 1 and 'tokenizer_config.json' in gone[0]
    assert 'hf download google/paligemma-3b-pt-224 tokenizer_config.json tokenizer.json --cache-dir' in gone[0]
    repo = cache / 'models--google--paligemma-3b-pt-224'
    old, snap = repo / 'snapshots' / 'old', repo / 'snapshots' / 'abc'
    for d in (old, snap):
        d.mkdir(parents=True)
        (d / 'tokenizer_config.json').write_text('{}')
    (repo / 'refs').mkdir()
    (repo / 'refs' / 'main').write_text('abc')
    assert 'tokenizer.json or tokenizer.model' in ck.missing_hub_files(needs, cache, {})[0]
    (snap / 'tokenizer.model').write_text('')   # a sentencepiece vocabulary is enough for AutoTokenizer
    assert ck.missing_hub_files(needs, cache, {}) == []
    assert ck.locate(needs[0], cache, {}) == (snap, [])   # refs/main's revision, the directory LeRobot is given
    local = tmp_path / 'snapshot'
    local.mkdir()
    assert ck.locate(needs[0], None, {'google/paligemma-3b-pt-224': local}) == (
        None, ['tokenizer_config.json', 'tokenizer.json or tokenizer.model or vocab.json or vocab.txt or spiece.model'])
    # the tokenizer step is pointed at the local directory
    assert ck.hub_overrides(ckpt, {'google/paligemma-3b-pt-224': snap}) == {
        'tokenizer_processor': {'tokenizer_name': str(snap)}}


def test_smolvla_backbone_files_as_transformers_5_saves_them_and_every_step_naming_it_redirected(tmp_path: Path):
    """A backbone as transformers 5 saves it is accepted; a missing file names itself.

    transformers 5 saves a processor as processor_config.json alone (no preprocessor_config.json, no
    special_tokens_map.json): the files the tiny SmolVLA of make check-lerobot saves with the installed one.
    """
    repo = 'HuggingFaceTB/SmolVLM2-500M-Video-Instruct'
    ckpt = tmp_path / 'smolvla'
    ckpt.mkdir()
    (ckpt / 'policy_preprocessor.json').write_text(json.dumps({'steps': [
        {'registry_name': 'rename_observations_processor', 'config': {'rename_map': {}}},
        {'registry_name': 'tokenizer_processor', 'config': {'tokenizer_name': repo, 'max_length': 48}}]}))
    needs = ck.hub_needs(ckpt, {'type': 'smolvla', 'vlm_model_name': repo})
    assert [(n.repo_id, n.files) for n in needs] == [(repo, ck.PROCESSOR_FILES)]
    local = tmp_path / 'smolvlm2'
    local.mkdir()
    for name in ('config.json', 'tokenizer.json', 'tokenizer_config.json'):
        (local / name).write_text('{}')
    (local / 'processor_config.json').write_text('{"image_seq_len": 64}')   # as transformers 4 saves it
    gone = ck.missing_hub_files(needs, None, {repo: local})
    assert len(gone) == 1 and ('preprocessor_config.json or processor_config.json (with image_processor) not in '
                               'the snapshot') in gone[0]
    assert ('hf download HuggingFaceTB/SmolVLM2-500M-Video-Instruct config.json tokenizer_config.json '
            'tokenizer.json preprocessor_config.json processor_config.json --cache-dir') in gone[0]
    (local / 'processor_config.json').write_text('{"image_processor": {}, "image_seq_len": 4}')   # transformers 5
    assert ck.missing_hub_files(needs, None, {repo: local}) == []
    assert ck.hub_overrides(ckpt, {repo: local}) == {'tokenizer_processor': {'tokenizer_name': str(local)}}
    (local / 'processor_config.json').unlink()
    (local / 'preprocessor_config.json').write_text('{}')   # transformers 4's image processor file
    assert ck.missing_hub_files(needs, None, {repo: local}) == []


def test_seq_deploy_refuses_before_loading_anything(tmp_path: Path, seq_home: Path):
    """Deploy's contract step refuses a checkpoint it cannot serve for what it is, torch and lerobot or not."""
    ckpt = tmp_path / 'ckpt'
    ckpt.mkdir()
    (ckpt / 'config.json').write_text(json.dumps(config(temporal_ensemble_coeff=0.01, n_action_steps=1)))
    (ckpt / 'model.safetensors').write_bytes(b'')
    pdir = tmp_path / 'mine'
    with contextlib.redirect_stdout(io.StringIO()):
        assert cli.main(['init', 'lerobot', str(pdir)]) == 0
    (pdir / 'config.yaml').write_text(f'checkpoint: {ckpt}\ndevice: cpu\naction_space: joint_delta\n')
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        assert cli.main(['deploy', str(pdir / 'policy.py'), '--name', 'ensembled']) != 0
    assert "'act' checkpoint correctly: temporal_ensemble_coeff=0.01" in err.getvalue()
    assert 'joint_delta' in err.getvalue()


def test_rtc_execution_horizon_covers_the_robots_delay_and_says_so_once(tmp_path: Path, caplog):
    """min(chunk_size, max(the checkpoint's execution_horizon, the delay)), or the config key; logged once."""
    from sequence_ai_ros.models.lerobot_runtime import LeRobotRunner

    (tmp_path / 'config.json').write_text(json.dumps(config('smolvla', chunk_size=50, n_action_steps=50,
                                                            rtc_config={'enabled': True, 'execution_horizon': 10})))
    runner = LeRobotRunner(tmp_path, 'cpu', 'lerobot')
    with caplog.at_level('WARNING', logger='sequence_ai_ros.models.lerobot_runtime'):
        horizons = [runner.rtc_kwargs(None, 0, d)['execution_horizon'] for d in (5, 27, 30, 80)]
    assert horizons == [10, 27, 30, 50]
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and '27 actions' in warned[0] and 'execution_horizon 10' in warned[0]
    fixed = LeRobotRunner(tmp_path, 'cpu', 'lerobot', rtc_execution_horizon=12)
    assert [fixed.rtc_kwargs(None, 0, d)['execution_horizon'] for d in (5, 27)] == [12, 12]
    (tmp_path / 'config.json').write_text(json.dumps(config('smolvla')))   # RTC off: no RTC arguments
    assert LeRobotRunner(tmp_path, 'cpu', 'lerobot').rtc_kwargs(None, 0, 27) == {}


def template(tmp_path: Path, monkeypatch, cfg: dict, yaml_text: str) -> Path:
    """A lerobot template folder over a checkpoint of ``cfg`` with config.yaml ``checkpoint: ...`` + ``yaml_text``."""
    from sequence_ai_ros.models import lerobot_runtime

    monkeypatch.setattr(lerobot_runtime, 'missing', lambda checkpoint, **_: [])   # as in LeRobot's venv
    ckpt = tmp_path / 'ckpt'
    ckpt.mkdir(exist_ok=True)
    (ckpt / 'config.json').write_text(json.dumps(cfg))
    (ckpt / 'model.safetensors').write_bytes(b'')
    pdir = tmp_path / 'mine'
    if not pdir.exists():
        with contextlib.redirect_stdout(io.StringIO()):
            assert cli.main(['init', 'lerobot', str(pdir)]) == 0
    (pdir / 'config.yaml').write_text(f'checkpoint: {ckpt}\ndevice: cpu\n{yaml_text}')
    return pdir / 'policy.py'


SMOLVLA_RTC = config('smolvla', chunk_size=50, n_action_steps=50, rtc_config={'enabled': True, 'execution_horizon': 10})


@pytest.mark.parametrize(('cfg', 'yaml_text', 'message'), [
    (SMOLVLA_RTC, 'rtc_execution_horizon: 0\n',
     r"rtc_execution_horizon: 0 is not null or an integer 1 \.\. the checkpoint's chunk_size"),
    (SMOLVLA_RTC, 'rtc_execution_horizon: -5\n', r'rtc_execution_horizon: -5 is not'),
    (SMOLVLA_RTC, 'rtc_execution_horizon: abc\n', r"rtc_execution_horizon: 'abc' is not"),
    (SMOLVLA_RTC, 'rtc_execution_horizon: 10.7\n', r'rtc_execution_horizon: 10.7 is not'),
    (SMOLVLA_RTC, 'rtc_execution_horizon: 1000\n', r'rtc_execution_horizon: 1000 is not null or an integer 1 \.\. 50'),
    (config('smolvla'), 'rtc_execution_horizon: 12\n', r"rtc_execution_horizon: 12 is set, but this 'smolvla' "
                                                        r'checkpoint does not enable real-time chunking'),
    (config(), 'rename_map: [a, b]\n', r"config.yaml rename_map: \['a', 'b'\] is not a mapping robot feature key"),
    (config(), 'hub_snapshots: [x]\n', r"config.yaml hub_snapshots: \['x'\] is not a mapping repo id"),
    (config(), 'hub_snapshots: {repo: null}\n', r"config.yaml hub_snapshots: \{'repo': None\} is not a mapping"),
    (config(), 'fps: 0\n', r'config.yaml fps: 0 is not a finite number > 0'),
    (config(), 'chunk_length: 0\n', r'config.yaml chunk_length: 0 is not null .* or an integer >= 1'),
    (config(), f'noise_seed: {2**70}\n', r'config.yaml noise_seed: 1180591620717411303424 is not null or an integer 0'),
    (config(), 'noise_seed: x\n', r"config.yaml noise_seed: 'x' is not null or an integer"),
    (config(), 'state_names: [[a], [b]]\n', r'config.yaml state_names: .* is not a list of joint names'),
    (config(), 'rename_map: {observation.images.cam: observation.images.cam_high}\n'
               'hub_snapshots: {google/paligemma-3b-pt-224: /x}\n',
     r"hub_snapshots names \['google/paligemma-3b-pt-224'\], which this 'act' checkpoint does not load; it loads "
     r'no backbone repo'),
    (config(), 'rename_map: {observation.images.a/b: observation.images.cam_high}\n',
     r"camera key: 'a/b' is outside the limit \(a letter or digit"),
])
def test_bad_config_values_are_refused_at_deploy_naming_the_key(tmp_path, seq_home, monkeypatch, cfg, yaml_text,
                                                                message):
    """Every config.yaml value outside its range is a ConfigError naming the key and what it allows."""
    from sequence_ai_ros.exceptions import DeploymentError

    with pytest.raises(DeploymentError, match=message):
        load_policy_file(template(tmp_path, monkeypatch, cfg, yaml_text))


def test_rtc_execution_horizon_in_range_and_nested_names_are_taken(tmp_path, seq_home, monkeypatch):
    """rtc_execution_horizon 1 .. chunk_size is taken; v2.1 info.json's nested names [[...]] are flattened."""
    cfg = dict(SMOLVLA_RTC, input_features={'observation.state': {'type': 'STATE', 'shape': [2]},
                                            'observation.images.cam_high': {'type': 'VISUAL', 'shape': [3, 8, 8]}},
               output_features={'action': {'type': 'ACTION', 'shape': [2]}})
    d = load_policy_file(template(tmp_path, monkeypatch, cfg, 'rtc_execution_horizon: 50\n'
                                                              'state_names: [[j0, j1]]\naction_names: [[a0, a1]]\n'))
    assert d.contract.observation.state_names == ('j0', 'j1') and d.contract.action_names == ('a0', 'a1')


def test_artifacts_add_the_backbone_snapshot_that_loading_uses(tmp_path, seq_home, monkeypatch):
    """The version covers the checkpoint and each backbone repo's located snapshot, never the whole hub cache."""
    repo = 'google/paligemma-3b-pt-224'
    path = template(tmp_path, monkeypatch, config('pi0'), '')
    ckpt = tmp_path / 'ckpt'
    (ckpt / 'policy_preprocessor.json').write_text(json.dumps({'steps': [
        {'registry_name': 'tokenizer_processor', 'config': {'tokenizer_name': repo}}]}))
    cache = tmp_path / 'hub'
    snap = cache / 'models--google--paligemma-3b-pt-224' / 'snapshots' / 'abc'
    snap.mkdir(parents=True)
    for name in ('tokenizer_config.json', 'tokenizer.json'):
        (snap / name).write_text('{}')
    (cache / 'models--other--repo').mkdir()                      # another repo in the same cache: not hashed
    (path.parent / 'config.yaml').write_text(f'checkpoint: {ckpt}\ndevice: cpu\nhub_cache: {cache}\n')
    d = load_policy_file(path)
    assert d.cls.artifacts(d.config) == [ckpt, snap]
    local = tmp_path / 'local'
    local.mkdir()
    for name in ('tokenizer_config.json', 'tokenizer.model'):
        (local / name).write_text('')
    (path.parent / 'config.yaml').write_text(f'checkpoint: {ckpt}\ndevice: cpu\nhub_cache: {cache}\n'
                                             f'hub_snapshots: {{{repo}: {local}}}\n')
    d = load_policy_file(path)
    assert d.cls.artifacts(d.config) == [ckpt, local]
    from sequence_ai_ros.worker import content
    fp = content.fingerprint(d)
    assert str(local / 'tokenizer.model') in fp.files and not any(str(cache) in f for f in fp.files)


def test_rtc_refuses_a_tail_longer_than_the_served_chunk_and_skips_a_foreign_one(tmp_path: Path, caplog):
    """A tail of more rows than were served would in-paint executed rows; one unlike the served rows is not guided."""
    import numpy as np

    from sequence_ai_ros.exceptions import ContractViolation
    from sequence_ai_ros.models.lerobot_runtime import LeRobotRunner, Raw

    (tmp_path / 'config.json').write_text(json.dumps(SMOLVLA_RTC))
    runner = LeRobotRunner(tmp_path, 'cpu', 'lerobot')
    served = np.arange(50 * 26, dtype=np.float32).reshape(50, 26)
    previous = Raw(model=np.zeros((50, 32), np.float32), served=50, actions=served)
    with pytest.raises(ContractViolation, match='chunk_tail has 80 rows, more than the 50 of the last served chunk'):
        runner.rtc_kwargs(previous, np.zeros((80, 26), np.float32), 10)
    with caplog.at_level('WARNING', logger='sequence_ai_ros.models.lerobot_runtime'):
        for _ in range(2):
            kw = runner.rtc_kwargs(previous, served[30:] + 1.0, 10)
    assert kw == {'inference_delay': 10, 'execution_horizon': 10}          # no leftover: not guided
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and 'not the last served chunk' in warned[0] and 'max difference 1' in warned[0]


def test_rtc_delay_warning_in_the_dry_run_names_the_dry_run(tmp_path: Path, caplog):
    from sequence_ai_ros.models.lerobot_runtime import LeRobotRunner

    (tmp_path / 'config.json').write_text(json.dumps(SMOLVLA_RTC))
    runner = LeRobotRunner(tmp_path, 'cpu', 'lerobot')
    runner.dry_run = True
    with caplog.at_level('WARNING', logger='sequence_ai_ros.models.lerobot_runtime'):
        runner.rtc_kwargs(None, 0, 12)
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and "seq deploy's dry run (a synthetic request, no robot) expects 12" in warned[0]


@pytest.mark.parametrize(('flag', 'value', 'message'), [('--chunks', '1', 'expected an integer >= 2'),
                                                        ('--delay', '0', 'expected an integer >= 1')])
def test_gpu_check_refuses_values_it_cannot_check_before_deploying(flag, value, message):
    """`--chunks 1` or `--delay 0` ran a whole deploy, then failed on max() of no seam gaps."""
    import os
    import subprocess
    import sys

    script = Path(__file__).resolve().parent / 'gpu' / 'check_policy.py'
    env = {**os.environ, 'PYTHONPATH': str(script.parents[2])}
    out = subprocess.run([sys.executable, str(script), '--checkpoint', 'x', '--rtc', flag, value], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and f'argument {flag}: {message}' in out.stderr, out.stderr


def test_empty_state_and_action_names_are_warned_about_at_deploy(caplog):
    base = load_policy_file(HOLD).contract
    with caplog.at_level('WARNING', logger='sequence_ai_ros.models.lerobot_checkpoint'):
        ck.contract_for(base, config(), action_space='joint_absolute', fps=30, state_names=None, action_names=None,
                        chunk_length=None)
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and 'state_names and action_names are empty' in warned[0]
    assert 'state_0 .. and action_0 ..' in warned[0] and 'meta/info.json' in warned[0]
    caplog.clear()
    names = [f'j{i}' for i in range(26)]
    with caplog.at_level('WARNING', logger='sequence_ai_ros.models.lerobot_checkpoint'):
        ck.contract_for(base, config(), action_space='joint_absolute', fps=30, state_names=names, action_names=names,
                        chunk_length=None)
    assert caplog.records == []
