"""Cross-role and cross-process transfers: moving arrays from one role's devices to another's.

* `transfer` moves a pytree of arrays from one role's devices to another role's shardings
  (weight sync trainer -> rollout, trajectories rollout -> trainer). What every process holds
  whole already (the frozen base and the decoder weights, built alike by every process) is
  not moved: `put_own_copy` places each process's own copy on its own devices.
* `put_in_pieces` copies a tree that every process holds (the initial train state, in host
  memory on accelerators) onto one role's shardings piece by piece, so the host holds one piece
  beyond the tree, and a process holding none of those devices places nothing.
* `to_every_process` gives every process a copy it can read on the host (metrics, evaluation
  samples, the values a checkpoint checks). `whole_on_one_process` and `SharedValues`
  (shared_values.py) serve what one process computes for all: the process holding a
  micro-batch's decoded samples scores them and shares the rewards through the key-value
  store, and every process computes the advantages from them alike, so the trainer's inputs
  need no device transfer of pixels.

What moves data across processes (measured with jax 0.10.2 on CPU, 2 processes x 4 devices):

* `jax.device_put` to a sharding whose devices belong to another process raises "backend
  does not support cross-host device transfers" unless the DCN transfer server is enabled
  (`jax_cross_host_transfer_socket_address`); with it enabled on CPU the put returns but the
  receiving side never gets the data (the reader blocks until killed). Not usable here.
* A jitted computation over a mesh that spans both roles does work, over gloo on CPU
  (`jax_cpu_collectives_implementation='gloo'`, set by `multihost.initialize`); on GPU the same
  program runs over NCCL (not exercised on this machine). So
  `transfer` builds a combined mesh, views the source shards plus zero-filled receive
  buffers on the destination devices as one global array (no copy), and runs a `shard_map`
  whose only op is `lax.ppermute` from the source half to the destination half. Processes
  that own none of the devices still call it (they receive arrays without local shards).
  Typed PRNG keys (a trajectory's sample keys) travel as their uint32 words.
* With equal role sizes the destination devices are laid out like the source mesh and each
  device sends its own shard: the bytes crossing between roles are one copy of the array,
  whatever its sharding; a reshard inside the destination role (e.g. an all-gather from
  FSDP to replicated weights) follows. With unequal sizes the source is first replicated
  inside its role and every destination device receives the whole array
  (ceil(n_dst / n_src) ppermute rounds), then slices its shard: correct for any sizes, but
  it costs n_dst copies of the array between roles and a full replica per source device.
* Memory: during a move each side holds one extra buffer per shard it moves (the zero
  receive buffers on the destination, ppermute's zero output on the source; with unequal
  sizes also the source's replica). So the leaves of one source mesh move in pieces of
  consecutive leaves of at most `TRANSFER_PIECE_BYTES` together (a larger leaf alone), one
  jitted call each (compiled once per piece layout), each waited for (`_fence`) before the
  next: a device needs the data it holds or receives plus the buffers of one piece (and,
  where the destination's layout differs, the piece as moved until its reshard), not a
  second copy of the whole tree. A tree within the bound (LoRA adapters, a micro-batch's
  trajectories) moves in one call, so dispatch stays cheap for trees of many leaves
  (timings on CPU: docs/design.md section 2).
"""
from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

_TRANSFER_AXIS = "_transfer"
# Most bytes (of whole arrays, summed over the leaves) one cross-process move program carries:
# the bound on its extra buffers per device. Above the fp32 LoRA adapters of every model-zoo
# config (1.6 GiB for Qwen-Image's rank 64), which then still move in one program. Read at
# each call, so tests can lower it.
TRANSFER_PIECE_BYTES = 2 << 30


