"""``seq deploy`` validation, the $SEQ_HOME registry, usage metering and the worker's ``seq`` commands."""

from __future__ import annotations

import importlib.util
import re
import signal
import textwrap

import numpy as np
import pytest
from test_worker_support import POLICIES, Stream, channel, handshake, state_request, wait_ready

from sequence_ai_ros.cli import serving as commands
from sequence_ai_ros.exceptions import ConfigError, DeploymentError, UnknownDeployment
from sequence_ai_ros.protocol import sequence_ai_pb2_grpc as pb_grpc
from sequence_ai_ros.worker import create_server
from sequence_ai_ros.worker.registry import Registry, deploy
from sequence_ai_ros.worker.usage import read_usage

HEADER = 'import numpy as np\nimport sequence_ai_ros.policy as seq\n'
GOOD = HEADER + textwrap.dedent('''
    @seq.policy(action_space='joint_delta', action_names=['x', 'y'], dt=0.05, chunk_length=4,
                observation=seq.ObservationContract(cameras=[seq.CameraSpec('cam', 16, 8, 'jpeg')],
                                                    state_names=['x', 'y'], history=2))
    class P:
        def __init__(self, scale=1.0):
            self.scale = scale

        def infer(self, inp, episode):
            assert len(inp.history) == 2 and inp.observation.images['cam'].shape == (8, 16, 3)
            return np.full((4, 2), self.scale, np.float32)
''')


def write(tmp_path, name: str, text: str, config: str | None = None):
    d = tmp_path / name
    d.mkdir()
    (d / 'policy.py').write_text(text)
    if config is not None:
        (d / 'config.yaml').write_text(config)
    return d / 'policy.py'


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = commands.main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_deploy_records_and_redeploy_bumps_the_version(tmp_path, seq_home):
    path = write(tmp_path, 'good', GOOD, config='scale: 2.5\n')
    rec, figures = deploy(path)
    assert (rec.name, rec.version, rec.action_space, rec.action_dim, rec.chunk_length) == ('good', 1, 'joint_delta',
                                                                                           2, 4)
    assert figures['chunk_length'] == 4 and len(rec.sha256) == 64
    assert deploy(path) == (rec, {})                             # the same content: nothing registered
    assert deploy(path, force=True)[0].version == 2
    assert [r.version for r in Registry().list()] == [2]
    _, definition = Registry().load('good')
    assert definition.config == {'scale': 2.5}


ARTIFACT = GOOD.replace("""
    def __init__(self, scale=1.0):
        self.scale = scale
""", """
    def __init__(self, scale=1.0, weights='ckpt'):
        self.scale = scale

    @classmethod
    def artifacts(cls, config):
        from pathlib import Path
        return [Path(__file__).parent / config.get('weights', 'ckpt')]
""")
assert 'artifacts' in ARTIFACT


