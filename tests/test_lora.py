"""LoRA init/merge over plain and scan-stacked kernels vs a numpy restatement.

Reference: huggingface/peft src/peft/tuners/lora/layer.py (the adapters Flow-GRPO
scripts/train_flux.py and DanceGRPO fastvideo/train_grpo_flux_lora.py train): delta W =
(alpha / r) * B A in torch's (out, in) layout, i.e. (alpha / r) * A @ B for a flax (in, out)
kernel; lora_A kaiming_uniform_(a=sqrt(5)) -> U(+-1/sqrt(in)), lora_B zeros. Factored
application (x @ W + s (x @ A) @ B inside the model) is checked against the merged weights.
"""
import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util

from digen_jax import model_flops
from digen_jax.models import FAMILIES
from digen_jax.rl import init_lora, lora_param_count, lora_scale, match_lora_targets, merge_lora
from configs.sections import ATTENTION_MLP_TARGETS
from digen_jax.rl.lora import LoraWeights, factored_variables, model_variables

TARGETS = [r"attn/to_(q|k)/kernel$", r"^proj_out/kernel$"]


def _params(dtype=jnp.float32):
    rng = np.random.default_rng(0)
    arr = lambda *s: jnp.asarray(rng.normal(size=s), dtype)  # noqa: E731
    return {
        "blocks": {  # a scanned stack of 3 layers
            "attn": {
                "to_q": {"kernel": arr(3, 8, 6), "bias": arr(3, 6)},
                "to_k": {"kernel": arr(3, 8, 6), "bias": arr(3, 6)},
                "to_v": {"kernel": arr(3, 8, 6), "bias": arr(3, 6)},
            },
            "norm": {"scale": arr(3, 8)},
        },
        "proj_out": {"kernel": arr(8, 4), "bias": arr(4)},
        "blocks_out": {"proj_out": {"kernel": arr(4, 4)}},
    }


def _randomise_b(lora, seed=1):
    rng = np.random.default_rng(seed)
    return jax.tree_util.tree_map_with_path(
        lambda path, x: jnp.asarray(rng.normal(size=x.shape), x.dtype)
        if path[-1].key == "lora_b"
        else x,
        lora,
    )


def test_targets_and_init_shapes():
    params = _params()
    assert match_lora_targets(params, TARGETS) == [
        "blocks/attn/to_k/kernel",
        "blocks/attn/to_q/kernel",
        "proj_out/kernel",
    ]
    lora = init_lora(params, rank=2, target_patterns=TARGETS, key=jax.random.key(0))
    q = lora["blocks"]["attn"]["to_q"]
    assert q["lora_a"].shape == (3, 8, 2) and q["lora_b"].shape == (3, 2, 6)
    assert lora["proj_out"]["lora_a"].shape == (8, 2) and lora["proj_out"]["lora_b"].shape == (2, 4)
    assert "to_v" not in lora["blocks"]["attn"] and "blocks_out" not in lora
    a = np.asarray(q["lora_a"])
    assert np.all(np.abs(a) <= 1 / np.sqrt(8)) and a.std() > 0.1
    assert not np.allclose(a[0], a[1])  # each stacked layer gets its own draw
    np.testing.assert_array_equal(np.asarray(q["lora_b"]), 0.0)
    assert lora_param_count(lora) == 2 * (3 * 8 * 2 + 3 * 2 * 6) + 8 * 2 + 2 * 4


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_zero_b_merge_is_identity(dtype):
    params = _params(dtype)
    lora = init_lora(params, rank=4, target_patterns=TARGETS, key=jax.random.key(1))
    merged = merge_lora(params, lora, scale=lora_scale(4, 8.0))
    for path in ("blocks/attn/to_q/kernel", "proj_out/kernel"):
        a, b = (_get(t, path) for t in (merged, params))
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_merge_matches_numpy_and_leaves_others_untouched():
    params = _params()
    lora = _randomise_b(init_lora(params, rank=3, target_patterns=TARGETS, key=jax.random.key(2)))
    scale = lora_scale(3, 6.0)
    merged = jax.jit(lambda p, l: merge_lora(p, l, scale=scale))(params, lora)
    eager = merge_lora(params, lora, scale=scale)
    for module in ("blocks/attn/to_q", "blocks/attn/to_k", "proj_out"):
        w = np.asarray(_get(params, module + "/kernel"), np.float64)
        a = np.asarray(_get(lora, module + "/lora_a"), np.float64)
        b = np.asarray(_get(lora, module + "/lora_b"), np.float64)
        want = w + scale * np.matmul(a, b)  # matmul broadcasts over the stacked layers axis
        got = np.asarray(_get(merged, module + "/kernel"))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    for path in ("blocks/attn/to_v/kernel", "blocks/attn/to_q/bias", "blocks/norm/scale",
                 "proj_out/bias", "blocks_out/proj_out/kernel"):
        assert _get(eager, path) is _get(params, path)


