"""Layers shared by the diffusion transformers: LoRA- and FP8-aware dense layers, norms, AdaLN
modulation, timestep and conditioning embedders, the feed-forward and the video patch embedding.

Parameters carry logical axis names, listed with the activation constraints in
`partitioning.py`; rotary embeddings are in `rope.py`, attention in `attention.py` and block
stacks (scan, unroll, remat) in `stacking.py`.

Numerics: norms and timestep sinusoids run in float32 whatever the compute dtype, then cast
back (the same places the PyTorch reference upcasts).
"""
from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from digen_jax.models import fp8
from digen_jax.models.partitioning import constrain


class AdaptableDense(nn.Dense):
    """`nn.Dense` that adds a factored low-rank term when the `lora` collection has one for it.

    With variables `{"params": ..., "lora": adapters}` where this module's entry holds
    `lora_a` (in, rank) and `lora_b` (rank, out), it computes `x @ W + b + (x @ A) @ B`
    (the adapter scale is folded into `lora_b` by the caller). Never materialising
    `W + A @ B` is what keeps LoRA training cheap: the backward pass needs `dx` through
    the frozen `W` and the small adapter gradients, not a kernel-sized `dW`. Without a
    `lora` entry it is exactly `nn.Dense`; `init` creates no `lora` variables.

    Where the params hold an FP8 kernel in place of `kernel` (`fp8.quantize_params`), the base
    product `x @ W` runs in FP8 (`fp8.fp8_matmul`, float32 accumulation, cast to `dtype`);
    the bias and the adapters' term stay in `dtype`.
    """

    @nn.compact
    def __call__(self, inputs: jax.Array) -> jax.Array:
        out = self._fp8_base(inputs) if self.has_variable("params", fp8.QUANTIZED) else super().__call__(inputs)
        if not self.has_variable("lora", "lora_a"):
            return out
        a, b = self.get_variable("lora", "lora_a"), self.get_variable("lora", "lora_b")
        x, a, b = nn.dtypes.promote_dtype(inputs, a, b, dtype=self.dtype)
        down = jnp.dot(x, a, precision=self.precision)
        return out + jnp.dot(down, b, precision=self.precision).astype(out.dtype)

    def _fp8_base(self, inputs: jax.Array) -> jax.Array:
        dtype = self.dtype or inputs.dtype
        kernel, scale = self.get_variable("params", fp8.QUANTIZED), self.get_variable("params", fp8.SCALE)
        out = fp8.fp8_matmul(inputs.astype(dtype), kernel, scale, dtype).astype(dtype)
        if self.use_bias:
            out = out + self.get_variable("params", "bias").astype(dtype)
        return out


def logical_dense(
    features: int,
    axes: tuple[str, str],
    *,
    name: str,
    dtype: jnp.dtype,
    param_dtype: jnp.dtype,
    use_bias: bool = True,
    kernel_init: nn.initializers.Initializer = nn.initializers.xavier_uniform(),
) -> AdaptableDense:
    """A dense layer whose kernel and bias carry the logical axis names `axes` (in, out).

    It is an `AdaptableDense`: LoRA adapters passed in the `lora` collection are applied
    factored, without merging them into the kernel.
    """
    return AdaptableDense(
        features,
        use_bias=use_bias,
        dtype=dtype,
        param_dtype=param_dtype,
        kernel_init=nn.with_logical_partitioning(kernel_init, axes),
        bias_init=nn.with_logical_partitioning(nn.initializers.zeros_init(), (axes[1],)),
        name=name,
    )


class RMSNorm(nn.Module):
    """RMS norm over the last axis with a learned scale, computed in float32."""

    eps: float = 1e-6
    axis_name: str = "head_dim"
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = self.param(
            "scale",
            nn.with_logical_partitioning(nn.initializers.ones_init(), (self.axis_name,)),
            (x.shape[-1],),
            self.param_dtype,
        )
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.eps)
        return (x32 * scale.astype(jnp.float32)).astype(x.dtype)


