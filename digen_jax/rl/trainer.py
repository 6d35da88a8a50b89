"""The GRPO trainer: training units, the loss, gradient accumulation and the guarded update.

A *training unit* is one (trajectory, trained step) pair (DESIGN.md vocabulary). Units of
a batch are independent, so they are flattened into one leading axis and cut into
micro-batches; gradients are summed over micro-batches and averaged once per optimizer
update, which makes the update independent of how units were grouped.

The trainable tree is either the full parameters or LoRA adapters over frozen base
weights; the forward always sees `params_for(trainable)`. The reference policy of the
KL term is the frozen base (LoRA) or a frozen copy of the initial weights (full
fine-tuning), kept only when the KL coefficient is non-zero.

Non-finite rewards, losses or gradients skip the update on device (parameters, optimizer
state and EMA stay as they were) and count a streak the host reads one step late.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import flax
import jax
import jax.numpy as jnp
import optax

from digen_jax.rl import losses, lora, optim
from digen_jax.rl.rollout import Conditioning, Sampler, Trajectory, kl_divisor


@flax.struct.dataclass
class TrainUnits:
    """A flat batch of training units (leading axis U)."""

    latents: jax.Array  # x_j
    next_latents: jax.Array  # x_{j+1}, the stored sample whose log-prob is trained
    step_index: jax.Array  # j
    noise_level: jax.Array
    old_log_prob: jax.Array  # behaviour log-prob recorded at rollout
    advantages: jax.Array
    cond: Conditioning
    # Log-prob under the policy at the start of this update (decoupled PPO); None: on-policy form.
    proximal_log_prob: jax.Array | None = None

    @property
    def size(self) -> int:
        return self.step_index.shape[0]

    def slice(self, start: int, stop: int) -> "TrainUnits":
        return jax.tree.map(lambda a: a[start:stop], self)


@jax.jit
def build_units(traj: Trajectory, cond: Conditioning, advantages: jax.Array, trained: jax.Array) -> TrainUnits:
    """Units for every (sample b, trained step trained[b, t]), flattened sample-major."""
    batch, per_sample = trained.shape
    rows = jnp.repeat(jnp.arange(batch), per_sample)
    steps = trained.reshape(-1)
    return TrainUnits(
        latents=traj.latents[rows, steps],
        next_latents=traj.latents[rows, steps + 1],
        step_index=steps,
        noise_level=traj.noise_levels[steps],
        old_log_prob=traj.log_probs[rows, steps],
        advantages=advantages[rows],
        cond=cond.take(rows),
    )


@flax.struct.dataclass
class TrainState:
    version: jax.Array  # optimizer updates applied: the policy version
    trainable: Any
    opt_state: Any
    ema: Any
    nonfinite_streak: jax.Array  # consecutive skipped updates


@dataclasses.dataclass(frozen=True)
class LossConfig:
    clip_range: float = 1e-4
    adv_clip: float = 5.0
    kl_beta: float = 0.0
    # Decoupled PPO for stale samples: the ratio is taken against the policy at the start of
    # each update and the behaviour policy enters through importance weights capped here.
    decoupled: bool = False
    is_cap: float | None = None
    lora_scale: float | None = None  # None: full fine-tuning
    ema_decay: float | None = None  # None: Flow-GRPO warm-up schedule
    ema_every: int = 8
    use_ema: bool = True


class Trainer:
    """Jitted pieces of a GRPO update for one sampler (model, ladder, guidance, step type)."""

    def __init__(self, sampler: Sampler, frozen: Any, optimizer: optax.GradientTransformation, cfg: LossConfig):
        self.sampler = sampler
        self.frozen = frozen  # LoRA: the base weights; full FT: the reference copy or None
        self.optimizer = optimizer
        self.cfg = cfg
        self.grad_fn = jax.jit(jax.value_and_grad(self._loss, has_aux=True))
        self.accumulate = jax.jit(lambda acc, g: jax.tree.map(jnp.add, acc, g), donate_argnums=(0,))
        self.apply_update = jax.jit(self._apply_update, donate_argnums=(0,))
        self.params_for = jax.jit(self._params_for)
        self.log_prob_fn = jax.jit(self._log_prob)

    def init_state(self, trainable) -> TrainState:
        return TrainState(
            version=jnp.zeros((), jnp.int32),
            trainable=trainable,
            opt_state=self.optimizer.init(trainable),
            ema=jax.tree.map(jnp.copy, trainable) if self.cfg.use_ema else None,
            nonfinite_streak=jnp.zeros((), jnp.int32),
        )

    def _params_for(self, trainable):
        if self.cfg.lora_scale is None:
            return trainable
        return lora.merge_lora(self.frozen, trainable, scale=self.cfg.lora_scale)

    def sampling_params(self, trainable, merge: bool = True):
        """Weights for rollout: LoRA merged once (`merge`) or applied on the fly in every step."""
        if self.cfg.lora_scale is None or merge:
            return self.params_for(trainable)
        return lora.LoraWeights(self.frozen, trainable, self.cfg.lora_scale)

    def _log_prob(self, trainable, units: TrainUnits):
        return self.sampler.transition(
            self._params_for(trainable), units.latents, units.cond, units.step_index, units.noise_level,
            prev_sample=units.next_latents,
        ).log_prob

    def _loss(self, trainable, units: TrainUnits):
        cfg, sampler = self.cfg, self.sampler
        out = sampler.transition(
            self._params_for(trainable), units.latents, units.cond, units.step_index, units.noise_level,
            prev_sample=units.next_latents,
        )
        loss, metrics = losses.policy_loss(
            out.log_prob,
            units.old_log_prob,
            units.advantages,
            clip_range=cfg.clip_range,
            adv_clip=cfg.adv_clip,
            proximal_log_prob=units.proximal_log_prob,
            is_cap=cfg.is_cap if units.proximal_log_prob is not None else None,
        )
        if cfg.kl_beta > 0:
            ref = sampler.transition(
                self.frozen, units.latents, units.cond, units.step_index, units.noise_level,
                prev_sample=units.next_latents,
            )
            kl = losses.policy_kl_loss(out.mean, jax.lax.stop_gradient(ref.mean), kl_divisor(sampler.spec.sde_type, out))
            loss = loss + cfg.kl_beta * kl
        else:
            kl = jnp.zeros((), jnp.float32)
        metrics = dict(metrics, kl=kl, policy_loss=loss - cfg.kl_beta * kl, loss=loss)
        return loss, metrics

    def _apply_update(self, state: TrainState, grad_sum, count, rewards_finite):
        grads = jax.tree.map(lambda g: g / count, grad_sum)
        grad_norm = optax.tree.norm(grads)
        ok = rewards_finite & jnp.isfinite(grad_norm)
        updates, opt_state = self.optimizer.update(grads, state.opt_state, state.trainable)
        trainable = optax.apply_updates(state.trainable, updates)
        keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, old)  # noqa: E731
        ema = state.ema
        if ema is not None:
            decay = {} if self.cfg.ema_decay is None else {"decay": self.cfg.ema_decay}
            ema = keep(optim.ema_update(ema, trainable, state.version, update_every=self.cfg.ema_every, **decay), ema)
        new_state = TrainState(
            version=state.version + ok.astype(jnp.int32),
            trainable=keep(trainable, state.trainable),
            opt_state=keep(opt_state, state.opt_state),
            ema=ema,
            nonfinite_streak=jnp.where(ok, 0, state.nonfinite_streak + 1),
        )
        # Fresh outputs (not views of the state, which the next update donates).
        metrics = {
            "grad_norm": grad_norm,
            "skipped": 1 - ok.astype(jnp.int32),
            "version": new_state.version + 0,
            "nonfinite_streak": new_state.nonfinite_streak + 0,
        }
        return new_state, metrics

    def update(self, state: TrainState, units: TrainUnits, micro_batch: int, rewards_finite) -> tuple[TrainState, dict]:
        """One optimizer update over all `units`, accumulated in micro-batches of `micro_batch`."""
        if units.size % micro_batch:
            raise ValueError(f"{units.size} training units do not split into micro-batches of {micro_batch}")
        grad_sum, metric_sum = None, None
        count = units.size // micro_batch
        chunks = [units.slice(start, start + micro_batch) for start in range(0, units.size, micro_batch)]
        if self.cfg.decoupled:
            chunks = [c.replace(proximal_log_prob=self.log_prob_fn(state.trainable, c)) for c in chunks]
        for chunk in chunks:
            (_, metrics), grads = self.grad_fn(state.trainable, chunk)
            grad_sum = grads if grad_sum is None else self.accumulate(grad_sum, grads)
            metric_sum = metrics if metric_sum is None else jax.tree.map(jnp.add, metric_sum, metrics)
        finite = jnp.asarray(rewards_finite) & jnp.isfinite(metric_sum["loss"])
        state, update_metrics = self.apply_update(state, grad_sum, jnp.float32(count), finite)
        metrics = {k: v / count for k, v in metric_sum.items()}
        return state, {**metrics, **update_metrics}
