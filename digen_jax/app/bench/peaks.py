"""The card's peak FLOP rate, which MFU is measured against: the datasheet's and a measured one."""
from __future__ import annotations

import math
from typing import Any

from digen_jax.app.bench.timing import time_calls

# Datasheet dense bf16 tensor-core peaks (FLOP/s, no sparsity), matched in order against the
# lower-cased device kind.
DATASHEET_BF16_PEAK = (
    ("h100 pcie", 756e12),
    ("h100", 989.4e12),
    ("h200", 989.4e12),
    ("h800", 989.4e12),
    ("a100", 312e12),
    ("l40s", 362e12),
)


def datasheet_peak(device_kind: str) -> float | None:
    """The datasheet dense bf16 peak (FLOP/s) of a device kind; None when unknown."""
    kind = device_kind.lower()
    return next((peak for name, peak in DATASHEET_BF16_PEAK if name in kind), None)


ACCELERATOR_MATMUL_SIZE = 8192  # the peak's matmul side where `--matmul_size` is left unset, off a CPU


def matmul_size_for(asked: int | None, platform: str) -> int:
    """The side of the peak's matmuls: `asked` if given (0 skips), else `ACCELERATOR_MATMUL_SIZE`
    on a GPU or TPU and 0 on a CPU, whose peak no MFU is read against and where that chain of
    8192^3 matmuls takes minutes."""
    if asked is not None:
        return asked
    return 0 if platform == "cpu" else ACCELERATOR_MATMUL_SIZE


def measure_matmul_peak(size: int, chain: int, repeats: int) -> dict[str, Any]:
    """Best FLOP rate of `chain` chained (size x size) bf16 matmuls in one jitted call."""
    import jax
    import jax.numpy as jnp

    @jax.jit
    def make(key):
        kx, kw = jax.random.split(key)
        x = jax.random.normal(kx, (size, size), jnp.bfloat16)
        # Scaled so that the chain neither overflows nor underflows.
        return x, (jax.random.normal(kw, (size, size), jnp.float32) / math.sqrt(size)).astype(jnp.bfloat16)

    @jax.jit
    def run(x, w):
        return jax.lax.fori_loop(0, chain, lambda _, y: jnp.dot(y, w), x)

    print(f"measuring the bf16 matmul peak: {chain} chained {size}^3 matmuls per call, {repeats} calls "
          "(--matmul_size=0 skips it)", flush=True)
    x, w = make(jax.random.key(0))
    times = time_calls(lambda: run(x, w), jax.block_until_ready, repeats, warmup=2)
    flop = 2 * chain * size**3
    return {"size": size, "chain": chain, "times_s": times, "flops_per_s": flop / min(times)}
