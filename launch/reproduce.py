r"""Simulate the paper's evaluation grid: four models x three testbeds x seven systems.

    python launch/reproduce.py --out_dir=/tmp/paper            # tables (markdown) + PNG plots (matplotlib)
    python launch/reproduce.py --readme=benchmarks/README.md  # also rewrite the benchmark log's section

Models: configs/paper/{flux,qwenimage,wan21,hunyuanvideo}.py. Testbeds: configs/paper/testbeds.py
(16 and 32 H800, and 16 H800 rollout + 16 L40S train with $/hour). Systems: colocated in the
veRL-Omni style (replicated rollout weights, training state offloaded around rollout),
colocated in the GenRL style (sampling on the FSDP training weights), then the disaggregated
ablation disagg_sync, +GAP, +TSP, +TAG, +TCSS at the testbed's role split, and the full mode
with role sizes, micro-batches and TAG share from `simulator.autosize`.

Every number is simulated (digen_jax/runtime/simulator.py, digen_jax/runtime/task_costs.py):
exact FLOPs of each model, the device table and the default `Efficiency` factors, scheduled by
the executor's planner. Each system runs at its best micro-batch count (a divisor of the
prompts, <= 16). Writes `tables.md`, `speedup_<testbed>.png` and
`timeline_<model>_<testbed>.png` to --out_dir. The plots need matplotlib (requirements-dev.txt);
without it the tables and --readme are written and the plots are skipped with a line saying so.
"""
from __future__ import annotations

import dataclasses
import importlib
import os
import re
import sys
import time

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from digen_jax import cli  # noqa: E402
from digen_jax.app import run_sizing  # noqa: E402
from digen_jax.runtime import simulator, task_costs  # noqa: E402
from digen_jax.runtime import plan as plan_lib  # noqa: E402

MODELS = (("FLUX.1-12B", "flux"), ("Qwen-Image-20B", "qwenimage"), ("Wan2.1-14B", "wan21"), ("HunyuanVideo-13B", "hunyuanvideo"))


def _column(mode: str) -> str:
    """A disaggregated mode's column: the sync baseline by name, every other by the technique it adds."""
    added = plan_lib.technique(mode)
    return f"+{added}" if added else mode


# (column, mode, colocated style): the two colocated baselines, then the disaggregated ablation
SYSTEMS = (
    ("veRL-Omni-style colocated", plan_lib.COLOCATED, "offload"),
    ("GenRL-style colocated", plan_lib.COLOCATED, "fsdp_sampling"),
    *((_column(mode), mode, None) for mode in plan_lib.DISAGGREGATED_MODES),
)
SYNC, FULL = _column(plan_lib.SYNC_BASELINE), _column(plan_lib.BEST_MODE)
PIPELINED = _column(next(m for m in plan_lib.DISAGGREGATED_MODES if plan_lib.mode_flags(m).pipelined))
AUTOSIZED = f"{FULL} autosized"
README_START = "<!-- simulated-paper-tables:start -->"
README_END = "<!-- simulated-paper-tables:end -->"

_OUT = flags.DEFINE_string("out_dir", "benchmarks/simulated", "Where tables.md and the PNG plots go.")
_README = flags.DEFINE_string("readme", None, f"Rewrite the part of this file between {README_START} and {README_END}.")
_PLOTS = flags.DEFINE_boolean("plots", True, "Write PNG plots (needs matplotlib; skipped with a note without it).")
NO_MATPLOTLIB = ("plots skipped: matplotlib is not installed (python3 -m pip install matplotlib, or "
                 "requirements-dev.txt); the tables are complete")


def testbeds() -> list[tuple[str, task_costs.Pool]]:
    out = []
    for t in importlib.import_module("configs.paper.testbeds").get_config().testbeds:
        pool = task_costs.Pool.parse(t["pool"], devices_per_host=t["devices_per_host"], cross_host_bw=t["cross_host_bw"],
                                     devices=task_costs.with_prices(t["prices"]))
        out.append((t["name"], pool))
    return out


