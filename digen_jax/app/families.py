"""The model-zoo table: every piece of each transformer family, in one row, and what a run
derives from a config against it.

`ZOO` holds one `ZooFamily` row per family spec (`models.specs.SPECS`): the spec with the
family's transformer and VAE `ModelFamily`s. `model_config`, `vae_config`, `latent_shape` and
`decoder` read a config against it without touching weights. Adding a family:
docs/adding_a_family.md.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Callable

import jax
import ml_collections

from digen_jax import diffusion, model_flops
from digen_jax.models import FAMILIES
from digen_jax.models.checkpoints import MODEL_JSON
from digen_jax.models.conversion import ModelFamily
from digen_jax.models.family_spec import FamilySpec
from digen_jax.models.specs import SPECS
from digen_jax.models.wan import vae as vae_wan


@dataclasses.dataclass(frozen=True)
class ZooFamily:
    """One transformer family as a run drives it: its spec's fields, plus

    transformer: its `ModelFamily` (module, conversion, variants, denoiser convention).
    vae: the VAE `ModelFamily` random weights are drawn for (the spec's `vae`).
    """

    spec: FamilySpec
    transformer: ModelFamily
    vae: ModelFamily

    def __getattr__(self, name: str):
        if name == "spec":  # not yet set (copying)
            raise AttributeError(name)
        return getattr(self.spec, name)

    @property
    def vae_family(self) -> str:
        return self.vae.name

    @property
    def decode(self) -> Callable[[Any, Any, jax.Array], jax.Array]:
        """decode(params, vae_cfg, latents) -> (B, 3, F, H, W): the VAE decode of unpacked latents,
        (B, C, H/8, W/8) images or (B, C, T', H/8, W/8) videos, as the family's pipeline decodes."""
        return self.vae.decode_frames

    @property
    def flop_formula(self) -> model_flops.Formula:
        return model_flops.FORMULAS[self.spec.name]


ZOO = {name: ZooFamily(spec, FAMILIES[name], FAMILIES[spec.vae]) for name, spec in SPECS.items()}

# Config keys that shorten a random-weight transformer (block stacks by their config field names).
DEPTH_KEYS = ("num_layers", "num_single_layers")
# The VAEs' 8x downsampling, then 2x2 packing or patches: sides are multiples of 16 (of
# `side_multiple(vae_cfg)` for a VAE that compresses more).
SIDE_MULTIPLE = 2 * diffusion.VAE_SCALE_FACTOR
TEMPORAL = 4  # both video VAEs: 4k + 1 frames <-> k + 1 latent frames


def policy(config: ml_collections.ConfigDict) -> dict:
    c = config.model
    return dict(dtype=c.dtype, param_dtype=c.param_dtype, attention_impl=c.attention_impl,
                remat_policy=c.remat_policy, scan_layers=c.scan_layers)


def read_model_json(path: str) -> dict:
    with open(os.path.join(path, MODEL_JSON)) as f:
        return json.load(f)


def model_config(config: ml_collections.ConfigDict):
    """The transformer's config (architecture + policy) without reading any weights."""
    c = config.model
    family = FAMILIES[c.family]
    if c.random_init:
        return dataclasses.replace(family.variants[c.variant], **policy(config), **depth_overrides(c))
    return family.config_from_diffusers(read_model_json(c.checkpoint)["config"], **policy(config))


def depth_overrides(model: ml_collections.ConfigDict) -> dict[str, int]:
    """`model.num_layers` / `model.num_single_layers` when > 0: a shallower stack of the variant's
    blocks (random weights only), for throughput runs that must fit a short device budget."""
    return {key: model[key] for key in DEPTH_KEYS if model.get(key, 0) > 0}


def vae_config(config: ml_collections.ConfigDict):
    """The VAE decoder's config without reading any weights; it decodes in `model.dtype`."""
    c, zoo = config.model, ZOO[config.model.family]
    if c.random_init:
        variant = zoo.vae_variants.get(c.variant) or ("tiny" if c.variant == "tiny" else zoo.full_vae_variant)
        return dataclasses.replace(zoo.vae.variants[variant], dtype=c.dtype)
    meta = read_model_json(c.vae_checkpoint)
    return FAMILIES[meta["family"]].config_from_diffusers(meta["config"], dtype=c.dtype)


def latent_shape(config: ml_collections.ConfigDict, vae_cfg) -> tuple[int, ...]:
    """Per-sample latent shape: (H/16 * W/16, 4C) packed tokens, or (C, (F - 1)/4 + 1, H/8, W/8) video."""
    s, zoo = config.sampling, ZOO[config.model.family]
    channels = vae_cfg.z_dim if isinstance(vae_cfg, vae_wan.WanVAEConfig) else vae_cfg.latent_channels
    if zoo.video:
        latent = diffusion.latent_size(s.height, s.width, vae_scale_factor(vae_cfg))
        return (channels, (s.num_frames - 1) // TEMPORAL + 1, *latent)
    return (diffusion.packed_seq_len(s.height, s.width), 4 * channels)


def vae_scale_factor(vae_cfg) -> int:
    """The VAE's spatial compression: 8, or the Wan VAE's own (16 for Wan2.2's)."""
    return vae_cfg.spatial_compression if isinstance(vae_cfg, vae_wan.WanVAEConfig) else diffusion.VAE_SCALE_FACTOR


def side_multiple(vae_cfg) -> int:
    """What image sides must be multiples of: the VAE's compression times the 2x2 packing or patch."""
    return 2 * vae_scale_factor(vae_cfg)


def decoder(family: str, vae_cfg, height: int, width: int):
    """`decode(params, latents) -> (B, 3, F, H, W)` in nominal [-1, 1], as the family's pipeline
    decodes: the row's `decode`, after unpacking packed image tokens."""
    zoo = ZOO[family]
    if zoo.video:
        return lambda p, x: zoo.decode(p, vae_cfg, x)
    unpack = lambda x: diffusion.unpack_latents(x, *diffusion.latent_size(height, width))  # noqa: E731
    return lambda p, x: zoo.decode(p, vae_cfg, unpack(x))
