"""FLUX.1 transformer (diffusers `FluxTransformer2DModel`) in flax.linen.

Computes exactly what the diffusers module computes (fp32 parity is tested):
double-stream blocks over [text, image] joint attention, single-stream blocks with
attention and MLP in parallel, AdaLN-Zero modulation, interleaved 3-axis RoPE,
an optional guidance embedding (FLUX.1-dev is guidance-distilled) and a final
AdaLN-Continuous norm whose chunks are (scale, shift).

Deliberate differences from the PyTorch module, none of which changes fp32 output:
* Blocks are stacked and run with `nn.scan` (parameters carry a leading `layers`
  axis), which keeps compile time independent of depth; `scan_layers=False` unrolls
  them instead (`stacking.scan_blocks`).
* Text and image tokens are concatenated once before the single-stream blocks and
  split once after them, instead of in every block.
* The timestep and guidance scalars stay float32 in the sinusoid; diffusers first
  casts them to the compute dtype, which rounds them in bf16.
"""
from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from digen_jax.models import attention, layers, partitioning, rope, stacking
from digen_jax.models.conversion import ModelFamily, WeightRule, linear_rules
from digen_jax.models.transformer_config import TransformerConfig

ACT = ("activation_batch", "activation_length", "activation_embed")


@dataclasses.dataclass(frozen=True)
class FluxConfig(TransformerConfig):
    """Architecture (the diffusers config fields); the execution policy is `TransformerConfig`'s."""

    patch_size: int = 1
    in_channels: int = 64
    out_channels: int | None = None
    num_layers: int = 19
    num_single_layers: int = 38
    attention_head_dim: int = 128
    num_attention_heads: int = 24
    joint_attention_dim: int = 4096
    pooled_projection_dim: int = 768
    guidance_embeds: bool = False
    axes_dims_rope: tuple[int, ...] = (16, 56, 56)

    def __post_init__(self):
        object.__setattr__(self, "axes_dims_rope", tuple(self.axes_dims_rope))
        if sum(self.axes_dims_rope) != self.attention_head_dim:
            raise ValueError(
                f"sum(axes_dims_rope)={sum(self.axes_dims_rope)} must equal attention_head_dim={self.attention_head_dim}"
            )
        super().__post_init__()

    @property
    def mlp_dim(self) -> int:
        return 4 * self.inner_dim

    @property
    def out_dim(self) -> int:
        return self.patch_size * self.patch_size * (self.out_channels or self.in_channels)


VARIANTS = {
    "dev": FluxConfig(guidance_embeds=True),
    "schnell": FluxConfig(guidance_embeds=False),
    # Structurally identical to the full model (2 blocks of each kind), for CPU tests.
    "tiny": FluxConfig(
        num_layers=2,
        num_single_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        in_channels=16,
        joint_attention_dim=32,
        pooled_projection_dim=32,
        guidance_embeds=True,
        axes_dims_rope=(4, 6, 6),
        dtype="float32",
    ),
}


