"""Config validation: every check of a config's values and of how they combine, before any
compute, each failure a `ConfigError` that names the key and what to do. `validate_config` runs
them all, once per run: the value tables (`config_ranges`), the workload (shapes, families,
rewards), the algorithm, the rollout precision, the runtime section, LoRA targets, and the
checks that need this machine (`machine_checks`: devices, memory, files).

The pure layers (rl/, runtime/, models/) keep only assertions on their own functions' arguments
(`advantages.validate_advantage_modes`, `lora.check_lora_mode`, `fp8.check_rollout_precision`,
`attention.check_seq_parallel`, `rewards.registry.validate_reward_config`): a library call with a
bad argument fails there whoever calls it; this module calls them once on the config's values.
"""
from __future__ import annotations

import copy
import functools
import math
import os
from typing import Sequence

import flax.linen as nn
import jax
import ml_collections
import numpy as np
from flax import traverse_util

from digen_jax import diffusion
from digen_jax.app import machine_checks, renamed_keys, run_checkpoints
from digen_jax.app.config_ranges import check_ranges
from digen_jax.app.errors import ConfigError
from digen_jax.app.precision import decoupled_loss, lora_base_precision, rollout_precision
from digen_jax.app.settings import step_settings
from digen_jax.app.families import (DEPTH_KEYS, SIDE_MULTIPLE, TEMPORAL, ZOO, model_config, policy, read_model_json,
                                    latent_shape, side_multiple, vae_config)
from digen_jax.app.workload import is_shapes, open_cache, pretrain_recipe, shapes_task
from digen_jax.data import first_frames
from digen_jax.models import FAMILIES, fp8
from digen_jax.models.attention import check_seq_parallel
from digen_jax.rewards import registry
from digen_jax.rl import advantages as adv_lib
from digen_jax.rl import lora
from digen_jax.rl.losses import GRPO_GUARD_SDE_TYPES, POLICY_LOSSES
from digen_jax.rl.rollout import SamplerSpec
from digen_jax.rl.nft_trainer import NftConfig
from digen_jax.rl.timesteps import STEP_SELECTIONS, nft_num_trained, num_trained, plan_steps
from digen_jax.rl.trainer import ALGORITHMS, ONPOLICY_ANCHORS
from digen_jax.runtime import plan as plan_lib
from digen_jax.runtime.memory_plan import COLOCATED_SAMPLING, TAG_PRECISION


