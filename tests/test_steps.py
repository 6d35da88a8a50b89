"""Sampler steps and KL vs float64 numpy restatements of the reference formulas.

References (docs/algorithms.md A1-A4, A7):
  * flow_grpo flow_grpo/diffusers_patch/sd3_sde_with_logprob.py (sde_step_with_logprob,
    sde_type "sde" and "cps"),
  * flow_grpo flow_grpo/diffusers_patch/wan_pipeline_with_logprob.py (sde_step_with_logprob),
  * DanceGRPO fastvideo/train_grpo_flux.py (flux_step with sde_solver=True),
  * flow_grpo scripts/train_sd3.py / train_wan2_1.py (KL term).
The numpy restatements below keep each reference's own arrangement of the arithmetic.
"""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from digen_jax.diffusion import (
    dance_grpo_step,
    dancegrpo_ladder,
    euler_step,
    flow_grpo_cps_step,
    flow_grpo_sde_step,
    flow_grpo_wan_step,
    flux_ladder,
    gaussian_mean_kl,
    sd3_ladder,
    wan_unipc_ladder,
)

SHAPES = [(2, 3, 4, 5), (2, 16, 8)]  # (B, C, H, W) image latents and (B, tokens, 4C) packed.


def _inputs(shape, seed):
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal(shape).astype(np.float32) for _ in range(3))


def _mean_rest(a):
    return a.mean(axis=tuple(range(1, a.ndim)))


def _ref_gaussian_log_prob(sample, mean, std):
    return _mean_rest(
        -((sample - mean) ** 2) / (2 * std**2) - math.log(std) - math.log(math.sqrt(2 * math.pi))
    )


def _ref_fg_transition(x, v, sigma, sigma_next, g, eps, prev):
    # flow_grpo's arrangement: x * (1 + g^2/(2 sigma) dt) + v * (1 + g^2 (1-sigma)/(2 sigma)) dt
    dt = sigma_next - sigma
    mean = x * (1 + g**2 / (2 * sigma) * dt) + v * (1 + g**2 * (1 - sigma) / (2 * sigma)) * dt
    std = g * math.sqrt(-dt)
    sample = mean + std * eps if prev is None else prev
    return sample, _ref_gaussian_log_prob(sample, mean, std), mean, std, g


def ref_sde(x, v, sigmas, i, a, eps=None, prev=None):
    sigma, sigma_next = float(sigmas[i]), float(sigmas[i + 1])
    sigma_tilde = float(sigmas[1]) if sigma == 1 else sigma
    g = math.sqrt(sigma / (1 - sigma_tilde)) * a
    return _ref_fg_transition(x, v, sigma, sigma_next, g, eps, prev)


def ref_wan(x, v, sigmas, i, eps=None, prev=None):
    sigma, sigma_next = float(sigmas[i]), float(sigmas[i + 1])
    sigma_max, sigma_min = float(sigmas[1]), float(sigmas[-1])
    g = sigma_min + (sigma_max - sigma_min) * sigma
    return _ref_fg_transition(x, v, sigma, sigma_next, g, eps, prev)


def ref_dance(x, v, sigmas, i, eta, eps=None, prev=None):
    # DanceGRPO's arrangement: Euler mean plus a score term.
    sigma, sigma_next = float(sigmas[i]), float(sigmas[i + 1])
    dsigma = sigma_next - sigma
    x0_hat = x - sigma * v
    score = -(x - x0_hat * (1 - sigma)) / sigma**2
    mean = x + dsigma * v + (-0.5 * eta**2 * score) * dsigma
    std = eta * math.sqrt(sigma - sigma_next)
    sample = mean + std * eps if prev is None else prev
    return sample, _ref_gaussian_log_prob(sample, mean, std), mean, std, eta


def ref_cps(x, v, sigmas, i, a, eps=None, prev=None):
    sigma, sigma_next = float(sigmas[i]), float(sigmas[i + 1])
    std = sigma_next * math.sin(a * math.pi / 2)
    x0_hat = x - sigma * v
    x1_hat = x + v * (1 - sigma)
    mean = x0_hat * (1 - sigma_next) + x1_hat * math.sqrt(sigma_next**2 - std**2)
    sample = mean + std * eps if prev is None else prev
    return sample, -_mean_rest((sample - mean) ** 2), mean, std, std


