"""What every configs/paper model config shares: one update per iteration and a runtime section.

The simulated grid compares systems on the same work per iteration, so the second
(off-policy) update some recipes make is folded into one (`rl.num_updates_per_batch = 1`),
and training chunks hold enough units to give every trainer device several
(`rl.micro_batch_size`).
"""
from configs.sections import runtime_section, sharding_section


def paper_overrides(c, *, micro_batch_size: int = 64):
    c.rl.num_updates_per_batch = 1
    c.rl.micro_batch_size = micro_batch_size
    c.runtime = runtime_section("gap+tsp+tag+tcss", micro_batches=8)
    c.sharding = sharding_section()
    return c
