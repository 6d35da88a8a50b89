"""Wan2.2 at the model level: the T2V-A14B pair of experts routed by timestep, its conversion,
and the released configs' shapes."""
import dataclasses

import flax.linen as nn
import jax
import numpy as np
import pytest
import torch
from diffusers import WanTransformer3DModel

from digen_jax.models import FAMILIES, make_apply_fn, wan, wan22
from digen_jax.models.conversion import convert_weights, torch_state_dict_arrays
from test_wan import port, random_wan, rel_err, to_numpy, wan_inputs


@pytest.fixture(scope="module")
def experts():
    """Two different tiny diffusers experts, the pair converted from them, and each alone."""
    high, low = random_wan(10), random_wan(11)
    cfg = dataclasses.replace(
        wan22.FAMILY.config_from_diffusers(dict(high.config), dtype="float32", param_dtype="float32"),
        boundary_ratio=0.875,
    )
    weights = wan22.expert_weights(torch_state_dict_arrays(high), torch_state_dict_arrays(low))
    params = convert_weights(wan22.FAMILY, cfg, weights, source="tiny experts")
    return high, low, make_apply_fn(wan22.FAMILY, cfg), params


def reference(high, low, inputs, boundary=875.0):
    """What diffusers' WanPipeline does per step: `transformer` for t >= boundary, else `transformer_2`."""
    with torch.no_grad():
        return np.concatenate([
            (high if float(t) >= boundary else low)(**{k: v[i : i + 1] for k, v in inputs.items()}).sample.numpy()
            for i, t in enumerate(inputs["timestep"])
        ])


@pytest.mark.parametrize("timesteps", [(880.0, 999.0), (875.0, 875.0), (874.9, 300.0), (900.0, 874.0)])
def test_each_step_uses_the_expert_of_its_side_of_the_boundary(experts, timesteps):
    """Both on the high side (the boundary itself included), both low, and a batch straddling
    the boundary, against the diffusers experts chosen as the pipeline chooses them."""
    high, low, apply_fn, params = experts
    inputs = wan_inputs(high, 2, 2, 4, 4, 5)
    inputs["timestep"] = torch.tensor(timesteps)
    ref = reference(high, low, inputs)
    out = np.asarray(apply_fn(params, **to_numpy(inputs)))
    assert rel_err(out, ref) <= 1e-5
    # The other expert gives something else, so the routing is what the comparison checks.
    other = reference(low, high, inputs)
    assert rel_err(out, other) > 1e-2


def test_uniform_batch_trains_its_expert_only(experts):
    """Gradients reach only the expert that ran; a step below the boundary trains the low-noise one."""
    high, _, _, params = experts
    cfg = dataclasses.replace(wan22.VARIANTS["tiny-a14b"], in_channels=4, out_channels=4)
    module = wan22.make_module(cfg)
    inputs = to_numpy(wan_inputs(high, 1, 1, 4, 4, 3))
    grad = jax.jit(jax.grad(lambda p, x: module.apply({"params": p}, **x).sum()))
    for t, trained, frozen in ((950.0, "transformer", "transformer_2"), (100.0, "transformer_2", "transformer")):
        grads = grad(params, {**inputs, "timestep": np.asarray([t], np.float32)})
        norm = lambda tree: float(sum(np.abs(np.asarray(g)).sum() for g in jax.tree.leaves(tree)))  # noqa: E731
        assert norm(grads[trained]) > 0 and norm(grads[frozen]) == 0


def test_per_token_timesteps_route_by_the_step(experts):
    """TI2V-style per-token timesteps (clean first frame at 0): the step's timestep decides."""
    high, low, apply_fn, params = experts
    inputs = wan_inputs(high, 1, 2, 4, 4, 5)
    per_token = torch.full((1, 8), 900.0)
    per_token[0, :4] = 0.0
    inputs["timestep"] = per_token
    with torch.no_grad():
        ref = high(**inputs).sample.numpy()
    assert rel_err(apply_fn(params, **to_numpy(inputs)), ref) <= 1e-5


def test_one_transformer_is_the_wan_module():
    model = random_wan(12)
    cfg = wan22.FAMILY.config_from_diffusers(dict(model.config), dtype="float32", param_dtype="float32")
    assert cfg.boundary_ratio is None and isinstance(wan22.make_module(cfg), wan.WanTransformer)
    _, direct = port(model)
    params = convert_weights(wan22.FAMILY, cfg, torch_state_dict_arrays(model))
    jax.tree.map(np.testing.assert_array_equal, params, direct)


def count(family, cfg):
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nn.unbox(family.abstract_params(cfg))))


def test_released_variants():
    assert FAMILIES["wan22"] is wan22.FAMILY
    ti2v = wan22.VARIANTS["ti2v-5b"]
    assert (ti2v.inner_dim, ti2v.num_layers, ti2v.in_channels, ti2v.ffn_dim) == (3072, 30, 48, 14336)
    fields = ("num_attention_heads", "attention_head_dim", "in_channels", "out_channels", "ffn_dim", "num_layers")
    with torch.device("meta"):
        released = WanTransformer3DModel(**{f: getattr(ti2v, f) for f in fields})
    assert count(wan22.FAMILY, ti2v) == sum(p.numel() for p in released.parameters())
    # Each A14B expert is the Wan2.1-14B architecture.
    a14b = wan22.VARIANTS["t2v-a14b"]
    assert count(wan22.FAMILY, a14b) == 2 * 14_288_491_584
    assert a14b.boundary_timestep == 875.0
    with pytest.raises(ValueError, match="boundary_ratio"):
        dataclasses.replace(a14b, boundary_ratio=1.5)
