"""Config validation: every check a config passes before any compute, each failure a
`ConfigError` that names the key and what to do (files, shapes, families, rewards, ranges, the
runtime section, LoRA targets, a lower bound of the run's memory)."""
from __future__ import annotations

import functools
import math
import os
import tempfile

import flax.linen as nn
import jax
import ml_collections
import numpy as np
from flax import traverse_util

from digen_jax import diffusion
from digen_jax.app import run_checkpoints
from digen_jax.app import pretrain as pretrain_lib
from digen_jax.app.config_ranges import check_ranges
from digen_jax.app.errors import ConfigError
from digen_jax.app.memory_bound import check_memory
from digen_jax.app.precision import decoupled_loss, validate_rollout_precision
from digen_jax.app.families import (DEPTH_KEYS, SIDE_MULTIPLE, TEMPORAL, ZOO, model_config, policy, read_model_json,
                                    latent_shape, side_multiple, vae_config)
from digen_jax.app.workload import is_shapes, open_cache, pretrain_recipe, shapes_task
from digen_jax.models import FAMILIES
from digen_jax.models.checkpoints import MODEL_JSON
from digen_jax.models.attention import check_seq_parallel
from digen_jax.rewards import registry
from digen_jax.rl import advantages as adv_lib
from digen_jax.rl import lora, losses
from digen_jax.rl.rollout import SamplerSpec
from digen_jax.rl.nft_trainer import NftConfig
from digen_jax.rl.timesteps import plan_steps, validate_nft_timesteps, validate_step_selection
from digen_jax.rl.trainer import ALGORITHMS, ONPOLICY_ANCHORS
from digen_jax.runtime import mesh as mesh_lib
from digen_jax.runtime import plan as plan_lib
from digen_jax.runtime.runtime_config import split_grain, validate_runtime_config


def validate_config(config: ml_collections.ConfigDict, *, this_machine: bool = True, one_mode: bool = True) -> None:
    """Reject a bad config before any compute, naming the offending key (raises ConfigError).

    this_machine: also reject a run whose largest arrays exceed the memory of this machine's
    devices and host (`memory_bound`); False checks the config alone (one written for others).
    one_mode: the config runs in its own `runtime.mode`, so role sizes that mode ignores are
    refused; False: it is run in several modes (the system bench), its role sizes serving the
    disaggregated ones."""
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
    try:
        adv_lib.validate_group_size(rl.group_size)
        adv_lib.validate_advantage_modes(rl.mean_mode, rl.std_mode)
        if rl.algorithm == "grpo":
            losses.validate_policy_loss(rl.policy_loss, config.sampling.sde_type, decoupled_loss(config)[0],
                                        config.sampling.noise_level)
            validate_step_selection(rl, config.sampling.num_steps)
        else:
            validate_nft_timesteps(rl, config.sampling.num_steps)
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
    if rl.micro_batch_size < 1 or per_update % rl.micro_batch_size:
        raise ConfigError(
            f"rl.micro_batch_size={rl.micro_batch_size} must divide the {per_update} training units of an update"
        )
    if rl.onpolicy_anchor not in ONPOLICY_ANCHORS:
        raise ConfigError(f"rl.onpolicy_anchor must be one of {ONPOLICY_ANCHORS}, got {rl.onpolicy_anchor!r}")
    if rl.lora_rank < 0:
        raise ConfigError(f"rl.lora_rank must be >= 0 (0 = full fine-tuning), got {rl.lora_rank}")
    if config.train.on_corrupt_checkpoint not in run_checkpoints.ON_CORRUPT:
        raise ConfigError(f"train.on_corrupt_checkpoint={config.train.on_corrupt_checkpoint!r} must be one of "
                          f"{run_checkpoints.ON_CORRUPT}")
    try:
        validate_runtime_config(config, len(jax.devices()))
        meshes = mesh_lib.build_role_meshes(config.runtime)  # role sizes against the hosts' devices (no compute)
        split_grain(config, meshes)  # a fixed fractional split on the pieces the meshes allow
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if one_mode:
        _validate_colocated_roles(config)
    _validate_model_size(config, this_machine)


def _validate_colocated_roles(config) -> None:
    """Role sizes a colocated run would ignore: rollout and reward share the train role's devices."""
    rt = config.runtime
    if not plan_lib.mode_flags(rt.mode).colocated:
        return
    for key in ("rollout_devices", "reward_devices"):
        if rt[key]:
            raise ConfigError(f"runtime.{key}={rt[key]} has no effect in runtime.mode={rt.mode!r}, where every role "
                              "shares the devices (runtime.train_devices picks how many): set it to 0, or choose a "
                              "disaggregated runtime.mode")
    if rt.train_devices > len(jax.devices()):
        raise ConfigError(f"runtime.train_devices={rt.train_devices} exceeds the {len(jax.devices())} devices "
                          "(0: all of them)")


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
        check_memory(config, abstract, lora_shapes, *_per_sample(config))


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
    plan = plan_steps(config.rl, config.sampling.num_steps, 1.0, 1, 0, np.random.default_rng(0))
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
        _validate_shapes_checkpoint(config)
    _transformer_config(config)  # model.arch with the model policy
    if not config.model.checkpoint:
        _validate_pretrain_cache(config)


