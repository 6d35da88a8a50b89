r"""Wan2.1-T2V-14B Flow-GRPO: 480x832, 33 frames, 20 sampling steps, CFG 4.5, the Wan SDE step
(g = sigma_1 * sigma, no noise-level knob) on every step and steps 0-18 trained, 4 videos per
prompt, two updates per batch, KL 0.004 to the base (the true KL), clip range 1e-3, lr 1e-4,
LoRA 32/64 on attention and MLP, per-group std. (The Flow-GRPO Wan recipe, on the 14B model at
480p; rewards average over every 4th decoded frame.)

Real run (converted weights and an embedding cache, see README "Model-zoo configs"):

    python launch/train.py --config=configs/wan21.py --workdir=/tmp/wan \
        --config.model.checkpoint=/ckpt/wan21-14b-jax --config.model.vae_checkpoint=/ckpt/wan21-vae-jax \
        --config.data.embedding_cache=/data/wan-prompts

Throughput run without weights: --config.model.random_init=True --config.data.random_embeddings=True.
CPU smoke run of the tiny variant: --config=configs/wan21.py:tiny

81 frames (21 latent frames; `LONG_SIZES`), remat 'full', 2 training units per gradient chunk:

* `:81f_480p`, 480x832: 32,760 tokens per video, twice that per unit with true CFG. Sets
  `runtime.seq_parallel=2`: about 18 GB of activations per unit and device (block inputs kept
  for the backward pass, 13.4 GB, plus one block's recomputation), 36 GB per chunk next to the
  28.6 GB of bf16 weights. Without sequence parallelism one unit per chunk fits
  (`--config.rl.micro_batch_size=1`, about 36 GB).
* `:81f_720p`, 720x1280: 75,600 tokens per video, about 84 GB of activations per unit on one
  device. Sets `runtime.seq_parallel=4` (about 42 GB per chunk and device; 8 gives 21 GB).

With more sequence groups than one, raise `rl.micro_batch_size` by their number. The Wan VAE
decodes frame by frame with causal caches at any length (docs/models.md section 4).
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
LONG_SIZES = {
    "81f_480p": dict(num_frames=81, height=480, width=832, micro_batch_size=2, seq_parallel=2),
    "81f_720p": dict(num_frames=81, height=720, width=1280, micro_batch_size=2, seq_parallel=4),
}
SIZES = ("full", "tiny", *LONG_SIZES)


def get_config(size: str = "full") -> ml_collections.ConfigDict:
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r} for configs/wan21.py; one of {SIZES}")
    c = ml_collections.ConfigDict()
    c.seed = 0

    c.model = ml_collections.ConfigDict()
    c.model.family = "wan"
    c.model.variant = "t2v-14b"  # with random_init: a digen_jax.models.wan.VARIANTS entry ('tiny' for CPU)
    c.model.checkpoint = ""  # converted transformer dir (convert/diffusers_to_orbax.py)
    c.model.vae_checkpoint = ""  # converted VAE dir (AutoencoderKLWan)
    c.model.random_init = False  # random transformer and VAE weights of `variant` (throughput runs)
    c.model.num_layers = 0  # with random_init: > 0 keeps that many blocks (short throughput runs)
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
    c.data.embedding_cache = ""  # convert/encode_prompts.py --family=wan output (with the negative "")
    c.data.random_embeddings = False  # random prompt embeddings of the model's shapes instead
    c.data.text_len = 512  # random embeddings: umT5 length (Wan pads to 512)
    c.data.num_prompts = 1024  # random embeddings: distinct prompts

    c.sampling = ml_collections.ConfigDict()
    c.sampling.height = 480
    c.sampling.width = 832
    c.sampling.num_frames = 33  # 4k+1
    c.sampling.num_steps = 20
    c.sampling.ladder = "wan"  # the UniPC flow-sigma ladder, flow shift 3
    c.sampling.ladder_options = {}  # keyword overrides of the ladder function
    c.sampling.guidance = 0.0  # no embedded guidance
    c.sampling.cfg_scale = 4.5  # true CFG against the cache's negative prompt
    c.sampling.cfg_rescale = False
    c.sampling.sde_type = "wan"
    c.sampling.noise_level = 1.0  # only zero vs non-zero matters for the Wan step

    c.rl = ml_collections.ConfigDict()
    c.rl.prompts_per_iteration = 16
    c.rl.group_size = 4
    c.rl.step_selection = "fraction"  # SDE on every step; steps 0-18 of 20 trained
    c.rl.timestep_fraction = 0.99
    c.rl.sde_window_size = 2
    c.rl.sde_window_range = (0, 5)
    c.rl.window_shift_every = 25
    c.rl.std_mode = "group"
    c.rl.mean_mode = "group"
    c.rl.std_ddof = 0
    c.rl.std_eps = 1e-4
    c.rl.adv_clip = 5.0
    c.rl.clip_range = 1e-3
    c.rl.policy_loss = "ppo"
    c.rl.kl_beta = 0.004
    c.rl.num_updates_per_batch = 2  # the second update of a batch is off-policy
    c.rl.micro_batch_size = 8  # training units (sample, step) per gradient micro-batch
    # Decoupled PPO (proximal policy) for off-policy updates; None: on with model.rollout_precision='fp8'
    c.rl.decoupled = ml_collections.config_dict.placeholder(bool)
    c.rl.is_cap = ml_collections.config_dict.placeholder(float)  # None: untruncated (2 for FP8 rollouts, README)
    c.rl.onpolicy_anchor = "trainer"
    c.rl.learning_rate = 1e-4
    c.rl.weight_decay = 1e-4
    c.rl.max_grad_norm = 1.0
    c.rl.lora_rank = 32
    c.rl.lora_alpha = 64.0
    # Factored adapters in rollout: while a sync lands the rollout role holds two weight versions,
    # and two merged copies next to the frozen base do not fit an 80 GB card.
    c.rl.lora_merge_for_sampling = False
    c.rl.lora_targets = ATTENTION_MLP_TARGETS["wan"]  # regexes searched in each kernel's path
    c.rl.ema = True
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
        return tiny_overrides(c, video=True, trained_steps=3)
    return long_video_overrides(c, **LONG_SIZES[size]) if size in LONG_SIZES else c
