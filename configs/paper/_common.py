"""What every configs/paper model config shares: one update per iteration and a runtime section.

The simulated grid compares systems on the same work per iteration, so the second
(off-policy) update some recipes make is folded into one (`rl.num_updates_per_batch = 1`),
and training chunks hold enough units to give every trainer device several
(`rl.grad_chunk_size`).
"""
from configs.schema import FSDP_RULES


def paper_overrides(c, *, grad_chunk_size: int = 64):
    c.rl.num_updates_per_batch = 1
    c.rl.grad_chunk_size = grad_chunk_size
    c.runtime.mode, c.runtime.micro_batches = "gap+tsp+tag+tcss", 8
    c.sharding.train_rules = FSDP_RULES
    return c
