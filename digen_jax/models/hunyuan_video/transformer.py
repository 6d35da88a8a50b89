"""HunyuanVideo transformer (diffusers `HunyuanVideoTransformer3DModel`, text-to-video) in flax.linen.

Computes exactly what the diffusers module computes (fp32 parity is tested):
a Conv3d patch embedding, a token refiner over the text (its own timestep and
masked-mean-pooled-text conditioning, self-attention blocks under the text mask),
double-stream blocks over [image, text] joint attention, single-stream blocks,
3-axis RoPE (theta 256) on the image tokens only, a final AdaLN-Continuous norm
whose chunks are (scale, shift), and unpatchify with `proj_out` channels ordered
(C, pt, p, p).

The text is right-padded: `encoder_attention_mask` (B, L) marks the first
`mask.sum()` tokens valid. diffusers masks keys only, so:
* joint attention masks keys at positions >= S_img + mask.sum(); this is exactly
  `kv_lengths` in `attention.dot_product_attention` (the cuDNN path takes it as is);
* the refiner's mask is `valid_q & valid_k` with key 0 always allowed. Valid query
  rows therefore attend to the first mask.sum() keys (`kv_lengths = mask.sum()`);
  padded query rows differ (diffusers lets them see key 0 only), but padded text
  tokens are never visible to valid tokens afterwards (they are masked keys in
  every later attention and dropped at the end), so the output is identical.
  A mask that is not right-padded is not supported.

Deliberate differences from the PyTorch module, none of which changes fp32 output:
* Blocks (refiner, double, single) are stacked and run with `nn.scan` (parameters
  carry a leading `layers` axis), which keeps compile time independent of depth;
  `scan_layers=False` unrolls them instead (`stacking.scan_blocks`).
* The single-stream blocks carry image and text tokens apart (the same weights on both;
  every op but attention is per token) and join them only in attention's q/k/v, so the
  image tokens can be split over devices while the text stays whole.
* The Conv3d patch embedding (kernel = stride) runs as patchify + one matmul. Its
  kernel keeps the Conv3d layout (pt, p, p, C_in, D) (the 'conv' transform).
* RoPE frequencies are computed in float64 and rounded (diffusers computes them in
  float32); they differ by at most one float32 ulp.
* The timestep and guidance scalars stay float32 in the sinusoid.

Sequence parallelism (`attention.token_parallel_attention`): traced under a mesh with a `seq`
axis, the image tokens are split over it from the patch embedding on; the text (token refiner
and text stream) stays whole on every device. Joint attention runs as Ulysses: the image
q/k/v move to head shards by an all-to-all, each device takes its heads of the text q/k/v,
attends over [image, text], and the image output returns to token shards.
"""
from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from digen_jax.models import attention, layers, partitioning, rope, stacking
from digen_jax.models.flux import transformer as flux
from digen_jax.models.conversion import ModelFamily, WeightRule, linear_rules
from digen_jax.models.transformer_config import TransformerConfig

ACT = ("activation_batch", "activation_length", "activation_embed")


@dataclasses.dataclass(frozen=True)
class HunyuanVideoConfig(TransformerConfig):
    """Architecture (the diffusers config fields); the execution policy is `TransformerConfig`'s."""

    in_channels: int = 16
    out_channels: int | None = 16
    num_attention_heads: int = 24
    attention_head_dim: int = 128
    num_layers: int = 20
    num_single_layers: int = 40
    num_refiner_layers: int = 2
    mlp_ratio: float = 4.0
    patch_size: int = 2
    patch_size_t: int = 1
    qk_norm: str = "rms_norm"
    guidance_embeds: bool = True
    text_embed_dim: int = 4096
    pooled_projection_dim: int = 768
    rope_theta: float = 256.0
    rope_axes_dim: tuple[int, ...] = (16, 56, 56)
    image_condition_type: str | None = None

    def __post_init__(self):
        object.__setattr__(self, "rope_axes_dim", tuple(self.rope_axes_dim))
        if self.image_condition_type is not None:
            raise ValueError(
                f"image_condition_type={self.image_condition_type!r} (image-to-video) is not supported: "
                "only the text-to-video model (image_condition_type=None) is ported"
            )
        if self.qk_norm != "rms_norm":
            raise ValueError(f"only qk_norm='rms_norm' is supported, got {self.qk_norm!r}")
        if len(self.rope_axes_dim) != 3 or sum(self.rope_axes_dim) != self.attention_head_dim:
            raise ValueError(
                f"rope_axes_dim={self.rope_axes_dim} must have 3 axes summing to attention_head_dim={self.attention_head_dim}"
            )
        super().__post_init__()

    @property
    def mlp_dim(self) -> int:
        return int(self.inner_dim * self.mlp_ratio)

    @property
    def refiner_mlp_dim(self) -> int:
        # diffusers builds the token refiner without passing `mlp_ratio`, so its MLP is
        # always 4x wide whatever the config says.
        return 4 * self.inner_dim

    @property
    def patch(self) -> tuple[int, int, int]:
        return (self.patch_size_t, self.patch_size, self.patch_size)

    @property
    def out_dim(self) -> int:
        return int(np.prod(self.patch)) * (self.out_channels or self.in_channels)


