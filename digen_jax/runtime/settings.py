"""The typed settings the runtime runs from: frozen values the application layer reads off a
validated config (`app.settings.run_settings`), so the executor, the role meshes and the weight
placement never read a config themselves."""
from __future__ import annotations

import dataclasses

from digen_jax.rl.advantages import AdvantageSettings
from digen_jax.rl.timesteps import StepSettings


@dataclasses.dataclass(frozen=True)
class RuntimeSettings:
    """The `runtime` section: the schedule mode, the role sizes and how iterations are split."""

    mode: str
    micro_batches: int
    rollout_devices: int
    train_devices: int  # colocated: how many devices the shared role takes (0: all)
    reward_devices: int
    staleness: int
    tag_microbatches: float  # trainer rollouts per iteration (-1: chosen from measured costs)
    prefetch_microbatches: int  # micro-batches of the next iteration rolled out early (-1: chosen)
    reward_workers: int  # host threads scoring rewards
    trace: bool  # write WORKDIR/trace.json
    seq_parallel: int = 1  # devices per sequence group of a role's mesh
    colocated_sampling: str = "auto"  # 'auto' | 'sharded' | 'gathered' (`memory_plan.colocated_sampling`)
    tag_precision: str = "auto"  # 'auto' | 'rollout' | 'training' (`memory_plan.tag_precision`)
    offload_optimizer: bool = False  # the optimizer state in pinned host memory


@dataclasses.dataclass(frozen=True)
class ShardingRules:
    """The `sharding` section: logical-axis rules of the train and rollout roles' weights."""

    train_rules: tuple[tuple[str, str | None], ...]
    rollout_rules: tuple[tuple[str, str | None], ...]


@dataclasses.dataclass(frozen=True)
class RewardSettings:
    """The rewards of `reward.weights` in a fixed order (the rows after the total in
    `MicroBatch.rewards`), their weights, and how advantages combine them (`reward.mix`)."""

    names: tuple[str, ...]
    weights: tuple[float, ...]
    mix: str = "reward"


@dataclasses.dataclass(frozen=True)
class RunSettings:
    """Everything the executor reads of a run's config."""

    runtime: RuntimeSettings
    sharding: ShardingRules
    steps: StepSettings  # which steps are stochastic and trained (`rl.timesteps.plan_steps`)
    advantages: AdvantageSettings
    rewards: RewardSettings
    seed: int
    prompts_per_iteration: int
    group_size: int
    grad_chunk_size: int  # training units per gradient chunk (`rl.grad_chunk_size`)
    num_updates_per_batch: int
    lora_merge_for_sampling: bool
    num_steps: int  # sampling steps of a rollout
    noise_level: float  # the SDE's noise level on stochastic steps

    @property
    def batch(self) -> int:
        """Samples per iteration."""
        return self.prompts_per_iteration * self.group_size
