"""Which ladder steps are stochastic and which are trained, per recipe.

| `rl.step_selection` | noise (SDE) on                   | trained steps                                   | recipe |
|---------------------|----------------------------------|-------------------------------------------------|--------|
| `fraction`          | every step                       | the first int(timestep_fraction * N)            | Flow-GRPO |
| `window`            | a window of `sde_window_size` steps starting at a random index in `sde_window_range` (drawn once per iteration) | the window | Flow-GRPO Fast / Qwen-Image |
| `mixgrpo`           | a window that advances by one every `window_shift_every` iterations and wraps | the window | MixGRPO progressive |
| `random`            | every step                       | per sample, a random int((N - 1) * timestep_fraction) of the first N - 1 | DanceGRPO |

The last step (sigma' = 0) has a near-zero transition std and is never trained; a
selection that would train it is rejected by `app.validation.validate_step_selection`.

`rl.algorithm='nft'` (DiffusionNFT, docs/algorithms.md section A12) ignores the selection: its
rollouts are deterministic (every noise level 0) and each sample trains K noise levels of its
own, a random K of the N sampling levels sigma_0..sigma_{N-1} (`nft_num_trained`).
"""
from __future__ import annotations

import dataclasses

import jax
import numpy as np

from digen_jax.rl import nft

STEP_SELECTIONS = ("fraction", "window", "mixgrpo", "random")


@dataclasses.dataclass(frozen=True)
class StepSettings:
    """The `rl` keys that choose a run's stochastic and trained steps (module docstring)."""

    step_selection: str
    timestep_fraction: float
    sde_window_size: int
    sde_window_range: tuple[int, int]
    window_shift_every: int
    algorithm: str = "grpo"  # 'nft': DiffusionNFT's K levels per sample, whatever the selection
    nft_timesteps: int = 0  # DiffusionNFT's K (0: int(num_steps * timestep_fraction))


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """noise_levels (N,) float32 per step; trained (B, T) int32 step indices per sample."""

    noise_levels: np.ndarray
    trained: np.ndarray


def num_trained(fraction: float, steps: int) -> int:
    return int(fraction * steps)


def nft_num_trained(rl: StepSettings, num_steps: int) -> int:
    """DiffusionNFT's K: `rl.nft_timesteps`, or where that is 0 int(N * `rl.timestep_fraction`)
    as the reference derives it (N - 1 for its 0.99)."""
    return rl.nft_timesteps or num_trained(rl.timestep_fraction, num_steps)


def plan_steps(rl: StepSettings, num_steps: int, noise_level: float, batch: int, iteration: int, rng: np.random.Generator) -> StepPlan:
    """The StepPlan of one iteration; `rng` is seeded per iteration so a resumed run replays it."""
    if rl.algorithm == "nft":
        key = jax.random.key(int(rng.integers(2**31)))
        trained = np.asarray(nft.draw_timestep_indices(key, batch, num_steps, nft_num_trained(rl, num_steps)))
        return StepPlan(np.zeros((num_steps,), np.float32), trained)
    mode = rl.step_selection
    if mode in ("fraction", "random"):
        noise = np.full((num_steps,), noise_level, np.float32)
        if mode == "fraction":
            trained = np.tile(np.arange(num_trained(rl.timestep_fraction, num_steps)), (batch, 1))
        else:
            t = num_trained(rl.timestep_fraction, num_steps - 1)
            trained = np.stack([np.sort(rng.permutation(num_steps - 1)[:t]) for _ in range(batch)])
        return StepPlan(noise, trained.astype(np.int32))
    size = rl.sde_window_size
    lo, hi = rl.sde_window_range
    if mode == "window":
        start = int(rng.integers(lo, hi - size + 1))
    else:
        start = lo + (iteration // rl.window_shift_every) % (hi - size - lo + 1)
    noise = np.zeros((num_steps,), np.float32)
    noise[start : start + size] = noise_level
    trained = np.tile(np.arange(start, start + size), (batch, 1))
    return StepPlan(noise, trained.astype(np.int32))
