"""HunyuanVideo VAE decoder (diffusers `AutoencoderKLHunyuanVideo.decode`) in flax.linen.

Computes what diffusers' `decode` computes (fp32 parity is tested, tiled and untiled): a 1x1x1
`post_quant_conv`, then `HunyuanVideoDecoder3D`: a causal `conv_in`, a mid block
(ResNet, single-head self-attention over all pixels of all frames with a causal
frame mask, ResNet), four up blocks (`layers_per_block + 1` ResNets, then an
upsampler on all but the last), GroupNorm -> SiLU -> causal `conv_out`. The output
is not clamped, as in diffusers. (B, 16, T', h, w) latents become
(B, 3, 4(T' - 1) + 1, 8h, 8w) videos. `decode_latents` adds the HunyuanVideo
pipeline's de-normalisation `z / scaling_factor` (no shift) in front.

Quirks reproduced:
* `HunyuanVideoCausalConv3d` pads *replicating* edge values, not zeros: kt - 1
  copies of the first frame in front (none behind) and k // 2 edge pixels on each
  side in space, then runs a valid convolution.
* `HunyuanVideoUpsampleCausal3D` upsamples the first frame in space only and the
  others in time and space (nearest), so T frames become 1 + 2(T - 1).
* The mid attention lets a pixel of frame i attend to every pixel of frames <= i
  (`prepare_causal_attention_mask`), so its output is causal in time.

`decode` splits long or large latents into overlapping tiles as diffusers' `decode` does
(`Tiling`, defaults as diffusers sets them): with `use_framewise_decoding` (on) more than
`tile_sample_min_num_frames // 4` latent frames are decoded in temporal tiles of that many
plus one, `tile_sample_stride_num_frames // 4` apart; each tile after the first drops its
first frame, its first `min - stride` frames fade linearly from the previous tile's last
ones, and the tiles are cut to the stride and joined. With `use_tiling` (diffusers'
`enable_tiling`, off by default) latents wider or taller than `tile_sample_min_* // 8`
are decoded in spatial tiles the same way (fade from the tile above, then from the tile to
the left, each already faded). Tiles of one shape run in one sequential `lax.map`, so
activations are held for one tile at a time. `UNTILED` decodes the whole clip at once
(`HunyuanVideoVAEDecoder`, diffusers with framewise decoding and tiling off). The
encoder is not ported (`IGNORED_PREFIXES`).

Layout: activations are channels-last (B, T, H, W, C) inside; the public entry
points take and return diffusers' channels-first (B, C, T, H, W). Conv kernels are
(kt, kh, kw, in, out) (the 'conv' layout change of diffusers' (out, in, kt, kh, kw)).
Numerics: GroupNorms (eps 1e-6) and the attention softmax run in float32 whatever the
compute dtype.

Logical axis names: `vae_in` / `vae_out` for conv and attention input / output
channels, `vae_channels` for norm scales and biases; kernel taps are unnamed (never
sharded).
"""
from __future__ import annotations

import dataclasses
import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from digen_jax.models import layers
from digen_jax.models.conversion import ModelFamily, WeightRule, linear_rules

# State-dict prefixes of a full `AutoencoderKLHunyuanVideo` that the decoder does not use.
IGNORED_PREFIXES = ("encoder.", "quant_conv.")

GROUP_NORM_EPS = 1e-6  # diffusers' `resnet_eps` for every norm of the decoder
_group_norm = functools.partial(layers.GroupNorm, eps=GROUP_NORM_EPS, axis_name="vae_channels")


