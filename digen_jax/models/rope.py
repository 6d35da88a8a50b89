"""Rotary position embeddings (RoPE) over several position axes: per-axis frequencies, the
(cos, sin) tables of a set of position ids, and the rotation of interleaved channel pairs.

Numerics: the frequencies are computed on the host in each reference's precision
(`rope_frequencies`); the tables and the rotation run in float32 whatever the compute dtype,
and the rotated values are cast back (the same places the PyTorch reference upcasts).
"""
from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np


def rope_frequencies(axes_dims: Sequence[int], theta: float, *, float32_exponent: bool = False) -> list[np.ndarray]:
    """Per-axis inverse frequencies `theta^(-2k/d)`, computed on the host.

    FLUX's reference builds them in float64. Qwen-Image's computes the exponent 2k/d and
    the reciprocal in float32 (`float32_exponent=True` reproduces it bit for bit): a few
    ulp apart, which shows at text positions in the thousands.
    """
    out = []
    for d in axes_dims:
        if d % 2:
            raise ValueError(f"every RoPE axis dim must be even, got axes_dims={tuple(axes_dims)}")
        if float32_exponent:
            exponent = np.arange(0, d, 2).astype(np.float32) / np.float32(d)
            out.append(np.float32(1.0) / (np.float64(theta) ** exponent.astype(np.float64)).astype(np.float32))
        else:
            out.append(1.0 / theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
    return out


def rope_tables(
    ids: jax.Array, axes_dims: Sequence[int], theta: float, *, float32_exponent: bool = False
) -> tuple[jax.Array, jax.Array]:
    """RoPE (cos, sin) tables of shape (S, sum(axes_dims)) for (S, n_axes) position ids.

    Each axis i rotates `axes_dims[i]` channels; pairs are interleaved, so every
    frequency is repeated twice along the channel axis. Float32 throughout.
    """
    if ids.shape[-1] != len(axes_dims):
        raise ValueError(f"position ids have {ids.shape[-1]} axes but axes_dims has {len(axes_dims)}")
    pos = ids.astype(jnp.float32)
    angles = [
        pos[:, i : i + 1] * jnp.asarray(np.repeat(f, 2), jnp.float32)[None, :]
        for i, f in enumerate(rope_frequencies(axes_dims, theta, float32_exponent=float32_exponent))
    ]
    angles = jnp.concatenate(angles, axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate interleaved channel pairs of x (B, S, N, H) by (S, H) tables, in float32."""
    x32 = x.astype(jnp.float32)
    pairs = x32.reshape(*x.shape[:-1], -1, 2)
    rotated = jnp.stack([-pairs[..., 1], pairs[..., 0]], axis=-1).reshape(x.shape)
    out = x32 * cos[None, :, None, :] + rotated * sin[None, :, None, :]
    return out.astype(x.dtype)
