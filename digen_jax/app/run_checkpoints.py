"""The run's checkpoints: saving the train state, choosing the checkpoint to resume from, restoring it.

Fingerprint: every checkpoint stores the run's fingerprint (fingerprint.py) in its `meta` item;
a resume whose config differs in what shapes the train state stops before any compute, naming
each key and both values. `train.init_from` (warm_start.py) is the deliberate way to start a new
run from another run's weights.

The other config keys a resume may change are noted or free (digen_jax/app/resume_keys.py): the
meta item records the noted keys' values, and a resume names each one it changes.

Faults: a checkpoint that cannot be read (an empty step directory, a missing or empty file, data
that does not decode, a meta item that is no object) or whose array data do not match the
checksums written with them (checksums.py) is reported in one paragraph and, as
`train.on_corrupt_checkpoint` says, moved to `WORKDIR/corrupt_checkpoints/` for the previous one
('fallback') or stops the run ('stop'). A full disk or a permission error stops the run with one
message naming the path (workdir.py); orbax's own error logs of such failures are not shown.

Who writes: the processes that own the train role's devices write the train state, each its own
shards (one replica of each shard, written once), with the meta and the prefetched micro-batches
(placed on the train role for the save); the other processes write nothing. A checkpoint is one
orbax tree whatever the process layout that wrote it, and each process restores the slices of
its own devices: a checkpoint saved by one process restores in several and the other way round
(docs/design.md section 10).
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import sys
from typing import Callable

import jax
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
from absl import logging as absl_logging
from etils import epath
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding

from digen_jax.app import resume_keys
from digen_jax.app.checksums import checksums, verify
from digen_jax.app.errors import RunStopped
from digen_jax.app.fingerprint import WEIGHT_KEYS, differences, fingerprint
from digen_jax.app.workdir import CORRUPT_DIR, START_OVER_HINT, disk_error, disk_message, short_reason
from digen_jax.app.settings import runtime_settings
from digen_jax.runtime import mesh as mesh_lib
from digen_jax.runtime.transfer import put_own_copy, to_every_process

ON_CORRUPT = ("fallback", "stop")


def open_manager(workdir: str, config: ml_collections.ConfigDict, read_only: bool = False) -> ocp.CheckpointManager:
    """The run's orbax checkpoints, WORKDIR/checkpoints (asynchronous saves); `read_only` for
    another run's, which may be writing (nothing there is created or cleaned up).

    Several processes: those that own the train role's devices (`writers`) save, and only
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
    writing, me = writers(config), jax.process_index()
    if me not in writing:
        alone = ocp.options.MultiprocessingOptions(primary_host=me, active_processes={me})
        return ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(
            read_only=True, create=False, save_interval_steps=0, multiprocessing_options=alone))
    together = ocp.options.MultiprocessingOptions(primary_host=writing[0], active_processes=set(writing))
    arrays = ocp.type_handlers.ArrayHandler(primary_host=writing[0], use_replica_parallel=False,
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


def writers(config: ml_collections.ConfigDict) -> list[int]:
    """The processes that own the train role's devices: they write the run's checkpoints."""
    return sorted({d.process_index for d in mesh_lib.build_role_meshes(runtime_settings(config)).train.devices.flat})


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
                      log: Callable[[str], None], auto: bool = False) -> list[int]:
    """The checkpoints a resume may restore, newest first, checked before any compute: those that
    are visibly unreadable are set aside (`set_aside`), and each one's fingerprint must match
    `config`'s (RunStopped naming the keys otherwise). RunStopped too when checkpoints exist and
    none is left: starting over would discard the run's outputs. `auto`: `config` is a run of
    `runtime.mode='auto'`, so each checkpoint is compared with `config` in the mode and sizing
    that checkpoint records the run as choosing (`auto_record`)."""
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
            chosen = auto_record(meta) if auto else None
            diff = differences(saved, current if chosen is None else fingerprint(_in_runtime(config, chosen["runtime"])),
                               carried=bool(meta["carried"]))
            if diff:
                fits = not differences(saved, current, carried=False, keys=WEIGHT_KEYS)
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


def auto_record(meta: dict) -> dict | None:
    """What a checkpoint's meta records of `runtime.mode='auto'`: {'decided': whether the run
    re-ranked from its measured costs already, 'runtime': the runtime keys it goes on with
    (`run_sizing.AUTO_KEYS`)}; None for a run of a fixed mode (or a meta without a valid record)."""
    record = meta.get("auto")
    if not isinstance(record, dict) or not isinstance(record.get("runtime"), dict):
        return None
    return record


def _in_runtime(config: ml_collections.ConfigDict, runtime: dict) -> ml_collections.ConfigDict:
    """A copy of `config` with the runtime keys `runtime`."""
    out = config.copy_and_resolve_references()
    out.runtime.update({key: value for key, value in runtime.items() if key in out.runtime})
    return out


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


