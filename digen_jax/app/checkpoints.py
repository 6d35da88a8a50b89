"""What makes resuming safe: the run fingerprint, the choice of checkpoint, the workdir lock, faults as messages.

Fingerprint: the config keys that shape the train state (model family, variant and depth, the
base model's identity, parameter dtype and block layout, LoRA rank/alpha/targets or full
fine-tuning, EMA, the optimizer's structure) and those that shape the prefetched micro-batches a
checkpoint may carry. Every checkpoint stores it in its `meta` item; a resume whose config
differs stops before any compute, naming each key and both values. `train.init_from` is the
deliberate way to start a new run from another run's weights.

The other config keys a resume may change are noted or free (digen_jax/app/resume_keys.py): the
meta item records the noted keys' values, and a resume names each one it changes.

Faults: a checkpoint that cannot be read (an empty step directory, a missing or empty file, data
that does not decode, a meta item that is no object) or whose array data do not match the
checksums written with them (`checksums`) is reported in one paragraph and, as
`train.on_corrupt_checkpoint` says, moved to `WORKDIR/corrupt_checkpoints/` for the previous one
('fallback') or stops the run ('stop'). A full disk or a permission error stops the run with one
message naming the path; orbax's own error logs of such failures are not shown.

History: nothing a run wrote is removed. A workdir holding a run's history but no checkpoint to
resume stops the run (`refuse_history`); `train.start_over` moves it all to
`WORKDIR/previous_runs/N/` first (`start_over`).

Who writes: the processes that own the train role's devices write the train state, each its own
shards (one replica of each shard, written once), with the meta and the prefetched micro-batches
(placed on the train role for the save); the other processes write nothing. A checkpoint is one
orbax tree whatever the process layout that wrote it, and each process restores the slices of
its own devices: a checkpoint saved by one process restores in several and the other way round
(docs/design.md section 10).
"""
from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import shutil
import socket
import sys
import time
from typing import Callable

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
from absl import logging as absl_logging
from etils import epath
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding

from digen_jax.app import resume_keys, workload as workload_lib
from digen_jax.rl import lora
from digen_jax.runtime import mesh as mesh_lib
from digen_jax.runtime.transfer import put_own_copy, to_every_process

ON_CORRUPT = ("fallback", "stop")
LOCK_FILE = "run.lock"
CORRUPT_DIR = "corrupt_checkpoints"
PREVIOUS_DIR = "previous_runs"  # earlier runs of a workdir, moved there by train.start_over
START_OVER_HINT = ("to start the run over, keeping this history in {workdir}/" + PREVIOUS_DIR
                   + "/, rerun with --config.train.start_over=true (once), or use another --workdir.")
# Keys that shape the micro-batches a checkpoint carries (compared only when it carries some).
_CARRIED_KEYS = ("task.resolution", "sampling.height", "sampling.width", "sampling.num_frames", "sampling.num_steps",
                 "rl.prompts_per_iteration", "rl.group_size", "runtime.micro_batches", "runtime.mode")
# Keys that must match for another run's trainable weights to fit this run's.
_WEIGHT_KEYS = ("model.family", "model.variant", "model.num_layers", "model.num_single_layers", "model.scan_layers",
                "trainable", "rl.lora_rank", "rl.lora_targets")
# Fingerprint keys a checkpoint may predate: compared only when it records them.
_RECORDED_LATER = ("seed", "rl.optimizer_state_dtype")
_DISK_ERRNOS = {errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is exceeded",
                errno.EACCES: "permission denied", errno.EPERM: "operation not permitted",
                errno.EROFS: "the file system is read-only"}
_DISK_TEXTS = {"No space left on device": errno.ENOSPC, "Disk quota exceeded": errno.EDQUOT,
               "Permission denied": errno.EACCES, "Read-only file system": errno.EROFS}


class RunStopped(Exception):
    """An expected fault or user error: the message says what happened and what to do
    (launch/train.py prints it without a traceback)."""


