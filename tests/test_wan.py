"""Wan port: fp32 parity with diffusers `WanTransformer3DModel`, full-size shapes, input checks."""
import dataclasses

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from diffusers import WanTransformer3DModel

from digen_jax.models import make_apply_fn, wan
from digen_jax.models.conversion import ConversionError, convert_weights, torch_state_dict_arrays

TINY = dict(
    num_attention_heads=2,
    attention_head_dim=12,
    in_channels=4,
    out_channels=4,
    text_dim=32,
    freq_dim=32,
    ffn_dim=32,
    num_layers=2,
    rope_max_seq_len=32,
)


def random_wan(seed: int, **overrides) -> WanTransformer3DModel:
    """A tiny diffusers Wan with every weight perturbed, the scale-shift tables included,
    so norm scales and biases are non-trivial and a wrong mapping shows."""
    torch.manual_seed(seed)
    model = WanTransformer3DModel(**{**TINY, **overrides}).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def port(model):
    """(apply_fn, params) of the fp32 port, through the shared conversion."""
    cfg = wan.FAMILY.config_from_diffusers(dict(model.config), dtype="float32", param_dtype="float32")
    params = convert_weights(wan.FAMILY, cfg, torch_state_dict_arrays(model), source="tiny wan")
    return make_apply_fn(wan.FAMILY, cfg), params


def wan_inputs(model, batch: int, frames: int, height: int, width: int, text_len: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    c = model.config
    return dict(
        hidden_states=torch.randn(batch, c.in_channels, frames, height, width, generator=g),
        # Fractional timesteps across the whole [0, 1000] range exercise the sinusoid.
        timestep=1000.0 * torch.rand(batch, generator=g),
        encoder_hidden_states=torch.randn(batch, text_len, c.text_dim, generator=g),
    )


def to_numpy(inputs):
    return {k: v.numpy() for k, v in inputs.items()}


def rel_err(a, b):
    return float(np.abs(np.asarray(a) - b).max() / np.abs(b).max())


@pytest.mark.parametrize(
    "overrides,batch,video,text_len",
    [
        ({}, 2, (1, 4, 6), 7),  # batch > 1, one latent frame, non-square
        ({}, 1, (2, 6, 2), 5),  # two frames, tall
        # Three frames, no cross-attention norm, an uneven RoPE split (8, 6, 6), other out_channels.
        (dict(cross_attn_norm=False, num_attention_heads=1, attention_head_dim=20, out_channels=8), 3, (3, 2, 4), 4),
    ],
)
def test_parity_with_diffusers(overrides, batch, video, text_len):
    model = random_wan(0, **overrides)
    inputs = wan_inputs(model, batch, *video, text_len)
    with torch.no_grad():
        ref = model(**inputs).sample.numpy()
    apply_fn, params = port(model)
    out = apply_fn(params, **to_numpy(inputs), return_dict=False)
    chex.assert_shape(out, ref.shape)
    assert out.dtype == jnp.float32
    assert rel_err(out, ref) <= 1e-5


@pytest.mark.parametrize("batch,video", [(2, (3, 4, 6)), (1, (2, 2, 4))])
def test_per_token_timesteps_parity_with_diffusers(batch, video):
    """Wan2.2 TI2V: a (B, S) timestep, one per patch token. The pipeline's pattern (first latent
    frame's tokens at 0, the rest at t) in the first sample, arbitrary per-token values in the
    others, so a wrong token order or a timestep broadcast over the wrong axis shows."""
    model = random_wan(4)
    inputs = wan_inputs(model, batch, *video, 5)
    f, h, w = video[0], video[1] // 2, video[2] // 2
    g = torch.Generator().manual_seed(5)
    per_token = 1000.0 * torch.rand(batch, f * h * w, generator=g)
    per_token[0] = 700.0
    per_token[0, : h * w] = 0.0
    inputs["timestep"] = per_token
    with torch.no_grad():
        ref = model(**inputs).sample.numpy()
    apply_fn, params = port(model)
    out = apply_fn(params, **to_numpy(inputs))
    chex.assert_shape(out, ref.shape)
    assert rel_err(out, ref) <= 1e-5
    # A (B, S) timestep equal on every token is the (B,) timestep.
    same = np.full((batch, f * h * w), 321.0, np.float32)
    np.testing.assert_allclose(
        np.asarray(apply_fn(params, **{**to_numpy(inputs), "timestep": same})),
        np.asarray(apply_fn(params, **{**to_numpy(inputs), "timestep": same[:, 0]})),
        rtol=1e-5, atol=1e-6,
    )


def test_rope_split_matches_diffusers():
    model = random_wan(0, attention_head_dim=20)
    cfg = wan.FAMILY.config_from_diffusers(dict(model.config))
    assert cfg.rope_axes_dims == (model.rope.t_dim, model.rope.h_dim, model.rope.w_dim) == (8, 6, 6)
    assert wan.VARIANTS["t2v-14b"].rope_axes_dims == (44, 42, 42)
    cos, sin = model.rope(torch.zeros(1, 4, 3, 4, 6))
    ours = wan.rope_tables(cfg, (3, 2, 3))
    np.testing.assert_array_equal(np.asarray(ours[0]), cos[0, :, 0].numpy())
    np.testing.assert_array_equal(np.asarray(ours[1]), sin[0, :, 0].numpy())


def test_parameter_counts_and_logical_axes():
    tiny = nn.unbox(wan.FAMILY.abstract_params(wan.VARIANTS["tiny"]))
    assert sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tiny)) == 20_600

    abstract = wan.FAMILY.abstract_params(wan.VARIANTS["t2v-14b"])
    leaves = jax.tree.leaves(abstract, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))
    assert sum(int(np.prod(x.value.shape)) for x in leaves) == 14_288_491_584
    # Every parameter carries one logical name per dimension; stacked blocks lead with `layers`.
    for leaf in leaves:
        assert isinstance(leaf, nn.LogicallyPartitioned)
        assert len(leaf.names) == leaf.value.ndim
    assert abstract["blocks"]["attn1"]["to_q"]["kernel"].names == ("layers", "embed", "heads")
    assert abstract["blocks"]["attn2"]["norm_k"]["scale"].names == ("layers", "heads")
    assert abstract["blocks"]["scale_shift_table"].value.shape == (40, 1, 6, 5120)
    assert abstract["patch_embedding"]["kernel"].value.shape == (1, 2, 2, 16, 5120)


