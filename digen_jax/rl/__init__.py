"""RL core: group advantages, policy losses, DiffusionNFT, LoRA adapters, optimizer and EMA (pure functions)."""
from digen_jax.rl.advantages import (
    clip_advantages,
    group_advantages,
    group_statistics,
    multi_reward_advantages,
    validate_advantage_modes,
)
from digen_jax.rl.lora import (
    init_lora,
    lora_param_count,
    lora_scale,
    match_lora_targets,
    merge_lora,
)
from digen_jax.rl.losses import (
    clipped_surrogate,
    grpo_guard_surrogate,
    policy_kl_loss,
    policy_loss,
    truncated_importance_weights,
)
from digen_jax.rl.nft import (
    NFT_DECAY_SCHEDULES,
    draw_timestep_indices,
    forward_point,
    nft_loss,
    old_policy_decay,
    optimality_weight,
    update_old_policy,
)
from digen_jax.rl.optim import ema_decay, ema_update, make_optimizer

__all__ = [
    "NFT_DECAY_SCHEDULES",
    "clip_advantages",
    "clipped_surrogate",
    "draw_timestep_indices",
    "ema_decay",
    "ema_update",
    "forward_point",
    "group_advantages",
    "group_statistics",
    "grpo_guard_surrogate",
    "init_lora",
    "lora_param_count",
    "lora_scale",
    "make_optimizer",
    "match_lora_targets",
    "merge_lora",
    "multi_reward_advantages",
    "nft_loss",
    "old_policy_decay",
    "optimality_weight",
    "policy_kl_loss",
    "policy_loss",
    "truncated_importance_weights",
    "update_old_policy",
    "validate_advantage_modes",
]
