"""Training data: prompt-embedding caches (written by convert/encode_prompts.py, read without
torch) and the coloured-shapes text-to-image task of the tiny CPU demo."""
from digen_jax.data.embeddings import EMBEDDING_LAYOUTS, CacheWriter, EmbeddingCache, write_cache
from digen_jax.data.shapes_task import COLORS, POSITIONS, SHAPES, ShapesTask

__all__ = ["COLORS", "EMBEDDING_LAYOUTS", "POSITIONS", "SHAPES", "CacheWriter", "EmbeddingCache", "ShapesTask", "write_cache"]
