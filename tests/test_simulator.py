"""The simulator: cost model, predictions from measured profiles, ablation logic, autosize, the grid."""
import dataclasses
import glob
import json
import os
import statistics
import subprocess
import sys
import time
import zlib

import numpy as np
import pytest

from configs.paper import qwenimage as paper_qwen
from digen_jax import model_flops
from digen_jax.app import run_sizing
from digen_jax.runtime import task_costs as cm
from digen_jax.runtime import plan as plan_lib
from digen_jax.runtime import simulator as sim

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FULL = "gap+tsp+tag+tcss"


@pytest.fixture(scope="module")
def qwen():
    return run_sizing.iteration_work(paper_qwen.get_config())


def test_workload_is_the_exact_flop_count(qwen):
    c = paper_qwen.get_config()
    from digen_jax.models import FAMILIES

    counted = model_flops.rl_sample_flops(
        "qwenimage", FAMILIES["qwenimage"].variants["qwen-image"], height=512, width=512, text_len=c.data.text_len,
        num_steps=10, trained_steps=2, cfg_forwards=2, lora_rank=64, lora_targets=list(c.rl.lora_targets),
    )
    assert qwen.flops_per_sample == pytest.approx(counted["total"], rel=1e-12)
    assert qwen.samples == 512 and qwen.trained_steps == 2
    assert 20.0e9 < qwen.params < 20.6e9  # Qwen-Image's 20B transformer
    # rank-64 adapters on every attention and MLP kernel of 60 blocks: r (in + out) each
    assert 0.3e9 < qwen.trainable < 0.5e9 and qwen.lora


def test_workload_follows_a_shortened_random_weight_model(qwen):
    """`model.num_layers` keeps that many blocks of the variant: FLOPs and weights shrink with them."""
    c = paper_qwen.get_config()
    c.model.num_layers = 12
    short = run_sizing.iteration_work(c)
    assert short.params == pytest.approx(qwen.params * 12 / 60, rel=0.02)  # embedders and output aside
    assert short.step_flops < 0.25 * qwen.step_flops


def test_fp8_rollouts_speed_up_the_rollout_role_only(qwen):
    """`model.rollout_precision='fp8'`: the rollout role's (and the colocated shared role's) rollouts
    run `fp8_rollout_speedup` times faster; the train role's assisted rollouts stay bf16."""
    c = paper_qwen.get_config()
    c.model.rollout_precision = "fp8"
    fp8 = run_sizing.iteration_work(c)
    assert fp8.rollout_precision == "fp8" and qwen.rollout_precision == "bf16"
    eff, pool = cm.Efficiency(step_call_s=0.0, block_s=0.0), cm.Pool.parse("h100:4")
    bf16_costs = cm.model_costs(qwen, pool, "gap+tsp+tag", 8, eff=eff)
    fp8_costs = cm.model_costs(fp8, pool, "gap+tsp+tag", 8, eff=eff)
    assert fp8_costs.rollout["rollout"] == pytest.approx(bf16_costs.rollout["rollout"] / eff.fp8_rollout_speedup)
    assert fp8_costs.rollout["train"] == bf16_costs.rollout["train"]
    assert fp8_costs.train == bf16_costs.train and fp8_costs.sync == bf16_costs.sync
    shared = cm.model_costs(fp8, pool, "colocated", 8, eff=eff, style="offload").rollout["shared"]
    assert shared == pytest.approx(cm.model_costs(qwen, pool, "colocated", 8, eff=eff, style="offload").rollout["shared"]
                                   / eff.fp8_rollout_speedup)
    # one-byte weights: 20B parameters fit one 24 GiB-usable share where bf16 needs two devices
    small = dataclasses.replace(cm.device_kind("h100"), hbm_bytes=28 * 2**30)
    assert cm._replica_size(qwen, small, 4, eff) == 2 and cm._replica_size(qwen, small, 4, eff, fp8=True) == 1


