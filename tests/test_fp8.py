"""FP8 rollout numerics (models/fp8.py, rl/quantized_params.py): the FP8 dense layer against a float64 numpy
fake-quantisation restatement, a tiny FLUX's velocity against its float32 one, LoRA on an FP8
base, and the `model.rollout_precision` config key."""
import dataclasses
import json
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import tiny
from digen_jax.app import loop, precision
from digen_jax.app.errors import ConfigError
from digen_jax.app.settings import runtime_settings
from digen_jax.app.validation import validate_config
from digen_jax.models import flux, fp8
from digen_jax.models.layers import logical_dense
from digen_jax.rl import lora, quantized_params
from digen_jax.runtime import mesh as mesh_lib, weight_sync
from digen_jax.runtime.executor import Executor

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from test_rollout import CFG, LATENT_SHAPE, make_cond, make_params, make_sampler  # noqa: E402
from test_runtime import runtime_config  # noqa: E402

IN, OUT = 48, 24


def e4m3_round(v: np.ndarray) -> np.ndarray:
    """Round float64 values within +-448 to the nearest float8_e4m3fn value, ties to even: 3
    mantissa bits, exponents from -6 (below it the subnormals share the step 2^-9)."""
    mag = np.abs(v)
    exponent = np.maximum(np.floor(np.log2(np.where(mag > 0, mag, 1.0))), -6.0)
    step = 2.0 ** (exponent - 3)
    return np.sign(v) * np.round(mag / step) * step


def fake_quant_dense(x, kernel, bias):
    """The FP8 dense layer restated in float64: per-output-channel weight scales, per-row
    activation scales, both max|.| / 448 (floored at fp8.AMAX_FLOOR)."""
    x, kernel = np.asarray(x, np.float64), np.asarray(kernel, np.float64)
    w_scale = np.maximum(np.abs(kernel).max(axis=0), fp8.AMAX_FLOOR) / 448.0
    x_scale = np.maximum(np.abs(x).max(axis=-1, keepdims=True), fp8.AMAX_FLOOR) / 448.0
    w_q, x_q = e4m3_round(kernel / w_scale), e4m3_round(x / x_scale)
    return (x_q @ w_q) * x_scale * w_scale + np.asarray(bias, np.float64)


def _dense_and_params(seed=0):
    rng = np.random.default_rng(seed)
    layer = logical_dense(OUT, ("embed", "mlp"), name="dense", dtype=jnp.float32, param_dtype=jnp.float32)
    # Columns and rows of very different magnitudes, and an all-zero activation row: the scales
    # must follow each one.
    kernel = rng.normal(size=(IN, OUT)) * np.logspace(-3, 2, OUT)
    params = {"kernel": jnp.asarray(kernel, jnp.float32), "bias": jnp.asarray(rng.normal(size=OUT), jnp.float32)}
    x = rng.normal(size=(2, 5, IN)) * np.logspace(-2, 3, 5)[None, :, None]
    x[1, 2] = 0.0
    return layer, params, jnp.asarray(x, jnp.float32)


def _quantized(params):
    return quantized_params.quantize_params(params, frozenset({"kernel"}))


def test_quantized_dense_matches_float64_fake_quantisation():
    layer, params, x = _dense_and_params()
    q = _quantized(params)
    assert q[fp8.QUANTIZED].dtype == jnp.float8_e4m3fn and q[fp8.SCALE].shape == (OUT,) and "kernel" not in q
    out = np.asarray(layer.apply({"params": q}, x), np.float64)
    ref = fake_quant_dense(x, params["kernel"], params["bias"])
    np.testing.assert_allclose(out, ref, rtol=2e-6, atol=1e-6 * np.abs(ref).max())
    exact = np.asarray(layer.apply({"params": params}, x), np.float64)
    err = np.abs(out - exact).max() / np.abs(exact).max()
    assert 1e-4 < err < 0.1  # it did quantise, and to e4m3's precision


def test_stacked_kernels_get_one_scale_per_layer_and_output_channel():
    rng = np.random.default_rng(1)
    kernel = jnp.asarray(rng.normal(size=(3, IN, OUT)) * np.array([1e-2, 1.0, 1e2])[:, None, None], jnp.float32)
    q, scale = fp8.quantize_weight(kernel)
    assert q.shape == kernel.shape and scale.shape == (3, OUT)
    np.testing.assert_allclose(np.abs(np.asarray(q, np.float32)).max(axis=1), 448.0)
    for i in range(3):
        np.testing.assert_array_equal(np.asarray(q[i], np.float32), np.asarray(fp8.quantize_weight(kernel[i])[0], np.float32))


