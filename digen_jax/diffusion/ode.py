"""Deterministic samplers for the flow-matching ODE dx/dsigma = v (docs/algorithms.md A12).

DiffusionNFT's rollouts integrate this ODE without noise and keep only the final latent, so no
log-prob is needed. Two solvers, both on the ladder conventions of ``steps.py`` (fp32 math,
``step_index`` a scalar or a (B,) array, possibly traced):

  * ``'euler'``: x' = x + (sigma' - sigma) v (:func:`digen_jax.diffusion.euler_step`).
  * ``'dpm2'``: DiffusionNFT's ``solver="dpm2"``, the multistep DPM-Solver++(2M) in the
    data-prediction form on the flow path alpha = 1 - sigma, with the reference's first-order
    steps at the ends (see :func:`dpm_solver_2m_step`).
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from digen_jax.diffusion.steps import _as_f32, _check_pair, _per_sample, _sigma_pair, euler_step

ODE_SOLVERS = ("euler", "dpm2")


class OdeStepOutput(NamedTuple):
    """prev_sample: x' (B, ...) float32; x0_hat: x - sigma v (B, ...) float32, the data
    prediction the next multistep update takes as ``prev_x0``."""

    prev_sample: jax.Array
    x0_hat: jax.Array


def _half_log_snr(sigma: jax.Array) -> jax.Array:
    """lambda = log((1 - sigma) / sigma); -inf at sigma = 1, +inf at sigma = 0."""
    return jnp.log(1.0 - sigma) - jnp.log(sigma)


def dpm_solver_2m_step(
    latents: jax.Array,
    velocity: jax.Array,
    sigmas: jax.Array,
    step_index: jax.Array | int,
    prev_x0: jax.Array | None = None,
) -> OdeStepOutput:
    """One DPM-Solver++(2M) step from sigma = sigmas[i] to sigma' = sigmas[i + 1].

    With D0 = x - sigma v (this step's data prediction), D_prev = ``prev_x0`` (step i - 1's),
    lambda(s) = log((1 - s) / s), h = lambda(sigma') - lambda(sigma) and
    h0 = lambda(sigma) - lambda(sigmas[i - 1]):
        x' = (sigma' / sigma) x + (1 - sigma') (1 - e^{-h}) (D0 + (h / (2 h0)) (D0 - D_prev)).
    The step is first order, x' = (sigma' / sigma) x + (1 - sigma') (1 - e^{-h}) D0 (which equals
    the Euler step x + (sigma' - sigma) v), where the reference takes it: at i = 0, at the last
    step i = N - 1 (so x' = D0 there) and when ``prev_x0`` is None. Where sigmas[i - 1] = 1,
    h0 is infinite and the correction vanishes, as in the reference (its step 1 on a ladder
    starting at 1 is first order too). All math is float32.
    """
    _check_pair(latents, velocity)
    x = _as_f32(latents)
    ndim = x.ndim
    ladder = _as_f32(sigmas)
    index = jnp.asarray(step_index, dtype=jnp.int32)
    sigma, sigma_next = _sigma_pair(ladder, index)
    sigma_b = _per_sample(sigma, ndim)
    x0_hat = x - sigma_b * _as_f32(velocity)
    first = euler_step(latents, velocity, ladder, index).prev_sample
    if prev_x0 is None:
        return OdeStepOutput(first, x0_hat)
    if prev_x0.shape != x.shape:
        raise ValueError(f"prev_x0 shape {prev_x0.shape} != latents {x.shape}")
    last = ladder.shape[0] - 2
    sigma_prev = ladder[jnp.maximum(index - 1, 0)]
    second_order = (index > 0) & (index < last) & (sigma_prev < 1.0)
    # Evaluate lambda only on safe values inside (0, 1) so masked lanes stay finite.
    safe = lambda s, ok: jnp.where(ok, s, 0.5)  # noqa: E731
    lam = _half_log_snr(safe(sigma, second_order))
    h = _half_log_snr(safe(sigma_next, second_order)) - lam
    h0 = lam - _half_log_snr(safe(sigma_prev, second_order))
    half_ratio = jnp.where(second_order, 0.5 * h / jnp.where(second_order, h0, 1.0), 0.0)
    coef = (1.0 - sigma_next) * -jnp.expm1(-h)
    d = x0_hat + _per_sample(half_ratio, ndim) * (x0_hat - _as_f32(prev_x0))
    second = _per_sample(sigma_next / safe(sigma, second_order), ndim) * x + _per_sample(coef, ndim) * d
    out = jnp.where(_per_sample(second_order, ndim), second, first)
    return OdeStepOutput(out, x0_hat)


def flow_ode_step(
    solver: str,
    latents: jax.Array,
    velocity: jax.Array,
    sigmas: jax.Array,
    step_index: jax.Array | int,
    prev_x0: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """One step of `solver` from sigmas[i] to sigmas[i + 1]: (x', the ``prev_x0`` the next step
    takes). Euler keeps no history (None); DPM2 passes its data prediction on."""
    if solver not in ODE_SOLVERS:
        raise ValueError(f"solver must be one of {ODE_SOLVERS}, got {solver!r}")
    if solver == "euler":
        return euler_step(latents, velocity, sigmas, step_index).prev_sample, None
    return tuple(dpm_solver_2m_step(latents, velocity, sigmas, step_index, prev_x0))


def solve_flow_ode(
    velocity_fn: Callable[[jax.Array, jax.Array], jax.Array],
    latents: jax.Array,
    sigmas: jax.Array,
    solver: str,
) -> jax.Array:
    """Integrate from sigmas[0] to sigmas[-1]; ``velocity_fn(x, sigma)`` gets sigma as a scalar.

    Returns the final latent (B, ...) float32. The Python loop unrolls the N steps.
    """
    ladder = _as_f32(sigmas)
    x = _as_f32(latents)
    prev_x0 = None
    for i in range(ladder.shape[0] - 1):
        x, prev_x0 = flow_ode_step(solver, x, velocity_fn(x, ladder[i]), ladder, i, prev_x0)
    return x