# ---------------------------------------------------------------------------------- fingerprint
def fingerprint(config: ml_collections.ConfigDict) -> dict:
    """The keys that shape a run's checkpointed state (module docstring), as JSON values."""
    m, rl = config.model, config.rl
    fp = {"seed": config.seed, "model.family": m.family}
    for key in ("variant", "num_layers", "num_single_layers"):
        if key in m:
            fp[f"model.{key}"] = m[key]
    fp["base model"] = workload_lib.base_model_id(config)
    fp["model.param_dtype"] = m.param_dtype
    fp["model.scan_layers"] = bool(m.scan_layers)
    fp["trainable"] = "LoRA adapters" if rl.lora_rank else "all weights (full fine-tuning)"
    fp["rl.lora_rank"] = rl.lora_rank
    if rl.lora_rank:
        fp["rl.lora_alpha"] = lora.config_alpha(rl)
        fp["rl.lora_targets"] = list(rl.lora_targets)
    fp["rl.ema"] = bool(rl.ema)
    if rl.get("algorithm", "grpo") != "grpo":  # DiffusionNFT's state holds the old policy too
        fp["rl.algorithm"] = rl.algorithm
    fp["optimizer"] = "adamw" if rl.max_grad_norm is None else "clip_by_global_norm, adamw"
    fp["rl.optimizer_state_dtype"] = rl.get("optimizer_state_dtype", "param")  # the moments' dtype
    carried = {}
    for key in _CARRIED_KEYS:
        section, name = key.split(".")
        if section in config and name in config[section]:
            carried[key] = config[section][name]
    fp["carried"] = carried
    return json.loads(json.dumps(fp))  # tuples as lists: compares equal to what a checkpoint read back holds


def _show(value) -> str:
    if isinstance(value, dict) and "id" in value:
        return f"{value['where']} [{value['id']}]"
    return "(none)" if value is None else json.dumps(value)


def differences(saved: dict, current: dict, *, carried: bool, keys: tuple[str, ...] | None = None) -> list[str]:
    """'key: saved value in the checkpoint, current value now' for each key that differs (the
    carried micro-batches' keys only when `carried`; only `keys` when given)."""
    lines = []
    for key in dict.fromkeys([*saved, *current]):
        if key == "carried" or (keys is not None and key not in keys) or (key in _RECORDED_LATER and key not in saved):
            continue
        a, b = saved.get(key), current.get(key)
        same = (a or {}).get("id") == (b or {}).get("id") if key == "base model" else a == b
        if not same:
            lines.append(f"{key}: {_show(a)} in the checkpoint, {_show(b)} now")
    if carried:
        a, b = saved.get("carried", {}), current.get("carried", {})
        for key in dict.fromkeys([*a, *b]):
            if a.get(key) != b.get(key):
                lines.append(f"{key}: {_show(a.get(key))} in the checkpoint, {_show(b.get(key))} now "
                             "(it holds micro-batches already generated for the next iteration)")
    return lines


# ---------------------------------------------------------------------------------- workdir lock
class WorkdirLock:
    """An exclusive `flock` on WORKDIR/run.lock for the run's lifetime. The kernel drops it when
    its process dies, so the lock of a killed run never blocks the next; the file records the
    holder (pid, host, start time) for the message a second run gets. On a file system without
    `flock` the run goes on unlocked and `unsupported` says why."""

    def __init__(self, workdir: str):
        os.makedirs(workdir, exist_ok=True)
        self.path = os.path.join(os.path.abspath(workdir), LOCK_FILE)
        self._fd, self.unsupported = None, None
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                holder = json.loads(os.read(fd, 4096) or b"{}")
            except ValueError:
                holder = {}
            os.close(fd)
            raise RunStopped(
                f"workdir {os.path.dirname(self.path)} is in use by another run (pid {holder.get('pid', '?')} on "
                f"{holder.get('host', '?')}, started {holder.get('started', '?')}): two runs in one workdir would "
                "interleave its metrics and checkpoints. Wait for that run to end, stop it, or use another --workdir."
            ) from None
        except OSError as e:
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                raise
            os.close(fd)
            self.unsupported = f"{self.path} cannot be locked here ({e.strerror}): nothing keeps a second run out"
            return
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                 "started": time.strftime("%Y-%m-%d %H:%M:%S")}).encode())
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


# ---------------------------------------------------------------------------------- history
def history(workdir: str) -> list[str]:
    """What an earlier run left in `workdir` that a run starting at iteration 0 would mix with its
    own: metrics rows, trace events, checkpoints set aside (as words, empty when none)."""
    found = []
    metrics = os.path.join(workdir, "metrics.jsonl")
    if os.path.exists(metrics) and os.path.getsize(metrics):
        with open(metrics, "rb") as f:
            found.append(f"metrics.jsonl ({sum(1 for line in f if line.strip())} rows)")
    trace = os.path.join(workdir, "trace.json")
    if os.path.exists(trace):
        with open(trace) as f:  # the header and thread names of a run that recorded no event are not history
            if any(line.strip() not in ("", "[") and '"ph": "M"' not in line for line in f):
                found.append("trace.json")
    corrupt = os.path.join(workdir, CORRUPT_DIR)
    if os.path.isdir(corrupt) and os.listdir(corrupt):
        found.append(f"{CORRUPT_DIR}/ ({len(os.listdir(corrupt))} set aside)")
    return found


