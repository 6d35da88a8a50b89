"""Multi-host layer: SLURM/env resolution, host-aligned roles, 2-process transfers and training.

The 2-process tests start two local processes (a simulated SLURM step with a loopback
coordinator, 4 fake CPU devices each): rollout on process 0's devices, training on process
1's. One drives the transfers and a gradient step by hand (and measures the host memory of
full fine-tuning's placements); another runs the training loop
(`loop.train` through the executor, evaluating every iteration), compares it with a 1-process
run bit for bit and checks its task timing and overlap; one launch serves the tests of
checkpoints (across process layouts), the elastic split and the frozen base placed from each
process's own copy; the others check the system bench run as two processes, and that a killed
process stops the others (the peer watchdog) and a rerun resumes. Run directly, this file is
the worker: `python tests/test_distributed.py transfers OUT_DIR`, `python
tests/test_distributed.py loop WORKDIR CACHE_DIR MODE`, `placement WORKDIR CACHE_DIR
SINGLE_DIR`, `sleep PEER_TIMEOUT_S`, or `train LAUNCH_TRAIN_ARGS...` (launch/train.py).
"""
import concurrent.futures
import faulthandler
import json
import os
import runpy
import shutil
import socket
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from digen_jax import diffusion
from digen_jax.app import loop, run_checkpoints
from digen_jax.app.fingerprint import fingerprint
from digen_jax.app import workload as workload_lib
from digen_jax.app.settings import distributed_settings, run_settings
from digen_jax.rl.rollout import Conditioning, Sampler, SamplerSpec, Trajectory, initial_noise
from digen_jax.runtime import executor as executor_lib
from digen_jax.runtime import mesh as mesh_lib
from digen_jax.runtime import multihost, peer_watchdog, shared_values
from digen_jax.runtime import plan as plan_lib
from digen_jax.runtime import transfer as transfer_lib
from digen_jax.runtime.multihost import DistributedSettings, ProcessLayout, resolve_settings, role_devices
from digen_jax.runtime.executor import Executor
from digen_jax.runtime.trace import read_trace

# ---------------------------------------------------------------------------- role_devices


def fake_devices(hosts: int, per_host: int):
    # Shuffled, with ids numbered per host as multi-process backends do.
    devices = [SimpleNamespace(id=h * 1000 + i, process_index=h) for h in range(hosts) for i in range(per_host)]
    return devices[::-1]


def layout(roles):
    return {role: [(d.process_index, d.id % 1000) for d in ds] for role, ds in roles.items()}


def test_roles_whole_hosts_2x8():
    roles = role_devices(fake_devices(2, 8), {"rollout": 8, "train": 8, "reward": 0})
    assert layout(roles) == {"rollout": [(0, i) for i in range(8)], "train": [(1, i) for i in range(8)]}


def test_roles_even_share_and_small_roles_inside_hosts_4x4():
    roles = role_devices(fake_devices(4, 4), {"rollout": 0, "train": 0, "reward": 8})
    assert layout(roles) == {
        "rollout": [(0, i) for i in range(4)],
        "train": [(1, i) for i in range(4)],
        "reward": [(h, i) for h in (2, 3) for i in range(4)],
    }
    # Roles smaller than a host may share one, as long as none straddles a boundary.
    roles = role_devices(fake_devices(4, 4), {"reward": 2, "rollout": 2, "train": 12})
    assert layout(roles)["reward"] == [(0, 0), (0, 1)] and layout(roles)["rollout"] == [(0, 2), (0, 3)]
    assert layout(roles)["train"][0] == (1, 0) and len(roles["train"]) == 12


def test_roles_keep_to_tpu_slices():
    """Devices of 2 TPU slices of 2 hosts x 4 chips, listed shuffled: roles come in slice order
    and lie inside one slice or are whole slices, even where they would be whole hosts."""
    devices = [SimpleNamespace(id=h * 1000 + i, process_index=h, slice_index=h // 2)
               for h in (3, 1, 2, 0) for i in range(4)]
    roles = role_devices(devices, {"rollout": 4, "train": 4, "reward": 8})
    assert [d.slice_index for d in roles["rollout"] + roles["train"]] == [0] * 8
    assert {d.slice_index for d in roles["reward"]} == {1} and layout(roles)["rollout"] == [(0, i) for i in range(4)]
    with pytest.raises(ValueError, match=r"runtime.train_devices=12 splits a slice: with \[8\] devices per slice"):
        role_devices(devices, {"rollout": 4, "train": 12})


def test_roles_colocated_share_every_device():
    devices = fake_devices(2, 4)
    roles = role_devices(devices, {"rollout": 3, "train": 0}, colocated=True)
    assert roles["rollout"] == roles["train"] == sorted(devices, key=lambda d: (d.process_index, d.id))


@pytest.mark.parametrize(
    "hosts,per_host,sizes,message",
    [
        (2, 8, {"rollout": 4, "train": 8, "reward": 4}, r"runtime.train_devices=8 splits a host"),
        (4, 4, {"rollout": 6, "train": 10}, r"runtime.rollout_devices=6 splits a host"),
        (2, 8, {"rollout": 10, "train": 8}, r"add up to 18 devices, but there are 16"),
        (4, 4, {"rollout": 0, "train": 0, "reward": 3}, r"13 devices left of 16 do not split evenly"),
        (1, 8, {"rollout": -2, "train": 8}, r"runtime.rollout_devices must be a device count >= 0"),
    ],
)
def test_roles_bad_sizes_name_the_key(hosts, per_host, sizes, message):
    with pytest.raises(ValueError, match=message):
        role_devices(fake_devices(hosts, per_host), sizes)


def test_roles_single_host_need_no_alignment():
    roles = role_devices(fake_devices(1, 8), {"rollout": 3, "train": 5})
    assert [len(roles["rollout"]), len(roles["train"])] == [3, 5]


# ---------------------------------------------------------------------------- settings


def slurm_env(**overrides):
    env = dict(
        SLURM_JOB_ID="123456",
        SLURM_NTASKS="16",
        SLURM_PROCID="13",
        SLURM_LOCALID="5",
        SLURM_STEP_NODELIST="gpu[007-008]",
        SLURM_STEP_NUM_NODES="2",
        SLURM_STEP_TASKS_PER_NODE="8(x2)",
    )
    return {k: v for k, v in (env | overrides).items() if v is not None}


def test_slurm_task_per_gpu():
    port = 61440 + 123456 % 4096
    assert resolve_settings(DistributedSettings(), slurm_env()) == ProcessLayout(
        "slurm-task-per-gpu", 16, 13, f"gpu007:{port}", (5,)
    )
    # srun already bound one GPU to the task: jax sees only that one.
    got = resolve_settings(DistributedSettings(), slurm_env(CUDA_VISIBLE_DEVICES="5", JAX_COORDINATOR_PORT="5000"))
    assert (got.local_device_ids, got.coordinator_address) == (None, "gpu007:5000")


def test_slurm_task_per_node():
    env = slurm_env(SLURM_NTASKS="2", SLURM_PROCID="1", SLURM_LOCALID="0", SLURM_STEP_TASKS_PER_NODE="1(x2)",
                    SLURM_STEP_NODELIST="a-node01,b-node02", CUDA_VISIBLE_DEVICES="0,1,2,3")
    got = resolve_settings(DistributedSettings(coordinator_address="10.0.0.1:1234"), env)
    assert got == ProcessLayout("slurm-task-per-node", 2, 1, "10.0.0.1:1234", None)


@pytest.mark.parametrize(
    "nodelist,first",
    [("node001", "node001"), ("node001,host2", "node001"), ("node[003-015],host2", "node003"),
     ("node[001,007-015]", "node001"), ("rack[2-3]-gpu[10-11]", "rack2-gpu10")],
)
def test_first_slurm_host(nodelist, first):
    assert multihost.first_slurm_host(nodelist) == first


def test_explicit_env_and_single_process():
    env = {"JAX_COORDINATOR_ADDRESS": "host:99", "JAX_NUM_PROCESSES": "4", "JAX_PROCESS_ID": "3"}
    assert resolve_settings(DistributedSettings(), env) == ProcessLayout("explicit", 4, 3, "host:99", None)
    assert resolve_settings(DistributedSettings(enabled=False), env).source == "single"
    assert resolve_settings(DistributedSettings(), {}) == ProcessLayout("single")
    # ml_collections-style config: runtime.distributed is a bool or a section.
    config = {"runtime": {"distributed": {"enabled": True, "num_processes": 2, "process_id": 0,
                                          "coordinator_address": "h:1", "local_device_ids": [0, 1]}}}
    assert distributed_settings(config) == DistributedSettings(True, "h:1", 2, 0, (0, 1))
    assert distributed_settings({"runtime": {"distributed": False}}).enabled is False


@pytest.mark.parametrize(
    "settings,env,message",
    [
        (DistributedSettings(num_processes=8), slurm_env(), r"num_processes=8 contradicts the SLURM step \(16\)"),
        (DistributedSettings(process_id=2), slurm_env(), r"process_id=2 contradicts"),
        (DistributedSettings(enabled=True), {}, r"runtime.distributed is on but there is no SLURM step and no coordinator"),
        (DistributedSettings(num_processes=2), {}, r"num_processes and process_id must both be set"),
        (DistributedSettings(num_processes=2, process_id=2, coordinator_address="h:1"), {}, r"process_id=2 must be in \[0, num_processes=2\)"),
        (DistributedSettings(num_processes=2, process_id=0), {}, r"coordinator_address .* is needed for 2 processes"),
        (DistributedSettings(num_processes=2, process_id=0, coordinator_address="h"), {}, r"must be 'host:port'"),
        (DistributedSettings(enabled="yes"), {}, r"enabled must be True, False or 'auto'"),
        (DistributedSettings(), {"JAX_NUM_PROCESSES": "two", "JAX_PROCESS_ID": "0"}, r"JAX_NUM_PROCESSES='two' is not an integer"),
        (DistributedSettings(), slurm_env(SLURM_STEP_TASKS_PER_NODE="8,4"), r"nodes run different task counts"),
        (DistributedSettings(), slurm_env(CUDA_VISIBLE_DEVICES="0,1,2,3"), r"8 SLURM tasks per node but CUDA_VISIBLE_DEVICES lists 4 GPUs"),
    ],
)
def test_inconsistent_settings_fail_clearly(settings, env, message):
    with pytest.raises(ValueError, match=message):
        resolve_settings(settings, env)


def test_single_process_initialize_is_a_no_op():
    assert multihost.initialize(DistributedSettings(enabled=False), env=slurm_env()) == ProcessLayout("single")
    assert multihost.initialize(env={}) == ProcessLayout("single")
    assert not jax.distributed.is_initialized()


def test_tpu_vm_starts_jax_distributed_without_arguments(monkeypatch):
    """On a Cloud TPU VM, `runtime.distributed=True` with no SLURM step or coordinator calls
    `jax.distributed.initialize()` with no arguments (JAX reads the slice from the TPU metadata);
    elsewhere the same settings are an error naming the launchers."""
    calls = []
    monkeypatch.setattr(multihost, "on_tpu_vm", lambda: True)
    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: bool(calls))
    monkeypatch.setattr(jax.distributed, "initialize", lambda *args, **kwargs: calls.append((args, kwargs)))
    assert resolve_settings(DistributedSettings(enabled=True), {}, tpu_vm=True) == ProcessLayout("tpu-vm")
    assert resolve_settings(DistributedSettings(enabled="auto"), {}, tpu_vm=True) == ProcessLayout("single")
    assert resolve_settings(DistributedSettings(enabled=True), slurm_env(), tpu_vm=True).source == "slurm-task-per-gpu"
    layout = multihost.initialize(DistributedSettings(enabled=True), env={})
    assert calls == [((), {})] and (layout.source, layout.num_processes) == ("tpu-vm", 1)


def test_unknown_config_key():
    with pytest.raises(ValueError, match=r"unknown keys runtime.distributed.\['port'\]"):
        distributed_settings({"runtime": {"distributed": {"port": 1}}})


class FakeStore:
    """The key-value part of a `jax.distributed` client, in memory; `answers=False`: unreachable."""

    def __init__(self):
        self.values, self.answers = {}, True

    def key_value_set(self, key, value, allow_overwrite=False):
        self._check()
        self.values[key] = value

    def key_value_dir_get(self, prefix):
        self._check()
        return [(k, v) for k, v in sorted(self.values.items()) if k.startswith(prefix)]

    def _check(self):
        if not self.answers:
            raise RuntimeError("UNAVAILABLE: failed to connect to all addresses\nmore detail")


