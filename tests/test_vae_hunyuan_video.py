"""HunyuanVideo VAE decoder port: fp32 parity with diffusers' `decode` (tiled as diffusers
tiles, and untiled), full-size shapes, conversion errors."""
import dataclasses

import flax.linen as nn
import jax
import numpy as np
import pytest
import torch
from diffusers import AutoencoderKLHunyuanVideo

from digen_jax.models.hunyuan_video import vae as vae_hv
from digen_jax.models.conversion import ConversionError, convert_weights, torch_state_dict_arrays

# docs/models.md's tiny HunyuanVideo VAE: the released structure with 8-channel bases.
TINY = dict(block_out_channels=[8, 16, 32, 32], layers_per_block=2, norm_num_groups=4, latent_channels=4)


@pytest.fixture(scope="module")
def tiny_vae():
    """A tiny diffusers VAE with every weight perturbed (so unit norm scales and zero biases
    are non-trivial and a wrong mapping shows), with diffusers' default tiling, and its conversion."""
    torch.manual_seed(0)
    model = AutoencoderKLHunyuanVideo(**TINY).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
        # Push one output channel well past 1 so clamping (which diffusers does not do) would show.
        model.decoder.conv_out.conv.bias[0] += 3.0
    cfg = vae_hv.FAMILY.config_from_diffusers(dict(model.config))
    params = convert_weights(vae_hv.FAMILY, cfg, torch_state_dict_arrays(model))
    return model, cfg, params


def rel_err(a, b):
    return float(np.abs(np.asarray(a) - b).max() / np.abs(b).max())