def refuse_history(workdir: str) -> None:
    """RunStopped when `workdir` holds an earlier run's history (`history`) and no checkpoint to
    resume it from: starting at iteration 0 there would mix two runs' outputs or replace them."""
    found = history(workdir)
    if found:
        raise RunStopped(f"{workdir} holds an earlier run's {', '.join(found)} but no checkpoint to resume it from; "
                         + START_OVER_HINT.format(workdir=workdir))


def start_over(workdir: str, log: Callable[[str], None]) -> None:
    """`train.start_over`: move everything in `workdir` (but its lock) to a new
    WORKDIR/previous_runs/N/, so that the run starts at iteration 0 and loses nothing."""
    entries = sorted(name for name in os.listdir(workdir) if name not in (LOCK_FILE, PREVIOUS_DIR))
    if entries and jax.process_index() == 0:
        n = 1
        while os.path.exists(os.path.join(workdir, PREVIOUS_DIR, str(n))):
            n += 1
        dest = os.path.join(workdir, PREVIOUS_DIR, str(n))
        os.makedirs(dest)
        for name in entries:
            shutil.move(os.path.join(workdir, name), os.path.join(dest, name))
        log(f"train.start_over: moved {', '.join(entries)} to {dest}; starting at iteration 0")
    if jax.process_count() > 1:  # the others look at the workdir once process 0 has cleared it
        multihost_utils.sync_global_devices("start over")


# ---------------------------------------------------------------------------------- faults
def _chain(exc: BaseException):
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def short_reason(exc: BaseException) -> str:
    """The innermost cause of `exc` in one line, without tensorstore's spec dumps."""
    root = list(_chain(exc))[-1]
    text = str(root).strip().splitlines()[0] if str(root).strip() else type(root).__name__
    for cut in (" [tensorstore_spec", " [source locations", ". See full TensorStore details"):
        text = text.split(cut)[0]
    return text[:400]


def disk_error(exc: BaseException) -> tuple[int, str] | None:
    """(errno, path or '') when `exc` comes from a full disk or a permission error, else None."""
    for e in _chain(exc):
        if isinstance(e, OSError) and e.errno in _DISK_ERRNOS:
            return e.errno, e.filename or ""
        for text, code in _DISK_TEXTS.items():
            if text in str(e):
                return code, ""
    return None


def disk_message(exc: BaseException, workdir: str, what: str) -> str:
    code, path = disk_error(exc)
    where = f" ({path})" if path else ""
    fix = "free space there" if code in (errno.ENOSPC, errno.EDQUOT) else "make it writable by this user"
    return (f"{what} failed: {_DISK_ERRNOS[code]}{where}; {fix} in or under {workdir}, then rerun the same "
            f"command to resume from the last checkpoint.")


# ---------------------------------------------------------------------------------- choosing a checkpoint
def open_manager(workdir: str, config: ml_collections.ConfigDict, read_only: bool = False) -> ocp.CheckpointManager:
    """The run's orbax checkpoints, WORKDIR/checkpoints (asynchronous saves); `read_only` for
    another run's, which may be writing (nothing there is created or cleaned up).

    Several processes: those that own the train role's devices (`_writers`) save, and only
    they (orbax's `active_processes`; the first of them is the primary host: it writes the
    meta item and commits the step); arrays are written by the processes that hold them, one
    replica each (replica-parallel writing off: `_writable` says why). Every other process
    gets a manager of its own that only reads, without waiting for any other process.
    """
    directory = os.path.join(os.path.abspath(workdir), "checkpoints")
    _quiet_orbax_failures()
    if read_only:  # orbax warns of every option that would write
        return ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(
            read_only=True, create=False, save_interval_steps=0))
    if jax.process_count() == 1:
        return ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(
            max_to_keep=config.train.keep_checkpoints, enable_async_checkpointing=True))
    os.makedirs(directory, exist_ok=True)  # orbax creates it only when every process takes part
    writers, me = _writers(config), jax.process_index()
    if me not in writers:
        alone = ocp.options.MultiprocessingOptions(primary_host=me, active_processes={me})
        return ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(
            read_only=True, create=False, save_interval_steps=0, multiprocessing_options=alone))
    together = ocp.options.MultiprocessingOptions(primary_host=writers[0], active_processes=set(writers))
    arrays = ocp.type_handlers.ArrayHandler(primary_host=writers[0], use_replica_parallel=False,
                                            enable_write_sharding_file=False)
    registry = ocp.type_handlers.create_type_handler_registry(
        *[(t, ocp.type_handlers.get_type_handler(t)) for t in (int, float, np.number, np.ndarray)], (jax.Array, arrays))
    trees = lambda: ocp.PyTreeCheckpointHandler(multiprocessing_options=together,  # noqa: E731
                                                type_handler_registry=registry)
    handlers = {"state": trees(), "carried": trees(),
                "meta": ocp.JsonCheckpointHandler(multiprocessing_options=together)}
    return ocp.CheckpointManager(directory, item_handlers=handlers, options=ocp.CheckpointManagerOptions(
        max_to_keep=config.train.keep_checkpoints, enable_async_checkpointing=True, create=False,
        multiprocessing_options=together))


