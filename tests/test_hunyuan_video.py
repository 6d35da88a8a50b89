"""HunyuanVideo port: fp32 parity with diffusers `HunyuanVideoTransformer3DModel`, full-size shapes."""
import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from diffusers import HunyuanVideoTransformer3DModel

from digen_jax.models import hunyuan_video, make_apply_fn
from digen_jax.models.conversion import ConversionError, convert_weights, torch_state_dict_arrays

TINY = dict(
    in_channels=4,
    out_channels=4,
    num_attention_heads=2,
    attention_head_dim=16,
    num_layers=2,
    num_single_layers=2,
    num_refiner_layers=2,
    text_embed_dim=32,
    pooled_projection_dim=16,
    rope_axes_dim=(4, 6, 6),
)


def random_hunyuan(seed: int, **overrides) -> HunyuanVideoTransformer3DModel:
    """A tiny diffusers HunyuanVideo with every weight perturbed, so norm scales, biases and
    any zero-initialised weight are non-trivial and a wrong mapping shows."""
    torch.manual_seed(seed)
    model = HunyuanVideoTransformer3DModel(**{**TINY, **overrides}).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def port(model, **policy):
    """(apply_fn, params) via the family's conversion, fp32 unless overridden."""
    family = hunyuan_video.FAMILY
    cfg = family.config_from_diffusers(dict(model.config), **{"dtype": "float32", "param_dtype": "float32", **policy})
    params = convert_weights(family, cfg, torch_state_dict_arrays(model), source="test")
    return make_apply_fn(family, cfg), params


def hunyuan_inputs(model, batch: int, frames: int, height: int, width: int, text_lengths, text_len: int, seed: int = 1):
    """Random inputs; `text_lengths` (one per sample) right-pads the text mask. Padded text
    positions hold random values too, so any leak of them into the output shows."""
    g = torch.Generator().manual_seed(seed)
    c = model.config
    mask = (torch.arange(text_len)[None, :] < torch.tensor(text_lengths)[:, None]).long()
    return dict(
        hidden_states=torch.randn(batch, c.in_channels, frames, height, width, generator=g),
        timestep=torch.rand(batch, generator=g) * 1000.0,
        encoder_hidden_states=torch.randn(batch, text_len, c.text_embed_dim, generator=g),
        encoder_attention_mask=mask,
        pooled_projections=torch.randn(batch, c.pooled_projection_dim, generator=g),
        guidance=torch.full((batch,), 6000.0) if c.guidance_embeds else None,
    )


def to_numpy(inputs):
    return {k: (None if v is None else v.numpy()) for k, v in inputs.items()}


def rel_err(a, b):
    return float(np.abs(np.asarray(a) - b).max() / np.abs(b).max())


@pytest.mark.parametrize(
    "overrides,batch,video,text_lengths,text_len",
    [
        (dict(), 2, (3, 4, 6), (5, 2), 7),  # non-square, padded text of different lengths
        (dict(), 3, (1, 6, 2), (4, 4, 1), 4),  # one latent frame, one unpadded sample
        # no guidance embedding, temporal patches, mlp_ratio != 4 (the refiner MLP stays 4x)
        (
            dict(guidance_embeds=False, patch_size_t=2, num_layers=1, num_single_layers=3, out_channels=8, mlp_ratio=2.0),
            2,
            (4, 2, 4),
            (3, 6),
            6,
        ),
    ],
)
def test_parity_with_diffusers(overrides, batch, video, text_lengths, text_len):
    model = random_hunyuan(0, **overrides)
    inputs = hunyuan_inputs(model, batch, *video, text_lengths, text_len)
    with torch.no_grad():
        ref = model(**inputs).sample.numpy()
    apply_fn, params = port(model)
    out = apply_fn(params, **to_numpy(inputs), return_dict=False)
    chex.assert_shape(out, ref.shape)
    assert out.dtype == jnp.float32
    assert rel_err(out, ref) <= 1e-5


def test_full_size_parameter_count_and_logical_axes():
    abstract = hunyuan_video.FAMILY.abstract_params(hunyuan_video.VARIANTS["t2v"])
    leaves = jax.tree.leaves(abstract, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))
    assert sum(int(np.prod(x.value.shape)) for x in leaves) == 12_821_012_544
    # Every parameter carries one logical name per dimension; stacked blocks lead with `layers`.
    for leaf in leaves:
        assert isinstance(leaf, nn.LogicallyPartitioned)
        assert len(leaf.names) == leaf.value.ndim
    unboxed = nn.unbox(abstract)
    assert unboxed["double_blocks"]["attn"]["to_q"]["kernel"].shape == (20, 3072, 3072)
    assert unboxed["single_blocks"]["proj_out"]["kernel"].shape == (40, 3072 + 12288, 3072)
    assert unboxed["context_embedder"]["refiner_blocks"]["ff"]["proj_in"]["kernel"].shape == (2, 3072, 12288)
    assert unboxed["x_embedder"]["kernel"].shape == (1, 2, 2, 16, 3072)
    assert abstract["single_blocks"]["attn"]["to_q"]["kernel"].names == ("layers", "embed", "heads")


def test_conversion_rejects_misshaped_weight():
    model = random_hunyuan(1)
    cfg = hunyuan_video.FAMILY.config_from_diffusers(dict(model.config), dtype="float32")
    weights = dict(torch_state_dict_arrays(model))
    weights["context_embedder.proj_in.weight"] = weights["context_embedder.proj_in.weight"][:, :-1]
    with pytest.raises(ConversionError, match="context_embedder.proj_in.weight"):
        convert_weights(hunyuan_video.FAMILY, cfg, weights.items())


def test_bad_inputs_and_unsupported_configs_fail_clearly():
    model = random_hunyuan(2)
    inputs = to_numpy(hunyuan_inputs(model, 1, 1, 2, 2, (2,), 3))
    apply_fn, params = port(model)
    with pytest.raises(ValueError, match="encoder_attention_mask is required"):
        apply_fn(params, **{**inputs, "encoder_attention_mask": None})
    with pytest.raises(ValueError, match="divisible by the patch"):
        apply_fn(params, **{**inputs, "hidden_states": np.zeros((1, 4, 1, 3, 2), np.float32)})
    with pytest.raises(ValueError, match="guidance_embeds=True"):
        apply_fn(params, **{**inputs, "guidance": None})
    with pytest.raises(ValueError, match="attention_kwargs"):
        apply_fn(params, **inputs, attention_kwargs={"scale": 0.5})
    with pytest.raises(ValueError, match="image-to-video"):
        hunyuan_video.HunyuanVideoConfig(image_condition_type="token_replace")
    with pytest.raises(ValueError, match="rope_axes_dim"):
        hunyuan_video.HunyuanVideoConfig(attention_head_dim=16, rope_axes_dim=(4, 4, 4))
