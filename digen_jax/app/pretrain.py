"""Flow-matching pretraining of a FLUX-family model on the coloured-shapes task, in pixel space.

The tiny demo's base model: RL post-training needs a policy that already draws the task's images
and follows prompts partially. Images (B, 3, H, W) in [-1, 1] are packed 2x2 into (H/2 * W/2)
tokens of 12 channels (``pack_latents``), exactly as FLUX packs its VAE latents.

Objective (rectified flow, FLUX convention): with data x0, noise e ~ N(0, I) and t ~ U(0, 1),
``x_t = (1 - t) x0 + t e`` and the model, fed ``timestep = t``, regresses the velocity
``v = dx_t/dt = e - x0`` with a mean squared error. The samplers step ``x + (sigma' - sigma) v``
with sigma' < sigma, which moves toward the data. t is uniform rather than SD3's logit-normal:
at 16 px the hard part is the layout (which quadrant, which colour), decided at the highest noise
levels that logit-normal rarely draws, and the FLUX ladder's first step is exactly sigma = 1 (in
a sweep, logit-normal t gave no better samples for the same budget).

Every batch is generated on device inside the jitted step (prompts, label-noised renders, frozen
text encoding, noise), so there is no input pipeline.

Measured with the configs/tiny.py model and the default ``ShapesTask``: 800 steps of 32 at
learning rate 3e-3 take about 1.7 minutes on 2 CPU cores (0.11 s a step plus ~10 s of
compilation); the model's 8-step Flow-GRPO SDE samples (noise level 0.7, FLUX ladder) then score
a mean ``shapes_reward`` of about 0.4-0.55 (clean renders 1.0, Gaussian noise 0.09): it draws the
shapes in roughly the right place and colour, with room for RL to improve all three.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import time
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from digen_jax.data.shapes_task import ShapesTask
from digen_jax.diffusion import flux_image_ids, pack_latents
from digen_jax.models import load_checkpoint, save_checkpoint
from digen_jax.models.conversion import POLICY_FIELDS
from digen_jax.models.flux.transformer import FAMILY, FluxConfig
from digen_jax.rl.optim import make_optimizer

PyTree = Any

# The embedded guidance scale the model is conditioned on (configs/tiny.py `sampling.guidance`);
# sampling must pass the same value.
DEFAULT_GUIDANCE = 3.5
# Bump when the recipe below changes what a given set of arguments produces: it is part of the
# cache key, so stale cached models are not reused.
RECIPE_VERSION = 1
PRETRAIN_JSON = "pretrain.json"


def check_compatible(model_cfg: FluxConfig, task: ShapesTask) -> None:
    """Raise ValueError unless the model consumes the task's packed pixels and text encoding."""
    need = {
        "patch_size": 1,
        "in_channels": 3 * 4,  # RGB x 2x2 packing
        "joint_attention_dim": task.embed_dim,
        "pooled_projection_dim": task.pooled_dim,
    }
    wrong = {k: getattr(model_cfg, k) for k, v in need.items() if getattr(model_cfg, k) != v}
    if wrong:
        raise ValueError(f"model config has {wrong}; the shapes task needs {need}")


def init_params(model_cfg: FluxConfig, key: jax.Array) -> PyTree:
    """Randomly initialised, unboxed parameters of the model (as ``launch/sample.py`` builds them)."""
    abstract = FAMILY.example_inputs(model_cfg)
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), abstract)
    params = jax.jit(lambda k, x: FAMILY.module_cls(model_cfg).init(k, **x))(key, zeros)["params"]
    return nn.unbox(params)


def model_inputs(model_cfg: FluxConfig, task: ShapesTask, ids: jax.Array, latents: jax.Array, timestep: jax.Array,
                 guidance: float = DEFAULT_GUIDANCE) -> dict:
    """The ``FluxTransformer`` keyword inputs for packed ``latents`` (B, S, 12) of prompts ``ids`` at ``timestep`` (B,).

    Text and pooled embeddings from ``task.encode``, image ids from ``flux_image_ids``, zero text
    ids, and the constant embedded ``guidance`` when the model embeds guidance.
    """
    text, pooled = task.encode(ids)
    batch = latents.shape[0]
    return dict(
        hidden_states=latents,
        encoder_hidden_states=text,
        pooled_projections=pooled,
        timestep=timestep,
        img_ids=flux_image_ids(task.resolution, task.resolution),
        txt_ids=jnp.zeros((task.text_len, 3), jnp.float32),
        guidance=jnp.full((batch,), guidance, jnp.float32) if model_cfg.guidance_embeds else None,
    )


def flow_matching_loss(params: PyTree, model_cfg: FluxConfig, task: ShapesTask, key: jax.Array, batch_size: int,
                       guidance: float = DEFAULT_GUIDANCE) -> jax.Array:
    """Scalar MSE between the predicted and the true velocity on one freshly drawn batch."""
    k_prompt, k_render, k_noise, k_t = jax.random.split(key, 4)
    ids = task.sample_prompts(k_prompt, batch_size)
    x0 = pack_latents(task.render(ids, k_render))
    noise = jax.random.normal(k_noise, x0.shape, jnp.float32)
    t = jax.random.uniform(k_t, (batch_size,), jnp.float32)
    x_t = (1.0 - t[:, None, None]) * x0 + t[:, None, None] * noise
    inputs = model_inputs(model_cfg, task, ids, x_t, t, guidance)
    pred = FAMILY.module_cls(model_cfg).apply({"params": params}, **inputs)
    return jnp.mean(jnp.square(pred.astype(jnp.float32) - (noise - x0)))