def _writers(config: ml_collections.ConfigDict) -> list[int]:
    """The processes that own the train role's devices: they write the run's checkpoints."""
    return sorted({d.process_index for d in mesh_lib.build_role_meshes(config.runtime).train.devices.flat})


def _structural_fault(step_dir: str) -> str | None:
    """A fault visible without reading the data: an empty step directory, an empty data or
    manifest file, a missing OCDBT manifest."""
    if not os.listdir(step_dir):
        return "the step directory is empty"
    for root, _, files in os.walk(step_dir):
        for name in files:
            path = os.path.join(root, name)
            if (os.path.basename(root) == "d" or name in ("manifest.ocdbt", "metadata")) and os.path.getsize(path) == 0:
                return f"{path} is empty (0 bytes)"
    for item in os.listdir(step_dir):
        item_dir = os.path.join(step_dir, item)
        written = os.path.isdir(item_dir) and any(name.startswith("ocdbt.process_") for name in os.listdir(item_dir))
        if written and not os.path.exists(os.path.join(item_dir, "manifest.ocdbt")):
            return f"{os.path.join(item_dir, 'manifest.ocdbt')} is missing"
    return None


def read_meta(manager: ocp.CheckpointManager, step: int) -> dict:
    """The meta item of checkpoint `step` (ValueError when it is not a JSON object)."""
    meta = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    if not isinstance(meta, dict) or not isinstance(meta.get("carried", []), list):
        raise ValueError(f"it holds {type(meta).__name__} {json.dumps(meta)[:80]}, not the object a save writes")
    return meta


def set_aside(manager: ocp.CheckpointManager, step: int, reason: str, policy: str, log: Callable[[str], None]) -> None:
    """Report checkpoint `step` as unreadable and apply `train.on_corrupt_checkpoint` (`policy`)."""
    step_dir = os.path.join(str(manager.directory), str(step))
    paragraph = f"checkpoint {step} ({step_dir}) cannot be read: {reason}."
    if policy == "stop":
        raise RunStopped(f"{paragraph} Stopping, as train.on_corrupt_checkpoint='stop' says: repair or remove it, "
                         "or rerun with --config.train.on_corrupt_checkpoint=fallback to resume from the one before.")
    workdir = os.path.dirname(str(manager.directory))
    dest = os.path.join(workdir, CORRUPT_DIR, str(step))
    n = 1
    while os.path.exists(dest):
        dest, n = os.path.join(workdir, CORRUPT_DIR, f"{step}.{n}"), n + 1
    if jax.process_index() == 0:
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        shutil.move(step_dir, dest)
    if jax.process_count() > 1:  # every process reached the same decision; they go on once it is done
        multihost_utils.sync_global_devices(f"set aside checkpoint {step}")
    manager.reload()
    log(f"{paragraph} Moved it to {dest}; the run resumes from the newest checkpoint that reads back "
        "(train.on_corrupt_checkpoint='fallback').")


def resume_candidates(manager: ocp.CheckpointManager, config: ml_collections.ConfigDict,
                      log: Callable[[str], None]) -> list[int]:
    """The checkpoints a resume may restore, newest first, checked before any compute: those that
    are visibly unreadable are set aside (`set_aside`), and each one's fingerprint must match
    `config`'s (RunStopped naming the keys otherwise). RunStopped too when checkpoints exist and
    none is left: starting over would discard the run's outputs."""
    policy = config.train.on_corrupt_checkpoint
    current = fingerprint(config)
    if jax.process_count() > 1:  # the writers' saves are committed by now (a run resumed in the same processes)
        multihost_utils.sync_global_devices("resume candidates")
        manager.reload()
    steps = sorted(manager.all_steps(), reverse=True)
    candidates = []
    for step in steps:
        step_dir = os.path.join(str(manager.directory), str(step))
        reason = _structural_fault(step_dir)
        meta = None
        if reason is None:
            try:
                meta = read_meta(manager, step)
            except Exception as e:  # noqa: BLE001 (any failure to read it is the fault to report)
                if disk_error(e):
                    raise RunStopped(disk_message(e, os.path.dirname(step_dir), f"reading checkpoint {step}")) from e
                reason = f"its meta item cannot be read ({short_reason(e)})"
        if reason is not None:
            set_aside(manager, step, reason, policy, log)
            continue
        saved = meta.get("fingerprint")
        if saved is None:
            log(f"checkpoint {step} records no run fingerprint (written by an older version): its config is not checked")
        else:
            diff = differences(saved, current, carried=bool(meta["carried"]))
            if diff:
                fits = not differences(saved, current, carried=False, keys=_WEIGHT_KEYS)
                warm = (f" (with --config.train.init_from={os.path.dirname(str(manager.directory))} to start from "
                        "these weights)") if fits else ""
                raise RunStopped(
                    f"checkpoint {step} in {manager.directory} was written by a run whose config differs from this one "
                    "in what shapes the trained state:\n  " + "\n  ".join(diff) + "\nResume with the checkpoint's "
                    f"values, or start a new run in another --workdir{warm}."
                )
        candidates.append(step)
    if steps and not candidates:
        raise _none_readable(manager)
    return candidates