@pytest.mark.parametrize("latent_frames,batch,latent_hw", [(1, 2, (3, 2)), (3, 2, (2, 3))])  # an image, then a video
def test_decode_latents_parity(tiny_vae, latent_frames, batch, latent_hw):
    model, cfg, params = tiny_vae
    assert cfg == vae_hv.VARIANTS["tiny"]
    latents = torch.randn(batch, 4, latent_frames, *latent_hw, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        # What the HunyuanVideo pipeline does with the denoised latents.
        ref = model.decode(latents / model.config.scaling_factor).sample.numpy()
    out = vae_hv.decode_latents(params, cfg, latents.numpy())
    frames = cfg.num_frames(latent_frames)
    assert frames == 4 * (latent_frames - 1) + 1
    assert out.shape == ref.shape == (batch, 3, frames, 8 * latent_hw[0], 8 * latent_hw[1])
    assert rel_err(out, ref) <= 1e-5
    assert float(out.max()) > 1.5  # unclamped, like diffusers


def torch_decode(model, z, tiling):
    """diffusers' `model.decode(z)` with `tiling`'s attributes set on the model, restored afterwards."""
    fields = dataclasses.asdict(tiling)
    saved = {k: getattr(model, k) for k in fields}
    try:
        for k, v in fields.items():
            setattr(model, k, v)
        with torch.no_grad():
            return model.decode(z).sample.numpy()
    finally:
        for k, v in saved.items():
            setattr(model, k, v)


# Latent lengths past 4 frames: diffusers' default decode blends 5-frame tiles 3 apart, the last
# ones short. Small tiles (3 + 1 latent frames, 2 apart; 4 x 3 latent pixels, 2 apart) give 2 x 2
# spatial tiles in each of 2 temporal ones, every direction with a short last tile; few distinct
# shapes keep compilation short. (Tiles of one or two latent pixels are ill-conditioned in fp32,
# decoded alone or not, as their GroupNorms see few values: a 1 x 2 tile exceeds 1e-5 relative
# error against diffusers, so the shapes avoid it.)
SMALL_TILES = vae_hv.Tiling(
    use_tiling=True, tile_sample_min_num_frames=12, tile_sample_stride_num_frames=8,
    tile_sample_min_height=32, tile_sample_stride_height=16, tile_sample_min_width=24, tile_sample_stride_width=16,
)


@pytest.mark.parametrize(
    "tiling,latent_frames,latent_hw",
    [
        (vae_hv.DEFAULT_TILING, 8, (2, 3)),  # temporal tiles 0:5, 3:8, 6:8
        (vae_hv.UNTILED, 6, (2, 3)),  # the whole clip at once
        (SMALL_TILES, 4, (4, 4)),  # temporal tiles 0:4, 2:4, each in spatial tiles (0:4, 2:4) x (0:3, 2:4)
    ],
    ids=["default", "untiled", "small_tiles"],
)
def test_tiled_decode_parity(tiny_vae, tiling, latent_frames, latent_hw):
    model, cfg, params = tiny_vae
    z = torch.randn(1, 4, latent_frames, *latent_hw, generator=torch.Generator().manual_seed(2))
    ref = torch_decode(model, z, tiling)
    out = np.asarray(vae_hv.decode(params, cfg, z.numpy(), tiling=tiling))
    assert out.shape == ref.shape == (1, 3, cfg.num_frames(latent_frames), 8 * latent_hw[0], 8 * latent_hw[1])
    assert rel_err(out, ref) <= 1e-5
    # The tiled decodes differ from the untiled one (else the test would not tell tiling apart).
    if tiling != vae_hv.UNTILED:
        untiled = torch_decode(model, z, vae_hv.UNTILED)
        assert rel_err(untiled, ref) > 1e-3


def test_tiling_plan():
    cfg = vae_hv.VARIANTS["hunyuan_video"]
    # 81 frames are 21 latent frames: seven tiles of up to 5 latent frames, 3 apart.
    tiles = vae_hv.DEFAULT_TILING.temporal_tiles(cfg, 21)
    assert [(s.start, s.stop) for s in tiles] == [(i, i + 5) for i in range(0, 21, 3)]
    assert vae_hv.DEFAULT_TILING.temporal_tiles(cfg, 4) is None  # up to 4 latent frames: one piece
    assert vae_hv.UNTILED.temporal_tiles(cfg, 21) is None
    assert vae_hv.DEFAULT_TILING.spatial_tiles(cfg, 60, 106) is None  # spatial tiling is off by default
    grid = dataclasses.replace(vae_hv.DEFAULT_TILING, use_tiling=True).spatial_tiles(cfg, 60, 106)
    assert [len(row) for row in grid] == [5, 5, 5]  # rows at 0, 24, 48; columns at 0, 24, ..., 96
    with pytest.raises(ValueError, match="tile_sample_stride_num_frames"):
        vae_hv.Tiling(tile_sample_stride_num_frames=20)


def test_full_size_parameter_count_and_logical_axes():
    cfg = vae_hv.FAMILY.config_from_diffusers(
        dict(_class_name="AutoencoderKLHunyuanVideo", block_out_channels=[128, 256, 512, 512], latent_channels=16)
    )
    assert cfg == vae_hv.VARIANTS["hunyuan_video"]
    with torch.device("meta"):
        model = AutoencoderKLHunyuanVideo()
    expected = sum(p.numel() for n, p in model.named_parameters() if not n.startswith(vae_hv.IGNORED_PREFIXES))
    abstract = vae_hv.FAMILY.abstract_params(cfg)
    leaves = jax.tree.leaves(abstract, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))
    assert sum(int(np.prod(x.value.shape)) for x in leaves) == expected
    assert round(expected / 1e6, 1) == 146.1  # docs/models.md: 146.1 M decoder parameters
    for leaf in leaves:
        assert isinstance(leaf, nn.LogicallyPartitioned)
        assert len(leaf.names) == leaf.value.ndim
    # 33 frames at 480x848 come from 9 latent frames of 60x106.
    out = jax.eval_shape(
        lambda p, x: vae_hv.HunyuanVideoVAEDecoder(cfg).apply({"params": p}, **x),
        nn.unbox(abstract),
        vae_hv.example_inputs(cfg, 1, 9, 60, 106),
    )
    assert out.shape == (1, 3, 33, 480, 848)
    # 81 frames decode in temporal tiles by default, to the same shape as untiled.
    z81 = vae_hv.example_inputs(cfg, 1, 21, 60, 106)["z"]
    assert jax.eval_shape(lambda p, z: vae_hv.decode(p, cfg, z), nn.unbox(abstract), z81).shape == (1, 3, 81, 480, 848)


def test_conversion_rejects_bad_checkpoints(tiny_vae):
    model, cfg, params = tiny_vae
    bad_key = "decoder.up_blocks.1.resnets.2.conv1.conv.weight"
    arrays = [
        (k, np.zeros((16, 16, 1, 3, 3), np.float32) if k == bad_key else a) for k, a in torch_state_dict_arrays(model)
    ]
    with pytest.raises(ConversionError, match="up_blocks.1.resnets.2.conv1.conv.weight"):
        convert_weights(vae_hv.FAMILY, cfg, arrays)
    with pytest.raises(ConversionError, match="unexpected weight 'decoder.bogus.weight'"):
        bogus = [("decoder.bogus.weight", np.zeros(1))]
        convert_weights(vae_hv.FAMILY, cfg, list(torch_state_dict_arrays(model)) + bogus)
    # The encoder keys are ignored by the family: a decoder-only state dict converts to the same parameters.
    decoder_only = ((k, a) for k, a in torch_state_dict_arrays(model) if not k.startswith(vae_hv.IGNORED_PREFIXES))
    jax.tree.map(np.testing.assert_array_equal, params, convert_weights(vae_hv.FAMILY, cfg, decoder_only))
