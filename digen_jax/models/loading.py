"""The converted-model registry (`FAMILIES`) and the public loading API, read through
`digen_jax.models`.

`from_diffusers(module)` ports an instantiated diffusers transformer;
`load_checkpoint(path)` reads one converted by `convert/diffusers_to_orbax.py`.
"""
from __future__ import annotations

import functools
import json
import os
import time
from typing import Any, Callable

import jax

from digen_jax.models import clip, image_reward
from digen_jax.models.flux import transformer as flux, vae as vae_flux
from digen_jax.models.hunyuan_video import transformer as hunyuan_video, vae as vae_hunyuan_video
from digen_jax.models.qwenimage import transformer as qwenimage
from digen_jax.models.sd3 import transformer as sd3
from digen_jax.models.wan import transformer as wan, vae as vae_wan
from digen_jax.models.wan22 import transformer as wan22
from digen_jax.models.checkpoints import load_checkpoint, save_checkpoint
from digen_jax.models.conversion import (
    ConversionError,
    ModelFamily,
    ParamBuilder,
    convert_weights,
    read_safetensors,
    safetensors_shards,
    torch_state_dict_arrays,
)

FAMILIES: dict[str, ModelFamily] = {
    f.name: f
    for f in (
        flux.FAMILY,
        qwenimage.FAMILY,
        wan.FAMILY,
        wan22.FAMILY,
        hunyuan_video.FAMILY,
        sd3.FAMILY,
        vae_flux.FAMILY,
        vae_wan.FAMILY,
        vae_wan.QWEN_FAMILY,
        vae_wan.ENCODER_FAMILY,
        vae_hunyuan_video.FAMILY,
        clip.TRANSFORMERS_FAMILY,
        clip.OPEN_CLIP_FAMILY,
        image_reward.FAMILY,
    )
}

__all__ = [
    "FAMILIES",
    "ConversionError",
    "convert_diffusers_folder",
    "convert_expert_pair",
    "family_for_class", "from_diffusers", "load_checkpoint", "make_apply_fn", "save_checkpoint"]


def family_for_class(class_name: str) -> ModelFamily:
    """The (first registered) family whose diffusers class is `class_name`; a clear error otherwise."""
    for family in FAMILIES.values():
        if family.diffusers_class == class_name:
            return family
    supported = sorted(f.diffusers_class for f in FAMILIES.values())
    raise ValueError(f"unsupported diffusers model class {class_name!r}; supported: {supported}")


def make_apply_fn(family: ModelFamily, cfg: Any) -> Callable:
    """A jitted `apply_fn(params, **inputs)` taking the diffusers forward's keyword arguments.

    Options of the PyTorch forward that have no meaning here (`return_dict`) are
    accepted and ignored; ones that would change the result (attention-processor
    kwargs, ControlNet residuals) are rejected rather than dropped.
    """
    module = family.module_cls(cfg)

    @jax.jit
    def apply(params, inputs):
        return module.apply({"params": params}, **inputs)

    @functools.wraps(module.__call__)
    def apply_fn(params, *, return_dict=None, **inputs):
        del return_dict  # always the output array
        unsupported = sorted(k for k, v in inputs.items() if v is not None and (k.startswith("controlnet") or k == "joint_attention_kwargs"))
        if unsupported:
            raise ValueError(f"{family.diffusers_class} port does not support {unsupported}")
        inputs = {k: v for k, v in inputs.items() if not (k.startswith("controlnet") or k == "joint_attention_kwargs")}
        return apply(params, inputs)

    return apply_fn


def from_diffusers(module, family: str | None = None, **policy) -> tuple[Callable, dict]:
    """Port an instantiated diffusers transformer: returns `(apply_fn, params)`.

    `apply_fn(params, **inputs)` accepts the keyword arguments of the module's
    `forward` (arrays in place of tensors) and returns the output array. `family` names the
    part to port where several families port one class (`"vae_wan_encoder"`: the encoder of an
    `AutoencoderKLWan`, whose default family is its decoder). `policy` overrides the execution
    policy (`dtype`, `param_dtype`, `attention_impl`, `remat_policy`); dtypes default to the
    module's own.
    """
    family = _family(type(module).__name__, family)
    module_dtype = str(next(module.parameters()).dtype).removeprefix("torch.")
    policy = {"dtype": module_dtype, "param_dtype": module_dtype, **policy}
    cfg = family.config_from_diffusers(dict(module.config), **policy)
    params = convert_weights(
        family, cfg, torch_state_dict_arrays(module), dtype=cfg.param_dtype, source=type(module).__name__
    )
    return make_apply_fn(family, cfg), params


