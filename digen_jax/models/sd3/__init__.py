"""Stable Diffusion 3 / 3.5: its transformer (`transformer`) and its JAX-free spec (`spec`).

The transformer module's names read as this package's (`models.sd3.FAMILY`), loaded on first
use so that `spec` imports no JAX.
"""
import importlib


def __getattr__(name: str):
    if name in ("spec", "transformer"):
        return importlib.import_module(f"{__name__}.{name}")
    return getattr(importlib.import_module(f"{__name__}.transformer"), name)
