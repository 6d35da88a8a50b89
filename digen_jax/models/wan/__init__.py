"""Wan2.1: its transformer (`transformer`), its VAE (`vae`) and its JAX-free spec (`spec`).

The transformer module's names read as this package's (`models.wan.FAMILY`), loaded on first
use so that `spec` imports no JAX.
"""
import importlib


def __getattr__(name: str):
    if name in ("spec", "transformer", "vae"):
        return importlib.import_module(f"{__name__}.{name}")
    return getattr(importlib.import_module(f"{__name__}.transformer"), name)
