"""Checksums of a checkpoint's arrays, written with them at a save and verified when they are
read back, so that data corrupted on disk is not trusted (`_leaf_checksum` says how they are
computed: where the arrays live, in any sharding and process layout).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from digen_jax.runtime.mesh import in_host_memory, reduce_in_host_memory


def _leaf_checksum(x: jax.Array) -> jax.Array:
    """sum(weight(index) * word) mod 2**32 over the 32-bit words of `x`'s data (a narrower
    element is one word, a wider one several), each word's weight its flat index times the golden
    ratio's 32-bit constant, made odd. The shards' sums add up to the same value in any sharding,
    so it is computed where the array lives, in any process layout, and no data goes to the host.
    An odd weight makes any change of one word change the sum; other changes go unseen with a
    chance of about 2**-32."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    size = x.dtype.itemsize
    words = (jax.lax.bitcast_convert_type(x, jnp.uint32) if size >= 4 else
             jax.lax.bitcast_convert_type(x, {1: jnp.uint8, 2: jnp.uint16}[size]).astype(jnp.uint32))
    index = jnp.zeros(words.shape, jnp.uint32)
    for axis, n in enumerate(words.shape):
        index = index * jnp.uint32(n) + jax.lax.broadcasted_iota(jnp.uint32, words.shape, axis)
    return jnp.sum((index * jnp.uint32(0x9E3779B1) | jnp.uint32(1)) * words, dtype=jnp.uint32)


@jax.jit
def _checksums(leaves: list) -> list[jax.Array]:
    return [_leaf_checksum(leaf) for leaf in leaves]


def checksums(tree) -> dict[str, int]:
    """{leaf path: checksum} of the arrays of `tree` (`_leaf_checksum`); every process that holds
    part of them calls it (one scalar read per leaf, at a save or a restore). Arrays in host
    memory are brought onto the devices one at a time, so the devices never hold more than one
    of them (FLUX.1-dev's offloaded moments: 48 GB)."""
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    paths = [jax.tree_util.keystr(path) for path, _ in flat]
    leaves = [leaf for _, leaf in flat]
    read = lambda v: int(np.asarray(v.addressable_shards[0].data))  # noqa: E731
    on_devices = [i for i, leaf in enumerate(leaves) if not in_host_memory(leaf)]
    values = {i: read(v) for i, v in zip(on_devices, _checksums([leaves[i] for i in on_devices]))}
    for i, leaf in enumerate(leaves):
        if i not in values:  # each read before the next is reduced (`reduce_in_host_memory`)
            values[i] = read(reduce_in_host_memory(_leaf_checksum, leaf))
    return {path: values[i] for i, path in enumerate(paths)}


def verify(item: str, tree, saved: dict | None) -> None:
    """Raise ValueError naming the first leaf of `tree` whose checksum differs from `saved`, the
    checksums written with item `item` (nothing to check without them, or on a process that
    holds none of the data)."""
    if not saved or not any(not isinstance(leaf, jax.Array) or leaf.addressable_shards for leaf in jax.tree.leaves(tree)):
        return
    for path, value in checksums(tree).items():
        if path in saved and saved[path] != value:
            raise ValueError(f"the data of {item}{path} does not match the checksum written with it (corrupted on disk)")