class BlockingStore(FakeStore):
    """`FakeStore` with the blocking byte reads of `jax.distributed`'s client (a timeout raises as it does)."""

    def __init__(self):
        super().__init__()
        self.changed = threading.Condition()

    def key_value_set_bytes(self, key, value):
        with self.changed:
            self.values[key] = value
            self.changed.notify_all()

    def blocking_key_value_get_bytes(self, key, timeout_ms):
        with self.changed:
            if not self.changed.wait_for(lambda: key in self.values, timeout_ms / 1e3):
                raise RuntimeError(f"DEADLINE_EXCEEDED: GetKeyValue() timed out with key: {key}")
            return self.values[key]


def test_shared_values_reach_readers_that_wait_and_carry_failures(monkeypatch):
    """A value published after its reader started waiting (past several poll timeouts) arrives
    whole; a failure reaches the reader as an error naming it; closing ends a waiting reader."""
    store = BlockingStore()
    monkeypatch.setattr(shared_values.SharedValues, "_client", staticmethod(lambda: store))
    monkeypatch.setattr(shared_values.SharedValues, "_POLL_MS", 20)
    shared, other = shared_values.SharedValues(), shared_values.SharedValues()
    rewards = np.array([0.5, -1.25, 3.0], np.float32)
    waiting = shared.read_later("rewards/0/1", np.float32)
    time.sleep(0.1)
    assert not waiting.done()
    other.publish("rewards/0/1", -rewards)  # another scope: not this reader's value
    shared.publish("rewards/0/1", rewards)
    assert np.array_equal(waiting.result(timeout=5), rewards)
    shared.fail("rewards/0/2", ValueError("reward model missing"))
    with pytest.raises(RuntimeError, match=r"rewards/0/2: process 0 failed: ValueError: reward model missing"):
        shared.read("rewards/0/2", np.float32)
    never = shared.read_later("rewards/0/3", np.float32)
    shared.close()
    with pytest.raises(RuntimeError, match="the run is closing"):
        never.result(timeout=5)
    other.close()


def test_shared_scalars_keep_each_dtype_for_every_process(monkeypatch):
    """An iteration's figures as the process holding them and another one get them: the same
    values with the same dtypes (what metrics.jsonl writes: ints stay ints), no device program."""
    store = BlockingStore()
    monkeypatch.setattr(shared_values.SharedValues, "_client", staticmethod(lambda: store))
    figures = {"loss": jnp.float32(-0.123456789), "version": jnp.int32(7), "skipped": jnp.int32(0),
               "finite": jnp.bool_(True), "kl": jnp.float32(np.nan)}
    owner, reader = shared_values.SharedValues(), shared_values.SharedValues()
    reader._scope = owner._scope  # the same object on another process
    pool = concurrent.futures.ThreadPoolExecutor(1)
    monkeypatch.setattr(shared_values.jax, "process_index", lambda: 1)
    read = reader.share_scalars("figures/3", figures, pool)
    assert not any(f.done() for f in read.values())  # waits for the owner (process 0 holds the arrays)
    monkeypatch.setattr(shared_values.jax, "process_index", lambda: 0)
    held = owner.share_scalars("figures/3", figures, pool)
    for got in (held, read):
        assert list(got) == list(figures)
        for name, value in figures.items():
            v = got[name].result(timeout=5)
            assert v.dtype == value.dtype and v.shape == ()
            np.testing.assert_array_equal(v, np.asarray(value))
    for shared in (owner, reader):
        shared.close()
    pool.shutdown()


@pytest.mark.parametrize("silent", ["process 2", "coordinator"])
def test_peer_watchdog_names_what_went_silent(monkeypatch, silent):
    """Process 1 of 3 watches with a 1 s timeout: while processes 0 and 2 beat (written here)
    nothing happens; then process 2 stops beating, or the store stops answering, and the watchdog
    reports it, naming the process and its host, 0.6 to 1 timeout later (plus scheduling slack)."""
    store = FakeStore()
    monkeypatch.setattr(peer_watchdog.global_state, "client", store)
    reports = []
    watchdog = peer_watchdog.PeerWatchdog(store, 1, 3, 1.0, "10.0.0.1:1234", on_lost=reports.append)

    def beat(processes, count):
        for process in processes:
            store.values[f"{peer_watchdog.HEARTBEAT_KEY}{process}"] = f"{count} node{process}"

    try:
        for count in range(30):  # 1.5 timeouts of healthy beats, 20 a second
            beat((0, 2), count)
            time.sleep(0.05)
        assert not reports and min(watchdog.counts().values()) >= 20
        assert store.values[f"{peer_watchdog.HEARTBEAT_KEY}1"].endswith(f" {socket.gethostname()}")
        start = time.monotonic()
        store.answers = silent != "coordinator"
        while not reports and time.monotonic() - start < 3:
            count += 1
            beat((0,), count)
            time.sleep(0.05)
        assert 0.5 < time.monotonic() - start < 1.5 and len(reports) == 1
        if silent == "coordinator":
            assert reports[0].startswith("lost the coordinator, process 0 of 3 (host node0): its key-value store at "
                                         "10.0.0.1:1234 has not answered for ")
            assert "(runtime.peer_timeout_s=1; UNAVAILABLE: failed to connect to all addresses)" in reports[0]
        else:
            assert reports[0].startswith("lost process 2 of 3 (host node2): no heartbeat for ")
        assert not watchdog.alive()
    finally:
        watchdog.close()


def test_peer_timeout_must_be_positive():
    for bad in (0, -1.0, "20", True, float("nan")):
        with pytest.raises(ValueError, match="runtime.peer_timeout_s must be a number of seconds > 0"):
            peer_watchdog.check_timeout(bad)
    assert peer_watchdog.jax_heartbeat_timeout_s(20) == 100 and peer_watchdog.jax_heartbeat_timeout_s(120) == 240


# ---------------------------------------------------------------------------- transfers in one process


def test_transfer_in_one_process_moves_device_to_device(monkeypatch):
    """Layouts jax.device_put would carry through host memory (shard k of the source is not
    shard k of the destination) are replicated inside the source devices and copied whole
    device to device; shard-for-shard copies stay a device_put. Values and shardings come out
    the same either way."""
    devices = jax.devices()
    by_copies = transfer_lib._move_by_copies
    copied = []
    monkeypatch.setattr(transfer_lib, "_move_by_copies", lambda *args: copied.append(len(args[2])) or by_copies(*args))
    src = NamedSharding(Mesh(np.array(devices[:4]).reshape(2, 2), ("a", "b")), P("a", "b"))
    dst = NamedSharding(Mesh(np.array(devices[4:]), ("data",)), P(None, "data"))
    x = jax.device_put(jnp.arange(32.0).reshape(4, 8), src)
    assert transfer_lib._through_host(x, dst)
    y = transfer_lib.transfer({"w": x}, dst)["w"]
    assert y.sharding == dst and np.array_equal(y, x)
    # A prefix tree of shardings, as jax.device_put takes.
    replicated = NamedSharding(dst.mesh, P())
    moved = transfer_lib.transfer({"a": x, "b": (x, None, x)}, {"a": dst, "b": replicated})
    assert moved["a"].sharding == dst and moved["b"][1] is None
    assert all(leaf.sharding == replicated and np.array_equal(leaf, x) for leaf in moved["b"][::2])
    # Full fine-tuning's sync: FSDP shards on 3 train devices onto 1 rollout device, bf16.
    fsdp = NamedSharding(Mesh(np.array(devices[1:4]), ("data",)), P("data"))
    one = NamedSharding(Mesh(np.array(devices[:1]), ("data",)), P())
    w = jax.device_put(jnp.arange(6 * 5, dtype=jnp.bfloat16).reshape(6, 5), fsdp)
    assert transfer_lib._through_host(w, one)
    moved = transfer_lib.transfer([w, jnp.float32(3)], one)
    assert moved[0].sharding == one and moved[0].dtype == jnp.bfloat16 and np.array_equal(moved[0], w)
    assert copied == [1, 3, 1]  # every move above that jax.device_put would read through host memory
    # Shard for shard between equal meshes: jax copies device to device itself.
    same = NamedSharding(Mesh(np.array(devices[4:]).reshape(2, 2), ("a", "b")), P("a", "b"))
    assert not transfer_lib._through_host(x, same)
    assert np.array_equal(transfer_lib.transfer(x, same), x) and len(copied) == 3


def test_a_layout_change_over_the_same_devices_runs_on_them(monkeypatch):
    """FSDP shards to a replicated copy over the same devices in the same order (colocated full
    fine-tuning's gathered sampling copy, the replica a move makes inside its source role): a
    compiled identity whose collectives run on the devices, never jax.device_put, which reads
    an array back through host memory when the destination takes a layout none of its shards
    hold. Other placements (another device order, other devices) are jax.device_put's."""
    devices = jax.devices()
    mesh = Mesh(np.array(devices[:4]), ("data",))
    flat = Mesh(np.array(devices[:4]).reshape(2, 2), ("a", "b"))  # same devices, same order
    x = jax.device_put(jnp.arange(32.0).reshape(8, 4) - 3.5, NamedSharding(mesh, P("data")))
    k = jax.device_put(jnp.arange(8, dtype=jnp.int32), NamedSharding(mesh, P("data")))
    targets = [NamedSharding(mesh, P()), NamedSharding(flat, P("b"))]
    put = jax.device_put
    puts = []
    monkeypatch.setattr(jax, "device_put", lambda *a, **kw: puts.append(a) or put(*a, **kw))
    placed = transfer_lib.place([x, k], targets)
    assert puts == []
    assert [y.sharding for y in placed] == targets
    assert np.array_equal(placed[0], x) and np.array_equal(placed[1], k)
    reordered = NamedSharding(Mesh(np.array(devices[:4])[::-1], ("data",)), P())
    [y] = transfer_lib.place([x], [reordered])
    assert len(puts) == 1 and y.sharding == reordered and np.array_equal(y, x)


def test_to_every_process_in_one_process_is_free():
    # Single-process runs read batch-split arrays on the host directly: no gather, no copy.
    x = jax.device_put(jnp.arange(8.0), NamedSharding(Mesh(np.array(jax.devices()[:4]), ("data",)), P("data")))
    tree = {"pixels": x, "version": jnp.int32(2)}
    assert transfer_lib.to_every_process(tree) is tree


def test_put_own_copy_places_like_device_put():
    """Host arrays, uncommitted and committed arrays each process holds whole, placed from this
    process's copy: the shardings and bits of `jax.device_put`; a whole array already on a
    destination device is that device's shard, not a second copy."""
    devices = jax.devices()
    mesh = Mesh(np.array(devices[4:]), ("data",))
    tree = {
        "host": np.arange(32, dtype=np.float32).reshape(8, 4) - 7.5,
        "uncommitted": jnp.arange(24, dtype=jnp.int32).reshape(2, 12),
        "committed": (jax.device_put(jnp.float32(-0.0), devices[0]),
                      jax.device_put(jnp.ones((4, 4), jnp.bfloat16), devices[5])),
    }
    shardings = {"host": NamedSharding(mesh, P("data")), "uncommitted": NamedSharding(mesh, P(None, "data")),
                 "committed": NamedSharding(mesh, P())}
    assert transfer_lib.own_copy_everywhere(tree)
    placed, reference = transfer_lib.put_own_copy(tree, shardings), jax.device_put(tree, shardings)
    for got, want in zip(jax.tree.leaves(placed), jax.tree.leaves(reference)):
        assert got.sharding == want.sharding and got.dtype == want.dtype
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        assert np.array_equal(got, want) and np.array_equal(np.signbit(got), np.signbit(want))
    on_device = tree["committed"][1]
    [shard] = [s for s in placed["committed"][1].addressable_shards if s.device == devices[5]]
    assert shard.data.unsafe_buffer_pointer() == on_device.unsafe_buffer_pointer()


def test_crossing_bytes_counts_one_copy_of_what_lives_elsewhere():
    devices = jax.devices()
    src, dst = Mesh(np.array(devices[:4]), ("data",)), Mesh(np.array(devices[4:]), ("data",))
    tree = {
        "moves": jax.device_put(jnp.zeros((8, 3), jnp.float32), NamedSharding(src, P("data"))),
        "keys": jax.device_put(jax.random.split(jax.random.key(0), 4), NamedSharding(src, P("data"))),
        "stays": jax.device_put(jnp.zeros((5,), jnp.int32), NamedSharding(dst, P())),
        "host_derived": jnp.zeros((7,), jnp.float32),  # uncommitted: every process places its own copy
    }
    assert transfer_lib.crossing_bytes(tree, dst) == 8 * 3 * 4 + 4 * 2 * 4
    assert transfer_lib.crossing_bytes(tree, src) == 5 * 4


