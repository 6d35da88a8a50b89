"""The disaggregated runtime on 8 fake CPU devices: plans, mode equivalence, trace invariants, TAG, resume."""
import collections
import copy
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest

from configs import tiny
from digen_jax.app import loop, run_checkpoints
from digen_jax.app import pretrain as pretrain_lib
from digen_jax.app import workload as workload_lib
from digen_jax.app.errors import ConfigError
from digen_jax.app.validation import validate_config
from digen_jax.rl import nft as nft_lib
from digen_jax.rl.grpo_trainer import GrpoTrainer
from digen_jax.rl.trainer import is_unbuilt
from digen_jax.runtime import executor as executor_lib
from digen_jax.runtime import figures as figures_lib
from digen_jax.runtime import mesh as mesh_lib
from digen_jax.runtime import plan as plan_lib
from digen_jax.runtime import transfer as transfer_lib
from digen_jax.runtime import weight_sync
from digen_jax.runtime.executor import Executor
from digen_jax.app.settings import run_settings
from digen_jax.app.validation import validate_runtime_config
from digen_jax.runtime.trace import TRAJECTORY, read_trace

PIPELINED = ("disagg_sync", "gap", "gap+tsp", "gap+tsp+tag", "gap+tsp+tag+tcss")


# ---------------------------------------------------------------- planner (pure)
def _rollouts_and_trains(plans):
    rolled = collections.Counter((t.iteration, t.index) for p in plans for t in p.tasks if t.kind == "rollout")
    trained = collections.Counter((t.iteration, t.index) for p in plans for t in p.tasks if t.kind == "train")
    return rolled, trained


@pytest.mark.parametrize("updates", [1, 2])
@pytest.mark.parametrize("mode", plan_lib.MODES)
def test_plans_roll_out_and_train_every_microbatch_once(mode, updates):
    flags = plan_lib.mode_flags(mode)
    m_total, prefetch, tag = 4, (2 if flags.tcss else 0), (1 if flags.tag else 0)
    plans, carried = [], 0
    for k in range(3):
        plans.append(plan_lib.plan_iteration(mode, k, m_total, carried=carried, tag=tag, prefetch=prefetch,
                                             updates=updates))
        carried = prefetch
    rolled, trained = _rollouts_and_trains(plans)
    for k in range(3):
        for m in range(m_total):
            assert rolled[(k, m)] == 1 and trained[(k, m)] == 1, (k, m)
    assert all(v == 1 for v in rolled.values())
    # Dependencies always point backwards in dispatch order (the executor relies on it).
    seen = set()
    for p in plans:
        for t in p.tasks:
            assert all(d in seen or d[1] < p.iteration or d[0] in ("update", "sync") and d[1] < t.iteration + 1 for d in t.deps), t
            seen.add(t.key)
    _assert_versions_follow_the_updates(plans, updates)


def _assert_versions_follow_the_updates(plans, updates):
    """Iteration k starts at version k * updates; its u-th share of micro-batches (in index order)
    trains with version k * updates + u and ends in the update making the next version; every
    rollout of iteration k's weights, the prefetched ones of k + 1 included, uses its head's
    version, which one sync per iteration carries after the last update. So a sample's lag is u,
    plus `updates` when it was prefetched in the iteration before."""
    for p in plans:
        k, start, per_update = p.iteration, p.iteration * updates, p.microbatches // updates
        assert [(t.index, t.version) for t in p.of_kind("update")] == [(u, start + u + 1) for u in range(updates)]
        for t in p.of_kind("train"):
            u = t.index // per_update
            assert t.version == start + u
            assert t.version - t.sample_version == u + (updates if t.index < p.carried else 0), t
            if u and t.index % per_update == 0:  # a share's first training waits for the update before it
                assert ("update", k, u - 1) in t.deps, t
        assert {t.version for t in p.of_kind("rollout")} <= {start}
        syncs = p.of_kind("sync")
        if syncs:
            (sync,) = syncs
            assert sync.version == start + updates and sync.deps == (("update", k, updates - 1),)
            assert {t.iteration for t in p.of_kind("rollout") if t.group == "rollout"} <= {k, k + 1}


def test_disagg_sync_waits_for_the_whole_batch_and_gap_does_not():
    sync = plan_lib.plan_iteration("disagg_sync", 1, 3)
    gap = plan_lib.plan_iteration("gap", 1, 3)
    first_sync = sync.of_kind("train")[0]
    first_gap = gap.of_kind("train")[0]
    assert {("reward", 1, m) for m in range(3)} <= set(first_sync.deps)
    assert ("reward", 1, 1) not in first_gap.deps


def test_a_sync_follows_every_rollout_of_the_weights_it_replaces():
    """In plan order (each lane's dispatch order) the weight sync comes after every rollout on the
    rollout group, the next iteration's prefetched ones included, for every split: a prefetch
    dispatched after it would roll out with the new weights under the old version."""
    for m_total in (1, 2, 3, 4):
        for carried, tag, prefetch in [(c, t, p) for c in range(m_total + 1) for t in range(m_total - c + 1)
                                       for p in range(m_total + 1)]:
            tasks = plan_lib.plan_iteration("gap+tsp+tag+tcss", 3, m_total, carried=carried, tag=tag,
                                            prefetch=prefetch).tasks
            sync = next(i for i, t in enumerate(tasks) if t.kind == "sync")
            late = [t.key for t in tasks[sync:] if t.kind == "rollout" and t.group == "rollout"]
            assert not late, (m_total, carried, tag, prefetch, late)


def test_bad_plan_arguments():
    with pytest.raises(ValueError, match="runtime.mode"):
        plan_lib.plan_iteration("gap+tag", 0, 2)
    with pytest.raises(ValueError, match="trainer rollouts"):
        plan_lib.plan_iteration("gap", 0, 2, tag=1)
    with pytest.raises(ValueError, match="num_updates_per_batch=3 must divide runtime.micro_batches=4"):
        plan_lib.plan_iteration("gap", 0, 4, updates=3)


def _costs(rollout, train):
    return plan_lib.Costs(rollout={"rollout": rollout, "train": rollout, "shared": rollout}, reward=0.01, train=train, update=0.05, sync=0.05)


def test_tag_share_is_elastic():
    # Rollout 4x slower than training: the trainer takes micro-batches at the head.
    slow_tag, _ = plan_lib.choose_split("gap+tsp+tag", 8, _costs(rollout=4.0, train=1.0))
    # Rollout much faster than training: the trainer is the bottleneck and rolls out nothing.
    fast_tag, _ = plan_lib.choose_split("gap+tsp+tag", 8, _costs(rollout=0.1, train=1.0))
    assert slow_tag > 0 and fast_tag == 0
    # The prediction moves with the costs: TAG helps exactly when rollout is the bottleneck.
    slow = _costs(rollout=4.0, train=1.0)
    assert plan_lib.iteration_time("gap+tsp+tag", 8, slow, tag=slow_tag) < plan_lib.iteration_time("gap+tsp", 8, slow)


def test_tcss_prefetch_fills_the_training_tail():
    costs = _costs(rollout=1.0, train=1.0)
    tag, prefetch = plan_lib.choose_split("gap+tsp+tag+tcss", 4, costs)
    assert prefetch > 0
    with_tcss = plan_lib.iteration_time("gap+tsp+tag+tcss", 4, costs, tag=tag, prefetch=prefetch)
    assert with_tcss < plan_lib.iteration_time("gap+tsp+tag", 4, costs, tag=tag)
    assert plan_lib.iteration_time("gap", 4, costs) < plan_lib.iteration_time("disagg_sync", 4, costs)


