"""The trainer every RL algorithm shares: train state, gradient accumulation, the guarded update.

An algorithm's trainer (`grpo_trainer.GrpoTrainer`, `nft_trainer.NftTrainer`) subclasses
`Trainer` and says what a rollout keeps, what a training unit is and the unit's loss; this
module holds what they share. Units of a batch are independent, so they are flattened into one
leading axis and cut into gradient micro-batches; gradients are summed over micro-batches and
averaged once per optimizer update, which makes the update independent of how units were grouped.

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
from typing import Any, Callable

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax

from digen_jax.models import fp8
from digen_jax.rl import losses, lora, optim
from digen_jax.rl.rollout import Conditioning, Sampler


def mesh_on_device(sharding: Any) -> Any:
    """`sharding` (a tree of shardings) with every leaf in device memory."""
    return jax.tree.map(lambda s: s.with_memory_kind("device"), sharding)


@flax.struct.dataclass
class TrainState:
    version: jax.Array  # optimizer updates applied: the policy version
    trainable: Any
    opt_state: Any
    ema: Any
    nonfinite_streak: jax.Array  # consecutive skipped updates
    # DiffusionNFT's old policy (a tree like `trainable`), which rollouts sample with; None for GRPO.
    old: Any = None


@dataclasses.dataclass(frozen=True)
class LossConfig:
    clip_range: float = 1e-4
    adv_clip: float = 5.0
    policy_loss: str = "ppo"  # losses.POLICY_LOSSES; 'grpo_guard' needs units with old_mean
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
    # Anchor of the ratio at version lag 0: 'trainer' (this pass's own log-prob) or 'rollout'
    # (the log-prob the rollout recorded).
    onpolicy_anchor: str = "trainer"
    # Updates with ||update|| > max_update_ratio * ||trainable|| are skipped as diverged (inf: no
    # bound). A healthy AdamW step moves each weight by about the learning rate, a small fraction
    # of the weights' typical magnitude; a step as large as the weights themselves replaces the model.
    max_update_ratio: float = 1.0
    # Numerics of the rollouts' forward (models.fp8.ROLLOUT_PRECISIONS): 'fp8' runs the blocks'
    # matmuls of the sampling weights in FP8 (runtime/weight_sync.py quantises them); the
    # trainer's own forward runs the model's dtype unless the LoRA base itself is FP8.
    rollout_precision: str = "bf16"
    # The frozen LoRA base's form ('fp8': `frozen` holds the e4m3 base, which the trainer's forward
    # and every rollout read, applying the adapters factored since they cannot merge into it).
    lora_base_precision: str = "bf16"

    def __post_init__(self):
        fp8.check_rollout_precision(self.rollout_precision)
        fp8.check_rollout_precision(self.lora_base_precision)
        if self.lora_base_precision == "fp8" and (self.lora_scale is None or self.lora_mode != "factored"):
            raise ValueError("an FP8 LoRA base needs LoRA adapters applied factored (lora_mode='factored')")
        if self.lora_base_precision == "fp8" and self.rollout_precision != "fp8":
            raise ValueError("an FP8 LoRA base is what the rollouts sample with: rollout_precision must be 'fp8'")
        if self.policy_loss not in losses.POLICY_LOSSES:
            raise ValueError(f"policy_loss must be one of {losses.POLICY_LOSSES}, got {self.policy_loss!r}")
        if self.onpolicy_anchor not in ONPOLICY_ANCHORS:
            raise ValueError(f"rl.onpolicy_anchor must be one of {ONPOLICY_ANCHORS}, got {self.onpolicy_anchor!r}")


ONPOLICY_ANCHORS = ("trainer", "rollout")
# `rl.algorithm`: the Flow-GRPO family (`grpo_trainer.GrpoTrainer`) or DiffusionNFT (`nft_trainer.NftTrainer`).
ALGORITHMS = ("grpo", "nft")
# Per-update figures over lag-0 units: '<name>_mean' and '<name>_max' (NaN when there were none).
LAG0_FIGURES = ("logp_diff", "rollout_logp_gap")


@jax.jit
def _combine_metrics(a: dict, b: dict) -> dict:
    """Two gradient micro-batches' summed metrics (maxima where the name says so)."""
    return {k: jnp.maximum(a[k], b[k]) if k.endswith("_max") else a[k] + b[k] for k in a}