# (name, jax step, numpy reference, ladder, extra positional args)
CASES = [
    ("sde_sd3", flow_grpo_sde_step, ref_sde, sd3_ladder(10).sigmas, (0.7,)),
    ("sde_flux", flow_grpo_sde_step, ref_sde, flux_ladder(6, 1024).sigmas, (0.9,)),
    ("cps_sd3", flow_grpo_cps_step, ref_cps, sd3_ladder(10).sigmas, (0.8,)),
    # Noise levels at and past 1, where sqrt(sigma'^2 - s^2) = sigma' |cos(a pi / 2)| and the
    # signed sigma' cos(a pi / 2) differ (the sign of the x1_hat coefficient flips past a = 1).
    ("cps_a1", flow_grpo_cps_step, ref_cps, sd3_ladder(10).sigmas, (1.0,)),
    ("cps_a1.2", flow_grpo_cps_step, ref_cps, flux_ladder(6, 1024).sigmas, (1.2,)),
    ("cps_a2", flow_grpo_cps_step, ref_cps, sd3_ladder(10).sigmas, (2.0,)),
    ("wan", flow_grpo_wan_step, ref_wan, wan_unipc_ladder(8).sigmas, ()),
    ("dance", dance_grpo_step, ref_dance, dancegrpo_ladder(8).sigmas, (0.3,)),
]
CASE_IDS = [case[0] for case in CASES]


def _as64(*arrays):
    return tuple(np.asarray(a, np.float64) for a in arrays)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name,step,ref,sigmas,extra", CASES, ids=CASE_IDS)
def test_step_matches_numpy_reference(name, step, ref, sigmas, extra, shape):
    """Every step, sampled with given noise and re-scored with a given prev_sample, equals the
    float64 restatement of its reference formula (rtol 1e-5)."""
    x, v, eps = _inputs(shape, seed=len(name))
    other = _inputs(shape, seed=99)[2]
    for i in range(len(sigmas) - 1):
        out = step(x, v, sigmas, i, *extra, noise=eps)
        want = ref(*_as64(x, v), sigmas, i, *extra, eps=np.float64(eps))
        for got, expected in zip(out, want):
            assert got.dtype == jnp.float32
            np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5, err_msg=f"step {i}")
        assert out.log_prob.shape == (shape[0],)
        # Score a different sample than the one drawn.
        prev = np.asarray(want[0] + want[3] * other, np.float32)
        scored = step(x, v, sigmas, i, *extra, prev_sample=prev)
        want_lp = ref(*_as64(x, v), sigmas, i, *extra, prev=np.float64(prev))[1]
        np.testing.assert_allclose(scored.log_prob, want_lp, rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(scored.prev_sample, prev)


def test_sd3_check_values():
    """docs/algorithms.md A1 check values: SD3.5-M ladder (shift 3, N = 10), a = 0.7; g and s to the
    printed precision (half a unit in the last printed digit)."""
    sigmas = sd3_ladder(10).sigmas
    x = jnp.zeros((1, 4))
    outs = [flow_grpo_sde_step(x, x, sigmas, i, 0.7, noise=x) for i in range(10)]
    g = np.array([float(o.noise_scale) for o in outs])
    s = np.array([float(o.std) for o in outs])
    expected_g = [3.506, 3.435, 2.273, 1.719, 1.359, 1.088, 0.861, 0.652, 0.434, 0.066]
    expected_s = [0.700, 0.743, 0.536, 0.446, 0.392, 0.353, 0.319, 0.282, 0.225]
    np.testing.assert_allclose(g, expected_g, rtol=0, atol=5e-4)
    np.testing.assert_allclose(s[:9], expected_s, rtol=0, atol=5e-4)
    assert s[9] == pytest.approx(0.0063, abs=5e-5)
    # The sigma == 1 substitution makes the step-0 std exactly the noise level.
    assert s[0] == pytest.approx(0.7, rel=1e-6)


def test_dance_grpo_equals_flow_grpo_with_constant_noise_scale():
    """docs/algorithms.md A7: DanceGRPO's step is the Flow-GRPO A1 step with g held at eta. At each
    step, setting eta to the A1 step's g gives the same transition (JAX), and the two references'
    different arithmetic agrees in float64."""
    sigmas = sd3_ladder(10).sigmas
    x, v, eps = _inputs((2, 3, 4, 4), seed=5)
    for i in range(10):
        fg = flow_grpo_sde_step(x, v, sigmas, i, 0.7, noise=eps)
        dg = dance_grpo_step(x, v, sigmas, i, fg.noise_scale, noise=eps)
        for a, b in zip(fg, dg):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
        fg_ref = ref_sde(*_as64(x, v), sigmas, i, 0.7, eps=np.float64(eps))
        dg_ref = ref_dance(*_as64(x, v), sigmas, i, fg_ref[4], eps=np.float64(eps))
        for a, b in zip(fg_ref, dg_ref):
            np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)