def test_cost_model_divides_work_over_devices(qwen):
    h100, eff = cm.device_kind("h100"), cm.Efficiency(step_call_s=0.0, block_s=0.0, train_call_s=0.0)
    one = cm.rollout_mb_s(qwen, 64, h100, 4, eff)
    assert cm.rollout_mb_s(qwen, 64, h100, 8, eff) == pytest.approx(one / 2)
    assert one == pytest.approx(10 * 16 * qwen.step_flops / (h100.bf16_flops * eff.rollout))
    # more devices than samples: the extra ones idle
    assert cm.rollout_mb_s(qwen, 4, h100, 8, eff) == pytest.approx(cm.rollout_mb_s(qwen, 4, h100, 4, eff))
    pool = cm.Pool.parse("h100:16")
    # TSP flattens samples x steps: with fewer samples than devices it keeps them busy, without it not
    tsp = cm.train_mb_s(qwen, 4, h100, 8, pool, eff, tsp=True)
    no_tsp = cm.train_mb_s(qwen, 4, h100, 8, pool, eff, tsp=False)
    assert tsp < no_tsp
    # enough samples for every device and step: the same compute either way
    assert cm.train_mb_s(qwen, 64, h100, 8, pool, dataclasses.replace(eff, link=1.0), tsp=True) == pytest.approx(
        cm.train_mb_s(qwen, 64, h100, 8, pool, dataclasses.replace(eff, link=1.0), tsp=False), rel=0.01)


def test_heterogeneous_pool_prices_and_kinds(qwen):
    hetero = cm.Pool.parse("rollout=h800:16,train=l40s:16", devices=cm.with_prices({"l40s": 1.0, "h800": 2.0}))
    assert hetero.heterogeneous and hetero.dollars_per_hour() == pytest.approx(48.0)
    homo = cm.Pool.parse("rollout=h800:16,train=h800:16")
    c_het, c_homo = (cm.model_costs(qwen, p, FULL, 8) for p in (hetero, homo))
    assert c_het.train > 2 * c_homo.train  # L40S: ~1/3 of the peak, no NVLink
    assert c_het.rollout["rollout"] == pytest.approx(c_homo.rollout["rollout"])
    # colocated steps run in lockstep: bounded by the slowest kind
    assert cm.model_costs(qwen, hetero, "colocated", 8).rollout["shared"] > cm.model_costs(qwen, homo, "colocated", 8).rollout["shared"]
    # role transfers between machines cross hosts
    assert hetero.role_link_bw() == hetero.cross_host_bw


def _rate(mode, costs, **kw):
    return sim.predict(mode, costs, batch=512, microbatches=8, devices=16, **kw).samples_per_s


@pytest.fixture(scope="module")
def base_costs(qwen):
    return cm.model_costs(qwen, cm.Pool.parse("h800:16"), FULL, 8)


def test_ablation_gains_follow_from_the_costs(base_costs):
    """Each schedule's gain appears and vanishes with the cost it hides, not with a fixed factor."""
    c = base_costs
    assert _rate("gap", c) > 1.2 * _rate("disagg_sync", c)
    # GAP overlaps training with rollout: with training nearly free there is nothing to overlap
    free_train = dataclasses.replace(c, train=1e-4, update=1e-4)
    assert _rate("gap", free_train) == pytest.approx(_rate("disagg_sync", free_train), rel=0.02)

    # TAG: the trainer takes rollout work only while rollout dominates
    rollout_heavy = dataclasses.replace(c, train=c.train * 0.05)
    assert _rate("gap+tsp+tag", rollout_heavy) > 1.1 * _rate("gap+tsp", rollout_heavy)
    cheap_rollout = dataclasses.replace(c, rollout={g: v * 0.01 for g, v in c.rollout.items()})
    p = sim.predict("gap+tsp+tag", cheap_rollout, batch=512, microbatches=8, devices=16)
    assert p.tag == 0 and p.samples_per_s == pytest.approx(_rate("gap+tsp", cheap_rollout))

    # TCSS fills the training tail with next-iteration rollouts: a big tail gains (more than the
    # 2% below which the planner keeps samples fresh), a tiny one does not
    assert _rate(FULL, c) > 1.03 * _rate("gap+tsp+tag", c)
    tiny_tail = dataclasses.replace(c, train=1e-4, update=1e-4, sync=1e-4, reward=1e-4)
    assert _rate(FULL, tiny_tail) == pytest.approx(_rate("gap+tsp+tag", tiny_tail), rel=0.01)

    # a huge weight sync slows every disaggregated mode; colocated has none to pay
    slow_sync = dataclasses.replace(c, sync=100.0)
    for mode in plan_lib.MODES[1:]:
        assert _rate(mode, slow_sync) < 0.8 * _rate(mode, c)
    colocated = dataclasses.replace(c, rollout={"shared": 10.0})
    assert _rate("colocated", dataclasses.replace(colocated, sync=100.0)) == _rate("colocated", colocated)


