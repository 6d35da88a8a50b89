"""The coloured-shapes task (prompts, frozen text encoder, renderer, label noise) and its reward."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from digen_jax.data import COLORS, POSITIONS, SHAPES, ShapesTask
from digen_jax.data.shapes_task import VOCAB
from digen_jax.rewards import get_reward, registered_rewards
from digen_jax.rewards.shapes_attributes import attribute_scores, shapes_reward, shapes_reward_jax

CLEAN = ShapesTask(label_noise=0.0)


def _quadrant_mask(position: int, res: int = 16) -> np.ndarray:
    rows = (np.arange(res) >= res // 2) == (position // 2 == 1)
    cols = (np.arange(res) >= res // 2) == (position % 2 == 1)
    return rows[:, None] & cols[None, :]


def test_prompt_text_metadata_and_tokens_agree():
    ids = ShapesTask.all_prompt_ids()
    assert ids.shape == (32, 3) and len({tuple(r) for r in np.asarray(ids).tolist()}) == 32
    text = ShapesTask.prompt_text(ids)
    meta = ShapesTask.prompt_metadata(ids)
    assert text[0] == "a red square in the top left"
    assert meta[0] == {"color": "red", "shape": "square", "position": "top left"}
    tokens = np.asarray(CLEAN.tokens(ids))
    assert tokens.shape == (32, CLEAN.text_len)
    for row, prompt, m in zip(tokens, text, meta):
        words = [VOCAB[t] for t in row]
        assert " ".join(w for w in words if w != "<pad>") == prompt
        assert words[-1] == "<pad>"
        assert prompt == f"a {m['color']} {m['shape']} in the {m['position']}"


def test_sample_prompts_cover_every_attribute():
    ids = np.asarray(CLEAN.sample_prompts(jax.random.key(0), 2000))
    assert ids.dtype == np.int32
    for col, names in enumerate((COLORS, SHAPES, POSITIONS)):
        counts = np.bincount(ids[:, col], minlength=len(names))
        assert len(counts) == len(names)
        np.testing.assert_allclose(counts / len(ids), 1 / len(names), atol=0.05)


def test_encoder_is_deterministic_and_separates_prompts():
    ids = ShapesTask.all_prompt_ids()
    text, pooled = CLEAN.encode(ids)
    assert text.shape == (32, 8, 32) and pooled.shape == (32, 32)
    assert text.dtype == jnp.float32 and pooled.dtype == jnp.float32
    # Same ids -> bit-identical embeddings: another instance, jitted, reordered batch.
    text2, pooled2 = jax.jit(ShapesTask(label_noise=0.9).encode)(ids)
    np.testing.assert_array_equal(np.asarray(text), np.asarray(text2))
    np.testing.assert_array_equal(np.asarray(pooled), np.asarray(pooled2))
    perm = np.random.default_rng(0).permutation(32)
    np.testing.assert_array_equal(np.asarray(CLEAN.encode(ids[perm])[1]), np.asarray(pooled)[perm])
    # Different prompts -> different sequences and different pooled vectors.
    for emb in (np.asarray(text).reshape(32, -1), np.asarray(pooled)):
        dist = np.linalg.norm(emb[:, None] - emb[None], axis=-1)
        assert dist[~np.eye(32, dtype=bool)].min() > 0.1
    # The table is a function of the seed.
    assert not np.allclose(np.asarray(ShapesTask(embedding_seed=1).encode(ids)[0]), np.asarray(text))


@pytest.mark.parametrize("jitter", [False, True])
def test_clean_render_shows_the_prompt(jitter):
    task = ShapesTask(label_noise=0.0, jitter=jitter)
    ids = jnp.tile(ShapesTask.all_prompt_ids(), (4, 1))
    images = np.asarray(task.render(ids, jax.random.key(1)))
    assert images.shape == (128, 3, 16, 16) and images.dtype == np.float32
    assert set(np.unique(images)) <= {-1.0, 1.0}
    for img, (color, shape, pos) in zip(images, np.asarray(ids).tolist()):
        lit = img.max(axis=0) > 0
        assert lit.sum() == (36 if SHAPES[shape] == "square" else 20)
        assert not (lit & ~_quadrant_mask(pos)).any()
        # Every lit pixel has exactly the named colour.
        expected = np.where(np.array([[1, 0, 0], [0, 1, 0], [0, 0, 1], [1, 1, 0]])[color] > 0, 1.0, -1.0)
        np.testing.assert_array_equal(img[:, lit].T, np.broadcast_to(expected, (lit.sum(), 3)))
        # Shapes sit on the 2x2 token grid: every packed token is all on or all off.
        blocks = lit.reshape(8, 2, 8, 2).sum(axis=(1, 3))
        assert set(np.unique(blocks)) <= {0, 4}
    if jitter:
        placements = {tuple(np.argwhere(img.max(axis=0) > 0).min(axis=0)) for img in images}
        assert len(placements) > 4  # more than one placement per quadrant


def test_label_noise_rate_and_kind():
    task = ShapesTask(label_noise=0.25)
    n = 20000
    ids = task.sample_prompts(jax.random.key(2), n)
    drawn = np.asarray(task.corrupt_labels(ids, jax.random.key(3)))
    changed = drawn != np.asarray(ids)
    assert not changed[:, 1].any()  # the shape is never changed
    assert changed.sum(axis=1).max() == 1  # at most one attribute per sample
    rate = changed.any(axis=1).mean()
    assert abs(rate - 0.25) < 0.015
    assert abs(changed[:, 0].mean() - changed[:, 2].mean()) < 0.015  # colour and position alike
    # A replaced colour is uniform over the three others.
    flips = np.asarray(ids)[changed[:, 0], 0], drawn[changed[:, 0], 0]
    offsets = (flips[1] - flips[0]) % len(COLORS)
    np.testing.assert_allclose(np.bincount(offsets, minlength=4)[1:] / len(offsets), 1 / 3, atol=0.04)
    # render = draw(corrupt_labels(k1), k2).
    k_labels, k_draw = jax.random.split(jax.random.key(4))
    np.testing.assert_array_equal(
        np.asarray(task.render(ids[:64], jax.random.key(4))),
        np.asarray(task.draw(task.corrupt_labels(ids[:64], k_labels), k_draw)),
    )
    assert (np.asarray(ShapesTask(label_noise=0.0).corrupt_labels(ids, jax.random.key(3))) == np.asarray(ids)).all()


def test_render_traces_under_jit():
    task = ShapesTask()
    sample = jax.jit(lambda key: task.render(task.sample_prompts(key, 8), key))
    assert sample(jax.random.key(0)).shape == (8, 3, 16, 16)


def _to_hwc01(images) -> np.ndarray:
    return ((np.asarray(images) + 1) / 2).transpose(0, 2, 3, 1)


def test_reward_orders_clean_wrong_and_noise():
    ids = jnp.tile(ShapesTask.all_prompt_ids(), (2, 1))
    n = ids.shape[0]
    key = jax.random.key(5)
    meta = ShapesTask.prompt_metadata(ids)
    prompts = ShapesTask.prompt_text(ids)
    shift = 1 + jax.random.randint(key, (n,), 0, 3)
    cases = {
        "clean": CLEAN.draw(ids, key),
        "wrong colour": CLEAN.draw(ids.at[:, 0].set((ids[:, 0] + shift) % 4), key),
        "wrong position": CLEAN.draw(ids.at[:, 2].set((ids[:, 2] + shift) % 4), key),
        "wrong shape": CLEAN.draw(ids.at[:, 1].set(1 - ids[:, 1]), key),
        "noise": jax.random.normal(key, (n, 3, 16, 16)),
        "black": -jnp.ones((n, 3, 16, 16)),
    }
    scores = {name: shapes_reward(_to_hwc01(img), prompts, meta) for name, img in cases.items()}
    for r in scores.values():
        assert r.shape == (n,) and r.dtype == np.float32 and (r >= 0).all() and (r <= 1).all()
    assert scores["clean"].min() > 0.99
    for wrong in ("wrong colour", "wrong position", "wrong shape"):
        assert scores[wrong].max() < 0.6
    assert scores["noise"].mean() < 0.2 and scores["black"].max() == 0.0
    # Attribute scores name the wrong attribute.
    attrs = np.asarray(attribute_scores(cases["wrong colour"], ids))
    np.testing.assert_allclose(attrs.mean(axis=0), [0.0, 1.0, 1.0], atol=1e-5)
    attrs = np.asarray(attribute_scores(cases["wrong position"], ids))
    np.testing.assert_allclose(attrs.mean(axis=0), [1.0, 1.0, 0.0], atol=1e-5)


def test_reward_inputs_and_registry():
    ids = ShapesTask.all_prompt_ids()[:6]
    images = CLEAN.draw(ids, jax.random.key(0))
    meta = ShapesTask.prompt_metadata(ids)
    as_float = shapes_reward(_to_hwc01(images), [""] * 6, meta)
    as_uint8 = shapes_reward(np.round(_to_hwc01(images) * 255).astype(np.uint8), [""] * 6, meta)
    np.testing.assert_array_equal(as_float, as_uint8)
    np.testing.assert_allclose(as_float, np.asarray(shapes_reward_jax(images, ids)), atol=1e-6)
    assert "shapes" in registered_rewards()
    np.testing.assert_array_equal(get_reward("shapes")(_to_hwc01(images), [""] * 6, meta), as_float)
    with pytest.raises(ValueError, match="'color'"):
        shapes_reward(_to_hwc01(images), [""] * 6, [{"color": "purple", "shape": "square", "position": "top left"}] * 6)
    with pytest.raises(ValueError, match="metadata entries"):
        shapes_reward(_to_hwc01(images), [""] * 6, meta[:5])