def test_gradient_reaches_b_only_at_init():
    # dL/dA = s * dL/dW @ B^T vanishes while B = 0; dL/dB = s * A^T @ dL/dW does not.
    params = _params()
    lora = init_lora(params, rank=2, target_patterns=TARGETS, key=jax.random.key(3))
    x = jnp.ones((5, 8))

    def loss(l):
        merged = merge_lora(params, l, scale=2.0)
        return jnp.sum(jnp.tanh(x @ merged["proj_out"]["kernel"]))

    g = jax.grad(loss)(lora)["proj_out"]
    np.testing.assert_array_equal(np.asarray(g["lora_a"]), 0.0)
    assert np.any(np.asarray(g["lora_b"]) != 0)
    g = jax.grad(loss)(_randomise_b(lora))["proj_out"]
    assert np.any(np.asarray(g["lora_a"]) != 0)


def test_errors():
    params = _params()
    key = jax.random.key(0)
    with pytest.raises(ValueError, match=r"'attn/to_z/kernel' matches no kernel"):
        init_lora(params, rank=2, target_patterns=[TARGETS[0], "attn/to_z/kernel"], key=key)
    for rank in (0, -1, 2.0):
        with pytest.raises(ValueError, match="rank"):
            init_lora(params, rank=rank, target_patterns=TARGETS, key=key)
    with pytest.raises(ValueError, match="non-empty"):
        init_lora(params, rank=2, target_patterns=[], key=key)
    with pytest.raises(ValueError, match="only"):
        conv = {"conv": {"kernel": jnp.zeros((3, 3, 4, 4))}}
        init_lora(conv, rank=2, target_patterns=["conv"], key=key)
    lora = init_lora(params, rank=2, target_patterns=TARGETS, key=key)
    with pytest.raises(ValueError, match="do not fit"):
        merge_lora({**params, "proj_out": {"kernel": jnp.zeros((8, 5))}}, lora, scale=1.0)
    with pytest.raises(ValueError, match="matching"):
        merge_lora({"blocks": params["blocks"]}, lora, scale=1.0)


def _get(tree, path):
    for key in path.split("/"):
        tree = tree[key]
    return tree


# ---------------------------------------------------------------- factored application
def _tiny_model(family, **overrides):
    """A tiny `family` model with random weights, random inputs and random non-zero adapters."""
    fam = FAMILIES[family]
    cfg = dataclasses.replace(fam.variants["tiny"], **overrides)
    if family in ("flux", "qwenimage"):
        shapes = dict(image_seq_len=8, text_seq_len=5)
    else:
        shapes = dict(frames=2, height=2, width=3, text_seq_len=5)
    specs = fam.example_inputs(cfg, 2, **shapes)
    keys = iter(jax.random.split(jax.random.key(7), len(specs)))
    inputs = {k: jax.random.normal(next(keys), v.shape) if isinstance(v, jax.ShapeDtypeStruct) else v for k, v in specs.items()}
    if family == "hunyuan_video":
        inputs["encoder_attention_mask"] = jnp.array([[1] * 5, [1] * 3 + [0] * 2], jnp.int32)
    module = fam.module_cls(cfg)
    params = nn.unbox(jax.jit(lambda x: module.init(jax.random.key(0), **x))(inputs))["params"]
    adapters = _randomise_b(init_lora(params, rank=3, target_patterns=ATTENTION_MLP_TARGETS[family], key=jax.random.key(1)))
    adapters = jax.tree.map(lambda x: 0.3 * x, adapters)
    return module, params, adapters, inputs


