"""What the configs share, as data: the `runtime` and `sharding` sections, the `rl.algorithm` keys,
the LoRA target sets of the model families, the CPU-size (`:tiny`), clip-length (`:81f...`) and
TPU-slice overrides of the model-zoo configs and the DiffusionNFT recipe of the `*_nft.py` zoo configs."""
from __future__ import annotations

import ml_collections


def runtime_section(mode: str = "colocated", micro_batches: int = 1) -> ml_collections.ConfigDict:
    """Schedule mode and device roles (docs/design.md sections 2 and 4; README 'Runtime')."""
    return ml_collections.ConfigDict(
        dict(
            # 'colocated' | 'disagg_sync' | 'gap' | 'gap+tsp' | 'gap+tsp+tag' | 'gap+tsp+tag+tcss'
            mode=mode,
            micro_batches=micro_batches,  # M: micro-batches (whole groups) per iteration
            # Devices per role (disaggregated modes); 0 = an even split of what is left.
            # Colocated: train_devices > 0 uses only the first train_devices devices.
            rollout_devices=0,
            train_devices=0,
            reward_devices=0,  # 0: rewards are scored where decoding ran
            # Devices per sequence group: each sample's tokens split over this many devices of its role
            # (Ulysses attention; video families, heads and tokens divisible by it). 1: no split.
            seq_parallel=1,
            # Micro-batches the trainer rolls out (tag modes; a fraction splits one micro-batch between
            # the roles, in pieces of samples) / the rollout group prefetches with stale weights
            # (tcss); -1: chosen every iteration from measured costs.
            tag_microbatches=-1.0,
            prefetch_microbatches=-1,
            staleness=1,  # tcss: iterations a prefetched sample's weights may lag (0 turns prefetching off)
            # Keep the optimizer state (Adam moments) in pinned host memory, copied through the train
            # devices at each update: full fine-tuning of 12-20B models on 80 GB cards (README).
            offload_optimizer=False,
            # Colocated full fine-tuning with FSDP train rules: 'sharded' samples from the sharded
            # weights (each step all-gathers them layer by layer); 'gathered' gathers one replicated
            # copy per iteration (sampled under the rollout rules, dropped before training); 'auto'
            # gathers when the memory plan fits the copy. LoRA and unsharded train rules ignore it.
            colocated_sampling="auto",
            # The train role's own rollouts (tag modes): 'rollout' samples in model.rollout_precision
            # like the rollout role (FP8: a quantised copy of the weights beside training's),
            # 'training' in the training precision; 'auto' takes 'rollout' where the memory plan fits it.
            tag_precision="auto",
            # Refuse a run whose memory plan (launch/simulate.py prints it) does not fit its devices.
            check_memory=True,
            reward_workers=2,  # host threads scoring micro-batches
            trace=True,  # WORKDIR/trace.json (Chrome trace)
            distributed=False,  # jax.distributed.initialize() (SLURM auto-detection); see launch/slurm/
            # Several processes: when one dies or freezes, every other one stops (exit status 1,
            # a line naming it) within this many seconds (digen_jax/runtime/peer_watchdog.py).
            peer_timeout_s=120.0,
        )
    )


def sharding_section(fsdp: bool = True) -> ml_collections.ConfigDict:
    """Logical axis -> mesh axis rules per role (digen_jax.models.partitioning lists the logical names).

    Rollout replicates the weights and splits the batch (no per-step all-gathers); training
    shards the hidden dimension of every weight over its devices (FSDP) when `fsdp`.
    """
    batch = (("activation_batch", "data"),)
    return ml_collections.ConfigDict(
        dict(
            rollout_rules=batch,
            train_rules=batch + ((("embed", "data"),) if fsdp else ()),
        )
    )


