"""Reward registry: named reward factories, config validation and weighted combination.

Conventions every reward follows:
  * Input images: one (B, H, W, 3) array, either ``uint8`` in [0, 255] or floating point in
    [0, 1] (the decoder's output mapped from [-1, 1] by the caller); floats are clipped to [0, 1]
    and rounded to uint8 by :func:`to_uint8_images`, as the references do before PIL. numpy or
    jax arrays are accepted (rewards run on the host).
  * Output: a (B,) float32 numpy array, one scalar per image. Rewards do not filter NaN/inf:
    :func:`check_finite_rewards` gives the mask, and skipping or failing is the trainer's policy.
  * Registration: ``@register_reward(name)`` on a factory ``(**options) -> RewardFn``; the
    factory runs once (loading weights, opening connections), the returned function per batch.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Mapping, Protocol, Sequence

import jax.numpy as jnp
import numpy as np


class RewardFn(Protocol):
    """``fn(images (B, H, W, 3), prompts [B], metadata [B]) -> (B,) float32 numpy array``."""

    def __call__(
        self, images: np.ndarray, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]
    ) -> np.ndarray: ...


RewardFactory = Callable[..., RewardFn]
CombinedRewardFn = Callable[
    [np.ndarray, Sequence[str], Sequence[Mapping[str, Any]]],
    tuple[np.ndarray, dict[str, np.ndarray]],
]

_REGISTRY: dict[str, RewardFactory] = {}


def register_reward(name: str) -> Callable[[RewardFactory], RewardFactory]:
    """Decorator registering a reward factory under ``name`` (a name may be registered once)."""

    def decorate(factory: RewardFactory) -> RewardFactory:
        if name in _REGISTRY:
            raise ValueError(f"reward {name!r} is already registered")
        _REGISTRY[name] = factory
        return factory

    return decorate


def registered_rewards() -> list[str]:
    """Sorted names of all registered rewards."""
    return sorted(_REGISTRY)


def get_reward(name: str, **options: Any) -> RewardFn:
    """Build the reward registered as ``name`` (``options`` go to its factory)."""
    if name not in _REGISTRY:
        raise ValueError(
            f"unknown reward {name!r} in config key reward.weights; "
            f"registered: {registered_rewards()}"
        )
    return _REGISTRY[name](**options)


def validate_reward_config(weights: Mapping[str, float]) -> None:
    """Check a ``reward.weights`` mapping {name: weight} before any reward is built or run.

    Raises ValueError for an empty mapping, an unknown name (listing the registered ones) or a
    weight that is not a finite number. An assertion on `weighted_reward`'s argument, kept with
    the registry it reads; a run's config reaches it once, through `app.validation`.
    """
    if not weights:
        raise ValueError("config key reward.weights is empty: give at least one reward a weight")
    unknown = sorted(set(weights) - set(_REGISTRY))
    if unknown:
        raise ValueError(
            f"unknown reward {unknown[0]!r} in config key reward.weights; "
            f"registered: {registered_rewards()}"
        )
    for name, weight in weights.items():
        number = isinstance(weight, (int, float)) and not isinstance(weight, bool)
        if not number or not math.isfinite(weight):
            raise ValueError(
                f"reward.weights[{name!r}] must be a finite number, got {weight!r}"
            )


def weighted_reward(
    weights: Mapping[str, float],
    options: Mapping[str, Mapping[str, Any]] | None = None,
) -> CombinedRewardFn:
    """Combine rewards: ``total = sum_k w_k * r_k`` (Flow-GRPO's ``multi_score``).

    ``weights`` maps reward names to weights and is validated first; ``options`` optionally maps
    a name to its factory's keyword arguments. Returns ``fn(images, prompts, metadata) ->
    (total (B,), {name: r_k (B,)})`` with the unweighted per-reward arrays for logging (and for
    per-reward advantages, see ``digen_jax.rl.multi_reward_advantages``). float32 throughout.
    """
    validate_reward_config(weights)
    options = options or {}
    extra = sorted(set(options) - set(weights))
    if extra:
        raise ValueError(f"reward options given for {extra}, which are not in reward.weights")
    fns = {name: get_reward(name, **options.get(name, {})) for name in weights}

    def combined(
        images: np.ndarray, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]
    ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        batch = len(images)
        per_reward = {}
        for name, fn in fns.items():
            r = np.asarray(fn(images, prompts, metadata), dtype=np.float32)
            if r.shape != (batch,):
                raise ValueError(f"reward {name!r} returned shape {r.shape}, expected ({batch},)")
            per_reward[name] = r
        total = np.zeros((batch,), np.float32)
        for name, r in per_reward.items():
            total += np.float32(weights[name]) * r
        return total, per_reward

    return combined


def check_finite_rewards(rewards: np.ndarray) -> np.ndarray:
    """Boolean (B,) mask, True where the reward is finite (not NaN or +-inf)."""
    return np.isfinite(np.asarray(rewards))


def to_uint8_images(images: Any) -> np.ndarray:
    """(B, H, W, 3) uint8 numpy images from uint8 or [0, 1]-float input.

    Floats map as ``round(clip(x, 0, 1) * 255)`` (the references' ``(x * 255).round().clamp``);
    non-finite float pixels raise ValueError instead of becoming arbitrary bytes.
    """
    array = np.asarray(images)
    if array.ndim != 4 or array.shape[-1] != 3:
        raise ValueError(f"images must be (B, H, W, 3), got shape {array.shape}")
    if array.dtype == np.uint8:
        return array
    # jnp.issubdtype also recognises bfloat16 (an ml_dtypes type numpy does not call floating).
    if not jnp.issubdtype(array.dtype, jnp.floating):
        raise ValueError(f"images must be uint8 or float in [0, 1], got dtype {array.dtype}")
    array = array.astype(np.float32)
    if not np.isfinite(array).all():
        raise ValueError("images contain NaN or inf pixels")
    return np.round(np.clip(array, 0.0, 1.0) * 255.0).astype(np.uint8)
