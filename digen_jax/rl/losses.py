"""Policy-gradient losses for one trained denoising step of a micro-batch.

Inputs are per-sample (B,) arrays: ``log_prob`` is the current policy's log-density of the stored
transition x_j -> x_{j+1} (:class:`digen_jax.diffusion.StepOutput.log_prob`, a mean over latent
elements), the other log-probs were recorded or recomputed without gradient, and ``advantages``
come from :mod:`digen_jax.rl.advantages`. All math is float32. Each loss returns
``(loss scalar, metrics)``; metrics are float32 scalars, already stop-gradiented, with keys fixed
by the static arguments (so a jitted train step returns one pytree structure).

Notation (docs/algorithms.md A4): ``r = exp(logp - logp_anchor)``, ``A_hat = clip(A, -c_A, c_A)`` with
``c_A = adv_clip``, and the PPO-clip term per sample
``l(r, A_hat) = max(-A_hat * r, -A_hat * clip(r, 1 - eps, 1 + eps))``.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from digen_jax.diffusion import gaussian_mean_kl

Metrics = dict[str, jax.Array]
# Values of config key rl.policy_loss: the plain PPO-clip surrogate or GRPO-Guard's (checked by
# `app.validation.validate_policy_loss`).
POLICY_LOSSES = ("ppo", "grpo_guard")
# Step types whose transition is Gaussian with s = g * sqrt(-Delta), which GRPO-Guard's
# normalisation assumes (the 'cps' step's log-prob is unnormalised and its s is not g sqrt(-Delta)).
GRPO_GUARD_SDE_TYPES = ("sde", "wan", "dance")


def clipped_surrogate(
    log_prob: jax.Array,
    old_log_prob: jax.Array,
    advantages: jax.Array,
    *,
    clip_range: float,
    adv_clip: float = 5.0,
) -> tuple[jax.Array, Metrics]:
    """Flow-GRPO / DanceGRPO PPO-clip loss ``L = mean_B l(exp(logp - logp_old), A_hat)``.

    ``old_log_prob`` and ``advantages`` are constants (stop-gradient): only ``log_prob`` carries
    gradient. Metrics, as the references log them:
      * ``ratio_mean``: mean_B r;
      * ``clip_frac``: mean_B [|r - 1| > clip_range];
      * ``approx_kl``: 0.5 * mean_B (logp - logp_old)^2.
    """
    _check_batch(log_prob, old_log_prob, advantages)
    log_prob = _f32(log_prob)
    old_log_prob = jax.lax.stop_gradient(_f32(old_log_prob))
    per_sample, metrics = _surrogate_terms(log_prob, old_log_prob, advantages, clip_range, adv_clip)
    return jnp.mean(per_sample), metrics


def truncated_importance_weights(
    proximal_log_prob: jax.Array,
    behaviour_log_prob: jax.Array,
    cap: float | None = None,
) -> jax.Array:
    """Importance weights ``w = sg(min(exp(logp_prox - logp_behav), cap))``, shape (B,) float32.

    ``w`` re-weights samples drawn by the behaviour policy (the weights that ran the rollout)
    towards the proximal policy. ``cap=None`` leaves ``w`` untruncated; truncation (TIS) bounds
    the variance a stale or numerically different rollout can inject. ``w`` never carries
    gradient: it is a sampling correction, not part of the objective being differentiated.
    """
    if cap is not None and cap <= 0:
        raise ValueError(f"importance-weight cap must be > 0, got {cap}")
    _check_batch(proximal_log_prob, behaviour_log_prob)
    w = jnp.exp(_f32(proximal_log_prob) - _f32(behaviour_log_prob))
    if cap is not None:
        w = jnp.minimum(w, cap)
    return jax.lax.stop_gradient(w)


def policy_loss(
    log_prob: jax.Array,
    behaviour_log_prob: jax.Array,
    advantages: jax.Array,
    *,
    clip_range: float,
    adv_clip: float = 5.0,
    proximal_log_prob: jax.Array | None = None,
    is_cap: float | None = None,
) -> tuple[jax.Array, Metrics]:
    """PPO-clip loss with the off-policy corrections of a disaggregated (stale-rollout) runtime.

    Three log-probs of the same stored transition: ``log_prob`` (current parameters theta, with
    gradient), ``behaviour_log_prob`` (recorded by the rollout that drew the sample, e.g. weights
    v - k) and optionally ``proximal_log_prob`` (recomputed by the trainer under the policy the
    trust region is centred on, e.g. the version at the start of this update).

    * ``proximal_log_prob=None`` (default): ``L = mean_B l(exp(logp - logp_behav), A_hat)``,
      exactly :func:`clipped_surrogate` with ``old_log_prob = behaviour_log_prob``.
    * Decoupled PPO (Hilton et al. 2022, "Batch size-invariance for policy optimization"): the
      clip ratio is taken against the proximal policy and the behaviour policy enters only
      through an importance weight,
      ``L = mean_B w * l(exp(logp - logp_prox), A_hat)`` with
      ``w = sg(min(exp(logp_prox - logp_behav), is_cap))`` (:func:`truncated_importance_weights`).
      ``is_cap=None`` keeps ``w`` untruncated; a finite cap is truncated importance sampling
      (TIS). With ``logp_prox == logp_behav`` (on-policy) ``w = 1`` and this is the default loss.

    ``is_cap`` needs ``proximal_log_prob``: without a proximal policy the weight is identically 1.
    Metrics: those of :func:`clipped_surrogate` (taken against the anchor of the ratio), plus, in
    the decoupled form, ``is_weight_mean`` (mean_B w) and ``is_truncated_frac`` (the fraction of
    samples whose weight hit the cap; 0 when uncapped).
    """
    if proximal_log_prob is None:
        if is_cap is not None:
            raise ValueError(
                "is_cap needs proximal_log_prob: the importance weight exp(logp_prox - logp_behav) "
                "is undefined without a proximal policy"
            )
        return clipped_surrogate(
            log_prob, behaviour_log_prob, advantages, clip_range=clip_range, adv_clip=adv_clip
        )
    _check_batch(log_prob, behaviour_log_prob, advantages, proximal_log_prob)
    weights = truncated_importance_weights(proximal_log_prob, behaviour_log_prob, is_cap)
    anchor = jax.lax.stop_gradient(_f32(proximal_log_prob))
    per_sample, metrics = _surrogate_terms(_f32(log_prob), anchor, advantages, clip_range, adv_clip)
    metrics["is_weight_mean"] = jnp.mean(weights)
    if is_cap is None:
        metrics["is_truncated_frac"] = jnp.zeros((), jnp.float32)
    else:
        raw = jnp.exp(anchor - _f32(behaviour_log_prob))
        metrics["is_truncated_frac"] = jnp.mean((raw > is_cap).astype(jnp.float32))
    return jnp.mean(weights * per_sample), metrics


def grpo_guard_surrogate(
    log_prob: jax.Array,
    old_log_prob: jax.Array,
    advantages: jax.Array,
    mean: jax.Array,
    old_mean: jax.Array,
    noise_scale: jax.Array | float,
    sigma_delta: jax.Array | float,
    *,
    clip_range: float,
    adv_clip: float = 5.0,
    per_sample_bias: bool = False,
    step_index: jax.Array | None = None,
) -> tuple[jax.Array, Metrics]:
    """GRPO-Guard's ratio-normalised PPO-clip loss (Flow-GRPO ``rationorm``, docs/algorithms.md A4).

    With ``g`` the step's diffusion coefficient (:attr:`StepOutput.noise_scale`, () or (B,)) and
    ``Delta = sigma' - sigma < 0`` (() or (B,)), let ``k = mean_B(sqrt(-Delta))`` and
    ``s_bar = mean_B(g) * k``. Then
      * ``b = mean((mu_theta - mu_old)^2) / (2 s_bar^2)`` (the mean-shift bias of the log-ratio),
      * ``r = exp((logp - logp_old + b) * s_bar)``,
      * ``L = mean_B l(r, A_hat) / k^2``.
    Adding ``b`` back removes the negative drift of the Gaussian log-ratio, and scaling by
    ``s_bar`` and dividing by ``k^2`` equalise the ratio spread and gradient size across steps;
    the reference pairs it with a tiny ``clip_range`` (2e-6).

    The mean in ``b`` runs over the latent elements AND the batch by default
    (``per_sample_bias=False``, one scalar): that is what the reference computes [inferred],
    because it reduces over ``dim=tuple(range(1, log_prob.ndim))`` of a 1-D log-prob, an empty
    tuple, which torch treats as "all dims". ``per_sample_bias=True`` takes the per-sample mean
    over elements only. ``mean`` carries gradient (through ``b``); ``old_mean``,
    ``old_log_prob`` and ``advantages`` are constants. Extra metric: ``ratio_mean_bias`` (mean b).

    The reference trains one denoising step per batch, so its batch means are means over one
    step's samples. ``step_index`` ((B,) ints) lets a batch hold units of several steps: every
    ``mean_B`` above (``k``, ``s_bar`` and the shared bias) then runs over the units of the same
    step, and ``L = mean_B l(r, A_hat) / k^2`` with each unit's own ``k``: the unit-weighted
    average of the per-step losses. ``None`` treats the whole batch as one step.
    """
    _check_batch(log_prob, old_log_prob, advantages)
    if mean.shape != old_mean.shape or mean.shape[:1] != log_prob.shape:
        raise ValueError(
            f"mean {mean.shape} and old_mean {old_mean.shape} must be one (B, ...) shape with "
            f"B = {log_prob.shape[0]}"
        )
    batch = log_prob.shape[0]
    if step_index is None:
        step_mean = jnp.mean
    else:
        _check_batch(log_prob, step_index)
        same = (step_index[:, None] == step_index[None, :]).astype(jnp.float32)
        # Elementwise sums (not a matmul, which a GPU may run in TF32): means over each unit's step.
        step_mean = lambda x: jnp.sum(same * jnp.broadcast_to(x, (batch,)), axis=1) / jnp.sum(same, axis=1)  # noqa: E731
    old_log_prob = jax.lax.stop_gradient(_f32(old_log_prob))
    sq = jnp.square(_f32(mean) - jax.lax.stop_gradient(_f32(old_mean)))
    sq = jnp.mean(sq, axis=tuple(range(1, sq.ndim)))
    if not per_sample_bias:
        sq = jnp.broadcast_to(step_mean(sq), sq.shape)
    k = step_mean(jnp.sqrt(-_f32(sigma_delta)))
    s_bar = step_mean(_f32(noise_scale)) * k
    bias = sq / (2.0 * jnp.square(s_bar))
    # Scaled log-ratio: the surrogate's exp() then yields exp((logp - logp_old + b) * s_bar).
    scaled = (_f32(log_prob) - old_log_prob + bias) * s_bar
    per_sample, metrics = _surrogate_terms(
        scaled, jnp.zeros_like(scaled), advantages, clip_range, adv_clip
    )
    # Logged like the references: approx KL of the raw, unscaled log-ratio.
    metrics["approx_kl"] = jax.lax.stop_gradient(
        0.5 * jnp.mean(jnp.square(_f32(log_prob) - old_log_prob))
    )
    metrics["ratio_mean_bias"] = jax.lax.stop_gradient(jnp.mean(bias))
    return jnp.mean(per_sample / jnp.square(k)), metrics


def policy_kl_loss(
    mean: jax.Array, ref_mean: jax.Array, divisor: jax.Array | float
) -> jax.Array:
    """KL penalty ``L_KL = mean_B gaussian_mean_kl(mu_theta, mu_ref, divisor)``, a float32 scalar.

    Per sample ``mean_d (mu_d - mu_ref_d)^2 / (2 divisor^2)``, see
    :func:`digen_jax.diffusion.gaussian_mean_kl` for which divisor each recipe uses (g for
    Flow-GRPO SD3/FLUX/Qwen, s for Wan). ``ref_mean`` is a constant (the reference model is
    frozen); the caller scales the result by beta.
    """
    return jnp.mean(gaussian_mean_kl(mean, jax.lax.stop_gradient(ref_mean), divisor))


def _surrogate_terms(
    log_prob: jax.Array,
    anchor_log_prob: jax.Array,
    advantages: jax.Array,
    clip_range: float,
    adv_clip: float,
) -> tuple[jax.Array, Metrics]:
    """Per-sample PPO-clip terms l(r, A_hat) (B,) and the ratio metrics."""
    if clip_range <= 0 or adv_clip <= 0:
        raise ValueError(f"clip_range and adv_clip must be > 0, got {clip_range} and {adv_clip}")
    adv = jnp.clip(jax.lax.stop_gradient(_f32(advantages)), -adv_clip, adv_clip)
    log_ratio = log_prob - anchor_log_prob
    ratio = jnp.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * jnp.clip(ratio, 1.0 - clip_range, 1.0 + clip_range)
    metrics = jax.lax.stop_gradient(
        {
            "ratio_mean": jnp.mean(ratio),
            "clip_frac": jnp.mean((jnp.abs(ratio - 1.0) > clip_range).astype(jnp.float32)),
            "approx_kl": 0.5 * jnp.mean(jnp.square(log_ratio)),
        }
    )
    return jnp.maximum(unclipped, clipped), metrics


def _f32(x: jax.Array | float) -> jax.Array:
    return jnp.asarray(x, dtype=jnp.float32)


def _check_batch(*arrays: jax.Array) -> None:
    shapes = [jnp.shape(a) for a in arrays]
    if len(shapes[0]) != 1 or any(s != shapes[0] for s in shapes):
        raise ValueError(f"per-sample inputs must be (B,) arrays of one shape, got {shapes}")
