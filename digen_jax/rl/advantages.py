"""Group-relative advantages (GRPO): rewards normalised within each prompt's group.

A group is one prompt sampled ``G`` times. Every function here takes the flat (N,) rewards of a
batch together with an (N,) integer ``group_ids`` array in ``[0, num_groups)`` naming each
sample's group, in any order (samples of one group need not be contiguous). ``num_groups`` is a
static Python int, so the functions jit with ``static_argnames=("num_groups", ...)``; the
per-group sums are ``jax.ops.segment_sum`` reductions. All math is float32.

Reference settings (docs/algorithms.md A5, A8, A9):

| recipe                         | ``mean_mode`` | ``std_mode``                               | ddof | eps  |
|--------------------------------|---------------|--------------------------------------------|------|------|
| Flow-GRPO (per-prompt tracker) | ``"group"``   | ``"global"`` (most configs) or ``"group"`` | 0    | 1e-4 |
| Flow-GRPO (no tracker)         | ``"global"``  | ``"global"``                               | 0    | 1e-4 |
| DanceGRPO                      | ``"group"``   | ``"group"``                                | 1    | 1e-8 |
| DanceGRPO ``use_group=False``  | ``"global"``  | ``"global"``                               | 1    | 1e-8 |
| MixGRPO                        | ``"group"``   | ``"group"``, per reward, then summed       | 1    | 1e-8 |

Flow-GRPO's tracker computes in float64 numpy; float32 here agrees to float32 rounding.
"""
from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp

StdMode = Literal["group", "global"]
MeanMode = Literal["group", "global"]
RewardMix = Literal["advantage", "reward"]


@dataclasses.dataclass(frozen=True)
class AdvantageSettings:
    """How rewards are normalised into advantages (`group_advantages`' keyword arguments)."""

    mean_mode: MeanMode
    std_mode: StdMode
    eps: float
    ddof: int


