"""Reward functions: a name registry and the built-in rewards (importing this registers them)."""
from digen_jax.rewards import clip_scores, image_reward, jpeg, remote, shapes_attributes, vlm_judge
from digen_jax.rewards.jpeg import jpeg_size_kb
from digen_jax.rewards.registry import (
    RewardFn,
    check_finite_rewards,
    get_reward,
    register_reward,
    registered_rewards,
    to_uint8_images,
    validate_reward_config,
    weighted_reward,
)
from digen_jax.rewards.remote import RemoteRewardError, RemoteScorer

__all__ = [
    "RemoteRewardError",
    "RemoteScorer",
    "RewardFn",
    "check_finite_rewards",
    "clip_scores",
    "image_reward",
    "get_reward",
    "jpeg",
    "remote",
    "shapes_attributes",
    "vlm_judge",
    "jpeg_size_kb",
    "register_reward",
    "registered_rewards",
    "to_uint8_images",
    "validate_reward_config",
    "weighted_reward",
]
