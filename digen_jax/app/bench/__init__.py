"""Benchmarks (`launch/bench.py`): the JAX model bench (`model`), the diffusers PyTorch module it is
compared with (`torch_peer`), the system bench over the schedule modes (`system`), and what they
share: the card's peak FLOP rate (`peaks`), timed calls (`timing`), profiler traces summed per
kernel (`profiler`), the provenance every result records (`provenance`) and where results go
(`results`).

The modules other than `system` import jax and torch inside the functions that use them: the
entry point's `--help` stays fast, and no GPU backend starts before the PyTorch peer has run."""