def test_lora_on_an_fp8_base_adds_exactly_the_adapter_term():
    layer, params, x = _dense_and_params()
    rng = np.random.default_rng(2)
    a, b = jnp.asarray(rng.normal(size=(IN, 4)), jnp.float32), jnp.asarray(rng.normal(size=(4, OUT)), jnp.float32)
    q = _quantized(params)
    variables = lora.factored_variables({"dense": q}, {"dense": {"lora_a": a, "lora_b": b}}, scale=0.5)
    with_adapter = layer.apply({k: v["dense"] for k, v in variables.items()}, x)
    base = layer.apply({"params": q}, x)
    term = jnp.dot(jnp.dot(x, a), 0.5 * b)
    np.testing.assert_array_equal(np.asarray(with_adapter), np.asarray(base + term))
    with pytest.raises(ValueError, match="FP8 kernel"):
        lora.merge_lora({"dense": q}, {"dense": {"lora_a": a, "lora_b": b}}, scale=0.5)


def test_tiny_flux_velocity_in_fp8_is_close_and_batch_invariant():
    """Only the blocks' attention and MLP kernels are quantised; the velocity moves by a few
    percent (e4m3 keeps 3 mantissa bits); a sample's velocity does not depend on its batch."""
    params = make_params()
    paths = quantized_params.quantized_kernel_paths(flux.FAMILY.abstract_params(CFG))
    assert paths and all(p.startswith(("double_blocks/", "single_blocks/")) for p in paths)
    assert not any("norm" in p for p in paths)  # AdaLN modulation stays in the compute dtype
    q = quantized_params.quantize_params(params, paths)
    velocity, cond = jax.jit(make_sampler().velocity), make_cond(4)
    latents = jax.random.normal(jax.random.key(0), (4, *LATENT_SHAPE))
    for step in (0, 2):
        v, v8 = velocity(params, latents, cond, step), velocity(q, latents, cond, step)
        rel = float(jnp.linalg.norm(v8 - v) / jnp.linalg.norm(v))
        print(f"step {step}: velocity relative error {rel:.4f}")
        assert 1e-3 < rel < 0.06
    # Batch mates 2 and 3 replaced by samples 30x larger: samples 0 and 1 keep their velocities.
    mates = latents.at[2:].set(30.0 * latents[:2])
    np.testing.assert_array_equal(velocity(q, mates, cond, 1)[:2], velocity(q, latents, cond, 1)[:2])


def test_rollout_precision_key_is_validated():
    c = tiny.get_config()
    c.model.rollout_precision = "fp16"
    with pytest.raises(ConfigError, match=r"model\.rollout_precision must be one of \('bf16', 'fp8'\), got 'fp16'"):
        validate_config(c)
    c = tiny.get_config()
    c.model.rollout_precision, c.rl.lora_rank, c.rl.lora_merge_for_sampling = "fp8", 4, True
    with pytest.raises(ConfigError, match=r"model\.rollout_precision='fp8'.*rl\.lora_merge_for_sampling=False"):
        validate_config(c)
    c.rl.lora_merge_for_sampling = False
    validate_config(c)
    for key, value, message in [
        ("lora_base_precision", "int8", r"model\.lora_base_precision must be one of \('bf16', 'fp8'\), got 'int8'"),
        ("rollout_precision", "bf16", r"model\.lora_base_precision='fp8'.*set model\.rollout_precision='fp8'"),
    ]:
        bad = c.copy_and_resolve_references()
        bad.model.lora_base_precision = "fp8"
        bad.model[key] = value
        with pytest.raises(ConfigError, match=message):
            validate_config(bad)
    c.model.lora_base_precision, c.rl.lora_rank = "fp8", 0
    with pytest.raises(ConfigError, match=r"model\.lora_base_precision='fp8'.*rl\.lora_rank=0.*'bf16'"):
        validate_config(c)


