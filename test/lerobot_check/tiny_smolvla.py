"""Build a tiny SmolVLA from LeRobot's real ``SmolVLAConfig``, fully offline, as a checkpoint directory.

Run with the LeRobot venv's python (``make check-lerobot`` does)::

    tiny_smolvla.py --dataset V21 --out DIR [--rtc-horizon 10]
    tiny_smolvla.py --hub DIR [--backbone JSON] [--words "open drawer"]   # the hub cache alone (make rtc-sim)

Writes, under ``DIR`` (nothing is downloaded; ``HF_HUB_OFFLINE=1``):

- ``hub/``: a Hugging Face hub cache holding ``HuggingFaceTB/SmolVLM2-500M-Video-Instruct`` as
  ``models--HuggingFaceTB--SmolVLM2-500M-Video-Instruct/snapshots/<rev>/``, the layout ``hf download REPO
  --cache-dir`` writes: the VLM backbone's ``config.json`` with tiny dimensions (SmolVLM: a 2-layer Llama
  text model, a 1-layer vision tower, 32x32 images) and its processor saved by the installed transformers
  (a WordLevel tokenizer made with ``tokenizers``, with SmolVLM's image tokens). SmolVLA builds its VLM from
  this config (``load_vlm_weights=False``, as LeRobot does when training the expert from scratch), exactly
  where it would find the real one.
- ``checkpoint/``: what ``lerobot-train`` writes as ``pretrained_model/``: ``config.json``,
  ``model.safetensors`` (random initialisation, seed 0) and the processor pipelines, with the G1
  dataset's features (26-D state and action, camera ``cam_high`` at 640x480) and normalisation statistics
  (aggregated from ``meta/episodes_stats.jsonl``), RTC enabled with ``--rtc-horizon``.

Prints the checkpoint directory, the hub cache and the parameter count as one JSON line. With ``--hub`` it
writes only the hub cache, of a backbone sized by ``--backbone`` (:class:`Backbone`'s fields as JSON; the
defaults are the tiny one) with ``--words`` added to the vocabulary, for ``lerobot-train`` to build its SmolVLA
from (``make rtc-sim``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from pathlib import Path

REPO_ID = 'HuggingFaceTB/SmolVLM2-500M-Video-Instruct'
REVISION = '0' * 40
#: SmolVLM's special tokens (what modeling_smolvla reads from the tokenizer), then a small word vocabulary
SPECIAL = {'pad_token': '<pad>', 'unk_token': '<unk>', 'bos_token': '<s>', 'eos_token': '</s>'}
EXTRA = {'fake_image_token': '<fake_token_around_image>', 'image_token': '<image>',
         'global_image_token': '<global-img>', 'end_of_utterance_token': '<end_of_utterance>'}
WORDS = ('pick the bottle up cup object put it on table and place red blue green left right a an to of in '
         'seq deploy dry run').split()
CAMERA = ('cam_high', 480, 640)   # name, height, width the checkpoint declares (the G1 dataset's own)


@dataclasses.dataclass(frozen=True)
class Backbone:
    """The SmolVLM backbone's sizes (a Llama text model, a SigLIP-style vision tower); defaults: the tiny one.

    :param image: the vision tower's input size (px, square); :param patch: its patch size (px).
    """

    text_hidden: int = 32
    text_intermediate: int = 64
    text_layers: int = 2
    text_heads: int = 4
    text_kv_heads: int = 2
    head_dim: int = 8
    vision_hidden: int = 16
    vision_intermediate: int = 32
    vision_layers: int = 1
    vision_heads: int = 2
    image: int = 32
    patch: int = 8


def place(hub: Path, size: Backbone = Backbone(), words: tuple[str, ...] = ()) -> Path:
    """Write the backbone into a hub cache ``hub`` as ``hf download REPO_ID --cache-dir hub`` lays it out.

    :param words: more whole words for the vocabulary (beside :data:`WORDS`).
    :returns: the snapshot directory.
    """
    repo_dir = hub / ('models--' + REPO_ID.replace('/', '--'))
    snapshot = repo_dir / 'snapshots' / REVISION
    snapshot.mkdir(parents=True, exist_ok=True)
    (repo_dir / 'refs').mkdir(exist_ok=True)
    (repo_dir / 'refs' / 'main').write_text(REVISION)
    backbone(snapshot, size, words)
    return snapshot


def backbone(snapshot: Path, size: Backbone = Backbone(), words: tuple[str, ...] = ()) -> None:
    """Write the SmolVLM config and processor into ``snapshot`` (saved by the installed transformers)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, SmolVLMConfig, SmolVLMImageProcessor, SmolVLMProcessor
    from transformers.models.smolvlm.video_processing_smolvlm import SmolVLMVideoProcessor

    tokens = [*SPECIAL.values(), *EXTRA.values(), '<row_1_col_1>', '<video>', *WORDS, *words]
    for r in range(1, 5):
        for c in range(1, 5):
            tokens.append(f'<row_{r}_col_{c}>')
    vocab = {t: i for i, t in enumerate(dict.fromkeys(tokens))}
    word = Tokenizer(models.WordLevel(vocab=vocab, unk_token=SPECIAL['unk_token']))
    word.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=word, **SPECIAL, extra_special_tokens=EXTRA)
    tok.add_special_tokens({'additional_special_tokens': list(EXTRA.values())})
    edge = {'longest_edge': size.image}
    image = SmolVLMImageProcessor(do_resize=False, do_image_splitting=False, size=edge, max_image_size=edge)
    video = SmolVLMVideoProcessor(size=edge, max_image_size=edge)
    image_seq_len = ((size.image // size.patch) ** 2) // (2 ** 2)
    SmolVLMProcessor(image_processor=image, tokenizer=tok, video_processor=video,
                     image_seq_len=image_seq_len).save_pretrained(snapshot)
    config = SmolVLMConfig(
        vision_config={'hidden_size': size.vision_hidden, 'intermediate_size': size.vision_intermediate,
                       'num_hidden_layers': size.vision_layers, 'num_attention_heads': size.vision_heads,
                       'image_size': size.image, 'patch_size': size.patch},
        text_config={'model_type': 'llama', 'vocab_size': len(vocab), 'hidden_size': size.text_hidden,
                     'intermediate_size': size.text_intermediate, 'num_hidden_layers': size.text_layers,
                     'num_attention_heads': size.text_heads, 'num_key_value_heads': size.text_kv_heads,
                     'head_dim': size.head_dim, 'max_position_embeddings': 256,
                     'pad_token_id': vocab[SPECIAL['pad_token']]},
        image_token_id=vocab[EXTRA['image_token']], scale_factor=2, pad_token_id=vocab[SPECIAL['pad_token']])
    config.save_pretrained(snapshot)


def dataset_features(dataset: Path) -> tuple[dict, dict, dict]:
    """(input features, output features, stats) for the G1 dataset: 26-D state/action, one camera."""
    import numpy as np
    from lerobot.configs import FeatureType, PolicyFeature
    from lerobot.datasets.compute_stats import aggregate_stats

    info = json.loads((dataset / 'meta' / 'info.json').read_text())
    d_state = int(info['features']['observation.state']['shape'][0])
    d_action = int(info['features']['action']['shape'][0])
    name, h, w = CAMERA
    inputs = {'observation.state': PolicyFeature(type=FeatureType.STATE, shape=(d_state,)),
              f'observation.images.{name}': PolicyFeature(type=FeatureType.VISUAL, shape=(3, h, w))}
    outputs = {'action': PolicyFeature(type=FeatureType.ACTION, shape=(d_action,))}
    per_episode = []
    for line in (dataset / 'meta' / 'episodes_stats.jsonl').read_text().splitlines():
        stats = json.loads(line)['stats']
        per_episode.append({k: {s: np.asarray(v, np.float64) for s, v in stats[k].items()}
                            for k in ('observation.state', 'action')})
    agg = aggregate_stats(per_episode)
    return inputs, outputs, {k: {s: np.asarray(v, np.float32) for s, v in st.items()} for k, st in agg.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--dataset', type=Path)
    parser.add_argument('--out', type=Path)
    parser.add_argument('--rtc-horizon', type=int, default=10)
    parser.add_argument('--hub', type=Path, help='write only the backbone into this hub cache')
    parser.add_argument('--backbone', type=json.loads, default={}, help='Backbone fields as JSON (with --hub)')
    parser.add_argument('--words', default='', help='more vocabulary words, space separated (with --hub)')
    args = parser.parse_args()
    if args.hub:
        os.environ.update(HF_HUB_OFFLINE='1', TRANSFORMERS_OFFLINE='1')
        snapshot = place(args.hub.resolve(), Backbone(**args.backbone), tuple(args.words.split()))
        print(json.dumps({'snapshot': str(snapshot)}))
        return 0
    if args.dataset is None or args.out is None:
        parser.error('--dataset and --out are required (or --hub)')
    out = args.out.resolve()
    hub = out / 'hub'
    # before any Hugging Face import: everything resolves in this cache, offline
    os.environ.update(HF_HUB_OFFLINE='1', TRANSFORMERS_OFFLINE='1', HF_HUB_CACHE=str(hub))
    place(hub)

    import torch
    from lerobot.policies.factory import make_pre_post_processors
    from lerobot.policies.rtc.configuration_rtc import RTCConfig
    from lerobot.policies.smolvla.configuration_smolvla import SmolVLAConfig
    from lerobot.policies.smolvla.modeling_smolvla import SmolVLAPolicy

    inputs, outputs, stats = dataset_features(args.dataset)
    torch.manual_seed(0)
    config = SmolVLAConfig(input_features=inputs, output_features=outputs, chunk_size=50, n_action_steps=50,
                           resize_imgs_with_padding=(32, 32), tokenizer_max_length=16, num_steps=10,
                           vlm_model_name=REPO_ID, load_vlm_weights=False, num_vlm_layers=2,
                           self_attn_every_n_layers=2, expert_width_multiplier=0.5, device='cpu',
                           rtc_config=RTCConfig(enabled=True, execution_horizon=args.rtc_horizon),
                           push_to_hub=False)
    policy = SmolVLAPolicy(config)
    ckpt = out / 'checkpoint'
    policy.save_pretrained(ckpt)
    pre, post = make_pre_post_processors(config, dataset_stats=stats)
    pre.save_pretrained(ckpt)
    post.save_pretrained(ckpt)
    params = sum(p.numel() for p in policy.parameters())
    print(json.dumps({'checkpoint': str(ckpt), 'hub_cache': str(hub), 'params': params}))
    return 0


if __name__ == '__main__':
    raise SystemExit(main())
