r"""Qwen-Image (20B) Flow-GRPO, the reference setting: LoRA rank 64 on attention and MLP, 512x512,
10 sampling steps, true CFG 4.0 with norm rescale, SDE noise level 1.2 on a 2-step window in
[0, 5), 16 images per prompt, 32 prompts per update, clip range 1e-5, lr 3e-4.

Real run (converted weights and an embedding cache, see README "Model-zoo configs"):

    python launch/train.py --config=configs/qwenimage.py --workdir=/tmp/qwen \
        --config.model.checkpoint=/ckpt/qwen-image-jax --config.model.vae_checkpoint=/ckpt/qwen-image-vae-jax \
        --config.data.embedding_cache=/data/qwen-prompts

Throughput run without weights: --config.model.random_init=True --config.data.random_embeddings=True.
CPU smoke run of the tiny variant: --config=configs/qwenimage.py:tiny
"""
import ml_collections

from configs.sections import ATTENTION_MLP_TARGETS, algorithm_keys, runtime_section, sharding_section, tiny_overrides


def get_config(size: str = "full") -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.seed = 0

    c.model = ml_collections.ConfigDict()
    c.model.family = "qwenimage"
    c.model.variant = "qwen-image"  # with random_init: a digen_jax.models.qwenimage.VARIANTS entry ('tiny' for CPU)
    c.model.checkpoint = ""  # converted transformer dir (convert/diffusers_to_orbax.py)
    c.model.vae_checkpoint = ""  # converted VAE dir (AutoencoderKLQwenImage)
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
    c.model.vae_decode_batch = 8  # samples per VAE decode call

    c.data = ml_collections.ConfigDict()
    c.data.embedding_cache = ""  # convert/encode_prompts.py --family=qwenimage output (with the negative " ")
    c.data.random_embeddings = False  # random prompt embeddings of the model's shapes instead
    c.data.text_len = 128  # random embeddings: padded text length (cap 1024)
    c.data.num_prompts = 1024  # random embeddings: distinct prompts

    c.sampling = ml_collections.ConfigDict()
    c.sampling.height = 512
    c.sampling.width = 512
    c.sampling.num_steps = 10
    c.sampling.ladder = "qwen_image"  # dynamic shift on the packed token count, terminal sigma 0.02
    c.sampling.ladder_options = {}  # keyword overrides of the ladder function
    c.sampling.guidance = 0.0  # no embedded guidance
    c.sampling.cfg_scale = 4.0  # true CFG against the cache's negative prompt
    c.sampling.cfg_rescale = True  # guided velocity rescaled to the conditional one's norm per token
    c.sampling.sde_type = "sde"
    c.sampling.noise_level = 1.2

    c.rl = ml_collections.ConfigDict()
    c.rl.prompts_per_iteration = 32
    c.rl.group_size = 16
    c.rl.step_selection = "window"  # SDE on (and training of) a 2-step window drawn in [0, 5) per iteration
    c.rl.timestep_fraction = 0.99
    c.rl.sde_window_size = 2
    c.rl.sde_window_range = (0, 5)
    c.rl.window_shift_every = 25
    c.rl.std_mode = "global"
    c.rl.mean_mode = "group"
    c.rl.std_ddof = 0
    c.rl.std_eps = 1e-4
    c.rl.adv_clip = 5.0
    c.rl.clip_range = 1e-5
    c.rl.policy_loss = "ppo"
    c.rl.kl_beta = 0.0
    c.rl.num_updates_per_batch = 1  # one update per 32 prompts x 16 samples
    c.rl.micro_batch_size = 16  # training units (sample, step) per gradient micro-batch
    # Decoupled PPO (proximal policy) for off-policy updates; None: on with model.rollout_precision='fp8'
    c.rl.decoupled = ml_collections.config_dict.placeholder(bool)
    c.rl.is_cap = ml_collections.config_dict.placeholder(float)  # None: untruncated (2 for FP8 rollouts, README)
    c.rl.onpolicy_anchor = "trainer"
    c.rl.learning_rate = 3e-4
    c.rl.weight_decay = 1e-4
    c.rl.max_grad_norm = 1.0
    c.rl.lora_rank = 64
    c.rl.lora_alpha = 128.0
    # Factored adapters in rollout: a merged copy next to the frozen base would not fit an 80 GB card.
    c.rl.lora_merge_for_sampling = False
    c.rl.lora_targets = ATTENTION_MLP_TARGETS["qwenimage"]  # regexes searched in each kernel's path
    c.rl.ema = False
    c.rl.ema_decay = ml_collections.config_dict.placeholder(float)
    c.rl.ema_every = 8
    c.rl.max_nonfinite_in_row = 3
    c.rl.max_update_ratio = 1.0
    c.rl.optimizer_state_dtype = "param"  # Adam moments: "param" (the weights' dtype) | "float32"
    c.rl.update(algorithm_keys())  # rl.algorithm and the DiffusionNFT keys (configs/sections.py)

    c.reward = ml_collections.ConfigDict()
    c.reward.weights = {"jpeg_compressibility": 1.0}  # a cheap host reward; any registered reward works
    c.reward.frame_stride = 1

    c.train = ml_collections.ConfigDict()
    c.train.iterations = 300
    c.train.eval_every = 0
    c.train.eval_prompts = 16
    c.train.image_every = 10
    c.train.checkpoint_every = 20
    c.train.keep_checkpoints = 2
    c.train.on_corrupt_checkpoint = "fallback"  # an unreadable latest checkpoint: "fallback" to the one before, or "stop"
    c.train.init_from = ""  # a workdir: start from its latest checkpoint's trainable weights (fresh optimizer, iteration 0)
    # True: move all the workdir holds to WORKDIR/previous_runs/N/, start at iteration 0 (each run given it starts over)
    c.train.start_over = False

    # Colocated by default (any device count); on a multi-GPU host try e.g.
    # --config.runtime.mode=gap+tsp+tag+tcss --config.runtime.rollout_devices=2 --config.runtime.train_devices=2
    c.runtime = runtime_section(micro_batches=8)
    # LoRA: the frozen base fits one GPU and is replicated on every train device (data parallel, one
    # adapter-gradient all-reduce per micro-batch, no per-layer weight gathers). Full fine-tuning
    # of these sizes needs sharding_section(fsdp=True) (docs/design.md, "Shardings from logical names").
    c.sharding = sharding_section(fsdp=False)
    return tiny_overrides(c, video=False, trained_steps=2) if size == "tiny" else c