VARIANTS = {
    # HunyuanVideo T2V (hunyuanvideo-community/HunyuanVideo, "HYVideo-T/2-cfgdistill").
    "t2v": HunyuanVideoConfig(),
    # Structurally identical to the full model (2 blocks of each kind), for CPU tests.
    "tiny": HunyuanVideoConfig(
        in_channels=4,
        out_channels=4,
        num_attention_heads=2,
        attention_head_dim=16,
        num_layers=2,
        num_single_layers=2,
        num_refiner_layers=2,
        text_embed_dim=32,
        pooled_projection_dim=16,
        rope_axes_dim=(4, 6, 6),
        dtype="float32",
    ),
}


class AffineLayerNorm(nn.Module):
    """LayerNorm with a learned scale and bias over the last axis, computed in float32."""

    eps: float = 1e-6
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        shape = (x.shape[-1],)
        ones, zeros = nn.initializers.ones_init(), nn.initializers.zeros_init()
        scale = self.param("scale", nn.with_logical_partitioning(ones, ("embed",)), shape, self.param_dtype)
        bias = self.param("bias", nn.with_logical_partitioning(zeros, ("embed",)), shape, self.param_dtype)
        out = layers.layer_norm(x.astype(jnp.float32), self.eps) * scale.astype(jnp.float32) + bias.astype(jnp.float32)
        return out.astype(x.dtype)


class HunyuanVideoAttention(nn.Module):
    """Multi-head attention with per-head RMS qk-norm, RoPE on image tokens, text key mask.

    Image tokens `x` and text tokens `ctx` attend jointly in [image, text] order.
    `joint=True` (double blocks): each has its own q/k/v and output projections.
    `joint=False` (single blocks): both go through the same q/k/v projections, no output
    projection. `kv_lengths` (B,) = S_img + valid text length masks the padded text keys.
    Returns the image and the text tokens' outputs.
    """

    cfg: HunyuanVideoConfig
    joint: bool

    def _qkv(self, prefix: str, q_norm: str, k_norm: str):
        """The q/k/v projections and qk-norms named with `prefix`, as one function of tokens."""
        cfg = self.cfg
        dense = [layers.logical_dense(cfg.inner_dim, ("embed", "heads"), name=f"{prefix}{n}", **cfg.kw) for n in "qkv"]
        norm_kw = dict(eps=1e-6, param_dtype=cfg.kw["param_dtype"])
        norms = (layers.RMSNorm(name=q_norm, **norm_kw), layers.RMSNorm(name=k_norm, **norm_kw), lambda a: a)

        def project(x):
            b, s, _ = x.shape
            return [norm(d(x).reshape(b, s, cfg.num_attention_heads, cfg.attention_head_dim)) for d, norm in zip(dense, norms)]

        return project

    @nn.compact
    def __call__(self, x, ctx, cos, sin, kv_lengths):
        cfg = self.cfg
        image_qkv = self._qkv("to_", "norm_q", "norm_k")
        text_qkv = self._qkv("add_", "norm_added_q", "norm_added_k") if self.joint else image_qkv
        q, k, v = image_qkv(x)
        q, k = rope.apply_rope(q, cos, sin), rope.apply_rope(k, cos, sin)
        x_out, ctx_out = attention.token_parallel_attention(
            q, k, v, kv_lengths=kv_lengths, appended=tuple(text_qkv(ctx)), impl=cfg.attention_impl
        )
        x_out, ctx_out = (checkpoint_name(o.reshape(*o.shape[:2], cfg.inner_dim), "attn_out") for o in (x_out, ctx_out))
        if not self.joint:
            return x_out, ctx_out
        x_out = layers.logical_dense(cfg.inner_dim, ("heads", "embed"), name="to_out", **cfg.kw)(x_out)
        ctx_out = layers.logical_dense(cfg.inner_dim, ("heads", "embed"), name="to_add_out", **cfg.kw)(ctx_out)
        return x_out, ctx_out