def _validate_pretrain_cache(config) -> None:
    """`pretrain.cache_dir` must take the pretrained model unless it holds it already: checked
    before pretraining, not after it."""
    model_cfg, task, args = pretrain_recipe(config)
    key = f"pretrain.cache_dir={config.pretrain.cache_dir!r}"
    path = pretrain_lib.cache_path(model_cfg, task, config.pretrain.cache_dir, **args)
    if pretrain_lib.is_cached(path):
        return
    existing = os.path.dirname(path)  # the nearest folder that exists: pretraining makes the rest in it
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    try:
        os.rmdir(tempfile.mkdtemp(dir=existing))  # no trace left
    except OSError as e:
        raise ConfigError(f"{key} cannot be written ({e.strerror or e}): the pretrained base model is saved there; "
                          "give a writable directory") from None


# What ties a transformer to the shapes task: packed pixel tokens in and out, the text encoder's widths.
_SHAPES_INTERFACE = ("in_channels", "out_dim", "joint_attention_dim", "pooled_projection_dim")


def _validate_shapes_checkpoint(config) -> None:
    """`model.checkpoint` of the shapes task: a converted model of `model.family` whose inputs and
    outputs are the task's (the architecture of `model.arch` there; its depth and width are free)."""
    c = config.model
    key = f"model.checkpoint={c.checkpoint!r}"
    if not os.path.exists(os.path.join(c.checkpoint, MODEL_JSON)):
        raise ConfigError(f"{key} holds no converted model ({MODEL_JSON} missing): give a directory written by "
                          "convert/diffusers_to_orbax.py, or leave it empty to pretrain on the task")
    meta = read_model_json(c.checkpoint)
    if meta.get("family") != c.family:
        raise ConfigError(f"{key} holds a {meta.get('family')!r} model; the shapes task trains "
                          f"model.family={c.family!r}")
    family = FAMILIES[c.family]
    try:
        found = family.config_from_diffusers(meta["config"])
        wanted = family.config_cls(**c.arch.to_dict())
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{key}: {e}") from None
    differ = [f"{name}={getattr(found, name)} (the task needs {getattr(wanted, name)})"
              for name in _SHAPES_INTERFACE if getattr(found, name) != getattr(wanted, name)]
    if differ:
        raise ConfigError(f"{key} does not fit the shapes task: {', '.join(differ)}; the task packs "
                          "pixels 2x2 into 12 channels and encodes prompts at model.arch's widths")

def _missing_inputs_message(config, missing: list[str]) -> str:
    zoo = ZOO[config.model.family]
    pipeline = f"<{zoo.title} diffusers folder>"
    how = {
        "model.checkpoint": (
            "the converted transformer",
            f"python convert/diffusers_to_orbax.py --model_dir={pipeline}/transformer --out=<DIR> --dtype=bfloat16"),
        "model.vae_checkpoint": (
            "the converted VAE",
            f"python convert/diffusers_to_orbax.py --model_dir={pipeline}/vae --out=<DIR>"),
        "data.embedding_cache": (
            "the prompt-embedding cache",
            f"python convert/encode_prompts.py --family={zoo.name} --prompts=<prompts.txt> "
            f"--encoder_dir={pipeline} --out=<DIR> --device=cuda"),
    }
    lines = [f"model.family={zoo.name!r} needs inputs that are not there:"]
    for key in missing:
        what, command = how[key]
        value = config[key.split(".")[0]][key.split(".")[1]]
        if not value:
            state = " is not set"
        elif os.path.isdir(value):
            state = f"={value!r} holds no {MODEL_JSON} (not a converted checkpoint)"
        else:
            state = f"={value!r} does not exist"
        lines += [f"  {key}{state}: {what}. Make it with", f"      {command}",
                  f"    then pass --config.{key}=<DIR>"]
    lines.append("Or, for a throughput run without weights or text encoders: "
                 "--config.model.random_init=True --config.data.random_embeddings=True")
    return "\n".join(lines)


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

    missing = []
    if not c.random_init:
        for key, path in (("model.checkpoint", c.checkpoint), ("model.vae_checkpoint", c.vae_checkpoint)):
            if not path or not os.path.exists(os.path.join(path, MODEL_JSON)):
                missing.append(key)
    if not d.random_embeddings and (not d.embedding_cache or not os.path.isdir(d.embedding_cache)):
        missing.append("data.embedding_cache")
    if missing:
        raise ConfigError(_missing_inputs_message(config, missing))

    if not c.random_init:
        for key, path, accepted in (("model.checkpoint", c.checkpoint, (c.family,)),
                                    ("model.vae_checkpoint", c.vae_checkpoint, zoo.vae_families)):
            found = read_model_json(path).get("family")
            if found not in accepted:
                raise ConfigError(f"{key}={path!r} holds a {found!r} model; model.family={c.family!r} needs "
                                  f"{' or '.join(map(repr, accepted))}")
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