def transfer(tree, dst_shardings):
    """Move a pytree of arrays to `dst_shardings` (a sharding, or a tree prefix of shardings).

    Works inside one process (`jax.device_put`) and across processes, where the source
    devices belong to some processes and the destination devices to others (a collective
    over a mesh spanning both; see the module docstring). Every process must call it with
    the same tree structure, shapes, dtypes and shardings, like any multi-process jit.
    Dispatched asynchronously: nothing blocks the host.

    Uncommitted arrays (made by `jnp` from host data, not placed by a sharding: prompts,
    sample keys, advantages) are values every process computes alike from the seed and
    the host rewards; across processes each process puts its own copy's slices on its
    own destination devices, and nothing crosses between processes.
    """
    leaves, treedef = jax.tree.flatten(tree)
    dst = _per_leaf(tree, dst_shardings)
    out: list = [None] * len(leaves)
    local: list[int] = []  # leaves a plain device_put moves
    # Leaves that cross processes, grouped by (source mesh, destination devices, equal sizes).
    groups: dict[tuple, list[int]] = {}
    for i, (x, s) in enumerate(zip(leaves, dst)):
        src = x.sharding
        owners = {d.process_index for d in src.device_set | s.device_set}
        if src.device_set == s.device_set or (
                src.is_fully_addressable and s.is_fully_addressable and not _through_host(x, s)):
            local.append(i)
        elif not x.committed:
            out[i] = _put_own_copy(x, s)
        elif len(owners) == 1 and jax.process_index() not in owners:
            # Both sides belong to one other process, which does the put: keep a handle.
            out[i] = jax.make_array_from_single_device_arrays(x.shape, s, [], dtype=x.dtype)
        elif not (isinstance(src, NamedSharding) and isinstance(s, NamedSharding)):
            raise ValueError(
                f"a cross-process transfer needs NamedShardings, got {type(src).__name__} -> {type(s).__name__}"
            )
        elif src.device_set & s.device_set:
            raise ValueError("a cross-process transfer needs disjoint source and destination devices (two roles)")
        else:
            same_size = len(src.device_set) == len(s.device_set)
            dst_ids = tuple(d.id for d in s.mesh.devices.flat)
            groups.setdefault((src.mesh, dst_ids, same_size), []).append(i)
    if local:
        for i, y in zip(local, place([leaves[i] for i in local], [dst[i] for i in local])):
            out[i] = y
    for (mesh, dst_ids, same_size), index in groups.items():
        if jax.process_count() == 1:
            move = _move_by_copies
        else:
            move = _move_same_layout if same_size else _move_replicated
        for piece, moved in _move_in_pieces(move, mesh, dst_ids, [_key_bits(leaves[i]) for i in index]):
            for i, y in zip([index[j] for j in piece], moved):
                # Then a reshard inside the destination devices (none where the layouts agree),
                # issued before the next piece moves.
                if _is_key(leaves[i]):
                    out[i] = _wrap_key_fn(jax.random.key_impl(leaves[i]), dst[i])(y)
                else:
                    out[i] = y if y.sharding == dst[i] else place([y], [dst[i]])[0]
    return jax.tree.unflatten(treedef, out)


def place(leaves: list, shardings: list) -> list:
    """`jax.device_put(leaves, shardings)`, where inside one process a leaf changes layout over the
    same devices in the same order by a jitted identity instead: its collectives run on the devices.
    `jax.device_put` of a committed array to a layout none of whose shards the array holds (FSDP
    shards to a replicated copy) reads the whole array back to host memory and puts it again, the
    dispatching thread blocked meanwhile."""
    out = list(leaves)
    same, other = [], []
    # Several processes: jax.device_put throughout. A collective among one process's devices,
    # issued between the programs that cross processes, needs every thread of that process's
    # pool while one may be held by its share of another process's move (`_fence`): a 2-process
    # training loop hung there. The host copies remain (docs/known_issues.md); a move's pieces bound them.
    one_process = jax.process_count() == 1
    for i, (x, s) in enumerate(zip(leaves, shardings)):
        (same if one_process and _same_device_order(x, s) and x.sharding != s else other).append(i)
    if same:
        for i, y in zip(same, _identity_fn(tuple(shardings[i] for i in same))(*[leaves[i] for i in same])):
            out[i] = y
    if other:
        for i, y in zip(other, jax.device_put([leaves[i] for i in other], [shardings[i] for i in other])):
            out[i] = y
    return out