def group_statistics(
    rewards: jax.Array,
    group_ids: jax.Array,
    num_groups: int,
    *,
    ddof: int = 0,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per-group (mean, std, count), each (num_groups,) float32.

    ``mean_g = sum_{i in g} r_i / n_g`` and ``std_g = sqrt(sum_{i in g} (r_i - mean_g)^2 /
    (n_g - ddof))`` (two-pass, so groups with a large common offset keep their precision).
    A group with ``n_g <= ddof`` (e.g. one sample with ``ddof=1``, where torch.std returns NaN)
    or whose rewards are all equal gets std exactly 0; an empty group gets mean 0 and std 0.
    """
    rewards, group_ids = _check_flat(rewards, group_ids)
    mean, _, std, count = _moments(rewards, group_ids, num_groups, ddof)
    return mean, std, count


def group_advantages(
    rewards: jax.Array,
    group_ids: jax.Array,
    num_groups: int,
    *,
    std_mode: StdMode = "group",
    eps: float = 1e-4,
    ddof: int = 0,
    mean_mode: MeanMode = "group",
) -> jax.Array:
    """GRPO advantages ``A_i = (r_i - mean) / (std + eps)``, shape (N,) float32.

    ``mean`` is the mean of sample i's own group (``mean_mode="group"``) or of all N rewards
    (``mean_mode="global"``: Flow-GRPO without its per-prompt tracker, DanceGRPO's
    ``use_group=False``). ``std`` is the std of sample i's own group (``std_mode="group"``) or
    of all N rewards (``std_mode="global"``, Flow-GRPO's ``global_std``), both with ``ddof``.
    A global mean needs the global std (:func:`validate_advantage_modes`): a group's std
    measures spread about its own mean, not about the batch's.

    Degenerate groups never give NaN, even with ``eps=0``: where the std is exactly 0 (a group
    of one, a group with ``n_g <= ddof``, all N rewards equal) the advantage is 0, and a group
    whose rewards are all equal yields exact zeros with a group mean (a trainer can count or
    drop them). NaN rewards propagate to their group (to every sample with a global mean);
    the NaN policy belongs to the trainer.
    """
    validate_advantage_modes(mean_mode, std_mode)
    if eps < 0 or ddof < 0:
        raise ValueError(f"eps and ddof must be >= 0, got eps={eps}, ddof={ddof}")
    rewards, group_ids = _check_flat(rewards, group_ids)
    _, deviation, group_std, _ = _moments(rewards, group_ids, num_groups, ddof)
    if mean_mode == "global":
        # The whole batch as one group: the same two-pass moments and exact-zero centring.
        deviation = _moments(rewards, jnp.zeros_like(group_ids), 1, ddof)[1]
    if std_mode == "group":
        std = group_std[group_ids]
    else:
        n = rewards.shape[0]
        if n > ddof:
            centred = rewards - jnp.mean(rewards)
            std = jnp.sqrt(jnp.sum(jnp.square(centred)) / (n - ddof))
        else:
            std = jnp.zeros((), jnp.float32)
        std = jnp.broadcast_to(std, rewards.shape)
    # Double where: the masked branch divides by 1, so eps=0 with std=0 cannot produce 0/0.
    is_zero = std == 0
    denom = jnp.where(is_zero, 1.0, std + eps)
    return jnp.where(is_zero, 0.0, deviation / denom)


def validate_advantage_modes(mean_mode: str, std_mode: str) -> None:
    """Raise ValueError unless (``rl.mean_mode``, ``rl.std_mode``) is a supported pair.

    Each is 'group' or 'global'; a global mean goes with the global std only (the recipes that
    centre on the batch mean also scale by the batch std). An assertion on `group_advantages`'
    arguments (a library call); a run's config reaches it once, through `app.validation`.
    """
    for key, value in (("mean_mode", mean_mode), ("std_mode", std_mode)):
        if value not in ("group", "global"):
            raise ValueError(f"rl.{key} must be 'group' or 'global', got {value!r}")
    if mean_mode == "global" and std_mode != "global":
        raise ValueError(
            "rl.mean_mode='global' needs rl.std_mode='global': a group's std measures the spread "
            "about the group's mean, not about the batch mean the advantages are centred on"
        )


def clip_advantages(advantages: jax.Array, limit: float) -> jax.Array:
    """``clip(A, -limit, limit)``; Flow-GRPO and DanceGRPO use ``limit = 5`` (``adv_clip_max``)."""
    if limit <= 0:
        raise ValueError(f"advantage clip limit must be > 0, got {limit}")
    return jnp.clip(jnp.asarray(advantages, jnp.float32), -limit, limit)


def validate_reward_mix(mix: str) -> None:
    """Raise ValueError unless ``mix`` (config key ``reward.mix``) is 'reward' or 'advantage'. An
    assertion on `multi_reward_advantages`' argument; a run's config reaches it once, through
    `app.validation`."""
    if mix not in ("reward", "advantage"):
        raise ValueError(
            f"reward.mix must be 'reward' (weighted sum of the rewards, then group normalisation) or "
            f"'advantage' (each reward normalised within its groups, then the weighted sum), got {mix!r}"
        )


def multi_reward_advantages(
    rewards: jax.Array,
    weights: jax.Array,
    group_ids: jax.Array,
    num_groups: int,
    *,
    mix: RewardMix = "advantage",
    std_mode: StdMode = "group",
    eps: float = 1e-4,
    ddof: int = 0,
    mean_mode: MeanMode = "group",
) -> jax.Array:
    """Advantages from K reward signals ``rewards`` (K, N) with ``weights`` (K,); returns (N,).

    * ``mix="advantage"`` (MixGRPO ``advantage_aggr``): ``A = sum_k w_k * adv(r_k)``, each reward
      normalised within its groups on its own scale before the weighted sum.
    * ``mix="reward"`` (Flow-GRPO, MixGRPO ``reward_aggr``): ``A = adv(sum_k w_k * r_k)``.

    ``adv`` is :func:`group_advantages` with the given ``mean_mode``, ``std_mode``, ``eps`` and
    ``ddof``. MixGRPO itself uses ``ddof=1, eps=1e-8`` and weights divided by their sum; pass
    them so for parity.
    """
    rewards = jnp.asarray(rewards, jnp.float32)
    weights = jnp.asarray(weights, jnp.float32)
    if rewards.ndim != 2 or weights.shape != (rewards.shape[0],):
        raise ValueError(
            f"rewards must be (K, N) and weights (K,), got {rewards.shape} and {weights.shape}"
        )
    validate_reward_mix(mix)
    kwargs = dict(std_mode=std_mode, eps=eps, ddof=ddof, mean_mode=mean_mode)
    # Elementwise weighted sums rather than a matmul: exact float32 on every backend (a GPU
    # float32 dot may run in TF32 at default precision).
    if mix == "reward":
        total = jnp.sum(weights[:, None] * rewards, axis=0)
        return group_advantages(total, group_ids, num_groups, **kwargs)
    per_reward = jax.vmap(lambda r: group_advantages(r, group_ids, num_groups, **kwargs))(rewards)
    return jnp.sum(weights[:, None] * per_reward, axis=0)


def _moments(
    rewards: jax.Array, group_ids: jax.Array, num_groups: int, ddof: int
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """(group mean (G,), r_i - mean_{g(i)} (N,), group std (G,), group count (G,)).

    ``sum / count`` can miss a group's common value by an ulp, which a small eps would then
    amplify into a spurious advantage; groups whose max equals their min are therefore centred
    to exact zeros.
    """
    count = jax.ops.segment_sum(jnp.ones_like(rewards), group_ids, num_segments=num_groups)
    total = jax.ops.segment_sum(rewards, group_ids, num_segments=num_groups)
    mean = total / jnp.maximum(count, 1.0)
    lo = jax.ops.segment_min(rewards, group_ids, num_segments=num_groups)
    hi = jax.ops.segment_max(rewards, group_ids, num_segments=num_groups)
    constant = (hi == lo)[group_ids]
    deviation = jnp.where(constant, 0.0, rewards - mean[group_ids])
    dof = count - ddof
    sq_sum = jax.ops.segment_sum(jnp.square(deviation), group_ids, num_segments=num_groups)
    std = jnp.where(dof > 0, jnp.sqrt(sq_sum / jnp.maximum(dof, 1.0)), 0.0)
    return mean, deviation, std, count


def _check_flat(rewards: jax.Array, group_ids: jax.Array) -> tuple[jax.Array, jax.Array]:
    rewards = jnp.asarray(rewards, jnp.float32)
    group_ids = jnp.asarray(group_ids)
    if rewards.ndim != 1 or group_ids.shape != rewards.shape:
        raise ValueError(
            f"rewards and group_ids must be (N,) arrays of one shape, got {rewards.shape} and "
            f"{group_ids.shape}"
        )
    if not jnp.issubdtype(group_ids.dtype, jnp.integer):
        raise ValueError(f"group_ids must be integers, got {group_ids.dtype}")
    return rewards, group_ids
