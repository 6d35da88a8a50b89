"""Bad input gets one line naming the key or file and what to do, before any device work: config
values (validation called directly), and through launch/train.py a missing config file, a bad
value of the default config run from outside the repository, a run too large for the machine,
and Ctrl-C (the last checkpoint and how to resume)."""
import math
import os
import re
import signal
import subprocess
import sys
import time

import jax
import pytest

from configs import tiny
from digen_jax.app import machine_checks, memory_bound
from digen_jax.app.errors import ConfigError
from digen_jax.app.validation import validate_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(ROOT, "launch", "train.py")


def _set(config, key: str, value) -> None:
    *sections, name = key.split(".")
    node = config
    for section in sections:
        node = node[section]
    node[name] = value


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("model.dtype", "", r"model\.dtype='' is not one of 'float32', 'bfloat16', 'float16'"),
        ("model.param_dtype", "int8", r"model\.param_dtype='int8' is not one of"),
        ("model.attention_impl", "bogus", r"model\.attention_impl='bogus' is not one of 'auto', 'cudnn', 'xla'"),
        ("model.remat_policy", "bogus", r"model\.remat_policy='bogus' is not one of 'none', 'full'"),
        ("rl.timestep_fraction", math.inf, r"rl\.timestep_fraction must be a number in \(0, 1\], got inf"),
        ("rl.timestep_fraction", math.nan, r"rl\.timestep_fraction must be a number in \(0, 1\], got nan"),
        ("model.arch.num_attention_heads", 0, r"model\.arch\.num_attention_heads must be an integer in \[1, inf\)"),
        ("model.arch.attention_head_dim", -16, r"model\.arch\.attention_head_dim must be an integer in \[1, inf\)"),
        ("model.arch.attention_head_dim", 32, r"model\.arch: sum\(axes_dims_rope\)=16 must equal attention_head_dim=32"),
        ("rl.lora_targets", ("no_such_layer",),
         r"rl\.lora_targets=\('no_such_layer',\): LoRA target pattern 'no_such_layer' matches no kernel"),
        ("rl.lora_rank", 100000, r"rl\.lora_rank=100000 exceeds 64, the full rank of the largest kernel"),
        ("runtime.rollout_devices", 100, r"runtime\.rollout_devices=100 has no effect in runtime\.mode='colocated'"),
        ("runtime.train_devices", 100, r"runtime\.train_devices=100 exceeds the 8 devices"),
        ("runtime.colocated_sampling", "bogus",
         r"runtime\.colocated_sampling='bogus' is not one of 'auto', 'sharded', 'gathered'$"),
        ("rl.num_updates_per_batch", 4, r"rl\.num_updates_per_batch=4 must divide runtime\.micro_batches=2 \(each "
                                        r"update trains an equal share of whole micro-batches\)"),
        ("pretrain.cache_dir", "/proc/nope", r"pretrain\.cache_dir='/proc/nope' cannot be written \(.*\): the "
                                             r"pretrained base model is saved there; give a writable directory"),
        ("task.resolution", 100000, r"the run needs at least .* of memory, more than the .* of the host's memory; .* "
                                    r"the trajectories of .*task\.resolution=100000\): lower task\.resolution$"),
        ("train.eval_prompts", 10**8, r"train\.eval_prompts=100000000 samples .*: lower train\.eval_prompts$"),
        ("rl.group_size", 10**8, r"rl\.group_size=100000000 samples .*: lower rl\.group_size$"),
    ],
)
def test_bad_config_values_name_the_key(key, value, message, tmp_path):
    config = tiny.get_config()
    config.pretrain.cache_dir = str(tmp_path)
    if key.startswith("rl.lora"):
        config.rl.lora_rank = 4
    _set(config, key, value)
    with pytest.raises(ConfigError, match=message) as caught:
        validate_config(config)
    assert "\n" not in str(caught.value)


