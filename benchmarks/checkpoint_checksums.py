"""Time the checkpoint checksums (digen_jax/app/checksums.py) on a full-size run's train state.

Builds the trained state a zoo config checkpoints (its LoRA adapters and their two Adam moments
in the config's parameter dtype, plus an EMA copy when `rl.ema`; every weight for full
fine-tuning) with random values on the default device, then times one checksum pass over it,
which a save adds before its background write and a restore adds after its read:

    PYTHONPATH=. python3 benchmarks/checkpoint_checksums.py --config=configs/qwenimage.py --repeats=3

On a GPU the pass reads the arrays once at memory speed; on a CPU it runs on its cores.
"""
from __future__ import annotations

import json
import platform
import time

import jax
import jax.numpy as jnp
from absl import app, flags
from flax import traverse_util
from ml_collections import config_flags

from digen_jax.app import checksums, validation
from digen_jax.rl import lora

_CONFIG = config_flags.DEFINE_config_file("config", "configs/qwenimage.py", "Zoo config whose train state to time.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed checksum passes (after one that compiles).")


def _state_shapes(config) -> dict[str, tuple]:
    """{path: shape} of the arrays a checkpoint's train state holds, without weights."""
    abstract = validation._abstract_params(config.model.family, validation._transformer_config(config))
    flat = traverse_util.flatten_dict(abstract, sep="/")
    rl = config.rl
    if rl.lora_rank:
        trained = {}
        for path in lora.match_lora_targets(abstract, list(rl.lora_targets)):
            *lead, fan_in, fan_out = flat[path].shape
            trained[f"{path}/a"] = (*lead, fan_in, rl.lora_rank)
            trained[f"{path}/b"] = (*lead, rl.lora_rank, fan_out)
    else:
        trained = {path: leaf.shape for path, leaf in flat.items()}
    copies = ("param", "mu", "nu") + (("ema",) if rl.ema else ())
    return {f"{copy}/{path}": shape for copy in copies for path, shape in trained.items()}


def main(argv):
    del argv
    config = _CONFIG.value
    config.model.random_init = True  # the architecture alone: no weight files
    dtype = jnp.dtype(config.model.param_dtype)
    shapes = _state_shapes(config)
    keys = jax.random.split(jax.random.key(0), len(shapes))
    tree = {path: jax.random.normal(k, shape, dtype) for k, (path, shape) in zip(keys, shapes.items())}
    nbytes = sum(x.nbytes for x in tree.values())
    jax.block_until_ready(tree)
    checksums.checksums(tree)  # compiles
    times = []
    for _ in range(_REPEATS.value):
        start = time.perf_counter()
        checksums.checksums(tree)  # reads one scalar per leaf: the pass has finished
        times.append(time.perf_counter() - start)
    device = jax.devices()[0]
    result = {
        "config": flags.FLAGS["config"].config_filename,
        "family": config.model.family, "lora_rank": config.rl.lora_rank, "dtype": str(dtype),
        "leaves": len(tree), "bytes": nbytes, "seconds": times,
        "gib_per_s": [nbytes / 2**30 / t for t in times],
        "device": device.device_kind, "platform": device.platform, "num_devices": jax.device_count(),
        "processor": platform.processor() or platform.machine(), "jax": jax.__version__,
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    app.run(main)