def test_several_updates_per_batch_in_every_mode(qwen):
    """`rl.num_updates_per_batch=2`: every mode's prediction schedules two updates in each timed
    iteration, over the micro-batch counts the executor accepts (even ones), and takes at least
    the time of one update per iteration on the same costs."""
    two = dataclasses.replace(qwen, updates=2)
    pool = cm.Pool.parse("h100:16")
    for mode in plan_lib.MODES:
        one_p, two_p = sim.simulate(qwen, pool, mode, microbatches=8), sim.simulate(two, pool, mode, microbatches=8)
        timed = [t for t in two_p.timeline if t["timed"]]
        for k in {t["iteration"] for t in timed}:
            assert sorted(t["index"] for t in timed if t["kind"] == "update" and t["iteration"] == k) == [0, 1], mode
        assert two_p.samples_per_s <= one_p.samples_per_s * (1 + 1e-9), mode
        assert sim.simulate(two, pool, mode).microbatches % 2 == 0, mode
    with pytest.raises(ValueError, match=r"rl\.num_updates_per_batch=2 must divide runtime\.micro_batches=1"):
        sim.simulate(two, pool, FULL, microbatches=1)


def test_cost_model_moves_with_efficiency(qwen):
    """Predictions respond to the efficiency factors the way the cost formulas say."""
    pool = cm.Pool.parse("h800:16")
    # compute-bound chunks (no all-gather floor) with no batch-independent or exposed-gather seconds
    big_chunks = cm.Efficiency(train_units_per_device=64, block_s=0.0, gather_exposed=0.0)
    base = sim.simulate(qwen, pool, "disagg_sync", microbatches=1, eff=big_chunks)
    fast_train = sim.simulate(qwen, pool, "disagg_sync", microbatches=1, eff=dataclasses.replace(big_chunks, train=0.8))
    assert fast_train.costs.train == pytest.approx(0.5 * base.costs.train, rel=0.02)
    # small chunks: each pays the weight all-gather, which faster compute does not shorten
    small = sim.simulate(qwen, pool, "disagg_sync", microbatches=1, eff=cm.Efficiency(train=0.8, train_units_per_device=1))
    assert small.costs.train > 1.5 * fast_train.costs.train
    assert fast_train.samples_per_s > base.samples_per_s
    assert fast_train.costs.rollout == base.costs.rollout


# ------------------------------------------------------------------ DiffusionNFT's cost profile
def _qwen_work(module, size="full", **rl):
    import importlib

    config = importlib.import_module(f"configs.{module}").get_config(size)
    config.rl.update(rl)
    return config, run_sizing.iteration_work(config)


def test_nft_moves_work_from_rollout_to_training():
    """Qwen-Image at the 2-GPU bench's batch (4 prompts x 8): DiffusionNFT's CFG-free ODE rollout costs
    half of Flow-GRPO's guided one per step, its 9 trained levels per sample (3 forwards each) cost
    more than GRPO's 2 guided steps, so the best mode goes from rollout-bound to train-bound."""
    _, grpo = _qwen_work("qwenimage", prompts_per_iteration=4, group_size=8)
    _, nft = _qwen_work("qwenimage_nft", prompts_per_iteration=4, group_size=8)
    assert (grpo.trained_steps, grpo.unit_forwards) == (2, 1) and (nft.trained_steps, nft.unit_forwards) == (9, 3)
    assert nft.step_flops == grpo.step_flops / 2  # one forward per step instead of a doubled batch
    assert nft.trained_steps * nft.unit_flops > 4 * grpo.trained_steps * grpo.unit_flops
    pool, eff = cm.Pool.parse("h100:2"), cm.Efficiency(step_call_s=0.0, block_s=0.0)
    g, n = (sim.simulate(w, pool, FULL, microbatches=4, eff=eff) for w in (grpo, nft))
    assert n.costs.rollout["rollout"] == pytest.approx(g.costs.rollout["rollout"] / 2)
    assert n.costs.train > 3 * g.costs.train
    assert g.costs.rollout["rollout"] > g.costs.train and n.costs.train > n.costs.rollout["rollout"]
    assert n.samples_per_s < g.samples_per_s and n.bubble_frac["rollout"] > g.bubble_frac["rollout"]


