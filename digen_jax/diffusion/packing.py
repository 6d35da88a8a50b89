"""2x2 latent packing for FLUX and Qwen-Image, and the FLUX image position ids.

The FLUX and Qwen-Image transformers consume the VAE latent as a token sequence: each 2x2 patch
of the (B, C, H, W) latent becomes one token of 4C channels, tokens in row-major (row, col)
order, and the channel index of latent channel c at patch offset (dy, dx) is ``c*4 + dy*2 + dx``.
Shape checks run at trace time (shapes are static), so every function is usable under ``jit``.
"""
from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp

from digen_jax.models.flux import transformer as flux

# FLUX and Qwen-Image VAEs downsample by 8; packing then needs even latent sides, hence 16 px.
VAE_SCALE_FACTOR = 8


def latent_size(
    height: int, width: int, vae_scale_factor: int = VAE_SCALE_FACTOR
) -> tuple[int, int]:
    """Latent (H', W') for an image of ``height`` x ``width`` pixels: ``(height / f, width / f)``.

    Raises:
        ValueError: if height or width is not a positive multiple of ``2 * vae_scale_factor``
            (16 for FLUX/Qwen). The diffusers pipelines silently round down instead; rounding
            here would make the decoded image differ in size from the requested one.
    """
    multiple = 2 * vae_scale_factor
    for name, value in (("height", height), ("width", width)):
        if (
            isinstance(value, bool)
            or not isinstance(value, numbers.Integral)
            or value <= 0
            or value % multiple
        ):
            raise ValueError(
                f"{name} must be a positive multiple of {multiple} (vae_scale_factor "
                f"{vae_scale_factor} x 2x2 packing), got {value!r}"
            )
    return int(height) // vae_scale_factor, int(width) // vae_scale_factor


def packed_seq_len(height: int, width: int, vae_scale_factor: int = VAE_SCALE_FACTOR) -> int:
    """Number of packed image tokens, ``(height // 16) * (width // 16)`` for factor 8.

    This is the ``image_seq_len`` the FLUX / Qwen-Image pipelines feed to ``calculate_shift``.
    """
    latent_h, latent_w = latent_size(height, width, vae_scale_factor)
    return (latent_h // 2) * (latent_w // 2)


def _check_even(latent_h: int, latent_w: int) -> None:
    if latent_h % 2 or latent_w % 2 or latent_h <= 0 or latent_w <= 0:
        raise ValueError(
            f"2x2 packing needs positive even latent height and width, got {latent_h}x{latent_w}"
        )


def pack_latents(latents: jax.Array) -> jax.Array:
    """Pack (B, C, H, W) latents into (B, H/2 * W/2, 4C) tokens.

    ``out[b, i * (W/2) + j, c*4 + dy*2 + dx] = latents[b, c, 2i + dy, 2j + dx]``; dtype kept.
    Same layout as diffusers ``FluxPipeline._pack_latents`` / ``QwenImagePipeline._pack_latents``
    (for Qwen-Image drop its singleton frame axis first).
    """
    if latents.ndim != 4:
        raise ValueError(f"expected (B, C, H, W) latents, got shape {latents.shape}")
    b, c, h, w = latents.shape
    _check_even(h, w)
    x = latents.reshape(b, c, h // 2, 2, w // 2, 2)
    x = x.transpose(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_latents(tokens: jax.Array, latent_h: int, latent_w: int) -> jax.Array:
    """Exact inverse of :func:`pack_latents`: (B, H/2 * W/2, 4C) tokens -> (B, C, H, W).

    ``latent_h``/``latent_w`` are the unpacked latent sides (H, W), e.g. from
    :func:`latent_size`. Qwen-Image's VAE wants (B, C, 1, H, W): add the axis with
    ``out[:, :, None]``.
    """
    if tokens.ndim != 3:
        raise ValueError(f"expected (B, tokens, channels) input, got shape {tokens.shape}")
    _check_even(latent_h, latent_w)
    b, n, c4 = tokens.shape
    if n != (latent_h // 2) * (latent_w // 2) or c4 % 4:
        raise ValueError(
            f"tokens of shape {tokens.shape} do not unpack to a {latent_h}x{latent_w} latent "
            f"(need {(latent_h // 2) * (latent_w // 2)} tokens and channels divisible by 4)"
        )
    x = tokens.reshape(b, latent_h // 2, latent_w // 2, c4 // 4, 2, 2)
    x = x.transpose(0, 3, 1, 4, 2, 5)
    return x.reshape(b, c4 // 4, latent_h, latent_w)


def flux_image_ids(latent_h: int, latent_w: int, dtype: jnp.dtype = jnp.float32) -> jax.Array:
    """FLUX rotary position ids of the packed image tokens, shape (H/2 * W/2, 3).

    Row ``i * (W/2) + j`` is ``[0, i, j]``: axis 0 is unused for images, axes 1/2 are the token's
    row and column on the packed grid, in token order (as ``FluxPipeline._prepare_latent_image_ids``
    builds them from the halved latent size). ``latent_h``/``latent_w`` are unpacked latent sides;
    the ids are ``models.flux.image_ids`` of the packed grid.
    """
    _check_even(latent_h, latent_w)
    return flux.image_ids(latent_h // 2, latent_w // 2, dtype)
