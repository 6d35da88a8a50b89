r"""`launch/bench.py` with XLA's compiled memory of the transformer programs recorded and set
against the memory plan (digen_jax/runtime/memory_plan.py) of each mode's roles.

Every argument goes to launch/bench.py. Before the first call of each rollout step, gradient,
update check and update program on each set of devices and argument shapes (per mode: a role's
programs run on its own devices), the program is lowered and compiled once more for
`compiled.memory_analysis()` (argument, output, temporary and aliased bytes per device), and the
bytes of the live arrays in device memory on its devices are read (`resident`: what the role
holds then, the program's arguments included). Its peak per device is

    xla = resident + output - alias + temp

(non-donated outputs are new buffers; donated ones are written over their arguments). Each
record names the mode that ran it and the role its devices belong to ('shared' when colocated,
'rollout' or 'train'). A role's compiled figure is the largest of its programs'; it is written
beside the plan's figure of the same role (the plan less its sync buffers: the rollout role's
second copy of the weights lives only while a sync lands, in no program, and the allocator's peak
in the bench JSON covers it) and their ratio:

    python benchmarks/compiled_memory.py --memory_out=/tmp/programs.json --mode=system \
        --config=configs/qwenimage.py --config.rl.lora_rank=0 ...

--memory_out holds {"programs": [...], "roles": [...]}, rewritten at every record. On CPU
devices (no device table entry) the plan is taken on H200s of the same role sizes: the figures
are then sizes only, for the code path.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "launch"))

import bench  # noqa: E402  (launch/bench.py: its flags and main)
import jax  # noqa: E402
from absl import flags  # noqa: E402

from digen_jax import cli  # noqa: E402
from digen_jax.app import run_sizing  # noqa: E402
from digen_jax.rl import rollout, trainer  # noqa: E402
from digen_jax.runtime import executor as executor_lib  # noqa: E402
from digen_jax.runtime import memory_plan, mesh as mesh_lib, plan as plan_lib  # noqa: E402
from digen_jax.runtime.task_costs import GIB, Pool  # noqa: E402

_MEMORY_OUT = flags.DEFINE_string("memory_out", "compiled_memory.json", "Where the programs' memory analyses go.")
FIELDS = ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes", "alias_size_in_bytes",
          "generated_code_size_in_bytes", "host_argument_size_in_bytes", "host_output_size_in_bytes",
          "host_temp_size_in_bytes")
TOLERANCE = 0.10  # the plan's figure within 10% of XLA's
RECORDS: list[dict] = []
# The mode being run and what its plan needs: set as each executor is built.
CURRENT: dict = {}
PLANS: dict[str, dict] = {}  # mode -> {"plan": MemoryPlan, "roles": {role: device ids}}


def resident_bytes(device_ids: set[int]) -> dict[int, int]:
    """Bytes of the live arrays in device memory on each of `device_ids` (host-memory arrays, an
    offloaded optimizer state, not counted)."""
    held = {d: 0 for d in device_ids}
    for array in jax.live_arrays():
        if getattr(array.sharding, "memory_kind", None) not in (None, "device"):
            continue
        for shard in array.addressable_shards:
            if shard.device.id in held:
                held[shard.device.id] += shard.data.nbytes
    return held


def _devices(args) -> tuple[int, ...]:
    for leaf in jax.tree.leaves(args):
        if isinstance(leaf, jax.Array):
            return tuple(sorted(d.id for d in leaf.sharding.device_set))
    return ()


def _signature(args) -> tuple:
    return tuple((getattr(x, "shape", None), str(getattr(x, "dtype", type(x).__name__))) for x in jax.tree.leaves(args))


def _role(device_ids: tuple[int, ...]) -> str | None:
    for role, ids in CURRENT.get("roles", {}).items():
        if set(device_ids) == set(ids):
            return role
    return None


def recording(name: str, fn):
    """`fn` (a jitted function) that records its compiled memory analysis before its first call on
    each set of devices and argument shapes."""
    seen = set()

    def call(*args, **kwargs):
        devices = _devices((args, kwargs))
        key = (devices, _signature((args, kwargs)))
        if key not in seen:
            seen.add(key)
            record = {"program": name, "mode": CURRENT.get("mode"), "role": _role(devices), "devices": list(devices)}
            try:
                analysis = fn.lower(*args, **kwargs).compile().memory_analysis()
                record.update({k: getattr(analysis, k, None) for k in FIELDS})
                held = resident_bytes(set(devices))
                record["resident_bytes"] = max(held.values()) if held else 0
                record["xla_bytes"] = (record["resident_bytes"] + record["output_size_in_bytes"]
                                       - record["alias_size_in_bytes"] + record["temp_size_in_bytes"])
            except Exception as e:  # noqa: BLE001 -- a failed analysis is a finding, not a stop
                record["error"] = repr(e)[:500]
            RECORDS.append(record)
            print("compiled memory:", json.dumps(record), flush=True)
            write()
        return fn(*args, **kwargs)

    call.recording = True
    return call


def _wrap(obj, attr: str, name: str) -> None:
    fn = getattr(obj, attr)
    if not getattr(fn, "recording", False):
        setattr(obj, attr, recording(name, fn))


def _pool(config, mode: str) -> tuple[Pool, int | None]:
    """The pool `run_sizing.local_pool` gives a run of `config` in `mode` on this machine's
    devices; on devices the device table lacks (CPU), H200s of the same role sizes."""
    devices = jax.devices()
    pools = run_sizing.local_pool(config, devices, mode)
    if pools is not None:
        return pools
    rt, n = config.runtime, len(devices)
    if plan_lib.mode_flags(mode).colocated:
        return Pool("h200", 1, "h200", 1), rt.train_devices or n
    rollout_n = rt.rollout_devices or (n - rt.reward_devices) // 2
    return Pool("h200", rollout_n, "h200", rt.train_devices or (n - rt.reward_devices - rollout_n)), None


def roles() -> list[dict]:
    """Per mode and role: the plan's bytes per device, the compiled figure (the largest `xla_bytes`
    of the role's programs) and whether the plan is within TOLERANCE of it."""
    out = []
    for mode, entry in PLANS.items():
        for role in entry["plan"].roles:
            programs = [r for r in RECORDS if r["mode"] == mode and r["role"] == role.role and "xla_bytes" in r]
            plan_bytes = role.device_bytes - role.sync_buffers
            row = {"mode": mode, "role": role.role, "devices": entry["roles"].get(role.role),
                   "plan": {k: v / GIB for k, v in role.as_dict().items() if isinstance(v, float)},
                   "plan_gib": plan_bytes / GIB, "plan_sync_buffers_gib": role.sync_buffers / GIB,
                   "plan_total_gib": role.device_bytes / GIB, "pool": entry["pool"]}
            if programs:
                top = max(programs, key=lambda r: r["xla_bytes"])
                row.update(xla_gib=top["xla_bytes"] / GIB, xla_program=top["program"],
                           ratio=plan_bytes / top["xla_bytes"] if top["xla_bytes"] else None)
                row["within_tolerance"] = row["ratio"] is not None and abs(row["ratio"] - 1) <= TOLERANCE
            out.append(row)
    return out


