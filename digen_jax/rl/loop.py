"""Colocated Flow-GRPO training: rollout, reward, advantages, updates, on one device group.

`train(config, workdir)` runs the loop of `launch/train.py` for any workload
(`digen_jax.rl.workload`): the shapes task of configs/tiny.py or one of the four model
families of configs/{flux,qwenimage,wan21,hunyuanvideo}.py. Every iteration k is a pure
function of (seed, k, state): prompts, noises and step selection derive from
`fold_in(seed, k)`, so a run resumed from a checkpoint replays exactly what an
uninterrupted run would have done.

Outputs in `workdir`: `metrics.jsonl` (one JSON object per iteration), TensorBoard
scalars and image grids under `tb/`, orbax checkpoints under `checkpoints/`.
"""
from __future__ import annotations

import json
import math
import os
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import orbax.checkpoint as ocp

from digen_jax.rewards import registry
from digen_jax.rl import advantages as adv_lib
from digen_jax.rl import lora, optim
from digen_jax.rl import workload as workload_lib
from digen_jax.rl.rollout import Conditioning, SamplerSpec
from digen_jax.rl.timesteps import plan_steps, validate_step_selection
from digen_jax.rl.trainer import LossConfig, Trainer, TrainState, build_units
from digen_jax.rl.workload import ConfigError


def validate_config(config: ml_collections.ConfigDict) -> None:
    """Reject a bad config before any compute, naming the offending key (raises ConfigError)."""
    workload_lib.validate_config(config)
    try:
        registry.validate_reward_config(dict(config.reward.weights))
    except ValueError as e:
        raise ConfigError(str(e)) from None
    rl = config.rl
    try:
        adv_lib.validate_group_size(rl.group_size)
        validate_step_selection(rl, config.sampling.num_steps)
        SamplerSpec(config.sampling.sde_type, config.sampling.cfg_scale, config.sampling.cfg_rescale)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if rl.prompts_per_iteration < 1:
        raise ConfigError(f"rl.prompts_per_iteration must be >= 1, got {rl.prompts_per_iteration}")
    batch = rl.prompts_per_iteration * rl.group_size
    if rl.num_updates_per_batch < 1 or batch % rl.num_updates_per_batch:
        raise ConfigError(
            f"rl.num_updates_per_batch={rl.num_updates_per_batch} must divide the {batch} samples of an iteration"
        )
    per_update = batch // rl.num_updates_per_batch * _trained_per_sample(config)
    if rl.micro_batch_size < 1 or per_update % rl.micro_batch_size:
        raise ConfigError(
            f"rl.micro_batch_size={rl.micro_batch_size} must divide the {per_update} training units of an update"
        )
    if rl.lora_rank < 0:
        raise ConfigError(f"rl.lora_rank must be >= 0 (0 = full fine-tuning), got {rl.lora_rank}")


def _trained_per_sample(config) -> int:
    plan = plan_steps(config.rl, config.sampling.num_steps, 1.0, 1, 0, np.random.default_rng(0))
    return plan.trained.shape[1]


