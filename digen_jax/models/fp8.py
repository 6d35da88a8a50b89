"""FP8 (e4m3) matmuls for the transformers' linear layers: the rollout role's numerics when
`model.rollout_precision='fp8'`, and training's too when `model.lora_base_precision='fp8'`
(LoRA trained through the one frozen FP8 base the rollouts sample with).

Weights: a kernel W (in, out) is stored as float8_e4m3fn with one float32 scale per output
channel, `s_w[o] = max_i |W[i, o]| / 448` and `W_q = e4m3(W / s_w)` (448 is e4m3's largest
finite value, so every column uses the format's whole range and none saturates).

Activations are quantised dynamically, one scale per token (a row of the input over its
features): `s_x[t] = max_j |x[t, j]| / 448`, `x_q = e4m3(x / s_x)`. Per token rather than per
tensor because a per-tensor scale is a maximum over the whole batch: a sample's velocity would
then depend on the other samples it is batched with (its CFG partner, its micro-batch, how the
batch is sharded), and a trajectory would stop being a function of its own key alone
(rl/rollout.py). Per token also follows the per-sample magnitudes AdaLN modulation gives the
activations.

Product: `y[t, o] = (x_q @ W_q)[t, o] * s_x[t] * s_w[o]`, the dot of the f8 operands converted
to the compute dtype with float32 accumulation; a row-times-column scaling commutes with the
contraction, so both scales apply to the dot's output, in float32, before the cast to the
compute dtype and the bias add. On GPU, XLA's GEMM rewriter turns `dot(convert(f8),
convert(f8))` into a cuBLASLt FP8 GEMM with unit operand scales (cuBLASLt on Hopper takes
scalar operand scales only; per-row and per-column ones are an elementwise epilogue, fused with
the bias add). On CPU, XLA computes the converted operands in the compute dtype: the path runs
anywhere, at no speed advantage.

Which layers: the kernels whose logical axes (models/partitioning.py) are in `QUANTIZED_AXES`, the
attention projections and MLPs of the blocks, which carry nearly all of a forward's FLOPs. The
input embedders, the output projection, the AdaLN modulation and the timestep/text embedders
stay in the compute dtype, as do norms, attention itself and the sampler's step math.
`rl/quantized_params.py` picks and quantises them in a parameter tree.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

E4M3 = jnp.float8_e4m3fn
E4M3_MAX = 448.0
# Floor of a row's or column's max |value| before it becomes a scale: an all-zero row quantises
# to zeros instead of 0/0.
AMAX_FLOOR = 1e-12
# Values of `model.rollout_precision`: the model's dtype throughout, or FP8 block matmuls.
ROLLOUT_PRECISIONS = ("bf16", "fp8")
# Parameter names of a quantised dense layer, in place of its `kernel`.
QUANTIZED = "kernel_fp8"
SCALE = "kernel_scale"
QUANTIZED_AXES = frozenset({("embed", "heads"), ("heads", "embed"), ("embed", "mlp"), ("mlp", "embed"),
                            ("attn_mlp", "embed")})


def check_rollout_precision(precision: str) -> str:
    """`precision` if it is one of `ROLLOUT_PRECISIONS`; a ValueError naming the key otherwise."""
    if precision not in ROLLOUT_PRECISIONS:
        raise ValueError(f"model.rollout_precision must be one of {ROLLOUT_PRECISIONS}, got {precision!r}")
    return precision


def quantize_weight(kernel: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(W_q float8_e4m3fn shaped like `kernel`, s_w float32 (..., out)) of an (..., in, out) kernel
    (a leading layers axis of scanned blocks is carried through)."""
    w = kernel.astype(jnp.float32)
    scale = jnp.maximum(jnp.max(jnp.abs(w), axis=-2), AMAX_FLOOR) / E4M3_MAX
    return _to_e4m3(w / scale[..., None, :]), scale


def quantize_activation(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(x_q float8_e4m3fn shaped like `x`, s_x float32 (..., 1)): one scale per row of the last axis.

    The row maximum is taken in `x`'s own dtype (exact) and the row multiplied by the scale's
    reciprocal: |x| * (1 / s_x) exceeds 448 by a few float32 ulps at most, which e4m3's
    round-to-nearest brings back to 448 (only 464 and beyond become NaN), so no clip is needed.
    One read of `x` fewer than a float32 upcast and division, so faster (docs/fp8_rollouts.md,
    Speed)."""
    amax = jnp.max(jnp.abs(x), axis=-1, keepdims=True).astype(jnp.float32)
    scale = jnp.maximum(amax, AMAX_FLOOR) / E4M3_MAX
    return (x.astype(jnp.float32) * (1.0 / scale)).astype(E4M3), scale


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def fp8_matmul(x: jax.Array, w_q: jax.Array, w_scale: jax.Array, compute_dtype: jnp.dtype) -> jax.Array:
    """`x @ W` in FP8, float32 (..., out): x quantised per row, times the quantised kernel
    `w_q` (in, out) with its per-column scales `w_scale` (out,).

    The product leaves the GEMM in `compute_dtype` (accumulated in float32 inside it): in bf16
    the scaling pass after it reads half the bytes of a float32 product, and the rounding it adds
    (2^-9) is far below e4m3's own (2^-4).

    Differentiable in `x` only, the kernel being a frozen base (`model.lora_base_precision='fp8'`
    trains LoRA adapters through it): the activations' rounding passes the gradient straight
    through, `dx = (g * s_w) @ W_q^T` in `compute_dtype`, the gradient of `x @ (W_q * s_w)`, the
    dequantised kernel the forward multiplies by."""
    return _fp8_product(x, w_q, w_scale, compute_dtype)


def _fp8_product(x, w_q, w_scale, compute_dtype):
    x_q, x_scale = quantize_activation(x)
    acc = jax.lax.dot_general(x_q.astype(compute_dtype), w_q.astype(compute_dtype),
                              (((x.ndim - 1,), (0,)), ((), ())), preferred_element_type=compute_dtype)
    return acc.astype(jnp.float32) * x_scale * w_scale


def _fp8_matmul_fwd(x, w_q, w_scale, compute_dtype):
    return _fp8_product(x, w_q, w_scale, compute_dtype), (w_q, w_scale, jnp.zeros((0,), x.dtype))


def _fp8_matmul_bwd(compute_dtype, residuals, g):
    w_q, w_scale, x_like = residuals
    scaled = (g * w_scale).astype(compute_dtype)
    dx = jax.lax.dot_general(scaled, w_q.astype(compute_dtype), (((g.ndim - 1,), (1,)), ((), ())),
                             preferred_element_type=compute_dtype)
    return dx.astype(x_like.dtype), jnp.zeros_like(w_q), jnp.zeros_like(w_scale)


fp8_matmul.defvjp(_fp8_matmul_fwd, _fp8_matmul_bwd)


def _to_e4m3(v: jax.Array) -> jax.Array:
    # e4m3fn has no infinity: a value past the largest finite one would convert to NaN.
    return jnp.clip(v, -E4M3_MAX, E4M3_MAX).astype(E4M3)
