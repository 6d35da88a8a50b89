"""ImageReward's BLIP backbone in flax.linen: a ViT image encoder and a BERT text encoder that
cross-attends to the image, as the `image-reward` package (THUDM/ImageReward,
`ImageReward/models/BLIP/{vit,med}.py`) defines them. The module returns the text encoder's
[CLS] state, the feature ImageReward's MLP head scores (`digen_jax.rewards.image_reward`).

* Vision (BLIP ViT-L/16): pre-norm blocks (LayerNorm eps 1e-6, fused biased qkv, exact GELU
  MLP), a class token and learned positions, a final LayerNorm; no projection.
* Text (BLIP's "med" BERT, post-norm, LayerNorm eps 1e-12): word + absolute position
  embeddings and a LayerNorm, then per layer self-attention over the prompt (padding keys get
  -10000 added to their logits, as the reference), cross-attention from the text to every image
  token (the image mask is all ones), and a GELU feed-forward, each followed by a residual
  LayerNorm.

Differences from the PyTorch modules that do not change fp32 output: blocks are stacked and
run with `nn.scan`; pixels are NHWC and the patch convolution is a reshape and one matmul.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from digen_jax.models import layers, stacking
from digen_jax.models.conversion import ModelFamily, WeightRule, linear_rules


@dataclasses.dataclass(frozen=True)
class ImageRewardConfig:
    """Architecture of both encoders plus the execution policy."""

    image_size: int = 224
    patch_size: int = 16
    vision_width: int = 1024
    vision_layers: int = 24
    vision_heads: int = 16
    vision_mlp_ratio: float = 4.0
    vision_eps: float = 1e-6
    vocab_size: int = 30524  # bert-base-uncased plus BLIP's [DEC] and [ENC]
    context_length: int = 35  # ImageReward tokenises prompts to 35 tokens
    max_positions: int = 512
    text_width: int = 768
    text_layers: int = 12
    text_heads: int = 12
    text_intermediate: int = 3072
    text_eps: float = 1e-12
    # Execution policy: not part of the weights.
    dtype: str = "float32"
    param_dtype: str = "float32"

    def __post_init__(self):
        if self.image_size % self.patch_size:
            raise ValueError(f"ImageRewardConfig.image_size={self.image_size} must be a multiple of "
                             f"patch_size={self.patch_size}")
        for tower in ("vision", "text"):
            width, heads = getattr(self, f"{tower}_width"), getattr(self, f"{tower}_heads")
            if width % heads:
                raise ValueError(f"ImageRewardConfig.{tower}_width={width} must be a multiple of {tower}_heads={heads}")
        if self.context_length > self.max_positions:
            raise ValueError(f"ImageRewardConfig.context_length={self.context_length} exceeds "
                             f"max_positions={self.max_positions}")

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def kw(self) -> dict:
        return dict(dtype=jnp.dtype(self.dtype), param_dtype=jnp.dtype(self.param_dtype))


VARIANTS = {
    "ImageReward-v1.0": ImageRewardConfig(),
    "tiny": ImageRewardConfig(image_size=32, patch_size=8, vision_width=32, vision_layers=2, vision_heads=4,
                              vocab_size=99, context_length=12, max_positions=16, text_width=24, text_layers=2,
                              text_heads=4, text_intermediate=48),
}

_gelu = functools.partial(jax.nn.gelu, approximate=False)


def _layer_norm(cfg: ImageRewardConfig, eps: float, name: str) -> nn.LayerNorm:
    return nn.LayerNorm(
        epsilon=eps,
        dtype=jnp.float32,  # statistics in float32 whatever the compute dtype
        param_dtype=cfg.kw["param_dtype"],
        scale_init=nn.with_logical_partitioning(nn.initializers.ones_init(), ("embed",)),
        bias_init=nn.with_logical_partitioning(nn.initializers.zeros_init(), ("embed",)),
        name=name,
    )


def _param(module: nn.Module, name: str, shape: tuple[int, ...], axes: tuple):
    init = nn.with_logical_partitioning(nn.initializers.normal(0.02), axes)
    return module.param(name, init, shape, module.cfg.kw["param_dtype"])


def _attention(q, k, v, bias=None):
    """Softmax attention of (B, S, H, D) queries over (B, T, H, D) keys, an additive (B, T) bias."""
    logits = jnp.einsum("bshd,bthd->bhst", q, k).astype(jnp.float32) / math.sqrt(q.shape[-1])
    if bias is not None:
        logits = logits + bias[:, None, None, :]
    probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    return jnp.einsum("bhst,bthd->bshd", probs, v)


class VisionBlock(nn.Module):
    """Pre-norm ViT block: x + attn(norm1(x)), then x + mlp(norm2(x)). Scanned; carry is x."""

    cfg: ImageRewardConfig

    @nn.compact
    def __call__(self, x):
        cfg, dtype = self.cfg, self.cfg.kw["dtype"]
        b, s, width = x.shape
        h = _layer_norm(cfg, cfg.vision_eps, "norm1")(x).astype(dtype)
        qkv = layers.logical_dense(3 * width, ("embed", "heads"), name="qkv", **cfg.kw)(h)
        q, k, v = jnp.moveaxis(qkv.reshape(b, s, 3, cfg.vision_heads, -1), 2, 0)
        attn = _attention(q, k, v).reshape(b, s, width)
        x = x + layers.logical_dense(width, ("heads", "embed"), name="proj", **cfg.kw)(attn)
        h = _layer_norm(cfg, cfg.vision_eps, "norm2")(x).astype(dtype)
        h = _gelu(layers.logical_dense(int(width * cfg.vision_mlp_ratio), ("embed", "mlp"), name="fc1", **cfg.kw)(h))
        return x + layers.logical_dense(width, ("mlp", "embed"), name="fc2", **cfg.kw)(h), None


class VisionEncoder(nn.Module):
    """(B, S, S, 3) normalised pixels -> (B, 1 + patches, vision_width) image tokens."""

    cfg: ImageRewardConfig

    @nn.compact
    def __call__(self, pixels):
        cfg, dtype = self.cfg, self.cfg.kw["dtype"]
        b, height, width, channels = pixels.shape
        if (height, width, channels) != (cfg.image_size, cfg.image_size, 3):
            raise ValueError(f"pixels must be (B, {cfg.image_size}, {cfg.image_size}, 3), got {pixels.shape}")
        p, w = cfg.patch_size, cfg.vision_width
        kernel = _param(self, "patch_kernel", (p, p, 3, w), (None, None, "cond", "embed"))
        bias = self.param("patch_bias", nn.with_logical_partitioning(nn.initializers.zeros_init(), ("embed",)),
                          (w,), cfg.kw["param_dtype"])
        patches = pixels.reshape(b, height // p, p, width // p, p, 3).transpose(0, 1, 3, 2, 4, 5)
        x = jnp.dot(patches.reshape(b, -1, p * p * 3).astype(dtype), kernel.reshape(-1, w).astype(dtype))
        x = x + bias.astype(dtype)
        cls = _param(self, "cls_token", (1, 1, w), (None, None, "embed"))
        x = jnp.concatenate([jnp.broadcast_to(cls.astype(dtype), (b, 1, w)), x], axis=1)
        x = x + _param(self, "pos_embed", (1, cfg.num_patches + 1, w), (None, None, "embed")).astype(dtype)
        x, _ = stacking.scan_blocks(VisionBlock, cfg.vision_layers, "none")(cfg, name="blocks")(x)
        return _layer_norm(cfg, cfg.vision_eps, "norm")(x).astype(dtype)


class TextLayer(nn.Module):
    """One med-BERT layer: self-attention, cross-attention to the image, feed-forward, each
    followed by LayerNorm(output + input). Scanned; carry is x."""

    cfg: ImageRewardConfig

    def _attend(self, name: str, x, context, bias):
        cfg = self.cfg
        b, s, width = x.shape
        dense = lambda n: layers.logical_dense(width, ("embed", "heads"), name=f"{name}_{n}", **cfg.kw)  # noqa: E731
        q = dense("query")(x).reshape(b, s, cfg.text_heads, -1)
        k = dense("key")(context).reshape(b, context.shape[1], cfg.text_heads, -1)
        v = dense("value")(context).reshape(b, context.shape[1], cfg.text_heads, -1)
        out = _attention(q, k, v, bias).reshape(b, s, width)
        out = layers.logical_dense(width, ("heads", "embed"), name=f"{name}_out", **cfg.kw)(out)
        return _layer_norm(cfg, cfg.text_eps, f"{name}_norm")(out + x).astype(x.dtype)

    @nn.compact
    def __call__(self, x, mask_bias, image):
        cfg = self.cfg
        x = self._attend("self", x, x, mask_bias)
        x = self._attend("cross", x, image, None)
        h = _gelu(layers.logical_dense(cfg.text_intermediate, ("embed", "mlp"), name="intermediate", **cfg.kw)(x))
        h = layers.logical_dense(cfg.text_width, ("mlp", "embed"), name="output", **cfg.kw)(h)
        return _layer_norm(cfg, cfg.text_eps, "output_norm")(h + x).astype(x.dtype), None


class TextEncoder(nn.Module):
    """(B, L) token ids, (B, L) attention mask and image tokens -> (B, L, text_width)."""

    cfg: ImageRewardConfig

    @nn.compact
    def __call__(self, input_ids, attention_mask, image):
        cfg, dtype = self.cfg, self.cfg.kw["dtype"]
        length = input_ids.shape[1]
        if length > cfg.max_positions:
            raise ValueError(f"input_ids has {length} tokens; ImageRewardConfig.max_positions is {cfg.max_positions}")
        words = _param(self, "word_embeddings", (cfg.vocab_size, cfg.text_width), ("vocab", "embed"))
        positions = _param(self, "position_embeddings", (cfg.max_positions, cfg.text_width), (None, "embed"))
        x = jnp.take(words, input_ids, axis=0) + positions[:length]
        x = _layer_norm(cfg, cfg.text_eps, "embed_norm")(x).astype(dtype)
        # The reference's extended mask: 0 where attended, -10000 on padding keys.
        mask_bias = jnp.where(attention_mask.astype(bool), 0.0, -10000.0).astype(jnp.float32)
        x, _ = stacking.scan_blocks(TextLayer, cfg.text_layers, "none")(cfg, name="layers")(x, mask_bias, image)
        return x


class ImageRewardModel(nn.Module):
    """`__call__(pixel_values, input_ids, attention_mask)` -> (B, text_width) [CLS] features."""

    cfg: ImageRewardConfig

    def setup(self):
        self.vision = VisionEncoder(self.cfg)
        self.text = TextEncoder(self.cfg)

    def __call__(self, pixel_values, input_ids, attention_mask):
        image = self.vision(pixel_values)
        return self.text(input_ids, attention_mask, image)[:, 0].astype(jnp.float32)


def example_inputs(cfg: ImageRewardConfig, batch: int = 1) -> dict:
    """Abstract inputs for `init`/`eval_shape`."""
    return dict(
        pixel_values=jax.ShapeDtypeStruct((batch, cfg.image_size, cfg.image_size, 3), jnp.float32),
        input_ids=jax.ShapeDtypeStruct((batch, cfg.context_length), jnp.int32),
        attention_mask=jax.ShapeDtypeStruct((batch, cfg.context_length), jnp.int32),
    )


# ----------------------------------------------------------------------------- conversion


def _norm_rules(path: tuple[str, ...], key: str) -> list[WeightRule]:
    return [WeightRule(path + ("scale",), f"{key}.weight"), WeightRule(path + ("bias",), f"{key}.bias")]


def weight_rules(cfg: ImageRewardConfig) -> list[WeightRule]:
    """Rules for the state dict of the package's `ImageReward` module (`blip.*`; the MLP head
    `mlp.*` is converted by the reward, the unused contrastive projections are ignored)."""
    v, t = "blip.visual_encoder", "blip.text_encoder"
    block, layer = ("vision", "blocks"), ("text", "layers")
    rules = [
        WeightRule(("vision", "patch_kernel"), f"{v}.patch_embed.proj.weight", "conv"),
        WeightRule(("vision", "patch_bias"), f"{v}.patch_embed.proj.bias"),
        WeightRule(("vision", "cls_token"), f"{v}.cls_token"),
        WeightRule(("vision", "pos_embed"), f"{v}.pos_embed"),
        WeightRule(("text", "word_embeddings"), f"{t}.embeddings.word_embeddings.weight"),
        WeightRule(("text", "position_embeddings"), f"{t}.embeddings.position_embeddings.weight"),
    ]
    rules += _norm_rules(("vision", "norm"), f"{v}.norm")
    rules += _norm_rules(("text", "embed_norm"), f"{t}.embeddings.LayerNorm")
    for ours, theirs in (("norm1", "norm1"), ("norm2", "norm2")):
        rules += _norm_rules(block + (ours,), f"{v}.blocks.{{i}}.{theirs}")
    for ours, theirs in (("qkv", "attn.qkv"), ("proj", "attn.proj"), ("fc1", "mlp.fc1"), ("fc2", "mlp.fc2")):
        rules += linear_rules(block + (ours,), f"{v}.blocks.{{i}}.{theirs}")
    root = f"{t}.encoder.layer.{{i}}"
    for ours, theirs in (("self", "attention"), ("cross", "crossattention")):
        for proj in ("query", "key", "value"):
            rules += linear_rules(layer + (f"{ours}_{proj}",), f"{root}.{theirs}.self.{proj}")
        rules += linear_rules(layer + (f"{ours}_out",), f"{root}.{theirs}.output.dense")
        rules += _norm_rules(layer + (f"{ours}_norm",), f"{root}.{theirs}.output.LayerNorm")
    rules += linear_rules(layer + ("intermediate",), f"{root}.intermediate.dense")
    rules += linear_rules(layer + ("output",), f"{root}.output.dense")
    rules += _norm_rules(layer + ("output_norm",), f"{root}.output.LayerNorm")
    return rules


FAMILY = ModelFamily(
    name="image_reward",
    diffusers_class="ImageReward",
    config_cls=ImageRewardConfig,
    module_cls=ImageRewardModel,
    weight_rules=weight_rules,
    example_inputs=example_inputs,
    variants=VARIANTS,
    # The MLP head (converted with the reward), BLIP's contrastive projections (unused by the
    # score) and the text encoder's saved position-id buffer.
    ignored_prefixes=("mlp.", "blip.vision_proj.", "blip.text_proj.", "blip.text_encoder.embeddings.position_ids"),
)
