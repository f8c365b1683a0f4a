"""The ridge model and ``seq train ridge`` on the real G1 dataset (train episodes 0-4, evaluate on 5)."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import numpy as np
import pytest

from sequence_ai_ros.cli import build_parser
from sequence_ai_ros.datasets.lerobot_reader import LeRobotDataset
from sequence_ai_ros.exceptions import ConfigError, ExportError
from sequence_ai_ros.models import ridge
from sequence_ai_ros.models import ridge_training as training

# one worker runs this module under xdist, so the module-scoped training runs once, not once per worker
pytestmark = pytest.mark.xdist_group('ridge_training')


@pytest.fixture(scope='module')
def trained(g1_root: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """Run the real ``seq train ridge`` once (episodes 0-4, eval 5); return (out dir, printed text)."""
    out = tmp_path_factory.mktemp('train') / 'g1-ridge'
    args = build_parser().parse_args(['train', 'ridge', '--dataset', str(g1_root), '--episodes', '0-4',
                                      '--eval-episodes', '5', '--out', str(out)])
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert args.func(args) == 0
    return out, buf.getvalue()


@pytest.fixture(scope='module')
def g1_root() -> Path:
    """The real G1 dataset (as ``g1_dataset``), module-scoped: one training run serves the tests here."""
    from conftest import G1_DATASET

    if not (G1_DATASET / 'meta' / 'info.json').exists():
        pytest.skip(f'real G1 dataset not found at {G1_DATASET}')
    return G1_DATASET


@pytest.mark.slow
def test_ridge_beats_hold_state_and_mean_action(trained: tuple[Path, str]) -> None:
    out, text = trained
    metrics = json.loads((out / 'metrics.json').read_text())
    e = metrics['errors']
    print(f'\nG1 episode 5, MAE over H=30 actions: ridge {e["ridge"]:.5f}  hold_state {e["hold_state"]:.5f}  '
          f'hold_last_action {e["hold_last_action"]:.5f}  mean_action {e["mean_action"]:.5f}')
    assert e['ridge'] < e['hold_state']
    assert e['ridge'] < e['mean_action']
    # seq train prints all four errors and the feature table
    for name in ('ridge', 'hold_state', 'hold_last_action', 'mean_action'):
        assert f'{name:18s} {e[name]:.5f}' in text
    assert 'per-joint residual: tracking_error + velocity' in text and 'cv_mae' in text
    assert metrics['episodes'] == [0, 1, 2, 3, 4] and metrics['eval_episodes'] == [5]
    # the chosen row is the one with the lowest cross-validated error (never the eval episode)
    rows = [r for r in metrics['table'] if not r['features'].startswith('baseline')]
    best = min(rows, key=lambda r: r['cv_mae'])
    assert best['eval_mae'] == pytest.approx(e['ridge'])


@pytest.mark.slow
def test_the_templates_readme_shows_what_seq_train_measures(trained: tuple[Path, str]) -> None:
    """Every CV and eval figure in the ridge README's feature table is the one ``seq train`` prints now."""
    import re

    out, _ = trained
    table = json.loads((out / 'metrics.json').read_text())['table']
    readme = (training.TEMPLATE_DIR / 'README.md').read_text()
    shown = re.findall(r'^\| .*? \| [^|]+ \| \**(0\.\d{5})\** \| (0\.\d{5}) \|$', readme, re.M)
    measured = [(f'{r["cv_mae"]:.5f}', f'{r["eval_mae"]:.5f}') for r in table]
    assert shown == measured, 'update the table in sequence_ai_ros/templates/ridge/README.md'


@pytest.mark.slow
def test_train_writes_a_deployable_folder(trained: tuple[Path, str]) -> None:
    out, text = trained
    assert sorted(p.name for p in out.iterdir()) == ['README.md', 'config.yaml', 'metrics.json', 'model.npz',
                                                     'policy.py']
    assert (out / 'policy.py').read_bytes() == (training.TEMPLATE_DIR / 'policy.py').read_bytes()
    assert f'seq deploy {out}/policy.py' in text
    model = ridge.RidgeModel.load(out / 'model.npz')
    assert model.horizon == 30 and model.dt == pytest.approx(1 / 30) and len(model.action_names) == 26
    assert model.residual and not model.coupled
    with pytest.raises(ExportError, match='--force'):
        training.write_deployment(out, training.TrainResult(model, [], {}, 0.0))


