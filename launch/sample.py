r"""Sample the eval prompts with the latest weights of a training workdir and score them.

    python launch/sample.py --config=configs/tiny.py --workdir=/tmp/digen [--noise_level=0]

Uses the latest checkpoint in `WORKDIR/checkpoints` (EMA weights when the run keeps an
EMA), or the base model when there is none yet. Writes `WORKDIR/samples.png` (one image
per eval prompt) and `WORKDIR/samples.json` (prompts, rewards, the policy version).
"""
from __future__ import annotations

import json
import os

import jax
import numpy as np
from absl import app, flags, logging
from ml_collections import config_flags
from PIL import Image

from digen_jax import xla_flags
from digen_jax.rl.loop import Run
from digen_jax.runtime.executor import Executor

_CONFIG = config_flags.DEFINE_config_file("config", "configs/tiny.py", "Config file (ml_collections).")
_WORKDIR = flags.DEFINE_string("workdir", None, "Training workdir to sample from.", required=True)
_NOISE = flags.DEFINE_float("noise_level", 0.0, "Sampler noise level; 0 is the deterministic ODE.")


def image_grid(images: np.ndarray, scale: int = 8) -> Image.Image:
    """(B, H, W, 3) floats in [0, 1] -> one PNG-ready grid, nearest-upscaled."""
    batch, h, w, _ = images.shape
    cols = int(np.ceil(np.sqrt(batch)))
    rows = int(np.ceil(batch / cols))
    sheet = np.ones((rows * (h + 1), cols * (w + 1), 3), np.float32)
    for n, img in enumerate(images):
        r, c = divmod(n, cols)
        sheet[r * (h + 1) : r * (h + 1) + h, c * (w + 1) : c * (w + 1) + w] = img
    pixels = (np.clip(sheet, 0, 1) * 255).round().astype(np.uint8)
    return Image.fromarray(pixels).resize((sheet.shape[1] * scale, sheet.shape[0] * scale), Image.NEAREST)


def main(argv):
    del argv
    xla_flags.set_defaults()  # before the first device is touched
    logging.set_verbosity(logging.WARNING)
    config = _CONFIG.value
    config.runtime.trace = False  # sampling adds nothing to the training trace
    run = Run(config, _WORKDIR.value)
    executor = Executor(run)
    executor.restore(run.checkpoints)
    executor.close()
    state = executor.state
    params = run.trainer.params_for(state.ema if state.ema is not None else state.trainable)
    noise = np.full((run.sampler.num_steps,), _NOISE.value, np.float32)
    traj = run.sampler.rollout(params, run.eval_cond, run.eval_keys, noise, run.latent_shape, state.version)
    rewards, _ = run.score(traj.final, run.eval_ids)
    images = run.images(traj.final)
    image_grid(images).save(os.path.join(_WORKDIR.value, "samples.png"))
    prompts = run.task.prompt_text(run.eval_ids)
    with open(os.path.join(_WORKDIR.value, "samples.json"), "w") as f:
        json.dump(
            {
                "version": int(jax.device_get(state.version)),
                "noise_level": _NOISE.value,
                "reward_mean": float(np.mean(rewards)),
                "samples": [{"prompt": p, "reward": float(r)} for p, r in zip(prompts, rewards)],
            },
            f,
            indent=1,
        )
    print(f"policy version {int(state.version)}: mean reward {np.mean(rewards):.3f} over {len(rewards)} prompts; "
          f"wrote {_WORKDIR.value}/samples.png")


if __name__ == "__main__":
    app.run(main)
