"""Diffusers -> Flax weight conversion, shared by every model family.

A family declares one `WeightRule` per Flax parameter: the diffusers state-dict key it
comes from and the layout change. `ParamBuilder` takes (key, array) pairs in any
order, one at a time (so a checkpoint streams shard by shard), and writes each into
its place; stacked (scanned) parameters are filled slice by slice. It validates
every key and shape against the module's own abstract parameters and raises
`ConversionError` naming the first unexpected, duplicated, mis-shaped or missing
weight: nothing is silently dropped or invented.
"""
from __future__ import annotations

import dataclasses
import json
import mmap
import os
from typing import Any, Callable, Iterable, Iterator, Mapping

import flax.linen as nn
import jax
import ml_dtypes
import numpy as np

from digen_jax.models import stacking
from digen_jax.models.transformer_config import POLICY_FIELDS

# Layout changes from PyTorch to Flax, by name.
TRANSFORMS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "none": lambda a: a,
    "linear": lambda a: a.T,  # (out, in) -> (in, out)
    "conv": lambda a: np.moveaxis(a, (0, 1), (-1, -2)),  # (O, I, *k) -> (*k, I, O)
    # A patchifying conv (kernel = stride) as a dense layer on patches flattened (I, *k): (I * prod(k), O)
    "patch": lambda a: a.reshape(a.shape[0], -1).T,
}


class ConversionError(ValueError):
    """A checkpoint does not match the model it is converted into."""


@dataclasses.dataclass(frozen=True)
class WeightRule:
    """One Flax parameter (`path`) and the diffusers key it is read from.

    A `{i}` in `key` makes the parameter stacked over blocks: the weight of block
    i + `offset` goes to index i of the parameter's leading (`layers`) axis (a stack that
    starts at block `offset` of the checkpoint's numbering).
    """

    path: tuple[str, ...]
    key: str
    transform: str = "none"
    offset: int = 0


def linear_rules(path: tuple[str, ...], key: str) -> list[WeightRule]:
    """The kernel and bias rules of a `torch.nn.Linear` at `key`."""
    return [WeightRule(path + ("kernel",), f"{key}.weight", "linear"), WeightRule(path + ("bias",), f"{key}.bias")]


@dataclasses.dataclass(frozen=True)
class ModelFamily:
    """What the generic loaders need to know about one model family."""

    name: str
    diffusers_class: str
    config_cls: type
    module_cls: type
    weight_rules: Callable[[Any], list[WeightRule]]
    example_inputs: Callable[..., dict]
    variants: Mapping[str, Any]
    # State-dict key prefixes the port deliberately does not take (e.g. a VAE's encoder when
    # only decoding is ported); any other unknown key is an error.
    ignored_prefixes: tuple[str, ...] = ()
    # How a transformer that denoises is called (`rl.rollout.make_denoiser`):
    # denoiser_inputs(cfg, *, guidance, image_grid) -> inputs(latents, cond, sigma), the module's
    # keyword arguments at noise level sigma in [0, 1] for a conditioning with `text`, `pooled` and
    # `mask`. None for the models that do not denoise (VAEs, CLIP).
    denoiser_inputs: Callable[..., Callable[..., dict]] | None = None
    # A VAE decoder's decode as its pipelines call it: decode_frames(params, cfg, latents) ->
    # (B, 3, F, H, W) for the denoiser's unpacked latents, (B, C, h, w) images (one frame) or
    # (B, C, T', h, w) videos. None for the models that do not decode.
    decode_frames: Callable[[Any, Any, Any], Any] | None = None

    def config_from_diffusers(self, diffusers_config: Mapping[str, Any], **policy) -> Any:
        """Build the family config from a diffusers `config.json` dict plus policy overrides.

        Keys starting with `_` (class name, version) are metadata; any other key the
        family does not know is an error, since ignoring an architecture flag would
        silently build a different model.
        """
        fields = {f.name for f in dataclasses.fields(self.config_cls)} - set(POLICY_FIELDS)
        arch = {k: v for k, v in diffusers_config.items() if not k.startswith("_")}
        unknown = sorted(set(arch) - fields)
        if unknown:
            raise ConversionError(
                f"{self.diffusers_class} config has keys {unknown} that {self.name} does not implement"
            )
        bad_policy = sorted(set(policy) - set(POLICY_FIELDS))
        if bad_policy:
            raise TypeError(f"unknown policy overrides {bad_policy}; valid: {list(POLICY_FIELDS)}")
        return self.config_cls(**arch, **policy)

    def stored_config(self, cfg: Any) -> Any:
        """`cfg` in the layout checkpoints and conversion rules use: blocks scanned (stacked)."""
        return dataclasses.replace(cfg, scan_layers=True) if getattr(cfg, "scan_layers", True) is False else cfg

    def to_layout(self, params: Mapping, cfg: Any, consume: bool = False) -> dict:
        """Stored-layout (stacked) `params` in `cfg`'s block layout (`stacking.relayout_blocks`).

        `consume` frees each stacked device array once split (the caller gives `params` up):
        a full-size model converts without being held twice.
        """
        if cfg is self.stored_config(cfg):
            return params
        unstack = stacking.unstack_consuming if consume else stacking.unstack_leaf
        return stacking.relayout_blocks(params, nn.unbox(self.abstract_params(cfg)), unstack=unstack)

    def abstract_params(self, cfg: Any) -> dict:
        """Boxed (logically partitioned) ShapeDtypeStructs of the parameters, no FLOPs."""
        module = self.module_cls(cfg)
        inputs = self.example_inputs(cfg)
        return jax.eval_shape(lambda x: module.init(jax.random.key(0), **x), inputs)["params"]


