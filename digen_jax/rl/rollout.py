"""Rollout: per-step jitted denoising with log-probs, collected into trajectories.

The unit of work is one denoising step of a batch (docs/design.md section 3): keeping it per
timestep, not one scan over the ladder, is what lets a scheduler interleave micro-batches
and hand trajectories between device groups at step boundaries.

Randomness is per sample: sample b's initial noise and its step-i noise come from
`fold_in(sample_keys[b], ...)`, so a trajectory does not depend on which batch or device
generated it (a group's samples may be spread over devices).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import flax
import jax
import jax.numpy as jnp
import numpy as np

from digen_jax import diffusion
from digen_jax.models.conversion import ModelFamily
from digen_jax.rl import lora

SDE_TYPES = ("sde", "cps", "wan", "dance")
# fold_in tag of a sample's initial noise (step noises use the step index 0..N-1).
_INITIAL_NOISE_TAG = 1 << 20


@flax.struct.dataclass
class Conditioning:
    """Prompt conditioning of a batch.

    text: (B, L, D) text-encoder states; pooled: (B, P) pooled vector (FLUX, HunyuanVideo)
    or None; mask: (B, L) right-padded validity mask (Qwen-Image, HunyuanVideo) or None.
    first_frame: (B, C, 1, h, w) float32, the clean latent of an image the video starts from
    (Wan2.2-TI2V's image conditioning), or None. The sampler keeps latent frame 0 equal to it
    at every step and steps, scores and trains only the frames after it (`generated`); the
    denoiser gives its tokens timestep 0. The same image conditions both halves of a CFG batch.
    """

    text: jax.Array
    pooled: jax.Array | None = None
    mask: jax.Array | None = None
    first_frame: jax.Array | None = None

    def take(self, index: jax.Array) -> "Conditioning":
        return jax.tree.map(lambda a: a[index], self)

    def repeat(self, times: int) -> "Conditioning":
        """Each prompt `times` times in a row (a group of G samples per prompt)."""
        return jax.tree.map(lambda a: jnp.repeat(a, times, axis=0), self)


# denoiser(params, latents, cond, sigma (B,)) -> velocity shaped like latents; params may be
# lora.LoraWeights (adapters applied inside the step, factored or merged as their mode says).
Denoiser = Callable[[Any, jax.Array, Conditioning, jax.Array], jax.Array]


def make_denoiser(family: ModelFamily, module, *, guidance: float = 0.0,
                  image_grid: tuple[int, int] | None = None) -> Denoiser:
    """A transformer of `family` (`module`, one built from its config) as a denoiser of latents at
    noise level sigma in [0, 1].

    The family's `denoiser_inputs` is how its transformer is called (docs/models.md section 2): the
    latent layout, the timestep and embedded-guidance conventions, position ids and masks.
    Image families take packed (B, S, C) tokens on the `image_grid` (rows, cols) token grid,
    video families (B, C, T, H, W) latents; `guidance` is the embedded guidance scale of
    guidance-distilled models.
    """
    if family.denoiser_inputs is None:
        raise ValueError(f"no denoiser for model family {family.name!r}")
    inputs = family.denoiser_inputs(module.cfg, guidance=guidance, image_grid=image_grid)

    def denoise(params, latents, cond, sigma):
        return module.apply(lora.model_variables(params), **inputs(latents, cond, sigma))

    return denoise


@dataclasses.dataclass(frozen=True)
class SamplerSpec:
    """How velocities become transitions.

    sde_type: 'sde' (Flow-GRPO A1), 'cps' (A2), 'wan' (A3), 'dance' (DanceGRPO A7, the
      noise level is eta). A noise level of 0 gives the Euler (ODE) step in every type.
    cfg_scale: true classifier-free guidance scale; 1 disables it (one forward per step).
      With CFG the negative and positive batches run as one forward, [negative, positive].
    cfg_rescale: rescale the guided velocity per token to the norm of the conditional one
      (Qwen-Image's true-CFG norm rescale).
    cfg_scale_2: a second scale for the steps whose timestep (sigma * 1000) is below
      `boundary_timestep`, as diffusers' Wan2.2 pipelines guide their low-noise expert
      (`guidance_scale_2`); None: `cfg_scale` on every step.
    """

    sde_type: str = "sde"
    cfg_scale: float = 1.0
    cfg_rescale: bool = False
    cfg_scale_2: float | None = None
    boundary_timestep: float | None = None

    def __post_init__(self):
        if self.sde_type not in SDE_TYPES:
            raise ValueError(f"sampling.sde_type must be one of {SDE_TYPES}, got {self.sde_type!r}")
        if self.cfg_scale < 1.0:
            raise ValueError(f"sampling.cfg_scale must be >= 1 (1 disables CFG), got {self.cfg_scale}")
        if self.cfg_scale_2 is not None:
            if self.boundary_timestep is None:
                raise ValueError("sampling.cfg_scale_2 guides the low-noise expert of a pair (Wan2.2-A14B); "
                                 "this model has one transformer: leave it unset")
            if self.cfg_scale == 1.0 or self.cfg_scale_2 < 1.0:
                raise ValueError(f"sampling.cfg_scale_2={self.cfg_scale_2} needs true CFG on (sampling.cfg_scale > 1) "
                                 "and must be >= 1")


def guided_velocity(
    denoiser: Denoiser,
    spec: SamplerSpec,
    params,
    latents: jax.Array,
    cond: Conditioning,
    sigma: jax.Array,
    negative: Conditioning | None,
) -> jax.Array:
    """The post-guidance velocity in float32 (identical in rollout and training)."""
    if spec.cfg_scale == 1.0:
        return denoiser(params, latents, cond, sigma).astype(jnp.float32)
    scale = spec.cfg_scale
    if spec.cfg_scale_2 is not None:  # per sample, on the side of the boundary its expert is chosen by
        high = sigma * 1000.0 >= spec.boundary_timestep
        scale = jnp.where(high, spec.cfg_scale, spec.cfg_scale_2).reshape(-1, *([1] * (latents.ndim - 1)))
    batch = latents.shape[0]
    negative = negative.replace(first_frame=cond.first_frame)  # the image conditions both halves
    neg = jax.tree.map(lambda n, c: jnp.broadcast_to(n, c.shape), negative, cond)
    both = denoiser(
        params,
        jnp.concatenate([latents, latents]),
        jax.tree.map(lambda n, c: jnp.concatenate([n, c]), neg, cond),
        jnp.concatenate([sigma, sigma]),
    ).astype(jnp.float32)
    v_neg, v_pos = both[:batch], both[batch:]
    guided = v_neg + scale * (v_pos - v_neg)
    if spec.cfg_rescale:
        norm = lambda v: jnp.linalg.norm(v, axis=-1, keepdims=True)  # noqa: E731
        guided = guided * norm(v_pos) / jnp.maximum(norm(guided), 1e-12)
    return guided


def sampler_step(
    sde_type: str,
    latents: jax.Array,
    velocity: jax.Array,
    sigmas: jax.Array,
    step_index: jax.Array,
    noise_level: jax.Array,
    **draw,
) -> diffusion.StepOutput:
    """Dispatch to the step function of `sde_type` (`draw`: key, noise or prev_sample)."""
    if sde_type == "sde":
        return diffusion.flow_grpo_sde_step(latents, velocity, sigmas, step_index, noise_level, **draw)
    if sde_type == "cps":
        return diffusion.flow_grpo_cps_step(latents, velocity, sigmas, step_index, noise_level, **draw)
    if sde_type == "dance":
        return diffusion.dance_grpo_step(latents, velocity, sigmas, step_index, noise_level, **draw)
    # 'wan' has no noise-level knob (g = sigma_1 * sigma); a zero noise level still means ODE.
    out = diffusion.flow_grpo_wan_step(latents, velocity, sigmas, step_index, **draw)
    if "prev_sample" in draw:
        return out
    ode = diffusion.euler_step(latents, velocity, sigmas, step_index)
    is_ode = jnp.reshape(noise_level == 0, (-1,) + (1,) * (latents.ndim - 1))
    return out._replace(
        prev_sample=jnp.where(is_ode, ode.prev_sample, out.prev_sample),
        log_prob=jnp.where(noise_level == 0, 0.0, out.log_prob),
    )


def generated(x: jax.Array, cond: Conditioning) -> jax.Array:
    """The part of (B, C, T, ...) video latents (or velocities, noises) that sampling generates:
    every latent frame after a conditioning first frame (`cond.first_frame`), else all of it."""
    return x if cond.first_frame is None else x[:, :, 1:]


def with_first_frame(generated_part: jax.Array, cond: Conditioning) -> jax.Array:
    """Whole latents from their `generated` part: the clean conditioning frame in front, if any."""
    if cond.first_frame is None:
        return generated_part
    return jnp.concatenate([cond.first_frame.astype(generated_part.dtype), generated_part], axis=2)


def kl_divisor(sde_type: str, out: diffusion.StepOutput) -> jax.Array:
    """The KL divisor of the reference recipes: g for sde/dance/cps (cps reports s as g), s for Wan."""
    return out.std if sde_type == "wan" else out.noise_scale


@flax.struct.dataclass
class Trajectory:
    """A batch of sampled ladders.

    latents: (B, N + 1, ...) float32, x_0 = initial noise ... x_N = the sample (with a
      conditioning first frame, latent frame 0 is that frame's clean latent at every step).
    log_probs: (B, N) behaviour log-probs (0 on zero-noise steps), over the generated latents.
    means: (B, N, ...) the transition means of the generated latents (`generated`).
    noise_levels: (N,) the noise level each step used.
    sample_keys: (B,) the PRNG keys the noises came from (the samples' seeds).
    version: () int32, the policy version that generated every step of every sample.
    """

    latents: jax.Array
    log_probs: jax.Array
    means: jax.Array
    noise_levels: jax.Array
    sample_keys: jax.Array
    version: jax.Array

    @property
    def final(self) -> jax.Array:
        return self.latents[:, -1]


@flax.struct.dataclass
class FinalSamples:
    """A batch of deterministic (ODE) samples kept as DiffusionNFT keeps them: no path, no
    log-probs (docs/algorithms.md section A12), so moving one to the trainer moves only this.

    final: (B, ...) float32, the latents the ODE solver reached.
    sample_keys: (B,) the PRNG keys of the initial noises (the samples' seeds).
    version: () int32, the (old-)policy version that generated every sample.
    """

    final: jax.Array
    sample_keys: jax.Array
    version: jax.Array


def initial_noise(sample_keys: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """x_0 of each sample: standard normal of `shape` from its own key."""
    return jax.vmap(lambda k: jax.random.normal(jax.random.fold_in(k, _INITIAL_NOISE_TAG), shape))(sample_keys)


_initial_noise = jax.jit(initial_noise, static_argnums=1)


@functools.partial(jax.jit, static_argnums=1)
def _start(sample_keys: jax.Array, shape: tuple[int, ...], first_frame: jax.Array | None) -> jax.Array:
    """x_0 of a rollout: each sample's initial noise, its latent frame 0 the clean conditioning
    frame if there is one (`Conditioning.first_frame`)."""
    noise = initial_noise(sample_keys, shape)
    return noise if first_frame is None else noise.at[:, :, :1].set(first_frame.astype(noise.dtype))


@jax.jit
def _stack_steps(path, log_probs, means):
    """(B, N + 1, ...) latents, (B, N) log-probs, (B, N, ...) means from the per-step lists."""
    return jnp.stack(path, axis=1), jnp.stack(log_probs, axis=1), jnp.stack(means, axis=1)


class Sampler:
    """Jitted per-step denoising for one model, ladder and sampler spec.

    `step(params, latents, cond, step_index, noise_level, sample_keys)` advances a batch
    by one step and returns (latents', log_prob, mean); `rollout` runs the ladder.
    """

    def __init__(self, denoiser: Denoiser, spec: SamplerSpec, sigmas: np.ndarray, negative: Conditioning | None = None):
        if spec.cfg_scale != 1.0 and negative is None:
            raise ValueError("sampling.cfg_scale > 1 needs negative-prompt conditioning")
        self.denoiser = denoiser
        self.spec = spec
        self.sigmas = jnp.asarray(sigmas, jnp.float32)
        self.negative = negative
        self.num_steps = len(sigmas) - 1
        self.step = jax.jit(self._step)
        self.ode_step = jax.jit(self._ode_step, static_argnames="solver")

    def velocity(self, params, latents, cond, step_index):
        sigma = jnp.broadcast_to(self.sigmas[step_index], (latents.shape[0],))
        return guided_velocity(self.denoiser, self.spec, params, latents, cond, sigma, self.negative)

    def transition(self, params, latents, cond, step_index, noise_level, **draw) -> diffusion.StepOutput:
        """Velocity then step; `draw` is noise=... (rollout) or prev_sample=... (training).

        The step, its log-prob and mean cover the `generated` latents only: a conditioning first
        frame is input to the denoiser, never a transition (rollout and training alike)."""
        v = self.velocity(params, latents, cond, step_index)
        draw = {name: generated(x, cond) for name, x in draw.items()}
        return sampler_step(self.spec.sde_type, generated(latents, cond), generated(v, cond), self.sigmas, step_index,
                            noise_level, **draw)

    def _step(self, params, latents, cond, step_index, noise_level, sample_keys):
        noise = jax.vmap(lambda k: jax.random.normal(jax.random.fold_in(k, step_index), latents.shape[1:]))(sample_keys)
        out = self.transition(params, latents, cond, step_index, noise_level, noise=noise)
        return with_first_frame(out.prev_sample, cond), out.log_prob, out.mean

    def _ode_step(self, params, latents, prev_x0, cond, step_index, solver: str):
        v = self.velocity(params, latents, cond, step_index)
        return diffusion.flow_ode_step(solver, latents, v, self.sigmas, step_index, prev_x0)

    def ode_rollout(self, params, cond: Conditioning, sample_keys: jax.Array, latent_shape, version,
                    solver: str) -> FinalSamples:
        """Integrate the ladder deterministically with `solver` (diffusion.ODE_SOLVERS) from each
        sample's initial noise (the one `rollout` starts from); one program per step, as `rollout`."""
        if cond.first_frame is not None:
            raise ValueError("ODE rollouts (DiffusionNFT) do not take a conditioning first frame")
        latents = _initial_noise(sample_keys, tuple(latent_shape))
        prev_x0 = None
        for i in range(self.num_steps):
            latents, prev_x0 = self.ode_step(params, latents, prev_x0, cond, i, solver=solver)
        return FinalSamples(final=latents, sample_keys=sample_keys, version=jnp.array(version, jnp.int32))

    def rollout(self, params, cond: Conditioning, sample_keys: jax.Array, noise_levels, latent_shape, version) -> Trajectory:
        """Sample the whole ladder for a batch; every step dispatched asynchronously.

        Twelve programs per batch (initial noise, N steps, one stack): the GPU client admits
        32 programs in flight per device before the dispatching thread blocks, and that thread
        must stay ahead of every device group at once. The noise levels are indexed on the host.
        """
        levels = np.asarray(noise_levels, np.float32)
        latents = _start(sample_keys, tuple(latent_shape), cond.first_frame)
        path, log_probs, means = [latents], [], []
        for i in range(self.num_steps):
            latents, log_prob, mean = self.step(params, latents, cond, i, levels[i], sample_keys)
            path.append(latents)
            log_probs.append(log_prob)
            means.append(mean)
        latents, log_probs, means = _stack_steps(path, log_probs, means)
        return Trajectory(
            latents=latents,
            log_probs=log_probs,
            means=means,
            noise_levels=jnp.asarray(levels),
            sample_keys=sample_keys,
            version=jnp.array(version, jnp.int32),  # a copy: the trainer donates its state
        )
