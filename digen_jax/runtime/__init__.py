"""The disaggregated runtime (DESIGN.md sections 2, 4 and 5)."""
from digen_jax.runtime import distributed  # noqa: F401
