r"""Wan2.2 Flow-GRPO: the Wan2.1 recipe (configs/wan21.py: 480x832, 33 frames, 20 sampling steps,
the Wan SDE step on every step and steps 0-18 trained, 4 videos per prompt, two updates per batch,
KL 0.004, clip range 1e-3, lr 1e-4, LoRA 32/64 on attention and MLP, per-group std) on the two
Wan2.2 text-to-video models, each at its released flow shift and guidance:

* `:ti2v_5b` (default): Wan2.2-TI2V-5B, one 5.0 B transformer on the Wan2.2 VAE (48 latent
  channels, 16x spatial compression, so sides are multiples of 32), flow shift 5, CFG 5.
  Text-to-video: every token shares the step's timestep (the per-token timesteps the model
  takes matter only for image conditioning, which this run does not do).
* `:t2v_a14b`: Wan2.2-T2V-A14B, two 14.3 B experts of the Wan2.1-14B architecture on the Wan2.1
  VAE; steps with timestep >= 875 (boundary_ratio 0.875) run the high-noise expert, the rest the
  low-noise one, in rollout and training alike; LoRA adapts both. Flow shift 12; CFG 4 on the
  high-noise steps and 3 on the low-noise ones (`sampling.cfg_scale_2`), as released.

Real run (converted weights and an embedding cache, see README "Model-zoo configs"):

    python convert/diffusers_to_orbax.py --model_dir=/ckpt/Wan2.2-TI2V-5B-Diffusers/transformer --family=wan22 \
        --out=/ckpt/wan22-5b-jax
    python convert/diffusers_to_orbax.py --model_dir=/ckpt/Wan2.2-TI2V-5B-Diffusers/vae --out=/ckpt/wan22-vae-jax
    python launch/train.py --config=configs/wan22.py --workdir=/tmp/wan22 \
        --config.model.checkpoint=/ckpt/wan22-5b-jax --config.model.vae_checkpoint=/ckpt/wan22-vae-jax \
        --config.data.embedding_cache=/data/wan-prompts

T2V-A14B: convert both experts into one checkpoint (convert/diffusers_to_orbax.py --model_dir_2) and
use the Wan2.1 VAE (configs/wan21.py's).

Throughput run without weights: --config.model.random_init=True --config.data.random_embeddings=True.
CPU smoke runs of the tiny variants: --config=configs/wan22.py:tiny (TI2V structure, tiny Wan2.2
VAE), --config=configs/wan22.py:tiny_a14b (the pair of experts, tiny Wan2.1 VAE).
"""
import ml_collections

from configs.sections import (
    ATTENTION_MLP_TARGETS,
    algorithm_keys,
    runtime_section,
    sharding_section,
    tiny_overrides,
)

# The released models: transformer variant, sample_shift and guidance (Wan2.2's configs).
MODELS = {
    "ti2v_5b": dict(variant="ti2v-5b", flow_shift=5.0, cfg_scale=5.0),
    "t2v_a14b": dict(variant="t2v-a14b", flow_shift=12.0, cfg_scale=4.0, cfg_scale_2=3.0),
}
SIZES = ("ti2v_5b", "t2v_a14b", "tiny", "tiny_a14b")


def get_config(size: str = "ti2v_5b") -> ml_collections.ConfigDict:
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r} for configs/wan22.py; one of {SIZES}")
    released = MODELS["t2v_a14b" if size in ("t2v_a14b", "tiny_a14b") else "ti2v_5b"]
    c = ml_collections.ConfigDict()
    c.seed = 0

    c.model = ml_collections.ConfigDict()
    c.model.family = "wan22"
    c.model.variant = released["variant"]  # with random_init: a digen_jax.models.wan22.VARIANTS entry
    c.model.checkpoint = ""  # converted transformer dir (convert/diffusers_to_orbax.py; the A14B pair: --model_dir_2)
    c.model.vae_checkpoint = ""  # converted VAE dir (AutoencoderKLWan: Wan2.2's for TI2V-5B, Wan2.1's for A14B)
    c.model.random_init = False  # random transformer and VAE weights of `variant` (throughput runs)
    c.model.num_layers = 0  # with random_init: > 0 keeps that many blocks (short throughput runs)
    c.model.dtype = "bfloat16"
    c.model.param_dtype = "bfloat16"
    c.model.attention_impl = "auto"
    c.model.remat_policy = "full"  # training these sizes needs it; sampling has no backward to save for
    c.model.scan_layers = True  # False unrolls blocks: no per-layer weight copies, longer compiles
    # Numerics of the rollouts' forward: 'bf16' = the model's dtype, 'fp8' = e4m3 block matmuls (README).
    c.model.rollout_precision = "bf16"
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
    c.sampling.ladder = "wan"  # the UniPC flow-sigma ladder
    c.sampling.ladder_options = {"flow_shift": released["flow_shift"]}  # the released sample_shift
    c.sampling.guidance = 0.0  # no embedded guidance
    c.sampling.cfg_scale = released["cfg_scale"]  # true CFG against the cache's negative prompt
    # A14B: the low-noise expert's scale (diffusers' guidance_scale_2); None: cfg_scale throughout.
    c.sampling.cfg_scale_2 = ml_collections.config_dict.placeholder(float)
    c.sampling.cfg_scale_2 = released.get("cfg_scale_2")
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
    c.rl.lora_targets = ATTENTION_MLP_TARGETS["wan22"]  # regexes searched in each kernel's path (both A14B experts)
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
    if size in ("tiny", "tiny_a14b"):
        c = tiny_overrides(c, video=True, trained_steps=3)
        c.model.variant = size.replace("_", "-")
    return c