def validate_config(config: ml_collections.ConfigDict, *, this_machine: bool = True, one_mode: bool = True,
                    modes: Sequence[str] | None = None) -> None:
    """Reject a bad config before any compute, naming the offending key (raises ConfigError).

    this_machine: also reject a run whose largest arrays exceed the memory of this machine's
    devices and host (`memory_bound`), or whose memory plan does not fit its devices
    (`machine_checks.check_fits`); False checks the config alone (one written for others).
    one_mode: the config runs in its own `runtime.mode`, so role sizes that mode ignores are
    refused; False: it is run in several modes (the system bench), its role sizes serving the
    disaggregated ones. modes: the schedule modes it runs in, each one's runtime section, role
    meshes and memory plan checked (default: `runtime.mode`). A key set under its old name is
    moved to the new one first (`renamed_keys.resolve`, one warning line)."""
    renamed_keys.resolve(config)
    check_ranges(config)
    _validate_workload(config)
    try:
        registry.validate_reward_config(dict(config.reward.weights))
        adv_lib.validate_reward_mix(config.reward.get("mix", "reward"))
    except ValueError as e:
        raise ConfigError(str(e)) from None
    rl = config.rl
    _validate_algorithm(config)
    validate_rollout_precision(config)
    validate_group_size(rl.group_size)
    try:
        adv_lib.validate_advantage_modes(rl.mean_mode, rl.std_mode)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if rl.algorithm == "grpo":
        validate_policy_loss(rl.policy_loss, config.sampling.sde_type, decoupled_loss(config)[0],
                             config.sampling.noise_level)
        validate_step_selection(rl, config.sampling.num_steps)
    else:
        validate_nft_timesteps(rl, config.sampling.num_steps)
    try:
        if rl.algorithm != "grpo":
            NftConfig(rl.nft_solver, rl.nft_beta, rl.nft_decay)
        SamplerSpec(config.sampling.sde_type, config.sampling.cfg_scale, config.sampling.cfg_rescale)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if rl.prompts_per_iteration < 1:
        raise ConfigError(f"rl.prompts_per_iteration must be >= 1, got {rl.prompts_per_iteration}")
    batch = rl.prompts_per_iteration * rl.group_size
    if rl.num_updates_per_batch < 1 or batch % rl.num_updates_per_batch:
        raise ConfigError(
            f"rl.num_updates_per_batch={rl.num_updates_per_batch} must divide the {batch} samples of an iteration"
        )
    per_update = batch // rl.num_updates_per_batch * _trained_per_sample(config)
    if rl.grad_chunk_size < 1 or per_update % rl.grad_chunk_size:
        raise ConfigError(
            f"rl.grad_chunk_size={rl.grad_chunk_size} must divide the {per_update} training units of an update"
        )
    if rl.onpolicy_anchor not in ONPOLICY_ANCHORS:
        raise ConfigError(f"rl.onpolicy_anchor must be one of {ONPOLICY_ANCHORS}, got {rl.onpolicy_anchor!r}")
    if rl.lora_rank < 0:
        raise ConfigError(f"rl.lora_rank must be >= 0 (0 = full fine-tuning), got {rl.lora_rank}")
    if config.train.on_corrupt_checkpoint not in run_checkpoints.ON_CORRUPT:
        raise ConfigError(f"train.on_corrupt_checkpoint={config.train.on_corrupt_checkpoint!r} must be one of "
                          f"{run_checkpoints.ON_CORRUPT}")
    modes = (config.runtime.mode,) if modes is None else tuple(modes)
    for mode in modes:
        mode_config = config
        if mode != config.runtime.mode:
            mode_config = copy.deepcopy(config)
            mode_config.runtime.mode = mode
        validate_runtime_config(mode_config, len(jax.devices()))
        machine_checks.check_devices(mode_config, one_mode)
    _validate_model_size(config, this_machine)
    if this_machine:
        for mode in modes:  # a run that cannot fit its devices: one line
            machine_checks.check_fits(config, jax.devices(), mode)  # runtime.check_memory=False skips it


