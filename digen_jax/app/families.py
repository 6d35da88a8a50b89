"""The model-zoo table: every piece of each transformer family, in one row, and what a run
derives from a config against it.

`ZOO` holds one `ZooFamily` row per family; `model_config`, `vae_config`, `latent_shape` and
`decoder` read a config against it without touching weights. A new family provides:

* its model file in `digen_jax/models/` (flax module, config, weight rules, variants) and its
  `ModelFamily` there, with `denoiser_inputs`: how the transformer is called as a denoiser
  (timestep scale, embedded guidance, position ids, masks), registered in `models.FAMILIES`;
* a VAE: a converted-VAE `ModelFamily` in `models.FAMILIES` and a decode function for the row;
* its FLOP formula in `digen_jax.flops.FORMULAS` (flops imports no model code);
* its prompt-embedding layout in `data.embeddings.EMBEDDING_LAYOUTS` and its text-encoder
  pipeline in `data.encode.PIPELINES`;
* a `ZooFamily` row in `ZOO` below, which references each of these;
* its LoRA targets in `configs/sections.py` `ATTENTION_MLP_TARGETS` (configs import nothing
  from the library).
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Callable, Mapping

import jax
import ml_collections

from digen_jax import diffusion, flops
from digen_jax.data.embeddings import EMBEDDING_LAYOUTS
from digen_jax.data.encode import PIPELINES
from digen_jax.models import (
    FAMILIES,
    flux,
    hunyuan_video,
    qwenimage,
    sd3,
    vae_flux,
    vae_hunyuan_video,
    vae_wan,
    wan,
    wan22,
)
from digen_jax.models.checkpoints import MODEL_JSON
from digen_jax.models.conversion import ModelFamily


@dataclasses.dataclass(frozen=True)
class ZooFamily:
    """One transformer family as a run drives it.

    transformer: its `ModelFamily` (module, conversion, variants, denoiser convention).
    full_variant / full_vae_variant: the released model's entries in the transformer's and the
    VAE's `variants` ('tiny' pairs with 'tiny').
    vae: the VAE family random weights are drawn for; vae_families: the converted-VAE families
    accepted for it.
    decode(params, vae_cfg, latents) -> (B, 3, F, H, W): the VAE decode of unpacked latents,
    (B, C, H/8, W/8) images or (B, C, T', H/8, W/8) videos, as the family's pipeline decodes.
    embedding: its prompt-embedding cache layout (`data.embeddings.EMBEDDING_LAYOUTS`).
    flop_formula: its FLOP formula (`flops.FORMULAS`).
    text_dim / pooled_dim: the config fields the conditioning must match.
    video: latents (C, T', H/s, W/s) and 4k+1 frames (s: the VAE's spatial compression); else
    packed 2x2 tokens.
    text_prefix: text positions in front of the capped encoder's (SD3: CLIP's 77 before T5's).
    latent_dim: the config field the latents' channels must match (packed tokens' width for image
      families; SD3's `in_channels` count the latent's channels before its 2x2 patching).
    vae_variants: transformer variants whose VAE is another `vae.variants` entry than the
    'tiny' / full_vae_variant rule gives (a family whose released models use two VAEs).
    """

    title: str  # as the released pipeline folder is usually called
    transformer: ModelFamily
    full_variant: str
    vae: ModelFamily
    full_vae_variant: str
    vae_families: tuple[str, ...]
    decode: Callable[[Any, Any, jax.Array], jax.Array]
    embedding: Mapping[str, Any]
    flop_formula: flops.Formula
    text_dim: str
    pooled_dim: str | None
    video: bool
    text_prefix: int = 0
    latent_dim: str = "in_channels"
    vae_variants: Mapping[str, str] = dataclasses.field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.transformer.name

    @property
    def vae_family(self) -> str:
        return self.vae.name

    @property
    def text_cap(self) -> int:
        """Longest text the model takes: the pipeline's hard cap of max_sequence_length where it
        has one, else the fixed length its text encoder pads to (the length it was trained with),
        after `text_prefix` positions of another encoder."""
        _, _, _, default_len, hard_cap = PIPELINES[self.name]
        return self.text_prefix + (hard_cap or default_len)


def _decode_flux(params, vae_cfg, latents):
    """FLUX's (and SD3's) VAE on (B, C, H, W) latents, as one-frame videos."""
    return vae_flux.decode_latents(vae_cfg, params, latents)[:, :, None]


def _decode_qwenimage(params, vae_cfg, latents):
    """Qwen-Image's (Wan) VAE on (B, C, H, W) latents as one-frame videos."""
    return vae_wan.decode_latents(params, vae_cfg, latents[:, :, None])