class FluxAttention(nn.Module):
    """Multi-head attention with per-head RMS qk-norm and RoPE.

    `joint=True` (double blocks): image tokens `x` and text tokens `ctx` have their own
    q/k/v and output projections and attend jointly in [text, image] order.
    `joint=False` (single blocks): one token stream, no output projection.
    """

    cfg: FluxConfig
    joint: bool

    def _qkv(self, x, prefix: str, q_norm: str, k_norm: str):
        cfg = self.cfg
        b, s, _ = x.shape
        out = []
        for name in ("q", "k", "v"):
            h = layers.logical_dense(cfg.inner_dim, ("embed", "heads"), name=f"{prefix}{name}", **cfg.kw)(x)
            out.append(h.reshape(b, s, cfg.num_attention_heads, cfg.attention_head_dim))
        q, k, v = out
        norm_kw = dict(eps=1e-6, param_dtype=cfg.kw["param_dtype"])
        return layers.RMSNorm(name=q_norm, **norm_kw)(q), layers.RMSNorm(name=k_norm, **norm_kw)(k), v

    @nn.compact
    def __call__(self, x, ctx, cos, sin):
        cfg = self.cfg
        q, k, v = self._qkv(x, "to_", "norm_q", "norm_k")
        if self.joint:
            cq, ck, cv = self._qkv(ctx, "add_", "norm_added_q", "norm_added_k")
            q, k, v = (jnp.concatenate(pair, axis=1) for pair in ((cq, q), (ck, k), (cv, v)))
        q, k = rope.apply_rope(q, cos, sin), rope.apply_rope(k, cos, sin)
        out = attention.dot_product_attention(q, k, v, impl=cfg.attention_impl)
        out = out.reshape(*out.shape[:2], cfg.inner_dim)
        out = checkpoint_name(out, "attn_out")
        if not self.joint:
            return out
        txt_len = ctx.shape[1]
        ctx_out, x_out = out[:, :txt_len], out[:, txt_len:]
        x_out = layers.logical_dense(cfg.inner_dim, ("heads", "embed"), name="to_out", **cfg.kw)(x_out)
        ctx_out = layers.logical_dense(cfg.inner_dim, ("heads", "embed"), name="to_add_out", **cfg.kw)(ctx_out)
        return x_out, ctx_out


class FluxDoubleBlock(nn.Module):
    """MMDiT block: separate image/text weights, joint attention. Scanned; carry (img, txt)."""

    cfg: FluxConfig

    @nn.compact
    def __call__(self, carry, temb, cos, sin):
        cfg = self.cfg
        img, txt = carry
        shift_a, scale_a, gate_a, shift_m, scale_m, gate_m = layers.Modulation(6, cfg.inner_dim, name="norm1", **cfg.kw)(temb)
        c_shift_a, c_scale_a, c_gate_a, c_shift_m, c_scale_m, c_gate_m = layers.Modulation(
            6, cfg.inner_dim, name="norm1_context", **cfg.kw
        )(temb)
        img_attn, txt_attn = FluxAttention(cfg, joint=True, name="attn")(
            layers.modulate(layers.layer_norm(img), shift_a, scale_a),
            layers.modulate(layers.layer_norm(txt), c_shift_a, c_scale_a),
            cos,
            sin,
        )
        img = img + gate_a[:, None] * img_attn
        img_mlp = layers.FeedForward(cfg.mlp_dim, cfg.inner_dim, name="ff", **cfg.kw)(
            layers.modulate(layers.layer_norm(img), shift_m, scale_m)
        )
        img = partitioning.constrain(img + gate_m[:, None] * img_mlp, ACT)
        txt = txt + c_gate_a[:, None] * txt_attn
        txt_mlp = layers.FeedForward(cfg.mlp_dim, cfg.inner_dim, name="ff_context", **cfg.kw)(
            layers.modulate(layers.layer_norm(txt), c_shift_m, c_scale_m)
        )
        txt = partitioning.constrain(txt + c_gate_m[:, None] * txt_mlp, ACT)
        return (img, txt), None


class FluxSingleBlock(nn.Module):
    """Single-stream block: attention and MLP in parallel on the joint sequence. Scanned."""

    cfg: FluxConfig

    @nn.compact
    def __call__(self, x, temb, cos, sin):
        cfg = self.cfg
        shift, scale, gate = layers.Modulation(3, cfg.inner_dim, name="norm", **cfg.kw)(temb)
        h = layers.modulate(layers.layer_norm(x), shift, scale)
        mlp = nn.gelu(layers.logical_dense(cfg.mlp_dim, ("embed", "mlp"), name="proj_mlp", **cfg.kw)(h), approximate=True)
        attn = FluxAttention(cfg, joint=False, name="attn")(h, None, cos, sin)
        out = layers.logical_dense(cfg.inner_dim, ("attn_mlp", "embed"), name="proj_out", **cfg.kw)(
            jnp.concatenate([attn, mlp], axis=-1)
        )
        return partitioning.constrain(x + gate[:, None] * out, ACT), None


