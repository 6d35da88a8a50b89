r"""Time the trainer -> rollout weight move of full fine-tuning inside one process: bfloat16
leaves sharded (FSDP, first axis) over the train devices, onto the rollout devices whole, by
`jax.device_put` and by `transfer.transfer`. Writes a JSON of the seconds per move and GB/s.

    python benchmarks/cross_role_transfer.py --rollout=1 --gb=8 --out=/tmp/transfer.json
"""
from __future__ import annotations

import json
import os
import platform
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from digen_jax.runtime.transfer import transfer  # noqa: E402

_ROLLOUT = flags.DEFINE_integer("rollout", 1, "Rollout devices (the first ones); the rest train.")
_GB = flags.DEFINE_float("gb", 8.0, "Size of the moved tree, GB (leaves of blocks x 3072 x 3072 bf16).")
_BLOCKS = flags.DEFINE_integer("blocks", 60, "Leading (stacked blocks) axis of each leaf.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed moves per method, after one untimed.")
_METHODS = flags.DEFINE_list("methods", ["transfer", "device_put"], "Which moves to time, in order.")
_OUT = flags.DEFINE_string("out", "cross_role_transfer.json", "Where the JSON goes.")


def _tree(train: Mesh, gb: float) -> list[jax.Array]:
    """Stacked-block-like bf16 leaves summing to about `gb` GB, FSDP-sharded over `train`."""
    n = train.devices.size
    leaf = (_BLOCKS.value, 3072, 3072)
    count = max(1, int(gb * 1e9 // (np.prod(leaf) * 2)))
    sharding = NamedSharding(train, P(None, "data"))
    make = jax.jit(lambda i: jnp.full(leaf, i, jnp.bfloat16), out_shardings=sharding)
    tree = [make(i) for i in range(count)]
    assert leaf[1] % n == 0
    return jax.block_until_ready(tree)


def main(_):
    devices = jax.devices()
    rollout = Mesh(np.array(devices[:_ROLLOUT.value]), ("data",))
    train = Mesh(np.array(devices[_ROLLOUT.value:]), ("data",))
    dst = NamedSharding(rollout, P())
    tree = _tree(train, _GB.value)
    nbytes = sum(x.nbytes for x in tree)
    moves = {"transfer": lambda t: transfer(t, dst), "device_put": lambda t: jax.device_put(t, dst)}
    results = {}
    for name in _METHODS.value:
        move = moves[name]
        jax.block_until_ready(move(tree))  # compiles the transfer programs
        times = []
        for _ in range(_REPEATS.value):
            start = time.perf_counter()
            moved = jax.block_until_ready(move(tree))
            times.append(time.perf_counter() - start)
            del moved
        results[name] = {"seconds": times, "gb_per_s": nbytes / 1e9 / min(times)}
        print(f"{name}: {min(times):.3f} s for {nbytes / 1e9:.2f} GB = {nbytes / 1e9 / min(times):.1f} GB/s", flush=True)
    report = {
        "what": "one move of bf16 FSDP-sharded weights (train devices) onto the rollout devices whole, one process",
        "device": devices[0].device_kind, "devices": len(devices), "rollout_devices": _ROLLOUT.value,
        "bytes": nbytes, "versions": {"jax": jax.__version__, "python": platform.python_version()},
        "results": results,
    }
    with open(_OUT.value, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    app.run(main)