@pytest.mark.slow
def test_serving_features_equal_training_features(trained: tuple[Path, str], g1_dataset: Path) -> None:
    """Frame by frame, predict() (what the policy calls) equals the batched rows training scored."""
    model = ridge.RidgeModel.load(trained[0] / 'model.npz')
    ep = LeRobotDataset(g1_dataset).episode(5)
    x = ridge.episode_channels(model.channel_names, ep.state, ep.action, model.dt)
    batch = model.predict_batch(x, ridge.last_actions(ep.state, ep.action), guard=True)
    assert batch.shape == (len(ep), 30, 26) and batch.dtype == np.float32
    # t = 0: no action executed yet, no previous state: last_action falls back to the state
    np.testing.assert_allclose(model.predict(ep.state[0], None, None, 0.0), batch[0], atol=1e-5)
    for t in (1, 57, 300):
        chunk = model.predict(ep.state[t], ep.action[t - 1], ep.state[t - 1], t * model.dt)
        np.testing.assert_allclose(chunk, batch[t], atol=1e-5)
    with pytest.raises(ConfigError, match='expects 26'):
        model.predict(np.zeros(7, np.float32))


def test_model_file_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match='seq train ridge'):
        ridge.RidgeModel.load(tmp_path / 'model.npz')
    (tmp_path / 'bad.npz').write_bytes(b'not an npz')
    with pytest.raises(ConfigError, match='unreadable'):
        ridge.RidgeModel.load(tmp_path / 'bad.npz')


def test_episode_ranges_and_bad_selections(g1_dataset: Path) -> None:
    assert training.parse_episodes('0-4') == [0, 1, 2, 3, 4]
    assert training.parse_episodes('5') == [5]
    assert training.parse_episodes('0,2,4-5') == [0, 2, 4, 5]
    for bad in ('', 'a', '4-2', '-1'):
        with pytest.raises(ConfigError):
            training.parse_episodes(bad)
    with pytest.raises(ConfigError, match='both train and eval'):
        training.train(g1_dataset, [0, 1], [1])
    with pytest.raises(ConfigError, match='no episode 9'):
        training.train(g1_dataset, [9], [])
    with pytest.raises(ConfigError, match='fewer than the horizon'):
        training.train(g1_dataset, [0], [], horizon=1000)


@pytest.mark.slow
def test_closed_loop_on_a_joint_that_does_not_follow_stays_bounded(trained: tuple[Path, str]) -> None:
    """Fed its own commands while the arm never moves, the served model stays in the guarded range."""
    out, _ = trained
    model = ridge.RidgeModel.load(out / 'model.npz')
    state = np.asarray(model.x_mean[:, model.channel_names.index('state')], np.float32)   # a typical pose
    last = state.copy()
    for k in range(300):   # 300 chunks: 5 minutes of a replayed bag whose state ignores the commands
        chunk = model.predict(state, last, state, elapsed_s=k * model.dt)
        last = chunk[0]
    assert np.all(chunk >= model.a_lo - 1e-5) and np.all(chunk <= model.a_hi + 1e-5)
    assert np.all(np.isfinite(chunk))


def test_saturated_ends_are_the_recorded_extremes_a_joint_repeats() -> None:
    action = np.array([[0.2, 0.0, -0.3], [1.0, 0.5, 0.1], [1.0, 0.0, 0.2], [0.7, 0.4, 0.4]], np.float32)
    lo, hi = ridge.saturated_ends(action)
    assert lo.tolist() == [False, True, False] and hi.tolist() == [True, False, False]
    lo, hi = ridge.saturated_ends(np.zeros((0, 3), np.float32))
    assert not lo.any() and not hi.any()


