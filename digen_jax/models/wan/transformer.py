"""Wan2.1 text-to-video transformer (diffusers `WanTransformer3DModel`) in flax.linen.

Computes exactly what the diffusers module computes (fp32 parity is tested): a
(1, 2, 2) patch embedding, 3-axis RoPE with Wan's own split of the head dim,
DiT blocks of self-attention (RoPE, RMS qk-norm across all heads), cross-attention
to the umT5 text (no mask) and a GELU-tanh FFN, modulated by a per-block
`scale_shift_table` plus one `time_proj(temb)` shared by all blocks, then a final
(shift, scale) modulation, `proj_out` and unpatchify.

Like diffusers (`_keep_in_fp32_modules`), the time embedder, the scale-shift
modulation, the LayerNorms (norm1/norm2/norm3/norm_out) and the gated residual
updates of self-attention and FFN run in float32 whatever the compute dtype; the
cross-attention residual is added in the compute dtype, as diffusers does.

Deliberate differences from the PyTorch module, none of which changes fp32 output:
* Blocks are stacked and run with `nn.scan` (parameters carry a leading `layers`
  axis), which keeps compile time independent of depth; `scan_layers=False` unrolls
  them instead (`stacking.scan_blocks`).
* The Conv3d patch embedding (kernel = stride = patch size) is a reshape into
  non-overlapping (pt, ph, pw, C) patches and one matmul with the conv kernel in
  Flax layout (pt, ph, pw, C, dim): the same sums, and a plain GEMM on accelerators.
* The RoPE tables are built on the host in float64 from the static latent shape
  (diffusers precomputes them in float64 for `rope_max_seq_len` positions and slices).

Sequence parallelism (`attention.token_parallel_attention`): traced under a mesh with a `seq`
axis, the video tokens are split over it from the patch embedding on; self-attention runs as
Ulysses (all-to-all to head shards and back), cross-attention needs no communication (only its
queries are video tokens; the text is whole on every device).

Timesteps are per sample, (B,), or per token, (B, S) over the S = T'H'W'/(pt ph pw) patch tokens
in (t, h, w) order (Wan2.2 TI2V, whose pipeline keeps the conditioning first frame clean with a
timestep of 0 on its tokens): then the time embedding, the blocks' six modulations and the final
(shift, scale) are per token, as in diffusers. Per-token modulations hold (B, S, 6, dim) values.

Not ported: the image-conditioning (I2V / FLF2V) branches (`image_dim`,
`added_kv_proj_dim`, `pos_embed_seq_len`, `encoder_hidden_states_image`); configs or inputs that
use them are rejected.
"""
from __future__ import annotations

import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from digen_jax.models import attention, layers, partitioning, rope, stacking
from digen_jax.models.conversion import ModelFamily, WeightRule, linear_rules
from digen_jax.models.transformer_config import TransformerConfig

ACT = ("activation_batch", "activation_length", "activation_embed")

# Config fields of the image-conditioned variants, which this port does not implement.
_IMAGE_FIELDS = ("image_dim", "added_kv_proj_dim", "pos_embed_seq_len")


