"""CLIP (vision and text towers) in flax.linen, converted from transformers or open_clip.

One module serves both checkpoint formats: transformers `CLIPModel` (PickScore_v1,
openai/clip-vit-large-patch14) and open_clip `CLIP` state dicts (HPSv2.1 on ViT-H-14).
Both compute the same network: pre-norm transformer blocks (LayerNorm eps 1e-5,
biased q/k/v/out projections, MLP with GELU or QuickGELU), a class token and learned
positions on the vision side (norm before the blocks, norm + bias-free projection of
the class token after), causal attention, a final norm and a bias-free projection of
the end-of-text token on the text side.

Deliberate differences from the PyTorch modules, none of which changes fp32 output:
* Blocks are stacked and run with `nn.scan` (parameters carry a leading `layers` axis).
* Pixels are NHWC; the patch convolution is a reshape and one matmul.
* The text tower applies only the causal mask. transformers also masks padding keys,
  which cannot change the pooled end-of-text token: causality already hides every
  position after it.

Text pooling: `eos_token_id=None` takes the position of the largest token id (open_clip,
and transformers configs with the legacy `eos_token_id == 2`: CLIP's end-of-text token has
the largest id); an integer takes the first position holding that id.

Preprocessing (`preprocess_images`) runs on device and reproduces the reference image
pipelines (see `ImagePreprocess`). Tokenisation stays on the host (`load_tokenizer`).
"""
from __future__ import annotations

import dataclasses
import functools
import math
import os
from typing import Any, Iterable, Iterator

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from digen_jax.models import attention, layers, partitioning, stacking
from digen_jax.models.conversion import ConversionError, ModelFamily, WeightRule, linear_rules

OPENAI_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclasses.dataclass(frozen=True)
class CLIPConfig:
    """Architecture of both towers plus the execution policy."""

    image_size: int = 224
    patch_size: int = 14
    vision_width: int = 1024
    vision_layers: int = 24
    vision_heads: int = 16
    vocab_size: int = 49408
    context_length: int = 77
    text_width: int = 768
    text_layers: int = 12
    text_heads: int = 12
    mlp_ratio: float = 4.0
    projection_dim: int = 768
    hidden_act: str = "quick_gelu"  # 'quick_gelu' (OpenAI weights) | 'gelu' (exact erf; LAION weights)
    eos_token_id: int | None = None  # text pooling: None = argmax of the ids, else first position of this id
    layer_norm_eps: float = 1e-5
    # Execution policy: not part of the weights.
    dtype: str = "float32"  # compute dtype of matmuls and the residual stream
    param_dtype: str = "float32"
    # Sequences are short (257 and 77 tokens) and odd, where a fused kernel gains little.
    attention_impl: str = "xla"  # 'auto' | 'cudnn' | 'xla'

    def __post_init__(self):
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"CLIPConfig.hidden_act must be one of {sorted(ACTIVATIONS)}, got {self.hidden_act!r}")
        if self.image_size % self.patch_size:
            raise ValueError(f"CLIPConfig.image_size={self.image_size} must be a multiple of patch_size={self.patch_size}")
        for tower in ("vision", "text"):
            width, heads = getattr(self, f"{tower}_width"), getattr(self, f"{tower}_heads")
            if width % heads:
                raise ValueError(f"CLIPConfig.{tower}_width={width} must be a multiple of {tower}_heads={heads}")

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def kw(self) -> dict:
        return dict(dtype=jnp.dtype(self.dtype), param_dtype=jnp.dtype(self.param_dtype))


ACTIVATIONS = {
    "quick_gelu": lambda x: x * jax.nn.sigmoid(1.702 * x),
    "gelu": functools.partial(jax.nn.gelu, approximate=False),
}

