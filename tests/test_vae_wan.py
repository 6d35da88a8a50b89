"""Wan VAE port: fp32 parity with diffusers `decode` (Wan2.1, Qwen-Image, Wan2.2) and `encode`
(Wan2.1, Wan2.2), full-size shapes, conversion from a folder and its errors."""
import dataclasses

import flax.linen as nn
import jax
import numpy as np
import pytest
import torch
from diffusers import AutoencoderKLQwenImage, AutoencoderKLWan

from digen_jax.models import convert_diffusers_folder, from_diffusers, load_checkpoint
from digen_jax.models.wan import vae as vae_wan
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


# The Wan2.2 VAE's structure (residual levels, 2x2 patches, decoder wider than the encoder) with
# 8- and 16-channel bases and z_dim 8, with the first eight released latent statistics.
TINY22 = dict(
    base_dim=8,
    decoder_base_dim=16,
    z_dim=8,
    dim_mult=[1, 2, 4, 4],
    num_res_blocks=2,
    in_channels=12,
    out_channels=12,
    is_residual=True,
    patch_size=2,
    scale_factor_spatial=16,
    latents_mean=list(vae_wan.LATENTS_MEAN_22[:8]),
    latents_std=list(vae_wan.LATENTS_STD_22[:8]),
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


@pytest.fixture(scope="module")
def tiny22():
    """A random tiny Wan2.2 VAE, its decoder and its encoder ported through `from_diffusers`."""
    torch.manual_seed(0)
    model = perturbed(AutoencoderKLWan(**TINY22), 4)
    decode_fn, decoder = from_diffusers(model)
    encode_fn, encoder = from_diffusers(model, family="vae_wan_encoder")
    return model, (decode_fn, decoder), (encode_fn, encoder)


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


def test_wan22_decode_parity(tiny22):
    """The residual decoder (DupUp3D shortcuts, width-keeping upsamplers) and unpatchify: 16x
    spatial, 4x temporal; the first latent frame gives one frame, the scanned later ones four."""
    model, (decode_fn, params), _ = tiny22
    z = 2.0 * torch.randn(2, 8, 3, 2, 3, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = model.decode(z).sample.numpy()
    out = np.asarray(decode_fn(params, z=z.numpy()))
    assert out.shape == ref.shape == (2, 3, 9, 32, 48)
    assert rel_err(out, ref) <= 1e-5


def test_wan22_encode_parity(tiny22):
    """patchify, the residual encoder (AvgDown3D shortcuts, strided time convs across the
    chunks: 1 frame, then 4 at a time) and quant_conv: the posterior's moments."""
    model, _, (encode_fn, params) = tiny22
    x = 2.0 * torch.rand(2, 3, 9, 32, 48, generator=torch.Generator().manual_seed(9)) - 1.0
    with torch.no_grad():
        ref = model.encode(x).latent_dist.parameters.numpy()
    out = np.asarray(encode_fn(params, x=x.numpy()))
    assert out.shape == ref.shape == (2, 16, 3, 2, 3)
    assert rel_err(out, ref) <= 1e-5


def test_wan22_encode_latents_of_an_image(tiny22):
    """TI2V's conditioning frame: the posterior mean, normalised as pipeline_wan_i2v does."""
    model, _, (_, params) = tiny22
    x = 2.0 * torch.rand(1, 3, 1, 16, 32, generator=torch.Generator().manual_seed(1)) - 1.0
    c = model.config
    mean = torch.tensor(c.latents_mean).view(1, c.z_dim, 1, 1, 1)
    inv_std = 1.0 / torch.tensor(c.latents_std).view(1, c.z_dim, 1, 1, 1)
    with torch.no_grad():
        ref = ((model.encode(x).latent_dist.mode() - mean) * inv_std).numpy()
    cfg = vae_wan.ENCODER_FAMILY.config_from_diffusers(dict(c))
    out = np.asarray(vae_wan.encode_latents(params, cfg, x.numpy()))
    assert out.shape == ref.shape == (1, 8, 1, 1, 2)
    assert rel_err(out, ref) <= 1e-5


def test_wan21_encode_parity(tiny_wan):
    model, _, _ = tiny_wan
    encode_fn, params = from_diffusers(model, family="vae_wan_encoder")
    x = 2.0 * torch.rand(1, 3, 5, 16, 24, generator=torch.Generator().manual_seed(2)) - 1.0
    with torch.no_grad():
        ref = model.encode(x).latent_dist.parameters.numpy()
    out = np.asarray(encode_fn(params, x=x.numpy()))
    assert out.shape == ref.shape == (1, 8, 2, 2, 3)
    assert rel_err(out, ref) <= 1e-5


def test_wan22_converts_from_a_folder(tiny22, tmp_path):
    """Decoder and encoder from one diffusers VAE folder, through the CLI's conversion function."""
    model, (_, decoder), (_, encoder) = tiny22
    model.save_pretrained(tmp_path / "vae")
    for family, direct in (("vae_wan", decoder), ("vae_wan_encoder", encoder)):
        out = tmp_path / family
        convert_diffusers_folder(str(tmp_path / "vae"), str(out), family=family, log=lambda _: None)
        loaded_family, cfg, params = load_checkpoint(str(out), dtype="float32")
        assert loaded_family.name == family and cfg.is_residual and cfg.patch_size == 2 and cfg.z_dim == 8
        jax.tree.map(np.testing.assert_array_equal, params, direct)
    with pytest.raises(ValueError, match="family 'wan' does not port 'AutoencoderKLWan'.*vae_wan_encoder"):
        convert_diffusers_folder(str(tmp_path / "vae"), str(tmp_path / "x"), family="wan", log=lambda _: None)


def test_wan22_full_size_parameter_counts():
    with torch.device("meta"):
        torch_model = AutoencoderKLWan(**{**TINY22, **_RELEASED22})
    cfg = vae_wan.VARIANTS["wan2.2"]
    assert cfg == vae_wan.FAMILY.config_from_diffusers(dict(torch_model.config))
    for family, prefixes in ((vae_wan.FAMILY, vae_wan.IGNORED_PREFIXES), (vae_wan.ENCODER_FAMILY, vae_wan.ENCODER_IGNORED_PREFIXES)):
        expected = {k: tuple(p.shape) for k, p in torch_model.named_parameters() if not k.startswith(prefixes)}
        assert {r.key for r in family.weight_rules(cfg)} == set(expected)
        leaves = jax.tree.leaves(nn.unbox(family.abstract_params(cfg)))
        assert sum(int(np.prod(x.shape)) for x in leaves) == sum(int(np.prod(s)) for s in expected.values())


# The released Wan2.2 VAE's config (Wan-AI/Wan2.2-TI2V-5B-Diffusers vae/config.json) over TINY22.
_RELEASED22 = dict(
    base_dim=160, decoder_base_dim=256, z_dim=48, latents_mean=list(vae_wan.LATENTS_MEAN_22),
    latents_std=list(vae_wan.LATENTS_STD_22),
)


def test_config_validation():
    with pytest.raises(ValueError, match="multiples of patch_size"):
        vae_wan.FAMILY.config_from_diffusers(dict(TINY22, out_channels=3))
    with pytest.raises(ValueError, match="attn_scales"):
        vae_wan.ENCODER_FAMILY.abstract_params(dataclasses.replace(vae_wan.VARIANTS["tiny"], attn_scales=(0.5,)))
    with pytest.raises(ValueError, match=r"frame count must be 1 \+ 4k and height and width multiples of 16"):
        vae_wan.encode({}, vae_wan.VARIANTS["tiny22"], np.zeros((1, 3, 4, 16, 16), np.float32))
    with pytest.raises(ValueError, match="z_dim=4"):
        dataclasses.replace(vae_wan.VARIANTS["tiny"], latents_mean=vae_wan.LATENTS_MEAN)
    with pytest.raises(ValueError, match="z must have shape"):
        vae_wan.decode_latents({}, vae_wan.VARIANTS["tiny"], np.zeros((1, 16, 1, 2, 2), np.float32))
