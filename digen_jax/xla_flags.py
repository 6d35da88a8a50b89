"""XLA settings the launchers set before the first device is touched (XLA reads them once, then).

GPU defaults, each chosen by measurement (docs/design.md section 5, XLA flags):
  --xla_gpu_enable_triton_gemm=false: cuBLAS for every matmul. Triton picked the per-block
      modulation projections (batch-sized rows against 3072 x 18432 weights) and ran them far
      below memory bandwidth; cuBLAS runs them near it, and forward and backward are faster.

Device memory: XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 (JAX's default is 0.75). The memory plan
(`runtime/memory_plan.py`) lets a role take `Efficiency.usable_hbm` (0.85) of a card and the
rest is headroom for what it does not count; at 0.75 a run the plan admits would stop with
RESOURCE_EXHAUSTED (Qwen-Image-20B full fine-tuning peaks at 113 GiB of an H200's 140 on its
train GPUs). Every GPU measurement in benchmarks/ ran at 0.95.

A flag already in XLA_FLAGS, or a memory fraction already set, is left as the user set it. Setting them on a CPU-only machine is
harmless: XLA parses GPU flags everywhere and the CPU backend ignores them.
"""
from __future__ import annotations

import os
from typing import MutableMapping

GPU_DEFAULTS = {
    "xla_gpu_enable_triton_gemm": "false",
}
MEM_FRACTION = "0.95"


def set_defaults(environ: MutableMapping[str, str] = os.environ, *, memory: bool = True) -> str:
    """Add every `GPU_DEFAULTS` flag that XLA_FLAGS does not set already, and (`memory`)
    MEM_FRACTION as XLA_PYTHON_CLIENT_MEM_FRACTION unless set; returns the new XLA_FLAGS."""
    flags = environ.get("XLA_FLAGS", "").split()
    present = {f.lstrip("-").split("=", 1)[0] for f in flags}
    flags += [f"--{name}={value}" for name, value in GPU_DEFAULTS.items() if name not in present]
    environ["XLA_FLAGS"] = " ".join(flags)
    if memory:
        environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", MEM_FRACTION)
    return environ["XLA_FLAGS"]
