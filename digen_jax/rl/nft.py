"""DiffusionNFT: negative-aware fine-tuning on the forward process (docs/algorithms.md A12).

Pure math, no runtime state. A rollout keeps only the clean latent x0 and its reward; training
noises x0 at K of the sampling ladder's noise levels and regresses two implicit policies built
from the trained velocity v_theta and the frozen "old" velocity v_old:
    v+ = beta v_theta + (1 - beta) v_old,    v- = (1 + beta) v_old - beta v_theta,
    x0+- = x_t - t v+-,    w+- = sg(max(mean_d |x0+- - x0|, 1e-5))        (per sample)
    rho = clip(clip(A, -c, c) / (2c) + 1/2, 0, 1)
    L = c mean_B[(rho mean_d(x0+ - x0)^2 / w+ + (1 - rho) mean_d(x0- - x0)^2 / w-) / beta]
        + kl_coef mean_B mean_d (v_theta - v_ref)^2
with c the advantage clip (5), which the reference also uses as the loss scale. After each
epoch the old parameters move towards the trained ones: old <- lam old + (1 - lam) theta.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from digen_jax.diffusion.steps import _as_f32 as _f32
from digen_jax.diffusion.steps import _mean_over_sample, _per_sample
from digen_jax.rl.optim import ema_update

Metrics = dict[str, jax.Array]
PyTree = Any

# Old-policy decay schedules: name -> (delay, rate, cap), lam = 0 before `delay` steps, then
# min(rate * (step - delay), cap). DiffusionNFT's config `decay_type` 0, 1 (its default) and 2
# (its OCR config).
NFT_DECAY_SCHEDULES = {
    "copy": (0, 0.0, 0.0),
    "ramp": (0, 0.001, 0.5),
    "ramp_delayed": (75, 0.0075, 0.999),
}


def optimality_weight(advantages: jax.Array, adv_clip: float = 5.0) -> jax.Array:
    """rho = clip(clip(A, -c, c) / c / 2 + 1/2, 0, 1), (B,) float32, with c = ``adv_clip``.

    rho = 1 trains only the positive policy, rho = 0 only the negative one, A = 0 both equally.
    """
    if not adv_clip > 0:
        raise ValueError(f"adv_clip must be > 0, got {adv_clip}")
    a = jnp.clip(_f32(advantages), -adv_clip, adv_clip)
    return jnp.clip(a / adv_clip / 2.0 + 0.5, 0.0, 1.0)


def forward_point(x0: jax.Array, t: jax.Array, noise: jax.Array) -> jax.Array:
    """x_t = (1 - t) x0 + t noise with a per-sample t, () or (B,); (B, ...) float32."""
    if x0.shape != noise.shape:
        raise ValueError(f"x0 {x0.shape} and noise {noise.shape} must have one shape")
    t = _per_sample(t, x0.ndim)
    return (1.0 - t) * _f32(x0) + t * _f32(noise)


def draw_timestep_indices(key: jax.Array, batch: int, num_steps: int, num_train: int) -> jax.Array:
    """(B, K) int32: per sample, the first K of a random permutation of ladder steps 0..N-1.

    The reference trains int(N * 0.99) = N - 1 of the N sampling noise levels sigmas[0..N-1]
    (never the terminal 0), in a random order per sample; the noise level of column k is
    ``sigmas[idx[:, k]]``. Deterministic per key.
    """
    if not 1 <= num_train <= num_steps:
        raise ValueError(f"num_train must be in [1, num_steps={num_steps}], got {num_train}")
    scores = jax.random.uniform(key, (batch, num_steps))
    return jnp.argsort(scores, axis=1)[:, :num_train].astype(jnp.int32)


def nft_loss(
    v_theta: jax.Array,
    v_old: jax.Array,
    x0: jax.Array,
    x_t: jax.Array,
    t: jax.Array,
    advantages: jax.Array,
    *,
    beta: float = 1.0,
    adv_clip: float = 5.0,
    v_ref: jax.Array | None = None,
    kl_coef: float = 1e-4,
    weight_floor: float = 1e-5,
) -> tuple[jax.Array, Metrics]:
    """The DiffusionNFT loss of one micro-batch at one noise level (formula in the module doc).

    ``v_theta``, ``v_old``, ``v_ref``, ``x0``, ``x_t``: (B, ...) arrays of one shape; ``t``: ()
    or (B,) noise levels; ``advantages``: (B,). Only ``v_theta`` carries gradient: the other
    inputs and the weights w+- are stop-gradient. ``v_ref`` (the frozen base model's velocity)
    adds the penalty kl_coef * mean_B mean_d (v_theta - v_ref)^2; None leaves it out. All math
    is float32. Metrics (stop-gradient scalars): ``nft_policy_loss`` (the first term),
    ``nft_ref_penalty`` (mean_B mean_d (v_theta - v_ref)^2, 0 without v_ref), ``nft_rho_mean``,
    ``nft_weight_pos_mean``, ``nft_weight_neg_mean`` (mean_B w+-) and ``nft_old_deviation``
    (mean (v_theta - v_old)^2).
    """
    if not beta > 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    shapes = {x.shape for x in (v_theta, v_old, x0, x_t) + (() if v_ref is None else (v_ref,))}
    if len(shapes) != 1 or v_theta.ndim < 1:
        raise ValueError(f"velocities, x0 and x_t must share one (B, ...) shape, got {sorted(shapes)}")
    if advantages.shape != v_theta.shape[:1]:
        raise ValueError(f"advantages must be (B,) = {v_theta.shape[:1]}, got {advantages.shape}")
    sg = jax.lax.stop_gradient
    ndim = v_theta.ndim
    v = _f32(v_theta)
    v_old = sg(_f32(v_old))
    x0 = sg(_f32(x0))
    x_t = sg(_f32(x_t))
    t = _per_sample(sg(_f32(t)), ndim)
    rho = sg(optimality_weight(advantages, adv_clip))

    def implicit_term(velocity: jax.Array) -> tuple[jax.Array, jax.Array]:
        err = x_t - t * velocity - x0
        weight = sg(jnp.maximum(_mean_over_sample(jnp.abs(err)), weight_floor))
        return _mean_over_sample(jnp.square(err)) / weight, weight

    pos, w_pos = implicit_term(beta * v + (1.0 - beta) * v_old)
    neg, w_neg = implicit_term((1.0 + beta) * v_old - beta * v)
    policy = adv_clip * jnp.mean((rho * pos + (1.0 - rho) * neg) / beta)
    if v_ref is None:
        ref_penalty = jnp.float32(0.0)
        loss = policy
    else:
        ref_penalty = jnp.mean(_mean_over_sample(jnp.square(v - sg(_f32(v_ref)))))
        loss = policy + kl_coef * ref_penalty
    metrics = {
        "nft_policy_loss": policy,
        "nft_ref_penalty": ref_penalty,
        "nft_rho_mean": jnp.mean(rho),
        "nft_weight_pos_mean": jnp.mean(w_pos),
        "nft_weight_neg_mean": jnp.mean(w_neg),
        "nft_old_deviation": jnp.mean(jnp.square(v - v_old)),
    }
    return loss, {k: sg(m) for k, m in metrics.items()}


def old_policy_decay(step, schedule: str = "ramp"):
    """lam(step) of a named schedule (``NFT_DECAY_SCHEDULES``); ``step`` counts optimizer steps.

    'copy': 0 (the old policy becomes the trained one); 'ramp': min(0.001 step, 0.5);
    'ramp_delayed': 0 before step 75, then min(0.0075 (step - 75), 0.999). A Python int step
    gives a float; a (traced) integer array, as inside a jitted update, a float32 array.
    """
    if schedule not in NFT_DECAY_SCHEDULES:
        raise ValueError(f"schedule must be one of {tuple(NFT_DECAY_SCHEDULES)}, got {schedule!r}")
    delay, rate, cap = NFT_DECAY_SCHEDULES[schedule]
    on_host = isinstance(step, (int, np.integer))
    xp = np if on_host else jnp
    lam = xp.minimum(xp.maximum(step - delay, 0) * rate, cap)  # 0 before the delay: max(...) is 0
    return float(lam) if on_host else lam.astype(jnp.float32)


def update_old_policy(old_params: PyTree, params: PyTree, step, schedule: str = "ramp") -> PyTree:
    """old <- lam old + (1 - lam) params with lam = :func:`old_policy_decay` (step, schedule).

    Called after optimizer steps with the number of steps taken so far (an int, or a traced
    integer inside a jitted update).
    Float32 arithmetic; each result keeps its old leaf's dtype.
    """
    return ema_update(old_params, params, 0, update_every=1, decay=old_policy_decay(step, schedule))
