"""Stable Diffusion 3 / 3.5 transformer (diffusers `SD3Transformer2DModel`, MMDiT) in flax.linen.

Computes exactly what the diffusers module computes (fp32 parity is tested): a 2x2 patch
embedding plus a cropped 2-D sin-cos position table, temb = MLP(sinusoid(timestep)) +
MLP(pooled CLIP text), the text projected by `context_embedder`, MMDiT blocks (AdaLN-Zero
modulation of each stream, joint attention over [image, text] with separate weights per
stream, no RoPE), and a final AdaLN-Continuous norm whose chunks are (scale, shift). The last
block is `context_pre_only`: its text stream is modulated by an AdaLN-Continuous norm, feeds
the joint attention's keys and values, and is then dropped (no text output projection, no
text MLP). SD3.5 adds, per `qk_norm='rms_norm'`, per-head RMS norms of q and k on both
streams, and in its `dual_attention_layers` (MMDiT-X) a second self-attention over the image
stream alone, modulated by the extra 3 chunks of a 9-way AdaLN-Zero.

Blocks of one kind are stacked and scanned, so the stack splits in up to three named runs:
`dual_blocks` (the leading `dual_attention_layers`, which every release places first),
`joint_blocks` (the rest) and `final_block` (the context-pre-only last block, with dual
attention where it is one of the dual layers). `scan_layers=False` unrolls each run.

Inputs: `hidden_states` is (B, C, H, W) latents as in diffusers, or the runtime's 2x2-packed
tokens (B, H/2 * W/2, 4C), channel index c * 4 + dy * 2 + dx (`diffusion.pack_latents`), with
`image_grid=(H/2, W/2)`; the output has the input's layout. The patch embedding is diffusers'
stride-2 Conv2d applied as one dense layer on such packed patches (its weight flattened in
the same (c, dy, dx) order), so both layouts share every matmul.

Deliberate differences from the PyTorch module, none of which changes fp32 output:
* The position table is evaluated for the cropped window only (in float64, as diffusers
  builds its table, then rounded to float32). The checkpoint's `pos_embed.pos_embed` buffer
  is that table over the whole `pos_embed_max_size`^2 grid; conversion skips it
  (`IGNORED_PREFIXES`): 226 M values for SD3.5-M that the port never needs.
* Joint attention concatenates [image, text], as diffusers does; without RoPE the order only
  decides how the output splits.
* The timestep stays float32 in the sinusoid; diffusers first casts it to the compute dtype,
  which rounds it in bf16.
"""
from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from digen_jax.models import attention, layers, partitioning, stacking
from digen_jax.models.conversion import ModelFamily, WeightRule, linear_rules
from digen_jax.models.transformer_config import TransformerConfig

ACT = ("activation_batch", "activation_length", "activation_embed")
# The full-grid position table, recomputed for the crop each input needs (module docstring).
IGNORED_PREFIXES = ("pos_embed.pos_embed",)
QK_NORMS = (None, "rms_norm")


