"""The GRPO trainer: training units, the loss, gradient accumulation and the guarded update.

A *training unit* is one (trajectory, trained step) pair (DESIGN.md vocabulary). Units of
a batch are independent, so they are flattened into one leading axis and cut into
micro-batches; gradients are summed over micro-batches and averaged once per optimizer
update, which makes the update independent of how units were grouped.

The trainable tree is either the full parameters or LoRA adapters over frozen base
weights; the forward always sees `params_for(trainable)`. The reference policy of the
KL term is the frozen base (LoRA) or a frozen copy of the initial weights (full
fine-tuning), kept only when the KL coefficient is non-zero.

Non-finite rewards, losses, gradients or updates, and an update larger than
`max_update_ratio` times the parameters' norm, skip the update on device (parameters,
optimizer state and EMA stay as they were) and count a streak the host reads one step late.
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
    lora_mode: str = "factored"  # how the train step applies LoRA: lora.LORA_MODES
    ema_decay: float | None = None  # None: Flow-GRPO warm-up schedule
    ema_every: int = 8
    use_ema: bool = True
    # Updates with ||update|| > max_update_ratio * ||trainable|| are skipped as diverged (inf: no
    # bound). A healthy AdamW step moves each weight by about the learning rate, a small fraction
    # of the weights' typical magnitude; a step as large as the weights themselves replaces the model.
    max_update_ratio: float = 1.0


class Trainer:
    """Jitted pieces of a GRPO update for one sampler (model, ladder, guidance, step type)."""

    def __init__(self, sampler: Sampler, frozen: Any, optimizer: optax.GradientTransformation, cfg: LossConfig):
        self.sampler = sampler
        self.frozen = frozen  # LoRA: the base weights; full FT: the reference copy or None
        self.optimizer = optimizer
        self.cfg = cfg
        # The frozen weights enter every jitted function as an argument: closed over, they
        # would be baked into the executable as constants (the whole base model).
        self._grad = jax.jit(jax.value_and_grad(self._loss, has_aux=True))
        self._log_prob_jit = jax.jit(self._log_prob)
        self._merged = jax.jit(lambda trainable, frozen: self._params_for(trainable, frozen, "merged"))
        self.accumulate = jax.jit(lambda acc, g: jax.tree.map(jnp.add, acc, g), donate_argnums=(0,))
        self.apply_update = jax.jit(self._apply_update, donate_argnums=(0,))

    def pin_state_sharding(self, state_sharding: Any) -> None:
        """Give updated states exactly `state_sharding`, so a state restored with it runs the same
        compiled programs (and the same reduction order) as the live one."""
        self.apply_update = jax.jit(self._apply_update, donate_argnums=(0,), out_shardings=(state_sharding, None))

    def grad_fn(self, trainable, units: "TrainUnits"):
        """((loss, metrics), gradients w.r.t. `trainable`) of a batch of units."""
        return self._grad(trainable, self.frozen, units)

    def log_prob_fn(self, trainable, units: "TrainUnits") -> jax.Array:
        return self._log_prob_jit(trainable, self.frozen, units)

    def params_for(self, trainable):
        """Merged weights (a plain tree) for sampling, evaluation and export."""
        return self._merged(trainable, self.frozen)

    def init_state(self, trainable) -> TrainState:
        return TrainState(
            version=jnp.zeros((), jnp.int32),
            trainable=trainable,
            opt_state=self.optimizer.init(trainable),
            ema=jax.tree.map(jnp.copy, trainable) if self.cfg.use_ema else None,
            nonfinite_streak=jnp.zeros((), jnp.int32),
        )

    def _params_for(self, trainable, frozen, mode: str | None = None):
        """The weights the forward sees. LoRA: the frozen base with the adapters applied as
        `mode` says (None: `cfg.lora_mode`); 'factored' keeps the backward pass free of
        kernel-sized weight gradients, 'merged' returns `W + s * A @ B` as a plain tree."""
        if self.cfg.lora_scale is None:
            return trainable
        mode = lora.check_lora_mode(self.cfg.lora_mode if mode is None else mode)
        if mode == "merged":
            return lora.merge_lora(frozen, trainable, scale=self.cfg.lora_scale)
        return lora.LoraWeights(frozen, trainable, self.cfg.lora_scale, mode)

    def sampling_params(self, trainable, merge: bool = True):
        """Weights for rollout: LoRA merged once (`merge`) or applied in every step as
        `cfg.lora_mode` says."""
        if self.cfg.lora_scale is None or merge:
            return self.params_for(trainable)
        mode = lora.check_lora_mode(self.cfg.lora_mode)
        return lora.LoraWeights(self.frozen, trainable, self.cfg.lora_scale, mode)

    def _log_prob(self, trainable, frozen, units: TrainUnits):
        return self.sampler.transition(
            self._params_for(trainable, frozen), units.latents, units.cond, units.step_index, units.noise_level,
            prev_sample=units.next_latents,
        ).log_prob

    def _loss(self, trainable, frozen, units: TrainUnits):
        cfg, sampler = self.cfg, self.sampler
        out = sampler.transition(
            self._params_for(trainable, frozen), units.latents, units.cond, units.step_index, units.noise_level,
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
                frozen, units.latents, units.cond, units.step_index, units.noise_level,
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
        updates, opt_state = self.optimizer.update(grads, state.opt_state, state.trainable)
        trainable = optax.apply_updates(state.trainable, updates)
        # The parameters themselves are checked, not only what produced them: a learning rate of
        # nan or 1e6 gives finite rewards, losses and gradients but non-finite or exploded weights.
        update_norm, param_norm = optax.tree.norm(updates), optax.tree.norm(state.trainable)
        ok = rewards_finite & jnp.isfinite(grad_norm) & jnp.isfinite(update_norm)
        ok &= jnp.isfinite(optax.tree.norm(trainable))
        if self.cfg.max_update_ratio != float("inf"):
            ok &= update_norm <= self.cfg.max_update_ratio * param_norm
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
            "update_ratio": update_norm / param_norm,
            "skipped": 1 - ok.astype(jnp.int32),
            "version": new_state.version + 0,
            "nonfinite_streak": new_state.nonfinite_streak + 0,
        }
        return new_state, metrics

    def add_chunk(self, acc: "GradSum", trainable, chunk: TrainUnits) -> None:
        """Add one gradient micro-batch's gradients and metrics to `acc` (asynchronous)."""
        if self.cfg.decoupled:  # the proximal policy: the weights at the start of this update
            chunk = chunk.replace(proximal_log_prob=self.log_prob_fn(trainable, chunk))
        (_, metrics), grads = self.grad_fn(trainable, chunk)
        acc.grads = grads if acc.grads is None else self.accumulate(acc.grads, grads)
        acc.metrics = metrics if acc.metrics is None else jax.tree.map(jnp.add, acc.metrics, metrics)
        acc.count += 1

    def finish_update(self, state: TrainState, acc: "GradSum", rewards_finite) -> tuple[TrainState, dict]:
        """Apply the averaged gradients of `acc` (skipped on device if anything is non-finite
        or the update exceeds `cfg.max_update_ratio`)."""
        finite = jnp.asarray(rewards_finite) & jnp.isfinite(acc.metrics["loss"])
        state, update_metrics = self.apply_update(state, acc.grads, jnp.float32(acc.count), finite)
        metrics = {k: v / acc.count for k, v in acc.metrics.items()}
        return state, {**metrics, **update_metrics}

    def update(self, state: TrainState, units: TrainUnits, micro_batch: int, rewards_finite) -> tuple[TrainState, dict]:
        """One optimizer update over all `units`, accumulated in micro-batches of `micro_batch`."""
        if units.size % micro_batch:
            raise ValueError(f"{units.size} training units do not split into micro-batches of {micro_batch}")
        acc = GradSum()
        for start in range(0, units.size, micro_batch):
            self.add_chunk(acc, state.trainable, units.slice(start, start + micro_batch))
        return self.finish_update(state, acc, rewards_finite)


@dataclasses.dataclass
class GradSum:
    """Gradients and metrics summed over the micro-batches of one update so far (device arrays)."""

    grads: Any = None
    metrics: Any = None
    count: int = 0
