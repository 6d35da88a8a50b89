"""The system bench (`--mode=system`): every schedule mode on the same devices, model and batch.

One `app.loop.Run` (model, sampler, trainer, reward) is built once; each mode gets its own
`Executor` over it, so every mode starts from the same weights and shares compiled step
functions where the meshes agree. After `warmup` iterations (compilation, first cost
measurements for the elastic splits; they finish before the timed ones are planned, so even
the first timed iteration splits from measured costs; a mode with elastic splits warms up one
iteration more, planned from those costs, so that its trainer rollouts are compiled and the
micro-batches it prefetches are in flight when the timing starts, as in a long run, and more,
up to `MAX_SETTLING_ITERATIONS`, until its split stops changing)
`iterations` are timed from the trace: images (or
videos) per second and per device, end-to-end MFU from exact FLOP counts, busy/bubble per
device group, weight-sync time and the splits the elastic modes chose, and the timed updates'
own figures: Flow-GRPO's ratio and lag-0 log-prob figures, or DiffusionNFT's `nft_*` loss
figures (the record names its `rl.algorithm`).
"""
from __future__ import annotations

import copy
import dataclasses
import gc
import json
import os
import statistics
import time
from typing import Any, Callable, Sequence

import jax
import numpy as np

from digen_jax.app import loop
from digen_jax.app.bench import provenance
from digen_jax.app.bench.peaks import datasheet_peak, matmul_size_for, measure_matmul_peak
from digen_jax.app.run_sizing import sample_flops
from digen_jax.app.settings import run_settings
from digen_jax.app.validation import validate_bench_arguments
from digen_jax.rl.grpo_trainer import GrpoTrainer
from digen_jax.rl.trainer import LAG0_FIGURES
from digen_jax.runtime import plan as plan_lib
from digen_jax.runtime.executor import Executor
from digen_jax.runtime.figures import read_figures


def measure(
    config,
    modes: Sequence[str],
    workdir: str,
    *,
    warmups: int,
    iterations: int,
    onpolicy_anchors: Sequence[str],
    matmul_size: int | None,
    matmul_chain: int,
    on_update: Callable[[dict[str, Any]], None],
) -> dict[str, Any]:
    """The system bench's result: provenance, the peak MFU is measured against (the bf16 matmul peak
    of `matmul_size`, else the datasheet's; 0 skips the measurement, None takes the platform's
    default, `matmul_size_for`) and the `run_modes` figures.

    `on_update` gets the result after every mode, so a run cut short keeps what it measured.
    """
    validate_bench_arguments(config, modes, warmups=warmups, iterations=iterations, onpolicy_anchors=onpolicy_anchors)
    device = jax.devices()[0]
    matmul_size = matmul_size_for(matmul_size, device.platform)
    matmul = measure_matmul_peak(matmul_size, matmul_chain, 3) if matmul_size else None
    peak = matmul["flops_per_s"] if matmul else datasheet_peak(device.device_kind)
    result = {
        **provenance.run_record("system", used=jax.device_count()),
        "gpu": device.device_kind,
        "config": json.loads(config.to_json_best_effort()),
        "peaks": {"datasheet_bf16_flops_per_s": datasheet_peak(device.device_kind), "measured_matmul": matmul,
                  "mfu_against": "measured_matmul" if matmul else "datasheet"},
    }

    def update(figures: dict[str, Any]) -> None:
        result.update(figures)
        on_update(result)

    run_modes(
        config, modes, workdir, warmups=warmups, iterations=iterations, peak_flops=peak,
        log=lambda m: print(m, flush=True), on_mode=update, onpolicy_anchors=onpolicy_anchors,
        checked=True,
    )
    return result


# Extra warm-up iterations an elastic mode may take for its split to settle.
MAX_SETTLING_ITERATIONS = 3


def _keep_warming(executor: Executor, k: int, plans: list, *, extra: int) -> bool:
    """Whether an elastic mode warms up one more iteration before timing iteration `k`.

    At least one (planned from measured costs: its trainer rollouts compile, its prefetch is
    in flight), then until iteration `k` would start as a long run's do: with the split of the
    one before and the micro-batches that one prefetched (a changed split leaves the previous
    iteration's extra prefetch to finish inside the timed one), at most
    `MAX_SETTLING_ITERATIONS`. Where the last warm-up prefetched and no earlier one did, the
    next iteration would be the first to train stale samples (their proximal log-probs compile
    then): it warms up too.
    """
    if extra == 0:
        return True
    if extra >= MAX_SETTLING_ITERATIONS:
        return False
    if plans[-1].prefetch and not any(p.prefetch for p in plans[:-1]):
        return True
    tag, prefetch = executor.split_for(k)
    return (tag, prefetch) != (plans[-1].tag, plans[-1].prefetch)


