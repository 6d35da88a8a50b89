"""LoRA adapters over a Flax params pytree.

A LoRA adapter replaces a dense kernel ``W`` (in, out) by ``W + scale * A @ B`` with
``A`` (in, rank), ``B`` (rank, out) and ``scale = alpha / rank`` (the peft convention Flow-GRPO
and DanceGRPO train with). Kernels of ``nn.scan``-stacked blocks carry a leading layers axis,
(L, in, out); their adapters are stacked the same way, (L, in, rank) and (L, rank, out), one
independent adapter per layer.

``params`` is the unboxed (``flax.linen.unbox``) nested dict the models produce. The adapter tree
mirrors it down to each targeted module and holds ``{"lora_a": A, "lora_b": B}`` where the
module holds ``"kernel"``; it is an ordinary pytree, so optax, ``jax.device_put`` (weight sync
moves only the adapter) and checkpointing apply to it directly. Target modules are chosen by
regular expressions searched (``re.search``) in the '/'-joined path of each ``kernel`` leaf,
e.g. ``r"attn/to_(q|k|v|out)/kernel$"`` for FLUX's ``double_blocks/attn/to_q/kernel`` (with
unrolled blocks, ``scan_layers=False``, the path holds the block index: ``double_blocks/0/attn/...``).

Two ways to apply adapters (``LORA_MODES``):
* ``factored``: the model runs on the frozen base with the adapters in its ``lora`` variable
  collection and each adapted layer computes ``x @ W + scale * (x @ A) @ B``
  (``models.layers.AdaptableDense``). Differentiating w.r.t. the adapters then costs the input
  gradients through ``W`` plus rank-sized products, never a kernel-sized ``dW``.
* ``merged``: ``W + scale * A @ B`` is formed first (:func:`merge_lora`). One merge serves many
  forwards, which suits sampling; under ``jax.grad`` its backward builds a full ``dW`` per
  adapted kernel, as expensive as full fine-tuning.
"""
from __future__ import annotations

import re
from typing import Any, Mapping, Sequence

import flax
import jax
import jax.numpy as jnp
from flax import traverse_util

from digen_jax.models import fp8

Params = Mapping[str, Any]
LoraParams = dict[str, Any]

_KERNEL = "kernel"
_A = "lora_a"
_B = "lora_b"
LORA_MODES = ("factored", "merged")


def lora_scale(rank: int, alpha: float) -> float:
    """The adapter scale ``alpha / rank`` that :func:`merge_lora` multiplies ``A @ B`` by."""
    _check_rank(rank)
    return float(alpha) / rank


def match_lora_targets(params: Params, target_patterns: Sequence[str]) -> list[str]:
    """Sorted '/'-joined paths of the ``kernel`` leaves of ``params`` matched by any pattern.

    Raises ValueError if ``target_patterns`` is empty or any pattern matches no kernel (naming
    the pattern), so a typo in the config cannot silently train nothing.
    """
    if isinstance(target_patterns, str) or not target_patterns:
        raise ValueError(
            f"target_patterns must be a non-empty list of regexes, got {target_patterns!r}"
        )
    kernels = [p for p in _flat_paths(params) if p.rsplit("/", 1)[-1] == _KERNEL]
    matched: set[str] = set()
    for pattern in target_patterns:
        hits = [p for p in kernels if re.search(pattern, p)]
        if not hits:
            raise ValueError(
                f"LoRA target pattern {pattern!r} matches no kernel; kernels look like "
                f"{kernels[:4]}"
            )
        matched.update(hits)
    return sorted(matched)


def init_lora(
    params: Params,
    *,
    rank: int,
    target_patterns: Sequence[str],
    key: jax.Array,
    dtype: jnp.dtype = jnp.float32,
) -> LoraParams:
    """Adapters for every kernel matched by ``target_patterns``: ``A ~ U(+-1/sqrt(in))``, ``B = 0``.

    The uniform bound is what peft's default LoRA init gives (``kaiming_uniform_(a=sqrt(5))`` on
    the (rank, in) torch weight), so adapters start distributed as the references' do. ``B = 0``
    makes the adapter a no-op at init: ``merge_lora(params, init_lora(params, ...), scale=...)``
    equals ``params`` exactly. Each kernel (and each layer of a stacked kernel) gets its own draw.
    """
    _check_rank(rank)
    paths = match_lora_targets(params, target_patterns)
    flat = traverse_util.flatten_dict(params, sep="/")
    adapters: dict[str, jax.Array] = {}
    for path, sub_key in zip(paths, jax.random.split(key, len(paths))):
        kernel = flat[path]
        _check_kernel(path, kernel)
        *lead, fan_in, fan_out = kernel.shape
        bound = 1.0 / float(fan_in) ** 0.5
        module = path[: -len(_KERNEL) - 1]
        adapters[f"{module}/{_A}"] = jax.random.uniform(
            sub_key, (*lead, fan_in, rank), dtype, minval=-bound, maxval=bound
        )
        adapters[f"{module}/{_B}"] = jnp.zeros((*lead, rank, fan_out), dtype)
    return traverse_util.unflatten_dict(adapters, sep="/")


