"""How model arrays are laid out over the mesh the caller traces under.

Every parameter carries logical axis names (`nn.with_logical_partitioning`); the mesh
rules that map them to device axes live in the configs (`configs/*.py`, key
`sharding`). The logical names the models use:

| name         | dimension                                                        |
|--------------|------------------------------------------------------------------|
| `embed`      | the transformer's hidden size                                    |
| `heads`      | fused heads x head_dim of q/k/v projections and attention output |
| `mlp`        | the MLP hidden size                                              |
| `modulation` | AdaLN modulation outputs (k x hidden)                            |
| `cond`       | conditioning inputs: latent channels, text/pooled/frequency dims |
| `head_dim`   | per-head norm scales                                             |
| `layers`     | the stacked-block axis of scanned layers                         |

Activations are constrained (`constrain`) with `activation_batch`, `activation_length`,
`activation_embed`, `activation_heads` and `activation_mlp`; the constraints act only where the
caller traces under a mesh and logical rules (the runtime sets both for programs whose weights
are sharded) and are no-ops otherwise.

Sequence parallelism (the video transformers): a model traced under `jax.set_mesh` of a mesh
with a `SEQ_AXIS` of size P > 1 splits each sample's video tokens over that axis
(`shard_tokens`; the compiler lays out every per-token op to match); only attention is written
per device (`attention.token_parallel_attention`, Ulysses). Outside such a mesh nothing is
split. The mesh is the runtime's (each role's); models only read it.
"""
from __future__ import annotations

import math
from typing import Sequence

import flax.linen as nn
import jax

from jax.sharding import PartitionSpec

# Mesh axes the models know of: the batch axis, and the axis a sample's tokens are split over
# (sequence parallelism). The runtime names its role meshes' axes with these.
DATA_AXIS = "data"
SEQ_AXIS = "seq"


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """`x` laid out by the logical names of its leading axes (the rest whole), under the rules and
    mesh the caller traces under (`nn.logical_axis_rules`, `jax.set_mesh`; the runtime sets both
    for programs whose weights are sharded). An axis that its mesh axes do not divide stays
    whole (a batch of 3 on 2 devices); nothing is constrained without rules or a mesh."""
    rules, mesh = nn.get_logical_axis_rules(), jax.sharding.get_abstract_mesh()
    if not rules or mesh.empty:
        return x
    table = dict(rules)
    spec = []
    for name, size in zip(tuple(names) + (None,) * (x.ndim - len(names)), x.shape):
        axes = table.get(name) if name is not None else None
        if isinstance(axes, (str, tuple)):
            ways = math.prod(mesh.shape[a] for a in ((axes,) if isinstance(axes, str) else axes))
            axes = axes if size % ways == 0 else None
        spec.append(axes)
    return jax.lax.with_sharding_constraint(x, PartitionSpec(*spec))


def seq_parallel_size() -> int:
    """P, the devices a sample's tokens are split over: the size of `SEQ_AXIS` in the mesh the
    caller traces under (`jax.set_mesh`); 1 without one."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or SEQ_AXIS not in mesh.axis_names:
        return 1
    return mesh.shape[SEQ_AXIS]


def shard_tokens(x: jax.Array) -> jax.Array:
    """`x` (B, S, ...) with its token axis split over `SEQ_AXIS` (the batch and the other axes as
    the compiler lays them out); `x` itself without sequence parallelism."""
    if seq_parallel_size() == 1:
        return x
    free = PartitionSpec.UNCONSTRAINED
    return jax.lax.with_sharding_constraint(x, PartitionSpec(free, SEQ_AXIS, *([free] * (x.ndim - 2))))