def test_steady_state_waits_for_a_lagging_prefetch():
    # Rollout the bottleneck with most of the batch prefetched: its head start shrinks a little
    # every iteration, so a short horizon times iterations the trainer never waits in. The
    # steady state is the rollout group's own load: 7 micro-batches per iteration.
    costs = _costs(rollout=3.2, train=1.9)
    steady = plan_lib.steady_state("gap+tsp+tag+tcss", 8, costs, tag=1, prefetch=7)
    assert steady.iteration_s == pytest.approx(7 * 3.2)
    assert steady.iterations > 6
    short = plan_lib.schedule(
        [plan_lib.plan_iteration("gap+tsp+tag+tcss", k, 8, carried=7, tag=1, prefetch=7) for k in range(1, 7)], costs
    )
    assert short.end[("update", 5, 0)] - short.end[("update", 4, 0)] < 0.95 * steady.iteration_s
    # Balanced loads settle at once, at the trainer's load (2 rollouts + 8 trainings + update).
    tag2 = plan_lib.steady_state("gap+tsp+tag", 8, costs, tag=2)
    assert tag2.iteration_s == pytest.approx(2 * 3.2 + 8 * 1.9 + 0.05 + 0.01, rel=0.02)
    assert plan_lib.choose_split("gap+tsp+tag+tcss", 8, costs)[0] == 2


def test_steady_state_is_not_fooled_by_updates_at_the_trainers_pace():
    # The 2+2 bf16 LoRA pair's measured costs (benchmarks/results/system_qwenimage_4xh200_2_2_bf16_pair.json):
    # the rollout group has 3 3/8 micro-batches per iteration (18.05 s), the trainer 16.7 s. With 3
    # prefetched the updates come evenly at the trainer's pace for the first iterations, while the
    # rollout group eats into its head start; the steady interval is the rollout group's load.
    costs = plan_lib.Costs(rollout={"rollout": 5.348, "train": 6.016, "shared": 5.348}, reward=0.339, train=3.228,
                           update=0.007, sync=0.264)
    steady = plan_lib.steady_state("gap+tsp+tag+tcss", 4, costs, tag=5, prefetch=3, grain=8)
    assert steady.iteration_s == pytest.approx((4 - 5 / 8) * 5.348)
    early = plan_lib.schedule(
        [plan_lib.plan_iteration("gap+tsp+tag+tcss", k, 4, carried=3, tag=5, prefetch=3, grain=8) for k in range(1, 7)], costs)
    gaps = [early.end[("update", k, 0)] - early.end[("update", k - 1, 0)] for k in (4, 5, 6)]
    assert gaps == pytest.approx([gaps[0]] * 3) and gaps[0] < 0.95 * steady.iteration_s


def test_a_group_goes_on_into_the_next_iteration_without_waiting_for_the_other():
    # Dispatch threads outlive an iteration: while the rollout group still prefetches, the
    # trainer starts the next iteration on the micro-batches it carried, right after its update.
    costs = _costs(rollout=1.0, train=0.5)
    first = plan_lib.plan_iteration("gap+tsp+tag+tcss", 1, 2, carried=2, prefetch=2)
    second = plan_lib.plan_iteration("gap+tsp+tag+tcss", 2, 2, carried=2, prefetch=2)
    timeline = plan_lib.schedule([first, second], costs)
    last_rollout_of_first = max(timeline.end[t.key] for t in first.tasks if t.kind == "rollout")
    assert last_rollout_of_first > timeline.end[("update", 1, 0)] + 0.5
    assert timeline.start[("train", 2, 0)] == pytest.approx(timeline.end[("update", 1, 0)])
    # The next update waits for the sync that read the weights it replaces.
    assert timeline.start[("update", 2, 0)] >= timeline.end[("sync", 2, 0)]


# ---------------------------------------------------------------- executor on fake devices
def runtime_config(cache_dir, mode, **runtime):
    c = tiny.get_config()
    c.pretrain.steps = 3
    c.pretrain.batch_size = 8
    c.pretrain.cache_dir = str(cache_dir)
    c.sampling.num_steps = 4
    c.rl.prompts_per_iteration = 4
    c.rl.group_size = 4
    c.rl.grad_chunk_size = 4  # 4 samples x 3 trained steps = 12 units per micro-batch
    c.rl.learning_rate = 1e-3
    c.rl.std_mode = "group"
    c.rl.num_updates_per_batch = 1  # every mode makes the same single update
    c.train.iterations = 3
    c.train.eval_every = 0
    c.train.image_every = 0
    c.train.checkpoint_every = 0
    c.runtime.mode = mode
    c.runtime.micro_batches = 4
    if mode != "colocated":
        c.runtime.rollout_devices, c.runtime.train_devices = 4, 4
    c.runtime.tag_microbatches = 1 if "tag" in mode else 0
    c.runtime.prefetch_microbatches = 1 if "tcss" in mode else 0
    c.runtime.update(runtime)
    return c


@pytest.fixture(scope="module")
def cache_dir(pretrain_cache_dir):
    return pretrain_cache_dir


def run_every_mode(make_config, workdir, snapshot=lambda state: state.trainable, modes=plan_lib.MODES, run=None) -> dict:
    """Every mode of `modes` for two iterations from the same Run (same initial weights, shared
    compiled steps), its configs from `make_config(mode)`; `snapshot(state)` after the first
    iteration, and for every rollout as it runs (task key, the group its micro-batch was planned
    on, the group running it). `run`: that Run, where one of `make_config`'s is built already
    (its executors take their runtime and update settings from their own configs)."""
    run = run or loop.Run(make_config("colocated"), str(workdir), log=lambda _: None)
    out = {"run": run, "initial": jax.device_get(run.state.trainable)}
    for mode in modes:
        trace_path = os.path.join(workdir, mode.replace("+", "_") + ".json")
        executor = Executor(run, settings=run_settings(make_config(mode)), trace_path=trace_path, log=lambda _: None)
        rollouts, rollout = [], executor._rollout

        def recorded(task, mb, rollouts=rollouts, rollout=rollout):
            rollouts.append((task.key, mb.rolled_on, task.group))
            rollout(task, mb)

        executor._rollout = recorded
        plans, metrics, after_first = [], [], None
        for k in range(ITERATIONS):
            plan, m = executor.iteration(k)
            plans.append(plan)
            metrics.append(m)
            if k == 0:
                after_first = jax.device_get(snapshot(executor.state))
        timings = [executor.timing(k, p) for k, p in enumerate(plans)]
        executor.close()
        out[mode] = dict(executor=executor, after_first=after_first, metrics=metrics, timings=timings,
                         trace=read_trace(trace_path), trace_path=trace_path, rollouts=rollouts)
    return out


@pytest.fixture(scope="module")
def runs(cache_dir, compile_cache, tmp_path_factory):
    return run_every_mode(lambda mode: runtime_config(cache_dir, mode), tmp_path_factory.mktemp("runtime"))


ITERATIONS = 2


