"""Every config key, once: its default, its allowed values where they are a fixed set, and what it
means. A config file starts from `config(...)` and sets only what differs from these defaults.

Keys come in groups, and a config holds the groups that apply to it: `base` (every config), `zoo`
(a model-zoo family: converted weights, a prompt-embedding cache, image sizes), `shapes` (the
synthetic task of configs/tiny.py: its architecture, task and pretraining), `video` (frames) and
`single_stream` (FLUX and HunyuanVideo's single-stream blocks) and `first_frame` (videos that start
from an image: Wan2.2-TI2V). A key absent from a config is not
part of its run (resume fingerprints and `--print_config` show only what a config holds).

Choices restate the library's own tuples (e.g. `digen_jax.rl.losses.POLICY_LOSSES`) so that the
configs stay data; tests/test_configs.py holds them equal.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import ml_collections


class Key(NamedTuple):
    default: Any
    meaning: str
    choices: tuple | None = None  # the allowed values, where they are a fixed set
    group: str = "base"


def _placeholder(kind: type) -> ml_collections.FieldReference:
    """An unset (None) value that accepts `kind` when set (`--config.rl.is_cap=2`)."""
    return ml_collections.config_dict.placeholder(kind)


GROUPS = ("base", "zoo", "shapes", "video", "single_stream", "first_frame")
BATCH_RULES = (("activation_batch", "data"),)
FSDP_RULES = BATCH_RULES + (("embed", "data"),)

KEYS: dict[str, Key] = {
    "seed": Key(0, "the run's seed: prompts, noises and step selection of iteration k derive from (seed, k)"),
    # ------------------------------------------------------------------ model
    "model.family": Key("flux", "model family: a digen_jax/models/specs.py family"),
    "model.variant": Key("dev", "with random_init: an entry of the family's VARIANTS table ('tiny' for CPU)", group="zoo"),
    "model.checkpoint": Key("", "converted transformer dir (convert/diffusers_to_orbax.py); configs/tiny.py: empty "
                                "pretrains on its task (cached)"),
    "model.vae_checkpoint": Key("", "converted VAE dir (convert/diffusers_to_orbax.py)", group="zoo"),
    "model.random_init": Key(False, "random transformer and VAE weights of `variant` (throughput runs)", group="zoo"),
    "model.num_layers": Key(0, "with random_init: > 0 keeps that many (double-stream) blocks (short throughput runs)",
                            group="zoo"),
    "model.num_single_layers": Key(0, "with random_init: > 0 keeps that many single-stream blocks",
                                   group="single_stream"),
    "model.arch.in_channels": Key(12, "the shapes task's FLUX transformer: 3 pixel channels x 2x2 packing",
                                  group="shapes"),
    "model.arch.num_layers": Key(2, "its double-stream blocks", group="shapes"),
    "model.arch.num_single_layers": Key(2, "its single-stream blocks", group="shapes"),
    "model.arch.attention_head_dim": Key(16, "its attention head width", group="shapes"),
    "model.arch.num_attention_heads": Key(4, "its attention heads", group="shapes"),
    "model.arch.joint_attention_dim": Key(32, "its text-token width", group="shapes"),
    "model.arch.pooled_projection_dim": Key(32, "its pooled-text width", group="shapes"),
    "model.arch.guidance_embeds": Key(True, "it embeds the guidance scale (FLUX.1-dev style)", group="shapes"),
    "model.arch.axes_dims_rope": Key((4, 6, 6), "its RoPE widths per position axis", group="shapes"),
    "model.dtype": Key("bfloat16", "compute dtype of the transformer", ("bfloat16", "float32")),
    "model.param_dtype": Key("bfloat16", "dtype the weights are held and trained in", ("bfloat16", "float32")),
    "model.attention_impl": Key("auto", "'auto' (TPU: splash; GPU, bf16: cudnn; else xla) | 'cudnn' | 'xla' | 'splash'",
                                ("auto", "cudnn", "xla", "splash")),
    "model.remat_policy": Key("full", "what a block saves for the backward pass (models/stacking.py REMAT_POLICIES); "
                                      "the 12-20B models need 'full'"),
    "model.scan_layers": Key(True, "False unrolls the blocks: no per-layer weight copies, longer compiles"),
    "model.rollout_precision": Key("bf16", "numerics of the rollouts' forward: 'bf16' = the model's dtype, 'fp8' = e4m3 "
                                           "block matmuls (docs/fp8_rollouts.md)", ("bf16", "fp8")),
    "model.lora_base_precision": Key("bf16", "LoRA's frozen base in training and every rollout: 'fp8' holds only its "
                                             "e4m3 form, one copy (needs rollout_precision='fp8')", ("bf16", "fp8")),
    "model.vae_decode_batch": Key(8, "samples per VAE decode call", group="zoo"),
    # ------------------------------------------------------------------ the shapes task (configs/tiny.py)
    "task.name": Key("shapes", "the synthetic task (digen_jax.data.shapes_task.ShapesTask)", ("shapes",), group="shapes"),
    "task.resolution": Key(16, "pixels per side (a multiple of 4, >= 16)", group="shapes"),
    "task.text_len": Key(8, "prompt tokens", group="shapes"),
    "task.label_noise": Key(0.25, "share of pretraining renders that contradict their prompt", group="shapes"),
    "pretrain.steps": Key(800, "flow-matching steps of the base model's pretraining", group="shapes"),
    "pretrain.batch_size": Key(32, "pretraining batch", group="shapes"),
    "pretrain.learning_rate": Key(3e-3, "pretraining learning rate", group="shapes"),
    "pretrain.cache_dir": Key("~/.cache/digen_jax/pretrained", "where the pretrained base model is cached",
                              group="shapes"),
    # ------------------------------------------------------------------ prompt embeddings
    "data.embedding_cache": Key("", "convert/encode_prompts.py output for the family", group="zoo"),
    "data.random_embeddings": Key(False, "random prompt embeddings of the model's shapes instead", group="zoo"),
    "data.text_len": Key(512, "random embeddings: padded text length", group="zoo"),
    "data.num_prompts": Key(1024, "random embeddings: distinct prompts", group="zoo"),
    "data.first_frames": Key("", "the image each prompt's videos start from (Wan2.2-TI2V): '' none (text-to-video), "
                                 "'synthetic' a drawn one per prompt, or a text file with one image path per line of "
                                 "the prompt file (docs/models.md section 9)", group="first_frame"),
    "model.vae_encoder_checkpoint": Key("", "with data.first_frames: the converted VAE encoder dir "
                                            "(convert/diffusers_to_orbax.py --family=vae_wan_encoder)",
                                        group="first_frame"),
    # ------------------------------------------------------------------ sampling
    "sampling.height": Key(512, "image height in pixels", group="zoo"),
    "sampling.width": Key(512, "image width in pixels", group="zoo"),
    "sampling.num_frames": Key(33, "video frames (4k + 1)", group="video"),
    "sampling.num_steps": Key(6, "denoising steps of a rollout"),
    "sampling.ladder": Key("flux", "the sigma ladder: a digen_jax.diffusion.LADDER_FAMILIES entry"),
    "sampling.ladder_options": Key({}, "keyword overrides of the ladder function", group="zoo"),
    "sampling.guidance": Key(3.5, "embedded guidance scale (FLUX.1-dev style; 0: none)"),
    "sampling.cfg_scale": Key(1.0, "true classifier-free guidance against the negative prompt (1: off)"),
    "sampling.cfg_rescale": Key(False, "guided velocity rescaled to the conditional one's norm per token"),
    "sampling.cfg_scale_2": Key(_placeholder(float), "a pair of experts (Wan2.2-A14B): the low-noise steps' CFG "
                                "scale (diffusers' guidance_scale_2); None: cfg_scale throughout", group="zoo"),
    "sampling.sde_type": Key("sde", "the SDE step: 'sde' (Flow-GRPO) | 'cps' | 'wan' | 'dance' (DanceGRPO)",
                             ("sde", "cps", "wan", "dance")),
    "sampling.noise_level": Key(0.9, "Flow-GRPO's noise level `a` (eta for 'dance')"),
    # ------------------------------------------------------------------ rl
    "rl.algorithm": Key("grpo", "'grpo' (Flow-GRPO family) | 'nft' (DiffusionNFT)", ("grpo", "nft")),
    "rl.prompts_per_iteration": Key(48, "prompts per iteration"),
    "rl.group_size": Key(24, "samples per prompt (G)"),
    "rl.step_selection": Key("fraction", "which steps are SDE steps and trained (docs/algorithms.md)",
                             ("fraction", "window", "mixgrpo", "random")),
    "rl.timestep_fraction": Key(0.99, "'fraction': the share of steps trained"),
    "rl.sde_window_size": Key(2, "'window': SDE steps per window"),
    "rl.sde_window_range": Key((0, 5), "'window': the steps the window is drawn in"),
    "rl.window_shift_every": Key(25, "'mixgrpo': iterations between window shifts"),
    "rl.std_mode": Key("global", "advantage std over the 'group' or the whole batch ('global', Flow-GRPO global_std)",
                       ("group", "global")),
    "rl.mean_mode": Key("group", "advantage mean per 'group' or over the batch ('global'; needs std_mode='global')",
                        ("group", "global")),
    "rl.std_ddof": Key(0, "delta degrees of freedom of the advantage std"),
    "rl.std_eps": Key(1e-4, "added to the advantage std"),
    "rl.adv_clip": Key(5.0, "advantages clipped to [-adv_clip, adv_clip]"),
    "rl.clip_range": Key(1e-4, "PPO clip range of the ratio"),
    "rl.policy_loss": Key("ppo", "'ppo' (PPO-clip) | 'grpo_guard' (ratio-normalised PPO-clip)", ("ppo", "grpo_guard")),
    "rl.kl_beta": Key(0.0, "weight of the KL to the base (LoRA) or initial (full fine-tuning) policy"),
    "rl.num_updates_per_batch": Key(2, "optimizer updates per iteration, each on a consecutive share of its "
                                       "micro-batches (the later ones trained off-policy)"),
    "rl.grad_chunk_size": Key(24, "training units (sample, step) per gradient chunk"),
    "rl.decoupled": Key(_placeholder(bool), "decoupled PPO (proximal policy) for off-policy updates; None: on with "
                                            "model.rollout_precision='fp8'"),
    "rl.is_cap": Key(_placeholder(float), "truncation of the decoupled importance weights; None: none (2 for FP8 "
                                          "rollouts)"),
    "rl.onpolicy_anchor": Key("trainer", "anchor of the ratio for samples of the weights being trained: the training "
                                         "pass's own log-prob ('trainer') or the rollout's ('rollout')",
                              ("trainer", "rollout")),
    "rl.learning_rate": Key(3e-4, "AdamW learning rate"),
    "rl.weight_decay": Key(1e-4, "AdamW weight decay"),
    "rl.max_grad_norm": Key(1.0, "global gradient-norm clip (None: no clipping)"),
    "rl.lora_rank": Key(64, "LoRA rank; 0: full fine-tuning"),
    "rl.lora_alpha": Key(128.0, "LoRA alpha (the adapters' scale is alpha / rank; 0: alpha = rank)"),
    "rl.lora_merge_for_sampling": Key(False, "merge the adapters into a copy of the base for rollouts (else applied "
                                             "factored in each step)"),
    "rl.lora_targets": Key((), "regexes searched in each kernel's path (configs/sections.py ATTENTION_MLP_TARGETS)"),
    "rl.ema": Key(True, "keep an EMA of the trainable weights (evaluation and sampling use it)"),
    "rl.ema_decay": Key(_placeholder(float), "EMA decay; None: Flow-GRPO's warm-up schedule"),
    "rl.ema_every": Key(8, "updates between EMA steps"),
    "rl.max_nonfinite_in_row": Key(3, "stop after this many skipped (non-finite) updates in a row"),
    "rl.max_update_ratio": Key(1.0, "skip an update larger than this times the weights' norm (inf: no bound)"),
    "rl.optimizer_state_dtype": Key("param", "Adam moments' dtype: 'param' (the weights') | 'float32'",
                                    ("param", "float32")),
    "rl.nft_solver": Key("dpm2", "DiffusionNFT rollout ODE solver", ("euler", "dpm2")),
    "rl.nft_timesteps": Key(0, "DiffusionNFT noise levels trained per sample; 0: int(num_steps * timestep_fraction)"),
    "rl.nft_beta": Key(1.0, "DiffusionNFT implicit-policy mixing strength"),
    "rl.nft_decay": Key("ramp", "DiffusionNFT old-policy decay per iteration", ("copy", "ramp", "ramp_delayed")),
    # ------------------------------------------------------------------ reward
    "reward.weights": Key({"jpeg_compressibility": 1.0}, "registered reward name -> weight in the total"),
    "reward.options": Key({}, "reward name -> its factory's keyword arguments, e.g. {'hpsv2': {'checkpoint_dir': "
                              "DIR}} (a reward of reward.weights only)"),
    "reward.mix": Key("reward", "several rewards: 'reward' normalises their weighted sum per group (Flow-GRPO); "
                                "'advantage' normalises each per group, then weights them (MixGRPO's advantage_aggr)",
                      ("reward", "advantage")),
    "reward.frame_stride": Key(1, "video: rewards average over every n-th decoded frame", group="zoo"),
    # ------------------------------------------------------------------ train
    "train.iterations": Key(300, "iterations of the run"),
    "train.eval_every": Key(0, "iterations between evaluations (ODE samples of fixed prompts; 0: none)"),
    "train.eval_prompts": Key(16, "prompts an evaluation samples"),
    "train.image_every": Key(10, "iterations between image grids in TensorBoard (0: none)"),
    "train.checkpoint_every": Key(20, "iterations between checkpoints (0: one at the end)"),
    "train.keep_checkpoints": Key(2, "checkpoints kept"),
    "train.on_corrupt_checkpoint": Key("fallback", "an unreadable latest checkpoint: 'fallback' to the one before, or "
                                                   "'stop'", ("fallback", "stop")),
    "train.init_from": Key("", "a workdir: start from its latest checkpoint's trainable weights (fresh optimizer, "
                               "iteration 0)"),
    "train.start_over": Key(False, "move all the workdir holds to WORKDIR/previous_runs/N/ and start at iteration 0"),
    # ------------------------------------------------------------------ runtime (docs/design.md sections 2 and 4)
    "runtime.mode": Key("colocated", "the schedule mode (docs/design.md); 'auto': the one the cost model predicts "
                                     "fastest, chosen before the run, then once more from the run's measured costs "
                                     "(runtime.auto_rerank_after)",
                        ("colocated", "disagg_sync", "gap", "gap+tsp", "gap+tsp+tag", "gap+tsp+tag+tcss", "auto")),
    "runtime.auto_rerank_after": Key(4, "runtime.mode='auto': by this iteration at the latest (earlier once every "
                                        "task kind was measured and the split stopped changing) every mode is "
                                        "re-ranked from the task costs the run measured, and the run switches once "
                                        "to one predicted faster by more than auto_switch_margin; 0: never"),
    "runtime.auto_switch_margin": Key(0.03, "runtime.mode='auto': how much faster (a fraction) the measured re-rank "
                                            "must predict another mode or sizing for the run to switch to it"),
    "runtime.micro_batches": Key(4, "micro-batches (whole prompt groups) per iteration"),
    "runtime.rollout_devices": Key(0, "rollout devices of a disaggregated mode; 0: an even split"),
    "runtime.train_devices": Key(0, "train devices (0: the rest); colocated, > 0 uses only the first train_devices"),
    "runtime.reward_devices": Key(0, "devices that decode and score (0: where the rollout ran)"),
    "runtime.seq_parallel": Key(1, "devices per sequence group: each sample's tokens split over them (Ulysses)"),
    "runtime.tag_microbatches": Key(-1.0, "micro-batches the trainer rolls out (tag modes; a fraction splits one "
                                          "micro-batch between the roles, in pieces of samples); -1: from measured "
                                          "costs"),
    "runtime.prefetch_microbatches": Key(-1, "micro-batches prefetched with stale weights (tcss); -1: from measured "
                                             "costs"),
    "runtime.staleness": Key(1, "tcss: iterations a prefetched sample's weights may lag (0: no prefetching)"),
    "runtime.offload_optimizer": Key(False, "keep the Adam moments in pinned host memory, streamed per update"),
    "runtime.colocated_sampling": Key("auto", "colocated full fine-tuning with FSDP: sample from the 'sharded' weights "
                                              "or a 'gathered' copy; 'auto': gathered where it fits",
                                      ("auto", "sharded", "gathered")),
    "runtime.tag_precision": Key("auto", "the train role's own rollouts (tag modes): 'rollout' samples in "
                                         "model.rollout_precision (FP8: a quantised copy beside training's weights), "
                                         "'training' in the training precision; 'auto': 'rollout' where the memory "
                                         "plan fits it", ("auto", "rollout", "training")),
    "runtime.check_memory": Key(True, "refuse a run whose memory plan does not fit its devices"),
    "runtime.reward_workers": Key(2, "host threads scoring micro-batches"),
    "runtime.trace": Key(True, "write WORKDIR/trace.json (Chrome trace)"),
    "runtime.distributed": Key(False, "jax.distributed.initialize() (SLURM auto-detection; launch/slurm/)"),
    "runtime.peer_timeout_s": Key(120.0, "several processes: seconds within which all stop when one dies or freezes"),
    # ------------------------------------------------------------------ sharding
    "sharding.rollout_rules": Key(BATCH_RULES, "logical axis -> mesh axis rules of the rollout role"),
    "sharding.train_rules": Key(BATCH_RULES, "those of the train role (FSDP: configs/schema.py FSDP_RULES)"),
}


def config(*groups: str) -> ml_collections.ConfigDict:
    """A config of the `base` keys and those of `groups`, at their defaults."""
    return add_groups(ml_collections.ConfigDict(), "base", *groups)


def add_groups(c: ml_collections.ConfigDict, *groups: str) -> ml_collections.ConfigDict:
    """`c` with the keys of `groups` added at their defaults."""
    unknown = [g for g in groups if g not in GROUPS]
    if unknown:
        raise ValueError(f"unknown key groups {unknown}; known: {GROUPS}")
    for key, spec in KEYS.items():
        if spec.group in groups:
            _set(c, key, _fresh(spec.default))
    return c


def _fresh(default: Any) -> Any:
    if isinstance(default, ml_collections.FieldReference):
        return ml_collections.config_dict.placeholder(default.get_type())
    return dict(default) if isinstance(default, dict) else default


def _set(c: ml_collections.ConfigDict, key: str, value: Any) -> None:
    *sections, name = key.split(".")
    node = c
    for section in sections:
        if section not in node:
            node[section] = ml_collections.ConfigDict()
        node = node[section]
    node[name] = value
