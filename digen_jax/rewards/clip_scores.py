"""CLIP-based rewards: PickScore, HPSv2.1, CLIPScore and the LAION aesthetic predictor.

Each scorer is a pure, jittable function `score(params, images, prompt_tokens) -> (B,)`
(built by `make_score_fn`), so it can run on whichever devices hold `params`, plus a host
wrapper registered in the reward registry. Outputs, as the reference scorers define them
(e = L2-normalised embedding, s = exp(logit_scale)):

| reward      | model                      | image pipeline                                 | output                  |
|-------------|----------------------------|------------------------------------------------|-------------------------|
| `pickscore` | PickScore_v1 (ViT-H/14)    | CLIPImageProcessor (PIL bicubic, center crop)  | s * <e_img, e_txt> / 26 |
| `hpsv2`     | HPS v2.1 (open_clip H/14)  | longest side to 224, black pad (PIL bicubic)   | <e_img, e_txt>          |
| `clipscore` | openai CLIP ViT-L/14       | float tensor: bilinear antialias, center crop  | s * <e_img, e_txt> / 30 |
| `aesthetic` | CLIP ViT-L/14 + MLP head   | CLIPImageProcessor                             | MLP(e_img), about 1-10  |

For the openai checkpoint s = 100, so CLIPScore is 100 * cos / 30. The aesthetic head is five
linear layers 768-1024-128-64-16-1 with no nonlinearity between them (the reference's dropouts
are inactive at inference).

Video: (B, T, H, W, 3) inputs are scored per frame on frames `0, stride, 2 * stride, ...`
and averaged over those frames.

Prompts are tokenised on the host: by a transformers CLIP tokenizer in a local folder
(option `tokenizer_dir`; default `<checkpoint_dir>/tokenizer` when it exists), by a
callable (option `tokenizer`), or taken from `metadata[i]['prompt_tokens']`.
"""
from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any, Callable, Mapping, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from digen_jax.models import clip, layers
from digen_jax.models.checkpoints import load_checkpoint
from digen_jax.models.conversion import ParamBuilder, linear_rules
from digen_jax.rewards.registry import RewardFn, register_reward, to_uint8_images

AESTHETIC_HEAD_DIR = "aesthetic_head"
AESTHETIC_WIDTHS = (1024, 128, 64, 16, 1)
# The reference's nn.Sequential indices of its five Linear layers (dropouts in between).
AESTHETIC_TORCH_INDICES = (0, 2, 4, 6, 7)
TOKENIZER_SUBDIR = "tokenizer"


@dataclasses.dataclass(frozen=True)
class Scorer:
    """How one reward turns CLIP embeddings into a scalar."""

    name: str
    preprocess: clip.ImagePreprocess
    head: str  # 'similarity' (uses text) | 'aesthetic' (image only)
    use_logit_scale: bool  # multiply the cosine by exp(logit_scale)
    divisor: float
    quantize_uint8: bool  # the reference sees uint8 (PIL) pixels
    convert_hint: str


SCORERS = {
    "pickscore": Scorer(
        "pickscore", clip.TRANSFORMERS_PROCESSOR, "similarity", True, 26.0, True,
        "--transformers_dir=<PickScore_v1 folder>",
    ),
    "hpsv2": Scorer(
        "hpsv2", clip.HPS_VAL, "similarity", False, 1.0, True,
        "--open_clip_checkpoint=<HPS_v2.1_compressed.pt> --variant=ViT-H-14",
    ),
    "clipscore": Scorer(
        "clipscore", clip.TENSOR_RESIZE, "similarity", True, 30.0, False,
        "--transformers_dir=<clip-vit-large-patch14 folder>",
    ),
    "aesthetic": Scorer(
        "aesthetic", clip.TRANSFORMERS_PROCESSOR, "aesthetic", False, 1.0, True,
        "--transformers_dir=<clip-vit-large-patch14 folder> --aesthetic_head=<sac+logos+ava1-l14-linearMSE.pth>",
    ),
}


class AestheticHead(nn.Module):
    """The LAION aesthetic MLP: linear layers 768-1024-128-64-16-1, no activations."""

    param_dtype: str = "float32"

    @nn.compact
    def __call__(self, embedding):
        x = embedding.astype(jnp.float32)
        for i, width in enumerate(AESTHETIC_WIDTHS):
            axes = ("projection" if i == 0 else "mlp", "mlp")
            dense = layers.logical_dense(
                width, axes, name=f"dense_{i}", dtype=jnp.float32, param_dtype=jnp.dtype(self.param_dtype)
            )
            x = dense(x)
        return x[:, 0]


