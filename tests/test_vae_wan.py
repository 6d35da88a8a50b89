"""Wan2.1 / Qwen-Image VAE decoder port: fp32 parity with diffusers `decode`, full-size shapes, conversion errors."""
import dataclasses

import flax.linen as nn
import jax
import numpy as np
import pytest
import torch
from diffusers import AutoencoderKLQwenImage, AutoencoderKLWan

from digen_jax.models import vae_wan
from digen_jax.models.conversion import ConversionError, convert_weights, torch_state_dict_arrays

# docs/models.md's tiny Wan/Qwen VAE: the released structure with 8-channel bases and z_dim 4,
# with the first four released latent statistics (non-trivial mean and std).
TINY = dict(
    base_dim=8,
    z_dim=4,
    dim_mult=[1, 2, 4, 4],
    num_res_blocks=2,
    latents_mean=list(vae_wan.LATENTS_MEAN[:4]),
    latents_std=list(vae_wan.LATENTS_STD[:4]),
)


def perturbed(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Every weight perturbed, so that the all-ones gammas and zero biases are non-trivial and a
    wrong mapping shows."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model.eval()


@pytest.fixture(scope="module")
def tiny_wan():
    torch.manual_seed(0)
    model = perturbed(AutoencoderKLWan(**TINY), 1)
    cfg = vae_wan.FAMILY.config_from_diffusers(dict(model.config))
    params = convert_weights(vae_wan.FAMILY, cfg, torch_state_dict_arrays(model))
    return model, cfg, params


def rel_err(a, b):
    return float(np.abs(np.asarray(a) - b).max() / np.abs(b).max())


def pipeline_decode(model, z: torch.Tensor) -> np.ndarray:
    """What the Wan / Qwen-Image pipelines do with the denoised latents."""
    c = model.config
    mean = torch.tensor(c.latents_mean).view(1, c.z_dim, 1, 1, 1)
    inv_std = 1.0 / torch.tensor(c.latents_std).view(1, c.z_dim, 1, 1, 1)
    with torch.no_grad():
        return model.decode(z / inv_std + mean, return_dict=False)[0].numpy()


@pytest.mark.parametrize("latent_frames", [1, 2, 3])  # an image (Qwen-Image), then videos
def test_decode_latents_parity(tiny_wan, latent_frames):
    model, cfg, params = tiny_wan
    z = torch.randn(2, 4, latent_frames, 3, 5, generator=torch.Generator().manual_seed(latent_frames))
    ref = pipeline_decode(model, z)
    out = np.asarray(vae_wan.decode_latents(params, cfg, z.numpy()))
    assert out.shape == ref.shape == (2, 3, cfg.num_frames(latent_frames), 24, 40)
    assert cfg.num_frames(latent_frames) == 4 * (latent_frames - 1) + 1
    assert out.dtype == np.float32
    assert out.min() >= -1.0 and out.max() <= 1.0
    assert rel_err(out, ref) <= 1e-5


def test_raw_decode_parity(tiny_wan):
    model, cfg, params = tiny_wan
    # The latent shape of a parity case above, so the compiled decoder is reused.
    z = 2.0 * torch.randn(2, 4, 2, 3, 5, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        ref = model.decode(z).sample.numpy()
    out = np.asarray(vae_wan.decode(params, cfg, z.numpy()))
    assert out.shape == ref.shape == (2, 3, 5, 24, 40)
    assert rel_err(out, ref) <= 1e-5


def test_later_latent_frames_are_scanned(tiny_wan):
    _, cfg, params = tiny_wan
    jaxpr = str(jax.make_jaxpr(lambda z: vae_wan.decode_latents(params, cfg, z))(np.zeros((1, 4, 3, 2, 2), np.float32)))
    assert "scan[" in jaxpr


def test_qwenimage_vae_is_the_same_decoder():
    model = perturbed(AutoencoderKLQwenImage(**TINY), 2)
    cfg = vae_wan.QWEN_FAMILY.config_from_diffusers(dict(model.config))
    params = convert_weights(vae_wan.QWEN_FAMILY, cfg, torch_state_dict_arrays(model))
    z = torch.randn(2, 4, 1, 2, 3, generator=torch.Generator().manual_seed(3))
    ref = pipeline_decode(model, z)
    out = np.asarray(vae_wan.decode_latents(params, cfg, z.numpy()))
    assert out.shape == ref.shape == (2, 3, 1, 16, 24)
    assert rel_err(out, ref) <= 1e-5


def test_full_size_parameter_count_and_logical_axes():
    torch_model = AutoencoderKLWan()
    expected = sum(
        p.numel() for k, p in torch_model.named_parameters() if not k.startswith(vae_wan.IGNORED_PREFIXES)
    )
    abstract = vae_wan.FAMILY.abstract_params(vae_wan.VARIANTS["wan2.1"])
    leaves = jax.tree.leaves(abstract, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))
    assert sum(int(np.prod(x.value.shape)) for x in leaves) == expected == 73_295_603
    for leaf in leaves:
        assert isinstance(leaf, nn.LogicallyPartitioned)
        assert len(leaf.names) == leaf.value.ndim
    # The rules cover exactly the decoder's keys: every parameter, none of the encoder's.
    decoder_keys = {k for k in torch_model.state_dict() if not k.startswith(vae_wan.IGNORED_PREFIXES)}
    assert {r.key for r in vae_wan.weight_rules(vae_wan.VARIANTS["wan2.1"])} == decoder_keys


def test_conversion_errors(tiny_wan):
    model, cfg, _ = tiny_wan
    pairs = list(torch_state_dict_arrays(model))
    key = "decoder.up_blocks.0.upsamplers.0.time_conv.weight"
    bad = [(k, a[:-1] if k == key else a) for k, a in pairs]
    with pytest.raises(ConversionError, match="time_conv.weight"):
        convert_weights(vae_wan.FAMILY, cfg, bad)
    # The encoder's keys are declared ignored by the family; any other unknown key is an error.
    with pytest.raises(ConversionError, match="unexpected weight 'decoder.bogus'"):
        convert_weights(vae_wan.FAMILY, cfg, pairs + [("decoder.bogus", np.zeros(1, np.float32))])


def test_config_validation():
    with pytest.raises(ValueError, match="is_residual"):
        vae_wan.FAMILY.config_from_diffusers(dict(base_dim=160, z_dim=48, is_residual=True, patch_size=2))
    with pytest.raises(ValueError, match="z_dim=4"):
        dataclasses.replace(vae_wan.VARIANTS["tiny"], latents_mean=vae_wan.LATENTS_MEAN)
    with pytest.raises(ValueError, match="z must have shape"):
        vae_wan.decode_latents({}, vae_wan.VARIANTS["tiny"], np.zeros((1, 16, 1, 2, 2), np.float32))