def validate_runtime_config(config, num_devices: int) -> None:
    """Reject a bad `runtime` section (against the batch and `num_devices` devices), naming the key."""
    rt, rl = config.runtime, config.rl
    flags = plan_lib.mode_flags(rt.mode)
    if rt.micro_batches < 1 or rl.prompts_per_iteration % rt.micro_batches:
        raise ConfigError(
            f"runtime.micro_batches={rt.micro_batches} must divide rl.prompts_per_iteration={rl.prompts_per_iteration}"
            " (micro-batches hold whole groups)"
        )
    sampling = rt.get("colocated_sampling", "auto")
    if sampling not in COLOCATED_SAMPLING:
        raise ConfigError(f"runtime.colocated_sampling={sampling!r} is not one of "
                          f"{', '.join(repr(v) for v in COLOCATED_SAMPLING)}")
    precision = rt.get("tag_precision", "auto")
    if precision not in TAG_PRECISION:
        raise ConfigError(f"runtime.tag_precision={precision!r} is not one of {', '.join(repr(v) for v in TAG_PRECISION)}")
    if rt.staleness < 0:
        raise ConfigError(f"runtime.staleness must be >= 0, got {rt.staleness}")
    if rl.num_updates_per_batch < 1 or rt.micro_batches % rl.num_updates_per_batch:
        raise ConfigError(
            f"rl.num_updates_per_batch={rl.num_updates_per_batch} must divide runtime.micro_batches={rt.micro_batches}"
            " (each update trains an equal share of whole micro-batches)"
        )
    for key in ("tag_microbatches", "prefetch_microbatches"):
        value = rt[key]
        if value > rt.micro_batches:
            raise ConfigError(f"runtime.{key}={value:g} exceeds runtime.micro_batches={rt.micro_batches}")
    # The micro-batches prefetched in one iteration are carried into the next, whose trainer
    # rollouts come from the rest (`plan.plan_iteration`); -1 (elastic) is chosen to fit.
    tag = rt.tag_microbatches if flags.tag else 0
    prefetch = rt.prefetch_microbatches if flags.tcss and rt.staleness > 0 else 0
    if tag >= 0 and prefetch >= 0 and tag + prefetch > rt.micro_batches:
        raise ConfigError(
            f"runtime.tag_microbatches={tag:g} + runtime.prefetch_microbatches={prefetch} exceed runtime.micro_batches="
            f"{rt.micro_batches}: the next iteration's prefetched micro-batches leave only "
            f"{rt.micro_batches - prefetch} for its trainer rollouts (lower one, or use -1 to choose from measured costs)"
        )
    units = rl.prompts_per_iteration * rl.group_size // rt.micro_batches * _trained_per_sample(config)
    if (flags.colocated or flags.tsp) and units % rl.grad_chunk_size:
        raise ConfigError(
            f"rl.grad_chunk_size={rl.grad_chunk_size} must divide the {units} training units of a micro-batch "
            f"(runtime.micro_batches={rt.micro_batches})"
        )
    for key in ("rollout_devices", "train_devices", "reward_devices"):
        if rt[key] < 0:
            raise ConfigError(f"runtime.{key} must be >= 0, got {rt[key]}")
    if rt.reward_devices and not flags.colocated and jax.process_count() > 1:
        # Both groups' threads would issue programs onto the reward devices, in no fixed order
        # between processes (docs/design.md section 2).
        raise ConfigError(
            f"runtime.reward_devices={rt.reward_devices} needs a single process; with {jax.process_count()} processes "
            "set runtime.reward_devices=0 (rewards are scored where the samples are decoded)"
        )
    wanted = rt.rollout_devices + rt.train_devices + rt.reward_devices
    if not flags.colocated and wanted > num_devices:
        raise ConfigError(
            f"runtime.rollout_devices + train_devices + reward_devices = {wanted} exceeds the {num_devices} devices"
        )


def validate_bench_arguments(config, modes: Sequence[str], *, warmups: int, iterations: int,
                             onpolicy_anchors: Sequence[str] = ()) -> None:
    """A `ConfigError` naming the flag or key if the system bench cannot run `config` in these
    modes, iterations and anchors: the config once, and each mode's runtime section, role meshes
    and memory plan (`validate_config` with `modes`; its role sizes serve every mode)."""
    for mode in modes:
        try:
            plan_lib.mode_flags(mode)
        except ValueError as e:
            raise ConfigError(f"--modes: {e}") from None
    if onpolicy_anchors and config.rl.get("algorithm", "grpo") == "nft":
        raise ConfigError("--onpolicy_anchors compares rl.onpolicy_anchor values, which play no part in "
                          "rl.algorithm='nft' (no log-prob ratio)")
    if warmups < 0 or iterations < 1:
        raise ConfigError(f"--warmup_iterations must be >= 0 and --iterations >= 1, got {warmups}, {iterations}")
    validate_config(config, one_mode=False, modes=modes)


def validate_group_size(group_size: int) -> None:
    """`rl.group_size` an int >= 2: a group of one sample equals its own mean, so its advantage is
    identically 0 and it contributes no gradient; such a run would train on nothing."""
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 2:
        raise ConfigError(
            f"rl.group_size must be an int >= 2, got {group_size!r}: group-relative advantages "
            "of a one-sample group are always 0, so nothing would be learned"
        )