def test_cps_log_prob_is_unnormalized():
    """flow_grpo sd3_sde_with_logprob.py, sde_type "cps": log_prob = -mean((x' - mu)^2)."""
    sigmas = sd3_ladder(10).sigmas
    x, v, prev = _inputs((2, 3, 4, 4), seed=6)
    out = flow_grpo_cps_step(x, v, sigmas, 4, 0.8, prev_sample=prev)
    np.testing.assert_array_equal(out.log_prob, -jnp.mean((prev - out.mean) ** 2, axis=(1, 2, 3)))
    # A drawn sample x' = mu + s * eps scores -s^2 mean(eps^2): no 1/(2 s^2), no log s.
    drawn = flow_grpo_cps_step(x, v, sigmas, 4, 0.8, noise=prev)
    want = -float(drawn.std) ** 2 * _mean_rest(np.float64(prev) ** 2)
    np.testing.assert_allclose(drawn.log_prob, want, rtol=1e-4)


@pytest.mark.parametrize("name,step,ref,sigmas,extra", CASES, ids=CASE_IDS)
def test_rescoring_own_sample_gives_ratio_one(name, step, ref, sigmas, extra):
    """On-policy: the log-prob of the step's own output, recomputed via prev_sample, equals the
    log-prob it returned (ratio 1 to 1e-6 in fp32), at every step, eager and jitted."""
    x, v, _ = _inputs((2, 4, 8, 8), seed=7)
    for i in range(len(sigmas) - 1):
        out = step(x, v, sigmas, i, *extra, key=jax.random.key(i))
        again = step(x, v, sigmas, i, *extra, prev_sample=out.prev_sample)
        np.testing.assert_allclose(jnp.exp(again.log_prob - out.log_prob), 1.0, atol=1e-6)


def test_zero_noise_is_euler_with_finite_log_prob_and_gradients():
    """a = 0 (outside an SDE window) must give the Euler step and a finite, masked log-prob whose
    gradients w.r.t. velocity and noise level are finite (the torch reference gives 0/0 NaN)."""
    sigmas = sd3_ladder(10).sigmas
    x, v, eps = _inputs((2, 3, 4, 4), seed=8)
    for i in (0, 4, 9):
        euler = euler_step(x, v, sigmas, i)
        want = x + (sigmas[i + 1] - sigmas[i]) * v
        np.testing.assert_allclose(euler.prev_sample, want, rtol=1e-6, atol=1e-7)
        for step in (flow_grpo_sde_step, flow_grpo_cps_step):
            out = step(x, v, sigmas, i, 0.0, noise=eps)
            np.testing.assert_allclose(out.prev_sample, euler.prev_sample, rtol=1e-6, atol=1e-6)
            np.testing.assert_array_equal(out.log_prob, np.zeros(2, np.float32))

    def objective(velocity, noise_level):
        out = flow_grpo_sde_step(x, velocity, sigmas, 3, noise_level, prev_sample=eps)
        return out.log_prob.sum() + gaussian_mean_kl(out.mean, x, out.noise_scale).sum()

    grad_v, grad_a = jax.grad(objective, argnums=(0, 1))(jnp.asarray(v), 0.0)
    assert np.isfinite(objective(v, 0.0))
    assert np.all(np.isfinite(grad_v)) and np.isfinite(grad_a)


def test_traced_per_sample_noise_level_masks_only_zero_rows():
    """SDE window: a traced per-sample noise level [0, 0.7] under jit; the a = 0 row scores 0,
    the other row matches an a = 0.7 step, and the gradient stays finite."""
    sigmas = sd3_ladder(10).sigmas
    x, v, eps = _inputs((2, 3, 4, 4), seed=9)
    levels = jnp.array([0.0, 0.7])

    @jax.jit
    def log_prob(velocity, noise_level, index):
        return flow_grpo_sde_step(x, velocity, sigmas, index, noise_level, noise=eps).log_prob

    got = log_prob(v, levels, 5)
    want = flow_grpo_sde_step(x, v, sigmas, 5, 0.7, noise=eps).log_prob
    assert got[0] == 0.0
    np.testing.assert_allclose(got[1], want[1], rtol=1e-6)
    grad = jax.grad(lambda vel: log_prob(vel, levels, 5).sum())(jnp.asarray(v))
    assert np.all(np.isfinite(grad))
    np.testing.assert_array_equal(grad[0], 0.0)


def test_log_prob_does_not_differentiate_prev_sample():
    sigmas = flux_ladder(6, 1024).sigmas
    x, v, prev = _inputs((2, 16, 8), seed=10)
    grad = jax.grad(
        lambda p: flow_grpo_sde_step(x, v, sigmas, 2, 0.9, prev_sample=p).log_prob.sum()
    )(jnp.asarray(prev))
    np.testing.assert_array_equal(grad, 0.0)