def _max_diff(a, b):
    return max(float(np.max(np.abs(x - y))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_pipelined_modes_make_the_same_update_as_disagg_sync(runs):
    reference = runs["disagg_sync"]["after_first"]
    moved = _max_diff(reference, runs["initial"])
    assert moved > 1e-5  # the update did something
    for mode in ("colocated", "gap", "gap+tsp", "gap+tsp+tag"):  # tag: the same samples, rolled out elsewhere
        assert _max_diff(runs[mode]["after_first"], reference) < 1e-5 * max(moved, 1.0), mode


@pytest.mark.parametrize("mode", plan_lib.MODES)
def test_offloaded_optimizer_state_gives_the_same_numbers(runs, cache_dir, tmp_path, mode):
    """Full fine-tuning with FSDP train rules and `runtime.offload_optimizer`: the Adam moments
    live in pinned host memory between updates, sharded like their weights, and every mode's
    weights and optimizer state after two iterations are bit-equal to keeping them on the
    devices (the same `Run`, so the same initial weights and compiled steps). The executor
    starts from the initial state a run on an accelerator holds (`Trainer.unbuilt_state`: the
    weights in host memory, the moments made where they are placed)."""
    config = runtime_config(cache_dir, mode, offload_optimizer=True)
    assert config.rl.lora_rank == 0 and mesh_lib.shards_weights(config.sharding.train_rules)
    run = runs["run"]
    initial = run.state
    run.state = run.trainer.unbuilt_state(initial.trainable)
    assert is_unbuilt(run.state) and not is_unbuilt(initial)
    try:
        executor = Executor(run, settings=run_settings(config), trace_path=str(tmp_path / "trace.json"), log=lambda _: None)
    finally:
        run.state = initial
    for k in range(ITERATIONS):
        executor.iteration(k)
    if mode == "colocated":  # a checkpoint of the offloaded state reads back into a fresh executor, bit-equal
        manager = run_checkpoints.open_manager(str(tmp_path), config)
        run_checkpoints.save(executor, manager, ITERATIONS, config)
        manager.wait_until_finished()
        resumed = Executor(run, settings=run_settings(config), trace_path=str(tmp_path / "resumed.json"), log=lambda _: None)
        assert run_checkpoints.restore(resumed, manager) == ITERATIONS
        resumed.close()
        manager.close()
        assert {a.sharding.memory_kind for a in jax.tree.leaves(resumed.state.opt_state)} == {mesh_lib.HOST_MEMORY}
        for a, b in zip(jax.tree.leaves(jax.device_get(resumed.state)), jax.tree.leaves(jax.device_get(executor.state))):
            np.testing.assert_array_equal(a, b)
    executor.close()
    moments = [a for a in jax.tree.leaves(executor.state.opt_state) if a.ndim]
    assert moments and {a.sharding.memory_kind for a in jax.tree.leaves(executor.state.opt_state)} == {mesh_lib.HOST_MEMORY}
    weights = jax.tree.leaves(executor.state.trainable)
    assert [a.sharding.spec for a in moments] == [w.sharding.spec for w in weights] * 2  # mu, nu: like the weights
    assert {a.sharding.memory_kind for a in jax.tree.leaves(executor.state.trainable)} == {"device"}
    on_device = runs[mode]["executor"].state
    got, want = jax.device_get((executor.state.trainable, executor.state.opt_state)), \
        jax.device_get((on_device.trainable, on_device.opt_state))
    assert _max_diff(got[0], runs["initial"]) > 0
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)))


@pytest.fixture(scope="module")
def colocated_fsdp(runs, cache_dir, tmp_path_factory):
    """Colocated full fine-tuning with FSDP train rules on 4 devices, from the `runs` fixture's Run,
    two iterations each with `runtime.colocated_sampling` 'sharded' and 'gathered'. Per setting:
    the final state, whether the executor gathers, whether the gathered copy was released after
    each iteration, and for every rollout call (its weights' first leaf's id, whether they were
    all replicated, whether it ran with no mesh context). Of the 'sharded' run also the sampler
    step and gradient programs as compiled at their first call, and its state shardings."""
    run, workdir = runs["run"], tmp_path_factory.mktemp("colocated_fsdp")
    rollout, seen, compiled = run.trainer.rollout, [], {}

    def spy(params, *args):
        leaves = jax.tree.leaves(params)
        seen.append((id(leaves[0]), all(a.sharding.is_fully_replicated for a in leaves),
                     jax.sharding.get_abstract_mesh().empty))
        return rollout(params, *args)

    def compiling(name, fn):
        def call(*args):
            if name not in compiled:
                compiled[name] = fn.lower(*args).compile()
            return fn(*args)
        return call

    out = {"colocated_sampling": run.colocated_sampling}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(run.trainer, "rollout", spy)
        for sampling in ("sharded", "gathered"):
            config = runtime_config(cache_dir, "colocated", colocated_sampling=sampling, train_devices=4)
            if sampling == "sharded":
                patch.setattr(run.trainer.sampler, "step", compiling("step", run.trainer.sampler.step))
            executor = Executor(run, settings=run_settings(config), trace_path=str(workdir / f"{sampling}.json"), log=lambda _: None)
            if sampling == "sharded":  # the executor pins the gradient program's shardings: wrap it after
                patch.setattr(run.trainer, "_grad", compiling("grad", run.trainer._grad))
            seen.clear()
            released = []
            for k in range(ITERATIONS):
                executor.iteration(k)
                executor.drain()
                released.append(executor.weights._gathered is None)
            executor.close()
            out[sampling] = dict(config=config, state=executor.state, state_sharding=executor.state_sharding,
                                 gathered=executor.weights.gathered, released=released, calls=list(seen))
    out["compiled"] = compiled
    return out


def test_gathered_colocated_sampling_gives_the_same_numbers(runs, colocated_fsdp):
    """Colocated full fine-tuning with FSDP train rules on 4 devices. `runtime.colocated_sampling=
    'gathered'`: each iteration's rollouts sample from one copy of the weights placed by the
    rollout rules (replicated), their programs traced under those rules (no mesh context, as the
    rollout role's), and the copy is dropped before training. 'sharded' (what 'auto' is on CPU
    devices) samples from the train state's sharded weights under the train rules. The weights
    and optimizer state after two iterations are bit-equal (`colocated_fsdp` runs both)."""
    assert colocated_fsdp["colocated_sampling"] == "sharded"
    for sampling in ("sharded", "gathered"):
        assert colocated_fsdp[sampling]["gathered"] == (sampling == "gathered")
        assert colocated_fsdp[sampling]["released"] == [True] * ITERATIONS  # released before training
    calls = {s: colocated_fsdp[s]["calls"] for s in ("sharded", "gathered")}
    per_iteration = colocated_fsdp["gathered"]["config"].runtime.micro_batches
    assert len(calls["gathered"]) == len(calls["sharded"]) == ITERATIONS * per_iteration
    assert all(replicated and no_mesh for _, replicated, no_mesh in calls["gathered"])
    assert not any(replicated or no_mesh for _, replicated, no_mesh in calls["sharded"])
    copies = [{c for c, _, _ in calls["gathered"][i:i + per_iteration]} for i in range(0, ITERATIONS * per_iteration, per_iteration)]
    assert [len(c) for c in copies] == [1] * ITERATIONS  # one copy per iteration
    states = {s: colocated_fsdp[s]["state"] for s in ("sharded", "gathered")}
    got, want = (jax.device_get((states[s].trainable, states[s].opt_state)) for s in ("gathered", "sharded"))
    assert _max_diff(got[0], runs["initial"]) > 0
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want))), \
        _max_diff(got, want)


def test_grpo_guard_trains_in_colocated_and_disaggregated_modes(runs, cache_dir, tmp_path):
    """`rl.policy_loss='grpo_guard'` through both ways of cutting gradient micro-batches: colocated
    (units of several steps in one micro-batch) and gap (one trained step per micro-batch). Its
    normalisation is per trained step, so on-policy both make the same first update; that update,
    and its gradient norm, are not PPO's from the same weights and samples."""
    def guard_config(mode):
        c = runtime_config(cache_dir, mode)
        c.rl.policy_loss = "grpo_guard"
        return c

    # The `runs` fixture's Run (its rollout programs) with the trainer a Run of guard_config builds.
    run, ppo_trainer = runs["run"], runs["run"].trainer
    assert _max_diff(jax.device_get(run.state.trainable), runs["initial"]) == 0
    run.trainer = GrpoTrainer(run.sampler, ppo_trainer.frozen, ppo_trainer.optimizer,
                              dataclasses.replace(ppo_trainer.cfg, policy_loss="grpo_guard"))
    after, metrics = {}, {}
    try:
        for mode in ("colocated", "gap"):
            executor = Executor(run, settings=run_settings(guard_config(mode)), trace_path=str(tmp_path / f"{mode}.json"), log=lambda _: None)
            _, m = executor.iteration(0)
            after[mode], metrics[mode] = jax.device_get((executor.state.trainable, m))
            executor.close()
    finally:
        run.trainer = ppo_trainer
    ppo = runs["colocated"]
    ppo_grad_norm = float(ppo["metrics"][0]["grad_norm"])
    for mode, m in metrics.items():
        assert np.isfinite(float(m["loss"])) and "ratio_mean_bias" in m, mode
        assert float(m["ratio_mean"]) == pytest.approx(1.0, abs=1e-6) and float(m["clip_frac"]) == 0.0, mode
        assert abs(float(m["grad_norm"]) - ppo_grad_norm) > 0.1 * ppo_grad_norm, (mode, float(m["grad_norm"]), ppo_grad_norm)
    # Adam's first step is about lr * sign(gradient), so the updates differ by about 2 lr wherever
    # the gradients' signs do: between the two losses, not between the two ways of cutting.
    moved = _max_diff(after["colocated"], runs["initial"])
    from_ppo = _max_diff(after["colocated"], ppo["after_first"])
    assert from_ppo > 0.5 * moved
    assert _max_diff(after["gap"], after["colocated"]) < 0.05 * from_ppo