def validate_step_selection(rl, num_steps: int) -> None:
    """`rl.step_selection` and its window or fraction inside the trainable ladder (`rl.timesteps`)."""
    mode = rl.step_selection
    if mode not in STEP_SELECTIONS:
        raise ConfigError(f"rl.step_selection must be one of {STEP_SELECTIONS}, got {mode!r}")
    if mode in ("fraction", "random"):
        pool = num_steps if mode == "fraction" else num_steps - 1
        t = num_trained(rl.timestep_fraction, pool)
        if not 0 < rl.timestep_fraction <= 1 or t < 1:
            raise ConfigError(
                f"rl.timestep_fraction={rl.timestep_fraction} trains {t} of sampling.num_steps={num_steps} steps; "
                "it must select at least one step and be in (0, 1]"
            )
        if mode == "fraction" and t > num_steps - 1:
            raise ConfigError(
                f"rl.timestep_fraction={rl.timestep_fraction} trains the last step of sampling.num_steps={num_steps} "
                "(sigma'=0, transition std ~0); use a fraction < 1 (Flow-GRPO uses 0.99)"
            )
        return
    size = rl.sde_window_size
    lo, hi = rl.sde_window_range
    if size < 1 or lo < 0 or hi - lo < size or hi > num_steps - 1:
        raise ConfigError(
            f"rl.sde_window_size={size} in rl.sde_window_range=({lo}, {hi}) must fit inside the trainable steps "
            f"[0, {num_steps - 1}) of sampling.num_steps={num_steps} (the last step is never trained)"
        )
    if mode == "mixgrpo" and rl.window_shift_every < 1:
        raise ConfigError(f"rl.window_shift_every must be >= 1, got {rl.window_shift_every}")


def validate_nft_timesteps(rl, num_steps: int) -> None:
    """DiffusionNFT's K noise levels per sample in [1, sampling.num_steps]."""
    k = nft_num_trained(rl, num_steps)
    if not 1 <= k <= num_steps:
        raise ConfigError(
            f"rl.nft_timesteps={rl.nft_timesteps} (rl.timestep_fraction={rl.timestep_fraction} where 0) trains {k} "
            f"noise levels per sample; it must be in [1, sampling.num_steps={num_steps}]")


def validate_policy_loss(policy_loss: str, sde_type: str, decoupled: bool, noise_level: float) -> None:
    """`rl.policy_loss` against the sampler and the loss's anchor (`rl.losses`)."""
    if policy_loss not in POLICY_LOSSES:
        raise ConfigError(f"rl.policy_loss must be one of {POLICY_LOSSES}, got {policy_loss!r}")
    if policy_loss != "grpo_guard":
        return
    if sde_type not in GRPO_GUARD_SDE_TYPES:
        raise ConfigError(
            f"rl.policy_loss='grpo_guard' needs sampling.sde_type in {GRPO_GUARD_SDE_TYPES}, got {sde_type!r}: "
            "its ratio normalisation assumes a Gaussian step with std g * sqrt(-Delta)"
        )
    if decoupled:
        raise ConfigError(
            "rl.policy_loss='grpo_guard' takes its ratio against the behaviour policy (log-prob and mean "
            "recorded at rollout); set rl.decoupled=False"
        )
    if not noise_level > 0:
        raise ConfigError(
            f"rl.policy_loss='grpo_guard' divides by the transition std: sampling.noise_level must be > 0, "
            f"got {noise_level}"
        )