@pytest.mark.parametrize("name,step,ref,sigmas,extra", CASES, ids=CASE_IDS)
def test_steps_under_jit_with_traced_index(name, step, ref, sigmas, extra):
    """A traced step index (and per-sample (B,) indices) give the same result as eager calls."""
    x, v, eps = _inputs((2, 3, 4, 4), seed=11)
    jitted = jax.jit(lambda index: step(x, v, sigmas, index, *extra, noise=eps))
    for i in range(len(sigmas) - 1):
        for got, want in zip(jitted(i), step(x, v, sigmas, i, *extra, noise=eps)):
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    per_sample = jitted(jnp.array([0, 3]))
    for row, i in enumerate((0, 3)):
        single = step(x, v, sigmas, i, *extra, noise=eps)
        np.testing.assert_allclose(
            per_sample.prev_sample[row], single.prev_sample[row], rtol=1e-6, atol=1e-6
        )
        np.testing.assert_allclose(per_sample.log_prob[row], single.log_prob[row], rtol=1e-6)
        np.testing.assert_allclose(per_sample.std[row], single.std, rtol=1e-6)


def test_full_trajectory_in_scan():
    """The whole SDE ladder as one lax.scan over a traced index (ODE for a constant velocity ends
    at x - v, since the sigmas sum to a total change of -1)."""
    sigmas = flux_ladder(6, 1024).sigmas
    x, v, _ = _inputs((2, 16, 8), seed=12)

    def body(carry, index):
        latents, key = carry
        key, sub = jax.random.split(key)
        out = flow_grpo_sde_step(latents, v, sigmas, index, 0.9, key=sub)
        return (out.prev_sample, key), out.log_prob

    (final, _), log_probs = jax.lax.scan(body, (jnp.asarray(x), jax.random.key(0)), jnp.arange(6))
    assert log_probs.shape == (6, 2) and np.all(np.isfinite(log_probs))
    assert np.all(np.isfinite(final))
    ode, _ = jax.lax.scan(
        lambda lat, index: (euler_step(lat, v, sigmas, index).prev_sample, None),
        jnp.asarray(x),
        jnp.arange(6),
    )
    np.testing.assert_allclose(ode, x - v, rtol=1e-5, atol=1e-5)


def test_wan_noise_scale_is_sigma_1_times_sigma():
    """docs/algorithms.md A3: g = sigma_1 * sigma on the UniPC ladder (sigma_min = 0)."""
    sigmas = wan_unipc_ladder(20).sigmas
    x = jnp.zeros((1, 2, 1, 2, 2))
    for i in (0, 7, 19):
        out = flow_grpo_wan_step(x, x, sigmas, i, noise=x)
        assert float(out.noise_scale) == pytest.approx(sigmas[1] * sigmas[i], rel=1e-6)
        assert float(out.std) == pytest.approx(
            sigmas[1] * sigmas[i] * math.sqrt(sigmas[i] - sigmas[i + 1]), rel=1e-6
        )


def test_gaussian_mean_kl():
    """flow_grpo scripts/train_sd3.py: kl = mean((mu - mu_ref)^2) / (2 g^2) per sample;
    train_wan2_1.py divides by the transition std instead."""
    mean, ref_mean, _ = _inputs((3, 4, 5, 5), seed=13)
    np.testing.assert_array_equal(gaussian_mean_kl(mean, mean, 0.5), np.zeros(3))
    want = _mean_rest((np.float64(mean) - ref_mean) ** 2) / (2 * 0.5**2)
    np.testing.assert_allclose(gaussian_mean_kl(mean, ref_mean, 0.5), want, rtol=1e-5)
    divisor = np.array([0.5, 2.0, 0.0], np.float32)
    got = gaussian_mean_kl(mean, ref_mean, divisor)
    np.testing.assert_allclose(got[:2], want[:2] * np.array([1.0, 1 / 16]), rtol=1e-5)
    assert got[2] == 0.0
    grad = jax.grad(lambda m: gaussian_mean_kl(m, ref_mean, divisor).sum())(jnp.asarray(mean))
    assert np.all(np.isfinite(grad))


def test_step_argument_errors():
    sigmas = sd3_ladder(10).sigmas
    x, v, eps = _inputs((2, 3, 4, 4), seed=14)
    with pytest.raises(ValueError, match="exactly one of key or noise"):
        flow_grpo_sde_step(x, v, sigmas, 0, 0.7)
    with pytest.raises(ValueError, match="exactly one of key or noise"):
        flow_grpo_sde_step(x, v, sigmas, 0, 0.7, key=jax.random.key(0), noise=eps)
    with pytest.raises(ValueError, match="not both"):
        flow_grpo_cps_step(x, v, sigmas, 0, 0.7, noise=eps, prev_sample=eps)
    with pytest.raises(ValueError, match="one shape"):
        euler_step(x, v[:1], sigmas, 0)
    with pytest.raises(ValueError, match="noise shape"):
        dance_grpo_step(x, v, sigmas, 0, 0.3, noise=eps[:1])
