"""The `runtime` and `sharding` config sections every config shares (`configs/*.py` call these)."""
from __future__ import annotations

import ml_collections


def runtime_section(mode: str = "colocated", micro_batches: int = 1) -> ml_collections.ConfigDict:
    """Schedule mode and device roles (DESIGN.md sections 2 and 4; README 'Runtime')."""
    return ml_collections.ConfigDict(
        dict(
            # 'colocated' | 'disagg_sync' | 'gap' | 'gap+tsp' | 'gap+tsp+tag' | 'gap+tsp+tag+tcss'
            mode=mode,
            micro_batches=micro_batches,  # M: micro-batches (whole groups) per iteration
            # Devices per role (disaggregated modes); 0 = an even split of what is left.
            # Colocated: train_devices > 0 uses only the first train_devices devices.
            rollout_devices=0,
            train_devices=0,
            reward_devices=0,  # 0: rewards are scored where decoding ran
            # Micro-batches the trainer rolls out (tag modes) / the rollout group prefetches with
            # stale weights (tcss); -1: chosen every iteration from measured costs.
            tag_microbatches=-1,
            prefetch_microbatches=-1,
            staleness=1,  # tcss bound on version lag (0 turns prefetching off)
            reward_workers=2,  # host threads scoring micro-batches
            trace=True,  # WORKDIR/trace.json (Chrome trace)
            distributed=False,  # jax.distributed.initialize() (SLURM auto-detection); see launch/slurm/
        )
    )


def sharding_section(fsdp: bool = True) -> ml_collections.ConfigDict:
    """Logical axis -> mesh axis rules per role (digen_jax.models.layers lists the logical names).

    Rollout replicates the weights and splits the batch (no per-step all-gathers); training
    shards the hidden dimension of every weight over its devices (FSDP) when `fsdp`.
    """
    batch = (("activation_batch", "data"),)
    return ml_collections.ConfigDict(
        dict(
            rollout_rules=batch,
            train_rules=batch + ((("embed", "data"),) if fsdp else ()),
        )
    )
