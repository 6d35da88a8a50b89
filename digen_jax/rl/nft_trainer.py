"""The DiffusionNFT trainer (`rl.algorithm='nft'`, docs/algorithms.md section A12).

Rollouts sample the *old* policy deterministically (an ODE solver, no CFG) and keep only the
final latents (`rollout.FinalSamples`). A training unit is one (sample, trained noise level)
pair: the sample's clean latent x0 is noised to x_t = (1 - t) x0 + t eps at one of the K levels
the iteration drew for it (`timesteps.plan_steps`), with eps derived from the sample's own key
and the level, so a unit does not depend on which batch, chunk or device trains it. Units are
cut into gradient micro-batches and accumulated, and the update guarded, as every algorithm's
(`trainer.Trainer`). Once per iteration, inside its last update (the reference moves it
after each epoch, however many optimizer steps that made), the old policy moves towards the
trained weights by the configured decay schedule (`nft.update_old_policy`, with the update count
so far as its step), on device.

The old policy is a second trainable tree in the train state (`TrainState.old`, adapters only
with LoRA); it is what rollouts sample with, so a weight sync carries it and a trace's
`version` names the old-policy version that generated each sample.
"""
from __future__ import annotations

import dataclasses

import flax
import jax
import jax.numpy as jnp
import optax

from digen_jax.diffusion import ODE_SOLVERS
from digen_jax.rl import nft
from digen_jax.rl.rollout import Conditioning, FinalSamples, Sampler
from digen_jax.rl.trainer import GradSum, LossConfig, Trainer, TrainState

# fold_in tag base of a unit's training noise: tag + ladder index (apart from the rollout's tags).
_TRAIN_NOISE_TAG = 1 << 21


@dataclasses.dataclass(frozen=True)
class NftConfig:
    """DiffusionNFT's own settings (the KL weight and advantage clip are LossConfig's)."""

    solver: str = "dpm2"  # diffusion.ODE_SOLVERS: the rollout's ODE solver
    beta: float = 1.0  # policy mixing strength (the reference's `beta`)
    decay: str = "ramp"  # nft.NFT_DECAY_SCHEDULES: the old policy's decay schedule

    def __post_init__(self):
        if self.solver not in ODE_SOLVERS:
            raise ValueError(f"rl.nft_solver must be one of {ODE_SOLVERS}, got {self.solver!r}")
        if not self.beta > 0:
            raise ValueError(f"rl.nft_beta must be > 0, got {self.beta}")
        if self.decay not in nft.NFT_DECAY_SCHEDULES:
            raise ValueError(f"rl.nft_decay must be one of {tuple(nft.NFT_DECAY_SCHEDULES)}, got {self.decay!r}")


@flax.struct.dataclass
class NftUnits:
    """A flat batch of DiffusionNFT training units (leading axis U)."""

    x0: jax.Array  # the sample's final latent
    x_t: jax.Array  # x0 noised to the unit's level
    step_index: jax.Array  # the level's ladder index: t = sigmas[step_index]
    advantages: jax.Array
    cond: Conditioning

    @property
    def size(self) -> int:
        return self.step_index.shape[0]

    def slice(self, start: int, stop: int) -> "NftUnits":
        return jax.tree.map(lambda a: a[start:stop], self)


def training_noise(sample_keys: jax.Array, step_index: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """(U, *shape) standard normal: unit u's noise from its sample's key and its ladder index."""
    draw = lambda key, i: jax.random.normal(jax.random.fold_in(key, _TRAIN_NOISE_TAG + i), shape)  # noqa: E731
    return jax.vmap(draw)(sample_keys, step_index)


@jax.jit
def build_nft_units(samples: FinalSamples, cond: Conditioning, advantages: jax.Array, trained: jax.Array,
                    sigmas: jax.Array) -> NftUnits:
    """Units for every (sample b, level trained[b, k]), flattened sample-major."""
    batch, per_sample = trained.shape
    rows = jnp.repeat(jnp.arange(batch), per_sample)
    steps = trained.reshape(-1)
    x0 = samples.final[rows]
    noise = training_noise(samples.sample_keys[rows], steps, x0.shape[1:])
    return NftUnits(
        x0=x0,
        x_t=nft.forward_point(x0, sigmas[steps], noise),
        step_index=steps,
        advantages=advantages[rows],
        cond=cond.take(rows),
    )


class NftTrainer(Trainer):
    """DiffusionNFT's rollout, units, loss and old policy over the shared `Trainer`."""

    trajectory_type = FinalSamples

    def __init__(self, sampler: Sampler, frozen, optimizer: optax.GradientTransformation, cfg: LossConfig,
                 nft_cfg: NftConfig):
        self.nft = nft_cfg
        super().__init__(sampler, frozen, optimizer, cfg)

    def init_state(self, trainable) -> TrainState:
        """The shared initial state plus the old policy, a copy of the trained weights."""
        return super().init_state(trainable).replace(old=jax.tree.map(jnp.copy, trainable))

    def rollout(self, params, cond: Conditioning, sample_keys: jax.Array, noise_levels, latent_shape, version) -> FinalSamples:
        """The ODE samples of `params` (the old policy's sampling weights); noise levels are unused."""
        return self.sampler.ode_rollout(params, cond, sample_keys, latent_shape, version, self.nft.solver)

    def rollout_weights(self, state: TrainState):
        return state.old

    def build_units(self, traj: FinalSamples, cond: Conditioning, advantages: jax.Array, trained: jax.Array) -> NftUnits:
        return build_nft_units(traj, cond, advantages, trained, self.sampler.sigmas)

    def train_chunk(self, acc: GradSum, state: TrainState, chunk: NftUnits, on_policy: bool = False) -> None:
        """One gradient micro-batch against `state`'s old policy (`on_policy` plays no part)."""
        (_, metrics), grads = self._grad(state.trainable, state.old, self.frozen, chunk)
        self.accumulate_chunk(acc, grads, metrics)

    def _loss(self, trainable, old, frozen, units: NftUnits):
        """DiffusionNFT's loss of `units` (`nft.nft_loss`); the old and frozen weights are arguments."""
        cfg, sampler = self.cfg, self.sampler
        velocity = lambda params: sampler.velocity(params, units.x_t, units.cond, units.step_index)  # noqa: E731
        v_theta = velocity(self._params_for(trainable, frozen))
        v_old = velocity(self._params_for(old, frozen))
        v_ref = velocity(frozen) if cfg.kl_beta > 0 else None
        loss, metrics = nft.nft_loss(
            v_theta, v_old, units.x0, units.x_t, sampler.sigmas[units.step_index], units.advantages,
            beta=self.nft.beta, adv_clip=cfg.adv_clip, v_ref=v_ref, kl_coef=cfg.kl_beta,
        )
        return loss, dict(metrics, loss=loss)

    def _next_old(self, old, trainable, version):
        return nft.update_old_policy(old, trainable, version, self.nft.decay)
