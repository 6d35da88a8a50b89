"""FLUX.1 port: fp32 parity with diffusers `FluxTransformer2DModel`, full-size shapes, policies."""
import dataclasses

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from diffusers import FluxTransformer2DModel

from digen_jax.models import flux, from_diffusers, make_apply_fn

TINY = dict(
    patch_size=1,
    in_channels=16,
    num_layers=2,
    num_single_layers=2,
    attention_head_dim=16,
    num_attention_heads=2,
    joint_attention_dim=32,
    pooled_projection_dim=32,
    axes_dims_rope=(4, 6, 6),
)


def random_flux(seed: int, **overrides) -> FluxTransformer2DModel:
    """A tiny diffusers FLUX with every weight perturbed (diffusers zero-inits none here, but
    perturbing makes norm scales and biases non-trivial, so a wrong mapping shows)."""
    torch.manual_seed(seed)
    model = FluxTransformer2DModel(**{**TINY, **overrides}).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def flux_inputs(model, batch: int, grid_h: int, grid_w: int, text_len: int, guidance: bool, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    c = model.config
    img_ids = torch.zeros(grid_h, grid_w, 3)
    img_ids[..., 1] = torch.arange(grid_h)[:, None]
    img_ids[..., 2] = torch.arange(grid_w)[None, :]
    return dict(
        hidden_states=torch.randn(batch, grid_h * grid_w, c.in_channels, generator=g),
        encoder_hidden_states=torch.randn(batch, text_len, c.joint_attention_dim, generator=g),
        pooled_projections=torch.randn(batch, c.pooled_projection_dim, generator=g),
        timestep=torch.rand(batch, generator=g),
        img_ids=img_ids.reshape(-1, 3),
        txt_ids=torch.zeros(text_len, 3),
        guidance=torch.full((batch,), 3.5) if guidance else None,
    )


def to_numpy(inputs):
    return {k: (None if v is None else v.numpy()) for k, v in inputs.items()}


def rel_err(a, b):
    return float(np.abs(np.asarray(a) - b).max() / np.abs(b).max())


@pytest.mark.parametrize(
    "overrides,batch,grid,text_len",
    [
        (dict(guidance_embeds=True), 2, (4, 6), 7),  # FLUX.1-dev style, non-square grid
        (dict(guidance_embeds=False), 3, (5, 3), 4),  # schnell style
        (dict(guidance_embeds=True, num_layers=1, num_single_layers=3, out_channels=8), 1, (2, 2), 5),
    ],
)
def test_parity_with_diffusers(overrides, batch, grid, text_len):
    model = random_flux(0, **overrides)
    inputs = flux_inputs(model, batch, *grid, text_len, guidance=overrides["guidance_embeds"])
    with torch.no_grad():
        ref = model(**inputs).sample.numpy()
    apply_fn, params = from_diffusers(model)
    out = apply_fn(params, **to_numpy(inputs), return_dict=False)
    chex.assert_shape(out, ref.shape)
    assert out.dtype == jnp.float32
    assert rel_err(out, ref) <= 1e-5


def test_deprecated_batched_ids_accepted():
    model = random_flux(1, guidance_embeds=True)
    inputs = flux_inputs(model, 2, 2, 3, 4, guidance=True)
    apply_fn, params = from_diffusers(model)
    flat = apply_fn(params, **to_numpy(inputs))
    batched = to_numpy(inputs)
    batched["img_ids"], batched["txt_ids"] = batched["img_ids"][None], batched["txt_ids"][None]
    np.testing.assert_array_equal(apply_fn(params, **batched), flat)


def test_full_size_parameter_count_and_logical_axes():
    abstract = flux.FAMILY.abstract_params(flux.VARIANTS["dev"])
    leaves = jax.tree.leaves(abstract, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))
    assert sum(int(np.prod(x.value.shape)) for x in leaves) == 11_901_408_320
    # Every parameter carries one logical name per dimension; stacked blocks lead with `layers`.
    for leaf in leaves:
        assert isinstance(leaf, nn.LogicallyPartitioned)
        assert len(leaf.names) == leaf.value.ndim
    blocks = nn.unbox(abstract)["double_blocks"]["attn"]["to_q"]["kernel"]
    assert blocks.shape == (19, 3072, 3072)
    assert abstract["double_blocks"]["attn"]["to_q"]["kernel"].names == ("layers", "embed", "heads")


def test_bf16_policy_close_to_fp32():
    model = random_flux(2, guidance_embeds=True)
    inputs = to_numpy(flux_inputs(model, 2, 4, 4, 6, guidance=True))
    apply32, params = from_diffusers(model)
    cfg16 = flux.FAMILY.config_from_diffusers(dict(model.config), dtype="bfloat16", param_dtype="float32")
    out16 = make_apply_fn(flux.FAMILY, cfg16)(params, **inputs)
    assert out16.dtype == jnp.bfloat16
    ref = np.asarray(apply32(params, **inputs))
    assert rel_err(np.asarray(out16, np.float32), ref) < 5e-2


def test_remat_policies_keep_values_and_gradients():
    cfg = dataclasses.replace(flux.VARIANTS["tiny"], num_layers=1, num_single_layers=1)
    inputs = {k: (None if v is None else jnp.full(v.shape, 0.3, v.dtype)) for k, v in flux.example_inputs(cfg, 2, 4, 3).items()}
    params = nn.unbox(flux.FluxTransformer(cfg).init(jax.random.key(0), **inputs))["params"]
    # Non-zero modulation weights, so every block contributes to the gradient.
    params = jax.tree.map(lambda p: p + 0.02 * jax.random.normal(jax.random.key(1), p.shape), params)

    def loss_fn(policy):
        model = flux.FluxTransformer(dataclasses.replace(cfg, remat_policy=policy))
        return jax.value_and_grad(lambda p: jnp.sum(model.apply({"params": p}, **inputs) ** 2))

    assert "remat" not in str(jax.make_jaxpr(loss_fn("none"))(params))
    v0, g0 = jax.jit(loss_fn("none"))(params)
    for policy in ("full", "save_attention"):
        assert "remat" in str(jax.make_jaxpr(loss_fn(policy))(params))  # remat really wraps the blocks
        v1, g1 = jax.jit(loss_fn(policy))(params)
        np.testing.assert_allclose(v1, v0, rtol=1e-6)
        chex.assert_trees_all_close(g1, g0, rtol=1e-4, atol=1e-5)


def test_bad_inputs_fail_with_named_argument():
    model = random_flux(3, guidance_embeds=True)
    inputs = to_numpy(flux_inputs(model, 1, 2, 2, 3, guidance=True))
    apply_fn, params = from_diffusers(model)
    with pytest.raises(ValueError, match="guidance_embeds=True"):
        apply_fn(params, **{**inputs, "guidance": None})
    with pytest.raises(ValueError, match="hidden_states"):
        apply_fn(params, **{**inputs, "hidden_states": inputs["hidden_states"][..., :8]})
    with pytest.raises(ValueError, match="img_ids"):
        apply_fn(params, **{**inputs, "img_ids": inputs["img_ids"][:3]})
    with pytest.raises(ValueError, match="joint_attention_kwargs"):
        apply_fn(params, **inputs, joint_attention_kwargs={"scale": 0.5})


def test_config_validation():
    with pytest.raises(ValueError, match="axes_dims_rope"):
        flux.FluxConfig(attention_head_dim=16, axes_dims_rope=(4, 4, 4))
    with pytest.raises(ValueError, match="remat_policy"):
        flux.FluxConfig(remat_policy="sometimes")
