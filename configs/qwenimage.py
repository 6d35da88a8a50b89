r"""Qwen-Image (20B) Flow-GRPO, the reference setting: LoRA rank 64 on attention and MLP, 512x512,
10 sampling steps, true CFG 4.0 with norm rescale, SDE noise level 1.2 on a 2-step window in
[0, 5), 16 images per prompt, 32 prompts per update, clip range 1e-5, lr 3e-4.

Real run (converted weights and an embedding cache, see README "Model-zoo configs"):

    python launch/train.py --config=configs/qwenimage.py --workdir=/tmp/qwen \
        --config.model.checkpoint=/ckpt/qwen-image-jax --config.model.vae_checkpoint=/ckpt/qwen-image-vae-jax \
        --config.data.embedding_cache=/data/qwen-prompts

"""
import ml_collections

from configs import schema
from configs.sections import ATTENTION_MLP_TARGETS, tiny_overrides

def get_config(size: str = "full") -> ml_collections.ConfigDict:
    c = schema.config("zoo")  # what differs from configs/schema.py's defaults:
    c.model.family = "qwenimage"
    c.model.variant = "qwen-image"
    c.data.text_len = 128  # random embeddings' length (the cache's negative prompt is " ")

    c.sampling.num_steps = 10
    c.sampling.ladder = "qwen_image"  # dynamic shift on the packed token count, terminal sigma 0.02
    c.sampling.guidance = 0.0  # no embedded guidance
    c.sampling.cfg_scale = 4.0  # true CFG against the cache's negative prompt
    c.sampling.cfg_rescale = True
    c.sampling.noise_level = 1.2

    c.rl.prompts_per_iteration = 32
    c.rl.group_size = 16
    c.rl.step_selection = "window"  # SDE on (and training of) a 2-step window drawn in [0, 5) per iteration
    c.rl.clip_range = 1e-5
    c.rl.num_updates_per_batch = 1  # one update per 32 prompts x 16 samples
    c.rl.grad_chunk_size = 16
    c.rl.lora_targets = ATTENTION_MLP_TARGETS["qwenimage"]
    c.rl.ema = False

    # Colocated by default (any device count); on a multi-GPU host try e.g.
    # --config.runtime.mode=gap+tsp+tag+tcss --config.runtime.rollout_devices=2 --config.runtime.train_devices=2
    c.runtime.micro_batches = 8
    # LoRA: the frozen base fits one GPU and is replicated on every train device (data parallel, one
    # adapter-gradient all-reduce per micro-batch, no per-layer weight gathers). Full fine-tuning
    # of these sizes needs schema.FSDP_RULES (docs/design.md, "Shardings from logical names").
    return tiny_overrides(c, video=False, trained_steps=2) if size == "tiny" else c
