"""The config checks that need this machine: its devices (role sizes, the fractional split, the
memory plan), its memory (a lower bound of the run's arrays), and files (converted checkpoints,
the embedding cache, the pretrained model's cache, `train.init_from`'s run). Each failure is one
line naming the key and what to do; `validation.validate_config` runs them in its order, before
any compute (`check_init_from` runs where the loop decides whether the run resumes instead)."""
from __future__ import annotations

import os
import tempfile
from typing import Any, Sequence

import jax
import ml_collections
import orbax.checkpoint as ocp

from digen_jax.app import run_sizing
from digen_jax.app import pretrain as pretrain_lib
from digen_jax.app.errors import ConfigError, RunStopped
from digen_jax.app.families import ZOO, read_model_json
from digen_jax.app.fingerprint import WEIGHT_KEYS, differences, fingerprint
from digen_jax.app.memory_bound import LATENT_BYTES, host_memory, ladder_copies, machine_memory, needs, size_text
from digen_jax.app.run_checkpoints import open_manager, read_meta
from digen_jax.app.settings import runtime_settings
from digen_jax.app.workdir import short_reason
from digen_jax.app.workload import pretrain_recipe
from digen_jax.models import FAMILIES
from digen_jax.models.checkpoints import MODEL_JSON
from digen_jax.runtime import memory_plan
from digen_jax.runtime import mesh as mesh_lib
from digen_jax.runtime import plan as plan_lib


