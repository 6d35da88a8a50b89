r"""Reward models as their users download them, with random weights: the inputs of the converter
CLIs, for benchmarks of the rewards at full size where the released weights cannot be fetched.

    python3 benchmarks/random_reward_checkpoints.py --out=/tmp/reward_sources [--size=tiny]

Writes under --out:
  ImageReward.pt      the `image-reward` package's `ImageReward` state dict (`blip.*`, `mlp.*`),
                      ImageReward-v1.0 (BLIP ViT-L/16 + BERT-base) or the tiny variant, built from
                      the package's own modules (tests/test_image_reward.py `package_model`);
  bert_tokenizer/     a BERT WordPiece tokenizer over a small vocabulary (bert-base-uncased's
                      special tokens, lower-case letters, digits and punctuation; ids < 99, so it
                      serves the tiny variant too);
  HPS_v2.1.pt         an open_clip ViT-H-14 state dict (open_clip's model_configs/ViT-H-14.json,
                      open_clip's own initialisation), or the tiny CLIP of tests/test_clip.py;
  clip_tokenizer/     CLIP's BPE tokenizer (vocab.json + merges.txt) made from the vocabulary
                      open_clip ships (bpe_simple_vocab_16e6.txt.gz): the real ViT-H-14 tokenizer;
                      at tiny size, tests/test_clip.py's five-word tokenizer.
Then, as a user would:

    python3 convert/image_reward_to_orbax.py --checkpoint=DIR/ImageReward.pt \
        --tokenizer_dir=DIR/bert_tokenizer --out=/tmp/image_reward_jax
    python3 convert/clip_to_orbax.py --open_clip_checkpoint=DIR/HPS_v2.1.pt --variant=ViT-H-14 \
        --tokenizer_dir=DIR/clip_tokenizer --out=/tmp/hpsv2_jax

(tiny: `--variant=tiny` to both, and `--config_overrides={"hidden_act": "gelu"}` to the CLIP one.)
Needs torch, transformers, image-reward and open_clip_torch (requirements-dev.txt).
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import transformers  # noqa: E402

import test_clip  # noqa: E402  (the open_clip import without torchvision, the tiny CLIP and tokenizer)
import test_image_reward  # noqa: E402  (the ImageReward package's modules and scorer)
from digen_jax.models import image_reward  # noqa: E402

BERT_WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *"abcdefghijklmnopqrstuvwxyz0123456789<>.,"]


def bytes_to_unicode() -> dict[int, str]:
    """CLIP's (and GPT-2's) map of the 256 bytes to printable characters."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def clip_tokenizer(out: str) -> int:
    """open_clip's SimpleTokenizer vocabulary as a transformers CLIP tokenizer folder; its size."""
    root = os.path.dirname(test_clip._open_clip_model_module().__file__)  # open_clip's package folder
    with gzip.open(os.path.join(root, "bpe_simple_vocab_16e6.txt.gz"), "rt", encoding="utf-8") as f:
        merges = f.read().split("\n")[1 : 49152 - 256 - 2 + 1]  # the slice open_clip takes
    vocab = list(bytes_to_unicode().values())
    vocab += [v + "</w>" for v in vocab] + ["".join(m.split()) for m in merges] + ["<|startoftext|>", "<|endoftext|>"]
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "vocab.json"), "w", encoding="utf-8") as f:
        json.dump({token: i for i, token in enumerate(vocab)}, f, ensure_ascii=False)
    with open(os.path.join(out, "merges.txt"), "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n" + "\n".join(merges) + "\n")
    transformers.CLIPTokenizer(os.path.join(out, "vocab.json"), os.path.join(out, "merges.txt"),
                               pad_token="<|endoftext|>").save_pretrained(out)
    return len(vocab)


def bert_tokenizer(out: str) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "vocab.txt"), "w") as f:
        f.write("\n".join(BERT_WORDS) + "\n")
    transformers.BertTokenizer(os.path.join(out, "vocab.txt"), do_lower_case=True).save_pretrained(out)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--size", default="full", choices=["full", "tiny"], help="full: ImageReward-v1.0 and ViT-H-14")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    full = args.size == "full"

    start = time.time()
    cfg = image_reward.VARIANTS["ImageReward-v1.0" if full else "tiny"]
    model = test_image_reward.package_model(test_image_reward.package_modules(), cfg, seed=args.seed, deep=full)
    torch.save(model.state_dict(), os.path.join(args.out, "ImageReward.pt"))
    count = sum(p.numel() for p in model.parameters())
    del model
    bert_tokenizer(os.path.join(args.out, "bert_tokenizer"))
    print(f"wrote ImageReward.pt ({count / 1e6:.1f}M parameters) and bert_tokenizer/ in {time.time() - start:.1f} s",
          flush=True)

    start = time.time()
    ocm = test_clip._open_clip_model_module()
    torch.manual_seed(args.seed + 1)
    if full:
        with open(os.path.join(os.path.dirname(ocm.__file__), "model_configs", "ViT-H-14.json")) as f:
            model = ocm.CLIP(**json.load(f))
        vocab = clip_tokenizer(os.path.join(args.out, "clip_tokenizer"))
    else:  # tests/test_clip.py's tiny open_clip model (gelu, as its conversion overrides)
        model = ocm.CLIP(embed_dim=24, vision_cfg=ocm.CLIPVisionCfg(layers=2, width=32, head_width=8, patch_size=8,
                                                                    image_size=32),
                         text_cfg=ocm.CLIPTextCfg(context_length=16, vocab_size=99, width=32, heads=4, layers=2))
        vocab = len(test_clip._tiny_tokenizer_dir(os.path.join(args.out, "clip_tokenizer")))
    torch.save(model.state_dict(), os.path.join(args.out, "HPS_v2.1.pt"))
    count = sum(p.numel() for p in model.parameters())
    print(f"wrote HPS_v2.1.pt ({count / 1e6:.1f}M parameters) and clip_tokenizer/ ({vocab} tokens) in "
          f"{time.time() - start:.1f} s", flush=True)


if __name__ == "__main__":
    main()