def test_gradient_through_the_fp8_kernel_is_the_dequantised_kernel_s():
    """An FP8 LoRA base (`model.lora_base_precision='fp8'`) passes gradients to the layers below it
    through its dequantised kernel, the activations' rounding passed straight through."""
    layer, params, x = _dense_and_params()
    fp8_params = quantized_params.quantize_params(params, frozenset({"kernel"}))
    dequantised = fp8_params[fp8.QUANTIZED].astype(jnp.float32) * fp8_params[fp8.SCALE]
    cotangent = jax.random.normal(jax.random.key(3), x.shape[:-1] + (OUT,))
    _, vjp = jax.vjp(lambda v: layer.apply({"params": fp8_params}, v), x)
    np.testing.assert_allclose(vjp(cotangent)[0], cotangent @ dequantised.T, rtol=1e-5, atol=1e-5)


def test_fp8_grpo_defaults_to_truncated_importance_sampling():
    c = tiny.get_config()
    assert precision.decoupled_loss(c) == (False, None)  # the bf16 default is untouched
    c.model.rollout_precision = "fp8"
    assert precision.decoupled_loss(c) == (True, precision.FP8_IS_CAP)
    c.rl.is_cap = 5.0
    assert precision.decoupled_loss(c) == (True, 5.0)
    c.rl.decoupled = False
    assert precision.decoupled_loss(c) == (False, 5.0)
    c = tiny.get_config()
    c.model.rollout_precision, c.rl.algorithm = "fp8", "nft"
    assert precision.decoupled_loss(c) == (False, None)  # DiffusionNFT has no ratio to correct


def test_lora_trained_through_the_fp8_base_the_rollouts_sample_from(pretrain_cache_dir, tmp_path):
    """`model.lora_base_precision='fp8'` in a disaggregated mode with trainer-assisted generation:
    the train role holds only the e4m3 base (no bf16 kernel where one is quantised, also once a
    second executor of the run has placed it), and the
    trainer's log-probs of the rollouts' transitions (its own and the rollout role's) are theirs up
    to float32 rounding: the trainer reads the FP8 base the rollouts sampled with. Over a bf16 base
    the gap is FP8's: 5e-4 mean and 2e-3 largest here. With the FP8 base the mean is 1e-6 or less;
    the largest is a rare activation whose e4m3 rounding the batch's float32 bits flip (2e-5 to
    2.4e-4, by processor)."""
    config = runtime_config(pretrain_cache_dir, "gap+tsp+tag")
    config.rl.update(lora_rank=2, lora_merge_for_sampling=False)
    config.model.rollout_precision = config.model.lora_base_precision = "fp8"
    run = loop.Run(config, str(tmp_path), log=lambda _: None)
    executor = Executor(run, log=lambda _: None)
    rows = jax.device_get([executor.iteration(k)[1] for k in range(2)])
    executor.close()
    Executor(run, log=lambda _: None).close()  # another executor of the run (a bench's next mode) places it again
    for row in rows:
        assert row["skipped"] == 0 and row["logp_diff_max"] == 0, row
        assert row["rollout_logp_gap_mean"] < 5e-5 and row["rollout_logp_gap_max"] < 1e-3, row
        assert row["is_truncated_frac"] == 0 and abs(row["is_weight_mean"] - 1) < 1e-4, row
    frozen = run.trainer.frozen
    leaves = {"/".join(str(getattr(k, "key", k)) for k in path): leaf
              for path, leaf in jax.tree_util.tree_flatten_with_path(frozen)[0]}
    quantised = [p for p in leaves if p.endswith(fp8.QUANTIZED)]
    assert quantised and all(p[: -len(fp8.QUANTIZED)] + "kernel" not in leaves for p in quantised)
    assert all(leaves[p].dtype == fp8.E4M3 for p in quantised)


def test_lora_grpo_with_fp8_rollouts_on_their_own_role(pretrain_cache_dir, tmp_path):
    """LoRA, disaggregated ('gap'): the rollout role's frozen base is the FP8 one (its log-probs
    differ from the trainer's), the decoupled loss is on by default with the ratio anchored on
    the trainer's own pass, and the importance weights carry the FP8 gap, below the cap."""
    config = runtime_config(pretrain_cache_dir, "gap")
    config.rl.update(lora_rank=2, lora_merge_for_sampling=False)
    config.model.rollout_precision = "fp8"
    config.train.iterations = 1
    loop.train(config, str(tmp_path), log=lambda _: None)
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    for row in rows:
        assert row["skipped"] == 0 and row["logp_diff_max"] == 0, row
        assert 0 < row["rollout_logp_gap_max"] < 0.05, row  # FP8 rollouts, bf16/f32 training
        assert row["is_truncated_frac"] == 0 and abs(row["is_weight_mean"] - 1) < 0.05, row