def _family(class_name: str, name: str | None) -> ModelFamily:
    """`family_for_class(class_name)`, or the family `name` after checking that it ports that class."""
    if name is None:
        return family_for_class(class_name)
    family = FAMILIES.get(name)
    if family is None or family.diffusers_class != class_name:
        parts = sorted(f.name for f in FAMILIES.values() if f.diffusers_class == class_name)
        raise ValueError(f"family {name!r} does not port {class_name!r}; the families that do: {parts}")
    return family


def convert_diffusers_folder(
    model_dir: str, out: str, dtype: str = "source", log=print, family: str | None = None
) -> None:
    """Convert a diffusers model folder (config.json + safetensors shards) into a checkpoint.

    Shards are read one at a time, memory-mapped, each weight written into its place
    as it is read (peak memory ~ the converted parameters). `dtype` is the stored
    dtype ('source' keeps each weight's); `family` as in `from_diffusers`. Load the result
    with `load_checkpoint(out)`.
    """
    diffusers_config = _read_config(model_dir, "--model_dir")
    family = _family(diffusers_config.get("_class_name", "<no _class_name in config.json>"), family)
    cfg = family.config_from_diffusers(diffusers_config)
    builder = _builder(family, cfg, dtype, model_dir)
    _stream(builder, model_dir, "", log)
    params = builder.finish()
    save_checkpoint(out, family, cfg, params)
    log(f"wrote {family.name} checkpoint with {len(builder.seen)} weights to {out}")


def convert_expert_pair(
    model_dir: str, model_dir_2: str, out: str, boundary_ratio: float | None = None, dtype: str = "source", log=print
) -> None:
    """Convert Wan2.2-A14B's two experts (the pipeline's `transformer` and `transformer_2`
    folders: high noise, low noise) into one `wan22` checkpoint of the pair.

    `boundary_ratio` defaults to the pipeline's (`model_index.json` next to `model_dir`). Both
    folders must hold the same architecture. Streams shard by shard as `convert_diffusers_folder`.
    """
    configs = [_read_config(d, flag) for d, flag in ((model_dir, "--model_dir"), (model_dir_2, "--model_dir_2"))]
    arch = [{k: v for k, v in c.items() if not k.startswith("_")} for c in configs]
    if arch[0] != arch[1]:
        differ = sorted(k for k in arch[0].keys() | arch[1].keys() if arch[0].get(k) != arch[1].get(k))
        raise ConversionError(f"the two experts' configs differ in {differ}: {model_dir} and {model_dir_2}")
    if boundary_ratio is None:
        index = os.path.join(os.path.dirname(os.path.abspath(model_dir)), "model_index.json")
        if os.path.exists(index):
            with open(index) as f:
                boundary_ratio = json.load(f).get("boundary_ratio")
        if boundary_ratio is None:
            raise ConversionError(f"no boundary_ratio in {index}: pass --boundary_ratio (0.875 for Wan2.2-T2V-A14B)")
    family = wan22.FAMILY
    cfg = family.config_from_diffusers({**configs[0], "boundary_ratio": boundary_ratio})
    builder = _builder(family, cfg, dtype, f"{model_dir} + {model_dir_2}")
    for expert, folder in zip(wan22.EXPERTS, (model_dir, model_dir_2)):
        _stream(builder, folder, f"{expert}.", log)
    params = builder.finish()
    save_checkpoint(out, family, cfg, params)
    log(f"wrote the {family.name} pair (boundary_ratio {boundary_ratio}) with {len(builder.seen)} weights to {out}")


def _read_config(model_dir: str, flag: str) -> dict:
    config_path = os.path.join(model_dir, "config.json")
    if not os.path.exists(config_path):
        raise FileNotFoundError(f"{config_path} not found: {flag} must be a diffusers model folder")
    with open(config_path) as f:
        return json.load(f)


def _builder(family: ModelFamily, cfg: Any, dtype: str, source: str) -> ParamBuilder:
    return ParamBuilder(
        family.weight_rules(cfg),
        family.abstract_params(cfg),
        dtype=None if dtype == "source" else dtype,
        source=source,
        ignored_prefixes=family.ignored_prefixes,
    )


def _stream(builder: ParamBuilder, model_dir: str, prefix: str, log) -> None:
    """Every weight of the folder's shards into `builder`, keys prefixed with `prefix`."""
    shards = safetensors_shards(model_dir)
    start = time.time()
    for n, shard in enumerate(shards, 1):
        count = 0
        for key, array in read_safetensors(shard):
            builder.add(prefix + key, array)
            count += 1
        log(f"[{n}/{len(shards)}] {os.path.basename(shard)}: {count} weights ({time.time() - start:.1f}s)")