def validate_rollout_precision(config: ml_collections.ConfigDict) -> None:
    """Reject an unknown `model.rollout_precision` or `model.lora_base_precision`, FP8 rollouts
    with LoRA merged for sampling (FP8 keeps the adapters factored in their own dtype on top of
    the FP8 base), and an FP8 base without LoRA or without FP8 rollouts (`precision`)."""
    precision = rollout_precision(config)
    try:
        fp8.check_rollout_precision(precision)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    rl = config.rl
    if precision == "fp8" and rl.lora_rank and rl.lora_merge_for_sampling:
        raise ConfigError("model.rollout_precision='fp8' applies LoRA adapters factored, in their own dtype, on "
                          "top of the FP8 base; it cannot merge them into it: set rl.lora_merge_for_sampling=False")
    base = lora_base_precision(config)
    if base not in fp8.ROLLOUT_PRECISIONS:
        raise ConfigError(f"model.lora_base_precision must be one of {fp8.ROLLOUT_PRECISIONS}, got {base!r}")
    if base == "fp8" and not rl.lora_rank:
        raise ConfigError("model.lora_base_precision='fp8' trains LoRA adapters through a frozen FP8 base; full "
                          "fine-tuning (rl.lora_rank=0) trains the weights themselves: set model.lora_base_precision='bf16'")
    if base == "fp8" and precision != "fp8":
        raise ConfigError("model.lora_base_precision='fp8' holds only the FP8 base, which the rollouts sample with "
                          "too: set model.rollout_precision='fp8' as well")


@functools.lru_cache(maxsize=4)
def _abstract_params(family: str, model_cfg) -> dict:
    """The transformer's unboxed parameter shapes (traced, no FLOPs; validation runs more than once)."""
    return nn.unbox(FAMILIES[family].abstract_params(model_cfg))


def _transformer_config(config):
    """The run's transformer config (architecture and policy), read without weights."""
    c = config.model
    if not is_shapes(config):
        return model_config(config)  # checked by _validate_zoo
    try:
        if c.checkpoint:
            return FAMILIES[c.family].config_from_diffusers(read_model_json(c.checkpoint)["config"], **policy(config))
        return pretrain_recipe(config)[0]
    except (ValueError, TypeError) as e:
        raise ConfigError(f"model.arch: {e}") from None


