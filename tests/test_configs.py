"""The four model-zoo configs: full-size validation (abstract shapes only), one tiny Flow-GRPO
iteration per family through `loop.train` (VAE decode and reward included), an embedding-cache
run, and the bad-input errors, which must come before any device work."""
import importlib.util
import dataclasses
import json
import os
import subprocess
import sys
import types

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs.sections import tpu_overrides
from digen_jax.data import write_cache
from digen_jax.models import FAMILIES, save_checkpoint
from digen_jax.app import loop, workload
from digen_jax.app.errors import ConfigError
from digen_jax.app import families, random_init
from digen_jax.rl import lora
from digen_jax.runtime import mesh as mesh_lib
from digen_jax.rl.rollout import Conditioning, make_denoiser

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = {"flux": "flux", "qwenimage": "qwenimage", "wan": "wan21", "hunyuan_video": "hunyuanvideo", "sd3": "sd35"}
# Released transformer sizes (docs/models.md section 1); FLUX.1-dev's is its guidance-distilled variant's.
PARAMS = {"flux": 11_901_408_320, "qwenimage": 20_430_401_088, "wan": 14_288_491_584, "hunyuan_video": 12_821_012_544,
          "sd3": 2_243_171_520}


def get_config(family: str, size: str = "full", files: dict = CONFIGS):
    """configs/<files[family]>.py's config of `size`."""
    path = os.path.join(ROOT, "configs", files[family] + ".py")
    spec = importlib.util.spec_from_file_location(f"config_{files[family]}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(size)


def read_metrics(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.fixture
def no_device_work(monkeypatch):
    """Fail the test if weights are drawn or read: validation must stop bad input first."""

    def forbidden(*args, **kwargs):
        raise AssertionError("weights were built before the config was validated")

    monkeypatch.setattr(random_init, "random_params", forbidden)
    monkeypatch.setattr(workload, "load_checkpoint", forbidden)


# Clip-length sizes of the video configs: (frames, height, width, runtime.seq_parallel it is sized for).
LONG_SIZES = {
    ("wan", "81f_480p"): (81, 480, 832, 2),
    ("wan", "81f_720p"): (81, 720, 1280, 4),
    ("hunyuan_video", "81f"): (81, 480, 848, 2),
}


@pytest.mark.parametrize("family,size", [(f, "full") for f in sorted(CONFIGS)] + sorted(LONG_SIZES))
def test_full_size_config_validates_and_fits_its_model(family, size):
    """At full size (and the video configs' 81-frame sizes), with no weights: the config validates,
    the latents fit the transformer and the VAE (jax.eval_shape), the LoRA targets match, and the
    parameter count is the released model's."""
    c = get_config(family, size)
    assert c.model.family == family and not c.model.random_init and not c.data.random_embeddings
    c.model.random_init = c.data.random_embeddings = True
    loop.validate_config(c, this_machine=False)  # a config for GPUs: its memory is not this machine's

    s, zoo = c.sampling, families.ZOO[family]
    model_cfg, vae_cfg = families.model_config(c), families.vae_config(c)
    shape = families.latent_shape(c, vae_cfg)
    if size != "full":
        frames, height, width, seq_parallel = LONG_SIZES[family, size]
        assert (s.num_frames, s.height, s.width, c.model.remat_policy) == (frames, height, width, "full")
        assert c.runtime.seq_parallel == seq_parallel
        assert c.rl.grad_chunk_size <= get_config(family).rl.grad_chunk_size  # longer clips: no more units per chunk
    if zoo.video:
        assert shape == (16, (s.num_frames - 1) // 4 + 1, s.height // 8, s.width // 8)  # 33 frames -> 9 latent frames
    else:
        assert shape == (s.height * s.width // 256, 64)
    fam = FAMILIES[family]
    params = nn.unbox(fam.abstract_params(model_cfg))
    assert sum(int(np.prod(p.shape)) for p in jax.tree.leaves(params)) == PARAMS[family]
    assert lora.match_lora_targets(params, list(c.rl.lora_targets))

    text_dim = getattr(model_cfg, zoo.text_dim)
    pooled = jax.ShapeDtypeStruct((1, getattr(model_cfg, zoo.pooled_dim)), jnp.float32) if zoo.pooled_dim else None
    mask = jax.ShapeDtypeStruct((1, c.data.text_len), jnp.int32) if family in ("qwenimage", "hunyuan_video") else None
    cond = Conditioning(jax.ShapeDtypeStruct((1, c.data.text_len, text_dim), jnp.float32), pooled, mask)
    grid = None if zoo.video else (s.height // 16, s.width // 16)
    denoiser = make_denoiser(fam, fam.module_cls(model_cfg), guidance=s.guidance, image_grid=grid)
    latents = jax.ShapeDtypeStruct((1, *shape), jnp.float32)
    velocity = jax.eval_shape(denoiser, params, latents, cond, jax.ShapeDtypeStruct((1,), jnp.float32))
    assert velocity.shape == (1, *shape)

    vae_family = FAMILIES[families.ZOO[family].vae_family]
    vae_params = nn.unbox(vae_family.abstract_params(vae_cfg))
    decode = families.decoder(family, vae_cfg, s.height, s.width)
    frames = jax.eval_shape(decode, vae_params, latents)
    assert frames.shape == (1, 3, s.num_frames if zoo.video else 1, s.height, s.width)


def assert_one_on_policy_lora_iteration(workdir, state) -> None:
    """The metrics row and trained state of one Flow-GRPO iteration of a zoo config at `:tiny`
    (jpeg_compressibility reward, LoRA): one update, nothing skipped, every figure finite, and
    exactly on-policy: the ratio of every unit is 1 (nothing clipped), and the trainer's
    log-probabilities of the rollout's own steps (true CFG for Qwen-Image and Wan, padded prompts,
    video latents) match the ones the rollout recorded to fp32 rounding."""
    rows = read_metrics(workdir)
    assert len(rows) == 1 and rows[0]["step"] == 1 and rows[0]["version"] == 1 and rows[0]["skipped"] == 0
    for key in ("reward_mean", "reward_std", "loss", "grad_norm", "clip_frac", "samples_per_s"):
        assert np.isfinite(rows[0][key]), key
    assert rows[0]["ratio_mean"] == 1 and rows[0]["clip_frac"] == 0, rows[0]["ratio_mean"]
    # The ratio is anchored on the trainer's own first pass (exact); the rollout's program (other
    # batch layout, merged adapters) records log-probs within fp32 rounding of it.
    assert rows[0]["logp_diff_max"] == 0 and rows[0]["rollout_logp_gap_max"] < 1e-5, rows[0]
    assert rows[0]["lag0_units"] > 0
    assert rows[0]["grad_norm"] > 0
    # jpeg_compressibility of decoded frames: negative kB / 500, never exactly 0.
    assert rows[0]["reward_mean"] < 0
    assert set(jax.tree.leaves(jax.tree.map(lambda x: x.ndim, state.trainable))) <= {2, 3}  # adapters only
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(state.trainable))


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_tiny_flow_grpo_iteration_through_train(family, tmp_path):
    """configs/<family>.py:tiny (random tiny weights and embeddings): one iteration of rollout,
    VAE decode, reward, advantages and a LoRA update, through the real entry point,
    disaggregated on 4 rollout + 4 train devices with the TPU settings (`sections.tpu_overrides`,
    one process): every role's weights sharded (FSDP) and splash attention (Pallas' TPU kernel,
    interpreted on the CPU; its parity with XLA's is tests/test_splash_attention.py's), so the
    kernel runs per device (`assert_one_on_policy_lora_iteration`). The colocated iteration with
    splash attention is tests/test_user_path.py's, from converted weights."""
    c = tpu_overrides(get_config(family, "tiny"))
    c.runtime.mode = "gap"
    c.runtime.distributed = False  # one process here
    c.runtime.rollout_devices = c.runtime.train_devices = 4
    state = loop.train(c, str(tmp_path), log=lambda _: None)
    assert_one_on_policy_lora_iteration(tmp_path, state)


NFT_CONFIGS = {"flux": "flux_nft", "qwenimage": "qwenimage_nft", "sd3": "sd35_nft"}


@pytest.mark.parametrize("family", sorted(NFT_CONFIGS))
def test_nft_zoo_configs_validate_with_the_reference_settings(family):
    """configs/<family>_nft.py at full size (no weights) validates and keeps its GRPO config's model
    and batch, with DiffusionNFT's reference settings: DPM2 over 10 steps without true CFG, 9 levels
    per sample, beta 1, the 'ramp' decay, KL weight 1e-4; its tiny size validates too."""
    c, grpo = get_config(family, files=NFT_CONFIGS), get_config(family)
    c.model.random_init = c.data.random_embeddings = True
    loop.validate_config(c, this_machine=False)  # a config for GPUs
    rl = c.rl
    assert (rl.algorithm, rl.nft_solver, rl.nft_beta, rl.nft_decay, rl.kl_beta) == ("nft", "dpm2", 1.0, "ramp", 1e-4)
    assert c.sampling.cfg_scale == 1.0 and c.sampling.num_steps == 10
    assert int(c.sampling.num_steps * rl.timestep_fraction) == 9
    assert (c.model.to_dict(), rl.lora_rank, rl.prompts_per_iteration, rl.group_size) == (
        grpo.model.to_dict() | {"random_init": True}, grpo.rl.lora_rank, grpo.rl.prompts_per_iteration, grpo.rl.group_size)
    loop.validate_config(get_config(family, "tiny", files=NFT_CONFIGS))


@pytest.mark.parametrize("family", ["wan", "hunyuan_video"])
def test_video_config_rejects_an_unknown_size(family):
    with pytest.raises(ValueError, match="unknown size '81f_1080p'"):
        get_config(family, "81f_1080p")


def test_nft_rejects_true_cfg():
    c = get_config("qwenimage", files=NFT_CONFIGS)
    c.model.random_init = c.data.random_embeddings = True
    c.sampling.cfg_scale = 4.0
    with pytest.raises(ConfigError, match=r"sampling\.cfg_scale=4\.0: rl\.algorithm='nft' samples without"):
        loop.validate_config(c)


@pytest.mark.gpu
@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_tiny_lag0_log_ratio_is_exact_in_bf16_on_gpu(family, tmp_path):
    """On a GPU in bf16 (cuDNN attention where it applies, the rollout and trainer programs differ
    in batch layout and LoRA form): every lag-0 unit's log-ratio is within 1e-6 of 0 before the
    update, nothing is clipped. CPU counterparts: test_tiny_flow_grpo_iteration_through_train (fp32)
    and tests/test_runtime.py::test_bf16_rollout_log_probs_differ_and_the_trainer_anchor_removes_the_gap."""
    c = get_config(family, "tiny")
    c.model.dtype = c.model.param_dtype = "bfloat16"
    loop.train(c, str(tmp_path), log=lambda _: None)
    row = read_metrics(tmp_path)[0]
    print(f"{family}: rollout_logp_gap max {row['rollout_logp_gap_max']:.3e} mean {row['rollout_logp_gap_mean']:.3e}")
    assert row["lag0_units"] > 0 and row["logp_diff_max"] <= 1e-6
    assert abs(row["ratio_mean"] - 1) <= 1e-6 and row["clip_frac"] == 0


PROMPTS = ("a cat", "a dog", "a red car", "two birds", "a house")


def _tiny_cache(path, family="qwenimage", *, text_dim=32):
    rng = np.random.default_rng(0)
    prompts, n, length = PROMPTS, len(PROMPTS), 6
    lengths = np.array([6, 3, 5, 1, 4], np.int32)
    mask = np.arange(length)[None] < lengths[:, None]
    text = rng.standard_normal((n, length, text_dim)).astype(np.float32) * mask[..., None]
    if family == "flux":
        return write_cache(str(path), "flux", prompts=prompts, text=text, pooled=rng.standard_normal((n, 32)))
    negative = {"text": rng.standard_normal((1, 2, text_dim)), "mask": np.ones((1, 2), bool), "lengths": np.array([2])}
    return write_cache(str(path), family, prompts=prompts, text=text, mask=mask, lengths=lengths,
                       negative_prompt=" ", negative=negative, info={"encoder_dir": "/enc/qwen-image"})


def test_real_user_path_checkpoints_and_embedding_cache(tmp_path):
    """Qwen-Image tiny from converted checkpoints and a real cache: the weights are the saved ones,
    prompt_batch rows are the cache's rows (distinct prompts), the true-CFG negative is the cache's
    negative entry, and rewards score the decoded samples."""
    saved = {}
    for name, key in (("qwenimage", "checkpoint"), ("vae_qwenimage", "vae_checkpoint")):
        fam = FAMILIES[name]
        saved[key] = random_init.random_params(fam, fam.variants["tiny"], seed=7)
        save_checkpoint(str(tmp_path / name), fam, fam.variants["tiny"], saved[key])
    cache = _tiny_cache(tmp_path / "cache")
    c = get_config("qwenimage", "tiny")
    c.model.random_init = False
    c.model.checkpoint, c.model.vae_checkpoint = str(tmp_path / "qwenimage"), str(tmp_path / "vae_qwenimage")
    c.data.random_embeddings, c.data.embedding_cache = False, cache
    c.rl.prompts_per_iteration, c.rl.grad_chunk_size = 3, 12  # 3 prompts x 2 samples x 2 window steps
    run = loop.Run(c, str(tmp_path / "run"), log=lambda _: None)
    jax.tree.map(np.testing.assert_array_equal, run.workload.base_params, saved["checkpoint"])
    jax.tree.map(np.testing.assert_array_equal, run.workload.vae_params, saved["vae_checkpoint"])
    ids, cond = run.prompt_batch(0)
    again_ids, _ = run.prompt_batch(0)
    np.testing.assert_array_equal(ids, again_ids)
    assert len(set(np.asarray(ids).tolist())) == 3
    text = np.load(os.path.join(cache, "text.npy"))
    mask = np.load(os.path.join(cache, "mask.npy"))
    np.testing.assert_array_equal(cond.text, text[np.asarray(ids)])
    np.testing.assert_array_equal(cond.mask, mask[np.asarray(ids)].astype(np.int32))
    assert cond.pooled is None
    assert run.task.prompt_text(ids) == [PROMPTS[i] for i in np.asarray(ids)]
    negative = np.zeros((1, 6, 32), np.float32)
    negative[:, :2] = np.load(os.path.join(cache, "negative_text.npy"))[:, :2]
    np.testing.assert_array_equal(run.sampler.negative.text, negative)
    np.testing.assert_array_equal(run.sampler.negative.mask, [[1, 1, 0, 0, 0, 0]])

    latents = jax.random.normal(jax.random.key(0), (2, *run.latent_shape))
    rewards, per_reward = run.score(latents, ids[:2])
    frames = run.workload.frames(latents, (0,))[:, 0]
    from digen_jax.rewards import jpeg_size_kb

    np.testing.assert_allclose(rewards, -jpeg_size_kb(frames) / 500, rtol=1e-6)
    assert run.images(latents).shape == (2, 32, 32, 3)


def test_video_reward_is_the_mean_over_scored_frames():
    """HunyuanVideo tiny at 9 frames, stride 4: a video's reward is the mean of frames 0, 4, 8's."""
    c = get_config("hunyuan_video", "tiny")
    c.sampling.num_frames, c.reward.frame_stride = 9, 4
    work = workload.make_workload(c)
    latents = jax.random.normal(jax.random.key(1), (2, *work.latent_shape))
    rewards, per_reward = work.score(latents, jnp.array([3, 5]))
    frames = work.frames(latents, (0, 4, 8))
    assert frames.shape == (2, 3, 32, 32, 3) and frames.dtype == np.uint8
    from digen_jax.rewards import jpeg_size_kb

    per_frame = -jpeg_size_kb(frames.reshape(6, 32, 32, 3)).reshape(2, 3) / 500
    assert np.ptp(per_frame, axis=1).min() > 0  # the frames differ, so the mean is not any one of them
    np.testing.assert_allclose(rewards, per_frame.mean(axis=1), rtol=1e-6)
    np.testing.assert_allclose(per_reward["jpeg_compressibility"], rewards)


def _model_json(path, family):
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "model.json"), "w") as f:
        json.dump({"family": family, "config": {}}, f)
    return str(path)


@pytest.mark.parametrize(
    "family,overrides,match",
    [
        ("flux", {"sampling.height": 500}, r"sampling.height=500 must be a positive multiple of 16"),
        ("qwenimage", {"sampling.width": 24}, r"sampling.width=24 must be a positive multiple of 16"),
        ("wan", {"sampling.num_frames": 32}, r"sampling.num_frames=32 must be 4k\+1"),
        ("hunyuan_video", {"sampling.num_frames": 0}, r"sampling.num_frames=0 must be 4k\+1"),
        ("qwenimage", {"data.text_len": 1025}, r"data.text_len 1025 is over the qwenimage text cap of 1024"),
        ("sd3", {"data.text_len": 590}, r"data.text_len 590 is over the sd3 text cap of 589"),  # CLIP's 77 + T5's 512
        ("hunyuan_video", {"data.text_len": 257}, r"data.text_len 257 is over the hunyuan_video text cap of 256"),
        ("qwenimage", {"model.family": "sdxl"}, r"model.family='sdxl' is unknown"),
        ("flux", {"model.variant": "huge"}, r"model.variant='huge' is unknown"),
        ("flux", {"sampling.cfg_scale": 3.0}, r"sampling.cfg_scale=3.0: flux uses embedded guidance"),
        ("wan", {"reward.frame_stride": 0}, r"reward.frame_stride must be a positive integer"),
        ("wan", {"model.random_init": False, "model.num_layers": 4}, r"model.num_layers=4 shortens random-weight models"),
        ("qwenimage", {"model.num_single_layers": 4}, r"model.num_single_layers=4: qwenimage has no num_single_layers"),
        ("flux", {"model.num_layers": -1}, r"model.num_layers must be an integer >= 0"),
        ("wan", {"model.random_init": False, "model.checkpoint": "/no/such/dir"},
         r"model.checkpoint='/no/such/dir' does not exist(.|\n)*diffusers_to_orbax.py --model_dir=<Wan2.1-T2V-14B"),
    ],
)
def test_bad_config_fails_before_device_work(no_device_work, family, overrides, match):
    c = get_config(family, "tiny")
    for key, value in overrides.items():
        section, name = key.split(".")
        c[section][name] = value
    with pytest.raises(workload.ConfigError, match=match):
        loop.Run(c, "/tmp/never-created", log=lambda _: None)


def test_depth_override_shortens_the_random_model_only():
    """`model.num_layers` / `num_single_layers` keep that many blocks at the variant's width."""
    c = get_config("flux")
    c.model.random_init = c.data.random_embeddings = True
    full = families.model_config(c)
    c.model.num_layers, c.model.num_single_layers = 2, 3
    loop.validate_config(c)
    short = families.model_config(c)
    assert (short.num_layers, short.num_single_layers) == (2, 3)
    assert dataclasses.replace(short, num_layers=full.num_layers, num_single_layers=full.num_single_layers) == full
    params = nn.unbox(FAMILIES["flux"].abstract_params(short))
    assert {p.shape[0] for p in jax.tree.leaves(params["double_blocks"])} == {2}  # stacked for the scan
    assert {p.shape[0] for p in jax.tree.leaves(params["single_blocks"])} == {3}


def test_missing_inputs_say_what_and_how(no_device_work, tmp_path):
    """The real-user path without weights or cache names every missing input and its command."""
    c = get_config("qwenimage")
    c.model.vae_checkpoint = str(tmp_path / "vae")
    with pytest.raises(workload.ConfigError) as info:
        loop.validate_config(c)
    message = str(info.value)
    assert "model.checkpoint is not set" in message
    assert f"model.vae_checkpoint='{tmp_path / 'vae'}' does not exist" in message
    assert "data.embedding_cache is not set" in message
    assert "python convert/diffusers_to_orbax.py --model_dir=<Qwen-Image diffusers folder>/transformer" in message
    assert "python convert/encode_prompts.py --family=qwenimage" in message
    assert "--config.model.random_init=True --config.data.random_embeddings=True" in message


def test_checkpoint_and_cache_of_another_model_are_rejected(no_device_work, tmp_path):
    c = get_config("qwenimage", "tiny")
    c.model.random_init = False
    c.model.checkpoint = _model_json(tmp_path / "transformer", "wan")
    c.model.vae_checkpoint = _model_json(tmp_path / "vae", "vae_qwenimage")
    with pytest.raises(workload.ConfigError, match=r"model.checkpoint=.* holds a 'wan' model; model.family='qwen"):
        loop.validate_config(c)

    c = get_config("qwenimage", "tiny")
    c.data.random_embeddings, c.data.embedding_cache = False, _tiny_cache(tmp_path / "flux_cache", "flux")
    with pytest.raises(workload.ConfigError, match=r"data.embedding_cache=.*holds 'flux' prompt embeddings"):
        loop.validate_config(c)

    # Same family, but encoded for a model of another width (here: the tiny model vs a 48-d encoder).
    c.data.embedding_cache = _tiny_cache(tmp_path / "wide_cache", text_dim=48)
    with pytest.raises(workload.ConfigError, match=r"another model \(encoded by /enc/qwen-image\): text dim 48"):
        loop.validate_config(c)


def test_train_script_reports_missing_inputs(tmp_path):
    """`python launch/train.py --config=configs/qwenimage.py` with nothing converted: exit status 1
    and the message, no traceback."""
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, "launch", "train.py"), f"--config={ROOT}/configs/qwenimage.py",
         f"--workdir={tmp_path}"], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 1
    assert "model.checkpoint is not set" in result.stderr and "Traceback" not in result.stderr
    assert not os.listdir(tmp_path)