def save(executor, manager: ocp.CheckpointManager, iterations_done: int, config: ml_collections.ConfigDict,
         auto: dict | None = None) -> None:
    """Checkpoint `executor`'s train state and the micro-batches it prefetched for the next
    iteration (asynchronously), with the run's fingerprint and the task costs measured so far;
    `auto`: what `runtime.mode='auto'` chose so far (`auto_record`), None for a fixed mode.

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
        "split": None if executor.split is None else list(executor.split),  # the last (tag in pieces, prefetch)
        # runtime.mode='auto': the mode and sizing the run goes on with, and whether they are final
        "auto": auto,
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
    if any(mesh_lib.in_host_memory(x) for x in jax.tree.leaves(executor.state)):
        # Orbax writes arrays in host memory (offloaded moments) from their own buffers, in the
        # background; the next update donates those buffers, which XLA refuses while they are
        # read. The write finishes first (device arrays are copied to the host before `save` returns).
        manager.wait_until_finished()


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


def read_item(manager: ocp.CheckpointManager, step: int, item: str, target, partial: bool = False):
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


def abstract(tree, shardings=None):
    """`tree`'s shapes and dtypes on `shardings` (default: its own)."""
    shardings = jax.tree.map(lambda a: a.sharding, tree) if shardings is None else shardings
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, shardings)


def _load(executor, manager: ocp.CheckpointManager, step: int) -> tuple:
    """Checkpoint `step` as this process reads it for `executor`: (state, carried, meta)."""
    meta = read_meta(manager, step)
    sums = meta.get("checksums") or {}
    state = read_item(manager, step, "state", abstract(executor.state, executor.state_sharding))
    verify("state", state, sums.get("state"))
    carried = _read_on_host(manager, step, "carried") if meta["carried"] else {}
    verify("carried", carried, sums.get("carried"))
    return state, carried, meta


def _resume(executor, step: int, state, carried: dict, meta: dict) -> tuple[int, dict]:
    """Continue `executor` from checkpoint `step`: (step, the noted keys the config changes)."""
    version = int(jax.device_get(to_every_process(state.version)))  # one scalar, read by every process
    # Task costs measured in another mode (the last iteration of a mode that runtime.mode='auto'
    # left) are not this mode's: the run that switched started the new mode without them too.
    own = meta.get("mode", executor.mode) == executor.mode
    executor.resume(step, state, carried, meta.get("measured", []) if own else [], meta.get("split") if own else None)
    executor.log(f"resumed from checkpoint {step} (policy version {version}, {len(executor.carried)} prefetched "
                 "micro-batches)")
    saved = meta.get("settings")
    record = auto_record(meta)
    if isinstance(saved, dict) and record is not None:  # what runtime.mode='auto' chose is no change of the config
        saved = {**saved, **{f"runtime.{key}": value for key, value in record["runtime"].items()}}
    changed = resume_keys.changes(saved, executor.job.config)
    if changed:
        executor.log(f"resumed with changed settings (metrics.jsonl records them as config_changes in the row of "
                     f"step {step + 1}): {resume_keys.describe(changed)}")
    return step, changed


def restore(executor, manager: ocp.CheckpointManager, step: int | None = None) -> int:
    """Restore checkpoint `step` (default: the latest) into `executor`, with its prefetched
    micro-batches and measured task costs; the iteration to start from. Every process calls it;
    each reads the state's slices of its own devices (`read_item`), whatever process layout
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
                state = read_item(manager, step, "state", abstract(like))
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
                           config: ml_collections.ConfigDict, log: Callable[[str], None],
                           auto: dict | None = None) -> tuple[int, dict]:
    """Restore the newest of `candidates` whose data reads back and matches its checksums
    (`set_aside` for the others): (the iteration to start from, 0 without candidates; the noted
    keys the config changes, `resume_keys.changes`). Several processes read different parts of
    a checkpoint, so they agree on each outcome before acting on it. `auto`: the `auto_record`
    of the newest candidate, which `executor` runs in (`runtime.mode='auto'`); an older one that
    records another choice stops the run (a rerun resumes from it in its own)."""
    for step in candidates:
        failure = None
        try:
            loaded = _load(executor, manager, step)
        except Exception as e:  # noqa: BLE001 (a checkpoint that does not read back is the fault handled here)
            _quiet_abandoned_reads()
            failure = e
        outcomes = _agree(0 if failure is None else 2 if disk_error(failure) else 1)
        if not any(outcomes):
            if auto is not None and auto_record(loaded[2]) != auto:
                raise RunStopped(f"checkpoint {step}, the newest that reads back, records another choice of "
                                 f"runtime.mode='auto' ({auto_record(loaded[2])}) than the one this run was built "
                                 f"for ({auto}): rerun to resume from it in its own")
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