# FLUX; Wan (cross-attention keys and values from the text) under full remat, so the lora
# collection passes through nn.remat as well as nn.scan.
@pytest.mark.parametrize("family,overrides", [("flux", {}), ("wan", {"remat_policy": "full"})])
def test_factored_equals_merged_outputs_and_adapter_gradients(family, overrides):
    module, params, adapters, inputs = _tiny_model(family, **overrides)
    scale = lora_scale(3, 6.0)

    def loss(a, mode):
        out = module.apply(model_variables(LoraWeights(params, a, scale, mode)), **inputs)
        return jnp.sum(jnp.sin(out)), out

    @jax.jit
    def both(a):  # one compilation for the two modes and the base model
        (_, factored), g_factored = jax.value_and_grad(lambda a: loss(a, "factored"), has_aux=True)(a)
        (_, merged), g_merged = jax.value_and_grad(lambda a: loss(a, "merged"), has_aux=True)(a)
        return factored, g_factored, merged, g_merged, module.apply({"params": params}, **inputs)

    factored, g_factored, merged, g_merged, base = both(adapters)
    assert float(jnp.abs(factored - base).max()) > 1e-2  # the adapters change the output
    np.testing.assert_allclose(factored, merged, rtol=1e-5, atol=1e-5)
    flat_f, flat_m = (traverse_util.flatten_dict(g, sep="/") for g in (g_factored, g_merged))
    assert sorted(flat_f) == sorted(flat_m)
    for path, g in flat_f.items():
        scale_of = float(jnp.abs(flat_m[path]).max())
        assert scale_of > 0, path
        np.testing.assert_allclose(g, flat_m[path], rtol=1e-4, atol=1e-5 * scale_of, err_msg=path)


def test_factored_gradient_builds_no_kernel_sized_matmul():
    """The optimisation fired: differentiating the factored model w.r.t. the adapters contains no
    dot_general whose output has an adapted kernel's (in, out) shape, while the merged form
    builds one per adapted kernel (the merge and the kernel gradient)."""
    module, params, adapters, inputs = _tiny_model("flux")
    flat = traverse_util.flatten_dict(params, sep="/")
    kernel_shapes = set()
    for path in match_lora_targets(params, ATTENTION_MLP_TARGETS["flux"]):
        shape = flat[path].shape
        kernel_shapes |= {shape, shape[-2:]}  # stacked (L, in, out) and per layer inside the scan

    def kernel_sized(mode):
        def loss(a):
            return jnp.sum(module.apply(model_variables(LoraWeights(params, a, 0.5, mode)), **inputs))

        return [eqn.outvars[0].aval.shape for eqn, _ in model_flops.dot_generals(jax.grad(loss), adapters)
                if eqn.outvars[0].aval.shape in kernel_shapes]

    assert kernel_sized("factored") == []
    assert len(kernel_sized("merged")) > len(match_lora_targets(params, ATTENTION_MLP_TARGETS["flux"]))


def test_factored_errors():
    params = _params()
    lora = init_lora(params, rank=2, target_patterns=TARGETS, key=jax.random.key(0))
    with pytest.raises(ValueError, match="matching"):
        factored_variables({"blocks": params["blocks"]}, lora, scale=1.0)
    with pytest.raises(ValueError, match="LoRA mode"):
        model_variables(LoraWeights(params, lora, 1.0, "fused"))
    variables = factored_variables(params, lora, scale=2.0)
    assert variables["params"] is params
    np.testing.assert_array_equal(variables["lora"]["proj_out"]["lora_a"], lora["proj_out"]["lora_a"])
