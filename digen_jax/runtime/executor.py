"""The executor: runs the planner's task lists on role meshes, one host thread per device group.

Per iteration it asks the planner for the task list (`plan.plan_iteration`) and dispatches
each device group's tasks in order from that group's thread (`dispatch.py`). Device work (rollout steps, weight
transfers, gradients, the update) is asynchronous JAX dispatch: a thread only enqueues it,
and JAX's data dependencies and cross-mesh `device_put` do the overlap; where a dispatch call
does wait for its device, it holds up only its own group. Rewards run on a host thread pool
as soon as a micro-batch's rollout is dispatched (queue scheduling). The only places a
dispatching thread waits are the rewards a training task needs, the dispatch of the tasks it
depends on in other groups, the metrics of the previous iteration (read one step late), the
meetings at programs that cross processes (`dispatch.Lanes.crossing`), and two bounds on
running ahead: a transfer between processes completes before the next is issued
(`transfer._fence`), and on CPU one gradient chunk is in flight at a time (`_train`).

Its parts, one concept per module: the micro-batches and their pieces (`microbatch`), the
rewards scored on host threads (`reward_scoring`), the split of each iteration between roles
(`elastic_split`), the order of programs that cross processes (`crossings`) and an iteration's
figures (`figures`).
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import threading
from typing import Any, Callable, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from digen_jax.rl import advantages as adv_lib
from digen_jax.rl.rollout import Conditioning, Sampler
from digen_jax.rl.timesteps import plan_steps
from digen_jax.rl.trainer import GradSum, Trainer, TrainState
from digen_jax.runtime import mesh as mesh_lib
from digen_jax.runtime import plan as plan_lib
from digen_jax.runtime.shared_values import SharedValues
from digen_jax.runtime.crossings import Crossings
from digen_jax.runtime.dispatch import Lanes
from digen_jax.runtime.elastic_split import ElasticSplit
from digen_jax.runtime.figures import iteration_metrics
from digen_jax.runtime.microbatch import (MicroBatch, concatenated, cut_fn, joined, piece_args, piece_of,
                                         settle_from, step_units, unit_rows)
from digen_jax.runtime.reward_scoring import RewardScoring
from digen_jax.runtime.trace import TASK_KINDS, TRAJECTORY, EventExchange, Tracer, iteration_of, iteration_summary
from digen_jax.runtime.transfer import crossing_bytes, to_every_process
from digen_jax.runtime.settings import RunSettings
from digen_jax.runtime.weight_sync import RoleWeights


class Job(Protocol):
    """What the executor runs: a run as the runtime sees it (the application layer's `Run`)."""

    settings: RunSettings  # what the run's config says (`app.settings.run_settings`)
    workdir: str  # the trace goes to WORKDIR/trace.json unless the executor is given another path
    trainer: Trainer
    state: TrainState  # the initial train state (the executor copies it; this one survives)
    sampler: Sampler
    latent_shape: tuple[int, ...]
    # What `runtime.colocated_sampling='auto'` is on the run's devices ('sharded' or 'gathered'):
    # the memory plan's pick (`memory_plan.colocated_sampling`)
    colocated_sampling: str
    # What `runtime.tag_precision='auto'` is on the run's devices ('rollout' or 'training'): the
    # memory plan's pick (`memory_plan.tag_precision`)
    tag_precision: str

    @property
    def abstract_params(self) -> Any:
        """The model's boxed abstract parameters: their logical axes name the weight shardings."""

    @property
    def decoder_params(self) -> Any:
        """The decoder's (VAE) weights, or None in pixel space."""

    def release_base_params(self) -> None:
        """Drop the run's own reference to the base weights once the trainer's copy is placed."""

    def prompt_batch(self, k: int) -> tuple[jax.Array, Conditioning]:
        """Iteration k's prompt ids (P,) and their conditioning (one row per prompt)."""

    def sample_key(self, k: int) -> jax.Array:
        """The key iteration k's samples' noise derives from."""

    def decode(self, latents: jax.Array, decoder_params: Any = None) -> jax.Array:
        """What rewards score, decoded from final latents on their devices (device work)."""

    def reward(self, decoded: np.ndarray, prompt_ids: jax.Array) -> tuple[np.ndarray, dict]:
        """Rewards of decoded samples on the host: (B,) and the per-reward arrays."""


def _finite(x: jax.Array) -> jax.Array:
    return jnp.all(jnp.isfinite(x))


@jax.jit
def _finite_parts(parts: dict) -> dict:
    """{part: whether every array of it is free of NaN and inf}."""
    def finite(leaves):
        return jnp.all(jnp.stack([_finite(x) for x in leaves])) if leaves else jnp.bool_(True)

    return {name: finite(leaves) for name, leaves in parts.items()}


class Executor(ElasticSplit, RewardScoring, Crossings):
    """Runs iterations of `job` (a `Job`: the application layer's `Run`) in its settings' runtime mode."""

    def __init__(self, job: Job, *, settings: RunSettings | None = None, trace_path: str | None = None,
                 log: Callable[[str], None] = print, after: Executor | None = None):
        """`settings` override `job.settings` (one run, several modes); the trace goes to
        `trace_path` (default WORKDIR/trace.json). `after`: the closed executor of the same job
        this one takes over from (a run that switches modes): the trace goes on on its clock."""
        self.job, self.settings, self.log = job, settings or job.settings, log
        rt = self.settings.runtime
        self.mode, self.flags = rt.mode, plan_lib.mode_flags(rt.mode)
        self.meshes = mesh_lib.build_role_meshes(rt)
        self._pace_chunks = self.meshes.train.devices.flat[0].platform == "cpu"  # see `_train`
        self.microbatches = rt.micro_batches
        # pieces per micro-batch of the trainer's rollouts
        self.grain = mesh_lib.split_grain(self.meshes, rt.mode, self.settings.batch // rt.micro_batches)
        for line in mesh_lib.replicated_work_lines(self.meshes, rt.mode, self.settings.batch // rt.micro_batches,
                                                   self.settings.grad_chunk_size):
            log(f"warning: {line}")
        # Each process times the tasks on its own devices and takes the others' events from their
        # processes (trace.EventExchange); process 0 writes them all to the trace.
        write_trace = rt.trace and jax.process_index() == 0
        self.tracer = Tracer((trace_path or os.path.join(job.workdir, "trace.json")) if write_trace else None,
                             peers=EventExchange.for_run())
        if after is not None:
            self.tracer.origin = after.tracer.origin
        self.lanes = Lanes()
        self.shared = SharedValues()  # host values one process computes for all (rewards, figures, costs)
        self._agreements = 0  # `_agreed_costs` calls so far: alike on every process
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=rt.reward_workers, thread_name_prefix="reward")
        rewards = self.settings.rewards
        self.reward_names = rewards.names
        self._reward_weights = np.asarray(rewards.weights, np.float32)
        self._reward_mix = rewards.mix
        self.carried: list[MicroBatch] = []  # prefetched micro-batches of the next iteration
        self.measured: dict[tuple[str, str], list[float]] = {}  # (kind, group) -> recent durations
        self._synced_version = -1  # what the rollout weights hold once the submitted syncs ran
        self.split: tuple[int, int] | None = None  # the last iteration's (tag in pieces, prefetch)
        self._compiled: set[tuple[str, str, float]] = set()  # (kind, group, share) whose first task was seen
        self._iteration_start: dict[int, float] = {}
        self._place_weights()

    # ------------------------------------------------------------------ weights
    def _place_weights(self) -> None:
        job = self.job
        self.weights = RoleWeights(self.meshes, self.settings.sharding, job.abstract_params, job.trainer,
                                   merge_for_sampling=self.settings.lora_merge_for_sampling,
                                   offload_optimizer=bool(self.settings.runtime.offload_optimizer),
                                   gathered_sampling=self.colocated_sampling == "gathered",
                                   fp8_on_train=self.flags.tag and self.tag_precision == "rollout")
        self.state_sharding = self.weights.state_sharding(job.state)
        job.trainer.pin_state_sharding(self.state_sharding)
        self.state = self.weights.fresh_state(job.state, self.state_sharding)
        own_base = self.weights.own_frozen()
        self.weights.place_frozen_on_train(own_base)
        if own_base is None:
            # The frozen base now lives on the train mesh; dropping the run's first copy frees its
            # device before the rollout replicas are made (a 20B base fits a card only once).
            job.release_base_params()
            self.weights.place_frozen_on_rollout()
        else:
            # Several processes, each holding the whole base: each makes its rollout devices'
            # replicas from its own copy (one already on a rollout device is that device's
            # replica), so nothing crosses between processes; then the run's copy goes.
            self.weights.place_frozen_on_rollout(own_base)
            del own_base
            job.release_base_params()
        self.weights.place_decoders(job.decoder_params)
        self._reward_dispatch = threading.Lock()  # see _rollout

    @property
    def colocated_sampling(self) -> str:
        """`runtime.colocated_sampling`, 'auto' being what the memory plan picks for the run's devices."""
        choice = self.settings.runtime.colocated_sampling
        return self.job.colocated_sampling if choice == "auto" else choice

    @property
    def tag_precision(self) -> str:
        """`runtime.tag_precision`, 'auto' being what the memory plan picks for the run's devices."""
        choice = self.settings.runtime.tag_precision
        return self.job.tag_precision if choice == "auto" else choice

    def _sync(self, task: plan_lib.Task, **args: Any) -> None:
        """Trainer -> rollout weight transfer of `task.version` (asynchronous; only adapters with
        LoRA); `args` go into its trace event."""
        start = self.tracer.now()
        weights = self.job.trainer.rollout_weights(self.state)  # DiffusionNFT: the old policy
        moved_bytes = crossing_bytes(weights, self.meshes.rollout)
        with self.lanes.crossing(task):
            moved = self.weights.sync(weights, task.version)
        self.tracer.record(task, moved, start, bytes=moved_bytes, **args)

    def _params_on(self, group: str, version: int):
        if group == "rollout":
            if self.weights.rollout_version != version:
                raise RuntimeError(f"a rollout needs weights of version {version} but version "
                                   f"{self.weights.rollout_version} was synced: the plan lacks a sync")
            return self.weights.rollout_params
        trainable = self.job.trainer.rollout_weights(self.state)
        if group == "shared":
            return self.weights.shared_sampling(trainable, version)
        return self.weights.on_train(trainable)

    # ------------------------------------------------------------------ inputs
    def microbatches_of(self, k: int) -> list[MicroBatch]:
        """Iteration k's micro-batches: pure functions of (seed, k), like `Run.iteration`."""
        with jax.default_device(mesh_lib.host_device()):  # host-derived: see mesh.host_device
            s = self.settings
            prompt_ids, cond = self.job.prompt_batch(k)
            group_size = s.group_size
            batch = len(prompt_ids) * group_size
            sample_keys = jax.random.split(self.job.sample_key(k), batch)
            steps = plan_steps(s.steps, s.num_steps, s.noise_level, batch, k, np.random.default_rng([s.seed, k]))
            per_mb = batch // self.microbatches
            sample_prompts = np.repeat(np.asarray(prompt_ids), group_size, axis=0)
            cond = cond.repeat(group_size)
            out = []
            for m in range(self.microbatches):
                rows = slice(m * per_mb, (m + 1) * per_mb)
                out.append(
                    MicroBatch(
                        iteration=k,
                        index=m,
                        sample_ids=np.arange(k * batch, (k + 1) * batch)[rows],
                        prompt_ids=sample_prompts[rows],
                        cond=jax.tree.map(lambda a: a[rows], cond),
                        sample_keys=sample_keys[rows],
                        noise_levels=steps.noise_levels,
                        trained=steps.trained[rows],
                    )
                )
            return out

    # ------------------------------------------------------------------ tasks
    def _rollout(self, task: plan_lib.Task, mb: MicroBatch) -> None:
        """Roll out, then decode where the reward runs; only host work goes to the reward threads.

        Runs on the dispatching thread of `task.group` (dispatch.py). Programs with collectives
        dispatched from several threads could interleave differently per device and deadlock,
        so the reward role, which decodes for both groups, takes one dispatch at a time.
        """
        whole, mb = mb, piece_of(mb, task.piece)
        mesh = self.meshes.for_group(task.group)
        params = self._params_on(task.group, task.version)
        start = self.tracer.now()
        cond, keys = mesh_lib.put_batch((mb.cond, mb.sample_keys), mesh)
        with self.weights.model_mesh(task.group):
            traj = self.job.trainer.rollout(params, cond, keys, mb.noise_levels, self.job.latent_shape, task.version)
        whole.version = mb.version = task.version
        final, decoder = traj.final, self.weights.decoders.get(task.group)
        self.tracer.record(task, final, start, sample_ids=mb.sample_ids.tolist(), **piece_args(task))
        if self.meshes.reward is None:
            decoded = self.job.decode(final, decoder)
        else:  # one process (`validation.validate_runtime_config`): nothing crosses processes here
            with self._reward_dispatch:
                final, decoder = mesh_lib.put_batch(final, self.meshes.reward), self.weights.decoders.get("reward")
                decoded = self.job.decode(final, decoder)
        if task.piece is None:
            whole.traj, whole.rewards = traj, self._rewards(mb, decoded)
        else:
            whole.pieces[task.piece[0]] = traj
            settle_from(self._rewards(mb, decoded), whole.piece_rewards[task.piece[0]])

    def _chunks(self, units, per_sample: int) -> list:
        """Gradient micro-batches of a micro-batch's units, batch-split over the train mesh.

        TSP: units (samples x trained steps) flattened and cut into `rl.grad_chunk_size`
        pieces split over every trainer device. Without TSP the grain is the trajectory: one
        trained step of all the micro-batch's samples at a time, split over samples only.
        One program cuts and places each chunk (not one per leaf plus a reshard: see `_train`).
        """
        if self.flags.tsp or self.flags.colocated:
            size = self.settings.grad_chunk_size
            cut = cut_fn(unit_rows, size, mesh_lib.batch_sharding(self.meshes.train, (size,)))
            return [cut(units, start) for start in range(0, units.size, size)]
        cut = cut_fn(step_units, per_sample, mesh_lib.batch_sharding(self.meshes.train, (units.size // per_sample,)))
        return [cut(units, t) for t in range(per_sample)]

    def _move_trajectory(self, mb: MicroBatch) -> None:
        """`mb`'s trajectory onto the train mesh (`mb.on_trainer`); a move between roles is recorded
        on the link track. Several processes: a dispatched task of its own (`_crossings`)."""
        mesh = self.meshes.train
        pieces = [mb.pieces[first] for first in sorted(mb.pieces)] or [mb.traj]
        moved_bytes, moving = sum(crossing_bytes(p, mesh) for p in pieces), self.tracer.now()
        rollouts = tuple(("rollout", mb.iteration, mb.index, first) for first in sorted(mb.pieces))
        move = plan_lib.Task(TRAJECTORY, "link", mb.iteration, mb.index, mb.version,
                             deps=rollouts or (("rollout", mb.iteration, mb.index),))
        with self.lanes.crossing(move):
            if mb.pieces:  # a split micro-batch: its pieces joined in sample order (one process)
                mb.on_trainer = mb.traj = joined(mesh_lib.put_batch(pieces, mesh), mesh)
                mb.pieces = {}
            else:
                mb.on_trainer = mesh_lib.put_batch(mb.traj, mesh)
        if moved_bytes:  # rolled out on another role: the trajectory crossed to the trainer
            self.tracer.record(move, mb.on_trainer, moving, bytes=moved_bytes, sample_ids=mb.sample_ids.tolist())

    def _train(self, task: plan_lib.Task, mb: MicroBatch, acc: dict) -> None:
        self.weights.release_gathered()  # training's working set has no room for it
        norm, group_size = self.settings.advantages, self.settings.group_size
        mesh = self.meshes.train
        if mb.on_trainer is None:  # not moved ahead by a crossing task
            self._move_trajectory(mb)
        traj, mb.on_trainer = mb.on_trainer, None  # the trainer's copy lives as long as this task's programs need it
        rows = mb.rewards.result()  # the one wait: everything that can run meanwhile is enqueued
        # 'reward': advantages of the weighted total; 'advantage': of each reward, then weighted.
        signal = rows[:1] if self._reward_mix == "reward" else rows[1:]
        acc["finite"] = acc["finite"] and bool(np.all(np.isfinite(signal)))
        signal = np.where(np.isfinite(signal), signal, 0.0)
        prompt_groups = rows.shape[1] // group_size  # GRPO groups: one prompt's samples each
        start = self.tracer.now()
        kwargs = dict(std_mode=norm.std_mode, eps=norm.eps, ddof=norm.ddof, mean_mode=norm.mean_mode)
        with jax.default_device(mesh_lib.host_device()):  # not behind the rollouts queued on a rollout device
            group_ids = jnp.asarray(np.repeat(np.arange(prompt_groups), group_size))
            if self._reward_mix == "reward":
                adv = adv_lib.group_advantages(jnp.asarray(signal[0]), group_ids, prompt_groups, **kwargs)
            else:
                adv = adv_lib.multi_reward_advantages(jnp.asarray(signal), self._reward_weights, group_ids,
                                                      prompt_groups, mix="advantage", **kwargs)
            trained = jnp.asarray(mb.trained)
        cond, adv, trained = mesh_lib.put_batch((mb.cond, adv, trained), mesh)
        trainer, acc_grads = self.job.trainer, acc["sum"]
        on_policy = task.version == mb.version  # generated by the weights this task trains
        with self.weights.model_mesh("train"):
            units = trainer.build_units(traj, cond, adv, trained)
            for chunk in self._chunks(units, mb.trained.shape[1]):
                if self._pace_chunks and acc_grads.metrics is not None:
                    # The CPU client runs a program's launch and its collective participants on one
                    # pool of as many threads as devices, and a launch that finds a device with 32
                    # programs in flight holds its thread until one finishes. Launches dispatched
                    # far ahead can take every thread a queued gradient's all-gather needs, so its
                    # started participants wait forever for the others. One chunk in flight keeps
                    # every device far below 32.
                    jax.block_until_ready(acc_grads.metrics)
                trainer.train_chunk(acc_grads, self.state, chunk, on_policy)
        self.tracer.record(task, acc_grads.metrics["loss"], start, sample_ids=mb.sample_ids.tolist())  # grads get donated

    def _update(self, task: plan_lib.Task, acc: dict) -> dict:
        start = self.tracer.now()
        last = task.index == self.settings.num_updates_per_batch - 1  # an iteration's updates are indexed 0..
        self.state, metrics = self.job.trainer.finish_update(self.state, acc["sum"], acc["finite"], end_of_batch=last)
        self.tracer.record(task, metrics["version"], start)
        return metrics

    # ------------------------------------------------------------------ one iteration
    def iteration(self, k: int) -> tuple[plan_lib.IterationPlan, dict]:
        """Dispatch iteration k; returns its plan and metrics (device arrays or futures: read them
        later, with `read_figures`)."""
        costs = self._agreed_costs() if self.elastic_split or jax.process_count() > 1 else None
        tag, prefetch = self.split = self.split_for(k, costs)
        carried = len(self.carried)
        plan = plan_lib.plan_iteration(
            self.mode, k, self.microbatches, carried=carried, tag=tag, prefetch=prefetch,
            updates=self.settings.num_updates_per_batch, grain=self.grain,
        )
        self._iteration_start[k] = self.tracer.now()
        mbs = {(k, m.index): m for m in self.microbatches_of(k)[carried:]}
        mbs.update({(k, m.index): m for m in self.carried})
        next_mbs = {}
        if prefetch:
            next_mbs = {(k + 1, m.index): m for m in self.microbatches_of(k + 1)[:prefetch]}
        for t in plan.tasks:  # here, not when it runs: the next plan's moves depend on it (`_crossings`)
            if t.kind == "rollout":
                mb = mbs.get((t.iteration, t.index)) or next_mbs[(t.iteration, t.index)]
                mb.rolled_on = mb.rolled_on if t.piece and t.piece[0] else t.group
                if t.piece is not None:
                    mb.piece_rewards[t.piece[0]] = concurrent.futures.Future()
        for mb in mbs.values():  # a split one's rewards: its pieces' joined once every piece is scored
            if mb.piece_rewards:
                mb.rewards = concatenated([mb.piece_rewards[f] for f in sorted(mb.piece_rewards)])
        acc = self._fresh_acc()
        update_metrics, figures = [], {}
        last_update = [t.key for t in plan.tasks if t.kind == "update" and t.iteration == k][-1]
        first = next((t for t in plan.tasks if t.kind == "rollout" and t.group == "rollout"), None)
        if first is not None and self._synced_version != first.version:
            # The initial (or a resumed run's) weights, which no planned sync carries: before any
            # lane runs, so every process issues this transfer at the same point. Named for the
            # iteration whose rollouts wait for it, like a planned sync; marked as a starting one,
            # which no row of figures counts (trace.py).
            self.lanes.drain()
            self._sync(plan_lib.Task("sync", "link", k, 0, first.version), starting=True)
            self._synced_version = first.version
        self._synced_version = max([t.version for t in plan.tasks if t.kind == "sync"], default=self._synced_version)

        def handle(task: plan_lib.Task) -> None:
            nonlocal acc
            if task.kind == "rollout":
                self._rollout(task, mbs.get((task.iteration, task.index)) or next_mbs[(task.iteration, task.index)])
            elif task.kind == "train":
                # The rewards it depends on scored, not only their rollouts dispatched (that is all a
                # dependency in another lane means): the sync baseline trains once the whole batch
                # is scored, also where the rolling lane's dispatch returns before its devices ran
                # (a process without rollout devices). One group runs its tasks in order anyway.
                for kind, iteration, index, *_ in task.deps if not self.meshes.colocated else ():
                    if kind == "reward":
                        mbs[(iteration, index)].rewards.result()
                self._train(task, mbs[(task.iteration, task.index)], acc)
            elif task.kind == "update":
                update_metrics.append(self._update(task, acc))
                acc = self._fresh_acc()
                if task.key == last_update:
                    figures.update(self._figures(k, update_metrics))
            elif task.kind == "sync":
                self._sync(task)
            elif task.kind == TRAJECTORY:
                self._move_trajectory(mbs[(task.iteration, task.index)])

        # Each device group's tasks from its own thread (dispatch.py says why), across
        # iterations: this returns once iteration k's own tasks were dispatched, while the next
        # iteration's prefetched rollouts (and the sync after them) may still be on the rollout
        # thread, so the next plan is queued behind them without a pause. This thread issues no
        # program that crosses processes between two plans (the metrics are shared by the key-value
        # store); whatever does (evaluation, images, checkpoints) drains the lanes first.
        self.lanes.forget(before_iteration=k - 1)
        self.lanes.submit(*self._crossings(plan, list(mbs.values()), costs), handle=handle)
        self.lanes.wait([t.key for t in plan.tasks if t.iteration == k and t.kind != "reward"])
        self.carried = list(next_mbs.values())
        self._last = [mbs[(k, m)] for m in range(self.microbatches)]
        rows = np.concatenate([mb.rewards.result() for mb in sorted(mbs.values(), key=lambda m: m.index)], axis=1)
        metrics = dict(figures)
        metrics.update({f"reward_{name}_mean": float(np.mean(r)) for name, r in zip(self.reward_names, rows[1:])})
        metrics.update(
            step=k + 1,
            reward_mean=float(np.mean(rows[0])),
            reward_std=float(np.std(rows[0])),
            mode=self.mode,
            tag_microbatches=plan.tag_microbatches,
            prefetch_microbatches=prefetch,
            carried_microbatches=carried,
        )
        return plan, metrics

    def _figures(self, k: int, update_metrics: list[dict]) -> dict:
        """Iteration k's figures from its updates', dispatched on the train lane: device arrays with
        one process; with several, each a future host value every process gets through the
        key-value store (`SharedValues.share_scalars`), so reading them never issues a program
        that crosses processes."""
        figures = iteration_metrics(update_metrics)
        if jax.process_count() == 1:
            return figures
        return self.shared.share_scalars(f"figures/{k}", figures, self.pool)

    def sample(self, trainable, cond: Conditioning, sample_keys: jax.Array, noise_levels, version) -> jax.Array:
        """Decoded samples of `trainable` (a tree laid out like the train state's, e.g. its EMA) for
        `cond` and `sample_keys` (host-derived, alike on every process), readable on every process.

        They roll out where micro-batches do: on the rollout role, the weights moved there first
        (outside the plan: the synced weights stay as they are), or on the shared mesh when
        colocated. Every process calls it at the same point of the loop (it runs transfers).
        """
        group = "shared" if self.meshes.colocated else "rollout"
        if self.meshes.colocated:
            params = self.weights.colocated_sampling(trainable)
        else:
            params = self.weights.to_rollout(trainable)[1]
        mesh = self.meshes.for_group(group)
        cond, sample_keys = mesh_lib.put_batch((cond, sample_keys), mesh)
        with self.weights.model_mesh(group):
            traj = self.job.sampler.rollout(params, cond, sample_keys, noise_levels, self.job.latent_shape, version)
        return to_every_process(self.job.decode(traj.final, self.weights.decoders.get(group)))

    def last_finals(self) -> jax.Array:
        """Final latents of the last iteration's samples, in sample order (readable on every process).
        With several processes the lanes are drained first: this moves them across processes."""
        if jax.process_count() > 1:
            self.drain()
        return to_every_process(jnp.concatenate([mesh_lib.put_batch(mb.traj.final, self.meshes.train) for mb in self._last]))

    def last_prompt_ids(self) -> np.ndarray:
        """The prompt id of each of the last iteration's samples, in `last_finals`' order."""
        return np.concatenate([mb.prompt_ids for mb in self._last])

    @staticmethod
    def _fresh_acc() -> dict:
        return {"sum": GradSum(), "finite": True}

    def timing(self, k: int, plan: plan_lib.IterationPlan) -> dict:
        """Iteration k's measured figures (waits until its tasks completed: call it one step late)."""
        # The sync carrying iteration k's update is dispatched from the rollout lane after k's own
        # tasks, behind the next iteration's prefetched rollouts: once it is, `wait_through` waits
        # for it too, so k's figures count it however early they are read (at a checkpoint, say).
        self.lanes.wait([t.key for t in plan.of_kind("sync")])
        self.tracer.wait_through(k)
        events = self.tracer.events
        mine = [e for e in events if iteration_of(e["args"]) == k]
        for e in sorted(mine, key=lambda e: e["ts"]):
            if e["args"]["kind"] not in TASK_KINDS:  # transfers the plan does not schedule (trajectory moves)
                continue
            key = (e["args"]["kind"], e["args"]["group"])
            first, end, grain = e["args"].get("piece", (0, 1, 1))
            share = (end - first) / grain
            if (*key, share) not in self._compiled:  # the first task of a kind and size on a group includes compilation
                self._compiled.add((*key, share))
                continue
            self.measured.setdefault(key, []).append(e["dur"] / 1e6 / share)  # per micro-batch
            self.measured[key] = self.measured[key][-2 * self.microbatches :]
        end_of = lambda it: max((e["ts"] + e["dur"]) / 1e6 for e in events if e["args"]["kind"] == "update" and e["args"]["iteration"] == it)  # noqa: E731
        end = end_of(k)
        start = end_of(k - 1) if k - 1 in self._iteration_start else self._iteration_start[k]
        groups = ["shared"] if self.meshes.colocated else ["rollout", "train"]
        summary = iteration_summary(events, k, (start, end), groups)
        batch = self.settings.batch
        seconds = max(end - start, 1e-9)
        return {
            **summary,
            "seconds": seconds,
            "samples_per_s": batch / seconds,
            "samples_per_s_per_device": batch / seconds / self.meshes.num_devices,
        }

    # ------------------------------------------------------------------ checkpoints
    def carried_snapshot(self) -> dict:
        """The micro-batches prefetched for the next iteration as host trees, keyed by index (on
        every process, process 0 included: it writes a run's checkpoints). Their rollouts must
        have run (`drain`)."""
        return {
            str(m.index): {
                "traj": jax.device_get(to_every_process(
                    {f.name: getattr(m.traj, f.name) for f in dataclasses.fields(m.traj) if f.name != "sample_keys"}
                )),
                "rewards": m.rewards.result(),
                "version": np.int32(m.version),
                "group": np.int32(plan_lib.GROUPS.index(m.rolled_on)),
            }
            for m in self.carried
        }

    def state_is_finite(self) -> dict[str, bool]:
        """Whether the weights, optimizer state, EMA (and old policy) of the live state are each
        free of NaN and inf. Arrays in host memory (offloaded moments) are checked one at a time
        on their devices (`mesh.reduce_in_host_memory`)."""
        state = self.state
        parts = {"trainable weights": state.trainable, "optimizer state": state.opt_state, "EMA weights": state.ema}
        if state.old is not None:
            parts["old-policy weights"] = state.old
        floats = {name: [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
                  for name, tree in parts.items()}
        on_devices = {name: [x for x in leaves if not mesh_lib.in_host_memory(x)] for name, leaves in floats.items()}
        finite = jax.device_get(to_every_process(_finite_parts(on_devices)))
        for name, leaves in floats.items():
            for x in leaves:
                if finite[name] and mesh_lib.in_host_memory(x):
                    finite[name] = jax.device_get(to_every_process(mesh_lib.reduce_in_host_memory(_finite, x)))
        return {name: bool(ok) for name, ok in finite.items()}

    def resume(self, step: int, state: TrainState, carried: dict, measured: list,
               split: tuple[int, int] | None = None) -> None:
        """Continue after iteration `step` from a restored `state` (placed on `state_sharding`), the
        prefetched micro-batches `carried` (as `carried_snapshot` gave them), the task costs
        measured so far (`[kind, group, durations]` rows) and the split of iteration `step - 1`."""
        self.state = state
        self.carried = []
        for mb in self.microbatches_of(step)[: len(carried)]:
            saved = carried[str(mb.index)]
            mb.traj = self.job.trainer.trajectory_type(
                sample_keys=mb.sample_keys, **{name: jnp.asarray(a) for name, a in saved["traj"].items()})
            mb.version = int(saved["version"])
            mb.rolled_on = plan_lib.GROUPS[int(saved["group"])]
            mb.rewards = concurrent.futures.Future()
            rows = np.asarray(saved["rewards"], np.float32)
            if rows.ndim == 1:  # a checkpoint holding the weighted totals only: the components are unknown
                rows = np.concatenate([rows[None], np.full((len(self.reward_names), rows.size), np.nan, np.float32)])
            mb.rewards.set_result(rows)
            self.carried.append(mb)
        self.weights.rollout_version = self._synced_version = -1
        self.weights.release_gathered()
        self.measured = {(kind, group): list(values) for kind, group, values in measured}
        self.split = None if split is None else (int(split[0]), int(split[1]))
        self.tracer.resume(step, kept={(step, m.index) for m in self.carried})

    def drain(self) -> None:
        """Wait until every dispatched task (the next iteration's prefetched rollouts too) ran."""
        self.lanes.drain()

    def close(self) -> None:
        try:
            self.drain()
        finally:
            self.lanes.close()
            self.shared.close()  # before the pool: readers waiting for a failed process give up
            self.pool.shutdown(wait=True)  # first: the reward threads record their tasks in the trace
            self.tracer.close()