class FluxConditioning(nn.Module):
    """temb = MLP(sinusoid(1000 t)) [+ MLP(sinusoid(1000 g))] + MLP(pooled text)."""

    cfg: FluxConfig

    @nn.compact
    def __call__(self, timestep, pooled, guidance):
        cfg = self.cfg
        embed = lambda name: layers.MLPEmbedder(cfg.inner_dim, name=name, **cfg.kw)  # noqa: E731
        temb = embed("timestep_embedder")(layers.timestep_sinusoid(timestep * 1000.0, 256))
        if cfg.guidance_embeds:
            temb = temb + embed("guidance_embedder")(layers.timestep_sinusoid(guidance * 1000.0, 256))
        return temb + embed("text_embedder")(pooled)


class FluxTransformer(nn.Module):
    """`FluxTransformer2DModel.forward` with the same keyword arguments (arrays for tensors).

    Args:
      hidden_states: (B, S_img, in_channels) packed latents.
      encoder_hidden_states: (B, S_txt, joint_attention_dim) T5 states, no mask.
      pooled_projections: (B, pooled_projection_dim) CLIP pooled vector.
      timestep: (B,) sigma in [0, 1]; multiplied by 1000 inside, as in diffusers.
      img_ids: (S_img, 3) position ids; txt_ids: (S_txt, 3). A leading batch axis
        (deprecated in diffusers) is accepted and dropped.
      guidance: (B,) raw guidance scale (e.g. 3.5), required iff `guidance_embeds`.
    Returns:
      (B, S_img, patch^2 * out_channels) velocity in the compute dtype.
    """

    cfg: FluxConfig

    @nn.compact
    def __call__(
        self,
        hidden_states,
        encoder_hidden_states,
        pooled_projections,
        timestep,
        img_ids,
        txt_ids,
        guidance=None,
    ):
        cfg = self.cfg
        _check_inputs(cfg, hidden_states, encoder_hidden_states, pooled_projections, timestep, img_ids, txt_ids, guidance)
        img_ids = img_ids[0] if img_ids.ndim == 3 else img_ids
        txt_ids = txt_ids[0] if txt_ids.ndim == 3 else txt_ids
        dtype = cfg.kw["dtype"]

        img = layers.logical_dense(cfg.inner_dim, ("cond", "embed"), name="x_embedder", **cfg.kw)(hidden_states.astype(dtype))
        txt = layers.logical_dense(cfg.inner_dim, ("cond", "embed"), name="context_embedder", **cfg.kw)(
            encoder_hidden_states.astype(dtype)
        )
        img, txt = partitioning.constrain(img, ACT), partitioning.constrain(txt, ACT)
        temb = FluxConditioning(cfg, name="time_text_embed")(timestep, pooled_projections, guidance)
        cos, sin = rope.rope_tables(jnp.concatenate([txt_ids, img_ids], axis=0), cfg.axes_dims_rope, 10000.0)

        if cfg.num_layers:
            blocks = stacking.scan_blocks(FluxDoubleBlock, cfg.num_layers, cfg.remat_policy, cfg.scan_layers)
            (img, txt), _ = blocks(cfg, name="double_blocks")((img, txt), temb, cos, sin)
        txt_len = txt.shape[1]
        x = jnp.concatenate([txt, img], axis=1)
        if cfg.num_single_layers:
            blocks = stacking.scan_blocks(FluxSingleBlock, cfg.num_single_layers, cfg.remat_policy, cfg.scan_layers)
            x, _ = blocks(cfg, name="single_blocks")(x, temb, cos, sin)
        img = x[:, txt_len:]

        scale, shift = layers.Modulation(2, cfg.inner_dim, name="norm_out", **cfg.kw)(temb)
        img = layers.modulate(layers.layer_norm(img), shift, scale)
        return layers.logical_dense(cfg.out_dim, ("embed", "cond"), name="proj_out", **cfg.kw)(img)


