"""JPEG rewards and the reward registry.

Reference: yifan123/flow_grpo flow_grpo/rewards.py (jpeg_incompressibility: PIL JPEG quality 95,
size = buffer.tell() / 1000; jpeg_compressibility: -size / 500; multi_score: weighted sum of
the named rewards, per-reward scores kept for logging). docs/algorithms.md (c).
"""
import io

import numpy as np
import pytest
from PIL import Image

from digen_jax.rewards import (
    check_finite_rewards,
    get_reward,
    jpeg_size_kb,
    registered_rewards,
    register_reward,
    to_uint8_images,
    validate_reward_config,
    weighted_reward,
)
from digen_jax.rewards import registry


def _images():
    rng = np.random.default_rng(0)
    flat = np.full((1, 64, 64, 3), 128, np.uint8)
    noise = rng.integers(0, 256, size=(1, 64, 64, 3), dtype=np.uint8)
    return np.concatenate([flat, noise])


def _pil_kb(image):
    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="JPEG", quality=95)
    return len(buffer.getvalue()) / 1000


def test_jpeg_size_equals_pil_bytes():
    images = _images()
    got = jpeg_size_kb(images)
    assert got.dtype == np.float32 and got.shape == (2,)
    np.testing.assert_allclose(got, [_pil_kb(im) for im in images], rtol=1e-6)


def test_jpeg_rewards_sign_conventions():
    images = _images()
    incompressible = get_reward("jpeg_incompressibility")(images, ["a", "b"], [{}, {}])
    compressible = get_reward("jpeg_compressibility")(images, ["a", "b"], [{}, {}])
    assert incompressible[1] > 5 * incompressible[0] > 0  # noise is far larger than flat
    assert compressible[0] > compressible[1]  # and compresses worse
    np.testing.assert_allclose(compressible, -incompressible / 500, rtol=1e-6)


def test_float_images_round_like_uint8():
    rng = np.random.default_rng(1)
    x = rng.uniform(-0.1, 1.1, size=(2, 16, 16, 3)).astype(np.float32)  # out of range clips
    want = np.round(np.clip(x, 0, 1) * 255).astype(np.uint8)
    np.testing.assert_array_equal(to_uint8_images(x), want)
    np.testing.assert_allclose(jpeg_size_kb(x), jpeg_size_kb(want))


def test_image_convention_errors():
    with pytest.raises(ValueError, match=r"\(B, H, W, 3\)"):
        to_uint8_images(np.zeros((2, 3, 8, 8), np.float32))
    with pytest.raises(ValueError, match="dtype"):
        to_uint8_images(np.zeros((1, 8, 8, 3), np.int32))
    with pytest.raises(ValueError, match="NaN"):
        to_uint8_images(np.full((1, 8, 8, 3), np.nan, np.float32))


def test_registry_errors():
    assert {"jpeg_compressibility", "jpeg_incompressibility"} <= set(registered_rewards())
    # The config key is reward.weights (name -> weight); there is no reward.names.
    unknown = r"unknown reward 'pickscor' in config key reward\.weights; registered: \["
    with pytest.raises(ValueError, match=unknown):
        get_reward("pickscor")
    with pytest.raises(ValueError, match=r"'nope' in config key reward\.weights.*jpeg_compressibility"):
        validate_reward_config({"jpeg_compressibility": 1.0, "nope": 1.0})
    with pytest.raises(ValueError, match=r"reward\.weights is empty"):
        validate_reward_config({})
    with pytest.raises(ValueError, match=r"reward\.weights\['jpeg_compressibility'\] must be a finite"):
        validate_reward_config({"jpeg_compressibility": float("nan")})
    with pytest.raises(ValueError, match="already registered"):
        register_reward("jpeg_compressibility")(lambda: None)


def test_weighted_reward(monkeypatch):
    def const_factory(value=1.0):
        return lambda images, prompts, metadata: np.full(len(images), value, np.float32)

    monkeypatch.setitem(registry._REGISTRY, "test_const", const_factory)
    images = _images()
    fn = weighted_reward(
        {"jpeg_incompressibility": 0.5, "test_const": -2.0}, options={"test_const": {"value": 3.0}}
    )
    total, per = fn(images, ["a", "b"], [{}, {}])
    np.testing.assert_allclose(per["test_const"], [3.0, 3.0])
    np.testing.assert_allclose(per["jpeg_incompressibility"], jpeg_size_kb(images))
    np.testing.assert_allclose(total, 0.5 * jpeg_size_kb(images) - 6.0, rtol=1e-6)
    assert total.dtype == np.float32


def test_weighted_reward_validates_before_compute(monkeypatch):
    built = []
    monkeypatch.setitem(registry._REGISTRY, "test_spy", lambda: built.append(1))
    with pytest.raises(ValueError, match="unknown reward"):
        weighted_reward({"test_spy": 1.0, "missing": 1.0})
    assert not built  # nothing was constructed before the bad name was caught
    with pytest.raises(ValueError, match=r"not in reward\.weights"):
        weighted_reward({"test_spy": 1.0}, options={"jpeg_compressibility": {}})


def test_weighted_reward_checks_output_shape(monkeypatch):
    monkeypatch.setitem(registry._REGISTRY, "test_bad", lambda: lambda i, p, m: np.zeros(3))
    with pytest.raises(ValueError, match=r"'test_bad' returned shape \(3,\)"):
        weighted_reward({"test_bad": 1.0})(_images(), ["a", "b"], [{}, {}])


def test_check_finite_rewards():
    mask = check_finite_rewards(np.array([0.1, np.nan, np.inf, -2.0], np.float32))
    np.testing.assert_array_equal(mask, [True, False, False, True])
