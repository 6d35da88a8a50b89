"""Policy losses vs float64 numpy restatements of the references, and their gradients' signs.

References (docs/algorithms.md A4, A8):
  * yifan123/flow_grpo scripts/train_flux.py and scripts/train_sd3.py (PPO-clip loss on
    clamp(advantages, +-adv_clip_max), approx_kl = 0.5 mean(dlogp^2), clipfrac = mean(|r-1| > eps),
    KL = mean((mu - mu_ref)^2) / (2 std_dev_t^2)),
  * GRPO-Guard's ratio normalisation as carried by Flow-GRPO forks (train_*_GRPO_Guard.py:
    ratio_mean_bias, sqrt_dt.mean() * std_dev_t.mean(), policy_loss / sqrt_dt.mean()^2),
  * XueZeyue/DanceGRPO fastvideo/train_grpo_flux.py (same PPO-clip per sample).
Decoupled PPO follows Hilton et al. 2022; TIS follows Yao et al. 2025 ("off-policy RL training").
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from digen_jax.diffusion import gaussian_mean_kl
from digen_jax.rl import (
    clipped_surrogate,
    grpo_guard_surrogate,
    policy_kl_loss,
    policy_loss,
    truncated_importance_weights,
)

CLIP = 0.2


def _batch(seed, b=8, spread=0.3):
    rng = np.random.default_rng(seed)
    old = rng.normal(size=b).astype(np.float32)
    new = (old + spread * rng.normal(size=b)).astype(np.float32)
    adv = (3.0 * rng.normal(size=b)).astype(np.float32)  # some beyond the +-5 clip
    adv[0] = 7.5
    return new, old, adv


def ref_terms(logp, anchor, adv, clip_range, adv_clip=5.0):
    ratio = np.exp(logp.astype(np.float64) - anchor)
    a = np.clip(adv.astype(np.float64), -adv_clip, adv_clip)
    return np.maximum(-a * ratio, -a * np.clip(ratio, 1 - clip_range, 1 + clip_range)), ratio


def test_clipped_surrogate_matches_reference():
    new, old, adv = _batch(0)
    loss, m = jax.jit(clipped_surrogate, static_argnames=("clip_range", "adv_clip"))(
        new, old, adv, clip_range=CLIP
    )
    terms, ratio = ref_terms(new, old, adv, CLIP)
    np.testing.assert_allclose(float(loss), terms.mean(), rtol=1e-5)
    np.testing.assert_allclose(float(m["ratio_mean"]), ratio.mean(), rtol=1e-5)
    np.testing.assert_allclose(float(m["clip_frac"]), np.mean(np.abs(ratio - 1) > CLIP))
    np.testing.assert_allclose(float(m["approx_kl"]), 0.5 * np.mean((new - old) ** 2.0), rtol=1e-5)
    assert 0 < float(m["clip_frac"]) < 1  # the batch exercises both branches


def test_on_policy_ratio_is_one():
    _, old, adv = _batch(1)
    loss, m = clipped_surrogate(old, old, adv, clip_range=1e-4)
    assert float(m["ratio_mean"]) == 1.0
    assert float(m["clip_frac"]) == 0.0 and float(m["approx_kl"]) == 0.0
    np.testing.assert_allclose(float(loss), -np.clip(adv, -5, 5).mean(), rtol=1e-6)


def test_clip_frac_counts():
    old = np.zeros(4, np.float32)
    new = np.array([0.0, 0.5, -0.5, 0.1], np.float32)  # |r - 1| = 0, .65, .39, .105
    _, m = clipped_surrogate(new, old, np.ones(4, np.float32), clip_range=CLIP)
    assert float(m["clip_frac"]) == 0.5


def test_gradient_sign_raises_logp_of_positive_advantages():
    # On-policy (r = 1) the loss is -mean(A r): d/dlogp_i = -A_i / B.
    _, old, _ = _batch(2)
    adv = np.array([2.0, -1.0, 0.5, -3.0, 1.0, -0.25, 4.0, -2.0], np.float32)
    grad = jax.grad(lambda lp: clipped_surrogate(lp, old, adv, clip_range=CLIP)[0])(old)
    grad = np.asarray(grad)
    assert np.all(grad[adv > 0] < 0) and np.all(grad[adv < 0] > 0)
    np.testing.assert_allclose(grad, -adv / len(adv), rtol=1e-6)
    # So a gradient-descent step raises the log-prob of positive-advantage samples.
    stepped = old - 0.1 * grad
    assert np.all((stepped - old)[adv > 0] > 0) and np.all((stepped - old)[adv < 0] < 0)


def test_gradient_vanishes_outside_trust_region():
    # A > 0 with r > 1 + eps (and A < 0 with r < 1 - eps) sits on the clipped branch: no gradient.
    old = np.zeros(2, np.float32)
    new = np.array([0.5, -0.5], np.float32)
    adv = np.array([1.0, -1.0], np.float32)
    grad = jax.grad(lambda lp: clipped_surrogate(lp, old, adv, clip_range=CLIP)[0])(new)
    np.testing.assert_array_equal(np.asarray(grad), 0.0)


def test_policy_loss_default_is_clipped_surrogate():
    new, old, adv = _batch(3)
    f = lambda lp: policy_loss(lp, old, adv, clip_range=CLIP)  # noqa: E731
    g = lambda lp: clipped_surrogate(lp, old, adv, clip_range=CLIP)  # noqa: E731
    (la, ma), (lb, mb) = f(new), g(new)
    assert float(la) == float(lb) and ma.keys() == mb.keys()
    np.testing.assert_array_equal(_grad(f, new), _grad(g, new))


def test_truncated_importance_weights_cap_and_stop_gradient():
    prox = np.array([0.0, 1.0, 2.0, -1.0], np.float32)
    behav = np.zeros(4, np.float32)
    w = np.asarray(truncated_importance_weights(prox, behav, cap=2.0))
    np.testing.assert_allclose(w, [1.0, 2.0, 2.0, np.exp(-1.0)], rtol=1e-6)
    np.testing.assert_allclose(
        np.asarray(truncated_importance_weights(prox, behav)), np.exp(prox), rtol=1e-6
    )
    grads = jax.grad(lambda p, b: truncated_importance_weights(p, b, 2.0).sum(), argnums=(0, 1))
    for g in grads(prox, behav):
        np.testing.assert_array_equal(np.asarray(g), 0.0)


def test_decoupled_reduces_to_standard_when_proximal_is_behaviour():
    new, old, adv = _batch(4)
    def f(lp):
        return policy_loss(lp, old, adv, clip_range=CLIP, proximal_log_prob=old, is_cap=2.0)

    g = lambda lp: clipped_surrogate(lp, old, adv, clip_range=CLIP)  # noqa: E731
    (la, ma), (lb, _) = f(new), g(new)
    np.testing.assert_allclose(float(la), float(lb), rtol=1e-6)
    assert float(ma["is_weight_mean"]) == 1.0 and float(ma["is_truncated_frac"]) == 0.0
    np.testing.assert_allclose(_grad(f, new), _grad(g, new), rtol=1e-6)


@pytest.mark.parametrize("cap", [None, 1.5])
def test_decoupled_matches_reference(cap):
    new, behav, adv = _batch(5)
    prox = (behav + 0.4 * np.random.default_rng(6).normal(size=behav.shape)).astype(np.float32)
    loss, m = policy_loss(
        new, behav, adv, clip_range=CLIP, proximal_log_prob=prox, is_cap=cap
    )
    raw = np.exp(prox.astype(np.float64) - behav)
    w = raw if cap is None else np.minimum(raw, cap)
    terms, ratio = ref_terms(new, prox, adv, CLIP)
    np.testing.assert_allclose(float(loss), np.mean(w * terms), rtol=1e-5)
    np.testing.assert_allclose(float(m["ratio_mean"]), ratio.mean(), rtol=1e-5)
    np.testing.assert_allclose(float(m["is_weight_mean"]), w.mean(), rtol=1e-5)
    want_frac = 0.0 if cap is None else np.mean(raw > cap)
    assert float(m["is_truncated_frac"]) == pytest.approx(want_frac)
    # The ratio is anchored at the proximal policy: the behaviour log-prob gets no gradient.
    def of_behaviour(b):
        return policy_loss(new, b, adv, clip_range=CLIP, proximal_log_prob=prox, is_cap=cap)

    np.testing.assert_array_equal(_grad(of_behaviour, behav), 0.0)


def test_is_cap_needs_proximal():
    new, old, adv = _batch(7)
    with pytest.raises(ValueError, match="proximal_log_prob"):
        policy_loss(new, old, adv, clip_range=CLIP, is_cap=2.0)


def test_policy_kl_loss_reuses_gaussian_mean_kl():
    rng = np.random.default_rng(8)
    mean, ref = rng.normal(size=(2, 2, 3, 4, 4)).astype(np.float32)
    g = np.array([0.7, 1.3], np.float32)
    got = policy_kl_loss(mean, ref, g)
    np.testing.assert_allclose(float(got), float(jnp.mean(gaussian_mean_kl(mean, ref, g))))
    sq = ((mean.astype(np.float64) - ref) ** 2).mean(axis=(1, 2, 3))
    want = np.mean(sq / (2 * g.astype(np.float64) ** 2))
    np.testing.assert_allclose(float(got), want, rtol=1e-5)
    g_ref = jax.grad(lambda r: policy_kl_loss(mean, r, g))(ref)
    np.testing.assert_array_equal(np.asarray(g_ref), 0.0)


def ref_guard(logp, old, adv, mean, old_mean, g, delta, clip_range, per_sample):
    sq = ((mean.astype(np.float64) - old_mean) ** 2).reshape(len(logp), -1).mean(axis=1)
    if not per_sample:
        sq = np.full_like(sq, sq.mean())  # torch's mean(dim=()) reduces every axis
    k = np.mean(np.sqrt(-np.asarray(delta, np.float64)))
    s_bar = np.mean(np.asarray(g, np.float64)) * k
    bias = sq / (2 * s_bar**2)
    ratio = np.exp((logp.astype(np.float64) - old + bias) * s_bar)
    a = np.clip(adv, -5, 5)
    terms = np.maximum(-a * ratio, -a * np.clip(ratio, 1 - clip_range, 1 + clip_range))
    return terms.mean() / k**2, ratio, bias


@pytest.mark.parametrize("per_sample", [False, True])
def test_grpo_guard_matches_reference(per_sample):
    rng = np.random.default_rng(9)
    new, old, adv = _batch(10, b=4, spread=0.01)
    old_mean = rng.normal(size=(4, 6, 5)).astype(np.float32)
    mean = (old_mean + 0.02 * rng.normal(size=old_mean.shape)).astype(np.float32)
    g = np.float32(0.9)
    delta = np.array([-0.1, -0.1, -0.12, -0.12], np.float32)
    clip = 2e-3
    loss, m = grpo_guard_surrogate(
        new, old, adv, mean, old_mean, g, delta, clip_range=clip, per_sample_bias=per_sample
    )
    want, ratio, bias = ref_guard(new, old, adv, mean, old_mean, g, delta, clip, per_sample)
    np.testing.assert_allclose(float(loss), want, rtol=1e-4)
    np.testing.assert_allclose(float(m["ratio_mean"]), ratio.mean(), rtol=1e-5)
    np.testing.assert_allclose(float(m["ratio_mean_bias"]), bias.mean(), rtol=1e-4)
    # The mean-shift bias carries gradient to the current policy's mean.
    gm = jax.grad(
        lambda mu: grpo_guard_surrogate(new, old, adv, mu, old_mean, g, delta, clip_range=clip)[0]
    )(mean)
    assert np.any(np.asarray(gm) != 0)


@pytest.mark.parametrize("per_sample", [False, True])
def test_grpo_guard_normalises_per_step_in_a_mixed_batch(per_sample):
    """A batch holding units of three steps (in the reference every batch is one step): with
    step_index, s_bar, k and the shared bias come from each unit's own step, so the loss is the
    unit-weighted mean of the reference's per-step losses and the ratios are the reference's."""
    rng = np.random.default_rng(13)
    steps = np.array([2, 0, 1, 2, 0, 2, 1, 0, 2], np.int32)
    new, old, adv = _batch(14, b=len(steps), spread=0.01)
    old_mean = rng.normal(size=(len(steps), 6, 5)).astype(np.float32)
    mean = (old_mean + 0.02 * rng.normal(size=old_mean.shape)).astype(np.float32)
    g_of, delta_of = np.array([1.4, 0.9, 0.6]), np.array([-0.05, -0.1, -0.2])
    g, delta = g_of[steps].astype(np.float32), delta_of[steps].astype(np.float32)
    clip = 2e-3
    loss, m = jax.jit(grpo_guard_surrogate, static_argnames=("clip_range", "per_sample_bias"))(
        new, old, adv, mean, old_mean, g, delta, clip_range=clip, per_sample_bias=per_sample, step_index=steps
    )
    want, ratio, bias = 0.0, np.zeros(len(steps)), np.zeros(len(steps))
    for j in range(3):
        at = steps == j
        step_loss, ratio[at], bias[at] = ref_guard(
            new[at], old[at], adv[at], mean[at], old_mean[at], g[at], delta[at], clip, per_sample
        )
        want += step_loss * at.sum() / len(steps)
    np.testing.assert_allclose(float(loss), want, rtol=1e-4)
    np.testing.assert_allclose(float(m["ratio_mean"]), ratio.mean(), rtol=1e-5)
    np.testing.assert_allclose(float(m["ratio_mean_bias"]), bias.mean(), rtol=1e-4)
    # Without step_index the batch is taken as one step: another normalisation, another loss.
    whole, _ = grpo_guard_surrogate(new, old, adv, mean, old_mean, g, delta, clip_range=clip, per_sample_bias=per_sample)
    assert abs(float(whole) - want) > 1e-2 * abs(want)


def test_grpo_guard_on_policy_ratio_is_one():
    rng = np.random.default_rng(11)
    _, old, adv = _batch(12, b=4)
    mu = rng.normal(size=(4, 8)).astype(np.float32)
    _, m = grpo_guard_surrogate(old, old, adv, mu, mu, 0.7, -0.05, clip_range=2e-6)
    assert float(m["ratio_mean"]) == 1.0 and float(m["ratio_mean_bias"]) == 0.0


def test_shape_errors():
    with pytest.raises(ValueError, match=r"\(B,\)"):
        clipped_surrogate(np.zeros(3), np.zeros(4), np.zeros(3), clip_range=CLIP)
    with pytest.raises(ValueError, match="clip_range"):
        clipped_surrogate(np.zeros(3), np.zeros(3), np.zeros(3), clip_range=0.0)


def _grad(loss_fn, x):
    """Gradient of the scalar loss of a (loss, metrics) function, as numpy."""
    return np.asarray(jax.grad(lambda v: loss_fn(v)[0])(x))
