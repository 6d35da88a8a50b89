"""Group advantages vs float64 numpy restatements of the references.

References (docs/algorithms.md A5, A8, A9):
  * yifan123/flow_grpo flow_grpo/stat_tracking.py (PerPromptStatTracker.update: group mean,
    numpy std ddof 0 + 1e-4, per prompt or global_std),
  * XueZeyue/DanceGRPO fastvideo/train_grpo_flux.py (per-group torch.std, ddof 1, + 1e-8;
    use_group=False: the gathered batch's mean and torch.std),
  * yifan123/flow_grpo scripts/train_sd3.py without per_prompt_stat_tracking (the batch's mean
    and numpy std, + 1e-4),
  * Tencent-Hunyuan/MixGRPO fastvideo/train_grpo_flux.py (multi_reward_mix "advantage_aggr"
    and "reward_aggr").
"""
import jax
import numpy as np
import pytest

from digen_jax.app.validation import validate_group_size
from digen_jax.rl import (
    clip_advantages,
    group_advantages,
    group_statistics,
    multi_reward_advantages,
    validate_advantage_modes,
)


def _grouped(seed, num_groups=5, group_size=4):
    rng = np.random.default_rng(seed)
    ids = rng.permutation(np.repeat(np.arange(num_groups), group_size)).astype(np.int32)
    # A per-group offset makes the group mean matter, unlike a plain standardisation.
    rewards = rng.normal(size=ids.shape) + 3.0 * ids
    return rewards.astype(np.float32), ids


def ref_advantages(rewards, ids, *, global_std, eps, ddof):
    """Restatement: for each group, (r - group mean) / (std + eps) in float64."""
    r = rewards.astype(np.float64)
    out = np.zeros_like(r)
    for g in np.unique(ids):
        member = ids == g
        std = np.std(r, ddof=ddof) if global_std else np.std(r[member], ddof=ddof)
        out[member] = (r[member] - r[member].mean()) / (std + eps)
    return out


@pytest.mark.parametrize(
    "std_mode,eps,ddof",
    [("group", 1e-4, 0), ("global", 1e-4, 0), ("group", 1e-8, 1)],
    ids=["flow_grpo_group", "flow_grpo_global", "dance_grpo"],
)
def test_matches_reference(std_mode, eps, ddof):
    rewards, ids = _grouped(0)
    fn = jax.jit(group_advantages, static_argnames=("num_groups", "std_mode", "eps", "ddof"))
    got = fn(rewards, ids, num_groups=5, std_mode=std_mode, eps=eps, ddof=ddof)
    want = ref_advantages(rewards, ids, global_std=std_mode == "global", eps=eps, ddof=ddof)
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize(
    "eps,ddof", [(1e-4, 0), (1e-8, 1)], ids=["flow_grpo_no_tracker", "dance_grpo_use_group_false"]
)
def test_global_mean_matches_reference(eps, ddof):
    """A = (r - mean(r)) / (std(r) + eps) over the whole batch, groups ignored."""
    rewards, ids = _grouped(4)
    fn = jax.jit(group_advantages, static_argnames=("num_groups", "std_mode", "eps", "ddof", "mean_mode"))
    got = fn(rewards, ids, num_groups=5, std_mode="global", eps=eps, ddof=ddof, mean_mode="global")
    r = rewards.astype(np.float64)
    want = (r - r.mean()) / (np.std(r, ddof=ddof) + eps)
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5)
    # The per-group offsets survive a global mean (a group mean would have removed them).
    group_mean = ref_advantages(rewards, ids, global_std=True, eps=eps, ddof=ddof)
    assert np.max(np.abs(want - group_mean)) > 0.5
    # Through the multi-reward path too (one reward, weight 1).
    mixed = multi_reward_advantages(rewards[None], np.ones(1), ids, 5, mix="reward", std_mode="global",
                                    eps=eps, ddof=ddof, mean_mode="global")
    np.testing.assert_allclose(np.asarray(mixed), want, rtol=2e-5, atol=2e-5)


def test_global_mean_of_equal_rewards_is_exactly_zero():
    rewards = np.full(6, 0.9, np.float32)
    adv = np.asarray(group_advantages(rewards, np.arange(6, dtype=np.int32) % 2, 2, std_mode="global",
                                      mean_mode="global", eps=0.0))
    np.testing.assert_array_equal(adv, 0.0)


def test_advantage_modes_are_validated_naming_the_keys():
    validate_advantage_modes("group", "group")
    validate_advantage_modes("group", "global")
    validate_advantage_modes("global", "global")
    with pytest.raises(ValueError, match=r"rl\.mean_mode='global' needs rl\.std_mode='global'"):
        validate_advantage_modes("global", "group")
    with pytest.raises(ValueError, match=r"rl\.mean_mode must be"):
        validate_advantage_modes("batch", "global")
    with pytest.raises(ValueError, match=r"rl\.std_mode must be"):
        validate_advantage_modes("group", "prompt")
    with pytest.raises(ValueError, match=r"rl\.mean_mode"):
        group_advantages(np.ones(4), np.zeros(4, np.int32), 1, std_mode="group", mean_mode="global")


