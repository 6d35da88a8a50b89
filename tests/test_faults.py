"""Resume safety and faults: the run fingerprint, warm starts, unreadable checkpoints, a cut
metrics row, failed saves, full disks, the workdir lock, the resumed trace, carried task costs.

Most tests copy one finished LoRA run (two iterations, a checkpoint after each) and damage or
change it; resuming to the last checkpoint restores without training.
"""
import errno
import glob
import logging
import os
import shutil
import signal
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from digen_jax.app import loop, machine_checks, random_init, run_checkpoints, warm_start, workload
from digen_jax.app.checksums import checksums, verify
from digen_jax.app.errors import RunStopped
from digen_jax.app.fingerprint import differences, fingerprint
from digen_jax.app.workdir import WorkdirLock, disk_error
from digen_jax.rl.trainer import TrainState
from digen_jax.runtime import mesh as mesh_lib
from digen_jax.runtime.executor import Executor
from digen_jax.runtime.trace import read_trace
from tests import test_train_loop as train_loop
from tests.test_train_loop import read_metrics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def lora_config(cache_dir, **train):
    """test_train_loop's LoRA run (its compiled programs), checkpointed after each iteration."""
    return train_loop.lora_config(cache_dir, **{"checkpoint_every": 1, **train})


@pytest.fixture(scope="module")
def template(pretrain_cache_dir, tmp_path_factory):
    """A finished LoRA run with checkpoints 1 and 2: (workdir, its final trainable weights)."""
    workdir = tmp_path_factory.mktemp("lora_run") / "run"
    state = loop.train(lora_config(pretrain_cache_dir), str(workdir), log=lambda _: None)
    return workdir, jax.device_get(state.trainable)


@pytest.fixture
def copy(template, tmp_path):
    workdir = tmp_path / "run"
    shutil.copytree(template[0], workdir)
    return workdir


@pytest.fixture
def no_compute(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("the base model was built before the check")

    monkeypatch.setattr(workload, "pretrained_params", fail)


# ---------------------------------------------------------------- fingerprint, warm start
@pytest.mark.parametrize(
    "change, expected",
    [
        # Another base model (another pretraining recipe) and another alpha: adapters at 2x on the wrong base.
        (dict(lora_alpha=8.0, pretrain_steps=4), ["rl.lora_alpha: 4.0 in the checkpoint, 8.0 now", "base model: "]),
        (dict(lora_rank=4), ["rl.lora_rank: 2 in the checkpoint, 4 now", "rl.lora_alpha: 4.0 in the checkpoint, 8.0 now"]),
        (dict(lora_rank=0), ['trainable: "LoRA adapters" in the checkpoint, "all weights (full fine-tuning)" now',
                             "rl.lora_rank: 2 in the checkpoint, 0 now"]),
    ],
)
def test_resume_with_a_config_that_changes_the_state_stops_before_compute(pretrain_cache_dir, copy, no_compute, change, expected):
    c = lora_config(pretrain_cache_dir)
    c.rl.lora_alpha = change.get("lora_alpha", c.rl.lora_alpha)
    c.rl.lora_rank = change.get("lora_rank", c.rl.lora_rank)
    c.pretrain.steps = change.get("pretrain_steps", c.pretrain.steps)
    with pytest.raises(RunStopped) as info:
        loop.train(c, str(copy), log=lambda _: None)
    message = str(info.value)
    assert f"checkpoint 2 in {copy / 'checkpoints'}" in message
    for line in expected:
        assert line in message, message
    assert not any(key in message for key in ("model.family", "rl.ema", "optimizer")), message  # only what differs
    assert ("train.init_from" in message) == (change == dict(lora_alpha=8.0, pretrain_steps=4))  # only where the weights fit


def test_init_from_loads_the_trainable_weights_with_a_fresh_optimizer(pretrain_cache_dir, template, tmp_path):
    source, final = template
    # Another alpha and base are a deliberate choice here; the weights' shapes must fit.
    c = lora_config(pretrain_cache_dir, iterations=1, checkpoint_every=0, init_from=str(source))
    c.rl.lora_alpha = 8.0
    run = loop.Run(c, str(tmp_path / "direct"), log=lambda _: None)
    logs = []
    loaded = warm_start.load_init_from(*machine_checks.check_init_from(c), run.state.trainable, c, logs.append)
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(loaded), final)
    assert "loaded the trainable weights (LoRA adapters)" in logs[0] and "rl.lora_alpha: 4.0 in the checkpoint, 8.0 now" in logs[0]

    c.rl.lora_alpha = 0.0  # the template's programs
    logs = []
    loop.train(c, str(tmp_path / "warm"), log=logs.append)
    assert any("train.init_from: loaded" in line for line in logs), logs
    rows = read_metrics(tmp_path / "warm")
    assert [(r["step"], r["version"]) for r in rows] == [(1, 2)]  # iteration 0 from version 0: its two updates

    c.rl.lora_rank = 4
    with pytest.raises(RunStopped, match=r"do not fit this run's:\n  rl\.lora_rank: 2 in the checkpoint, 4 now"):
        loop.train(c, str(tmp_path / "other"), log=lambda _: None)