class Run:
    """Everything built once per run: workload (task, model, sampler, reward), trainer, writers."""

    def __init__(self, config: ml_collections.ConfigDict, workdir: str, log: Callable[[str], None] = print):
        validate_config(config)
        self.config, self.workdir, self.log = config, workdir, log
        os.makedirs(workdir, exist_ok=True)
        rl = config.rl
        self.workload = workload_lib.make_workload(config)
        self.task = self.workload.task
        self.sampler = self.workload.sampler
        self.latent_shape = self.workload.latent_shape
        base = self.workload.base_params
        optimizer = optim.make_optimizer(
            rl.learning_rate, weight_decay=rl.weight_decay, max_grad_norm=rl.max_grad_norm
        )
        if rl.lora_rank:
            alpha = rl.lora_alpha or 2.0 * rl.lora_rank
            trainable = lora.init_lora(base, rank=rl.lora_rank, target_patterns=list(rl.lora_targets), key=jax.random.key(config.seed + 1))
            frozen, scale = base, lora.lora_scale(rl.lora_rank, alpha)
        else:
            trainable, frozen, scale = base, (base if rl.kl_beta > 0 else None), None
            if frozen is not None:
                trainable = jax.tree.map(jnp.copy, base)
        loss_cfg = LossConfig(
            clip_range=rl.clip_range,
            adv_clip=rl.adv_clip,
            kl_beta=rl.kl_beta,
            decoupled=rl.decoupled,
            is_cap=rl.is_cap,
            lora_scale=scale,
            ema_decay=rl.ema_decay,
            ema_every=rl.ema_every,
            use_ema=rl.ema,
        )
        self.trainer = Trainer(self.sampler, frozen, optimizer, loss_cfg)
        self.state = self.trainer.init_state(trainable)
        self.checkpoints = ocp.CheckpointManager(
            os.path.join(os.path.abspath(workdir), "checkpoints"),
            options=ocp.CheckpointManagerOptions(
                max_to_keep=config.train.keep_checkpoints, enable_async_checkpointing=True
            ),
        )
        self.root_key = jax.random.key(config.seed)
        self.eval_ids, self.eval_cond = self.workload.eval_batch(config.train.eval_prompts)
        self.eval_keys = jax.random.split(jax.random.key(config.seed + 8), config.train.eval_prompts)
        self._writer = None

    @property
    def writer(self):
        if self._writer is None:
            from tensorboardX import SummaryWriter

            self._writer = SummaryWriter(os.path.join(self.workdir, "tb"))
        return self._writer

    # ---------------------------------------------------------------- prompts, decode + reward
    def prompt_batch(self, k: int) -> tuple[jax.Array, Conditioning]:
        """Iteration k's prompt ids (P,) and their conditioning (one row per prompt, not per sample)."""
        return self.workload.prompt_batch(k)

    def images(self, latents: jax.Array) -> np.ndarray:
        """(B, H, W, 3) float32 in [0, 1] previews of final latents (a video's middle frame)."""
        return self.workload.images(latents)

    def score(self, latents: jax.Array, ids: jax.Array) -> tuple[np.ndarray, dict]:
        """Rewards (B,) of final latents (decoded first) and the per-reward arrays, for sample prompt ids."""
        return self.workload.score(latents, ids)

    # ---------------------------------------------------------------- one iteration
    def iteration(self, k: int) -> dict[str, Any]:
        """Roll out, score and train iteration k; returns its metrics (device arrays allowed)."""
        config, rl = self.config, self.config.rl
        start = time.time()
        key = jax.random.fold_in(self.root_key, k)
        num_prompts, group = rl.prompts_per_iteration, rl.group_size
        batch = num_prompts * group
        prompt_ids, cond = self.prompt_batch(k)
        cond = cond.repeat(group)
        sample_ids = jnp.repeat(prompt_ids, group, axis=0)
        group_ids = jnp.repeat(jnp.arange(num_prompts), group)
        sample_keys = jax.random.split(jax.random.fold_in(key, workload_lib.SAMPLES), batch)
        plan = plan_steps(
            rl, config.sampling.num_steps, config.sampling.noise_level, batch, k, np.random.default_rng([config.seed, k])
        )

        params = self.trainer.sampling_params(self.state.trainable, merge=rl.lora_merge_for_sampling)
        traj = self.sampler.rollout(params, cond, sample_keys, plan.noise_levels, self.latent_shape, self.state.version)
        rewards_np, _ = self.score(traj.final, sample_ids)
        rewards = jnp.asarray(rewards_np)
        finite = jnp.all(jnp.isfinite(rewards))
        adv = adv_lib.group_advantages(
            jnp.where(jnp.isfinite(rewards), rewards, 0.0), group_ids, num_prompts,
            std_mode=rl.std_mode, eps=rl.std_eps, ddof=rl.std_ddof,
        )
        units = build_units(traj, cond, adv, jnp.asarray(plan.trained))
        per_update = units.size // rl.num_updates_per_batch
        update_metrics = []
        for u in range(rl.num_updates_per_batch):
            self.state, m = self.trainer.update(
                self.state, units.slice(u * per_update, (u + 1) * per_update), rl.micro_batch_size, finite
            )
            update_metrics.append(m)
        last = update_metrics[-1]
        metrics = {k_: jnp.mean(jnp.stack([m[k_] for m in update_metrics])) for k_ in last}
        metrics.update(
            step=k + 1,
            version=last["version"],
            nonfinite_streak=last["nonfinite_streak"],
            skipped=jnp.sum(jnp.stack([m["skipped"] for m in update_metrics])),
            rollout_version=traj.version,
            reward_mean=float(np.mean(rewards_np)),
            reward_std=float(np.std(rewards_np)),
        )
        if config.train.eval_every and (k + 1) % config.train.eval_every == 0:
            metrics["eval_reward_mean"] = self.evaluate()
        if config.train.image_every and (k + 1) % config.train.image_every == 0:
            self.writer.add_images("samples", self.images(traj.final[:: group][:16]), k + 1, dataformats="NHWC")
        metrics["seconds"] = time.time() - start
        metrics["samples_per_s"] = batch / metrics["seconds"]
        return metrics

    def evaluate(self) -> float:
        """Mean reward of deterministic (ODE) samples of the fixed eval prompts."""
        weights = self.state.ema if self.state.ema is not None else self.state.trainable
        params = self.trainer.params_for(weights)
        zeros = np.zeros((self.sampler.num_steps,), np.float32)
        traj = self.sampler.rollout(params, self.eval_cond, self.eval_keys, zeros, self.latent_shape, self.state.version)
        rewards, _ = self.score(traj.final, self.eval_ids)
        return float(np.mean(rewards))

    # ---------------------------------------------------------------- checkpoints
    def restore(self) -> int:
        """Restore the latest checkpoint if any; returns the iteration to start from."""
        latest = self.checkpoints.latest_step()
        if latest is None:
            return 0
        self.state = self.checkpoints.restore(latest, args=ocp.args.StandardRestore(self.state))
        self.log(f"resumed from {self.workdir}/checkpoints/{latest} (policy version {int(self.state.version)})")
        return latest

    def save(self, iterations_done: int) -> None:
        self.checkpoints.save(iterations_done, args=ocp.args.StandardSave(self.state))


