"""The memory plan (runtime/memory_plan.py): bytes per device of every role, checked by hand for
Qwen-Image-20B full fine-tuning, pinned for every model-zoo config, and what the simulator and
the launchers do with a plan that does not fit."""
import dataclasses
import importlib
import subprocess
import sys
import types

import pytest

from digen_jax.app import machine_checks, run_sizing
from digen_jax.app.errors import ConfigError
from digen_jax.runtime import memory_plan as mp
from digen_jax.runtime import simulator as sim
from digen_jax.runtime.task_costs import GIB, Pool

FSDP = (("activation_batch", "data"), ("embed", "data"))
HOST = 512 * GIB  # the host memory of a 4-GPU machine, not this one's
FULL = "gap+tsp+tag+tcss"


def qwen_full_ft(**rl):
    """Qwen-Image-20B full fine-tuning with FSDP train rules and no CFG (the peers' setting)."""
    c = importlib.import_module("configs.qwenimage").get_config()
    c.rl.lora_rank = 0
    c.sharding.train_rules = FSDP
    c.sampling.cfg_scale = 1.0
    c.rl.update(rl)
    return c


def test_qwen_image_full_fine_tuning_by_hand():
    """20.4B weights: 41 GB in bf16. On 4 H100s colocated each device holds a quarter of the
    weights, of the gradient sum and of two moments (bf16: 2 bytes each, float32: 4); offloaded,
    the moments are host bytes instead. The frozen KL reference is sharded like the weights."""
    w = run_sizing.iteration_work(qwen_full_ft())
    assert 20.3e9 < w.params < 20.5e9 and w.trainable == w.params and w.param_bytes == 2
    assert 40.6e9 < 2 * w.params < 41.0e9
    pool = Pool.parse("h100:4")
    shared = mp.memory_plan(w, pool, "colocated", 8).role("shared")
    assert shared.devices == 4 and shared.weight_shards == 4
    assert shared.weights == pytest.approx(2 * w.params / 4)  # 10.2 GB
    assert shared.gradients == pytest.approx(2 * w.params / 4)
    assert shared.optimizer == pytest.approx(2 * 2 * w.params / 4)  # bf16 moments ('param'): 20.4 GB
    assert shared.copies == shared.rollout_copy == shared.sync_buffers == shared.host == 0
    assert shared.capacity == pytest.approx(0.85 * 80e9)

    f32 = run_sizing.iteration_work(qwen_full_ft(optimizer_state_dtype="float32"))
    assert mp.memory_plan(f32, pool, "colocated", 8).role("shared").optimizer == pytest.approx(2 * 4 * w.params / 4)
    c = qwen_full_ft(optimizer_state_dtype="float32")
    c.runtime.offload_optimizer = True
    off = mp.memory_plan(run_sizing.iteration_work(c), pool, "colocated", 8).role("shared")
    assert off.optimizer == 0 and off.host == pytest.approx(2 * 4 * w.params / 4)  # 40.8 GB of host memory per device
    kl = mp.memory_plan(run_sizing.iteration_work(qwen_full_ft(kl_beta=0.01)), pool, "colocated", 8).role("shared")
    assert kl.copies == pytest.approx(2 * w.params / 4)  # the reference: sharded, never replicated


def test_disaggregated_rollout_role_holds_whole_weights_and_the_next_version():
    """The rollout role samples with whole weights (bf16, or e4m3 with FP8 rollouts: one byte a
    weight) and receives the next version beside them; it holds no gradients or optimizer state."""
    w = run_sizing.iteration_work(qwen_full_ft())
    plan = mp.memory_plan(w, Pool.parse("h200:8/rollout=2"), FULL, 8)
    rollout, train = plan.role("rollout"), plan.role("train")
    assert rollout.weights == pytest.approx(2 * w.params) and rollout.sync_buffers == pytest.approx(2 * w.params)
    assert rollout.gradients == rollout.optimizer == rollout.host == 0
    assert train.devices == 6 and train.weights == pytest.approx(2 * w.params / 6)
    c = qwen_full_ft()
    c.model.rollout_precision = "fp8"
    fp8 = mp.memory_plan(run_sizing.iteration_work(c), Pool.parse("h200:8/rollout=2"), FULL, 8).role("rollout")
    assert fp8.weights == pytest.approx(w.params) and fp8.sync_buffers == pytest.approx(w.params)


