r"""Convert ImageReward weights into a checkpoint the `image_reward` reward loads.

    python convert/image_reward_to_orbax.py --checkpoint=/ckpt/ImageReward/ImageReward.pt \
        --tokenizer_dir=/ckpt/bert-base-uncased --out=/ckpt/image-reward-jax

--checkpoint is the package's state dict (THUDM/ImageReward on the Hugging Face hub:
ImageReward.pt; `torch.load` gives the keys `blip.*` and `mlp.*`), --variant its architecture
(`ImageReward-v1.0`: BLIP ViT-L/16 + BERT-base). The output folder holds `model.json` + `params`
(the BLIP backbone, read by `digen_jax.models.load_checkpoint`), `mlp_head/` (the scoring MLP)
and `tokenizer/` (the BERT tokenizer files of --tokenizer_dir). Every key and shape is checked
against the Flax modules; the first unexpected, missing or mis-shaped weight stops the
conversion with its name.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys

import orbax.checkpoint as ocp

from digen_jax.models import image_reward
from digen_jax.models.checkpoints import save_checkpoint
from digen_jax.models.conversion import ConversionError, ParamBuilder, read_weight_file
from digen_jax.rewards.clip_scores import TOKENIZER_SUBDIR, aesthetic_head_params
from digen_jax.rewards.image_reward import HEAD_DIR

TOKENIZER_FILES = ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
HEAD_PREFIX = "mlp."


def convert(args: argparse.Namespace, log=print) -> None:
    """Run one conversion (see the module docstring for the arguments)."""
    if args.variant not in image_reward.VARIANTS:
        raise ValueError(f"--variant must be one of {sorted(image_reward.VARIANTS)}, got {args.variant!r}")
    cfg = image_reward.VARIANTS[args.variant]
    if args.config_overrides:
        cfg = dataclasses.replace(cfg, **json.loads(args.config_overrides))
    dtype = None if args.dtype == "source" else args.dtype
    family = image_reward.FAMILY
    builder = ParamBuilder(family.weight_rules(cfg), family.abstract_params(cfg), dtype=dtype,
                           source=args.checkpoint, ignored_prefixes=family.ignored_prefixes)
    head_weights = []
    for key, array in read_weight_file(args.checkpoint):
        if key.startswith(HEAD_PREFIX):
            head_weights.append((key[len(HEAD_PREFIX):], array))
        else:
            builder.add(key, array)
    if not head_weights:
        raise ConversionError(f"{args.checkpoint}: no {HEAD_PREFIX}* weights (the scoring MLP); "
                              "is this ImageReward's state dict?")
    head = aesthetic_head_params(head_weights, cfg.text_width, f"{args.checkpoint} ({HEAD_PREFIX}*)")
    save_checkpoint(args.out, family, cfg, builder.finish())
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(os.path.join(os.path.abspath(args.out), HEAD_DIR), head, force=True)
    checkpointer.wait_until_finished()
    log(f"wrote the ImageReward backbone ({len(builder.seen)} weights) and its MLP head to {args.out}")

    files = [n for n in TOKENIZER_FILES if args.tokenizer_dir and os.path.exists(os.path.join(args.tokenizer_dir, n))]
    if args.tokenizer_dir and not files:
        raise FileNotFoundError(f"--tokenizer_dir {args.tokenizer_dir} has none of {TOKENIZER_FILES}")
    if files:
        target = os.path.join(args.out, TOKENIZER_SUBDIR)
        os.makedirs(target, exist_ok=True)
        for name in files:
            shutil.copy(os.path.join(args.tokenizer_dir, name), target)
        log(f"copied tokenizer files {files} to {target}")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, help="ImageReward state dict (ImageReward.pt or .safetensors)")
    p.add_argument("--variant", default="ImageReward-v1.0", help=f"architecture: {sorted(image_reward.VARIANTS)}")
    p.add_argument("--config_overrides", help="JSON object of ImageRewardConfig fields replacing the variant's")
    p.add_argument("--tokenizer_dir", help="folder with the BERT tokenizer files (bert-base-uncased) to copy")
    p.add_argument("--out", required=True, help="output checkpoint folder")
    p.add_argument("--dtype", default="source", choices=["source", "float32", "bfloat16", "float16"],
                   help="stored dtype; 'source' keeps the file's")
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    try:
        convert(args)
    except (ValueError, FileNotFoundError) as e:
        sys.exit(f"image_reward_to_orbax: {e}")


if __name__ == "__main__":
    main()
