"""The colocated training loop end to end on the tiny task: outputs, resume, bad input, NaN guard."""
import json
import os

import jax
import numpy as np
import pytest

from configs import tiny
from digen_jax.rewards import registry
from digen_jax.rl import loop, workload
from digen_jax.runtime.executor import Executor


def small_config(cache_dir, **train):
    """configs/tiny.py shrunk for mechanics tests: a few pretraining steps, 4 prompts x 2."""
    c = tiny.get_config()
    c.pretrain.steps = 3
    c.pretrain.batch_size = 8
    c.pretrain.cache_dir = str(cache_dir)
    c.task.resolution = 16
    c.sampling.num_steps = 4
    c.rl.prompts_per_iteration = 4
    c.rl.group_size = 2
    c.rl.micro_batch_size = 8
    c.rl.learning_rate = 1e-3
    c.train.iterations = 4
    c.train.eval_every = 2
    c.train.eval_prompts = 4
    c.train.image_every = 2
    c.train.checkpoint_every = 2
    c.train.update(train)
    return c


@pytest.fixture(scope="module")
def cache_dir(pretrain_cache_dir):
    return pretrain_cache_dir


def read_metrics(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_outputs_and_resume_match_an_uninterrupted_run(cache_dir, tmp_path):
    full = loop.train(small_config(cache_dir), str(tmp_path / "full"), log=lambda _: None)
    rows = read_metrics(tmp_path / "full")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for key in ("step", "reward_mean", "reward_std", "loss", "kl", "clip_frac", "samples_per_s", "version"):
        assert all(np.isfinite(r[key]) for r in rows), key
    assert rows[-1]["version"] == 4 and "eval_reward_mean" in rows[1]
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(tmp_path / "full" / "tb"))
    assert sorted(os.listdir(tmp_path / "full" / "checkpoints")) == ["2", "4"]

    # Stop after 2 iterations, then resume to 4 in the same workdir.
    loop.train(small_config(cache_dir, iterations=2), str(tmp_path / "resumed"), log=lambda _: None)
    logs = []
    resumed = loop.train(small_config(cache_dir), str(tmp_path / "resumed"), log=logs.append)
    assert any("resumed from" in line for line in logs)
    assert [r["step"] for r in read_metrics(tmp_path / "resumed")] == [1, 2, 3, 4]
    assert int(resumed.version) == int(full.version) == 4
    jax.tree.map(np.testing.assert_array_equal, resumed.trainable, full.trainable)


@pytest.mark.parametrize(
    "key,value,match",
    [
        ("reward.weights", {"no_such_reward": 1.0}, "reward.names"),
        ("rl.group_size", 1, "rl.group_size"),
        ("rl.timestep_fraction", 1.0, "trains the last step"),
        ("sampling.sde_type", "langevin", "sampling.sde_type"),
        ("rl.micro_batch_size", 5, "rl.micro_batch_size"),
    ],
)
def test_bad_config_fails_before_any_compute(cache_dir, tmp_path, monkeypatch, key, value, match):
    def no_compute(*args, **kwargs):
        raise AssertionError("pretraining started before the config was validated")

    monkeypatch.setattr(workload, "pretrained_params", no_compute)
    c = small_config(cache_dir)
    section, name = key.split(".")
    if key == "reward.weights":
        c.reward.weights = value
    else:
        c[section][name] = value
    with pytest.raises(ValueError, match=match):
        loop.train(c, str(tmp_path), log=lambda _: None)


def test_nonfinite_rewards_skip_updates_then_stop(cache_dir, tmp_path):
    name = "always_nan_for_tests"
    if name not in registry.registered_rewards():

        @registry.register_reward(name)
        def _factory():
            return lambda images, prompts, metadata: np.full(len(images), np.nan, np.float32)

    c = small_config(cache_dir, iterations=6, checkpoint_every=0)
    c.reward.weights = {name: 1.0}
    c.rl.max_nonfinite_in_row = 2
    logs = []
    with pytest.raises(FloatingPointError, match="2 updates in a row"):
        loop.train(c, str(tmp_path), log=logs.append)
    rows = read_metrics(tmp_path)
    assert [r["skipped"] for r in rows] == [1, 1] and rows[-1]["version"] == 0
    assert sum("skipped: non-finite" in line for line in logs) == 2


def test_tiny_demo_raises_reward(tiny_pretrained_cache, tmp_path):
    """The README demo's recipe, seeded and cut to 10 iterations, must clearly raise the reward.
    Its pretrained base model comes from the cache conftest.py fills in the background with the
    same config.

    Margins (0.1 each, about half the rise this run shows): (a) the eval reward, deterministic
    ODE samples of 32 fixed prompts and noises before vs after, is a paired comparison, so
    sampling noise cancels and only learning moves it; (b) the mean training reward of the last
    3 iterations vs the first 3 (192 samples each, per-sample std about 0.2, so the standard
    error of the difference is about 0.02 and 0.1 is 5 of them).
    """
    c = tiny.get_config()
    c.pretrain.cache_dir = tiny_pretrained_cache
    c.rl.ema = False  # evaluate the trained weights themselves, not a lagging average
    run = loop.Run(c, str(tmp_path / "run"), log=lambda _: None)
    executor = Executor(run, log=lambda _: None)
    before = run.evaluate(executor.state)
    rewards = [executor.iteration(k)[1]["reward_mean"] for k in range(10)]
    after = run.evaluate(executor.state)
    executor.close()
    assert after - before > 0.1, (before, after)
    assert np.mean(rewards[-3:]) - np.mean(rewards[:3]) > 0.1, rewards


def lora_config(cache_dir, **train):
    """LoRA on the configured targets, a KL to the base, two updates per batch (the second off-policy)
    with decoupled PPO and truncated importance weights; two iterations."""
    c = small_config(cache_dir, iterations=2, eval_every=0, image_every=0, checkpoint_every=0)
    c.rl.lora_rank, c.rl.kl_beta = 2, 0.05
    c.rl.lora_merge_for_sampling = False
    c.rl.num_updates_per_batch, c.rl.decoupled, c.rl.is_cap = 2, True, 2.0
    c.runtime.micro_batches = 2  # each update trains one micro-batch
    c.rl.micro_batch_size = 6  # 4 prompts x 2 samples x 3 trained steps, halved per update
    c.rl.clip_range = 1e-3
    c.train.update(train)
    return c


def test_lora_kl_and_off_policy_updates_run_in_the_loop(cache_dir, tmp_path):
    c = lora_config(cache_dir)
    state = loop.train(c, str(tmp_path), log=lambda _: None)
    rows = read_metrics(tmp_path)
    assert [r["version"] for r in rows] == [2, 4]
    assert set(jax.tree.leaves(jax.tree.map(lambda x: x.ndim, state.trainable))) <= {2, 3}  # adapters only
    assert all(np.isfinite(r["kl"]) for r in rows) and rows[-1]["kl"] > 0
    # Decoupled PPO: the ratio is against the policy at the start of each update (so it is 1),
    # while the second update's samples carry behaviour->proximal importance weights != 1.
    assert all(abs(r["ratio_mean"] - 1) < 1e-5 for r in rows)
    assert all(abs(r["is_weight_mean"] - 1) > 1e-7 for r in rows)
