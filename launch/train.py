r"""Train a model by RL post-training, Flow-GRPO (config key rl.algorithm='grpo', the default) or
DiffusionNFT (rl.algorithm='nft'), in any schedule mode of the runtime (config key runtime.mode:
colocated, the default, rolls out and trains on the same devices; disagg_sync, gap, gap+tsp,
gap+tsp+tag and gap+tsp+tag+tcss split the devices into rollout and train roles).

    python launch/train.py --config=configs/tiny.py --workdir=/tmp/digen
    python launch/train.py --config=configs/tiny.py --workdir=/tmp/digen --config.train.iterations=10 \
        --config.rl.lora_rank=4
    python launch/train.py --config=configs/tiny.py --print_config   # every key as training resolves it

The model-zoo configs (configs/flux.py, qwenimage.py, wan21.py, hunyuanvideo.py, sd35.py) need a
converted checkpoint, a converted VAE and a prompt-embedding cache (--config.model.checkpoint,
--config.model.vae_checkpoint, --config.data.embedding_cache; without them the error says how
to make each), or run on random weights and embeddings for throughput:

    python launch/train.py --config=configs/qwenimage.py --workdir=/tmp/qwen \
        --config.model.random_init=True --config.data.random_embeddings=True
    python launch/train.py --config=configs/qwenimage.py:tiny --workdir=/tmp/qwen-tiny  # CPU-sized

`--autosize=h100:8` (a pool as `launch/simulate.py --pool` takes it) or `--autosize=local` (this
run's devices) lets the simulator choose runtime.rollout_devices, train_devices and
micro_batches for the configured disaggregated runtime.mode before training starts; with
`--config.runtime.mode=auto` it chooses the mode too, colocated included (on this run's devices
without --autosize), and prints what it chose and the predicted speed of the runners-up. Such a
run re-ranks every mode once more from the task costs its first iterations measured (by iteration
runtime.auto_rerank_after) and switches, once, to one predicted faster by more than
runtime.auto_switch_margin (default 3%), printing the measured costs and the ranking; metrics.jsonl
names the mode of every iteration, and a resumed run goes on in the mode its checkpoint records.

Any config key can be overridden as `--config.a.b=value`; `--print_config` lists every key
(`a.b = value`, after the overrides and --autosize) and exits without training. Writes
`WORKDIR/metrics.jsonl` (one JSON object per iteration: step, reward_mean, reward_std, loss, kl,
clip_frac, samples_per_s, ...), `WORKDIR/trace.json`, TensorBoard logs in `WORKDIR/tb` and
checkpoints in `WORKDIR/checkpoints`; rerunning with the same workdir resumes from the latest
checkpoint. At the end it writes `WORKDIR/metrics.png` (reward and eval curves) and prints a
summary: the rewards, where each file is, and the command that samples the trained weights. With
several processes, process 0 alone prints progress; every process prints its own errors.
"""
import json
import os
import shlex
import signal
import sys
import threading

import jax
import ml_collections
from absl import flags, logging
from jax.errors import JaxRuntimeError
from ml_collections import config_flags

# Config files import `configs.sections`: the repository root must be importable when this
# script runs from a clone (an editable install maps only `digen_jax`).
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)
from digen_jax import cli, xla_flags
from digen_jax.rewards.remote import RemoteRewardError
from digen_jax.app.errors import ConfigError, RunStopped
from digen_jax.app.loop import train
from digen_jax.app import console, precision, report, run_sizing
from digen_jax.app.settings import distributed_settings
from digen_jax.app.validation import validate_config
from digen_jax.runtime.multihost import initialize
from digen_jax.runtime.peer_watchdog import await_verdict, end_after_failure, watching

# The default is the repository's, wherever the command runs from.
_DEFAULT_CONFIG = os.path.join(REPO_ROOT, "configs", "tiny.py")
with cli.config_file_errors(default=_DEFAULT_CONFIG), cli.config_override_errors():
    _CONFIG = config_flags.DEFINE_config_file("config", _DEFAULT_CONFIG, "Config file (ml_collections).")
