"""Stacks of repeated transformer blocks: how they run and how their parameters are laid out.

Blocks run in one of two layouts (`scan_blocks`): scanned, one parameter per weight with a
leading `layers` axis (the stored layout: compile time flat in depth), or unrolled, one
sub-tree per block named by its index (`blocks/0/...`, `blocks/1/...`). Unrolled programs
compile slower but skip the per-layer copy a scan makes when it slices each block's weights
out of the stacked arrays (its cost: docs/models.md, "Block layouts"). `relayout_blocks`
converts parameter trees between the two. `remat_policy` (`REMAT_POLICIES`) names what the
backward pass keeps of each block.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np


REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_saveable,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    # Keeps each block's attention output (tagged `attn_out`); recomputes the rest.
    "save_attention": jax.checkpoint_policies.save_only_these_names("attn_out"),
}


def scan_blocks(block_cls: type[nn.Module], length: int, remat_policy: str, scan: bool = True):
    """`block_cls` repeated `length` times: `make(*block_args, name=...)(carry, *broadcast_args)`.

    With `scan`, an `nn.scan` (params on a leading `layers` axis, one compiled body);
    otherwise `UnrolledBlocks` (params under `name/0`, `name/1`, ...; one program per block,
    no per-layer weight slicing). `remat_policy` (a key of `REMAT_POLICIES`) wraps each
    block in `nn.remat` with that policy. The block's `__call__(carry, *broadcast_args)` must
    return `(carry, None)`. LoRA adapters in the `lora` collection follow the params' layout.
    """
    if remat_policy not in REMAT_POLICIES:
        raise ValueError(f"remat_policy must be one of {sorted(REMAT_POLICIES)}, got {remat_policy!r}")
    if remat_policy != "none":
        # Common-subexpression elimination may only merge a block's recomputation with its
        # forward where a loop boundary separates them, i.e. under scan.
        block_cls = nn.remat(block_cls, policy=REMAT_POLICIES[remat_policy], prevent_cse=not scan)
    if not scan:
        return lambda *block_args, name: UnrolledBlocks(block_cls, length, block_args, name=name)
    return nn.scan(
        block_cls,
        variable_axes={"params": 0, "lora": 0},
        split_rngs={"params": True},
        in_axes=nn.broadcast,
        length=length,
        metadata_params={nn.PARTITION_NAME: "layers"},
    )


class UnrolledBlocks(nn.Module):
    """`length` instances of `block_cls(*block_args)`, named "0".."length-1", run in order."""

    block_cls: type[nn.Module]
    length: int
    block_args: tuple

    @nn.compact
    def __call__(self, carry, *broadcast_args):
        for i in range(self.length):
            carry, _ = self.block_cls(*self.block_args, name=str(i))(carry, *broadcast_args)
        return carry, None


def _is_unrolled(node) -> bool:
    return isinstance(node, Mapping) and bool(node) and all(isinstance(k, str) and k.isdigit() for k in node)


def _stack_leaves(leaves: Sequence):
    if all(isinstance(x, np.ndarray) for x in leaves):
        return np.stack(leaves)
    return jnp.stack(leaves)


def unstack_leaf(leaf, n: int) -> list:
    """`relayout_blocks`' default `unstack`: the n slices along the leading (layers) axis."""
    return [leaf[i] for i in range(n)]


def unstack_consuming(leaf, n: int) -> list:
    """`relayout_blocks`' `unstack` that frees each stacked device array once it is split, so
    converting a model to the unrolled layout never holds it twice."""
    pieces = unstack_leaf(leaf, n)
    if isinstance(leaf, jax.Array):
        jax.block_until_ready(pieces)
        leaf.delete()
    return pieces


def relayout_blocks(tree, like, *, stack=_stack_leaves, unstack=unstack_leaf):
    """`tree` (params, adapters, shardings...) in the block layout of `like`.

    Walks both nested dicts together: where `like` holds per-block sub-trees ("0", "1", ...)
    and `tree` one stacked sub-tree, every leaf is split with `unstack(leaf, n)` and block i
    gets the i-th pieces; where `tree` holds per-block sub-trees and `like` a stacked one, the
    blocks' leaves are combined with `stack(leaves)`. Elsewhere the keys must match. Host
    (numpy) leaves are sliced as views.
    """
    if not isinstance(like, Mapping):
        return tree
    if not isinstance(tree, Mapping):
        raise ValueError(f"expected a sub-tree with keys {sorted(like)}, got a leaf")
    recurse = lambda t, l: relayout_blocks(t, l, stack=stack, unstack=unstack)  # noqa: E731
    if _is_unrolled(like) and not _is_unrolled(tree):
        pieces = jax.tree.map(lambda x: unstack(x, len(like)), tree)
        is_pieces = lambda v: isinstance(v, list)  # noqa: E731
        return {k: recurse(jax.tree.map(lambda p, k=k: p[int(k)], pieces, is_leaf=is_pieces), like[k]) for k in like}
    if _is_unrolled(tree) and not _is_unrolled(like):
        blocks = [tree[str(i)] for i in range(len(tree))]
        return recurse(jax.tree.map(lambda *xs: stack(xs), *blocks), like)
    if set(tree) != set(like):
        raise ValueError(f"parameter trees differ: keys {sorted(map(str, tree))} vs {sorted(map(str, like))}")
    return {k: recurse(tree[k], like[k]) for k in tree}
