"""What a new user meets first: the install split, every script's --help, --print_config, the
captioned sample grid, and the model bench's memory share."""
import json
import os
import re
import subprocess
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENTRY_POINTS = ("launch/train.py", "launch/sample.py", "launch/bench.py", "launch/reproduce.py", "launch/simulate.py",
                "launch/reward_server.py", "launch/check_splash.py", "convert/diffusers_to_orbax.py",
                "convert/encode_prompts.py", "convert/clip_to_orbax.py")
# Installed by requirements-dev.txt only: the main job must not import them.
DEV_ONLY = ("torch", "diffusers", "transformers", "matplotlib", "tensorboard", "pytest", "safetensors")


def _env(**extra):
    return dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu", **extra)


def _requirements(name):
    with open(os.path.join(ROOT, name)) as f:
        lines = [line.split("#")[0].strip() for line in f]
    return [line for line in lines if line]


def run_side_by_side(*commands, timeout_s: float = 300) -> list[subprocess.CompletedProcess]:
    """Run each (argv, cwd, env) at the same time; their completed processes, in order."""
    procs = [subprocess.Popen(argv, cwd=cwd, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for argv, cwd, env in commands]
    done = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=timeout_s)
            done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    return done


def test_runtime_requirements_hold_no_dev_package_and_dev_adds_them():
    names = lambda reqs: {re.split(r"[<>=!~\[ ]", r)[0].lower() for r in reqs}  # noqa: E731
    runtime, dev = _requirements("requirements.txt"), _requirements("requirements-dev.txt")
    assert not names(runtime) & {"torch", "diffusers", "transformers", "matplotlib", "tensorboard", "pytest"}
    assert "-r requirements.txt" in dev
    assert {"pytest", "torch", "diffusers", "transformers", "safetensors", "matplotlib", "tensorboard"} <= names(dev)


def test_ci_runs_exactly_the_readme_test_command():
    """.ci/run installs what README's test command installs and runs the same pytest command."""
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    command = next(line for line in readme.splitlines() if line.startswith("python3 -m pip install") and "pytest" in line)
    readme_steps = [step.strip() for step in command.split("&&")]
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        ci_steps = [line.strip().replace(" -q -r ", " -r ").replace("install -q ", "install ")
                    for line in f if line.startswith("python3 ")]
    assert ci_steps == readme_steps


def test_main_job_imports_no_dev_package(tmp_path):
    """launch/train.py's imports, the shapes task's reward and the TensorBoard writer the loop
    opens: none of them loads torch, diffusers, transformers or matplotlib (torch is installed
    here, and tensorboardX would import it)."""
    script = f"""
import runpy, sys
runpy.run_path("launch/train.py")
from configs import tiny
from digen_jax.app import loop, workload
workload.make_reward_fn(tiny.get_config())
loop.summary_writer({str(tmp_path)!r}).close()
print(sorted(m for m in {DEV_ONLY!r} if m in sys.modules))
"""
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=_env(), capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "[]"
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(tmp_path))


def test_every_entry_point_help_exits_0_with_its_text():
    procs = {path: subprocess.Popen([sys.executable, path, "--help"], cwd=ROOT, env=_env(), text=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE) for path in ENTRY_POINTS}
    helped = {}
    for path, proc in procs.items():
        helped[path], err = proc.communicate(timeout=300)
        assert proc.returncode == 0, (path, err[-2000:])
        assert "Traceback" not in err and "--" in helped[path], path
    train = helped["launch/train.py"]
    assert "runtime.mode" in train and "gap+tsp+tag+tcss" in train and "--print_config" in train


