"""Wan VAE (diffusers `AutoencoderKLWan`) in flax.linen: the Wan2.1 and the Wan2.2 (residual) variants.

`WanVAEDecoder` computes exactly what diffusers' `decode` computes (fp32 parity is tested):
`post_quant_conv`, then the decoder (causal 3D convolutions, channel RMS norms, a mid block
with single-head spatial attention, four up blocks of which the temporally upsampling ones
double the frame count), unpatchify when the config has a `patch_size`, and a clamp to
[-1, 1]. (B, z_dim, T', h, w) latents become (B, 3, 1 + 2^k (T' - 1), s h, s w) videos, with
k the number of temporally upsampling blocks (2 in every released config, hence 4(T' - 1) + 1
frames) and s the spatial compression (8 for Wan2.1; 16 for Wan2.2's 2x2 patches).
`AutoencoderKLQwenImage` has the same decoder, state-dict keys and `_decode`; `QWEN_FAMILY`
ports it with the same module.

`WanVAEEncoder` computes diffusers' `_encode`: patchify, the encoder (causal convolutions,
down blocks whose downsamplers halve space and, where `temperal_downsample` says, time, the
mid block) and `quant_conv`, giving the posterior's (mean, logvar) moments; `encode_latents`
takes the mean (the pipelines' `sample_mode="argmax"`) and normalises it as they do.

The Wan2.2 VAE (`is_residual=True`, `patch_size=2`, z_dim 48) differs in three ways, all
ported: pixels are patchified 2x2 into channels before the encoder and back after the decoder;
each encoder level is a residual block whose shortcut averages channel groups of the
space-to-channel folded input (diffusers' `AvgDown3D`); each decoder level likewise adds a
shortcut that repeats channels into space and time (`DupUp3D`), and its upsampler keeps the
level's width instead of halving it.

Like diffusers, frames are processed one chunk at a time (decoder: one latent frame; encoder:
the first frame, then 4 frames), each causal convolution carrying the last two frames of its
input from chunk to chunk: the first chunk runs on its own, the rest in a `lax.scan`
(`nn.scan`), so intermediate activations are only ever held for one chunk. The first chunk is
special, as in diffusers: the decoder's temporal upsamplers skip their `time_conv` (one latent
frame gives one video frame) and leave an all-zero history (diffusers' "Rep" marker), so the
second chunk's `time_conv` sees zeros where frame 0 would be; the encoder's temporal
downsamplers skip theirs (one frame gives one latent frame) and keep the frame for the next
chunk's strided `time_conv`.

Layout: activations are channels-last (B, T, H, W, C) inside; the public entry points take
and return diffusers' channels-first (B, C, T, H, W). Conv kernels are (kt, kh, kw, in, out);
the RMS-norm `gamma`s keep diffusers' shapes ((C, 1, 1, 1) and (C, 1, 1)), so every weight
converts with the existing 'none' / 'conv' layout changes.

Logical axis names: `vae_in` / `vae_out` for conv input / output channels,
`vae_channels` for norm scales; kernel taps are unnamed (never sharded).

Two families port one `AutoencoderKLWan`: `FAMILY` (`vae_wan`) its decoder, the part a run
needs, which ignores the encoder's keys (`IGNORED_PREFIXES`), and `ENCODER_FAMILY`
(`vae_wan_encoder`) its encoder, which ignores the decoder's (`from_diffusers(vae,
family="vae_wan_encoder")`). Not ported: diffusers' optional spatial tiling (`enable_tiling`,
off by default: decoding here is always untiled, which is what diffusers computes unless
tiling is enabled).
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

# State-dict prefixes of a full `AutoencoderKLWan` that the decoder does not use, and those the
# encoder does not use.
IGNORED_PREFIXES = ("encoder.", "quant_conv.")
ENCODER_IGNORED_PREFIXES = ("decoder.", "post_quant_conv.")

# diffusers' `_encode` feeds the encoder the first frame, then chunks of this many frames.
ENCODE_CHUNK = 4

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

# The Wan2.2 VAE's latent statistics (Wan-AI/Wan2.2-TI2V-5B-Diffusers vae/config.json).
LATENTS_MEAN_22 = (
    -0.2289, -0.0052, -0.1323, -0.2339, -0.2799, 0.0174, 0.1838, 0.1557,
    -0.1382, 0.0542, 0.2813, 0.0891, 0.1570, -0.0098, 0.0375, -0.1825,
    -0.2246, -0.1207, -0.0698, 0.5109, 0.2665, -0.2108, -0.2158, 0.2502,
    -0.2055, -0.0322, 0.1109, 0.1567, -0.0729, 0.0899, -0.2799, -0.1230,
    -0.0313, -0.1649, 0.0117, 0.0723, -0.2839, -0.2083, -0.0520, 0.3748,
    0.0152, 0.1957, 0.1433, -0.2944, 0.3573, -0.0548, -0.1681, -0.0667,
)  # fmt: skip
LATENTS_STD_22 = (
    0.4765, 1.0364, 0.4514, 1.1677, 0.5313, 0.4990, 0.4818, 0.5013,
    0.8158, 1.0344, 0.5894, 1.0901, 0.6885, 0.6165, 0.8454, 0.4978,
    0.5759, 0.3523, 0.7135, 0.6804, 0.5833, 1.4146, 0.8986, 0.5659,
    0.7069, 0.5338, 0.4889, 0.4917, 0.4069, 0.4999, 0.6866, 0.4093,
    0.5709, 0.6065, 0.6415, 0.4944, 0.5726, 1.2042, 0.5458, 1.6887,
    0.3971, 1.0600, 0.3943, 0.5537, 0.5444, 0.4089, 0.7468, 0.7744,
)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class WanVAEConfig:
    """Architecture (the diffusers `AutoencoderKLWan` config fields) plus the execution policy.

    `base_dim` is the encoder's width and the decoder's unless `decoder_base_dim` is set;
    `in_channels` / `out_channels` count the encoder's input and the decoder's output channels
    after patchifying (3 * patch_size^2); `attn_scales` would add attention to the Wan2.1
    encoder (not ported: empty in every released config) and `dropout` does nothing at inference.
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
        patch = self.patch_size or 1
        channels = self.out_channels if self.input_channels is None else self.input_channels
        if channels % (patch * patch) or self.in_channels % (patch * patch):
            raise ValueError(
                f"in_channels={self.in_channels} and out_channels={channels} must be multiples of "
                f"patch_size^2={patch * patch} (they count patchified channels)"
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
    def decoder_channels(self) -> int:
        """Channels of the decoder's `conv_out`: Qwen-Image's `input_channels`, else `out_channels`."""
        return self.out_channels if self.input_channels is None else self.input_channels

    @property
    def encoder_dims(self) -> tuple[int, ...]:
        """The encoder's widths: `conv_in`'s output, then each down level's (diffusers' `dims`)."""
        return tuple(self.base_dim * u for u in (1,) + self.dim_mult)

    @property
    def spatial_compression(self) -> int:
        """Pixels per latent along height and width: the patch times 2 per down level."""
        return (self.patch_size or 1) * 2 ** (len(self.dim_mult) - 1)

    def downsample_mode(self, i: int) -> str | None:
        """Encoder level i's resampler: 'downsample3d' (time and space), 'downsample2d' or None (last level)."""
        if i == len(self.dim_mult) - 1:
            return None
        return "downsample3d" if self.temperal_downsample[i] else "downsample2d"

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
    # The Wan2.2 VAE of TI2V-5B (Wan-AI/Wan2.2-TI2V-5B-Diffusers vae/config.json).
    "wan2.2": WanVAEConfig(
        base_dim=160, decoder_base_dim=256, z_dim=48, in_channels=12, out_channels=12, is_residual=True,
        patch_size=2, scale_factor_spatial=16, latents_mean=LATENTS_MEAN_22, latents_std=LATENTS_STD_22,
    ),
    # Structurally identical to "wan2.2" with 8- and 16-channel bases and z_dim 8, for CPU tests.
    "tiny22": WanVAEConfig(
        base_dim=8, decoder_base_dim=16, z_dim=8, in_channels=12, out_channels=12, is_residual=True,
        patch_size=2, scale_factor_spatial=16, latents_mean=LATENTS_MEAN_22[:8], latents_std=LATENTS_STD_22[:8],
    ),
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

    A 3-tap `kernel_size` (kt, kh, kw) is `WanCausalConv3d`: with kt = 3 and `caches` the input is
    prefixed with the previous chunk's last two frames, exactly what diffusers' `cache_x` plus
    the remaining zero padding give; without `caches` it is valid in time (the caller supplies
    the history); kt = 1 needs none. A 2-tap (kh, kw) is an `nn.Conv2d` applied frame by
    frame, its kernel kept 4-D so that diffusers' weight converts with the plain 'conv' layout
    change. `strides` are (t, h, w); `padding` the (low, high) spatial zero padding of H and W,
    by default k // 2 on both sides.
    """

    features: int
    kernel_size: tuple[int, ...]
    strides: tuple[int, int, int] = (1, 1, 1)
    padding: tuple[tuple[int, int], tuple[int, int]] | None = None
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
        if kt > 1 and caches is not None:  # kt = CACHE_T + 1 = 3: the history is exactly the causal padding
            x = jnp.concatenate([caches.history(x), x], axis=1)
            caches.record(x[:, -CACHE_T:])
        kh, kw = self.kernel_size[-2:]
        padding = self.padding or ((kh // 2, kh // 2), (kw // 2, kw // 2))
        y = jax.lax.conv_general_dilated(
            x.astype(self.dtype),
            kernel.reshape((kt,) + kernel.shape[-4:]).astype(self.dtype),
            window_strides=self.strides,
            padding=((0, 0),) + tuple(padding),
            dimension_numbers=("NDHWC", "DHWIO", "NDHWC"),
        )
        return y + bias.astype(self.dtype)


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
    features: int | None = None  # the resample conv's output width; None: half the input's
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
        return Conv(self.features or c // 2, (3, 3), name="resample", **kw)(x)


class Downsample(nn.Module):
    """`WanResample` in 'downsample2d' / 'downsample3d' mode (the encoder's).

    Both halve space frame by frame: zero padding of one pixel at the bottom and right, then a
    3x3 conv of stride 2. 'downsample3d' then halves time with `time_conv`, a (3, 1, 1) conv of
    stride 2 over the previous chunk's last frame and this chunk's frames -- except on the first
    chunk, which diffusers leaves as it is (one frame) and only keeps for the next.
    """

    mode: str
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, caches: _Caches) -> jax.Array:
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        c = x.shape[-1]
        x = Conv(c, (3, 3), strides=(1, 2, 2), padding=((0, 1), (0, 1)), name="resample", **kw)(x)
        if self.mode == "downsample3d":
            previous = None if caches.first else caches.history(x)
            caches.record(x[:, -1:])
            if previous is not None:
                x = Conv(c, (3, 1, 1), strides=(2, 1, 1), name="time_conv", **kw)(jnp.concatenate([previous, x], 1))
        return x


def avg_down(x: jax.Array, features: int, factor_t: int, factor_s: int) -> jax.Array:
    """diffusers' `AvgDown3D` on (B, T, H, W, C): zero frames in front up to a multiple of
    `factor_t`, fold each (factor_t, factor_s, factor_s) block into channels ordered (C, t, h, w),
    then average consecutive groups of them down to `features` channels."""
    pad = -x.shape[1] % factor_t
    x = jnp.pad(x, ((0, 0), (pad, 0), (0, 0), (0, 0), (0, 0)))
    b, t, h, w, c = x.shape
    x = x.reshape(b, t // factor_t, factor_t, h // factor_s, factor_s, w // factor_s, factor_s, c)
    x = x.transpose(0, 1, 3, 5, 7, 2, 4, 6).reshape(b, t // factor_t, h // factor_s, w // factor_s, features, -1)
    return jnp.mean(x, axis=-1)


def dup_up(x: jax.Array, features: int, factor_t: int, factor_s: int, first_chunk: bool) -> jax.Array:
    """diffusers' `DupUp3D` on (B, T, H, W, C): repeat each channel into `features` channels of
    (factor_t, factor_s, factor_s) blocks, unfolded into time and space; the first chunk keeps
    only the last of its `factor_t` frames."""
    b, t, h, w, c = x.shape
    x = jnp.repeat(x, features * factor_t * factor_s * factor_s // c, axis=-1)
    x = x.reshape(b, t, h, w, features, factor_t, factor_s, factor_s).transpose(0, 1, 5, 2, 6, 3, 7, 4)
    x = x.reshape(b, t * factor_t, h * factor_s, w * factor_s, features)
    return x[:, factor_t - 1 :] if first_chunk else x


def patchify(x: jax.Array, patch: int | None) -> jax.Array:
    """diffusers' `patchify` on (B, T, H, W, C): each patch x patch block into channels ordered (C, w, h)."""
    if not patch:
        return x
    b, t, h, w, c = x.shape
    x = x.reshape(b, t, h // patch, patch, w // patch, patch, c).transpose(0, 1, 2, 4, 6, 5, 3)
    return x.reshape(b, t, h // patch, w // patch, c * patch * patch)


def unpatchify(x: jax.Array, patch: int | None) -> jax.Array:
    """The inverse of `patchify` (diffusers' `unpatchify`)."""
    if not patch:
        return x
    b, t, h, w, cp = x.shape
    x = x.reshape(b, t, h, w, cp // (patch * patch), patch, patch).transpose(0, 1, 2, 6, 3, 5, 4)
    return x.reshape(b, t, h * patch, w * patch, -1)


class Decoder3d(nn.Module):
    """`WanDecoder3d` on one chunk: its latent frame(s) in, its video frames out.

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
            level_input = x
            for j in range(cfg.num_res_blocks + 1):
                x = ResidualBlock(out_dim, name=f"up_blocks_{i}_resnets_{j}", **kw)(x, caches)
            mode = cfg.upsample_mode(i)
            if mode is not None:
                # The residual decoder's upsamplers keep the level's width; Wan2.1's halve it.
                features = out_dim if cfg.is_residual else None
                x = Upsample(mode, features, name=f"up_blocks_{i}_upsampler", **kw)(x, caches)
                if cfg.is_residual:
                    factor_t = 2 if mode == "upsample3d" else 1
                    x = x + dup_up(level_input, out_dim, factor_t, 2, caches.first)
        x = nn.silu(RMSNorm(name="norm_out", **kw)(x))
        x = Conv(cfg.decoder_channels, (3, 3, 3), name="conv_out", **kw)(x, caches)
        return x, tuple(caches.new)


def _later_chunk(module: "WanVAEDecoder", previous: tuple[jax.Array, ...], x: jax.Array):
    """Scan body: decode one latent frame (B, h, w, C) given the previous chunk's histories."""
    out, caches = module.decoder(x[:, None], previous)
    return caches, out


class WanVAEDecoder(nn.Module):
    """`AutoencoderKLWan.decode`: (B, z_dim, T', h, w) latents -> (B, 3, frames, s h, s w) in [-1, 1].

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
        out = unpatchify(out, cfg.patch_size)
        return jnp.clip(jnp.transpose(out, (0, 4, 1, 2, 3)), -1.0, 1.0)


class Encoder3d(nn.Module):
    """`WanEncoder3d` on one chunk: its frames in (patchified), its latent frame(s) out.

    `previous` is the tuple of causal histories the previous chunk returned, or None for the
    first chunk. Returns the chunk's (mean, logvar) features (2 z_dim channels) and the new
    histories.
    """

    cfg: WanVAEConfig

    @nn.compact
    def __call__(self, x: jax.Array, previous: tuple[jax.Array, ...] | None):
        cfg = self.cfg
        kw = cfg.kw
        dims = cfg.encoder_dims
        _check_encoder_config(cfg)
        caches = _Caches(previous)
        x = Conv(dims[0], (3, 3, 3), name="conv_in", **kw)(x, caches)
        for i, out_dim in enumerate(dims[1:]):
            level_input = x
            for j in range(cfg.num_res_blocks):
                x = ResidualBlock(out_dim, name=f"down_blocks_{i}_resnets_{j}", **kw)(x, caches)
            mode = cfg.downsample_mode(i)
            if mode is not None:
                x = Downsample(mode, name=f"down_blocks_{i}_downsampler", **kw)(x, caches)
            if cfg.is_residual:
                factor_t, factor_s = (2 if mode == "downsample3d" else 1), (2 if mode else 1)
                x = x + avg_down(level_input, out_dim, factor_t, factor_s)
        x = ResidualBlock(dims[-1], name="mid_resnets_0", **kw)(x, caches)
        x = AttentionBlock(name="mid_attentions_0", **kw)(x)
        x = ResidualBlock(dims[-1], name="mid_resnets_1", **kw)(x, caches)
        x = nn.silu(RMSNorm(name="norm_out", **kw)(x))
        x = Conv(2 * cfg.z_dim, (3, 3, 3), name="conv_out", **kw)(x, caches)
        return x, tuple(caches.new)


def _check_encoder_config(cfg: WanVAEConfig) -> None:
    if cfg.attn_scales and not cfg.is_residual:
        raise ValueError(
            f"attn_scales={list(cfg.attn_scales)}: the encoder's attention blocks are not ported (diffusers' "
            "encoder cannot run them either); every released Wan VAE has attn_scales=[]"
        )


def _later_encode_chunk(module: "WanVAEEncoder", previous: tuple[jax.Array, ...], x: jax.Array):
    """Scan body: encode one chunk of ENCODE_CHUNK frames given the previous chunk's histories."""
    out, caches = module.encoder(x, previous)
    return caches, out


class WanVAEEncoder(nn.Module):
    """`AutoencoderKLWan._encode`: (B, 3, 1 + 4k, H, W) video in [-1, 1] -> the posterior's
    moments (B, 2 z_dim, 1 + k, H / s, W / s), mean then logvar along channels (unclamped, as
    diffusers' `latent_dist.parameters`)."""

    cfg: WanVAEConfig

    def setup(self):
        self.encoder = Encoder3d(self.cfg)
        self.quant_conv = Conv(2 * self.cfg.z_dim, (1, 1, 1), **self.cfg.kw)

    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.cfg
        _check_video(cfg, x)
        x = patchify(jnp.transpose(x, (0, 2, 3, 4, 1)).astype(cfg.kw["dtype"]), cfg.patch_size)
        out, caches = self.encoder(x[:, :1], None)
        if x.shape[1] > 1:
            b, t, *rest = x.shape
            chunks = x[:, 1:].reshape(b, (t - 1) // ENCODE_CHUNK, ENCODE_CHUNK, *rest)
            scan = nn.scan(
                _later_encode_chunk, variable_broadcast="params", split_rngs={"params": False}, in_axes=1, out_axes=1
            )
            _, later = scan(self, caches, chunks)  # (B, k, 1, h, w, 2 z_dim)
            out = jnp.concatenate([out, later.reshape(b, -1, *later.shape[3:])], axis=1)
        return jnp.transpose(self.quant_conv(out), (0, 4, 1, 2, 3))


def _check_video(cfg: WanVAEConfig, x: jax.Array) -> None:
    channels = cfg.in_channels // (cfg.patch_size or 1) ** 2
    side = cfg.spatial_compression
    if x.ndim != 5 or x.shape[1] != channels:
        raise ValueError(f"video must have shape (B, {channels}, 1 + 4k, H, W), got {x.shape}")
    if (x.shape[2] - 1) % ENCODE_CHUNK or x.shape[3] % side or x.shape[4] % side:
        raise ValueError(
            f"video of shape {x.shape}: the frame count must be 1 + {ENCODE_CHUNK}k and height and width "
            f"multiples of {side}"
        )


@functools.partial(jax.jit, static_argnums=1)
def encode(params: dict, cfg: WanVAEConfig, x: jax.Array) -> jax.Array:
    """diffusers' `vae.encode(x).latent_dist.parameters`: (mean, logvar) moments of a (B, 3, F, H, W) video."""
    return WanVAEEncoder(cfg).apply({"params": params}, x)


def encode_latents(params: dict, cfg: WanVAEConfig, x: jax.Array) -> jax.Array:
    """Encode a video (B, 3, F, H, W) in [-1, 1] into the denoiser's normalised latents as the Wan
    pipelines do: the posterior mean (`sample_mode="argmax"`), then `(z - mean) * (1 / std)`."""
    moments = encode(params, cfg, jnp.asarray(x, jnp.float32))
    shape = (1, cfg.z_dim, 1, 1, 1)
    mean = np.asarray(cfg.latents_mean, np.float32).reshape(shape)
    inv_std = (1.0 / np.asarray(cfg.latents_std, np.float32)).reshape(shape)
    return (moments[:, : cfg.z_dim].astype(jnp.float32) - mean) * inv_std


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


def encoder_example_inputs(cfg: WanVAEConfig, batch: int = 1, frames: int = 5, height: int | None = None,
                           width: int | None = None) -> dict:
    """Abstract inputs for the encoder's `init`/`eval_shape`: two chunks by default, so that the
    temporal downsamplers' `time_conv`s (which the first chunk skips) are created."""
    side = cfg.spatial_compression
    shape = (batch, cfg.in_channels // (cfg.patch_size or 1) ** 2, frames, height or side, width or side)
    return dict(x=jax.ShapeDtypeStruct(shape, jnp.float32))


def _conv_rules(path, key):
    return [WeightRule(path + ("kernel",), f"{key}.weight", "conv"), WeightRule(path + ("bias",), f"{key}.bias")]


def _resnet_rules(path, key, has_shortcut):
    rules = _conv_rules(path + ("conv1",), f"{key}.conv1") + _conv_rules(path + ("conv2",), f"{key}.conv2")
    rules += [WeightRule(path + (n, "gamma"), f"{key}.{n}.gamma") for n in ("norm1", "norm2")]
    if has_shortcut:
        rules += _conv_rules(path + ("conv_shortcut",), f"{key}.conv_shortcut")
    return rules


def _attention_rules(path, key):
    rules = _conv_rules(path + ("to_qkv",), f"{key}.to_qkv") + _conv_rules(path + ("proj",), f"{key}.proj")
    return rules + [WeightRule(path + ("norm", "gamma"), f"{key}.norm.gamma")]


def _mid_and_head_rules(path, key):
    rules = _conv_rules(path + ("conv_in",), f"{key}.conv_in") + _conv_rules(path + ("conv_out",), f"{key}.conv_out")
    rules.append(WeightRule(path + ("norm_out", "gamma"), f"{key}.norm_out.gamma"))
    for j in range(2):
        rules += _resnet_rules(path + (f"mid_resnets_{j}",), f"{key}.mid_block.resnets.{j}", False)
    return rules + _attention_rules(path + ("mid_attentions_0",), f"{key}.mid_block.attentions.0")


def weight_rules(cfg: WanVAEConfig) -> list[WeightRule]:
    """Every Flax parameter of the decoder and the diffusers state-dict key it comes from
    (decoder + post_quant_conv)."""
    d, dk = ("decoder",), "decoder"
    dims = cfg.dims
    rules = _conv_rules(("post_quant_conv",), "post_quant_conv") + _mid_and_head_rules(d, dk)
    in_dim = dims[0]
    for i, out_dim in enumerate(dims[1:]):
        for j in range(cfg.num_res_blocks + 1):
            key = f"{dk}.up_blocks.{i}.resnets.{j}"
            rules += _resnet_rules(d + (f"up_blocks_{i}_resnets_{j}",), key, in_dim != out_dim)
            in_dim = out_dim
        mode = cfg.upsample_mode(i)
        if mode is not None:
            # diffusers names the residual levels' upsampler `upsampler`, Wan2.1's `upsamplers.0`.
            up_key = f"{dk}.up_blocks.{i}." + ("upsampler" if cfg.is_residual else "upsamplers.0")
            up = d + (f"up_blocks_{i}_upsampler",)
            rules += _conv_rules(up + ("resample",), f"{up_key}.resample.1")
            if mode == "upsample3d":
                rules += _conv_rules(up + ("time_conv",), f"{up_key}.time_conv")
            in_dim = out_dim if cfg.is_residual else out_dim // 2
    return rules


def encoder_weight_rules(cfg: WanVAEConfig) -> list[WeightRule]:
    """Every Flax parameter of the encoder and the diffusers state-dict key it comes from
    (encoder + quant_conv). The residual encoder's levels are `down_blocks.{i}` with `resnets`
    and a `downsampler`; Wan2.1's are consecutive `down_blocks.{n}` entries (resnets, then the
    resample)."""
    _check_encoder_config(cfg)
    e, ek = ("encoder",), "encoder"
    rules = _conv_rules(("quant_conv",), "quant_conv") + _mid_and_head_rules(e, ek)
    dims = cfg.encoder_dims
    in_dim, n = dims[0], 0
    for i, out_dim in enumerate(dims[1:]):
        for j in range(cfg.num_res_blocks):
            key = f"{ek}.down_blocks.{i}.resnets.{j}" if cfg.is_residual else f"{ek}.down_blocks.{n}"
            rules += _resnet_rules(e + (f"down_blocks_{i}_resnets_{j}",), key, in_dim != out_dim)
            in_dim, n = out_dim, n + 1
        mode = cfg.downsample_mode(i)
        if mode is not None:
            key = f"{ek}.down_blocks.{i}.downsampler" if cfg.is_residual else f"{ek}.down_blocks.{n}"
            n += 1
            down = e + (f"down_blocks_{i}_downsampler",)
            rules += _conv_rules(down + ("resample",), f"{key}.resample.1")
            if mode == "downsample3d":
                rules += _conv_rules(down + ("time_conv",), f"{key}.time_conv")
    return rules


def decode_frames(params: dict, cfg: WanVAEConfig, z: jax.Array) -> jax.Array:
    """`decode_latents` of (B, C, T, H, W) video latents, or of (B, C, H, W) image latents
    (Qwen-Image's) as one-frame videos."""
    return decode_latents(params, cfg, z[:, :, None] if z.ndim == 4 else z)


FAMILY = ModelFamily(
    name="vae_wan",
    diffusers_class="AutoencoderKLWan",
    config_cls=WanVAEConfig,
    module_cls=WanVAEDecoder,
    weight_rules=weight_rules,
    example_inputs=example_inputs,
    variants=VARIANTS,
    ignored_prefixes=IGNORED_PREFIXES,
    decode_frames=decode_frames,
)

# Same decoder, keys and latent statistics; only the config spells the channels `input_channels`.
QWEN_FAMILY = dataclasses.replace(FAMILY, name="vae_qwenimage", diffusers_class="AutoencoderKLQwenImage")

# The encoder of the same `AutoencoderKLWan` (`from_diffusers(vae, family="vae_wan_encoder")`).
ENCODER_FAMILY = ModelFamily(
    name="vae_wan_encoder",
    diffusers_class="AutoencoderKLWan",
    config_cls=WanVAEConfig,
    module_cls=WanVAEEncoder,
    weight_rules=encoder_weight_rules,
    example_inputs=encoder_example_inputs,
    variants=VARIANTS,
    ignored_prefixes=ENCODER_IGNORED_PREFIXES,
)
