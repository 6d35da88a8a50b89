"""JPEG-size rewards (Flow-GRPO ``jpeg_incompressibility`` / ``jpeg_compressibility``).

The size of an image saved by PIL as JPEG at quality 95 (PIL's other defaults, e.g. 4:2:0
chroma subsampling) measures how much detail it carries: flat images compress to a few hundred
bytes, noise to tens of kB. Values depend on the installed libjpeg, so compare them within one
environment.
"""
from __future__ import annotations

import io
from typing import Any, Mapping, Sequence

import numpy as np
from PIL import Image

from digen_jax.rewards.registry import RewardFn, register_reward, to_uint8_images

JPEG_QUALITY = 95


def jpeg_size_kb(images: Any, *, quality: int = JPEG_QUALITY) -> np.ndarray:
    """(B,) float32 JPEG sizes in kB (bytes / 1000) of (B, H, W, 3) uint8 or [0, 1]-float images."""
    sizes = []
    for image in to_uint8_images(images):
        buffer = io.BytesIO()
        Image.fromarray(image).save(buffer, format="JPEG", quality=quality)
        sizes.append(buffer.tell() / 1000.0)
    return np.asarray(sizes, dtype=np.float32)


@register_reward("jpeg_incompressibility")
def jpeg_incompressibility() -> RewardFn:
    """Reward = JPEG size in kB: larger for images that compress worse (more detail or noise)."""

    def reward(
        images: Any, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]
    ) -> np.ndarray:
        return jpeg_size_kb(images)

    return reward


@register_reward("jpeg_compressibility")
def jpeg_compressibility() -> RewardFn:
    """Reward = -(JPEG size in kB) / 500: higher for images that compress better."""

    def reward(
        images: Any, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]
    ) -> np.ndarray:
        return -jpeg_size_kb(images) / np.float32(500.0)

    return reward