def test_train_script_reports_diverged_updates_without_a_traceback(tmp_path, compile_cache):
    """Updates the divergence guard skips (here: any update at all, under a bound of 1e-12 of the
    weights' norm) stop the run after rl.max_nonfinite_in_row with a message, exit status 1.
    The run is the colocated Qwen-Image one of `test_tiny_flow_grpo_iteration_through_train`, so
    it loads that test's rollout, decode and gradient programs from the session's cache."""
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu", JAX_DEFAULT_MATMUL_PRECISION="highest",
               JAX_COMPILATION_CACHE_DIR=compile_cache)
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, "launch", "train.py"), f"--config={ROOT}/configs/qwenimage.py:tiny",
         f"--workdir={tmp_path}", "--config.model.attention_impl=splash", "--config.rl.max_update_ratio=1e-12",
         "--config.rl.max_nonfinite_in_row=1"], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert "stopped:" in result.stderr and "rl.max_update_ratio" in result.stderr, result.stderr[-3000:]


def test_train_script_reports_an_unknown_config_key(tmp_path):
    """A mistyped `--config.KEY` override: one line with ml_collections' hint and exit status 2,
    not a chained traceback."""
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, "launch", "train.py"), f"--config={ROOT}/configs/tiny.py",
         f"--workdir={tmp_path}", "--config.rl.lora_rnk=4"], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error")]
    assert errors == ["error: --config.rl.lora_rnk=4: the config has no key 'lora_rnk'. "
                      'Did you mean "lora_rank" instead of "lora_rnk"?'], result.stderr
    assert "Traceback" not in result.stderr and not os.listdir(tmp_path)


