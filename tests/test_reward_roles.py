"""Where rewards run and what a failing scorer does, through the real executor and training loop.

Contract (docs/design.md sections 4 and 9): decoding runs on the `reward` role's devices when
`runtime.reward_devices > 0`, else on the devices that rolled the micro-batch out; scoring
runs on host threads while later micro-batches roll out (queue scheduling), with reward
models that run on a device (CLIP) on a device that decoded the micro-batch; a remote scorer
that stops answering fails the iteration loudly after its retry budget, and nothing is
trained or checkpointed on missing rewards.
"""
import json
import os
import re
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from test_remote_rewards import Serving, mean_pixel_score, reward_server
from test_runtime import runtime_config

from digen_jax.models import FAMILIES
from digen_jax.rewards import RemoteRewardError, clip_scores
from digen_jax.app import loop, random_init, run_checkpoints, workload
from digen_jax.app.settings import run_settings
from configs import schema
from digen_jax.runtime.executor import Executor
from digen_jax.runtime.trace import read_trace

REWARD_SECONDS = 0.25  # host scoring time: long against a tiny rollout, so overlaps are unambiguous


def random_base_model(model_cfg, task, *, seed, **_):
    """Stands in for pretraining (random weights): these tests are about placement and failure."""
    return random_init.random_params(FAMILIES["flux"], model_cfg, seed)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One Run shared by the executor tests (same weights, shared compiled rollout steps)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(workload, "pretrained_params", random_base_model)
        return loop.Run(small_config("gap"), str(tmp_path_factory.mktemp("roles")), log=lambda _: None)


def small_config(mode, **runtime):
    """tests/test_runtime.py's runtime config with a one-block model (placement, not quality)."""
    c = runtime_config("unused", mode, **runtime)  # no pretraining cache: random_base_model
    c.model.arch.num_layers = c.model.arch.num_single_layers = 1
    c.sharding.train_rules = schema.BATCH_RULES  # replicated training weights: far less to compile
    c.rl.ema = False
    c.sampling.num_steps = 8  # rollouts long enough that scoring visibly overlaps the next one
    return c


def _record_decodes(monkeypatch, run) -> list:
    """Wrap the workload's decode: each call appends (input devices, output devices)."""
    calls, decode = [], run.workload.decode

    def recording(latents, decoder_params=None):
        decoded = decode(latents, decoder_params)
        calls.append((latents.sharding.device_set, decoded.sharding.device_set))
        return decoded

    monkeypatch.setattr(run.workload, "decode", recording)
    return calls


def _record_scoring(monkeypatch, run, seconds=0.0) -> list:
    """Wrap the workload's reward (host work taking at least `seconds`): each call appends the
    scoring thread's default device, where a reward model (CLIP) runs."""
    scored_on, score = [], run.workload.reward

    def recording(pixels, ids):
        scored_on.append(clip_scores.current_device())
        time.sleep(seconds)
        return score(pixels, ids)

    monkeypatch.setattr(run.workload, "reward", recording)
    return scored_on


def _iterations(run, config, count):
    """Run `count` iterations of `config`'s mode on `run`; its role meshes and trace events."""
    executor = Executor(run, settings=run_settings(config), trace_path=None, log=lambda _: None)
    try:
        for k in range(count):
            plan, _ = executor.iteration(k)
            executor.timing(k, plan)  # waits for every task of the iteration
        return executor.meshes, executor.tracer.events
    finally:
        executor.close()


def test_decode_runs_on_reward_devices_and_scoring_overlaps_rollout(run, monkeypatch):
    config = small_config("gap", rollout_devices=4, train_devices=2, reward_devices=2, reward_workers=4)
    calls = _record_decodes(monkeypatch, run)
    scored_on = _record_scoring(monkeypatch, run, seconds=REWARD_SECONDS)
    meshes, events = _iterations(run, config, 2)  # iteration 0 compiles; iteration 1 shows the schedule

    reward_devices = set(meshes.reward.devices.flat)
    assert reward_devices.isdisjoint(meshes.rollout.devices.flat) and len(reward_devices) == 2
    assert [decoded_on for _, decoded_on in calls] == [reward_devices] * (2 * config.runtime.micro_batches)
    assert len(scored_on) == 2 * config.runtime.micro_batches and set(scored_on) <= reward_devices

    span = {(e["args"]["kind"], e["args"]["microbatch"]): (e["ts"], e["ts"] + e["dur"])
            for e in events if e["args"]["iteration"] == 1}
    for m in range(config.runtime.micro_batches - 1):
        (score_start, score_end), (roll_start, roll_end) = span[("reward", m)], span[("rollout", m + 1)]
        # Scoring m runs while m + 1 rolls out: the rollout group never waits for the reward queue.
        assert score_start < roll_end and roll_start < score_end, (m, span)