def _flat(tree: Mapping, prefix: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    for k, v in tree.items():
        if isinstance(v, Mapping):
            yield from _flat(v, prefix + (k,))
        else:
            yield prefix + (k,), v


def _nest(flat: Mapping[tuple[str, ...], Any]) -> dict:
    out: dict = {}
    for path, v in flat.items():
        node = out
        for k in path[:-1]:
            node = node.setdefault(k, {})
        node[path[-1]] = v
    return out


class ParamBuilder:
    """Assembles a Flax parameter tree from (diffusers key, array) pairs, validating each.

    Args:
      rules: the family's weight rules for this config.
      abstract_params: the module's parameters as (possibly boxed) ShapeDtypeStructs.
      dtype: dtype to store; None keeps each weight's source dtype.
      source: a name for the checkpoint, used in error messages.
      ignored_prefixes: keys starting with these are skipped (ModelFamily.ignored_prefixes).
    """

    def __init__(
        self,
        rules: list[WeightRule],
        abstract_params: Mapping,
        dtype=None,
        source: str = "checkpoint",
        ignored_prefixes: tuple[str, ...] = (),
    ):
        self.source = source
        self.ignored_prefixes = tuple(ignored_prefixes)
        self.dtype = None if dtype is None else np.dtype(dtype)
        self.expected = {path: tuple(v.shape) for path, v in _flat(nn.unbox(abstract_params))}
        self.buffers: dict[tuple[str, ...], np.ndarray] = {}
        self.by_key: dict[str, tuple[WeightRule, int | None]] = {}
        ruled = set()
        for rule in rules:
            if rule.path not in self.expected:
                raise ConversionError(f"rule for {rule.key!r} targets {'/'.join(rule.path)}, which the module lacks")
            ruled.add(rule.path)
            if "{i}" in rule.key:
                for i in range(self.expected[rule.path][0]):
                    self.by_key[rule.key.format(i=i + rule.offset)] = (rule, i)
            else:
                self.by_key[rule.key] = (rule, None)
        unruled = sorted(set(self.expected) - ruled)
        if unruled:
            raise ConversionError(f"no conversion rule for parameter {'/'.join(unruled[0])}")
        self.seen: set[str] = set()

    def add(self, key: str, array: np.ndarray) -> None:
        """Place one weight. Raises ConversionError on an unknown, repeated or mis-shaped key."""
        if key.startswith(self.ignored_prefixes) and key not in self.by_key:
            return
        if key not in self.by_key:
            raise ConversionError(f"{self.source}: unexpected weight {key!r}: no parameter of this model takes it")
        if key in self.seen:
            raise ConversionError(f"{self.source}: weight {key!r} appears twice")
        rule, index = self.by_key[key]
        value = TRANSFORMS[rule.transform](np.asarray(array))
        full = self.expected[rule.path]
        want = full[1:] if index is not None else full
        if value.shape != want:
            raise ConversionError(
                f"{self.source}: weight {key!r} has shape {tuple(np.shape(array))}; parameter "
                f"{'/'.join(rule.path)} needs {want} after the {rule.transform!r} layout change"
            )
        if rule.path not in self.buffers:
            self.buffers[rule.path] = np.empty(full, self.dtype or value.dtype)
        buf = self.buffers[rule.path]
        if index is None:
            buf[...] = value
        else:
            buf[index] = value
        self.seen.add(key)

    def finish(self) -> dict:
        """The nested parameter dict; raises ConversionError naming the first missing weight."""
        missing = [k for k in self.by_key if k not in self.seen]
        if missing:
            rule, _ = self.by_key[missing[0]]
            raise ConversionError(
                f"{self.source}: missing weight {missing[0]!r} for parameter {'/'.join(rule.path)} "
                f"({len(missing)} missing in all)"
            )
        return _nest(self.buffers)


def convert_weights(
    family: ModelFamily, cfg: Any, weights: Iterable[tuple[str, np.ndarray]], dtype=None, source: str = "checkpoint"
) -> dict:
    """Convert (key, array) pairs of a diffusers state dict into the family's Flax params
    (in `cfg`'s block layout)."""
    stored = family.stored_config(cfg)
    builder = ParamBuilder(
        family.weight_rules(stored), family.abstract_params(stored), dtype=dtype, source=source,
        ignored_prefixes=family.ignored_prefixes,
    )
    for key, array in weights:
        builder.add(key, array)
    return family.to_layout(builder.finish(), cfg)


_SAFETENSORS_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}