def _none_readable(manager: ocp.CheckpointManager) -> RunStopped:
    workdir = os.path.dirname(str(manager.directory))
    return RunStopped(f"no checkpoint in {manager.directory} can be read (they were moved to "
                      f"{os.path.join(workdir, CORRUPT_DIR)}); {START_OVER_HINT.format(workdir=workdir)}")


class _OrbaxFailures(logging.Filter):
    """Drops orbax's error records (a failed save or read logged with its traceback, often more
    than once): the run reports each failure itself, in one line (`disk_message`, `set_aside`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno >= logging.ERROR and f"{os.sep}orbax{os.sep}" in record.pathname)


def _quiet_orbax_failures() -> None:
    logger = absl_logging.get_absl_logger()
    if not any(isinstance(f, _OrbaxFailures) for f in logger.filters):
        logger.addFilter(_OrbaxFailures())


class _AbandonedReadErrors(logging.Filter):
    """Drops asyncio's 'Future exception was never retrieved' records of the other reads of a
    restore that failed: each damaged array's read fails on its own, after the first failure has
    been reported (`set_aside`), whenever the garbage collector finds its future."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        return not (isinstance(error, ValueError) and "tensorstore_spec" in str(error))


def _quiet_abandoned_reads() -> None:
    """Keep quiet about the reads orbax abandons when a restore fails: their callbacks find its
    event loop closed and Python would print each as an 'Exception ignored' traceback, and
    asyncio logs the failures nobody retrieved (`_AbandonedReadErrors`)."""
    asyncio_logger = logging.getLogger("asyncio")
    if not any(isinstance(f, _AbandonedReadErrors) for f in asyncio_logger.filters):
        asyncio_logger.addFilter(_AbandonedReadErrors())
    previous = sys.unraisablehook
    if getattr(previous, "quiet_abandoned_reads", False):
        return

    def hook(unraisable):
        if not (isinstance(unraisable.exc_value, RuntimeError) and str(unraisable.exc_value) == "Event loop is closed"):
            previous(unraisable)

    hook.quiet_abandoned_reads = True
    sys.unraisablehook = hook


# ---------------------------------------------------------------------------------- checksums
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
def _checksums(tree) -> list[jax.Array]:
    return [_leaf_checksum(leaf) for leaf in jax.tree.leaves(tree)]