def merge_lora(params: Params, lora: LoraParams, *, scale: float) -> dict[str, Any]:
    """``params`` with every adapted kernel replaced by ``W + scale * A @ B``.

    The product runs in float32 at highest matmul precision and the sum is cast back to ``W``'s
    dtype; a leading layers axis is carried through (``einsum('...ir,...ro->...io')``). Every
    other leaf is returned as the same object. Differentiable w.r.t. ``lora`` (and ``params``).
    Each merged kernel is a new full-size array: under jit that is one kernel-sized temporary
    per adapted module.
    """
    flat = traverse_util.flatten_dict(params, sep="/")
    for _, path, kernel, a, b in _adapted_kernels(flat, lora):
        if not path.endswith(f"/{_KERNEL}"):
            raise ValueError(f"{path!r} is an FP8 kernel: adapters on an FP8 base are applied factored, "
                             "never merged into it")
        delta = jnp.einsum(
            "...ir,...ro->...io",
            a.astype(jnp.float32),
            b.astype(jnp.float32),
            precision=jax.lax.Precision.HIGHEST,
        )
        flat[path] = (kernel.astype(jnp.float32) + scale * delta).astype(kernel.dtype)
    return traverse_util.unflatten_dict(flat, sep="/")


def factored_variables(params: Params, lora: LoraParams, *, scale: float) -> dict[str, Any]:
    """Model variables ``{"params": params, "lora": adapters}`` for factored application.

    ``scale`` is folded into each ``lora_b`` (a rank x out product, cheap), so the adapted layers
    compute ``x @ W + (x @ A) @ (scale * B)``; gradients w.r.t. ``lora`` are those of
    :func:`merge_lora`'s form. Every adapter is checked against its kernel as in
    :func:`merge_lora`, so an adapter that no layer would read is an error, not a silent no-op.
    ``params`` may be an FP8 base (``models.fp8.quantize_params``): the adapters stay in their own
    dtype on top of the FP8 base product.
    """
    flat = traverse_util.flatten_dict(params, sep="/")
    scaled = {}
    for module, _, _, a, b in _adapted_kernels(flat, lora):
        scaled[f"{module}/{_A}"] = a
        scaled[f"{module}/{_B}"] = b * jnp.asarray(scale, b.dtype)
    return {"params": params, "lora": traverse_util.unflatten_dict(scaled, sep="/")}


def _adapted_kernels(flat: dict[str, Any], lora: LoraParams):
    """(module, kernel path, kernel, A, B) of every adapter in ``lora``, shapes checked against
    ``flat``; the kernel is the module's ``kernel`` or its FP8 one (``models.fp8.QUANTIZED``)."""
    adapters = traverse_util.flatten_dict(lora, sep="/")
    for module in sorted({p.rsplit("/", 1)[0] for p in adapters}):
        a, b = adapters.get(f"{module}/{_A}"), adapters.get(f"{module}/{_B}")
        path = f"{module}/{_KERNEL}"
        if path not in flat and f"{module}/{fp8.QUANTIZED}" in flat:
            path = f"{module}/{fp8.QUANTIZED}"
        if a is None or b is None or path not in flat:
            raise ValueError(
                f"LoRA entry {module!r} needs {_A!r} and {_B!r} and a matching {path!r} in params"
            )
        kernel = flat[path]
        _check_kernel(path, kernel)
        *lead, fan_in, fan_out = kernel.shape
        rank = a.shape[-1]
        if a.shape != (*lead, fan_in, rank) or b.shape != (*lead, rank, fan_out):
            raise ValueError(
                f"LoRA shapes for {path!r} do not fit kernel {kernel.shape}: "
                f"A {a.shape}, B {b.shape}"
            )
        yield module, path, kernel, a, b


def lora_param_count(lora: LoraParams) -> int:
    """Total number of adapter parameters (sum of leaf sizes)."""
    return sum(int(x.size) for x in jax.tree_util.tree_leaves(lora))


def _flat_paths(params: Params) -> list[str]:
    flat = traverse_util.flatten_dict(params, sep="/")
    for path, leaf in flat.items():
        if not hasattr(leaf, "shape"):
            raise ValueError(
                f"params leaf {path!r} is a {type(leaf).__name__}, not an array: pass unboxed "
                "params (flax.linen.unbox)"
            )
    return list(flat)


def _check_kernel(path: str, kernel: Any) -> None:
    if kernel.ndim not in (2, 3):
        raise ValueError(
            f"LoRA target {path!r} has shape {kernel.shape}; only (in, out) kernels and "
            "(layers, in, out) scanned kernels can be adapted"
        )


def _check_rank(rank: int) -> None:
    if isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0:
        raise ValueError(f"LoRA rank must be a positive int, got {rank!r}")


def check_lora_mode(mode: str) -> str:
    """``mode`` if it is one of ``LORA_MODES``; a ValueError naming the choices otherwise."""
    if mode not in LORA_MODES:
        raise ValueError(f"LoRA mode must be one of {LORA_MODES}, got {mode!r}")
    return mode


@flax.struct.dataclass
class LoraWeights:
    """Base weights plus adapters, applied inside whatever jitted function consumes them.

    ``mode`` (one of ``LORA_MODES``) says how: ``factored`` runs the base with the adapters in
    the ``lora`` collection (no merged kernel at all), ``merged`` forms ``W + scale * A @ B``
    inside each compiled step. Either way no merged copy of the model outlives the step.
    """

    base: Any
    adapters: Any
    scale: float = flax.struct.field(pytree_node=False)
    mode: str = flax.struct.field(pytree_node=False, default="factored")

    def merged(self) -> dict[str, Any]:
        return merge_lora(self.base, self.adapters, scale=self.scale)


def model_variables(params: Any) -> dict[str, Any]:
    """The variables to ``module.apply`` for ``params``: a plain params tree, or LoraWeights
    applied as their ``mode`` says (``{"params", "lora"}`` factored, ``{"params"}`` merged)."""
    if not isinstance(params, LoraWeights):
        return {"params": params}
    if check_lora_mode(params.mode) == "factored":
        return factored_variables(params.base, params.adapters, scale=params.scale)
    return {"params": params.merged()}
