"""The executor: runs the planner's task lists on role meshes, one host thread per device group.

Per iteration it asks the planner for the task list (`plan.plan_iteration`) and dispatches
each device group's tasks in order from that group's thread (`dispatch.py`; one thread in
plan order when the run spans several processes). Device work (rollout steps, weight
transfers, gradients, the update) is asynchronous JAX dispatch: a thread only enqueues it,
and JAX's data dependencies and cross-mesh `device_put` do the overlap; where a dispatch call
does wait for its device, it holds up only its own group. Rewards run on a host thread pool
as soon as a micro-batch's rollout is dispatched (queue scheduling). The only places a
dispatching thread waits are the rewards a training task needs, the dispatch of the tasks it
depends on in other groups, the metrics of the previous iteration (read one step late), and
two bounds on running ahead: a transfer between processes completes before the next is
issued (`distributed._fence`), and on CPU one gradient chunk is in flight at a time (`_train`).

Micro-batches are whole groups: iteration k's P prompts are cut into M contiguous slices,
each carrying its prompts' G samples. Advantages are normalised per micro-batch (the grain
that flows from reward to trainer; 'global' in `rl.std_mode` and `rl.mean_mode` means
micro-batch-global), so every mode trains the same numbers on the same batch.

Several processes (roles on different hosts): every process runs this same loop and
dispatches the same device programs in the same order. Host-derived inputs (prompts, sample
keys, advantages) are computed alike on every process and placed by each on its own devices
(`distributed.transfer` of uncommitted arrays); every process scores the rewards from its own
copy of the decoded pixels and reads the metrics from its own copy (`to_every_process`);
evaluation samples roll out on the rollout role the same way (`sample`).

Elastic splits: with `runtime.tag_microbatches` or `runtime.prefetch_microbatches` < 0 the
split of each iteration is chosen by `plan.choose_split` from the task times measured in
the previous iteration (with several processes, process 0's choice, broadcast: the plan must
be the same everywhere); the first iteration uses no trainer rollouts and no prefetch. The
measured times travel with each checkpoint, so a resumed run's first split is the one the
uninterrupted run chose.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import os
import threading
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from digen_jax.rl import advantages as adv_lib
from digen_jax.rl import lora
from digen_jax.app import workload as workload_lib
from digen_jax.rl.rollout import Conditioning, Trajectory
from digen_jax.rl.timesteps import plan_steps
from digen_jax.rl.trainer import LAG0_FIGURES, GradSum, TrainState, build_units
from digen_jax.app import checkpoints
from digen_jax.runtime import mesh as mesh_lib
from digen_jax.runtime import plan as plan_lib
from digen_jax.runtime.distributed import to_every_process, transfer
from digen_jax.runtime.dispatch import Lanes, dispatch
from digen_jax.runtime.trace import Tracer, iteration_summary

def validate_runtime_config(config, num_devices: int) -> None:
    """Reject a bad `runtime` section before any compute, naming the key."""
    rt, rl = config.runtime, config.rl
    flags = plan_lib.mode_flags(rt.mode)
    if rt.micro_batches < 1 or rl.prompts_per_iteration % rt.micro_batches:
        raise ValueError(
            f"runtime.micro_batches={rt.micro_batches} must divide rl.prompts_per_iteration={rl.prompts_per_iteration}"
            " (micro-batches hold whole groups)"
        )
    if rt.staleness < 0:
        raise ValueError(f"runtime.staleness must be >= 0, got {rt.staleness}")
    if not flags.colocated and rl.num_updates_per_batch != 1:
        raise ValueError(
            f"rl.num_updates_per_batch must be 1 in runtime.mode={rt.mode!r} (one update per iteration), got "
            f"{rl.num_updates_per_batch}: set --config.rl.num_updates_per_batch=1"
        )
    if flags.colocated and rt.micro_batches % rl.num_updates_per_batch:
        raise ValueError(
            f"rl.num_updates_per_batch={rl.num_updates_per_batch} must divide runtime.micro_batches={rt.micro_batches}"
        )
    for key in ("tag_microbatches", "prefetch_microbatches"):
        value = rt[key]
        if value > rt.micro_batches:
            raise ValueError(f"runtime.{key}={value} exceeds runtime.micro_batches={rt.micro_batches}")
    # The micro-batches prefetched in one iteration are carried into the next, whose trainer
    # rollouts come from the rest (`plan.plan_iteration`); -1 (elastic) is chosen to fit.
    tag = rt.tag_microbatches if flags.tag else 0
    prefetch = rt.prefetch_microbatches if flags.tcss and rt.staleness > 0 else 0
    if tag >= 0 and prefetch >= 0 and tag + prefetch > rt.micro_batches:
        raise ValueError(
            f"runtime.tag_microbatches={tag} + runtime.prefetch_microbatches={prefetch} exceed runtime.micro_batches="
            f"{rt.micro_batches}: the next iteration's prefetched micro-batches leave only "
            f"{rt.micro_batches - prefetch} for its trainer rollouts (lower one, or use -1 to choose from measured costs)"
        )
    batch = rl.prompts_per_iteration * rl.group_size
    trained = plan_steps(rl, config.sampling.num_steps, 1.0, 1, 0, np.random.default_rng(0)).trained.shape[1]
    units = batch // rt.micro_batches * trained
    if (flags.colocated or flags.tsp) and units % rl.micro_batch_size:
        raise ValueError(
            f"rl.micro_batch_size={rl.micro_batch_size} must divide the {units} training units of a micro-batch "
            f"(runtime.micro_batches={rt.micro_batches})"
        )
    for key in ("rollout_devices", "train_devices", "reward_devices"):
        if rt[key] < 0:
            raise ValueError(f"runtime.{key} must be >= 0, got {rt[key]}")
    wanted = rt.rollout_devices + rt.train_devices + rt.reward_devices
    if not flags.colocated and wanted > num_devices:
        raise ValueError(
            f"runtime.rollout_devices + train_devices + reward_devices = {wanted} exceeds the {num_devices} devices"
        )


def _unit_rows(units, start, size: int):
    """Units start .. start + size - 1 (`start` traced: one program serves every chunk)."""
    return jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, start, size), units)


def _step_units(units, step, per_sample: int):
    """Each sample's unit of its `step`-th trained step (units are sample-major: a[step::per_sample])."""
    return jax.tree.map(
        lambda a: jax.lax.dynamic_index_in_dim(a.reshape(-1, per_sample, *a.shape[1:]), step, axis=1, keepdims=False),
        units,
    )


