"""Wan2.2: TI2V-5B (one transformer) and T2V-A14B (two experts switched at a timestep boundary).

Both are diffusers `WanTransformer3DModel`s (`wan.WanTransformer`); what Wan2.2 adds is in the
pipeline, and is ported here at the model level:

* TI2V-5B is one transformer of its own size (3072 wide, 30 layers, 48 latent channels: the
  Wan2.2 VAE's, `vae_wan.VARIANTS["wan2.2"]`) that takes per-token timesteps (`wan.WanTransformer`
  accepts a (B, S) `timestep`), with which diffusers' pipeline keeps a conditioning first frame
  clean (`expand_timesteps`).
* T2V-A14B is two experts of the Wan2.1-14B architecture: diffusers' `transformer` (high noise)
  denoises the steps with timestep t >= `boundary_ratio` * 1000, `transformer_2` (low noise) the
  rest. `WanExperts` holds both (parameters `transformer/...` and `transformer_2/...`) and routes
  each forward by timestep, so a policy of two transformers is one module: one parameter tree
  (LoRA targets match inside both experts, a weight sync moves both), rollout steps and training
  steps routed alike. A batch whose samples all fall on one side runs that expert only (`nn.cond`:
  one branch executes, and the other expert gets zero gradients); a batch straddling the boundary
  runs both and takes each sample's from its own expert. With per-token timesteps the largest
  timestep of a sample decides (the step's; clean conditioning tokens are at 0).

`Wan22Config` is `wan.WanConfig` plus `boundary_ratio` (None: one transformer). The
pair converts from its two diffusers transformers with keys prefixed `transformer.` and
`transformer_2.` (`expert_weights`); each expert alone converts as the `wan` family.
"""
from __future__ import annotations

import dataclasses
import itertools
from typing import Iterable

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

from digen_jax.models.wan import transformer as wan
from digen_jax.models.conversion import ModelFamily, WeightRule

# diffusers' scheduler `num_train_timesteps`: the boundary timestep is boundary_ratio times it.
NUM_TRAIN_TIMESTEPS = 1000
EXPERTS = ("transformer", "transformer_2")  # high noise, low noise: the pipeline's component names


@dataclasses.dataclass(frozen=True)
class Wan22Config(wan.WanConfig):
    """`wan.WanConfig` plus the pipeline's `boundary_ratio`: None for one transformer (TI2V-5B),
    else two experts of this architecture, the high-noise one for timesteps >= boundary_ratio * 1000."""

    boundary_ratio: float | None = None
    # The spatial compression of the VAE whose latents the transformer takes (the pipeline's
    # `vae_scale_factor_spatial`); None: 16 for 48 latent channels (the Wan2.2 VAE), else 8
    # (the Wan2.1 VAE). Not part of the weights: it sizes the latents for a given video.
    vae_scale_factor_spatial: int | None = None

    def __post_init__(self):
        super().__post_init__()
        if self.vae_scale_factor_spatial is None:
            object.__setattr__(self, "vae_scale_factor_spatial", 16 if self.in_channels == 48 else 8)
        if self.boundary_ratio is not None and not 0.0 < self.boundary_ratio < 1.0:
            raise ValueError(f"boundary_ratio must be in (0, 1) (or None for one transformer), got {self.boundary_ratio}")

    @property
    def boundary_timestep(self) -> float | None:
        return None if self.boundary_ratio is None else self.boundary_ratio * NUM_TRAIN_TIMESTEPS


_A14B = dict(num_attention_heads=40, attention_head_dim=128, in_channels=16, out_channels=16, ffn_dim=13824, num_layers=40)
_TINY = dict(num_attention_heads=2, attention_head_dim=12, text_dim=32, freq_dim=32, ffn_dim=32, num_layers=2,
             rope_max_seq_len=32, dtype="float32")