@jax.jit
def _update_figures(metrics: dict, count: jax.Array) -> dict:
    """An update's figures from its summed micro-batch metrics: means over micro-batches, and
    the lag-0 figures over the lag-0 units (NaN when the update had none)."""
    units = metrics.get("lag0_units")  # absent from losses without log-probs (DiffusionNFT)
    out = {}
    for k, v in metrics.items():
        if k == "lag0_units":
            out[k] = v
        elif k.endswith("_sum"):
            out[k[: -len("_sum")] + "_mean"] = jnp.where(units > 0, v / jnp.maximum(units, 1.0), jnp.nan)
        elif k.endswith("_max"):
            out[k] = jnp.where(units > 0, v, jnp.nan)
        else:
            out[k] = v / count
    return out


class Trainer:
    """Jitted pieces of an RL update for one sampler (model, ladder, guidance, step type): the
    optimizer state, LoRA or full fine-tuning, gradient accumulation, the guarded two-program
    update and the sharding pins.

    What the runtime asks of an algorithm, which a subclass gives: `rollout` (what a rollout
    keeps, a `trajectory_type`), `rollout_weights` (which weights of the state rollouts sample
    with), `build_units` and `train_chunk` (a micro-batch's training units and one gradient
    micro-batch of them, through `_grad`, the jitted gradient of its `_loss`); `finish_update`
    is this class's.
    """

    trajectory_type: type  # what the algorithm's `rollout` returns

    def __init__(self, sampler: Sampler, frozen: Any, optimizer: optax.GradientTransformation, cfg: LossConfig):
        self.sampler = sampler
        self.frozen = frozen  # LoRA: the base weights; full FT: the reference copy or None
        self.optimizer = optimizer
        self.cfg = cfg
        # The frozen weights enter every jitted function as an argument: closed over, they
        # would be baked into the executable as constants (the whole base model).
        self._grad = jax.jit(jax.value_and_grad(self._loss, has_aux=True))  # of the algorithm's `_loss`
        self._merged = jax.jit(lambda trainable, frozen: self._params_for(trainable, frozen, "merged"))
        self.accumulate = jax.jit(lambda acc, g: jax.tree.map(jnp.add, acc, g), donate_argnums=(0,))
        self._opt_on_device = None  # device shardings of an offloaded optimizer state (pin_state_sharding)
        self._check_update = jax.jit(self._update_check)
        self._commit_update = jax.jit(self._commit, donate_argnums=(0,))
        self._pinned: dict = {}  # state sharding -> its (commit, gradient) programs (pin_state_sharding)

    def rollout(self, params, cond: Conditioning, sample_keys: jax.Array, noise_levels, latent_shape, version):
        """A batch's rollout with sampling weights `params`: a `trajectory_type`."""
        raise NotImplementedError

    def rollout_weights(self, state: TrainState):
        """The trainable tree rollouts of `state`'s version sample with."""
        raise NotImplementedError

    def build_units(self, traj, cond: Conditioning, advantages: jax.Array, trained: jax.Array):
        """The training units of a rolled-out micro-batch: every (sample b, trained[b, k]) pair."""
        raise NotImplementedError

    def train_chunk(self, acc: "GradSum", state: TrainState, chunk, on_policy: bool = False) -> None:
        """Add the gradients and metrics of one gradient micro-batch `chunk` of units, trained
        against `state`, to `acc` (asynchronous); `on_policy`: `state`'s weights generated them."""
        raise NotImplementedError

    def _loss(self, trainable, *args):
        """(loss, metrics) of a gradient micro-batch, differentiated w.r.t. `trainable` (`_grad`);
        the frozen weights are an argument, never a constant closed over."""
        raise NotImplementedError

    def pin_state_sharding(self, state_sharding: Any) -> None:
        """Give updated states exactly `state_sharding`, so a state restored with it runs the same
        compiled programs (and the same reduction order) as the live one; and gradients the
        trainable weights' own sharding: with sharded weights (FSDP) each device then reduces
        and keeps only its shard of every gradient instead of whole gradients. The jitted
        functions are kept per sharding: another executor of this run on the same devices
        (another mode's, a resumed one) runs the programs the first one traced and compiled."""
        host = {s.memory_kind for s in jax.tree.leaves(state_sharding.opt_state)} - {"device", None}
        self._opt_on_device = mesh_on_device(state_sharding.opt_state) if host else None
        key = (jax.tree.structure(state_sharding), tuple(jax.tree.leaves(state_sharding)))
        if key not in self._pinned:
            self._pinned[key] = self._pinned_programs(state_sharding)
        self._commit_update, self._grad = self._pinned[key]

    def _pinned_programs(self, state_sharding: Any) -> tuple[Callable, Callable]:
        """The update's commit and the gradient, jitted to give `state_sharding` (pin_state_sharding)."""
        commit = jax.jit(self._commit, donate_argnums=(0,), out_shardings=(state_sharding, None))
        value_and_grad = jax.value_and_grad(self._loss, has_aux=True)

        def sharded_grad(*args):
            value, grads = value_and_grad(*args)
            return value, jax.lax.with_sharding_constraint(grads, state_sharding.trainable)

        return commit, jax.jit(sharded_grad)

    def place_frozen(self, sharding: Any, put: Callable[[Any, Any], Any] = jax.device_put) -> None:
        """Move the frozen weights (if any) onto `sharding` (the train role's parameter shardings)
        with `put` (a `jax.device_put`-like placement)."""
        if self.frozen is not None:
            self.frozen = put(self.frozen, sharding)

    def params_for(self, trainable):
        """Merged weights (a plain tree) for sampling, evaluation and export; over an FP8 base
        (`cfg.lora_base_precision`), the base with the adapters applied factored."""
        if self.cfg.lora_base_precision == "fp8":
            return lora.LoraWeights(self.frozen, trainable, self.cfg.lora_scale, "factored")
        return self._merged(trainable, self.frozen)

    def init_state(self, trainable) -> TrainState:
        return TrainState(
            version=jnp.zeros((), jnp.int32),
            trainable=trainable,
            opt_state=self.optimizer.init(trainable),
            ema=jax.tree.map(jnp.copy, trainable) if self.cfg.use_ema else None,
            nonfinite_streak=jnp.zeros((), jnp.int32),
        )

    def unbuilt_state(self, trainable) -> TrainState:
        """The initial state of `trainable` with every other part abstract (shapes and dtypes on
        `trainable`'s device): `build_state` makes them where the state is placed. Full
        fine-tuning's Adam moments (FLUX.1-dev: 48 GB in bf16) are then never held in host
        memory beside the pinned buffers they are offloaded to."""
        device = jax.tree.leaves(trainable)[0].sharding
        abstract = jax.eval_shape(self.init_state, trainable)
        built = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device)  # noqa: E731
        return jax.tree.map(built, abstract).replace(trainable=trainable)

    def build_state(self, trainable, sharding: TrainState) -> TrainState:
        """`init_state(trainable)` made on `sharding` (`trainable` is already on its part of it,
        and is donated): the optimizer state, EMA and old policy are written where they live."""
        return jax.jit(self.init_state, out_shardings=sharding, donate_argnums=0)(trainable)

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

    def apply_update(self, state: TrainState, grad_sum, count, rewards_finite, end_of_batch):
        """(the state after one optimizer step with the gradient sum `grad_sum` of `count`
        micro-batches, its metrics); the step is skipped (the state kept, its version too) if
        anything is non-finite or the update exceeds `cfg.max_update_ratio`.

        Two programs: the first decides from norms alone whether the step is kept, the second
        writes the step into the donated state in place. In one program XLA has to hold the new
        weights and Adam moments beside the old ones until the decision is known: a second copy
        of the optimizer state, 20 GB per device for a 20B model on 4 GPUs."""
        ok, checks = self._check_update(state, grad_sum, count, rewards_finite)
        state, metrics = self._commit_update(state, grad_sum, count, ok, end_of_batch)
        return state, {**checks, **metrics}

    def _on_device(self, state: TrainState) -> TrainState:
        """`state` with an offloaded optimizer state copied onto the devices inside the program
        (XLA overlaps the copies with the update; the program's output shardings write the new
        value back to host memory): the arithmetic is the same as for state kept on devices."""
        if self._opt_on_device is None:
            return state
        return state.replace(opt_state=jax.device_put(state.opt_state, self._opt_on_device))

    def _step(self, state: TrainState, grad_sum, count):
        """The optimizer step on `state` (on the devices): (averaged gradients, updates, new
        optimizer state, new weights)."""
        grads = jax.tree.map(lambda g: g / count, grad_sum)
        updates, opt_state = self.optimizer.update(grads, state.opt_state, state.trainable)
        return grads, updates, opt_state, optax.apply_updates(state.trainable, updates)

    def _update_check(self, state: TrainState, grad_sum, count, rewards_finite):
        """(whether the step is kept, its norms): reductions only, nothing the size of the state."""
        state = self._on_device(state)
        grads, updates, _, trainable = self._step(state, grad_sum, count)
        grad_norm = optax.tree.norm(grads)
        # The parameters themselves are checked, not only what produced them: a learning rate of
        # nan or 1e6 gives finite rewards, losses and gradients but non-finite or exploded weights.
        update_norm, param_norm = optax.tree.norm(updates), optax.tree.norm(state.trainable)
        ok = rewards_finite & jnp.isfinite(grad_norm) & jnp.isfinite(update_norm)
        ok &= jnp.isfinite(optax.tree.norm(trainable))
        if self.cfg.max_update_ratio != float("inf"):
            ok &= update_norm <= self.cfg.max_update_ratio * param_norm
        return ok, {"grad_norm": grad_norm, "update_ratio": update_norm / param_norm}

    def _commit(self, state: TrainState, grad_sum, count, ok, end_of_batch):
        """The state after the step where `ok`, else `state` itself, and the step's bookkeeping."""
        state = self._on_device(state)
        _, _, opt_state, trainable = self._step(state, grad_sum, count)
        # Every leaf keeps its dtype: averaged in float32, a bfloat16 gradient makes optax's first
        # moment float32, which would double its memory and recompile the next update.
        keep = lambda new, prev: jax.tree.map(lambda a, b: jnp.where(ok, a.astype(b.dtype), b), new, prev)  # noqa: E731
        ema = state.ema
        if ema is not None:
            decay = {} if self.cfg.ema_decay is None else {"decay": self.cfg.ema_decay}
            ema = keep(optim.ema_update(ema, trainable, state.version, update_every=self.cfg.ema_every, **decay), ema)
        version = state.version + ok.astype(jnp.int32)
        new_state = TrainState(
            version=version,
            trainable=keep(trainable, state.trainable),
            opt_state=keep(opt_state, state.opt_state),
            ema=ema,
            nonfinite_streak=jnp.where(ok, 0, state.nonfinite_streak + 1),
            # DiffusionNFT's old policy moves once per batch (the reference's epoch), after its last update.
            old=None if state.old is None else jax.tree.map(
                lambda a, b: jnp.where(ok & end_of_batch, a, b), self._next_old(state.old, trainable, version), state.old),
        )
        # Fresh outputs (not views of the state, which the next update donates).
        metrics = {
            "skipped": 1 - ok.astype(jnp.int32),
            "version": new_state.version + 0,
            "nonfinite_streak": new_state.nonfinite_streak + 0,
        }
        return new_state, metrics

    def _next_old(self, old, trainable, version):
        """The old policy after an update to `trainable` (version `version`); kept as it is (an
        algorithm without one keeps None)."""
        return old

    def accumulate_chunk(self, acc: "GradSum", grads, metrics: dict) -> None:
        """Add one micro-batch's gradients and metrics to `acc` (asynchronous)."""
        acc.grads = grads if acc.grads is None else self.accumulate(acc.grads, grads)
        acc.metrics = metrics if acc.metrics is None else _combine_metrics(acc.metrics, metrics)
        acc.count += 1

    def finish_update(self, state: TrainState, acc: "GradSum", rewards_finite,
                      end_of_batch: bool = True) -> tuple[TrainState, dict]:
        """Apply the averaged gradients of `acc` (skipped on device if anything is non-finite
        or the update exceeds `cfg.max_update_ratio`); `end_of_batch`: the last update on the
        iteration's batch (`rl.num_updates_per_batch` make one)."""
        finite = jnp.isfinite(acc.metrics["loss"]) & bool(rewards_finite)
        state, update_metrics = self.apply_update(state, acc.grads, np.float32(acc.count), finite,
                                                  np.bool_(end_of_batch))
        return state, {**_update_figures(acc.metrics, np.float32(acc.count)), **update_metrics}


@dataclasses.dataclass
class GradSum:
    """Gradients and metrics summed over the micro-batches of one update so far (device arrays)."""

    grads: Any = None
    metrics: Any = None
    count: int = 0


def is_unbuilt(state: TrainState) -> bool:
    """True for a `Trainer.unbuilt_state`: its optimizer state is abstract."""
    return any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(state.opt_state))
