"""The programmatic GenEval-like reward of the coloured-shapes task (`digen_jax.data.shapes_task`).

Three attribute scores in [0, 1], computed from a soft foreground map: a pixel's foreground
weight ramps linearly from 0 to 1 as its brightest channel goes from 0.25 to 0.75 (in [0, 1]
pixel units), so a black background weighs nothing and a full-intensity shape weighs 1.

* colour: the foreground-weighted mean over pixels of ``clip(1 - d / 0.75, 0, 1)``, d the
  distance between the pixel's chroma (RGB divided by its brightest channel, so dim edges keep
  their colour) and the named colour's RGB. Distinct palette colours are >= 1 apart: score 0.
* position: the fraction of the foreground weight inside the named quadrant.
* shape: the best soft IoU, over every pixel placement, between the foreground map and the named
  shape's mask, counted inside the mask's box plus a 1-px margin (ink just outside the shape
  lowers it). Mapped ``clip((IoU - 0.5) / 0.5, 0, 1)``: a drawn shape has IoU 1 with its own
  mask and 0.56 with the other shape's (score 0.11).

The reward is ``0.5 * mean(scores) + 0.5 * prod(scores)``: GenEval-style partial credit plus an
equal weight on getting every attribute right at once, so one wrong attribute costs more than a
third. Clean renders score 1; a wrong colour or quadrant about 1/3; noise and black images < 0.2.
"""
from __future__ import annotations

import functools
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from digen_jax.data.shapes_task import COLOR_RGB, COLORS, POSITIONS, SHAPE_SIZE, SHAPES, shape_mask
from digen_jax.rewards.registry import RewardFn, register_reward, to_uint8_images

FOREGROUND_LOW, FOREGROUND_HIGH = 0.25, 0.75
COLOR_TOLERANCE = 0.75
IOU_FLOOR = 0.5
_EPS = 1e-6


@functools.cache  # built on first use: importing must not start JAX (multi-process runs initialise first)
def _templates() -> np.ndarray:
    """(len(SHAPES) + 1, S + 2, S + 2) float32: each shape's mask with a 1-px margin, then the window."""
    local = np.arange(SHAPE_SIZE + 2) - 1
    y, x = local[:, None], local[None, :]
    with jax.ensure_compile_time_eval():  # the first use may be inside a jitted reward
        masks = [np.asarray(shape_mask(k, y, x), np.float32) for k in range(len(SHAPES))]
    return np.stack(masks + [np.ones((SHAPE_SIZE + 2, SHAPE_SIZE + 2), np.float32)])


def _best_iou(foreground: jax.Array) -> jax.Array:
    """(B, len(SHAPES)): per shape, the max soft IoU of its mask with ``foreground`` over placements."""
    # Correlate with [mask_0, mask_1, window]; padding 1 lets the margin hang off the image.
    sums = jax.lax.conv_general_dilated(
        foreground[:, None], jnp.asarray(_templates())[:, None], (1, 1), ((1, 1), (1, 1)),
        precision=jax.lax.Precision.HIGHEST,
    )
    inter, window = sums[:, : len(SHAPES)], sums[:, len(SHAPES) :]
    area = jnp.asarray(_templates()[: len(SHAPES)].sum(axis=(1, 2)))[None, :, None, None]
    # Binary mask T, weights w in [0, 1]: sum min(w, T) = inter, sum max(w, T) = |T| + ink off T.
    iou = inter / (area + window - inter)
    return jnp.max(iou, axis=(2, 3))


@jax.jit
def attribute_scores(images: jax.Array, ids: jax.Array) -> jax.Array:
    """(B, 3) float32 (colour, shape, position) scores in [0, 1] (module docstring).

    Args:
      images: (B, 3, H, W) in [-1, 1] (the model's pixel space; values outside are clipped).
      ids: (B, 3) int attribute ids (colour, shape, position) of the prompts.
    """
    ids = jnp.asarray(ids, jnp.int32)
    rgb = jnp.clip((images.astype(jnp.float32) + 1.0) / 2.0, 0.0, 1.0)
    ink = jnp.max(rgb, axis=1)  # (B, H, W)
    weight = jnp.clip((ink - FOREGROUND_LOW) / (FOREGROUND_HIGH - FOREGROUND_LOW), 0.0, 1.0)
    total = jnp.sum(weight, axis=(1, 2))

    chroma = rgb / jnp.maximum(ink, _EPS)[:, None]
    target = jnp.asarray(COLOR_RGB)[ids[:, 0]][:, :, None, None]
    dist = jnp.sqrt(jnp.sum(jnp.square(chroma - target), axis=1))
    pixel_color = jnp.clip(1.0 - dist / COLOR_TOLERANCE, 0.0, 1.0)
    color = jnp.sum(weight * pixel_color, axis=(1, 2)) / (total + _EPS)

    h, w = ink.shape[1:]
    rows = (jnp.arange(h) >= h // 2)[None, :, None]
    cols = (jnp.arange(w) >= w // 2)[None, None, :]
    pos = ids[:, 2, None, None]
    in_quadrant = (rows == (pos // 2 == 1)) & (cols == (pos % 2 == 1))
    position = jnp.sum(weight * in_quadrant, axis=(1, 2)) / (total + _EPS)

    iou = jnp.take_along_axis(_best_iou(weight), ids[:, 1:2], axis=1)[:, 0]
    shape = jnp.clip((iou - IOU_FLOOR) / (1.0 - IOU_FLOOR), 0.0, 1.0)
    return jnp.stack([color, shape, position], axis=1)


@jax.jit
def shapes_reward_jax(images: jax.Array, ids: jax.Array) -> jax.Array:
    """(B,) float32 reward in [0, 1]: ``0.5 * mean + 0.5 * product`` of :func:`attribute_scores`."""
    scores = attribute_scores(images, ids)
    return 0.5 * jnp.mean(scores, axis=1) + 0.5 * jnp.prod(scores, axis=1)


def metadata_ids(metadata: Sequence[Mapping[str, Any]]) -> np.ndarray:
    """(B, 3) int32 attribute ids from per-prompt {'color', 'shape', 'position'} names."""
    try:
        return np.asarray(
            [[COLORS.index(m["color"]), SHAPES.index(m["shape"]), POSITIONS.index(m["position"])] for m in metadata],
            np.int32,
        ).reshape(-1, 3)
    except (KeyError, ValueError) as e:
        raise ValueError(
            f"shapes reward needs metadata with 'color' in {COLORS}, 'shape' in {SHAPES}, "
            f"'position' in {POSITIONS}: {e}"
        ) from e


def shapes_reward(images: Any, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]) -> np.ndarray:
    """(B,) float32 reward of (B, H, W, 3) uint8 or [0, 1]-float images (registry conventions).

    The attributes come from ``metadata`` (``ShapesTask.prompt_metadata``); ``prompts`` are not
    parsed. Pixels are quantised to uint8 first, like every registry reward.
    """
    del prompts
    pixels = to_uint8_images(images)
    ids = metadata_ids(metadata)
    if len(ids) != len(pixels):
        raise ValueError(f"got {len(pixels)} images but {len(ids)} metadata entries")
    signed = pixels.transpose(0, 3, 1, 2).astype(np.float32) / 127.5 - 1.0
    return np.asarray(shapes_reward_jax(signed, ids), np.float32)


@register_reward("shapes")
def shapes() -> RewardFn:
    """The coloured-shapes reward (:func:`shapes_reward`); needs ``ShapesTask.prompt_metadata``."""
    return shapes_reward