def test_without_reward_devices_decode_runs_where_the_microbatch_rolled_out(run, monkeypatch):
    # The trainer rolls out micro-batch 0 (TAG), the rollout group the rest.
    config = small_config("gap+tsp+tag", rollout_devices=4, train_devices=4, tag_microbatches=1)
    calls = _record_decodes(monkeypatch, run)
    scored_on = _record_scoring(monkeypatch, run)
    meshes, events = _iterations(run, config, 1)

    assert meshes.reward is None and len(calls) == config.runtime.micro_batches
    for rolled_on, decoded_on in calls:
        assert decoded_on == rolled_on
    rollout_devices, train_devices = set(meshes.rollout.devices.flat), set(meshes.train.devices.flat)
    rolled = sorted((e["args"]["microbatch"], e["args"]["group"]) for e in events if e["args"]["kind"] == "rollout")
    assert rolled == [(0, "train"), (1, "rollout"), (2, "rollout"), (3, "rollout")]
    # Each group dispatches from its own thread: one decode on the trainer's devices, three on rollout's, in any order.
    assert sorted(decoded_on == train_devices for _, decoded_on in calls) == [False, False, False, True]
    assert all(decoded_on in (train_devices, rollout_devices) for _, decoded_on in calls)
    # Scoring threads run in any order: one micro-batch scored on a trainer device, three on rollout ones.
    assert sorted(d in train_devices for d in scored_on) == [False, False, False, True]
    assert set(scored_on) <= train_devices | rollout_devices


def test_remote_scorer_dying_mid_run_fails_the_iteration_and_trains_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(workload, "pretrained_params", random_base_model)
    micro_batches = 2
    requests = []

    def score_then_die(images, prompts, metadata):
        requests.append(len(images))
        if len(requests) > micro_batches:  # the first request of iteration 1: the server goes away
            threading.Thread(target=lambda: (server.shutdown(), server.server_close())).start()
            raise RuntimeError("scoring model crashed")
        return mean_pixel_score(images, prompts, metadata)

    server = reward_server.make_server(score_then_die)
    saved = {}
    save = run_checkpoints.save

    def recording_save(executor, manager, iterations_done, config, **options):
        saved[iterations_done] = jax.device_get(executor.state.trainable)
        save(executor, manager, iterations_done, config, **options)

    monkeypatch.setattr(run_checkpoints, "save", recording_save)
    with Serving(server) as serving:
        c = small_config("colocated", micro_batches=micro_batches, train_devices=1)
        c.rl.prompts_per_iteration = 2
        c.train.iterations, c.train.checkpoint_every = 3, 1
        c.reward.weights = {"remote": 1.0}
        c.reward.options = {"remote": {"url": serving.url, "timeout": 2.0, "retries": 2, "backoff": 0.0}}
        workdir = str(tmp_path / "run")
        failure = rf"reward server {re.escape(serving.url)} gave no valid scores after 3 attempt"
        with pytest.raises(RemoteRewardError, match=failure):
            loop.train(c, workdir, log=lambda _: None)

    # Iteration 0 was scored, trained and checkpointed; iteration 1 wrote nothing.
    assert requests[:micro_batches] == [4] * micro_batches and len(requests) > micro_batches
    assert sorted(saved) == [1]
    # Committed by the time train raises (an exception ending the process must not lose it).
    assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["1"]
    manager = ocp.CheckpointManager(os.path.join(workdir, "checkpoints"))
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        assert [json.loads(line)["step"] for line in f] == [1]
    events = read_trace(os.path.join(workdir, "trace.json"))
    assert {e["args"]["iteration"] for e in events if e["args"]["kind"] in ("train", "update")} == {0}
    assert len([e for e in events if e["args"]["kind"] == "reward"]) == micro_batches  # only iteration 0's
    # The last good checkpoint holds exactly the weights after iteration 0's update.
    restored = manager.restore(1, args=ocp.args.Composite(state=ocp.args.StandardRestore()))["state"]
    assert int(restored["version"]) == 1
    for got, want in zip(jax.tree.leaves(restored["trainable"]), jax.tree.leaves(saved[1])):
        np.testing.assert_array_equal(got, want)


