"""What a new user sees around a run: the end-of-run summary and plot, the training script's help
and config printout, and launch/reproduce.py on the runtime install (no matplotlib)."""
import json
import os
import subprocess
import sys

import numpy as np
from PIL import Image

from digen_jax.app import report

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_first_hour import ROOT, _env, run_side_by_side  # noqa: E402

# launch/reproduce.py as the runtime install runs it: matplotlib cannot be imported. One cell of
# the grid (a model on a testbed) keeps it to seconds; the flags, tables, --readme and exit path
# are the script's own.
_REPRODUCE_WITHOUT_MATPLOTLIB = """
import sys
sys.modules["matplotlib"] = None  # the import system's "not importable" marker
sys.path.insert(0, "launch")
import reproduce
from digen_jax import cli
reproduce.MODELS = reproduce.MODELS[:1]
first_testbed = reproduce.testbeds()[:1]
reproduce.testbeds = lambda: first_testbed
sys.argv = ["launch/reproduce.py", *sys.argv[1:]]
cli.run(reproduce.main)
"""


def _rows(n: int = 8, eval_every: int = 4) -> list[dict]:
    rows = []
    for step in range(1, n + 1):
        row = {"step": step, "version": 2 * step, "reward_mean": 0.4 + 0.05 * step}
        if step % eval_every == 0:
            row["eval_reward_mean"] = 0.5 + 0.04 * step
        rows.append(row)
    return rows


def test_run_summary_names_results_files_and_next_command(tmp_path):
    """`report.finish` on a workdir as a run leaves it: metrics.png drawn with both curves, and a
    summary with the first and last rewards, the last eval, the version explained, every file's
    path and the command to run next."""
    workdir = tmp_path / "run"
    (workdir / "checkpoints" / "4").mkdir(parents=True)
    (workdir / "checkpoints" / "8").mkdir()
    rows = _rows()
    (workdir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 9, "rew')
    lines = []
    report.finish(str(workdir), "python3 launch/sample.py --config=configs/tiny.py --workdir=RUN", log=lines.append)
    text = "\n".join(lines)
    assert lines[0].startswith("done: 8 iterations; policy version 16 (the version counts optimizer updates")
    assert "0.450 at iteration 1, 0.800 at iteration 8" in text
    assert "eval reward (fixed prompts): 0.660 at iteration 4, 0.820 at iteration 8" in text
    for path in ("checkpoints/8", "metrics.jsonl", "metrics.png", "tb", "trace.json"):
        assert str(workdir / path) in text, path
    assert lines[-1].endswith("python3 launch/sample.py --config=configs/tiny.py --workdir=RUN")
    image = np.asarray(Image.open(workdir / "metrics.png").convert("RGB")).reshape(-1, 3)
    for _, _, colour in report.CURVES:  # each curve drawn in its colour
        assert (image == colour).all(axis=1).sum() > 50, colour


def test_run_summary_without_metrics_writes_no_plot(tmp_path):
    lines = []
    report.finish(str(tmp_path), "NEXT", log=lines.append)
    assert lines[0] == "done: no iteration ran" and "none written" in lines[1]
    assert not (tmp_path / "metrics.png").exists()


def test_train_help_names_both_algorithms_and_print_config_says_what_rollout_precision_means():
    helped, printed = run_side_by_side(
        ([sys.executable, "launch/train.py", "--help"], ROOT, _env()),
        ([sys.executable, "launch/train.py", "--config=configs/tiny.py", "--print_config"], ROOT, _env()),
    )
    assert helped.returncode == 0 and printed.returncode == 0, helped.stderr[-2000:] + printed.stderr[-2000:]
    assert "Flow-GRPO" in helped.stdout and "DiffusionNFT (rl.algorithm='nft')" in helped.stdout
    assert "metrics.png" in helped.stdout
    lines = printed.stdout.splitlines()
    assert "model.dtype = 'float32'" in lines
    assert ("model.rollout_precision = 'bf16'  # 'bf16' means the model's own dtype: rollouts and training compute in "
            "model.dtype='float32'") in lines


def test_reproduce_without_matplotlib_writes_tables_and_readme(tmp_path):
    """launch/reproduce.py as README documents it, on the runtime install: the tables and the
    --readme rewrite, one line that the plots were skipped and how to get them, exit status 0."""
    readme = tmp_path / "README.md"
    readme.write_text("before\n<!-- simulated-paper-tables:start -->\nold\n<!-- simulated-paper-tables:end -->\nafter\n")
    result = subprocess.run(
        [sys.executable, "-c", _REPRODUCE_WITHOUT_MATPLOTLIB, f"--out_dir={tmp_path / 'out'}", f"--readme={readme}"],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr[-3000:]
    skipped = [line for line in result.stdout.splitlines() if line.startswith("plots skipped")]
    assert skipped == ["plots skipped: matplotlib is not installed (python3 -m pip install matplotlib, or "
                       "requirements-dev.txt); the tables are complete"]
    text = readme.read_text()
    assert text.startswith("before\n") and text.endswith("after\n") and "old" not in text and "| FLUX.1-12B |" in text
    assert (tmp_path / "out" / "tables.md").exists() and not list((tmp_path / "out").glob("*.png"))


def test_every_path_readme_names_exists():
    """Each repository path README.md names (in backticks or as a link target) is there."""
    import re

    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    named = set(re.findall(r"`([^`\s]+)`", text)) | set(re.findall(r"\]\(([^)\s]+)\)", text))
    paths = {p.rstrip(".,:;") for p in named
             if "/" in p and re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_./-]*\.(py|md|txt|sbatch|toml|json)", p)}
    assert "digen_jax/models/fp8.py" in paths and "configs/tiny.py" in paths
    missing = sorted(p for p in paths if not os.path.exists(os.path.join(ROOT, p)))
    assert not missing, missing


def test_readme_gives_the_two_process_command_for_a_cpu_too():
    """README's 2-process launch on GPUs has a CPU form that is a command, not prose: the same
    launch/train.py arguments, with the CPU's environment instead of CUDA_VISIBLE_DEVICES."""
    import re

    with open(os.path.join(ROOT, "README.md")) as f:
        blocks = re.findall(r"```bash\n(.*?)```", f.read(), re.S)
    launches = [b.replace("\\\n", " ") for b in blocks if "JAX_NUM_PROCESSES=2" in b and "for i in 0 1" in b]
    gpu = [b for b in launches if "CUDA_VISIBLE_DEVICES=$i" in b]
    cpu = [b for b in launches if "JAX_PLATFORMS=cpu" in b and "--xla_force_host_platform_device_count=4" in b]
    assert len(gpu) == 1 and len(cpu) == 1, launches
    args = lambda block: block[block.index("python3 launch/train.py"):].split()  # noqa: E731
    assert args(gpu[0]) == args(cpu[0])


def test_stdout_filter_drops_gloo_lines_and_keeps_the_rest_in_order():
    """What Gloo writes to file descriptor 1 from C++ (`[Gloo] Rank ...` per communicator) is
    dropped; Python's prints and other raw writes come through whole, in order, up to the exit."""
    script = """
import os
from digen_jax.app import console
console.StdoutFilter()
print("first", flush=True)
os.write(1, b"[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1\\n")
os.write(1, b"raw line\\n[Gloo] Rank 1 is connected to 1 peer ranks.\\n")
print("last line without a newline", end="")
"""
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=_env(), capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout == "first\nraw line\nlast line without a newline"