def _host(metrics: dict) -> dict:
    out = {}
    for k, v in jax.device_get(metrics).items():
        v = np.asarray(v)
        out[k] = v.item() if v.ndim == 0 else v.tolist()
    return out


def train(config: ml_collections.ConfigDict, workdir: str, log: Callable[[str], None] = print) -> TrainState:
    """Run (or resume) the training loop of `config` in `workdir`; returns the final state."""
    run = Run(config, workdir, log)
    start = run.restore()
    total = config.train.iterations
    metrics_path = os.path.join(workdir, "metrics.jsonl")
    if start == 0 and os.path.exists(metrics_path):
        os.remove(metrics_path)
    log(f"training {total - start} iterations of {config.rl.prompts_per_iteration * config.rl.group_size} samples "
        f"(from iteration {start}) in {workdir}")

    def emit(m: dict) -> None:
        m = _host(m)
        with open(metrics_path, "a") as f:
            f.write(json.dumps(m) + "\n")
        for name, value in m.items():
            if isinstance(value, (int, float)) and math.isfinite(value):
                run.writer.add_scalar(name, value, m["step"])
        extra = f" eval {m['eval_reward_mean']:.3f}" if "eval_reward_mean" in m else ""
        log(
            f"[{m['step']:4d}/{total}] reward {m['reward_mean']:.3f} ± {m['reward_std']:.3f}{extra} "
            f"loss {m['loss']:+.4f} kl {m['kl']:.2e} clip {m['clip_frac']:.3f} "
            f"{m['samples_per_s']:.1f} samples/s"
        )
        if m["skipped"]:
            log(f"  update {m['step']} skipped: non-finite reward, loss or gradient ({m['nonfinite_streak']} in a row)")
        if m["nonfinite_streak"] >= config.rl.max_nonfinite_in_row:
            raise FloatingPointError(
                f"{m['nonfinite_streak']} updates in a row had non-finite rewards, losses or gradients "
                f"(rl.max_nonfinite_in_row={config.rl.max_nonfinite_in_row}); stopping"
            )

    pending = None
    for k in range(start, total):
        metrics = run.iteration(k)
        if pending is not None:
            emit(pending)  # the previous iteration's metrics: reading them does not stall this one
        pending = metrics
        if config.train.checkpoint_every and (k + 1) % config.train.checkpoint_every == 0:
            run.save(k + 1)
    if pending is not None:
        emit(pending)
    if total > start and (not config.train.checkpoint_every or total % config.train.checkpoint_every):
        run.save(total)
    run.checkpoints.wait_until_finished()
    run.writer.flush()
    return run.state