def aesthetic_head_params(weights, embed_dim: int = 768, source: str = "aesthetic head") -> dict:
    """Convert the reference MLP's state dict ((key, array) pairs) into `AestheticHead` params."""
    abstract = jax.eval_shape(
        lambda: AestheticHead().init(jax.random.key(0), jnp.zeros((1, embed_dim)))
    )["params"]
    rules = []
    for i, torch_index in enumerate(AESTHETIC_TORCH_INDICES):
        rules += linear_rules((f"dense_{i}",), f"layers.{torch_index}")
    builder = ParamBuilder(rules, abstract, dtype=np.float32, source=source)
    for key, array in weights:
        builder.add(key, array)
    return builder.finish()


def make_score_fn(scorer: Scorer, cfg: clip.CLIPConfig) -> Callable:
    """The pure score function `score(params, images, prompt_tokens) -> (B,) float32`.

    `params` is {'clip': CLIP params} plus {'head': AestheticHead params} for the aesthetic
    scorer; `images` (B, H, W, 3) uint8 or [0, 1] float; `prompt_tokens` (B, L) int ids
    (ignored by the aesthetic scorer, may be None). Jittable; sharding follows `params`.
    """
    model = clip.CLIPModel(cfg)
    spec = dataclasses.replace(scorer.preprocess, size=cfg.image_size)

    def score(params, images, prompt_tokens):
        pixels = clip.preprocess_images(images, spec).astype(cfg.kw["dtype"])
        variables = {"params": params["clip"]}
        image = clip.normalized(model.apply(variables, pixels, method=clip.CLIPModel.encode_image))
        if scorer.head == "aesthetic":
            return AestheticHead().apply({"params": params["head"]}, image) / scorer.divisor
        text = clip.normalized(model.apply(variables, prompt_tokens, method=clip.CLIPModel.encode_text))
        cosine = jnp.sum(image * text, axis=-1)
        if scorer.use_logit_scale:
            cosine = jnp.exp(model.apply(variables, method=clip.CLIPModel.logit_scale).astype(jnp.float32)) * cosine
        return cosine / scorer.divisor

    return score


@functools.lru_cache(maxsize=None)
def jitted_score_fn(scorer: Scorer, cfg: clip.CLIPConfig) -> Callable:
    """`jax.jit(make_score_fn(scorer, cfg))`, shared by every reward built for the same
    scorer and config (one compilation per input shape, however many rewards exist)."""
    return jax.jit(make_score_fn(scorer, cfg))


def frame_batch(images: np.ndarray, frame_stride: int) -> tuple[np.ndarray, int]:
    """(B, H, W, 3) or (B, T, H, W, 3) -> ((B * T', H, W, 3), T'), T' = frames 0, stride, ..."""
    if images.ndim == 4:
        return images, 1
    if images.ndim != 5:
        raise ValueError(f"images must be (B, H, W, 3) or (B, T, H, W, 3), got shape {images.shape}")
    if frame_stride < 1:
        raise ValueError(f"reward option frame_stride must be >= 1, got {frame_stride}")
    frames = images[:, ::frame_stride]
    return frames.reshape(-1, *frames.shape[2:]), frames.shape[1]


def _checked_float_images(images: np.ndarray) -> np.ndarray:
    if images.dtype == np.uint8:
        return images
    if not jnp.issubdtype(images.dtype, jnp.floating):
        raise ValueError(f"images must be uint8 or float in [0, 1], got dtype {images.dtype}")
    images = images.astype(np.float32)
    if not np.isfinite(images).all():
        raise ValueError("images contain NaN or inf pixels")
    return np.clip(images, 0.0, 1.0)


def prompt_tokens(tokenize, prompts, metadata, context_length: int) -> np.ndarray:
    """(B, <= context_length) int32 token ids of `prompts`: from `tokenize(prompts, context_length)`,
    else from every `metadata[i]['prompt_tokens']`; ValueError naming the options otherwise."""
    if tokenize is not None:
        return np.asarray(tokenize(list(prompts), context_length), np.int32)
    if metadata and all("prompt_tokens" in m for m in metadata):
        tokens = np.asarray([m["prompt_tokens"] for m in metadata], np.int32)
        if tokens.ndim != 2 or tokens.shape[1] > context_length:
            raise ValueError(f"metadata prompt_tokens must be (B, <= {context_length}) ids, got shape {tokens.shape}")
        return tokens
    raise ValueError(
        "this reward needs token ids: set the reward option tokenizer_dir (a local tokenizer folder of the reward model), "
        "pass tokenizer=fn(prompts, context_length), or give metadata[i]['prompt_tokens']"
    )


