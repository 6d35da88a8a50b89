"""The colocated training loop end to end on the tiny task: outputs, resume, bad input, NaN guard."""
import json
import math
import os
import subprocess
import sys

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from configs import tiny
from digen_jax.rewards import registry
from digen_jax.app import loop, run_checkpoints, workload
from digen_jax.app.errors import RunStopped
from digen_jax.rl import advantages as adv_lib
from digen_jax.rl import optim
from digen_jax.rl.grpo_trainer import GrpoTrainer
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
    c.rl.grad_chunk_size = 8
    c.rl.num_updates_per_batch = 1
    c.runtime.micro_batches = 1
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


def test_outputs_and_resume_match_an_uninterrupted_run(cache_dir, tmp_path, monkeypatch):
    runs, build = [], loop.Run
    monkeypatch.setattr(loop, "Run", lambda *a, **k: runs.append(build(*a, **k)) or runs[-1])
    full = loop.train(small_config(cache_dir), str(tmp_path / "full"), log=lambda _: None)
    # The executor held the live state: the run kept no host copy of the initial one (full
    # fine-tuning's weights and moments would fill a host's memory beside the offloaded moments).
    assert len(runs) == 1 and runs[0].state is None
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
        ("reward.weights", {"no_such_reward": 1.0}, r"'no_such_reward' in config key reward\.weights"),
        ("rl.group_size", 1, "rl.group_size"),
        ("rl.timestep_fraction", 1.0, "trains the last step"),
        ("sampling.sde_type", "langevin", "sampling.sde_type"),
        ("rl.grad_chunk_size", 5, "rl.grad_chunk_size"),
        ("rl.policy_loss", "trpo", "rl.policy_loss"),
        ("rl.mean_mode", "batch", "rl.mean_mode"),
        ("rl.std_mode", "prompt", "rl.std_mode"),
        ("reward.mix", "sum", r"reward\.mix must be 'reward'"),
        ("rl.learning_rate", float("nan"), r"rl\.learning_rate must be a number in \(0, inf\), got nan"),
        ("rl.learning_rate", -3e-4, r"rl\.learning_rate"),
        ("rl.clip_range", -1.0, r"rl\.clip_range"),
        ("rl.max_nonfinite_in_row", 0, r"rl\.max_nonfinite_in_row must be an integer in \[1, inf\)"),
        ("train.iterations", -3, r"train\.iterations"),
        ("train.checkpoint_every", -1, r"train\.checkpoint_every"),
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


@pytest.mark.parametrize(
    "overrides,match",
    [
        ({"sampling.sde_type": "cps"}, "sampling.sde_type"),
        ({"rl.decoupled": True}, "rl.decoupled"),
        ({"sampling.noise_level": 0.0}, "sampling.noise_level"),
        ({"rl.std_mode": "group", "rl.mean_mode": "global"}, "rl.mean_mode='global' needs rl.std_mode='global'"),
    ],
)
def test_unsupported_combinations_name_their_keys(cache_dir, overrides, match):
    c = small_config(cache_dir)
    c.rl.policy_loss = "grpo_guard"
    for key, value in overrides.items():
        section, name = key.split(".")
        c[section][name] = value
    with pytest.raises(ValueError, match=match):
        loop.validate_config(c)


def test_role_sizes_that_leave_devices_unused_fail_before_any_compute(cache_dir):
    """Role sizes are checked against the devices when the config is, not when the meshes are built."""
    c = small_config(cache_dir)
    c.runtime.update(mode="gap", micro_batches=4, rollout_devices=2, train_devices=2)
    with pytest.raises(workload.ConfigError, match=r"runtime\.rollout_devices=2, runtime\.train_devices=2.*but there are 8"):
        loop.validate_config(c)


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
    assert sum("skipped (" in line and "a non-finite reward" in line for line in logs) == 2