class HunyuanVideoDoubleBlock(nn.Module):
    """MMDiT block: separate image/text weights, joint attention. Scanned; carry (img, txt)."""

    cfg: HunyuanVideoConfig

    @nn.compact
    def __call__(self, carry, temb, cos, sin, kv_lengths):
        cfg = self.cfg
        img, txt = carry
        shift_a, scale_a, gate_a, shift_m, scale_m, gate_m = layers.Modulation(6, cfg.inner_dim, name="norm1", **cfg.kw)(temb)
        c_shift_a, c_scale_a, c_gate_a, c_shift_m, c_scale_m, c_gate_m = layers.Modulation(
            6, cfg.inner_dim, name="norm1_context", **cfg.kw
        )(temb)
        img_attn, txt_attn = HunyuanVideoAttention(cfg, joint=True, name="attn")(
            layers.modulate(layers.layer_norm(img), shift_a, scale_a),
            layers.modulate(layers.layer_norm(txt), c_shift_a, c_scale_a),
            cos,
            sin,
            kv_lengths,
        )
        img = img + gate_a[:, None] * img_attn
        img_mlp = layers.FeedForward(cfg.mlp_dim, cfg.inner_dim, name="ff", **cfg.kw)(
            layers.modulate(layers.layer_norm(img), shift_m, scale_m)
        )
        img = partitioning.shard_tokens(partitioning.constrain(img + gate_m[:, None] * img_mlp, ACT))
        txt = txt + c_gate_a[:, None] * txt_attn
        txt_mlp = layers.FeedForward(cfg.mlp_dim, cfg.inner_dim, name="ff_context", **cfg.kw)(
            layers.modulate(layers.layer_norm(txt), c_shift_m, c_scale_m)
        )
        txt = partitioning.constrain(txt + c_gate_m[:, None] * txt_mlp, ACT)
        return (img, txt), None


class HunyuanVideoSingleBlock(nn.Module):
    """Single-stream block on [image, text] (one set of weights for both, joint attention):
    attention and MLP in parallel. Scanned; carry (img, txt)."""

    cfg: HunyuanVideoConfig

    @nn.compact
    def __call__(self, carry, temb, cos, sin, kv_lengths):
        cfg = self.cfg
        shift, scale, gate = layers.Modulation(3, cfg.inner_dim, name="norm", **cfg.kw)(temb)
        h_img, h_txt = (layers.modulate(layers.layer_norm(x), shift, scale) for x in carry)
        attn = HunyuanVideoAttention(cfg, joint=False, name="attn")(h_img, h_txt, cos, sin, kv_lengths)
        proj_mlp = layers.logical_dense(cfg.mlp_dim, ("embed", "mlp"), name="proj_mlp", **cfg.kw)
        proj_out = layers.logical_dense(cfg.inner_dim, ("attn_mlp", "embed"), name="proj_out", **cfg.kw)

        def residual(x, h, a):
            mlp = nn.gelu(proj_mlp(h), approximate=True)
            return partitioning.constrain(x + gate[:, None] * proj_out(jnp.concatenate([a, mlp], axis=-1)), ACT)

        img, txt = (residual(*parts) for parts in zip(carry, (h_img, h_txt), attn))
        return (partitioning.shard_tokens(img), txt), None


class RefinerBlock(nn.Module):
    """Token-refiner block: LayerNorm (affine) -> masked self-attention -> gated residual,
    LayerNorm (affine) -> SiLU MLP -> gated residual; gates from the refiner's temb. Scanned."""

    cfg: HunyuanVideoConfig

    @nn.compact
    def __call__(self, x, temb, kv_lengths):
        cfg = self.cfg
        b, s, _ = x.shape
        norm_kw = dict(eps=1e-6, param_dtype=cfg.kw["param_dtype"])
        h = AffineLayerNorm(name="norm1", **norm_kw)(x)
        q, k, v = (
            layers.logical_dense(cfg.inner_dim, ("embed", "heads"), name=f"to_{n}", **cfg.kw)(h).reshape(
                b, s, cfg.num_attention_heads, cfg.attention_head_dim
            )
            for n in ("q", "k", "v")
        )
        attn = attention.dot_product_attention(q, k, v, kv_lengths=kv_lengths, impl=cfg.attention_impl)
        attn = checkpoint_name(attn.reshape(b, s, cfg.inner_dim), "attn_out")
        attn = layers.logical_dense(cfg.inner_dim, ("heads", "embed"), name="to_out", **cfg.kw)(attn)
        gate_a, gate_m = layers.Modulation(2, cfg.inner_dim, name="norm_out", **cfg.kw)(temb)
        x = x + attn * gate_a[:, None]
        mlp = layers.FeedForward(cfg.refiner_mlp_dim, cfg.inner_dim, "silu", name="ff", **cfg.kw)(AffineLayerNorm(name="norm2", **norm_kw)(x))
        return partitioning.constrain(x + mlp * gate_m[:, None], ACT), None