def piece_leaves(src_mesh):
    """Leaves of 1152, 96, 288, 4 and 4096 bytes: a tree above a 1 KiB piece bound."""
    fsdp = NamedSharding(src_mesh, P(src_mesh.axis_names[0]))
    return [
        jax.device_put(jnp.arange(288.0, dtype=jnp.float32).reshape(24, 12) - 100.5, fsdp),
        jax.device_put(jnp.arange(24, dtype=jnp.int32).reshape(4, 6), fsdp),
        jax.device_put(jnp.linspace(-1.0, 1.0, 144).astype(jnp.bfloat16).reshape(12, 12), NamedSharding(src_mesh, P())),
        jax.device_put(jnp.float32(-0.0), NamedSharding(src_mesh, P())),
        jax.device_put(jnp.arange(1024.0, dtype=jnp.float32).reshape(4, 256), fsdp),
    ]


@pytest.mark.parametrize("n_src,n_dst,copies", [(4, 4, False), (4, 2, False), (4, 1, True)])
def test_moves_in_pieces_keep_every_bit(monkeypatch, n_src, n_dst, copies):
    """A move of a tree above the piece bound runs one program per piece (consecutive leaves of
    at most the bound together, a larger leaf alone), each finished before the next is issued
    (inside one process the last is not waited for): the same bits as one program for the
    whole tree."""
    devices = jax.devices()
    src_mesh = Mesh(np.array(devices[:n_src]), ("fsdp",))
    dst_ids = tuple(d.id for d in devices[n_src:n_src + n_dst])
    if copies:
        move = transfer_lib._move_by_copies
    else:
        move = transfer_lib._move_same_layout if n_src == n_dst else transfer_lib._move_replicated
    leaves = piece_leaves(src_mesh)
    whole = move(src_mesh, dst_ids, leaves)
    fenced = []
    fence = transfer_lib._fence
    monkeypatch.setattr(transfer_lib, "_fence", lambda moved, wait: fenced.append((len(moved), wait)) or fence(moved, wait))
    monkeypatch.setattr(transfer_lib, "TRANSFER_PIECE_BYTES", 1024)
    pieces, moved = [], [None] * len(leaves)
    for piece, arrays in transfer_lib._move_in_pieces(move, src_mesh, dst_ids, leaves):
        assert len(fenced) == len(pieces) + 1  # this piece's program finished before the next is issued
        pieces.append(piece)
        for j, y in zip(piece, arrays):
            moved[j] = y
    assert pieces == [[0], [1, 2, 3], [4]] and fenced == [(1, True), (3, True), (1, False)]
    for x, y, ref in zip(leaves, moved, whole):
        assert y.sharding == ref.sharding and y.shape == x.shape and y.dtype == x.dtype
        got, sent = np.asarray(y, np.float32), np.asarray(x, np.float32)
        assert np.array_equal(got, sent) and np.array_equal(np.signbit(got), np.signbit(sent))
    monkeypatch.setattr(transfer_lib, "TRANSFER_PIECE_BYTES", 1 << 20)  # within the bound: one program
    assert [piece for piece, _ in transfer_lib._move_in_pieces(move, src_mesh, dst_ids, leaves)] == [[0, 1, 2, 3, 4]]


@pytest.mark.parametrize("n_src,n_dst", [(4, 4), (3, 5), (4, 2)])
def test_collective_paths_keep_every_bit(n_src, n_dst):
    """The cross-process paths (and the one-process copies), run inside one process: 2-D
    meshes, scalars, -0.0, any sizes."""
    devices = jax.devices()
    grid = (2, 2) if n_src == 4 else (n_src, 1)
    src_mesh = Mesh(np.array(devices[:n_src]).reshape(grid), ("fsdp", "tensor"))
    dst_ids = tuple(d.id for d in devices[n_src:n_src + n_dst])
    leaves = [
        jax.device_put(jnp.arange(48.0).reshape(12, 4) - 7.5, NamedSharding(src_mesh, P(("fsdp", "tensor")))),
        jax.device_put(jnp.arange(72, dtype=jnp.int32).reshape(2, 3, 12), NamedSharding(src_mesh, P(None, None, "fsdp"))),
        jax.device_put(jnp.float32(-0.0), NamedSharding(src_mesh, P())),
    ]
    move = transfer_lib._move_same_layout if n_src == n_dst else transfer_lib._move_replicated
    moved = move(src_mesh, dst_ids, leaves) + transfer_lib._move_by_copies(src_mesh, dst_ids, leaves)
    for x, y in zip(leaves + leaves, moved):
        assert {d.id for d in y.sharding.device_set} == set(dst_ids)
        assert y.shape == x.shape and y.dtype == x.dtype
        got, sent = np.asarray(y), np.asarray(x)
        assert np.array_equal(got, sent) and np.array_equal(np.signbit(got), np.signbit(sent))  # -0.0 stays -0.0


# ---------------------------------------------------------------------------- two processes

BATCH, LATENT_SHAPE, TEXT_SHAPE, WORKER_TIMEOUT_S = 8, (16, 8), (4, 8), 120
LOOP_TIMEOUT_S = 300  # the training loop compiles a model's rollout and training steps in every process
PLACEMENT_TIMEOUT_S = 3 * LOOP_TIMEOUT_S  # `run_placement_worker`: three parts, each a loop's worth
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOISE_LEVEL, LEARNING_RATE = 0.7, 0.1


class TinyDenoiser(nn.Module):
    """A velocity model small enough to compile quickly in two processes on a busy CPU."""

    @nn.compact
    def __call__(self, latents, text, sigma):
        context = jnp.broadcast_to(jnp.mean(text, axis=1, keepdims=True), latents.shape[:2] + text.shape[-1:])
        level = jnp.broadcast_to(sigma[:, None, None], latents.shape[:2] + (1,))
        hidden = nn.gelu(nn.Dense(32)(jnp.concatenate([latents, context, level], axis=-1)))
        return nn.Dense(latents.shape[-1])(hidden)


def make_params():
    shapes = (1, *LATENT_SHAPE), (1, *TEXT_SHAPE), (1,)
    return TinyDenoiser().init(jax.random.key(0), *(jnp.zeros(s) for s in shapes))["params"]


def make_sampler():
    model = TinyDenoiser()
    denoiser = lambda params, latents, cond, sigma: model.apply({"params": params}, latents, cond.text, sigma)  # noqa: E731
    sigmas = diffusion.sigma_ladder("flux", 4, image_seq_len=LATENT_SHAPE[0]).sigmas
    return Sampler(denoiser, SamplerSpec("sde"), sigmas)


def make_cond():
    return Conditioning(jax.random.normal(jax.random.key(3), (BATCH, *TEXT_SHAPE)))


def fsdp_spec(shape):
    """The test's FSDP rule: split the last axis over the 4 train devices where it divides."""
    return P(*([None] * (len(shape) - 1)), "fsdp") if shape and shape[-1] % 4 == 0 else P()


def rollout_ladder(sampler, params, cond, sample_keys, latent_shape):
    """Initial noise then every step of the ladder: the (B, N + 1, ...) path and (B, N) log-probs."""
    latents = initial_noise(sample_keys, latent_shape)
    path, log_probs = [latents], []
    for i in range(sampler.num_steps):
        latents, log_prob, _ = sampler.step(params, latents, cond, i, NOISE_LEVEL, sample_keys)
        path.append(latents)
        log_probs.append(log_prob)
    return jnp.stack(path, axis=1), jnp.stack(log_probs, axis=1)


def policy_gradient(sampler, params, latents, log_probs, cond):
    """Gradient of a clip-free GRPO surrogate over every step, fixed advantages."""
    advantages = jnp.linspace(-1.0, 1.0, latents.shape[0])

    def loss(p):
        total = 0.0
        for j in range(sampler.num_steps):
            out = sampler.transition(p, latents[:, j], cond, j, NOISE_LEVEL, prev_sample=latents[:, j + 1])
            total += -jnp.mean(advantages * jnp.exp(out.log_prob - log_probs[:, j]))
        return total / sampler.num_steps

    return jax.grad(loss)(params)


def stage(message: str) -> None:
    # Progress on stdout: where a hung worker stopped shows in the test's failure message.
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


MEMORY_LEAVES, MEMORY_LEAF_SHAPE = 24, (256, 4096)  # 24 float32 leaves of 4 MiB: a 96 MiB tree
MEMORY_TREE_BYTES = MEMORY_LEAVES * 4 << 20
MEMORY_PIECE_BYTES = 4 << 20  # one leaf per piece: Qwen-Image-20B's 41 GB move in 2 GiB pieces


def rss_growth(fn):
    """(fn(), (the most this process's resident memory rose above its level before the call while
    it ran, how far above it the call left it), in bytes), sampled every millisecond. On CPU,
    devices' buffers are host memory too; the workers run with MALLOC_MMAP_THRESHOLD_ set, so
    freed buffers leave the resident set."""
    page, peak, done = os.sysconf("SC_PAGE_SIZE"), [0], threading.Event()

    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * page

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], rss())
            time.sleep(0.001)

    before = rss()
    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        out = jax.block_until_ready(fn())
    finally:
        done.set()
        sampler.join()
    after = rss()
    return out, (max(peak[0], after) - before, after - before)


def measure_host_memory(train_mesh: Mesh, rollout_mesh: Mesh) -> dict:
    """Full fine-tuning's placements of a 96 MiB tree in 4 MiB pieces and the resident memory each
    adds on this process (`rss_growth`): the train state, which every process holds whole
    (`Run.state`), onto the train role's FSDP shardings (`put_in_pieces`, the executor's first
    placement); then the weight sync of it to the rollout role, replicated (`transfer`)."""
    host_state = jax.block_until_ready([jnp.full(MEMORY_LEAF_SHAPE, i - 11.5, jnp.float32) for i in range(MEMORY_LEAVES)])
    fsdp = NamedSharding(train_mesh, P(None, "fsdp"))
    default, transfer_lib.TRANSFER_PIECE_BYTES = transfer_lib.TRANSFER_PIECE_BYTES, MEMORY_PIECE_BYTES
    try:
        placed, placement = rss_growth(lambda: transfer_lib.put_in_pieces(host_state, fsdp))
        synced, sync = rss_growth(lambda: transfer_lib.transfer(placed, NamedSharding(rollout_mesh, P())))
    finally:
        transfer_lib.TRANSFER_PIECE_BYTES = default
    if jax.process_index() == 0:  # every bit arrived
        assert all(np.array_equal(np.asarray(y), np.asarray(x)) for x, y in zip(host_state, synced))
    else:
        assert all(y.sharding == fsdp and np.array_equal(np.asarray(y), np.asarray(x)) for x, y in zip(host_state, placed))
    stage("placement and sync measured")
    return {"placement_growth": np.int64(placement), "sync_growth": np.int64(sync)}


