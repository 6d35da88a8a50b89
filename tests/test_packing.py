"""2x2 latent packing and FLUX image ids vs diffusers FluxPipeline / QwenImagePipeline."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from digen_jax.diffusion import (
    flux_image_ids,
    latent_size,
    pack_latents,
    packed_seq_len,
    unpack_latents,
)

# (B, C, H', W') latent shapes: FLUX/Qwen have C = 16; include a non-square one.
SHAPES = [(2, 16, 8, 8), (1, 16, 6, 10), (3, 4, 2, 4)]


def _random(shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


@pytest.fixture(scope="module")
def flux_pipeline():
    return pytest.importorskip("diffusers.pipelines.flux.pipeline_flux").FluxPipeline


@pytest.fixture(scope="module")
def qwen_pipeline():
    return pytest.importorskip("diffusers.pipelines.qwenimage.pipeline_qwenimage").QwenImagePipeline


@pytest.mark.parametrize("shape", SHAPES)
def test_pack_round_trip_and_channel_layout(shape):
    b, c, h, w = shape
    latents = _random(shape)
    tokens = np.asarray(pack_latents(jnp.asarray(latents)))
    assert tokens.shape == (b, (h // 2) * (w // 2), 4 * c)
    np.testing.assert_array_equal(unpack_latents(tokens, h, w), latents)
    # Spell out the documented index map on one token per row/column combination.
    for i in range(h // 2):
        for j in range(w // 2):
            for dy in range(2):
                for dx in range(2):
                    np.testing.assert_array_equal(
                        tokens[:, i * (w // 2) + j, np.arange(c) * 4 + dy * 2 + dx],
                        latents[:, :, 2 * i + dy, 2 * j + dx],
                    )


@pytest.mark.parametrize("shape", SHAPES)
def test_pack_matches_flux_pipeline(flux_pipeline, shape):
    """diffusers pipelines/flux/pipeline_flux.py FluxPipeline._pack_latents / _unpack_latents
    (the latter takes pixel sizes: latent side * vae_scale_factor 8)."""
    torch = pytest.importorskip("torch")
    b, c, h, w = shape
    latents = _random(shape, seed=1)
    want = flux_pipeline._pack_latents(torch.from_numpy(latents), b, c, h, w).numpy()
    tokens = pack_latents(jnp.asarray(latents))
    np.testing.assert_array_equal(tokens, want)
    back = flux_pipeline._unpack_latents(torch.from_numpy(want), h * 8, w * 8, 8).numpy()
    np.testing.assert_array_equal(unpack_latents(tokens, h, w), back)


@pytest.mark.parametrize("shape", SHAPES)
def test_pack_matches_qwen_image_pipeline(qwen_pipeline, shape):
    """diffusers pipelines/qwenimage/pipeline_qwenimage.py: prepare_latents packs a
    (B, 1, C, H, W) tensor; _unpack_latents returns (B, C, 1, H, W)."""
    torch = pytest.importorskip("torch")
    b, c, h, w = shape
    latents = _random(shape, seed=2)
    framed = torch.from_numpy(latents[:, None])
    want = qwen_pipeline._pack_latents(framed, b, c, h, w).numpy()
    tokens = pack_latents(jnp.asarray(latents))
    np.testing.assert_array_equal(tokens, want)
    back = qwen_pipeline._unpack_latents(torch.from_numpy(want), h * 8, w * 8, 8).numpy()
    np.testing.assert_array_equal(unpack_latents(tokens, h, w)[:, :, None], back)


@pytest.mark.parametrize("height,width", [(512, 512), (1328, 1024), (256, 768)])
def test_flux_image_ids_match_pipeline(flux_pipeline, height, width):
    """FluxPipeline.prepare_latents calls _prepare_latent_image_ids(B, H' // 2, W' // 2, ...)."""
    torch = pytest.importorskip("torch")
    latent_h, latent_w = latent_size(height, width)
    want = flux_pipeline._prepare_latent_image_ids(
        1, latent_h // 2, latent_w // 2, "cpu", torch.float32
    ).numpy()
    ids = flux_image_ids(latent_h, latent_w)
    assert ids.dtype == jnp.float32
    np.testing.assert_array_equal(ids, want)
    assert ids.shape[0] == packed_seq_len(height, width)


def test_latent_size_and_seq_len():
    assert latent_size(512, 512) == (64, 64)
    assert latent_size(1328, 1024) == (166, 128)
    assert packed_seq_len(512, 512) == 1024
    assert packed_seq_len(1024, 1024) == 4096
    assert packed_seq_len(1328, 1024) == 83 * 64


@pytest.mark.parametrize(
    "height,width", [(520, 512), (512, 1000), (0, 512), (-16, 512), (512.0, 512)]
)
def test_bad_image_size_raises(height, width):
    with pytest.raises(ValueError, match="multiple of 16"):
        latent_size(height, width)
    with pytest.raises(ValueError, match="multiple of 16"):
        packed_seq_len(height, width)


def test_bad_latent_shapes_raise():
    with pytest.raises(ValueError, match="even"):
        pack_latents(jnp.zeros((1, 16, 7, 8)))
    with pytest.raises(ValueError, match=r"\(B, C, H, W\)"):
        pack_latents(jnp.zeros((16, 8, 8)))
    with pytest.raises(ValueError, match="do not unpack"):
        unpack_latents(jnp.zeros((1, 15, 64)), 8, 8)
    with pytest.raises(ValueError, match="even"):
        flux_image_ids(7, 8)


def test_packing_under_jit():
    latents = jnp.asarray(_random((2, 16, 8, 6), seed=3))
    tokens = jax.jit(pack_latents)(latents)
    back = jax.jit(unpack_latents, static_argnums=(1, 2))(tokens, 8, 6)
    np.testing.assert_array_equal(back, latents)
