r"""Sample the eval prompts with the latest weights of a training workdir and score them.

    python launch/sample.py --config=configs/tiny.py --workdir=/tmp/digen [--noise_level=0]

Uses the latest checkpoint in `WORKDIR/checkpoints` that reads back and matches its checksums
(EMA weights when the run keeps an EMA; one that does not is named in one line and the one
before is used), or the base model when there is none yet (and says so); a WORKDIR that does
not exist, or one of a run whose config trains another state, is an error. Writes `WORKDIR/samples.png` (one image
per eval prompt, its prompt written under it) and `WORKDIR/samples.json` (prompts in grid order,
rewards, the policy version).
"""
from __future__ import annotations

import json
import os
import sys

import jax
import numpy as np
from absl import flags, logging
from ml_collections import config_flags

# Config files import `configs.sections`: the repository root must be importable when this
# script runs from a clone (an editable install maps only `digen_jax`).
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)
from digen_jax import cli, xla_flags
from digen_jax.app import run_checkpoints
from digen_jax.app.errors import RunStopped
from digen_jax.app.loop import Run
from digen_jax.grid import image_grid

# The default is the repository's, wherever the command runs from; it reads the overrides here
# (renamed keys renamed first).
with cli.config_override_errors():
    _CONFIG = config_flags.DEFINE_config_file("config", os.path.join(REPO_ROOT, "configs", "tiny.py"),
                                              "Config file (ml_collections).")
_WORKDIR = flags.DEFINE_string("workdir", None, "Training workdir to sample from.", required=True)
_NOISE = flags.DEFINE_float("noise_level", 0.0, "Sampler noise level; 0 is the deterministic ODE.")


def write_samples(workdir: str, images: np.ndarray, prompts: list[str], rewards: np.ndarray, version: int,
                  noise_level: float) -> None:
    """`samples.png` (the images in a grid, each prompt under its image) and `samples.json`."""
    image_grid(images, prompts).save(os.path.join(workdir, "samples.png"))
    with open(os.path.join(workdir, "samples.json"), "w") as f:
        json.dump(
            {
                "version": version,
                "noise_level": noise_level,
                "reward_mean": float(np.mean(rewards)),
                "samples": [{"prompt": p, "reward": float(r)} for p, r in zip(prompts, rewards)],
            },
            f,
            indent=1,
        )


def main(argv):
    del argv
    xla_flags.set_defaults()  # before the first device is touched
    logging.set_verbosity(logging.WARNING)
    config = _CONFIG.value
    config.runtime.trace = False  # sampling adds nothing to the training trace
    if not os.path.isdir(_WORKDIR.value):  # a mistyped workdir would sample the base model unnoticed
        sys.exit(f"error: --workdir={_WORKDIR.value} does not exist; give a training workdir (an existing empty "
                 "directory samples the base model)")
    run = Run(config, _WORKDIR.value)
    try:  # an unreadable checkpoint is named in one line and the one before it sampled
        state = run_checkpoints.read_state(run.checkpoints, run.state, config)
    except RunStopped as e:
        sys.exit(f"error: {e}")
    if state is None:
        print(f"no checkpoint in {_WORKDIR.value}/checkpoints: sampling the base model")
        state = run.state  # an initial state: its EMA (if any) is the weights themselves
        params = run.trainer.params_for(state.trainable)
    else:
        params = run.trainer.params_for(state.ema if state.ema is not None else state.trainable)
    noise = np.full((run.sampler.num_steps,), _NOISE.value, np.float32)
    traj = run.sampler.rollout(params, run.eval_cond, run.eval_keys, noise, run.latent_shape, state.version)
    rewards, _ = run.score(traj.final, run.eval_ids)
    write_samples(_WORKDIR.value, run.images(traj.final), run.task.prompt_text(run.eval_ids), rewards,
                  int(jax.device_get(state.version)), _NOISE.value)
    print(f"policy version {int(state.version)}: mean reward {np.mean(rewards):.3f} over {len(rewards)} prompts; "
          f"wrote {_WORKDIR.value}/samples.png (the policy version counts optimizer updates: "
          f"rl.num_updates_per_batch={config.rl.num_updates_per_batch} per training iteration)")


if __name__ == "__main__":
    cli.run(main, interrupted=lambda: "interrupted: nothing written (samples.png and samples.json come last); rerun the "
                                      "same command to sample")
