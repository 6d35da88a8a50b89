"""Wan2.1 VAE decoder (diffusers `AutoencoderKLWan.decode`) in flax.linen.

Computes exactly what diffusers' `decode` computes (fp32 parity is tested):
`post_quant_conv`, then the decoder (causal 3D convolutions, channel RMS norms,
a mid block with single-head spatial attention, four up blocks of which the
temporally upsampling ones double the frame count) and a clamp to [-1, 1].
(B, z_dim, T', h, w) latents become (B, 3, 1 + 2^k (T' - 1), 8h, 8w) videos, with
k the number of temporally upsampling blocks (2 in every released config, hence
4(T' - 1) + 1 frames). `AutoencoderKLQwenImage` has the same decoder, state-dict
keys and `_decode`; `QWEN_FAMILY` ports it with the same module.

Like diffusers, the latent frames are decoded one at a time, each causal
convolution carrying the last two frames of its input from chunk to chunk: the
first chunk runs on its own, the rest in a `lax.scan` (`nn.scan`), so intermediate
activations are only ever held for one latent frame. The first chunk is special, as in
diffusers: its temporal upsamplers skip their `time_conv` (one latent frame gives
one video frame) and leave an all-zero history (diffusers' "Rep" marker), so the
second chunk's `time_conv` sees zeros where frame 0 would be.

Layout: activations are channels-last (B, T, H, W, C) inside; the public entry
points take and return diffusers' channels-first (B, C, T, H, W). Conv kernels are
(kt, kh, kw, in, out); the RMS-norm `gamma`s keep diffusers' shapes ((C, 1, 1, 1)
and (C, 1, 1)), so every weight converts with the existing 'none' / 'conv'
layout changes.

Logical axis names: `vae_in` / `vae_out` for conv input / output channels,
`vae_channels` for norm scales; kernel taps are unnamed (never sharded).

Not ported: the encoder (`IGNORED_PREFIXES` lists its keys), Wan2.2's residual
variant (`is_residual=True`, with `patch_size`; such configs are rejected) and
diffusers' optional spatial tiling (`enable_tiling`, off by default: decoding here
is always untiled, which is what diffusers computes unless tiling is enabled).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Iterator

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from digen_jax.models.conversion import ModelFamily, WeightRule

# State-dict prefixes of a full `AutoencoderKLWan` that the decoder does not use.
IGNORED_PREFIXES = ("encoder.", "quant_conv.")

# Causal convolutions carry this many input frames from one chunk to the next
# (diffusers' CACHE_T): the temporal kernel size 3 minus one.
CACHE_T = 2

# diffusers' defaults, which the released Wan2.1 and Qwen-Image VAEs also use.
LATENTS_MEAN = (
    -0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
    0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921,
)  # fmt: skip
LATENTS_STD = (
    2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
    3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160,
)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class WanVAEConfig:
    """Architecture (the diffusers `AutoencoderKLWan` config fields) plus the execution policy.

    Encoder-only fields (`base_dim` when `decoder_base_dim` is set, `in_channels`,
    `attn_scales`, which only the encoder reads) and `dropout` (inference) are
    accepted so that released configs load.
    """

    base_dim: int = 96
    decoder_base_dim: int | None = None
    z_dim: int = 16
    dim_mult: tuple[int, ...] = (1, 2, 4, 4)
    num_res_blocks: int = 2
    attn_scales: tuple[float, ...] = ()
    temperal_downsample: tuple[bool, ...] = (False, True, True)
    dropout: float = 0.0
    latents_mean: tuple[float, ...] = LATENTS_MEAN
    latents_std: tuple[float, ...] = LATENTS_STD
    is_residual: bool = False
    in_channels: int = 3
    out_channels: int = 3
    patch_size: int | None = None
    scale_factor_temporal: int | None = 4
    scale_factor_spatial: int | None = 8
    # `AutoencoderKLQwenImage`'s name for the video channels (in_channels = out_channels).
    input_channels: int | None = None
    # Execution policy: not part of the weights. The Wan pipelines run the VAE in float32.
    dtype: str = "float32"
    param_dtype: str = "float32"

    def __post_init__(self):
        for name in ("dim_mult", "attn_scales", "temperal_downsample", "latents_mean", "latents_std"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        if self.is_residual or self.patch_size is not None:
            raise ValueError(
                "the Wan VAE port implements the Wan2.1 decoder only; Wan2.2's residual variant "
                f"(is_residual={self.is_residual}, patch_size={self.patch_size}) is not supported"
            )
        if len(self.temperal_downsample) != len(self.dim_mult) - 1:
            raise ValueError(
                f"temperal_downsample needs len(dim_mult) - 1 = {len(self.dim_mult) - 1} entries, "
                f"got {self.temperal_downsample}"
            )
        if len(self.latents_mean) != self.z_dim or len(self.latents_std) != self.z_dim:
            raise ValueError(
                f"latents_mean and latents_std need z_dim={self.z_dim} values, "
                f"got {len(self.latents_mean)} and {len(self.latents_std)}"
            )

    @property
    def dims(self) -> tuple[int, ...]:
        """Channel widths: the mid block's, then each up block's output (diffusers' `dims`)."""
        dim = self.decoder_base_dim or self.base_dim
        return tuple(dim * u for u in (self.dim_mult[-1],) + self.dim_mult[::-1])

    @property
    def video_channels(self) -> int:
        """Channels of the decoded video: Qwen-Image's `input_channels`, else `out_channels`."""
        return self.out_channels if self.input_channels is None else self.input_channels

    @property
    def temperal_upsample(self) -> tuple[bool, ...]:
        return self.temperal_downsample[::-1]

    def upsample_mode(self, i: int) -> str | None:
        """Up block i's resampler: 'upsample3d' (time and space), 'upsample2d' or None (last block)."""
        if i == len(self.dim_mult) - 1:
            return None
        return "upsample3d" if self.temperal_upsample[i] else "upsample2d"

    def num_frames(self, latent_frames: int) -> int:
        """Video frames decoded from `latent_frames`: the first gives one, each later one 2^k."""
        return 1 + (latent_frames - 1) * 2 ** sum(self.temperal_upsample)

    @property
    def kw(self) -> dict:
        return dict(dtype=jnp.dtype(self.dtype), param_dtype=jnp.dtype(self.param_dtype))


VARIANTS = {
    "wan2.1": WanVAEConfig(),
    # Structurally identical to the released VAE with 8-channel bases, for CPU tests.
    "tiny": WanVAEConfig(base_dim=8, z_dim=4, latents_mean=LATENTS_MEAN[:4], latents_std=LATENTS_STD[:4]),
}


class _Caches:
    """The causal convolutions' input histories, read and written in call order.

    diffusers keeps them in the list `feat_cache`, indexed by a running `feat_idx`;
    here the previous chunk's histories come in as a tuple (None for the first chunk,
    whose history is all zeros: causal zero padding) and the new ones are appended to
    `new` in the same order, which the next chunk reads back.
    """

    def __init__(self, previous: tuple[jax.Array, ...] | None):
        self.first = previous is None
        self._previous: Iterator[jax.Array] | None = None if previous is None else iter(previous)
        self.new: list[jax.Array] = []

    def history(self, x: jax.Array) -> jax.Array:
        """The last CACHE_T input frames before `x` (zeros before the first chunk)."""
        if self._previous is None:
            return jnp.zeros((x.shape[0], CACHE_T) + x.shape[2:], x.dtype)
        return next(self._previous)

    def record(self, history: jax.Array) -> None:
        self.new.append(history)


class Conv(nn.Module):
    """A convolution on (B, T, H, W, C), zero-padded in space.

    A 3-tap `kernel_size` (kt, kh, kw) is `WanCausalConv3d`: with kt = 3 the input is
    prefixed with the previous chunk's last two frames (`caches`), exactly what
    diffusers' `cache_x` plus the remaining zero padding give; kt = 1 needs no history.
    A 2-tap (kh, kw) is an `nn.Conv2d` applied frame by frame, its kernel kept 4-D so
    that diffusers' weight converts with the plain 'conv' layout change.
    """

    features: int
    kernel_size: tuple[int, ...]
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, caches: _Caches | None = None) -> jax.Array:
        taps = len(self.kernel_size)
        kernel = self.param(
            "kernel",
            nn.with_logical_partitioning(nn.initializers.lecun_normal(), (None,) * taps + ("vae_in", "vae_out")),
            tuple(self.kernel_size) + (x.shape[-1], self.features),
            self.param_dtype,
        )
        bias_init = nn.with_logical_partitioning(nn.initializers.zeros_init(), ("vae_out",))
        bias = self.param("bias", bias_init, (self.features,), self.param_dtype)
        kt = self.kernel_size[0] if taps == 3 else 1
        if kt > 1:  # kt = CACHE_T + 1 = 3: the history is exactly the causal padding
            x = jnp.concatenate([caches.history(x), x], axis=1)
            caches.record(x[:, -CACHE_T:])
        return _conv(x, kernel.reshape((kt,) + kernel.shape[-4:]), bias, self.dtype)