@dataclasses.dataclass(frozen=True)
class SD3Config(TransformerConfig):
    """Architecture (the diffusers config fields); the execution policy is `TransformerConfig`'s."""

    sample_size: int = 128
    patch_size: int = 2
    in_channels: int = 16
    num_layers: int = 18
    attention_head_dim: int = 64
    num_attention_heads: int = 18
    joint_attention_dim: int = 4096
    caption_projection_dim: int = 1152
    pooled_projection_dim: int = 2048
    out_channels: int = 16
    pos_embed_max_size: int = 96
    dual_attention_layers: tuple[int, ...] = ()
    qk_norm: str | None = None

    def __post_init__(self):
        if self.num_layers < 1:
            raise ValueError(f"num_layers must be >= 1 (the last block is the context-pre-only one), got {self.num_layers}")
        # diffusers ignores indices past the last block (a shortened stack keeps its first blocks).
        object.__setattr__(self, "dual_attention_layers",
                           tuple(i for i in self.dual_attention_layers if i < self.num_layers))
        if self.qk_norm not in QK_NORMS:
            raise ValueError(f"qk_norm must be one of {QK_NORMS}, got {self.qk_norm!r}")
        if self.caption_projection_dim != self.inner_dim:
            raise ValueError(
                f"caption_projection_dim={self.caption_projection_dim} must equal num_attention_heads * "
                f"attention_head_dim = {self.inner_dim}: the blocks take the projected text at that width")
        if self.dual_attention_layers != tuple(range(self.num_dual)):
            raise ValueError(
                f"dual_attention_layers must be the first k blocks (0, 1, ..., k-1) as in every release, "
                f"got {self.dual_attention_layers}")
        super().__post_init__()

    @property
    def mlp_dim(self) -> int:
        return 4 * self.inner_dim

    @property
    def num_dual(self) -> int:
        return len(self.dual_attention_layers)

    @property
    def patch_dim(self) -> int:
        return self.patch_size * self.patch_size * self.in_channels

    @property
    def out_dim(self) -> int:
        return self.patch_size * self.patch_size * self.out_channels

    @property
    def stacks(self) -> tuple[tuple[str, int, int, bool], ...]:
        """(name, first block index, block count, dual attention) of each non-empty scanned run,
        in order: the dual blocks, the plain joint blocks, then the context-pre-only last block."""
        last = self.num_layers - 1
        runs = (("dual_blocks", 0, min(self.num_dual, last), True),
                ("joint_blocks", min(self.num_dual, last), last - min(self.num_dual, last), False),
                ("final_block", last, 1, self.num_dual == self.num_layers))
        return tuple(run for run in runs if run[2])


_SD35 = dict(num_layers=24, num_attention_heads=24, caption_projection_dim=1536, qk_norm="rms_norm")
VARIANTS = {
    # stabilityai/stable-diffusion-3.5-medium: MMDiT-X (dual attention in blocks 0-12), RMS qk-norm.
    "sd3.5-medium": SD3Config(**_SD35, pos_embed_max_size=384, dual_attention_layers=tuple(range(13))),
    # stabilityai/stable-diffusion-3-medium-diffusers transformer/config.json.
    "sd3-medium": SD3Config(num_layers=24, num_attention_heads=24, caption_projection_dim=1536, pos_embed_max_size=192),
    # stabilityai/stable-diffusion-3.5-large: 38 blocks of 38 heads, RMS qk-norm, no dual attention.
    "sd3.5-large": SD3Config(num_layers=38, num_attention_heads=38, caption_projection_dim=2432,
                             pos_embed_max_size=192, qk_norm="rms_norm"),
    # SD3.5-M's structure (dual, joint and final blocks; qk-norm) at CPU size.
    "tiny": SD3Config(
        sample_size=16,
        num_layers=4,
        attention_head_dim=8,
        num_attention_heads=2,
        in_channels=4,
        out_channels=4,
        joint_attention_dim=32,
        caption_projection_dim=16,
        pooled_projection_dim=32,
        pos_embed_max_size=16,
        dual_attention_layers=(0, 1),
        qk_norm="rms_norm",
        dtype="float32",
    ),
}


