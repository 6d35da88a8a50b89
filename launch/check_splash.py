r"""Check splash attention (`model.attention_impl='splash'`) against XLA's attention on this host's
devices: the first command to run on a TPU slice.

    python3 launch/check_splash.py                 # Qwen-Image 512 px joint attention, bf16
    python3 launch/check_splash.py --tokens=4096 --text=512 --dtype=float32
    JAX_PLATFORMS=cpu python3 launch/check_splash.py --tokens=30 --text=7 --heads=2 --head_dim=16

Runs one joint attention of `--tokens` image tokens and `--text` text tokens (the second half of
the batch with its text half padded, masked through key lengths), forward and backward, with
the batch split over every local device (the kernel runs per device, as in the runtime's
programs). Prints the largest differences of the output and the q/k/v gradients relative to
XLA's, and the median time of each kernel; exits 1 when a difference exceeds the tolerance.
Off a TPU the kernel runs interpreted (slow; use small shapes).
"""
from __future__ import annotations

import os
import statistics
import sys
import time

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from digen_jax import cli  # noqa: E402

_TOKENS = flags.DEFINE_integer("tokens", 1024, "Image tokens per sample (Qwen-Image 512 px: 1024).")
_TEXT = flags.DEFINE_integer("text", 200, "Text tokens per sample (padded; half the batch uses half of them).")
_HEADS = flags.DEFINE_integer("heads", 24, "Attention heads.")
_HEAD_DIM = flags.DEFINE_integer("head_dim", 128, "Head dimension.")
_BATCH = flags.DEFINE_integer("batch", 0, "Samples (0: two per local device).")
_DTYPE = flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "Compute dtype.")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Timed calls per kernel (after one warm-up call).")
_TOLERANCE = flags.DEFINE_float("tolerance", None, "Largest relative difference accepted (default: 3e-2 bf16, 1e-3 float32).")


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}")
    for flag in (_TOKENS, _TEXT, _HEADS, _HEAD_DIM, _REPEATS):
        if flag.value < 1:
            raise app.UsageError(f"--{flag.name} must be >= 1, got {flag.value}")
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from digen_jax.models import attention, partitioning

    if _DTYPE.value == "float32":
        jax.config.update("jax_default_matmul_precision", "highest")
    devices = jax.local_devices()
    batch = _BATCH.value or 2 * len(devices)
    if batch % len(devices):
        raise app.UsageError(f"--batch={batch} must divide over the {len(devices)} local devices")
    mesh = Mesh(np.array(devices), (partitioning.DATA_AXIS,))
    length = _TOKENS.value + _TEXT.value
    dtype = jnp.dtype(_DTYPE.value)
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    shape = (batch, length, _HEADS.value, _HEAD_DIM.value)
    split = NamedSharding(mesh, PartitionSpec(partitioning.DATA_AXIS))
    q, k, v = (jax.device_put(jax.random.normal(key, shape, dtype), split) for key in keys)
    text = np.where(np.arange(batch) < batch // 2, _TEXT.value, max(1, _TEXT.value // 2))
    lengths = jax.device_put(jnp.asarray(_TOKENS.value + text, jnp.int32), split)

    def step(impl):
        def loss(q, k, v):
            out = attention.dot_product_attention(q, k, v, kv_lengths=lengths, impl=impl)
            return jnp.sum(jnp.sin(out.astype(jnp.float32))), out

        with jax.set_mesh(mesh):
            return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))

    print(f"backend {jax.default_backend()}, {len(devices)} x {devices[0].device_kind}; batch {batch}, "
          f"{length} tokens ({_TOKENS.value} + {_TEXT.value} text), {_HEADS.value} heads x {_HEAD_DIM.value}, {dtype.name}")
    results, times = {}, {}
    for impl in ("xla", "splash"):
        run = step(impl)
        with jax.set_mesh(mesh):
            results[impl] = jax.block_until_ready(run(q, k, v))
            spans = []
            for _ in range(_REPEATS.value):
                start = time.perf_counter()
                jax.block_until_ready(run(q, k, v))
                spans.append(time.perf_counter() - start)
        times[impl] = statistics.median(spans)
    (_, out_x), grads_x = results["xla"]
    (_, out_s), grads_s = results["splash"]
    tolerance = _TOLERANCE.value or (3e-2 if dtype == jnp.bfloat16 else 1e-3)
    worst = 0.0
    for name, a, b in zip(("output", "dq", "dk", "dv"), (out_s, *grads_s), (out_x, *grads_x)):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        rel = float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))
        worst = max(worst, rel)
        print(f"{name}: largest difference {rel:.2e} of the largest XLA value")
    print(f"forward + backward, median of {_REPEATS.value}: xla {times['xla'] * 1e3:.2f} ms, "
          f"splash {times['splash'] * 1e3:.2f} ms")
    if worst > tolerance:
        sys.exit(f"splash attention differs from XLA's by {worst:.2e} > {tolerance:.0e}")
    print(f"splash attention matches XLA's within {tolerance:.0e}")


if __name__ == "__main__":
    cli.run(main)