@pytest.mark.parametrize("mode", plan_lib.MODES)
def test_trace_shows_every_sample_trained_once_at_bounded_staleness(runs, mode):
    _assert_every_sample_trained_once_at_bounded_staleness(runs[mode], mode)


def _assert_every_sample_trained_once_at_bounded_staleness(result, mode):
    """The trace's invariants: every sample generated once and trained once, each training task's
    samples of one version, share u of iteration k's micro-batches trained with version
    k * U + u (U updates per iteration) and a lag of u, plus U for a micro-batch prefetched in
    the iteration before (TCSS only); the timings' staleness figures and the metrics' versions
    agree."""
    executor, events, timings = result["executor"], result["trace"], result["timings"]
    updates = executor.settings.num_updates_per_batch
    per_update = executor.microbatches // updates
    batch = 16
    rollouts = [e for e in events if e["args"]["kind"] == "rollout"]
    trains = [e for e in events if e["args"]["kind"] == "train"]
    generated_by = {}
    for e in rollouts:
        for sid in e["args"]["sample_ids"]:
            assert sid not in generated_by, f"sample {sid} generated twice"
            generated_by[sid] = e["args"]["version"]
    trained = collections.Counter(sid for e in trains for sid in e["args"]["sample_ids"])
    assert sorted(trained) == list(range(ITERATIONS * batch))  # nothing lost
    assert set(trained.values()) == {1}  # nothing doubled
    for e in trains:
        args = e["args"]
        versions = {generated_by[sid] for sid in args["sample_ids"]}
        assert versions == {args["sample_version"]}  # one version per trajectory batch
        k, u = args["iteration"], args["microbatch"] // per_update
        assert args["version"] == k * updates + u
        prefetched = args["sample_version"] < k * updates
        assert not prefetched or "tcss" in mode and executor.settings.runtime.staleness >= 1
        assert args["version"] - args["sample_version"] == u + (updates if prefetched else 0), args
    groups = {e["args"]["group"] for e in rollouts}
    assert groups == ({"shared"} if mode == "colocated" else {"rollout", "train"} if "tag" in mode else {"rollout"})
    bound = updates - 1 + (updates if "tcss" in mode else 0)
    for t in timings:
        assert t["samples_per_s"] > 0 and all(0 <= f <= 1 for f in t["bubble_frac"].values())
        assert t["staleness_max"] <= bound
    if "tcss" in mode:
        assert timings[1]["staleness_max"] == updates  # iteration 1 trained a micro-batch prefetched with version 0
    assert [int(m["version"]) for m in result["metrics"]] == [updates * (k + 1) for k in range(ITERATIONS)]


# Several updates per iteration: the modes at both ends, between them every way an update's share
# reaches the trainer (all at once; pipelined, with trainer rollouts and a prefetch carried in).
MULTI_UPDATE_MODES = (plan_lib.COLOCATED, plan_lib.BEST_MODE)


@pytest.fixture(scope="module")
def multi_update_runs(runs, cache_dir, compile_cache, tmp_path_factory):
    """`runs` with `rl.num_updates_per_batch=2`: each iteration's 4 micro-batches make two updates
    (executors of the `runs` fixture's Run: the number of updates is the executor's setting)."""
    def config(mode):
        c = runtime_config(cache_dir, mode)
        c.rl.num_updates_per_batch = 2
        return c

    return run_every_mode(config, tmp_path_factory.mktemp("runtime_updates"), modes=MULTI_UPDATE_MODES, run=runs["run"])


@pytest.mark.parametrize("mode", MULTI_UPDATE_MODES)
def test_several_updates_per_iteration_train_every_sample_once_at_their_share_s_staleness(multi_update_runs, mode):
    """Two updates per iteration: the trace invariants with each share's lag; one metrics row per
    iteration whose version advanced by two, its staleness histogram per trained sample (the
    second share one version old; TCSS's prefetched micro-batch two, in share 0), the lag-0
    units those of the first share's own samples only, and the rollout role holding the last
    version."""
    result = multi_update_runs[mode]
    _assert_every_sample_trained_once_at_bounded_staleness(result, mode)
    prefetched = result["executor"].settings.runtime.prefetch_microbatches if "tcss" in mode else 0
    for k, (m, t) in enumerate(zip(jax.device_get(result["metrics"]), result["timings"])):
        stale = 4 * prefetched if k else 0  # samples of the micro-batches carried into iteration k
        want = {"0": 8 - stale, "1": 8, "2": stale}
        assert t["staleness_hist"] == {lag: n for lag, n in want.items() if n}, (k, t["staleness_hist"])
        assert int(m["lag0_units"]) == (8 - stale) * 3 and np.isfinite(m["loss"]), k
        assert int(m["skipped"]) == 0
    executor = result["executor"]
    assert int(executor.state.version) == 2 * ITERATIONS
    if mode != plan_lib.COLOCATED:
        assert executor.weights.rollout_version == 2 * ITERATIONS


def test_several_updates_per_iteration_are_the_same_in_pipelined_and_colocated_modes(multi_update_runs):
    """The first iteration's two updates (the second on samples one version old, anchored on the
    log-probs their rollout recorded) move the weights the same in the full mode as colocated:
    the shares, versions and anchors are the schedule's, whichever group rolled a sample out."""
    reference = multi_update_runs[plan_lib.COLOCATED]["after_first"]
    moved = _max_diff(reference, multi_update_runs["initial"])
    assert moved > 1e-5
    assert _max_diff(multi_update_runs[plan_lib.BEST_MODE]["after_first"], reference) < 1e-5 * max(moved, 1.0)


def test_a_resumed_run_with_several_updates_per_iteration_continues_bit_equal(multi_update_runs, tmp_path):
    """The full mode with two updates per iteration, resumed after iteration 0 by a fresh executor
    from host copies of its state and prefetched micro-batch (what a checkpoint holds): iteration
    1 rolls out only what was not carried, and its updates equal the uninterrupted run's bit for bit."""
    reference = multi_update_runs[plan_lib.BEST_MODE]
    settings, run = reference["executor"].settings, multi_update_runs["run"]
    first = Executor(run, settings=settings, trace_path=str(tmp_path / "first.json"), log=lambda _: None)
    first.iteration(0)
    first.drain()
    state, carried = jax.device_get(first.state), first.carried_snapshot()
    first.close()
    assert list(carried) == ["0"] and int(carried["0"]["version"]) == 0
    resumed = Executor(run, settings=settings, trace_path=str(tmp_path / "resumed.json"), log=lambda _: None)
    resumed.resume(1, jax.device_put(state, resumed.state_sharding), carried, [])
    _, metrics = resumed.iteration(1)
    resumed.close()
    assert float(metrics["loss"]) == float(reference["metrics"][1]["loss"])
    assert int(metrics["version"]) == 4
    for a, b in zip(jax.tree.leaves(jax.device_get(resumed.state.trainable)),
                    jax.tree.leaves(jax.device_get(reference["executor"].state.trainable))):
        np.testing.assert_array_equal(a, b)
    events = read_trace(tmp_path / "resumed.json")
    assert sorted(e["args"]["microbatch"] for e in events if e["args"]["kind"] == "rollout"
                  and e["args"]["iteration"] == 1) == [1, 2, 3]


