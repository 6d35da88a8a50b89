r"""Convert CLIP reward-model weights into a checkpoint the CLIP rewards load.

    # transformers CLIPModel folder (PickScore_v1, openai/clip-vit-large-patch14):
    python convert/clip_to_orbax.py --transformers_dir=/ckpt/PickScore_v1 \
        --tokenizer_dir=/ckpt/CLIP-ViT-H-14-laion2B-s32B-b79K --out=/ckpt/pickscore-jax
    # open_clip state dict (HPSv2.1: HPS_v2.1_compressed.pt on ViT-H-14):
    python convert/clip_to_orbax.py --open_clip_checkpoint=/ckpt/HPS_v2.1_compressed.pt \
        --variant=ViT-H-14 --tokenizer_dir=/ckpt/CLIP-ViT-H-14-laion2B-s32B-b79K --out=/ckpt/hpsv2-jax
    # LAION aesthetic: CLIP ViT-L/14 plus the MLP head:
    python convert/clip_to_orbax.py --transformers_dir=/ckpt/clip-vit-large-patch14 \
        --aesthetic_head=/ckpt/sac+logos+ava1-l14-linearMSE.pth --out=/ckpt/aesthetic-jax

The output folder holds `model.json` + `params` (read by `digen_jax.models.load_checkpoint`),
`aesthetic_head/` when converted, and `tokenizer/` (the tokenizer files of --tokenizer_dir,
default --transformers_dir when it has them), which the rewards use to tokenise prompts.
Every key and shape is checked against the Flax module; the first unexpected, missing or
mis-shaped weight stops the conversion with its name.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
from typing import Iterator

import numpy as np
import orbax.checkpoint as ocp

from digen_jax.models import clip
from digen_jax.models.checkpoints import save_checkpoint
from digen_jax.models.conversion import (
    ConversionError,
    ParamBuilder,
    read_safetensors,
    read_weight_file,
    safetensors_shards,
)
from digen_jax.rewards.clip_scores import AESTHETIC_HEAD_DIR, TOKENIZER_SUBDIR, aesthetic_head_params

TOKENIZER_FILES = (
    "vocab.json", "merges.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
)


def _transformers_weights(model_dir: str) -> Iterator[tuple[str, np.ndarray]]:
    if any(n.endswith(".safetensors") for n in os.listdir(model_dir)):
        for shard in safetensors_shards(model_dir):
            yield from read_safetensors(shard)
    elif os.path.exists(os.path.join(model_dir, "pytorch_model.bin")):
        yield from read_weight_file(os.path.join(model_dir, "pytorch_model.bin"))
    else:
        raise ConversionError(f"{model_dir}: no *.safetensors or pytorch_model.bin")


def convert(args: argparse.Namespace, log=print) -> None:
    """Run one conversion (see the module docstring for the arguments)."""
    if bool(args.transformers_dir) == bool(args.open_clip_checkpoint):
        raise ValueError("give exactly one of --transformers_dir and --open_clip_checkpoint")
    dtype = None if args.dtype == "source" else args.dtype
    if args.transformers_dir:
        config_path = os.path.join(args.transformers_dir, "config.json")
        if not os.path.exists(config_path):
            raise FileNotFoundError(f"{config_path} not found: --transformers_dir must be a transformers CLIPModel folder")
        with open(config_path) as f:
            cfg = clip.config_from_transformers(json.load(f))
        family, source = clip.TRANSFORMERS_FAMILY, args.transformers_dir
        weights = _transformers_weights(args.transformers_dir)
    else:
        if args.variant not in clip.VARIANTS:
            raise ValueError(
                f"--variant must be one of {sorted(clip.VARIANTS)} for an open_clip checkpoint, got {args.variant!r}"
            )
        cfg = clip.VARIANTS[args.variant]
        if args.config_overrides:
            cfg = dataclasses.replace(cfg, **json.loads(args.config_overrides))
        family, source = clip.OPEN_CLIP_FAMILY, args.open_clip_checkpoint
        weights = clip.split_fused_qkv(read_weight_file(args.open_clip_checkpoint))
    builder = ParamBuilder(
        family.weight_rules(cfg), family.abstract_params(cfg), dtype=dtype, source=source,
        ignored_prefixes=family.ignored_prefixes,
    )
    for key, array in weights:
        builder.add(key, array)
    save_checkpoint(args.out, family, cfg, builder.finish())
    log(f"wrote {family.name} checkpoint ({len(builder.seen)} weights) to {args.out}")

    if args.aesthetic_head:
        head = aesthetic_head_params(read_weight_file(args.aesthetic_head), cfg.projection_dim, args.aesthetic_head)
        checkpointer = ocp.StandardCheckpointer()
        checkpointer.save(os.path.join(os.path.abspath(args.out), AESTHETIC_HEAD_DIR), head, force=True)
        checkpointer.wait_until_finished()
        log(f"wrote the aesthetic head to {os.path.join(args.out, AESTHETIC_HEAD_DIR)}")

    tokenizer_dir = args.tokenizer_dir or args.transformers_dir
    files = [n for n in TOKENIZER_FILES if tokenizer_dir and os.path.exists(os.path.join(tokenizer_dir, n))]
    if files:
        target = os.path.join(args.out, TOKENIZER_SUBDIR)
        os.makedirs(target, exist_ok=True)
        for name in files:
            shutil.copy(os.path.join(tokenizer_dir, name), target)
        log(f"copied tokenizer files {files} to {target}")
    elif args.tokenizer_dir:
        raise FileNotFoundError(f"--tokenizer_dir {args.tokenizer_dir} has none of {TOKENIZER_FILES}")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--transformers_dir", help="transformers CLIPModel folder (config.json + weights)")
    p.add_argument("--open_clip_checkpoint", help="open_clip state dict (.bin, .pt or .safetensors)")
    p.add_argument("--variant", default="ViT-H-14", help=f"architecture of an open_clip checkpoint: {sorted(clip.VARIANTS)}")
    p.add_argument("--config_overrides", help="JSON object of CLIPConfig fields replacing the variant's")
    p.add_argument("--aesthetic_head", help="LAION aesthetic MLP state dict (.pth or .safetensors)")
    p.add_argument("--tokenizer_dir", help="folder with the CLIP tokenizer files to copy next to the weights")
    p.add_argument("--out", required=True, help="output checkpoint folder")
    p.add_argument("--dtype", default="source", choices=["source", "float32", "bfloat16", "float16"],
                   help="stored dtype; 'source' keeps the file's")
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    try:
        convert(args)
    except (ValueError, FileNotFoundError) as e:
        sys.exit(f"clip_to_orbax: {e}")


if __name__ == "__main__":
    main()