def check_devices(config: ml_collections.ConfigDict, one_mode: bool) -> None:
    """The role sizes against the hosts' devices (meshes built, no compute), a fixed fractional
    `runtime.tag_microbatches` on the pieces those meshes allow, and (`one_mode`) the role sizes
    a colocated run would ignore."""
    rt, rl = config.runtime, config.rl
    try:
        meshes = mesh_lib.build_role_meshes(runtime_settings(config))
    except ValueError as e:
        raise ConfigError(str(e)) from None
    grain = mesh_lib.split_grain(meshes, rt.mode, rl.prompts_per_iteration * rl.group_size // rt.micro_batches)
    tag = rt.tag_microbatches
    if plan_lib.mode_flags(rt.mode).tag and tag >= 0 and abs(tag * grain - round(tag * grain)) > 1e-9:
        raise ConfigError(
            f"runtime.tag_microbatches={tag:g} is not a multiple of 1/{grain} micro-batch, the finest split of this run "
            f"({'several processes split whole micro-batches' if jax.process_count() > 1 else 'pieces of samples every role batch axis divides'}); "
            f"use a multiple of {1 / grain:g}, or -1 to choose from measured costs")
    if one_mode:
        _check_colocated_roles(config)


def check_pretrain_cache(config) -> None:
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


def check_shapes_checkpoint(config) -> None:
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


def check_zoo_inputs(config) -> None:
    """The converted transformer and VAE and the embedding cache a model-zoo run reads: there,
    and (the checkpoints) of the model family the config names."""
    c, d = config.model, config.data
    zoo = ZOO[c.family]
    missing = []
    checkpoints = [("model.checkpoint", c.checkpoint, (c.family,)),
                   ("model.vae_checkpoint", c.vae_checkpoint, zoo.vae_families)]
    if d.get("first_frames"):  # image conditioning encodes with the VAE's encoder
        checkpoints.append(("model.vae_encoder_checkpoint", c.get("vae_encoder_checkpoint"), ("vae_wan_encoder",)))
    if not c.random_init:
        for key, path, _ in checkpoints:
            if not path or not os.path.exists(os.path.join(path, MODEL_JSON)):
                missing.append(key)
    if not d.random_embeddings and (not d.embedding_cache or not os.path.isdir(d.embedding_cache)):
        missing.append("data.embedding_cache")
    if missing:
        raise ConfigError(_missing_inputs_message(config, missing))

    if not c.random_init:
        for key, path, accepted in checkpoints:
            found = read_model_json(path).get("family")
            if found not in accepted:
                raise ConfigError(f"{key}={path!r} holds a {found!r} model; model.family={c.family!r} needs "
                                  f"{' or '.join(map(repr, accepted))}")


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
        "model.vae_encoder_checkpoint": (
            "the converted VAE encoder (data.first_frames encodes the images with it)",
            f"python convert/diffusers_to_orbax.py --model_dir={pipeline}/vae --family=vae_wan_encoder --out=<DIR>"),
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


def _check_colocated_roles(config) -> None:
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


def check_memory(config: ml_collections.ConfigDict, abstract_params, lora_shapes: list[tuple[int, ...]],
                 latent_values: int, sample_keys: str, capacity: tuple[int, str] | None = None) -> None:
    """Raise ConfigError when the run's largest arrays (`needs`) exceed `capacity` (bytes,
    description; default `machine_memory()`), naming the largest and the key to lower."""
    items = needs(config, abstract_params, lora_shapes, latent_values, sample_keys)
    total = sum(n.nbytes for n in items)
    available, where = machine_memory() if capacity is None else capacity
    if total <= available:
        return
    top = max(items, key=lambda n: n.nbytes)
    fix = top.fix
    smallest_group = 2 * ladder_copies(config) * latent_values * LATENT_BYTES
    if top in items[2:] and smallest_group > available:  # fewer samples would not do: smaller ones
        fix = "lower " + " / ".join(key.split("=")[0] for key in sample_keys.split(" x "))
    raise ConfigError(f"the run needs at least {size_text(total)} of memory, more than the {size_text(available)} of "
                      f"{where}; {size_text(top.nbytes)} of it are {top.what}: {fix}")


def check_fits(config, devices: Sequence[Any], mode: str | None = None, host: float | None = None) -> None:
    """Refuse (ConfigError, one line) a config whose memory plan in `mode` (default `runtime.mode`)
    does not fit `devices` (a run's devices), or, in one process, whose host memory
    (`memory_plan.host_bytes`) does not fit this host's (`host` bytes: default its physical
    memory), before any compute. Not checked: CPU devices, kinds the device table lacks, the
    shapes task, and `runtime.check_memory=False`."""
    rt = config.runtime
    if not rt.get("check_memory", True):
        return
    mode = mode or rt.mode
    pools = run_sizing.local_pool(config, devices, mode)
    if pools is None:
        return
    work = run_sizing.iteration_work(config)
    line = memory_plan.advice(work, pools[0], mode, rt.micro_batches, colocated_devices=pools[1])
    if not line and jax.process_count() == 1:  # several processes: each holds its own devices' share
        plan = memory_plan.memory_plan(work, pools[0], mode, rt.micro_batches, colocated_devices=pools[1])
        line = memory_plan.host_advice(work, plan, host_memory() if host is None else host)
    if line:
        raise ConfigError(line)


def check_init_from(config: ml_collections.ConfigDict) -> tuple[ocp.CheckpointManager, int, dict]:
    """`train.init_from`'s checkpoint, checked before any compute: (its manager, step, meta).
    RunStopped when there is none or its weights cannot fit this run's (naming the keys)."""
    source = os.path.abspath(os.path.expanduser(config.train.init_from))
    if not os.path.isdir(os.path.join(source, "checkpoints")):
        raise RunStopped(f"train.init_from={config.train.init_from!r}: {source}/checkpoints does not exist "
                         "(it names the workdir of the run to start from)")
    manager = open_manager(source, config, read_only=True)
    step = manager.latest_step()
    if step is None:
        raise RunStopped(f"train.init_from={config.train.init_from!r}: {source}/checkpoints holds no checkpoint "
                         "(it names the workdir of the run to start from)")
    try:
        meta = read_meta(manager, step)
    except Exception as e:  # noqa: BLE001 (reported as what it is: an unreadable source)
        raise RunStopped(f"train.init_from={config.train.init_from!r}: checkpoint {step} cannot be read "
                         f"({short_reason(e)})") from e
    saved = meta.get("fingerprint")
    if saved is not None:
        diff = differences(saved, fingerprint(config), carried=False, keys=WEIGHT_KEYS)
        if diff:
            raise RunStopped(f"train.init_from={config.train.init_from!r}: the trainable weights of its checkpoint "
                             f"{step} do not fit this run's:\n  " + "\n  ".join(diff))
    return manager, step, meta
