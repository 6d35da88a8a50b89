"""Every per-family table is built from the family specs: each spec has its row in each, and a new
spec appears in all of them."""
from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

from configs.sections import ATTENTION_MLP_TARGETS
from digen_jax import diffusion, model_flops
from digen_jax.app.families import ZOO
from digen_jax.data.embeddings import EMBEDDING_LAYOUTS
from digen_jax.data.encode import PIPELINES
from digen_jax.models import FAMILIES
from digen_jax.models.specs import SPECS

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_the_tables_have_exactly_the_specs_families():
    for table in (ZOO, model_flops.FORMULAS, EMBEDDING_LAYOUTS, PIPELINES, ATTENTION_MLP_TARGETS):
        assert list(table) == list(SPECS)


@pytest.mark.parametrize("name", list(SPECS))
def test_each_table_row_is_the_specs(name):
    spec = SPECS[name]
    zoo = ZOO[name]
    assert zoo.spec is spec and zoo.transformer is FAMILIES[name] and zoo.vae is FAMILIES[spec.vae]
    assert zoo.decode is FAMILIES[spec.vae].decode_frames is not None
    formula = model_flops.FORMULAS[name]
    assert formula.terms is model_flops.TERMS[spec.flop_terms]
    assert (formula.temporal_patch, formula.pixels_per_token) == (spec.temporal_patch, spec.pixels_per_token)
    assert spec.video == (spec.temporal_patch is not None)
    assert EMBEDDING_LAYOUTS[name] is spec.embedding
    assert PIPELINES[name] is spec.text_pipeline
    assert ATTENTION_MLP_TARGETS[name] == spec.lora_targets
    assert spec.ladder in diffusion.LADDER_FAMILIES
    # The variants it names exist, and every LoRA pattern adapts some matmul of the blocks.
    assert spec.full_variant in FAMILIES[name].variants
    vae_variants = FAMILIES[spec.vae].variants
    assert {spec.full_vae_variant, *spec.vae_variants.values()} <= set(vae_variants)
    assert set(spec.vae_families) <= set(FAMILIES)
    cfg = FAMILIES[name].variants["tiny"]
    frames = 5 if spec.video else 1
    side = spec.pixels_per_token(cfg) if spec.pixels_per_token else model_flops.PIXELS_PER_TOKEN
    terms = model_flops.model_terms(name, cfg, batch=1, height=2 * side, width=2 * side, frames=frames, text_len=4)
    assert terms.adapted(spec.lora_targets)


def test_a_new_spec_appears_in_every_table():
    # A copy of FLUX's spec and family under a new name, added before the tables are built.
    code = """
import dataclasses
from digen_jax.models import FAMILIES, specs
from digen_jax.models.flux import transformer
specs.SPECS["new"] = dataclasses.replace(specs.SPECS["flux"], name="new")
FAMILIES["new"] = dataclasses.replace(transformer.FAMILY, name="new")
from configs.sections import ATTENTION_MLP_TARGETS
from digen_jax import model_flops
from digen_jax.app.families import ZOO
from digen_jax.data.embeddings import EMBEDDING_LAYOUTS
from digen_jax.data.encode import PIPELINES
print([sorted(t) == sorted(specs.SPECS) and "new" in t
       for t in (ZOO, model_flops.FORMULAS, EMBEDDING_LAYOUTS, PIPELINES, ATTENTION_MLP_TARGETS)])
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str([True] * 5)


def test_the_public_module_paths_read_the_family_packages():
    from digen_jax import models
    from digen_jax.models import flux, vae_flux, vae_hunyuan_video, vae_wan
    from digen_jax.models.flux import transformer

    assert flux.FluxConfig is transformer.FluxConfig and flux.FAMILY is FAMILIES["flux"]
    assert (vae_flux.FAMILY, vae_wan.FAMILY, vae_hunyuan_video.FAMILY) == (
        FAMILIES["vae_flux"], FAMILIES["vae_wan"], FAMILIES["vae_hunyuan_video"])
    assert callable(models.from_diffusers) and callable(models.load_checkpoint)
    with pytest.raises(AttributeError):
        models.no_such_module