def test_auto_colocated_sampling_gathers_where_the_copy_fits():
    """Colocated Qwen-Image-20B full fine-tuning: 'auto' gathers one whole bf16 copy for sampling
    on 4 H200s (it fits beside the sharded train state) and samples from the sharded weights on 4
    H100s (it does not). The copy counts in sampling's working set, not as resident weights; LoRA
    never gathers; an explicit value is kept."""
    w = run_sizing.iteration_work(qwen_full_ft())
    assert w.colocated_sampling == "auto"
    h200, h100 = Pool.parse("h200:4"), Pool.parse("h100:4")
    assert mp.colocated_sampling(w, h200, 8) == "gathered" and mp.colocated_sampling(w, h100, 8) == "sharded"
    gathered, sharded = mp.memory_plan(w, h200, "colocated", 8), mp.memory_plan(w, h100, "colocated", 8)
    assert gathered.colocated_sampling == "gathered" and sharded.colocated_sampling == "sharded"
    g, s = gathered.role("shared"), sharded.role("shared")
    assert g.weights == s.weights and g.rollout_copy == s.rollout_copy == 0
    # sampling's working set: the whole bf16 copy and one block's outputs per sample, no gradients alive
    assert 2 * w.params - g.gradients < g.activations < 2 * w.params
    assert "colocated sampling: gathered" in gathered.table()
    forced = mp.memory_plan(dataclasses.replace(w, colocated_sampling="gathered"), h100, "colocated", 8)
    assert not forced.fits and forced.colocated_sampling == "gathered"
    assert "--config.runtime.colocated_sampling=sharded" in mp.advice(
        dataclasses.replace(w, colocated_sampling="gathered"), h100, "colocated", 8)
    lora = run_sizing.iteration_work(importlib.import_module("configs.qwenimage").get_config())
    assert mp.colocated_sampling(lora, h200, 8) == "sharded"


# GiB per device of each role's weights, gradients, optimizer, copies, rollout copy, activations,
# sync buffers and host bytes, for every zoo config on 8 H100s (an even split when disaggregated).
PINNED = {
    ("flux", "colocated"): {"shared": (22.6, 0.5, 1.0, 0.5, 0.0, 5.2, 0.0, 0.0)},
    ("flux", FULL): {"rollout": (22.6, 0.0, 0.0, 0.0, 0.0, 11.4, 0.5, 0.0), "train": (22.6, 0.5, 1.0, 0.5, 0.0, 10.9, 0.0, 0.0)},
    ("flux_nft", "colocated"): {"shared": (22.6, 0.5, 1.0, 1.0, 0.0, 5.2, 0.0, 0.0)},
    ("flux_nft", FULL): {"rollout": (22.6, 0.0, 0.0, 0.0, 0.0, 11.4, 0.5, 0.0), "train": (22.6, 0.5, 1.0, 1.0, 0.0, 10.9, 0.0, 0.0)},
    ("qwenimage", "colocated"): {"shared": (38.8, 0.8, 1.6, 0.0, 0.0, 1.9, 0.0, 0.0)},
    ("qwenimage", FULL): {"rollout": (38.8, 0.0, 0.0, 0.0, 0.0, 3.8, 0.8, 0.0), "train": (38.8, 0.8, 1.6, 0.0, 0.0, 3.1, 0.0, 0.0)},
    ("qwenimage_nft", "colocated"): {"shared": (38.8, 0.8, 1.6, 1.6, 0.0, 1.9, 0.0, 0.0)},
    ("qwenimage_nft", FULL): {"rollout": (38.8, 0.0, 0.0, 0.0, 0.0, 1.9, 0.8, 0.0), "train": (38.8, 0.8, 1.6, 1.6, 0.0, 3.1, 0.0, 0.0)},
    ("wan21", "colocated"): {"shared": (26.9, 0.3, 0.6, 0.3, 0.0, 10.2, 0.0, 0.0)},
    ("wan21", FULL): {"rollout": (26.9, 0.0, 0.0, 0.0, 0.0, 20.9, 0.3, 0.0), "train": (26.9, 0.3, 0.6, 0.3, 0.0, 20.7, 0.0, 0.0)},
    ("hunyuanvideo", "colocated"): {"shared": (24.4, 0.5, 1.0, 0.0, 0.0, 7.8, 0.0, 0.0)},
    ("hunyuanvideo", FULL): {"rollout": (24.4, 0.0, 0.0, 0.0, 0.0, 9.0, 0.5, 0.0), "train": (24.4, 0.5, 1.0, 0.0, 0.0, 8.5, 0.0, 0.0)},
    ("sd35", "colocated"): {"shared": (4.2, 0.0, 0.1, 0.0, 0.0, 6.2, 0.0, 0.0)},
    ("sd35", FULL): {"rollout": (4.2, 0.0, 0.0, 0.0, 0.0, 12.5, 0.0, 0.0), "train": (4.2, 0.0, 0.1, 0.0, 0.0, 12.5, 0.0, 0.0)},
    ("sd35_nft", "colocated"): {"shared": (4.2, 0.0, 0.1, 0.1, 0.0, 3.1, 0.0, 0.0)},
    ("sd35_nft", FULL): {"rollout": (4.2, 0.0, 0.0, 0.0, 0.0, 6.3, 0.0, 0.0), "train": (4.2, 0.0, 0.1, 0.1, 0.0, 6.2, 0.0, 0.0)},
    ("flux_full", "colocated"): {"shared": (2.8, 2.8, 11.1, 2.8, 0.0, 25.1, 0.0, 0.0)},  # samples from a gathered copy
    ("flux_full", FULL): {"rollout": (22.2, 0.0, 0.0, 0.0, 0.0, 11.4, 22.2, 0.0), "train": (5.5, 5.5, 22.2, 5.5, 0.0, 11.5, 0.0, 0.0)},
    ("qwenimage_full", "colocated"): {"shared": (4.8, 4.8, 19.0, 0.0, 0.0, 34.2, 0.0, 0.0)},  # gathered copy
    ("qwenimage_full", FULL): {"rollout": (38.0, 0.0, 0.0, 0.0, 0.0, 1.9, 38.0, 0.0), "train": (9.5, 9.5, 38.0, 0.0, 0.0, 14.3, 0.0, 0.0)},  # does not fit
}


