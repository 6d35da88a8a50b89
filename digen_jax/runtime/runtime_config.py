"""Checks of a config's `runtime` section against the planner's modes, the batch and the devices,
before any compute: each failure a ValueError naming the key."""
from __future__ import annotations

import jax
import numpy as np

from digen_jax.rl.timesteps import plan_steps
from digen_jax.runtime import plan as plan_lib
from digen_jax.runtime.memory_plan import COLOCATED_SAMPLING, TAG_PRECISION
from digen_jax.runtime.mesh import AXIS


def split_grain(config, meshes) -> int:
    """Pieces per micro-batch the trainer's rollouts count in on the role meshes `meshes`
    (`plan.pieces_per_microbatch`; 1: whole micro-batches, without TAG or with several
    processes); a ValueError naming the key when a fixed `runtime.tag_microbatches` is off it."""
    rt, rl = config.runtime, config.rl
    flags = plan_lib.mode_flags(rt.mode)
    grain = 1
    if flags.tag and jax.process_count() == 1:
        samples = rl.prompts_per_iteration * rl.group_size // rt.micro_batches
        grain = plan_lib.pieces_per_microbatch(samples, [meshes.for_group(g).shape[AXIS] for g in ("rollout", "train")])
    tag = rt.tag_microbatches
    if flags.tag and tag >= 0 and abs(tag * grain - round(tag * grain)) > 1e-9:
        raise ValueError(
            f"runtime.tag_microbatches={tag:g} is not a multiple of 1/{grain} micro-batch, the finest split of this run "
            f"({'several processes split whole micro-batches' if jax.process_count() > 1 else 'pieces of samples every role batch axis divides'}); "
            f"use a multiple of {1 / grain:g}, or -1 to choose from measured costs")
    return grain


def validate_runtime_config(config, num_devices: int) -> None:
    """Reject a bad `runtime` section before any compute, naming the key."""
    rt, rl = config.runtime, config.rl
    flags = plan_lib.mode_flags(rt.mode)
    if rt.micro_batches < 1 or rl.prompts_per_iteration % rt.micro_batches:
        raise ValueError(
            f"runtime.micro_batches={rt.micro_batches} must divide rl.prompts_per_iteration={rl.prompts_per_iteration}"
            " (micro-batches hold whole groups)"
        )
    sampling = rt.get("colocated_sampling", "auto")
    if sampling not in COLOCATED_SAMPLING:
        raise ValueError(f"runtime.colocated_sampling={sampling!r} is not one of "
                         f"{', '.join(repr(v) for v in COLOCATED_SAMPLING)}")
    precision = rt.get("tag_precision", "auto")
    if precision not in TAG_PRECISION:
        raise ValueError(f"runtime.tag_precision={precision!r} is not one of {', '.join(repr(v) for v in TAG_PRECISION)}")
    if rt.staleness < 0:
        raise ValueError(f"runtime.staleness must be >= 0, got {rt.staleness}")
    if rl.num_updates_per_batch < 1 or rt.micro_batches % rl.num_updates_per_batch:
        raise ValueError(
            f"rl.num_updates_per_batch={rl.num_updates_per_batch} must divide runtime.micro_batches={rt.micro_batches}"
            " (each update trains an equal share of whole micro-batches)"
        )
    for key in ("tag_microbatches", "prefetch_microbatches"):
        value = rt[key]
        if value > rt.micro_batches:
            raise ValueError(f"runtime.{key}={value:g} exceeds runtime.micro_batches={rt.micro_batches}")
    # The micro-batches prefetched in one iteration are carried into the next, whose trainer
    # rollouts come from the rest (`plan.plan_iteration`); -1 (elastic) is chosen to fit.
    tag = rt.tag_microbatches if flags.tag else 0
    prefetch = rt.prefetch_microbatches if flags.tcss and rt.staleness > 0 else 0
    if tag >= 0 and prefetch >= 0 and tag + prefetch > rt.micro_batches:
        raise ValueError(
            f"runtime.tag_microbatches={tag:g} + runtime.prefetch_microbatches={prefetch} exceed runtime.micro_batches="
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
    if rt.reward_devices and not flags.colocated and jax.process_count() > 1:
        # Both groups' threads would issue programs onto the reward devices, in no fixed order
        # between processes (docs/design.md section 2).
        raise ValueError(
            f"runtime.reward_devices={rt.reward_devices} needs a single process; with {jax.process_count()} processes "
            "set runtime.reward_devices=0 (rewards are scored where the samples are decoded)"
        )
    wanted = rt.rollout_devices + rt.train_devices + rt.reward_devices
    if not flags.colocated and wanted > num_devices:
        raise ValueError(
            f"runtime.rollout_devices + train_devices + reward_devices = {wanted} exceeds the {num_devices} devices"
        )