@dataclasses.dataclass(frozen=True)
class HunyuanVideoVAEConfig:
    """Architecture (the diffusers `AutoencoderKLHunyuanVideo` config fields) plus the execution policy.

    Defaults are the released HunyuanVideo `vae/config.json`. `in_channels` and
    `down_block_types` describe the encoder; they are accepted so that a full config loads.
    """

    in_channels: int = 3
    out_channels: int = 3
    latent_channels: int = 16
    down_block_types: tuple[str, ...] = ("HunyuanVideoDownBlock3D",) * 4
    up_block_types: tuple[str, ...] = ("HunyuanVideoUpBlock3D",) * 4
    block_out_channels: tuple[int, ...] = (128, 256, 512, 512)
    layers_per_block: int = 2
    act_fn: str = "silu"
    norm_num_groups: int = 32
    scaling_factor: float = 0.476986
    spatial_compression_ratio: int = 8
    temporal_compression_ratio: int = 4
    mid_block_add_attention: bool = True
    # Execution policy: not part of the weights.
    dtype: str = "float32"  # compute dtype of convolutions, attention and activations
    param_dtype: str = "float32"  # master weights

    def __post_init__(self):
        for name in ("down_block_types", "up_block_types", "block_out_channels"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        if len(self.up_block_types) != len(self.block_out_channels):
            raise ValueError(
                f"up_block_types has {len(self.up_block_types)} entries but block_out_channels has "
                f"{len(self.block_out_channels)}: diffusers pairs them one to one"
            )
        unsupported = sorted(set(self.up_block_types) - {"HunyuanVideoUpBlock3D"})
        if unsupported:
            raise ValueError(f"up block types {unsupported} are not supported (diffusers rejects them too)")
        if self.temporal_compression_ratio != 4:
            # diffusers' decoder raises for any other ratio as well.
            raise ValueError(f"temporal_compression_ratio must be 4, got {self.temporal_compression_ratio}")
        if self.act_fn not in ("silu", "swish"):
            raise ValueError(f"act_fn {self.act_fn!r} is not implemented; HunyuanVideo uses 'silu'")
        bad = [c for c in self.block_out_channels if c % self.norm_num_groups]
        if bad:
            raise ValueError(f"block_out_channels {bad} do not divide into norm_num_groups={self.norm_num_groups}")

    def upsample_factor(self, i: int) -> tuple[int, int, int] | None:
        """Up block i's (t, h, w) upsampling factor, or None where it has no upsampler (diffusers' rule)."""
        n = len(self.block_out_channels)
        spatial = i < int(math.log2(self.spatial_compression_ratio))
        temporal = i >= n - 1 - int(math.log2(self.temporal_compression_ratio)) and i != n - 1
        if not (spatial or temporal):
            return None
        return (2 if temporal else 1,) + ((2, 2) if spatial else (1, 1))

    def num_frames(self, latent_frames: int) -> int:
        """Video frames decoded from `latent_frames`: the first gives one, each later one 2^k."""
        k = sum(f[0] == 2 for f in map(self.upsample_factor, range(len(self.block_out_channels))) if f)
        return 1 + (latent_frames - 1) * 2**k

    @property
    def kw(self) -> dict:
        return dict(dtype=jnp.dtype(self.dtype), param_dtype=jnp.dtype(self.param_dtype))


VARIANTS = {
    "hunyuan_video": HunyuanVideoVAEConfig(),
    # The released structure with 8-channel bases (docs/models.md section 4), for CPU tests.
    "tiny": HunyuanVideoVAEConfig(block_out_channels=(8, 16, 32, 32), latent_channels=4, norm_num_groups=4),
}


class CausalConv3d(nn.Module):
    """`HunyuanVideoCausalConv3d` (stride 1) on (B, T, H, W, C): replicate padding, causal in time."""

    features: int
    kernel_size: int
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        k = self.kernel_size
        kernel = self.param(
            "kernel",
            nn.with_logical_partitioning(nn.initializers.lecun_normal(), (None, None, None, "vae_in", "vae_out")),
            (k, k, k, x.shape[-1], self.features),
            self.param_dtype,
        )
        bias_init = nn.with_logical_partitioning(nn.initializers.zeros_init(), ("vae_out",))
        bias = self.param("bias", bias_init, (self.features,), self.param_dtype)
        if k > 1:
            # F.pad(..., mode="replicate") with (k//2, k//2, k//2, k//2, k - 1, 0): W, H, then T (front only).
            x = jnp.pad(x, ((0, 0), (k - 1, 0), (k // 2, k // 2), (k // 2, k // 2), (0, 0)), mode="edge")
        y = jax.lax.conv_general_dilated(
            x.astype(self.dtype),
            kernel.astype(self.dtype),
            window_strides=(1, 1, 1),
            padding="VALID",
            dimension_numbers=("NDHWC", "DHWIO", "NDHWC"),
        )
        return y + bias.astype(self.dtype)


class ResnetBlock(nn.Module):
    """`HunyuanVideoResnetBlockCausal3D`: (GroupNorm, SiLU, causal 3x3x3 conv) twice, plus a skip.

    The skip is a 1x1x1 `conv_shortcut` where the channel count changes.
    """

    cfg: HunyuanVideoVAEConfig
    features: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.cfg
        norm_kw = dict(num_groups=cfg.norm_num_groups, param_dtype=cfg.kw["param_dtype"])
        h = nn.silu(_group_norm(name="norm1", **norm_kw)(x))
        h = CausalConv3d(self.features, 3, name="conv1", **cfg.kw)(h)
        h = nn.silu(_group_norm(name="norm2", **norm_kw)(h))
        h = CausalConv3d(self.features, 3, name="conv2", **cfg.kw)(h)
        if x.shape[-1] != self.features:
            x = CausalConv3d(self.features, 1, name="conv_shortcut", **cfg.kw)(x)
        return h + x


class MidAttention(nn.Module):
    """The mid block's `Attention`: GroupNorm, one head over all pixels of all frames, residual add.

    diffusers builds it with `attention_head_dim = channels`, hence one head, and
    passes `prepare_causal_attention_mask`: pixels of frame i see frames 0..i only.
    Every query sees its own frame, so no row of the mask is fully masked.
    """

    cfg: HunyuanVideoVAEConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.cfg
        b, t, h, w, c = x.shape
        normed = _group_norm(num_groups=cfg.norm_num_groups, param_dtype=cfg.kw["param_dtype"], name="group_norm")(x)
        tokens = normed.reshape(b, t * h * w, c)
        dense = functools.partial(layers.logical_dense, c, ("vae_in", "vae_out"), **cfg.kw)
        q, k, v = (dense(name=n)(tokens) for n in ("to_q", "to_k", "to_v"))
        frame = jnp.repeat(jnp.arange(t), h * w)
        causal = frame[None, :] <= frame[:, None]  # (query, key)
        logits = jnp.einsum("bqc,bkc->bqk", q, k).astype(jnp.float32) / math.sqrt(c)
        weights = jax.nn.softmax(jnp.where(causal, logits, -jnp.inf), axis=-1).astype(cfg.kw["dtype"])
        out = jnp.einsum("bqk,bkc->bqc", weights, v)
        return x + dense(name="to_out")(out).reshape(b, t, h, w, c)


class Upsample(nn.Module):
    """`HunyuanVideoUpsampleCausal3D`: nearest upsampling (first frame in space only), then a causal conv."""

    cfg: HunyuanVideoVAEConfig
    factor: tuple[int, int, int]

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        ft, fh, fw = self.factor
        x = jnp.repeat(jnp.repeat(x, fh, axis=2), fw, axis=3)
        # Frame 0 stays one frame; nearest interpolation repeats each later frame ft times.
        x = jnp.concatenate([x[:, :1], jnp.repeat(x[:, 1:], ft, axis=1)], axis=1)
        return CausalConv3d(x.shape[-1], 3, name="conv", **self.cfg.kw)(x)


class Decoder(nn.Module):
    """`HunyuanVideoDecoder3D` on channels-last (B, T', h, w, C) latents."""

    cfg: HunyuanVideoVAEConfig

    @nn.compact
    def __call__(self, z: jax.Array) -> jax.Array:
        cfg = self.cfg
        channels = cfg.block_out_channels[::-1]
        x = CausalConv3d(channels[0], 3, name="conv_in", **cfg.kw)(z)
        x = ResnetBlock(cfg, channels[0], name="mid_block_resnets_0")(x)
        if cfg.mid_block_add_attention:
            x = MidAttention(cfg, name="mid_block_attentions_0")(x)
        x = ResnetBlock(cfg, channels[0], name="mid_block_resnets_1")(x)
        for i, out in enumerate(channels):
            for j in range(cfg.layers_per_block + 1):
                x = ResnetBlock(cfg, out, name=f"up_blocks_{i}_resnets_{j}")(x)
            factor = cfg.upsample_factor(i)
            if factor is not None:
                x = Upsample(cfg, factor, name=f"up_blocks_{i}_upsamplers_0")(x)
        x = nn.silu(_group_norm(num_groups=cfg.norm_num_groups, param_dtype=cfg.kw["param_dtype"], name="conv_norm_out")(x))
        return CausalConv3d(cfg.out_channels, 3, name="conv_out", **cfg.kw)(x)


class HunyuanVideoVAEDecoder(nn.Module):
    """`AutoencoderKLHunyuanVideo.decode` (untiled): (B, C, T', h, w) -> (B, 3, 4(T'-1)+1, 8h, 8w), unclamped.

    Takes latents already de-normalised (what the pipeline passes to `vae.decode`);
    `decode_latents` starts from the transformer's latents instead.
    """

    cfg: HunyuanVideoVAEConfig

    @nn.compact
    def __call__(self, z: jax.Array) -> jax.Array:
        cfg = self.cfg
        _check_latents(cfg, z)
        x = jnp.transpose(z, (0, 2, 3, 4, 1)).astype(cfg.kw["dtype"])
        x = CausalConv3d(cfg.latent_channels, 1, name="post_quant_conv", **cfg.kw)(x)
        x = Decoder(cfg, name="decoder")(x)
        return jnp.transpose(x, (0, 4, 1, 2, 3))


def _check_latents(cfg: HunyuanVideoVAEConfig, z: jax.Array) -> None:
    if z.ndim != 5 or z.shape[1] != cfg.latent_channels:
        raise ValueError(f"z must have shape (B, {cfg.latent_channels}, T', h, w), got {z.shape}")


@dataclasses.dataclass(frozen=True)
class Tiling:
    """How `decode` tiles: diffusers' `AutoencoderKLHunyuanVideo` attributes of the same names,
    defaults as diffusers sets them (sizes and strides in video frames and pixels)."""

    use_framewise_decoding: bool = True  # temporal tiles beyond tile_sample_min_num_frames // 4 latent frames
    use_tiling: bool = False  # spatial tiles (diffusers' `enable_tiling`)
    tile_sample_min_height: int = 256
    tile_sample_min_width: int = 256
    tile_sample_min_num_frames: int = 16
    tile_sample_stride_height: int = 192
    tile_sample_stride_width: int = 192
    tile_sample_stride_num_frames: int = 12

    def __post_init__(self):
        for axis in ("height", "width", "num_frames"):
            size, stride = getattr(self, f"tile_sample_min_{axis}"), getattr(self, f"tile_sample_stride_{axis}")
            if not 0 < stride <= size:
                raise ValueError(f"tile_sample_stride_{axis}={stride} must be in (0, tile_sample_min_{axis}={size}]")

    def temporal_tiles(self, cfg: HunyuanVideoVAEConfig, latent_frames: int) -> list[slice] | None:
        """The latent-frame slices of the temporal tiles, or None where the clip decodes in one piece."""
        size = self.tile_sample_min_num_frames // cfg.temporal_compression_ratio
        stride = self.tile_sample_stride_num_frames // cfg.temporal_compression_ratio
        if not self.use_framewise_decoding or latent_frames <= size:
            return None
        if stride < 1:
            raise ValueError(
                f"tile_sample_stride_num_frames={self.tile_sample_stride_num_frames} is under one latent frame"
            )
        return [slice(i, i + size + 1) for i in range(0, latent_frames, stride)]

    def spatial_tiles(
        self, cfg: HunyuanVideoVAEConfig, height: int, width: int
    ) -> list[list[tuple[slice, slice]]] | None:
        """Rows of (height, width) latent slices of the spatial tiles, or None for one piece."""
        r = cfg.spatial_compression_ratio
        size_h, size_w = self.tile_sample_min_height // r, self.tile_sample_min_width // r
        stride_h, stride_w = self.tile_sample_stride_height // r, self.tile_sample_stride_width // r
        if not self.use_tiling or (height <= size_h and width <= size_w):
            return None
        if min(stride_h, stride_w) < 1:
            raise ValueError(f"spatial tile strides ({stride_h}, {stride_w}) are under one latent pixel")
        return [
            [(slice(i, i + size_h), slice(j, j + size_w)) for j in range(0, width, stride_w)]
            for i in range(0, height, stride_h)
        ]


DEFAULT_TILING = Tiling()  # diffusers' `vae.decode(z)` as the model is loaded
UNTILED = Tiling(use_framewise_decoding=False)  # the whole clip at once


def _blend(a: jax.Array, b: jax.Array, extent: int, axis: int) -> jax.Array:
    """`b` with its first `extent` entries along `axis` faded linearly from `a`'s last ones.

    diffusers' `blend_t` / `blend_v` / `blend_h`: entry k of the overlap is
    a[-extent + k] * (1 - k / extent) + b[k] * (k / extent), the extent cut to both lengths.
    """
    extent = min(a.shape[axis], b.shape[axis], extent)
    if extent <= 0:
        return b
    k = np.arange(extent, dtype=np.float64) / extent
    shape = [1] * b.ndim
    shape[axis] = extent
    w_a, w_b = ((x.astype(np.float32).reshape(shape)) for x in (1 - k, k))
    tail = jax.lax.slice_in_dim(a, a.shape[axis] - extent, a.shape[axis], axis=axis)
    head = jax.lax.slice_in_dim(b, 0, extent, axis=axis)
    faded = (tail * w_a + head * w_b).astype(b.dtype)
    return jnp.concatenate([faded, jax.lax.slice_in_dim(b, extent, b.shape[axis], axis=axis)], axis=axis)


def _decode_pieces(params: dict, cfg: HunyuanVideoVAEConfig, pieces: list[jax.Array]) -> list[jax.Array]:
    """The untiled decode of every latent piece; pieces of one shape run in one sequential `lax.map`."""
    module = HunyuanVideoVAEDecoder(cfg)
    by_shape: dict[tuple[int, ...], list[int]] = {}
    for i, piece in enumerate(pieces):
        by_shape.setdefault(piece.shape, []).append(i)
    out: list[jax.Array | None] = [None] * len(pieces)
    for indices in by_shape.values():
        decoded = jax.lax.map(lambda x: module.apply({"params": params}, x), jnp.stack([pieces[i] for i in indices]))
        for n, i in enumerate(indices):
            out[i] = decoded[n]
    return out


def _join_spatial(
    cfg: HunyuanVideoVAEConfig, tiling: Tiling, grid: list[list[jax.Array]], height: int, width: int
) -> jax.Array:
    """diffusers' `tiled_decode` after the tiles are decoded: fade each tile from the (already
    faded) tile above and the one to its left, keep its first stride pixels, join, crop."""
    r = cfg.spatial_compression_ratio
    blend_h = tiling.tile_sample_min_height - tiling.tile_sample_stride_height
    blend_w = tiling.tile_sample_min_width - tiling.tile_sample_stride_width
    faded: list[list[jax.Array]] = []
    for i, row in enumerate(grid):
        faded.append([])
        for j, tile in enumerate(row):
            if i > 0:
                tile = _blend(faded[i - 1][j], tile, blend_h, axis=3)
            if j > 0:
                tile = _blend(faded[i][j - 1], tile, blend_w, axis=4)
            faded[i].append(tile)
    stride_h, stride_w = tiling.tile_sample_stride_height, tiling.tile_sample_stride_width
    rows = [jnp.concatenate([t[..., :stride_h, :stride_w] for t in row], axis=4) for row in faded]
    return jnp.concatenate(rows, axis=3)[..., : height * r, : width * r]


def _join_temporal(tiling: Tiling, tiles: list[jax.Array], frames: int) -> jax.Array:
    """diffusers' `_temporal_tiled_decode` after the tiles are decoded: every tile but the first
    loses its first frame and fades in from the (already faded) previous one; the first keeps
    stride + 1 frames, the others stride."""
    stride = tiling.tile_sample_stride_num_frames
    blend = tiling.tile_sample_min_num_frames - stride
    faded = [tiles[0]]
    for tile in tiles[1:]:
        faded.append(_blend(faded[-1], tile[:, :, 1:], blend, axis=2))
    kept = [faded[0][:, :, : stride + 1]] + [tile[:, :, :stride] for tile in faded[1:]]
    return jnp.concatenate(kept, axis=2)[:, :, :frames]


@functools.partial(jax.jit, static_argnames=("cfg", "tiling"))
def decode(params: dict, cfg: HunyuanVideoVAEConfig, z: jax.Array, tiling: Tiling = DEFAULT_TILING) -> jax.Array:
    """diffusers' `vae.decode(z).sample` for already de-normalised latents (B, C, T', h, w),
    tiled as `tiling` says (default: as diffusers loads the model; `UNTILED`: one piece)."""
    _check_latents(cfg, z)
    _, _, t, h, w = z.shape
    t_slices = tiling.temporal_tiles(cfg, t) or [slice(0, t)]
    spatial = tiling.spatial_tiles(cfg, h, w)
    grid = spatial or [[(slice(0, h), slice(0, w))]]
    pieces = [z[:, :, ts, hs, ws] for ts in t_slices for row in grid for hs, ws in row]
    decoded = iter(_decode_pieces(params, cfg, pieces))
    tiles = [[[next(decoded) for _ in row] for row in grid] for _ in t_slices]
    tiles = [_join_spatial(cfg, tiling, g, h, w) if spatial else g[0][0] for g in tiles]
    return tiles[0] if len(tiles) == 1 else _join_temporal(tiling, tiles, cfg.num_frames(t))


def decode_latents(
    params: dict, cfg: HunyuanVideoVAEConfig, z: jax.Array, tiling: Tiling = DEFAULT_TILING
) -> jax.Array:
    """Decode the denoiser's latents as the HunyuanVideo pipeline does: `vae.decode(z / scaling_factor)`.

    De-normalised in float32 (the pipeline does it in the VAE's dtype). Not jitted
    itself: the jitted `decode` is shared with raw latents.
    """
    _check_latents(cfg, z)
    return decode(params, cfg, jnp.asarray(z, jnp.float32) / cfg.scaling_factor, tiling)


def example_inputs(
    cfg: HunyuanVideoVAEConfig, batch: int = 1, latent_frames: int = 2, height: int = 2, width: int = 2
) -> dict:
    """Abstract inputs (ShapeDtypeStructs) for `init`/`eval_shape`; sizes in latent units."""
    return dict(z=jax.ShapeDtypeStruct((batch, cfg.latent_channels, latent_frames, height, width), jnp.float32))


def weight_rules(cfg: HunyuanVideoVAEConfig) -> list[WeightRule]:
    """Every Flax parameter and the diffusers state-dict key it comes from (decoder + post_quant_conv)."""

    def conv(path, key):
        return [WeightRule(path + ("kernel",), f"{key}.weight", "conv"), WeightRule(path + ("bias",), f"{key}.bias")]

    def norm(path, key):
        return [WeightRule(path + ("scale",), f"{key}.weight"), WeightRule(path + ("bias",), f"{key}.bias")]

    def resnet(path, key, shortcut):
        rules = norm(path + ("norm1",), f"{key}.norm1") + conv(path + ("conv1",), f"{key}.conv1.conv")
        rules += norm(path + ("norm2",), f"{key}.norm2") + conv(path + ("conv2",), f"{key}.conv2.conv")
        if shortcut:
            rules += conv(path + ("conv_shortcut",), f"{key}.conv_shortcut.conv")
        return rules

    d, dk = ("decoder",), "decoder"
    rules = conv(("post_quant_conv",), "post_quant_conv")
    rules += conv(d + ("conv_in",), f"{dk}.conv_in.conv")
    for j in range(2):
        rules += resnet(d + (f"mid_block_resnets_{j}",), f"{dk}.mid_block.resnets.{j}", shortcut=False)
    if cfg.mid_block_add_attention:
        attn, attnk = d + ("mid_block_attentions_0",), f"{dk}.mid_block.attentions.0"
        rules += norm(attn + ("group_norm",), f"{attnk}.group_norm")
        for flax_name, key_name in (("to_q", "to_q"), ("to_k", "to_k"), ("to_v", "to_v"), ("to_out", "to_out.0")):
            rules += linear_rules(attn + (flax_name,), f"{attnk}.{key_name}")
    channels = cfg.block_out_channels[::-1]
    prev = channels[0]
    for i, out in enumerate(channels):
        for j in range(cfg.layers_per_block + 1):
            in_channels = prev if j == 0 else out
            rules += resnet(d + (f"up_blocks_{i}_resnets_{j}",), f"{dk}.up_blocks.{i}.resnets.{j}", in_channels != out)
        if cfg.upsample_factor(i) is not None:
            up = d + (f"up_blocks_{i}_upsamplers_0", "conv")
            rules += conv(up, f"{dk}.up_blocks.{i}.upsamplers.0.conv.conv")
        prev = out
    rules += norm(d + ("conv_norm_out",), f"{dk}.conv_norm_out")
    rules += conv(d + ("conv_out",), f"{dk}.conv_out.conv")
    return rules


FAMILY = ModelFamily(
    name="vae_hunyuan_video",
    diffusers_class="AutoencoderKLHunyuanVideo",
    config_cls=HunyuanVideoVAEConfig,
    module_cls=HunyuanVideoVAEDecoder,
    weight_rules=weight_rules,
    example_inputs=example_inputs,
    variants=VARIANTS,
    ignored_prefixes=IGNORED_PREFIXES,
    decode_frames=decode_latents,  # videos only
)