@pytest.mark.parametrize("name,mode", sorted(PINNED))
def test_zoo_config_memory_plans_are_pinned(name, mode):
    config = importlib.import_module(f"configs.{name}").get_config()
    plan = run_sizing.memory_plan(config, Pool.parse("h100:8"), mode)
    got = {r.role: tuple(round(getattr(r, f) / GIB, 1) for f in mp.RoleMemory.FIELDS + ("host",)) for r in plan.roles}
    assert got == PINNED[(name, mode)]
    # The zoo's configs fit 8 80 GB cards, except Qwen-Image-20B full fine-tuning's rollout role
    # (a whole bf16 copy and the next version beside it: 78 GiB).
    assert plan.fits == ((name, mode) != ("qwenimage_full", FULL))


def test_simulator_predicts_no_speed_for_a_mode_that_does_not_fit():
    """Qwen-Image-20B full fine-tuning, float32 moments, on 4 H200s: colocated fits, the
    disaggregated train role of 2 devices does not; autosize keeps to splits that fit (3 train
    devices); on 4 H100s no split does (the fastest comes back marked)."""
    w = run_sizing.iteration_work(qwen_full_ft(optimizer_state_dtype="float32"))
    pool = Pool.parse("h200:4")
    assert sim.simulate(w, pool, "colocated").fits
    p = sim.simulate(w, pool, FULL)
    assert not p.fits and p.memory.over().role == "train"
    assert p.as_dict()["fits"] is False
    sizing = sim.autosize(w, pool)
    assert sizing.prediction.fits and (sizing.rollout_devices, sizing.train_devices) == (1, 3)
    assert not sim.autosize(w, Pool.parse("h100:4")).prediction.fits


def _gpus(n, kind="NVIDIA H100 80GB HBM3"):
    return [types.SimpleNamespace(platform="gpu", device_kind=kind)] * n


def test_one_gpu_has_no_trainer_assisted_rollouts_to_size():
    """A colocated run on one GPU asks what trainer-assisted rollouts would sample in; with no
    device for a second role the answer is the default, not an error."""
    c = importlib.import_module("configs.sd35").get_config()
    c.runtime.update(rollout_devices=0, train_devices=0)
    assert run_sizing.tag_precision(c, _gpus(1, "NVIDIA H200")) == "rollout"
    assert run_sizing.local_pool(c, _gpus(2, "NVIDIA H200"), FULL)[0].train_devices == 1