def test_unknown_config_key_without_config_flag(capsys):
    """Without --config the config flag reads the overrides while it is defined: same message."""
    from absl import flags
    from ml_collections import config_flags

    from digen_jax import cli

    argv = ["train.py", "--config.foo.bar=1"]
    with pytest.raises(SystemExit) as exited, cli.config_override_errors(argv):
        config_flags.DEFINE_config_file("config", f"{ROOT}/configs/tiny.py", flag_values=flags.FlagValues(), sys_argv=argv)
    assert exited.value.code == cli.USAGE_ERROR
    assert capsys.readouterr().err == "error: --config.foo.bar=1: the config has no key 'foo'.\n"
    with pytest.raises(AttributeError, match="not a config key"), cli.config_override_errors(argv):
        raise AttributeError("not a config key")  # other errors pass through unchanged


def test_zoo_configs_replicate_the_weights_and_the_fsdp_rules_shard_them():
    """The model-zoo configs train data parallel (every weight whole on each train device);
    `schema.FSDP_RULES` shard the weights; the full fine-tuning recipe uses them for training
    only, never for rollouts."""
    from configs import schema, sections

    for family in CONFIGS:
        assert not mesh_lib.shards_weights(get_config(family).sharding.train_rules), family
    fsdp = sections.full_ft_recipe(get_config("qwenimage")).sharding
    assert mesh_lib.shards_weights(fsdp.train_rules) and not mesh_lib.shards_weights(fsdp.rollout_rules)
    assert tuple(fsdp.train_rules) == schema.FSDP_RULES


def test_a_converted_vae_decodes_in_model_dtype(tmp_path):
    """A converted FLUX VAE's stored config holds no dtype (the port's default is bfloat16): the
    workload's decoder computes in model.dtype, float32 or bfloat16."""
    vae_family = FAMILIES["vae_flux"]
    cfg = vae_family.variants["tiny"]
    save_checkpoint(str(tmp_path / "vae"), vae_family, cfg, random_init.random_params(vae_family, cfg, 0))
    for dtype in ("float32", "bfloat16"):
        c = get_config("flux", "tiny")
        c.model.random_init, c.model.vae_checkpoint, c.model.dtype = False, str(tmp_path / "vae"), dtype
        vae_cfg, vae_params = workload.ModelZooWorkload._vae(types.SimpleNamespace(config=c))
        assert vae_cfg.dtype == families.vae_config(c).dtype == dtype
        latents = jnp.zeros((1, *families.latent_shape(c, vae_cfg)), jnp.float32)
        pixels = families.decoder("flux", vae_cfg, c.sampling.height, c.sampling.width)(vae_params, latents)
        assert pixels.dtype == jnp.dtype(dtype)
