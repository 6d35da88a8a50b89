"""The model-zoo table: how a run drives each transformer family, and what it derives from a config.

`ZOO` holds, per family, its released variants, the VAE families it decodes with, the config
fields its conditioning must match and whether it makes video; `model_config`, `vae_config`,
`latent_shape` and `decoder` read a config against it without touching weights. The models
themselves (`digen_jax.models`), their denoiser conventions (`rl.rollout.make_denoiser`), FLOP
formulas (`digen_jax.flops`) and embedding layouts (`data.embeddings`) are keyed by the same
family names; docs/models.md lists what a new family adds in each.
"""
from __future__ import annotations

import dataclasses
import json
import os

import jax
import ml_collections

from digen_jax import diffusion
from digen_jax.data.encode import PIPELINES
from digen_jax.models import FAMILIES, vae_flux, vae_hunyuan_video, vae_wan
from digen_jax.models.checkpoints import MODEL_JSON

@dataclasses.dataclass(frozen=True)
class ZooFamily:
    """How the loop drives one transformer family.

    full_variant / full_vae_variant: the released model's entries in the transformer and VAE
    families' `variants` ('tiny' pairs with 'tiny'). vae_families: the converted-VAE families
    accepted for it (`vae_family`: the one random weights use). text_dim / pooled_dim: the config fields the conditioning must match.
    video: latents (C, T', H/8, W/8) and 4k+1 frames; else packed 2x2 tokens.
    """

    name: str
    title: str  # as the released pipeline folder is usually called
    full_variant: str
    full_vae_variant: str
    vae_families: tuple[str, ...]
    text_dim: str
    pooled_dim: str | None
    video: bool
    vae_family: str  # the VAE family random weights are drawn for

    @property
    def text_cap(self) -> int:
        """Longest text the model takes: the pipeline's hard cap of max_sequence_length where it
        has one, else the fixed length its text encoder pads to (the length it was trained with)."""
        _, _, _, default_len, hard_cap = PIPELINES[self.name]
        return hard_cap or default_len


ZOO = {
    f.name: f
    for f in (
        ZooFamily("flux", "FLUX.1-dev", "dev", "flux1", ("vae_flux",), "joint_attention_dim",
                  "pooled_projection_dim", False, "vae_flux"),
        ZooFamily("qwenimage", "Qwen-Image", "qwen-image", "wan2.1", ("vae_qwenimage", "vae_wan"),
                  "joint_attention_dim", None, False, "vae_qwenimage"),
        ZooFamily("wan", "Wan2.1-T2V-14B", "t2v-14b", "wan2.1", ("vae_wan",), "text_dim", None, True, "vae_wan"),
        ZooFamily("hunyuan_video", "HunyuanVideo", "t2v", "hunyuan_video", ("vae_hunyuan_video",),
                  "text_embed_dim", "pooled_projection_dim", True, "vae_hunyuan_video"),
    )
}
# Config keys that shorten a random-weight transformer (block stacks by their config field names).
DEPTH_KEYS = ("num_layers", "num_single_layers")
# The VAEs' 8x downsampling, then 2x2 packing or patches: sides are multiples of 16.
SIDE_MULTIPLE = 2 * diffusion.VAE_SCALE_FACTOR
TEMPORAL = 4  # both video VAEs: 4k + 1 frames <-> k + 1 latent frames


def shards_weights(rules) -> bool:
    """Whether logical-axis `rules` split a weight axis over the mesh (FSDP), not only activations."""
    return any(mesh_axis and not logical.startswith("activation_") for logical, mesh_axis in rules)


def attention_impl(config: ml_collections.ConfigDict) -> str:
    """`model.attention_impl`, where `auto` also steers clear of cuDNN attention in FSDP programs
    on several GPUs.

    On the lent H100s (jax 0.11.2, NCCL 2.28.9) a program that all-gathers or all-reduces
    sharded weights per layer and runs cuDNN's fused attention deadlocked at its first run: one
    device's thread never joined the collective's rendezvous. The same programs with XLA's
    attention ran every mode, as did cuDNN attention with replicated weights and a plain FSDP
    scan without attention (README "Training shards"). An explicit 'cudnn' is kept as asked.
    """
    impl = config.model.attention_impl
    sharding = config.get("sharding")
    if (impl == "auto" and sharding is not None and shards_weights(sharding.train_rules)
            and jax.default_backend() == "gpu" and jax.device_count() > 1):
        return "xla"
    return impl


def policy(config: ml_collections.ConfigDict) -> dict:
    c = config.model
    return dict(dtype=c.dtype, param_dtype=c.param_dtype, attention_impl=attention_impl(config),
                remat_policy=c.remat_policy, scan_layers=c.scan_layers)


def read_model_json(path: str) -> dict:
    with open(os.path.join(path, MODEL_JSON)) as f:
        return json.load(f)


def model_config(config: ml_collections.ConfigDict):
    """The transformer's config (architecture + policy) without reading any weights."""
    c = config.model
    family = FAMILIES[c.family]
    if c.random_init:
        return dataclasses.replace(family.variants[c.variant], **policy(config), **_depth_overrides(c))
    return family.config_from_diffusers(read_model_json(c.checkpoint)["config"], **policy(config))


def _depth_overrides(model: ml_collections.ConfigDict) -> dict[str, int]:
    """`model.num_layers` / `model.num_single_layers` when > 0: a shallower stack of the variant's
    blocks (random weights only), for throughput runs that must fit a short device budget."""
    return {key: model[key] for key in DEPTH_KEYS if model.get(key, 0) > 0}


def vae_config(config: ml_collections.ConfigDict):
    """The VAE decoder's config without reading any weights."""
    c, zoo = config.model, ZOO[config.model.family]
    if c.random_init:
        family = FAMILIES[zoo.vae_family]
        return family.variants["tiny" if c.variant == "tiny" else zoo.full_vae_variant]
    meta = read_model_json(c.vae_checkpoint)
    return FAMILIES[meta["family"]].config_from_diffusers(meta["config"])


def latent_shape(config: ml_collections.ConfigDict, vae_cfg) -> tuple[int, ...]:
    """Per-sample latent shape: (H/16 * W/16, 4C) packed tokens, or (C, (F - 1)/4 + 1, H/8, W/8) video."""
    s, zoo = config.sampling, ZOO[config.model.family]
    channels = vae_cfg.z_dim if isinstance(vae_cfg, vae_wan.WanVAEConfig) else vae_cfg.latent_channels
    if zoo.video:
        return (channels, (s.num_frames - 1) // TEMPORAL + 1, *diffusion.latent_size(s.height, s.width))
    return (diffusion.packed_seq_len(s.height, s.width), 4 * channels)


def decoder(family: str, vae_cfg, height: int, width: int):
    """`decode(params, latents) -> (B, 3, F, H, W)` in nominal [-1, 1], as the family's pipeline decodes."""
    unpack = lambda x: diffusion.unpack_latents(x, *diffusion.latent_size(height, width))  # noqa: E731
    if family == "flux":
        return lambda p, x: vae_flux.decode_latents(vae_cfg, p, unpack(x))[:, :, None]
    if family == "qwenimage":
        return lambda p, x: vae_wan.decode_latents(p, vae_cfg, unpack(x)[:, :, None])
    if family == "wan":
        return lambda p, x: vae_wan.decode_latents(p, vae_cfg, x)
    return lambda p, x: vae_hunyuan_video.decode_latents(p, vae_cfg, x)
