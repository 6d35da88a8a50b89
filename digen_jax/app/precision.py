"""The rollout role's numerics (`model.rollout_precision`, models/fp8.py) and the off-policy
correction they imply for Flow-GRPO (what a config may pair with FP8 rollouts is checked by
`validation.validate_rollout_precision`).

An FP8 rollout samples from a policy slightly different from the bf16 one the trainer
differentiates, so every sample is off-policy by the numerics. Flow-GRPO runs with
`rollout_precision='fp8'` therefore take the decoupled loss with truncated importance sampling
unless the config says otherwise: an unset `rl.decoupled` (None) means True there (False
everywhere else) and an unset `rl.is_cap` means `FP8_IS_CAP`. The ratio stays anchored on the
trainer's own log-prob at version lag 0 (`rl.onpolicy_anchor='trainer'`), and the importance
weight `min(exp(logp_bf16 - logp_fp8), cap)` carries the rollout's numerics into the loss;
`is_weight_mean` and `is_truncated_frac` record it. DiffusionNFT has no likelihood: FP8 enters its
loss only through the samples.

`model.lora_base_precision='fp8'` trains LoRA through the same e4m3 base the rollouts sample
with (one frozen copy, no bf16 base). The trainer and the rollouts then run the same layers, but
not the same batches: in bf16 a value's last bit depends on its batch, and the activations'
rounding to e4m3 (3 mantissa bits) turns such a bit into a step of 2^-4 where it flips a
rounding. Their log-probs differ as much as those of FP8 rollouts over a bf16 base
(docs/fp8_rollouts.md), so the same decoupled default applies.
"""
from __future__ import annotations

import ml_collections


# The truncation of the importance weights of FP8-rollout GRPO runs that leave `rl.is_cap` unset.
FP8_IS_CAP = 2.0


def rollout_precision(config: ml_collections.ConfigDict) -> str:
    return config.model.get("rollout_precision", "bf16")


def lora_base_precision(config: ml_collections.ConfigDict) -> str:
    return config.model.get("lora_base_precision", "bf16")


def rollout_precision_note(config: ml_collections.ConfigDict) -> str:
    """What `model.rollout_precision` resolves to next to `model.dtype`: 'bf16' names no dtype of
    its own but the model's unchanged numerics, so model.dtype is what the rollouts compute in."""
    dtype = config.model.get("dtype", "bfloat16")
    if lora_base_precision(config) == "fp8":
        return "rollouts and LoRA training through one e4m3 base (attention projections and MLPs), " \
               f"the rest in model.dtype={dtype!r}"
    if rollout_precision(config) == "fp8":
        return f"rollout attention projections and MLPs in FP8 e4m3, the rest in model.dtype={dtype!r}; training in {dtype!r}"
    return f"'bf16' means the model's own dtype: rollouts and training compute in model.dtype={dtype!r}"


def decoupled_loss(config: ml_collections.ConfigDict) -> tuple[bool, float | None]:
    """(decoupled, is_cap) of the run: `rl.decoupled` / `rl.is_cap` as set, their unset (None)
    values resolved as the module docstring says."""
    rl = config.rl
    fp8_grpo = rollout_precision(config) == "fp8" and rl.get("algorithm", "grpo") == "grpo" and rl.policy_loss == "ppo"
    decoupled = fp8_grpo if rl.get("decoupled") is None else bool(rl.decoupled)
    is_cap = rl.is_cap
    if is_cap is None and decoupled and fp8_grpo:
        is_cap = FP8_IS_CAP
    return decoupled, is_cap
