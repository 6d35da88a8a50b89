"""Multi-host start-up: joining the processes of a run, and host-aligned role device lists.

Every process runs the same program (multi-controller JAX, docs/design.md section 2). The pieces:

* `initialize` starts `jax.distributed` from explicit settings (typed, or `JAX_*` env), from
  a SLURM step (one task per GPU, or one task per node owning all its GPUs) or, on a Cloud TPU
  VM, with no arguments (JAX reads the slice's hosts from the TPU metadata), and the peer
  watchdog (`peer_watchdog`: a dead process ends the others); a single process is a no-op.
  `resolve_settings` is the pure part, tested without a cluster.
* `role_devices` cuts the global device list into contiguous role lists (rollout, train,
  optionally reward); on several hosts a role is either inside one host or whole hosts.

Moving arrays between roles and processes is `transfer.py`; small host values one process
computes for all travel through `shared_values.py`.
"""
from __future__ import annotations

import dataclasses
import glob
import importlib.util
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax._src.distributed import global_state

from digen_jax.runtime import peer_watchdog

# Environment variables for explicit (non-SLURM) launches; JAX_COORDINATOR_ADDRESS,
# JAX_COORDINATOR_PORT and JAX_LOCAL_DEVICE_IDS are the names jax itself reads.
ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"
ENV_COORDINATOR_PORT = "JAX_COORDINATOR_PORT"
ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"
ENV_LOCAL_DEVICE_IDS = "JAX_LOCAL_DEVICE_IDS"
_SLURM_REQUIRED = ("SLURM_JOB_ID", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")


@dataclasses.dataclass(frozen=True)
class DistributedSettings:
    """How this process joins a multi-process run (config section `runtime.distributed` and
    `runtime.peer_timeout_s`, read by `app.settings.distributed_settings`).

    enabled: 'auto' (SLURM step or `JAX_*` env if present, else one process), True (must
      find a multi-process setting), False (never initialise).
    coordinator_address: 'host:port' of process 0; None: from env or SLURM.
    num_processes, process_id: None: from env or SLURM.
    local_device_ids: GPU indices this process drives; None: one task per GPU gets its
      SLURM local rank unless CUDA_VISIBLE_DEVICES already names a single GPU, one task per
      node gets every visible GPU.
    initialization_timeout: seconds to wait for every process to join.
    peer_timeout_s: seconds within which every process stops when one dies or freezes (the
      peer watchdog's); None: `peer_watchdog.PEER_TIMEOUT_S`.
    """

    enabled: bool | str = "auto"
    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    local_device_ids: tuple[int, ...] | None = None
    initialization_timeout: int = 300
    peer_timeout_s: float | None = None


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


def initialize(settings: DistributedSettings | None = None, env: Mapping[str, str] | None = None) -> ProcessLayout:
    """Join the multi-process run `settings` describe (None: the defaults, from env or SLURM).

    Call before any other JAX work. A single process returns without touching
    `jax.distributed`. On CPU, collectives across processes go over gloo. Several processes
    also start the peer watchdog (`peer_watchdog`): a process that dies or freezes ends every
    other one within `settings.peer_timeout_s`.
    """
    settings = settings or DistributedSettings()
    peer_timeout_s = settings.peer_timeout_s
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


def _slice_of(device) -> int:
    """The TPU slice a device belongs to (0 where devices have none: GPUs, CPUs, one slice)."""
    return getattr(device, "slice_index", 0) or 0


class _Units:
    """Consecutive runs of equal labels (hosts or slices) along the ordered device list."""

    def __init__(self, labels: Sequence[int]):
        self.labels = list(labels)
        self.start = {u: self.labels.index(u) for u in dict.fromkeys(self.labels)}
        self.size = {u: self.labels.count(u) for u in self.start}

    def sizes(self) -> list[int]:
        return sorted(set(self.size.values()))

    def aligned(self, begin: int, end: int) -> bool:
        """Whether devices [begin, end) lie inside one unit or are whole units."""
        first, last = self.labels[begin], self.labels[end - 1]
        if len(self.start) == 1 or first == last:
            return True
        return begin == self.start[first] and end == self.start[last] + self.size[last]


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
      every device. Devices are ordered by (slice_index, process_index, id); on several hosts
      every role is either inside one host or made of whole hosts, so no role splits a host
      unless it is smaller than one; likewise on several TPU slices (devices with a
      `slice_index`) every role is inside one slice or made of whole slices, so a role's
      collectives never mix a slice's ICI with the links between slices.
    colocated: every role gets every device (one shared mesh); sizes are not used.
    key_format: how a role's config key is named in errors.
    """
    devices = sorted(devices, key=lambda d: (_slice_of(d), d.process_index, d.id))
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

    levels = [(unit, _Units([of(d) for d in devices])) for unit, of in (("slice", _slice_of), ("host", lambda d: d.process_index))]
    roles, cursor = {}, 0
    for role, n in counts.items():
        for unit, units in levels:
            if not units.aligned(cursor, cursor + n):
                raise ValueError(
                    f"{key(role)}={n} splits a {unit}: with {units.sizes()} devices per {unit} a role "
                    f"must fit inside one {unit} or consist of whole {unit}s (reorder or resize the roles)"
                )
        roles[role] = devices[cursor:cursor + n]
        cursor += n
    return roles