def _check_inputs(cfg, hidden_states, encoder_hidden_states, pooled, timestep, img_ids, txt_ids, guidance):
    """Shape errors at trace time, naming the argument, before any device work."""
    b = hidden_states.shape[0]
    expect = {
        "hidden_states": (hidden_states, 3, cfg.in_channels),
        "encoder_hidden_states": (encoder_hidden_states, 3, cfg.joint_attention_dim),
        "pooled_projections": (pooled, 2, cfg.pooled_projection_dim),
    }
    for name, (arr, ndim, last) in expect.items():
        if arr.ndim != ndim or arr.shape[-1] != last or arr.shape[0] != b:
            raise ValueError(f"{name} must have shape (B={b}, ..., {last}) with {ndim} dims, got {arr.shape}")
    if timestep.shape != (b,):
        raise ValueError(f"timestep must have shape ({b},), got {timestep.shape}")
    for name, ids, seq in (("img_ids", img_ids, hidden_states.shape[1]), ("txt_ids", txt_ids, encoder_hidden_states.shape[1])):
        if ids.shape[-2:] != (seq, len(cfg.axes_dims_rope)):
            raise ValueError(f"{name} must have shape ({seq}, {len(cfg.axes_dims_rope)}), got {ids.shape}")
    if cfg.guidance_embeds and guidance is None:
        raise ValueError("this FLUX model embeds guidance (guidance_embeds=True): pass guidance of shape (B,)")
    if not cfg.guidance_embeds and guidance is not None:
        raise ValueError("this FLUX model has no guidance embedding (guidance_embeds=False): pass guidance=None")
    if guidance is not None and guidance.shape != (b,):
        raise ValueError(f"guidance must have shape ({b},), got {guidance.shape}")


def example_inputs(cfg: FluxConfig, batch: int = 1, image_seq_len: int = 16, text_seq_len: int = 8) -> dict:
    """Abstract inputs (ShapeDtypeStructs) for `init`/`eval_shape` at the given sizes."""
    f32 = jnp.float32
    spec = lambda *shape: jax.ShapeDtypeStruct(shape, f32)  # noqa: E731
    return dict(
        hidden_states=spec(batch, image_seq_len, cfg.in_channels),
        encoder_hidden_states=spec(batch, text_seq_len, cfg.joint_attention_dim),
        pooled_projections=spec(batch, cfg.pooled_projection_dim),
        timestep=spec(batch),
        img_ids=spec(image_seq_len, 3),
        txt_ids=spec(text_seq_len, 3),
        guidance=spec(batch) if cfg.guidance_embeds else None,
    )


def weight_rules(cfg: FluxConfig) -> list[WeightRule]:
    """Every Flax parameter and the diffusers state-dict key it comes from.

    `{i}` in a key is the block index; those parameters are stacked on a leading axis.
    """
    rules: list[WeightRule] = []
    for sub in ("timestep_embedder", "text_embedder") + (("guidance_embedder",) if cfg.guidance_embeds else ()):
        for lin in ("linear_1", "linear_2"):
            rules += linear_rules(("time_text_embed", sub, lin), f"time_text_embed.{sub}.{lin}")
    for name in ("x_embedder", "context_embedder", "proj_out"):
        rules += linear_rules((name,), name)
    rules += linear_rules(("norm_out", "linear"), "norm_out.linear")

    rules += mmdit_block_rules()
    return rules