def _per_sample(config) -> tuple[int, str]:
    """(latent values of one sample, the keys that set them)."""
    s = config.sampling
    if is_shapes(config):
        return (config.task.resolution // 2) ** 2 * 12, f"task.resolution={config.task.resolution}"
    keys = f"sampling.height={s.height} x sampling.width={s.width}"
    if ZOO[config.model.family].video:
        keys += f" x sampling.num_frames={s.num_frames}"
    return math.prod(latent_shape(config, vae_config(config))), keys


def _validate_model_size(config, this_machine: bool) -> None:
    """The transformer's config, the kernels `rl.lora_targets` adapt and `rl.lora_rank`, then
    (`this_machine`) the memory the run's largest arrays need (`memory_bound`)."""
    model_cfg = _transformer_config(config)
    try:
        abstract = _abstract_params(config.model.family, model_cfg)
    except TypeError:  # an unhashable config field: trace it uncached
        abstract = _abstract_params.__wrapped__(config.model.family, model_cfg)
    except ValueError as e:
        raise ConfigError(f"model: {e}") from None
    lora_shapes = []
    rl = config.rl
    if rl.lora_rank:
        try:
            paths = lora.match_lora_targets(abstract, list(rl.lora_targets))
        except ValueError as e:
            raise ConfigError(f"rl.lora_targets={tuple(rl.lora_targets)!r}: {e}") from None
        flat = traverse_util.flatten_dict(abstract, sep="/")
        lora_shapes = [flat[p].shape for p in paths]
        widest = max(min(shape[-2:]) for shape in lora_shapes)
        if rl.lora_rank > widest:
            raise ConfigError(f"rl.lora_rank={rl.lora_rank} exceeds {widest}, the full rank of the largest kernel "
                              f"rl.lora_targets adapts: a higher rank adds parameters and nothing else; use "
                              f"rl.lora_rank <= {widest}, or 0 to fine-tune every weight")
    if this_machine:
        machine_checks.check_memory(config, abstract, lora_shapes, *_per_sample(config))


def _validate_algorithm(config) -> None:
    """`rl.algorithm`, and what DiffusionNFT rules out: true CFG in its rollouts and the GRPO-only
    off-policy corrections (it has no log-probs to correct)."""
    rl = config.rl
    if rl.algorithm not in ALGORITHMS:
        raise ConfigError(f"rl.algorithm={rl.algorithm!r} is unknown; use one of {ALGORITHMS} "
                          "('grpo': the Flow-GRPO family, 'nft': DiffusionNFT)")
    if rl.algorithm != "nft":
        return
    if config.sampling.cfg_scale != 1.0:
        raise ConfigError(f"sampling.cfg_scale={config.sampling.cfg_scale}: rl.algorithm='nft' samples without "
                          "classifier-free guidance; set sampling.cfg_scale=1")
    if rl.decoupled or rl.policy_loss != "ppo":
        raise ConfigError(f"rl.decoupled={rl.decoupled} / rl.policy_loss={rl.policy_loss!r} correct GRPO's "
                          "log-prob ratio, which rl.algorithm='nft' does not have; set rl.decoupled=False and "
                          "rl.policy_loss='ppo'")


def _trained_per_sample(config) -> int:
    plan = plan_steps(step_settings(config), config.sampling.num_steps, 1.0, 1, 0, np.random.default_rng(0))
    return plan.trained.shape[1]


def _validate_reward_options(config: ml_collections.ConfigDict) -> None:
    options = config.reward.get("options") or {}
    for name, kwargs in options.items():
        if name not in config.reward.weights:
            raise ConfigError(f"reward.options names {name!r}, which is not in reward.weights "
                              f"{sorted(dict(config.reward.weights))}: options belong to a weighted reward")
        if not isinstance(kwargs, (dict, ml_collections.ConfigDict)):
            raise ConfigError(f"reward.options[{name!r}] must map option names to values, got {kwargs!r}")

def _validate_shapes(config) -> None:
    if config.model.family not in FAMILIES:
        raise ConfigError(f"model.family={config.model.family!r} is unknown; known: {sorted(FAMILIES)}")
    if config.task.name != "shapes":
        raise ConfigError(f"task.name={config.task.name!r} is unknown; known: ['shapes']")
    if config.sampling.cfg_scale != 1.0:
        raise ConfigError("sampling.cfg_scale: the shapes task has no negative prompt; use 1 (embedded guidance)")
    try:
        shapes_task(config)
    except ValueError as e:
        raise ConfigError(f"task: {e}") from None
    if config.model.checkpoint:
        machine_checks.check_shapes_checkpoint(config)
    _transformer_config(config)  # model.arch with the model policy
    if not config.model.checkpoint:
        machine_checks.check_pretrain_cache(config)


def _validate_zoo(config) -> None:
    c, s, d = config.model, config.sampling, config.data
    if c.family not in ZOO:
        raise ConfigError(f"model.family={c.family!r} is unknown; known: {sorted(ZOO)}")
    zoo = ZOO[c.family]
    if c.random_init and c.variant not in zoo.transformer.variants:
        raise ConfigError(f"model.variant={c.variant!r} is unknown for {c.family}; "
                          f"known: {sorted(zoo.transformer.variants)}")
    for key in DEPTH_KEYS:
        depth = c.get(key, 0)
        if depth and not c.random_init:
            raise ConfigError(f"model.{key}={depth} shortens random-weight models only (model.random_init=True); "
                              "a converted checkpoint has its own depth")
        if depth and not hasattr(zoo.transformer.variants[c.variant], key):
            raise ConfigError(f"model.{key}={depth}: {c.family} has no {key}")
        if not isinstance(depth, int) or depth < 0:
            raise ConfigError(f"model.{key} must be an integer >= 0 (0: the variant's depth), got {depth!r}")
    for key in ("height", "width"):
        value = s[key]
        if not isinstance(value, int) or value <= 0 or value % SIDE_MULTIPLE:
            raise ConfigError(f"sampling.{key}={value!r} must be a positive multiple of {SIDE_MULTIPLE} "
                              f"(the VAE's 8x downsampling, then 2x2 packing or patches)")
    if zoo.video and (not isinstance(s.num_frames, int) or s.num_frames < 1 or (s.num_frames - 1) % TEMPORAL):
        raise ConfigError(f"sampling.num_frames={s.num_frames!r} must be 4k+1 (1, 5, ..., 33, ..., 81): "
                          "the causal video VAE decodes k+1 latent frames into 4k+1")
    if s.cfg_scale != 1.0 and zoo.embedding["negative"] is None:
        raise ConfigError(f"sampling.cfg_scale={s.cfg_scale}: {c.family} uses embedded guidance (sampling.guidance), "
                          "not true CFG; set sampling.cfg_scale=1")
    positive = (("reward.frame_stride", config.reward.frame_stride), ("model.vae_decode_batch", c.vae_decode_batch))
    for key, value in positive:
        if not isinstance(value, int) or value < 1:
            raise ConfigError(f"{key} must be a positive integer, got {value!r}")
    try:
        diffusion.sigma_ladder(s.ladder, s.num_steps, image_seq_len=256, **s.ladder_options.to_dict())
    except ValueError as e:
        raise ConfigError(f"sampling.ladder / sampling.ladder_options / sampling.num_steps: {e}") from None

    machine_checks.check_zoo_inputs(config)
    try:
        model_cfg, vae_cfg = model_config(config), vae_config(config)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"model: {e}") from None
    try:
        SamplerSpec(s.sde_type, s.cfg_scale, s.cfg_rescale, s.get("cfg_scale_2"),
                    getattr(model_cfg, "boundary_timestep", None))
    except ValueError as e:
        raise ConfigError(str(e)) from None
    side = side_multiple(vae_cfg)
    for key in ("height", "width"):
        if s[key] % side:
            raise ConfigError(f"sampling.{key}={s[key]} must be a multiple of {side} for this VAE "
                              f"({side // 2}x downsampling, then 2x2 patches)")
    shape = latent_shape(config, vae_cfg)
    model_in = getattr(model_cfg, zoo.latent_dim)
    if model_in != (shape[1] if not zoo.video else shape[0]):
        raise ConfigError(f"the transformer (model.checkpoint / model.variant) takes {model_in} latent channels but "
                          f"the VAE (model.vae_checkpoint) gives latents of shape {shape}: they are not one model's")

    _validate_seq_parallel(config, model_cfg, shape)
    _validate_first_frames(config, model_cfg, vae_cfg)

    text_dim = getattr(model_cfg, zoo.text_dim)
    pooled_dim = getattr(model_cfg, zoo.pooled_dim) if zoo.pooled_dim else None
    if d.random_embeddings:
        text_len, key = d.text_len, "data.text_len"
        if d.num_prompts < 1:
            raise ConfigError(f"data.num_prompts must be >= 1, got {d.num_prompts}")
    else:
        cache = open_cache(config)
        made_by = [str(cache.meta[k]) for k in ("encoders", "encoder_dir") if k in cache.meta]
        source = f" (encoded by {', '.join(made_by)})" if made_by else ""
        if (cache.text_dim, cache.pooled_dim) != (text_dim, pooled_dim):
            raise ConfigError(
                f"data.embedding_cache={d.embedding_cache!r} was made for another model{source}: text dim "
                f"{cache.text_dim}, pooled dim {cache.pooled_dim}; this {c.family} model takes {text_dim} and "
                f"{pooled_dim}. Encode the prompts with this model's text encoders")
        if s.cfg_scale != 1.0 and not cache.has_negative:
            raise ConfigError(f"data.embedding_cache={d.embedding_cache!r} stores no negative prompt, which "
                              f"sampling.cfg_scale={s.cfg_scale} (true CFG) needs; re-encode without --no_negative")
        text_len, key = cache.text_len, f"data.embedding_cache={d.embedding_cache!r}: its text length"
    if not 1 <= text_len <= zoo.text_cap:
        raise ConfigError(f"{key} {text_len} is over the {c.family} text cap of {zoo.text_cap} tokens "
                          "(or below 1)")