def put_in_pieces(tree, dst_shardings):
    """A copy of `tree` (arrays, or host arrays) on `dst_shardings` (a sharding, or a tree prefix of
    shardings) that shares no buffer with it, so the copy can be donated and `tree` read again;
    placed in pieces (`_pieces`), each waited for before the next. `jax.device_put` keeps a buffer
    already on a destination device as that device's shard, so only such leaves are copied first;
    and it slices a host array for each destination device in host memory, so one call for the
    whole tree (full fine-tuning's train state: Qwen-Image-20B's weights and Adam moments, 123 GB)
    would hold those slices, a second copy of the tree, at once. Piece by piece the host holds one
    piece's beyond `tree`. A process holding none of a leaf's destination devices keeps a handle
    only. Every process calls it alike."""
    leaves, treedef = jax.tree.flatten(tree)
    dst = _per_leaf(tree, dst_shardings)
    out: list = [None] * len(leaves)
    for piece in _pieces(leaves):
        mine = [i for i in piece if dst[i].addressable_devices]
        for i in piece:
            if i not in mine:
                x = leaves[i]
                out[i] = jax.make_array_from_single_device_arrays(x.shape, dst[i], [], dtype=x.dtype)
        held = [jnp.copy(leaves[i]) if _on_devices_of(leaves[i], dst[i]) else leaves[i] for i in mine]
        for i, y in zip(mine, jax.block_until_ready(jax.device_put(held, [dst[i] for i in mine]))):
            out[i] = y
    return jax.tree.unflatten(treedef, out)


def _on_devices_of(x, sharding) -> bool:
    return isinstance(x, jax.Array) and bool(x.sharding.device_set & sharding.device_set)


def _same_device_order(x, s) -> bool:
    src = getattr(x, "sharding", None)
    return (isinstance(x, jax.Array) and x.committed and isinstance(src, NamedSharding) and isinstance(s, NamedSharding)
            and src.memory_kind == s.memory_kind and list(src.mesh.devices.flat) == list(s.mesh.devices.flat))


@functools.lru_cache(maxsize=256)  # one entry per layout of every tree placed
def _identity_fn(shardings: tuple):
    return jax.jit(lambda *xs: xs, out_shardings=shardings)


def _through_host(x: jax.Array, dst) -> bool:
    """Whether `jax.device_put(x, dst)` inside one process would copy `x` through host memory:
    between disjoint device sets it copies device to device only where shard k of the source is
    shard k of the destination; any other layout (FSDP shards over 3 train devices onto 1
    rollout device) reads the whole array back to the host and puts it again, the host thread
    blocked throughout (docs/design.md section 2). Such moves go over a mesh spanning both sets,
    as across processes."""
    src = x.sharding
    if not (x.committed and isinstance(src, NamedSharding) and isinstance(dst, NamedSharding)):
        return False
    if src.device_set & dst.device_set:
        return False
    src_index = list(src.devices_indices_map(x.shape).values())
    return src_index != list(dst.devices_indices_map(x.shape).values())


def _move_in_pieces(move, src_mesh: Mesh, dst_ids: tuple, leaves: list):
    """`move` (`_move_same_layout` or `_move_replicated`) of `leaves` piece by piece
    (`_pieces`): yields each piece's positions in `leaves` and its moved arrays, once the
    piece's program has finished (`_fence`) and before the next is issued. Inside one process
    the last piece is not waited for: no other process's collective can hold a thread there,
    and the wait only bounds the buffers of pieces in flight, so a move of one piece (a
    micro-batch's trajectories) leaves the dispatching thread free."""
    pieces = _pieces(leaves)
    for i, piece in enumerate(pieces):
        wait = jax.process_count() > 1 or i + 1 < len(pieces)
        yield piece, move(src_mesh, dst_ids, [leaves[j] for j in piece], wait)


def _pieces(leaves: Sequence) -> list[list[int]]:
    """Positions of `leaves` in runs of consecutive leaves of at most `TRANSFER_PIECE_BYTES`
    together (a larger leaf alone). From shapes and dtypes: every process cuts alike."""
    pieces: list[list[int]] = []
    size = 0
    for i, x in enumerate(leaves):
        if not pieces or size + x.nbytes > TRANSFER_PIECE_BYTES:
            pieces.append([])
            size = 0
        pieces[-1].append(i)
        size += x.nbytes
    return pieces


def crossing_bytes(tree, mesh: Mesh) -> int:
    """Bytes `transfer` carries between device sets to put `tree` on `mesh`: one copy of each
    committed leaf that lives on other devices (uncommitted leaves are values every process
    places from its own copy). From shapes and dtypes: it waits for no device."""
    devices = set(mesh.devices.flat)
    return sum(int(x.nbytes) for x in jax.tree.leaves(tree)
               if isinstance(x, jax.Array) and x.committed and x.sharding.device_set != devices)