_WORKDIR = flags.DEFINE_string("workdir", None, "Output directory (metrics, TensorBoard, checkpoints); required to train.")
_PRINT_CONFIG = flags.DEFINE_bool(
    "print_config", False,
    "Print the resolved config (after --config.* overrides and --autosize), one `a.b = value` line per key "
    "(each settable as --config.a.b=value), and exit without training.",
)
_AUTOSIZE = flags.DEFINE_string(
    "autosize", None,
    "Let the simulator choose runtime.rollout_devices, train_devices and micro_batches for the configured "
    "disaggregated runtime.mode (with runtime.mode=auto, the mode too, and after the first iterations once more from "
    "their measured costs): a pool spec such as 'h100:8' (launch/simulate.py --pool), or 'local' for this run's "
    "devices (their kind and count).",
)
_TRACEBACK = flags.DEFINE_bool(
    "traceback", False,
    "Show the Python traceback of expected errors (a bad config, a workdir in use, an unreadable checkpoint, a "
    "full disk) as well as their message.",
)


def autosize_line(config, spec: str) -> str:
    """--autosize: size `config`'s roles in place; a line saying what was chosen."""
    try:
        pool, sizing = run_sizing.size_config(config, spec, jax.devices())
    except ValueError as e:
        raise ConfigError(f"--autosize={spec}: {e}") from None
    rt = config.runtime
    return (f"autosize for {pool.total} x {pool.kind('rollout').name}: rollout_devices={rt.rollout_devices} train_devices={rt.train_devices} "
            f"micro_batches={rt.micro_batches} (predicted {sizing.prediction.samples_per_s:.3f} samples/s)")


def config_lines(config, prefix: str = "", notes: dict | None = None) -> list[str]:
    """Every leaf of `config` as `a.b = value` (sorted by key; the value's repr), `# note` after
    a key of `notes` (full key -> what the value resolves to)."""
    lines, notes = [], notes or {}
    for key in sorted(config.keys()):
        value = config[key]
        if isinstance(value, ml_collections.ConfigDict) and value.keys():
            lines += config_lines(value, f"{prefix}{key}.", notes)
        else:
            shown = value.to_dict() if isinstance(value, ml_collections.ConfigDict) else value
            note = notes.get(f"{prefix}{key}")
            lines.append(f"{prefix}{key} = {shown!r}" + (f"  # {note}" if note else ""))
    return lines


def main(argv):
    del argv
    xla_flags.set_defaults()  # before the first device is touched
    logging.set_verbosity(logging.WARNING)
    if not _PRINT_CONFIG.value:
        if not _WORKDIR.value:
            sys.exit("error: --workdir is required (the run's output directory); --print_config needs none")
        if initialize(distributed_settings(_CONFIG.value)).num_processes > 1:  # multi-process runs join before any JAX work
            console.quiet(jax.process_index())  # process 0 reports; the others print their errors
    auto = None  # runtime.mode='auto': the pool it is chosen on, again from measured costs during the run
    try:
        if _CONFIG.value.runtime.mode == run_sizing.AUTO_MODE:
            auto = _AUTOSIZE.value or "local"
            print(run_sizing.choose_mode(_CONFIG.value, auto, jax.devices()), flush=True)
        elif _AUTOSIZE.value:
            print(autosize_line(_CONFIG.value, _AUTOSIZE.value), flush=True)
        if _PRINT_CONFIG.value:
            notes = {"model.rollout_precision": precision.rollout_precision_note(_CONFIG.value)}
            print("\n".join(config_lines(_CONFIG.value, notes=notes)))
            return
        validate_config(_CONFIG.value)  # bad input or missing files: a message, not a traceback
    except ConfigError as e:
        if _TRACEBACK.value:
            raise
        sys.exit(f"error in --config={flags.FLAGS['config'].config_filename}: {e}")
    try:
        os.makedirs(_WORKDIR.value, exist_ok=True)
    except OSError as e:
        sys.exit(f"error: --workdir={_WORKDIR.value} cannot be made: {e.strerror}")
    try:
        _train_and_report(auto)
    except SystemExit as e:
        # Several processes: the message shown, the others learn that this one stopped, and why,
        # instead of waiting for it in a collective (docs/design.md section 9). An exception
        # does the same through the watchdog's `sys.excepthook`, Ctrl-C through `cli.run`.
        if watching() and e.code not in (0, None):
            print(e.code, file=sys.stderr)
            end_after_failure(str(e.code).removeprefix("stopped: "))
        raise