def nft_config(cache_dir, mode):
    """`runtime_config` with DiffusionNFT: 2 of the 4 levels trained per sample, 2 samples' units
    (4) per gradient micro-batch: the size of a level of a micro-batch's 4 samples, gap's grain, so
    every disaggregated mode runs one compiled gradient program."""
    c = runtime_config(cache_dir, mode)
    c.rl.update(algorithm="nft", nft_timesteps=2, grad_chunk_size=4)
    return c


@pytest.fixture(scope="module")
def nft_runs(cache_dir, compile_cache, tmp_path_factory):
    """Every mode for two iterations of DiffusionNFT from one Run, like `runs` (after the first
    update: the trained weights and the old policy)."""
    return run_every_mode(lambda mode: nft_config(cache_dir, mode), tmp_path_factory.mktemp("runtime_nft"),
                          snapshot=lambda state: (state.trainable, state.old))


@pytest.mark.parametrize("mode", plan_lib.MODES)
def test_nft_trains_every_sample_once_at_bounded_staleness_and_moves_only_final_latents(nft_runs, mode):
    """DiffusionNFT in every mode: the trace invariants GRPO's runs hold; each micro-batch that
    crossed to the trainer moved only its samples' final latents (fp32) and keys; the rollout
    role samples with the old policy (the synced tree is the state's `old`, not its trained
    weights)."""
    result = nft_runs[mode]
    _assert_every_sample_trained_once_at_bounded_staleness(result, mode)
    events, timings = result["trace"], result["timings"]
    per_sample = int(np.prod(nft_runs["run"].latent_shape)) * 4 + 2 * 4
    rolled_on = {(e["args"]["iteration"], e["args"]["microbatch"]): e["args"]["group"]
                 for e in events if e["args"]["kind"] == "rollout"}
    for k, t in enumerate(timings):
        crossed = sum(len(e["args"]["sample_ids"]) for e in events if e["args"]["kind"] == "train"
                      and e["args"]["iteration"] == k and rolled_on[(k, e["args"]["microbatch"])] == "rollout")
        assert t["trajectory_bytes"] == crossed * per_sample, (k, t)
    for m in jax.device_get(result["metrics"]):
        assert np.isfinite(m["loss"]) and "lag0_units" not in m and 0 < m["nft_rho_mean"] < 1
    executor = result["executor"]
    if mode != plan_lib.COLOCATED:
        assert executor.weights.rollout_version == int(executor.state.version) == ITERATIONS
        synced, old, trained = jax.device_get((executor.weights.rollout_params, executor.state.old,
                                               executor.state.trainable))
        assert _max_diff(synced, old) == 0 and _max_diff(synced, trained) > 0


def test_nft_modes_make_the_same_first_update_and_move_the_old_policy_by_its_decay(nft_runs):
    """One update from the same samples whichever way the units were cut (colocated and TSP: 4
    units of several samples and levels per gradient micro-batch; gap: one level of every
    sample), and the old policy after it is lam old + (1 - lam) theta with the 'ramp' schedule's
    lam(1) = 0.001.
    Adam's first step is lr g / (|g| + eps) per weight: where |g| is near eps, the rounding of
    gradients summed in another order (one device colocated, four sharded otherwise) shows at a
    few percent of the step, far below the 2 lr of a gradient whose sign differs."""
    reference, old = nft_runs["disagg_sync"]["after_first"]
    moved = _max_diff(reference, nft_runs["initial"])
    assert moved > 1e-5
    for mode in ("colocated", "gap", "gap+tsp", "gap+tsp+tag"):
        assert _max_diff(nft_runs[mode]["after_first"][0], reference) < 0.05 * moved, mode
    lam = nft_lib.old_policy_decay(1, "ramp")
    expected = jax.tree.map(lambda a, b: lam * a + (1 - lam) * b, nft_runs["initial"], reference)
    assert _max_diff(old, expected) < 1e-6 * max(moved, 1.0)


@pytest.mark.parametrize("mode", plan_lib.MODES)
def test_lag0_units_are_anchored_on_the_trainers_first_pass(runs, mode):
    """Every mode: units generated by the weights being trained have a log-ratio of exactly 0
    before the update; a TCSS iteration's prefetched (stale) micro-batch is not counted."""
    units_per_iteration = 16 * 3  # 16 samples x 3 trained steps
    for k, m in enumerate(jax.device_get(runs[mode]["metrics"])):
        stale = 4 * 3 if "tcss" in mode and k > 0 else 0  # one prefetched micro-batch of 4 samples
        assert int(m["lag0_units"]) == units_per_iteration - stale, (k, m["lag0_units"])
        assert m["logp_diff_max"] == 0 and m["logp_diff_mean"] == 0
        assert 0 <= m["rollout_logp_gap_max"] < 1e-5  # fp32: the rollout's log-probs to rounding


def test_a_rollout_s_group_is_known_when_planned(runs):
    """Every micro-batch's group is set when its rollout is planned, before the rollout runs: the
    next plan reads it to place trajectory moves (`_crossings`), and the prefetched rollouts of
    iteration k + 1 may not have run when it is made. The `runs` fixture's full mode, whose
    rollouts it records as they run."""
    result = runs["gap+tsp+tag+tcss"]
    seen = result["rollouts"]
    assert len(seen) >= ITERATIONS * result["executor"].microbatches  # and the prefetched rollout of iteration 2
    assert all(planned == group for _, planned, group in seen), seen
    assert {group for *_, group in seen} == {"rollout", "train"}


@pytest.mark.parametrize("mode", plan_lib.MODES)
def test_transfer_metrics_are_the_bytes_that_crossed(runs, mode):
    """Per iteration: the bytes of the weight sync carrying its update (here full fine-tuning: the
    whole trainable tree) and of the trajectories it trained that crossed from the rollout role
    to the trainer (not the trainer's own rollouts; nothing when colocated), as shapes and
    dtypes give them, with their times; each move is an event on the trace's link track, whose
    events never overlap, and `read_trace` returns the moves only when asked."""
    result = runs[mode]
    events, timings, colocated = result["trace"], result["timings"], mode == plan_lib.COLOCATED
    steps, latent = result["executor"].settings.num_steps, int(np.prod(runs["run"].latent_shape))
    # A sample's latents (steps + 1) and means (steps), fp32; its fp32 log-probs; its key's two uint32 words.
    per_sample = (2 * steps + 1) * latent * 4 + steps * 4 + 2 * 4
    trainable = sum(leaf.nbytes for leaf in jax.tree.leaves(runs["initial"]))
    rolled_on = {(e["args"]["iteration"], e["args"]["microbatch"]): e["args"]["group"]
                 for e in events if e["args"]["kind"] == "rollout"}
    moves = read_trace(result["trace_path"], kinds=(TRAJECTORY,))
    assert not [e for e in events if e["args"]["kind"] == TRAJECTORY]
    assert all(e["args"]["group"] == "link" for e in moves) and len({e["tid"] for e in moves}) <= 1
    for k, t in enumerate(timings):
        trained = {e["args"]["microbatch"]: len(e["args"]["sample_ids"]) for e in events
                   if e["args"]["kind"] == "train" and e["args"]["iteration"] == k}
        crossed = {m: n for m, n in trained.items() if rolled_on[(k, m)] == "rollout"}
        assert t["trajectory_bytes"] == sum(crossed.values()) * per_sample, (k, t)
        assert bool(crossed) != colocated
        assert (t["trajectory_s"] > 0) == bool(crossed)
        # The last iteration's too, its figures read before its sync was dispatched.
        assert t["sync_bytes"] == (0 if colocated else trainable) and (t["sync_s"] > 0) != colocated
        mine = [e for e in moves if e["args"]["iteration"] == k]
        assert sorted(e["args"]["microbatch"] for e in mine) == sorted(crossed)
        assert sum(e["args"]["bytes"] for e in mine) == t["trajectory_bytes"]
        if "tag" in mode:  # the trainer's own rollouts were trained without a move
            assert set(crossed) < set(trained)
    if colocated:
        assert not moves and all(t["trajectory_bytes"] == t["trajectory_s"] == 0 for t in timings)
    link = sorted((e for e in result["executor"].tracer.events if e["args"]["group"] == "link"), key=lambda e: e["ts"])
    assert {e["args"]["kind"] for e in link} == (set() if colocated else {"sync", TRAJECTORY})
    for before, after in zip(link, link[1:]):
        assert after["ts"] >= before["ts"] + before["dur"] - 0.01  # microseconds, rounded