def test_launch_check_refuses_with_one_line_saying_what_to_change():
    c = qwen_full_ft(optimizer_state_dtype="float32")
    c.runtime.update(mode=FULL, rollout_devices=4, train_devices=12)
    with pytest.raises(ConfigError) as e:
        machine_checks.check_fits(c, _gpus(16), host=HOST)
    line = str(e.value)
    assert "\n" not in line and "rollout role needs" in line and "--config.model.rollout_precision=fp8" in line
    c.model.rollout_precision = "fp8"
    machine_checks.check_fits(c, _gpus(16), host=HOST)  # fits now
    c.runtime.update(mode="colocated", rollout_devices=0, train_devices=0)
    with pytest.raises(ConfigError, match="shared role needs"):
        machine_checks.check_fits(c, _gpus(2), host=HOST)
    c.runtime.check_memory = False
    machine_checks.check_fits(c, _gpus(2), host=HOST)
    c.runtime.check_memory = True
    machine_checks.check_fits(c, [types.SimpleNamespace(platform="cpu", device_kind="cpu")] * 2)  # CPU runs: no plan


def test_host_memory_is_planned_for_the_initial_weights_and_offloaded_moments():
    """One process holds the initial trainable weights until they are placed and every device's
    offloaded moments: FLUX.1-dev full fine-tuning on one H200 (bf16 moments offloaded, no EMA)
    plans 66.5 GiB and fits a 125 GiB host, as it ran (peak 119 GiB, benchmarks/README.md);
    Qwen-Image-20B on 4 H200s with float32 moments offloaded needs 190 GiB, which a 125 GiB host
    refuses in one line and a 512 GiB one takes."""
    c = importlib.import_module("configs.flux_full").get_config()
    c.rl.update(prompts_per_iteration=2, group_size=8, optimizer_state_dtype="param", ema=False)
    c.runtime.update(micro_batches=2, offload_optimizer=True, rollout_devices=0, train_devices=0)
    w = run_sizing.iteration_work(c)
    pool, n = run_sizing.local_pool(c, _gpus(1, "NVIDIA H200"), "colocated")
    plan = mp.memory_plan(w, pool, "colocated", 2, colocated_devices=n)
    moments = 2 * 2 * w.trainable
    assert plan.role("shared").host == pytest.approx(moments)
    assert mp.host_bytes(w, plan) == pytest.approx(2 * w.trainable + moments) and 66 < mp.host_bytes(w, plan) / GIB < 67
    machine_checks.check_fits(c, _gpus(1, "NVIDIA H200"), host=125 * GIB)

    q = qwen_full_ft(optimizer_state_dtype="float32")
    q.runtime.update(mode="colocated", offload_optimizer=True, rollout_devices=0, train_devices=0)
    with pytest.raises(ConfigError) as e:
        machine_checks.check_fits(q, _gpus(4, "NVIDIA H200"), host=125 * GIB)
    line = str(e.value)
    assert "\n" not in line and "the host needs 190.2 GiB" in line and "memory_plan.USABLE_HOST" in line
    assert "--config.rl.optimizer_state_dtype=param" in line
    machine_checks.check_fits(q, _gpus(4, "NVIDIA H200"), host=512 * GIB)


def test_simulate_prints_the_memory_plan_and_marks_what_does_not_fit():
    out = subprocess.run(
        [sys.executable, "launch/simulate.py", "--config=configs/qwenimage.py", "--config.rl.lora_rank=0",
         f"--config.sharding.train_rules={FSDP}", "--config.rl.optimizer_state_dtype=float32", "--pool=h200:4"],
        capture_output=True, text=True, check=True,
    ).stdout
    assert f"| {FULL} | does not fit: train needs" in out
    assert "| colocated (fsdp_sampling) | " in out and "Memory plan, GiB per device" in out
    assert "| train | 2 | 19.0 | 19.0 | 76.1 |" in out  # 20.4B weights over 2 devices: bf16, gradients, f32 moments


