"""Test setup: eight fake CPU devices, so meshes and cross-mesh transfers are exercised.

GPU-marked tests run only where JAX sees a GPU: `JAX_PLATFORMS=cuda,cpu pytest -m gpu`.
"""
import os

# Must happen before JAX initialises its backends.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402

# Parity tests compare against float32 torch references: keep matmuls exact.
jax.config.update("jax_default_matmul_precision", "highest")


def pytest_collection_modifyitems(config, items):
    has_gpu = any(d.platform == "gpu" for d in jax.devices())
    skip_gpu = pytest.mark.skip(reason="needs a GPU (run with JAX_PLATFORMS=cuda,cpu)")
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(skip_gpu)