def interrupted_line() -> str:
    """What Ctrl-C leaves: the last iteration metrics.jsonl records, the last checkpoint, and
    that the same command resumes from it."""
    workdir = _WORKDIR.value
    if not workdir or not os.path.isdir(workdir):
        return "interrupted"
    steps = []
    if os.path.isdir(root := os.path.join(workdir, "checkpoints")):
        steps = sorted(int(name) for name in os.listdir(root) if name.isdigit())
    done = 0
    try:
        with open(os.path.join(workdir, "metrics.jsonl")) as f:
            for line in f:
                try:
                    done = max(done, int(json.loads(line)["step"]))
                except (ValueError, KeyError, TypeError):
                    continue  # a row cut short by the interruption
    except OSError:
        pass
    total = _CONFIG.value.train.iterations
    where = f"interrupted after iteration {done} of {total}" if done else "interrupted before the first iteration ended"
    if not steps:
        return f"{where}, before the first checkpoint: rerun the same command to start over"
    last = steps[-1]
    redone = (f" (iteration {done} is redone)" if done == last + 1 else
              f" (iterations {last + 1}-{done} are redone)" if done > last else "")
    return (f"{where}; the last checkpoint is {last} ({os.path.join(root, str(last))}): rerun the same command to "
            f"resume from it{redone}")


class _StopAtIteration:
    """Ctrl-C during the training loop stops it after the iteration under way: a KeyboardInterrupt
    raised at whatever line runs could land in orbax's save threads' bookkeeping (leaving a
    half-committed save and their tracebacks) or in an asyncio loop that swallows it. The loop's
    progress lines (`log`) are the safe points: the first Ctrl-C is raised at the next one on the
    main thread. Before the loop, and at a second Ctrl-C, it is raised at once."""

    def __init__(self, echo):
        self.echo = echo
        self.looping = self.requested = False
        signal.signal(signal.SIGINT, self._on_sigint)

    def _on_sigint(self, signum, frame) -> None:
        if not self.looping or self.requested:
            raise KeyboardInterrupt
        self.requested = True
        print("Ctrl-C: stopping after this iteration (Ctrl-C again stops at once)", file=sys.stderr, flush=True)

    def log(self, message: str) -> None:
        self.echo(message)
        self.looping = self.looping or message.startswith("training ")  # the loop's first line
        if self.requested and threading.current_thread() is threading.main_thread():
            raise KeyboardInterrupt


def sample_command(argv: list[str], workdir: str) -> str:
    """The launch/sample.py command for the run `argv` started: its config file and overrides
    (but the multi-process switch: sampling is one process)."""
    overrides = [a for a in argv[1:] if a.startswith("--config.") and not a.startswith("--config.runtime.distributed")]
    script = os.path.join(os.path.dirname(argv[0]), "sample.py")
    return shlex.join(["python3", script, f"--config={flags.FLAGS['config'].config_filename}", f"--workdir={workdir}",
                       *overrides])


def _train_and_report(auto: str | None) -> None:
    """Train (`auto`: the pool runtime.mode='auto' was chosen on, None for a fixed mode) and report."""
    # Several processes: process 0 reports progress; the others print only their errors (stderr).
    reporting = jax.process_index() == 0
    log = (lambda msg: print(msg, flush=True)) if reporting else (lambda msg: None)
    try:
        train(_CONFIG.value, _WORKDIR.value, log=_StopAtIteration(log).log, validated=True, auto=auto)
    except (RunStopped, FloatingPointError, RemoteRewardError) as e:
        # An expected fault (a workdir in use, an unreadable checkpoint, a full disk, diverged
        # updates, a reward server that stopped answering): its message says what to do.
        if _TRACEBACK.value:
            raise
        sys.exit(f"stopped: {e}")
    except JaxRuntimeError:
        # In a multi-process run a failed collective usually means that another process died: the
        # peer watchdog then ends this one with a "stopped: ..." line naming it (docs/design.md
        # section 9). Otherwise, or with --traceback, the error itself.
        if not _TRACEBACK.value:
            await_verdict()
        raise
    if reporting:
        report.finish(_WORKDIR.value, sample_command(sys.argv, _WORKDIR.value), log=log)


if __name__ == "__main__":
    cli.run(main, interrupted=interrupted_line)