VARIANTS = {
    # Wan-AI/Wan2.2-TI2V-5B-Diffusers transformer/config.json.
    "ti2v-5b": Wan22Config(num_attention_heads=24, attention_head_dim=128, in_channels=48, out_channels=48,
                           ffn_dim=14336, num_layers=30),
    # Wan-AI/Wan2.2-T2V-A14B-Diffusers: transformer and transformer_2 (the Wan2.1-14B architecture each),
    # model_index.json boundary_ratio 0.875.
    "t2v-a14b": Wan22Config(**_A14B, boundary_ratio=0.875),
    # Structurally identical to TI2V-5B (2 blocks; 8 latent channels, the tiny Wan2.2 VAE's).
    "tiny": Wan22Config(**_TINY, in_channels=8, out_channels=8, vae_scale_factor_spatial=16),
    # Structurally identical to T2V-A14B (two experts of 2 blocks; the tiny Wan2.1 VAE's 4 channels).
    "tiny-a14b": Wan22Config(**_TINY, in_channels=4, out_channels=4, boundary_ratio=0.875),
}


class WanExperts(nn.Module):
    """Two `wan.WanTransformer` experts routed by timestep; the same call as `wan.WanTransformer`."""

    cfg: Wan22Config

    def setup(self):
        self.transformer = wan.WanTransformer(self.cfg)  # high noise: t >= boundary
        self.transformer_2 = wan.WanTransformer(self.cfg)  # low noise

    def __call__(self, hidden_states, timestep, encoder_hidden_states, encoder_hidden_states_image=None,
                 attention_kwargs=None):
        rest = (encoder_hidden_states_image, attention_kwargs)
        t = timestep.reshape(timestep.shape[0], -1).max(axis=1)  # the step's timestep of each sample
        high = t >= self.cfg.boundary_timestep

        def run_high(m, x, ts, ctx):
            return m.transformer(x, ts, ctx, *rest)

        def run_low(m, x, ts, ctx):
            return m.transformer_2(x, ts, ctx, *rest)

        def run_both(m, x, ts, ctx):
            mask = high.reshape(-1, *([1] * (x.ndim - 1)))
            return jnp.where(mask, run_high(m, x, ts, ctx), run_low(m, x, ts, ctx))

        args = (self, hidden_states, timestep, encoder_hidden_states)
        if self.is_initializing():  # both experts' parameters
            return run_both(*args)
        low_or_both = lambda *a: nn.cond(jnp.all(~high), run_low, run_both, *a)  # noqa: E731
        return nn.cond(jnp.all(high), run_high, low_or_both, *args)


def make_module(cfg: Wan22Config) -> nn.Module:
    """The family's module for `cfg`: one transformer, or the pair of experts."""
    return wan.WanTransformer(cfg) if cfg.boundary_ratio is None else WanExperts(cfg)


def weight_rules(cfg: Wan22Config) -> list[WeightRule]:
    """`wan.weight_rules`, for the pair once per expert: parameters under the expert's name, keys
    prefixed with its diffusers component name (`transformer.`, `transformer_2.`)."""
    rules = wan.weight_rules(cfg)
    if cfg.boundary_ratio is None:
        return rules
    return [WeightRule((e,) + r.path, f"{e}.{r.key}", r.transform) for e in EXPERTS for r in rules]


def expert_weights(high: Iterable[tuple[str, np.ndarray]], low: Iterable[tuple[str, np.ndarray]]):
    """(key, array) pairs of the pair from its two experts' state dicts (`convert_weights` input)."""
    return itertools.chain(((f"{EXPERTS[0]}.{k}", a) for k, a in high), ((f"{EXPERTS[1]}.{k}", a) for k, a in low))


FAMILY = ModelFamily(
    name="wan22",
    diffusers_class="WanTransformer3DModel",
    config_cls=Wan22Config,
    module_cls=make_module,
    weight_rules=weight_rules,
    example_inputs=wan.example_inputs,
    variants=VARIANTS,
    denoiser_inputs=wan.denoiser_inputs,
)
