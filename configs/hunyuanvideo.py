r"""HunyuanVideo (13B) GRPO after DanceGRPO's recipe: 480x848, 33 frames, 16 sampling steps on
its shift-5 ladder, embedded guidance 6.0, the DanceGRPO step with eta 0.25, a random 60% of
steps 0..14 trained per sample, 24 videos per prompt, per-group std (ddof 1, eps 1e-8), clip range
1e-4. DanceGRPO fine-tunes all weights at lr 1e-5; here LoRA 64/128 on attention and MLP at the
Flow-GRPO LoRA lr 3e-4. Rewards average over every 4th decoded frame.

Real run (converted weights and an embedding cache, see README "Model-zoo configs"):

    python launch/train.py --config=configs/hunyuanvideo.py --workdir=/tmp/hunyuan \
        --config.model.checkpoint=/ckpt/hunyuan-video-jax --config.model.vae_checkpoint=/ckpt/hunyuan-vae-jax \
        --config.data.embedding_cache=/data/hunyuan-prompts

Throughput run without weights: --config.model.random_init=True --config.data.random_embeddings=True.
CPU smoke run of the tiny variant: --config=configs/hunyuanvideo.py:tiny

`:81f`: 81 frames (21 latent frames) at 480x848 (`LONG_SIZES`), remat 'full', 4 training
units per gradient chunk as at 33 frames. 33,390 video tokens (plus 256 text tokens) per unit,
about 17 GB of activations per unit on one device (block inputs kept for the backward pass,
12.4 GB, plus one block's recomputation). Sets `runtime.seq_parallel=2`: about 33 GB per
chunk and device next to the 25.6 GB of bf16 weights. Without sequence parallelism two units
per chunk fit (`--config.rl.micro_batch_size=2`). With more sequence groups than one, raise
`rl.micro_batch_size` by their number. The VAE decodes as diffusers' default does: 7 temporal
tiles of 5 latent frames (17 frames), 3 apart, blended over 4 frames, no spatial tiles
(`vae_hunyuan_video.DEFAULT_TILING`, docs/models.md section 4); its mid attention scores of
one tile (31,800 pixels) take about 4 GB in fp32.
"""
import ml_collections

from configs.sections import (
    ATTENTION_MLP_TARGETS,
    algorithm_keys,
    long_video_overrides,
    runtime_section,
    sharding_section,
    tiny_overrides,
)

# Clip-length sizes (module docstring), each with the runtime.seq_parallel it sets.
LONG_SIZES = {"81f": dict(num_frames=81, height=480, width=848, micro_batch_size=4, seq_parallel=2)}
SIZES = ("full", "tiny", *LONG_SIZES)