def own_copy_everywhere(tree) -> bool:
    """Whether every process holds every leaf of `tree` whole itself (a host array, or an array
    on its own devices), so that `put_own_copy` can place it without moving anything between
    processes. Several processes: every process must call it at the same point (one small
    all-gather of the answers), and all get the same answer."""
    mine = all(isinstance(x, (np.ndarray, np.generic)) or (isinstance(x, jax.Array) and x.is_fully_addressable)
               for x in jax.tree.leaves(tree))
    if jax.process_count() == 1:
        return mine
    return bool(np.all(multihost_utils.process_allgather(np.int32(mine))))


def put_own_copy(tree, dst_shardings):
    """`tree`, which every process holds whole and alike (`own_copy_everywhere`: weights every
    process builds from the same checkpoint or seed), onto `dst_shardings` (a sharding, or a
    tree prefix of shardings): each process places the slices of its own destination devices
    from its own copy. Nothing crosses between processes and no program spans them; an array
    already on a destination device that takes it whole is that device's shard as it is (no
    second copy there). Dispatched asynchronously."""
    leaves, treedef = jax.tree.flatten(tree)
    dst = _per_leaf(tree, dst_shardings)
    return jax.tree.unflatten(treedef, [_put_own_copy(x, s) for x, s in zip(leaves, dst)])


def _per_leaf(tree, dst_shardings) -> list:
    """The sharding of every leaf of `tree` from a sharding or a tree prefix of shardings."""
    is_sharding = lambda s: isinstance(s, jax.sharding.Sharding)  # noqa: E731
    per_leaf = jax.tree.map(lambda s, sub: jax.tree.map(lambda _: s, sub), dst_shardings, tree, is_leaf=is_sharding)
    return jax.tree.leaves(per_leaf)


def to_every_process(tree):
    """Every leaf as an array this process holds whole on one of its own devices, for host
    reads that every process makes alike (rewards of decoded pixels, metrics).

    One process: the tree as it is. Several: a leaf is replicated inside its own devices (an
    all-gather inside its role), then each process that owns none of them receives one copy
    on its first device (`transfer`, so its bytes cross once per such process). Every process
    must call it with the same tree, from the dispatching thread (it runs collectives).
    Dispatched asynchronously: reading the result on the host is what waits.
    """
    if jax.process_count() == 1:
        return tree
    leaves, treedef = jax.tree.flatten(tree)
    me = jax.process_index()
    first_device = {}
    for d in sorted(jax.devices(), key=lambda d: d.id):
        first_device.setdefault(d.process_index, d)
    out = list(leaves)  # uncommitted leaves are values every process already holds (see `transfer`)
    by_mesh: dict[Mesh, list[int]] = {}  # the leaves of one mesh move in one call
    for i, x in enumerate(leaves):
        if x.committed:
            by_mesh.setdefault(x.sharding.mesh, []).append(i)
    for mesh, index in by_mesh.items():
        whole = transfer([leaves[i] for i in index], NamedSharding(mesh, PartitionSpec()))
        owners = {d.process_index for d in mesh.devices.flat}
        others = [first_device[p] for p in sorted(first_device) if p not in owners]
        if others:
            sent = transfer(whole, NamedSharding(Mesh(np.array(others), (_TRANSFER_AXIS,)), PartitionSpec()))
            whole = whole if me in owners else sent
        for i, y in zip(index, whole):
            out[i] = y.addressable_shards[0].data
    return jax.tree.unflatten(treedef, out)


def whole_on_one_process(x: jax.Array) -> tuple[jax.Array | None, int]:
    """(`x` readable whole on the host of one process, or None on the others; that process).

    `x` as it is when its devices belong to one process; else it is first replicated inside its
    devices (a collective among their processes: every process calls this, like any program of
    theirs) and the lowest of those processes reads its own copy."""
    processes = {d.process_index for d in x.sharding.device_set}
    owner = min(processes)
    if len(processes) > 1:
        x = jax.device_put(x, NamedSharding(x.sharding.mesh, PartitionSpec()))
        x = x.addressable_shards[0].data if jax.process_index() == owner else x
    return (x if jax.process_index() == owner else None), owner


def _put_own_copy(x, sharding) -> jax.Array:
    """`x` (a value every process holds alike: an array, or a host array) on `sharding`: each
    process places the slices of its own devices from its own copy."""
    indices = sharding.addressable_devices_indices_map(x.shape)
    shards = [jax.device_put(x[index], device) for device, index in indices.items()]
    return jax.make_array_from_single_device_arrays(x.shape, sharding, shards, dtype=x.dtype)