def write() -> None:
    with open(_MEMORY_OUT.value, "w") as f:
        json.dump({"tolerance": TOLERANCE, "programs": RECORDS, "roles": roles()}, f, indent=1)


def plan_mode(executor, run_config, rt) -> None:
    """The memory plan of the mode `executor` runs (`rt`: its runtime settings), as it resolved
    colocated sampling and the trainer rollouts' precision, into PLANS."""
    config = copy.deepcopy(run_config)
    config.runtime.mode = rt.mode
    work = dataclasses.replace(run_sizing.iteration_work(config), colocated_sampling=executor.colocated_sampling,
                               tag_precision=executor.tag_precision)
    pool, colocated_devices = _pool(config, rt.mode)
    PLANS[rt.mode] = {"plan": memory_plan.memory_plan(work, pool, rt.mode, rt.micro_batches,
                                                      colocated_devices=colocated_devices),
                      "roles": CURRENT["roles"],
                      "pool": f"{pool.rollout_kind} x {colocated_devices} (colocated)" if colocated_devices else
                              f"{pool.rollout_kind} x {pool.rollout_devices} rollout, {pool.train_kind} x "
                              f"{pool.train_devices} train"}
    write()


def install() -> None:
    pin = trainer.Trainer.pin_state_sharding

    def pinned(self, state_sharding):
        pin(self, state_sharding)
        _wrap(self, "_grad", "gradient")
        _wrap(self, "_check_update", "update_check")
        _wrap(self, "_commit_update", "update")

    trainer.Trainer.pin_state_sharding = pinned
    init = rollout.Sampler.__init__

    def sampler_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        _wrap(self, "step", "rollout_step")

    rollout.Sampler.__init__ = sampler_init
    executor_init = executor_lib.Executor.__init__

    def executor(self, job, *, settings=None, **kwargs):
        rt = (settings or job.settings).runtime
        meshes = mesh_lib.build_role_meshes(rt)
        ids = lambda mesh: sorted(d.id for d in mesh.devices.flat)  # noqa: E731
        CURRENT.update(mode=rt.mode, roles={"shared": ids(meshes.train)} if meshes.colocated else
                       {"rollout": ids(meshes.rollout), "train": ids(meshes.train)})
        executor_init(self, job, settings=settings, **kwargs)
        try:
            plan_mode(self, job.config, rt)
        except Exception as e:  # noqa: BLE001 -- a plan that cannot be made is a finding, not a stop
            print(f"compiled memory: no memory plan for {rt.mode}: {e!r}"[:500], flush=True)

    executor_lib.Executor.__init__ = executor


if __name__ == "__main__":
    install()
    cli.run(bench.main)