@jax.jit
def _iteration_metrics(update_metrics: list[dict]) -> dict:
    """An iteration's figures from its updates' (means; the last version and streak; skips summed),
    in one program on the train devices rather than two per figure."""
    last = update_metrics[-1]
    metrics = {name: jnp.mean(jnp.stack([m[name] for m in update_metrics])) for name in last}
    units = jnp.stack([m["lag0_units"] for m in update_metrics])
    metrics["lag0_units"] = jnp.sum(units)
    for name in LAG0_FIGURES:  # over the lag-0 units of every update (NaN: there were none)
        means = jnp.stack([m[f"{name}_mean"] for m in update_metrics])
        metrics[f"{name}_mean"] = jnp.sum(jnp.where(units > 0, means * units, 0.0)) / jnp.sum(units)
        metrics[f"{name}_max"] = jnp.nanmax(jnp.stack([m[f"{name}_max"] for m in update_metrics]))
    metrics.update(
        version=last["version"],
        nonfinite_streak=last["nonfinite_streak"],
        skipped=jnp.sum(jnp.stack([m["skipped"] for m in update_metrics])),
    )
    return metrics


@jax.jit
def _finite_parts(state: TrainState) -> dict:
    """Whether the weights, optimizer state and EMA of `state` are each free of NaN and inf."""
    def finite(tree):
        leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
        return jnp.all(jnp.stack(leaves)) if leaves else jnp.bool_(True)

    return {"trainable weights": finite(state.trainable), "optimizer state": finite(state.opt_state),
            "EMA weights": finite(state.ema)}


@functools.lru_cache(maxsize=16)
def _cut_fn(cut, static: int, sharding):
    return jax.jit(lambda units, index: cut(units, index, static), out_shardings=sharding)


@dataclasses.dataclass
class MicroBatch:
    """One micro-batch of an iteration: its inputs, and once rolled out its trajectory and rewards."""

    iteration: int
    index: int
    sample_ids: np.ndarray  # global sample ids (iteration * batch + position)
    prompt_ids: np.ndarray  # (samples,) the prompt of each sample
    cond: Conditioning  # (samples, ...)
    sample_keys: jax.Array
    noise_levels: np.ndarray  # (N,) the iteration's per-step noise levels
    trained: np.ndarray  # (samples, S) trained step indices
    group: str | None = None  # where it was rolled out
    version: int | None = None  # the policy version that generated it
    traj: Trajectory | None = None
    rewards: concurrent.futures.Future | None = None