def test_normalising_each_reward_trains_on_their_weighted_advantages_and_logs_each(cache_dir, tmp_path, monkeypatch):
    """`reward.mix='advantage'`: the trainer's advantages are the weighted sum of each reward's
    group-normalised advantages, and every reward's mean is a metric beside the weighted total's."""
    name = "brightness_for_tests"
    if name not in registry.registered_rewards():

        @registry.register_reward(name)
        def _factory():
            return lambda images, prompts, metadata: np.asarray(images, np.float32).mean(axis=(1, 2, 3))

    calls = []
    multi = adv_lib.multi_reward_advantages

    def spy(rewards, weights, group_ids, num_groups, **kwargs):
        out = multi(rewards, weights, group_ids, num_groups, **kwargs)
        calls.append((np.asarray(rewards), np.asarray(weights), kwargs, np.asarray(out)))
        return out

    monkeypatch.setattr(adv_lib, "multi_reward_advantages", spy)
    c = small_config(cache_dir, iterations=1, eval_every=0, image_every=0, checkpoint_every=0)
    c.reward.weights = {"shapes": 1.0, name: -0.5}
    c.reward.mix = "advantage"
    loop.train(c, str(tmp_path), log=lambda _: None)
    (row,) = read_metrics(tmp_path)
    (rewards, weights, kwargs, adv), = calls
    assert kwargs["mix"] == "advantage" and list(weights) == [-0.5, 1.0]  # sorted names: brightness, shapes
    assert row[f"reward_{name}_mean"] == pytest.approx(float(rewards[0].mean()), rel=1e-6)
    assert row["reward_shapes_mean"] == pytest.approx(float(rewards[1].mean()), rel=1e-6)
    assert row["reward_mean"] == pytest.approx(row["reward_shapes_mean"] - 0.5 * row[f"reward_{name}_mean"], abs=1e-6)
    group_ids = np.repeat(np.arange(c.rl.prompts_per_iteration), c.rl.group_size)
    per_reward = [adv_lib.group_advantages(r, group_ids, c.rl.prompts_per_iteration, std_mode=c.rl.std_mode,
                                           mean_mode=c.rl.mean_mode, eps=c.rl.std_eps, ddof=c.rl.std_ddof)
                  for r in rewards]
    np.testing.assert_allclose(adv, -0.5 * per_reward[0] + per_reward[1], rtol=1e-6, atol=1e-6)
    total = adv_lib.group_advantages(rewards[1] - 0.5 * rewards[0], group_ids, c.rl.prompts_per_iteration,
                                     std_mode=c.rl.std_mode, mean_mode=c.rl.mean_mode, eps=c.rl.std_eps)
    assert np.max(np.abs(adv - total)) > 1e-3  # the other mix would have trained on other numbers


@pytest.mark.parametrize("learning_rate", [1e6, float("nan")])
def test_diverging_updates_are_skipped_and_never_checkpointed(cache_dir, tmp_path, monkeypatch, learning_rate):
    """A learning rate of 1e6 (or one that became NaN) gives finite rewards, losses and gradients
    but weights of about 1e6 (or NaN): every update is skipped on device, checkpoints hold the
    unchanged weights, and the run stops after rl.max_nonfinite_in_row skips naming the keys.
    A NaN learning rate in the config fails validation, so that case enters past it."""
    c = small_config(cache_dir, iterations=4, checkpoint_every=1, eval_every=0, image_every=0)
    c.rl.max_nonfinite_in_row = 2
    if math.isnan(learning_rate):
        make_optimizer = optim.make_optimizer
        monkeypatch.setattr(optim, "make_optimizer", lambda lr, **kw: make_optimizer(learning_rate, **kw))
        reason = r"a non-finite reward, loss, gradient or update"
    else:
        c.rl.learning_rate = learning_rate
        reason = r"over rl\.max_update_ratio=1\.0"
    with pytest.raises(FloatingPointError, match=rf"2 updates in a row.*rl\.max_nonfinite_in_row=2.*{reason}.*rl\.learning_rate"):
        loop.train(c, str(tmp_path / "run"), log=lambda _: None)
    rows = read_metrics(tmp_path / "run")
    assert [(r["skipped"], r["version"]) for r in rows] == [(1, 0), (1, 0)]
    assert all(r["update_ratio"] > 1e3 or math.isnan(learning_rate) for r in rows)
    initial = loop.Run(c, str(tmp_path / "initial"), log=lambda _: None).state.trainable
    manager = ocp.CheckpointManager(str(tmp_path / "run" / "checkpoints"))
    assert manager.all_steps() == [1]
    saved = manager.restore(1, args=ocp.args.Composite(state=ocp.args.StandardRestore()))["state"]
    jax.tree.map(np.testing.assert_array_equal, saved["trainable"], jax.device_get(initial))


