r"""Precompute the prompt embeddings of a prompt file into a cache that training reads without torch.

    python convert/encode_prompts.py --family=flux --prompts=prompts.txt \
        --encoder_dir=/ckpt/FLUX.1-dev --out=/data/flux-prompts [--device=cuda --dtype=bfloat16]

--prompts is a text file (one prompt per line) or JSON lines with a "prompt" key (blank lines
are skipped; each row keeps its line number). --encoder_dir is a diffusers pipeline folder; only
its text encoder and tokenizer subfolders are read (FLUX: text_encoder, tokenizer,
text_encoder_2, tokenizer_2; Qwen-Image and Wan: text_encoder, tokenizer; HunyuanVideo: all
four; SD3: the three encoders and tokenizers). The pipeline's own `encode_prompt` does the
encoding, so templates, cropping, padding and caps are exactly diffusers'. The true-CFG families
(Qwen-Image, Wan, SD3) also store their negative prompt's embedding (" ", "" and "" unless
--negative_prompt is given, none with --no_negative).
Read the result with `digen_jax.data.embeddings.EmbeddingCache.open(out)`.
"""
from __future__ import annotations

import os
import sys

from absl import flags, logging

from digen_jax import cli
from digen_jax.data import embeddings, encode

_FAMILY = flags.DEFINE_enum("family", None, sorted(embeddings.EMBEDDING_LAYOUTS), "Model family of the encoders.")
_PROMPTS = flags.DEFINE_string("prompts", None, "Prompt file: .txt (one per line) or .jsonl with \"prompt\".")
_OUT = flags.DEFINE_string("out", None, "Cache directory to create.")
_ENCODER_DIR = flags.DEFINE_string("encoder_dir", None, "Diffusers pipeline folder with the text encoder(s).")
_BATCH_SIZE = flags.DEFINE_integer("batch_size", 8, "Prompts per encoder call.")
_DEVICE = flags.DEFINE_string("device", "cpu", "torch device: cpu, cuda, cuda:1, ...")
_DTYPE = flags.DEFINE_enum("dtype", "bfloat16", list(embeddings.DTYPES), "Encoder weights and stored dtype.")
_MAX_LEN = flags.DEFINE_integer(
    "max_sequence_length", None, "Text length cap; default FLUX 512, Qwen-Image 512, Wan 512, HunyuanVideo 256, SD3 256 (T5's).")
_NEGATIVE = flags.DEFINE_string("negative_prompt", None, "Negative prompt of true-CFG families; default family's.")
_NO_NEGATIVE = flags.DEFINE_bool("no_negative", False, "Store no negative prompt embedding.")


def main(argv):
    del argv
    if not (_FAMILY.value and _PROMPTS.value and _OUT.value and _ENCODER_DIR.value):
        sys.exit("usage: encode_prompts.py --family=FAMILY --prompts=FILE --encoder_dir=DIR --out=DIR "
                 "[--batch_size=8 --device=cpu --dtype=bfloat16 --max_sequence_length=N --negative_prompt=TEXT]")
    if _NO_NEGATIVE.value and _NEGATIVE.value is not None:
        sys.exit("--negative_prompt and --no_negative exclude each other")
    # Fail before loading encoders that can take minutes; write_cache checks again.
    if not os.path.isfile(_PROMPTS.value):
        sys.exit(f"error: --prompts={_PROMPTS.value} is not a file (one prompt per line, or jsonl with \"prompt\")")
    if not os.path.isdir(_ENCODER_DIR.value):
        sys.exit(f"error: --encoder_dir={_ENCODER_DIR.value} is not a folder (the diffusers pipeline's folder)")
    if os.path.exists(os.path.join(_OUT.value, "meta.json")):
        sys.exit(f"{_OUT.value} already holds an embedding cache; remove it or choose another --out")
    ids, prompts = encode.read_prompts(_PROMPTS.value)
    logging.info("%d prompts from %s", len(prompts), _PROMPTS.value)
    pipe = encode.load_pipeline(_FAMILY.value, _ENCODER_DIR.value, device=_DEVICE.value, dtype=_DTYPE.value)
    if _NO_NEGATIVE.value:
        negative = None
    else:
        negative = encode.FAMILY_DEFAULT if _NEGATIVE.value is None else _NEGATIVE.value
    out = encode.encode_to_cache(
        pipe, _FAMILY.value, prompts, _OUT.value, prompt_ids=ids, batch_size=_BATCH_SIZE.value,
        max_sequence_length=_MAX_LEN.value, negative_prompt=negative, dtype=_DTYPE.value, device=_DEVICE.value,
        info={"source": _PROMPTS.value, "encoder_dir": _ENCODER_DIR.value})
    logging.info("wrote %s", out)


if __name__ == "__main__":
    cli.run(main)