class Executor:
    """Runs iterations of `run` (a `rl.loop.Run`) in `config.runtime.mode`."""

    def __init__(self, run, *, config=None, trace_path: str | None = None, log: Callable[[str], None] = print):
        """`config` overrides `run.config`'s runtime and sharding sections (one Run, several modes);
        the trace goes to `trace_path` (default WORKDIR/trace.json)."""
        self.run, self.config, self.log = run, config or run.config, log
        rt = self.config.runtime
        self.mode, self.flags = rt.mode, plan_lib.mode_flags(rt.mode)
        validate_runtime_config(self.config, len(jax.devices()))
        self.meshes = mesh_lib.build_role_meshes(rt)
        self._pace_chunks = self.meshes.train.devices.flat[0].platform == "cpu"  # see `_train`
        self.microbatches = rt.micro_batches
        # Process 0 writes the trace (it stamps tasks on other processes' devices when dispatched).
        write_trace = rt.trace and jax.process_index() == 0
        self.tracer = Tracer((trace_path or os.path.join(run.workdir, "trace.json")) if write_trace else None)
        self.lanes = Lanes() if jax.process_count() == 1 else None
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=rt.reward_workers, thread_name_prefix="reward")
        self.carried: list[MicroBatch] = []  # prefetched micro-batches of the next iteration
        self.measured: dict[tuple[str, str], list[float]] = {}  # (kind, group) -> recent durations
        self._compiled: set[tuple[str, str]] = set()  # (kind, group) keys whose first task was seen
        self._iteration_start: dict[int, float] = {}
        self._place_weights()

    # ------------------------------------------------------------------ weights
    def _place_weights(self) -> None:
        run, trainer = self.run, self.run.trainer
        rules = self.config.sharding
        boxed = run.workload.family.abstract_params(run.workload.model_cfg)
        self._sharding = {
            "train": mesh_lib.param_shardings(boxed, self.meshes.train, rules.train_rules),
            "rollout": mesh_lib.param_shardings(boxed, self.meshes.rollout, rules.rollout_rules),
        }
        self.lora_scale = trainer.cfg.lora_scale
        train_mesh = self.meshes.train
        trainable_sh = mesh_lib.like_params(run.state.trainable, self._sharding["train"], train_mesh)
        state_sh = TrainState(
            version=mesh_lib.replicated(train_mesh),
            trainable=trainable_sh,
            opt_state=mesh_lib.optimizer_state_shardings(trainer.optimizer, run.state.trainable, trainable_sh, train_mesh),
            ema=None if run.state.ema is None else trainable_sh,
            nonfinite_streak=mesh_lib.replicated(train_mesh),
        )
        self.state_sharding = state_sh
        trainer.pin_state_sharding(state_sh)
        # Fresh buffers: the update donates the state, and run.state must survive (resume, other modes).
        self.state = jax.device_put(jax.tree.map(jnp.copy, run.state), state_sh)
        if trainer.frozen is not None:
            trainer.frozen = jax.device_put(trainer.frozen, self._sharding["train"])
            # The frozen base now lives on the train mesh; dropping the workload's first copy frees
            # its device before the rollout replicas are made (a 20B base fits a card only once).
            run.workload.base_params = None
        self.frozen_on_rollout = None
        if self.lora_scale is not None and not self.meshes.colocated:
            self.frozen_on_rollout = transfer(trainer.frozen, self._sharding["rollout"])
        decoder = run.workload.decoder_params
        groups = {"shared": self.meshes.train} if self.meshes.colocated else {"rollout": self.meshes.rollout, "train": self.meshes.train}
        if self.meshes.reward is not None:
            groups["reward"] = self.meshes.reward
        self._decoder = {} if decoder is None else {g: transfer(decoder, mesh_lib.replicated(m)) for g, m in groups.items()}
        self._merge = jax.jit(functools.partial(lora.merge_lora, scale=self.lora_scale)) if self.lora_scale else None
        self.rollout_params = None
        self.rollout_version = -1
        self._reward_dispatch = threading.Lock()  # see _rollout

    def _weights_for_sampling(self, trainable, frozen):
        """Sampling weights from trainable (+ frozen base for LoRA) where they live."""
        if self.lora_scale is None:
            return trainable
        if self.config.rl.lora_merge_for_sampling:
            return self._merge(frozen, trainable)
        return lora.LoraWeights(frozen, trainable, self.lora_scale)

    def _to_rollout(self, trainable):
        """`trainable` (on the train role) moved to the rollout role: the tree that moved (only
        adapters with LoRA) and the sampling weights made from it there."""
        if self.lora_scale is None:
            moved = transfer(trainable, self._sharding["rollout"])
        else:
            moved = transfer(trainable, mesh_lib.replicated(self.meshes.rollout))
        return moved, self._weights_for_sampling(moved, self.frozen_on_rollout)

    def _sync(self, version: int, deps: tuple = ()) -> None:
        """Trainer -> rollout weight transfer of `version` (asynchronous; only adapters with LoRA)."""
        task = plan_lib.Task("sync", "link", version, 0, version, deps=deps)
        start = self.tracer.now()
        moved, self.rollout_params = self._to_rollout(self.state.trainable)
        self.tracer.record(task, moved, start)
        self.rollout_version = version

    def _params_on(self, group: str, version: int):
        if group == "rollout":
            if self.rollout_version != version:
                self._sync(version)  # the initial weights, or a sync the plan did not place
            return self.rollout_params
        return self._weights_for_sampling(self.state.trainable, self.run.trainer.frozen)

    # ------------------------------------------------------------------ inputs
    def microbatches_of(self, k: int) -> list[MicroBatch]:
        """Iteration k's micro-batches: pure functions of (seed, k), like `Run.iteration`."""
        with jax.default_device(mesh_lib.host_device()):  # host-derived: see mesh.host_device
            run, rl, s = self.run, self.config.rl, self.config.sampling
            prompt_ids, cond = run.prompt_batch(k)
            group = rl.group_size
            batch = len(prompt_ids) * group
            key = jax.random.fold_in(run.root_key, k)
            sample_keys = jax.random.split(jax.random.fold_in(key, workload_lib.SAMPLES), batch)
            steps = plan_steps(rl, s.num_steps, s.noise_level, batch, k, np.random.default_rng([self.config.seed, k]))
            per_mb = batch // self.microbatches
            sample_prompts = np.repeat(np.asarray(prompt_ids), group, axis=0)
            cond = cond.repeat(group)
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
        mesh = self.meshes.for_group(task.group)
        params = self._params_on(task.group, task.version)
        start = self.tracer.now()
        cond, keys = mesh_lib.put_batch((mb.cond, mb.sample_keys), mesh)
        mb.traj = self.run.sampler.rollout(params, cond, keys, mb.noise_levels, self.run.latent_shape, task.version)
        mb.group, mb.version = task.group, task.version
        self.tracer.record(task, mb.traj.latents, start, sample_ids=mb.sample_ids.tolist())
        final, decoder = mb.traj.final, self._decoder.get(task.group)
        # Every process scores the same rewards from its own copy of the pixels (their bytes cross
        # to each process once; the host reward work is repeated per process), so advantages and
        # reward metrics need no further exchange. One process: the decoded arrays as they are.
        if self.meshes.reward is None:
            decoded = to_every_process(self.run.workload.decode(final, decoder))
        else:
            with self._reward_dispatch:
                final, decoder = mesh_lib.put_batch(final, self.meshes.reward), self._decoder.get("reward")
                decoded = to_every_process(self.run.workload.decode(final, decoder))
        mb.rewards = self.pool.submit(self._score, mb, decoded)

    def _score(self, mb: MicroBatch, decoded: jax.Array) -> np.ndarray:
        pixels = np.asarray(decoded)  # device-to-host copies only: no device program from this thread
        start = self.tracer.now()
        # Reward models that run on a device (CLIP scorers) use a device that decoded this
        # micro-batch: the reward role's when it has devices (single-device programs, no collectives).
        with jax.default_device(decoded.addressable_shards[0].device):
            rewards, _ = self.run.workload.reward(pixels, jnp.asarray(mb.prompt_ids))
        rewards = np.asarray(rewards, np.float32)
        reward_task = plan_lib.Task("reward", "reward", mb.iteration, mb.index, mb.version)
        self.tracer.record_done(reward_task, start, self.tracer.now(), sample_ids=mb.sample_ids.tolist())
        return rewards

    def _chunks(self, units, per_sample: int) -> list:
        """Gradient micro-batches of a micro-batch's units, batch-split over the train mesh.

        TSP: units (samples x trained steps) flattened and cut into `rl.micro_batch_size`
        pieces split over every trainer device. Without TSP the grain is the trajectory: one
        trained step of all the micro-batch's samples at a time, split over samples only.
        One program cuts and places each chunk (not one per leaf plus a reshard: see `_train`).
        """
        if self.flags.tsp or self.flags.colocated:
            size = self.config.rl.micro_batch_size
            cut = _cut_fn(_unit_rows, size, mesh_lib.batch_sharding(self.meshes.train, (size,)))
            return [cut(units, start) for start in range(0, units.size, size)]
        cut = _cut_fn(_step_units, per_sample, mesh_lib.batch_sharding(self.meshes.train, (units.size // per_sample,)))
        return [cut(units, t) for t in range(per_sample)]

    def _train(self, task: plan_lib.Task, mb: MicroBatch, acc: dict) -> None:
        rl = self.config.rl
        rewards = mb.rewards.result()  # the one wait: everything that can run meanwhile is enqueued
        mesh = self.meshes.train
        acc["finite"] = acc["finite"] and bool(np.all(np.isfinite(rewards)))
        groups = len(rewards) // rl.group_size
        group_ids = np.repeat(np.arange(groups), rl.group_size)
        start = self.tracer.now()
        with jax.default_device(mesh_lib.host_device()):  # not behind the rollouts queued on a rollout device
            adv = adv_lib.group_advantages(
                jnp.asarray(np.where(np.isfinite(rewards), rewards, 0.0)), jnp.asarray(group_ids), groups,
                std_mode=rl.std_mode, eps=rl.std_eps, ddof=rl.std_ddof, mean_mode=rl.mean_mode,
            )
            trained = jnp.asarray(mb.trained)
        traj, cond, adv, trained = mesh_lib.put_batch((mb.traj, mb.cond, adv, trained), mesh)
        units = build_units(traj, cond, adv, trained, old_means=self.run.trainer.cfg.policy_loss == "grpo_guard")
        trainer, acc_grads = self.run.trainer, acc["sum"]
        on_policy = task.version == mb.version  # generated by the weights this task trains
        for chunk in self._chunks(units, mb.trained.shape[1]):
            if self._pace_chunks and acc_grads.metrics is not None:
                # The CPU client runs a program's launch and its collective participants on one
                # pool of as many threads as devices, and a launch that finds a device with 32
                # programs in flight holds its thread until one finishes. Dispatched far ahead,
                # those launches took the threads that a queued gradient's all-gather needed:
                # the started participants waited for the missing ones, forever (2-process
                # gap+tsp, 1 run in 7). One chunk in flight keeps every device far below 32.
                jax.block_until_ready(acc_grads.metrics)
            trainer.add_chunk(acc_grads, self.state.trainable, chunk, on_policy)
        self.tracer.record(task, acc_grads.metrics["loss"], start, sample_ids=mb.sample_ids.tolist())  # grads get donated

    def _update(self, task: plan_lib.Task, acc: dict) -> dict:
        start = self.tracer.now()
        self.state, metrics = self.run.trainer.finish_update(self.state, acc["sum"], acc["finite"])
        self.tracer.record(task, metrics["version"], start)
        return metrics

    # ------------------------------------------------------------------ one iteration
    def _fixed_split(self) -> tuple[int | None, int | None]:
        """(tag, prefetch) as the config fixes them; None where the executor chooses from costs."""
        rt = self.config.runtime
        fixed_tag = rt.tag_microbatches if rt.tag_microbatches >= 0 or not self.flags.tag else None
        fixed_prefetch = rt.prefetch_microbatches if rt.prefetch_microbatches >= 0 or not self.flags.tcss else None
        if not self.flags.tag:
            fixed_tag = 0
        if not self.flags.tcss or rt.staleness == 0:
            fixed_prefetch = 0
        return fixed_tag, fixed_prefetch

    @property
    def elastic_split(self) -> bool:
        """Whether iterations choose their (tag, prefetch) from measured costs."""
        return None in self._fixed_split()

    def split_for(self, k: int) -> tuple[int, int]:
        """(tag, prefetch) of iteration k: fixed by config, or chosen from measured costs."""
        fixed_tag, fixed_prefetch = self._fixed_split()
        if fixed_tag is not None and fixed_prefetch is not None:
            return fixed_tag, fixed_prefetch
        costs = self.measured_costs()
        if costs is None:
            split = (fixed_tag or 0, fixed_prefetch or 0)
        else:
            tag, prefetch = plan_lib.choose_split(self.mode, self.microbatches, costs, fixed_tag=fixed_tag, fixed_prefetch=fixed_prefetch)
            split = (min(tag, self.microbatches - len(self.carried)), prefetch)
        if jax.process_count() > 1:
            # Each process timed the tasks as it saw them (its own devices' work, the others' as
            # dispatched), so their choices can differ; a different plan would issue different
            # cross-process transfers and hang them all. Every process takes process 0's split.
            split = tuple(int(v) for v in multihost_utils.broadcast_one_to_all(np.asarray(split, np.int32)))
        return split

    def measured_costs(self) -> plan_lib.Costs | None:
        def typical(kind, group):  # the median: robust to a stray slow task (a late compile, a host pause)
            values = self.measured.get((kind, group))
            return float(np.median(values)) if values else None

        if self.meshes.colocated:  # one group: rollout and training share every device
            roll, train = typical("rollout", "shared"), typical("train", "shared")
            if roll is None or train is None:
                return None
            return plan_lib.Costs(rollout={"shared": roll}, reward=typical("reward", "reward") or 0.0, train=train,
                                  update=typical("update", "shared") or 0.0, sync=0.0)
        roll_r, roll_t, train = typical("rollout", "rollout"), typical("rollout", "train"), typical("train", "train")
        if roll_r is None or train is None:
            return None
        if roll_t is None:  # never measured: assume the trainer's speed per device matches rollout's
            roll_t = roll_r * self.meshes.rollout.devices.size / self.meshes.train.devices.size
        return plan_lib.Costs(
            rollout={"rollout": roll_r, "train": roll_t, "shared": roll_r},
            reward=typical("reward", "reward") or 0.0,
            train=train,
            update=typical("update", "train") or 0.0,
            sync=typical("sync", "link") or 0.0,
        )

    def iteration(self, k: int) -> tuple[plan_lib.IterationPlan, dict]:
        """Dispatch iteration k; returns its plan and metrics (device arrays; read them later)."""
        tag, prefetch = self.split_for(k)
        carried = len(self.carried)
        plan = plan_lib.plan_iteration(
            self.mode, k, self.microbatches, carried=carried, tag=tag, prefetch=prefetch,
            updates=self.config.rl.num_updates_per_batch,
        )
        self._iteration_start[k] = self.tracer.now()
        mbs = {(k, m.index): m for m in self.microbatches_of(k)[carried:]}
        mbs.update({(k, m.index): m for m in self.carried})
        next_mbs = {}
        if prefetch:
            next_mbs = {(k + 1, m.index): m for m in self.microbatches_of(k + 1)[:prefetch]}
        acc = self._fresh_acc()
        update_metrics = []

        def handle(task: plan_lib.Task) -> None:
            nonlocal acc
            if task.kind == "rollout":
                self._rollout(task, mbs.get((task.iteration, task.index)) or next_mbs[(task.iteration, task.index)])
            elif task.kind == "train":
                self._train(task, mbs[(task.iteration, task.index)], acc)
            elif task.kind == "update":
                update_metrics.append(self._update(task, acc))
                acc = self._fresh_acc()
            elif task.kind == "sync":
                self._sync(task.version, task.deps)

        # Each device group's tasks from its own thread (dispatch.py says why), across
        # iterations: this returns once iteration k's own tasks ran, while the next iteration's
        # prefetched rollouts (and the sync after them) may still be on the rollout thread.
        # Several processes dispatch from one thread: their cross-process transfers must be
        # issued in the same order by every process.
        if self.lanes is None:
            dispatch(plan.tasks, handle, threaded=False)
        else:
            self.lanes.forget(before_iteration=k - 1)
            self.lanes.submit(plan.tasks, handle)
            self.lanes.wait([t.key for t in plan.tasks if t.iteration == k and t.kind != "reward"])
        self.carried = list(next_mbs.values())
        self._last = [mbs[(k, m)] for m in range(self.microbatches)]
        all_rewards = np.concatenate([mb.rewards.result() for mb in sorted(mbs.values(), key=lambda m: m.index)])
        metrics = to_every_process(_iteration_metrics(update_metrics))  # readable on every process
        metrics.update(
            step=k + 1,
            reward_mean=float(np.mean(all_rewards)),
            reward_std=float(np.std(all_rewards)),
            mode=self.mode,
            tag_microbatches=tag,
            prefetch_microbatches=prefetch,
            carried_microbatches=carried,
        )
        return plan, metrics

    def sample(self, trainable, cond: Conditioning, sample_keys: jax.Array, noise_levels, version) -> jax.Array:
        """Decoded samples of `trainable` (a tree laid out like the train state's, e.g. its EMA) for
        `cond` and `sample_keys` (host-derived, alike on every process), readable on every process.

        They roll out where micro-batches do: on the rollout role, the weights moved there first
        (outside the plan: the synced weights stay as they are), or on the shared mesh when
        colocated. Every process calls it at the same point of the loop (it runs transfers).
        """
        group = "shared" if self.meshes.colocated else "rollout"
        if self.meshes.colocated:
            params = self._weights_for_sampling(trainable, self.run.trainer.frozen)
        else:
            params = self._to_rollout(trainable)[1]
        cond, sample_keys = mesh_lib.put_batch((cond, sample_keys), self.meshes.for_group(group))
        traj = self.run.sampler.rollout(params, cond, sample_keys, noise_levels, self.run.latent_shape, version)
        return to_every_process(self.run.workload.decode(traj.final, self._decoder.get(group)))

    def last_finals(self) -> jax.Array:
        """Final latents of the last iteration's samples, in sample order (readable on every process)."""
        return to_every_process(jnp.concatenate([mesh_lib.put_batch(mb.traj.final, self.meshes.train) for mb in self._last]))

    def last_prompt_ids(self) -> np.ndarray:
        """The prompt id of each of the last iteration's samples, in `last_finals`' order."""
        return np.concatenate([mb.prompt_ids for mb in self._last])

    @staticmethod
    def _fresh_acc() -> dict:
        return {"sum": GradSum(), "finite": True}

    def timing(self, k: int, plan: plan_lib.IterationPlan) -> dict:
        """Iteration k's measured figures (waits until its tasks completed: call it one step late)."""
        self.tracer.wait_through(k)
        events = self.tracer.events
        mine = [e for e in events if e["args"]["iteration"] == k or (e["args"]["kind"] == "sync" and e["args"]["iteration"] == k + 1)]
        for e in sorted(mine, key=lambda e: e["ts"]):
            key = (e["args"]["kind"], e["args"]["group"])
            if key not in self._compiled:  # the first task of a kind on a group includes compilation
                self._compiled.add(key)
                continue
            self.measured.setdefault(key, []).append(e["dur"] / 1e6)
            self.measured[key] = self.measured[key][-2 * self.microbatches :]
        end_of = lambda it: max((e["ts"] + e["dur"]) / 1e6 for e in events if e["args"]["kind"] == "update" and e["args"]["iteration"] == it)  # noqa: E731
        end = end_of(k)
        start = end_of(k - 1) if k - 1 in self._iteration_start else self._iteration_start[k]
        groups = ["shared"] if self.meshes.colocated else ["rollout", "train"]
        summary = iteration_summary(events, k, (start, end), groups)
        batch = self.config.rl.prompts_per_iteration * self.config.rl.group_size
        seconds = max(end - start, 1e-9)
        return {
            **summary,
            "seconds": seconds,
            "samples_per_s": batch / seconds,
            "samples_per_s_per_device": batch / seconds / self.meshes.num_devices,
        }

    # ------------------------------------------------------------------ checkpoints
    def _carried_tree(self) -> dict:
        # The trajectories live on the rollout role (or the trainer's, with TAG): host copies on
        # every process, process 0 included (orbax's writer of host arrays; see `save`).
        return {
            str(m.index): {
                "traj": jax.device_get(to_every_process(
                    {f.name: getattr(m.traj, f.name) for f in dataclasses.fields(Trajectory) if f.name != "sample_keys"}
                )),
                "rewards": m.rewards.result(),
                "version": np.int32(m.version),
                "group": np.int32(plan_lib.GROUPS.index(m.group)),
            }
            for m in self.carried
        }

    def save(self, manager: ocp.CheckpointManager, iterations_done: int) -> None:
        """Checkpoint the train state and the micro-batches prefetched for the next iteration (async).

        Every process calls it at the same point of the loop. Several processes: orbax (0.12)
        writes a jax.Array only from shards spread over several processes (a train role inside
        one process has host-local arrays there, which it refuses; processes without shards fail)
        and host arrays from process 0 only, which need not own a train device. So every process
        takes a whole host copy of the state and process 0 writes it: `to_every_process`
        replicates the state on every train device, then sends one copy to each other process;
        for the save, a full state per train device and per host. One process: the state as it
        lives on its devices, written asynchronously without a host copy.
        """
        self.drain()  # the prefetched micro-batches are saved: their rollouts must have run
        # No checkpoint holds NaN or inf: one device reduction per save, read here (saves are rare).
        finite = jax.device_get(to_every_process(_finite_parts(self.state)))
        bad = [part for part, ok in finite.items() if not ok]
        if bad:
            raise FloatingPointError(
                f"checkpoint {iterations_done} not saved: the {' and '.join(bad)} hold NaN or inf values (the "
                "checkpoints saved before are kept). Updates are checked before they are applied (non-finite values, "
                "rl.max_update_ratio), so these came from a restored checkpoint or a bug; stopping"
            )
        state = self.state
        if jax.process_count() > 1:
            state = jax.device_get(to_every_process(state))
        meta = {
            "carried": [m.index for m in self.carried],
            "mode": self.mode,
            "fingerprint": checkpoints.fingerprint(self.config),
            # The task costs measured so far: a resumed run chooses its elastic splits as this one would.
            "measured": [[kind, group, values] for (kind, group), values in self.measured.items()],
        }
        items = {"state": ocp.args.StandardSave(state), "meta": ocp.args.JsonSave(meta)}
        if self.carried:
            items["carried"] = ocp.args.StandardSave(self._carried_tree())
        manager.save(iterations_done, args=ocp.args.Composite(**items))

    def restore(self, manager: ocp.CheckpointManager, step: int | None = None) -> int:
        """Restore checkpoint `step` (default: the latest) with its prefetched micro-batches and
        measured task costs; the iteration to start from."""
        latest = manager.latest_step() if step is None else step
        if latest is None:
            return 0
        meta = checkpoints.read_meta(manager, latest)
        multi_process = jax.process_count() > 1
        # One process: straight onto the train shardings. Several: host arrays on every process
        # (as `save` wrote them), then each process places the slices of its own train devices.
        abstract_state = jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=None if multi_process else s),
            self.state, self.state_sharding,
        )
        items = {"state": ocp.args.StandardRestore(abstract_state)}
        if meta["carried"]:
            items["carried"] = ocp.args.StandardRestore()
        restored = manager.restore(latest, args=ocp.args.Composite(**items))
        version = int(restored["state"].version)
        self.state = restored["state"]
        if multi_process:
            self.state = jax.tree.map(
                lambda a, s: jax.make_array_from_callback(a.shape, s, a.__getitem__, dtype=a.dtype),
                self.state, self.state_sharding,
            )
        self.carried = []
        for mb in self.microbatches_of(latest)[: len(meta["carried"])]:
            saved = restored["carried"][str(mb.index)]
            mb.traj = Trajectory(sample_keys=mb.sample_keys, **{name: jnp.asarray(a) for name, a in saved["traj"].items()})
            mb.version = int(saved["version"])
            mb.group = plan_lib.GROUPS[int(saved["group"])]
            mb.rewards = concurrent.futures.Future()
            mb.rewards.set_result(np.asarray(saved["rewards"], np.float32))
            self.carried.append(mb)
        self.rollout_version = -1
        self.measured = {(kind, group): list(values) for kind, group, values in meta.get("measured", [])}
        self.tracer.resume(latest, kept={(latest, m.index) for m in self.carried})
        self.log(f"resumed from checkpoint {latest} (policy version {version}, {len(self.carried)} prefetched micro-batches)")
        return latest

    def drain(self) -> None:
        """Wait until every dispatched task (the next iteration's prefetched rollouts too) ran."""
        if self.lanes is not None:
            self.lanes.drain()

    def close(self) -> None:
        try:
            self.drain()
        finally:
            if self.lanes is not None:
                self.lanes.close()
            self.pool.shutdown(wait=True)  # first: the reward threads record their tasks in the trace
            self.tracer.close()