def test_nft_prediction_is_the_hand_count_of_a_tiny_setting():
    """configs/qwenimage_nft.py:tiny (2 prompts x 2 samples, 4 steps, K = 3, KL weight > 0) on one
    rollout and one train H100 in disagg_sync with one micro-batch: every task's seconds from the
    exact counts by hand, and the iteration their sum."""
    config, w = _qwen_work("qwenimage_nft", "tiny")
    from digen_jax.models import FAMILIES

    terms = model_flops.model_terms("qwenimage", FAMILIES["qwenimage"].variants["tiny"], batch=1, height=32, width=32,
                              text_len=config.data.text_len)
    rank, targets = config.rl.lora_rank, list(config.rl.lora_targets)
    forward = terms.forward().total
    unit = terms.lora_fwd_bwd(rank, targets).total + terms.lora_forward(rank, targets).total + forward
    assert (w.samples, w.num_steps, w.trained_steps, w.unit_forwards) == (4, 4, 3, 3)
    assert (w.step_flops, w.unit_flops) == (forward, unit)

    eff = cm.Efficiency(step_call_s=0.0, block_s=0.0, train_call_s=0.0, update_call_s=0.0, reward_s_per_sample=0.0,
                        decode_flops_per_pixel=0.0)
    peak = cm.device_kind("h100").bf16_flops
    p = sim.simulate(w, cm.Pool.parse("h100:2"), "disagg_sync", microbatches=1, eff=eff)
    rollout = 4 * 4 * forward / (peak * eff.rollout)  # 4 steps of 4 samples, one forward each
    train = 4 * 3 * unit / (peak * eff.train)  # 4 samples x 3 levels, chunks of 4 units on one device
    assert p.costs.rollout["rollout"] == pytest.approx(rollout, rel=1e-12)
    assert p.costs.train == pytest.approx(train, rel=1e-12)
    assert p.iteration_s == pytest.approx(rollout + train + p.costs.update + p.costs.sync, rel=1e-9)
    assert p.samples_per_s == pytest.approx(4 / p.iteration_s)

    # Sharded over train devices, a chunk all-gathers the weights once per forward and once for the
    # backward: with no compute, the three-forward unit's floor against a one-forward unit's.
    free = dataclasses.replace(w, unit_flops=0.0)
    pool, h100 = cm.Pool.parse("h100:8"), cm.device_kind("h100")
    floor = {f: cm.train_mb_s(dataclasses.replace(free, unit_forwards=f), 4, h100, 4, pool, eff, tsp=True) for f in (1, 3)}
    weights = w.params * w.param_bytes
    assert floor[3] / floor[1] == pytest.approx((4 * weights + 4 * w.trainable) / (2 * weights + 4 * w.trainable))


# ------------------------------------------------------------------ validation against bench runs
class _Jittered(plan_lib.Costs):
    """Task times of a pretend run: every task a few percent off the mean, the first iteration slow (compile)."""

    def of(self, task):
        noise = np.random.default_rng(zlib.crc32(repr((task.key, task.group)).encode())).normal(0.0, 0.05)
        return super().of(task) * float(np.exp(noise)) * (3.0 if task.iteration == 0 else 1.0)


