"""Optimizer vs torch's AdamW + clip_grad_norm_, and the EMA schedules.

References (docs/algorithms.md A4, A6, A8):
  * yifan123/flow_grpo scripts/train_flux.py (torch.optim.AdamW 0.9/0.999, wd 1e-4, eps 1e-8,
    accelerator.clip_grad_norm_ 1.0; EMAModuleWrapper(decay=0.9, update_step_interval=8)),
  * yifan123/flow_grpo flow_grpo/ema.py (decay min((1+k)/(10+k), decay), update when
    (k+1) % interval == 0, ema += (1 - decay) (p - ema)),
  * XueZeyue/DanceGRPO fastvideo/train_grpo_flux.py (constant EMA decay 0.995).
"""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch

from digen_jax.rl import ema_decay, ema_update, make_optimizer


def _run(opt, params, grads_seq):
    state = opt.init(params)
    for grads in grads_seq:
        updates, state = opt.update(grads, state, params)
        params = optax.apply_updates(params, updates)
    return params


def _tree(rng):
    return {
        "w": rng.normal(size=(4, 3)).astype(np.float32),
        "b": rng.normal(size=3).astype(np.float32),
    }


def _grads(seed, norm):
    rng = np.random.default_rng(seed)
    g = _tree(rng)
    total = np.sqrt(sum(np.sum(x**2) for x in g.values()))
    return {k: jnp.asarray(v * norm / total) for k, v in g.items()}


def test_matches_torch_adamw_with_clipping():
    rng = np.random.default_rng(0)
    init = _tree(rng)
    # Norms above and below the clip threshold, so the clip is on in some steps only.
    grads_seq = [_grads(s, n) for s, n in enumerate([10.0, 0.5, 3.0, 0.2])]
    lr = 1e-2
    got = _run(make_optimizer(lr), {k: jnp.asarray(v) for k, v in init.items()}, grads_seq)

    torch_params = {k: torch.tensor(v, requires_grad=True) for k, v in init.items()}
    opt = torch.optim.AdamW(
        list(torch_params.values()), lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-4
    )
    for grads in grads_seq:
        for k, p in torch_params.items():
            p.grad = torch.tensor(np.asarray(grads[k]))
        torch.nn.utils.clip_grad_norm_(list(torch_params.values()), 1.0)
        opt.step()
    for k, p in torch_params.items():
        np.testing.assert_allclose(np.asarray(got[k]), p.detach().numpy(), rtol=1e-5, atol=1e-6)


def test_global_norm_clip_is_applied():
    # Adam's first step is scale-invariant, so compare whole trajectories: with clipping, a
    # norm-10 first gradient leaves the same optimizer state as its norm-1 rescaling.
    params = {"w": jnp.ones((4, 3)), "b": jnp.zeros(3)}
    big, unit, second = _grads(0, 10.0), _grads(0, 1.0), _grads(1, 0.5)
    clipped = make_optimizer(1e-2)
    a, b = _run(clipped, params, [big, second]), _run(clipped, params, [unit, second])
    for k in params:
        np.testing.assert_allclose(np.asarray(a[k]), np.asarray(b[k]), rtol=1e-6)
    unclipped = make_optimizer(1e-2, max_grad_norm=None)
    a, b = _run(unclipped, params, [big, second]), _run(unclipped, params, [unit, second])
    assert not np.allclose(np.asarray(a["w"]), np.asarray(b["w"]), rtol=1e-4)


def test_ema_decay_schedule():
    got = np.asarray(jax.vmap(ema_decay)(jnp.array([0, 1, 8, 79, 80, 1000])))
    np.testing.assert_allclose(got, [0.1, 2 / 11, 0.5, 80 / 89, 0.9, 0.9], rtol=1e-6)


def ref_ema(ema, p, k, every, decay=None):
    if (k + 1) % every:
        return ema
    d = min((1 + k) / (10 + k), 0.9) if decay is None else decay
    return ema + (1 - d) * (p - ema)


@pytest.mark.parametrize("decay,every", [(None, 8), (0.995, 1)], ids=["flow_grpo", "dance_grpo"])
def test_ema_update_schedule(decay, every):
    step_fn = jax.jit(lambda e, p, k: ema_update(e, p, k, update_every=every, decay=decay))
    rng = np.random.default_rng(1)
    ema = {"w": jnp.zeros((2, 3))}
    want = np.zeros((2, 3))
    for k in range(20):
        p = rng.normal(size=(2, 3)).astype(np.float32)
        before = ema
        ema = step_fn(ema, {"w": jnp.asarray(p)}, jnp.int32(k))  # traced step
        want = ref_ema(want, p.astype(np.float64), k, every, decay)
        np.testing.assert_allclose(np.asarray(ema["w"]), want, rtol=1e-5, atol=1e-7)
        if (k + 1) % every:
            np.testing.assert_array_equal(np.asarray(ema["w"]), np.asarray(before["w"]))
        else:
            assert not np.array_equal(np.asarray(ema["w"]), np.asarray(before["w"]))


def test_ema_keeps_dtype():
    ema = {"w": jnp.zeros(3, jnp.bfloat16)}
    out = ema_update(ema, {"w": jnp.ones(3, jnp.float32)}, 7)
    assert out["w"].dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out["w"], np.float32), 1 - 8 / 17, rtol=1e-2)


def test_bad_arguments():
    with pytest.raises(ValueError, match="max_grad_norm"):
        make_optimizer(1e-3, max_grad_norm=0.0)
    with pytest.raises(ValueError, match="update_every"):
        ema_update({}, {}, 0, update_every=0)


def test_float32_optimizer_state_for_bf16_weights():
    """`rl.optimizer_state_dtype`: 'param' keeps bf16 moments for bf16 weights; 'float32' keeps
    float32 moments and runs the update in float32: for bf16 weights its update is the float32
    reference's (the same AdamW on float32 copies) rounded once to bf16, unlike the bf16 one."""
    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.normal(size=(64,)), jnp.bfloat16)}
    grads_seq = [{"w": jnp.asarray(rng.normal(size=(64,)) * 1e-3, jnp.bfloat16)} for _ in range(3)]
    moments = lambda tx: [x for x in jax.tree.leaves(tx.init(params)) if x.ndim]  # noqa: E731
    assert {x.dtype for x in moments(make_optimizer(1e-2))} == {np.dtype(jnp.bfloat16)}
    assert {x.dtype for x in moments(make_optimizer(1e-2, state_dtype="float32"))} == {np.dtype(np.float32)}

    def updates(tx, p, cast):
        state, out = tx.init(p), []
        for g in grads_seq:
            u, state = tx.update(jax.tree.map(cast, g), state, p)
            out.append(u["w"])
        return out

    f32 = updates(make_optimizer(1e-2, state_dtype="float32"), params, lambda g: g)
    ref = updates(make_optimizer(1e-2), jax.tree.map(lambda x: x.astype(jnp.float32), params),
                  lambda g: g.astype(jnp.float32))
    bf16 = updates(make_optimizer(1e-2), params, lambda g: g)
    assert all(u.dtype == jnp.bfloat16 for u in f32)
    for got, want in zip(f32, ref):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want.astype(jnp.bfloat16)))
    assert any(not np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(bf16, f32))
    with pytest.raises(ValueError, match="rl.optimizer_state_dtype"):
        make_optimizer(1e-3, state_dtype="float16")
