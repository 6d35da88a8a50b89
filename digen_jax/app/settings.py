"""The typed settings rl/ and runtime/ are handed, read off a validated config: frozen
dataclasses (`runtime.settings.RunSettings` and its parts), never the config itself.

Each builder names the config key of every field (`KEYS`); keys a config may lack take the
field's default, the value the schema states for them (configs/schema.py)."""
from __future__ import annotations

import dataclasses

import ml_collections

from digen_jax.app import renamed_keys
from digen_jax.rl.advantages import AdvantageSettings
from digen_jax.rl.timesteps import StepSettings
from digen_jax.runtime.multihost import DistributedSettings
from digen_jax.runtime.settings import RewardSettings, RunSettings, RuntimeSettings, ShardingRules

# Config key of every field, per settings class (the rewards' names and weights both come from
# `reward.weights`; `RunSettings` fields that are settings of their own are built from theirs).
KEYS: dict[type, dict[str, str]] = {
    RuntimeSettings: {f.name: f"runtime.{f.name}" for f in dataclasses.fields(RuntimeSettings)},
    ShardingRules: {"train_rules": "sharding.train_rules", "rollout_rules": "sharding.rollout_rules"},
    StepSettings: {"algorithm": "rl.algorithm", "step_selection": "rl.step_selection",
                   "timestep_fraction": "rl.timestep_fraction", "sde_window_size": "rl.sde_window_size",
                   "sde_window_range": "rl.sde_window_range", "window_shift_every": "rl.window_shift_every",
                   "nft_timesteps": "rl.nft_timesteps"},
    AdvantageSettings: {"mean_mode": "rl.mean_mode", "std_mode": "rl.std_mode", "eps": "rl.std_eps",
                        "ddof": "rl.std_ddof"},
    RewardSettings: {"names": "reward.weights", "weights": "reward.weights", "mix": "reward.mix"},
    RunSettings: {"seed": "seed", "prompts_per_iteration": "rl.prompts_per_iteration", "group_size": "rl.group_size",
                  "grad_chunk_size": "rl.grad_chunk_size", "num_updates_per_batch": "rl.num_updates_per_batch",
                  "lora_merge_for_sampling": "rl.lora_merge_for_sampling", "num_steps": "sampling.num_steps",
                  "noise_level": "sampling.noise_level"},
}


def _value(config: ml_collections.ConfigDict, key: str, default=dataclasses.MISSING):
    node = config
    for part in key.split("."):
        if part not in node:
            if default is dataclasses.MISSING:
                raise KeyError(f"the config has no {key}")
            return default
        node = node[part]
    return node


def _read(cls, config: ml_collections.ConfigDict):
    """The fields of `cls` that `KEYS[cls]` names, read off `config` (a missing key: the field's default)."""
    defaults = {f.name: f.default for f in dataclasses.fields(cls)}
    return {name: _value(config, key, defaults.get(name, dataclasses.MISSING)) for name, key in KEYS[cls].items()}


def _rules(rules) -> tuple[tuple[str, str | None], ...]:
    return tuple((name, axis) for name, axis in rules)


def runtime_settings(config: ml_collections.ConfigDict) -> RuntimeSettings:
    return RuntimeSettings(**_read(RuntimeSettings, config))


def step_settings(config: ml_collections.ConfigDict) -> StepSettings:
    values = _read(StepSettings, config)
    return StepSettings(**values | {"sde_window_range": tuple(values["sde_window_range"])})


def run_settings(config: ml_collections.ConfigDict) -> RunSettings:
    """What the executor runs `config` with (validated first: `validation.validate_config`). A key
    set under its old name is moved to the new one first (`renamed_keys.resolve`)."""
    renamed_keys.resolve(config)
    rules = _read(ShardingRules, config)
    weights = dict(config.reward.weights)
    names = tuple(sorted(weights))
    return RunSettings(
        runtime=runtime_settings(config),
        sharding=ShardingRules(**{k: _rules(v) for k, v in rules.items()}),
        steps=step_settings(config),
        advantages=AdvantageSettings(**_read(AdvantageSettings, config)),
        rewards=RewardSettings(names, tuple(weights[n] for n in names),
                               _value(config, "reward.mix", RewardSettings.mix)),
        **_read(RunSettings, config),
    )


def lora_alpha(config: ml_collections.ConfigDict) -> float:
    """`rl.lora_alpha`, where 0 means twice `rl.lora_rank`."""
    rl = config.rl
    return float(rl.lora_alpha or 2.0 * rl.lora_rank)


def distributed_settings(config) -> DistributedSettings:
    """How this process joins a multi-process run: `runtime.distributed` (absent: 'auto'; a bool,
    'auto', or a section of `DistributedSettings`' fields) and `runtime.peer_timeout_s`. Read
    before the config is validated (a run joins its processes first): a mapping will do."""
    runtime = config.get("runtime") or {}
    section, peer_timeout_s = runtime.get("distributed"), runtime.get("peer_timeout_s")
    if section is None or isinstance(section, (bool, str)):
        return DistributedSettings(**({} if section is None else {"enabled": section}), peer_timeout_s=peer_timeout_s)
    known = {f.name for f in dataclasses.fields(DistributedSettings)} - {"peer_timeout_s"}
    values = dict(section.items())
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"unknown keys runtime.distributed.{unknown}; known: {sorted(known)}")
    if values.get("local_device_ids") is not None:
        values["local_device_ids"] = tuple(int(i) for i in values["local_device_ids"])
    return DistributedSettings(**values, peer_timeout_s=peer_timeout_s)
