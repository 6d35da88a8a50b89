"""Random weights of a model family at any variant's size, for throughput runs and tests."""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

# Up to this many parameters, random weights are drawn on the host: compiling an RNG program
# costs far more than the draw at tiny sizes; at full size the host would be the slow side.
_HOST_DRAW_LIMIT = 10**8


def random_params(family, cfg, seed: int) -> dict:
    """Random weights of the shapes `family` has at `cfg`, for throughput runs and tests.

    Built from the abstract parameters (a trace, no compiled init): kernels normal with
    variance 1 / fan-in (the input axis and any kernel-window axes before it, not a
    stacked-layers axis), norm scales one, biases and modulation tables small normal. Drawn in
    the stored (stacked) layout, then split per block if `cfg` unrolls them.
    """
    stored = family.stored_config(cfg)
    if stored is not cfg:
        return family.to_layout(random_params(family, stored, seed), cfg, consume=True)
    abstract = nn.unbox(family.abstract_params(cfg))
    leaves, treedef = jax.tree_util.tree_flatten_with_path(abstract)

    def value(path, leaf, normal):
        name, shape = str(path[-1].key), leaf.shape
        if name == "gamma" or name.endswith("scale"):
            return np.ones(shape, np.float32)
        if name == "kernel":
            fan_in = shape[-2] if len(shape) == 3 else int(np.prod(shape[:-1]))  # 3-D: (layers, in, out)
            return normal(shape) / np.float32(np.sqrt(fan_in))
        return np.float32(0.02) * normal(shape)

    if sum(int(np.prod(leaf.shape)) for _, leaf in leaves) <= _HOST_DRAW_LIMIT:
        rng = np.random.default_rng(seed)
        host_normal = lambda shape: rng.standard_normal(shape, np.float32)  # noqa: E731
        drawn = [jax.device_put(value(path, leaf, host_normal).astype(leaf.dtype)) for path, leaf in leaves]
        return jax.tree_util.tree_unflatten(treedef, drawn)

    def draw(key):
        drawn = []
        for i, (path, leaf) in enumerate(leaves):
            device_normal = lambda shape, i=i: jax.random.normal(jax.random.fold_in(key, i), shape)  # noqa: E731
            drawn.append(jnp.asarray(value(path, leaf, device_normal), leaf.dtype))
        return jax.tree_util.tree_unflatten(treedef, drawn)

    return jax.jit(draw)(jax.random.key(seed))
