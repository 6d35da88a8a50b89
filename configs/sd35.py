r"""Stable Diffusion 3.5 Medium (2.2B) Flow-GRPO, the reference recipe (yifan123/flow_grpo
config/grpo.py `geneval_sd3` / `general_ocr_sd3`, scripts/train_sd3.py): 512x512, 10 sampling
steps with SDE noise level 0.7 on every step and the first 9 trained, true CFG 4.5 against the
empty prompt (in rollouts and in the trainer's recomputed velocity), 24 images per prompt x 48
prompts, two optimizer updates per batch (the second off-policy), KL weight 0.04, clip range
1e-4, lr 3e-4, LoRA 32/64, EMA on (decay 0.9 every 8 steps), per-prompt advantages with the
global std. The reference evaluates with 40 ODE steps; here evaluation uses the training ladder.

LoRA targets: the reference adapts the joint attention's projections of every block (peft
`attn.{to_q,to_k,to_v,to_out.0,add_q_proj,add_k_proj,add_v_proj,to_add_out}`), not the MMDiT-X
blocks' second attention `attn2` nor the MLPs; `sections.ATTENTION_MLP_TARGETS["sd3"]` is the
wider attention-and-MLP set the other zoo configs use. The last block's `add_q_proj` is left
out: that block discards its text outputs, so an adapter there never gets a gradient.

Real run (converted weights and an embedding cache; Flow-GRPO encodes T5 to 128 tokens):

    python convert/diffusers_to_orbax.py --model_dir=/ckpt/stable-diffusion-3.5-medium/transformer \
        --out=/ckpt/sd35m-jax
    python convert/diffusers_to_orbax.py --model_dir=/ckpt/stable-diffusion-3.5-medium/vae --out=/ckpt/sd35m-vae-jax
    python convert/encode_prompts.py --family=sd3 --prompts=prompts.txt --max_sequence_length=128 \
        --encoder_dir=/ckpt/stable-diffusion-3.5-medium --out=/data/sd35-prompts
    python launch/train.py --config=configs/sd35.py --workdir=/tmp/sd35 \
        --config.model.checkpoint=/ckpt/sd35m-jax --config.model.vae_checkpoint=/ckpt/sd35m-vae-jax \
        --config.data.embedding_cache=/data/sd35-prompts

"""
import ml_collections

from configs import schema
from configs.sections import tiny_overrides

# The reference's peft targets: the joint attention (`attn`) of every block, both streams
# (in the last block, which drops its text outputs, the text keys and values only).
JOINT_ATTENTION_TARGETS = (r"(dual|joint)_blocks/(\d+/)?attn/(to_|add_)", r"final_block/(\d+/)?attn/(to_|add_[kv])")

def get_config(size: str = "full") -> ml_collections.ConfigDict:
    c = schema.config("zoo")  # what differs from configs/schema.py's defaults:
    c.model.family = "sd3"
    c.model.variant = "sd3.5-medium"
    c.data.text_len = 77 + 128  # random embeddings: CLIP's 77 positions, then T5's 128 (the reference's)

    c.sampling.num_steps = 10
    c.sampling.ladder = "sd3"  # FlowMatchEuler, static shift 3
    c.sampling.guidance = 0.0  # no embedded guidance
    c.sampling.cfg_scale = 4.5  # true CFG against the cache's negative prompt ""
    c.sampling.noise_level = 0.7  # SDE on every step; steps 0-8 of 10 trained

    c.rl.kl_beta = 0.04  # the GenEval and OCR runs' (PickScore: 0.01)
    c.rl.lora_rank = 32
    c.rl.lora_alpha = 64.0
    c.rl.lora_targets = JOINT_ATTENTION_TARGETS
    c.rl.ema_decay = 0.9
    # The reference trains on GenEval, OCR or PickScore; the schema's cheap host reward here.

    # Colocated by default; on two GPUs try --config.runtime.mode=gap+tsp+tag+tcss
    # --config.runtime.rollout_devices=1 --config.runtime.train_devices=1. LoRA on a 2.2B model:
    # the frozen base is replicated on every train device (data parallel).
    return tiny_overrides(c, video=False, trained_steps=3) if size == "tiny" else c
