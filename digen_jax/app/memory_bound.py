"""A lower bound of a run's memory, checked before any compute.

A run's largest arrays have sizes the config fixes: the base weights; the trained ones (LoRA
adapters, or the whole model) with their two Adam moments and, with `rl.ema`, an EMA copy; the
trajectories of an iteration's samples (float32 latents along the ladder and the step means);
and those of the eval prompts. Their sum is a bound from below of what the run holds:
activations, compiled programs and copies on other roles come on top. When it exceeds all the
memory of the run's devices and hosts together, no placement can run it, and
`machine_checks.check_memory` refuses the config with one line naming the key that makes it so, before anything is
allocated (instead of an abort or an out-of-memory kill minutes into the run).
"""
from __future__ import annotations

import math
import os
from typing import NamedTuple

import jax
import ml_collections


LATENT_BYTES = 4  # latents and means are float32 (rl.rollout.Trajectory)


class Need(NamedTuple):
    what: str  # the arrays, with the config values that size them
    nbytes: int
    fix: str  # which key to lower


def size_text(n: float) -> str:
    """`n` bytes in GB, TB or PB, three significant digits."""
    for scale, unit in ((1e15, "PB"), (1e12, "TB")):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n / 1e9:.3g} GB"


def host_memory() -> int:
    """This host's physical memory in bytes."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def machine_memory() -> tuple[int, str]:
    """(bytes, description) of the memory every process of the run can reach together: each
    accelerator's allocator limit plus the host's physical memory, times the processes (CPU
    devices share the host's; processes that share a host count it each, which only loosens the
    bound)."""
    host = host_memory()
    processes = jax.process_count()
    accelerators = [d for d in jax.local_devices() if d.platform != "cpu"]
    device_bytes = sum((d.memory_stats() or {}).get("bytes_limit", 0) for d in accelerators)
    total = (host + device_bytes) * processes
    hosts = f"{processes} hosts'" if processes > 1 else "the host's"
    if accelerators:
        return total, f"{len(accelerators) * processes} x {accelerators[0].device_kind} and {hosts} memory"
    return total, f"{hosts} memory"


def ladder_copies(config: ml_collections.ConfigDict) -> int:
    """Latent-sized float32 arrays a sampled trajectory keeps per sample: the N + 1 latents of the
    ladder and the N step means (eval samples and GRPO's rollouts; DiffusionNFT's rollouts keep
    the final sample only)."""
    return 2 * config.sampling.num_steps + 1


def needs(config: ml_collections.ConfigDict, abstract_params, lora_shapes: list[tuple[int, ...]],
          latent_values: int, sample_keys: str) -> list[Need]:
    """The arrays `machine_checks.check_memory` counts. abstract_params: the transformer's (ShapeDtypeStructs);
    lora_shapes: the adapted kernels' shapes ((layers,) in, out), empty for full fine-tuning;
    latent_values: values per sample's latents; sample_keys: the keys that size one sample."""
    rl = config.rl
    base_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(abstract_params))
    base = Need("the base model's weights", base_bytes,
                "it needs devices with more memory, or a smaller model (model.variant, model.arch, model.num_layers)")
    copies = 2 + bool(rl.ema)  # Adam's two moments, the EMA
    state = f"their Adam moments{' and EMA' if rl.ema else ''}"
    if rl.lora_rank:  # float32 adapters (rl.lora.init_lora) beside the base
        adapters = sum(4 * math.prod(s[:-2]) * rl.lora_rank * (s[-2] + s[-1]) for s in lora_shapes)
        trained = Need(f"the rl.lora_rank={rl.lora_rank} adapters and {state}", (1 + copies) * adapters,
                       "lower rl.lora_rank")
    else:  # the base weights are the trained ones
        trained = Need(f"{state} of the fully fine-tuned weights", copies * base_bytes,
                       "train LoRA adapters (rl.lora_rank > 0) or a smaller model")
    per_sample = latent_values * LATENT_BYTES
    rollout_copies = 1 if rl.algorithm == "nft" else ladder_copies(config)
    eval_copies = ladder_copies(config)
    samples = rl.prompts_per_iteration * rl.group_size
    bigger = "rl.group_size" if rl.group_size >= rl.prompts_per_iteration else "rl.prompts_per_iteration"
    rollout = Need(f"the trajectories of rl.prompts_per_iteration={rl.prompts_per_iteration} x rl.group_size="
                   f"{rl.group_size} samples of {latent_values} latent values ({sample_keys})",
                   samples * rollout_copies * per_sample, f"lower {bigger}")
    evals = Need(f"the trajectories of train.eval_prompts={config.train.eval_prompts} samples of {latent_values} "
                 f"latent values ({sample_keys})", config.train.eval_prompts * eval_copies * per_sample,
                 "lower train.eval_prompts")
    return [base, trained, rollout, evals]
