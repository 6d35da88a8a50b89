"""Qwen-Image port: fp32 parity with diffusers `QwenImageTransformer2DModel`, full-size shapes, policies."""
import dataclasses

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from diffusers import QwenImageTransformer2DModel
from diffusers.models.transformers.transformer_qwenimage import QwenEmbedRope

from digen_jax.models import make_apply_fn, qwenimage, rope
from digen_jax.models.conversion import ConversionError, convert_weights, torch_state_dict_arrays

FAMILY = qwenimage.FAMILY
TINY = dict(
    num_layers=2,
    attention_head_dim=16,
    num_attention_heads=2,
    in_channels=16,
    out_channels=4,
    joint_attention_dim=32,
    axes_dims_rope=(4, 6, 6),
)


def random_qwen(seed: int, **overrides) -> QwenImageTransformer2DModel:
    """A tiny diffusers Qwen-Image with every weight perturbed (so norm scales and biases are
    non-trivial and a wrong mapping shows)."""
    torch.manual_seed(seed)
    model = QwenImageTransformer2DModel(**{**TINY, **overrides}).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def port(model, **policy):
    """(apply_fn, params, cfg) of the port, in float32 unless `policy` says otherwise."""
    policy = {"dtype": "float32", "param_dtype": "float32", **policy}
    cfg = FAMILY.config_from_diffusers(dict(model.config), **policy)
    params = convert_weights(FAMILY, cfg, torch_state_dict_arrays(model))
    return make_apply_fn(FAMILY, cfg), params, cfg


def qwen_inputs(model, batch: int, images, text_len: int, valid_lens=None, seed: int = 1):
    """Forward kwargs for `images` = one sample's list of (frames, h, w); `valid_lens` per
    sample builds a right-padded mask (None: no mask)."""
    g = torch.Generator().manual_seed(seed)
    c = model.config
    image_seq_len = sum(f * h * w for f, h, w in images)
    mask = None
    if valid_lens is not None:
        mask = (torch.arange(text_len)[None, :] < torch.tensor(valid_lens)[:, None]).long()
    return dict(
        hidden_states=torch.randn(batch, image_seq_len, c.in_channels, generator=g),
        encoder_hidden_states=torch.randn(batch, text_len, c.joint_attention_dim, generator=g),
        encoder_hidden_states_mask=mask,
        timestep=torch.rand(batch, generator=g),
        img_shapes=[list(images)] * batch,
    )


def to_numpy(inputs):
    return {k: (v.numpy() if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()}


def rel_err(a, b):
    return float(np.abs(np.asarray(a) - b).max() / np.abs(b).max())


@pytest.mark.parametrize(
    "overrides,batch,images,text_len,valid_lens",
    [
        ({}, 2, [(1, 4, 6)], 7, (7, 4)),  # non-square grid, padded prompts of different lengths
        ({}, 3, [(1, 5, 3)], 5, None),  # odd grid, no mask
        (dict(num_layers=1, out_channels=None), 2, [(1, 3, 3), (1, 2, 4)], 6, (3, 6)),  # two images (edit-style)
    ],
)
def test_parity_with_diffusers(overrides, batch, images, text_len, valid_lens):
    model = random_qwen(0, **overrides)
    inputs = qwen_inputs(model, batch, images, text_len, valid_lens)
    with torch.no_grad():
        ref = model(**inputs).sample.numpy()
    apply_fn, params, _ = port(model)
    out = apply_fn(params, **to_numpy(inputs), return_dict=False)
    chex.assert_shape(out, ref.shape)
    assert out.dtype == jnp.float32
    assert rel_err(out, ref) <= 1e-5
    if valid_lens is not None:  # the mask really changes the result, so parity covers it
        with torch.no_grad():
            unmasked = model(**{**inputs, "encoder_hidden_states_mask": None}).sample.numpy()
        assert rel_err(unmasked, ref) > 1e-3


def test_rope_positions_match_diffusers():
    """Centred image rows/cols, frame = image index, text from max(h//2, w//2): the angles of
    diffusers' complex tables, at full-size dims and positions into the thousands."""
    axes = (16, 56, 56)
    embed = QwenEmbedRope(theta=10000, axes_dim=list(axes), scale_rope=True)
    images, text_len = [(1, 5, 8), (1, 64, 3)], 2000
    img_freqs, txt_freqs = embed([images], max_txt_seq_len=text_len, device=torch.device("cpu"))
    img_ids, txt_ids = qwenimage.rope_position_ids([images], 5 * 8 + 64 * 3, text_len)
    cos, sin = rope.rope_tables(jnp.concatenate([img_ids, txt_ids]), axes, qwenimage.ROPE_THETA, float32_exponent=True)
    ref = torch.cat([img_freqs, txt_freqs]).numpy()  # complex, one entry per channel pair
    np.testing.assert_allclose(np.asarray(cos)[:, ::2], ref.real, atol=2e-6, rtol=0)
    np.testing.assert_allclose(np.asarray(sin)[:, ::2], ref.imag, atol=2e-6, rtol=0)


def test_full_size_parameter_count_and_logical_axes():
    abstract = FAMILY.abstract_params(qwenimage.VARIANTS["qwen-image"])
    leaves = jax.tree.leaves(abstract, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))
    assert sum(int(np.prod(x.value.shape)) for x in leaves) == 20_430_401_088
    # Every parameter carries one logical name per dimension; stacked blocks lead with `layers`.
    for leaf in leaves:
        assert isinstance(leaf, nn.LogicallyPartitioned)
        assert len(leaf.names) == leaf.value.ndim
    blocks = nn.unbox(abstract)["transformer_blocks"]["attn"]["to_q"]["kernel"]
    assert blocks.shape == (60, 3072, 3072)
    assert abstract["transformer_blocks"]["img_mod"]["linear"]["kernel"].names == ("layers", "embed", "modulation")
    assert abstract["txt_norm"]["scale"].names == ("cond",)