ZOO = {
    f.name: f
    for f in (
        ZooFamily(
            title="FLUX.1-dev", transformer=flux.FAMILY, full_variant="dev",
            vae=vae_flux.FAMILY, full_vae_variant="flux1", vae_families=("vae_flux",), decode=_decode_flux,
            embedding=EMBEDDING_LAYOUTS["flux"], flop_formula=flops.FORMULAS["flux"],
            text_dim="joint_attention_dim", pooled_dim="pooled_projection_dim", video=False),
        ZooFamily(
            title="Qwen-Image", transformer=qwenimage.FAMILY, full_variant="qwen-image",
            vae=vae_wan.QWEN_FAMILY, full_vae_variant="wan2.1", vae_families=("vae_qwenimage", "vae_wan"),
            decode=_decode_qwenimage,
            embedding=EMBEDDING_LAYOUTS["qwenimage"], flop_formula=flops.FORMULAS["qwenimage"],
            text_dim="joint_attention_dim", pooled_dim=None, video=False),
        ZooFamily(
            title="Wan2.1-T2V-14B", transformer=wan.FAMILY, full_variant="t2v-14b",
            vae=vae_wan.FAMILY, full_vae_variant="wan2.1", vae_families=("vae_wan",), decode=vae_wan.decode_latents,
            embedding=EMBEDDING_LAYOUTS["wan"], flop_formula=flops.FORMULAS["wan"],
            text_dim="text_dim", pooled_dim=None, video=True),
        ZooFamily(
            title="Wan2.2-TI2V-5B", transformer=wan22.FAMILY, full_variant="ti2v-5b",
            vae=vae_wan.FAMILY, full_vae_variant="wan2.2", vae_families=("vae_wan",), decode=vae_wan.decode_latents,
            embedding=EMBEDDING_LAYOUTS["wan22"], flop_formula=flops.FORMULAS["wan22"],
            text_dim="text_dim", pooled_dim=None, video=True,
            # T2V-A14B decodes with the Wan2.1 VAE; the tiny TI2V with the tiny Wan2.2 VAE.
            vae_variants={"t2v-a14b": "wan2.1", "tiny-a14b": "tiny", "tiny": "tiny22"}),
        ZooFamily(
            title="HunyuanVideo", transformer=hunyuan_video.FAMILY, full_variant="t2v",
            vae=vae_hunyuan_video.FAMILY, full_vae_variant="hunyuan_video", vae_families=("vae_hunyuan_video",),
            decode=vae_hunyuan_video.decode_latents,
            embedding=EMBEDDING_LAYOUTS["hunyuan_video"], flop_formula=flops.FORMULAS["hunyuan_video"],
            text_dim="text_embed_dim", pooled_dim="pooled_projection_dim", video=True),
        ZooFamily(
            title="stable-diffusion-3.5-medium", transformer=sd3.FAMILY, full_variant="sd3.5-medium",
            vae=vae_flux.FAMILY, full_vae_variant="sd3", vae_families=("vae_flux",), decode=_decode_flux,
            embedding=EMBEDDING_LAYOUTS["sd3"], flop_formula=flops.FORMULAS["sd3"],
            text_dim="joint_attention_dim", pooled_dim="pooled_projection_dim", video=False, text_prefix=77,
            latent_dim="patch_dim"),
    )
}
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
