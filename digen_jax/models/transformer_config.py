"""What every family's transformer config shares: the execution policy (fields that are not part
of the weights: converted checkpoints neither store nor read them) and the widths and dtype
keywords derived from the architecture.

A family's config subclasses `TransformerConfig` with its diffusers architecture fields and
calls `super().__post_init__()` after its own checks.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from digen_jax.models import stacking


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """The execution policy; subclasses add the architecture (`num_attention_heads`,
    `attention_head_dim` and the rest of the diffusers config fields)."""

    dtype: str = "bfloat16"  # compute dtype of matmuls and the residual stream
    param_dtype: str = "float32"  # master weights
    attention_impl: str = "auto"  # 'auto' | 'cudnn' | 'xla' | 'splash'
    remat_policy: str = "none"  # a key of stacking.REMAT_POLICIES
    scan_layers: bool = True  # False: blocks unrolled (stacking.scan_blocks): slower compile, no weight slicing

    def __post_init__(self):
        if self.remat_policy not in stacking.REMAT_POLICIES:
            raise ValueError(f"remat_policy must be one of {sorted(stacking.REMAT_POLICIES)}, got {self.remat_policy!r}")

    @property
    def inner_dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @property
    def kw(self) -> dict:
        return dict(dtype=jnp.dtype(self.dtype), param_dtype=jnp.dtype(self.param_dtype))


# The policy fields, which a converted checkpoint's config leaves out.
POLICY_FIELDS = tuple(f.name for f in dataclasses.fields(TransformerConfig))
