"""The tiny CPU default: Flow-GRPO on a synthetic shapes task, end to end on two CPU cores.

A tiny FLUX-family transformer works in pixel space (no VAE): a (3, H, W) image is packed
2x2 into (H/2 * W/2) tokens of 12 channels, as FLUX packs its latents. It is pretrained
briefly by flow matching on prompts like "a red square in the top left" whose renders
follow the prompt only partly (label noise), so it follows prompts imperfectly; Flow-GRPO
then trains it against a programmatic reward that checks colour, shape and position.

    python launch/train.py --config=configs/tiny.py --workdir=/tmp/digen
    python launch/train.py --config=configs/tiny.py --workdir=/tmp/digen --config.train.iterations=10
"""
import ml_collections

from configs.sections import ATTENTION_MLP_TARGETS, algorithm_keys, runtime_section, sharding_section


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.seed = 0

    c.model = ml_collections.ConfigDict()
    c.model.family = "flux"
    # Architecture: the fields of digen_jax.models.flux.FluxConfig (diffusers names).
    c.model.arch = ml_collections.ConfigDict(
        dict(
            in_channels=12,  # 3 pixel channels x 2x2 packing
            num_layers=2,
            num_single_layers=2,
            attention_head_dim=16,
            num_attention_heads=4,
            joint_attention_dim=32,
            pooled_projection_dim=32,
            guidance_embeds=True,
            axes_dims_rope=(4, 6, 6),
        )
    )
    c.model.dtype = "float32"
    c.model.param_dtype = "float32"
    c.model.attention_impl = "auto"  # 'auto' (TPU: splash; GPU, bf16: cudnn; else xla) | 'cudnn' | 'xla' | 'splash'
    c.model.remat_policy = "none"
    c.model.scan_layers = True  # False unrolls blocks: no per-layer weight copies, longer compiles
    # Numerics of the rollouts' forward: 'bf16' = the model's dtype, 'fp8' = e4m3 block matmuls (README).
    c.model.rollout_precision = "bf16"
    # A converted FLUX checkpoint dir with model.arch's in_channels and text widths (any depth);
    # empty: pretrain on the task (cached).
    c.model.checkpoint = ""

    # The synthetic task (digen_jax.data.shapes.ShapesTask).
    c.task = ml_collections.ConfigDict()
    c.task.name = "shapes"
    c.task.resolution = 16  # pixels per side (a multiple of 4, >= 16)
    c.task.text_len = 8
    c.task.label_noise = 0.25  # share of pretraining renders that contradict their prompt

    c.pretrain = ml_collections.ConfigDict()
    c.pretrain.steps = 800
    c.pretrain.batch_size = 32
    c.pretrain.learning_rate = 3e-3
    c.pretrain.cache_dir = "~/.cache/digen_jax/pretrained"

    c.sampling = ml_collections.ConfigDict()
    c.sampling.num_steps = 8
    c.sampling.ladder = "flux"  # a digen_jax.diffusion.LADDER_FAMILIES entry
    c.sampling.guidance = 3.5  # embedded guidance scale (FLUX.1-dev style)
    c.sampling.cfg_scale = 1.0  # true CFG (1 = off)
    c.sampling.cfg_rescale = False
    c.sampling.sde_type = "sde"  # 'sde' | 'cps' | 'wan' | 'dance'
    c.sampling.noise_level = 0.7  # Flow-GRPO `a` (eta for 'dance')

    c.rl = ml_collections.ConfigDict()
    c.rl.prompts_per_iteration = 8
    c.rl.group_size = 8  # samples per prompt (G)
    c.rl.step_selection = "fraction"  # 'fraction' | 'window' | 'mixgrpo' | 'random'
    c.rl.timestep_fraction = 0.99
    c.rl.sde_window_size = 2
    c.rl.sde_window_range = (0, 5)
    c.rl.window_shift_every = 25
    c.rl.std_mode = "global"  # 'group' | 'global' (Flow-GRPO global_std)
    c.rl.mean_mode = "group"  # 'group' | 'global' (batch mean; needs std_mode='global')
    c.rl.std_ddof = 0
    c.rl.std_eps = 1e-4
    c.rl.adv_clip = 5.0
    c.rl.clip_range = 1e-4
    c.rl.policy_loss = "ppo"  # 'ppo' (PPO-clip) | 'grpo_guard' (ratio-normalised PPO-clip)
    c.rl.kl_beta = 0.0
    # Two optimizer updates per batch, each on half of its micro-batches (Flow-GRPO's recipe): the
    # second half is trained one update off-policy, which is where clip_frac and approx_kl move.
    c.rl.num_updates_per_batch = 2
    c.rl.micro_batch_size = 112  # training units per gradient micro-batch
    # Decoupled PPO (proximal policy) for off-policy updates; None: on with model.rollout_precision='fp8'
    c.rl.decoupled = ml_collections.config_dict.placeholder(bool)
    c.rl.is_cap = ml_collections.config_dict.placeholder(float)  # None: untruncated (2 for FP8 rollouts, README)
    # Anchor of the ratio for samples of the weights being trained (version lag 0, first update):
    # 'trainer' = the training pass's own log-prob (ratio exactly 1 whatever numerics the rollout
    # ran with); 'rollout' = the log-prob the rollout recorded. Stale samples always use the latter.
    c.rl.onpolicy_anchor = "trainer"
    c.rl.learning_rate = 3e-4
    c.rl.weight_decay = 1e-4
    c.rl.max_grad_norm = 1.0
    c.rl.lora_rank = 0  # 0: full fine-tuning
    c.rl.lora_alpha = 0.0
    c.rl.lora_merge_for_sampling = True  # False: adapters applied on the fly in each rollout step
    c.rl.lora_targets = ATTENTION_MLP_TARGETS["flux"]  # regexes searched in each kernel's path
    c.rl.ema = True
    c.rl.ema_decay = ml_collections.config_dict.placeholder(float)  # None: Flow-GRPO warm-up schedule
    c.rl.ema_every = 8
    c.rl.max_nonfinite_in_row = 3  # stop after this many skipped updates in a row (>= 1)
    # Skip an update larger than this times the parameters' norm (a diverged step; inf: no bound).
    c.rl.max_update_ratio = 1.0
    c.rl.optimizer_state_dtype = "param"  # Adam moments: "param" (the weights' dtype) | "float32"
    c.rl.update(algorithm_keys())  # rl.algorithm and the DiffusionNFT keys (configs/sections.py)

    c.reward = ml_collections.ConfigDict()
    c.reward.weights = {"shapes": 1.0}
    # Several rewards: 'reward' normalises their weighted sum per group (Flow-GRPO); 'advantage'
    # normalises each per group, then weights them (MixGRPO's advantage_aggr). Optional key.
    c.reward.mix = "reward"

    c.train = ml_collections.ConfigDict()
    c.train.iterations = 40
    c.train.eval_every = 5  # ODE samples of fixed eval prompts, EMA weights when enabled
    c.train.eval_prompts = 32
    c.train.image_every = 10
    c.train.checkpoint_every = 10
    c.train.keep_checkpoints = 2
    c.train.on_corrupt_checkpoint = "fallback"  # an unreadable latest checkpoint: "fallback" to the one before, or "stop"
    c.train.init_from = ""  # a workdir: start from its latest checkpoint's trainable weights (fresh optimizer, iteration 0)
    # True: move all the workdir holds to WORKDIR/previous_runs/N/, start at iteration 0 (each run given it starts over)
    c.train.start_over = False

    c.runtime = runtime_section()  # colocated: the plain Flow-GRPO loop
    c.runtime.micro_batches = 2  # one per update
    c.runtime.train_devices = 1  # the tiny model gains nothing from splitting over (fake) devices
    c.sharding = sharding_section()
    return c