def position_table(cfg: SD3Config, rows: int, cols: int) -> np.ndarray:
    """The (rows * cols, inner_dim) float32 position embedding of a rows x cols token grid:
    the centred crop of diffusers' `get_2d_sincos_pos_embed(inner_dim, pos_embed_max_size,
    base_size=sample_size // patch_size)`. Each token's first half embeds its column, the second
    half its row, each as [sin, cos] of position * 10000^(-k / (D/4))."""
    size = cfg.pos_embed_max_size
    if rows > size or cols > size:
        raise ValueError(f"a {rows} x {cols} token grid exceeds pos_embed_max_size={size}: at most "
                         f"{size * cfg.patch_size * 8} px per side")
    if cfg.inner_dim % 4:
        raise ValueError(f"the position table needs inner_dim divisible by 4, got {cfg.inner_dim}")
    # diffusers divides a float32 arange by the python float size / base_size (in float32) ...
    step = np.float32(size / (cfg.sample_size // cfg.patch_size))
    top, left = (size - rows) // 2, (size - cols) // 2
    ys = np.arange(size, dtype=np.float32)[top:top + rows] / step
    xs = np.arange(size, dtype=np.float32)[left:left + cols] / step
    # ... and takes sines and cosines of its products with float64 frequencies.
    quarter = cfg.inner_dim // 4
    omega = 1.0 / 10000 ** (np.arange(quarter, dtype=np.float64) / quarter)

    def axis(pos):
        out = np.outer(pos.astype(np.float64), omega)
        return np.concatenate([np.sin(out), np.cos(out)], axis=1)

    col, row = axis(xs), axis(ys)
    table = np.concatenate([np.tile(col, (rows, 1)), np.repeat(row, cols, axis=0)], axis=1)
    return table.astype(np.float32)


class SD3Attention(nn.Module):
    """Multi-head attention with optional per-head RMS qk-norms (`qk_norm='rms_norm'`).

    With `ctx` (the joint attention): the text tokens have their own q/k/v projections and
    norms and the two streams attend jointly as [image, text]; `ctx_out` says whether the text
    part of the output is projected (`to_add_out`) and returned (every block but the last).
    Without `ctx`: self-attention over `x` (the dual blocks' `attn2`).
    """

    cfg: SD3Config
    ctx_out: bool = True

    def _qkv(self, x, prefix: str, q_norm: str, k_norm: str, suffix: str = ""):
        cfg = self.cfg
        b, s, _ = x.shape
        out = []
        for name in ("q", "k", "v"):
            h = layers.logical_dense(cfg.inner_dim, ("embed", "heads"), name=f"{prefix}{name}{suffix}", **cfg.kw)(x)
            out.append(h.reshape(b, s, cfg.num_attention_heads, cfg.attention_head_dim))
        q, k, v = out
        if cfg.qk_norm == "rms_norm":
            norm_kw = dict(eps=1e-6, param_dtype=cfg.kw["param_dtype"])
            q, k = layers.RMSNorm(name=q_norm, **norm_kw)(q), layers.RMSNorm(name=k_norm, **norm_kw)(k)
        return q, k, v

    @nn.compact
    def __call__(self, x, ctx=None):
        cfg = self.cfg
        q, k, v = self._qkv(x, "to_", "norm_q", "norm_k")
        if ctx is not None:
            cq, ck, cv = self._qkv(ctx, "add_", "norm_added_q", "norm_added_k", "_proj")
            q, k, v = (jnp.concatenate(pair, axis=1) for pair in ((q, cq), (k, ck), (v, cv)))
        out = attention.dot_product_attention(q, k, v, impl=cfg.attention_impl)
        out = out.reshape(*out.shape[:2], cfg.inner_dim)
        out = checkpoint_name(out, "attn_out")
        img_len = x.shape[1]
        x_out = layers.logical_dense(cfg.inner_dim, ("heads", "embed"), name="to_out", **cfg.kw)(out[:, :img_len])
        if ctx is None or not self.ctx_out:
            return x_out, None
        ctx_out = layers.logical_dense(cfg.inner_dim, ("heads", "embed"), name="to_add_out", **cfg.kw)(out[:, img_len:])
        return x_out, ctx_out


class SD3Block(nn.Module):
    """diffusers `JointTransformerBlock`. Scanned; carry (img, txt).

    `dual`: MMDiT-X, a 9-way AdaLN-Zero whose last 3 chunks modulate and gate a second
    self-attention over the image stream (`attn2`), added after the joint attention's output.
    `context_pre_only`: the last block, whose text stream only feeds the joint attention
    (AdaLN-Continuous norm; carried through unchanged, as nothing reads it afterwards).
    """

    cfg: SD3Config
    dual: bool
    context_pre_only: bool

    @nn.compact
    def __call__(self, carry, temb):
        cfg = self.cfg
        img, txt = carry
        chunks = layers.Modulation(9 if self.dual else 6, cfg.inner_dim, name="norm1", **cfg.kw)(temb)
        shift_a, scale_a, gate_a, shift_m, scale_m, gate_m = chunks[:6]
        normed = layers.layer_norm(img)
        if self.context_pre_only:
            c_scale, c_shift = layers.Modulation(2, cfg.inner_dim, name="norm1_context", **cfg.kw)(temb)
            ctx = layers.modulate(layers.layer_norm(txt), c_shift, c_scale)
        else:
            c_shift_a, c_scale_a, c_gate_a, c_shift_m, c_scale_m, c_gate_m = layers.Modulation(
                6, cfg.inner_dim, name="norm1_context", **cfg.kw)(temb)
            ctx = layers.modulate(layers.layer_norm(txt), c_shift_a, c_scale_a)
        img_attn, txt_attn = SD3Attention(cfg, ctx_out=not self.context_pre_only, name="attn")(
            layers.modulate(normed, shift_a, scale_a), ctx)
        img = img + gate_a[:, None] * img_attn
        if self.dual:
            shift_2, scale_2, gate_2 = chunks[6:]
            img_attn2, _ = SD3Attention(cfg, name="attn2")(layers.modulate(normed, shift_2, scale_2))
            img = img + gate_2[:, None] * img_attn2
        img_mlp = layers.FeedForward(cfg.mlp_dim, cfg.inner_dim, name="ff", **cfg.kw)(
            layers.modulate(layers.layer_norm(img), shift_m, scale_m))
        img = partitioning.constrain(img + gate_m[:, None] * img_mlp, ACT)
        if not self.context_pre_only:
            txt = txt + c_gate_a[:, None] * txt_attn
            txt_mlp = layers.FeedForward(cfg.mlp_dim, cfg.inner_dim, name="ff_context", **cfg.kw)(
                layers.modulate(layers.layer_norm(txt), c_shift_m, c_scale_m))
            txt = partitioning.constrain(txt + c_gate_m[:, None] * txt_mlp, ACT)
        return (img, txt), None


class SD3Conditioning(nn.Module):
    """temb = MLP(sinusoid(timestep)) + MLP(pooled text) (`CombinedTimestepTextProjEmbeddings`)."""

    cfg: SD3Config

    @nn.compact
    def __call__(self, timestep, pooled):
        cfg = self.cfg
        temb = layers.MLPEmbedder(cfg.inner_dim, name="timestep_embedder", **cfg.kw)(layers.timestep_sinusoid(timestep, 256))
        return temb + layers.MLPEmbedder(cfg.inner_dim, name="text_embedder", **cfg.kw)(pooled)


class SD3Transformer(nn.Module):
    """`SD3Transformer2DModel.forward` with the same keyword arguments (arrays for tensors).

    Args:
      hidden_states: (B, in_channels, H, W) latents, or (B, H/2 * W/2, 4 * in_channels)
        2x2-packed tokens with `image_grid`.
      encoder_hidden_states: (B, S_txt, joint_attention_dim): CLIP-L/G states (zero-padded to
        4096) followed by T5's, no mask.
      pooled_projections: (B, pooled_projection_dim) CLIP-L and CLIP-G pooled, concatenated.
      timestep: (B,) in [0, 1000] (sigma * 1000, as the pipeline passes it).
      image_grid: (rows, cols) of packed `hidden_states`; None for (B, C, H, W) latents.
    Returns:
      the velocity in `hidden_states`' layout, in the compute dtype.
    """

    cfg: SD3Config

    @nn.compact
    def __call__(self, hidden_states, encoder_hidden_states, pooled_projections, timestep, image_grid=None):
        cfg = self.cfg
        _check_inputs(cfg, hidden_states, encoder_hidden_states, pooled_projections, timestep, image_grid)
        dtype, p = cfg.kw["dtype"], cfg.patch_size
        b = hidden_states.shape[0]
        if image_grid is None:
            _, c, h, w = hidden_states.shape
            rows, cols = h // p, w // p
            patches = hidden_states.reshape(b, c, rows, p, cols, p).transpose(0, 2, 4, 1, 3, 5)
            patches = patches.reshape(b, rows * cols, cfg.patch_dim)
        else:
            (rows, cols), patches = image_grid, hidden_states

        img = layers.logical_dense(cfg.inner_dim, ("cond", "embed"), name="pos_embed", **cfg.kw)(patches.astype(dtype))
        img = (img + jnp.asarray(position_table(cfg, rows, cols))[None]).astype(dtype)
        txt = layers.logical_dense(cfg.inner_dim, ("cond", "embed"), name="context_embedder", **cfg.kw)(
            encoder_hidden_states.astype(dtype))
        img, txt = partitioning.constrain(img, ACT), partitioning.constrain(txt, ACT)
        temb = SD3Conditioning(cfg, name="time_text_embed")(timestep, pooled_projections)

        for name, _, count, dual in cfg.stacks:
            blocks = stacking.scan_blocks(SD3Block, count, cfg.remat_policy, cfg.scan_layers)
            (img, txt), _ = blocks(cfg, dual, name == "final_block", name=name)((img, txt), temb)

        scale, shift = layers.Modulation(2, cfg.inner_dim, name="norm_out", **cfg.kw)(temb)
        img = layers.modulate(layers.layer_norm(img), shift, scale)
        out = layers.logical_dense(cfg.out_dim, ("embed", "cond"), name="proj_out", **cfg.kw)(img)
        # proj_out's channels are ordered (dy, dx, c).
        out = out.reshape(b, rows, cols, p, p, cfg.out_channels)
        if image_grid is not None:
            return out.transpose(0, 1, 2, 5, 3, 4).reshape(b, rows * cols, cfg.out_dim)
        return out.transpose(0, 5, 1, 3, 2, 4).reshape(b, cfg.out_channels, rows * p, cols * p)


def _check_inputs(cfg, hidden_states, encoder_hidden_states, pooled, timestep, image_grid):
    """Shape errors at trace time, naming the argument, before any device work."""
    b = hidden_states.shape[0]
    if image_grid is None:
        if hidden_states.ndim != 4 or hidden_states.shape[1] != cfg.in_channels or any(
                s % cfg.patch_size for s in hidden_states.shape[2:]):
            raise ValueError(f"hidden_states must have shape (B, {cfg.in_channels}, H, W) with H and W multiples of "
                             f"{cfg.patch_size}, or be packed tokens with image_grid; got {hidden_states.shape}")
    elif hidden_states.ndim != 3 or hidden_states.shape[1:] != (image_grid[0] * image_grid[1], cfg.patch_dim):
        raise ValueError(f"packed hidden_states on the {tuple(image_grid)} grid must have shape "
                         f"(B, {image_grid[0] * image_grid[1]}, {cfg.patch_dim}), got {hidden_states.shape}")
    for name, arr, ndim, last in (("encoder_hidden_states", encoder_hidden_states, 3, cfg.joint_attention_dim),
                                  ("pooled_projections", pooled, 2, cfg.pooled_projection_dim)):
        if arr.ndim != ndim or arr.shape[-1] != last or arr.shape[0] != b:
            raise ValueError(f"{name} must have shape (B={b}, ..., {last}) with {ndim} dims, got {arr.shape}")
    if timestep.shape != (b,):
        raise ValueError(f"timestep must have shape ({b},), got {timestep.shape}")


def example_inputs(cfg: SD3Config, batch: int = 1, image_seq_len: int = 16, text_seq_len: int = 8) -> dict:
    """Abstract inputs (ShapeDtypeStructs) for `init`/`eval_shape`: (B, C, H, W) latents of
    `image_seq_len` patches, on a square grid when it is a square, else one row of patches."""
    side = int(round(image_seq_len ** 0.5))
    rows, cols = (side, side) if side * side == image_seq_len else (1, image_seq_len)
    p = cfg.patch_size
    spec = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # noqa: E731
    return dict(
        hidden_states=spec(batch, cfg.in_channels, rows * p, cols * p),
        encoder_hidden_states=spec(batch, text_seq_len, cfg.joint_attention_dim),
        pooled_projections=spec(batch, cfg.pooled_projection_dim),
        timestep=spec(batch),
    )


def weight_rules(cfg: SD3Config) -> list[WeightRule]:
    """Every Flax parameter and the diffusers state-dict key it comes from.

    `{i}` in a key is the block index; each run's parameters are stacked on a leading axis,
    from the run's first block on (`WeightRule.offset`).
    """
    rules = [WeightRule(("pos_embed", "kernel"), "pos_embed.proj.weight", "patch"),
             WeightRule(("pos_embed", "bias"), "pos_embed.proj.bias")]
    for sub in ("timestep_embedder", "text_embedder"):
        for lin in ("linear_1", "linear_2"):
            rules += linear_rules(("time_text_embed", sub, lin), f"time_text_embed.{sub}.{lin}")
    for name in ("context_embedder", "proj_out"):
        rules += linear_rules((name,), name)
    rules += linear_rules(("norm_out", "linear"), "norm_out.linear")

    key = "transformer_blocks.{i}"
    for name, first, _, dual in cfg.stacks:
        last = name == "final_block"
        block: list[WeightRule] = []
        block += linear_rules(("norm1", "linear"), f"{key}.norm1.linear")
        block += linear_rules(("norm1_context", "linear"), f"{key}.norm1_context.linear")
        attns = [("attn", ["to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj"]
                  + ([] if last else ["to_add_out"]))]
        if dual:
            attns.append(("attn2", ["to_q", "to_k", "to_v"]))
        for attn, names in attns:
            for n in names + ["to_out"]:
                block += linear_rules((attn, n), f"{key}.{attn}.{n}.0" if n == "to_out" else f"{key}.{attn}.{n}")
            if cfg.qk_norm:
                norms = ("norm_q", "norm_k") + (("norm_added_q", "norm_added_k") if attn == "attn" else ())
                block += [WeightRule((attn, n, "scale"), f"{key}.{attn}.{n}.weight") for n in norms]
        for ff in ("ff",) if last else ("ff", "ff_context"):
            block += linear_rules((ff, "proj_in"), f"{key}.{ff}.net.0.proj")
            block += linear_rules((ff, "proj_out"), f"{key}.{ff}.net.2")
        rules += [dataclasses.replace(r, path=(name,) + r.path, offset=first) for r in block]
    return rules


def denoiser_inputs(cfg: SD3Config, *, guidance: float, image_grid: tuple[int, int] | None):
    """SD3 as a denoiser (`ModelFamily.denoiser_inputs`): packed (B, S, C) tokens on the
    `image_grid` (rows, cols) grid, sigma * 1000 as the timestep (what the pipeline passes); no
    embedded guidance (true CFG), so `guidance` is unused."""
    del cfg, guidance
    if image_grid is None:
        raise ValueError("an sd3 denoiser needs image_grid, the (rows, cols) grid of packed tokens")

    def inputs(latents, cond, sigma):
        return dict(hidden_states=latents, encoder_hidden_states=cond.text, pooled_projections=cond.pooled,
                    timestep=sigma * 1000.0, image_grid=tuple(image_grid))

    return inputs


FAMILY = ModelFamily(
    name="sd3",
    diffusers_class="SD3Transformer2DModel",
    config_cls=SD3Config,
    module_cls=SD3Transformer,
    weight_rules=weight_rules,
    example_inputs=example_inputs,
    variants=VARIANTS,
    ignored_prefixes=IGNORED_PREFIXES,
    denoiser_inputs=denoiser_inputs,
)
