r"""Convert a diffusers transformer folder (config.json + safetensors) into an orbax checkpoint.

    python convert/diffusers_to_orbax.py \
        --model_dir=/ckpt/FLUX.1-dev/transformer --out=/ckpt/flux-dev-jax [--dtype=bfloat16]

The shards are read one at a time, memory-mapped, and each weight is written into
its place in the output tree as it is read, so peak memory is about the size of
the converted parameters. Every key and shape is checked against the Flax module;
the first unexpected, missing or mis-shaped weight stops the conversion with its
name. Load the result with `digen_jax.models.load_checkpoint(out)`.
"""
from __future__ import annotations

import json
import os
import sys
import time

from absl import app, flags

from digen_jax.models import family_for_class, save_checkpoint
from digen_jax.models.conversion import ParamBuilder, read_safetensors, safetensors_shards

_MODEL_DIR = flags.DEFINE_string("model_dir", None, "Diffusers model folder holding config.json and *.safetensors.")
_OUT = flags.DEFINE_string("out", None, "Output checkpoint folder.")
_DTYPE = flags.DEFINE_enum(
    "dtype", "source", ["source", "float32", "bfloat16", "float16"], "Stored dtype; 'source' keeps the file's."
)


def convert(model_dir: str, out: str, dtype: str = "source", log=print) -> None:
    """Convert `model_dir` into a checkpoint at `out` (see the module docstring)."""
    config_path = os.path.join(model_dir, "config.json")
    if not os.path.exists(config_path):
        raise FileNotFoundError(f"{config_path} not found: --model_dir must be a diffusers model folder")
    with open(config_path) as f:
        diffusers_config = json.load(f)
    family = family_for_class(diffusers_config.get("_class_name", "<no _class_name in config.json>"))
    cfg = family.config_from_diffusers(diffusers_config)
    builder = ParamBuilder(
        family.weight_rules(cfg),
        family.abstract_params(cfg),
        dtype=None if dtype == "source" else dtype,
        source=model_dir,
    )
    shards = safetensors_shards(model_dir)
    start = time.time()
    for n, shard in enumerate(shards, 1):
        count = 0
        for key, array in read_safetensors(shard):
            builder.add(key, array)
            count += 1
        log(f"[{n}/{len(shards)}] {os.path.basename(shard)}: {count} weights ({time.time() - start:.1f}s)")
    params = builder.finish()
    save_checkpoint(out, family, cfg, params)
    log(f"wrote {family.name} checkpoint with {len(builder.seen)} weights to {out}")


def main(argv):
    del argv
    if not _MODEL_DIR.value or not _OUT.value:
        sys.exit("usage: diffusers_to_orbax.py --model_dir=DIR --out=DIR [--dtype=source|float32|bfloat16|float16]")
    convert(_MODEL_DIR.value, _OUT.value, _DTYPE.value)


if __name__ == "__main__":
    app.run(main)