def test_conversion_rejects_mismatched_checkpoints():
    model = random_qwen(1)
    cfg = FAMILY.config_from_diffusers(dict(model.config))
    weights = dict(torch_state_dict_arrays(model))
    missing = {k: v for k, v in weights.items() if k != "transformer_blocks.1.attn.norm_added_k.weight"}
    with pytest.raises(ConversionError, match="missing weight 'transformer_blocks.1.attn.norm_added_k.weight'"):
        convert_weights(FAMILY, cfg, missing.items())
    extra = {**weights, "pos_embed.freqs": np.zeros(4, np.float32)}
    with pytest.raises(ConversionError, match="unexpected weight 'pos_embed.freqs'"):
        convert_weights(FAMILY, cfg, extra.items())
    bad = {**weights, "txt_in.weight": weights["txt_in.weight"][:, :16]}
    with pytest.raises(ConversionError, match="'txt_in.weight' has shape"):
        convert_weights(FAMILY, cfg, bad.items())


def test_bf16_policy_close_to_fp32():
    model = random_qwen(2)
    inputs = qwen_inputs(model, 2, [(1, 4, 4)], 6, (6, 2))
    with torch.no_grad():
        ref = model(**inputs).sample.numpy()
    apply16, params, _ = port(model, dtype="bfloat16")
    out16 = apply16(params, **to_numpy(inputs))
    assert out16.dtype == jnp.bfloat16
    assert rel_err(np.asarray(out16, np.float32), ref) < 5e-2


def test_remat_policy_wraps_the_blocks():
    """Tracing only (compiling the gradient costs tens of seconds on CPU); that remat keeps
    values and gradients is tested on FLUX, through the same `stacking.scan_blocks`."""
    cfg = dataclasses.replace(qwenimage.VARIANTS["tiny"], num_layers=1)
    inputs = qwenimage.example_inputs(cfg, 2, 6, 3)
    inputs = {k: (jnp.full(v.shape, 0.3, v.dtype) if isinstance(v, jax.ShapeDtypeStruct) else v) for k, v in inputs.items()}
    params = nn.unbox(jax.eval_shape(lambda: qwenimage.QwenImageTransformer(cfg).init(jax.random.key(0), **inputs)))

    def grad_jaxpr(policy):
        model = qwenimage.QwenImageTransformer(dataclasses.replace(cfg, remat_policy=policy))
        loss = lambda p: jnp.sum(model.apply(p, **inputs) ** 2)  # noqa: E731
        return str(jax.make_jaxpr(jax.grad(loss))(params))

    assert "remat" not in grad_jaxpr("none")
    assert "remat" in grad_jaxpr("save_attention")


def test_bad_inputs_fail_with_named_argument():
    model = random_qwen(3)
    inputs = to_numpy(qwen_inputs(model, 1, [(1, 2, 2)], 3, (2,)))
    apply_fn, params, cfg = port(model)
    with pytest.raises(ValueError, match="guidance"):
        apply_fn(params, **inputs, guidance=np.ones(1, np.float32))
    with pytest.raises(ValueError, match="attention_kwargs"):
        apply_fn(params, **inputs, attention_kwargs={"scale": 0.5})
    with pytest.raises(TypeError, match="txt_seq_lens"):  # removed from the diffusers forward
        apply_fn(params, **inputs, txt_seq_lens=[3])
    with pytest.raises(ValueError, match="encoder_hidden_states_mask"):
        apply_fn(params, **{**inputs, "encoder_hidden_states_mask": inputs["encoder_hidden_states_mask"][:, :2]})
    with pytest.raises(ValueError, match="img_shapes is required"):
        apply_fn(params, **{**inputs, "img_shapes": None})
    # Concrete sizes (outside jit) are checked against the token count.
    module = qwenimage.QwenImageTransformer(cfg)
    with pytest.raises(ValueError, match="hold 6 image tokens"):
        module.apply({"params": params}, **{**inputs, "img_shapes": [[(1, 2, 3)]]})


def test_config_validation():
    with pytest.raises(ValueError, match="axes_dims_rope"):
        qwenimage.QwenImageConfig(attention_head_dim=16, axes_dims_rope=(4, 4, 4))
    with pytest.raises(ValueError, match="zero_cond_t"):
        qwenimage.QwenImageConfig(zero_cond_t=True)
    with pytest.raises(ValueError, match="remat_policy"):
        qwenimage.QwenImageConfig(remat_policy="sometimes")
    # The released config.json's legacy key is accepted and builds nothing.
    cfg = FAMILY.config_from_diffusers({"_class_name": "QwenImageTransformer2DModel", "pooled_projection_dim": 768})
    assert cfg == qwenimage.QwenImageConfig(pooled_projection_dim=768)