# ---------------------------------------------------------------- unreadable checkpoints
def _damage(step_dir, variant):
    # OCDBT keeps small arrays inline in its tree nodes and large ones in per-process data files:
    # damage every data file, so that whatever layout orbax chose, the state cannot be read.
    data = glob.glob(f"{step_dir}/state/**/d/*", recursive=True)
    if variant == "truncated data files":
        for path in data:
            with open(path, "r+b") as f:
                f.truncate(os.path.getsize(path) // 2)
        return "state"
    if variant == "garbage data files":
        for path in data:
            with open(path, "r+b") as f:
                f.write(os.urandom(os.path.getsize(path)))
        return "state"
    if variant == "missing manifest":
        os.remove(f"{step_dir}/state/manifest.ocdbt")
        return "manifest.ocdbt is missing"
    if variant == "missing meta":
        shutil.rmtree(f"{step_dir}/meta")
        return "meta"
    if variant == "empty step dir":
        shutil.rmtree(step_dir)
        os.makedirs(step_dir)
        return "the step directory is empty"
    if variant == "meta not an object":
        with open(f"{step_dir}/meta/metadata", "w") as f:
            f.write("[]")
        return "its meta item cannot be read (it holds list [], not the object a save writes)"
    if variant == "truncated meta":
        with open(f"{step_dir}/meta/metadata", "r+b") as f:
            f.truncate(os.path.getsize(f"{step_dir}/meta/metadata") // 2)
        return "its meta item cannot be read"
    if variant == "another step's data":
        # Files that read back with data other than those saved: only the checksums can tell
        # (orbax's zstd-compressed chunks decode without complaint after some flipped bytes, too).
        shutil.rmtree(f"{step_dir}/state")
        shutil.copytree(f"{os.path.dirname(step_dir)}/1/state", f"{step_dir}/state")
        return "does not match the checksum written with it"
    raise ValueError(variant)


VARIANTS = ("truncated data files", "garbage data files", "missing manifest", "missing meta", "empty step dir",
            "meta not an object", "truncated meta", "another step's data")


@pytest.mark.parametrize("variant", VARIANTS[1:])
def test_unreadable_latest_checkpoint_is_set_aside_for_the_previous_one(pretrain_cache_dir, copy, variant, caplog):
    hint = _damage(copy / "checkpoints" / "2", variant)
    logs = []
    loop.train(lora_config(pretrain_cache_dir, iterations=1), str(copy), log=logs.append)  # to checkpoint 1: no training
    report = [line for line in logs if "cannot be read" in line]
    assert len(report) == 1 and f"checkpoint 2 ({copy / 'checkpoints' / '2'}) cannot be read" in report[0], logs
    assert hint in report[0] and "resumes from the newest checkpoint that reads back" in report[0] and len(report[0]) < 800
    assert any("resumed from checkpoint 1" in line for line in logs), logs
    assert os.listdir(copy / "checkpoints") == ["1"] and os.listdir(copy / "corrupt_checkpoints") == ["2"]
    assert [r["step"] for r in read_metrics(copy)] == [1]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]  # the report above is all there is


def test_fallback_retrains_to_the_uninterrupted_weights_and_the_trace_marks_the_resume(pretrain_cache_dir, template, copy):
    """A latest checkpoint with truncated data files: the run resumes from checkpoint 1 and trains iteration 1
    again; its weights are the uninterrupted run's, and the trace says which events count."""
    _damage(copy / "checkpoints" / "2", "truncated data files")
    before = read_trace(copy / "trace.json")
    logs = []
    state = loop.train(lora_config(pretrain_cache_dir), str(copy), log=logs.append)
    assert any("checkpoint 2" in line and "cannot be read" in line for line in logs), logs
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(state.trainable), template[1])
    assert [r["step"] for r in read_metrics(copy)] == [1, 2]

    markers = read_trace(copy / "trace.json", phases=("i",))
    assert [m["args"]["resumed_from"] for m in markers] == [1]
    everything = read_trace(copy / "trace.json", superseded=True)
    superseded = [e for e in everything if e["args"].get("superseded")]
    assert superseded and {e["args"]["iteration"] for e in superseded} == {1}  # the earlier run's iteration 1
    last_before = max(e["ts"] + e["dur"] for e in before)
    after = everything[len(before):]
    assert markers[0]["ts"] >= last_before and all(e["ts"] >= markers[0]["ts"] for e in after)  # monotonic
    # What counts: every sample generated once and trained once, by the update of its iteration.
    events = read_trace(copy / "trace.json")
    for kind in ("rollout", "train"):
        ids = [sid for e in events if e["args"]["kind"] == kind for sid in e["args"]["sample_ids"]]
        assert sorted(ids) == list(range(16)), kind


