"""The transformer families: one `FamilySpec` row each, in one list. Every per-family table
(the run's model zoo, FLOP formulas, embedding layouts, text pipelines, LoRA targets) is built
from it; adding a family is its package plus one row here (docs/adding_a_family.md).
Imports no JAX."""
from __future__ import annotations

from digen_jax.models.family_spec import FamilySpec
from digen_jax.models.flux import spec as flux
from digen_jax.models.hunyuan_video import spec as hunyuan_video
from digen_jax.models.qwenimage import spec as qwenimage
from digen_jax.models.sd3 import spec as sd3
from digen_jax.models.wan import spec as wan
from digen_jax.models.wan22 import spec as wan22

SPECS: dict[str, FamilySpec] = {
    s.name: s for s in (flux.SPEC, qwenimage.SPEC, wan.SPEC, wan22.SPEC, hunyuan_video.SPEC, sd3.SPEC)
}
