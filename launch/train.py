r"""Train a model with Flow-GRPO (colocated: rollout and training on the same devices).

    python launch/train.py --config=configs/tiny.py --workdir=/tmp/digen
    python launch/train.py --config=configs/tiny.py --workdir=/tmp/digen --config.train.iterations=10 \
        --config.rl.lora_rank=4

The model-zoo configs (configs/flux.py, qwenimage.py, wan21.py, hunyuanvideo.py) need a
converted checkpoint, a converted VAE and a prompt-embedding cache (--config.model.checkpoint,
--config.model.vae_checkpoint, --config.data.embedding_cache; without them the error says how
to make each), or run on random weights and embeddings for throughput:

    python launch/train.py --config=configs/qwenimage.py --workdir=/tmp/qwen \
        --config.model.random_init=True --config.data.random_embeddings=True
    python launch/train.py --config=configs/qwenimage.py:tiny --workdir=/tmp/qwen-tiny  # CPU-sized

`--autosize=h100:8` (a pool as `launch/simulate.py --pool` takes it) or `--autosize=local` (this
run's devices) lets the simulator choose runtime.rollout_devices, train_devices and
micro_batches for the configured disaggregated runtime.mode before training starts.

Any config key can be overridden as `--config.a.b=value`. Writes `WORKDIR/metrics.jsonl`
(one JSON object per iteration: step, reward_mean, reward_std, loss, kl, clip_frac,
samples_per_s, ...), TensorBoard logs in `WORKDIR/tb` and checkpoints in
`WORKDIR/checkpoints`; rerunning with the same workdir resumes from the latest checkpoint.
"""
import sys

from absl import app, flags, logging
from ml_collections import config_flags

from digen_jax import xla_flags
from digen_jax.rl.loop import ConfigError, train, validate_config
from digen_jax.runtime.checkpoints import RunStopped
from digen_jax.runtime.distributed import initialize

_CONFIG = config_flags.DEFINE_config_file("config", "configs/tiny.py", "Config file (ml_collections).")
_WORKDIR = flags.DEFINE_string("workdir", None, "Output directory (metrics, TensorBoard, checkpoints).", required=True)
_AUTOSIZE = flags.DEFINE_string(
    "autosize", None,
    "Let the simulator choose runtime.rollout_devices, train_devices and micro_batches for the configured "
    "disaggregated runtime.mode: a pool spec such as 'h100:8' (launch/simulate.py --pool), or 'local' for "
    "this run's devices (their kind and count).",
)
_TRACEBACK = flags.DEFINE_bool(
    "traceback", False,
    "Show the Python traceback of expected errors (a bad config, a workdir in use, an unreadable checkpoint, a "
    "full disk) as well as their message.",
)


def autosize_line(config, spec: str) -> str:
    """--autosize: size `config`'s roles in place; a line saying what was chosen."""
    import jax

    from digen_jax.runtime import simulator

    try:
        pool, sizing = simulator.size_config(config, spec, jax.devices())
    except ValueError as e:
        raise ConfigError(f"--autosize={spec}: {e}") from None
    rt = config.runtime
    return (f"autosize for {pool.total} x {pool.kind('rollout').name}: rollout_devices={rt.rollout_devices} train_devices={rt.train_devices} "
            f"micro_batches={rt.micro_batches} (predicted {sizing.prediction.samples_per_s:.3f} samples/s)")


def main(argv):
    del argv
    xla_flags.set_defaults()  # before the first device is touched
    logging.set_verbosity(logging.WARNING)
    initialize(_CONFIG.value)  # multi-process runs (runtime.distributed, SLURM) join before any JAX work
    try:
        if _AUTOSIZE.value:
            print(autosize_line(_CONFIG.value, _AUTOSIZE.value), flush=True)
        validate_config(_CONFIG.value)  # bad input or missing files: a message, not a traceback
    except ConfigError as e:
        if _TRACEBACK.value:
            raise
        sys.exit(f"error in --config={flags.FLAGS['config'].config_filename}: {e}")
    try:
        train(_CONFIG.value, _WORKDIR.value, log=lambda msg: print(msg, flush=True))
    except RunStopped as e:  # an expected fault: its message says what to do (--traceback shows where)
        if _TRACEBACK.value:
            raise
        sys.exit(f"stopped: {e}")


if __name__ == "__main__":
    app.run(main)