def get_config(size: str = "full") -> ml_collections.ConfigDict:
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r} for configs/hunyuanvideo.py; one of {SIZES}")
    c = ml_collections.ConfigDict()
    c.seed = 0

    c.model = ml_collections.ConfigDict()
    c.model.family = "hunyuan_video"
    c.model.variant = "t2v"  # with random_init: a digen_jax.models.hunyuan_video.VARIANTS entry ('tiny' for CPU)
    c.model.checkpoint = ""  # converted transformer dir (convert/diffusers_to_orbax.py)
    c.model.vae_checkpoint = ""  # converted VAE dir (AutoencoderKLHunyuanVideo)
    c.model.random_init = False  # random transformer and VAE weights of `variant` (throughput runs)
    c.model.num_layers = 0  # with random_init: > 0 keeps that many blocks (short throughput runs)
    c.model.num_single_layers = 0  # likewise for the single-stream blocks
    c.model.dtype = "bfloat16"
    c.model.param_dtype = "bfloat16"
    c.model.attention_impl = "auto"
    c.model.remat_policy = "full"  # training these sizes needs it; sampling has no backward to save for
    c.model.scan_layers = True  # False unrolls blocks: no per-layer weight copies, longer compiles
    # Numerics of the rollouts' forward: 'bf16' = the model's dtype, 'fp8' = e4m3 block matmuls (README).
    c.model.rollout_precision = "bf16"
    # LoRA's frozen base in training and every rollout: 'fp8' holds only its e4m3 form, one copy
    # (needs rollout_precision='fp8'); 'bf16' trains on the model's dtype (docs/fp8_rollouts.md).
    c.model.lora_base_precision = "bf16"
    c.model.vae_decode_batch = 1  # samples per VAE decode call

    c.data = ml_collections.ConfigDict()
    c.data.embedding_cache = ""  # convert/encode_prompts.py --family=hunyuan_video output
    c.data.random_embeddings = False  # random prompt embeddings of the model's shapes instead
    c.data.text_len = 256  # random embeddings: Llama length (HunyuanVideo pads to 256)
    c.data.num_prompts = 1024  # random embeddings: distinct prompts

    c.sampling = ml_collections.ConfigDict()
    c.sampling.height = 480
    c.sampling.width = 848
    c.sampling.num_frames = 33  # 4k+1
    c.sampling.num_steps = 16
    c.sampling.ladder = "dancegrpo"  # static shift of linspace(1, 0, N + 1)
    c.sampling.ladder_options = {"shift": 5.0}  # DanceGRPO's HunyuanVideo shift
    c.sampling.guidance = 6.0  # embedded (distilled) guidance
    c.sampling.cfg_scale = 1.0  # no true CFG: one forward per step
    c.sampling.cfg_rescale = False
    c.sampling.sde_type = "dance"
    c.sampling.noise_level = 0.25  # eta

    c.rl = ml_collections.ConfigDict()
    c.rl.prompts_per_iteration = 4
    c.rl.group_size = 24
    c.rl.step_selection = "random"  # per sample, a random int(0.6 * 15) of steps 0..14
    c.rl.timestep_fraction = 0.6
    c.rl.sde_window_size = 2
    c.rl.sde_window_range = (0, 5)
    c.rl.window_shift_every = 25
    c.rl.std_mode = "group"
    c.rl.mean_mode = "group"
    c.rl.std_ddof = 1
    c.rl.std_eps = 1e-8
    c.rl.adv_clip = 5.0
    c.rl.clip_range = 1e-4
    c.rl.policy_loss = "ppo"
    c.rl.kl_beta = 0.0
    c.rl.num_updates_per_batch = 1
    c.rl.micro_batch_size = 4  # training units (sample, step) per gradient micro-batch
    # Decoupled PPO (proximal policy) for off-policy updates; None: on with model.rollout_precision='fp8'
    c.rl.decoupled = ml_collections.config_dict.placeholder(bool)
    c.rl.is_cap = ml_collections.config_dict.placeholder(float)  # None: untruncated (2 for FP8 rollouts, README)
    c.rl.onpolicy_anchor = "trainer"
    c.rl.learning_rate = 3e-4
    c.rl.weight_decay = 1e-4
    c.rl.max_grad_norm = 1.0
    c.rl.lora_rank = 64
    c.rl.lora_alpha = 128.0
    # Factored adapters in rollout: while a sync lands the rollout role holds two weight versions,
    # and two merged copies next to the frozen base do not fit an 80 GB card.
    c.rl.lora_merge_for_sampling = False
    # Attention + MLP of the double and single blocks, not the text refiner's.
    c.rl.lora_targets = ATTENTION_MLP_TARGETS["hunyuan_video"]  # regexes searched in each kernel's path
    c.rl.ema = False
    c.rl.ema_decay = ml_collections.config_dict.placeholder(float)
    c.rl.ema_every = 8
    c.rl.max_nonfinite_in_row = 3
    c.rl.max_update_ratio = 1.0
    c.rl.optimizer_state_dtype = "param"  # Adam moments: "param" (the weights' dtype) | "float32"
    c.rl.update(algorithm_keys())  # rl.algorithm and the DiffusionNFT keys (configs/sections.py)

    c.reward = ml_collections.ConfigDict()
    c.reward.weights = {"jpeg_compressibility": 1.0}  # a cheap host reward; any registered reward works
    c.reward.frame_stride = 4  # reward = mean over frames 0, 4, ..., 32

    c.train = ml_collections.ConfigDict()
    c.train.iterations = 300
    c.train.eval_every = 0
    c.train.eval_prompts = 16
    c.train.image_every = 0  # a preview decodes the videos again
    c.train.checkpoint_every = 20
    c.train.keep_checkpoints = 2
    c.train.on_corrupt_checkpoint = "fallback"  # an unreadable latest checkpoint: "fallback" to the one before, or "stop"
    c.train.init_from = ""  # a workdir: start from its latest checkpoint's trainable weights (fresh optimizer, iteration 0)
    # True: move all the workdir holds to WORKDIR/previous_runs/N/, start at iteration 0 (each run given it starts over)
    c.train.start_over = False

    # Colocated by default (any device count); on a multi-GPU host try e.g.
    # --config.runtime.mode=gap+tsp+tag+tcss --config.runtime.rollout_devices=2 --config.runtime.train_devices=2
    c.runtime = runtime_section(micro_batches=4)
    # LoRA: the frozen base fits one GPU and is replicated on every train device (data parallel, one
    # adapter-gradient all-reduce per micro-batch, no per-layer weight gathers). Full fine-tuning
    # of these sizes needs sharding_section(fsdp=True) (docs/design.md, "Shardings from logical names").
    c.sharding = sharding_section(fsdp=False)
    if size == "tiny":
        return tiny_overrides(c, video=True, trained_steps=1)
    return long_video_overrides(c, **LONG_SIZES[size]) if size in LONG_SIZES else c
