"""Qwen-Image transformer (diffusers `QwenImageTransformer2DModel`) in flax.linen.

Computes exactly what the diffusers module computes (fp32 parity is tested): an
RMS-normed text input, a sinusoid(1000 sigma) timestep embedding, double-stream
(MMDiT) blocks with separate image/text weights and AdaLN modulation (shift, scale,
gate for attention, then for the MLP), joint attention with per-head RMS qk-norms
and complex (interleaved) 3-axis RoPE, and a final AdaLN-Continuous norm whose
chunks are (scale, shift).

RoPE positions, as diffusers' `QwenEmbedRope` places them: image token (f, r, c) of
the k-th image of a sample sits at (k + f, r - ceil(h/2), c - ceil(w/2)), so rows and
columns are centred on 0; text token j sits at m + j on all three axes, with
m = max over the images of max(h // 2, w // 2). Diffusers takes the image list of the
first sample for the whole batch; so does this port.

`img_shapes` is the pipeline's Python list `[[(frames, h, w), ...]] * B`. The jitted
`apply_fn` traces every input, so its integers arrive as traced scalars: the port
therefore computes the position ids arithmetically from them (array-valued ids
over the static token counts) instead of slicing tables by them. The list structure
(how many images) stays static; the sizes may change without recompiling. That
the sizes add up to the image sequence length is checked whenever they are
concrete (plain Python or numpy integers); under `jit` it cannot be.

Deliberate differences from the PyTorch module, none of which changes fp32 output:
* Blocks are stacked and run with `nn.scan` (parameters carry a leading `layers`
  axis), which keeps compile time independent of depth; `scan_layers=False` unrolls
  them instead (`stacking.scan_blocks`).
* Joint attention runs on the sequence [image, text] instead of [text, image].
  Attention is permutation-equivariant once RoPE has been applied per token, so
  only the split of its output changes. With text last, the right-padded prompt
  padding (`encoder_hidden_states_mask`) sits at the end of the keys and is masked
  through key lengths (`S_img + valid text tokens`), the one kind of mask the fused
  cuDNN kernel takes. This assumes right padding (valid tokens first), which is
  how the pipeline pads; diffusers also accepts masks with holes.
* The timestep stays float32 in the sinusoid; diffusers first casts it to the
  compute dtype, which rounds it in bf16.
"""
from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from digen_jax.models import attention, layers, partitioning, rope, stacking
from digen_jax.models.conversion import ModelFamily, WeightRule, linear_rules
from digen_jax.models.transformer_config import TransformerConfig

ACT = ("activation_batch", "activation_length", "activation_embed")
ROPE_THETA = 10000.0


@dataclasses.dataclass(frozen=True)
class QwenImageConfig(TransformerConfig):
    """Architecture (the diffusers config fields); the execution policy is `TransformerConfig`'s."""

    patch_size: int = 2
    in_channels: int = 64
    out_channels: int | None = 16
    num_layers: int = 60
    attention_head_dim: int = 128
    num_attention_heads: int = 24
    joint_attention_dim: int = 3584
    # Stored by diffusers but builds nothing (its forward fails if guidance is passed).
    guidance_embeds: bool = False
    axes_dims_rope: tuple[int, ...] = (16, 56, 56)
    # Variants (Qwen-Image-Edit-2511, Qwen-Image-Layered) this port does not implement.
    zero_cond_t: bool = False
    use_additional_t_cond: bool = False
    use_layer3d_rope: bool = False
    # A legacy key of the released config.json that diffusers ignores.
    pooled_projection_dim: int | None = None

    def __post_init__(self):
        object.__setattr__(self, "axes_dims_rope", tuple(self.axes_dims_rope))
        if len(self.axes_dims_rope) != 3:
            raise ValueError(f"axes_dims_rope must have 3 entries (frame, height, width), got {self.axes_dims_rope}")
        if sum(self.axes_dims_rope) != self.attention_head_dim:
            raise ValueError(
                f"sum(axes_dims_rope)={sum(self.axes_dims_rope)} must equal attention_head_dim={self.attention_head_dim}"
            )
        unsupported = [f for f in ("zero_cond_t", "use_additional_t_cond", "use_layer3d_rope") if getattr(self, f)]
        if unsupported:
            raise ValueError(f"the Qwen-Image port does not implement {unsupported}; only the base model (all False)")
        super().__post_init__()

    @property
    def mlp_dim(self) -> int:
        return 4 * self.inner_dim

    @property
    def out_dim(self) -> int:
        return self.patch_size * self.patch_size * (self.out_channels or self.in_channels)


