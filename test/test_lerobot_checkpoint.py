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


def test_act_with_temporal_ensembling_is_refused_naming_type_and_reason():
    with pytest.raises(ConfigError, match=r"'act' checkpoint.*temporal_ensemble_coeff=0.01.*ACTTemporalEnsembler"):
        ck.plan(config(temporal_ensemble_coeff=0.01, n_action_steps=1))
    assert ck.plan(config(temporal_ensemble_coeff=None)).steps == 30


def test_unserved_types_and_unsent_inputs_are_refused():
    with pytest.raises(ConfigError, match=r"'vqbet' checkpoint.*only act, diffusion, smolvla, pi0, pi05"):
        ck.plan(config('vqbet'))
    env = config('diffusion', n_obs_steps=2, horizon=32, n_action_steps=16)
    env['input_features']['observation.environment_state'] = {'type': 'ENV', 'shape': [10]}
    with pytest.raises(ConfigError, match=r"'diffusion'.*observation.environment_state"):
        ck.plan(env)
    with pytest.raises(ConfigError, match='n_action_steps=30 > horizon - n_obs_steps'):
        ck.plan(config('diffusion', n_obs_steps=2, horizon=16, n_action_steps=30))


def test_diffusion_n_obs_steps_becomes_the_contract_history():
    base = load_policy_file(HOLD).contract
    c = ck.contract_for(base, config('diffusion', n_obs_steps=2, horizon=32, n_action_steps=16),
                        action_space='joint_absolute', fps=30, state_names=None, action_names=None, chunk_length=None)
    assert c.observation.history == 2 and c.chunk_length == 16
    act = ck.contract_for(base, config(), action_space='joint_absolute', fps=30, state_names=None,
                          action_names=None, chunk_length=10)
    assert act.observation.history == 1 and act.chunk_length == 10
    with pytest.raises(ConfigError, match='exceeds'):
        ck.plan(config(), chunk_length=31)


def test_camera_rename_map_keeps_the_checkpoint_size():
    cfg = config()
    cfg['input_features']['observation.images.wrist'] = {'type': 'VISUAL', 'shape': [3, 96, 128]}
    how = ck.plan(cfg, cameras={'head_rgb': 'cam_high'})
    assert how.cameras == {'head_rgb': 'cam_high', 'wrist': 'wrist'}
    base = load_policy_file(HOLD).contract
    c = ck.contract_for(base, cfg, action_space='joint_absolute', fps=30, state_names=None, action_names=None,
                        chunk_length=None, cameras={'head_rgb': 'cam_high'})
    assert [(cam.key, cam.width, cam.height) for cam in c.observation.cameras] == [('head_rgb', 640, 480),
                                                                                  ('wrist', 128, 96)]
    with pytest.raises(ConfigError, match=r"onto \['top'\].*its cameras: \['cam_high', 'wrist'\]"):
        ck.plan(cfg, cameras={'head_rgb': 'top'})


def test_backbone_files_are_found_offline_or_named_with_how_to_place_them(tmp_path: Path):
    ckpt = tmp_path / 'pi05'
    ckpt.mkdir()
    (ckpt / 'policy_preprocessor.json').write_text(json.dumps({'steps': [
        {'registry_name': 'tokenizer_processor', 'config': {'tokenizer_name': 'google/paligemma-3b-pt-224'}}]}))
    needs = ck.hub_needs(ckpt, {'type': 'pi05'})
    assert [n.repo_id for n in needs] == ['google/paligemma-3b-pt-224']
    cache = tmp_path / 'hub'
    gone = ck.missing_hub_files(needs, cache, {})
    assert len(gone) == 1 and 'tokenizer_config.json' in gone[0] and 'hf download google/paligemma-3b-pt-224' in gone[0]
    snap = cache / 'models--google--paligemma-3b-pt-224' / 'snapshots' / 'abc'
    snap.mkdir(parents=True)
    for name in ck.TOKENIZER_FILES:
        (snap / name).write_text('{}')
    assert ck.missing_hub_files(needs, cache, {}) == []
    local = tmp_path / 'snapshot'
    local.mkdir()
    assert 'special_tokens_map.json' in ck.missing_hub_files(needs, None, {'google/paligemma-3b-pt-224': local})[0]
    smol = ck.hub_needs(tmp_path, {'type': 'smolvla', 'vlm_model_name': 'HuggingFaceTB/SmolVLM2-500M-Video-Instruct'})
    assert smol[0].files == ck.PROCESSOR_FILES


def test_seq_deploy_refuses_before_loading_anything(tmp_path: Path, seq_home: Path, monkeypatch):
    """Deploy's contract step refuses a checkpoint it cannot serve, even with torch and lerobot present."""
    from sequence_ai_ros.models import lerobot_runtime

    monkeypatch.setattr(lerobot_runtime, 'missing', lambda checkpoint, **_: [])   # as in LeRobot's venv
    ckpt = tmp_path / 'ckpt'
    ckpt.mkdir()
    (ckpt / 'config.json').write_text(json.dumps(config(temporal_ensemble_coeff=0.01, n_action_steps=1)))
    pdir = tmp_path / 'mine'
    with contextlib.redirect_stdout(io.StringIO()):
        assert cli.main(['init', 'lerobot', str(pdir)]) == 0
    (pdir / 'config.yaml').write_text(f'checkpoint: {ckpt}\ndevice: cpu\n')
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        assert cli.main(['deploy', str(pdir / 'policy.py'), '--name', 'ensembled']) != 0
    assert "'act' checkpoint correctly: temporal_ensemble_coeff=0.01" in err.getvalue()