def test_metrics_rows_carry_the_transfer_figures(runs, cache_dir, tmp_path):
    """metrics.jsonl of a disaggregated run with trainer rollouts: each row's trajectory bytes are
    those of the micro-batches the rollout role generated (the trainer's own are not moved), its
    sync bytes the trainable tree's, the last row's too (read after the run's last sync).
    The `runs` fixture's programs, loaded from the session's compilation cache."""
    config = runtime_config(cache_dir, "gap+tsp+tag")
    config.train.iterations = ITERATIONS
    loop.train(config, str(tmp_path), log=lambda _: None)
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    steps, latent = config.sampling.num_steps, int(np.prod(runs["run"].latent_shape))
    per_sample = (2 * steps + 1) * latent * 4 + steps * 4 + 2 * 4  # as in test_transfer_metrics_are_the_bytes_that_crossed
    samples = config.rl.prompts_per_iteration * config.rl.group_size
    from_rollout = samples * (config.runtime.micro_batches - config.runtime.tag_microbatches) // config.runtime.micro_batches
    trainable = sum(leaf.nbytes for leaf in jax.tree.leaves(runs["initial"]))
    assert [r["step"] for r in rows] == list(range(1, ITERATIONS + 1))
    for row in rows:
        assert row["trajectory_bytes"] == from_rollout * per_sample and row["trajectory_s"] > 0, row
        assert row["sync_bytes"] == trainable and row["sync_s"] > 0, row


def test_frozen_base_on_the_rollout_role_equals_the_trainers(cache_dir, tmp_path, monkeypatch):
    """LoRA, disaggregated, one process: the frozen base lies on the train mesh and once on the
    rollout role, bit for bit the run's base, the run's own copy dropped; the rollout's copy is
    made from the train mesh's with no own-copy check. Its FSDP shards do not map shard for
    shard onto the rollout role's replicated layout, so it is replicated inside the train role
    and copied whole device to device (jax.device_put would read it through host memory)."""
    config = runtime_config(cache_dir, "gap")
    config.rl.update(lora_rank=2, lora_merge_for_sampling=False)

    def refuse(*args, **kwargs):
        raise AssertionError("a cross-process step in a one-process run")

    monkeypatch.setattr(weight_sync, "own_copy_everywhere", refuse)
    device_moves = []
    by_copies = transfer_lib._move_by_copies
    monkeypatch.setattr(transfer_lib, "_move_by_copies",
                        lambda *args: device_moves.append(len(args[2])) or by_copies(*args))
    moved = []
    transfer = weight_sync.transfer
    monkeypatch.setattr(weight_sync, "transfer", lambda tree, shardings: moved.append(tree) or transfer(tree, shardings))
    run = loop.Run(config, str(tmp_path), log=lambda _: None)
    base = jax.device_get(run.workload.base_params)
    executor = Executor(run, settings=run_settings(config), trace_path=str(tmp_path / "trace.json"), log=lambda _: None)
    weights = executor.weights
    assert run.workload.base_params is None  # released once the train mesh holds the base
    on_train, on_rollout = run.trainer.frozen, weights.frozen_on_rollout
    assert [tree is on_train for tree in moved] == [True]  # the rollout's copy, from the train mesh's
    across = [transfer_lib._through_host(a, s) for a, s in zip(jax.tree.leaves(on_train), jax.tree.leaves(weights.sharding["rollout"]))]
    assert any(across) and sum(device_moves) == sum(across)  # what device_put would copy through host memory
    for role, tree in (("train", on_train), ("rollout", on_rollout)):
        assert jax.tree.leaves(jax.tree.map(lambda a, s: a.sharding == s, tree, weights.sharding[role])) == [True] * len(jax.tree.leaves(base))
        assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(jax.device_get(tree)), jax.tree.leaves(base)))
    executor.close()


def test_fsdp_programs_gather_the_weights_and_keep_gradient_shards(colocated_fsdp):
    """Colocated with the weights sharded (tiny's FSDP train rules), as the executor compiles them
    (`colocated_fsdp`'s 'sharded' run): the sampler step gathers each weight and moves nothing
    else (every product contracts a whole hidden axis on the device's share of the batch), and
    the gradient program leaves each gradient sharded like its weight. Left to itself, the
    compiler split the products' contraction and all-reduced activations, which deadlocked with
    cuDNN attention on 2 GPUs (docs/known_issues.md), and returned whole gradients on every device."""
    sharded = colocated_fsdp["sharded"]
    assert mesh_lib.shards_weights(sharded["config"].sharding.train_rules)
    compiled = colocated_fsdp["compiled"]
    ops = ("all-gather", "all-reduce", "reduce-scatter", "collective-permute", "all-to-all")
    text = compiled["step"].as_text()
    counts = {op: len(re.findall(rf"\b{op}(?:-start)?\(", text)) for op in ops}
    assert counts["all-gather"] > 0 and sum(counts.values()) == counts["all-gather"], counts
    grad = compiled["grad"]
    grads, shapes = jax.tree.leaves(grad.output_shardings[1]), jax.tree.leaves(grad.out_info[1])
    expected = jax.tree.leaves(sharded["state_sharding"].trainable)
    assert len(grads) == len(shapes) == len(expected) and any(not e.is_fully_replicated for e in expected)
    assert all(g.is_equivalent_to(e, s.ndim) for g, e, s in zip(grads, expected, shapes))


