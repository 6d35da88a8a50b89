r"""Predict the throughput of every schedule mode for a config on a device pool (no devices used).

The simulator (digen_jax/runtime/simulator.py) runs the executor's planner against a cost
model (digen_jax/runtime/task_costs.py: exact FLOPs of the config's model and a device table),
or against the task costs a system bench run measured:

    python launch/simulate.py --config=configs/qwenimage.py --pool=h800:16
    python launch/simulate.py --config=configs/paper/wan21.py --pool=h100:32/rollout=12 --micro_batches=8
    python launch/simulate.py --config=configs/flux.py --pool=rollout=h800:16,train=l40s:16 --price=l40s=0.9
    python launch/simulate.py --config=configs/qwenimage.py --pool=h100:16 --autosize
    python launch/simulate.py --profile=benchmarks/results/system_<...>.json   # + what 'auto' re-ranks to

Pools: KIND:N (an even rollout/train split), KIND:N/rollout=R, or rollout=KIND:N,train=KIND:N
(kinds: h100, h100_pcie, h200, h800, a100, l40s; TPU chips v5e, v5p, v6e, whose slice shares ICI:
`--pool=v5p:8 --devices_per_host=8`). Colocated modes use every device of the pool
and are shown in both styles: fsdp_sampling (the executor's, as GenRL) and offload (as
veRL-Omni). Prints a markdown table: samples/s, per device, speedup over disagg_sync, bubble
fraction per device group, the TAG / prefetch split, micro-batches, MFU and samples per dollar;
then the memory plan of every mode (digen_jax/runtime/memory_plan.py: GiB per device of each
role's weights, gradients, optimizer state, copies, rollout copy, activations and sync buffers).
A mode whose plan does not fit the pool's device memory gets no predicted speed.
"""
from __future__ import annotations

import json
import os
import sys

from absl import app, flags
from ml_collections import config_flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from digen_jax import cli  # noqa: E402
from digen_jax.app import run_sizing  # noqa: E402
from digen_jax.runtime import plan as plan_lib  # noqa: E402
from digen_jax.runtime import memory_plan, simulator, task_costs  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", None, "Model-zoo config file (ml_collections), e.g. configs/qwenimage.py.")
_POOL = flags.DEFINE_string("pool", "h100:16", "Device pool: KIND:N, KIND:N/rollout=R or rollout=KIND:N,train=KIND:N.")
_PROFILE = flags.DEFINE_string("profile", None, "A system bench JSON (benchmarks/results/system_*.json): predict from its measured costs.")
_MICRO = flags.DEFINE_integer("micro_batches", None, "Micro-batches per iteration; default: each mode's best divisor of the prompts (<= 16).")
_HOSTS = flags.DEFINE_integer("devices_per_host", 8, "Devices per host (role groups beyond one host cross the network).")
_XBW = flags.DEFINE_float("cross_host_gbps", 200.0, "Network bandwidth between hosts, Gb/s per GPU.")
_PRICE = flags.DEFINE_multi_string("price", [], "KIND=DOLLARS per device-hour, repeatable (overrides the device table).")
_EFF = flags.DEFINE_multi_string("efficiency", [], "NAME=VALUE overriding task_costs.Efficiency (e.g. rollout=0.45), repeatable.")
_AUTOSIZE = flags.DEFINE_boolean("autosize", False, "Also search role sizes, micro-batches and TAG share for the full mode, "
                                  "and rank every mode at its best sizing (what runtime.mode=auto runs).")
_JSON = flags.DEFINE_string("json", None, "Also write the predictions to this JSON file.")


def _pairs(values: list[str], flag: str) -> dict[str, float]:
    out = {}
    for v in values:
        name, sep, number = v.partition("=")
        try:
            out[name] = float(number)
        except ValueError:
            sep = ""
        if not sep:
            raise app.UsageError(f"--{flag}={v!r}: expected NAME=NUMBER")
    return out


def pool_from_flags() -> task_costs.Pool:
    try:
        return task_costs.Pool.parse(
            _POOL.value, devices_per_host=_HOSTS.value, cross_host_bw=_XBW.value * 1e9 / 8,
            devices=task_costs.with_prices(_pairs(_PRICE.value, "price")),
        )
    except ValueError as e:
        raise app.UsageError(f"--pool: {e}") from None


