"""Multi-host layer: process start-up, host-aligned role device lists, cross-role transfers.

Every process runs the same program (multi-controller JAX, docs/design.md section 2). The pieces:

* `initialize` starts `jax.distributed` from explicit settings (config or `JAX_*` env), from
  a SLURM step (one task per GPU, or one task per node owning all its GPUs) or, on a Cloud TPU
  VM, with no arguments (JAX reads the slice's hosts from the TPU metadata), and the peer
  watchdog (`peer_watchdog`: a dead process ends the others); a single process is a no-op.
  `resolve_settings` is the pure part, tested without a cluster.
* `role_devices` cuts the global device list into contiguous role lists (rollout, train,
  optionally reward); on several hosts a role is either inside one host or whole hosts.
* `transfer` moves a pytree of arrays from one role's devices to another role's shardings
  (weight sync trainer -> rollout, trajectories rollout -> trainer). What every process holds
  whole already (the frozen base and the decoder weights, built alike by every process) is
  not moved: `put_own_copy` places each process's own copy on its own devices.
* `to_every_process` gives every process a copy it can read on the host (metrics, evaluation
  samples, the values a checkpoint checks). `whole_on_one_process` and `SharedValues` serve
  what one process computes for all: the process holding a micro-batch's decoded samples
  scores them and shares the rewards through the key-value store, and every process computes
  the advantages from them alike, so the trainer's inputs need no device transfer of pixels.

What moves data across processes (measured with jax 0.10.2 on CPU, 2 processes x 4 devices):

* `jax.device_put` to a sharding whose devices belong to another process raises "backend
  does not support cross-host device transfers" unless the DCN transfer server is enabled
  (`jax_cross_host_transfer_socket_address`); with it enabled on CPU the put returns but the
  receiving side never gets the data (the reader blocks until killed). Not usable here.
* A jitted computation over a mesh that spans both roles does work, over gloo on CPU
  (`jax_cpu_collectives_implementation='gloo'`, set by `initialize`); on GPU the same
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
  trajectories) moves in one call, so dispatch stays cheap for trees of many leaves.
  Measured on the 2-core CPU machine under load (gloo over loopback, 64 MiB in 16 leaves,
  timed on the receiving process): 4 -> 4 devices FSDP -> FSDP 130-150 ms, FSDP ->
  replicated (move, then all-gather) about 300 ms, 4 -> 2 devices replicated 180-230 ms; an
  in-process device_put of the same tree between two 2-device meshes 30 ms.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import glob
import importlib.util
import os
import re
import threading
from collections.abc import Mapping, Sequence
from typing import Any, Callable

import jax
import numpy as np
from jax._src.distributed import global_state
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from digen_jax.runtime import peer_watchdog

# Environment variables for explicit (non-SLURM) launches; JAX_COORDINATOR_ADDRESS,
# JAX_COORDINATOR_PORT and JAX_LOCAL_DEVICE_IDS are the names jax itself reads.
ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"
ENV_COORDINATOR_PORT = "JAX_COORDINATOR_PORT"
ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"
ENV_LOCAL_DEVICE_IDS = "JAX_LOCAL_DEVICE_IDS"
_SLURM_REQUIRED = ("SLURM_JOB_ID", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")
_TRANSFER_AXIS = "_transfer"
# Most bytes (of whole arrays, summed over the leaves) one cross-process move program carries:
# the bound on its extra buffers per device. Above the fp32 LoRA adapters of every model-zoo
# config (1.6 GiB for Qwen-Image's rank 64), which then still move in one program. Read at
# each call, so tests can lower it.
TRANSFER_PIECE_BYTES = 2 << 30


@dataclasses.dataclass(frozen=True)
class DistributedSettings:
    """How this process joins a multi-process run (config section `runtime.distributed`).

    enabled: 'auto' (SLURM step or `JAX_*` env if present, else one process), True (must
      find a multi-process setting), False (never initialise).
    coordinator_address: 'host:port' of process 0; None: from env or SLURM.
    num_processes, process_id: None: from env or SLURM.
    local_device_ids: GPU indices this process drives; None: one task per GPU gets its
      SLURM local rank unless CUDA_VISIBLE_DEVICES already names a single GPU, one task per
      node gets every visible GPU.
    initialization_timeout: seconds to wait for every process to join.
    """

    enabled: bool | str = "auto"
    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    local_device_ids: tuple[int, ...] | None = None
    initialization_timeout: int = 300

    @classmethod
    def from_config(cls, config) -> "DistributedSettings":
        """Read `config.runtime.distributed` (absent section or keys: defaults)."""
        section = _get(_get(config, "runtime"), "distributed")
        if section is None:
            return cls()
        if isinstance(section, (bool, str)):
            return cls(enabled=section)
        known = {f.name for f in dataclasses.fields(cls)}
        values = dict(section.items() if hasattr(section, "items") else vars(section))
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown keys runtime.distributed.{unknown}; known: {sorted(known)}")
        ids = values.get("local_device_ids")
        if ids is not None:
            values["local_device_ids"] = tuple(int(i) for i in ids)
        return cls(**values)


@dataclasses.dataclass(frozen=True)
class ProcessLayout:
    """The resolved launch: what `jax.distributed.initialize` is called with.

    source: 'single', 'explicit', 'slurm-task-per-gpu', 'slurm-task-per-node' or 'tpu-vm' (the
    process count and index known once `jax.distributed` has started).
    """

    source: str
    num_processes: int = 1
    process_id: int = 0
    coordinator_address: str | None = None
    local_device_ids: tuple[int, ...] | None = None


def _get(section, key):
    if section is None:
        return None
    if isinstance(section, Mapping):
        return section.get(key)
    try:
        return section[key]  # ml_collections.ConfigDict
    except (KeyError, TypeError, AttributeError):
        return getattr(section, key, None)


def _int_env(env: Mapping[str, str], name: str) -> int | None:
    if name not in env or env[name] == "":
        return None
    try:
        return int(env[name])
    except ValueError:
        raise ValueError(f"environment variable {name}={env[name]!r} is not an integer") from None


def first_slurm_host(nodelist: str) -> str:
    """The first host name of a SLURM node list ('gpu[003-008,012],cpu01' -> 'gpu003')."""
    host, depth = [], 0
    skipping = False
    for ch in nodelist:
        if depth == 0 and ch == ",":
            break
        if ch == "[":
            depth, skipping = depth + 1, False
        elif ch == "]":
            depth -= 1
        elif depth > 0:
            # Inside a bracket: keep the first number of the first range only.
            if ch in ",-":
                skipping = True
            elif not skipping:
                host.append(ch)
        else:
            host.append(ch)
    if depth != 0 or not host:
        raise ValueError(f"cannot parse SLURM node list {nodelist!r}")
    return "".join(host)


def _slurm_tasks_per_node(env: Mapping[str, str], num_tasks: int) -> int:
    """Tasks on this node: SLURM_NTASKS_PER_NODE, else SLURM_STEP_TASKS_PER_NODE ('4(x2)'),
    else the even split of SLURM_NTASKS over the step's nodes."""
    explicit = _int_env(env, "SLURM_NTASKS_PER_NODE")
    if explicit is not None:
        return explicit
    for name in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        if env.get(name):
            counts = {int(m) for m in re.findall(r"(\d+)(?:\(x\d+\))?", env[name])}
            if len(counts) != 1:
                raise ValueError(
                    f"{name}={env[name]!r}: nodes run different task counts; launch the same number per node"
                )
            return counts.pop()
    nodes = _int_env(env, "SLURM_STEP_NUM_NODES") or _int_env(env, "SLURM_NNODES") or 1
    return max(1, num_tasks // nodes)


def on_tpu_vm() -> bool:
    """Whether this host is a Cloud TPU VM (libtpu installed, TPU chips present), found without
    starting a JAX backend."""
    chips = glob.glob("/dev/accel[0-9]*") or glob.glob("/dev/vfio/[0-9]*")
    return bool(chips) and importlib.util.find_spec("libtpu") is not None


def resolve_settings(settings: DistributedSettings, env: Mapping[str, str], tpu_vm: bool = False) -> ProcessLayout:
    """The process layout from explicit settings, then `JAX_*` env, then SLURM env, then (on a
    Cloud TPU VM, `tpu_vm`) the TPU slice's own (pure).

    Explicit values win over SLURM's but must agree with it when both are present.
    """
    if settings.enabled not in (True, False, "auto"):
        raise ValueError(f"runtime.distributed.enabled must be True, False or 'auto', got {settings.enabled!r}")
    if settings.enabled is False:
        return ProcessLayout("single")
    address = settings.coordinator_address or env.get(ENV_COORDINATOR) or None
    num = settings.num_processes if settings.num_processes is not None else _int_env(env, ENV_NUM_PROCESSES)
    pid = settings.process_id if settings.process_id is not None else _int_env(env, ENV_PROCESS_ID)
    ids = settings.local_device_ids
    if ids is None and env.get(ENV_LOCAL_DEVICE_IDS):
        ids = tuple(int(i) for i in env[ENV_LOCAL_DEVICE_IDS].split(","))
    source = "explicit"

    in_slurm = all(name in env for name in _SLURM_REQUIRED)
    if in_slurm:
        slurm_num, slurm_pid = int(env["SLURM_NTASKS"]), int(env["SLURM_PROCID"])
        for key, given, found in (("num_processes", num, slurm_num), ("process_id", pid, slurm_pid)):
            if given is not None and given != found:
                raise ValueError(
                    f"runtime.distributed.{key}={given} contradicts the SLURM step ({found}); "
                    "leave it unset under SLURM"
                )
        num, pid = slurm_num, slurm_pid
        if address is None:
            nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
            if not nodelist:
                raise ValueError(
                    "SLURM step without SLURM_STEP_NODELIST/SLURM_JOB_NODELIST: "
                    "set runtime.distributed.coordinator_address"
                )
            # A port every task derives alike: JAX_COORDINATOR_PORT, else one from the job id.
            port = _int_env(env, ENV_COORDINATOR_PORT) or 61440 + int(env["SLURM_JOB_ID"]) % 4096
            address = f"{first_slurm_host(nodelist)}:{port}"
        per_node = _slurm_tasks_per_node(env, num)
        if per_node > 1:
            source = "slurm-task-per-gpu"
            visible = [v for v in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if v]
            if ids is None and len(visible) > 1 and len(visible) != per_node:
                raise ValueError(
                    f"{per_node} SLURM tasks per node but CUDA_VISIBLE_DEVICES lists {len(visible)} GPUs: "
                    "run one task per GPU or one task per node (launch/slurm/README.md)"
                )
            if ids is None and len(visible) != 1:
                # The task sees all GPUs of the node: drive the one of its local rank.
                ids = (int(env["SLURM_LOCALID"]),)
        else:
            source = "slurm-task-per-node"

    if num is None and pid is None and address is None:
        if settings.enabled is True and tpu_vm:  # JAX reads the slice's hosts from the TPU VM's metadata
            return ProcessLayout("tpu-vm")
        if settings.enabled is True:
            raise ValueError(
                "runtime.distributed is on but there is no SLURM step and no coordinator: run under srun "
                f"(launch/slurm/) or set {ENV_COORDINATOR}/{ENV_NUM_PROCESSES}/{ENV_PROCESS_ID} "
                "(or runtime.distributed.coordinator_address/num_processes/process_id)"
            )
        return ProcessLayout("single")
    if num is None or pid is None:
        raise ValueError(
            "runtime.distributed: num_processes and process_id must both be set "
            f"(or {ENV_NUM_PROCESSES}/{ENV_PROCESS_ID}), got num_processes={num}, process_id={pid}"
        )
    if num < 1 or not 0 <= pid < num:
        raise ValueError(f"runtime.distributed.process_id={pid} must be in [0, num_processes={num})")
    if num == 1:
        return ProcessLayout("single")
    if address is None:
        raise ValueError(
            f"runtime.distributed.coordinator_address (or {ENV_COORDINATOR}) is needed for {num} processes"
        )
    if not re.fullmatch(r"\[?[\w.:-]+\]?:\d+", address):
        raise ValueError(f"runtime.distributed.coordinator_address must be 'host:port', got {address!r}")
    return ProcessLayout(source, num, pid, address, ids)


def initialize(config_or_settings=None, env: Mapping[str, str] | None = None) -> ProcessLayout:
    """Join the multi-process run described by a config (`runtime.distributed`), settings or env.

    Call before any other JAX work. A single process returns without touching
    `jax.distributed`. On CPU, collectives across processes go over gloo. Several processes
    also start the peer watchdog (`peer_watchdog`): a process that dies or freezes ends every
    other one within `runtime.peer_timeout_s` (of a config; else `peer_watchdog.PEER_TIMEOUT_S`).
    """
    if isinstance(config_or_settings, DistributedSettings):
        settings, peer_timeout_s = config_or_settings, None
    elif config_or_settings is None:
        settings, peer_timeout_s = DistributedSettings(), None
    else:
        settings = DistributedSettings.from_config(config_or_settings)
        peer_timeout_s = _get(_get(config_or_settings, "runtime"), "peer_timeout_s")
    layout = resolve_settings(settings, os.environ if env is None else env, tpu_vm=on_tpu_vm())
    if layout.source == "tpu-vm":  # every host of the slice runs the same command
        if not jax.distributed.is_initialized():
            jax.distributed.initialize()
        layout = ProcessLayout("tpu-vm", jax.process_count(), jax.process_index(), global_state.coordinator_address)
    if layout.num_processes == 1:
        return layout
    peer_timeout_s = peer_watchdog.check_timeout(
        peer_watchdog.PEER_TIMEOUT_S if peer_timeout_s is None else peer_timeout_s
    )
    if jax.distributed.is_initialized():
        if (jax.process_count(), jax.process_index()) != (layout.num_processes, layout.process_id):
            raise ValueError(
                f"jax.distributed is already initialised as process {jax.process_index()} of "
                f"{jax.process_count()}, not {layout.process_id} of {layout.num_processes}"
            )
    else:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            coordinator_address=layout.coordinator_address,
            num_processes=layout.num_processes,
            process_id=layout.process_id,
            local_device_ids=list(layout.local_device_ids) if layout.local_device_ids is not None else None,
            # Everything is resolved above; jax's own detection would pin one GPU per SLURM task.
            cluster_detection_method="deactivate",
            initialization_timeout=settings.initialization_timeout,
            # JAX's own detection of a silent process (an abort with a stack dump) only backs up the watchdog's.
            heartbeat_timeout_seconds=peer_watchdog.jax_heartbeat_timeout_s(peer_timeout_s),
        )
    peer_watchdog.start(layout.process_id, layout.num_processes, peer_timeout_s, layout.coordinator_address)
    return layout