def test_bf16_rollout_log_probs_differ_and_the_trainer_anchor_removes_the_gap(cache_dir, tmp_path):
    """In bf16 the rollout's program (whole micro-batch, merged weights) and the trainer's (chunks
    of units, under differentiation) round differently. Anchored on the rollout's log-prob, the
    lag-0 ratio is off by that gap; anchored on the trainer's own first pass it is exactly 1.
    Both anchors from one Run (the same weights, samples and rollout programs), one trainer each.
    The base model is the fp32 runs' (their pretraining, loaded as a checkpoint and run in bf16)."""
    config = runtime_config(cache_dir, "colocated")
    model_cfg, task, args = workload_lib.pretrain_recipe(config)
    pretrain_lib.pretrained_params(model_cfg, task, **args, cache_dir=str(cache_dir), log=lambda _: None)
    config.model.checkpoint = pretrain_lib.cache_path(model_cfg, task, str(cache_dir), **args)
    config.model.dtype = "bfloat16"
    config.rl.onpolicy_anchor = "rollout"
    config.rl.grad_chunk_size = 3  # chunks unlike the rollout's batch of 4 samples
    run = loop.Run(config, str(tmp_path), log=lambda _: None)
    rows = {}
    for anchor in ("rollout", "trainer"):
        anchored = copy.deepcopy(config)
        anchored.rl.onpolicy_anchor = anchor
        if anchor != run.trainer.cfg.onpolicy_anchor:  # the Run's own trainer anchors on the rollout
            run.trainer = GrpoTrainer(run.sampler, run.trainer.frozen, run.trainer.optimizer,
                                  dataclasses.replace(run.trainer.cfg, onpolicy_anchor=anchor))
        executor = Executor(run, settings=run_settings(anchored), trace_path=str(tmp_path / f"{anchor}.json"), log=lambda _: None)
        _, metrics = executor.iteration(0)
        rows[anchor] = {name: float(value) for name, value in figures_lib.read_figures(metrics).items()
                        if name in ("rollout_logp_gap_max", "logp_diff_max", "ratio_mean", "clip_frac")}
        executor.close()
    gap = rows["rollout"]["rollout_logp_gap_max"]
    assert gap > 0 and rows["rollout"]["logp_diff_max"] == gap
    assert rows["rollout"]["ratio_mean"] != 1
    trainer = rows["trainer"]
    assert trainer["logp_diff_max"] == 0 and trainer["ratio_mean"] == 1 and trainer["clip_frac"] == 0
    assert trainer["rollout_logp_gap_max"] == pytest.approx(gap)  # the same numerics, now only reported


def test_tag_share_follows_measured_costs(runs, cache_dir, tmp_path):
    config = runtime_config(cache_dir, "gap+tsp+tag", tag_microbatches=-1)
    executor = Executor(runs["run"], settings=run_settings(config), trace_path=str(tmp_path / "trace.json"), log=lambda _: None)
    assert executor.split_for(0) == (0, 0)  # nothing measured yet
    executor.measured = {("rollout", "rollout"): [4.0], ("train", "train"): [1.0], ("rollout", "train"): [4.0]}
    slow = executor.split_for(1)
    executor.measured = {("rollout", "rollout"): [0.1], ("train", "train"): [1.0], ("rollout", "train"): [0.1]}
    fast = executor.split_for(1)
    assert slow[0] > 0 and fast[0] == 0
    executor.close()


@pytest.mark.parametrize(
    "override, key",
    [
        (dict(mode="gap+tag"), "runtime.mode"),
        (dict(micro_batches=3), "runtime.micro_batches"),
        (dict(staleness=-1), "runtime.staleness"),
        (dict(rollout_devices=6, train_devices=4), "runtime.rollout_devices"),
        (dict(tag_microbatches=9), "runtime.tag_microbatches"),
        (dict(mode="gap+tsp+tag+tcss", tag_microbatches=3, prefetch_microbatches=2),
         "runtime.tag_microbatches=3 + runtime.prefetch_microbatches=2 exceed runtime.micro_batches=4"),
    ],
)
def test_bad_runtime_config_names_the_key(cache_dir, override, key):
    config = runtime_config(cache_dir, "gap")
    config.runtime.update(override)
    with pytest.raises(ValueError, match=key.replace(".", r"\.").replace("+", r"\+")):
        validate_runtime_config(config, 8)


@pytest.mark.parametrize(
    "override, key",
    [
        (dict(algorithm="ppo"), "rl.algorithm='ppo' is unknown"),
        (dict(nft_solver="heun"), "rl.nft_solver"),
        (dict(nft_decay="linear"), "rl.nft_decay"),
        (dict(nft_beta=0.0), "rl.nft_beta"),
        (dict(nft_timesteps=5), "rl.nft_timesteps=5"),
        (dict(grad_chunk_size=3), "rl.grad_chunk_size=3"),
        (dict(decoupled=True), "rl.decoupled=True"),
    ],
)
def test_bad_nft_config_names_the_key(cache_dir, override, key):
    config = nft_config(cache_dir, "gap")
    config.rl.update(override)
    with pytest.raises(ConfigError, match=key.replace(".", r"\.").replace("+", r"\+")):
        validate_config(config)


@pytest.mark.parametrize("mode", ["gap+tsp+tag", "gap+tsp+tag+tcss"])
@pytest.mark.parametrize("staleness", [0, 1])
def test_fixed_splits_pass_validation_iff_every_iteration_plans(cache_dir, mode, staleness):
    """A fixed (tag, prefetch) split is accepted up front exactly when the planner can plan every
    iteration with it: the first (nothing carried) and every later one (prefetch carried in)."""
    for tag in range(5):
        for prefetch in range(5):
            config = runtime_config(cache_dir, mode, tag_microbatches=tag, prefetch_microbatches=prefetch,
                                    staleness=staleness)
            executor = Executor.__new__(Executor)  # split_for's rule without devices or a run
            executor.settings, executor.mode, executor.flags = run_settings(config), mode, plan_lib.mode_flags(mode)
            executor.microbatches, executor.carried, executor.grain = 4, [], 1
            tag_k, prefetch_k = executor.split_for(1)
            try:
                for carried in (0, prefetch_k):
                    plan_lib.plan_iteration(mode, 1, 4, carried=carried, tag=tag_k, prefetch=prefetch_k)
                plans = True
            except ValueError:
                plans = False
            try:
                validate_runtime_config(config, 8)
                valid = True
            except ValueError:
                valid = False
            assert valid == plans, (tag, prefetch)


# ---------------------------------------------------------------- kill and resume
# The killed run: `kill_config` in a child process whose first training task of iteration
# KILLED_IN (after checkpoint KILLED_IN was written) announces itself and stalls until its
# stdin closes, so the SIGKILL always lands mid-iteration (and a child outlives no parent).
# It runs the programs the `runs` fixture compiled (same configs, and conftest.py's matmul
# precision), loaded from the session's compilation cache (conftest.py).
KILLED_IN = ITERATIONS - 1
_KILLED_RUN = """
import json
import os
import sys
from digen_jax.app import loop
from digen_jax.app.errors import ConfigError
from digen_jax.app.validation import validate_config
from digen_jax.rl import nft as nft_lib
from digen_jax.runtime.executor import Executor
from tests.test_runtime import KILLED_IN, kill_config

train = Executor._train

def train_then_stall(self, task, mb, acc):
    train(self, task, mb, acc)
    if task.iteration == KILLED_IN:
        print("STALLED", flush=True)
        sys.stdin.read()  # returns when the test process closes the pipe: it is gone
        os._exit(1)

Executor._train = train_then_stall
loop.train(kill_config(sys.argv[1], sys.argv[2], **json.loads(sys.argv[4])), sys.argv[3], log=lambda m: print(m, flush=True))
"""


def kill_config(cache_dir, mode, **runtime):
    """The `runs` fixture's config of `mode` (with `runtime` overrides) as a training run
    checkpointing every iteration."""
    config = runtime_config(cache_dir, mode, **runtime)
    config.train.iterations = ITERATIONS
    config.train.checkpoint_every = 1
    return config


