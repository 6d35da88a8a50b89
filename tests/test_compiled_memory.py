"""benchmarks/compiled_memory.py: a program's compiled memory is recorded once per devices and
argument shapes with the bytes its devices hold, and set against the memory plan of its role.

The script defines launch/bench.py's flags, so it runs in a child process of its own."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = r"""
import json, sys
sys.path.insert(0, "benchmarks")
import compiled_memory as cm
from absl import flags
flags.FLAGS(["x", "--memory_out=" + sys.argv[1]])
import jax, jax.numpy as jnp
from digen_jax.runtime.memory_plan import MemoryPlan, RoleMemory

d0, d1 = jax.devices()[:2]
cm.CURRENT.update(mode="colocated", roles={"shared": [d0.id]})
before = cm.resident_bytes({d0.id, d1.id})
x = jax.device_put(jnp.ones((256, 256), jnp.float32), d0)
after = cm.resident_bytes({d0.id, d1.id})
square = cm.recording("rollout_step", jax.jit(lambda a: a @ a))
square(x)
square(x)  # the same devices and shapes: not recorded again
square(jax.device_put(jnp.ones((128, 128), jnp.float32), d0))
square(jax.device_put(jnp.ones((128, 128), jnp.float32), d1))  # another device: no role of the mode

def plan(activations):
    role = RoleMemory(role="shared", devices=1, capacity=2**40, weights=0.0, gradients=0.0, optimizer=0.0, copies=0.0,
                      rollout_copy=0.0, activations=activations, sync_buffers=1e9, host=0.0)
    return {"plan": MemoryPlan("colocated", (role,)), "roles": {"shared": [d0.id]}, "pool": "test"}

top = max(r["xla_bytes"] for r in cm.RECORDS if r["role"] == "shared")
verdicts = []
for factor in (1.05, 1.2):
    cm.PLANS["colocated"] = plan(factor * top)
    verdicts.append(cm.roles()[0])
cm.write()
print(json.dumps({"added": [after[d] - before[d] for d in (d0.id, d1.id)], "records": cm.RECORDS,
                  "verdicts": verdicts, "top": top}))
"""


def test_programs_are_recorded_per_devices_and_shapes_and_set_against_the_plan(tmp_path):
    out = tmp_path / "memory.json"
    proc = subprocess.run([sys.executable, "-c", CHILD, str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["added"] == [256 * 256 * 4, 0]  # the new array, on its own device only
    records = result["records"]
    assert [(r["program"], r["role"], r["devices"]) for r in records] == [
        ("rollout_step", "shared", [0]), ("rollout_step", "shared", [0]), ("rollout_step", None, [1])]
    first = records[0]
    assert first["output_size_in_bytes"] == 256 * 256 * 4 and first["resident_bytes"] >= 256 * 256 * 4
    assert first["xla_bytes"] == (first["resident_bytes"] + first["output_size_in_bytes"] - first["alias_size_in_bytes"]
                                  + first["temp_size_in_bytes"])
    near, far = result["verdicts"]
    # The plan less its sync buffers against the largest program of the role.
    assert near["xla_gib"] * 2**30 == result["top"] and abs(near["ratio"] - 1.05) < 1e-9 and near["within_tolerance"]
    assert abs(far["ratio"] - 1.2) < 1e-9 and not far["within_tolerance"]
    assert near["plan_sync_buffers_gib"] == 1e9 / 2**30
    written = json.loads(out.read_text())
    assert len(written["programs"]) == 3 and written["roles"][0]["ratio"] == far["ratio"]
