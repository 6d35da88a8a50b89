"""FLUX VAE decoder port: fp32 parity with diffusers `AutoencoderKL`, full-size shapes, conversion errors."""
import dataclasses

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from diffusers import AutoencoderKL

from digen_jax.models.flux import vae as vae_flux
from digen_jax.models.conversion import ConversionError, convert_weights, torch_state_dict_arrays

# The released FLUX.1 vae/config.json (dev and schnell ship the same VAE).
FLUX_VAE_CONFIG = dict(
    _class_name="AutoencoderKL",
    in_channels=3,
    out_channels=3,
    down_block_types=["DownEncoderBlock2D"] * 4,
    up_block_types=["UpDecoderBlock2D"] * 4,
    block_out_channels=[128, 256, 512, 512],
    layers_per_block=2,
    act_fn="silu",
    latent_channels=16,
    norm_num_groups=32,
    sample_size=1024,
    scaling_factor=0.3611,
    shift_factor=0.1159,
    latents_mean=None,
    latents_std=None,
    force_upcast=True,
    use_quant_conv=False,
    use_post_quant_conv=False,
    mid_block_add_attention=True,
)
TINY = {**FLUX_VAE_CONFIG, "block_out_channels": [8, 16, 32, 32], "latent_channels": 4, "norm_num_groups": 4}