def test_a_version_is_policy_config_and_checkpoint_validated_once(tmp_path, seq_home):
    """The version hashes policy.py, config.yaml and the checkpoint's files at deploy.

    Serving compares, never re-hashes; any change is refused until `seq deploy` validates it as a new version.
    """
    path = write(tmp_path, 'versioned', ARTIFACT, config='scale: 2.5\n')
    ckpt = path.parent / 'ckpt'
    (ckpt / 'sub').mkdir(parents=True)
    (ckpt / 'model.safetensors').write_bytes(b'\0' * 4096)
    (ckpt / 'sub' / 'config.json').write_text('{}')
    rec, _ = deploy(path)
    assert len(rec.content_sha256) == 64 and rec.artifact_roots == [str(ckpt)]
    assert sorted(rec.files) == [str(ckpt / 'model.safetensors'), str(ckpt / 'sub' / 'config.json')]
    Registry().load('versioned')                                    # unchanged: served
    first = rec.content_sha256

    (path.parent / 'config.yaml').write_text('scale: 3.0\n')         # an edited config.yaml
    with pytest.raises(DeploymentError, match=r'config.yaml changed since version 1.*seq deploy'):
        Registry().load('versioned')
    rec2, _ = deploy(path)
    assert rec2.version == 2 and rec2.content_sha256 != first
    Registry().load('versioned')

    (ckpt / 'model.safetensors').write_bytes(b'\1' * 4096)           # another checkpoint, same size
    import os
    st = os.stat(ckpt / 'model.safetensors')
    os.utime(ckpt / 'model.safetensors', ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    with pytest.raises(DeploymentError, match=r'model.safetensors changed \(size or modification time\)'):
        Registry().load('versioned')
    (ckpt / 'extra.bin').write_bytes(b'x')
    with pytest.raises(DeploymentError, match=r'extra.bin is new'):
        Registry().load('versioned')
    rec3, _ = deploy(path)
    assert rec3.version == 3 and rec3.content_sha256 not in (first, rec2.content_sha256)
    Registry().load('versioned')
    (ckpt / 'sub' / 'config.json').unlink()
    with pytest.raises(DeploymentError, match=r'config.json is gone'):
        Registry().load('versioned')


def test_a_checkpoint_swapped_after_serve_starts_is_never_loaded(tmp_path, seq_home):
    """`seq serve` checks the content at start, but the weights load at the first handshake: checked again there."""
    path = write(tmp_path, 'swapped', ARTIFACT, config='scale: 2.5\n')
    ckpt = path.parent / 'ckpt'
    ckpt.mkdir()
    (ckpt / 'model.safetensors').write_bytes(b'\0' * 4096)
    deploy(path)
    server = create_server(['swapped'])                              # checked here: unchanged
    try:
        (ckpt / 'model.safetensors').write_bytes(b'\0' * 8192)       # swapped before anything loads
        ch = channel(server.port)
        stub = pb_grpc.PolicyServiceStub(ch)
        handshake(stub, 'swapped')
        reply = wait_ready(stub, 'swapped')
        assert not reply.ready and reply.state == 'failed', reply
        assert 'model.safetensors changed' in reply.message and 'since version 1' in reply.message, reply.message
        assert 'seq deploy' in reply.message
        ch.close()
    finally:
        server.stop()


@pytest.mark.parametrize(('name', 'text', 'config', 'message'), [
    ('broken_import', HEADER + 'import definitely_not_a_module_xyz\n', None, "No module named 'definitely_not"),
    ('syntax', HEADER + 'def (:\n', None, 'SyntaxError'),
    ('no_class', HEADER + 'class P:\n    pass\n', None, 'no class decorated'),
    ('bad_contract', GOOD.replace('dt=0.05', 'dt=0'), None, 'dt must be a positive'),
    ('bad_space', GOOD.replace("'joint_delta'", "'joint_torque'"), None, 'unknown action_space'),
    ('frames_per_chunk', GOOD.replace('chunk_length=4,', 'chunk_length=4, frames_per_chunk=4,'), None,
     'frames_per_chunk is retired.*chunk_length.*history'),
    ('streaming_no_hook', GOOD.replace('chunk_length=4,', 'chunk_length=4, streaming=True,'), None,
     'streaming=True needs a method decorated @seq.on_episode'),
    ('failing_dry_run', GOOD.replace('return np.full', 'raise RuntimeError("weights missing"); return np.full'),
     None, 'dry inference failed: RuntimeError: weights missing'),
    ('failing_with_a_tail', GOOD.replace('return np.full', 'if len(inp.chunk_tail): raise RuntimeError("element 0 '
     'of tensors does not require grad")\n        return np.full'), None,
     r'dry inference with a chunk tail \(2 rows, expected delay 1\) failed: RuntimeError: element 0'),
    ('bad_chunk', GOOD.replace('(4, 2)', '(4, 3)'), None, r'bad chunk.*\(4, 3\)'),
    ('nan_chunk', GOOD.replace('self.scale, np.float32', 'np.nan, np.float32'), None, 'non-finite'),
    ('bad_config', GOOD, 'scale: 1\nunknown_kw: 3\n', "constructing the policy failed: TypeError.*unknown_kw"),
    ('missing_dep', GOOD.replace('self.scale = scale', 'raise seq_missing()'), None, 'missing dependency: torch'),
])
def test_deploy_rejects_what_would_fail_at_serve_time(tmp_path, seq_home, name, text, config, message):
    if name == 'missing_dep':
        text = text.replace(HEADER, HEADER + 'from sequence_ai_ros.exceptions import MissingDependency\n'
                            'def seq_missing():\n    return MissingDependency("torch is not installed")\n')
    path = write(tmp_path, name, text, config)
    with pytest.raises(DeploymentError, match=message):
        deploy(path)
    assert Registry().list() == []


def test_serving_refuses_a_policy_changed_since_deploy(tmp_path, seq_home):
    path = write(tmp_path, 'good', GOOD)
    deploy(path)
    path.write_text(GOOD.replace('self.scale, ', '2 * self.scale, '))
    with pytest.raises(DeploymentError, match='changed since version 1'):
        create_server(['good'])
    with pytest.raises(UnknownDeployment, match='nope'):
        create_server(['nope'])


def test_usage_is_metered_and_persisted(tmp_path, seq_home, capsys):
    deploy(POLICIES / 'fast.py', name='fast')
    server = create_server(['fast'])
    ch = channel(server.port)
    stub = pb_grpc.PolicyServiceStub(ch)
    handshake(stub, 'fast')
    handshake(stub, 'fast')
    assert wait_ready(stub, 'fast').ready
    names = [f'j{i}' for i in range(26)]
    for eid in ('u1', 'u2'):
        s = Stream(stub, 'fast', eid)
        s.start()
        for rid in range(1, 6):
            assert s.ask(state_request(rid, np.zeros(26), names)).HasField('chunk')
        s.end()
    ch.close()
    server.stop()
    u = read_usage(seq_home / 'usage.sqlite')['fast']
    assert (u.sessions, u.episodes, u.requests) == (2, 2, 10)
    assert u.inference_s > 0 and u.warming_s > 0
    assert server.usage()['fast'].requests == 10
    # capture is off: the worker recorded both runs in its store's index, and bills no capture storage
    assert (seq_home / 'capture' / 'fast').is_dir()
    code, out, _ = run(capsys, 'usage')
    assert code == 0 and re.search(r'^fast\s', out, re.M) and 'capture:' not in out, out


def test_cli_deploy_deployments_usage_delete(tmp_path, seq_home, capsys):
    path = write(tmp_path, 'good', GOOD)
    code, out, _ = run(capsys, 'deploy', str(path))
    assert code == 0 and 'deployed good version 1' in out and 'seq serve good' in out
    code, out, _ = run(capsys, 'deploy', str(path), '--force')
    assert 'version 2' in out
    code, out, err = run(capsys, 'deploy', str(write(tmp_path, 'bad', GOOD.replace('dt=0.05', 'dt=-1'))))
    assert code == 2 and 'dt must be a positive' in err
    code, out, _ = run(capsys, 'deployments')
    assert re.search(r'good\s+2\s+joint_delta\s+2\s+4', out) and 'bad' not in out
    capture = seq_home / 'capture' / 'good'
    (capture / 'episodes' / 'e1').mkdir(parents=True)
    (capture / 'episodes' / 'e1' / 'blob').write_bytes(b'x' * 1000)
    (capture / 'index.sqlite').write_bytes(b'x' * 5000)   # the runs index is not captured data
    code, out, _ = run(capsys, 'usage')
    assert code == 0 and re.search(r'^good\s', out, re.M)
    if importlib.util.find_spec('sequence_ai_ros.capture.store') is not None:  # stored bytes come from the store
        assert re.search(r'capture:good\s+1000 bytes stored', out), out
    code, _, err = run(capsys, 'delete', 'good')   # field data: not removed without being asked (no terminal here)
    assert code == 2 and 'pass --yes' in err and '--keep-data' in err and capture.exists() and Registry().list()
    assert err.startswith('seq delete: error: good has 1000 bytes of captured field data'), err   # as every error
    code, out, _ = run(capsys, 'delete', 'good', '--yes')
    assert code == 0 and not capture.exists() and Registry().list() == []
    code, _, err = run(capsys, 'delete', 'good')
    assert code == 2 and "no deployment 'good'" in err


def test_seq_deploy_of_the_registered_content_says_unchanged_and_registers_nothing_unless_forced(
        tmp_path, seq_home, capsys):
    path = write(tmp_path, 'same', ARTIFACT, config='scale: 2.5\n')
    (path.parent / 'ckpt').mkdir()
    (path.parent / 'ckpt' / 'model.safetensors').write_bytes(b'\0' * 4096)
    assert run(capsys, 'deploy', str(path))[0] == 0
    registry = seq_home / 'deployments.json'
    before = registry.read_text()
    code, out, err = run(capsys, 'deploy', str(path))
    assert code == 0 and out.startswith('unchanged: same version 1 ('), (out, err)
    assert 'deployed' not in out and registry.read_text() == before            # nothing registered
    for isolation in ('process', 'none'):
        code, out, _ = run(capsys, 'deploy', str(path), '--isolation', isolation)
        assert code == 0 and out.startswith('unchanged: same version 1 ('), out
    code, out, _ = run(capsys, 'deploy', str(path), '--force')
    assert code == 0 and 'deployed same version 2 (' in out, out
    assert run(capsys, 'deploy', str(path))[1].startswith('unchanged: same version 2 (')
    (path.parent / 'ckpt' / 'model.safetensors').write_bytes(b'\1' * 4096)   # another checkpoint: a new version
    code, out, _ = run(capsys, 'deploy', str(path))
    assert code == 0 and 'deployed same version 3 (' in out, out
    (path.parent / 'config.yaml').write_text('scale: 3.0\n')
    assert 'deployed same version 4 (' in run(capsys, 'deploy', str(path))[1]
    other = write(tmp_path, 'elsewhere', ARTIFACT, config='scale: 3.0\n')    # the same content from another folder
    (other.parent / 'ckpt').mkdir()
    (other.parent / 'ckpt' / 'model.safetensors').write_bytes(b'\1' * 4096)
    assert 'deployed same version 5 (' in run(capsys, 'deploy', str(other), '--name', 'same')[1]


def test_a_seq_home_that_cannot_be_created_is_a_typed_error(tmp_path, monkeypatch, capsys):
    path = write(tmp_path, 'good', GOOD)
    (tmp_path / 'file').write_text('')           # $SEQ_HOME below a file (as below a folder the user cannot write)
    monkeypatch.setenv('SEQ_HOME', str(tmp_path / 'file' / 'home'))
    code, _, err = run(capsys, 'deploy', str(path))
    assert code == 2 and err.startswith('seq deploy: error: $SEQ_HOME ') and str(tmp_path / 'file' / 'home') in err, err
    assert 'Traceback' not in err


def test_cli_init_copies_a_template(tmp_path, capsys, monkeypatch):
    code, out, _ = run(capsys, 'init', '--list')
    templates = [line.split()[0] for line in out.splitlines() if line.strip()]
    assert code == 0 and {'hold', 'replay', 'ridge', 'lerobot', 'pi05-droid'} <= set(templates), out
    monkeypatch.chdir(tmp_path)
    code, out, _ = run(capsys, 'init', templates[0], 'mine')
    assert code == 0 and (tmp_path / 'mine' / 'policy.py').is_file()
    code, _, err = run(capsys, 'init', templates[0], 'mine')
    assert code == 2 and 'not empty' in err
    code, _, err = run(capsys, 'init', 'no-such-template', 'x')
    assert code == 2 and 'unknown template' in err


def test_bad_names_are_refused(tmp_path, seq_home):
    with pytest.raises(ConfigError, match='deployment name'):
        deploy(write(tmp_path, 'good', GOOD), name='../evil')


@pytest.mark.slow
def test_seq_serve_process_prints_its_address_and_stops_on_sigterm(tmp_path, seq_home, processes):
    deploy(POLICIES / 'fast.py', name='fast')
    token = tmp_path / 'token'
    token.write_text('tok\n')
    proc = processes.python('import sys; from sequence_ai_ros.cli.serving import main; sys.exit(main())',
                            'serve', 'fast', '--port', '0', '--token-file', str(token), '--idle-timeout', '5')
    line = proc.stdout.readline()
    match = re.match(r'serving fast on 127\.0\.0\.1:(\d+)', line)
    assert match, (line, proc.stderr.read() if proc.poll() is not None else '')
    with channel(int(match.group(1))) as ch:
        assert handshake(pb_grpc.PolicyServiceStub(ch), 'fast',
                         metadata=[('authorization', 'Bearer tok')]).action_dim == 26
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=15) == 0
    assert 'stopping' in proc.stdout.read()