VARIANTS = {
    # openai/clip-vit-large-patch14 (CLIPScore, LAION aesthetic).
    "ViT-L-14": CLIPConfig(),
    # laion CLIP-ViT-H-14 (PickScore_v1, HPSv2.1).
    "ViT-H-14": CLIPConfig(
        vision_width=1280, vision_layers=32, vision_heads=16,
        text_width=1024, text_layers=24, text_heads=16, projection_dim=1024, hidden_act="gelu",
    ),
    "tiny": CLIPConfig(
        image_size=32, patch_size=8, vision_width=32, vision_layers=2, vision_heads=4,
        vocab_size=99, context_length=16, text_width=32, text_layers=2, text_heads=4, projection_dim=24,
    ),
}


def _layer_norm(cfg: CLIPConfig, name: str) -> nn.LayerNorm:
    return nn.LayerNorm(
        epsilon=cfg.layer_norm_eps,
        dtype=jnp.float32,  # statistics in float32 whatever the compute dtype
        param_dtype=cfg.kw["param_dtype"],
        scale_init=nn.with_logical_partitioning(nn.initializers.ones_init(), ("embed",)),
        bias_init=nn.with_logical_partitioning(nn.initializers.zeros_init(), ("embed",)),
        name=name,
    )


class CLIPBlock(nn.Module):
    """Pre-norm block: x + attn(ln1(x)), then x + mlp(ln2(x)). Scanned; carry is x."""

    cfg: CLIPConfig
    heads: int
    causal: bool

    @nn.compact
    def __call__(self, x):
        cfg, dtype = self.cfg, self.cfg.kw["dtype"]
        b, s, width = x.shape
        h = _layer_norm(cfg, "layer_norm1")(x).astype(dtype)
        q, k, v = (
            layers.logical_dense(width, ("embed", "heads"), name=f"{n}_proj", **cfg.kw)(h).reshape(b, s, self.heads, -1)
            for n in ("q", "k", "v")
        )
        impl = attention.resolve_attention_impl(cfg.attention_impl, dtype, width // self.heads)
        impl = "xla" if impl == "splash" else impl  # the splash path serves unmasked / key-padded attention
        attn = jax.nn.dot_product_attention(q, k, v, is_causal=self.causal, implementation=impl)
        attn = layers.logical_dense(width, ("heads", "embed"), name="out_proj", **cfg.kw)(attn.reshape(b, s, width))
        x = x + attn
        h = _layer_norm(cfg, "layer_norm2")(x).astype(dtype)
        h = layers.logical_dense(int(width * cfg.mlp_ratio), ("embed", "mlp"), name="fc1", **cfg.kw)(h)
        h = ACTIVATIONS[cfg.hidden_act](h)
        h = layers.logical_dense(width, ("mlp", "embed"), name="fc2", **cfg.kw)(h)
        return partitioning.constrain(x + h, ("activation_batch", "activation_length", "activation_embed")), None


def _encoder(cfg: CLIPConfig, depth: int, heads: int, causal: bool, name: str) -> nn.Module:
    return stacking.scan_blocks(CLIPBlock, depth, "none")(cfg, heads, causal, name=name)


def _param(module: nn.Module, name: str, shape: tuple[int, ...], axes: tuple, init=nn.initializers.normal(0.02)):
    return module.param(name, nn.with_logical_partitioning(init, axes), shape, module.cfg.kw["param_dtype"])


class CLIPVisionTower(nn.Module):
    """(B, S, S, 3) normalised pixels -> (B, projection_dim) image embedding (not normalised)."""

    cfg: CLIPConfig

    @nn.compact
    def __call__(self, pixels):
        cfg, dtype = self.cfg, self.cfg.kw["dtype"]
        b, height, width, channels = pixels.shape
        if (height, width, channels) != (cfg.image_size, cfg.image_size, 3):
            raise ValueError(f"pixels must be (B, {cfg.image_size}, {cfg.image_size}, 3), got {pixels.shape}")
        p, w = cfg.patch_size, cfg.vision_width
        kernel = _param(self, "patch_embedding", (p, p, 3, w), (None, None, "cond", "embed"))
        patches = pixels.reshape(b, height // p, p, width // p, p, 3).transpose(0, 1, 3, 2, 4, 5)
        x = jnp.dot(patches.reshape(b, -1, p * p * 3).astype(dtype), kernel.reshape(-1, w).astype(dtype))
        cls = _param(self, "class_embedding", (w,), ("embed",))
        x = jnp.concatenate([jnp.broadcast_to(cls.astype(dtype), (b, 1, w)), x], axis=1)
        x = x + _param(self, "position_embedding", (cfg.num_patches + 1, w), (None, "embed")).astype(dtype)
        x = _layer_norm(cfg, "pre_layernorm")(x).astype(dtype)
        x, _ = _encoder(cfg, cfg.vision_layers, cfg.vision_heads, False, "encoder")(x)
        pooled = _layer_norm(cfg, "post_layernorm")(x[:, 0]).astype(dtype)
        return layers.logical_dense(
            cfg.projection_dim, ("embed", "projection"), name="projection", use_bias=False, **cfg.kw
        )(pooled)


class CLIPTextTower(nn.Module):
    """(B, L) int token ids -> (B, projection_dim) text embedding (not normalised)."""

    cfg: CLIPConfig

    @nn.compact
    def __call__(self, input_ids):
        cfg, dtype = self.cfg, self.cfg.kw["dtype"]
        b, length = input_ids.shape
        if length > cfg.context_length:
            raise ValueError(f"input_ids has {length} tokens; CLIPConfig.context_length is {cfg.context_length}")
        w = cfg.text_width
        table = _param(self, "token_embedding", (cfg.vocab_size, w), ("vocab", "embed"))
        positions = _param(self, "position_embedding", (cfg.context_length, w), (None, "embed"))
        x = jnp.take(table, input_ids, axis=0).astype(dtype) + positions[:length].astype(dtype)
        x, _ = _encoder(cfg, cfg.text_layers, cfg.text_heads, True, "encoder")(x)
        x = _layer_norm(cfg, "final_layer_norm")(x).astype(dtype)
        if cfg.eos_token_id is None:
            eos = jnp.argmax(input_ids, axis=-1)
        else:
            eos = jnp.argmax(input_ids == cfg.eos_token_id, axis=-1)
        pooled = jnp.take_along_axis(x, eos[:, None, None], axis=1)[:, 0]
        return layers.logical_dense(
            cfg.projection_dim, ("embed", "projection"), name="projection", use_bias=False, **cfg.kw
        )(pooled)


class CLIPModel(nn.Module):
    """Both towers and the learned temperature.

    `__call__(pixel_values, input_ids)` returns the unnormalised (image, text) embeddings;
    `encode_image` / `encode_text` run one tower (`apply(..., method=...)`);
    `logit_scale()` is the log temperature (scores use its exp).
    """

    cfg: CLIPConfig

    def setup(self):
        self.vision = CLIPVisionTower(self.cfg)
        self.text = CLIPTextTower(self.cfg)
        self.logit_scale_param = self.param(
            "logit_scale",
            nn.with_logical_partitioning(nn.initializers.constant(math.log(1 / 0.07)), ()),
            (),
            self.cfg.kw["param_dtype"],
        )

    def encode_image(self, pixel_values):
        return self.vision(pixel_values)

    def encode_text(self, input_ids):
        return self.text(input_ids)

    def logit_scale(self):
        return self.logit_scale_param

    def __call__(self, pixel_values, input_ids):
        return self.vision(pixel_values), self.text(input_ids)


def example_inputs(cfg: CLIPConfig, batch: int = 1) -> dict:
    """Abstract inputs for `init`/`eval_shape`."""
    return dict(
        pixel_values=jax.ShapeDtypeStruct((batch, cfg.image_size, cfg.image_size, 3), jnp.float32),
        input_ids=jax.ShapeDtypeStruct((batch, cfg.context_length), jnp.int32),
    )


def normalized(x: jax.Array) -> jax.Array:
    """x / ||x|| over the last axis, in float32."""
    x = x.astype(jnp.float32)
    return x / jnp.linalg.norm(x, axis=-1, keepdims=True)


# ----------------------------------------------------------------------------- conversion


def _block_rules(flax_root: tuple[str, ...], key_root: str, names: dict[str, str]) -> list[WeightRule]:
    """Rules of one scanned encoder; `names` maps our sub-module names to the source's."""
    rules = []
    for ln in ("layer_norm1", "layer_norm2"):
        rules += [
            WeightRule(flax_root + (ln, "scale"), f"{key_root}.{names[ln]}.weight"),
            WeightRule(flax_root + (ln, "bias"), f"{key_root}.{names[ln]}.bias"),
        ]
    for proj in ("q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"):
        rules += linear_rules(flax_root + (proj,), f"{key_root}.{names[proj]}")
    return rules


def _norm_rules(path: tuple[str, ...], key: str) -> list[WeightRule]:
    return [WeightRule(path + ("scale",), f"{key}.weight"), WeightRule(path + ("bias",), f"{key}.bias")]


def transformers_weight_rules(cfg: CLIPConfig) -> list[WeightRule]:
    """Rules for a transformers `CLIPModel` state dict."""
    names = {
        "layer_norm1": "layer_norm1", "layer_norm2": "layer_norm2",
        "q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj", "v_proj": "self_attn.v_proj",
        "out_proj": "self_attn.out_proj", "fc1": "mlp.fc1", "fc2": "mlp.fc2",
    }
    v, t = "vision_model", "text_model"
    rules = [
        WeightRule(("vision", "patch_embedding"), f"{v}.embeddings.patch_embedding.weight", "conv"),
        WeightRule(("vision", "class_embedding"), f"{v}.embeddings.class_embedding"),
        WeightRule(("vision", "position_embedding"), f"{v}.embeddings.position_embedding.weight"),
        WeightRule(("vision", "projection", "kernel"), "visual_projection.weight", "linear"),
        WeightRule(("text", "token_embedding"), f"{t}.embeddings.token_embedding.weight"),
        WeightRule(("text", "position_embedding"), f"{t}.embeddings.position_embedding.weight"),
        WeightRule(("text", "projection", "kernel"), "text_projection.weight", "linear"),
        WeightRule(("logit_scale",), "logit_scale"),
    ]
    rules += _norm_rules(("vision", "pre_layernorm"), f"{v}.pre_layrnorm")
    rules += _norm_rules(("vision", "post_layernorm"), f"{v}.post_layernorm")
    rules += _norm_rules(("text", "final_layer_norm"), f"{t}.final_layer_norm")
    rules += _block_rules(("vision", "encoder"), f"{v}.encoder.layers.{{i}}", names)
    rules += _block_rules(("text", "encoder"), f"{t}.encoder.layers.{{i}}", names)
    return rules


def open_clip_weight_rules(cfg: CLIPConfig) -> list[WeightRule]:
    """Rules for an open_clip `CLIP` state dict, read through `split_fused_qkv`."""
    names = {
        "layer_norm1": "ln_1", "layer_norm2": "ln_2",
        "q_proj": "attn.q_proj", "k_proj": "attn.k_proj", "v_proj": "attn.v_proj",
        "out_proj": "attn.out_proj", "fc1": "mlp.c_fc", "fc2": "mlp.c_proj",
    }
    rules = [
        WeightRule(("vision", "patch_embedding"), "visual.conv1.weight", "conv"),
        WeightRule(("vision", "class_embedding"), "visual.class_embedding"),
        WeightRule(("vision", "position_embedding"), "visual.positional_embedding"),
        # open_clip stores its projections as (in, out) matrices used as x @ proj.
        WeightRule(("vision", "projection", "kernel"), "visual.proj"),
        WeightRule(("text", "token_embedding"), "token_embedding.weight"),
        WeightRule(("text", "position_embedding"), "positional_embedding"),
        WeightRule(("text", "projection", "kernel"), "text_projection"),
        WeightRule(("logit_scale",), "logit_scale"),
    ]
    rules += _norm_rules(("vision", "pre_layernorm"), "visual.ln_pre")
    rules += _norm_rules(("vision", "post_layernorm"), "visual.ln_post")
    rules += _norm_rules(("text", "final_layer_norm"), "ln_final")
    rules += _block_rules(("vision", "encoder"), "visual.transformer.resblocks.{i}", names)
    rules += _block_rules(("text", "encoder"), "transformer.resblocks.{i}", names)
    return rules


def split_fused_qkv(weights: Iterable[tuple[str, np.ndarray]]) -> Iterator[tuple[str, np.ndarray]]:
    """open_clip keeps q/k/v fused (`attn.in_proj_weight` (3W, W), `attn.in_proj_bias`):
    yield them as separate `attn.{q,k,v}_proj.{weight,bias}` keys, every other key unchanged."""
    for key, array in weights:
        for suffix, kind in (("attn.in_proj_weight", "weight"), ("attn.in_proj_bias", "bias")):
            if key.endswith(suffix):
                root = key[: -len(suffix)]
                array = np.asarray(array)
                if array.shape[0] % 3:
                    raise ConversionError(f"{key!r} has shape {array.shape}: its first axis is not 3 x width")
                for name, part in zip(("q", "k", "v"), np.split(array, 3, axis=0)):
                    yield f"{root}attn.{name}_proj.{kind}", part
                break
        else:
            yield key, array


def config_from_transformers(hf_config: Any, **policy) -> CLIPConfig:
    """CLIPConfig from a transformers `CLIPConfig` (object or its `to_dict()`)."""
    d = hf_config if isinstance(hf_config, dict) else hf_config.to_dict()
    vision, text = d["vision_config"], d["text_config"]
    if vision["hidden_act"] != text["hidden_act"]:
        raise ConversionError(f"towers use different activations ({vision['hidden_act']}, {text['hidden_act']})")
    mlp_ratio = vision["intermediate_size"] / vision["hidden_size"]
    if text["intermediate_size"] / text["hidden_size"] != mlp_ratio:
        raise ConversionError("towers use different MLP ratios; CLIPConfig has one mlp_ratio")
    eos = text.get("eos_token_id")
    return CLIPConfig(
        image_size=vision["image_size"], patch_size=vision["patch_size"], vision_width=vision["hidden_size"],
        vision_layers=vision["num_hidden_layers"], vision_heads=vision["num_attention_heads"],
        vocab_size=text["vocab_size"], context_length=text["max_position_embeddings"], text_width=text["hidden_size"],
        text_layers=text["num_hidden_layers"], text_heads=text["num_attention_heads"], mlp_ratio=mlp_ratio,
        projection_dim=d["projection_dim"], hidden_act=vision["hidden_act"],
        # Configs written before transformers fixed CLIP's eos id say 2 and pool at argmax.
        eos_token_id=None if eos in (None, 2) else eos, layer_norm_eps=vision["layer_norm_eps"], **policy,
    )


TRANSFORMERS_FAMILY = ModelFamily(
    name="clip",
    diffusers_class="CLIPModel",
    config_cls=CLIPConfig,
    module_cls=CLIPModel,
    weight_rules=transformers_weight_rules,
    example_inputs=example_inputs,
    variants=VARIANTS,
    # Non-persistent position-id buffers that older transformers versions saved.
    ignored_prefixes=("vision_model.embeddings.position_ids", "text_model.embeddings.position_ids"),
)

OPEN_CLIP_FAMILY = ModelFamily(
    name="open_clip",
    diffusers_class="open_clip.CLIP",
    config_cls=CLIPConfig,
    module_cls=CLIPModel,
    weight_rules=open_clip_weight_rules,
    example_inputs=example_inputs,
    variants=VARIANTS,
    # The causal mask buffer that open_clip versions before 2.0 saved.
    ignored_prefixes=("attn_mask",),
)


# ----------------------------------------------------------------------------- preprocessing


def _bicubic(x: np.ndarray) -> np.ndarray:
    a, x = -0.5, np.abs(x)
    near = ((a + 2) * x - (a + 3)) * x * x + 1
    far = (((x - 5) * x + 8) * x - 4) * a
    return np.where(x < 1, near, np.where(x < 2, far, 0.0))


def _triangle(x: np.ndarray) -> np.ndarray:
    return np.maximum(1.0 - np.abs(x), 0.0)


_FILTERS = {"pil_bicubic": (_bicubic, 2.0), "bilinear_antialias": (_triangle, 1.0)}
PIL_PRECISION_BITS = 22  # 32 - 8 - 2, PIL's fixed-point fraction bits for 8-bit images


@dataclasses.dataclass(frozen=True)
class ImagePreprocess:
    """An image pipeline: resize, center crop (or pad), normalise; runs on device.

    * `mode='shortest_crop'`: shorter side -> `size` (longer side `int(size * long / short)`),
      then center crop; `crop_rounding` is 'floor' (transformers: (d // 2)) or 'half_even'
      (torchvision: Python round(d / 2)).
    * `mode='longest_pad'`: longer side -> `size` (shorter `round(short * size / long)`),
      then zero (black) padding, `pad // 2` before (HPSv2's `ResizeMaxSize`).
    * `resample='pil_bicubic'`: PIL's antialiased bicubic on uint8 pixels (float input is
      quantised first), in PIL's fixed point with uint8 rounding after each pass, so the
      result is bit-exact. 'bilinear_antialias': torch `interpolate(mode='bilinear',
      antialias=True)` on float pixels (torchvision `Resize` of a tensor).
    """

    size: int = 224
    mode: str = "shortest_crop"
    resample: str = "pil_bicubic"
    crop_rounding: str = "floor"
    mean: tuple[float, float, float] = OPENAI_MEAN
    std: tuple[float, float, float] = OPENAI_STD

    def __post_init__(self):
        for field, allowed in (
            ("mode", ("shortest_crop", "longest_pad")),
            ("resample", tuple(_FILTERS)),
            ("crop_rounding", ("floor", "half_even")),
        ):
            if getattr(self, field) not in allowed:
                raise ValueError(f"ImagePreprocess.{field} must be one of {allowed}, got {getattr(self, field)!r}")


# The reference pipelines.
TRANSFORMERS_PROCESSOR = ImagePreprocess()  # CLIPImageProcessor (PIL backend): PickScore, aesthetic
OPEN_CLIP_VAL = ImagePreprocess(crop_rounding="half_even")  # open_clip's default eval transform
HPS_VAL = ImagePreprocess(mode="longest_pad")  # HPSv2's preprocess_val
TENSOR_RESIZE = ImagePreprocess(resample="bilinear_antialias", crop_rounding="half_even")  # CLIPScore


@functools.lru_cache(maxsize=64)
def resample_taps(in_size: int, out_size: int, resample: str) -> tuple[np.ndarray, np.ndarray]:
    """(out_size, K) input indices and float64 weights of an antialiased 1-D resize.

    The filter is stretched by the downscale factor (antialiasing), each output pixel
    takes the inputs within its support and the weights are normalised to sum 1: the
    scheme PIL's `resize` and torch's `interpolate(antialias=True)` share. Padding taps
    have weight 0 and index 0.
    """
    kernel, support = _FILTERS[resample]
    scale = in_size / out_size
    filter_scale = max(scale, 1.0)
    support *= filter_scale
    width = int(math.ceil(support)) * 2 + 1
    index = np.zeros((out_size, width), np.int32)
    weight = np.zeros((out_size, width), np.float64)
    for i in range(out_size):
        center = (i + 0.5) * scale
        lo = max(int(center - support + 0.5), 0)
        hi = min(int(center + support + 0.5), in_size)
        taps = np.arange(lo, hi)
        w = kernel((taps - center + 0.5) / filter_scale)
        index[i, : len(taps)] = taps
        weight[i, : len(taps)] = w / w.sum()
    return index, weight


def _resize_axis(x: jax.Array, axis: int, out_size: int, resample: str) -> jax.Array:
    index, weight = resample_taps(x.shape[axis], out_size, resample)
    taps = jnp.take(x, jnp.asarray(index), axis=axis)  # axis -> (out, K)
    shape = [1] * taps.ndim
    shape[axis], shape[axis + 1] = weight.shape
    if resample == "pil_bicubic":
        one = 1 << PIL_PRECISION_BITS
        # PIL rounds each weight half away from zero to fixed point; int32 sums are exact.
        fixed = np.trunc(weight * one + np.where(weight < 0, -0.5, 0.5)).astype(np.int32)
        acc = jnp.sum(taps.astype(jnp.int32) * jnp.asarray(fixed).reshape(shape), axis=axis + 1) + (one >> 1)
        return jnp.clip(acc >> PIL_PRECISION_BITS, 0, 255).astype(jnp.uint8)
    return jnp.sum(taps * jnp.asarray(weight, jnp.float32).reshape(shape), axis=axis + 1)


def resized_shape(height: int, width: int, spec: ImagePreprocess) -> tuple[int, int]:
    """(h, w) after the resize step, computed as the reference pipelines do."""
    s = spec.size
    if spec.mode == "shortest_crop":
        if height <= width:
            return s, int(s * width / height)
        return int(s * height / width), s
    scale = s / max(height, width)
    return round(height * scale), round(width * scale)


def preprocess_images(images: jax.Array, spec: ImagePreprocess = TRANSFORMERS_PROCESSOR) -> jax.Array:
    """(B, H, W, 3) uint8 or [0, 1]-float images -> (B, size, size, 3) float32 normalised pixels.

    Shapes are static, so the resampling taps are computed once per input size on the
    host; everything else runs on device (jit-compatible).
    """
    if images.ndim != 4 or images.shape[-1] != 3:
        raise ValueError(f"images must be (B, H, W, 3), got shape {images.shape}")
    _, height, width, _ = images.shape
    new_h, new_w = resized_shape(height, width, spec)
    if spec.resample == "pil_bicubic":
        if images.dtype != jnp.uint8:
            # PIL sees uint8: round(clip(x, 0, 1) * 255), as rewards.to_uint8_images.
            images = jnp.round(jnp.clip(images.astype(jnp.float32), 0.0, 1.0) * 255.0).astype(jnp.uint8)
        # PIL runs the horizontal pass first and rounds to uint8 in between.
        x = _resize_axis(_resize_axis(images, 2, new_w, spec.resample), 1, new_h, spec.resample)
        x = x.astype(jnp.float32) / 255.0
    else:
        x = images.astype(jnp.float32) / 255.0 if images.dtype == jnp.uint8 else images.astype(jnp.float32)
        x = _resize_axis(_resize_axis(x, 2, new_w, spec.resample), 1, new_h, spec.resample)
    s = spec.size
    if spec.mode == "shortest_crop":
        offset = (lambda d: d // 2) if spec.crop_rounding == "floor" else (lambda d: int(round(d / 2)))
        top, left = offset(new_h - s), offset(new_w - s)
        x = x[:, top : top + s, left : left + s]
    else:
        pad_h, pad_w = s - new_h, s - new_w
        x = jnp.pad(x, ((0, 0), (pad_h // 2, pad_h - pad_h // 2), (pad_w // 2, pad_w - pad_w // 2), (0, 0)))
    mean, std = jnp.asarray(spec.mean, jnp.float32), jnp.asarray(spec.std, jnp.float32)
    return (x - mean) / std


# ----------------------------------------------------------------------------- tokenisation


def load_tokenizer(tokenizer_dir: str):
    """A host tokenizer `fn(prompts) -> (B, context_length) int32 ids` from a local folder.

    `tokenizer_dir` holds a transformers CLIP tokenizer (vocab.json + merges.txt, or
    tokenizer.json); prompts are padded to `max_length` (77 for CLIP) and truncated, as the
    scorers' references do. Nothing is downloaded.
    """
    if not os.path.isdir(tokenizer_dir):
        raise FileNotFoundError(
            f"tokenizer_dir {tokenizer_dir!r} is not a folder; point it at a local CLIP tokenizer "
            "(the tokenizer files of the reward model's transformers folder)"
        )
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)

    def tokenize(prompts, context_length: int = 77) -> np.ndarray:
        out = tokenizer(list(prompts), padding="max_length", truncation=True, max_length=context_length)
        return np.asarray(out["input_ids"], np.int32)

    return tokenize