def test_reward_options_are_set_on_the_command_line():
    """`reward.options` is a schema key (empty by default), so a converted reward checkpoint is
    named by an override, as the weights are: `--config.reward.options={...}`."""
    assert dict(schema.config().reward.options) == {}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    printed = subprocess.run(
        [sys.executable, "launch/train.py", "--config=configs/sd35.py:tiny", "--print_config",
         "--config.reward.weights={'image_reward': 1.0, 'hpsv2': 0.5}",
         "--config.reward.options={'image_reward': {'checkpoint_dir': '/ckpt/ir'}, 'hpsv2': {'dtype': 'bfloat16'}}"],
        cwd=root, env=dict(os.environ, PYTHONPATH=root, JAX_PLATFORMS="cpu"), capture_output=True, text=True,
        timeout=300)
    assert printed.returncode == 0, printed.stderr[-2000:]
    lines = set(printed.stdout.splitlines())
    assert {"reward.options.image_reward.checkpoint_dir = '/ckpt/ir'", "reward.options.hpsv2.dtype = 'bfloat16'",
            "reward.weights.image_reward = 1.0", "reward.weights.hpsv2 = 0.5"} <= lines, printed.stdout


def test_reward_options_reach_their_reward_and_are_checked():
    c = small_config("colocated")
    c.reward.weights = {"shapes": 1.0, "remote": 0.5}
    c.reward.options = {"remote": {"url": "http://127.0.0.1:1/score", "retries": 0}}
    assert workload.reward_options(c) == {"remote": {"url": "http://127.0.0.1:1/score", "retries": 0}}
    loop.validate_config(c)
    c.reward.options = {"clipscore": {"checkpoint_dir": "/ckpt"}}
    with pytest.raises(workload.ConfigError, match=r"reward.options names 'clipscore', which is not in reward.weights"):
        loop.validate_config(c)
    c.reward.weights = {"remote": 1.0}
    c.reward.options = {}
    with pytest.raises(ValueError, match="reward 'remote' needs the option url"):
        workload.make_reward_fn(c)


def test_clip_reward_scores_on_the_calling_threads_default_device(monkeypatch):
    cfg = FAMILIES["clip"].variants["tiny"]
    params = {"clip": random_init.random_params(FAMILIES["clip"], cfg, 0)}
    jitted, ran_on = clip_scores.jitted_score_fn(clip_scores.SCORERS["clipscore"], cfg), []

    def recording(scorer, cfg):
        def score(*args):
            out = jitted(*args)
            ran_on.append(out.sharding.device_set)
            return out
        return score

    monkeypatch.setattr(clip_scores, "jitted_score_fn", recording)
    reward = clip_scores.build_clip_reward(clip_scores.SCORERS["clipscore"], cfg, params)
    images = np.random.default_rng(0).integers(0, 256, size=(2, 32, 32, 3), dtype=np.uint8)
    metadata = [{"prompt_tokens": np.arange(1, 17, dtype=np.int32) * (i + 1) % 90} for i in range(2)]
    on_first = reward(images, ["a", "b"], metadata)
    reward_device = jax.devices()[6]
    with jax.default_device(reward_device):  # as the executor's reward threads score
        on_reward_device = reward(images, ["a", "b"], metadata)
    assert ran_on == [{jax.devices()[0]}, {reward_device}]
    np.testing.assert_allclose(on_reward_device, on_first, rtol=1e-6)