def test_flow_grpo_tracker_example():
    # The tracker module's own demo: prompts a,b,a,c,b,a with rewards 1..6 (c is a group of one).
    rewards = np.arange(1, 7, dtype=np.float32)
    ids = np.array([0, 1, 0, 2, 1, 0], np.int32)
    got = np.asarray(group_advantages(rewards, ids, 3))
    want = ref_advantages(rewards, ids, global_std=False, eps=1e-4, ddof=0)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert got[3] == 0.0


def test_degenerate_groups_are_zero_not_nan():
    # Group 0: one sample (ddof 1 -> torch.std is NaN); group 1: constant; group 2: normal.
    rewards = np.array([0.7, 0.9, 0.9, 0.9, 1.0, 2.0], np.float32)
    ids = np.array([0, 1, 1, 1, 2, 2], np.int32)
    for eps in (1e-8, 0.0):
        adv = np.asarray(group_advantages(rewards, ids, 3, eps=eps, ddof=1))
        assert np.all(np.isfinite(adv))
        np.testing.assert_array_equal(adv[:4], 0.0)  # exact zeros, though float32 sum/3 != 0.9
        np.testing.assert_allclose(adv[4:], [-0.70710678, 0.70710678], rtol=1e-5)
    adv = np.asarray(group_advantages(rewards, ids, 3, std_mode="global"))
    np.testing.assert_array_equal(adv[:4], 0.0)


def test_group_statistics():
    rewards, ids = _grouped(1)
    mean, std, count = (np.asarray(x) for x in group_statistics(rewards, ids, 6, ddof=1))
    for g in range(5):
        np.testing.assert_allclose(mean[g], rewards[ids == g].mean(), rtol=1e-6)
        np.testing.assert_allclose(std[g], rewards[ids == g].std(ddof=1), rtol=1e-5)
    np.testing.assert_array_equal(count, [4, 4, 4, 4, 4, 0])
    assert mean[5] == 0.0 and std[5] == 0.0  # an empty group is harmless


def test_clip_advantages():
    adv = np.array([-7.0, -5.0, 0.3, 5.0, 9.0], np.float32)
    want = np.array([-5, -5, 0.3, 5, 5], np.float32)
    np.testing.assert_array_equal(np.asarray(clip_advantages(adv, 5.0)), want)
    with pytest.raises(ValueError, match="> 0"):
        clip_advantages(adv, 0.0)


@pytest.mark.parametrize("bad", [1, 0, -3, 2.0, True])
def test_group_size_validation_names_config_key(bad):
    with pytest.raises(ValueError, match=r"rl\.group_size.*>= 2"):
        validate_group_size(bad)


def test_group_size_two_is_fine():
    validate_group_size(2)


def test_multi_reward_advantage_mix_matches_mixgrpo():
    rng = np.random.default_rng(2)
    ids = rng.permutation(np.repeat(np.arange(3), 4)).astype(np.int32)
    # Two rewards on very different scales: the point of normalising each before summing.
    rewards = np.stack([rng.normal(size=12), 100.0 * rng.normal(size=12)]).astype(np.float32)
    weights = np.array([0.25, 0.75], np.float32)
    got = multi_reward_advantages(rewards, weights, ids, 3, mix="advantage", eps=1e-8, ddof=1)
    want = sum(
        w * ref_advantages(r, ids, global_std=False, eps=1e-8, ddof=1)
        for w, r in zip(weights, rewards)
    )
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def test_multi_reward_reward_mix_is_normalised_weighted_sum():
    rng = np.random.default_rng(3)
    ids = rng.permutation(np.repeat(np.arange(3), 4)).astype(np.int32)
    rewards = rng.normal(size=(3, 12)).astype(np.float32)
    weights = np.array([1.0, -0.5, 2.0], np.float32)
    got = multi_reward_advantages(rewards, weights, ids, 3, mix="reward")
    total = (weights[:, None] * rewards).sum(0)
    want = ref_advantages(total, ids, global_std=False, eps=1e-4, ddof=0)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    # The two mixes genuinely differ.
    other = multi_reward_advantages(rewards, weights, ids, 3, mix="advantage")
    assert not np.allclose(np.asarray(got), np.asarray(other))


def test_bad_inputs():
    with pytest.raises(ValueError, match="std_mode"):
        group_advantages(np.ones(4), np.zeros(4, np.int32), 1, std_mode="batch")
    with pytest.raises(ValueError, match="integers"):
        group_advantages(np.ones(4), np.zeros(4), 1)
    with pytest.raises(ValueError, match=r"\(N,\)"):
        group_advantages(np.ones(4), np.zeros(3, np.int32), 1)
    with pytest.raises(ValueError, match=r"\(K, N\)"):
        multi_reward_advantages(np.ones((2, 4)), np.ones(3), np.zeros(4, np.int32), 1)