def test_a_state_with_nan_is_never_saved(cache_dir, tmp_path):
    run = loop.Run(small_config(cache_dir), str(tmp_path), log=lambda _: None)
    executor = Executor(run, log=lambda _: None)
    run_checkpoints.save(executor, run.checkpoints, 1, run.config)
    leaves, treedef = jax.tree.flatten(executor.state.trainable)
    leaves[0] = leaves[0].at[(0,) * leaves[0].ndim].set(np.nan)
    executor.state = executor.state.replace(trainable=jax.tree.unflatten(treedef, leaves))
    with pytest.raises(FloatingPointError, match="checkpoint 2 not saved: the trainable weights hold NaN or inf"):
        run_checkpoints.save(executor, run.checkpoints, 2, run.config)
    run.checkpoints.wait_until_finished()
    executor.close()
    assert run.checkpoints.all_steps() == [1]


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
    metrics = jax.device_get([executor.iteration(k)[1] for k in range(10)])
    after = run.evaluate(executor.state)
    executor.close()
    rewards = [m["reward_mean"] for m in metrics]
    assert after - before > 0.1, (before, after)
    assert np.mean(rewards[-3:]) - np.mean(rewards[:3]) > 0.1, rewards
    # The second update of each batch is off-policy: the ratio figures the console prints move.
    clip = [f"{m['clip_frac']:.4f}" for m in metrics]
    approx_kl = [f"{m['approx_kl']:.2e}" for m in metrics]
    assert "0.0000" not in clip and len(set(clip)) > 1, clip
    assert "0.00e+00" not in approx_kl and len(set(approx_kl)) > 1, approx_kl
    assert all(m["logp_diff_max"] == 0 for m in metrics)  # the first update's units: exactly on-policy


def lora_config(cache_dir, **train):
    """LoRA on the configured targets, a KL to the base, two updates per batch (the second off-policy)
    with decoupled PPO and truncated importance weights; two iterations."""
    c = small_config(cache_dir, iterations=2, eval_every=0, image_every=0, checkpoint_every=0)
    c.rl.lora_rank, c.rl.kl_beta = 2, 0.05
    c.rl.lora_merge_for_sampling = False
    c.rl.num_updates_per_batch, c.rl.decoupled, c.rl.is_cap = 2, True, 2.0
    c.runtime.micro_batches = 2  # each update trains one micro-batch
    c.rl.grad_chunk_size = 6  # 4 prompts x 2 samples x 3 trained steps, halved per update
    c.rl.clip_range = 1e-3
    c.train.update(train)
    return c


def test_lora_kl_and_off_policy_updates_run_in_the_loop(cache_dir, tmp_path, monkeypatch):
    def second_forward(*args):
        raise AssertionError("the proximal log-prob is the trained pass's own: no second forward")

    monkeypatch.setattr(GrpoTrainer, "log_prob_fn", second_forward)
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


def _overrides(config) -> list[str]:
    """`--config.a.b=v` flags that turn configs/tiny.py into `config` (the keys small_config sets)."""
    keys = ("pretrain.steps", "pretrain.batch_size", "pretrain.cache_dir", "task.resolution", "sampling.num_steps",
            "rl.prompts_per_iteration", "rl.group_size", "rl.grad_chunk_size", "rl.num_updates_per_batch",
            "runtime.micro_batches", "rl.learning_rate", "train.eval_prompts")
    return [f"--config.{key}={config[key.split('.')[0]][key.split('.')[1]]}" for key in keys]


def test_sample_script_restores_the_latest_state_and_checks_its_config(cache_dir, compile_cache, tmp_path):
    """launch/sample.py as a user runs it on a training workdir: the latest checkpoint's weights
    (read without an executor), its samples scored; a config that trains another state is refused.
    The script loads the sampling programs the run compiled from the session's compilation cache."""
    config = small_config(cache_dir, iterations=2, checkpoint_every=2)
    workdir = str(tmp_path / "run")
    final = loop.train(config, workdir, log=lambda _: None)
    run = loop.Run(config, workdir, log=lambda _: None)
    restored = run_checkpoints.read_state(run.checkpoints, run.state, config)
    assert int(restored.version) == int(final.version) == 2
    jax.tree.map(np.testing.assert_array_equal, restored.trainable, jax.device_get(final.trainable))
    other = small_config(cache_dir, iterations=2, checkpoint_every=2)
    other.rl.lora_rank = 4
    with pytest.raises(RunStopped, match=r"rl\.lora_rank"):
        run_checkpoints.read_state(run.checkpoints, run.state, other)
    run.checkpoints.close()

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root,  # conftest.py's XLA flags (8 devices), so the cache's programs fit
           "JAX_DEFAULT_MATMUL_PRECISION": "highest", "JAX_COMPILATION_CACHE_DIR": compile_cache}
    result = subprocess.run([sys.executable, "launch/sample.py", "--config=configs/tiny.py", f"--workdir={workdir}",
                             *_overrides(config)], cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    with open(os.path.join(workdir, "samples.json")) as f:
        samples = json.load(f)
    assert samples["version"] == 2 and len(samples["samples"]) == config.train.eval_prompts
    assert f"policy version 2: mean reward {samples['reward_mean']:.3f}" in result.stdout
    assert "(the policy version counts optimizer updates: rl.num_updates_per_batch=" in result.stdout