def mmdit_block_rules() -> list[WeightRule]:
    """Rules of the scanned double- and single-stream blocks, shared with HunyuanVideo,
    whose blocks carry the same diffusers key names (`transformer_blocks.{i}`,
    `single_transformer_blocks.{i}`)."""
    rules: list[WeightRule] = []

    def attn(flax_root, key_root, names):
        out = []
        for flax_name, key_name in names:
            out += linear_rules(flax_root + ("attn", flax_name), f"{key_root}.attn.{key_name}")
        return out

    def qk_norms(flax_root, key_root, names):
        return [WeightRule(flax_root + ("attn", n, "scale"), f"{key_root}.attn.{n}.weight") for n in names]

    d, dk = ("double_blocks",), "transformer_blocks.{i}"
    rules += linear_rules(d + ("norm1", "linear"), f"{dk}.norm1.linear")
    rules += linear_rules(d + ("norm1_context", "linear"), f"{dk}.norm1_context.linear")
    rules += attn(
        d,
        dk,
        [("to_q", "to_q"), ("to_k", "to_k"), ("to_v", "to_v"), ("to_out", "to_out.0"),
         ("add_q", "add_q_proj"), ("add_k", "add_k_proj"), ("add_v", "add_v_proj"), ("to_add_out", "to_add_out")],
    )
    rules += qk_norms(d, dk, ("norm_q", "norm_k", "norm_added_q", "norm_added_k"))
    for ff in ("ff", "ff_context"):
        rules += linear_rules(d + (ff, "proj_in"), f"{dk}.{ff}.net.0.proj")
        rules += linear_rules(d + (ff, "proj_out"), f"{dk}.{ff}.net.2")

    s, sk = ("single_blocks",), "single_transformer_blocks.{i}"
    rules += linear_rules(s + ("norm", "linear"), f"{sk}.norm.linear")
    rules += linear_rules(s + ("proj_mlp",), f"{sk}.proj_mlp")
    rules += linear_rules(s + ("proj_out",), f"{sk}.proj_out")
    rules += attn(s, sk, [("to_q", "to_q"), ("to_k", "to_k"), ("to_v", "to_v")])
    rules += qk_norms(s, sk, ("norm_q", "norm_k"))
    return rules


def image_ids(rows: int, cols: int, dtype: jnp.dtype = jnp.float32) -> jax.Array:
    """Rotary position ids of a `rows` x `cols` grid of packed image tokens, shape (rows * cols, 3).

    Row ``i * cols + j`` is ``[0, i, j]``: axis 0 is unused for images, axes 1/2 are the token's
    row and column, in token order.
    """
    r, c = jnp.meshgrid(jnp.arange(rows), jnp.arange(cols), indexing="ij")
    ids = jnp.stack([jnp.zeros_like(r), r, c], axis=-1)
    return ids.reshape(-1, 3).astype(dtype)


def denoiser_inputs(cfg: FluxConfig, *, guidance: float, image_grid: tuple[int, int] | None):
    """FLUX as a denoiser (`ModelFamily.denoiser_inputs`): packed (B, S, C) tokens on the
    `image_grid` (rows, cols) grid, sigma as the timestep, the raw `guidance` scale embedded
    (guidance-distilled variants), zero text position ids."""
    if image_grid is None:
        raise ValueError("a flux denoiser needs image_grid, the (rows, cols) grid of packed tokens")

    def inputs(latents, cond, sigma):
        embedded_guidance = jnp.full((latents.shape[0],), guidance, jnp.float32)
        return dict(
            hidden_states=latents,
            encoder_hidden_states=cond.text,
            pooled_projections=cond.pooled,
            timestep=sigma,
            img_ids=image_ids(*image_grid),
            txt_ids=jnp.zeros((cond.text.shape[1], 3)),
            guidance=embedded_guidance if cfg.guidance_embeds else None,
        )

    return inputs


FAMILY = ModelFamily(
    name="flux",
    diffusers_class="FluxTransformer2DModel",
    config_cls=FluxConfig,
    module_cls=FluxTransformer,
    weight_rules=weight_rules,
    example_inputs=example_inputs,
    variants=VARIANTS,
    denoiser_inputs=denoiser_inputs,
)