@dataclasses.dataclass
class Grid:
    """Predictions per (model, testbed) and system, and the role split autosize chose per cell."""

    cells: dict  # (model, testbed) -> {system: Prediction}
    autosized: dict  # (model, testbed) -> simulator.Sizing


def run_grid() -> Grid:
    """Every cell of the grid: each system at its best micro-batch count, plus the autosized full mode."""
    grid = Grid({}, {})
    beds = testbeds()
    for title, module in MODELS:
        work = run_sizing.iteration_work(importlib.import_module(f"configs.paper.{module}").get_config())
        for bed, pool in beds:
            row = {name: simulator.simulate(work, pool, mode, style=style or "fsdp_sampling") for name, mode, style in SYSTEMS}
            # role sizes in half-host steps: a finer search gains little and would take minutes
            sizing = simulator.autosize(work, pool, role_step=max(1, pool.devices_per_host // 2))
            row[AUTOSIZED] = sizing.prediction
            grid.cells[(title, bed)] = row
            grid.autosized[(title, bed)] = sizing
    return grid


def tables(grid: Grid) -> str:
    names = [s[0] for s in SYSTEMS] + [AUTOSIZED]
    head = "| model | testbed | " + " | ".join(names) + " |\n|---|---|" + "---:|" * len(names)
    out = ["**Throughput** (samples/s: images or videos per second, whole testbed)\n", head]
    for (model, bed), row in grid.cells.items():
        out.append(f"| {model} | {bed} | " + " | ".join(f"{row[n].samples_per_s:.3g}" for n in names) + " |")
    out += ["", "**Speedup** over the better colocated baseline (and over disagg_sync in brackets)\n", head]
    for (model, bed), row in grid.cells.items():
        base = max(row[SYSTEMS[0][0]].samples_per_s, row[SYSTEMS[1][0]].samples_per_s)
        sync = row[SYNC].samples_per_s
        out.append(f"| {model} | {bed} | " + " | ".join(
            f"{row[n].samples_per_s / base:.2f}x ({row[n].samples_per_s / sync:.2f}x)" for n in names) + " |")
    out += ["", "**Where the time goes**: bubble fraction per device group, TAG / prefetch micro-batches, micro-batches M "
            "(full mode at the testbed split; autosized: rollout/train devices)\n",
            f"| model | testbed | {SYNC} bubbles | {FULL} bubbles | {FULL} tag/prefetch/M | autosized split, tag/prefetch/M |",
            "|---|---|---|---|---|---|"]
    for (model, bed), row in grid.cells.items():
        sync, full, auto = row[SYNC], row[FULL], grid.autosized[(model, bed)]
        bub = lambda p: ", ".join(f"{g} {f:.0%}" for g, f in p.bubble_frac.items())  # noqa: E731
        out.append(f"| {model} | {bed} | {bub(sync)} | {bub(full)} | {full.tag:g}/{full.prefetch}/{full.microbatches} | "
                   f"{auto.rollout_devices}/{auto.train_devices}, {auto.tag:g}/{auto.prefetch}/{auto.microbatches} |")
    out += ["", "**Cost efficiency** (samples per dollar; $/GPU-hour from configs/paper/testbeds.py)\n",
            "| model | testbed | $/h | " + " | ".join(names) + " |", "|---|---|---:|" + "---:|" * len(names)]
    for (model, bed), row in grid.cells.items():
        dollars = row[names[0]].dollars_per_hour
        out.append(f"| {model} | {bed} | {dollars:.0f} | " + " | ".join(f"{row[n].samples_per_dollar:.3g}" for n in names) + " |")
    return "\n".join(out)


def plots(grid: Grid, out_dir: str) -> list[str]:
    """Speedup bars per testbed and simulated timelines (bubbles are the gaps) of one model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.patches
    import matplotlib.pyplot as plt

    written = []
    names = [s[0] for s in SYSTEMS] + [AUTOSIZED]
    beds = list(dict.fromkeys(bed for _, bed in grid.cells))
    for bed in beds:
        fig, ax = plt.subplots(figsize=(11, 4))
        models = [m for m, b in grid.cells if b == bed]
        width = 0.8 / len(names)
        for i, n in enumerate(names):
            values = []
            for m in models:
                row = grid.cells[(m, bed)]
                base = max(row[SYSTEMS[0][0]].samples_per_s, row[SYSTEMS[1][0]].samples_per_s)
                values.append(row[n].samples_per_s / base)
            ax.bar([j + i * width for j in range(len(models))], values, width, label=n)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(models))], models)
        ax.set_ylabel("speedup over best colocated (simulated)")
        ax.set_title(f"Simulated throughput, {bed}")
        ax.legend(fontsize=7, ncol=4)
        path = os.path.join(out_dir, f"speedup_{_slug(bed)}.png")
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    model, bed = MODELS[1][0], beds[0]
    row = grid.cells[(model, bed)]
    shown = (SYNC, PIPELINED, FULL)
    fig, axes = plt.subplots(len(shown), 1, figsize=(11, 1.6 * len(shown) + 0.6), sharex=True)
    colors = {"rollout": "tab:blue", "train": "tab:orange", "update": "tab:red", "sync": "tab:green", "reward": "tab:gray"}
    span = max(row[n].iteration_s for n in shown)
    for ax, n in zip(axes, shown):
        p = row[n]
        lanes = ["rollout", "train", "reward", "link"]
        for t in p.timeline:
            if t["group"] not in lanes:
                continue
            y = lanes.index(t["group"])
            start, end = max(t["start"], 0.0), min(t["end"], p.iteration_s)
            ax.broken_barh([(start, end - start)], (y - 0.4, 0.8), color=colors[t["kind"]],
                           alpha=1.0 if t["timed"] else 0.5, edgecolor="k", lw=0.2)
        ax.set_yticks(range(len(lanes)), lanes)
        ax.set_xlim(0, span)
        ax.set_title(f"{n}: {p.iteration_s:.1f} s/iteration, bubbles " + ", ".join(f"{g} {f:.0%}" for g, f in p.bubble_frac.items()), fontsize=8)
    axes[0].legend(handles=[matplotlib.patches.Patch(color=c, label=k) for k, c in colors.items()], fontsize=7,
                   ncol=len(colors), loc="upper right")
    axes[-1].set_xlabel(f"seconds into one steady-state iteration ({model}, {bed}; simulated; pale: other iterations' work)")
    fig.tight_layout()
    path = os.path.join(out_dir, f"timeline_{_slug(model)}_{_slug(bed)}.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)
    return written


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", text.lower()).strip("_")


def write_readme(path: str, body: str) -> None:
    with open(path) as f:
        text = f.read()
    if README_START not in text or README_END not in text:
        raise app.UsageError(f"--readme={path}: no {README_START} ... {README_END} markers")
    head, rest = text.split(README_START, 1)
    _, tail = rest.split(README_END, 1)
    with open(path, "w") as f:
        f.write(f"{head}{README_START}\n{body}\n{README_END}{tail}")


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}")
    started = time.time()
    grid = run_grid()
    body = tables(grid)
    os.makedirs(_OUT.value, exist_ok=True)
    with open(os.path.join(_OUT.value, "tables.md"), "w") as f:
        f.write(body + "\n")
    print(body)
    if _README.value:
        write_readme(_README.value, body)
        print(f"rewrote the simulated tables in {_README.value}")
    if _PLOTS.value:
        try:
            import matplotlib  # noqa: F401  (a dev extra: the tables need none of it)
        except ImportError:
            print(NO_MATPLOTLIB)
        else:
            for path in plots(grid, _OUT.value):
                print(f"wrote {path}")
    print(f"\n{len(grid.cells)} cells x {len(SYSTEMS) + 1} systems simulated in {time.time() - started:.1f} s")


if __name__ == "__main__":
    cli.run(main)
