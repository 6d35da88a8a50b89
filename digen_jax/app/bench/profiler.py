"""Device time per kernel and per kernel class, from one call recorded with the JAX profiler."""
from __future__ import annotations

import glob
import gzip
import json
import os
import re
from typing import Any, Callable

# Kernel classes by name, first match wins: GEMMs (cuBLAS/cuBLASLt/CUTLASS), fused attention
# (cuDNN/flash), collectives, copies; the rest are XLA's generated fusions.
KERNEL_CLASSES = (
    ("attention", re.compile(r"cudnn|flash|fmha|sdpa", re.I)),
    ("matmul", re.compile(r"gemm|cutlass|xmma|nvjet|cublas|wgmma", re.I)),
    ("collective", re.compile(r"nccl|all_reduce|all_gather|reduce_scatter", re.I)),
    ("copy", re.compile(r"memcpy|memset|copy", re.I)),
)


def kernel_class(name: str) -> str:
    return next((cls for cls, pattern in KERNEL_CLASSES if pattern.search(name)), "fusion/other")


def profile(call: Callable[[], Any], log_dir: str) -> dict[str, Any]:
    """Record one synchronised `call` with the JAX profiler (a Perfetto trace under `log_dir`) and
    return its `device_time_by_kernel`."""
    import jax

    with jax.profiler.trace(log_dir, create_perfetto_trace=True):
        jax.block_until_ready(call())
    return device_time_by_kernel(log_dir)


def device_time_by_kernel(log_dir: str, top: int = 40) -> dict[str, Any]:
    """Device time of the Perfetto trace under `log_dir`: per kernel class and the `top` kernels.

    Device events are those of processes named like a device ('/device:GPU:0'), except the
    XLA summary lines (modules and ops), which would count every kernel twice.
    """
    paths = sorted(glob.glob(os.path.join(log_dir, "**", "perfetto_trace.json.gz"), recursive=True))
    if not paths:
        return {"error": f"no perfetto_trace.json.gz under {log_dir}"}
    with gzip.open(paths[-1], "rt") as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    names = {(e.get("pid"), e.get("tid")): e.get("args", {}).get("name", "")
             for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"}
    processes = {e.get("pid"): e.get("args", {}).get("name", "") for e in events
                 if e.get("ph") == "M" and e.get("name") == "process_name"}
    devices = {pid for pid, name in processes.items() if "/device:" in name}
    per_kernel: dict[str, list[float]] = {}
    for e in events:
        if e.get("ph") != "X" or e.get("pid") not in devices:
            continue
        if re.search(r"XLA (Modules|Ops|TraceMe)|Steps", names.get((e.get("pid"), e.get("tid")), "")):
            continue
        stat = per_kernel.setdefault(e.get("name", "?"), [0.0, 0])
        stat[0] += float(e.get("dur", 0.0)) / 1e3
        stat[1] += 1
    total = sum(ms for ms, _ in per_kernel.values())
    classes: dict[str, float] = {}
    for name, (ms, _) in per_kernel.items():
        classes[kernel_class(name)] = classes.get(kernel_class(name), 0.0) + ms
    kernels = sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[:top]
    return {
        "trace": paths[-1],
        "processes": sorted(processes.values()),
        "device_ms": total,
        "class_ms": dict(sorted(classes.items(), key=lambda kv: -kv[1])),
        "kernels": [{"name": n[:200], "ms": ms, "calls": calls, "class": kernel_class(n)} for n, (ms, calls) in kernels],
    }
