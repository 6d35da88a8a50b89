"""Prompt sources of the model-zoo workloads: rows of an embedding cache, or random embeddings.

Both offer the interface the training loop draws prompts through (the same one
:class:`digen_jax.data.shapes_task.ShapesTask` has):

* ``sample_prompts(key, n)``: (n,) int32 prompt ids, a pure function of ``key``;
* ``encode(ids)``: ``(text (n, L, D), pooled (n, P) or None, mask (n, L) int32 or None)``,
  the arrays of :class:`digen_jax.rl.rollout.Conditioning` in its field order;
* ``negative()``: the same triple for the true-CFG negative prompt (one row), or None;
* ``prompt_text(ids)`` / ``prompt_metadata(ids)``: what rewards read.

Which arrays a family has follows :data:`digen_jax.data.embeddings.EMBEDDING_LAYOUTS`.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from digen_jax.data.embeddings import EMBEDDING_LAYOUTS, EmbeddingCache

class CachedPrompts:
    """Prompts of an :class:`EmbeddingCache`; a prompt id is a row index of the cache."""

    def __init__(self, cache: EmbeddingCache):
        self.cache = cache
        self.family = cache.family

    def __len__(self) -> int:
        return len(self.cache)

    def sample_prompts(self, key: jax.Array, n: int) -> jax.Array:
        """n distinct rows when the cache has that many (as a pass over a prompt file would), else with repeats."""
        return jax.random.choice(key, len(self.cache), (n,), replace=n > len(self.cache)).astype(jnp.int32)

    def _triple(self, rows: dict) -> tuple:
        mask = rows.get("mask")
        return rows["text"], rows.get("pooled"), None if mask is None else mask.astype(jnp.int32)

    def encode(self, ids) -> tuple:
        return self._triple(self.cache.batch(np.asarray(ids)))

    def negative(self) -> tuple | None:
        return self._triple(self.cache.negative()) if self.cache.has_negative else None

    def prompt_text(self, ids) -> list[str]:
        return [self.cache.prompts[i] for i in np.asarray(ids).tolist()]

    def prompt_metadata(self, ids) -> list[dict]:
        """Per prompt {'prompt_id': its line number in the source prompt file}."""
        return [{"prompt_id": int(self.cache.prompt_ids[i])} for i in np.asarray(ids).tolist()]


class RandomPrompts:
    """Random embeddings of the family's shapes, for throughput runs without text encoders.

    Prompt id i always encodes to the same arrays (drawn from ``fold_in(seed, i)``): a standard
    normal text of length L, a real length uniform in [1, L] (masked, or zeroed past the length
    for Wan, as its encoder output is), and a standard normal pooled vector where the family
    has one.
    """

    def __init__(self, family: str, *, num_prompts: int, text_len: int, text_dim: int,
                 pooled_dim: int | None, seed: int):
        spec = EMBEDDING_LAYOUTS[family]
        self.family, self.num_prompts = family, num_prompts
        self.text_len, self.text_dim, self.pooled_dim = text_len, text_dim, pooled_dim
        self._key = jax.random.key(seed)
        self._has_pooled, self._has_mask = spec["pooled"], spec["mask"]
        self._has_negative = spec["negative"] is not None

    def __len__(self) -> int:
        return self.num_prompts

    def sample_prompts(self, key: jax.Array, n: int) -> jax.Array:
        return jax.random.randint(key, (n,), 0, self.num_prompts, dtype=jnp.int32)

    @functools.partial(jax.jit, static_argnums=0)
    def _rows(self, ids: jax.Array) -> tuple:
        def one(i):
            k_text, k_len, k_pooled = jax.random.split(jax.random.fold_in(self._key, i), 3)
            text = jax.random.normal(k_text, (self.text_len, self.text_dim))
            valid = jnp.arange(self.text_len) < jax.random.randint(k_len, (), 1, self.text_len + 1)
            pooled = jax.random.normal(k_pooled, (self.pooled_dim,)) if self._has_pooled else None
            if self._has_mask:
                return text, pooled, valid.astype(jnp.int32)
            return text * valid[:, None], pooled, None

        return jax.vmap(one)(ids)

    def encode(self, ids) -> tuple:
        return self._rows(jnp.asarray(ids, jnp.int32))

    def negative(self) -> tuple | None:
        # Drawn like a prompt id outside the sampled range [0, num_prompts).
        return self._rows(jnp.array([self.num_prompts], jnp.int32)) if self._has_negative else None

    def prompt_text(self, ids) -> list[str]:
        return [f"<random prompt {i}>" for i in np.asarray(ids).tolist()]

    def prompt_metadata(self, ids) -> list[dict]:
        return [{"prompt_id": i} for i in np.asarray(ids).tolist()]