def random_vae(seed: int, **overrides) -> AutoencoderKL:
    """A tiny diffusers FLUX-structured VAE with every weight perturbed, so norm scales and
    biases are non-trivial and a wrong mapping shows."""
    torch.manual_seed(seed)
    config = {k: v for k, v in {**TINY, **overrides}.items() if not k.startswith("_")}
    model = AutoencoderKL(**config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
        # Push one output channel well past 1 so clamping (which diffusers does not do) would show.
        model.decoder.conv_out.bias[0] += 3.0
    return model


def decoder_arrays(model):
    """The state dict without the encoder side, which this port skips by design."""
    return ((k, a) for k, a in torch_state_dict_arrays(model) if not k.startswith(vae_flux.IGNORED_PREFIXES))


def rel_err(a, b):
    return float(np.abs(np.asarray(a) - b).max() / np.abs(b).max())


@pytest.mark.parametrize(
    "overrides,batch,latent_hw",
    [
        ({}, 2, (3, 5)),  # FLUX.1 structure: no post_quant_conv, mid attention; non-square
        # SD-style options FLUX does not use: post_quant_conv, no shift, no mid attention.
        (dict(use_post_quant_conv=True, use_quant_conv=True, shift_factor=None, mid_block_add_attention=False),
         3, (4, 2)),
    ],
)
def test_parity_with_diffusers(overrides, batch, latent_hw):
    model = random_vae(0, **overrides)
    latents = torch.randn(batch, model.config.latent_channels, *latent_hw, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        # What the FLUX pipeline does after unpacking the transformer's latents.
        z = latents / model.config.scaling_factor + (model.config.shift_factor or 0.0)
        ref = model.decode(z).sample.numpy()
    cfg = vae_flux.FAMILY.config_from_diffusers(dict(model.config), dtype="float32", param_dtype="float32")
    params = convert_weights(vae_flux.FAMILY, cfg, decoder_arrays(model))
    out = vae_flux.decode_latents(cfg, params, jnp.asarray(latents.numpy()))
    chex.assert_shape(out, (batch, 3, 8 * latent_hw[0], 8 * latent_hw[1]))
    assert out.dtype == jnp.float32
    assert rel_err(out, ref) <= 1e-5
    assert float(jnp.max(out)) > 1.5  # unclamped, like diffusers


def test_full_size_parameter_count_and_logical_axes():
    cfg = vae_flux.FAMILY.config_from_diffusers(FLUX_VAE_CONFIG)
    assert cfg == vae_flux.VARIANTS["flux1"]
    config = {k: v for k, v in FLUX_VAE_CONFIG.items() if not k.startswith("_")}
    with torch.device("meta"):
        model = AutoencoderKL(**config)
    expected = sum(
        p.numel() for name, p in model.named_parameters() if not name.startswith(vae_flux.IGNORED_PREFIXES)
    )
    abstract = vae_flux.FAMILY.abstract_params(cfg)
    leaves = jax.tree.leaves(abstract, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))
    assert sum(int(np.prod(x.value.shape)) for x in leaves) == expected
    assert expected == 49_545_475  # docs/models.md: 49.5 M decoder parameters
    # Every parameter carries one logical name per dimension.
    for leaf in leaves:
        assert isinstance(leaf, nn.LogicallyPartitioned)
        assert len(leaf.names) == leaf.value.ndim
    conv = abstract["decoder"]["up_blocks_2"]["resnets_0"]["conv_shortcut"]["kernel"]
    assert conv.value.shape == (1, 1, 512, 256)
    assert conv.names == ("conv_kernel", "conv_kernel", "channels_in", "channels")
    # A 128x128 latent decodes to 1024x1024 pixels.
    out = jax.eval_shape(
        lambda p, x: vae_flux.VAEDecoder(cfg).apply({"params": p}, **x),
        nn.unbox(abstract),
        vae_flux.example_inputs(cfg, 1, 128, 128),
    )
    assert out.shape == (1, 3, 1024, 1024)


def test_conversion_rejects_bad_checkpoints():
    model = random_vae(1)
    cfg = vae_flux.FAMILY.config_from_diffusers(dict(model.config), dtype="float32", param_dtype="float32")
    assert cfg == vae_flux.VARIANTS["tiny"]
    bad_key = "decoder.up_blocks.1.resnets.2.conv1.weight"
    arrays = [(k, np.zeros((32, 32, 1, 1), np.float32) if k == bad_key else a) for k, a in decoder_arrays(model)]
    with pytest.raises(ConversionError, match="up_blocks.1.resnets.2.conv1.weight"):
        convert_weights(vae_flux.FAMILY, cfg, arrays)
    # The encoder keys are declared ignored by the family, so a full state dict converts to the
    # same decoder; any other unknown key is still an error.
    full = convert_weights(vae_flux.FAMILY, cfg, torch_state_dict_arrays(model))
    jax.tree.map(np.testing.assert_array_equal, full, convert_weights(vae_flux.FAMILY, cfg, decoder_arrays(model)))
    with pytest.raises(ConversionError, match="unexpected weight 'decoder.bogus.weight'"):
        convert_weights(vae_flux.FAMILY, cfg, list(decoder_arrays(model)) + [("decoder.bogus.weight", np.zeros(1))])
    # A post_quant_conv weight where the config says there is none is unexpected too.
    extra = list(decoder_arrays(model)) + [("post_quant_conv.weight", np.zeros((4, 4, 1, 1), np.float32))]
    with pytest.raises(ConversionError, match="post_quant_conv"):
        convert_weights(vae_flux.FAMILY, cfg, extra)


def test_config_rejects_unimplemented_options():
    with pytest.raises(ValueError, match="latents_mean"):
        vae_flux.VAEConfig(latents_mean=(0.0,) * 16, latents_std=(1.0,) * 16)
    with pytest.raises(ValueError, match="AttnUpDecoderBlock2D"):
        vae_flux.VAEConfig(up_block_types=("UpDecoderBlock2D",) * 3 + ("AttnUpDecoderBlock2D",))
    with pytest.raises(ValueError, match="norm_num_groups"):
        vae_flux.VAEConfig(norm_num_groups=24)


def test_bf16_policy_close_to_fp32():
    model = random_vae(2)
    cfg32 = vae_flux.FAMILY.config_from_diffusers(dict(model.config), dtype="float32", param_dtype="float32")
    params = convert_weights(vae_flux.FAMILY, cfg32, decoder_arrays(model))
    # The shapes of the first parity case, so the float32 decode is already compiled.
    latents = jax.random.normal(jax.random.key(0), (2, 4, 3, 5))
    ref = np.asarray(vae_flux.decode_latents(cfg32, params, latents))
    out16 = vae_flux.decode_latents(dataclasses.replace(cfg32, dtype="bfloat16"), params, latents)
    assert out16.dtype == jnp.bfloat16
    assert rel_err(np.asarray(out16, np.float32), ref) < 5e-2