class TokenRefiner(nn.Module):
    """`context_embedder`: projects the text and refines it under its mask, conditioned on
    MLP(sinusoid(t)) + MLP(masked mean of the raw text states)."""

    cfg: HunyuanVideoConfig

    @nn.compact
    def __call__(self, text, timestep, mask, text_lengths):
        cfg = self.cfg
        weights = mask.astype(jnp.float32)[..., None]
        pooled = jnp.sum(text.astype(jnp.float32) * weights, axis=1) / jnp.sum(weights, axis=1)
        embed = lambda name: layers.MLPEmbedder(cfg.inner_dim, name=name, **cfg.kw)  # noqa: E731
        temb = embed("timestep_embedder")(layers.timestep_sinusoid(timestep, 256))
        temb = temb + embed("text_embedder")(pooled)
        x = layers.logical_dense(cfg.inner_dim, ("cond", "embed"), name="proj_in", **cfg.kw)(text.astype(cfg.kw["dtype"]))
        x = partitioning.constrain(x, ACT)
        if cfg.num_refiner_layers:
            blocks = stacking.scan_blocks(RefinerBlock, cfg.num_refiner_layers, cfg.remat_policy, cfg.scan_layers)
            x, _ = blocks(cfg, name="refiner_blocks")(x, temb, text_lengths)
        return x


class HunyuanVideoConditioning(nn.Module):
    """temb = MLP(sinusoid(t)) [+ MLP(sinusoid(guidance))] + MLP(pooled text); no x1000 inside."""

    cfg: HunyuanVideoConfig

    @nn.compact
    def __call__(self, timestep, pooled, guidance):
        cfg = self.cfg
        embed = lambda name: layers.MLPEmbedder(cfg.inner_dim, name=name, **cfg.kw)  # noqa: E731
        temb = embed("timestep_embedder")(layers.timestep_sinusoid(timestep, 256))
        if cfg.guidance_embeds:
            temb = temb + embed("guidance_embedder")(layers.timestep_sinusoid(guidance, 256))
        return temb + embed("text_embedder")(pooled)