def current_device() -> jax.Device:
    """The device this thread places new arrays on: `jax.default_device`'s, else the first local one."""
    device = jax.config.jax_default_device
    return device if isinstance(device, jax.Device) else jax.local_devices(backend=device)[0]


def build_clip_reward(
    scorer: Scorer,
    cfg: clip.CLIPConfig,
    params: Mapping[str, Any],
    *,
    tokenizer: Callable | None = None,
    frame_stride: int = 1,
) -> RewardFn:
    """Host wrapper: a registry `RewardFn` around the jitted score function.

    Scores on the calling thread's default device (`jax.default_device`; the executor sets the
    reward role's device there), with `params` copied to each such device once.
    """
    score = jitted_score_fn(scorer, cfg)
    placed = {}  # device -> params on it

    def reward(images: Any, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]) -> np.ndarray:
        array = np.asarray(images)
        batch = array.shape[0]
        frames, per_sample = frame_batch(array, frame_stride)
        if scorer.quantize_uint8:
            frames = to_uint8_images(frames)
        else:
            frames = _checked_float_images(frames)
        tokens = None
        if scorer.head != "aesthetic":
            tokens = prompt_tokens(tokenizer, prompts, metadata, cfg.context_length)
            if len(tokens) != batch:
                raise ValueError(f"got {batch} images but {len(tokens)} prompts")
            tokens = np.repeat(tokens, per_sample, axis=0)
        device = current_device()
        if device not in placed:
            placed[device] = jax.device_put(params, device)
        scores = np.asarray(score(placed[device], frames, tokens), np.float32)
        return scores.reshape(batch, per_sample).mean(axis=1)

    return reward


def load_clip_reward(
    name: str,
    checkpoint_dir: str | None = None,
    *,
    tokenizer_dir: str | None = None,
    tokenizer: Callable | None = None,
    frame_stride: int = 1,
    dtype: str = "float32",
) -> RewardFn:
    """Build the registered CLIP reward `name` from a checkpoint written by convert/clip_to_orbax.py."""
    scorer = SCORERS[name]
    hint = f"`python convert/clip_to_orbax.py {scorer.convert_hint} --out=DIR`"
    if checkpoint_dir is None:
        raise ValueError(
            f"reward {name!r} needs the option checkpoint_dir: a converted CLIP checkpoint; make one with {hint}"
        )
    if not os.path.exists(os.path.join(checkpoint_dir, "model.json")):
        raise FileNotFoundError(
            f"reward {name!r}: no converted CLIP checkpoint at {checkpoint_dir}; make one with {hint}"
        )
    family, cfg, clip_params = load_checkpoint(checkpoint_dir, dtype=dtype, param_dtype=dtype)
    if family.module_cls is not clip.CLIPModel:
        raise ValueError(f"reward {name!r}: {checkpoint_dir} holds a {family.name} model, not CLIP")
    params = {"clip": clip_params}
    if scorer.head == "aesthetic":
        head_dir = os.path.join(os.path.abspath(checkpoint_dir), AESTHETIC_HEAD_DIR)
        if not os.path.isdir(head_dir):
            raise FileNotFoundError(f"reward 'aesthetic': {head_dir} missing; convert the MLP head with {hint}")
        params["head"] = ocp.StandardCheckpointer().restore(head_dir)
    if tokenizer is None and scorer.head != "aesthetic":
        default_dir = os.path.join(checkpoint_dir, TOKENIZER_SUBDIR)
        tokenizer_dir = tokenizer_dir or (default_dir if os.path.isdir(default_dir) else None)
        if tokenizer_dir is not None:
            tokenizer = clip.load_tokenizer(tokenizer_dir)
    return build_clip_reward(SCORERS[name], cfg, params, tokenizer=tokenizer, frame_stride=frame_stride)


def _register(name: str, summary: str) -> None:
    def factory(checkpoint_dir: str | None = None, **options) -> RewardFn:
        return load_clip_reward(name, checkpoint_dir, **options)

    factory.__doc__ = (
        f"{summary} Options: checkpoint_dir (required), tokenizer_dir, tokenizer, frame_stride, dtype."
    )
    register_reward(name)(factory)


_register("pickscore", "PickScore: exp(logit_scale) * cosine / 26.")
_register("hpsv2", "HPSv2.1: cosine of the open_clip ViT-H/14 embeddings.")
_register("clipscore", "CLIPScore: exp(logit_scale) * cosine / 30 (100 * cosine / 30 for openai CLIP).")
_register("aesthetic", "LAION aesthetic predictor on the normalised CLIP ViT-L/14 image embedding.")
