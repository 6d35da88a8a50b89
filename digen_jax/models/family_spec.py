"""What one transformer family is, as data: the JAX-free spec each family package's `spec.py`
states and every per-family table is built from (`specs.SPECS`).

The spec imports nothing but the standard library, so the FLOP counter, the simulator and the
data tools read it without the model zoo. The family's code lives beside it: its
`transformer` module (flax module, config, weight rules, variants and `FAMILY`, whose
`denoiser_inputs` is how the transformer is called as a denoiser) and, where the family has its
own, its `vae` module.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, NamedTuple


class TextPipeline(NamedTuple):
    """How the family's diffusers pipeline encodes prompts (`data.encode`).

    pipeline: the diffusers pipeline class; encoders: {text-encoder subfolder: default
    transformers class} (the class is read from the subfolder's config.json "architectures"
    when it has one); tokenizers: the tokenizer subfolders; default_len: the default
    max_sequence_length; hard_cap: the largest max_sequence_length the pipeline takes (None: no cap).
    """

    pipeline: str
    encoders: Mapping[str, str]
    tokenizers: tuple[str, ...]
    default_len: int
    hard_cap: int | None


@dataclasses.dataclass(frozen=True)
class FamilySpec:
    """One transformer family: one row of every per-family table.

    name: the family's name (`model.family`, a checkpoint's family); title: as the released
      pipeline folder is usually called.
    full_variant / full_vae_variant: the released model's entries in the transformer's and the
      VAE's `variants` ('tiny' pairs with 'tiny').
    vae: the VAE family random weights are drawn for; vae_families: the converted-VAE families
      accepted for it; vae_variants: transformer variants whose VAE is another `variants` entry
      than the 'tiny' / full_vae_variant rule gives (a family whose released models use two VAEs).
    video: latents (C, T', H/s, W/s) and 4k+1 frames (s: the VAE's spatial compression); else
      packed 2x2 tokens.
    text_dim / pooled_dim: the config fields the conditioning must match.
    text_prefix: text positions in front of the capped encoder's (SD3: CLIP's 77 before T5's).
    latent_dim: the config field the latents' channels must match (packed tokens' width for image
      families; SD3's `in_channels` count the latent's channels before its 2x2 patching).
    embedding: the prompt-embedding cache layout (`data.embeddings`): which of `pooled`, `mask`
      and `lengths` it stores, and `negative`, the true-CFG default negative prompt (None: no true CFG).
    text_pipeline: the prompt encoder (`TextPipeline`).
    lora_targets: the usual RL LoRA targets, "attention and MLP" of every block: regexes searched
      in each kernel's path; `(\\d+/)?` admits the block index of unrolled layouts.
    flop_terms: the FLOP term builder of its architecture (`model_flops.TERMS`); temporal_patch(cfg):
      for video families, the latent frames one token spans (None for image families);
      pixels_per_token(cfg): the side of the pixel square one token spans (None: 16).
    ladder: the sigma ladder its released pipeline samples with (`diffusion.LADDER_FAMILIES`).
    """

    name: str
    title: str
    full_variant: str
    vae: str
    full_vae_variant: str
    vae_families: tuple[str, ...]
    video: bool
    text_dim: str
    pooled_dim: str | None
    embedding: Mapping[str, Any]
    text_pipeline: TextPipeline
    lora_targets: tuple[str, ...]
    flop_terms: str
    ladder: str
    temporal_patch: Callable[[Any], int] | None = None
    pixels_per_token: Callable[[Any], int] | None = None
    text_prefix: int = 0
    latent_dim: str = "in_channels"
    vae_variants: Mapping[str, str] = dataclasses.field(default_factory=dict)

    @property
    def text_cap(self) -> int:
        """Longest text the model takes: the pipeline's hard cap of max_sequence_length where it
        has one, else the fixed length its text encoder pads to (the length it was trained with),
        after `text_prefix` positions of another encoder."""
        return self.text_prefix + (self.text_pipeline.hard_cap or self.text_pipeline.default_len)