def test_stop_policy_refuses_an_unreadable_checkpoint(pretrain_cache_dir, copy):
    _damage(copy / "checkpoints" / "2", "empty step dir")
    with pytest.raises(RunStopped, match=r"checkpoint 2 .* cannot be read: the step directory is empty\. Stopping"):
        loop.train(lora_config(pretrain_cache_dir, iterations=1, on_corrupt_checkpoint="stop"), str(copy), log=lambda _: None)
    assert sorted(os.listdir(copy / "checkpoints")) == ["1", "2"]  # nothing moved


def test_rows_that_are_no_metrics_row_are_moved_aside_on_resume(pretrain_cache_dir, copy):
    with open(copy / "metrics.jsonl", "a") as f:
        f.write('[]\n{"reward_mean": 1.0}\n{"step": 3, "reward_me')  # edited lines; a write cut by a kill or a full disk
    logs = []
    loop.train(lora_config(pretrain_cache_dir), str(copy), log=logs.append)
    assert [r["step"] for r in read_metrics(copy)] == [1, 2]
    assert [line for line in logs if "no metrics row" in line] == [
        f"{copy / 'metrics.jsonl'}: moved 3 row(s) that are no metrics row (a write cut short, or an edited line) to "
        f"{copy / 'metrics.dropped.jsonl'}"], logs
    with open(copy / "metrics.dropped.jsonl") as f:
        assert f.read() == '[]\n{"reward_mean": 1.0}\n{"step": 3, "reward_me\n'  # nothing lost