def read_safetensors(path: str) -> Iterator[tuple[str, np.ndarray]]:
    """Yield (key, array) from a .safetensors file, memory-mapped (bf16 included)."""
    with open(path, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        try:
            header = json.loads(f.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConversionError(f"{path}: not a safetensors file (bad header: {e})") from None
        data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    start = 8 + header_len
    for key, info in header.items():
        if key == "__metadata__":
            continue
        if info["dtype"] not in _SAFETENSORS_DTYPES:
            raise ConversionError(f"{path}: weight {key!r} has unsupported dtype {info['dtype']}")
        lo, hi = info["data_offsets"]
        dtype = np.dtype(_SAFETENSORS_DTYPES[info["dtype"]])
        if (hi - lo) != dtype.itemsize * int(np.prod(info["shape"], dtype=np.int64)) or start + hi > len(data):
            raise ConversionError(f"{path}: weight {key!r} is truncated or corrupt")
        yield key, np.frombuffer(data, dtype=dtype, count=(hi - lo) // dtype.itemsize, offset=start + lo).reshape(
            info["shape"]
        )


def safetensors_shards(model_dir: str) -> list[str]:
    """The weight files of a diffusers model folder, in index order when sharded."""
    index = [n for n in os.listdir(model_dir) if n.endswith(".safetensors.index.json")]
    if index:
        with open(os.path.join(model_dir, index[0])) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = sorted(n for n in os.listdir(model_dir) if n.endswith(".safetensors"))
    if not files:
        raise ConversionError(f"{model_dir}: no .safetensors weights found")
    paths = [os.path.join(model_dir, n) for n in files]
    absent = [p for p in paths if not os.path.exists(p)]
    if absent:
        raise ConversionError(f"{model_dir}: shard {absent[0]} named in the index is missing")
    return paths


def torch_state_dict_arrays(module) -> Iterator[tuple[str, np.ndarray]]:
    """(key, float32 numpy array) for every tensor of a torch module's state dict."""
    for key, tensor in module.state_dict().items():
        yield key, tensor.detach().float().cpu().numpy()


def read_weight_file(path: str) -> Iterator[tuple[str, np.ndarray]]:
    """(key, array) pairs of a .safetensors or torch (.bin/.pt/.pth) state dict.

    A torch file may wrap the state dict as {'state_dict': ...} (HPS and ImageReward checkpoints) and
    carry a DistributedDataParallel 'module.' prefix; both are removed.
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"weight file {path} not found")
    if path.endswith(".safetensors"):
        yield from read_safetensors(path)
        return
    import torch

    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 (torch raises many types for a bad file)
        raise ConversionError(f"{path}: not a readable torch state dict ({type(e).__name__}: {e})") from None
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]
    for key, tensor in state.items():
        yield key.removeprefix("module."), tensor.detach().float().numpy() if tensor.is_floating_point() else tensor.numpy()