def checksums(tree) -> dict[str, int]:
    """{leaf path: checksum} of the arrays of `tree` (`_leaf_checksum`); every process that holds
    part of them calls it (one scalar read per leaf, at a save or a restore)."""
    paths = [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
    values = _checksums(tree)
    return {path: int(np.asarray(v.addressable_shards[0].data)) for path, v in zip(paths, values)}


def verify(item: str, tree, saved: dict | None) -> None:
    """Raise ValueError naming the first leaf of `tree` whose checksum differs from `saved`, the
    checksums written with item `item` (nothing to check without them, or on a process that
    holds none of the data)."""
    if not saved or not any(not isinstance(leaf, jax.Array) or leaf.addressable_shards for leaf in jax.tree.leaves(tree)):
        return
    for path, value in checksums(tree).items():
        if path in saved and saved[path] != value:
            raise ValueError(f"the data of {item}{path} does not match the checksum written with it (corrupted on disk)")


# ---------------------------------------------------------------------------------- save and restore
def save(executor, manager: ocp.CheckpointManager, iterations_done: int, config: ml_collections.ConfigDict) -> None:
    """Checkpoint `executor`'s train state and the micro-batches it prefetched for the next
    iteration (asynchronously), with the run's fingerprint and the task costs measured so far.

    Every process calls it at the same point of the loop (the checks and the prefetched
    micro-batches' host copies run collectives). Then the processes that own the train role's
    devices write (`open_manager`): each the shards of the state on its own devices, one
    replica of each, copied to its host by orbax for the asynchronous write; no process
    gathers or copies the whole state. The prefetched micro-batches, which every process
    holds on its host (`executor.carried_snapshot`), are placed on the train role from each
    writer's own copy and written like the state; the primary writer writes the meta item.
    The other processes write nothing.
    """
    executor.drain()  # the prefetched micro-batches are saved: their rollouts must have run
    # No checkpoint holds NaN or inf: one device reduction per save, read here (saves are rare).
    bad = [part for part, ok in executor.state_is_finite().items() if not ok]
    if bad:
        raise FloatingPointError(
            f"checkpoint {iterations_done} not saved: the {' and '.join(bad)} hold NaN or inf values (the "
            "checkpoints saved before are kept). Updates are checked before they are applied (non-finite values, "
            "rl.max_update_ratio), so these came from a restored checkpoint or a bug; stopping"
        )
    carried = executor.carried_snapshot() if executor.carried else None
    shardings = jax.tree.leaves(executor.state_sharding)
    if jax.process_index() not in {d.process_index for s in shardings for d in s.device_set}:
        return
    meta = {
        "carried": [m.index for m in executor.carried],
        "mode": executor.mode,
        "fingerprint": fingerprint(config),
        # The task costs measured so far: a resumed run chooses its elastic splits as this one would.
        "measured": [[kind, group, values] for (kind, group), values in executor.measured.items()],
        # The noted keys' values: a resume names those it changes (digen_jax/app/resume_keys.py).
        "settings": resume_keys.settings(config),
        # Verified when the checkpoint is read back: data corrupted on disk is not trusted.
        "checksums": {"state": checksums(executor.state), **({"carried": checksums(carried)} if carried else {})},
    }
    state = jax.tree.map(_writable, executor.state, executor.state_sharding)
    items = {"state": ocp.args.PyTreeSave(state), "meta": ocp.args.JsonSave(meta)}
    if carried is not None:
        items["carried"] = ocp.args.PyTreeSave(jax.tree.map(lambda a: _on_role(a, executor.meshes.train), carried))
    manager.save(iterations_done, args=ocp.args.Composite(**items))


def _writable(x: jax.Array, sharding: NamedSharding) -> jax.Array:
    """`x` (on `sharding`) as orbax can write it from this process.

    Orbax 0.12 refuses, in a run of several processes, an array whose devices all belong to
    one process (it takes it for a per-host pmap array), and that is every leaf of a train
    role inside one process. Such a leaf is handed over as a view of the same device buffers:
    one replica of an array on a mesh with a leading axis of size 2, its own devices first and
    as many devices of other processes second. This process's shards are replica 0, which is
    the replica orbax writes with replica-parallel writing off (`open_manager`), and orbax
    reads only the shards of its own process; nothing is copied or moved, and no computation
    ever runs on the view.
    """
    if jax.process_count() == 1 or not x.is_fully_addressable:
        return x
    mesh = sharding.mesh
    others = [d for d in jax.devices() if d.process_index != jax.process_index()][: mesh.devices.size]
    if len(others) < mesh.devices.size:
        raise ValueError(f"a checkpoint of a train role of {mesh.devices.size} devices inside one process needs as "
                         f"many devices in the other processes; they have {len(others)}")
    view = Mesh(np.stack([mesh.devices, np.array(others).reshape(mesh.devices.shape)]), ("_view", *mesh.axis_names))
    return jax.make_array_from_single_device_arrays(
        x.shape, NamedSharding(view, sharding.spec), [shard.data for shard in x.addressable_shards])


def _on_role(host: np.ndarray, mesh: Mesh) -> jax.Array:
    """A host array every process holds alike, on `mesh` (split along its leading axis when the
    mesh divides it) from this process's own copy, as orbax writes it (`_writable`)."""
    sharding = mesh_lib.batch_sharding(mesh, np.shape(host))
    return _writable(put_own_copy(np.asarray(host), sharding), sharding)


def _read(manager: ocp.CheckpointManager, step: int, item: str, target, partial: bool = False):
    """`target` (ShapeDtypeStructs with shardings; with `partial`, a part of the saved tree) from
    item `item` of checkpoint `step`, in any process layout: each process reads the slices of
    its own devices, whichever processes wrote them. A process that owns none of the devices
    reads nothing and gets arrays without local data, as it holds them in the run."""
    if not any(leaf.sharding.addressable_devices for leaf in jax.tree.leaves(target)):
        return jax.tree.map(lambda a: jax.make_array_from_single_device_arrays(a.shape, a.sharding, [], dtype=a.dtype),
                            target)
    args = ocp.args.PyTreeRestore(item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
                                  partial_restore=partial)
    return manager.restore(step, args=ocp.args.Composite(**{item: args}))[item]


def _read_on_host(manager: ocp.CheckpointManager, step: int, item: str):
    """Item `item` of checkpoint `step` whole as host arrays, on every process (the prefetched
    micro-batches: saved as arrays on the train role, or as host arrays before)."""
    saved = ocp.PyTreeCheckpointHandler().metadata(epath.Path(str(manager.directory)) / str(step) / item).tree
    args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), saved)
    return manager.restore(step, args=ocp.args.Composite(**{item: ocp.args.PyTreeRestore(restore_args=args)}))[item]