def test_reruns_after_every_checkpoint_is_set_aside_keep_the_history(pretrain_cache_dir, copy):
    """Every checkpoint unreadable: each rerun stops with one line and the run's files stay as
    they are; train.start_over moves them to previous_runs/1 and starts at iteration 0; then a
    rerun resumes the new run."""
    for step in ("1", "2"):
        _damage(copy / "checkpoints" / step, "truncated meta")
    before = {name: (copy / name).read_bytes() for name in ("metrics.jsonl", "trace.json")}
    config = lora_config(pretrain_cache_dir, iterations=1)
    with pytest.raises(RunStopped, match=r"no checkpoint in .* can be read .* --config\.train\.start_over=true"):
        loop.train(config, str(copy), log=lambda _: None)
    for _ in range(2):
        with pytest.raises(RunStopped) as info:
            loop.train(config, str(copy), log=lambda _: None)
        assert str(info.value).startswith(
            f"{copy} holds an earlier run's metrics.jsonl (2 rows), trace.json, corrupt_checkpoints/ (2 set aside) but "
            "no checkpoint to resume it from; to start the run over, keeping this history in "), str(info.value)
        assert {name: (copy / name).read_bytes() for name in before} == before
    config.train.start_over = True
    logs = []
    loop.train(config, str(copy), log=logs.append)
    previous = copy / "previous_runs" / "1"
    assert {name: (previous / name).read_bytes() for name in before} == before
    assert sorted(os.listdir(previous / "corrupt_checkpoints")) == ["1", "2"]
    assert any(line.startswith("train.start_over: moved checkpoints, corrupt_checkpoints, metrics.jsonl") for line in logs)
    assert [r["step"] for r in read_metrics(copy)] == [1] and os.listdir(copy / "checkpoints") == ["1"]
    config.train.start_over = False
    logs = []
    loop.train(config, str(copy), log=logs.append)  # at iteration 1 already: resumes, trains nothing
    assert any("resumed from checkpoint 1" in line for line in logs) and os.listdir(copy / "previous_runs") == ["1"]


def test_a_workdir_with_history_and_no_checkpoint_is_refused_by_the_launcher(copy):
    """A run killed before its first checkpoint (or one whose checkpoints were removed): starting
    over there would mix two runs' rows or replace them."""
    shutil.rmtree(copy / "checkpoints")
    rows = (copy / "metrics.jsonl").read_bytes()
    out = _launch("train", copy)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert out.stderr.strip().splitlines() == [
        f"stopped: {copy} holds an earlier run's metrics.jsonl (2 rows), trace.json but no checkpoint to resume it "
        f"from; to start the run over, keeping this history in {copy}/previous_runs/, rerun with "
        "--config.train.start_over=true (once), or use another --workdir."], out.stderr
    assert (copy / "metrics.jsonl").read_bytes() == rows


def test_a_resume_names_the_settings_it_changes_in_the_log_and_the_metrics(pretrain_cache_dir, copy):
    config = lora_config(pretrain_cache_dir, iterations=3)
    config.rl.learning_rate *= 33
    config.reward.weights.shapes = -1.0
    logs = []
    loop.train(config, str(copy), log=logs.append)
    noted = [line for line in logs if "changed settings" in line]
    assert noted == ["resumed with changed settings (metrics.jsonl records them as config_changes in the row of step 3): "
                     "reward.weights.shapes 1.0 -> -1.0, rl.learning_rate 0.001 -> 0.033"], logs
    rows = read_metrics(copy)
    assert [r.get("config_changes") for r in rows] == [
        None, None, {"reward.weights.shapes": [1.0, -1.0], "rl.learning_rate": [0.001, 0.033]}]


def test_iterations_below_the_checkpoint_is_one_clear_line(pretrain_cache_dir, copy):
    with pytest.raises(RunStopped, match=r"^train\.iterations=1 is below the iteration this run resumes from "
                                         r"\(checkpoint 2 in .*\): give train\.iterations=2 or more"):
        loop.train(lora_config(pretrain_cache_dir, iterations=1), str(copy), log=lambda _: None)
    assert [r["step"] for r in read_metrics(copy)] == [1, 2] and sorted(os.listdir(copy / "checkpoints")) == ["1", "2"]


