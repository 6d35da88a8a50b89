"""Timed calls: synchronised repeats after untimed warm-up calls, and their summary figures."""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable


def time_calls(call: Callable[[], Any], sync: Callable[[Any], Any], repeats: int, warmup: int) -> list[float]:
    """Seconds of `repeats` synchronised calls after `warmup` untimed ones."""
    for _ in range(warmup):
        sync(call())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        sync(call())
        times.append(time.perf_counter() - start)
    return times


def summary(times: list[float], flop: int | None, peaks: dict[str, float | None]) -> dict[str, Any]:
    """Median and minimum of `times`; with `flop`, the achieved rate and its MFU against each of `peaks`
    (`mfu_<name>`, None for an unknown peak)."""
    median = statistics.median(times)
    out = {"times_s": times, "median_s": median, "min_s": min(times)}
    if flop is not None:
        rate = flop / median
        out["flops_per_s"] = rate
        for name, peak in peaks.items():
            out[f"mfu_{name}"] = rate / peak if peak else None
    return out
