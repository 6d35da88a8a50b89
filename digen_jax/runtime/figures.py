"""An iteration's figures: its updates' metrics folded into one set (in one program on the train
devices), and read on the host one iteration late."""
from __future__ import annotations

import concurrent.futures

import jax
import jax.numpy as jnp

from digen_jax.rl.trainer import LAG0_FIGURES


@jax.jit
def iteration_metrics(update_metrics: list[dict]) -> dict:
    """An iteration's figures from its updates' (means; the last version and streak; skips summed),
    in one program on the train devices rather than two per figure."""
    last = update_metrics[-1]
    metrics = {name: jnp.mean(jnp.stack([m[name] for m in update_metrics])) for name in last}
    if "lag0_units" in last:  # losses on log-probs (GRPO); DiffusionNFT has none
        units = jnp.stack([m["lag0_units"] for m in update_metrics])
        metrics["lag0_units"] = jnp.sum(units)
        for name in LAG0_FIGURES:  # over the lag-0 units of every update (NaN: there were none)
            means = jnp.stack([m[f"{name}_mean"] for m in update_metrics])
            metrics[f"{name}_mean"] = jnp.sum(jnp.where(units > 0, means * units, 0.0)) / jnp.sum(units)
            metrics[f"{name}_max"] = jnp.nanmax(jnp.stack([m[f"{name}_max"] for m in update_metrics]))
    metrics.update(
        version=last["version"],
        nonfinite_streak=last["nonfinite_streak"],
        skipped=jnp.sum(jnp.stack([m["skipped"] for m in update_metrics])),
    )
    return metrics


def read_figures(figures: dict) -> dict:
    """An iteration's figures (`Executor.iteration`) on the host: device arrays read, the values
    another process shares awaited."""
    return jax.device_get({k: v.result() if isinstance(v, concurrent.futures.Future) else v for k, v in figures.items()})