def test_full_fine_tuning_zoo_configs_follow_the_peers_recipe(tmp_path):
    """configs/{qwenimage,flux}_full.py: every weight trained and sharded (FSDP), no CFG, 512 px,
    10 steps, lr 3e-5, clip range 1e-5, float32 moments; the tiny variant trains one iteration
    through the real entry point with float32 moments for every weight."""
    import jax
    import numpy as np

    from digen_jax.app import loop
    from digen_jax.runtime import mesh as mesh_lib

    for name in ("qwenimage_full", "flux_full"):
        c = importlib.import_module(f"configs.{name}").get_config()
        assert c.rl.lora_rank == 0 and mesh_lib.shards_weights(c.sharding.train_rules), name
        assert (c.sampling.cfg_scale, c.sampling.height, c.sampling.width, c.sampling.num_steps) == (1.0, 512, 512, 10)
        assert (c.rl.learning_rate, c.rl.clip_range, c.rl.optimizer_state_dtype) == (3e-5, 1e-5, "float32"), name
    c = importlib.import_module("configs.qwenimage_full").get_config("tiny")
    c.model.dtype = c.model.param_dtype = "bfloat16"  # float32 moments beside bf16 weights
    state = loop.train(c, str(tmp_path), log=lambda _: None)
    weights = jax.tree.leaves(state.trainable)
    moments = [x for x in jax.tree.leaves(state.opt_state) if x.ndim]
    assert {x.dtype for x in weights} == {np.dtype(jax.numpy.bfloat16)} and len(moments) == 2 * len(weights)
    assert {x.dtype for x in moments} == {np.dtype(np.float32)}
    assert int(state.version) == 1


def test_fp8_lora_base_is_the_only_copy_and_fits_one_80gb_card():
    """Qwen-Image-20B LoRA colocated on one H100, 4 x 8 images: bf16 fits; FP8 rollouts over a bf16
    base hold an e4m3 copy beside it and do not fit (as on the card); the FP8 base
    (`model.lora_base_precision='fp8'`) is one byte per weight with no second copy, fits, and is
    what the refusal suggests."""
    def config(**model):
        c = importlib.import_module("configs.qwenimage").get_config()
        c.rl.prompts_per_iteration, c.rl.group_size = 4, 8
        c.runtime.update(micro_batches=4, rollout_devices=0, train_devices=0)
        c.model.update(model)
        return c

    def shared(c):
        return mp.memory_plan(run_sizing.iteration_work(c), Pool.parse("h100:2"), "colocated", 4,
                              colocated_devices=1).role("shared")

    bf16, fp8_rollouts = shared(config()), shared(config(rollout_precision="fp8"))
    fp8_base = shared(config(rollout_precision="fp8", lora_base_precision="fp8"))
    w = run_sizing.iteration_work(config())
    assert bf16.fits and not fp8_rollouts.fits and fp8_base.fits
    assert fp8_rollouts.rollout_copy == pytest.approx(w.params) and fp8_base.rollout_copy == 0
    assert fp8_base.weights == pytest.approx(bf16.weights - w.params)  # 1 byte a base weight, not 2
    with pytest.raises(ConfigError) as e:
        machine_checks.check_fits(config(rollout_precision="fp8"), _gpus(1), host=HOST)
    assert "--config.model.lora_base_precision=fp8" in str(e.value)
    machine_checks.check_fits(config(rollout_precision="fp8", lora_base_precision="fp8"), _gpus(1), host=HOST)


def test_a_pair_of_experts_is_held_synced_and_trained_whole_and_one_runs_each_forward():
    """Wan2.2-T2V-A14B is two Wan2.1-14B experts: every copy holds, syncs and trains both, while
    a forward (and its FSDP gathers) reads one, so its FLOPs are one expert's."""
    from digen_jax.runtime import task_costs

    one = importlib.import_module("configs.wan21").get_config()
    pair = importlib.import_module("configs.wan22").get_config("t2v_a14b")
    for c in (one, pair):  # the same sampling and training work apart from the experts
        c.sampling.update(num_steps=20, cfg_scale=5.0, cfg_scale_2=None)
    w1, w2 = run_sizing.iteration_work(one), run_sizing.iteration_work(pair)
    assert (w1.experts, w2.experts) == (1, 2)
    assert w2.params == pytest.approx(2 * w1.params) and w2.trainable == pytest.approx(2 * w1.trainable)
    assert w2.forward_params == pytest.approx(w1.params) and w2.step_flops == pytest.approx(w1.step_flops)
    pool = Pool.parse("h200:8/rollout=4")
    assert task_costs.sync_s(w2, pool, task_costs.Efficiency()) > 1.9 * task_costs.sync_s(w1, pool, task_costs.Efficiency())
    for role in ("rollout", "train"):
        held = [mp.memory_plan(w, pool, FULL, 4).role(role).weights for w in (w1, w2)]
        assert held[1] == pytest.approx(2 * held[0]), role
