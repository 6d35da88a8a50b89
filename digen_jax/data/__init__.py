"""Synthetic training data: the coloured-shapes text-to-image task of the tiny CPU demo."""
from digen_jax.data.shapes import COLORS, POSITIONS, SHAPES, ShapesTask

__all__ = ["COLORS", "POSITIONS", "SHAPES", "ShapesTask"]
