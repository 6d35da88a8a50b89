"""Stochastic flow-matching sampler steps with Gaussian log-probs, and the mean-matching KL.

One step moves a latent x at noise level ``sigma = sigmas[i]`` to ``sigma' = sigmas[i + 1]``
(``Delta = sigma' - sigma < 0``) given the post-guidance velocity v. The stochastic steps draw
``x' = mu + s * eps`` from a Gaussian with per-sample mean ``mu`` and scalar std ``s`` and return
its log-density, which the GRPO ratio compares between policies. Notation (docs/algorithms.md A1):
``x0_hat = x - sigma * v`` and ``x1_hat = x + (1 - sigma) * v`` are the predicted data and noise.

Conventions shared by every step function:
  * ``latents`` and ``velocity`` are (B, ...) arrays of any float dtype; all math is float32.
  * ``sigmas`` is the (N + 1,) ladder (see ``sigmas.py``); ``step_index`` is an int in
    [0, N - 1], a scalar or a (B,) array, and may be traced. A traced index is not range-checked.
  * Exactly one of ``key`` (a PRNG key) or ``noise`` (a (B, ...) standard-normal array) draws the
    sample, unless ``prev_sample`` is given: then no sample is drawn and the log-prob of that
    stored transition is computed instead (``prev_sample`` is treated as a constant).
  * ``log_prob`` has shape (B,) and is the MEAN over all non-batch elements of the elementwise
    log-density, not the sum (Flow-GRPO and DanceGRPO both do this; constants cancel in ratios).
  * ``std`` (s) and ``noise_scale`` (g) are float32 with the broadcast shape of ``step_index`` and
    the noise parameter: () or (B,).
  * A zero-noise transition (s == 0, e.g. ``noise_level`` 0 outside an SDE window, possibly
    traced) is the deterministic Euler step; its log-prob is reported as 0, and the masking keeps
    both that value and its gradients free of the 0/0 NaN.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

_HALF_LOG_2PI = 0.5 * math.log(2.0 * math.pi)


class StepOutput(NamedTuple):
    """Result of one sampler step.

    Attributes:
        prev_sample: x', (B, ...) float32: the drawn sample, or the given ``prev_sample``.
        log_prob: (B,) float32 log-density of x' under the step's Gaussian (mean over elements).
        mean: mu, (B, ...) float32, the Gaussian's mean (differentiable w.r.t. the velocity).
        std: s, () or (B,) float32, the transition standard deviation.
        noise_scale: g, () or (B,) float32, the diffusion coefficient (s = g * sqrt(-Delta) for
            the SDE steps). Flow-GRPO's KL for SD3/FLUX/Qwen divides by this; see
            :func:`gaussian_mean_kl`.
    """

    prev_sample: jax.Array
    log_prob: jax.Array
    mean: jax.Array
    std: jax.Array
    noise_scale: jax.Array


def _as_f32(x: jax.Array) -> jax.Array:
    return jnp.asarray(x, dtype=jnp.float32)


def _per_sample(value: jax.Array, ndim: int) -> jax.Array:
    """Reshape a () or (B,) value so it broadcasts against a (B, ...) array of rank ``ndim``."""
    value = _as_f32(value)
    return value.reshape(value.shape + (1,) * (ndim - value.ndim))


def _mean_over_sample(x: jax.Array) -> jax.Array:
    """(B, ...) -> (B,): mean over every non-batch axis."""
    return jnp.mean(x, axis=tuple(range(1, x.ndim)))


def _check_pair(latents: jax.Array, velocity: jax.Array) -> None:
    if latents.ndim < 1 or latents.shape != velocity.shape:
        raise ValueError(
            "latents and velocity must be (B, ...) arrays of one shape, got "
            f"{latents.shape} and {velocity.shape}"
        )


def _sigma_pair(sigmas: jax.Array, step_index: jax.Array) -> tuple[jax.Array, jax.Array]:
    sigmas = _as_f32(sigmas)
    index = jnp.asarray(step_index, dtype=jnp.int32)
    return sigmas[index], sigmas[index + 1]


def _draw(
    mean: jax.Array,
    std: jax.Array,
    key: jax.Array | None,
    noise: jax.Array | None,
    prev_sample: jax.Array | None,
) -> jax.Array:
    """x' = mean + std * eps, or the given (constant) prev_sample."""
    if prev_sample is not None:
        if key is not None or noise is not None:
            raise ValueError(
                "pass prev_sample (score a stored transition) or key/noise (draw one), not both"
            )
        if prev_sample.shape != mean.shape:
            raise ValueError(f"prev_sample shape {prev_sample.shape} != latents {mean.shape}")
        return jax.lax.stop_gradient(_as_f32(prev_sample))
    if (key is None) == (noise is None):
        raise ValueError("pass exactly one of key or noise to draw the transition")
    if noise is None:
        noise = jax.random.normal(key, mean.shape, dtype=jnp.float32)
    elif noise.shape != mean.shape:
        raise ValueError(f"noise shape {noise.shape} != latents {mean.shape}")
    return mean + _per_sample(std, mean.ndim) * _as_f32(noise)


