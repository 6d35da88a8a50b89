"""What a resume may change: every config key is refused, noted or free.

Refused: the keys that shape the checkpointed state or name the base model; `fingerprint.fingerprint`
records them and a resume with another value stops before any compute.
Noted: the keys that change what the remaining iterations compute (hyperparameters, rewards,
prompts and sampling, the schedule, the numerics). A resume with another value goes on with it,
says so in one line naming each key with its old and new value, and records the changes in the
metrics row of the first iteration it trains (`config_changes`). The keys that shape the
micro-batches a checkpoint carries are refused while it carries some (`fingerprint._CARRIED_KEYS`).
Free: the keys that change nothing a run computes (evaluation, logging, checkpoint cadence, where
files are cached, fault handling, process plumbing).

A key belongs to its longest listed prefix. A key in no list counts as noted; tests check that
every key of the configs in configs/ is listed, so that a new key is classified when it is added.
"""
from __future__ import annotations

import json

import ml_collections

from digen_jax.app import renamed_keys

REFUSED = (
    "seed",  # the base model of random or pretrained weights, and every prompt and noise
    "model.family", "model.variant", "model.num_layers", "model.num_single_layers", "model.arch",
    "model.checkpoint", "model.random_init", "model.param_dtype", "model.scan_layers",
    # configs/tiny.py pretrains its base model: the recipe is its identity
    "task.resolution", "task.text_len", "task.label_noise",
    "pretrain.steps", "pretrain.batch_size", "pretrain.learning_rate",
    "rl.lora_rank", "rl.lora_alpha", "rl.lora_targets", "rl.ema", "rl.algorithm", "rl.optimizer_state_dtype",
)
NOTED = (
    # configs/tiny.py: dtype, attention_impl and sampling.guidance are part of its pretraining recipe (refused)
    "model.dtype", "model.attention_impl", "model.rollout_precision", "model.lora_base_precision", "model.vae_checkpoint",
    "model.vae_encoder_checkpoint",
    "task.name", "data", "sampling", "reward", "sharding",
    # rl.max_grad_norm: clipping on or off is refused (the optimizer's state), its value is noted
    "rl",
    "runtime.mode", "runtime.micro_batches", "runtime.rollout_devices", "runtime.train_devices",
    "runtime.reward_devices", "runtime.seq_parallel", "runtime.tag_microbatches", "runtime.prefetch_microbatches",
    "runtime.staleness", "runtime.tag_precision", "runtime.auto_rerank_after", "runtime.auto_switch_margin",
)
FREE = (
    "model.remat_policy",  # recomputes the same activations
    "model.vae_decode_batch",  # decodes the same samples in other batches
    "pretrain.cache_dir",  # where the pretrained weights are cached; the recipe names them
    "rl.max_nonfinite_in_row",  # when a diverging run stops, not what it computes
    "runtime.reward_workers", "runtime.trace", "runtime.distributed", "runtime.peer_timeout_s",
    # the Adam moments in host memory give the same numbers; the memory check refuses, never changes
    "runtime.offload_optimizer", "runtime.check_memory",
    # sampling from a gathered copy gives bit-equal rollouts and weights (tests/test_runtime.py)
    "runtime.colocated_sampling",
    # train.iterations: a resume checks it against the checkpoint's iteration
    "train",
)
_KINDS = {**{p: "noted" for p in NOTED}, **{p: "free" for p in FREE}, **{p: "refused" for p in REFUSED}}


def listed_prefix(key: str) -> str | None:
    """The longest listed prefix of `key` (None: it is in no list)."""
    parts = key.split(".")
    for n in range(len(parts), 0, -1):
        prefix = ".".join(parts[:n])
        if prefix in _KINDS:
            return prefix
    return None


def kind(key: str) -> str:
    """'refused', 'noted' or 'free' (module docstring)."""
    prefix = listed_prefix(key)
    return "noted" if prefix is None else _KINDS[prefix]


def leaves(config, prefix: str = "") -> dict:
    """Every leaf of `config` as {dotted key: value}; empty sections have none."""
    out = {}
    for name, value in config.items():
        if isinstance(value, (ml_collections.ConfigDict, dict)):
            out.update(leaves(value, f"{prefix}{name}."))
        else:
            out[f"{prefix}{name}"] = value
    return out


def settings(config: ml_collections.ConfigDict) -> dict:
    """The values of `config`'s noted keys, as JSON values (what a checkpoint records)."""
    noted = {key: value for key, value in leaves(config).items() if kind(key) == "noted"}
    return json.loads(json.dumps(noted, default=str))


def changes(saved: dict | None, config: ml_collections.ConfigDict) -> dict:
    """{key: [value in the checkpoint, value now]} for each noted key that differs (none when the
    checkpoint records no settings). A checkpoint's key under an old name counts as its new name."""
    if not isinstance(saved, dict):
        return {}
    saved = {renamed_keys.RENAMED.get(key, key): value for key, value in saved.items()}
    now = settings(config)
    return {key: [saved.get(key), now.get(key)] for key in dict.fromkeys([*saved, *now])
            if saved.get(key) != now.get(key) and kind(key) == "noted"}


def describe(changed: dict) -> str:
    """`changes`' result in words: 'key old -> new, ...'."""
    return ", ".join(f"{key} {json.dumps(old)} -> {json.dumps(new)}" for key, (old, new) in changed.items())
