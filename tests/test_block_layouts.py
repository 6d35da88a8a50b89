"""Scanned (stacked) vs unrolled blocks: same function, convertible parameters, same adapters."""
import dataclasses

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs.sections import ATTENTION_MLP_TARGETS
from digen_jax.models import FAMILIES, load_checkpoint, save_checkpoint, stacking
from digen_jax.app import random_init
from digen_jax.rl import lora

TRANSFORMERS = ("flux", "qwenimage", "wan", "hunyuan_video", "sd3")


def _tiny(name: str, **policy):
    return dataclasses.replace(FAMILIES[name].variants["tiny"], dtype="float32", param_dtype="float32", **policy)


def _inputs(example: dict, seed: int) -> dict:
    keys = iter(jax.random.split(jax.random.key(seed), len(example)))
    out = {}
    for k, v in example.items():
        if isinstance(v, jax.ShapeDtypeStruct):
            key = next(keys)
            out[k] = jnp.ones(v.shape, v.dtype) if jnp.issubdtype(v.dtype, jnp.integer) else jax.random.uniform(key, v.shape, v.dtype)
        else:
            out[k] = v
    return out


def _init(name: str, cfg):
    fam = FAMILIES[name]
    inputs = _inputs(fam.example_inputs(cfg), 1)
    return fam, inputs, random_init.random_params(fam, cfg, seed=0)  # host draws: no init program to compile


def _apply(fam, cfg, params, inputs):
    return jax.jit(lambda p, x: fam.module_cls(cfg).apply({"params": p}, **x))(params, inputs)


@pytest.mark.parametrize("name", TRANSFORMERS)
def test_unrolled_blocks_compute_the_scanned_function(name):
    scanned, unrolled = _tiny(name), _tiny(name, scan_layers=False)
    fam, inputs, params = _init(name, scanned)
    per_block = fam.to_layout(params, unrolled)

    # The converted tree is exactly what the unrolled module declares: one sub-tree per block.
    chex.assert_trees_all_equal_shapes_and_dtypes(per_block, nn.unbox(fam.abstract_params(unrolled)))
    block_trees = [k for k, v in per_block.items() if isinstance(v, dict) and "0" in v]
    assert block_trees, "no unrolled block tree"
    assert all("0" not in v for v in params.values() if isinstance(v, dict))
    # ...and it converts back to the stacked weights bit for bit.
    chex.assert_trees_all_equal(stacking.relayout_blocks(per_block, params), params)

    out_scanned = _apply(fam, scanned, params, inputs)
    out_unrolled = _apply(fam, unrolled, per_block, inputs)
    np.testing.assert_allclose(out_unrolled, out_scanned, rtol=1e-5, atol=1e-5)

    # The default LoRA targets adapt the same weights in both layouts.
    targets = ATTENTION_MLP_TARGETS[name]
    counts = [lora.lora_param_count(lora.init_lora(p, rank=2, target_patterns=targets, key=jax.random.key(2)))
              for p in (params, per_block)]
    assert counts[0] == counts[1] > 0


def test_unrolled_remat_gradients_match_scanned():
    name = "qwenimage"
    scanned, unrolled = _tiny(name, remat_policy="full"), _tiny(name, remat_policy="full", scan_layers=False)
    fam, inputs, params = _init(name, scanned)

    def grads(cfg, p):
        loss = lambda q: jnp.mean(jnp.square(fam.module_cls(cfg).apply({"params": q}, **inputs)))  # noqa: E731
        return jax.jit(jax.grad(loss))(p)

    g_scanned = grads(scanned, params)
    g_unrolled = grads(unrolled, fam.to_layout(params, unrolled))
    chex.assert_trees_all_close(stacking.relayout_blocks(g_unrolled, g_scanned), g_scanned, rtol=1e-4, atol=1e-6)


def test_checkpoints_store_stacked_blocks_and_load_into_either_layout(tmp_path):
    name = "flux"
    scanned, unrolled = _tiny(name), _tiny(name, scan_layers=False)
    fam, _, params = _init(name, scanned)
    save_checkpoint(str(tmp_path / "ckpt"), fam, unrolled, fam.to_layout(params, unrolled))

    _, cfg_s, loaded_s = load_checkpoint(str(tmp_path / "ckpt"), dtype="float32", param_dtype="float32")
    assert cfg_s.scan_layers
    chex.assert_trees_all_equal(loaded_s, params)

    _, cfg_u, loaded_u = load_checkpoint(str(tmp_path / "ckpt"), dtype="float32", param_dtype="float32",
                                         scan_layers=False)
    assert not cfg_u.scan_layers
    chex.assert_trees_all_equal(loaded_u, fam.to_layout(params, unrolled))


def test_relayout_rejects_mismatched_trees():
    with pytest.raises(ValueError, match="differ"):
        stacking.relayout_blocks({"a": np.zeros(2)}, {"b": np.zeros(2)})
    with pytest.raises(ValueError, match="got a leaf"):
        stacking.relayout_blocks({"blocks": np.zeros((2, 3))}, {"blocks": {"0": {"w": np.zeros(3)}, "1": {"w": np.zeros(3)}}})