def pretrain(
    model_cfg: FluxConfig,
    task: ShapesTask,
    *,
    steps: int,
    batch_size: int,
    learning_rate: float,
    seed: int,
    guidance: float = DEFAULT_GUIDANCE,
    log_every: int = 50,
    log: Callable[[str], None] = print,
) -> PyTree:
    """Train a randomly initialised model (seeded by ``seed``) by flow matching; return its params.

    AdamW (``digen_jax.rl.make_optimizer``: global-norm clip 1.0, weight decay 1e-4) at a
    constant ``learning_rate`` for ``steps`` steps of ``batch_size`` fresh samples. Every
    ``log_every`` steps (and at the end) ``log`` gets the step, the mean loss since the last
    line and the elapsed time (compilation included).
    """
    check_compatible(model_cfg, task)
    if steps < 1 or batch_size < 1 or log_every < 1:
        raise ValueError(f"steps, batch_size and log_every must be >= 1, got {steps}, {batch_size}, {log_every}")
    init_key, data_key = jax.random.split(jax.random.key(seed))
    params = init_params(model_cfg, init_key)
    optimizer = make_optimizer(learning_rate)
    opt_state = optimizer.init(params)

    def train_step(params, opt_state, step):
        key = jax.random.fold_in(data_key, step)
        loss, grads = jax.value_and_grad(flow_matching_loss)(params, model_cfg, task, key, batch_size, guidance)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    # Params and optimizer state are donated: updated in place instead of copied every step.
    train_step = jax.jit(train_step, donate_argnums=(0, 1))
    start = time.time()
    window = []
    for step in range(steps):
        params, opt_state, loss = train_step(params, opt_state, step)
        window.append(loss)
        if (step + 1) % log_every == 0 or step + 1 == steps:
            mean = float(jnp.mean(jnp.stack(window)))
            log(f"pretrain step {step + 1}/{steps} loss {mean:.4f} ({time.time() - start:.1f}s)")
            window = []
    return params


def cache_key(model_cfg: FluxConfig, task: ShapesTask, **hyperparameters: Any) -> str:
    """Hex digest naming the pretraining result of these arguments (and the recipe version)."""
    spec = {
        "recipe": RECIPE_VERSION,
        "model": dataclasses.asdict(model_cfg),
        "task": dataclasses.asdict(task),
        "hyperparameters": hyperparameters,
    }
    return hashlib.sha256(json.dumps(spec, sort_keys=True, default=str).encode()).hexdigest()[:16]


def cache_path(model_cfg: FluxConfig, task: ShapesTask, cache_dir: str, **hyperparameters: Any) -> str:
    """Where :func:`pretrained_params` caches the result of these arguments."""
    return os.path.join(os.path.abspath(os.path.expanduser(cache_dir)), cache_key(model_cfg, task, **hyperparameters))


def is_cached(path: str) -> bool:
    """Whether a complete pretraining result is cached at `path` (a `cache_path`)."""
    return os.path.exists(os.path.join(path, PRETRAIN_JSON))


def pretrained_params(
    model_cfg: FluxConfig,
    task: ShapesTask,
    *,
    steps: int,
    batch_size: int,
    learning_rate: float,
    seed: int,
    cache_dir: str,
    guidance: float = DEFAULT_GUIDANCE,
    log_every: int = 50,
    log: Callable[[str], None] = print,
) -> PyTree:
    """:func:`pretrain`'s params, cached under ``cache_dir/<cache_key(...)>/``.

    The first call trains and saves an orbax checkpoint (``digen_jax.models.save_checkpoint``)
    plus ``pretrain.json`` (arguments, final-window loss, seconds); later calls with the same
    model config, task and hyperparameters load it (``log`` says which happened). The
    checkpoint is written to a temporary folder and renamed into place, so an interrupted run
    leaves no half-written cache entry.
    """
    hyperparameters = dict(
        steps=steps, batch_size=batch_size, learning_rate=learning_rate, seed=seed, guidance=guidance
    )
    path = cache_path(model_cfg, task, cache_dir, **hyperparameters)
    if is_cached(path):
        policy = {k: getattr(model_cfg, k) for k in POLICY_FIELDS}
        _, _, params = load_checkpoint(path, **policy)
        log(f"loaded pretrained model from {path}")
        return params

    start = time.time()
    lines = []

    def record(line: str) -> None:
        lines.append(line)
        log(line)

    params = pretrain(
        model_cfg, task, steps=steps, batch_size=batch_size, learning_rate=learning_rate, seed=seed,
        guidance=guidance, log_every=log_every, log=record,
    )
    tmp = f"{path}.tmp-{os.getpid()}"
    save_checkpoint(tmp, FAMILY, model_cfg, params)
    with open(os.path.join(tmp, PRETRAIN_JSON), "w") as f:
        json.dump(
            {"hyperparameters": hyperparameters, "task": dataclasses.asdict(task), "final_log_line": lines[-1],
             "seconds": time.time() - start},
            f, indent=1,
        )
    try:
        os.rename(tmp, path)
    except OSError:
        # Another process cached the same result first; keep theirs.
        shutil.rmtree(tmp, ignore_errors=True)
    log(f"saved pretrained model to {path}")
    return params
