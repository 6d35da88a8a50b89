r"""Wan2.1-T2V-14B Flow-GRPO: 480x832, 33 frames, 20 sampling steps, CFG 4.5, the Wan SDE step
(g = sigma_1 * sigma, no noise-level knob) on every step and steps 0-18 trained, 4 videos per
prompt, two updates per batch, KL 0.004 to the base (the true KL), clip range 1e-3, lr 1e-4,
LoRA 32/64 on attention and MLP, per-group std. (The Flow-GRPO Wan recipe, on the 14B model at
480p; rewards average over every 4th decoded frame.)

Real run (converted weights and an embedding cache, see README "Model-zoo configs"):

    python launch/train.py --config=configs/wan21.py --workdir=/tmp/wan \
        --config.model.checkpoint=/ckpt/wan21-14b-jax --config.model.vae_checkpoint=/ckpt/wan21-vae-jax \
        --config.data.embedding_cache=/data/wan-prompts

81 frames (21 latent frames; `LONG_SIZES`), remat 'full', 2 training units per gradient chunk:

* `:81f_480p`, 480x832: 32,760 tokens per video, twice that per unit with true CFG. Sets
  `runtime.seq_parallel=2`: about 18 GB of activations per unit and device (block inputs kept
  for the backward pass, 13.4 GB, plus one block's recomputation), 36 GB per chunk next to the
  28.6 GB of bf16 weights. Without sequence parallelism one unit per chunk fits
  (`--config.rl.grad_chunk_size=1`, about 36 GB).
* `:81f_720p`, 720x1280: 75,600 tokens per video, about 84 GB of activations per unit on one
  device. Sets `runtime.seq_parallel=4` (about 42 GB per chunk and device; 8 gives 21 GB).

With more sequence groups than one, raise `rl.grad_chunk_size` by their number. The Wan VAE
decodes frame by frame with causal caches at any length (docs/models.md section 4).
"""
import ml_collections

from configs import schema
from configs.sections import ATTENTION_MLP_TARGETS, long_video_overrides, tiny_overrides

# Clip-length sizes (module docstring), each with the runtime.seq_parallel it sets.
LONG_SIZES = {
    "81f_480p": dict(num_frames=81, height=480, width=832, grad_chunk_size=2, seq_parallel=2),
    "81f_720p": dict(num_frames=81, height=720, width=1280, grad_chunk_size=2, seq_parallel=4),
}
SIZES = ("full", "tiny", *LONG_SIZES)

def get_config(size: str = "full") -> ml_collections.ConfigDict:
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r} for configs/wan21.py; one of {SIZES}")
    c = schema.config("zoo", "video")  # what differs from configs/schema.py's defaults:
    c.model.family = "wan"
    c.model.variant = "t2v-14b"
    c.model.vae_decode_batch = 1

    c.sampling.height, c.sampling.width = 480, 832
    c.sampling.num_steps = 20
    c.sampling.ladder = "wan"
    c.sampling.guidance = 0.0  # no embedded guidance
    c.sampling.cfg_scale = 4.5  # true CFG against the cache's negative prompt
    c.sampling.sde_type = "wan"  # g = sigma_1 * sigma: no noise-level knob
    c.sampling.noise_level = 1.0

    c.rl.prompts_per_iteration = 16
    c.rl.group_size = 4
    c.rl.std_mode = "group"
    c.rl.clip_range = 1e-3
    c.rl.kl_beta = 0.004  # the true KL to the base
    c.rl.grad_chunk_size = 8
    c.rl.learning_rate = 1e-4
    c.rl.lora_rank, c.rl.lora_alpha = 32, 64.0
    c.rl.lora_targets = ATTENTION_MLP_TARGETS["wan"]

    c.reward.frame_stride = 4  # reward = mean over frames 0, 4, ..., 32
    c.train.image_every = 0  # a preview decodes the videos again
    # Colocated by default; LoRA's frozen base is replicated on every train device (full
    # fine-tuning of these sizes needs schema.FSDP_RULES, docs/design.md).
    if size == "tiny":
        return tiny_overrides(c, video=True, trained_steps=3)
    return long_video_overrides(c, **LONG_SIZES[size]) if size in LONG_SIZES else c
