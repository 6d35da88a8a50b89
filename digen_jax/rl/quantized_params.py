"""Quantised parameter trees: which kernels of a Flax params pytree the FP8 rollouts quantise,
the quantised tree and its shardings (the numerics of a kernel and a matmul: models/fp8.py).

The rollout role of a `model.rollout_precision='fp8'` run samples with a parameter tree in which
every block kernel picked by `quantized_kernel_paths` is replaced by its e4m3 form and its
per-output-channel scales (`quantize_params`); the dense layers read that form as FP8 layers
(models/layers.py `AdaptableDense`). LoRA adapters stay as they are and apply factored on top
(rl/lora.py `factored_variables`). runtime/weight_sync.py decides when a tree is quantised.
"""
from __future__ import annotations

from typing import Any, Mapping

import flax.linen as nn
from flax import traverse_util
from jax.sharding import NamedSharding, PartitionSpec

from digen_jax.models.fp8 import QUANTIZED, QUANTIZED_AXES, SCALE, quantize_weight


def quantized_kernel_paths(abstract_params: Mapping) -> frozenset[str]:
    """'/'-joined paths of the `kernel` leaves of boxed (logically partitioned) parameters whose last
    two logical axes are in `models.fp8.QUANTIZED_AXES` (a scanned kernel's leading `layers` axis aside)."""
    flat = traverse_util.flatten_dict(abstract_params, sep="/", is_leaf=lambda _, v: isinstance(v, nn.Partitioned))
    return frozenset(
        path for path, leaf in flat.items()
        if path.rsplit("/", 1)[-1] == "kernel" and isinstance(leaf, nn.Partitioned)
        and tuple(leaf.names[-2:]) in QUANTIZED_AXES
    )


def quantize_params(params: Mapping, paths: frozenset[str]) -> dict[str, Any]:
    """`params` (unboxed) with every kernel at `paths` replaced by its `QUANTIZED` e4m3 kernel and
    `SCALE` per-output-channel scales (`models.fp8.quantize_weight`); every other leaf is the same
    object."""
    flat = traverse_util.flatten_dict(params, sep="/")
    missing = sorted(p for p in paths if p not in flat)
    if missing:
        raise ValueError(f"parameters to quantise are missing (another block layout?): {missing[:4]}")
    for path in paths:
        prefix = path[: -len("kernel")]  # the module's path and '/', or '' for a lone layer's params
        flat[prefix + QUANTIZED], flat[prefix + SCALE] = quantize_weight(flat.pop(path))
    return traverse_util.unflatten_dict(flat, sep="/")


def is_quantized(params: Mapping, paths: frozenset[str]) -> bool:
    """Whether `params` (unboxed) hold the e4m3 form of the kernels at `paths` (`quantize_params`)."""
    flat = traverse_util.flatten_dict(params, sep="/")
    return bool(paths) and all(p[: -len("kernel")] + QUANTIZED in flat for p in paths)


def quantized_shardings(shardings: Mapping, params: Mapping, paths: frozenset[str]) -> dict[str, Any]:
    """The shardings of `quantize_params(params, paths)` from `params`' own (`shardings`): each
    e4m3 kernel like its kernel, each per-output-channel scale like the kernel without its input
    axis."""
    flat = traverse_util.flatten_dict(shardings, sep="/")
    shapes = traverse_util.flatten_dict(params, sep="/")
    for path in paths:
        prefix, sharding = path[: -len("kernel")], flat.pop(path)
        spec = tuple(sharding.spec) + (None,) * (shapes[path].ndim - len(sharding.spec))
        flat[prefix + QUANTIZED] = sharding
        flat[prefix + SCALE] = NamedSharding(sharding.mesh, PartitionSpec(*spec[:-2], spec[-1]))
    return traverse_util.unflatten_dict(flat, sep="/")