def run_worker(out_dir: str) -> None:
    """One process of the 2-process test: rollout on process 0's devices, training on 1's."""
    layout = multihost.initialize()
    stage("initialize")
    jax.config.update("jax_default_matmul_precision", "highest")
    assert layout == ProcessLayout("slurm-task-per-node", 2, jax.process_index(), f"127.0.0.1:{os.environ['JAX_COORDINATOR_PORT']}")
    assert jax.process_count() == 2
    me = jax.process_index()
    roles = role_devices(jax.devices(), {"rollout": 0, "train": 0})
    assert [d.process_index for d in roles["rollout"]] == [0] * 4
    assert [d.process_index for d in roles["train"]] == [1] * 4
    rollout_mesh = Mesh(np.array(roles["rollout"]), ("data",))
    train_mesh = Mesh(np.array(roles["train"]), ("fsdp",))
    rollout_batch, train_batch = NamedSharding(rollout_mesh, P("data")), NamedSharding(train_mesh, P("fsdp"))
    memory = measure_host_memory(train_mesh, rollout_mesh)
    sampler = make_sampler()

    # Weights on the trainer (FSDP), then the weight sync to the rollout role (replicated).
    abstract = jax.eval_shape(make_params)
    train_shardings = jax.tree.map(lambda a: NamedSharding(train_mesh, fsdp_spec(a.shape)), abstract)
    params = jax.jit(make_params, out_shardings=train_shardings)()
    stage("params on the train role")
    version = jax.device_put(np.int32(3), NamedSharding(train_mesh, P()))
    synced = transfer_lib.transfer((params, version), NamedSharding(rollout_mesh, P()))
    stage("first weight sync dispatched")
    start = time.perf_counter()
    synced = jax.block_until_ready(transfer_lib.transfer((params, version), NamedSharding(rollout_mesh, P())))
    sync_s = time.perf_counter() - start
    rollout_params, rollout_version = synced
    stage("weight sync done")

    # Rollout on process 0's devices, the batch split over them.
    cond, sample_keys = jax.jit(
        lambda: (make_cond(), jax.random.split(jax.random.key(7), BATCH)), out_shardings=rollout_batch
    )()
    latents, log_probs = jax.jit(
        lambda p, c, k: rollout_ladder(sampler, p, c, k, LATENT_SHAPE), out_shardings=rollout_batch
    )(rollout_params, cond, sample_keys)
    stage("rollout dispatched")

    # Trajectories back to the trainer, then one gradient step there.
    trajectories = transfer_lib.transfer((latents, log_probs, cond, sample_keys), train_batch)
    stage("trajectories dispatched")
    grads = jax.jit(
        lambda p, l, lp, c: policy_gradient(sampler, p, l, lp, c), out_shardings=train_shardings
    )(params, *trajectories[:3])
    updated = jax.jit(lambda p, g: jax.tree.map(lambda a, b: a - LEARNING_RATE * b, p, g))(params, grads)
    stage("update dispatched")

    # Unequal role sizes: to 2 devices of the other process (the replicate-and-send path).
    narrow_rollout = NamedSharding(Mesh(np.array(roles["rollout"][:2]), ("data",)), P())
    narrow_train = NamedSharding(Mesh(np.array(roles["train"][1:3]), ("fsdp",)), P("fsdp"))
    narrow_params = transfer_lib.transfer(params, narrow_rollout)
    narrow_latents = transfer_lib.transfer(latents, narrow_train)
    # Between two device sets of process 1: process 0 only keeps handles.
    within_train = transfer_lib.transfer((trajectories[0], trajectories[3]), narrow_train)
    stage("unequal transfers dispatched")

    def host(tree):
        return [np.asarray(leaf) for leaf in jax.tree.leaves(tree)]

    if me == 0:
        rows = dict(rollout_params=host(rollout_params), narrow_params=host(narrow_params), latents=host(latents),
                    log_probs=host(log_probs), keys=host(jax.random.key_data(sample_keys)), version=host(rollout_version))
        assert {s.device for s in jax.tree.leaves(narrow_params)[0].addressable_shards} == set(roles["rollout"][:2])
    else:
        assert all(leaf.sharding == train_batch for leaf in jax.tree.leaves(trajectories))
        assert all(leaf.sharding == narrow_train for leaf in within_train)
        within_train = (within_train[0], jax.random.key_data(within_train[1]))
        trajectories = (*trajectories[:3], jax.random.key_data(trajectories[3]))
        rows = dict(params=host(params), trajectories=host(trajectories), grads=host(grads), updated=host(updated),
                    narrow_latents=host(narrow_latents), within_train=host(within_train), sync_s=[np.float64(sync_s)])
    rows.update(memory)
    np.savez(os.path.join(out_dir, f"process{me}.npz"),
             **{f"{name}/{i}": leaf for name, leaves in rows.items() for i, leaf in enumerate(leaves)})
    stage("results written")


def load(path):
    with np.load(path) as data:
        rows = {}
        for key in sorted(data.files, key=lambda k: (k.split("/")[0], int(k.split("/")[1]))):
            rows.setdefault(key.split("/")[0], []).append(data[key])
        return rows


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """n distinct free loopback ports: all bound at once, so no two runs get the same coordinator."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def worker_env(devices: int, **extra: str) -> dict:
    """The environment of a worker process: `devices` fake CPU devices, the test process's other
    XLA flags (conftest.py's), this repository importable."""
    inherited = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "JAX_"))}
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
    return inherited | {
        "XLA_FLAGS": " ".join([*flags, f"--xla_force_host_platform_device_count={devices}"]),
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": os.pathsep.join([REPO_ROOT, os.environ.get("PYTHONPATH", "")]),
    } | extra