def _abstract(tree, shardings=None):
    """`tree`'s shapes and dtypes on `shardings` (default: its own)."""
    shardings = jax.tree.map(lambda a: a.sharding, tree) if shardings is None else shardings
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, shardings)


def _load(executor, manager: ocp.CheckpointManager, step: int) -> tuple:
    """Checkpoint `step` as this process reads it for `executor`: (state, carried, meta)."""
    meta = read_meta(manager, step)
    sums = meta.get("checksums") or {}
    state = _read(manager, step, "state", _abstract(executor.state, executor.state_sharding))
    verify("state", state, sums.get("state"))
    carried = _read_on_host(manager, step, "carried") if meta["carried"] else {}
    verify("carried", carried, sums.get("carried"))
    return state, carried, meta


def _resume(executor, step: int, state, carried: dict, meta: dict) -> tuple[int, dict]:
    """Continue `executor` from checkpoint `step`: (step, the noted keys the config changes)."""
    version = int(jax.device_get(to_every_process(state.version)))  # one scalar, read by every process
    executor.resume(step, state, carried, meta.get("measured", []))
    executor.log(f"resumed from checkpoint {step} (policy version {version}, {len(executor.carried)} prefetched "
                 "micro-batches)")
    changed = resume_keys.changes(meta.get("settings"), executor.job.config)
    if changed:
        executor.log(f"resumed with changed settings (metrics.jsonl records them as config_changes in the row of "
                     f"step {step + 1}): {resume_keys.describe(changed)}")
    return step, changed


def restore(executor, manager: ocp.CheckpointManager, step: int | None = None) -> int:
    """Restore checkpoint `step` (default: the latest) into `executor`, with its prefetched
    micro-batches and measured task costs; the iteration to start from. Every process calls it;
    each reads the state's slices of its own devices (`_read`), whatever process layout
    saved it, and the prefetched micro-batches whole."""
    latest = manager.latest_step() if step is None else step
    if latest is None:
        return 0
    return _resume(executor, latest, *_load(executor, manager, latest))[0]


def read_state(manager: ocp.CheckpointManager, like, config: ml_collections.ConfigDict,
               log: Callable[[str], None] = print):
    """The train state of the newest checkpoint that reads back and matches its checksums, laid
    out like `like` (its shapes and shardings), or None when there is none. One that does not is
    named in one line (`log`) and the one before is tried; nothing is moved (a run may be
    writing there). RunStopped when a checkpoint was written by another config or none reads back."""
    steps = sorted(manager.all_steps(), reverse=True)
    for step in steps:
        step_dir = os.path.join(str(manager.directory), str(step))
        reason = _structural_fault(step_dir)
        if reason is None:
            try:
                meta = read_meta(manager, step)
            except Exception as e:  # noqa: BLE001 (any failure to read it is the fault to report)
                _quiet_abandoned_reads()
                reason = f"its meta item cannot be read ({short_reason(e)})"
        if reason is None:
            saved = meta.get("fingerprint")
            diff = differences(saved, fingerprint(config), carried=False) if saved is not None else []
            if diff:
                raise RunStopped(f"checkpoint {step} in {manager.directory} was written by a run whose config differs "
                                 f"from this one in what shapes the trained state ({'; '.join(diff)}): give that "
                                 "run's --config and overrides")
            try:
                state = _read(manager, step, "state", _abstract(like))
                verify("state", state, (meta.get("checksums") or {}).get("state"))
                return state
            except Exception as e:  # noqa: BLE001 (likewise)
                _quiet_abandoned_reads()
                reason = short_reason(e)
        log(f"checkpoint {step} ({step_dir}) cannot be read: {reason}; trying the one before")
    if steps:
        raise RunStopped(f"no checkpoint in {manager.directory} can be read (each is named above)")
    return None


