r"""Convert a diffusers transformer or VAE folder (config.json + safetensors) into an orbax checkpoint.

    python convert/diffusers_to_orbax.py \
        --model_dir=/ckpt/FLUX.1-dev/transformer --out=/ckpt/flux-dev-jax [--dtype=bfloat16]
    python convert/diffusers_to_orbax.py --model_dir=/ckpt/FLUX.1-dev/vae --out=/ckpt/flux-vae-jax

Families: the FLUX, Qwen-Image, Wan2.1/2.2, HunyuanVideo and SD3 / SD3.5 transformers and their
VAEs (the decoder; the encoder's weights are skipped), recognised by config.json's `_class_name`.
`--family=vae_wan_encoder` converts a Wan VAE folder's encoder instead (Wan2.2 TI2V encodes its
conditioning image with it); `--family=wan22` a Wan2.2-TI2V-5B transformer for configs/wan22.py.
Wan2.2-A14B's two experts convert into one checkpoint of the pair:

    python convert/diffusers_to_orbax.py --model_dir=/ckpt/Wan2.2-T2V-A14B-Diffusers/transformer \
        --model_dir_2=/ckpt/Wan2.2-T2V-A14B-Diffusers/transformer_2 --out=/ckpt/wan22-a14b-jax

The shards are read one at a time, memory-mapped, and each weight is written into
its place in the output tree as it is read, so peak memory is about the size of
the converted parameters. Every key and shape is checked against the Flax module;
the first unexpected, missing or mis-shaped weight stops the conversion with its
name. Load the result with `digen_jax.models.load_checkpoint(out)`.
"""
from __future__ import annotations

import sys

from absl import flags

from digen_jax import cli
from digen_jax.models import ConversionError, convert_diffusers_folder, convert_expert_pair

_MODEL_DIR = flags.DEFINE_string("model_dir", None, "Diffusers model folder holding config.json and *.safetensors.")
_OUT = flags.DEFINE_string("out", None, "Output checkpoint folder.")
_FAMILY = flags.DEFINE_string(
    "family", None, "The part to convert where several families port one class (vae_wan_encoder); default: by class."
)
_MODEL_DIR_2 = flags.DEFINE_string(
    "model_dir_2", None, "Wan2.2-A14B: the low-noise expert's folder (transformer_2); --model_dir is the high-noise one."
)
_BOUNDARY = flags.DEFINE_float(
    "boundary_ratio", None, "With --model_dir_2: the expert switch; default the pipeline's model_index.json's."
)
_DTYPE = flags.DEFINE_enum(
    "dtype", "source", ["source", "float32", "bfloat16", "float16"], "Stored dtype; 'source' keeps the file's."
)


def main(argv):
    del argv
    if not _MODEL_DIR.value or not _OUT.value:
        sys.exit("usage: diffusers_to_orbax.py --model_dir=DIR --out=DIR [--model_dir_2=DIR] [--family=NAME] "
                 "[--dtype=source|float32|bfloat16|float16]")
    try:
        if _MODEL_DIR_2.value:
            convert_expert_pair(_MODEL_DIR.value, _MODEL_DIR_2.value, _OUT.value, _BOUNDARY.value, _DTYPE.value)
        else:
            convert_diffusers_folder(_MODEL_DIR.value, _OUT.value, _DTYPE.value, family=_FAMILY.value)
    except (FileNotFoundError, ConversionError, ValueError) as e:  # a folder that is not a diffusers model, corrupt weights
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    cli.run(main)