def test_conversion_rejects_misshaped_weight():
    model = random_wan(1)
    cfg = wan.FAMILY.config_from_diffusers(dict(model.config))
    weights = dict(torch_state_dict_arrays(model))
    weights["blocks.1.scale_shift_table"] = weights["blocks.1.scale_shift_table"][:, :5]
    with pytest.raises(ConversionError, match="blocks.1.scale_shift_table"):
        convert_weights(wan.FAMILY, cfg, weights.items())


def test_image_conditioning_configs_rejected():
    with pytest.raises(ValueError, match="added_kv_proj_dim"):
        wan.WanConfig(added_kv_proj_dim=5120)
    with pytest.raises(ValueError, match="image_dim"):
        wan.FAMILY.config_from_diffusers({**dict(random_wan(0).config), "image_dim": 1280})


def test_bad_inputs_fail_with_named_argument():
    model = random_wan(2)
    inputs = to_numpy(wan_inputs(model, 1, 1, 4, 4, 3))
    apply_fn, params = port(model)
    with pytest.raises(ValueError, match="hidden_states W = 5 must be a multiple"):
        apply_fn(params, **{**inputs, "hidden_states": np.zeros((1, 4, 1, 4, 5), np.float32)})
    with pytest.raises(ValueError, match="rope_max_seq_len"):
        apply_fn(params, **{**inputs, "hidden_states": np.zeros((1, 4, 33, 4, 4), np.float32)})
    with pytest.raises(ValueError, match=r"timestep must have shape \(1,\) or, one per patch token, \(1, 4\)"):
        apply_fn(params, **{**inputs, "timestep": np.zeros((1, 5), np.float32)})
    with pytest.raises(ValueError, match="encoder_hidden_states"):
        apply_fn(params, **{**inputs, "encoder_hidden_states": inputs["encoder_hidden_states"][..., :8]})
    with pytest.raises(ValueError, match="encoder_hidden_states_image"):
        apply_fn(params, **inputs, encoder_hidden_states_image=np.zeros((1, 257, 32), np.float32))
    with pytest.raises(ValueError, match="attention_kwargs"):
        apply_fn(params, **inputs, attention_kwargs={"scale": 0.5})


def test_bf16_policy_close_to_fp32():
    model = random_wan(3)
    inputs = to_numpy(wan_inputs(model, 2, 2, 4, 4, 6))
    apply32, params = port(model)
    cfg16 = wan.FAMILY.config_from_diffusers(dict(model.config), dtype="bfloat16", param_dtype="float32")
    out16 = make_apply_fn(wan.FAMILY, cfg16)(params, **inputs)
    assert out16.dtype == jnp.bfloat16
    ref = np.asarray(apply32(params, **inputs))
    assert rel_err(np.asarray(out16, np.float32), ref) < 5e-2



def test_remat_policy_wraps_blocks_and_names_attention():
    # Remat itself is the shared `stacking.scan_blocks` mechanism (values and gradients are
    # tested with FLUX); here: the Wan blocks are wrapped and tag both attentions'
    # outputs `attn_out`, which the 'save_attention' policy keeps. Tracing only, no compile.
    cfg = dataclasses.replace(wan.VARIANTS["tiny"], remat_policy="save_attention")
    inputs = wan.example_inputs(cfg, 1, 2, 2, 2, 3)
    module = wan.WanTransformer(cfg)
    params = nn.unbox(wan.FAMILY.abstract_params(cfg))
    forward = lambda p, x: module.apply({"params": p}, **x)  # noqa: E731
    assert str(jax.make_jaxpr(forward)(params, inputs)).count("name=attn_out") == 2  # once per attention
    assert "remat" in str(jax.make_jaxpr(jax.grad(lambda p, x: jnp.sum(forward(p, x))))(params, inputs))