def _is_key(x) -> bool:
    return jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _key_bits(x) -> jax.Array:
    # Typed PRNG keys (a trajectory's sample keys) travel as their uint32 words.
    return jax.random.key_data(x) if _is_key(x) else x


@functools.lru_cache(maxsize=64)
def _wrap_key_fn(impl, sharding):
    return jax.jit(functools.partial(jax.random.wrap_key_data, impl=impl), out_shardings=sharding)


def _devices_by_id(ids) -> np.ndarray:
    lookup = {d.id: d for d in jax.devices()}
    return np.array([lookup[i] for i in ids], dtype=object)


def _as_rows(x, mesh: Mesh) -> jax.Array:
    # Scalars get a leading axis so that every leaf can be concatenated along axis 0.
    return _row_fn(NamedSharding(mesh, PartitionSpec()))(x) if x.ndim == 0 else x


@functools.lru_cache(maxsize=64)
def _row_fn(sharding):
    return jax.jit(lambda a: a.reshape(1), out_shardings=sharding)


def _from_rows(y, shape) -> jax.Array:
    return y.reshape(shape) if len(shape) == 0 else y


@functools.lru_cache(maxsize=256)  # one entry per piece layout of every tree that moves
def _zeros_fn(shardings: tuple, shapes: tuple, dtypes: tuple):
    return jax.jit(
        lambda: tuple(jax.numpy.zeros(s, d) for s, d in zip(shapes, dtypes)), out_shardings=shardings
    )


def _combined(leaves, mesh: Mesh, specs, shapes, dst_mesh: Mesh, dst_specs) -> list[jax.Array]:
    """Global arrays over `mesh`: each leaf's shards on the source devices (no copy) and,
    on the destination devices, zero receive buffers of the same shard shapes (made in one
    jitted call). Every process passes only its own shards."""
    receive = _zeros_fn(
        tuple(NamedSharding(dst_mesh, s) for s in dst_specs),
        tuple(x.shape for x in leaves),
        tuple(x.dtype for x in leaves),
    )()
    arrays = []
    for x, zeros, spec, shape in zip(leaves, receive, specs, shapes):
        local = {s.device: s.data for s in x.addressable_shards}
        local.update({s.device: s.data for s in zeros.addressable_shards})
        sharding = NamedSharding(mesh, spec)
        buffers = [local[d] for d in sharding.addressable_devices_indices_map(shape)]
        arrays.append(jax.make_array_from_single_device_arrays(shape, sharding, buffers, dtype=x.dtype))
    return arrays


def _dst_part(y, sharding: NamedSharding, shape) -> jax.Array:
    """The destination devices' shards of a combined array, as an array of its own."""
    dst = set(sharding.device_set)
    buffers = [s.data for s in y.addressable_shards if s.device in dst]
    return jax.make_array_from_single_device_arrays(shape, sharding, buffers, dtype=y.dtype)


@functools.lru_cache(maxsize=256)  # one entry per piece layout of every tree that moves
def _ppermute_fn(mesh: Mesh, specs: tuple, rounds: tuple):
    """jit(shard_map) running each round's (source, destination) pairs along the transfer
    axis; every destination receives in exactly one round, the other devices end with zeros."""
    axis_size = mesh.shape[_TRANSFER_AXIS]

    def move(*blocks):
        result = []
        for block in blocks:
            received = jax.lax.ppermute(block, _TRANSFER_AXIS, rounds[0])
            for pairs in rounds[1:]:
                receivers = np.zeros(axis_size, bool)
                receivers[[dst for _, dst in pairs]] = True
                here = jax.numpy.asarray(receivers)[jax.lax.axis_index(_TRANSFER_AXIS)]
                received = jax.numpy.where(here, jax.lax.ppermute(block, _TRANSFER_AXIS, pairs), received)
            result.append(received)
        return tuple(result)

    return jax.jit(jax.shard_map(move, mesh=mesh, in_specs=specs, out_specs=specs))