def _validate_first_frames(config, model_cfg, vae_cfg) -> None:
    """`data.first_frames` (videos that start from an image): a Wan2.2 model of one transformer
    (TI2V), the Flow-GRPO trainer, an image for every prompt and an encoder of the run's VAE."""
    c, d, s = config.model, config.data, config.sampling
    source = d.get("first_frames")
    if not source:
        return
    if c.family != "wan22" or model_cfg.boundary_ratio is not None:
        raise ConfigError(f"data.first_frames={source!r}: image conditioning is Wan2.2-TI2V's (model.family='wan22', "
                          "one transformer); unset it for this model")
    if config.rl.algorithm != "grpo":
        raise ConfigError(f"data.first_frames={source!r} trains with rl.algorithm='grpo' only (DiffusionNFT's ODE "
                          "rollouts do not keep a first frame)")
    if source != first_frames.SYNTHETIC:
        if not os.path.isfile(source):
            raise ConfigError(f"data.first_frames={source!r} is not a file: give '{first_frames.SYNTHETIC}' or a text "
                              "file with one image path per line of the prompt file")
        ids = range(d.num_prompts) if d.random_embeddings else open_cache(config).prompt_ids
        try:
            first_frames.ImageList(source, s.height, s.width).check(ids)
        except ValueError as e:
            raise ConfigError(f"data.first_frames: {e}") from None
    if not c.random_init:
        encoder = FAMILIES["vae_wan_encoder"].config_from_diffusers(read_model_json(c.vae_encoder_checkpoint)["config"])
        if encoder.z_dim != vae_cfg.z_dim:
            raise ConfigError(f"model.vae_encoder_checkpoint={c.vae_encoder_checkpoint!r} encodes {encoder.z_dim} "
                              f"latent channels; the VAE (model.vae_checkpoint) decodes {vae_cfg.z_dim}: convert the "
                              "encoder of the same VAE")


