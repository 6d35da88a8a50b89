"""The run fingerprint: the config keys that shape the train state (model family, variant and
depth, the base model's identity, parameter dtype and block layout, LoRA rank/alpha/targets or full
fine-tuning, EMA, the optimizer's structure) and those that shape the prefetched micro-batches a
checkpoint may carry. Every checkpoint stores it in its `meta` item; a resume whose config
differs stops before any compute, naming each key and both values (run_checkpoints.py).
`train.init_from` is the deliberate way to start a new run from another run's weights
(warm_start.py): only `WEIGHT_KEYS` must match there.
"""
from __future__ import annotations

import json

import ml_collections

from digen_jax.app import workload as workload_lib
from digen_jax.app.settings import lora_alpha

# Keys that shape the micro-batches a checkpoint carries (compared only when it carries some).
_CARRIED_KEYS = ("task.resolution", "sampling.height", "sampling.width", "sampling.num_frames", "sampling.num_steps",
                 "rl.prompts_per_iteration", "rl.group_size", "runtime.micro_batches", "runtime.mode")
# Keys that must match for another run's trainable weights to fit this run's.
WEIGHT_KEYS = ("model.family", "model.variant", "model.num_layers", "model.num_single_layers", "model.scan_layers",
               "trainable", "rl.lora_rank", "rl.lora_targets")
# Fingerprint keys a checkpoint may predate: compared only when it records them.
_RECORDED_LATER = ("seed", "rl.optimizer_state_dtype")


def fingerprint(config: ml_collections.ConfigDict) -> dict:
    """The keys that shape a run's checkpointed state (module docstring), as JSON values."""
    m, rl = config.model, config.rl
    fp = {"seed": config.seed, "model.family": m.family}
    for key in ("variant", "num_layers", "num_single_layers"):
        if key in m:
            fp[f"model.{key}"] = m[key]
    fp["base model"] = workload_lib.base_model_id(config)
    fp["model.param_dtype"] = m.param_dtype
    fp["model.scan_layers"] = bool(m.scan_layers)
    fp["trainable"] = "LoRA adapters" if rl.lora_rank else "all weights (full fine-tuning)"
    fp["rl.lora_rank"] = rl.lora_rank
    if rl.lora_rank:
        fp["rl.lora_alpha"] = lora_alpha(config)
        fp["rl.lora_targets"] = list(rl.lora_targets)
    fp["rl.ema"] = bool(rl.ema)
    if rl.get("algorithm", "grpo") != "grpo":  # DiffusionNFT's state holds the old policy too
        fp["rl.algorithm"] = rl.algorithm
    fp["optimizer"] = "adamw" if rl.max_grad_norm is None else "clip_by_global_norm, adamw"
    fp["rl.optimizer_state_dtype"] = rl.get("optimizer_state_dtype", "param")  # the moments' dtype
    carried = {}
    for key in _CARRIED_KEYS:
        section, name = key.split(".")
        if section in config and name in config[section]:
            carried[key] = config[section][name]
    if "data" in config and config.data.get("first_frames"):  # the images the carried videos start from
        carried["data.first_frames"] = config.data.first_frames
    fp["carried"] = carried
    return json.loads(json.dumps(fp))  # tuples as lists: compares equal to what a checkpoint read back holds


def _show(value) -> str:
    if isinstance(value, dict) and "id" in value:
        return f"{value['where']} [{value['id']}]"
    return "(none)" if value is None else json.dumps(value)


def differences(saved: dict, current: dict, *, carried: bool, keys: tuple[str, ...] | None = None) -> list[str]:
    """'key: saved value in the checkpoint, current value now' for each key that differs (the
    carried micro-batches' keys only when `carried`; only `keys` when given)."""
    lines = []
    for key in dict.fromkeys([*saved, *current]):
        if key == "carried" or (keys is not None and key not in keys) or (key in _RECORDED_LATER and key not in saved):
            continue
        a, b = saved.get(key), current.get(key)
        same = (a or {}).get("id") == (b or {}).get("id") if key == "base model" else a == b
        if not same:
            lines.append(f"{key}: {_show(a)} in the checkpoint, {_show(b)} now")
    if carried:
        a, b = saved.get("carried", {}), current.get("carried", {})
        for key in dict.fromkeys([*a, *b]):
            if a.get(key) != b.get(key):
                lines.append(f"{key}: {_show(a.get(key))} in the checkpoint, {_show(b.get(key))} now "
                             "(it holds micro-batches already generated for the next iteration)")
    return lines