def compiled_env(cache_dir) -> dict:
    """A worker's persistent compilation cache in `cache_dir`, at the tests' matmul precision: the
    2-process launches of this module share one (`two_process_cache`), so the programs one
    launch compiled are loaded by the next (`cache_every_process`); so do the 1-process
    references, whose programs (8 devices of one process) are their own."""
    return dict(JAX_DEFAULT_MATMUL_PRECISION="highest", JAX_COMPILATION_CACHE_DIR=str(cache_dir),
                JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1")


class _AsProcess0:
    """JAX's distributed state as seen by the compilation cache's writer: process 0."""

    process_id = 0

    def __init__(self, state):
        self._state = state

    def __getattr__(self, name):
        return getattr(self._state, name)


def cache_every_process() -> None:
    """Let this worker process write its compiled programs to the persistent compilation cache.
    JAX writes from process 0 only, so process 1's own programs (the train role's, on its
    devices alone) would be compiled afresh by every launch and by each `loop.train` of one;
    its cache keys name its devices, so what it writes is loaded only where they are the same."""
    from jax._src import compiler

    if not hasattr(compiler, "_cache_write") or not hasattr(compiler, "distributed"):
        return  # another JAX: its launches compile as JAX has them (slower, the same programs)
    write, real = compiler._cache_write, compiler.distributed

    def write_from_any_process(*args, **kwargs):
        compiler.distributed = SimpleNamespace(global_state=_AsProcess0(real.global_state))
        try:
            write(*args, **kwargs)
        finally:
            compiler.distributed = real

    compiler._cache_write = write_from_any_process


def slurm_step_env(pid: int, port: int) -> dict:
    """A SLURM step of two one-task "nodes" on the loopback interface: initialize() finds it."""
    return {"JAX_COORDINATOR_PORT": str(port), "SLURM_JOB_ID": "4242", "SLURM_NTASKS": "2",
            "SLURM_NTASKS_PER_NODE": "1", "SLURM_PROCID": str(pid), "SLURM_LOCALID": "0",
            "SLURM_STEP_NODELIST": "127.0.0.1"}


def run_workers(*workers: tuple[tuple[str, ...], dict], timeout_s: float = WORKER_TIMEOUT_S) -> list[str]:
    """Run this file once per (args, env) at the same time; their outputs.

    Fails the test if any exits non-zero or if they outlive `timeout_s`."""
    procs = [subprocess.Popen([sys.executable, __file__, *args], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for args, env in workers]
    # A hung collective must fail the test, not hang it; a crash stops the others too.
    deadline = time.monotonic() + timeout_s
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        if any(p.poll() not in (None, 0) for p in procs):
            break
        time.sleep(0.2)
    hung = [i for i, p in enumerate(procs) if p.poll() is None]
    for i in hung:
        procs[i].kill()
    outputs = [p.communicate()[0] for p in procs]
    crashed = [i for i, p in enumerate(procs) if i not in hung and p.returncode != 0]
    failed = crashed + hung  # the cause first: the others were stopped because of it
    if failed:
        i = failed[0]
        state = "was stopped" if i in hung else f"exited with {procs[i].returncode}"
        pytest.fail(f"worker {i} {workers[i][0]} {state} ({len(failed)} of {len(procs)} failed):\n{outputs[i][-8000:]}")
    return outputs


def test_two_process_rollout_and_training(tmp_path):
    """Weights synced trainer -> rollout across processes, trajectories back, one gradient step:
    every transferred array bit-identical, numbers equal to a single-process reference; full
    fine-tuning's placements of the train state and its sync hold a few pieces beyond what the
    devices keep in host memory, never a copy of the tree."""
    port = free_port()
    run_workers(*[(("transfers", str(tmp_path)), worker_env(4, **slurm_step_env(pid, port), MALLOC_MMAP_THRESHOLD_="65536"))
                  for pid in range(2)])
    rollout, train = load(tmp_path / "process0.npz"), load(tmp_path / "process1.npz")

    # Transfers move bits, nothing else (trainer -> rollout and back, equal and unequal sizes).
    sent_trajectories = rollout["latents"] + rollout["log_probs"] + [np.asarray(make_cond().text)] + rollout["keys"]
    for got, sent in [(rollout["rollout_params"], train["params"]), (rollout["narrow_params"], train["params"]),
                      (train["trajectories"], sent_trajectories), (train["narrow_latents"], rollout["latents"]),
                      (train["within_train"], rollout["latents"] + rollout["keys"])]:
        assert len(got) == len(sent) and all(np.array_equal(a, b) for a, b in zip(got, sent))
    assert rollout["version"] == [3]

    # Host memory of full fine-tuning's placements (`measure_host_memory`; on CPU a device's buffers
    # count too): (peak, left) growth per process. The train state goes onto the train role piece
    # by piece: process 1 ends holding its shards and peaks a few pieces above them, never at a
    # second copy of the tree; process 0, holding none of the train devices, adds nothing. The
    # sync peaks a few pieces above what it leaves. Measured on 2 cores: process 1 placing 5 MiB
    # above its shards, process 0 0 MiB; with one jax.device_put of a copied state, 96 and 99 MiB.
    # (The sync's reshard reads through host memory on process 0, and on CPU it leaves more held
    # than the 4 replicas, the host copies with them: only its peak above what it leaves is compared.)
    growth = {k: [tuple(int(v) for v in r[k]) for r in (rollout, train)] for k in ("placement_growth", "sync_growth")}
    (placed_0, _), (placed_1, shards_1) = growth["placement_growth"]
    few_pieces = MEMORY_TREE_BYTES // 4
    assert placed_0 < few_pieces and shards_1 <= placed_1 < shards_1 + few_pieces, growth
    assert shards_1 >= MEMORY_TREE_BYTES * 3 // 4, growth  # the shards are there: the measure sees them
    assert all(peak - left < few_pieces for peak, left in growth["sync_growth"]), growth

    # The same computation in this process on one device.
    sampler, params = make_sampler(), make_params()
    cond, sample_keys = make_cond(), jax.random.split(jax.random.key(7), BATCH)
    latents, log_probs = rollout_ladder(sampler, params, cond, sample_keys, LATENT_SHAPE)
    grads = jax.jit(lambda p: policy_gradient(sampler, p, latents, log_probs, cond))(params)
    for got, want in zip(train["params"], jax.tree.leaves(params)):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(rollout["latents"][0], latents, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(rollout["log_probs"][0], log_probs, rtol=1e-5, atol=1e-5)
    for got, want in zip(train["grads"], jax.tree.leaves(grads)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * float(np.max(np.abs(want))))
    for got, p, g in zip(train["updated"], train["params"], train["grads"]):
        np.testing.assert_allclose(got, p - LEARNING_RATE * g, rtol=1e-6, atol=1e-7)
    assert max(float(np.max(np.abs(g))) for g in train["grads"]) > 0  # the step does move the weights


# ---------------------------------------------------------------------------- the training loop on two processes


def loop_config(cache_dir: str, mode: str):
    """The runtime tests' tiny config in `mode`: rollout on 4 devices, training on the other 4, 2 iterations."""
    from tests.test_runtime import runtime_config

    config = runtime_config(cache_dir, mode)
    config.model.arch.update(num_layers=1, num_single_layers=1)  # less to compile in each process
    config.train.iterations = 2
    # An eval every iteration, of as many prompts as a micro-batch has samples (its programs are
    # the rollout's, already compiled), with an EMA that moves at every update.
    config.train.update(eval_every=1, eval_prompts=4)
    config.rl.ema_every = 1
    return config


def watch_tracers(out_dir: str) -> None:
    """Instrument this process's tracers: each, when closed, writes
    OUT_DIR/tracer_<process>_<n>.json (n: the how-manieth of the process) with its events, its
    origin as wall time, and for every task whose outputs have shards on this process's devices
    the wall time at which a thread of this file's own saw them ready."""
    from digen_jax.runtime import trace

    record, close, closed = trace.Tracer.record, trace.Tracer.close, []
    waiters, ready = {}, {}  # per tracer: the threads, and [kind, iteration, index, wall time] rows

    def watching_record(self, task, outputs, dispatched, **args):
        record(self, task, outputs, dispatched, **args)
        if trace.EventExchange.owner(outputs) == jax.process_index():
            def wait():
                jax.block_until_ready(outputs)
                ready.setdefault(id(self), []).append([*task.key, time.time()])

            waiters.setdefault(id(self), []).append(threading.Thread(target=wait))
            waiters[id(self)][-1].start()

    def watching_close(self):
        close(self)
        for waiter in waiters.get(id(self), []):
            waiter.join()
        path = os.path.join(out_dir, f"tracer_{jax.process_index()}_{len(closed)}.json")
        closed.append(path)
        with open(path, "w") as f:
            json.dump({"origin": time.time() - self.now(), "events": self.events, "ready": ready.get(id(self), [])}, f)

    trace.Tracer.record, trace.Tracer.close = watching_record, watching_close


def run_loop_worker(workdir: str, cache_dir: str, mode: str) -> None:
    """One process of a training-loop run; the process holding the trainer saves the final weights.

    Under a SLURM step: one of the 2 processes, checkpointing every iteration; it stops after
    the first iteration, then a second `loop.train` resumes from that checkpoint for the second.
    Otherwise the 1-process reference on 8 devices, uninterrupted, with its collectives over
    gloo as in the 2-process run: a gradient's all-reduce then sums in the same order (XLA's
    in-process collectives sum in another, and Adam turns the last-bit differences of
    near-zero gradients into ~1e-5 weight differences after 2 updates).
    """
    config = loop_config(cache_dir, mode)
    if "SLURM_PROCID" in os.environ:
        assert multihost.initialize().num_processes == 2
        watch_tracers(os.path.dirname(workdir))
        jax.config.update("jax_default_matmul_precision", "highest")  # as in every test process (conftest)
        # The resumed run loads the programs the first one compiled: the test passes the module's
        # compilation cache (`compiled_env`), which every process writes (`cache_every_process`).
        assert jax.config.jax_compilation_cache_dir, "started without compiled_env"
        config.train.checkpoint_every = 1
        stopped = loop_config(cache_dir, mode)
        stopped.train.update(checkpoint_every=1, iterations=1)
        loop.train(stopped, workdir, log=stage)
    else:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(f"127.0.0.1:{os.environ['JAX_COORDINATOR_PORT']}", num_processes=1, process_id=0,
                                   cluster_detection_method="deactivate")
        jax.config.update("jax_default_matmul_precision", "highest")
    state = loop.train(config, workdir, log=stage)
    if all(leaf.is_fully_addressable for leaf in jax.tree.leaves(state.trainable)):
        leaves = jax.tree.leaves(jax.device_get(state.trainable))
        np.savez(os.path.join(workdir, "trained.npz"), *leaves, version=np.asarray(state.version))
    stage("done")


@pytest.fixture(scope="module")
def two_process_cache(tmp_path_factory):
    """The persistent compilation cache of this module's 2-process launches (`compiled_env`)."""
    return tmp_path_factory.mktemp("two_process_compiled")


@pytest.fixture(scope="module")
def pretrained_cache(tmp_path_factory):
    """The pretrained tiny model's cache, filled here once: the workers only read it."""
    cache_dir = tmp_path_factory.mktemp("pretrained")
    workload_lib.make_workload(loop_config(str(cache_dir), "disagg_sync"))
    return cache_dir


# Every mode passes this test's 2-process run, in 2-3 minutes each on 2 cores: too long for the
# suite, which runs the mode with every technique here (`test_system_bench_runs_as_two_processes`
# runs 'gap').
@pytest.mark.parametrize("mode", ["gap+tsp+tag+tcss"])
def test_two_process_training_loop_matches_one_process(tmp_path, pretrained_cache, two_process_cache, mode):
    """`loop.train` through the executor with rollout on process 0's devices and training on
    process 1's, stopped after iteration 1 and resumed from its checkpoint: the weights after 2
    iterations equal bit for bit those of the same run uninterrupted in one process on 8
    devices with the same role sizes, and so do the eval rewards (rolled out on process 0's
    devices with weights from process 1's, read by both); process 0 alone writes metrics and
    trace, and the tasks in it are timed right (`check_two_process_timing`)."""
    cache_dir, single, multi = pretrained_cache, tmp_path / "single", tmp_path / "multi"
    initial = workload_lib.make_workload(loop_config(str(cache_dir), mode)).base_params
    ports = free_ports(2)
    outputs = run_workers(
        (("loop", str(single), str(cache_dir), mode),
         worker_env(8, JAX_COORDINATOR_PORT=str(ports[0]), **compiled_env(two_process_cache))),
        *[(("loop", str(multi), str(cache_dir), mode),
           worker_env(4, **slurm_step_env(pid, ports[1]), **compiled_env(two_process_cache))) for pid in range(2)],
        timeout_s=LOOP_TIMEOUT_S,
    )
    assert "training 2 iterations" in outputs[0]
    for out in outputs[1:]:  # both processes: the first iteration, then the second from its checkpoint
        assert "training 1 iterations of 16 samples (from iteration 0)" in out
        prefetched = loop_config(str(cache_dir), mode).runtime.prefetch_microbatches
        assert f"resumed from checkpoint 1 (policy version 1, {prefetched} prefetched micro-batches)" in out
        assert "training 1 iterations of 16 samples (from iteration 1)" in out
    assert {"1", "2"} <= set(os.listdir(multi / "checkpoints"))  # every iteration checkpointed

    with np.load(single / "trained.npz") as reference, np.load(multi / "trained.npz") as trained:
        assert int(trained["version"]) == int(reference["version"]) == 2
        assert reference.files == trained.files
        assert all(np.array_equal(trained[name], reference[name]) for name in reference.files)
        moved = [reference[f"arr_{i}"] - leaf for i, leaf in enumerate(jax.tree.leaves(initial))]
    assert max(float(np.max(np.abs(d))) for d in moved) > 1e-4  # the updates did move the weights

    rows = [json.loads(line) for line in open(multi / "metrics.jsonl")]
    reference_rows = [json.loads(line) for line in open(single / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2]  # one writer
    for row, ref in zip(rows, reference_rows):
        for key in ("reward_mean", "reward_std", "grad_norm", "loss", "version"):
            assert row[key] == ref[key], key
        # The eval rolled out on process 0's devices with weights moved from process 1's.
        assert row["eval_reward_mean"] == pytest.approx(ref["eval_reward_mean"], rel=1e-6, abs=1e-7)
    for out in outputs:  # every process gets the eval reward
        assert f"eval {rows[-1]['eval_reward_mean']:.3f}" in out
    events = read_trace(str(multi / "trace.json"))
    rolled = [sid for e in events if e["args"]["kind"] == "rollout" for sid in e["args"]["sample_ids"]]
    # Every sample once (one writer, every task recorded), and the third iteration's prefetched ones.
    assert sorted(rolled) == list(range(2 * 16 + prefetched * 4))
    assert {e["args"]["kind"] for e in events} == {"rollout", "reward", "train", "update", "sync"}
    # Every micro-batch's reward once, whichever process scored it (TAG's on process 1).
    scored = sorted((e["args"]["iteration"], e["args"]["microbatch"]) for e in events if e["args"]["kind"] == "reward")
    rolled_mbs = sorted((e["args"]["iteration"], e["args"]["microbatch"]) for e in events if e["args"]["kind"] == "rollout")
    assert scored == rolled_mbs
    assert {e["args"]["process"] for e in events if e["args"]["kind"] == "reward"} == {0, 1}
    check_two_process_timing(tmp_path, multi, rows)
    # Across processes the pipeline overlaps: a later micro-batch rolls out on process 0's devices
    # while process 1's train an earlier one.
    span = lambda e: (e["ts"], e["ts"] + e["dur"])  # noqa: E731
    overlaps = [
        (t["args"]["iteration"], t["args"]["microbatch"], r["args"]["microbatch"])
        for t in events if t["args"]["kind"] == "train"
        for r in events if r["args"]["kind"] == "rollout" and r["args"]["group"] == "rollout"
        and r["args"]["iteration"] == t["args"]["iteration"] and r["args"]["microbatch"] > t["args"]["microbatch"]
        and min(span(t)[1], span(r)[1]) - max(span(t)[0], span(r)[0]) > 0
    ]
    assert overlaps, "no rollout of a later micro-batch overlapped the training of an earlier one"


DEVICE_KINDS = ("rollout", "trajectory", "train", "update", "sync")


def check_two_process_timing(out_dir, workdir, rows) -> None:
    """The tasks of the 2-process loop run are timed by the process holding their outputs
    (rollouts and the weights' arrival: process 0; trajectories' arrival, training, updates and
    the trainer's rollouts: process 1), on one clock: each event ends when its owner saw the outputs ready (as measured
    by `watch_tracers`' own threads, in wall time, read on process 0's clock); both processes
    hold the same events, all in the trace; training does not start before its micro-batch's
    rollout ended, and neither group is idle all the time."""
    traced = {(p, n): json.loads((out_dir / f"tracer_{p}_{n}.json").read_text()) for p in (0, 1) for n in (0, 1)}
    trace = read_trace(str(workdir / "trace.json"), superseded=True, kinds=DEVICE_KINDS)

    def device_events(events):
        return sorted((e["name"], e["ts"], e["dur"], e["args"]["process"])
                      for e in events if e["args"]["kind"] in DEVICE_KINDS)

    assert device_events(trace) == device_events(traced[0, 0]["events"] + traced[0, 1]["events"])
    for n in (0, 1):  # the first run, then the resumed one
        events = traced[0, n]["events"]
        assert device_events(traced[1, n]["events"]) == device_events(events)
        by_key = {(e["args"]["kind"], e["args"]["iteration"], e["args"]["microbatch"]): e for e in events}
        assert len(by_key) == len(events)
        trainer_rollouts = {"rollout"} if any(e["args"]["group"] == "train" for e in events) else set()  # TAG
        for p, kinds in ((0, {"rollout", "sync"}), (1, {"trajectory", "train", "update"} | trainer_rollouts)):
            assert {kind for kind, *_ in traced[p, n]["ready"]} == kinds
            for kind, iteration, index, ready in traced[p, n]["ready"]:
                e = by_key[kind, iteration, index]
                assert e["args"]["process"] == p
                assert abs((e["ts"] + e["dur"]) / 1e6 - (ready - traced[0, n]["origin"])) < 1.0, (e, ready)
        for (kind, iteration, index), e in by_key.items():
            if kind == "train" and ("rollout", iteration, index) in by_key:  # not restored from the checkpoint
                rollout = by_key["rollout", iteration, index]
                assert e["ts"] >= rollout["ts"] + rollout["dur"] - 1e5, (iteration, index)  # 0.1 s
    for row in rows:
        assert all(0 <= f < 1 for f in row["bubble_frac"].values()), row["bubble_frac"]


def save_with_prefetch(run, config, shift: int, out_dir) -> Executor:
    """Save checkpoint 1 of `run`: its train state plus `shift` and a micro-batch prefetched on
    the rollout role, with values that tell them apart; the process whose devices hold the whole
    state writes what was saved (state leaves, prefetched arrays) to OUT_DIR/saved.npz."""
    executor = Executor(run, log=stage)
    executor.state = jax.jit(lambda s: jax.tree.map(lambda a: a + shift, s), out_shardings=executor.state_sharding)(
        executor.state)
    prefetched = executor.microbatches_of(1)[0]
    samples = len(prefetched.sample_ids)
    latents = jnp.arange(samples * 6.0).reshape(samples, 3, 2) - 7.5 + shift
    log_probs = -jnp.arange(samples * 2.0).reshape(samples, 2) * shift
    placed = mesh_lib.put_batch((latents, log_probs), executor.meshes.rollout)
    prefetched.traj = Trajectory(latents=placed[0], log_probs=placed[1], means=placed[0],
                                 noise_levels=jnp.asarray(prefetched.noise_levels),
                                 sample_keys=prefetched.sample_keys, version=jnp.int32(shift))
    prefetched.rolled_on, prefetched.version = "rollout", shift
    prefetched.rewards = concurrent.futures.Future()
    total = np.linspace(-1.0, 1.0, samples, dtype=np.float32) * shift  # rows: the total, then each reward's
    prefetched.rewards.set_result(np.stack([total] * (1 + len(executor.reward_names))))
    executor.carried = [prefetched]
    run_checkpoints.save(executor, run.checkpoints, 1, config)
    run.checkpoints.wait_until_finished()
    if all(leaf.is_fully_addressable for leaf in jax.tree.leaves(executor.state)):
        saved = {f"state/{i}": leaf for i, leaf in enumerate(jax.tree.leaves(jax.device_get(executor.state)))}
        np.savez(os.path.join(out_dir, "saved.npz"), **saved, latents=np.asarray(latents), log_probs=np.asarray(log_probs),
                 rewards=prefetched.rewards.result(), keys=np.asarray(jax.random.key_data(prefetched.sample_keys)))
    return executor


def save_as_before(executor, workdir, config) -> None:
    """Checkpoint 1 of `executor` as one process wrote it before process layouts interchanged:
    the state and the prefetched micro-batches' host copies through orbax's StandardSave."""
    meta = {"carried": [m.index for m in executor.carried], "mode": executor.mode,
            "fingerprint": fingerprint(config), "measured": []}
    manager = run_checkpoints.open_manager(workdir, config)
    manager.save(1, args=ocp.args.Composite(state=ocp.args.StandardSave(executor.state), meta=ocp.args.JsonSave(meta),
                                            carried=ocp.args.StandardSave(executor.carried_snapshot())))
    manager.close()


def assert_restored(run, manager, saved_dir, version: int) -> None:
    """A fresh executor of `run` restores checkpoint 1 from `manager`: on the train shardings, each
    process's shards bit-equal to the saved state (a process without train devices holds none),
    and the prefetched micro-batch whole on every process."""
    resumed = Executor(run, log=stage)
    assert run_checkpoints.restore(resumed, manager) == 1
    mine = set(jax.local_devices())
    with np.load(os.path.join(saved_dir, "saved.npz")) as want:
        leaves = jax.tree.leaves(resumed.state)
        assert len(leaves) == len([k for k in want.files if k.startswith("state/")])
        for i, (leaf, sharding) in enumerate(zip(leaves, jax.tree.leaves(resumed.state_sharding))):
            assert leaf.sharding == sharding and bool(leaf.addressable_shards) == (sharding.device_set <= mine)
            assert all(np.array_equal(shard.data, want[f"state/{i}"][shard.index]) for shard in leaf.addressable_shards)
        [carried] = resumed.carried
        assert (carried.index, carried.rolled_on, carried.version) == (0, "rollout", version)
        assert np.array_equal(carried.rewards.result(), want["rewards"])
        assert np.array_equal(carried.traj.latents, want["latents"]) and np.array_equal(carried.traj.means, want["latents"])
        assert np.array_equal(carried.traj.log_probs, want["log_probs"])
        assert np.array_equal(jax.random.key_data(carried.traj.sample_keys), want["keys"])
    resumed.close()


def run_checkpoint_worker(workdir: str, cache_dir: str, single_dir: str) -> loop.Run:
    """The checkpoint test's part of a `run_placement_worker` process (train role on process 1's
    devices): restores the checkpoint one process saved in SINGLE_DIR, then saves its own (an
    updated state and a micro-batch prefetched on process 0's devices) and restores it. Asserts
    that no process gathered the state for the save (no `to_every_process` of a state leaf) and
    that each restore keeps every bit and the train shardings. The Run it restored in."""
    config = loop_config(cache_dir, "disagg_sync")
    run = loop.Run(config, workdir, log=stage)
    gathered = []

    def recording(tree, gather=transfer_lib.to_every_process):
        gathered.extend(jax.tree.leaves(tree))
        return gather(tree)

    for module in (run_checkpoints, executor_lib):
        module.to_every_process = recording
    executor = save_with_prefetch(run, config, 1, workdir)
    for module in (run_checkpoints, executor_lib):
        module.to_every_process = transfer_lib.to_every_process
    state = {id(leaf) for leaf in jax.tree.leaves(executor.state)}
    assert gathered and not any(id(leaf) in state for leaf in gathered)  # the prefetched batch's, not the state's
    executor.close()
    multihost_utils.sync_global_devices("checkpoint 1 committed")  # process 1 wrote it; process 0 reads it next

    rerun = loop.Run(config, workdir, log=stage)
    assert_restored(rerun, rerun.checkpoints, workdir, version=1)
    stage("checkpoint round trip kept every bit")
    set_aside_in_both(rerun, config, workdir, single_dir)
    # As a launch of several processes runs it: the fingerprint holds nothing of the process layout.
    launched = loop_config(cache_dir, "disagg_sync")
    launched.runtime.distributed = True
    assert run_checkpoints.resume_candidates(run_checkpoints.open_manager(single_dir, launched), launched, stage) == [1]
    for workdir in (single_dir, os.path.join(single_dir, "before")):
        assert_restored(rerun, run_checkpoints.open_manager(workdir, config), single_dir, version=2)
        stage(f"one-process checkpoint in {workdir} restored")
    return rerun


def set_aside_in_both(run, config, workdir: str, single_dir: str) -> None:
    """A copy of WORKDIR's checkpoint 1 as checkpoints 1 and 2, 2's state data replaced by the
    one-process checkpoint's (other values, same shapes): only process 1, which holds the train
    state, reads it and sees its checksums fail; both processes set it aside and resume from 1."""
    copy = f"{workdir}_corrupt"
    if jax.process_index() == 0:
        for step in ("1", "2"):
            shutil.copytree(os.path.join(workdir, "checkpoints", "1"), os.path.join(copy, "checkpoints", step))
        shutil.rmtree(os.path.join(copy, "checkpoints", "2", "state"))
        shutil.copytree(os.path.join(single_dir, "checkpoints", "1", "state"), os.path.join(copy, "checkpoints", "2", "state"))
    multihost_utils.sync_global_devices("corrupt copy made")
    executor = Executor(run, log=stage)
    manager = run_checkpoints.open_manager(copy, config)
    start, _ = run_checkpoints.restore_first_readable(executor, manager, [2, 1], config, stage)
    executor.close()
    stage(f"set aside, resumed from {start}")


def run_placement_worker(workdir: str, cache_dir: str, single_dir: str) -> None:
    """One process of the 2-process launch the checkpoint, elastic-split and frozen-base tests
    share (a process's start, JAX's distributed setup and the tiny model's Run, once): the
    checkpoint round trip in WORKDIR/multi, the elastic split on the Run it restored in, then the
    frozen base's placement in WORKDIR/frozen. Each part prints what its test reads."""
    assert multihost.initialize().num_processes == 2
    jax.config.update("jax_default_matmul_precision", "highest")
    run = run_checkpoint_worker(os.path.join(workdir, "multi"), cache_dir, single_dir)
    run_split_worker(run, workdir, cache_dir)
    run.checkpoints.close()
    run_frozen_worker(os.path.join(workdir, "frozen"), cache_dir)


@pytest.fixture(scope="module")
def placement_launch(tmp_path_factory, pretrained_cache, two_process_cache):
    """Checkpoints of one process on 8 devices (rollout on 4, training on the other 4) in
    SINGLE: one saved with a prefetched micro-batch, one as checkpoints were written before (in
    SINGLE/before); then one 2-process launch of `run_placement_worker` (training on process 1's
    devices) that restores them and runs the checkpoint, elastic-split and frozen-base parts.
    Its processes' outputs, and the one-process Run and config."""
    tmp_path = tmp_path_factory.mktemp("placement")
    config = loop_config(str(pretrained_cache), "disagg_sync")
    single = tmp_path / "single"
    run = loop.Run(config, str(single), log=stage)
    executor = save_with_prefetch(run, config, 2, single)
    save_as_before(executor, str(single / "before"), config)
    executor.close()
    run.checkpoints.close()
    port = free_port()
    outputs = run_workers(
        *[(("placement", str(tmp_path), str(pretrained_cache), str(single)),
           worker_env(4, **slurm_step_env(pid, port), **compiled_env(two_process_cache)))
          for pid in range(2)],
        timeout_s=PLACEMENT_TIMEOUT_S,
    )
    return SimpleNamespace(config=config, run=run, single=single, multi=tmp_path / "multi", outputs=outputs)


def test_two_process_checkpoint_round_trip(placement_launch):
    """Checkpoints interchange between process layouts (the same roles: rollout on 4 devices,
    training on the other 4). One process on 8 devices saves one, and one as checkpoints were
    written before; two processes (training on process 1's devices, a prefetched micro-batch
    on process 0's) restore both, then save and restore their own, which one process restores
    in turn. Process 1 alone writes the state and the micro-batches; every restore gives back
    every saved bit on the train shardings, and the micro-batch (most assertions run in the
    workers: `assert_restored`; `placement_launch` runs them)."""
    config, single, multi, outputs = (getattr(placement_launch, key) for key in ("config", "single", "multi", "outputs"))
    assert_restored(placement_launch.run, run_checkpoints.open_manager(str(single / "before"), config), single, version=2)
    for out in outputs:
        assert "resumed from checkpoint 1 (policy version 1, 1 prefetched micro-batches)" in out
        assert "checkpoint round trip kept every bit" in out
        assert f"checkpoint 2 ({multi}_corrupt/checkpoints/2) cannot be read: " in out and "set aside, resumed from 1" in out
        assert out.count("policy version 2, 1 prefetched micro-batches") == 2
        assert f"one-process checkpoint in {single / 'before'} restored" in out
    # A corrupt checkpoint in two processes (`set_aside_in_both`): set aside once, both go on from the one before.
    assert "does not read back on process 1" in outputs[0]  # process 0 holds none of the state it checks
    assert "does not match the checksum written with it" in outputs[1]  # process 1 checks the state it holds
    assert os.listdir(f"{multi}_corrupt/corrupt_checkpoints") == ["2"] and os.listdir(f"{multi}_corrupt/checkpoints") == ["1"]
    for item in ("state", "carried"):  # the train role's process wrote each array once; process 0 nothing
        written = [name for name in os.listdir(multi / "checkpoints" / "1" / item) if name.startswith("ocdbt.process_")]
        assert written == ["ocdbt.process_1"], (item, written)

    rerun = loop.Run(config, str(multi), log=stage)
    assert_restored(rerun, rerun.checkpoints, multi, version=1)
    rerun.checkpoints.close()


# Task times each process would measure: the rollout role slow (trainer-assisted rollouts pay)
# or the trainer slow (prefetching the next iteration pays).
SLOW_ROLLOUT = {("rollout", "rollout"): [1.0], ("rollout", "train"): [1.0], ("train", "train"): [0.2],
                ("update", "train"): [0.05], ("sync", "link"): [0.05]}
SLOW_TRAIN = {("rollout", "rollout"): [0.2], ("rollout", "train"): [0.2], ("train", "train"): [1.0],
              ("update", "train"): [0.05], ("sync", "link"): [0.05]}


def run_split_worker(run: loop.Run, workdir: str, cache_dir: str) -> None:
    """The elastic-split test's part of a `run_placement_worker` process, an executor of `run` in
    the full mode: each process has measured other task times; both must still plan the
    iteration alike (process 0's split), or their transfers would not pair up."""
    mode = "gap+tsp+tag+tcss"
    config = loop_config(cache_dir, mode)
    config.runtime.update(tag_microbatches=-1, prefetch_microbatches=-1)  # chosen from measured costs
    executor = Executor(run, settings=run_settings(config), trace_path=os.path.join(workdir, "split_trace.json"), log=stage)
    executor.measured = SLOW_ROLLOUT if jax.process_index() == 0 else SLOW_TRAIN
    own = plan_lib.choose_split(mode, config.runtime.micro_batches, executor.measured_costs())
    split = executor.split_for(1)
    executor.close()
    stage(f"own split {own}, planned split {split}")


def test_two_process_elastic_split_is_process_0s(placement_launch):
    """With TAG and prefetch chosen from measured costs, processes that measured different costs
    still dispatch the same plan: process 0's choice (`placement_launch` runs them)."""
    outputs = placement_launch.outputs
    assert "own split (2, 0), planned split (2, 0)" in outputs[0]
    assert "own split (0, 1), planned split (2, 0)" in outputs[1]


def test_system_bench_runs_as_two_processes(tmp_path, pretrained_cache, two_process_cache):
    """`launch/bench.py --mode=system` as each process of a 2-process run launches it (the env of
    a SLURM step, `--config.runtime.distributed=True`): both exit cleanly, process 0 alone writes
    the JSON, and it holds the mode measured over the 8 devices of both processes."""
    config_file = tmp_path / "config.py"
    config_file.write_text(
        "from tests.test_distributed import loop_config\n\n\n"
        "def get_config():\n"
        f"    c = loop_config({str(pretrained_cache)!r}, 'disagg_sync')\n"
        "    c.runtime.distributed = True\n"
        "    return c\n"
    )
    out = tmp_path / "system.json"
    port = free_port()
    args = [sys.executable, __file__, "launch", "bench.py", "--mode=system", f"--config={config_file}",
            "--modes=gap", "--warmup_iterations=0", "--iterations=1", "--matmul_size=0",
            f"--workdir={tmp_path / 'work'}", f"--out={out}"]
    env = [worker_env(4, **slurm_step_env(pid, port), **compiled_env(two_process_cache)) for pid in range(2)]
    procs = [subprocess.Popen(args, env=env[pid], cwd=REPO_ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for pid in range(2)]
    try:
        outputs = [p.communicate(timeout=LOOP_TIMEOUT_S)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], outputs[0][-4000:] + outputs[1][-4000:]
    assert f"wrote {out}" in outputs[0] and "wrote" not in outputs[1]
    result = json.loads(out.read_text())
    assert list(result["modes"]) == ["gap"] and result["num_devices"] == 8
    assert all(record["samples_per_s"] > 0 for record in result["modes"].values())


def run_frozen_worker(workdir: str, cache_dir: str) -> None:
    """The frozen-base test's part of a `run_placement_worker` process (LoRA, rollout on process
    0's devices, training on process 1's): asserts that the frozen base and decoder weights are placed from each
    process's own copy with no cross-process move, that the train role's base moved in pieces
    or in one program lands bit for bit as the rollout's own copy, and that one iteration's
    transfer figures are the bytes shapes and dtypes give."""
    config = loop_config(cache_dir, "disagg_sync")
    config.rl.update(lora_rank=2, lora_merge_for_sampling=False)
    config.train.update(eval_every=0)
    moves = []  # the bytes of every cross-process move program, on this process
    for name in ("_move_same_layout", "_move_replicated"):
        def counting(src_mesh, dst_ids, leaves, wait=True, move=getattr(transfer_lib, name)):
            moves.append(sum(x.nbytes for x in leaves))
            return move(src_mesh, dst_ids, leaves, wait)

        setattr(transfer_lib, name, counting)
    run = loop.Run(config, workdir, log=stage)
    base = [np.asarray(leaf) for leaf in jax.tree.leaves(run.workload.base_params)]  # this process's own copy
    executor = Executor(run, log=stage)
    weights = executor.weights
    assert moves == [] and run.workload.base_params is None, moves

    def local_bits_equal(tree, want) -> bool:
        """Every shard of `tree` this process holds equals its slice of the host arrays `want`."""
        return all(np.array_equal(np.asarray(shard.data), np.asarray(w)[shard.index])
                   for leaf, w in zip(jax.tree.leaves(tree), want) for shard in leaf.addressable_shards)

    mine = set(jax.local_devices())
    for role, tree in (("train", run.trainer.frozen), ("rollout", weights.frozen_on_rollout)):
        shardings = jax.tree.leaves(weights.sharding[role])
        assert all(leaf.sharding == s for leaf, s in zip(jax.tree.leaves(tree), shardings))
        assert all(bool(leaf.addressable_shards) == (leaf.sharding.device_set <= mine) for leaf in jax.tree.leaves(tree))
        assert local_bits_equal(tree, base), role
    stage("frozen base placed on both roles without a cross-process move")

    # The train role's base moved to the rollout role: in pieces of at most its largest leaf,
    # and in one program; both are, bit for bit, the rollout role's own copy.
    sizes = [leaf.nbytes for leaf in jax.tree.leaves(run.trainer.frozen)]
    default_bound = transfer_lib.TRANSFER_PIECE_BYTES
    pieced, whole, pieces = {}, {}, {}
    for bound, out in ((max(sizes), pieced), (sum(sizes), whole)):
        transfer_lib.TRANSFER_PIECE_BYTES = bound
        moves.clear()
        out["tree"] = transfer_lib.transfer(run.trainer.frozen, weights.sharding["rollout"])
        pieces[bound] = list(moves)
    transfer_lib.TRANSFER_PIECE_BYTES = default_bound
    assert len(pieces[sum(sizes)]) == 1 and len(pieces[max(sizes)]) > 1, pieces
    assert all(size <= max(sizes) for size in pieces[max(sizes)]) and sum(pieces[max(sizes)]) == sum(sizes)
    own = [np.asarray(shard.data) for leaf in jax.tree.leaves(weights.frozen_on_rollout) for shard in leaf.addressable_shards]
    for out in (pieced, whole):
        got = [np.asarray(shard.data) for leaf in jax.tree.leaves(out["tree"]) for shard in leaf.addressable_shards]
        assert len(got) == len(own) and all(np.array_equal(a, b) for a, b in zip(got, own))
    stage(f"the train role's base moved in {len(pieces[max(sizes)])} pieces and in one program: the rollout's own copy")

    # Decoder weights every process holds on the host: placed on every group from its own copy.
    decoder = {"kernel": np.arange(48, dtype=np.float32).reshape(6, 8) - 3.5, "scale": np.float32(-0.0)}
    moves.clear()
    weights.place_decoders(decoder)
    assert moves == [] and set(weights.decoders) == {"rollout", "train"}
    for group, tree in weights.decoders.items():
        assert all(leaf.sharding == mesh_lib.replicated(executor.meshes.for_group(group)) for leaf in jax.tree.leaves(tree))
        assert local_bits_equal(tree, jax.tree.leaves(decoder)), group
    stage("decoder weights placed without a cross-process move")

    plan, _ = executor.iteration(0)
    executor.drain()  # the sync after the update is dispatched: its figures belong to iteration 0
    figures = executor.timing(0, plan)
    steps, latent = config.sampling.num_steps, int(np.prod(run.latent_shape))
    per_sample = (2 * steps + 1) * latent * 4 + steps * 4 + 2 * 4  # latents and means, log-probs (fp32), a key's 2 words
    samples = config.rl.prompts_per_iteration * config.rl.group_size
    adapters = sum(leaf.nbytes for leaf in jax.tree.leaves(run.state.trainable))
    assert figures["trajectory_bytes"] == samples * per_sample and figures["trajectory_s"] > 0, figures
    assert figures["sync_bytes"] == adapters and figures["sync_s"] > 0, figures
    executor.close()
    stage(f"transfer figures: trajectories {figures['trajectory_bytes']} bytes, sync {figures['sync_bytes']} bytes")


def test_two_process_frozen_base_placed_from_own_copies(placement_launch):
    """LoRA with rollout on process 0's devices and training on process 1's: the frozen base and
    the decoder weights reach every role from each process's own copy, with no cross-process
    move, bit for bit what the train role's base moved in pieces (or in one program) gives; one
    iteration's trajectory and sync bytes are those of their shapes (asserted in the workers,
    which `placement_launch` runs)."""
    for out in placement_launch.outputs:
        assert "frozen base placed on both roles without a cross-process move" in out
        assert "pieces and in one program: the rollout's own copy" in out
        assert "decoder weights placed without a cross-process move" in out
        assert "transfer figures: trajectories" in out


# ---------------------------------------------------------------------------- a process that dies

PEER_TIMEOUT_S = 20  # the runs' runtime.peer_timeout_s: the survivor of a killed process stops within it
STALL_ENV = "DIGEN_TEST_STALL_IN"  # set for a killed run: the iteration in which process 1 stalls
RAISE_ENV = "DIGEN_TEST_RAISE_IN"  # the iteration in which process 1's training raises


def start_worker(args: tuple[str, ...], env: dict, output: str, stdin=None, niceness: int = 0) -> subprocess.Popen:
    """This file run as a worker in the background, its stdout and stderr into the file `output`
    (`niceness` added to its CPU niceness)."""
    with open(output, "w") as out:
        proc = subprocess.Popen([sys.executable, __file__, *args], env=env, stdin=stdin, stdout=out,
                                stderr=subprocess.STDOUT, text=True)
    if niceness:
        os.setpriority(os.PRIO_PROCESS, proc.pid, os.getpriority(os.PRIO_PROCESS, 0) + niceness)
    return proc


def wait_for(condition, proc: subprocess.Popen, timeout_s: float, output: str) -> None:
    """Poll `condition()` until it holds; fail if `proc` ends or `timeout_s` passes first."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if proc.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"the worker {'exited' if proc.poll() is not None else 'did not get there'}:\n"
                        f"{open(output).read()[-8000:]}")
        time.sleep(0.1)


def run_sleep_worker(peer_timeout_s: str) -> None:
    """One process that joins a 2-process run with a peer timeout, then idles until it is killed."""
    config = {"runtime": {"distributed": True, "peer_timeout_s": float(peer_timeout_s)}}
    assert multihost.initialize(distributed_settings(config)).num_processes == 2
    stage(f"process {jax.process_index()} joined")
    time.sleep(LOOP_TIMEOUT_S)


def test_a_dead_process_stops_the_others(tmp_path):
    """SIGKILL one process of an idle 2-process run: the other exits non-zero within the peer
    timeout. A non-coordinator's death ends the other with the watchdog's line naming it; process
    0's ends the others at once (JAX's coordination service lives in it)."""
    timeout_s = 6
    ports, runs = free_ports(2), []
    for victim, port in zip((1, 0), ports):
        outputs = [str(tmp_path / f"victim{victim}_process{pid}.txt") for pid in range(2)]
        procs = [start_worker(("sleep", str(timeout_s)), worker_env(1, **slurm_step_env(pid, port)), out)
                 for pid, out in enumerate(outputs)]
        runs.append((victim, procs, outputs))
    try:
        for victim, procs, outputs in runs:
            wait_for(lambda: f"process {victim} joined" in open(outputs[victim]).read(), procs[victim], WORKER_TIMEOUT_S,
                     outputs[victim])
            procs[victim].kill()
            killed = time.monotonic()
            survivor = procs[1 - victim]
            try:
                survivor.wait(timeout_s + 10)
            except subprocess.TimeoutExpired:
                pytest.fail(f"process {1 - victim} outlived process {victim} by {timeout_s + 10} s")
            stopped_s, out = time.monotonic() - killed, open(outputs[1 - victim]).read()
            assert survivor.returncode != 0 and stopped_s < timeout_s + 2, (survivor.returncode, stopped_s, out[-3000:])
            if victim == 1:
                assert survivor.returncode == 1
                assert out.rstrip().splitlines()[-1].startswith("stopped: lost process 1 of 2 (host "), out[-3000:]
    finally:
        for _, procs, _ in runs:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                proc.wait()


def run_raise_worker(peer_timeout_s: str, raiser: str) -> None:
    """One process of an idle 2-process run (`run_sleep_worker`); process `raiser` raises once
    both have joined, and nothing of this program catches it."""
    config = {"runtime": {"distributed": True, "peer_timeout_s": float(peer_timeout_s)}}
    assert multihost.initialize(distributed_settings(config)).num_processes == 2
    stage(f"process {jax.process_index()} joined")
    if jax.process_index() == int(raiser):
        raise RuntimeError(f"injected failure in process {raiser}")
    time.sleep(LOOP_TIMEOUT_S)


def test_an_exception_in_one_process_stops_the_others_in_seconds(tmp_path):
    """A program of its own whose process 1 (then, in a second run beside it, process 0) raises
    once both joined: the raiser prints its traceback and exits with status 1 without waiting in
    JAX's shutdown barrier; the other exits with status 1 within seconds, well before a silent
    process would be noticed (0.6 of runtime.peer_timeout_s=30), its last line naming the raiser
    and its error (not JAX's abort, though process 0 holds the coordination service)."""
    timeout_s, runs = 30, []
    for raiser, port in zip((1, 0), free_ports(2)):
        outputs = [str(tmp_path / f"raiser{raiser}_process{pid}.txt") for pid in range(2)]
        procs = [start_worker(("raise", str(timeout_s), str(raiser)), worker_env(1, **slurm_step_env(pid, port)), out)
                 for pid, out in enumerate(outputs)]
        runs.append((raiser, procs, outputs))
    try:
        for raiser, procs, outputs in runs:
            wait_for(lambda: "process 0 joined" in open(outputs[0]).read(), procs[0], WORKER_TIMEOUT_S, outputs[0])
            joined = time.monotonic()
            for proc in procs:
                try:
                    proc.wait(joined + 0.3 * timeout_s - time.monotonic())
                except subprocess.TimeoutExpired:
                    pytest.fail(f"a process outlived the failure of process {raiser} by {0.3 * timeout_s} s:\n"
                                f"{open(outputs[1 - raiser]).read()[-3000:]}")
            texts = [open(out).read() for out in outputs]
            other = 1 - raiser
            assert [p.returncode for p in procs] == [1, 1], texts
            assert f"RuntimeError: injected failure in process {raiser}" in texts[raiser]
            last = texts[other].rstrip().splitlines()[-1]
            assert last.startswith(f"stopped: process {raiser} of 2 (host "), texts[other][-3000:]
            assert last.endswith(f"failed: RuntimeError: injected failure in process {raiser}; rerun the same "
                                 "command on every process to resume from the last checkpoint"), last
    finally:
        for _, procs, _ in runs:
            stop(procs)


def run_train_worker(*argv: str) -> None:
    """One process of `launch/train.py argv`. With STALL_ENV set, process 1 stalls after its first
    training task of that iteration (while the checkpoint before it is written) until its stdin
    closes; with RAISE_ENV set, that task raises on process 1 instead."""
    stall_in = int(os.environ.get(STALL_ENV, -1))
    raise_in = int(os.environ.get(RAISE_ENV, -1))
    if raise_in >= 0 and os.environ["SLURM_PROCID"] == "1":
        train_first = Executor._train

        def train_or_raise(self, task, mb, acc):
            if task.iteration == raise_in:
                raise RuntimeError(f"injected failure in iteration {raise_in}")
            train_first(self, task, mb, acc)

        Executor._train = train_or_raise
    if stall_in >= 0 and os.environ["SLURM_PROCID"] == "1":
        train = Executor._train

        def train_then_stall(self, task, mb, acc):
            train(self, task, mb, acc)
            if task.iteration == stall_in:
                print("STALLED", flush=True)
                sys.stdin.read()  # returns when the test closes the pipe
                os._exit(1)

        Executor._train = train_then_stall
    run_launch_worker("train.py", *argv)


def run_launch_worker(script: str, *argv: str) -> None:
    """One process of `launch/SCRIPT argv`, as a worker of this file (`cache_every_process`)."""
    sys.argv = [os.path.join(REPO_ROOT, "launch", script), *argv]
    runpy.run_path(sys.argv[0], run_name="__main__")


TRAIN_CONFIG = """
from tests.test_distributed import loop_config


def get_config():
    config = loop_config({cache_dir!r}, "disagg_sync")
    config.train.checkpoint_every = 1
    return config
"""


def stop(procs) -> None:
    """Kill what is left of `procs` and reap them."""
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def stopped_runs(tmp_path_factory, pretrained_cache, two_process_cache):
    """The launches of the SIGKILL and error tests: `launch/train.py` with TRAIN_CONFIG on 2
    processes, first with runtime.peer_timeout_s=20 and process 1 (the trainer) SIGKILLed in
    iteration 1, after checkpoint 1 (the 1-process reference, `run_loop_worker`, uninterrupted
    beside it); then, side by side, the same command again, which resumes the killed run, and in
    a copy of the killed workdir the same command with runtime.peer_timeout_s=60, which resumes
    there too and whose process 1 raises in its training of iteration 1. The copy's run loads the
    programs the killed run compiled, and raises before its process 1 compiles a training step.
    What the tests check, as data: the processes' return codes, outputs and times."""
    tmp_path = tmp_path_factory.mktemp("stopped_runs")
    cache_dir, single, multi, errored = pretrained_cache, tmp_path / "single", tmp_path / "multi", tmp_path / "errored"
    config_file = tmp_path / "config.py"
    config_file.write_text(TRAIN_CONFIG.format(cache_dir=str(cache_dir)))

    def command(workdir, peer_timeout_s):
        return ("train", f"--config={config_file}", f"--workdir={workdir}", "--config.runtime.distributed=True",
                f"--config.runtime.peer_timeout_s={peer_timeout_s}")

    ports, compiled = free_ports(4), compiled_env(two_process_cache)
    outputs = {name: str(tmp_path / f"{name}.txt") for name in ("reference", "survivor", "victim")}
    # The reference at the lowest CPU priority: it soaks up what the 2-process runs leave idle
    # (their waits for each other and for the killed process), off their critical path.
    reference = start_worker(("loop", str(single), str(cache_dir), "disagg_sync"),
                             worker_env(8, JAX_COORDINATOR_PORT=str(ports[0]), **compiled),
                             outputs["reference"], niceness=19)
    survivor, victim = [start_worker(command(multi, PEER_TIMEOUT_S),
                                     worker_env(4, **slurm_step_env(pid, ports[1]), **compiled, **{STALL_ENV: "1"}),
                                     outputs[name], stdin=subprocess.PIPE)
                        for pid, name in enumerate(("survivor", "victim"))]
    runs, procs = SimpleNamespace(single=single, multi=multi), {}
    try:
        checkpoint = multi / "checkpoints" / "1"
        wait_for(lambda: "STALLED" in open(outputs["victim"]).read() and checkpoint.exists(), victim, LOOP_TIMEOUT_S,
                 outputs["victim"])
        victim.kill()
        killed = time.monotonic()
        try:
            survivor.wait(PEER_TIMEOUT_S + 20)
        except subprocess.TimeoutExpired:
            pytest.fail(f"process 0 outlived process 1 by {PEER_TIMEOUT_S + 20} s:\n{open(outputs['survivor']).read()[-8000:]}")
        runs.stopped_s = time.monotonic() - killed
        stage(f"process 0 stopped {runs.stopped_s:.1f} s after process 1 was killed")
        runs.checkpoint_2_before_rerun = (multi / "checkpoints" / "2").exists()
        stop((survivor, victim))
        shutil.copytree(multi, errored)

        # Side by side: the rerun of the killed run, and the copy's run whose process 1 raises.
        launches = {"resumed": (multi, PEER_TIMEOUT_S, ports[2], {}), "errored": (errored, 60, ports[3], {RAISE_ENV: "1"})}
        for name, (workdir, peer_timeout_s, port, extra) in launches.items():
            for pid in range(2):
                outputs[f"{name}{pid}"] = str(tmp_path / f"{name}{pid}.txt")
                procs[f"{name}{pid}"] = start_worker(command(workdir, peer_timeout_s),
                                                     worker_env(4, **slurm_step_env(pid, port), **compiled, **extra),
                                                     outputs[f"{name}{pid}"])
        deadline = time.monotonic() + LOOP_TIMEOUT_S
        for proc in procs.values():
            proc.wait(max(deadline - time.monotonic(), 1))
        reference.wait(LOOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pass  # the tests name what did not finish (its return code)
    finally:
        stop([survivor, victim, *procs.values(), reference])
    runs.survivor = survivor.returncode
    runs.returncodes = {name: proc.returncode for name, proc in procs.items()} | {"reference": reference.returncode}
    runs.text = {name: open(path).read() for name, path in outputs.items()}
    runs.errored_ended = [os.path.getmtime(outputs[f"errored{pid}"]) for pid in range(2)]
    return runs


def test_an_error_in_one_process_stops_the_others_at_once(stopped_runs):
    """`launch/train.py` on 2 processes with runtime.peer_timeout_s=60 (resuming a copy of the
    killed run's workdir, `stopped_runs`): process 1's training raises in iteration 1. It shows
    its traceback and exits with status 1; process 0 exits with status 1 well within the timeout
    (not through the missing heartbeats, nor JAX's shutdown barrier), its last line naming
    process 1 and its error."""
    codes, last = stopped_runs.returncodes, [stopped_runs.text["errored0"], stopped_runs.text["errored1"]]
    assert codes["errored1"] == 1 and "RuntimeError: injected failure in iteration 1" in last[1], last[1][-3000:]
    assert codes["errored0"] == 1, last[0][-3000:]
    assert last[0].rstrip().splitlines()[-1].startswith(
        "stopped: process 1 of 2 (host "), last[0][-3000:]
    assert "failed: RuntimeError: injected failure in iteration 1; rerun the same command" in last[0].splitlines()[-1]
    ended = stopped_runs.errored_ended
    assert ended[0] - ended[1] < 30  # 60 s would be the missing heartbeats' bound


def test_sigkill_of_a_process_stops_the_run_and_a_rerun_resumes(stopped_runs, pretrained_cache):
    """`launch/train.py` on 2 processes with runtime.peer_timeout_s=20: process 1 (the trainer) is
    SIGKILLed in iteration 1, after checkpoint 1; process 0 exits with status 1 within the
    timeout and a last line naming process 1. The same command then resumes both from
    checkpoint 1, and the run ends with the metrics and weights of an uninterrupted 1-process
    run (`run_loop_worker`'s reference), every sample rolled out and trained once (`stopped_runs`
    runs them)."""
    runs, mode = stopped_runs, "disagg_sync"
    single, multi, out = runs.single, runs.multi, runs.text["survivor"]
    assert runs.survivor == 1 and runs.stopped_s < PEER_TIMEOUT_S + 2, (runs.survivor, runs.stopped_s, out[-3000:])
    assert out.rstrip().splitlines()[-1].startswith("stopped: lost process 1 of 2 (host "), out[-3000:]
    assert not runs.checkpoint_2_before_rerun, "the run finished before it was killed"

    # The same command again: both processes resume from checkpoint 1 (process 0 says so).
    for name in ("resumed0", "resumed1"):
        out = runs.text[name]
        assert runs.returncodes[name] == 0, f"{name} exited with {runs.returncodes[name]}:\n{out[-8000:]}"
    assert "resumed from checkpoint 1 (policy version 1, 0 prefetched micro-batches)" in runs.text["resumed0"]
    assert "training 1 iterations of 16 samples (from iteration 1)" in runs.text["resumed0"]
    assert runs.returncodes["reference"] == 0, runs.text["reference"][-8000:]

    rows = [json.loads(line) for line in open(multi / "metrics.jsonl")]
    reference_rows = [json.loads(line) for line in open(single / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2]
    for row, ref in zip(rows, reference_rows):
        for key in ("reward_mean", "reward_std", "grad_norm", "loss", "version"):
            assert row[key] == ref[key], key
        assert row["eval_reward_mean"] == pytest.approx(ref["eval_reward_mean"], rel=1e-6, abs=1e-7)
    config = loop_config(str(pretrained_cache), mode)
    run = loop.Run(config, str(multi), log=stage)
    trained = run_checkpoints.read_state(run.checkpoints, run.state, config)
    run.checkpoints.close()
    with np.load(single / "trained.npz") as want:
        assert int(trained.version) == int(want["version"]) == 2
        leaves = jax.tree.leaves(jax.device_get(trained.trainable))
        assert len(leaves) == len(want.files) - 1
        assert all(np.array_equal(leaf, want[f"arr_{i}"]) for i, leaf in enumerate(leaves))
    # Nothing lost or done twice: the killed run's tasks past checkpoint 1 are superseded.
    events = read_trace(str(multi / "trace.json"))
    for kind in ("rollout", "train"):
        ids = [sid for e in events if e["args"]["kind"] == kind for sid in e["args"]["sample_ids"]]
        assert sorted(ids) == list(range(2 * 16)), kind


def test_two_processes_report_on_process_0_only(stopped_runs):
    """`launch/train.py` on 2 processes (the rerun that resumes the killed run, `stopped_runs`):
    process 0 prints the progress and, at the end, the summary with the next command, and writes
    metrics.png; process 1 prints none of it, and neither prints Gloo's connection lines or orbax's
    read-only warning for the manager of a process that writes no checkpoint."""
    out0, out1 = stopped_runs.text["resumed0"], stopped_runs.text["resumed1"]
    assert stopped_runs.returncodes["resumed0"] == stopped_runs.returncodes["resumed1"] == 0, out0[-3000:] + out1[-3000:]
    assert "[   2/2] reward" in out0 and "compiling the rollout, reward and training programs" in out0, out0[-3000:]
    assert "done: 2 iterations; policy version 2" in out0 and "launch/sample.py --config=" in out0, out0[-3000:]
    assert (stopped_runs.multi / "metrics.png").exists()
    for text in ("reward", "training", "done:", "loaded pretrained", "resumed from"):
        assert text not in out1, (text, out1[-3000:])
    for out in (out0, out1):
        assert "[Gloo]" not in out and "Given directory is read only" not in out, out[-3000:]


if __name__ == "__main__":
    # A hung worker prints where every thread waits before the test kills it.
    timeouts = {"transfers": WORKER_TIMEOUT_S, "placement": PLACEMENT_TIMEOUT_S}
    faulthandler.dump_traceback_later(timeouts.get(sys.argv[1], LOOP_TIMEOUT_S) - 10)
    cache_every_process()
    if sys.argv[1] == "transfers":
        run_worker(sys.argv[2])
    elif sys.argv[1] == "placement":
        run_placement_worker(*sys.argv[2:])
    elif sys.argv[1] == "sleep":
        run_sleep_worker(*sys.argv[2:])
    elif sys.argv[1] == "raise":
        run_raise_worker(*sys.argv[2:])
    elif sys.argv[1] == "train":
        run_train_worker(*sys.argv[2:])
    elif sys.argv[1] == "launch":
        run_launch_worker(*sys.argv[2:])
    else:
        run_loop_worker(*sys.argv[2:])
