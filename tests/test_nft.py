"""DiffusionNFT math and the flow-ODE solvers vs float64 numpy restatements (docs/algorithms.md A12).

References: NVlabs/DiffusionNFT scripts/train_nft_sd3.py (the training loop: timestep draw,
forward-process point, loss, the old-policy update and its `return_decay`) and
flow_grpo/diffusers_patch/solver.py (`dpm_step` with order 2 and its update helpers).
The restatements below are written from the formulas, in float64.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from digen_jax.diffusion import dpm_solver_2m_step, euler_step, sd3_ladder, solve_flow_ode
from digen_jax.rl import (
    NFT_DECAY_SCHEDULES,
    draw_timestep_indices,
    forward_point,
    nft_loss,
    old_policy_decay,
    optimality_weight,
    update_old_policy,
)


def _np_rho(a, c):
    return np.clip(np.clip(a, -c, c) / (2.0 * c) + 0.5, 0.0, 1.0)


def _np_nft(v, v_old, x0, x_t, t, adv, beta, c, v_ref, k, floor):
    """Loss, dL/dv, w+ and w- in float64; the weights are constants of the gradient."""
    v, v_old, x0, x_t, t, adv = (np.asarray(a, np.float64) for a in (v, v_old, x0, x_t, t, adv))
    b, d = v.shape[0], v[0].size
    tb = t.reshape(-1, *([1] * (v.ndim - 1)))
    rho = _np_rho(adv, c)
    axes = tuple(range(1, v.ndim))
    e_pos = x_t - tb * (beta * v + (1 - beta) * v_old) - x0
    e_neg = x_t - tb * ((1 + beta) * v_old - beta * v) - x0
    w_pos = np.maximum(np.abs(e_pos).mean(axis=axes), floor)
    w_neg = np.maximum(np.abs(e_neg).mean(axis=axes), floor)
    pos = (e_pos**2).mean(axis=axes) / w_pos
    neg = (e_neg**2).mean(axis=axes) / w_neg
    loss = c * np.mean((rho * pos + (1 - rho) * neg) / beta)
    shape = (-1,) + (1,) * (v.ndim - 1)
    grad = (c / (b * beta)) * (
        rho.reshape(shape) * (-2 * tb * beta * e_pos) / (d * w_pos.reshape(shape))
        + (1 - rho).reshape(shape) * (2 * tb * beta * e_neg) / (d * w_neg.reshape(shape))
    )
    if v_ref is not None:
        diff = v - np.asarray(v_ref, np.float64)
        loss += k * np.mean((diff**2).mean(axis=axes))
        grad += k * 2 * diff / (b * d)
    return loss, grad, w_pos, w_neg


def _batch(seed, shape=(6, 3, 2, 2)):
    r = np.random.default_rng(seed)
    v, v_old, v_ref, x0, noise = (r.normal(size=shape).astype(np.float32) for _ in range(5))
    v_old = (v + 0.3 * v_old).astype(np.float32)
    t = r.uniform(0.05, 1.0, size=shape[0]).astype(np.float32)
    # Sample 0 sits at the weight floor: x0 = x_t = v_old = 0, |v_theta| ~ 1e-6.
    v[0] *= 2e-6
    v_old[0] = x0[0] = noise[0] = 0.0
    x_t = np.asarray(forward_point(jnp.asarray(x0), jnp.asarray(t), jnp.asarray(noise)))
    adv = np.array([-7.0, -5.0, -1.3, 0.0, 2.2, 9.0], np.float32)[: shape[0]]
    return v, v_old, v_ref, x0, x_t, t, adv


@pytest.mark.parametrize("beta", [1.0, 0.1, 0.5])
@pytest.mark.parametrize("with_ref", [True, False])
def test_loss_gradient_and_weights_match_float64_restatement(beta, with_ref):
    v, v_old, v_ref, x0, x_t, t, adv = _batch(int(beta * 10) + with_ref)
    ref = v_ref if with_ref else None
    k, floor = 1e-4, 1e-5
    want_loss, want_grad, w_pos, w_neg = _np_nft(v, v_old, x0, x_t, t, adv, beta, 5.0, ref, k, floor)
    assert w_pos[0] == floor and w_neg[0] == floor and (w_pos[1:] > floor).all()

    def f(v_theta, v_o, xt):
        return nft_loss(v_theta, v_o, x0, xt, t, adv, beta=beta, v_ref=ref, kl_coef=k, weight_floor=floor)

    (loss, metrics), grads = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))(v, v_old, x_t)
    np.testing.assert_allclose(float(loss), want_loss, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(grads[0]), want_grad, rtol=1e-4, atol=1e-6 * np.abs(want_grad).max())
    # v_old and x_t are constants of the loss.
    assert not np.asarray(grads[1]).any() and not np.asarray(grads[2]).any()
    np.testing.assert_allclose(float(metrics["nft_weight_pos_mean"]), w_pos.mean(), rtol=1e-5)
    np.testing.assert_allclose(float(metrics["nft_weight_neg_mean"]), w_neg.mean(), rtol=1e-5)
    np.testing.assert_allclose(float(metrics["nft_rho_mean"]), _np_rho(adv.astype(np.float64), 5.0).mean(), rtol=1e-6)
    diff = v.astype(np.float64) - v_ref
    want_pen = (diff**2).mean() if with_ref else 0.0
    np.testing.assert_allclose(float(metrics["nft_ref_penalty"]), want_pen, rtol=1e-5)
    np.testing.assert_allclose(float(metrics["nft_policy_loss"]), want_loss - k * want_pen, rtol=1e-5)


def test_beta_one_positive_policy_is_the_trained_one():
    # With beta = 1, x0+ = x_t - t v_theta: a sample with rho = 1 and v_theta exact has loss 0.
    r = np.random.default_rng(3)
    x0, noise, v_old = (r.normal(size=(2, 8)).astype(np.float32) for _ in range(3))
    t = np.array([0.3, 0.8], np.float32)
    x_t = forward_point(x0, t, noise)
    exact = jnp.asarray(noise - x0)
    loss, _ = nft_loss(exact, v_old, x0, x_t, t, jnp.array([5.0, 6.0]), beta=1.0)
    assert abs(float(loss)) < 1e-5
    loss_neg, _ = nft_loss(exact, v_old, x0, x_t, t, jnp.array([-5.0, 6.0]), beta=1.0)
    assert float(loss_neg) > 1e-2


def test_optimality_weight_values():
    a = np.array([-100.0, -5.0, -2.5, -1e-3, 0.0, 1.0, 5.0, 7.5], np.float32)
    for c in (5.0, 2.0):
        got = np.asarray(optimality_weight(a, c))
        np.testing.assert_allclose(got, _np_rho(a.astype(np.float64), c), rtol=1e-6, atol=1e-7)
    got = np.asarray(optimality_weight(a))
    assert got[0] == 0.0 and got[4] == 0.5 and got[-1] == 1.0 and got[2] == 0.25
    with pytest.raises(ValueError):
        optimality_weight(a, 0.0)


def _np_decay(step, delay, rate, cap):
    return 0.0 if step < delay else min((step - delay) * rate, cap)


def test_old_policy_decay_schedules():
    steps = [0, 1, 10, 74, 75, 76, 100, 208, 300, 499, 500, 1000, 10**5]
    for name, params in NFT_DECAY_SCHEDULES.items():
        for s in steps:
            assert old_policy_decay(s, name) == pytest.approx(_np_decay(s, *params), abs=1e-12), (name, s)
    assert [old_policy_decay(s, "copy") for s in steps] == [0.0] * len(steps)
    assert old_policy_decay(100, "ramp") == pytest.approx(0.1)
    assert old_policy_decay(600, "ramp") == 0.5
    assert old_policy_decay(74, "ramp_delayed") == 0.0
    assert old_policy_decay(175, "ramp_delayed") == pytest.approx(0.75)
    assert old_policy_decay(300, "ramp_delayed") == 0.999
    with pytest.raises(ValueError):
        old_policy_decay(3, "linear")


@pytest.mark.parametrize("schedule,step", [("ramp", 250), ("copy", 40), ("ramp_delayed", 100)])
def test_update_old_policy_tree(schedule, step):
    r = np.random.default_rng(step)
    old = {"a": r.normal(size=(3, 4)).astype(np.float32), "b": {"c": r.normal(size=5).astype(np.float32)}}
    new = jax.tree_util.tree_map(lambda x: (x + r.normal(size=x.shape)).astype(np.float32), old)
    lam = _np_decay(step, *NFT_DECAY_SCHEDULES[schedule])
    got = update_old_policy(old, new, step, schedule)
    want = jax.tree_util.tree_map(lambda o, n: lam * o.astype(np.float64) + (1 - lam) * n, old, new)
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        assert g.dtype == np.float32
        np.testing.assert_allclose(np.asarray(g), w, rtol=1e-6, atol=1e-6)


def test_forward_point_per_sample_t():
    r = np.random.default_rng(0)
    x0, noise = (r.normal(size=(4, 2, 3)).astype(np.float32) for _ in range(2))
    t = np.array([1.0, 0.0, 0.25, 0.6], np.float32)
    got = np.asarray(forward_point(x0, t, noise))
    tb = t.astype(np.float64)[:, None, None]
    np.testing.assert_allclose(got, (1 - tb) * x0 + tb * noise, rtol=1e-6, atol=1e-7)
    assert np.array_equal(got[0], noise[0]) and np.array_equal(got[1], x0[1])


def test_timestep_draw_distinct_shuffled_and_deterministic():
    n, k, b = 10, 9, 64
    key = jax.random.PRNGKey(7)
    idx = np.asarray(draw_timestep_indices(key, b, n, k))
    assert idx.shape == (b, k) and idx.dtype == np.int32
    assert ((idx >= 0) & (idx < n)).all()
    assert all(len(set(row)) == k for row in idx)
    assert np.array_equal(idx, np.asarray(draw_timestep_indices(key, b, n, k)))
    assert not np.array_equal(idx, np.asarray(draw_timestep_indices(jax.random.PRNGKey(8), b, n, k)))
    # Shuffled per sample: rows differ and the first column takes many ladder positions.
    assert len({tuple(row) for row in idx}) > b // 2
    assert len(set(idx[:, 0])) >= n - 2
    sigmas = sd3_ladder(n).sigmas
    assert all(len(set(sigmas[row])) == k and 0.0 not in sigmas[row] for row in idx)
    with pytest.raises(ValueError):
        draw_timestep_indices(key, b, n, n + 1)


# ---- flow-ODE solvers ----

_M, _S = 0.7, 0.4  # Gaussian data N(m, s^2) per element: the exact velocity field is linear.


def _gaussian_velocity(x, sigma):
    var = (1 - sigma) ** 2 * _S**2 + sigma**2
    x0 = _M + (1 - sigma) * _S**2 * (x - (1 - sigma) * _M) / var
    return (x - x0) / sigma


def test_dpm2_converges_quadratically_and_beats_euler():
    # A ladder uniform in lambda = log((1 - sigma) / sigma) on [0.9, 0.05], the solver's own
    # variable; x(sigma) = (1 - sigma) m + std(sigma) z is the exact trajectory.
    z = np.random.default_rng(0).normal(size=(4, 16))
    std = lambda s: np.sqrt((1 - s) ** 2 * _S**2 + s**2)  # noqa: E731
    errors = {"euler": [], "dpm2": []}
    for n in (16, 32, 64, 128):
        lam = np.linspace(np.log(0.1 / 0.9), np.log(0.95 / 0.05), n + 1)
        sigmas = (1.0 / (1.0 + np.exp(lam))).astype(np.float32)
        first, last = np.float64(sigmas[0]), np.float64(sigmas[-1])
        x_start = ((1 - first) * _M + std(first) * z).astype(np.float32)
        exact = (1 - last) * _M + std(last) * z
        for solver in errors:
            x = solve_flow_ode(_gaussian_velocity, x_start, sigmas, solver)
            errors[solver].append(np.abs(np.asarray(x, np.float64) - exact).mean())
    e, d = np.array(errors["euler"]), np.array(errors["dpm2"])
    assert (d < e / 5).all(), errors
    assert (d[:-1] / d[1:] > 2.5).all() and d[-2] / d[-1] > 3.3, errors  # second order: -> 4x per halving
    assert (e[:-1] / e[1:] < 2.2).all(), errors  # first order: about 2x


def _np_dpm2_trajectory(x, velocities, sigmas):
    """The reference's dpm_step(order=2) loop, float64: DDIM (eta 0) at the first and last step,
    the lambda-form multistep update in between (lambda = -inf at sigma = 1 zeroes D1)."""
    sig = np.asarray(sigmas, np.float64)
    lam = lambda s: np.log(1 - s) - np.log(s)  # noqa: E731
    n = len(sig) - 1
    out, prev = [], None
    with np.errstate(divide="ignore"):
        for i in range(n):
            s, t = sig[i], sig[i + 1]
            m0 = x - s * velocities[i]
            if i == 0 or i == n - 1:
                x = (1 - t) * m0 + t * (x - (1 - s) * m0) / s
            else:
                h, h0 = lam(t) - lam(s), lam(s) - lam(sig[i - 1])
                d1 = (h / h0) * (m0 - prev)
                x = (t / s) * x - (1 - t) * np.expm1(-h) * m0 - 0.5 * (1 - t) * np.expm1(-h) * d1
            prev = m0
            out.append(x)
    return out


@pytest.mark.parametrize("ladder", ["sd3", "shifted_from_below_one"])
def test_dpm2_step_matches_float64_restatement(ladder):
    n = 10
    sigmas = sd3_ladder(n).sigmas if ladder == "sd3" else np.linspace(0.9, 0.0, n + 1).astype(np.float32)
    r = np.random.default_rng(1)
    x = r.normal(size=(3, 2, 4)).astype(np.float32)
    vs = [r.normal(size=x.shape).astype(np.float32) for _ in range(n)]
    want = _np_dpm2_trajectory(x.astype(np.float64), [v.astype(np.float64) for v in vs], sigmas)
    step = jax.jit(dpm_solver_2m_step)
    got, prev = jnp.asarray(x), None
    for i in range(n):
        got, prev = step(got, vs[i], sigmas, i) if prev is None else step(got, vs[i], sigmas, i, prev)
        np.testing.assert_allclose(np.asarray(got), want[i], rtol=2e-5, atol=2e-5, err_msg=f"step {i}")
    # The same inputs through a second-order step differ from Euler (the correction is live).
    mid = np.asarray(dpm_solver_2m_step(x, vs[3], sigmas, 3, x).prev_sample)
    assert np.abs(mid - np.asarray(euler_step(x, vs[3], sigmas, 3).prev_sample)).max() > 1e-3


def test_dpm2_per_sample_step_index():
    sigmas = sd3_ladder(10).sigmas
    r = np.random.default_rng(2)
    x, v, prev = (r.normal(size=(4, 5)).astype(np.float32) for _ in range(3))
    idx = np.array([0, 3, 5, 9], np.int32)
    got = np.asarray(dpm_solver_2m_step(x, v, sigmas, idx, prev).prev_sample)
    for b, i in enumerate(idx):
        one = np.asarray(dpm_solver_2m_step(x[b : b + 1], v[b : b + 1], sigmas, int(i), prev[b : b + 1]).prev_sample)
        np.testing.assert_allclose(got[b : b + 1], one, rtol=1e-6, atol=1e-6)
    # The last step lands on the data prediction.
    np.testing.assert_allclose(got[3], x[3] - sigmas[9] * v[3], rtol=1e-6, atol=1e-6)


def test_old_policy_moves_once_per_batch_after_its_last_update():
    """With several updates on one batch the old policy stays through the earlier ones and moves
    in the last, by the decay of the update count so far (the reference: once per epoch, after
    all of its optimizer steps); a skipped last update leaves it."""
    from digen_jax.rl import make_optimizer
    from digen_jax.rl.nft_trainer import NftConfig, NftTrainer
    from digen_jax.rl.trainer import LossConfig

    trainer = NftTrainer(None, None, make_optimizer(1e-3), LossConfig(), NftConfig(decay="ramp"))
    r = np.random.default_rng(0)
    state = trainer.init_state({"w": jnp.asarray(r.normal(0, 0.05, (16, 8)), jnp.float32)})
    old0 = np.asarray(state.old["w"])
    grads = {"w": jnp.full((16, 8), 0.3, jnp.float32)}
    state, _ = trainer.apply_update(state, grads, jnp.float32(1), jnp.bool_(True), False)
    assert int(state.version) == 1
    np.testing.assert_array_equal(np.asarray(state.old["w"]), old0)  # an earlier update of the batch
    trained1 = np.asarray(state.trainable["w"])
    state, _ = trainer.apply_update(state, grads, jnp.float32(1), jnp.bool_(True), True)
    lam = old_policy_decay(2, "ramp")
    want = lam * old0.astype(np.float64) + (1 - lam) * np.asarray(state.trainable["w"], np.float64)
    np.testing.assert_allclose(np.asarray(state.old["w"]), want, rtol=1e-6, atol=1e-7)
    assert not np.allclose(np.asarray(state.trainable["w"]), trained1)
    before = np.asarray(state.old["w"])
    state, metrics = trainer.apply_update(state, grads, jnp.float32(1), jnp.bool_(False), True)  # skipped
    assert int(metrics["skipped"]) == 1
    np.testing.assert_array_equal(np.asarray(state.old["w"]), before)