VARIANTS = {
    "qwen-image": QwenImageConfig(),
    # Structurally identical to the full model (2 blocks), for CPU tests.
    "tiny": QwenImageConfig(
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        in_channels=16,
        out_channels=4,
        joint_attention_dim=32,
        axes_dims_rope=(4, 6, 6),
        dtype="float32",
    ),
}


def _image_list(img_shapes) -> list:
    """The (frames, h, w) list diffusers' `QwenEmbedRope` uses: the first sample's, for all."""
    if img_shapes is None:
        raise ValueError("img_shapes is required: a per-sample list of (frames, h, w) tuples, e.g. [[(1, 32, 32)]] * B")
    shapes = img_shapes[0] if isinstance(img_shapes, list) else img_shapes
    if not isinstance(shapes, list):
        shapes = [shapes]
    for fhw in shapes:
        if not isinstance(fhw, (tuple, list)) or len(fhw) != 3:
            raise ValueError(f"img_shapes entries must be (frames, h, w) triples, got {fhw!r}")
    return shapes


def rope_position_ids(img_shapes, image_seq_len: int, text_seq_len: int) -> tuple[jax.Array, jax.Array]:
    """Integer (frame, row, col) ids of the image tokens (S_img, 3) and of the text tokens (S_txt, 3).

    The sizes in `img_shapes` may be traced scalars; the token counts are static.
    """
    shapes = _image_list(img_shapes)
    sizes = [f * h * w for f, h, w in shapes]
    if all(isinstance(v, (int, np.integer)) for fhw in shapes for v in fhw) and sum(sizes) != image_seq_len:
        raise ValueError(f"img_shapes {shapes} hold {sum(sizes)} image tokens but hidden_states has {image_seq_len}")
    token = jnp.arange(image_seq_len, dtype=jnp.int32)
    img_ids = jnp.zeros((image_seq_len, 3), jnp.int32)
    start, text_start = 0, 0
    for idx, (fhw, size) in enumerate(zip(shapes, sizes)):
        _, h, w = (jnp.asarray(v, jnp.int32) for v in fhw)
        local = token - start
        ids = jnp.stack([idx + local // (h * w), (local // w) % h - (h - h // 2), local % w - (w - w // 2)], axis=-1)
        img_ids = jnp.where(((local >= 0) & (local < size))[:, None], ids, img_ids)
        start = start + size
        text_start = jnp.maximum(text_start, jnp.maximum(h // 2, w // 2))
    txt_ids = jnp.broadcast_to((text_start + jnp.arange(text_seq_len, dtype=jnp.int32))[:, None], (text_seq_len, 3))
    return img_ids, txt_ids


class QwenImageAttention(nn.Module):
    """Joint attention over [image, text]: per-stream q/k/v and output projections,
    per-head RMS qk-norms, RoPE, text padding masked through key lengths."""

    cfg: QwenImageConfig

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
    def __call__(self, img, txt, cos, sin, kv_lengths):
        cfg = self.cfg
        q, k, v = self._qkv(img, "to_", "norm_q", "norm_k")
        tq, tk, tv = self._qkv(txt, "add_", "norm_added_q", "norm_added_k")
        q, k, v = (jnp.concatenate(pair, axis=1) for pair in ((q, tq), (k, tk), (v, tv)))
        q, k = rope.apply_rope(q, cos, sin), rope.apply_rope(k, cos, sin)
        out = attention.dot_product_attention(q, k, v, kv_lengths=kv_lengths, impl=cfg.attention_impl)
        out = out.reshape(*out.shape[:2], cfg.inner_dim)
        out = checkpoint_name(out, "attn_out")
        img_len = img.shape[1]
        img_out, txt_out = out[:, :img_len], out[:, img_len:]
        img_out = layers.logical_dense(cfg.inner_dim, ("heads", "embed"), name="to_out", **cfg.kw)(img_out)
        txt_out = layers.logical_dense(cfg.inner_dim, ("heads", "embed"), name="to_add_out", **cfg.kw)(txt_out)
        return img_out, txt_out


class QwenImageBlock(nn.Module):
    """Double-stream block: separate image/text weights, joint attention. Scanned; carry (img, txt)."""

    cfg: QwenImageConfig

    @nn.compact
    def __call__(self, carry, temb, cos, sin, kv_lengths):
        cfg = self.cfg
        img, txt = carry
        shift_a, scale_a, gate_a, shift_m, scale_m, gate_m = layers.Modulation(6, cfg.inner_dim, name="img_mod", **cfg.kw)(
            temb
        )
        t_shift_a, t_scale_a, t_gate_a, t_shift_m, t_scale_m, t_gate_m = layers.Modulation(
            6, cfg.inner_dim, name="txt_mod", **cfg.kw
        )(temb)
        img_attn, txt_attn = QwenImageAttention(cfg, name="attn")(
            layers.modulate(layers.layer_norm(img), shift_a, scale_a),
            layers.modulate(layers.layer_norm(txt), t_shift_a, t_scale_a),
            cos,
            sin,
            kv_lengths,
        )
        img = img + gate_a[:, None] * img_attn
        txt = txt + t_gate_a[:, None] * txt_attn
        img_mlp = layers.FeedForward(cfg.mlp_dim, cfg.inner_dim, name="img_mlp", **cfg.kw)(
            layers.modulate(layers.layer_norm(img), shift_m, scale_m)
        )
        img = partitioning.constrain(img + gate_m[:, None] * img_mlp, ACT)
        txt_mlp = layers.FeedForward(cfg.mlp_dim, cfg.inner_dim, name="txt_mlp", **cfg.kw)(
            layers.modulate(layers.layer_norm(txt), t_shift_m, t_scale_m)
        )
        txt = partitioning.constrain(txt + t_gate_m[:, None] * txt_mlp, ACT)
        return (img, txt), None


class QwenImageTimestepEmbedding(nn.Module):
    """temb = MLP(sinusoid(1000 sigma)); the 1000 scales the angles, after the frequencies."""

    cfg: QwenImageConfig

    @nn.compact
    def __call__(self, timestep):
        cfg = self.cfg
        freq = layers.timestep_sinusoid(timestep, 256, scale=1000.0)
        return layers.MLPEmbedder(cfg.inner_dim, name="timestep_embedder", **cfg.kw)(freq)


class QwenImageTransformer(nn.Module):
    """`QwenImageTransformer2DModel.forward` with the same keyword arguments (arrays for tensors).

    Args:
      hidden_states: (B, S_img, in_channels) packed latents.
      encoder_hidden_states: (B, S_txt, joint_attention_dim) Qwen2.5-VL states.
      encoder_hidden_states_mask: (B, S_txt), nonzero = valid, right-padded; None = all valid.
      timestep: (B,) sigma in [0, 1]; the sinusoid scales it by 1000, as in diffusers.
      img_shapes: the pipeline's per-sample list of (frames, h, w) tuples of the
        latent token grid, e.g. `[[(1, H/16, W/16)]] * B`; only the first sample's
        list is used (as in diffusers). Its integers may be traced.
      guidance, attention_kwargs, additional_t_cond: accepted for signature
        compatibility; must be None (the released model uses none of them).
    Returns:
      (B, S_img, patch^2 * out_channels) velocity in the compute dtype.
    """

    cfg: QwenImageConfig

    @nn.compact
    def __call__(
        self,
        hidden_states,
        encoder_hidden_states,
        encoder_hidden_states_mask=None,
        timestep=None,
        img_shapes=None,
        guidance=None,
        attention_kwargs=None,
        additional_t_cond=None,
    ):
        cfg = self.cfg
        _check_inputs(cfg, hidden_states, encoder_hidden_states, encoder_hidden_states_mask, timestep)
        for name, value in (
            ("guidance", guidance),
            ("attention_kwargs", attention_kwargs),
            ("additional_t_cond", additional_t_cond),
        ):
            if value is not None:
                raise ValueError(f"QwenImageTransformer2DModel port does not support {name}; pass None")
        dtype = cfg.kw["dtype"]
        img_len, txt_len = hidden_states.shape[1], encoder_hidden_states.shape[1]

        img = layers.logical_dense(cfg.inner_dim, ("cond", "embed"), name="img_in", **cfg.kw)(hidden_states.astype(dtype))
        txt = layers.RMSNorm(eps=1e-6, axis_name="cond", param_dtype=cfg.kw["param_dtype"], name="txt_norm")(
            encoder_hidden_states
        )
        txt = layers.logical_dense(cfg.inner_dim, ("cond", "embed"), name="txt_in", **cfg.kw)(txt.astype(dtype))
        img, txt = partitioning.constrain(img, ACT), partitioning.constrain(txt, ACT)
        temb = QwenImageTimestepEmbedding(cfg, name="time_text_embed")(timestep)

        img_ids, txt_ids = rope_position_ids(img_shapes, img_len, txt_len)
        cos, sin = rope.rope_tables(
            jnp.concatenate([img_ids, txt_ids], axis=0), cfg.axes_dims_rope, ROPE_THETA, float32_exponent=True
        )
        kv_lengths = None
        if encoder_hidden_states_mask is not None:
            kv_lengths = img_len + jnp.sum(encoder_hidden_states_mask != 0, axis=1, dtype=jnp.int32)

        if cfg.num_layers:
            blocks = stacking.scan_blocks(QwenImageBlock, cfg.num_layers, cfg.remat_policy, cfg.scan_layers)
            (img, txt), _ = blocks(cfg, name="transformer_blocks")((img, txt), temb, cos, sin, kv_lengths)

        scale, shift = layers.Modulation(2, cfg.inner_dim, name="norm_out", **cfg.kw)(temb)
        img = layers.modulate(layers.layer_norm(img), shift, scale)
        return layers.logical_dense(cfg.out_dim, ("embed", "cond"), name="proj_out", **cfg.kw)(img)


def _check_inputs(cfg, hidden_states, encoder_hidden_states, mask, timestep):
    """Shape errors at trace time, naming the argument, before any device work."""
    b = hidden_states.shape[0]
    expect = {
        "hidden_states": (hidden_states, cfg.in_channels),
        "encoder_hidden_states": (encoder_hidden_states, cfg.joint_attention_dim),
    }
    for name, (arr, last) in expect.items():
        if arr.ndim != 3 or arr.shape[-1] != last or arr.shape[0] != b:
            raise ValueError(f"{name} must have shape (B={b}, ..., {last}) with 3 dims, got {arr.shape}")
    if mask is not None and mask.shape != encoder_hidden_states.shape[:2]:
        raise ValueError(
            f"encoder_hidden_states_mask must have shape {encoder_hidden_states.shape[:2]} (B, S_txt), got {mask.shape}"
        )
    if timestep is None or timestep.shape != (b,):
        raise ValueError(f"timestep must have shape ({b},), got {None if timestep is None else timestep.shape}")


def example_inputs(cfg: QwenImageConfig, batch: int = 1, image_seq_len: int = 16, text_seq_len: int = 8) -> dict:
    """Inputs for `init`/`eval_shape` at the given sizes: ShapeDtypeStructs for the arrays,
    and `img_shapes` as the pipeline passes it (Python ints), on the most square grid."""
    f32 = jnp.float32
    spec = lambda *shape: jax.ShapeDtypeStruct(shape, f32)  # noqa: E731
    h = max(d for d in range(1, int(image_seq_len**0.5) + 1) if image_seq_len % d == 0)
    return dict(
        hidden_states=spec(batch, image_seq_len, cfg.in_channels),
        encoder_hidden_states=spec(batch, text_seq_len, cfg.joint_attention_dim),
        encoder_hidden_states_mask=spec(batch, text_seq_len),
        timestep=spec(batch),
        img_shapes=[[(1, h, image_seq_len // h)]] * batch,
    )


def weight_rules(cfg: QwenImageConfig) -> list[WeightRule]:
    """Every Flax parameter and the diffusers state-dict key it comes from.

    `{i}` in a key is the block index; those parameters are stacked on a leading axis.
    """
    rules: list[WeightRule] = []
    for lin in ("linear_1", "linear_2"):
        rules += linear_rules(("time_text_embed", "timestep_embedder", lin), f"time_text_embed.timestep_embedder.{lin}")
    rules.append(WeightRule(("txt_norm", "scale"), "txt_norm.weight"))
    for name in ("img_in", "txt_in", "proj_out"):
        rules += linear_rules((name,), name)
    rules += linear_rules(("norm_out", "linear"), "norm_out.linear")

    b, bk = ("transformer_blocks",), "transformer_blocks.{i}"
    for mod in ("img_mod", "txt_mod"):
        rules += linear_rules(b + (mod, "linear"), f"{bk}.{mod}.1")
    for flax_name, key_name in [
        ("to_q", "to_q"), ("to_k", "to_k"), ("to_v", "to_v"), ("to_out", "to_out.0"),
        ("add_q", "add_q_proj"), ("add_k", "add_k_proj"), ("add_v", "add_v_proj"), ("to_add_out", "to_add_out"),
    ]:
        rules += linear_rules(b + ("attn", flax_name), f"{bk}.attn.{key_name}")
    for norm in ("norm_q", "norm_k", "norm_added_q", "norm_added_k"):
        rules.append(WeightRule(b + ("attn", norm, "scale"), f"{bk}.attn.{norm}.weight"))
    for mlp in ("img_mlp", "txt_mlp"):
        rules += linear_rules(b + (mlp, "proj_in"), f"{bk}.{mlp}.net.0.proj")
        rules += linear_rules(b + (mlp, "proj_out"), f"{bk}.{mlp}.net.2")
    return rules


def denoiser_inputs(cfg: QwenImageConfig, *, guidance: float, image_grid: tuple[int, int] | None):
    """Qwen-Image as a denoiser (`ModelFamily.denoiser_inputs`): packed (B, S, C) tokens on the
    `image_grid` (rows, cols) grid, sigma as the timestep, the text mask; no embedded guidance
    (the model uses true CFG), so `guidance` is unused."""
    del cfg, guidance
    if image_grid is None:
        raise ValueError("a qwenimage denoiser needs image_grid, the (rows, cols) grid of packed tokens")

    def inputs(latents, cond, sigma):
        return dict(
            hidden_states=latents,
            encoder_hidden_states=cond.text,
            encoder_hidden_states_mask=cond.mask,
            timestep=sigma,
            img_shapes=[[(1, *image_grid)]] * latents.shape[0],
        )

    return inputs


FAMILY = ModelFamily(
    name="qwenimage",
    diffusers_class="QwenImageTransformer2DModel",
    config_cls=QwenImageConfig,
    module_cls=QwenImageTransformer,
    weight_rules=weight_rules,
    example_inputs=example_inputs,
    variants=VARIANTS,
    denoiser_inputs=denoiser_inputs,
)