@pytest.mark.parametrize('value', ['inf', 'nan', '0', '-3', 'abc', '1e9'])
def test_deploy_timeout_out_of_range_is_refused_by_argparse(tmp_path, seq_home, capsys, value):
    """`seq deploy --timeout inf` was an OverflowError traceback from the thread join."""
    path = write(tmp_path, 'good', GOOD)
    with pytest.raises(SystemExit) as exit_info:
        run(capsys, 'deploy', str(path), '--timeout', value)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and '--timeout' in err and 'expected seconds, 0 < S <= 86400' in err, err
    assert Registry().list() == []


BATCHED = HEADER + textwrap.dedent('''
    @seq.policy(action_space='joint_absolute', action_names=['x', 'y'], dt=0.05, chunk_length=4,
                batching=seq.Batching(max_batch_size=4, max_wait_s=0.001))
    class P:
        def infer(self, inp, episode):
            return self.infer_batch([inp], [episode])[0]

        def infer_batch(self, inputs, episodes):
            if any(len(inp.chunk_tail) for inp in inputs) and len(inputs) > 1:
                raise RuntimeError('element 0 of tensors does not require grad')
            return [np.zeros((4, 2), np.float32) for _ in inputs]
''')


def test_the_batched_dry_run_sends_a_tail_when_the_single_one_does(tmp_path, seq_home):
    """A batched in-painting path that fails is refused at deploy, as the single one is."""
    with pytest.raises(DeploymentError, match=r'dry batched inference with a chunk tail \(2 rows\) failed: '
                                              r'RuntimeError: element 0'):
        deploy(write(tmp_path, 'batched', BATCHED))
    assert Registry().list() == []