@pytest.mark.parametrize("mode, fp8_on_train", [("colocated", False), ("gap+tsp+tag", False), ("gap+tsp+tag", True)])
def test_train_role_samples_in_fp8_where_it_is_the_rollout_role_or_asked_to(mode, fp8_on_train):
    """The rollout role always samples with the FP8 tree; the train role does when colocated (it
    is the rollout role then) or, disaggregated, with `fp8_on_train` (`runtime.tag_precision`
    'rollout'); otherwise its trainer-assisted rollouts keep the training precision rather than
    hold a quantised copy of the base beside the one training reads."""
    runtime = dataclasses.replace(runtime_settings(tiny.get_config()), mode=mode, rollout_devices=4, train_devices=4)
    trainer = types.SimpleNamespace(cfg=types.SimpleNamespace(lora_scale=None, rollout_precision="fp8", lora_base_precision="bf16"), frozen=None)
    weights = weight_sync.RoleWeights(mesh_lib.build_role_meshes(runtime), tiny.get_config().sharding,
                                      flux.FAMILY.abstract_params(CFG), trainer, merge_for_sampling=False,
                                      fp8_on_train=fp8_on_train)
    params = jax.device_put(make_params(), weights.sharding["train"])  # as the trainer holds them (FSDP)

    def kernels(tree):
        return {str(path[-1].key) for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]}

    moved, sampling = weights.to_rollout(params)
    assert fp8.QUANTIZED in kernels(sampling)
    # Full fine-tuning: quantised on the train role, so the tree that crossed is the e4m3 one (no
    # bf16 kernel on the rollout role), laid out by the rollout rules and equal to quantising there.
    def count(tree, name):
        return sum(str(path[-1].key) == name for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0])

    quantized = count(moved, fp8.QUANTIZED)
    assert moved is sampling and quantized > 0 and count(moved, "kernel") == count(params, "kernel") - quantized
    rollout_devices = set(weights.meshes.rollout.devices.flat)
    assert all(a.sharding.device_set == rollout_devices for a in jax.tree.leaves(moved))
    there = weights._quantize(jax.device_put(params, weights.sharding["rollout"]))
    assert all(np.array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
               for a, b in zip(jax.tree.leaves(moved), jax.tree.leaves(there)))
    on_train = kernels(weights.on_train(params))
    assert (fp8.QUANTIZED in on_train) == (mode == "colocated" or fp8_on_train)


def test_gathered_colocated_sampling_quantises_then_gathers():
    """Colocated full fine-tuning with FP8 rollouts and `runtime.colocated_sampling='gathered'`: the
    copy the rollouts read is the e4m3 tree, replicated over the shared mesh (quantised where the
    weights are sharded, so no bf16 copy is gathered), equal to quantising a gathered copy, and
    made once per version until released."""
    runtime = dataclasses.replace(runtime_settings(tiny.get_config()), mode="colocated", train_devices=4)
    trainer = types.SimpleNamespace(cfg=types.SimpleNamespace(lora_scale=None, rollout_precision="fp8", lora_base_precision="bf16"), frozen=None)
    weights = weight_sync.RoleWeights(mesh_lib.build_role_meshes(runtime), tiny.get_config().sharding,
                                      flux.FAMILY.abstract_params(CFG), trainer, merge_for_sampling=False,
                                      gathered_sampling=True)
    assert weights.gathered
    params = jax.device_put(make_params(), weights.sharding["train"])  # as the trainer holds them (FSDP)
    assert not all(a.sharding.is_fully_replicated for a in jax.tree.leaves(params))
    copy = weights.shared_sampling(params, 0)
    assert weights.shared_sampling(params, 0) is copy
    kinds = {str(path[-1].key) for path, _ in jax.tree_util.tree_flatten_with_path(copy)[0]}
    assert fp8.QUANTIZED in kinds
    shared = set(weights.meshes.train.devices.flat)
    assert all(a.sharding.is_fully_replicated and a.sharding.device_set == shared for a in jax.tree.leaves(copy))
    gathered_first = weights._quantize(jax.device_put(params, weights.sharding["rollout"]))
    assert all(np.array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
               for a, b in zip(jax.tree.leaves(copy), jax.tree.leaves(gathered_first)))
    weights.release_gathered()
    assert weights.shared_sampling(params, 0) is not copy