def table(predictions: list[simulator.Prediction]) -> str:
    """A markdown table of predictions (speedups against disagg_sync when it is among them)."""
    base = next((p.samples_per_s for p in predictions if p.mode == plan_lib.SYNC_BASELINE), None)
    lines = [
        "| mode | samples/s | per device | vs disagg_sync | bubble | tag / prefetch | M | MFU | samples/$ |",
        "|---|---:|---:|---:|---|---|---:|---:|---:|",
    ]
    for p in predictions:
        name = p.mode + (f" ({p.style})" if p.style else "")
        if not p.fits:
            r = p.memory.over()
            lines.append(f"| {name} | does not fit: {r.role} needs {r.device_bytes / task_costs.GIB:.1f} of "
                         f"{r.capacity / task_costs.GIB:.1f} GiB | - | - | - | - | {p.microbatches} | - | - |")
            continue
        bubble = ", ".join(f"{g} {f:.0%}" for g, f in p.bubble_frac.items())
        speedup = f"{p.samples_per_s / base:.2f}x" if base else "-"
        mfu = f"{p.mfu:.1%}" if p.mfu is not None else "-"
        per_dollar = f"{p.samples_per_dollar:.0f}" if p.samples_per_dollar else "-"
        lines.append(
            f"| {name} | {p.samples_per_s:.3f} | {p.samples_per_s_per_device:.4f} | {speedup} | {bubble} | "
            f"{p.tag:g} / {p.prefetch} | {p.microbatches} | {mfu} | {per_dollar} |"
        )
    return "\n".join(lines)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}")
    if _PROFILE.value:
        try:
            with open(_PROFILE.value) as f:
                record = json.load(f)
            if not isinstance(record, dict) or record.get("mode") != "system":
                raise ValueError("not a system bench record (`launch/bench.py --mode=system` writes one)")
            predicted = simulator.predict_from_profile(record)
        except (OSError, ValueError) as e:  # JSONDecodeError is a ValueError
            sys.exit(f"error: --profile={_PROFILE.value}: {e}")
        print(f"Predicted from the measured costs in {_PROFILE.value} ({record.get('gpu', '?')}):\n")
        print("| mode | measured samples/s | predicted | predicted / measured |\n|---|---:|---:|---:|")
        for mode, rate in predicted.items():
            measured = record["modes"][mode].get("samples_per_s")
            ratio = f"{rate / measured:.3f}" if measured else "-"
            shown = f"{measured:.3f}" if measured else "-"
            print(f"| {mode} | {shown} | {rate:.3f} | {ratio} |")
        # What runtime.mode='auto' would choose after measuring each mode's costs (the cost model
        # calibrated by them prices every other mode and sizing on the record's devices).
        print()
        for mode, r in record["modes"].items():
            try:
                print(f"{mode}: " + run_sizing.rerank_line(run_sizing.rerank_record(record, mode),
                                                           f"from {mode}'s measured costs"))
            except ValueError as e:
                print(f"{mode}: no re-rank ({e})")
        return
    if _CONFIG.value is None:
        raise app.UsageError("--config (a model-zoo config file) or --profile is required")
    pool = pool_from_flags()
    try:
        eff = task_costs.Efficiency(**_pairs(_EFF.value, "efficiency"))
    except TypeError as e:
        raise app.UsageError(f"--efficiency: {e}") from None
    try:
        work = run_sizing.iteration_work(_CONFIG.value)
        predictions = [simulator.simulate(work, pool, plan_lib.COLOCATED, style=s, eff=eff, microbatches=_MICRO.value)
                       for s in task_costs.COLOCATED_STYLES]
        predictions += [simulator.simulate(work, pool, m, eff=eff, microbatches=_MICRO.value)
                        for m in plan_lib.DISAGGREGATED_MODES]
    except ValueError as e:  # a config / pool combination that cannot run: say which key
        raise app.UsageError(str(e)) from None
    print(f"Simulated on {pool.describe()} (${pool.dollars_per_hour():.2f}/h), {work.family}, "
          f"{work.samples} samples per iteration, costs from FLOPs x device table x efficiency {eff}.\n")
    print(table(predictions))
    print("\nMemory plan, GiB per device (runtime/memory_plan.py; activations estimated):")
    for p in predictions:
        print(f"\n{p.mode}{f' ({p.style})' if p.style else ''}, {p.microbatches} micro-batches:\n{p.memory.table()}")
        print(f"host memory of one process driving every device: {memory_plan.host_bytes(work, p.memory) / task_costs.GIB:.1f} GiB "
              f"(initial weights and offloaded moments; a run refuses over {memory_plan.USABLE_HOST:.0%} of the host's)")
    out = {"pool": pool.describe(), "predictions": [p.as_dict() for p in predictions]}
    if _AUTOSIZE.value:
        try:
            sizing = simulator.autosize(work, pool, eff=eff)
        except ValueError as e:
            raise app.UsageError(str(e)) from None
        speed = f"{sizing.prediction.samples_per_s:.3f} samples/s" if sizing.prediction.fits else \
            f"no split fits: {sizing.prediction.memory.over().role} role over its memory"
        print(f"\nautosize ({plan_lib.BEST_MODE}): {sizing.runtime_overrides()} -> {speed}")
        out["autosize"] = {**sizing.runtime_overrides(), "samples_per_s": sizing.prediction.samples_per_s}
        try:
            ranked = simulator.choose_mode(work, pool, eff=eff)
        except ValueError as e:
            raise app.UsageError(str(e)) from None
        print(run_sizing.mode_line(pool, ranked))
        out["auto"] = [{**s.runtime_overrides(), "samples_per_s": s.prediction.samples_per_s, "fits": s.prediction.fits}
                       for s in ranked]
    if _JSON.value:
        with open(_JSON.value, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    cli.run(main)