def _fence(moved: tuple, wait: bool = True) -> tuple:
    """Wait (if `wait`) until a cross-process move has finished on this process's devices.

    Why (the jax 0.10 CPU client over gloo, by its scheduling rules): a process's pool of executor
    threads is as large as its device count, because the participants of a collective each
    block a thread until all have joined; so programs that span several local devices run one
    at a time, in dispatch order. A program with one local device (this process's share of a
    `to_every_process` move, one receiving device) is not in that order: it runs beside it and
    blocks its thread until the other process joins. Without the wait a process could dispatch
    move B while its earlier move A still queued behind local work; B's participant then holds
    a thread the local work needs (or B runs before A), while the other process waits in A for
    this one: a cycle. With it, every process has at most one cross-process program pending,
    and it is the same one everywhere (every process dispatches the same programs in the same
    order); all that either process enqueued before it is local work that finishes without the
    other process, so the move always completes (provided local work cannot starve itself: a
    device with 32 programs in flight can, which `Executor._train` prevents). Device work
    dispatched before the move still overlaps with it.
    """
    return jax.block_until_ready(moved) if wait else moved


def _lead(entry) -> tuple:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


def _move_same_layout(src_mesh: Mesh, dst_ids: tuple, leaves: list, wait: bool = True) -> list:
    """Equal role sizes: destination device k takes the shard of source mesh position k."""
    dst_grid = _devices_by_id(dst_ids).reshape(src_mesh.devices.shape)
    combined = Mesh(np.stack([src_mesh.devices, dst_grid]), (_TRANSFER_AXIS, *src_mesh.axis_names))
    dst_mesh = Mesh(dst_grid, src_mesh.axis_names)
    rows = [_as_rows(x, src_mesh) for x in leaves]
    dst_specs = [PartitionSpec(*x.sharding.spec) for x in rows]
    # Axis 0 doubles: the source half on the source devices, the destination half after it.
    specs = [PartitionSpec((_TRANSFER_AXIS, *_lead(s[0] if len(s) else None)), *s[1:]) for s in dst_specs]
    shapes = [(2 * r.shape[0], *r.shape[1:]) for r in rows]
    blocks = _combined(rows, combined, specs, shapes, dst_mesh, dst_specs)
    moved = _fence(_ppermute_fn(combined, tuple(specs), (((0, 1),),))(*blocks), wait)
    return [
        _from_rows(_dst_part(y, NamedSharding(dst_mesh, spec), r.shape), x.shape)
        for y, spec, r, x in zip(moved, dst_specs, rows, leaves)
    ]


def _move_by_copies(src_mesh: Mesh, dst_ids: tuple, leaves: list, wait: bool = True) -> list:
    """One process: replicate inside the source devices (collectives there), then every
    destination device copies the whole array from a source device (device to device)."""
    replicated = place(leaves, [NamedSharding(src_mesh, PartitionSpec())] * len(leaves))
    dst = NamedSharding(Mesh(_devices_by_id(dst_ids), (_TRANSFER_AXIS,)), PartitionSpec())
    return list(_fence(tuple(jax.device_put(replicated, [dst] * len(leaves))), wait))


def _move_replicated(src_mesh: Mesh, dst_ids: tuple, leaves: list, wait: bool = True) -> list:
    """Unequal role sizes: replicate inside the source role, then every destination device
    receives the whole array from source device (k mod n_src) in round k // n_src."""
    src_devices = list(src_mesh.devices.flat)
    dst_devices = list(_devices_by_id(dst_ids))
    n_src, n_dst = len(src_devices), len(dst_devices)
    union = Mesh(np.array(src_devices + dst_devices, dtype=object), (_TRANSFER_AXIS,))
    dst_mesh = Mesh(np.array(dst_devices, dtype=object), (_TRANSFER_AXIS,))
    rounds = tuple(
        tuple((k % n_src, n_src + k) for k in range(start, min(start + n_src, n_dst)))
        for start in range(0, n_dst, n_src)
    )
    replicated = NamedSharding(src_mesh, PartitionSpec())
    rows = [_as_rows(y, src_mesh) for y in place(leaves, [replicated] * len(leaves))]
    spec = PartitionSpec(_TRANSFER_AXIS)
    shapes = [((n_src + n_dst) * r.shape[0], *r.shape[1:]) for r in rows]
    blocks = _combined(rows, union, [spec] * len(rows), shapes, dst_mesh, [PartitionSpec()] * len(rows))
    moved = _fence(_ppermute_fn(union, (spec,) * len(blocks), rounds)(*blocks), wait)
    return [
        _from_rows(_dst_part(y, NamedSharding(dst_mesh, PartitionSpec()), r.shape), x.shape)
        for y, r, x in zip(moved, rows, leaves)
    ]