def test_memory_bound_counts_the_largest_arrays():
    """The bound of configs/tiny.py (LoRA rank 4): base weights, adapters with Adam moments and
    EMA, and the float32 trajectories (17 latent-sized arrays per sample over 8 steps) of the
    64 samples of an iteration and the 32 eval prompts; a capacity below it names the largest."""
    config = tiny.get_config()
    config.rl.lora_rank = 4
    kernel = (2, 64, 64)  # two stacked blocks' (in, out) kernels
    abstract = {"w": jax.ShapeDtypeStruct((1000,), "float32")}
    needs = memory_bound.needs(config, abstract, [kernel], 768, "task.resolution=16")
    assert [n.nbytes for n in needs] == [4000, 4 * 4 * 2 * 4 * 128, 64 * 17 * 768 * 4, 32 * 17 * 768 * 4]
    total = sum(n.nbytes for n in needs)
    machine_checks.check_memory(config, abstract, [kernel], 768, "task.resolution=16", capacity=(total, "a test"))
    with pytest.raises(ConfigError, match=r"more than the .* GB of a test; .* are the trajectories of "
                                          r"rl\.prompts_per_iteration=8 x rl\.group_size=8 samples .*: lower rl\.group_size$"):
        machine_checks.check_memory(config, abstract, [kernel], 768, "task.resolution=16", capacity=(total - 1, "a test"))
    # Where two samples exceed the memory, fewer would not help: smaller ones would.
    with pytest.raises(ConfigError, match=r"lower task\.resolution$"):
        machine_checks.check_memory(config, abstract, [kernel], 768, "task.resolution=16", capacity=(4000, "a test"))


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return env | {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=1"} | extra


def _one_error_line(proc: subprocess.CompletedProcess, code: int, *expected: str) -> None:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == code and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert lines and all(text in lines[-1] for text in expected), proc.stderr[-3000:]


def test_cli_mistakes_are_one_line(tmp_path):
    """Run side by side from outside the repository (no PYTHONPATH): a config file that does not
    exist (status 2, where it was looked for), a bad value of the default config (found from
    anywhere; status 1, naming the key), a run too large for the machine (status 1, naming the key)."""
    cache = f"--config.pretrain.cache_dir={tmp_path / 'cache'}"
    commands = {
        "missing": [f"--config={tmp_path / 'nope.py'}:tiny", f"--workdir={tmp_path / 'a'}", "--config.rl.lora_rank=2"],
        "value": [f"--workdir={tmp_path / 'b'}", "--config.model.attention_impl=bogus", cache],
        "size": [f"--workdir={tmp_path / 'c'}", "--config.train.eval_prompts=100000000", cache],
    }
    procs = {name: subprocess.Popen([sys.executable, TRAIN, *args], cwd=tmp_path, env=_env(), text=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE) for name, args in commands.items()}
    done = {}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        done[name] = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    _one_error_line(done["missing"], 2, f"error: --config={tmp_path / 'nope.py'}:tiny: no such file (looked for "
                                        f"{tmp_path / 'nope.py'})")
    _one_error_line(done["value"], 1, f"error in --config={ROOT}/configs/tiny.py: model.attention_impl='bogus' is "
                                      "not one of 'auto', 'cudnn', 'xla'")
    _one_error_line(done["size"], 1, "the run needs at least", "lower train.eval_prompts")
    assert not any((tmp_path / name).exists() for name in "abc")  # refused before the workdir was made


def test_ctrl_c_names_the_last_checkpoint(tmp_path, pretrain_cache_dir):
    """SIGINT to launch/train.py once its first checkpoint is written: the loop stops after the
    iteration under way, status 130, no traceback, a last line naming the last checkpoint and
    that the same command resumes from it. (That a rerun resumes exactly is tests/test_faults.py's.)"""
    workdir = tmp_path / "run"
    command = [sys.executable, TRAIN, f"--workdir={workdir}", f"--config.pretrain.cache_dir={pretrain_cache_dir}",
               # runtime_config of tests/test_runtime.py: its pretrained model is shared
               "--config.pretrain.steps=3", "--config.pretrain.batch_size=8", "--config.sampling.num_steps=4",
               "--config.rl.prompts_per_iteration=2", "--config.rl.group_size=2", "--config.rl.grad_chunk_size=3",
               "--config.rl.num_updates_per_batch=1", "--config.runtime.micro_batches=1",
               "--config.train.eval_every=0", "--config.train.image_every=0", "--config.train.checkpoint_every=1",
               "--config.train.keep_checkpoints=100", "--config.train.iterations=100000"]
    proc = subprocess.Popen(command, cwd=ROOT, env=_env(), text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 600
    while not (workdir / "checkpoints" / "1").exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=300)
    lines = err.strip().splitlines()
    assert proc.returncode == 130 and "Traceback" not in err, err[-3000:]
    assert "Ctrl-C: stopping after this iteration (Ctrl-C again stops at once)\n" in err, err[-3000:]
    steps = sorted(int(name) for name in os.listdir(workdir / "checkpoints") if name.isdigit())
    said = re.fullmatch(r"interrupted after iteration (\d+) of 100000; the last checkpoint is (\d+) \((.+)\): rerun the "
                        r"same command to resume from it(.*)", lines[-1])
    assert said, lines[-1]
    done, last = int(said[1]), int(said[2])
    assert last == steps[-1] >= 1 and said[3] == f"{workdir}/checkpoints/{last}" and done >= last, lines[-1]
    redone = {0: "", 1: f" (iteration {done} is redone)"}.get(done - last, f" (iterations {last + 1}-{done} are redone)")
    assert said[4] == redone, lines[-1]
