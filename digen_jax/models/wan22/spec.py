"""Wan2.2 as data (`family_spec.FamilySpec`); imports no JAX. Wan2.1's text encoder, cache
layout, block names (LoRA targets in both A14B experts alike) and ladder."""
import dataclasses

from digen_jax.models.family_spec import FamilySpec
from digen_jax.models.wan.spec import SPEC as WAN

SPEC: FamilySpec = dataclasses.replace(
    WAN, name="wan22", title="Wan2.2-TI2V-5B", full_variant="ti2v-5b", full_vae_variant="wan2.2",
    # T2V-A14B decodes with the Wan2.1 VAE; the tiny TI2V with the tiny Wan2.2 VAE.
    vae_variants={"t2v-a14b": "wan2.1", "tiny-a14b": "tiny", "tiny": "tiny22"},
    # One forward runs one transformer (of the A14B pair, one expert); its VAE sets the token size.
    pixels_per_token=lambda cfg: cfg.vae_scale_factor_spatial * cfg.patch_size[1],
)
