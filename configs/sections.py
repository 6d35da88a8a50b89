"""Recipes the configs share, as data: the LoRA target sets of the model families, the CPU-size
(`:tiny`), clip-length (`:81f...`) and TPU-slice overrides of the model-zoo configs, and the
DiffusionNFT and full fine-tuning recipes of the `*_nft.py` and `*_full.py` zoo configs. Every key
and its default: configs/schema.py. Each variant config (`*_nft.py`, `*_full.py`) is a recipe
applied to its base (`variant`)."""
from __future__ import annotations

from typing import Callable

import ml_collections

from configs.schema import FSDP_RULES
from digen_jax.models.specs import SPECS


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
    c.sharding.train_rules = c.sharding.rollout_rules = FSDP_RULES
    c.runtime.distributed = True
    return c


def nft_recipe(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """`c` (a model-zoo config) switched to DiffusionNFT with the reference's settings
    (NVlabs/DiffusionNFT config/nft.py over config/base.py; docs/algorithms.md section A12): ODE
    rollouts with DPM2 and no CFG, int(N * 0.99) trained levels per sample, beta 1, the 'ramp'
    decay, KL-to-base weight 1e-4, advantage clip 5, one update per batch, an evaluation EMA of
    decay 0.9 updated every step, 10 steps (the reference's SD3.5-M rollouts; it ran 24 images x 48
    prompts per update). The model, ladder, LoRA and batch stay `c`'s."""
    c.rl.algorithm = "nft"
    c.sampling.num_steps = 10
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
    c.sharding.train_rules = FSDP_RULES
    return c


# The usual RL target set, "attention and MLP" of every block, per model family (each family
# spec's `lora_targets`, which imports no JAX): every q/k/v and output projection of the
# attentions and both MLP matmuls; embedders and AdaLN modulation stay frozen.
ATTENTION_MLP_TARGETS: dict[str, tuple[str, ...]] = {name: spec.lora_targets for name, spec in SPECS.items()}


def variant(base, recipe: Callable[[ml_collections.ConfigDict], ml_collections.ConfigDict], *, trained_steps: int):
    """The `get_config(size)` of a variant config: `recipe` (`nft_recipe`, `full_ft_recipe`) applied
    to the full config of `base` (an image model-zoo config module); `:tiny` at CPU size, where the
    recipe trains `trained_steps` steps per sample (`tiny_overrides`)."""

    def get_config(size: str = "full") -> ml_collections.ConfigDict:
        c = recipe(base.get_config())
        return tiny_overrides(c, video=False, trained_steps=trained_steps) if size == "tiny" else c

    return get_config


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
    c.rl.grad_chunk_size = c.rl.prompts_per_iteration * c.rl.group_size * trained_steps
    c.rl.lora_rank = min(c.rl.lora_rank, 2)
    c.model.vae_decode_batch = 4
    c.train.iterations = 1
    c.train.eval_every = c.train.image_every = c.train.checkpoint_every = 0
    c.train.eval_prompts = 2
    return c


def long_video_overrides(
    c: ml_collections.ConfigDict, *, num_frames: int, height: int, width: int, grad_chunk_size: int, seq_parallel: int
) -> ml_collections.ConfigDict:
    """`c` (a video model-zoo config) at clip length: `num_frames` frames at `height` x `width`,
    every block recomputed in the backward pass (remat 'full'), `grad_chunk_size` training
    units per gradient chunk (what one sequence group holds on the devices the size is written
    for).

    `seq_parallel`: the devices per sequence group (`runtime.seq_parallel`) the size is sized for.
    """
    c.sampling.num_frames, c.sampling.height, c.sampling.width = num_frames, height, width
    c.model.remat_policy = "full"
    c.rl.grad_chunk_size = grad_chunk_size
    c.runtime.seq_parallel = seq_parallel
    return c