# ---------------------------------------------------------------------------- role devices


def role_devices(
    devices: Sequence[Any],
    sizes: Mapping[str, int],
    colocated: bool = False,
    optional: Sequence[str] = ("reward",),
    key_format: str = "runtime.{role}_devices",
) -> dict[str, list]:
    """Split `devices` into contiguous role lists, in the order of `sizes`.

    sizes: role -> device count; 0 means an even split of the devices the others leave,
      except for roles in `optional`, where 0 means the role is absent. The roles must use
      every device. Devices are ordered by (process_index, id); on several hosts every role
      is either inside one host or made of whole hosts, so no role splits a host unless it
      is smaller than one.
    colocated: every role gets every device (one shared mesh); sizes are not used.
    key_format: how a role's config key is named in errors.
    """
    devices = sorted(devices, key=lambda d: (d.process_index, d.id))
    if not devices:
        raise ValueError("no devices to split into roles")
    if colocated:
        return {role: list(devices) for role in sizes}
    key = lambda role: key_format.format(role=role)  # noqa: E731
    for role, n in sizes.items():
        if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 0:
            raise ValueError(f"{key(role)} must be a device count >= 0, got {n!r}")
    listing = ", ".join(f"{key(r)}={n}" for r, n in sizes.items())
    fixed = sum(sizes.values())
    shared = [role for role, n in sizes.items() if n == 0 and role not in optional]
    counts = {role: n for role, n in sizes.items() if n > 0}
    if shared:
        left = len(devices) - fixed
        if left <= 0 or left % len(shared):
            raise ValueError(
                f"{listing}: the {left} devices left of {len(devices)} do not split evenly over "
                f"{', '.join(key(r) for r in shared)} (0 = an even share)"
            )
        counts.update({role: left // len(shared) for role in shared})
    elif fixed != len(devices):
        raise ValueError(f"{listing} add up to {fixed} devices, but there are {len(devices)}")
    counts = {role: counts[role] for role in sizes if role in counts}

    host_of = [d.process_index for d in devices]
    host_start = {h: host_of.index(h) for h in dict.fromkeys(host_of)}
    host_size = {h: host_of.count(h) for h in host_start}
    multi_host = len(host_start) > 1
    roles, cursor = {}, 0
    for role, n in counts.items():
        span = devices[cursor:cursor + n]
        first, last = span[0].process_index, span[-1].process_index
        if multi_host and first != last:
            whole = cursor == host_start[first] and cursor + n == host_start[last] + host_size[last]
            if not whole:
                per_host = sorted(set(host_size.values()))
                raise ValueError(
                    f"{key(role)}={n} splits a host: with {per_host} devices per host a role "
                    "must fit inside one host or consist of whole hosts (reorder or resize the roles)"
                )
        roles[role] = span
        cursor += n
    return roles


# ---------------------------------------------------------------------------- transfers


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
        for i, y in zip(local, jax.device_put([leaves[i] for i in local], [dst[i] for i in local])):
            out[i] = y
    for (mesh, dst_ids, same_size), index in groups.items():
        move = _move_same_layout if same_size else _move_replicated
        for piece, moved in _move_in_pieces(move, mesh, dst_ids, [_key_bits(leaves[i]) for i in index]):
            for i, y in zip([index[j] for j in piece], moved):
                # Then a reshard inside the destination devices (none where the layouts agree),
                # issued before the next piece moves.
                if _is_key(leaves[i]):
                    out[i] = _wrap_key_fn(jax.random.key_impl(leaves[i]), dst[i])(y)
                else:
                    out[i] = y if y.sharding == dst[i] else jax.device_put(y, dst[i])
    return jax.tree.unflatten(treedef, out)


def _through_host(x: jax.Array, dst) -> bool:
    """Whether `jax.device_put(x, dst)` inside one process would copy `x` through host memory:
    between disjoint device sets it copies device to device only where shard k of the source is
    shard k of the destination; any other layout (FSDP shards over 3 train devices onto 1
    rollout device) reads the whole array back to the host and puts it again (35 s for
    Qwen-Image-20B's 41 GB on 4 H200s, the host thread blocked throughout). Such moves go over
    a mesh spanning both sets, as across processes."""
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
    piece's program has finished (`_fence`) and before the next is issued."""
    for piece in _pieces(leaves):
        yield piece, move(src_mesh, dst_ids, [leaves[j] for j in piece])


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


class SharedValues:
    """Small host arrays that one process computes and every other one reads (the rewards of a
    micro-batch), through the coordination service's key-value store of `jax.distributed`.

    No device program is involved, so reading one adds nothing to the order in which the
    processes issue their cross-process programs (dispatch.py). Names are scoped to this
    object: every process makes its `SharedValues` at the same point of the run, so the
    scopes agree. A failure is shared too: a reader gets an error naming the process that
    failed instead of waiting for a value that never comes.
    """

    _made = 0  # objects made so far in this process: the scope of the next one
    _POLL_MS = 2000  # a reader checks this often whether the object was closed

    def __init__(self):
        SharedValues._made += 1
        self._scope = f"digen/shared/{SharedValues._made}"
        self._closed = threading.Event()
        # Readers wait on threads of their own: a reader that held a thread of the pool that
        # computes values could wait for a value of another process whose own computing thread
        # waits the same way for one of this process's.
        self._readers = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="shared-read")

    @staticmethod
    def _client():
        return global_state.client

    def publish(self, name: str, value: np.ndarray) -> None:
        self._client().key_value_set_bytes(f"{self._scope}/{name}", b"=" + np.ascontiguousarray(value).tobytes())

    def fail(self, name: str, error: BaseException) -> None:
        message = f"process {jax.process_index()} failed: {type(error).__name__}: {error}"
        self._client().key_value_set_bytes(f"{self._scope}/{name}", b"!" + message.encode())

    def read_later(self, name: str, dtype, then: Callable[[np.ndarray], Any] | None = None) -> concurrent.futures.Future:
        """The future value `name` (`read` on a reading thread), passed through `then` there if given."""
        if then is None:
            return self._readers.submit(self.read, name, dtype)
        return self._readers.submit(lambda: then(self.read(name, dtype)))

    def read(self, name: str, dtype) -> np.ndarray:
        """The value `name` as a flat array of `dtype`, once published (waits)."""
        key = f"{self._scope}/{name}"
        while True:
            if self._closed.is_set():
                raise RuntimeError(f"stopped waiting for {name}: the run is closing")
            try:
                raw = self._client().blocking_key_value_get_bytes(key, self._POLL_MS)
                break
            except Exception as e:  # noqa: BLE001 - a timeout: poll again (anything else shows in the next try)
                if "DEADLINE_EXCEEDED" not in str(e) and "deadline" not in str(e).lower():
                    raise
        if raw[:1] == b"!":
            raise RuntimeError(f"{name}: {raw[1:].decode()}")
        return np.frombuffer(raw[1:], dtype=dtype).copy()

    def share_scalars(self, name: str, values: dict[str, jax.Array], pool: concurrent.futures.Executor
                      ) -> dict[str, concurrent.futures.Future]:
        """Every process's future host copy of `values` (scalar arrays of one set of devices),
        without a device program: the lowest process holding them reads its own copy on `pool`
        once computed and publishes it; every other process reads it here. Each value keeps its
        dtype (they travel as float64, exact for the float32, integer and boolean figures)."""
        names = list(values)
        arrays = [values[n] for n in names]
        owner = min(d.process_index for x in arrays for d in x.sharding.device_set)
        if jax.process_index() == owner:
            def read_and_publish() -> list[np.ndarray]:
                try:
                    host = [np.asarray(x.addressable_shards[0].data) for x in arrays]  # scalars: whole in every shard
                except BaseException as e:
                    self.fail(name, e)
                    raise
                self.publish(name, np.array([v.item() for v in host], np.float64))
                return host
            whole = pool.submit(read_and_publish)
        else:
            whole = self._readers.submit(
                lambda: [np.asarray(v, x.dtype) for v, x in zip(self.read(name, np.float64), arrays)])
        each = {n: concurrent.futures.Future() for n in names}

        def split(done: concurrent.futures.Future) -> None:
            error = done.exception()
            for i, n in enumerate(names):
                each[n].set_exception(error) if error else each[n].set_result(done.result()[i])

        whole.add_done_callback(split)
        return each

    def close(self) -> None:
        self._closed.set()
        self._readers.shutdown(wait=True)


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


def _fence(moved: tuple) -> tuple:
    """Wait until a cross-process move has finished on this process's devices.

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
    return jax.block_until_ready(moved)


def _lead(entry) -> tuple:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


def _move_same_layout(src_mesh: Mesh, dst_ids: tuple, leaves: list) -> list:
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
    moved = _fence(_ppermute_fn(combined, tuple(specs), (((0, 1),),))(*blocks))
    return [
        _from_rows(_dst_part(y, NamedSharding(dst_mesh, spec), r.shape), x.shape)
        for y, spec, r, x in zip(moved, dst_specs, rows, leaves)
    ]


def _move_replicated(src_mesh: Mesh, dst_ids: tuple, leaves: list) -> list:
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
    rows = [_as_rows(y, src_mesh) for y in jax.device_put(leaves, [replicated] * len(leaves))]
    spec = PartitionSpec(_TRANSFER_AXIS)
    shapes = [((n_src + n_dst) * r.shape[0], *r.shape[1:]) for r in rows]
    blocks = _combined(rows, union, [spec] * len(rows), shapes, dst_mesh, [PartitionSpec()] * len(rows))
    moved = _fence(_ppermute_fn(union, (spec,) * len(blocks), rounds)(*blocks))
    return [
        _from_rows(_dst_part(y, NamedSharding(dst_mesh, PartitionSpec()), r.shape), x.shape)
        for y, r, x in zip(moved, rows, leaves)
    ]