# ---------------------------------------------------------------- checksums
def test_checksums_see_one_changed_word_and_agree_across_shardings():
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    x = jax.random.normal(jax.random.key(0), (16, 24))
    tree = {"f32": x, "bf16": x.astype(jax.numpy.bfloat16), "i8": (x * 10).astype(np.int8), "key": jax.random.key(3),
            "flag": x > 0}
    sums = checksums(tree)
    mesh = Mesh(np.array(jax.devices()).reshape(2, -1), ("a", "b"))
    placed = jax.tree.map(lambda a: jax.device_put(a, NamedSharding(mesh, PartitionSpec("a", "b"))) if a.ndim == 2
                          else a, tree)
    assert checksums(placed) == sums == checksums(jax.device_get(tree))
    # Offloaded leaves (`runtime.offload_optimizer`: in pinned host memory), sharded or replicated,
    # are summed on their devices one at a time, to the same values.
    offloaded = {name: a if name == "key" else jax.device_put(a, NamedSharding(
        mesh, PartitionSpec("a", "b") if a.ndim == 2 else PartitionSpec()).with_memory_kind("pinned_host"))
        for name, a in tree.items()}
    assert {a.sharding.memory_kind for name, a in offloaded.items() if name != "key"} == {"pinned_host"}
    assert checksums(offloaded) == sums
    for name in ("f32", "bf16", "i8", "flag"):
        host = np.array(tree[name])
        host.reshape(-1).view(np.uint8)[137] ^= 0x01  # one bit of one word
        assert checksums({**tree, name: host})[f"['{name}']"] != sums[f"['{name}']"], name
    swapped = np.array(x)
    swapped[[0, 1]] = swapped[[1, 0]]  # the same words in other places
    assert checksums({**tree, "f32": swapped})["['f32']"] != sums["['f32']"]
    with pytest.raises(ValueError, match=r"the data of state\['f32'\] does not match the checksum"):
        verify("state", {**tree, "f32": swapped}, sums)


def test_a_nonfinite_offloaded_moment_is_found_on_the_devices():
    """`Executor.state_is_finite` before a save: arrays in host memory (offloaded Adam moments)
    are checked on their devices one at a time, and a NaN in one is named as the optimizer state's."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
    rows = NamedSharding(mesh, PartitionSpec("data"))
    host = rows.with_memory_kind(mesh_lib.HOST_MEMORY)
    weights = {"w": jax.device_put(np.ones((4, 3), np.float32), rows)}

    def state(moment):
        moments = {"mu": jax.device_put(moment, host), "count": jax.device_put(np.int32(1), NamedSharding(
            mesh, PartitionSpec()).with_memory_kind(mesh_lib.HOST_MEMORY))}
        return TrainState(version=jnp.int32(1), trainable=weights, opt_state=moments, ema=None, nonfinite_streak=jnp.int32(0))

    assert mesh_lib.in_host_memory(state(np.zeros((4, 3), np.float32)).opt_state["mu"])
    ok = Executor.state_is_finite(types.SimpleNamespace(state=state(np.zeros((4, 3), np.float32))))
    assert ok == {"trainable weights": True, "optimizer state": True, "EMA weights": True}
    bad = np.zeros((4, 3), np.float32)
    bad[3, 1] = np.nan
    assert Executor.state_is_finite(types.SimpleNamespace(state=state(bad)))["optimizer state"] is False


# ---------------------------------------------------------------- launch/sample.py
def _launch(script, workdir, config=None):
    """launch/SCRIPT.py on `workdir` with configs/tiny.py turned into `config` (the keys the LoRA
    template sets), loading the programs this session compiled."""
    flags = [*train_loop._overrides(config), f"--config.rl.lora_rank={config.rl.lora_rank}",
             f"--config.rl.lora_merge_for_sampling={config.rl.lora_merge_for_sampling}"] if config else []
    env = {**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
           "JAX_DEFAULT_MATMUL_PRECISION": "highest", "JAX_COMPILATION_CACHE_DIR": jax.config.jax_compilation_cache_dir}
    return subprocess.run([sys.executable, f"launch/{script}.py", "--config=configs/tiny.py", f"--workdir={workdir}",
                           *flags], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def like(pretrain_cache_dir, template, tmp_path_factory):
    """The template's train state as launch/sample.py lays it out (without an executor)."""
    run = loop.Run(lora_config(pretrain_cache_dir), str(tmp_path_factory.mktemp("like")), log=lambda _: None)
    run.checkpoints.close()
    return run.state


@pytest.mark.parametrize("variant", ["truncated data files", "truncated meta", "empty step dir", "meta not an object",
                                     "another step's data"])
