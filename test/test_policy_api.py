"""The authoring API (``import sequence_ai_ros.policy as seq``): decorator, hook, loader and config."""

from __future__ import annotations

import numpy as np
import pytest

import sequence_ai_ros.policy as seq
from sequence_ai_ros.exceptions import ConfigError, ContractViolation, DeploymentError

NAMES = ['j0', 'j1']


def test_decorator_records_the_contract_and_the_hook():
    @seq.policy(action_space='joint_velocity', action_names=NAMES, dt=0.1, chunk_length=8, streaming=True,
                observation=seq.ObservationContract(cameras=[seq.CameraSpec('wrist', 64, 48, 'raw')],
                                                    state_names=NAMES, history=3), gripper='last dim, 0..1')
    class P:
        def infer(self, inp, episode):
            return np.zeros((8, 2), np.float32)

        @seq.on_episode
        def forget(self, episode):
            episode.state.clear()

    spec = seq.spec_of(P)
    c = spec.contract
    assert (c.action_space, c.action_dim, c.chunk_length, c.covers_seconds) == (seq.ActionSpace.JOINT_VELOCITY, 2, 8,
                                                                               pytest.approx(0.8))
    assert c.streaming and c.gripper == 'last dim, 0..1' and c.observation.history == 3
    assert spec.hook == 'forget'
    assert seq.spec_of(object) is None


def test_frames_per_chunk_is_retired_with_its_replacement_named():
    retired = r'frames_per_chunk is retired.*chunk_length.*ObservationContract\(history=N\)'
    with pytest.raises(ConfigError, match=retired):
        seq.policy(action_space='joint_absolute', action_names=NAMES, dt=0.1, chunk_length=8, frames_per_chunk=8)
    with pytest.raises(ConfigError, match='unknown arguments.*horizon'):
        seq.policy(action_space='joint_absolute', action_names=NAMES, dt=0.1, chunk_length=8, horizon=8)


def test_streaming_needs_a_hook_and_classes_need_infer():
    deco = seq.policy(action_space='joint_absolute', action_names=NAMES, dt=0.1, chunk_length=8, streaming=True)
    with pytest.raises(ConfigError, match='streaming=True needs a method decorated @seq.on_episode'):
        deco(type('NoHook', (), {'infer': lambda self, inp, ep: None}))
    plain = seq.policy(action_space='joint_absolute', action_names=NAMES, dt=0.1, chunk_length=8)
    with pytest.raises(ConfigError, match='needs an infer'):
        plain(type('NoInfer', (), {}))


@pytest.mark.parametrize(('kwargs', 'error', 'message'), [
    ({'dt': 0}, ContractViolation, 'dt must be a positive'),
    ({'chunk_length': 0}, ContractViolation, 'chunk_length'),
    ({'action_names': ['a', 'a']}, ContractViolation, 'unique'),
    ({'action_space': 'torque'}, ConfigError, 'unknown action_space'),
    ({'chunk_length': 2.7}, ContractViolation, 'integer number of actions'),
    ({'chunk_length': 20_000}, ContractViolation, r'1\.\.10000'),
    ({'action_names': 'abc'}, ContractViolation, 'not the single string'),
])
def test_invalid_contracts_fail_at_declaration(kwargs, error, message):
    args = dict(action_space='joint_absolute', action_names=NAMES, dt=0.1, chunk_length=8) | kwargs
    with pytest.raises(error, match=message):
        seq.policy(**args)


def test_loader_finds_the_class_reads_config_and_applies_overrides(tmp_path):
    (tmp_path / 'helper.py').write_text('SCALE = 3.0\n')  # a sibling module, importable from policy.py
    (tmp_path / 'policy.py').write_text(
        'import numpy as np\nimport sequence_ai_ros.policy as seq\nfrom helper import SCALE\n'
        "@seq.policy(action_space='joint_absolute', action_names=['a'], dt=0.5, chunk_length=2)\n"
        'class P:\n'
        '    def __init__(self, offset=0.0, gain=1.0):\n'
        '        self.value = SCALE * gain + offset\n'
        '    def infer(self, inp, episode):\n'
        '        return seq.Result(np.full((2, 1), self.value, np.float32), done=True)\n')
    (tmp_path / 'config.yaml').write_text('offset: 1.5\ngain: 2.0\n')
    d = seq.load_policy_file(tmp_path / 'policy.py', gain=10.0)
    assert d.cls.__name__ == 'P' and d.config == {'offset': 1.5, 'gain': 10.0} and d.hook is None
    assert d.instantiate().value == 31.5
    (tmp_path / 'config.yaml').write_text('- not a mapping\n')
    with pytest.raises(DeploymentError, match='must be a mapping'):
        seq.load_policy_file(tmp_path / 'policy.py')


def test_loader_rejects_two_policy_classes_and_missing_files(tmp_path):
    body = ("@seq.policy(action_space='joint_absolute', action_names=['a'], dt=0.5, chunk_length=2)\n"
            'class {}:\n    def infer(self, inp, episode):\n        return None\n')
    (tmp_path / 'two.py').write_text('import sequence_ai_ros.policy as seq\n' + body.format('A') + body.format('B'))
    with pytest.raises(DeploymentError, match='several @seq.policy classes'):
        seq.load_policy_file(tmp_path / 'two.py')
    with pytest.raises(DeploymentError, match='no such policy file'):
        seq.load_policy_file(tmp_path / 'absent.py')


def test_configure_contract_follows_the_config():
    from pathlib import Path

    fast = Path(__file__).parent / 'policies' / 'fast.py'
    assert seq.load_policy_file(fast).contract.action_dim == 26
    d = seq.load_policy_file(fast, dim=7, camera='cam_high')
    assert d.contract.action_names == tuple(f'j{i}' for i in range(7))
    assert d.contract.observation.camera('cam_high').width == 224
