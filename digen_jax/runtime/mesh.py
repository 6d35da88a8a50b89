"""Role meshes and shardings: which devices roll out, which train, and how arrays lie on them.

Every role gets a Mesh over its own devices: one axis `data`, or with sequence parallelism
(`runtime.seq_parallel` = P > 1) two, (`data`, `seq`), the P devices of a `seq` row holding
one sample's tokens between them (the models split them under `model_mesh`; the batch is
split over `data`). Parameters carry logical axis names in the model code; a per-role rule
table from the config (`sharding.rollout_rules`, `sharding.train_rules`) maps them to mesh
axes: rollout usually replicates the weights (no per-step all-gathers, the batch is split over
`data`), training shards them (FSDP: the `embed` dimension over `data`, gathered per layer by
XLA). A dimension that the axis does not divide stays replicated, and so does every weight
over `seq`. Colocated runs use one mesh for both roles.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any, Callable, Sequence

import flax.linen as nn
import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from digen_jax.runtime import plan as plan_lib
from digen_jax.runtime.multihost import role_devices
from digen_jax.runtime.settings import RuntimeSettings
from digen_jax.runtime.transfer import transfer


# The mesh axis names the models read (`models/partitioning.py` DATA_AXIS and SEQ_AXIS; the runtime
# sits above rl and does not import the models).
AXIS = "data"
SEQ_AXIS = "seq"


@dataclasses.dataclass(frozen=True)
class RoleMeshes:
    rollout: Mesh
    train: Mesh
    reward: Mesh | None
    colocated: bool

    def for_group(self, group: str) -> Mesh:
        """The mesh of a plan group ('shared' is the colocated mesh)."""
        if group in ("shared", "train"):
            return self.train
        if group == "rollout":
            return self.rollout
        if group == "reward":
            return self.reward or self.rollout
        raise ValueError(f"no mesh for group {group!r}")

    @property
    def num_devices(self) -> int:
        meshes = [self.train] if self.colocated else [self.rollout, self.train]
        if self.reward is not None and not self.colocated:
            meshes.append(self.reward)
        return sum(m.devices.size for m in meshes)


def build_role_meshes(runtime: RuntimeSettings, devices: Sequence[jax.Device] | None = None) -> RoleMeshes:
    """Meshes of the roles `runtime` sizes (its mode, rollout_devices, train_devices, reward_devices,
    seq_parallel)."""
    devices = list(jax.devices() if devices is None else devices)
    colocated = plan_lib.mode_flags(runtime.mode).colocated
    if colocated and runtime.train_devices:  # colocated on the first `train_devices` devices
        devices = devices[: runtime.train_devices]
    sizes = {"rollout": runtime.rollout_devices, "train": runtime.train_devices, "reward": runtime.reward_devices}
    roles = role_devices(devices, sizes, colocated=colocated)
    seq = runtime.seq_parallel
    if not isinstance(seq, int) or seq < 1:
        raise ValueError(f"runtime.seq_parallel must be an integer >= 1 (devices per sequence group), got {seq!r}")
    for role in ("train",) if colocated else ("rollout", "train"):  # the roles that run the transformer
        if len(ds := roles[role]) % seq:
            raise ValueError(
                f"runtime.seq_parallel={seq} must divide the {len(ds)} devices of the {role} role "
                "(each role's devices form groups of runtime.seq_parallel that split one sample's tokens)"
            )

    def mesh(ds, seq=seq):
        if seq == 1:
            return Mesh(np.array(ds), (AXIS,))
        return Mesh(np.array(ds).reshape(-1, seq), (AXIS, SEQ_AXIS))

    if colocated:
        shared = mesh(roles["train"])
        return RoleMeshes(shared, shared, None, True)
    reward = mesh(roles["reward"], seq=1) if roles.get("reward") else None  # decodes only: no transformer
    return RoleMeshes(mesh(roles["rollout"]), mesh(roles["train"]), reward, False)


@functools.cache
def split_grain(meshes: RoleMeshes, mode: str, samples: int) -> int:
    """Pieces per micro-batch of `samples` that the trainer's rollouts count in on `meshes`
    (`plan.pieces_per_microbatch` over the rollout and train roles' batch axes); 1: whole
    micro-batches, without trainer rollouts (a mode without TAG) or with several processes."""
    if not plan_lib.mode_flags(mode).tag or jax.process_count() > 1:
        return 1
    return plan_lib.pieces_per_microbatch(samples, [meshes.for_group(g).shape[AXIS] for g in ("rollout", "train")])


def replicated_work_lines(meshes: RoleMeshes, mode: str, samples: int, grad_chunk_size: int) -> list[str]:
    """One line per batch a role of `meshes` computes whole on every device instead of splitting
    (`plan.replicated_work`), naming the keys that avoid it."""
    widths = {g: meshes.for_group(g).shape[AXIS] for g in ("shared", "rollout", "train")}
    what = {"rollout": f"the rollouts of a micro-batch ({samples} samples)", "train": "a gradient chunk"}
    return [f"{what[kind]} on the {group} role run whole on each of its {n} devices, {n}x the work: its data axis "
            f"does not divide them; choose runtime.micro_batches, rl.grad_chunk_size and role sizes "
            f"(runtime.rollout_devices/train_devices) that it divides"
            for (kind, group), n in plan_lib.replicated_work(mode, samples, grad_chunk_size, widths).items()]


def host_device() -> jax.Device:
    """Where the executor computes host-derived inputs (sample keys, conditioning slices,
    advantages): the CPU backend. On the default device (the first accelerator, a rollout
    device) they would queue behind that role's rollouts, and a training task waiting for its
    advantages would wait for every rollout dispatched before it. Without a CPU backend
    (JAX_PLATFORMS naming only an accelerator): this process's first device."""
    try:
        return jax.local_devices(backend="cpu")[0]
    except RuntimeError:
        return jax.local_devices()[0]


def shards_weights(rules: Sequence[tuple[str, str | None]]) -> bool:
    """Whether logical-axis `rules` split a weight axis over the mesh (FSDP), not only activations."""
    return any(mesh_axis and not logical.startswith("activation_") for logical, mesh_axis in rules)


def activation_rules(rules: Sequence[tuple[str, str | None]], mesh: Mesh) -> tuple[tuple[str, Any], ...]:
    """The rules the models' activation constraints follow on `mesh`: each `activation_*` rule of
    `rules`, the batch over `data` unless they say otherwise, and with a `seq` axis the token axis
    left to `models.partitioning.shard_tokens`; every other activation axis whole."""
    table = {name: axis for name, axis in rules if name.startswith("activation_")}
    table.setdefault("activation_batch", AXIS)
    if SEQ_AXIS in mesh.axis_names:
        table["activation_length"] = PartitionSpec.UNCONSTRAINED
    return tuple(table.items())


def model_mesh(mesh: Mesh, rules: Sequence[tuple[str, str | None]] = ()):
    """The context the model's forward (and its gradient) is traced and run under on `mesh`,
    whose weights lie by `rules`.

    With a `seq` axis, the mesh itself (`jax.set_mesh`), so the models split each sample's
    tokens over it (`models.partitioning.seq_parallel_size`). Where `rules` shard the weights (FSDP),
    also `activation_rules`, so the models' activation constraints hold each activation split by
    batch and whole in its hidden axis: the compiler then gathers each layer's weight shards
    (one all-gather per weight) instead of splitting the products' contraction over the devices
    and all-reducing every activation. Nothing otherwise.
    """
    fsdp = shards_weights(rules)
    if SEQ_AXIS not in mesh.axis_names and not fsdp:
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    stack.enter_context(jax.set_mesh(mesh))
    if fsdp:
        stack.enter_context(nn.logical_axis_rules(activation_rules(rules, mesh)))
    return stack


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def batch_sharding(mesh: Mesh, shape: Sequence[int]) -> NamedSharding:
    """Leading (batch) axis split over the mesh's `data` axis when it divides, else replicated
    (with sequence parallelism, replicated over `seq`: the model splits the tokens)."""
    if shape and shape[0] % mesh.shape[AXIS] == 0:
        return NamedSharding(mesh, PartitionSpec(AXIS))
    return replicated(mesh)


def put_batch(tree: Any, mesh: Mesh) -> Any:
    """Every array of `tree` onto `mesh`, batch-split (asynchronous; across roles and processes)."""
    tree = jax.tree.map(lambda a: a if isinstance(a, jax.Array) else jax.numpy.asarray(a), tree)
    return transfer(tree, jax.tree.map(lambda a: batch_sharding(mesh, a.shape), tree))


def _mesh_spec(logical: PartitionSpec, shape: Sequence[int], mesh: Mesh, rules: dict) -> PartitionSpec:
    """Mesh axes of one parameter: each logical name through `rules`; a mesh axis is used once
    (the first dimension that maps to it) and only where it divides the dimension."""
    used, axes = set(), []
    for name, dim in zip(tuple(logical) + (None,) * (len(shape) - len(logical)), shape):
        axis = rules.get(name) if isinstance(name, str) else None
        if axis is None or axis in used or dim % mesh.shape[axis]:
            axes.append(None)
        else:
            used.add(axis)
            axes.append(axis)
    return PartitionSpec(*axes)


def param_shardings(boxed_abstract: Any, mesh: Mesh, rules: Sequence[tuple[str, str | None]]) -> Any:
    """NamedShardings of a parameter tree from its boxed abstract (logical names) and `rules`."""
    logical = nn.get_partition_spec(boxed_abstract)
    shapes = nn.unbox(boxed_abstract)
    table = {name: axis for name, axis in rules}
    return jax.tree.map(
        lambda spec, s: NamedSharding(mesh, _mesh_spec(spec, s.shape, mesh, table)),
        logical,
        shapes,
        is_leaf=lambda x: isinstance(x, PartitionSpec),
    )


def like_params(tree: Any, params_sharding: Any, mesh: Mesh) -> Any:
    """Shardings for `tree` (adapters, EMA): the parameter's where shapes agree, else replicated."""
    flat_params = {jax.tree_util.keystr(p): s for p, s in jax.tree_util.tree_leaves_with_path(params_sharding)}

    def pick(path, leaf):
        sharding = flat_params.get(jax.tree_util.keystr(path))
        return sharding if sharding is not None else replicated(mesh)

    return jax.tree_util.tree_map_with_path(pick, tree)


# Memory kind of state kept off the devices (`runtime.offload_optimizer`): page-locked host memory,
# which devices copy from by DMA; the CPU backend has it too (jax 0.10 and later).
HOST_MEMORY = "pinned_host"


def in_host_memory(x: Any) -> bool:
    """True for an array kept in host memory (`runtime.offload_optimizer`'s moments)."""
    return isinstance(x, jax.Array) and x.sharding.memory_kind not in (None, "device")


@functools.partial(jax.jit, static_argnums=(0, 2))
def _on_its_devices(fn, x, on_device):
    return fn(jax.device_put(x, on_device))


def reduce_in_host_memory(fn: Callable[[jax.Array], jax.Array], x: jax.Array) -> jax.Array:
    """`fn(x)`, a reduction, of an array in host memory, computed on its devices: XLA computes
    nothing in host memory (on a GPU it refuses to compile it), so the program brings `x` onto
    them first. The caller reads each result before it reduces the next array, so the devices
    hold one such array at a time and no multi-device programs queue up behind each other."""
    return _on_its_devices(fn, x, x.sharding.with_memory_kind("device"))


def optimizer_state_shardings(optimizer: optax.GradientTransformation, trainable: Any, trainable_sharding: Any, mesh: Mesh) -> Any:
    """Optimizer-state shardings: per-parameter statistics sharded like their parameter."""
    abstract = jax.eval_shape(optimizer.init, trainable)
    return optax.tree_map_params(
        optimizer,
        lambda _, sharding: sharding,
        abstract,
        trainable_sharding,
        transform_non_params=lambda _: replicated(mesh),
    )