def _validate_seq_parallel(config, model_cfg, latent_shape) -> None:
    """`runtime.seq_parallel` against the model: a video family, its heads and video tokens divisible."""
    seq = config.runtime.get("seq_parallel", 1)
    if seq == 1:
        return
    zoo = ZOO[config.model.family]
    if not zoo.video:
        raise ConfigError(f"runtime.seq_parallel={seq}: sequence parallelism is built for the video families "
                          f"({', '.join(sorted(f for f in ZOO if ZOO[f].video))}), not {config.model.family}; set it to 1")
    tokens = int(np.prod(latent_shape[1:])) // int(np.prod(model_cfg.patch))
    try:
        check_seq_parallel(model_cfg.num_attention_heads, tokens, seq)
    except ValueError as e:
        raise ConfigError(f"runtime.seq_parallel={seq}: {e}") from None


def _validate_workload(config: ml_collections.ConfigDict) -> None:
    """The workload part of config validation: files, shapes, families and reward options, no device work."""
    if is_shapes(config) and config.runtime.get("seq_parallel", 1) != 1:
        raise ConfigError(f"runtime.seq_parallel={config.runtime.seq_parallel}: sequence parallelism is built for "
                          "the video families, not the shapes task; set it to 1")
    (_validate_shapes if is_shapes(config) else _validate_zoo)(config)
    _validate_reward_options(config)