@dataclasses.dataclass(frozen=True)
class WanConfig(TransformerConfig):
    """Architecture (the diffusers config fields); the execution policy is `TransformerConfig`'s."""

    patch_size: tuple[int, int, int] = (1, 2, 2)
    num_attention_heads: int = 40
    attention_head_dim: int = 128
    in_channels: int = 16
    out_channels: int | None = 16
    text_dim: int = 4096
    freq_dim: int = 256
    ffn_dim: int = 13824
    num_layers: int = 40
    cross_attn_norm: bool = True
    # diffusers stores but never reads `qk_norm`: every attention has RMS norm_q/norm_k
    # across all heads whatever its value, so it is kept only to accept the config.
    qk_norm: str | None = "rms_norm_across_heads"
    eps: float = 1e-6
    image_dim: int | None = None
    added_kv_proj_dim: int | None = None
    rope_max_seq_len: int = 1024
    pos_embed_seq_len: int | None = None

    def __post_init__(self):
        object.__setattr__(self, "patch_size", tuple(self.patch_size))
        if len(self.patch_size) != 3:
            raise ValueError(f"patch_size must be (t, h, w), got {self.patch_size}")
        used = [f"{name}={getattr(self, name)}" for name in _IMAGE_FIELDS if getattr(self, name) is not None]
        if used:
            raise ValueError(
                f"the Wan port implements text-to-video only; image conditioning ({', '.join(used)}) is not supported"
            )
        if self.attention_head_dim % 2:
            raise ValueError(f"attention_head_dim must be even for RoPE, got {self.attention_head_dim}")
        super().__post_init__()

    @property
    def patch(self) -> tuple[int, int, int]:
        """The (t, h, w) patch, named as the other video config names it."""
        return self.patch_size

    @property
    def out_dim(self) -> int:
        return math.prod(self.patch_size) * (self.out_channels or self.in_channels)

    @property
    def rope_axes_dims(self) -> tuple[int, int, int]:
        """Wan's (t, h, w) split of the head dim: h = w = 2 * (head_dim // 6), t the rest."""
        hw = 2 * (self.attention_head_dim // 6)
        return (self.attention_head_dim - 2 * hw, hw, hw)


VARIANTS = {
    "t2v-14b": WanConfig(),
    # Structurally identical to the full model (2 blocks), for CPU tests.
    "tiny": WanConfig(
        num_attention_heads=2,
        attention_head_dim=12,
        in_channels=4,
        out_channels=4,
        text_dim=32,
        freq_dim=32,
        ffn_dim=32,
        num_layers=2,
        rope_max_seq_len=32,
        dtype="float32",
    ),
}


def rope_tables(cfg: WanConfig, grid: tuple[int, int, int]) -> tuple[jax.Array, jax.Array]:
    """(cos, sin) tables of shape (F * H * W, head_dim) for a post-patch (F, H, W) grid.

    Tokens are in (f, h, w) order; the channels are [t | h | w] with Wan's split and
    interleaved pairs. Angles are float64 on the host, as diffusers builds them.
    """
    freqs = rope.rope_frequencies(cfg.rope_axes_dims, 10000.0)
    angles = [np.outer(np.arange(n, dtype=np.float64), np.repeat(f, 2)) for n, f in zip(grid, freqs)]
    f, h, w = grid
    full = np.concatenate(
        [
            np.broadcast_to(angles[0][:, None, None], (f, h, w, angles[0].shape[-1])),
            np.broadcast_to(angles[1][None, :, None], (f, h, w, angles[1].shape[-1])),
            np.broadcast_to(angles[2][None, None, :], (f, h, w, angles[2].shape[-1])),
        ],
        axis=-1,
    ).reshape(f * h * w, -1)
    return jnp.asarray(np.cos(full), jnp.float32), jnp.asarray(np.sin(full), jnp.float32)


def fp32_layer_norm(x: jax.Array, eps: float, scale: jax.Array | None = None, bias: jax.Array | None = None):
    """diffusers' FP32LayerNorm: LayerNorm in float32 (optionally affine); returns float32."""
    out = layers.layer_norm(x.astype(jnp.float32), eps)
    if scale is not None:
        out = out * scale.astype(jnp.float32) + bias.astype(jnp.float32)
    return out


class WanAttention(nn.Module):
    """Attention with RMS qk-norm over all heads (weight of size heads * head_dim).

    `cross=False`: self-attention over the video tokens with RoPE.
    `cross=True`: queries from the video tokens, keys/values from the text, no RoPE.
    """

    cfg: WanConfig
    cross: bool

    @nn.compact
    def __call__(self, x, ctx, cos, sin):
        cfg = self.cfg
        src = ctx if self.cross else x
        dense = lambda name: layers.logical_dense(cfg.inner_dim, ("embed", "heads"), name=name, **cfg.kw)  # noqa: E731
        norm = lambda name: layers.RMSNorm(  # noqa: E731
            eps=cfg.eps, axis_name="heads", param_dtype=cfg.kw["param_dtype"], name=name
        )
        q = norm("norm_q")(dense("to_q")(x))
        k = norm("norm_k")(dense("to_k")(src))
        v = dense("to_v")(src)
        split = lambda a: a.reshape(*a.shape[:2], cfg.num_attention_heads, cfg.attention_head_dim)  # noqa: E731
        q, k, v = split(q), split(k), split(v)
        if not self.cross:
            q, k = rope.apply_rope(q, cos, sin), rope.apply_rope(k, cos, sin)
        out = attention.token_parallel_attention(q, k, v, impl=cfg.attention_impl, cross=self.cross)
        out = checkpoint_name(out.reshape(*out.shape[:2], cfg.inner_dim), "attn_out")
        return layers.logical_dense(cfg.inner_dim, ("heads", "embed"), name="to_out", **cfg.kw)(out)


class WanBlock(nn.Module):
    """Self-attention, cross-attention to the text and FFN. Scanned; carry: video tokens."""

    cfg: WanConfig

    @nn.compact
    def __call__(self, x, ctx, timestep_proj, cos, sin):
        """`timestep_proj` is (B, 1, 6, dim) per sample or (B, S, 6, dim) per token."""
        cfg = self.cfg
        table = self.param(
            "scale_shift_table",
            nn.with_logical_partitioning(nn.initializers.normal(cfg.inner_dim**-0.5), (None, None, "embed")),
            (1, 6, cfg.inner_dim),
            cfg.kw["param_dtype"],
        )
        # The modulation stays float32 (scale_shift_table is an fp32 module in diffusers).
        mod = table.astype(jnp.float32)[:, None] + timestep_proj.astype(jnp.float32)
        shift_a, scale_a, gate_a, shift_m, scale_m, gate_m = (mod[:, :, i] for i in range(6))

        h = _modulate(fp32_layer_norm(x, cfg.eps), shift_a, scale_a).astype(x.dtype)
        attn = WanAttention(cfg, cross=False, name="attn1")(h, None, cos, sin)
        x = (x.astype(jnp.float32) + attn * gate_a).astype(x.dtype)

        if cfg.cross_attn_norm:
            ones = nn.with_logical_partitioning(nn.initializers.ones_init(), ("embed",))
            zeros = nn.with_logical_partitioning(nn.initializers.zeros_init(), ("embed",))
            h = fp32_layer_norm(
                x,
                cfg.eps,
                self.param("norm2_scale", ones, (cfg.inner_dim,), cfg.kw["param_dtype"]),
                self.param("norm2_bias", zeros, (cfg.inner_dim,), cfg.kw["param_dtype"]),
            ).astype(x.dtype)
        else:
            h = x
        x = x + WanAttention(cfg, cross=True, name="attn2")(h, ctx, None, None)

        h = _modulate(fp32_layer_norm(x, cfg.eps), shift_m, scale_m).astype(x.dtype)
        ff = layers.FeedForward(cfg.ffn_dim, cfg.inner_dim, name="ffn", **cfg.kw)(h)
        x = (x.astype(jnp.float32) + ff.astype(jnp.float32) * gate_m).astype(x.dtype)
        return partitioning.shard_tokens(partitioning.constrain(x, ACT)), None


def _modulate(x: jax.Array, shift: jax.Array, scale: jax.Array) -> jax.Array:
    """`x * (1 + scale) + shift` with (B, 1, D) per-sample or (B, S, D) per-token shift/scale."""
    return x * (1 + scale) + shift


class WanConditioning(nn.Module):
    """temb = MLP(sinusoid(t)) in float32, (B, S', dim); timestep_proj = Linear(SiLU(temb)) as
    (B, S', 6, dim), where S' = 1 for a (B,) timestep and S for a per-token (B, S) one;
    text = Linear -> GELU(tanh) -> Linear of the text states."""

    cfg: WanConfig

    @nn.compact
    def __call__(self, timestep, encoder_hidden_states):
        cfg = self.cfg
        dtype = cfg.kw["dtype"]
        # The time embedder is an fp32 module in diffusers; its output is then cast to
        # the dtype of the text states, here the compute dtype.
        time_embedder = layers.MLPEmbedder(
            cfg.inner_dim, name="time_embedder", dtype=jnp.float32, param_dtype=cfg.kw["param_dtype"]
        )
        per_token = timestep.reshape(timestep.shape[0], -1)  # (B, S')
        sinusoid = layers.timestep_sinusoid(per_token.reshape(-1), cfg.freq_dim)
        temb = time_embedder(sinusoid).astype(dtype).reshape(*per_token.shape, cfg.inner_dim)
        timestep_proj = layers.logical_dense(6 * cfg.inner_dim, ("embed", "modulation"), name="time_proj", **cfg.kw)(
            nn.silu(temb)
        )
        text = layers.logical_dense(cfg.inner_dim, ("cond", "embed"), name="text_linear_1", **cfg.kw)(
            encoder_hidden_states.astype(dtype)
        )
        text = layers.logical_dense(cfg.inner_dim, ("embed", "embed"), name="text_linear_2", **cfg.kw)(
            nn.gelu(text, approximate=True)
        )
        return temb, timestep_proj.reshape(*per_token.shape, 6, cfg.inner_dim), text


class WanTransformer(nn.Module):
    """`WanTransformer3DModel.forward` with the same keyword arguments (arrays for tensors).

    Args:
      hidden_states: (B, in_channels, T', H', W') video latents; T', H', W' must divide
        by `patch_size` and, after patching, be at most `rope_max_seq_len`.
      timestep: (B,) raw scheduler timestep in [0, 1000] (not scaled inside), or (B, S) one per
        patch token (S = T'H'W' / prod(patch_size), tokens in (t, h, w) order).
      encoder_hidden_states: (B, L, text_dim) umT5 states, no mask.
      encoder_hidden_states_image: image conditioning; must be None (text-to-video only).
      attention_kwargs: diffusers' LoRA-scale dict; must be None or empty.
    Returns:
      (B, out_channels, T', H', W') prediction in the compute dtype.
    """

    cfg: WanConfig

    @nn.compact
    def __call__(
        self,
        hidden_states,
        timestep,
        encoder_hidden_states,
        encoder_hidden_states_image=None,
        attention_kwargs=None,
    ):
        cfg = self.cfg
        _check_inputs(
            cfg, hidden_states, timestep, encoder_hidden_states, encoder_hidden_states_image, attention_kwargs
        )
        b, _, t, h, w = hidden_states.shape
        pt, ph, pw = cfg.patch_size
        grid = (t // pt, h // ph, w // pw)
        cos, sin = rope_tables(cfg, grid)

        patch_embed = layers.PatchEmbed3D(cfg.patch_size, cfg.inner_dim, name="patch_embedding", **cfg.kw)
        x = partitioning.shard_tokens(partitioning.constrain(patch_embed(hidden_states), ACT))
        temb, timestep_proj, ctx = WanConditioning(cfg, name="condition_embedder")(timestep, encoder_hidden_states)
        if timestep.ndim == 2:  # per-token modulations follow the tokens' split
            temb, timestep_proj = partitioning.shard_tokens(temb), partitioning.shard_tokens(timestep_proj)
        ctx = partitioning.constrain(ctx, ACT)

        if cfg.num_layers:
            blocks = stacking.scan_blocks(WanBlock, cfg.num_layers, cfg.remat_policy, cfg.scan_layers)
            x, _ = blocks(cfg, name="blocks")(x, ctx, timestep_proj, cos, sin)

        table = self.param(
            "scale_shift_table",
            nn.with_logical_partitioning(nn.initializers.normal(cfg.inner_dim**-0.5), (None, None, "embed")),
            (1, 2, cfg.inner_dim),
            cfg.kw["param_dtype"],
        )
        # Unlike the blocks' tables, the final one is (shift, scale) applied to temb itself.
        mod = table.astype(jnp.float32)[:, None] + temb.astype(jnp.float32)[:, :, None]
        x = _modulate(fp32_layer_norm(x, cfg.eps), mod[:, :, 0], mod[:, :, 1]).astype(x.dtype)
        x = layers.logical_dense(cfg.out_dim, ("embed", "cond"), name="proj_out", **cfg.kw)(x)

        # Unpatchify: proj_out channels are (pt, ph, pw, C), channel last.
        x = x.reshape(b, *grid, pt, ph, pw, -1).transpose(0, 7, 1, 4, 2, 5, 3, 6)
        return x.reshape(b, -1, t, h, w)


def _check_inputs(cfg, hidden_states, timestep, encoder_hidden_states, encoder_hidden_states_image, attention_kwargs):
    """Shape errors at trace time, naming the argument, before any device work."""
    if encoder_hidden_states_image is not None:
        raise ValueError("encoder_hidden_states_image is not supported: the Wan port is text-to-video only")
    if attention_kwargs:
        raise ValueError(
            f"attention_kwargs is not supported (LoRA scaling is not ported), got keys {sorted(attention_kwargs)}"
        )
    if hidden_states.ndim != 5 or hidden_states.shape[1] != cfg.in_channels:
        raise ValueError(f"hidden_states must have shape (B, {cfg.in_channels}, T, H, W), got {hidden_states.shape}")
    b, _, *sizes = hidden_states.shape
    for axis, size, patch in zip("THW", sizes, cfg.patch_size):
        if size % patch:
            raise ValueError(
                f"hidden_states {axis} = {size} must be a multiple of the patch size {patch} "
                f"(shape {hidden_states.shape})"
            )
        if size // patch > cfg.rope_max_seq_len:
            raise ValueError(
                f"hidden_states {axis} = {size} gives {size // patch} patches, "
                f"more than rope_max_seq_len={cfg.rope_max_seq_len}"
            )
    tokens = math.prod(size // patch for size, patch in zip(sizes, cfg.patch_size))
    if timestep.shape not in ((b,), (b, tokens)):
        raise ValueError(
            f"timestep must have shape ({b},) or, one per patch token, ({b}, {tokens}); got {timestep.shape}"
        )
    ehs = encoder_hidden_states
    if ehs.ndim != 3 or ehs.shape[0] != b or ehs.shape[2] != cfg.text_dim:
        raise ValueError(f"encoder_hidden_states must have shape ({b}, L, {cfg.text_dim}), got {ehs.shape}")


def example_inputs(
    cfg: WanConfig, batch: int = 1, frames: int = 1, height: int = 4, width: int = 4, text_seq_len: int = 8
) -> dict:
    """Abstract inputs (ShapeDtypeStructs) for `init`/`eval_shape`.

    `frames`, `height` and `width` count patches: the latent is (frames * pt, height * ph,
    width * pw).
    """
    pt, ph, pw = cfg.patch_size
    f32 = jnp.float32
    return dict(
        hidden_states=jax.ShapeDtypeStruct((batch, cfg.in_channels, frames * pt, height * ph, width * pw), f32),
        timestep=jax.ShapeDtypeStruct((batch,), f32),
        encoder_hidden_states=jax.ShapeDtypeStruct((batch, text_seq_len, cfg.text_dim), f32),
    )


def weight_rules(cfg: WanConfig) -> list[WeightRule]:
    """Every Flax parameter and the diffusers state-dict key it comes from.

    `{i}` in a key is the block index; those parameters are stacked on a leading axis.
    """
    rules = [
        WeightRule(("patch_embedding", "kernel"), "patch_embedding.weight", "conv"),
        WeightRule(("patch_embedding", "bias"), "patch_embedding.bias"),
        WeightRule(("scale_shift_table",), "scale_shift_table"),
    ]
    rules += linear_rules(("proj_out",), "proj_out")
    c, ck = ("condition_embedder",), "condition_embedder"
    for lin in ("linear_1", "linear_2"):
        rules += linear_rules(c + ("time_embedder", lin), f"{ck}.time_embedder.{lin}")
        rules += linear_rules(c + (f"text_{lin}",), f"{ck}.text_embedder.{lin}")
    rules += linear_rules(c + ("time_proj",), f"{ck}.time_proj")

    b, bk = ("blocks",), "blocks.{i}"
    rules.append(WeightRule(b + ("scale_shift_table",), f"{bk}.scale_shift_table"))
    for attn in ("attn1", "attn2"):
        for name in ("to_q", "to_k", "to_v"):
            rules += linear_rules(b + (attn, name), f"{bk}.{attn}.{name}")
        rules += linear_rules(b + (attn, "to_out"), f"{bk}.{attn}.to_out.0")
        rules += [WeightRule(b + (attn, n, "scale"), f"{bk}.{attn}.{n}.weight") for n in ("norm_q", "norm_k")]
    if cfg.cross_attn_norm:
        rules.append(WeightRule(b + ("norm2_scale",), f"{bk}.norm2.weight"))
        rules.append(WeightRule(b + ("norm2_bias",), f"{bk}.norm2.bias"))
    rules += linear_rules(b + ("ffn", "proj_in"), f"{bk}.ffn.net.0.proj")
    rules += linear_rules(b + ("ffn", "proj_out"), f"{bk}.ffn.net.2")
    return rules


def first_frame_timesteps(cfg: WanConfig, latent_shape: tuple[int, ...], timestep: jax.Array) -> jax.Array:
    """(B, S) per-token timesteps of (B, C, T, H, W) latents whose first latent frame is a clean
    conditioning image: 0 on that frame's tokens, the sample's `timestep` (B,) on the rest, in the
    transformer's (t, h, w) token order (diffusers' `expand_timesteps`: `mask[:, ::2, ::2] * t`)."""
    _, _, frames, height, width = latent_shape
    pt, ph, pw = cfg.patch_size
    clean = np.repeat(np.arange(frames // pt) == 0, (height // ph) * (width // pw))
    return jnp.where(clean[None, :], 0.0, timestep[:, None])


def denoiser_inputs(cfg: WanConfig, *, guidance: float, image_grid: tuple[int, int] | None):
    """Wan as a denoiser (`ModelFamily.denoiser_inputs`): (B, C, T, H, W) latents, sigma * 1000 as
    the timestep (per token, 0 on a conditioning first frame's tokens, when `cond.first_frame` is
    set: `first_frame_timesteps`), no text mask; no embedded guidance (the model uses true CFG),
    so `guidance` and `image_grid` are unused."""
    del guidance, image_grid

    def inputs(latents, cond, sigma):
        timestep = sigma * 1000.0
        if cond.first_frame is not None:
            timestep = first_frame_timesteps(cfg, latents.shape, timestep)
        return dict(hidden_states=latents, timestep=timestep, encoder_hidden_states=cond.text)

    return inputs


FAMILY = ModelFamily(
    name="wan",
    diffusers_class="WanTransformer3DModel",
    config_cls=WanConfig,
    module_cls=WanTransformer,
    weight_rules=weight_rules,
    example_inputs=example_inputs,
    variants=VARIANTS,
    denoiser_inputs=denoiser_inputs,
)