def test_sampling_names_an_unreadable_checkpoint_and_reads_the_one_before(pretrain_cache_dir, copy, like, variant):
    hint = _damage(copy / "checkpoints" / "2", variant)
    manager = run_checkpoints.open_manager(str(copy), None, read_only=True)
    logs = []
    state = run_checkpoints.read_state(manager, like, lora_config(pretrain_cache_dir), logs.append)
    assert int(state.version) == 2  # checkpoint 1's
    assert len(logs) == 1 and logs[0].startswith(f"checkpoint 2 ({copy / 'checkpoints' / '2'}) cannot be read: ")
    assert hint in logs[0] and logs[0].endswith("; trying the one before"), logs
    assert sorted(os.listdir(copy / "checkpoints")) == ["1", "2"]  # nothing moved: a run may be writing there
    _damage(copy / "checkpoints" / "1", "truncated meta")
    with pytest.raises(RunStopped, match=r"^no checkpoint in .* can be read \(each is named above\)$"):
        run_checkpoints.read_state(manager, like, lora_config(pretrain_cache_dir), lambda _: None)


def test_sample_script_falls_back_in_one_line_and_refuses_another_config_in_one_line(pretrain_cache_dir, copy):
    config = lora_config(pretrain_cache_dir)
    _damage(copy / "checkpoints" / "2", "truncated meta")
    out = _launch("sample", copy, config)
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr[-3000:]
    [line] = [line for line in out.stdout.splitlines() if "cannot be read" in line]
    assert line.startswith(f"checkpoint 2 ({copy / 'checkpoints' / '2'}) cannot be read: its meta item cannot be read (")
    assert line.endswith("; trying the one before"), line
    assert "policy version 2: mean reward" in out.stdout
    config.rl.lora_rank = 4
    out = _launch("sample", copy, config)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
    [line] = [line for line in out.stderr.splitlines() if line.strip() and "WARNING" not in line]
    assert line.startswith("error: checkpoint 1 in ") and "rl.lora_rank: 2 in the checkpoint, 4 now" in line, out.stderr


# ---------------------------------------------------------------- failed saves, full disk
def test_a_failed_asynchronous_save_stops_the_run(pretrain_cache_dir, tmp_path, monkeypatch, caplog):
    from orbax.checkpoint._src.path import async_path

    async def disk_full(*args, **kwargs):  # the rename that commits a checkpoint, in orbax's save thread
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "run" / "checkpoints" / "1"))

    monkeypatch.setattr(async_path, "rename", disk_full)
    with pytest.raises(RunStopped) as info:
        loop.train(lora_config(pretrain_cache_dir, iterations=3), str(tmp_path / "run"), log=lambda _: None)
    message = str(info.value)
    assert message.startswith("saving checkpoint 1 failed: the disk is full") and "rerun" in message, message
    assert len(message.splitlines()) == 1
    assert len(read_metrics(tmp_path / "run")) < 3  # it did not run on to the end
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]  # orbax's tracebacks of it are not shown


@pytest.mark.parametrize("code, words", [(errno.ENOSPC, "the disk is full"), (errno.EACCES, "permission denied")])
def test_a_full_disk_or_a_permission_error_is_one_message(pretrain_cache_dir, tmp_path, monkeypatch, code, words):
    metrics = str(tmp_path / "run" / "metrics.jsonl")

    def failing_open(path, mode="r", *args, **kwargs):
        if str(path) == metrics and "a" in mode:
            raise OSError(code, os.strerror(code), metrics)
        return open(path, mode, *args, **kwargs)

    monkeypatch.setattr(loop, "open", failing_open, raising=False)  # the loop's own writes
    with pytest.raises(RunStopped) as info:
        loop.train(lora_config(pretrain_cache_dir, iterations=1), str(tmp_path / "run"), log=lambda _: None)
    assert str(info.value).startswith(f"writing the run's outputs failed: {words} ({metrics})"), str(info.value)
    WorkdirLock(str(tmp_path / "run")).release()  # the stopped run released its workdir