class HunyuanVideoTransformer(nn.Module):
    """`HunyuanVideoTransformer3DModel.forward` with the same keyword arguments (arrays for tensors).

    Args:
      hidden_states: (B, in_channels, T', H', W') video latents; T' divisible by
        patch_size_t, H' and W' by patch_size.
      timestep: (B,) raw scheduler timestep in [0, 1000] (no scaling inside).
      encoder_hidden_states: (B, L, text_embed_dim) text-encoder states.
      encoder_attention_mask: (B, L) right-padded mask, nonzero = valid; required.
      pooled_projections: (B, pooled_projection_dim) CLIP pooled vector.
      guidance: (B,) embedded guidance, already x1000 (the pipeline multiplies),
        required iff `guidance_embeds`.
      attention_kwargs: diffusers' LoRA-scale dict; not supported, must be None.
    Returns:
      (B, out_channels, T', H', W') velocity in the compute dtype.
    """

    cfg: HunyuanVideoConfig

    @nn.compact
    def __call__(
        self,
        hidden_states,
        timestep,
        encoder_hidden_states,
        encoder_attention_mask,
        pooled_projections,
        guidance=None,
        attention_kwargs=None,
    ):
        cfg = self.cfg
        if attention_kwargs is not None:
            raise ValueError("attention_kwargs (LoRA scale) is not supported by the HunyuanVideo port: pass None")
        _check_inputs(cfg, hidden_states, timestep, encoder_hidden_states, encoder_attention_mask, pooled_projections, guidance)
        b, _, frames, height, width = hidden_states.shape
        pt, p, _ = cfg.patch
        grid = (frames // pt, height // p, width // p)
        dtype = cfg.kw["dtype"]

        ids = np.stack(np.meshgrid(*(np.arange(n) for n in grid), indexing="ij"), axis=-1).reshape(-1, 3)
        cos, sin = rope.rope_tables(jnp.asarray(ids, jnp.float32), cfg.rope_axes_dim, cfg.rope_theta)
        temb = HunyuanVideoConditioning(cfg, name="time_text_embed")(timestep, pooled_projections, guidance)

        img = layers.PatchEmbed3D(cfg.patch, cfg.inner_dim, name="x_embedder", **cfg.kw)(hidden_states.astype(dtype))
        img = partitioning.shard_tokens(img)
        text_lengths = jnp.sum(encoder_attention_mask != 0, axis=-1, dtype=jnp.int32)
        txt = TokenRefiner(cfg, name="context_embedder")(encoder_hidden_states, timestep, encoder_attention_mask, text_lengths)
        img, txt = partitioning.constrain(img, ACT), partitioning.constrain(txt, ACT)
        # [image, text] order with right-padded text: the padded keys are the tail.
        img_len = img.shape[1]
        kv_lengths = img_len + text_lengths

        if cfg.num_layers:
            blocks = stacking.scan_blocks(HunyuanVideoDoubleBlock, cfg.num_layers, cfg.remat_policy, cfg.scan_layers)
            (img, txt), _ = blocks(cfg, name="double_blocks")((img, txt), temb, cos, sin, kv_lengths)
        if cfg.num_single_layers:
            blocks = stacking.scan_blocks(HunyuanVideoSingleBlock, cfg.num_single_layers, cfg.remat_policy, cfg.scan_layers)
            (img, txt), _ = blocks(cfg, name="single_blocks")((img, txt), temb, cos, sin, kv_lengths)

        scale, shift = layers.Modulation(2, cfg.inner_dim, name="norm_out", **cfg.kw)(temb)
        img = layers.modulate(layers.layer_norm(img), shift, scale)
        out = layers.logical_dense(cfg.out_dim, ("embed", "cond"), name="proj_out", **cfg.kw)(img)
        # proj_out channels are ordered (C, pt, p, p): channel first.
        out = out.reshape(b, *grid, -1, pt, p, p).transpose(0, 4, 1, 5, 2, 6, 3, 7)
        return out.reshape(b, -1, frames, height, width)


def _check_inputs(cfg, hidden_states, timestep, text, mask, pooled, guidance):
    """Shape errors at trace time, naming the argument, before any device work."""
    if hidden_states.ndim != 5 or hidden_states.shape[1] != cfg.in_channels:
        raise ValueError(f"hidden_states must have shape (B, {cfg.in_channels}, T, H, W), got {hidden_states.shape}")
    b, _, frames, height, width = hidden_states.shape
    pt, p, _ = cfg.patch
    if frames % pt or height % p or width % p:
        raise ValueError(
            f"hidden_states frames/height/width {(frames, height, width)} must be divisible by the patch {(pt, p, p)}"
        )
    if text.ndim != 3 or text.shape[0] != b or text.shape[-1] != cfg.text_embed_dim:
        raise ValueError(f"encoder_hidden_states must have shape (B={b}, L, {cfg.text_embed_dim}), got {text.shape}")
    if mask is None or mask.shape != text.shape[:2]:
        raise ValueError(
            f"encoder_attention_mask is required, with shape {text.shape[:2]} (right-padded), got "
            f"{None if mask is None else mask.shape}"
        )
    if pooled.shape != (b, cfg.pooled_projection_dim):
        raise ValueError(f"pooled_projections must have shape ({b}, {cfg.pooled_projection_dim}), got {pooled.shape}")
    if timestep.shape != (b,):
        raise ValueError(f"timestep must have shape ({b},), got {timestep.shape}")
    if cfg.guidance_embeds and guidance is None:
        raise ValueError("this HunyuanVideo model embeds guidance (guidance_embeds=True): pass guidance of shape (B,)")
    if not cfg.guidance_embeds and guidance is not None:
        raise ValueError("this HunyuanVideo model has no guidance embedding (guidance_embeds=False): pass guidance=None")
    if guidance is not None and guidance.shape != (b,):
        raise ValueError(f"guidance must have shape ({b},), got {guidance.shape}")


def example_inputs(
    cfg: HunyuanVideoConfig, batch: int = 1, frames: int = 1, height: int = 2, width: int = 2, text_seq_len: int = 8
) -> dict:
    """Abstract inputs (ShapeDtypeStructs) for `init`/`eval_shape`.

    `frames`, `height`, `width` are in patches: hidden_states is
    (B, C, frames * patch_size_t, height * patch_size, width * patch_size).
    """
    f32 = jnp.float32
    spec = lambda *shape: jax.ShapeDtypeStruct(shape, f32)  # noqa: E731
    pt, p, _ = cfg.patch
    return dict(
        hidden_states=spec(batch, cfg.in_channels, frames * pt, height * p, width * p),
        timestep=spec(batch),
        encoder_hidden_states=spec(batch, text_seq_len, cfg.text_embed_dim),
        encoder_attention_mask=jax.ShapeDtypeStruct((batch, text_seq_len), jnp.int32),
        pooled_projections=spec(batch, cfg.pooled_projection_dim),
        guidance=spec(batch) if cfg.guidance_embeds else None,
    )


def weight_rules(cfg: HunyuanVideoConfig) -> list[WeightRule]:
    """Every Flax parameter and the diffusers state-dict key it comes from.

    `{i}` in a key is the block index; those parameters are stacked on a leading axis.
    """
    rules: list[WeightRule] = [
        WeightRule(("x_embedder", "kernel"), "x_embedder.proj.weight", "conv"),
        WeightRule(("x_embedder", "bias"), "x_embedder.proj.bias"),
    ]
    for sub in ("timestep_embedder", "text_embedder") + (("guidance_embedder",) if cfg.guidance_embeds else ()):
        for lin in ("linear_1", "linear_2"):
            rules += linear_rules(("time_text_embed", sub, lin), f"time_text_embed.{sub}.{lin}")
    rules += linear_rules(("proj_out",), "proj_out")
    rules += linear_rules(("norm_out", "linear"), "norm_out.linear")

    c, ck = ("context_embedder",), "context_embedder"
    for sub in ("timestep_embedder", "text_embedder"):
        for lin in ("linear_1", "linear_2"):
            rules += linear_rules(c + (sub, lin), f"{ck}.time_text_embed.{sub}.{lin}")
    rules += linear_rules(c + ("proj_in",), f"{ck}.proj_in")
    r, rk = c + ("refiner_blocks",), f"{ck}.token_refiner.refiner_blocks.{{i}}"
    for norm in ("norm1", "norm2"):
        rules += [WeightRule(r + (norm, "scale"), f"{rk}.{norm}.weight"), WeightRule(r + (norm, "bias"), f"{rk}.{norm}.bias")]
    for flax_name, key_name in (("to_q", "to_q"), ("to_k", "to_k"), ("to_v", "to_v"), ("to_out", "to_out.0")):
        rules += linear_rules(r + (flax_name,), f"{rk}.attn.{key_name}")
    rules += linear_rules(r + ("ff", "proj_in"), f"{rk}.ff.net.0.proj")
    rules += linear_rules(r + ("ff", "proj_out"), f"{rk}.ff.net.2")
    rules += linear_rules(r + ("norm_out", "linear"), f"{rk}.norm_out.linear")

    rules += flux.mmdit_block_rules()  # same block key names as FLUX
    return rules


def denoiser_inputs(cfg: HunyuanVideoConfig, *, guidance: float, image_grid: tuple[int, int] | None):
    """HunyuanVideo as a denoiser (`ModelFamily.denoiser_inputs`): (B, C, T, H, W) latents,
    sigma * 1000 as the timestep, the text mask and pooled vector, the `guidance` scale * 1000
    embedded (guidance-distilled variants); `image_grid` is unused."""
    del image_grid

    def inputs(latents, cond, sigma):
        embedded_guidance = jnp.full((latents.shape[0],), guidance, jnp.float32)
        return dict(
            hidden_states=latents,
            timestep=sigma * 1000.0,
            encoder_hidden_states=cond.text,
            encoder_attention_mask=cond.mask,
            pooled_projections=cond.pooled,
            guidance=embedded_guidance * 1000.0 if cfg.guidance_embeds else None,
        )

    return inputs


FAMILY = ModelFamily(
    name="hunyuan_video",
    diffusers_class="HunyuanVideoTransformer3DModel",
    config_cls=HunyuanVideoConfig,
    module_cls=HunyuanVideoTransformer,
    weight_rules=weight_rules,
    example_inputs=example_inputs,
    variants=VARIANTS,
    denoiser_inputs=denoiser_inputs,
)
