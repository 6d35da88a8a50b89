"""One Flow-GRPO iteration (rollout, on-policy ratio, update) for each non-FLUX family, tiny, video included."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from digen_jax import diffusion
from digen_jax.models import FAMILIES
from digen_jax.rl import optim
from digen_jax.rl.rollout import Conditioning, Sampler, SamplerSpec, make_denoiser
from digen_jax.rl.trainer import LossConfig, Trainer, build_units

BATCH, TEXT_LEN, STEPS = 4, 6, 3
MASK = jnp.array([[1] * 6, [1] * 3 + [0] * 3, [1] * 6, [1] * 1 + [0] * 5], jnp.int32)  # right-padded prompts

# family -> (latent shape per sample, example_inputs kwargs, sampler spec, image grid)
CASES = {
    # Qwen-Image: packed 2x2 tokens, true CFG 4 with the norm rescale, padded prompts.
    "qwenimage": ((6, 16), dict(image_seq_len=6, text_seq_len=TEXT_LEN), SamplerSpec("sde", 4.0, True), (2, 3)),
    # Wan2.1: (C, T', H', W') video latents with two latent frames, CFG 5, the Wan step.
    "wan": ((4, 2, 4, 2), dict(frames=2, height=2, width=1, text_seq_len=TEXT_LEN), SamplerSpec("wan", 5.0), None),
    # HunyuanVideo: video latents, embedded guidance, padded prompts.
    "hunyuan_video": ((4, 2, 2, 4), dict(frames=2, height=1, width=2, text_seq_len=TEXT_LEN), SamplerSpec("sde"), None),
}


def _cond(family, cfg, key):
    k1, k2 = jax.random.split(key)
    text_dim = {"qwenimage": "joint_attention_dim", "wan": "text_dim", "hunyuan_video": "text_embed_dim"}[family]
    text = jax.random.normal(k1, (BATCH, TEXT_LEN, getattr(cfg, text_dim)))
    pooled = jax.random.normal(k2, (BATCH, cfg.pooled_projection_dim)) if family == "hunyuan_video" else None
    mask = MASK if family in ("qwenimage", "hunyuan_video") else None
    return Conditioning(text, pooled, mask)


@pytest.mark.parametrize("family", sorted(CASES))
def test_one_iteration_per_family(family):
    latent_shape, shapes, spec, grid = CASES[family]
    fam = FAMILIES[family]
    cfg = fam.variants["tiny"]
    module = fam.module_cls(cfg)
    inputs = {
        k: jnp.ones(v.shape, v.dtype) if isinstance(v, jax.ShapeDtypeStruct) else v
        for k, v in fam.example_inputs(cfg, 1, **shapes).items()
    }
    params = nn.unbox(module.init(jax.random.key(0), **inputs))["params"]
    params = jax.tree.map(lambda p: p + 0.05 * jax.random.normal(jax.random.key(1), p.shape), params)

    cond = _cond(family, cfg, jax.random.key(2))
    negative = jax.tree.map(lambda a: a[:1] * 0.0, cond) if spec.cfg_scale > 1 else None
    if negative is not None and negative.mask is not None:
        negative = negative.replace(mask=jnp.ones_like(negative.mask))
    sigmas = diffusion.sigma_ladder("flux", STEPS, image_seq_len=256).sigmas
    sampler = Sampler(make_denoiser(family, module, guidance=6.0, image_grid=grid), spec, sigmas, negative)
    traj = sampler.rollout(params, cond, jax.random.split(jax.random.key(3), BATCH), np.full(STEPS, 0.9, np.float32), latent_shape, 0)
    assert traj.latents.shape == (BATCH, STEPS + 1, *latent_shape)

    units = build_units(traj, cond, jnp.array([1.0, -1.0, 0.5, -0.5]), jnp.tile(jnp.arange(STEPS - 1), (BATCH, 1)))
    trainer = Trainer(sampler, None, optim.make_optimizer(1e-3), LossConfig())
    ratio = np.exp(np.asarray(trainer.log_prob_fn(params, units) - units.old_log_prob))
    np.testing.assert_allclose(ratio, 1.0, atol=1e-6)

    state, metrics = trainer.update(trainer.init_state(jax.tree.map(jnp.copy, params)), units, units.size // 2, True)
    assert int(state.version) == 1 and int(metrics["skipped"]) == 0 and np.isfinite(float(metrics["loss"]))