# ---------------------------------------------------------------- workdir lock
_HOLD_LOCK = """
import sys
from digen_jax.app.workdir import WorkdirLock
WorkdirLock(sys.argv[1])
print("LOCKED", flush=True)
sys.stdin.read()
"""


def test_a_second_run_in_a_workdir_stops_and_a_dead_holder_does_not_block(pretrain_cache_dir, tmp_path, no_compute):
    workdir = str(tmp_path / "run")
    holder = subprocess.Popen([sys.executable, "-c", _HOLD_LOCK, workdir], cwd=ROOT, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "LOCKED"
        with pytest.raises(RunStopped, match=rf"workdir {workdir} is in use by another run \(pid {holder.pid} on "):
            loop.train(lora_config(pretrain_cache_dir), workdir, log=lambda _: None)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.communicate()
    lock = WorkdirLock(workdir)  # the killed holder's lock file is still there; its lock is not
    lock.release()


def test_launcher_prints_a_message_not_a_traceback(tmp_path):
    workdir = str(tmp_path / "run")
    lock = WorkdirLock(workdir)
    try:
        env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
        out = subprocess.run([sys.executable, "launch/train.py", "--config=configs/tiny.py", f"--workdir={workdir}"],
                             cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    finally:
        lock.release()
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert f"stopped: workdir {workdir} is in use by another run (pid {os.getpid()}" in out.stderr


# ---------------------------------------------------------------- elastic splits
def test_measured_costs_travel_with_the_checkpoint(pretrain_cache_dir, tmp_path):
    """An elastic TAG split is chosen from measured task costs: the resumed run chooses from the
    costs its checkpoint recorded, as the uninterrupted run would, not from none."""
    c = train_loop.small_config(pretrain_cache_dir)
    c.runtime.update(mode="gap+tsp+tag", micro_batches=2, rollout_devices=4, train_devices=4, tag_microbatches=-1)
    c.rl.grad_chunk_size = 4
    run = loop.Run(c, str(tmp_path), log=lambda _: None)
    first = Executor(run, log=lambda _: None)
    first.measured = {("rollout", "rollout"): [4.0, 4.2], ("train", "train"): [1.0], ("rollout", "train"): [4.0]}
    split = first.split_for(1)
    assert split[0] > 0  # rollout is slow: the trainer takes a micro-batch
    run_checkpoints.save(first, run.checkpoints, 1, c)
    run.checkpoints.wait_until_finished()
    first.close()
    resumed = Executor(run, log=lambda _: None)
    assert run_checkpoints.restore(resumed, run.checkpoints) == 1
    assert resumed.measured == first.measured and resumed.split_for(1) == split
    resumed.close()


def test_base_model_id_tells_converted_checkpoints_apart(tmp_path):
    """Two conversions of one architecture (other weights) differ; a copied checkpoint is the same base."""
    import ml_collections

    from digen_jax.models import FAMILIES, save_checkpoint

    family = FAMILIES["flux"]
    for name, seed in (("a", 1), ("b", 2)):
        save_checkpoint(str(tmp_path / name), family, family.variants["tiny"],
                        random_init.random_params(family, family.variants["tiny"], seed=seed))
    shutil.copytree(tmp_path / "a", tmp_path / "a_copy")
    ids = {name: workload.base_model_id(ml_collections.ConfigDict({"model": {"checkpoint": str(tmp_path / name)}}))
           for name in ("a", "b", "a_copy")}
    assert ids["a"]["id"] != ids["b"]["id"] and ids["a"]["id"] == ids["a_copy"]["id"]
    assert ids["a_copy"]["where"] == str(tmp_path / "a_copy")


def test_a_trace_write_that_fails_reaches_the_loop_instead_of_hanging_it(tmp_path):
    """The watcher thread that stamps a task writes its event; a full disk there must surface
    to the dispatching thread (and let `wait` return), not end the watcher with the task pending."""
    import threading

    import jax.numpy as jnp

    from digen_jax.runtime.plan import Task
    from digen_jax.runtime.trace import Tracer

    tracer = Tracer(str(tmp_path / "trace.json"))

    class FullDisk:
        def write(self, text):
            raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "trace.json"))

        def flush(self):
            pass

        def close(self):
            pass

    tracer._file = FullDisk()
    tracer.record(Task("update", "train", 0, 0, 1), jnp.ones(2), tracer.now())
    raised = []

    def wait():
        try:
            tracer.wait()
        except OSError as e:
            raised.append(e)

    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    waiter.join(30)
    assert not waiter.is_alive() and raised and raised[0].errno == errno.ENOSPC
    assert disk_error(raised[0]) == (errno.ENOSPC, str(tmp_path / "trace.json"))