def test_a_wrong_path_is_one_error_line_naming_it(tmp_path):
    """A mistyped or wrong file or folder given to the scripts a user runs first: one `error:` line
    naming the flag and path, status 1, no traceback, and nothing written (run side by side)."""
    (tmp_path / "not_a_model").mkdir()
    (tmp_path / "not_a_model" / "config.json").write_text('{"_class_name": "FluxTransformer2DModel"}')
    (tmp_path / "model_bench.json").write_text(json.dumps({"mode": "model", "results": {}}))
    (tmp_path / "a_file").write_text("")
    cases = {
        ("launch/train.py", "--config=configs/tiny.py", f"--workdir={tmp_path / 'a_file' / 'run'}"):
            f"error: --workdir={tmp_path / 'a_file' / 'run'} cannot be made: Not a directory",
        ("convert/encode_prompts.py", "--family=flux", f"--prompts={tmp_path / 'prompts.txt'}", f"--encoder_dir={tmp_path}",
         f"--out={tmp_path / 'out'}"): f"error: --prompts={tmp_path / 'prompts.txt'} is not a file",
        ("launch/sample.py", f"--workdir={tmp_path / 'no_such_run'}"):
            f"error: --workdir={tmp_path / 'no_such_run'} does not exist",
        ("launch/simulate.py", f"--profile={tmp_path / 'no_such.json'}"): f"error: --profile={tmp_path / 'no_such.json'}: ",
        ("launch/simulate.py", f"--profile={tmp_path / 'model_bench.json'}"): "not a system bench record",
        ("convert/diffusers_to_orbax.py", f"--model_dir={tmp_path / 'nothing'}", f"--out={tmp_path / 'out'}"):
            f"error: {tmp_path / 'nothing'}/config.json not found: --model_dir must be a diffusers model folder",
        ("convert/diffusers_to_orbax.py", f"--model_dir={tmp_path / 'not_a_model'}", f"--out={tmp_path / 'out'}"):
            f"error: {tmp_path / 'not_a_model'}: no .safetensors weights found",
    }
    done = run_side_by_side(*[([sys.executable, *argv], ROOT, _env()) for argv in cases])
    for (argv, expected), proc in zip(cases.items(), done):
        last = proc.stderr.rstrip().splitlines()[-1] if proc.stderr.strip() else ""
        assert proc.returncode == 1 and expected in last and "Traceback" not in proc.stderr, (argv, proc.stderr[-2000:])
    assert not (tmp_path / "no_such_run").exists() and not (tmp_path / "out").exists()


def test_print_config_prints_the_resolved_config_without_training():
    """Overrides and the `:tiny` resolution land in the printout; no workdir is needed. (The two
    commands run side by side: each is mostly its imports, on one core.)"""
    printed, untold = run_side_by_side(
        ([sys.executable, "launch/train.py", "--config=configs/wan21.py:tiny", "--config.rl.lora_rank=1",
          "--config.sampling.noise_level=0.5", "--print_config"], ROOT, _env()),
        ([sys.executable, "launch/train.py", "--config=configs/wan21.py:tiny"], ROOT, _env()),
    )
    assert printed.returncode == 0, printed.stderr[-2000:]
    lines = set(printed.stdout.splitlines())
    assert {"rl.lora_rank = 1", "sampling.noise_level = 0.5", "model.variant = 'tiny'", "sampling.num_frames = 5",
            "model.family = 'wan'", "train.iterations = 1", "reward.weights.jpeg_compressibility = 1.0"} <= lines
    assert untold.returncode == 1 and "--workdir is required" in untold.stderr and "Traceback" not in untold.stderr


def test_sample_grid_has_each_prompt_under_its_image(tmp_path):
    """launch/sample.py's outputs (written in a fresh process: the script defines its flags)."""
    prompts = ["a red square in the top left", "a blue cross", "a green square in the bottom right corner"]
    script = f"""
import sys
import numpy as np
sys.path.insert(0, "launch")
import sample
images = np.zeros((3, 16, 16, 3), np.float32)  # black squares
sample.write_samples({str(tmp_path)!r}, images, {prompts!r}, np.array([0.5, 0.25, 1.0]), 4, 0.0)
"""
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=_env(), capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    from PIL import Image

    grid = np.asarray(Image.open(tmp_path / "samples.png").convert("L"))
    cell = 16 * 8
    assert grid.shape[0] > 2 * cell  # 2 rows of 2 images, each row with a caption band under it
    band = grid[cell:cell + 24]  # under the first row's images
    first, second = band[:, :cell], band[:, cell + 8:2 * cell + 8]
    assert (first < 128).any() and (second < 128).any()  # text drawn in black on white
    assert not np.array_equal(first, second)  # each image has its own caption
    assert (grid[:cell, :cell] == 0).all()  # the image itself is untouched
    written = json.loads((tmp_path / "samples.json").read_text())
    assert [s["prompt"] for s in written["samples"]] == prompts and written["version"] == 4


def test_config_scripts_run_from_anywhere_without_pythonpath(tmp_path):
    """README's commands as a user runs them after `pip install -e .`: no PYTHONPATH (the editable
    install maps only `digen_jax`), here from another directory. The scripts that load a config
    file find `configs.sections`, which every config imports."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["JAX_PLATFORMS"] = "cpu"
    scripts = (("launch/train.py", ["--print_config"]), ("launch/sample.py", ["--helpshort"]))
    results = run_side_by_side(
        *[([sys.executable, os.path.join(ROOT, script), f"--config={ROOT}/configs/tiny.py", *args], tmp_path, env)
          for script, args in scripts])
    for (script, _), result in zip(scripts, results):
        assert result.returncode == 0, (script, result.stderr[-3000:])
        assert "No module named" not in result.stderr
    assert "runtime.mode = " in results[0].stdout