def _safe_divisor(value: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(value == 0, value with zeros replaced by 1): the first half of the double-where trick.

    Evaluating the masked branch on a harmless 1 instead of 0 keeps its value and its gradient
    finite, so the outer ``where`` does not multiply a NaN gradient by zero (which is still NaN).
    """
    is_zero = value == 0
    return is_zero, jnp.where(is_zero, 1.0, value)


def _gaussian_log_prob(sample: jax.Array, mean: jax.Array, std: jax.Array) -> jax.Array:
    """Per-sample mean over elements of log N(sample; mean, std^2); 0 where std == 0.

    Because std is constant within a sample, the elementwise mean equals
    ``-mean((x' - mu)^2) / (2 s^2) - log s - log(2 pi) / 2``.
    """
    is_zero, safe_std = _safe_divisor(std)
    sq = _mean_over_sample(jnp.square(jax.lax.stop_gradient(sample) - mean))
    log_prob = -sq / (2.0 * jnp.square(safe_std)) - jnp.log(safe_std) - _HALF_LOG_2PI
    return jnp.where(is_zero, 0.0, log_prob)


def _sde_transition(
    latents: jax.Array,
    velocity: jax.Array,
    sigma: jax.Array,
    sigma_next: jax.Array,
    noise_scale: jax.Array,
    key: jax.Array | None,
    noise: jax.Array | None,
    prev_sample: jax.Array | None,
) -> StepOutput:
    """Shared Flow-GRPO / DanceGRPO SDE transition for a given diffusion coefficient g."""
    x = _as_f32(latents)
    v = _as_f32(velocity)
    g = _as_f32(noise_scale)
    ndim = x.ndim
    sigma_b = _per_sample(sigma, ndim)
    g_b = _per_sample(g, ndim)
    x1_hat = x + (1.0 - sigma_b) * v
    # The reverse SDE's drift: the ODE velocity plus the score correction g^2/(2 sigma) * x1_hat.
    delta = _per_sample(sigma_next - sigma, ndim)
    mean = x + delta * (v + jnp.square(g_b) / (2.0 * sigma_b) * x1_hat)
    std = g * jnp.sqrt(sigma - sigma_next)
    x_next = _draw(mean, std, key, noise, prev_sample)
    log_prob = _gaussian_log_prob(x_next, mean, std)
    std, g = jnp.broadcast_arrays(std, g)
    return StepOutput(x_next, log_prob, mean, std, g)


def flow_grpo_sde_step(
    latents: jax.Array,
    velocity: jax.Array,
    sigmas: jax.Array,
    step_index: jax.Array | int,
    noise_level: jax.Array | float,
    *,
    key: jax.Array | None = None,
    noise: jax.Array | None = None,
    prev_sample: jax.Array | None = None,
) -> StepOutput:
    """Flow-GRPO ``sde_type="sde"`` step (docs/algorithms.md A1; SD3, FLUX, Qwen-Image).

    With a = ``noise_level`` (scalar or (B,), may be traced; 0 gives the Euler step):
        g = a * sqrt(sigma / (1 - sigma~)),  sigma~ = sigmas[1] if sigma == 1 else sigma
        mu = x + Delta * (v + g^2 / (2 sigma) * x1_hat)
        s = g * sqrt(-Delta),  x' = mu + s * eps
        log_prob = mean_d[-(x'_d - mu_d)^2 / (2 s^2) - log s - log(2 pi) / 2]
    The sigma == 1 substitution (exact compare) avoids 0/0 at step 0 and makes s = a there.
    ``noise_scale`` is g. See the module docstring for shapes, dtypes and ``prev_sample``.
    """
    _check_pair(latents, velocity)
    sigma, sigma_next = _sigma_pair(sigmas, step_index)
    sigma_1 = _as_f32(sigmas)[1]
    sigma_tilde = jnp.where(sigma == 1.0, sigma_1, sigma)
    g = jnp.sqrt(sigma / (1.0 - sigma_tilde)) * _as_f32(noise_level)
    return _sde_transition(latents, velocity, sigma, sigma_next, g, key, noise, prev_sample)


def flow_grpo_wan_step(
    latents: jax.Array,
    velocity: jax.Array,
    sigmas: jax.Array,
    step_index: jax.Array | int,
    *,
    key: jax.Array | None = None,
    noise: jax.Array | None = None,
    prev_sample: jax.Array | None = None,
) -> StepOutput:
    """Flow-GRPO's Wan2.1 step (docs/algorithms.md A3; flow_grpo ``wan_pipeline_with_logprob.py``).

    The A1 transition with a noise scale linear in sigma and no noise_level knob:
        g = sigma_min + (sigma_max - sigma_min) * sigma,  sigma_max = sigmas[1],
        sigma_min = sigmas[-1] (0 for the UniPC ladder, so g = sigmas[1] * sigma).
    mu, s = g * sqrt(-Delta), x' and log_prob as in :func:`flow_grpo_sde_step`. ``noise_scale``
    is g, but Flow-GRPO's Wan KL divides by ``std`` (s), the true Gaussian KL.
    """
    _check_pair(latents, velocity)
    sigma, sigma_next = _sigma_pair(sigmas, step_index)
    ladder = _as_f32(sigmas)
    sigma_max, sigma_min = ladder[1], ladder[-1]
    g = sigma_min + (sigma_max - sigma_min) * sigma
    return _sde_transition(latents, velocity, sigma, sigma_next, g, key, noise, prev_sample)


def dance_grpo_step(
    latents: jax.Array,
    velocity: jax.Array,
    sigmas: jax.Array,
    step_index: jax.Array | int,
    eta: jax.Array | float,
    *,
    key: jax.Array | None = None,
    noise: jax.Array | None = None,
    prev_sample: jax.Array | None = None,
) -> StepOutput:
    """DanceGRPO ``flux_step`` with ``sde_solver=True`` (docs/algorithms.md A7).

    The A1 transition with a constant diffusion coefficient g = eta:
        mu = x + Delta * (v + eta^2 / (2 sigma) * x1_hat),  s = eta * sqrt(-Delta)
    (DanceGRPO writes the drift as a score term, ``-(x - (1 - sigma) x0_hat) / sigma^2``, which is
    the same thing). log_prob keeps the Gaussian constants. ``noise_scale`` is eta.
    """
    _check_pair(latents, velocity)
    sigma, sigma_next = _sigma_pair(sigmas, step_index)
    return _sde_transition(latents, velocity, sigma, sigma_next, eta, key, noise, prev_sample)


def flow_grpo_cps_step(
    latents: jax.Array,
    velocity: jax.Array,
    sigmas: jax.Array,
    step_index: jax.Array | int,
    noise_level: jax.Array | float,
    *,
    key: jax.Array | None = None,
    noise: jax.Array | None = None,
    prev_sample: jax.Array | None = None,
) -> StepOutput:
    """Flow-GRPO ``sde_type="cps"`` (coefficient-preserving) step (docs/algorithms.md A2).

    With a = ``noise_level`` (scalar or (B,), may be traced):
        s = sigma' * sin(a pi / 2)
        mu = (1 - sigma') * x0_hat + sqrt(sigma'^2 - s^2) * x1_hat,  x' = mu + s * eps
        log_prob = -mean_d (x'_d - mu_d)^2
    The log-prob is deliberately UNNORMALIZED (no 1/(2 s^2), no log s, no constants), as in
    Flow-GRPO; it is finite at s = 0. The noise coefficient ``sqrt(sigma'^2 - s^2)`` equals
    ``sigma' * |cos(a pi / 2)|`` for every a and is evaluated that way: no cancellation near
    a = 1 and never a square root of a rounding-negative number. It agrees with the signed
    ``sigma' * cos(a pi / 2)`` only for 0 <= a <= 1; for 1 < a <= 2 the cosine is negative
    and the square root (the original's value) keeps the coefficient non-negative.
    ``noise_scale`` is s: Flow-GRPO returns s where its SDE step returns g, so a KL on this
    step divides by s.
    """
    _check_pair(latents, velocity)
    sigma, sigma_next = _sigma_pair(sigmas, step_index)
    x = _as_f32(latents)
    v = _as_f32(velocity)
    ndim = x.ndim
    half_angle = _as_f32(noise_level) * (math.pi / 2.0)
    std = sigma_next * jnp.sin(half_angle)
    sigma_b = _per_sample(sigma, ndim)
    sigma_next_b = _per_sample(sigma_next, ndim)
    x0_hat = x - sigma_b * v
    x1_hat = x + (1.0 - sigma_b) * v
    x1_coef = _per_sample(sigma_next * jnp.abs(jnp.cos(half_angle)), ndim)
    mean = (1.0 - sigma_next_b) * x0_hat + x1_coef * x1_hat
    x_next = _draw(mean, std, key, noise, prev_sample)
    log_prob = -_mean_over_sample(jnp.square(jax.lax.stop_gradient(x_next) - mean))
    return StepOutput(x_next, log_prob, mean, std, std)


def euler_step(
    latents: jax.Array,
    velocity: jax.Array,
    sigmas: jax.Array,
    step_index: jax.Array | int,
) -> StepOutput:
    """Deterministic flow-matching Euler (ODE) step: x' = mu = x + Delta * v.

    ``log_prob`` is zeros (B,), ``std`` and ``noise_scale`` are zeros shaped like
    ``step_index``. Equals the SDE steps with zero noise.
    """
    _check_pair(latents, velocity)
    sigma, sigma_next = _sigma_pair(sigmas, step_index)
    x = _as_f32(latents)
    x_next = x + _per_sample(sigma_next - sigma, x.ndim) * _as_f32(velocity)
    zeros = jnp.zeros_like(sigma)
    return StepOutput(x_next, jnp.zeros(x.shape[:1], jnp.float32), x_next, zeros, zeros)


def gaussian_mean_kl(mean: jax.Array, ref_mean: jax.Array, divisor: jax.Array | float) -> jax.Array:
    """Per-sample Gaussian KL for a shared std: mean_d (mu_d - mu_ref_d)^2 / (2 divisor^2).

    ``mean``/``ref_mean``: (B, ...) step means of the policy and the reference model (any float
    dtype, computed in float32); ``divisor``: () or (B,). Returns (B,) float32; the caller
    averages over the batch and scales by beta. Which divisor (docs/algorithms.md A4):
      * Flow-GRPO SD3 / FLUX / Qwen-Image: ``StepOutput.noise_scale`` (g; dropping sqrt(-Delta)
        is deliberate upstream and beta is tuned for it);
      * Flow-GRPO Wan: ``StepOutput.std`` (s = g * sqrt(-Delta), the true KL).
    A zero divisor (a zero-noise step) yields 0 with finite gradients.
    """
    if mean.shape != ref_mean.shape or mean.ndim < 1:
        raise ValueError(
            f"mean {mean.shape} and ref_mean {ref_mean.shape} must be one (B, ...) shape"
        )
    is_zero, safe = _safe_divisor(_as_f32(divisor))
    sq = _mean_over_sample(jnp.square(_as_f32(mean) - _as_f32(ref_mean)))
    return jnp.where(is_zero, 0.0, sq / (2.0 * jnp.square(safe)))
