"""The tiny CPU default: a FLUX-family transformer small enough to run on two CPU cores.

It works in pixel space (no VAE): a (3, H, W) image is packed 2x2 into (H/2 * W/2)
tokens of 12 channels, exactly like FLUX packs its 16-channel latents.

    python launch/sample.py --config=configs/tiny.py --workdir=/tmp/digen
    python launch/sample.py --config=configs/tiny.py --config.sampling.num_steps=4 ...
"""
import ml_collections


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.seed = 0

    c.model = ml_collections.ConfigDict()
    c.model.family = "flux"
    # Architecture: the fields of digen_jax.models.flux.FluxConfig (diffusers names).
    c.model.arch = ml_collections.ConfigDict(
        dict(
            in_channels=12,  # 3 pixel channels x 2x2 packing
            num_layers=2,
            num_single_layers=2,
            attention_head_dim=16,
            num_attention_heads=4,
            joint_attention_dim=32,
            pooled_projection_dim=32,
            guidance_embeds=True,
            axes_dims_rope=(4, 6, 6),
        )
    )
    c.model.dtype = "float32"
    c.model.param_dtype = "float32"
    c.model.attention_impl = "auto"
    c.model.remat_policy = "none"
    c.model.checkpoint = ""  # a converted checkpoint dir; empty = random init from `seed`

    c.sampling = ml_collections.ConfigDict()
    c.sampling.resolution = 16  # pixels per side (a multiple of 2 for the 2x2 packing)
    c.sampling.num_steps = 8
    c.sampling.ladder = "flux"  # a digen_jax.diffusion.LADDER_FAMILIES entry
    c.sampling.guidance = 3.5  # embedded guidance scale (FLUX.1-dev style)
    c.sampling.noise_level = 0.7  # Flow-GRPO SDE `a`; 0 = deterministic ODE sampling
    c.sampling.batch_size = 8
    c.sampling.text_len = 8

    # Logical axis -> mesh axis rules (digen_jax.models.layers lists the logical names).
    # The tiny model runs on one device: everything replicated.
    c.sharding = ml_collections.ConfigDict()
    c.sharding.rules = (
        ("embed", None),
        ("heads", None),
        ("mlp", None),
        ("layers", None),
        ("activation_batch", None),
    )
    return c