def _conv(x: jax.Array, kernel: jax.Array, bias: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """Valid in time, 'same' zero padding in space (odd kernels), on (B, T, H, W, C)."""
    _, kh, kw, _, _ = kernel.shape
    y = jax.lax.conv_general_dilated(
        x.astype(dtype),
        kernel.astype(dtype),
        window_strides=(1, 1, 1),
        padding=((0, 0), (kh // 2, kh // 2), (kw // 2, kw // 2)),
        dimension_numbers=("NDHWC", "DHWIO", "NDHWC"),
    )
    return y + bias.astype(dtype)


class RMSNorm(nn.Module):
    """`WanRMS_norm`: x / max(||x||_2, 1e-12) over channels, times sqrt(C) and gamma.

    `gamma` keeps diffusers' shape, (C, 1, 1, 1) (`images=False`) or (C, 1, 1)
    (`images=True`), so it converts without a layout change. Normalised in float32.
    """

    images: bool = False
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c = x.shape[-1]
        trailing = 2 if self.images else 3
        gamma = self.param(
            "gamma",
            nn.with_logical_partitioning(nn.initializers.ones_init(), ("vae_channels",) + (None,) * trailing),
            (c,) + (1,) * trailing,
            self.param_dtype,
        )
        x32 = x.astype(jnp.float32)
        norm = jnp.sqrt(jnp.sum(jnp.square(x32), axis=-1, keepdims=True))
        normalized = (x32 / jnp.maximum(norm, 1e-12)).astype(self.dtype)
        return normalized * math.sqrt(c) * gamma.reshape(c).astype(self.dtype)


class ResidualBlock(nn.Module):
    """`WanResidualBlock`: (RMS norm, SiLU, causal 3x3x3 conv) twice, plus a 1x1x1 shortcut if widths differ."""

    features: int
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, caches: _Caches) -> jax.Array:
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        shortcut = x
        if x.shape[-1] != self.features:
            shortcut = Conv(self.features, (1, 1, 1), name="conv_shortcut", **kw)(x)
        h = nn.silu(RMSNorm(name="norm1", **kw)(x))
        h = Conv(self.features, (3, 3, 3), name="conv1", **kw)(h, caches)
        h = nn.silu(RMSNorm(name="norm2", **kw)(h))
        h = Conv(self.features, (3, 3, 3), name="conv2", **kw)(h, caches)
        return h + shortcut


class AttentionBlock(nn.Module):
    """`WanAttentionBlock`: single-head self-attention over each frame's pixels, with residual."""

    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        b, t, h, w, c = x.shape
        y = RMSNorm(images=True, name="norm", **kw)(x)
        qkv = Conv(3 * c, (1, 1), name="to_qkv", **kw)(y).reshape(b * t, h * w, 3 * c)
        q, k, v = jnp.split(qkv, 3, axis=-1)
        logits = jnp.einsum("bqc,bkc->bqk", q, k).astype(jnp.float32) / math.sqrt(c)
        weights = jax.nn.softmax(logits, axis=-1).astype(self.dtype)
        out = jnp.einsum("bqk,bkc->bqc", weights, v).reshape(b, t, h, w, c)
        return x + Conv(c, (1, 1), name="proj", **kw)(out)


class Upsample(nn.Module):
    """`WanResample` in 'upsample2d' / 'upsample3d' mode.

    'upsample3d' first doubles the frames with `time_conv` (a causal (3, 1, 1) conv to
    2C channels whose halves are the even and odd output frames) — except on the first
    chunk, where diffusers skips it and marks the cache "Rep": that chunk keeps its
    frame count and the next one sees a zero history. Then both modes upsample 2x in
    space (nearest) and apply a 3x3 conv to half the channels, frame by frame.
    """

    mode: str
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, caches: _Caches) -> jax.Array:
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        b, t, h, w, c = x.shape
        if self.mode == "upsample3d":
            if caches.first:
                caches.record(caches.history(x))
            else:
                x = Conv(2 * c, (3, 1, 1), name="time_conv", **kw)(x, caches)
                x = x.reshape(b, t, h, w, 2, c).transpose(0, 1, 4, 2, 3, 5).reshape(b, 2 * t, h, w, c)
        # nearest-exact at scale 2 repeats every pixel 2x2.
        x = jnp.repeat(jnp.repeat(x, 2, axis=2), 2, axis=3)
        return Conv(c // 2, (3, 3), name="resample", **kw)(x)


class Decoder3d(nn.Module):
    """`WanDecoder3d` (Wan2.1) on one chunk: its latent frame(s) in, its video frames out.

    `previous` is the tuple of causal histories the previous chunk returned, or None
    for the first chunk. Returns the chunk's frames and the new histories.
    """

    cfg: WanVAEConfig

    @nn.compact
    def __call__(self, x: jax.Array, previous: tuple[jax.Array, ...] | None):
        cfg = self.cfg
        kw = cfg.kw
        dims = cfg.dims
        caches = _Caches(previous)
        x = Conv(dims[0], (3, 3, 3), name="conv_in", **kw)(x, caches)
        x = ResidualBlock(dims[0], name="mid_resnets_0", **kw)(x, caches)
        x = AttentionBlock(name="mid_attentions_0", **kw)(x)
        x = ResidualBlock(dims[0], name="mid_resnets_1", **kw)(x, caches)
        for i, out_dim in enumerate(dims[1:]):
            for j in range(cfg.num_res_blocks + 1):
                x = ResidualBlock(out_dim, name=f"up_blocks_{i}_resnets_{j}", **kw)(x, caches)
            mode = cfg.upsample_mode(i)
            if mode is not None:
                x = Upsample(mode, name=f"up_blocks_{i}_upsampler", **kw)(x, caches)
        x = nn.silu(RMSNorm(name="norm_out", **kw)(x))
        x = Conv(cfg.video_channels, (3, 3, 3), name="conv_out", **kw)(x, caches)
        return x, tuple(caches.new)


def _later_chunk(module: "WanVAEDecoder", previous: tuple[jax.Array, ...], x: jax.Array):
    """Scan body: decode one latent frame (B, h, w, C) given the previous chunk's histories."""
    out, caches = module.decoder(x[:, None], previous)
    return caches, out


class WanVAEDecoder(nn.Module):
    """`AutoencoderKLWan.decode`: (B, z_dim, T', h, w) latents -> (B, 3, frames, 8h, 8w) in [-1, 1].

    The latents are the decoder's input as diffusers' `decode` takes them, i.e. already
    de-normalised; `decode_latents` applies the pipelines' `z * std + mean` first.
    """

    cfg: WanVAEConfig

    def setup(self):
        self.post_quant_conv = Conv(self.cfg.z_dim, (1, 1, 1), **self.cfg.kw)
        self.decoder = Decoder3d(self.cfg)

    def __call__(self, z: jax.Array) -> jax.Array:
        cfg = self.cfg
        _check_latents(cfg, z)
        x = self.post_quant_conv(jnp.transpose(z, (0, 2, 3, 4, 1)).astype(cfg.kw["dtype"]))
        out, caches = self.decoder(x[:, :1], None)
        if x.shape[1] > 1:
            scan = nn.scan(_later_chunk, variable_broadcast="params", split_rngs={"params": False}, in_axes=1, out_axes=1)
            _, rest = scan(self, caches, x[:, 1:])  # (B, T' - 1, 2^k, H, W, C)
            out = jnp.concatenate([out, rest.reshape(rest.shape[0], -1, *rest.shape[3:])], axis=1)
        return jnp.clip(jnp.transpose(out, (0, 4, 1, 2, 3)), -1.0, 1.0)


def _check_latents(cfg: WanVAEConfig, z: jax.Array) -> None:
    if z.ndim != 5 or z.shape[1] != cfg.z_dim:
        raise ValueError(f"z must have shape (B, z_dim={cfg.z_dim}, T', h, w), got {z.shape}")


@functools.partial(jax.jit, static_argnums=1)
def decode(params: dict, cfg: WanVAEConfig, z: jax.Array) -> jax.Array:
    """diffusers' `vae.decode(z).sample` for already de-normalised latents (B, z_dim, T', h, w)."""
    return WanVAEDecoder(cfg).apply({"params": params}, z)


def decode_latents(params: dict, cfg: WanVAEConfig, z: jax.Array) -> jax.Array:
    """Decode the denoiser's normalised latents as the Wan / Qwen-Image pipelines do.

    The pipelines de-normalise with `z / (1 / std) + mean` in float32 (that order of
    operations is kept, so the decoder input matches to the last bit), then call
    `vae.decode`. Not jitted itself: the jitted `decode` is shared with raw latents.
    """
    _check_latents(cfg, z)
    shape = (1, cfg.z_dim, 1, 1, 1)
    mean = np.asarray(cfg.latents_mean, np.float32).reshape(shape)
    inv_std = (1.0 / np.asarray(cfg.latents_std, np.float32)).reshape(shape)
    return decode(params, cfg, jnp.asarray(z, jnp.float32) / inv_std + mean)


def example_inputs(cfg: WanVAEConfig, batch: int = 1, latent_frames: int = 2, height: int = 2, width: int = 2) -> dict:
    """Abstract inputs for `init`/`eval_shape`.

    At least two latent frames, so that the temporal upsamplers' `time_conv`s (which
    the first chunk skips) are created.
    """
    return dict(z=jax.ShapeDtypeStruct((batch, cfg.z_dim, latent_frames, height, width), jnp.float32))


def weight_rules(cfg: WanVAEConfig) -> list[WeightRule]:
    """Every Flax parameter and the diffusers state-dict key it comes from (decoder + post_quant_conv)."""

    def conv(path, key):
        return [WeightRule(path + ("kernel",), f"{key}.weight", "conv"), WeightRule(path + ("bias",), f"{key}.bias")]

    def resnet(path, key, has_shortcut):
        rules = conv(path + ("conv1",), f"{key}.conv1") + conv(path + ("conv2",), f"{key}.conv2")
        rules += [WeightRule(path + (n, "gamma"), f"{key}.{n}.gamma") for n in ("norm1", "norm2")]
        if has_shortcut:
            rules += conv(path + ("conv_shortcut",), f"{key}.conv_shortcut")
        return rules

    d, dk = ("decoder",), "decoder"
    dims = cfg.dims
    rules = conv(("post_quant_conv",), "post_quant_conv")
    rules += conv(d + ("conv_in",), f"{dk}.conv_in") + conv(d + ("conv_out",), f"{dk}.conv_out")
    rules.append(WeightRule(d + ("norm_out", "gamma"), f"{dk}.norm_out.gamma"))
    for j in range(2):
        rules += resnet(d + (f"mid_resnets_{j}",), f"{dk}.mid_block.resnets.{j}", False)
    attn, attn_key = d + ("mid_attentions_0",), f"{dk}.mid_block.attentions.0"
    rules += conv(attn + ("to_qkv",), f"{attn_key}.to_qkv") + conv(attn + ("proj",), f"{attn_key}.proj")
    rules.append(WeightRule(attn + ("norm", "gamma"), f"{attn_key}.norm.gamma"))
    in_dim = dims[0]
    for i, out_dim in enumerate(dims[1:]):
        for j in range(cfg.num_res_blocks + 1):
            rules += resnet(d + (f"up_blocks_{i}_resnets_{j}",), f"{dk}.up_blocks.{i}.resnets.{j}", in_dim != out_dim)
            in_dim = out_dim
        mode = cfg.upsample_mode(i)
        if mode is not None:
            up, up_key = d + (f"up_blocks_{i}_upsampler",), f"{dk}.up_blocks.{i}.upsamplers.0"
            rules += conv(up + ("resample",), f"{up_key}.resample.1")
            if mode == "upsample3d":
                rules += conv(up + ("time_conv",), f"{up_key}.time_conv")
            in_dim = out_dim // 2
    return rules


FAMILY = ModelFamily(
    name="vae_wan",
    diffusers_class="AutoencoderKLWan",
    config_cls=WanVAEConfig,
    module_cls=WanVAEDecoder,
    weight_rules=weight_rules,
    example_inputs=example_inputs,
    variants=VARIANTS,
    ignored_prefixes=IGNORED_PREFIXES,
)

# Same decoder, keys and latent statistics; only the config spells the channels `input_channels`.
QWEN_FAMILY = dataclasses.replace(FAMILY, name="vae_qwenimage", diffusers_class="AutoencoderKLQwenImage")