def restore_first_readable(executor, manager: ocp.CheckpointManager, candidates: list[int],
                           config: ml_collections.ConfigDict, log: Callable[[str], None]) -> tuple[int, dict]:
    """Restore the newest of `candidates` whose data reads back and matches its checksums
    (`set_aside` for the others): (the iteration to start from, 0 without candidates; the noted
    keys the config changes, `resume_keys.changes`). Several processes read different parts of
    a checkpoint, so they agree on each outcome before acting on it."""
    for step in candidates:
        failure = None
        try:
            loaded = _load(executor, manager, step)
        except Exception as e:  # noqa: BLE001 (a checkpoint that does not read back is the fault handled here)
            _quiet_abandoned_reads()
            failure = e
        outcomes = _agree(0 if failure is None else 2 if disk_error(failure) else 1)
        if not any(outcomes):
            return _resume(executor, step, *loaded)
        workdir = os.path.dirname(str(manager.directory))
        elsewhere = f"it does not read back on process {outcomes.index(max(outcomes))} (its log says why)"
        if 2 in outcomes:
            message = (disk_message(failure, workdir, f"reading checkpoint {step}") if disk_error(failure)
                       else f"reading checkpoint {step} failed: {elsewhere}")
            raise RunStopped(message) from failure
        set_aside(manager, step, short_reason(failure) if failure is not None else elsewhere,
                  config.train.on_corrupt_checkpoint, log)
    if candidates:
        raise _none_readable(manager)
    return 0, {}


def _agree(outcome: int) -> list[int]:
    """Every process's `outcome` (0: read back, 1: unreadable, 2: a disk error), in process order."""
    if jax.process_count() == 1:
        return [outcome]
    return [int(v) for v in multihost_utils.process_allgather(np.int32(outcome))]


# ---------------------------------------------------------------------------------- warm start
def check_init_from(config: ml_collections.ConfigDict) -> tuple[ocp.CheckpointManager, int, dict]:
    """`train.init_from`'s checkpoint, checked before any compute: (its manager, step, meta).
    RunStopped when there is none or its weights cannot fit this run's (naming the keys)."""
    source = os.path.abspath(os.path.expanduser(config.train.init_from))
    if not os.path.isdir(os.path.join(source, "checkpoints")):
        raise RunStopped(f"train.init_from={config.train.init_from!r}: {source}/checkpoints does not exist "
                         "(it names the workdir of the run to start from)")
    manager = open_manager(source, config, read_only=True)
    step = manager.latest_step()
    if step is None:
        raise RunStopped(f"train.init_from={config.train.init_from!r}: {source}/checkpoints holds no checkpoint "
                         "(it names the workdir of the run to start from)")
    try:
        meta = read_meta(manager, step)
    except Exception as e:  # noqa: BLE001 (reported as what it is: an unreadable source)
        raise RunStopped(f"train.init_from={config.train.init_from!r}: checkpoint {step} cannot be read "
                         f"({short_reason(e)})") from e
    saved = meta.get("fingerprint")
    if saved is not None:
        diff = differences(saved, fingerprint(config), carried=False, keys=_WEIGHT_KEYS)
        if diff:
            raise RunStopped(f"train.init_from={config.train.init_from!r}: the trainable weights of its checkpoint "
                             f"{step} do not fit this run's:\n  " + "\n  ".join(diff))
    return manager, step, meta


def load_init_from(manager: ocp.CheckpointManager, step: int, meta: dict, trainable,
                   config: ml_collections.ConfigDict, log: Callable[[str], None]):
    """The trainable weights of `train.init_from`'s checkpoint `step`, in `trainable`'s shapes and
    placement (RunStopped when a leaf does not fit); logs what was loaded."""
    target = _abstract(trainable)
    try:
        restored = _read(manager, step, "state", {"trainable": target}, partial=True)
    except Exception as e:  # noqa: BLE001 (a source written before fingerprints: its shapes are the check)
        raise RunStopped(f"train.init_from={config.train.init_from!r}: the trainable weights of checkpoint {step} "
                         f"do not load into this run's: {short_reason(e)}") from e
    saved = meta.get("fingerprint") or {}
    notes = differences(saved, fingerprint(config), carried=False,
                        keys=tuple(k for k in saved if k not in _WEIGHT_KEYS)) if saved else []
    log(f"train.init_from: loaded the trainable weights ({saved.get('trainable', 'trainable tree')}) of "
        f"{manager.directory}/{step}; fresh optimizer state and EMA, starting at iteration 0"
        + ("; that run differed in:\n  " + "\n  ".join(notes) if notes else ""))
    return restored["trainable"]
