r"""Sample images from a model with the Flow-GRPO SDE sampler and write a PNG grid.

    python launch/sample.py --config=configs/tiny.py --workdir=/tmp/digen \
        [--config.sampling.num_steps=4] [--config.sampling.noise_level=0]

Writes `WORKDIR/samples.png` and `WORKDIR/samples.json` (per-step mean log-prob,
timing). Prompt embeddings are random (seeded): this is the smoke test of the model
and the step math; the training loop conditions on real prompts.
"""
from __future__ import annotations

import json
import os
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags, logging
from ml_collections import config_flags
from PIL import Image

from digen_jax.diffusion import flow_grpo_sde_step, flux_image_ids, pack_latents, sigma_ladder, unpack_latents
from digen_jax.models import FAMILIES, load_checkpoint

_CONFIG = config_flags.DEFINE_config_file("config", "configs/tiny.py", "Config file (ml_collections).")
_WORKDIR = flags.DEFINE_string("workdir", "/tmp/digen", "Output directory.")


def build_model(cfg):
    """(family, model config, params) from a checkpoint or a seeded random init."""
    policy = dict(
        dtype=cfg.model.dtype,
        param_dtype=cfg.model.param_dtype,
        attention_impl=cfg.model.attention_impl,
        remat_policy=cfg.model.remat_policy,
    )
    if cfg.model.checkpoint:
        return load_checkpoint(cfg.model.checkpoint, **policy)
    if cfg.model.family not in FAMILIES:
        raise ValueError(f"config.model.family={cfg.model.family!r} is unknown; known: {sorted(FAMILIES)}")
    family = FAMILIES[cfg.model.family]
    model_cfg = family.config_cls(**cfg.model.arch.to_dict(), **policy)
    abstract = family.example_inputs(model_cfg)
    params = jax.jit(lambda key, x: family.module_cls(model_cfg).init(key, **x))(
        jax.random.key(cfg.seed), jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), abstract)
    )["params"]
    return family, model_cfg, nn.unbox(params)


def main(argv):
    del argv
    cfg = _CONFIG.value
    s = cfg.sampling
    if s.resolution % 2:
        raise ValueError(f"config.sampling.resolution={s.resolution} must be even (2x2 packing)")
    os.makedirs(_WORKDIR.value, exist_ok=True)
    family, model_cfg, params = build_model(cfg)
    module = family.module_cls(model_cfg)
    grid = s.resolution // 2
    seq_len = grid * grid
    ladder = sigma_ladder(s.ladder, s.num_steps, image_seq_len=seq_len)
    sigmas = jnp.asarray(ladder.sigmas)

    key = jax.random.key(cfg.seed)
    k_text, k_pool, k_noise, key = jax.random.split(key, 4)
    batch = s.batch_size
    text = jax.random.normal(k_text, (batch, s.text_len, model_cfg.joint_attention_dim))
    pooled = jax.random.normal(k_pool, (batch, model_cfg.pooled_projection_dim))
    img_ids = flux_image_ids(s.resolution, s.resolution)
    txt_ids = jnp.zeros((s.text_len, 3))
    guidance = jnp.full((batch,), s.guidance) if model_cfg.guidance_embeds else None
    x = pack_latents(jax.random.normal(k_noise, (batch, 3, s.resolution, s.resolution)))

    @jax.jit
    def step(x, i, key):
        v = module.apply(
            {"params": params},
            hidden_states=x,
            encoder_hidden_states=text,
            pooled_projections=pooled,
            timestep=jnp.full((batch,), sigmas[i]),
            img_ids=img_ids,
            txt_ids=txt_ids,
            guidance=guidance,
        )
        out = flow_grpo_sde_step(x, v, sigmas, i, s.noise_level, key=key)
        return out.prev_sample, jnp.mean(out.log_prob)

    start = time.time()
    log_probs = []
    for i in range(s.num_steps):
        key, k = jax.random.split(key)
        x, logp = step(x, i, k)
        log_probs.append(logp)
        logging.info("step %d/%d sigma %.4f", i + 1, s.num_steps, float(ladder.sigmas[i]))
    images = np.asarray(unpack_latents(x, s.resolution, s.resolution))  # (B, 3, H, W) in ~[-1, 1]
    elapsed = time.time() - start

    pixels = np.clip((images + 1) * 127.5, 0, 255).astype(np.uint8).transpose(0, 2, 3, 1)
    cols = int(np.ceil(np.sqrt(batch)))
    rows = int(np.ceil(batch / cols))
    sheet = np.zeros((rows * s.resolution, cols * s.resolution, 3), np.uint8)
    for n, img in enumerate(pixels):
        r, c = divmod(n, cols)
        sheet[r * s.resolution : (r + 1) * s.resolution, c * s.resolution : (c + 1) * s.resolution] = img
    scale = max(1, 256 // (cols * s.resolution))
    Image.fromarray(sheet).resize((sheet.shape[1] * scale, sheet.shape[0] * scale), Image.NEAREST).save(
        os.path.join(_WORKDIR.value, "samples.png")
    )
    stats = {
        "num_steps": s.num_steps,
        "batch_size": batch,
        "sigmas": [float(v) for v in ladder.sigmas],
        "mean_log_prob_per_step": [float(v) for v in log_probs],
        "seconds": elapsed,
        "finite": bool(np.isfinite(images).all()),
    }
    with open(os.path.join(_WORKDIR.value, "samples.json"), "w") as f:
        json.dump(stats, f, indent=1)
    print(f"sampled {batch} images in {elapsed:.2f}s; wrote {_WORKDIR.value}/samples.png and samples.json")


if __name__ == "__main__":
    app.run(main)