# ---------------------------------------------------------------- what a resume may change
def _config_files():
    import importlib

    names = [f"configs.{n[:-3]}" for n in sorted(os.listdir(os.path.join(ROOT, "configs")))
             if n.endswith(".py") and n not in ("__init__.py", "sections.py", "schema.py")]
    names += [f"configs.paper.{n[:-3]}" for n in sorted(os.listdir(os.path.join(ROOT, "configs", "paper")))
              if n.endswith(".py") and not n.startswith("_")]
    configs = {name: importlib.import_module(name).get_config() for name in names}
    return {name: c for name, c in configs.items() if "train" in c}  # run configs (not paper/testbeds' table)


def test_every_config_key_is_refused_noted_or_free_on_resume():
    from digen_jax.app import resume_keys

    unlisted = {f"{name}: {key}" for name, config in _config_files().items()
                for key in resume_keys.leaves(config) if resume_keys.listed_prefix(key) is None}
    assert not unlisted, f"classify these keys in digen_jax/app/resume_keys.py: {sorted(unlisted)}"


def _changed(value):
    """Another value of a config leaf's type."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value * 2 + 1 if value != -1 else 0
    if isinstance(value, str):
        return value + "_other"
    if isinstance(value, tuple):
        return (*value, value[-1] if value else "x")
    raise TypeError(value)


# Values where `_changed`'s would not be valid for the key.
_ALTERNATES = {"model.remat_policy": "full", "task.label_noise": 0.5, "task.resolution": 32}
# Keys no other value of which is valid alone (another family, head width or rope split), or
# (model.random_init=False) without a checkpoint to name the base weights.
_UNCHECKED = {"model.family", "model.arch.attention_head_dim", "model.arch.axes_dims_rope", "model.random_init"}


def _with(config, key, value):
    import copy

    c = copy.deepcopy(config)
    *sections, name = key.split(".")
    section = c
    for s in sections:
        section = section[s]
    if value is None:  # a placeholder: the first type it takes
        for candidate in (True, 2.0, 1, "x"):
            try:
                section[name] = candidate
                return c
            except TypeError:
                continue
    section[name] = _ALTERNATES.get(key) or _changed(value)
    return c


@pytest.mark.parametrize("name", ["configs.tiny", "configs.flux"])
def test_a_changed_key_is_refused_or_named_as_its_class_says(name):
    """Every key of the config, changed alone: a refused key changes the fingerprint (the resume
    stops), a noted one changes it or is named by the note, a free one is never named."""
    from digen_jax.app import resume_keys

    config = _config_files()[name]
    config.rl.lora_rank = 4  # the LoRA keys shape the state only with adapters
    if name == "configs.flux":
        config.model.update(variant="tiny", random_init=True)  # base weights named without files
    base = fingerprint(config)
    saved = resume_keys.settings(config)
    unchecked = []
    for key, value in resume_keys.leaves(config).items():
        changed = _with(config, key, value)
        try:
            refused = differences(base, fingerprint(changed), carried=True) != []
        except Exception:  # noqa: BLE001 (a value this config cannot take: nothing to compare)
            unchecked.append(key)
            continue
        named = key in resume_keys.changes(saved, changed)
        kind = resume_keys.kind(key)
        assert (refused if kind == "refused" else (refused or named) if kind == "noted" else not named), (key, kind)
    assert set(unchecked) <= _UNCHECKED, unchecked
