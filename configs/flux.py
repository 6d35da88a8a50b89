r"""FLUX.1-dev (12B) Flow-GRPO, the reference recipe: 512x512, 6 sampling steps, embedded guidance
3.5, SDE noise level 0.9 on every step and the first 5 trained, 24 images per prompt x 48 prompts,
two optimizer updates per batch (the second off-policy), clip range 1e-4, lr 3e-4, LoRA 64/128 on
attention and MLP, EMA on.

Real run (converted weights and an embedding cache, see README "Model-zoo configs"):

    python launch/train.py --config=configs/flux.py --workdir=/tmp/flux \
        --config.model.checkpoint=/ckpt/flux-dev-jax --config.model.vae_checkpoint=/ckpt/flux-vae-jax \
        --config.data.embedding_cache=/data/flux-prompts

"""
import ml_collections

from configs import schema
from configs.sections import ATTENTION_MLP_TARGETS, tiny_overrides

def get_config(size: str = "full") -> ml_collections.ConfigDict:
    # configs/schema.py's defaults are FLUX.1-dev's Flow-GRPO recipe; only the targets differ.
    c = schema.config("zoo", "single_stream")
    c.rl.lora_targets = ATTENTION_MLP_TARGETS["flux"]
    # Colocated by default; LoRA's frozen base is replicated on every train device (full
    # fine-tuning of these sizes needs schema.FSDP_RULES, docs/design.md).
    return tiny_overrides(c, video=False, trained_steps=3) if size == "tiny" else c
