"""What a finished training run tells its user: a summary of its results and files, the next
command, and `metrics.png`, the reward and eval curves of `metrics.jsonl`.

`finish(workdir, next_command)` is called by `launch/train.py` on process 0 once `loop.train`
returns. The plot is drawn with Pillow (a runtime dependency), so the first command of the
README writes it without the plotting extras.
"""
from __future__ import annotations

import json
import os
from typing import Callable, Sequence

from PIL import Image, ImageDraw, ImageFont

PLOT_NAME = "metrics.png"
# (metrics.jsonl key, legend, RGB colour) of each curve in the plot
CURVES = (
    ("reward_mean", "reward of the iteration's samples", (31, 119, 180)),
    ("eval_reward_mean", "eval reward (fixed prompts, ODE, EMA weights)", (255, 127, 14)),
)


def read_rows(workdir: str) -> list[dict]:
    """The rows of `workdir/metrics.jsonl` ([] without the file); a row cut short is left out."""
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    rows = []
    with open(path) as f:
        for line in f:
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows


def latest_checkpoint(workdir: str) -> str | None:
    """The path of the highest-numbered checkpoint under `workdir/checkpoints`, or None."""
    root = os.path.join(workdir, "checkpoints")
    steps = [int(name) for name in os.listdir(root) if name.isdigit()] if os.path.isdir(root) else []
    return os.path.join(root, str(max(steps))) if steps else None


def _series(rows: Sequence[dict], key: str) -> list[tuple[int, float]]:
    return [(row["step"], row[key]) for row in rows if isinstance(row.get(key), (int, float))]


def plot(rows: Sequence[dict], path: str, title: str = "") -> bool:
    """Draw the `CURVES` of `rows` against the iteration into the PNG `path`; False (and nothing
    written) when no row has a reward."""
    curves = [(_series(rows, key), label, colour) for key, label, colour in CURVES]
    curves = [c for c in curves if c[0]]
    if not curves:
        return False
    width, height, left, right, top, bottom = 720, 420, 60, 20, 40, 70
    steps = [s for points, _, _ in curves for s, _ in points]
    values = [v for points, _, _ in curves for _, v in points]
    x0, x1 = min(steps), max(max(steps), min(steps) + 1)
    y0, y1 = min(values), max(values)
    pad = max(0.05 * (y1 - y0), 0.01)
    y0, y1 = y0 - pad, y1 + pad
    image = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(image)
    font = ImageFont.load_default()

    def xy(step: float, value: float) -> tuple[float, float]:
        return (left + (step - x0) / (x1 - x0) * (width - left - right),
                height - bottom - (value - y0) / (y1 - y0) * (height - top - bottom))

    for i in range(5):  # value ticks and grid lines
        value = y0 + (y1 - y0) * i / 4
        _, y = xy(x0, value)
        draw.line((left, y, width - right, y), fill=(225, 225, 225))
        draw.text((4, y - 6), f"{value:.3f}", fill="black", font=font)
    for step in sorted({x0 + round((x1 - x0) * i / 4) for i in range(5)}):  # iteration ticks
        x, _ = xy(step, y0)
        draw.line((x, height - bottom, x, height - bottom + 4), fill="black")
        draw.text((x - 8, height - bottom + 6), str(step), fill="black", font=font)
    draw.rectangle((left, top, width - right, height - bottom), outline="black")
    draw.text((width // 2 - 24, height - bottom + 20), "iteration", fill="black", font=font)
    draw.text((left, 12), title or "reward per iteration", fill="black", font=font)
    for i, (points, label, colour) in enumerate(curves):
        pixels = [xy(s, v) for s, v in points]
        if len(pixels) > 1:
            draw.line(pixels, fill=colour, width=2)
        for x, y in pixels:
            draw.ellipse((x - 2, y - 2, x + 2, y + 2), fill=colour)
        legend_y = height - bottom + 36 + 14 * i
        draw.line((left, legend_y + 6, left + 24, legend_y + 6), fill=colour, width=3)
        draw.text((left + 32, legend_y), label, fill="black", font=font)
    image.save(path)
    return True


def _first_and_last(points: Sequence[tuple[int, float]]) -> str:
    text = [f"{value:.3f} at iteration {step}" for step, value in (points[0], points[-1])]
    return text[0] if len(points) == 1 else ", ".join(text)


def summary(workdir: str, rows: Sequence[dict], plotted: bool, next_command: str) -> list[str]:
    """The lines printed at the end of a run: results, where its files are, what to run next."""
    lines = []
    if rows:
        last = rows[-1]
        iterations = last["step"]
        lines.append(f"done: {iterations} iterations; policy version {last['version']} (the version counts optimizer "
                     "updates: rl.num_updates_per_batch per iteration)")
        lines.append(f"  reward of the iteration's samples: {_first_and_last(_series(rows, 'reward_mean'))}")
        evals = _series(rows, "eval_reward_mean")
        if evals:
            lines.append(f"  eval reward (fixed prompts): {_first_and_last(evals)}")
        # The loop saves a checkpoint after the last iteration; with several processes the train
        # role's processes write it, so it may still be landing while process 0 reports.
        checkpoint = os.path.join(workdir, "checkpoints", str(iterations))
    else:
        lines.append("done: no iteration ran")
        checkpoint = latest_checkpoint(workdir)
    files = [
        ("checkpoint", checkpoint or "none written"),
        ("metrics", f"{os.path.join(workdir, 'metrics.jsonl')} (one JSON object per iteration)"),
        ("plot", os.path.join(workdir, PLOT_NAME) if plotted else "none (no reward in metrics.jsonl)"),
        ("TensorBoard", f"{os.path.join(workdir, 'tb')} (scalars and sample grids: tensorboard --logdir "
                        f"{os.path.join(workdir, 'tb')}; python3 -m pip install tensorboard)"),
        ("trace", f"{os.path.join(workdir, 'trace.json')} (open in https://ui.perfetto.dev)"),
    ]
    lines += [f"  {name + ':':13s}{where}" for name, where in files]
    lines.append(f"next, sample the eval prompts with the trained weights (writes samples.png): {next_command}")
    return lines


def finish(workdir: str, next_command: str, log: Callable[[str], None] = print) -> None:
    """Write `metrics.png` of the run in `workdir` and log the end-of-run summary."""
    rows = read_rows(workdir)
    plotted = plot(rows, os.path.join(workdir, PLOT_NAME), title=f"reward per iteration: {workdir}")
    for line in summary(workdir, rows, plotted, next_command):
        log(line)
