r"""HunyuanVideo (13B) GRPO after DanceGRPO's recipe: 480x848, 33 frames, 16 sampling steps on
its shift-5 ladder, embedded guidance 6.0, the DanceGRPO step with eta 0.25, a random 60% of
steps 0..14 trained per sample, 24 videos per prompt, per-group std (ddof 1, eps 1e-8), clip range
1e-4. DanceGRPO fine-tunes all weights at lr 1e-5; here LoRA 64/128 on attention and MLP at the
Flow-GRPO LoRA lr 3e-4. Rewards average over every 4th decoded frame.

Real run (converted weights and an embedding cache, see README "Model-zoo configs"):

    python launch/train.py --config=configs/hunyuanvideo.py --workdir=/tmp/hunyuan \
        --config.model.checkpoint=/ckpt/hunyuan-video-jax --config.model.vae_checkpoint=/ckpt/hunyuan-vae-jax \
        --config.data.embedding_cache=/data/hunyuan-prompts

`:81f`: 81 frames (21 latent frames) at 480x848 (`LONG_SIZES`), remat 'full', 4 training
units per gradient chunk as at 33 frames. 33,390 video tokens (plus 256 text tokens) per unit,
about 17 GB of activations per unit on one device (block inputs kept for the backward pass,
12.4 GB, plus one block's recomputation). Sets `runtime.seq_parallel=2`: about 33 GB per
chunk and device next to the 25.6 GB of bf16 weights. Without sequence parallelism two units
per chunk fit (`--config.rl.grad_chunk_size=2`). With more sequence groups than one, raise
`rl.grad_chunk_size` by their number. The VAE decodes as diffusers' default does: 7 temporal
tiles of 5 latent frames (17 frames), 3 apart, blended over 4 frames, no spatial tiles
(`models/hunyuan_video/vae.py` `DEFAULT_TILING`, docs/models.md section 4); its mid attention scores of
one tile (31,800 pixels) take about 4 GB in fp32.
"""
import ml_collections

from configs import schema
from configs.sections import ATTENTION_MLP_TARGETS, long_video_overrides, tiny_overrides

# Clip-length sizes (module docstring), each with the runtime.seq_parallel it sets.
LONG_SIZES = {"81f": dict(num_frames=81, height=480, width=848, grad_chunk_size=4, seq_parallel=2)}
SIZES = ("full", "tiny", *LONG_SIZES)

def get_config(size: str = "full") -> ml_collections.ConfigDict:
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r} for configs/hunyuanvideo.py; one of {SIZES}")
    c = schema.config("zoo", "video", "single_stream")  # what differs from configs/schema.py's defaults:
    c.model.family = "hunyuan_video"
    c.model.variant = "t2v"
    c.model.vae_decode_batch = 1
    c.data.text_len = 256  # random embeddings: Llama length (HunyuanVideo pads to 256)

    c.sampling.height, c.sampling.width = 480, 848
    c.sampling.num_steps = 16
    c.sampling.ladder = "dancegrpo"  # static shift of linspace(1, 0, N + 1)
    c.sampling.ladder_options = {"shift": 5.0}  # DanceGRPO's HunyuanVideo shift
    c.sampling.guidance = 6.0  # embedded (distilled) guidance; no true CFG: one forward per step
    c.sampling.sde_type = "dance"
    c.sampling.noise_level = 0.25  # eta

    c.rl.prompts_per_iteration = 4
    c.rl.step_selection = "random"  # per sample, a random int(0.6 * 15) of steps 0..14
    c.rl.timestep_fraction = 0.6
    c.rl.std_mode = "group"
    c.rl.std_ddof, c.rl.std_eps = 1, 1e-8  # DanceGRPO's torch.std and epsilon
    c.rl.num_updates_per_batch = 1
    c.rl.grad_chunk_size = 4
    # Attention + MLP of the double and single blocks, not the text refiner's.
    c.rl.lora_targets = ATTENTION_MLP_TARGETS["hunyuan_video"]
    c.rl.ema = False

    c.reward.frame_stride = 4  # reward = mean over frames 0, 4, ..., 32
    c.train.image_every = 0  # a preview decodes the videos again
    # Colocated by default; LoRA's frozen base is replicated on every train device (full
    # fine-tuning of these sizes needs schema.FSDP_RULES, docs/design.md).
    if size == "tiny":
        return tiny_overrides(c, video=True, trained_steps=1)
    return long_video_overrides(c, **LONG_SIZES[size]) if size in LONG_SIZES else c