def layer_norm(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """LayerNorm without affine parameters over the last axis, in float32."""
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
    return ((x32 - mean) * jax.lax.rsqrt(var + eps)).astype(x.dtype)


class GroupNorm(nn.Module):
    """`torch.nn.GroupNorm` (affine, biased variance) on channels-last input, in float32.

    Statistics run over every non-batch position and the channels of each group, so one
    module serves images (B, H, W, C) and videos (B, T, H, W, C).
    """

    num_groups: int
    eps: float = 1e-6
    axis_name: str = "vae_channels"
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        channels = x.shape[-1]
        ones, zeros = nn.initializers.ones_init(), nn.initializers.zeros_init()
        scale = self.param("scale", nn.with_logical_partitioning(ones, (self.axis_name,)), (channels,), self.param_dtype)
        bias = self.param("bias", nn.with_logical_partitioning(zeros, (self.axis_name,)), (channels,), self.param_dtype)
        grouped = x.astype(jnp.float32).reshape(*x.shape[:-1], self.num_groups, channels // self.num_groups)
        axes = tuple(range(1, x.ndim - 1)) + (x.ndim,)  # positions and the channels within a group
        mean = jnp.mean(grouped, axis=axes, keepdims=True)
        var = jnp.mean(jnp.square(grouped - mean), axis=axes, keepdims=True)
        normed = ((grouped - mean) * jax.lax.rsqrt(var + self.eps)).reshape(x.shape)
        return (normed * scale.astype(jnp.float32) + bias.astype(jnp.float32)).astype(x.dtype)


def modulate(x: jax.Array, shift: jax.Array, scale: jax.Array) -> jax.Array:
    """AdaLN modulation `x * (1 + scale) + shift` with per-sample (B, D) shift/scale."""
    return x * (1 + scale[:, None, :]) + shift[:, None, :]


class Modulation(nn.Module):
    """SiLU -> Dense(k * dim) -> k chunks: the AdaLN conditioning projection.

    The chunk order is the caller's business (FLUX double blocks: shift, scale, gate
    for attention then MLP; the final norm: scale, shift).
    """

    num_chunks: int
    dim: int
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, cond: jax.Array) -> list[jax.Array]:
        out = logical_dense(
            self.num_chunks * self.dim,
            ("embed", "modulation"),
            name="linear",
            dtype=self.dtype,
            param_dtype=self.param_dtype,
        )(nn.silu(cond.astype(self.dtype)))
        out = constrain(out, ("activation_batch",))
        return jnp.split(out, self.num_chunks, axis=-1)


def timestep_sinusoid(
    t: jax.Array,
    dim: int,
    *,
    flip_sin_to_cos: bool = True,
    downscale_freq_shift: float = 0.0,
    scale: float = 1.0,
    max_period: float = 10000.0,
) -> jax.Array:
    """Sinusoidal embedding of a (B,) vector of (possibly fractional) timesteps, float32.

    Frequencies `exp(-log(max_period) * k / (half - downscale_freq_shift))`; output
    [cos, sin] when `flip_sin_to_cos` else [sin, cos]; an odd `dim` is zero-padded.
    """
    half = dim // 2
    # float32 in the reference's order of operations: with timesteps up to 1000, one
    # ulp of difference in a frequency moves the angle by ~6e-5.
    exponent = np.float32(-math.log(max_period)) * np.arange(half, dtype=np.float32)
    freqs = jnp.exp(jnp.asarray(exponent / np.float32(half - downscale_freq_shift), jnp.float32))
    args = scale * (t.astype(jnp.float32)[:, None] * freqs[None, :])
    first, second = (jnp.cos(args), jnp.sin(args)) if flip_sin_to_cos else (jnp.sin(args), jnp.cos(args))
    emb = jnp.concatenate([first, second], axis=-1)
    if dim % 2:
        emb = jnp.pad(emb, ((0, 0), (0, 1)))
    return emb


class MLPEmbedder(nn.Module):
    """Dense -> SiLU -> Dense: embeds timesteps, guidance and pooled text vectors."""

    dim: int
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        x = constrain(logical_dense(self.dim, ("cond", "embed"), name="linear_1", **kw)(x.astype(self.dtype)), ("activation_batch",))
        return constrain(logical_dense(self.dim, ("embed", "embed"), name="linear_2", **kw)(nn.silu(x)), ("activation_batch",))


class FeedForward(nn.Module):
    """Dense -> activation -> Dense, the transformer feed-forward.

    `activation` is 'gelu_tanh' (every DiT MLP here) or 'silu' (HunyuanVideo's token refiner).
    """

    hidden_dim: int
    out_dim: int
    activation: str = "gelu_tanh"
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        h = logical_dense(self.hidden_dim, ("embed", "mlp"), name="proj_in", **kw)(x)
        if self.activation == "gelu_tanh":
            h = nn.gelu(h, approximate=True)
        elif self.activation == "silu":
            h = nn.silu(h)
        else:
            raise ValueError(f"FeedForward activation must be 'gelu_tanh' or 'silu', got {self.activation!r}")
        h = constrain(h, ("activation_batch", "activation_length", "activation_mlp"))
        return logical_dense(self.out_dim, ("mlp", "embed"), name="proj_out", **kw)(h)


class PatchEmbed3D(nn.Module):
    """Conv3d with kernel = stride = `patch` on (B, C, T, H, W), as patchify + one matmul.

    Returns (B, T'H'W', features) tokens in (t, h, w) order, like diffusers'
    `proj(x).flatten(2).transpose(1, 2)`. The kernel keeps the Flax conv layout
    (pt, ph, pw, C, features), so a PyTorch Conv3d weight converts with the 'conv'
    transform; the window axes are never sharded.
    """

    patch: tuple[int, int, int]
    features: int
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        b, c, t, h, w = x.shape
        pt, ph, pw = self.patch
        kernel = self.param(
            "kernel",
            nn.with_logical_partitioning(nn.initializers.xavier_uniform(), (None, None, None, "cond", "embed")),
            (pt, ph, pw, c, self.features),
            self.param_dtype,
        )
        bias = self.param(
            "bias", nn.with_logical_partitioning(nn.initializers.zeros_init(), ("embed",)), (self.features,), self.param_dtype
        )
        x = x.reshape(b, c, t // pt, pt, h // ph, ph, w // pw, pw)
        x = x.transpose(0, 2, 4, 6, 3, 5, 7, 1).reshape(b, -1, pt * ph * pw * c)  # (B, S, pt*ph*pw*C)
        out = jnp.dot(x.astype(self.dtype), kernel.reshape(-1, self.features).astype(self.dtype))
        return out + bias.astype(self.dtype)
