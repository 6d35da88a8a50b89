"""Converted-model checkpoints: `DIR/model.json` (family + config) and `DIR/params` (orbax)."""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import flax.linen as nn
import jax
import numpy as np
import orbax.checkpoint as ocp

from digen_jax.models import stacking
from digen_jax.models.conversion import POLICY_FIELDS, ConversionError, ModelFamily

MODEL_JSON = "model.json"
PARAMS_DIR = "params"


def save_checkpoint(path: str, family: ModelFamily, cfg: Any, params: dict) -> None:
    """Write `params` (numpy or jax arrays, in `cfg`'s block layout) and the architecture
    config under `path`. Blocks are stored stacked whatever the layout, so a checkpoint loads
    into either (`scan_layers` is a loading policy)."""
    path = os.path.abspath(path)
    stored = family.stored_config(cfg)
    if stored is not cfg:
        params = stacking.relayout_blocks(params, nn.unbox(family.abstract_params(stored)))
    os.makedirs(path, exist_ok=True)
    arch = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in POLICY_FIELDS}
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(os.path.join(path, PARAMS_DIR), params, force=True)
    checkpointer.wait_until_finished()
    with open(os.path.join(path, MODEL_JSON), "w") as f:
        json.dump({"family": family.name, "diffusers_class": family.diffusers_class, "config": arch}, f, indent=1)


def load_checkpoint(path: str, *, shardings=None, **policy) -> tuple[ModelFamily, Any, dict]:
    """Read a converted checkpoint: returns (family, config, params).

    Parameters are restored with the config's `param_dtype` (override it through
    `policy`), into `shardings` when given (a pytree of `jax.sharding.Sharding`
    matching the params), and validated against the module's parameter shapes.
    Without `shardings` they land on the first device, or in a multi-process run on the
    host (numpy): every process then holds the same values, which `jax.device_put` and
    `runtime.distributed.transfer` may place on any process's devices.
    """
    from digen_jax.models import FAMILIES  # the registry imports this module

    path = os.path.abspath(path)
    meta_path = os.path.join(path, MODEL_JSON)
    if not os.path.exists(meta_path):
        raise FileNotFoundError(
            f"no converted checkpoint at {path} ({MODEL_JSON} missing); make one with "
            f"`python convert/diffusers_to_orbax.py --model_dir=<diffusers transformer folder> --out={path}`"
        )
    with open(meta_path) as f:
        meta = json.load(f)
    if meta.get("family") not in FAMILIES:
        raise ConversionError(f"{meta_path}: unknown model family {meta.get('family')!r}; known: {sorted(FAMILIES)}")
    family = FAMILIES[meta["family"]]
    cfg = family.config_from_diffusers(meta["config"], **policy)
    stored = family.stored_config(cfg)
    abstract = jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s.shape, np.dtype(cfg.param_dtype)), nn.unbox(family.abstract_params(stored))
    )
    if shardings is not None and stored is not cfg:  # restore stacked, each block's sharding behind a layers axis
        shardings = stacking.relayout_blocks(shardings, abstract, stack=lambda xs: _with_layers_axis(xs[0]))
    on_host = shardings is None and jax.process_count() > 1
    if shardings is None:
        # Restored as saved, a checkpoint written from host arrays (every converted one) would
        # come back as numpy, and one saved on devices onto a device that may belong to another
        # process: restore onto this process's first device either way.
        shardings = jax.tree.map(lambda _: jax.sharding.SingleDeviceSharding(jax.local_devices()[0]), abstract)
    abstract = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), abstract, shardings)
    try:
        params = ocp.StandardCheckpointer().restore(os.path.join(path, PARAMS_DIR), abstract)
    except (ValueError, FileNotFoundError, KeyError) as e:
        raise ConversionError(f"{path}: checkpoint does not match the {family.name} config in {MODEL_JSON}: {e}") from e
    if on_host:
        params = jax.tree.map(np.asarray, params)
    return family, cfg, family.to_layout(params, cfg, consume=True)


def _with_layers_axis(sharding: jax.sharding.Sharding) -> jax.sharding.Sharding:
    """The sharding of a stacked weight whose blocks each have `sharding` (layers unsplit)."""
    if isinstance(sharding, jax.sharding.NamedSharding):
        return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(None, *sharding.spec))
    if isinstance(sharding, jax.sharding.SingleDeviceSharding):
        return sharding
    raise ValueError(f"cannot restore unrolled blocks into a {type(sharding).__name__}: pass NamedShardings")