@pytest.mark.slow
def test_fed_its_own_commands_the_g1_model_never_leaves_the_hands_recorded_range(
        trained: tuple[Path, str], g1_dataset: Path) -> None:
    """The right hand sits at 1.0 (fully open) in the recording: predictions stop there, not half a range above.

    Replayed against the held-out episode's recorded states (which ignore the commands), the model's own
    commands stay inside the hands' 0..1 range on every joint the recording saturates.
    """
    out, _ = trained
    model = ridge.RidgeModel.load(out / 'model.npz')
    ds = LeRobotDataset(g1_dataset)
    recorded = np.concatenate([ds.episode(k).action for k in range(5)])
    sat_lo, sat_hi = ridge.saturated_ends(recorded)
    names = list(model.action_names)
    right_hand = [names.index(n) for n in ('kRightHandPinky', 'kRightHandRing', 'kRightHandMiddle',
                                            'kRightHandIndex', 'kRightHandThumbBend')]
    assert sat_hi[right_hand].all() and sat_lo[names.index('kRightHandThumbRotation')]
    np.testing.assert_array_equal(model.a_hi[sat_hi], recorded.max(axis=0)[sat_hi])
    np.testing.assert_array_equal(model.a_lo[sat_lo], recorded.min(axis=0)[sat_lo])
    assert np.all(model.a_hi[~sat_hi] > recorded.max(axis=0)[~sat_hi])   # elsewhere still widened
    ep = ds.episode(5)
    last, highest, lowest = None, np.full(len(names), -np.inf), np.full(len(names), np.inf)
    for t in range(1, len(ep.state)):
        chunk = model.predict(ep.state[t], last, ep.state[t - 1], elapsed_s=t * model.dt)
        last = chunk[0]
        highest, lowest = np.maximum(highest, chunk.max(axis=0)), np.minimum(lowest, chunk.min(axis=0))
    hands = slice(14, 26)
    assert np.all(highest[hands] <= 1.0) and np.all(lowest[hands] >= 0.0), (highest[hands], lowest[hands])


@pytest.mark.slow
def test_ridge_batches_give_each_robot_its_own_chunk(trained: tuple[Path, str], g1_dataset: Path) -> None:
    from sequence_ai_ros.datasets.lerobot_reader import LeRobotDataset
    from sequence_ai_ros.policy import Episode, load_policy_file
    from sequence_ai_ros.protocol import messages
    from sequence_ai_ros.protocol.types import Observation
    from sequence_ai_ros.worker.validate import dry_run

    out, _ = trained
    definition = load_policy_file(out / 'policy.py')
    assert definition.spec.batching is not None and definition.spec.batching.max_batch_size > 1
    dry_run(definition)  # seq deploy's dry run calls infer_batch too
    policy = definition.instantiate()
    policy.load()
    ep = LeRobotDataset(g1_dataset).episode(5)
    inputs, episodes = [], []
    for k, t in enumerate((40, 120, 200, 201)):
        hist = [Observation(state=ep.state[t - 1], timestamp=9.0)] if k % 2 else []
        now = Observation(state=ep.state[t], timestamp=10.0 + k)
        inputs.append(messages.PolicyInput(observation=now, history=[*hist, now], chunk_tail=np.zeros((0, 26)),
                                           expected_delay_actions=0, last_action=None if k == 3 else ep.action[t - 1],
                                           request_id=1, episode_id=f'e{k}'))
        episodes.append(Episode(id=f'e{k}', state={'t0': 10.0}))
    batch = policy.infer_batch(inputs, episodes)
    for inp, episode, chunk in zip(inputs, episodes, batch, strict=True):
        alone = policy.infer(inp, Episode(id='alone', state=dict(episode.state)))
        np.testing.assert_allclose(chunk, alone, atol=1e-6)
        prev = inp.history[-2].state if len(inp.history) >= 2 else None
        expected = policy.model.predict(inp.observation.state, inp.last_action, prev,
                                        elapsed_s=inp.observation.timestamp - 10.0)
        np.testing.assert_allclose(chunk, expected, atol=1e-6)