def run_modes(
    config,
    modes: Sequence[str],
    workdir: str,
    *,
    warmups: int = 1,
    iterations: int = 2,
    peak_flops: float | None = None,
    log: Callable[[str], None] = print,
    on_mode: Callable[[dict], None] | None = None,
    onpolicy_anchors: Sequence[str] = (),
    checked: bool = False,
) -> dict:
    """Benchmark `modes` on `config`; returns one record per mode plus the shared figures.

    `on_mode` gets the figures so far after each mode, so a long run that is cut short
    still leaves the modes it finished. `onpolicy_anchors` (values of `rl.onpolicy_anchor`)
    runs every mode once per anchor, from the same run and weights; records are then keyed
    `'<mode> onpolicy_anchor=<anchor>'`. `checked`: the caller ran `validate_bench_arguments` on
    these arguments already.
    """
    if not checked:
        validate_bench_arguments(config, modes, warmups=warmups, iterations=iterations,
                                 onpolicy_anchors=onpolicy_anchors)
    algorithm = config.rl.get("algorithm", "grpo")
    os.makedirs(workdir, exist_ok=True)
    started = time.time()
    run = loop.Run(config, workdir, log=log, validated=True)  # validate_bench_arguments checked every mode
    log(f"built the run in {time.time() - started:.1f} s")
    per_sample = sample_flops(config, run.workload.model_cfg)
    batch = config.rl.prompts_per_iteration * config.rl.group_size
    records = {}
    jobs = [(a, m) for a in (onpolicy_anchors or [None]) for m in modes]
    for i, (anchor, mode) in enumerate(jobs):
        name = mode if anchor is None else f"{mode} onpolicy_anchor={anchor}"
        mode_config = copy.deepcopy(config)
        mode_config.runtime.mode = mode
        if anchor is not None and anchor != run.trainer.cfg.onpolicy_anchor:
            mode_config.rl.onpolicy_anchor = anchor
            run.trainer = GrpoTrainer(run.sampler, run.trainer.frozen, run.trainer.optimizer,
                                  dataclasses.replace(run.trainer.cfg, onpolicy_anchor=anchor))
        trace_path = os.path.join(workdir, f"trace_{name.replace('+', '_').replace(' ', '_').replace('=', '_')}.json")
        if jax.process_index() == 0 and os.path.exists(trace_path):  # its writer: processes may share the workdir
            os.remove(trace_path)
        executor = Executor(run, settings=run_settings(mode_config), trace_path=trace_path, log=log)
        if i == len(jobs) - 1:
            # Each mode starts from the initial state in host memory; after the last one has placed
            # it, nothing reads it again (full fine-tuning: the weights and Adam moments).
            run.state = None
        warmup, settling = warmups, bool(warmups and executor.elastic_split)
        more = f" (+1 to {MAX_SETTLING_ITERATIONS} while the elastic split settles)" if settling else ""
        log(f"[{name}] {warmup} warm-up{more} + {iterations} timed iterations of {batch} samples")
        try:
            plans, timings, metrics = [], [], []
            k = 0
            while k < warmup + iterations:
                if 0 < k <= warmup:  # a warm-up finishes before the next iteration is planned from its costs
                    timings.append(executor.timing(k - 1, plans[k - 1]))
                    if k == warmup and settling:
                        settling = _keep_warming(executor, k, plans, extra=warmup - warmups)
                        warmup += int(settling)
                plan, figures = executor.iteration(k)
                plans.append(plan)
                metrics.append(figures)  # device arrays: read after the mode
                if k > warmup:  # one step late, as in training: the splits of k + 1 use k - 1's costs
                    timings.append(executor.timing(k - 1, plans[k - 1]))
                k += 1
            executor.drain()  # the last iteration's prefetched rollouts belong to its timing
            timings.append(executor.timing(len(plans) - 1, plans[-1]))
            timings = timings[warmup:]
        finally:
            executor.close()
        metrics = [read_figures(m) for m in metrics[warmup:]]
        devices = executor.meshes.num_devices
        rate = statistics.mean(t["samples_per_s"] for t in timings)
        groups = timings[0]["bubble_frac"].keys()
        record = {
            "algorithm": algorithm,
            "samples_per_s": rate,
            "samples_per_s_per_device": rate / devices,
            "devices": devices,
            "iteration_s": [t["seconds"] for t in timings],
            "bubble_frac": {g: statistics.mean(t["bubble_frac"][g] for t in timings) for g in groups},
            "dispatch_frac": {g: statistics.mean(t["dispatch_frac"][g] for t in timings) for g in groups},
            "sync_s": statistics.mean(t["sync_s"] for t in timings),
            "staleness_max": max(t["staleness_max"] for t in timings),
            "splits": [{"tag": p.tag_microbatches, "prefetch": p.prefetch, "carried": p.carried} for p in plans[warmup:]],
            "trace": os.path.basename(trace_path),
            "micro_batches": mode_config.runtime.micro_batches,
            "colocated_sampling": executor.colocated_sampling if mode == plan_lib.COLOCATED else None,
            "warmup_iterations": warmup,
            "onpolicy_anchor": mode_config.rl.onpolicy_anchor,
            # Peak bytes each local device held since the process started (the allocator's figure;
            # it includes earlier modes), beside the memory plan's prediction.
            "peak_bytes_in_use": [(d.memory_stats() or {}).get("peak_bytes_in_use") for d in jax.local_devices()],
            **(_nft_figures(metrics) if algorithm == "nft" else _ratio_figures(metrics)),
        }
        costs = executor.measured_costs()
        if costs is not None:  # the measured task times, for the simulator (simulator.predict_from_profile)
            record["costs"] = {"rollout": dict(costs.rollout), "reward": costs.reward, "train": costs.train,
                               "update": costs.update, "sync": costs.sync}
        if per_sample is not None:
            record["flops_per_sample"] = per_sample
            achieved = rate * per_sample["total"] / devices
            record["flops_per_s_per_device"] = achieved
            if peak_flops:
                record["mfu"] = achieved / peak_flops
        records[name] = record
        log(
            f"[{name}] {rate:.3f} samples/s = {rate / devices:.3f} per device; bubbles "
            + ", ".join(f"{g} {f:.0%}" for g, f in record["bubble_frac"].items())
            + (f"; MFU {record['mfu']:.1%}" if "mfu" in record else "")
            + "; " + _figures_line(record)
        )
        del executor
        gc.collect()
        if on_mode is not None:
            on_mode(_figures(records, batch))
    return _figures(records, batch)


