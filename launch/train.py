r"""Train a model with Flow-GRPO (colocated: rollout and training on the same devices).

    python launch/train.py --config=configs/tiny.py --workdir=/tmp/digen
    python launch/train.py --config=configs/tiny.py --workdir=/tmp/digen --config.train.iterations=10 \
        --config.rl.lora_rank=4

Any config key can be overridden as `--config.a.b=value`. Writes `WORKDIR/metrics.jsonl`
(one JSON object per iteration: step, reward_mean, reward_std, loss, kl, clip_frac,
samples_per_s, ...), TensorBoard logs in `WORKDIR/tb` and checkpoints in
`WORKDIR/checkpoints`; rerunning with the same workdir resumes from the latest checkpoint.
"""
from absl import app, flags, logging
from ml_collections import config_flags

from digen_jax.rl.loop import train

_CONFIG = config_flags.DEFINE_config_file("config", "configs/tiny.py", "Config file (ml_collections).")
_WORKDIR = flags.DEFINE_string("workdir", None, "Output directory (metrics, TensorBoard, checkpoints).", required=True)


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)
    train(_CONFIG.value, _WORKDIR.value, log=lambda msg: print(msg, flush=True))


if __name__ == "__main__":
    app.run(main)
