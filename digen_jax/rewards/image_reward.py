"""ImageReward (Xu et al., NeurIPS 2023): BLIP features of (prompt, image) scored by an MLP.

As the `image-reward` package computes it (`ImageReward.score` / `score_gard`):

    tokens = BertTokenizer(prompt, padding='max_length', truncation=True, max_length=35)
    pixels = Resize(224, bicubic) + CenterCrop(224) + Normalize(CLIP mean, std) of the PIL image
    feature = BLIP text encoder's [CLS] state, cross-attending to the BLIP ViT-L image tokens
    reward = (MLP(feature) - 0.16717362830052426) / 1.0333394966054072

The MLP is five linear layers 768-1024-128-64-16-1 without activations (its dropouts are
inactive at inference), the same head as the LAION aesthetic predictor
(`clip_scores.AestheticHead`). The mean and std standardise the raw score over the
package's training set, so rewards are about N(0, 1) across its prompts. The backbone is
`digen_jax.models.image_reward`; images are preprocessed on the device (PIL-exact bicubic).

Prompts are tokenised on the host by a BERT tokenizer in a local folder (option
`tokenizer_dir`, default `<checkpoint_dir>/tokenizer`), by a callable (`tokenizer`), or taken
from `metadata[i]['prompt_tokens']`; padding is token id 0 ([PAD]), masked as the reference.
"""
from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any, Callable, Mapping, Sequence

import jax
import numpy as np
import orbax.checkpoint as ocp

from digen_jax.models import clip
from digen_jax.models import image_reward as model_lib
from digen_jax.models.checkpoints import load_checkpoint
from digen_jax.rewards.clip_scores import (
    TOKENIZER_SUBDIR,
    AestheticHead,
    current_device,
    frame_batch,
    prompt_tokens,
)
from digen_jax.rewards.registry import RewardFn, register_reward, to_uint8_images

SCORE_MEAN = 0.16717362830052426
SCORE_STD = 1.0333394966054072
HEAD_DIR = "mlp_head"
PAD_ID = 0
# torchvision Resize(224, BICUBIC) on a PIL image is PIL's resize; CenterCrop rounds half to even.
PREPROCESS = clip.ImagePreprocess(crop_rounding="half_even")
CONVERT_HINT = ("`python convert/image_reward_to_orbax.py --checkpoint=<ImageReward.pt> "
                "--tokenizer_dir=<bert-base-uncased folder> --out=DIR`")


def make_score_fn(cfg: model_lib.ImageRewardConfig) -> Callable:
    """The pure score `score(params, images, input_ids, attention_mask) -> (B,) float32`.

    `params` is {'model': ImageRewardModel params, 'head': AestheticHead params}; `images`
    (B, H, W, 3) uint8 or [0, 1] float; `input_ids`, `attention_mask` (B, L) ints. Jittable.
    """
    model = model_lib.ImageRewardModel(cfg)
    spec = dataclasses.replace(PREPROCESS, size=cfg.image_size)

    def score(params, images, input_ids, attention_mask):
        pixels = clip.preprocess_images(images, spec).astype(cfg.kw["dtype"])
        feature = model.apply({"params": params["model"]}, pixels, input_ids, attention_mask)
        raw = AestheticHead().apply({"params": params["head"]}, feature)
        return (raw - SCORE_MEAN) / SCORE_STD

    return score


@functools.lru_cache(maxsize=None)
def jitted_score_fn(cfg: model_lib.ImageRewardConfig) -> Callable:
    """`jax.jit(make_score_fn(cfg))`, one per config (compiled once per input shape)."""
    return jax.jit(make_score_fn(cfg))


def build_image_reward(
    cfg: model_lib.ImageRewardConfig,
    params: Mapping[str, Any],
    *,
    tokenizer: Callable | None = None,
    frame_stride: int = 1,
) -> RewardFn:
    """Host wrapper: a registry `RewardFn` around the jitted score, on the calling thread's
    default device (params copied there once), video frames averaged as the CLIP rewards do."""
    score = jitted_score_fn(cfg)
    placed = {}  # device -> params on it

    def reward(images: Any, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]) -> np.ndarray:
        array = np.asarray(images)
        batch = array.shape[0]
        frames, per_sample = frame_batch(array, frame_stride)
        frames = to_uint8_images(frames)  # the reference sees PIL (uint8) images
        ids = prompt_tokens(tokenizer, prompts, metadata, cfg.context_length)
        if len(ids) != batch:
            raise ValueError(f"got {batch} images but {len(ids)} prompts")
        ids = np.repeat(ids, per_sample, axis=0)
        device = current_device()
        if device not in placed:
            placed[device] = jax.device_put(params, device)
        scores = np.asarray(score(placed[device], frames, ids, (ids != PAD_ID).astype(np.int32)), np.float32)
        return scores.reshape(batch, per_sample).mean(axis=1)

    return reward


@register_reward("image_reward")
def load_image_reward(
    checkpoint_dir: str | None = None,
    *,
    tokenizer_dir: str | None = None,
    tokenizer: Callable | None = None,
    frame_stride: int = 1,
    dtype: str = "float32",
) -> RewardFn:
    """ImageReward from a checkpoint written by convert/image_reward_to_orbax.py.

    Options: checkpoint_dir (required), tokenizer_dir, tokenizer, frame_stride, dtype.
    """
    if checkpoint_dir is None:
        raise ValueError(f"reward 'image_reward' needs the option checkpoint_dir: a converted checkpoint; "
                         f"make one with {CONVERT_HINT}")
    if not os.path.exists(os.path.join(checkpoint_dir, "model.json")):
        raise FileNotFoundError(f"reward 'image_reward': no converted checkpoint at {checkpoint_dir}; "
                                f"make one with {CONVERT_HINT}")
    family, cfg, model_params = load_checkpoint(checkpoint_dir, dtype=dtype, param_dtype=dtype)
    if family is not model_lib.FAMILY:
        raise ValueError(f"reward 'image_reward': {checkpoint_dir} holds a {family.name} model, not ImageReward")
    head_dir = os.path.join(os.path.abspath(checkpoint_dir), HEAD_DIR)
    if not os.path.isdir(head_dir):
        raise FileNotFoundError(f"reward 'image_reward': {head_dir} missing; convert again with {CONVERT_HINT}")
    params = {"model": model_params, "head": ocp.StandardCheckpointer().restore(head_dir)}
    if tokenizer is None:
        default_dir = os.path.join(checkpoint_dir, TOKENIZER_SUBDIR)
        tokenizer_dir = tokenizer_dir or (default_dir if os.path.isdir(default_dir) else None)
        if tokenizer_dir is not None:
            tokenizer = clip.load_tokenizer(tokenizer_dir)
    return build_image_reward(cfg, params, tokenizer=tokenizer, frame_stride=frame_stride)
