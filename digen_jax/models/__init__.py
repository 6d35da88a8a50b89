"""Model families and the public loading API.

Each transformer family is a package (`flux`, `qwenimage`, `wan`, `wan22`, `hunyuan_video`,
`sd3`): its `transformer` module, its own `vae` where it has one, and a JAX-free `spec`; `specs`
lists the families. `from_diffusers(module)` ports an instantiated diffusers transformer;
`load_checkpoint(path)` reads one converted by `convert/diffusers_to_orbax.py` (both in
`loading`, with `FAMILIES`, the converted-model registry).

Names load on first use, so that the specs import no JAX.
"""
from __future__ import annotations

import importlib

_REGISTRY = (
    "FAMILIES", "ConversionError", "convert_diffusers_folder", "convert_expert_pair", "family_for_class",
    "from_diffusers", "load_checkpoint", "make_apply_fn", "save_checkpoint",
)
__all__ = list(_REGISTRY)
# The VAE modules by their names outside the family packages (`from digen_jax.models import vae_wan`).
_VAES = {"vae_flux": "flux.vae", "vae_wan": "wan.vae", "vae_hunyuan_video": "hunyuan_video.vae"}


def __getattr__(name: str):
    if name in _REGISTRY:
        return getattr(importlib.import_module(f"{__name__}.loading"), name)
    if name in _VAES:
        return importlib.import_module(f"{__name__}.{_VAES[name]}")
    try:
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as e:
        if e.name != f"{__name__}.{name}":
            raise
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