def _emulated_bench(mode, costs, microbatches, batch, *, warmup=1, iterations=4):
    """A system-bench record made the executor's way: the split of iteration k chosen from the task
    times measured in k - 1 (none at first), carried micro-batches, timed from update to update."""
    jittered = _Jittered(**dataclasses.asdict(costs))
    plans, carried = [], 0
    for k in range(warmup + iterations):
        tag = prefetch = 0
        if k:
            timeline = plan_lib.schedule(plans, jittered)
            measured = {}
            for key, start in timeline.start.items():
                if key[1] - (key[0] == "sync") == k - 1:  # a sync: the iteration whose update it carries
                    measured.setdefault((key[0], timeline.group[key]), []).append(timeline.end[key] - start)
            mean = lambda kind, group: statistics.mean(measured[(kind, group)]) if (kind, group) in measured else 0.0  # noqa: E731
            group = "shared" if mode == "colocated" else "rollout"
            train_group = "shared" if mode == "colocated" else "train"
            seen = plan_lib.Costs(
                rollout={group: mean("rollout", group), "train": mean("rollout", "train") or mean("rollout", group)},
                reward=mean("reward", "reward"), train=mean("train", train_group), update=mean("update", train_group),
                sync=mean("sync", "link"),
            )
            tag, prefetch = plan_lib.choose_split(mode, microbatches, seen)
            tag = min(tag, microbatches - carried)
        plans.append(plan_lib.plan_iteration(mode, k, microbatches, carried=carried, tag=tag, prefetch=prefetch))
        carried = prefetch
    timeline = plan_lib.schedule(plans, jittered)
    timed = range(warmup, warmup + iterations)
    seconds = [timeline.end[("update", k, 0)] - timeline.end[("update", k - 1, 0)] for k in timed]
    durations = {}
    for key, start in timeline.start.items():
        if key[1] in timed:
            durations.setdefault((key[0], timeline.group[key]), []).append(timeline.end[key] - start)
    train_group = "shared" if mode == "colocated" else "train"
    recorded = {
        "rollout": {g: statistics.mean(v) for (kind, g), v in durations.items() if kind == "rollout"},
        "reward": statistics.mean(durations[("reward", "reward")]),
        "train": statistics.mean(durations[("train", train_group)]),
        "update": statistics.mean(durations[("update", train_group)]),
        "sync": statistics.mean(durations.get(("sync", "link"), [0.0])),
    }
    return {
        "samples_per_s": statistics.mean(batch / s for s in seconds),
        "devices": 8,
        "costs": recorded,
        "micro_batches": microbatches,
        "splits": [{"tag": p.tag, "prefetch": p.prefetch, "carried": p.carried} for p in plans[warmup:]],
    }


def _check_record(record, name):
    predicted = sim.predict_from_profile(record)
    for mode, r in record["modes"].items():
        measured = r["samples_per_s"]
        assert abs(predicted[mode] / measured - 1) <= 0.10, (
            f"{name}: {mode} predicted {predicted[mode]:.4g} samples/s vs measured {measured:.4g}"
        )
    return predicted


def test_predictions_match_committed_bench_runs(qwen):
    """Within 10% of every mode of every committed system bench run, and of a synthetic one.

    The synthetic run stands in until runs land: task times jittered around the cost model's,
    a slow first iteration, elastic splits chosen from the previous iteration's measured times
    (so the timed iterations do not start in steady state) and costs recorded as means.
    """
    pool = cm.Pool.parse("h100:8")
    batch, micro = qwen.samples, 4
    modes = {}
    for mode in plan_lib.MODES:
        costs = cm.model_costs(qwen, pool, mode, micro)
        modes[mode] = _emulated_bench(mode, costs, micro, batch)
    synthetic = {"modes": modes, "batch": batch, "gpu": "synthetic (cost model + 5% jitter)"}
    predicted = _check_record(synthetic, "synthetic")
    assert predicted[FULL] > predicted["disagg_sync"]  # a record where the modes really differ
    assert any(s["tag"] or s["prefetch"] for s in modes[FULL]["splits"])

    files = sorted(glob.glob(os.path.join(ROOT, "benchmarks", "results", "system_*.json")))
    for path in files:
        with open(path) as f:
            _check_record(json.load(f), os.path.basename(path))


def test_profile_errors_name_what_is_missing():
    with pytest.raises(ValueError, match="batch"):
        sim.predict_from_profile({"modes": {}})
    with pytest.raises(ValueError, match="micro_batches"):
        sim.predict_from_profile({"batch": 8, "modes": {"gap": {"costs": {}}}})
    with pytest.raises(ValueError, match="reward"):
        sim.costs_from_profile({"rollout": {"rollout": 1.0}})


# ------------------------------------------------------------------ a-priori predictions of GPU runs
# Every row of benchmarks/README.md's table "Colocated against the full mode, LoRA" (its file column).
LORA_PAIRS = (
    "system_qwenimage_2xh200_1_1_bf16_pair", "system_qwenimage_2xh200_1_1_fp8_pair",
    "system_qwenimage_4xh200_2_2_bf16_pair", "system_qwenimage_4xh200_2_2_fp8_pair",
    "system_qwenimage_4xh200_1_3_fp8_pair",
)