def tpu_overrides(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """`c` (a model-zoo config) on a Cloud TPU slice (README "TPU"; `configs/tpu.py` applies it):

    * splash attention, Pallas' TPU kernel (`auto` picks it on a TPU as well; named so that the
      run's config says which kernel ran);
    * every role's weights sharded over its chips (FSDP, rollout too): a chip holds 16-95 GB
      (v5e-v5p), the per-layer gathers run over the slice's ICI, and the programs run under
      their role's mesh, where the kernel runs per chip (`shard_map`) rather than as one call
      that XLA would have to partition;
    * `runtime.distributed=True`: every host of the slice runs the same command and
      `jax.distributed.initialize()` takes the hosts from the TPU metadata (one host: one process).
    """
    c.model.attention_impl = "splash"
    c.sharding = sharding_section(fsdp=True)
    c.sharding.rollout_rules = c.sharding.train_rules
    c.runtime.distributed = True
    return c


def algorithm_keys() -> dict:
    """`rl.algorithm` and DiffusionNFT's own keys (docs/algorithms.md section A12), to add to a
    config's `rl` section; the defaults train Flow-GRPO and leave the NFT keys unused.

    With 'nft' the GRPO-only keys (step selection, clip range, policy loss, decoupled PPO, the
    on-policy anchor, sampling.noise_level and sde_type) play no part; `rl.adv_clip` is the
    reference's `train.adv_clip_max` (advantage clip and loss scale) and `rl.kl_beta` its
    `train.beta` (the weight of the squared distance to the base model's velocity).
    """
    return dict(
        algorithm="grpo",  # 'grpo' (Flow-GRPO family) | 'nft' (DiffusionNFT)
        nft_solver="dpm2",  # NFT rollout ODE solver: 'euler' | 'dpm2' (the reference's sample.solver)
        # K noise levels trained per sample; 0: int(sampling.num_steps * rl.timestep_fraction), the reference's rule
        nft_timesteps=0,
        nft_beta=1.0,  # implicit-policy mixing strength (the reference's `beta`; 0.1 for its OCR config)
        # Old-policy decay once per iteration, after its last update: 'copy' | 'ramp' | 'ramp_delayed' (the reference's decay_type 0 | 1 | 2)
        nft_decay="ramp",
    )


def nft_recipe(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """`c` (a model-zoo config) switched to DiffusionNFT with the reference's settings
    (NVlabs/DiffusionNFT config/nft.py over config/base.py; docs/algorithms.md section A12): ODE
    rollouts with DPM2 and no CFG, int(N * 0.99) trained levels per sample, beta 1, the 'ramp'
    decay, KL-to-base weight 1e-4, advantage clip 5, one update per batch, an evaluation EMA of
    decay 0.9 updated every step. The reference's SD3.5-M ran 10 steps with 24 images x 48
    prompts per update; the model, ladder, LoRA and batch stay `c`'s."""
    c.rl.algorithm = "nft"
    c.rl.nft_solver, c.rl.nft_beta, c.rl.nft_decay, c.rl.nft_timesteps = "dpm2", 1.0, "ramp", 0
    c.rl.timestep_fraction = 0.99
    c.rl.kl_beta = 1e-4
    c.rl.adv_clip = 5.0
    c.rl.num_updates_per_batch = 1
    c.rl.ema, c.rl.ema_decay, c.rl.ema_every = True, 0.9, 1
    c.rl.std_mode, c.rl.mean_mode = "global", "group"  # per-prompt mean, global std
    c.sampling.cfg_scale, c.sampling.cfg_rescale = 1.0, False  # CFG-free
    return c


def full_ft_recipe(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """`c` (a model-zoo config) switched to the peers' full fine-tuning recipe (veRL-Omni's
    Flow-GRPO on Qwen-Image): every weight trained (no LoRA) and sharded over the train devices
    (FSDP), no CFG, 512 x 512, 10 steps, lr 3e-5, clip range 1e-5, float32 Adam moments. The
    model, step selection, reward and batch stay `c`'s; launch/simulate.py prints the memory
    plan of a pool (Qwen-Image-20B needs more than 4 x 80 GB, docs/known_issues.md)."""
    c.rl.lora_rank = 0
    c.rl.learning_rate, c.rl.clip_range = 3e-5, 1e-5
    c.rl.optimizer_state_dtype = "float32"
    c.sampling.height = c.sampling.width = 512
    c.sampling.num_steps = 10
    c.sampling.cfg_scale = 1.0
    if "cfg_rescale" in c.sampling:
        c.sampling.cfg_rescale = False
    c.sharding = sharding_section(fsdp=True)
    return c


# The usual RL target set, "attention and MLP" of every block, per model family: every q/k/v and
# output projection of the attentions and both MLP matmuls (FLUX/HunyuanVideo single blocks:
# proj_mlp and the fused proj_out). Embedders, AdaLN modulation and HunyuanVideo's token
# refiner stay frozen. `(\d+/)?` admits the block index of unrolled layouts (`blocks/3/ffn/...`).
ATTENTION_MLP_TARGETS: dict[str, tuple[str, ...]] = {
    "flux": (r"attn/(to_|add_)", r"/(ff|ff_context)/", r"single_blocks/(\d+/)?proj_(mlp|out)/"),
    "qwenimage": (r"attn/(to_|add_)", r"/(img_mlp|txt_mlp)/"),
    "wan": (r"blocks/(\d+/)?attn[12]/to_", r"blocks/(\d+/)?ffn/"),
    "hunyuan_video": (
        r"(double|single)_blocks/(\d+/)?attn/(to_|add_)",
        r"double_blocks/(\d+/)?(ff|ff_context)/",
        r"single_blocks/(\d+/)?proj_(mlp|out)/",
    ),
}


def tiny_overrides(c: ml_collections.ConfigDict, *, video: bool, trained_steps: int) -> ml_collections.ConfigDict:
    """`c` (a model-zoo config) at CPU size: the tiny variants, random weights and embeddings,
    32x32 px (5 frames for video), 4 steps, 2 prompts x 2 samples, one iteration, float32.

    `trained_steps`: the steps per sample the config's step selection trains at this size; one
    training chunk holds every unit of the batch (tests check it against `rl.timesteps`).
    """
    c.model.variant, c.model.random_init = "tiny", True
    c.model.dtype = c.model.param_dtype = "float32"
    c.data.random_embeddings, c.data.text_len, c.data.num_prompts = True, 8, 16
    c.sampling.height = c.sampling.width = 32
    if video:
        c.sampling.num_frames = 5
    c.sampling.num_steps = 4
    c.rl.sde_window_range = (0, 3)
    c.rl.sde_window_size = min(c.rl.sde_window_size, 2)
    c.rl.prompts_per_iteration, c.rl.group_size = 2, 2
    c.rl.num_updates_per_batch = 1
    c.runtime.micro_batches = 1
    c.rl.micro_batch_size = c.rl.prompts_per_iteration * c.rl.group_size * trained_steps
    c.rl.lora_rank = min(c.rl.lora_rank, 2)
    c.model.vae_decode_batch = 4
    c.train.iterations = 1
    c.train.eval_every = c.train.image_every = c.train.checkpoint_every = 0
    c.train.eval_prompts = 2
    return c


def long_video_overrides(
    c: ml_collections.ConfigDict, *, num_frames: int, height: int, width: int, micro_batch_size: int, seq_parallel: int
) -> ml_collections.ConfigDict:
    """`c` (a video model-zoo config) at clip length: `num_frames` frames at `height` x `width`,
    every block recomputed in the backward pass (remat 'full'), `micro_batch_size` training
    units per gradient chunk (what one sequence group holds on the devices the size is written
    for).

    `seq_parallel`: the devices per sequence group (`runtime.seq_parallel`) the size is sized for.
    """
    c.sampling.num_frames, c.sampling.height, c.sampling.width = num_frames, height, width
    c.model.remat_policy = "full"
    c.rl.micro_batch_size = micro_batch_size
    c.runtime.seq_parallel = seq_parallel
    return c