def _ratio_figures(metrics: list[dict]) -> dict:
    """The timed iterations' ratio figures: means, and the lag-0 log-prob figures over all their
    lag-0 units (None when there were none)."""
    out = {k: float(np.mean([m[k] for m in metrics])) for k in ("ratio_mean", "clip_frac", "approx_kl")}
    units = np.array([m["lag0_units"] for m in metrics], np.float64)
    out["lag0_units"] = int(units.sum())
    for name in LAG0_FIGURES:
        if not units.sum():
            out[f"{name}_mean"] = out[f"{name}_max"] = None
            continue
        means = np.array([m[f"{name}_mean"] for m in metrics], np.float64)
        out[f"{name}_mean"] = float(np.sum(np.where(units > 0, means * units, 0.0)) / units.sum())
        out[f"{name}_max"] = float(np.nanmax([m[f"{name}_max"] for m in metrics]))
    return out


def _nft_figures(metrics: list[dict]) -> dict:
    """The timed iterations' DiffusionNFT figures (`rl.nft.nft_loss`'s `nft_*`): their means."""
    return {k: float(np.mean([m[k] for m in metrics])) for k in metrics[0] if k.startswith("nft_")}


def _figures_line(record: dict) -> str:
    """The log line's part for the update figures of `record`'s algorithm."""
    if record["algorithm"] == "nft":
        return (f"nft rho {record['nft_rho_mean']:.3f}, old-policy deviation {record['nft_old_deviation']:.2e}, "
                f"ref penalty {record['nft_ref_penalty']:.2e}")
    return f"clip_frac {record['clip_frac']:.4f}, lag-0 |log-ratio| max {record['logp_diff_max']}"


def _figures(records: dict, batch: int) -> dict:
    """The per-mode records with their speedups over the baselines among them, and the shared figures."""
    for baseline in (plan_lib.SYNC_BASELINE, plan_lib.COLOCATED):
        if baseline in records:
            base = records[baseline]["samples_per_s"]
            for r in records.values():
                r[f"speedup_vs_{baseline}"] = r["samples_per_s"] / base
    return {"modes": records, "batch": batch, "num_devices": len(jax.devices())}