def _bench_config(argv):
    """The config a bench record ran: its `--config=` file with the `--config.KEY=VALUE` flags of
    its argv applied, each value read as the type of the field it sets."""
    import importlib.util

    path = next(a.split("=", 1)[1] for a in argv if a.startswith("--config="))
    spec = importlib.util.spec_from_file_location("bench_config", os.path.join(ROOT, path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config()
    for flag in argv:
        if not flag.startswith("--config."):
            continue
        key, value = flag[len("--config."):].split("=", 1)
        *parents, leaf = key.split(".")
        node = config
        for name in parents:
            node = node[name]
        old = node[leaf]
        node[leaf] = value == "True" if isinstance(old, bool) else type(old)(value) if old is not None else value
    return config


@pytest.mark.parametrize("name", LORA_PAIRS)
def test_a_priori_predictions_of_the_lora_pairs_are_within_10_percent(name):
    """The cost model alone (no measured costs), given the config and the pool a committed GPU run
    used, predicts each of its modes at the run's micro-batch count within 10% of the samples/s
    the run measured (`launch/simulate.py --config=... --pool=h200:N/rollout=R --micro_batches=M`)."""
    with open(os.path.join(ROOT, "benchmarks", "results", f"{name}.json")) as f:
        record = json.load(f)
    config = _bench_config(record["argv"])
    work = run_sizing.iteration_work(config)
    pool = cm.Pool.parse(f"{cm.local_kind(record['gpu'])}:{record['num_devices']}/rollout={config.runtime.rollout_devices}")
    assert work.samples == record["batch"] and set(record["modes"]) == {"colocated", FULL}
    for mode, measured in record["modes"].items():
        p = sim.simulate(work, pool, mode, microbatches=int(measured["micro_batches"]))
        assert p.fits, (name, mode)
        assert abs(p.samples_per_s / measured["samples_per_s"] - 1) <= 0.10, (
            f"{name}: {mode} a priori {p.samples_per_s:.4g} samples/s vs measured {measured['samples_per_s']:.4g}")


# ------------------------------------------------------------------ autosize, input checks
def test_autosize_is_at_least_as_good_as_the_naive_split(qwen):
    pool = cm.Pool.parse("h100:8")
    naive = sim.simulate(qwen, pool, FULL, microbatches=8)  # even split, the config's micro-batches
    sized = sim.autosize(qwen, pool)
    assert sized.prediction.samples_per_s >= naive.samples_per_s
    assert sized.rollout_devices + sized.train_devices == 8
    again = sim.simulate(qwen, dataclasses.replace(pool, rollout_devices=sized.rollout_devices, train_devices=sized.train_devices),
                         FULL, microbatches=sized.microbatches)
    assert again.samples_per_s == pytest.approx(sized.prediction.samples_per_s)
    assert set(sized.runtime_overrides()) <= set(paper_qwen.get_config().runtime.keys())
    with pytest.raises(ValueError, match="colocated"):
        sim.autosize(qwen, pool, mode="colocated")


def test_size_config_sizes_the_config_it_will_run():
    """launch/train.py --autosize: the simulator's role sizes and micro-batches land in the config,
    which the executor then accepts on this run's 8 devices; TAG share and prefetch stay elastic."""
    import jax

    from configs import qwenimage
    from digen_jax.app.validation import validate_runtime_config

    config = qwenimage.get_config()
    config.runtime.mode = FULL
    pool, sized = run_sizing.size_config(config, "h100:8", jax.devices())
    want = sim.autosize(run_sizing.iteration_work(config), cm.Pool.parse("h100:8"), mode=FULL)
    rt = config.runtime
    assert (rt.rollout_devices, rt.train_devices, rt.micro_batches) == (want.rollout_devices, want.train_devices, want.microbatches)
    assert sized.prediction.samples_per_s == pytest.approx(want.prediction.samples_per_s) and pool.total == 8
    assert rt.tag_microbatches == rt.prefetch_microbatches == -1
    validate_runtime_config(config, 8)
    with pytest.raises(ValueError, match="device kind 'cpu' has no entry"):
        run_sizing.size_config(config, "local", jax.devices())
    with pytest.raises(ValueError, match="has 16 devices, this run 8"):
        run_sizing.size_config(config, "h100:16", jax.devices())
    config.runtime.mode = "colocated"
    with pytest.raises(ValueError, match="'colocated' has one group"):
        run_sizing.size_config(config, "h100:8", jax.devices())


@pytest.mark.parametrize("jax_kind, key", [
    ("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H100 PCIe", "h100_pcie"), ("NVIDIA H200", "h200"),
    ("NVIDIA A100-SXM4-80GB", "a100"), ("NVIDIA L40S", "l40s"),
    ("TPU v5 lite", "v5e"), ("TPU v5", "v5p"), ("TPU v6 lite", "v6e"),
])
def test_local_device_kinds(jax_kind, key):
    assert cm.local_kind(jax_kind) == key


@pytest.mark.parametrize("spec, match", [
    ("b200:8", "unknown"), ("h100:8/rollout=8", "rollout devices"), ("h100", "expected"), ("rollout=h100:4", "expected"),
    ("h200:1", r"2 or more devices.*one device runs colocated only.*--modes=colocated"),
])
def test_bad_pools_fail_with_a_clear_message(spec, match):
    with pytest.raises(ValueError, match=match):
        cm.Pool.parse(spec)


def test_bad_inputs_name_the_key(qwen):
    pool = cm.Pool.parse("h100:8")
    with pytest.raises(ValueError, match="runtime.micro_batches"):
        cm.model_costs(qwen, pool, "gap", 5)
    with pytest.raises(ValueError, match="runtime.mode"):
        cm.model_costs(qwen, pool, "gap+tag", 4)
    with pytest.raises(ValueError, match="Efficiency.rollout"):
        cm.Efficiency(rollout=1.5)
    with pytest.raises(ValueError, match="do not fit"):
        sim.simulate(qwen, cm.Pool.parse("rollout=l40s:1,train=h100:4"), "gap", microbatches=1,
                     eff=cm.Efficiency(usable_hbm=0.5))


# ------------------------------------------------------------------ the scripts
def test_simulator_and_cost_model_import_no_checkpointing_or_model_code():
    """The runtime's simulator and cost model take plain values: importing them loads neither
    orbax nor flax, the model zoo or the application layer."""
    code = ("import sys, digen_jax.runtime.simulator, digen_jax.runtime.task_costs; "
            "assert not [m for m in sys.modules if m.startswith(('orbax', 'digen_jax.models', 'digen_jax.app', 'flax'))]")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]


def test_paper_grid_runs_under_a_minute(tmp_path):
    """The grid takes under a minute of this thread's CPU time: its work, whatever else the
    machine runs beside it (a shared machine stretches wall time several-fold) or threads that
    earlier tests left in this process spend (they count in the process's CPU time)."""
    sys.path.insert(0, os.path.join(ROOT, "launch"))
    try:
        import reproduce
    finally:
        sys.path.pop(0)
    started = time.thread_time()
    grid = reproduce.run_grid()
    body = reproduce.tables(grid)
    elapsed = time.thread_time() - started
    assert elapsed < 60, f"the grid took {elapsed:.0f} CPU-seconds"
    assert len(grid.cells) == 12 and all(len(row) == len(reproduce.SYSTEMS) + 1 for row in grid.cells.values())
    for model, _ in reproduce.MODELS:
        assert model in body
    assert "Cost efficiency" in body and "16xH800+16xL40S" in body
    written = reproduce.plots(grid, str(tmp_path))
    assert written and all(os.path.getsize(p) > 10_000 for p in written)


@pytest.mark.parametrize("pool, kind", [("h100:8", "8xH100 SXM"), ("v5p:8", "8xTPU v5p")])
def test_simulate_cli_prints_every_mode(pool, kind):
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "launch", "simulate.py"), "--config=configs/paper/qwenimage.py",
         f"--pool={pool}", "--micro_batches=4"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"Simulated on {kind} (4 rollout / 4 train)" in out.stdout
    for mode in plan_lib.MODES:
        assert f"| {mode}" in out.stdout
    if pool == "h100:8":  # the help text, once
        helped = subprocess.run([sys.executable, os.path.join(ROOT, "launch", "simulate.py"), "--help"],
                                cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert "--pool" in helped.stdout and "--profile" in helped.stdout