class KilledRuns:
    """One killed training process per mode. Each is started a mode ahead, so that it runs on
    the second core while the previous mode resumes in the test process."""

    def __init__(self, cache_dir, compile_cache, workdirs, modes=plan_lib.MODES, **runtime):
        """`runtime`: overrides of every run's `runtime` section; `modes`: the order they run in."""
        self.cache_dir, self.workdirs, self.modes, self.runtime = cache_dir, workdirs, modes, runtime
        self.env = dict(
            os.environ,  # conftest.py's XLA flags: 8 devices
            JAX_PLATFORMS="cpu",
            JAX_DEFAULT_MATMUL_PRECISION="highest",
            JAX_COMPILATION_CACHE_DIR=compile_cache,
            JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
            JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1",
        )
        self.procs = {}

    def start(self, mode):
        """Start `mode`'s run unless it was started; (process, workdir)."""
        if mode not in self.procs:
            workdir = self.workdirs.mktemp(mode.replace("+", "_"))
            root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
            proc = subprocess.Popen(
                [sys.executable, "-c", _KILLED_RUN, str(self.cache_dir), mode, str(workdir), json.dumps(self.runtime)],
                cwd=root, env=self.env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            )
            self.procs[mode] = (proc, workdir)
        return self.procs[mode]

    def kill(self, mode):
        """SIGKILL `mode`'s run once it stalls mid-iteration (and its checkpoint is written); its workdir."""
        proc, workdir = self.start(mode)
        following = self.modes[self.modes.index(mode) + 1 :]
        if following:
            self.start(following[0])
        watchdog = threading.Timer(240, proc.kill)  # a child that never stalls must not hang the suite
        watchdog.daemon = True
        watchdog.start()
        output = []
        for line in proc.stdout:
            output.append(line)
            if line.strip() == "STALLED":
                break
        checkpoint = workdir / "checkpoints" / str(KILLED_IN)
        while proc.poll() is None and not checkpoint.exists():  # written asynchronously
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
        output.append(proc.communicate()[0])
        watchdog.cancel()
        assert proc.returncode == -signal.SIGKILL and checkpoint.exists(), "".join(output)[-3000:]
        return workdir

    def close(self):
        for proc, _ in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.communicate()


@pytest.fixture(scope="module")
def killed_runs(runs, cache_dir, compile_cache, tmp_path_factory):
    """Started after `runs`, whose compiled programs the children load from the cache."""
    killed = KilledRuns(cache_dir, compile_cache, tmp_path_factory)
    yield killed
    killed.close()


@pytest.mark.parametrize("mode", plan_lib.MODES)
def test_sigkill_mid_iteration_then_resume_matches_an_uninterrupted_run(runs, killed_runs, cache_dir, mode):
    assert_sigkill_then_resume_matches(killed_runs, runs[mode], cache_dir, mode)


def assert_sigkill_then_resume_matches(killed_runs, uninterrupted, cache_dir, mode):
    """`killed_runs`' run of `mode`, killed mid-iteration and resumed, against `uninterrupted` (a
    `run_every_mode` result of the same config): the same metrics and bit-equal weights, and a
    trace that holds every sample generated and trained once."""
    config = kill_config(cache_dir, mode, **killed_runs.runtime)
    workdir = killed_runs.kill(mode)
    assert not (workdir / "checkpoints" / str(ITERATIONS)).exists(), "the run finished before it was killed"
    killed_rows = [json.loads(line)["step"] for line in open(workdir / "metrics.jsonl")]
    assert killed_rows == list(range(1, KILLED_IN + 1))
    killed_end = max(e["ts"] + e["dur"] for e in read_trace(workdir / "trace.json"))

    logs = []
    resumed = loop.train(config, str(workdir), log=logs.append)
    assert any(f"resumed from checkpoint {KILLED_IN}" in line for line in logs), logs
    rows = [json.loads(line) for line in open(workdir / "metrics.jsonl")]
    assert [r["step"] for r in rows] == list(range(1, ITERATIONS + 1))
    for row, metrics in zip(rows, uninterrupted["metrics"]):
        assert row["reward_mean"] == metrics["reward_mean"] and row["loss"] == float(metrics["loss"]), row["step"]
    # Each row counts the sync carrying its update (none when colocated), read at a checkpoint
    # right after its iteration too; the resumed run's first row counts no starting sync of its own.
    synced = uninterrupted["timings"][0]["sync_bytes"]
    assert (synced > 0) != (mode == plan_lib.COLOCATED)
    for row, timing in zip(rows, uninterrupted["timings"]):
        assert row["sync_bytes"] == timing["sync_bytes"] == synced and (row["sync_s"] > 0) == bool(synced), row
    final = jax.device_get(uninterrupted["executor"].state.trainable)
    for a, b in zip(jax.tree.leaves(jax.device_get(resumed.trainable)), jax.tree.leaves(final)):
        np.testing.assert_array_equal(a, b)
    # The trace marks the resume; the resumed process's clock goes on after the killed one's.
    (marker,) = read_trace(workdir / "trace.json", phases=("i",))
    assert marker["args"]["resumed_from"] == KILLED_IN and marker["ts"] >= killed_end
    events = read_trace(workdir / "trace.json")  # without the killed run's events the resume superseded
    resumed_events = [e for e in events if e["ts"] >= marker["ts"]]
    prefetch = config.runtime.prefetch_microbatches
    # Of the killed run's tasks past the checkpoint only what the checkpoint holds still counts:
    # the prefetched micro-batches' rollouts and rewards, and the sync of the checkpointed update.
    for e in events:
        if e["ts"] < marker["ts"] and e["args"]["iteration"] >= KILLED_IN:
            kind, args = e["args"]["kind"], e["args"]
            assert (kind == "sync" and args["iteration"] == KILLED_IN
                    or kind in ("rollout", "reward") and args["iteration"] == KILLED_IN and args["microbatch"] < prefetch), e
    # The whole trace says which version generated and which update trained every sample, once.
    generated = collections.Counter(sid for e in events if e["args"]["kind"] == "rollout" for sid in e["args"]["sample_ids"])
    trained_all = collections.Counter(sid for e in events if e["args"]["kind"] == "train" for sid in e["args"]["sample_ids"])
    batch = config.rl.prompts_per_iteration * config.rl.group_size
    per_microbatch = batch // config.runtime.micro_batches
    assert set(generated.values()) == {1} and set(trained_all.values()) == {1}
    assert sorted(trained_all) == list(range(ITERATIONS * batch))
    # The resumed process trained the killed iteration's samples once each, and took the ones
    # prefetched before the checkpoint from it instead of rolling them out again.

    def sample_ids(kind):
        return collections.Counter(sid for e in resumed_events if e["args"]["kind"] == kind for sid in e["args"]["sample_ids"])

    trained, rolled = sample_ids("train"), sample_ids("rollout")
    assert sorted(trained) == list(range(KILLED_IN * batch, ITERATIONS * batch)) and set(trained.values()) == {1}
    prefetched = prefetch * per_microbatch
    assert set(trained) - set(rolled) == set(range(KILLED_IN * batch, KILLED_IN * batch + prefetched))
    assert set(rolled.values()) == {1}


def test_host_derived_inputs_are_computed_off_the_role_devices(runs, cache_dir, tmp_path, monkeypatch):
    """Sample keys, conditioning slices and advantages are computed on `mesh.host_device()` (the
    CPU backend on accelerator machines), not on the default device: that is a rollout device,
    and a training task's advantages would wait there behind every rollout dispatched before it.
    Colocated on the first 4 devices, `colocated_fsdp`'s 'sharded' setting on the `runs`
    fixture's Run, whose programs on these devices are compiled."""
    host = jax.devices()[7]  # stands in for the CPU backend: a device neither rollout nor train
    monkeypatch.setattr(mesh_lib, "host_device", lambda: host)
    config = runtime_config(cache_dir, "colocated", colocated_sampling="sharded", train_devices=4)
    executor = Executor(runs["run"], settings=run_settings(config), trace_path=str(tmp_path / "trace.json"), log=lambda _: None)
    assert host not in set(executor.meshes.rollout.devices.flat) | set(executor.meshes.train.devices.flat)
    for mb in executor.microbatches_of(0):
        assert {d for leaf in jax.tree.leaves((mb.cond, mb.sample_keys)) for d in leaf.devices()} == {host}
    made_on = []
    advantages = executor_lib.adv_lib.group_advantages

    def recording(*args, **kwargs):
        out = advantages(*args, **kwargs)
        made_on.append(out.devices())
        return out

    monkeypatch.setattr(executor_lib.adv_lib, "group_advantages", recording)
    executor.iteration(0)
    executor.close()
    assert made_on == [{host}] * config.runtime.micro_batches
