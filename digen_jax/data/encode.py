"""Prompt encoding in torch with the diffusers pipelines' own `encode_prompt`, into a cache.

The pipelines are built from their text components only (transformer, VAE and scheduler None,
which diffusers accepts), so the template, cropping, padding and caps are diffusers' code, not
a re-implementation; see :mod:`digen_jax.data.embeddings` for what each family stores. torch,
transformers and diffusers are imported inside the functions: training imports this package
without them.
"""
from __future__ import annotations

import inspect
import json
import os
import time
from collections.abc import Sequence

import numpy as np
from absl import logging

from digen_jax.data.embeddings import DTYPES, EMBEDDING_LAYOUTS, CacheWriter
from digen_jax.models.specs import SPECS

# family -> (diffusers pipeline class, {text-encoder subfolder: default transformers class},
#            tokenizer subfolders, default max_sequence_length, hard cap of max_sequence_length),
# from the family specs (`TextPipeline`).
PIPELINES = {name: spec.text_pipeline for name, spec in SPECS.items()}
# Sentinel for "the family's default negative prompt" (EMBEDDING_LAYOUTS[family]["negative"]).
FAMILY_DEFAULT = object()


def read_prompts(path: str) -> tuple[list[int], list[str]]:
    """(line numbers, prompts) of a prompt file: one prompt per line, or JSON lines with "prompt".

    Blank lines are skipped (their line numbers too); prompts are kept verbatim apart from the
    line break, since the tokenizers see leading and trailing spaces.
    """
    ids, prompts = [], []
    jsonl = path.endswith(".jsonl")
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f):
            line = line.rstrip("\r\n")
            if not line.strip():
                continue
            if jsonl:
                try:
                    line = json.loads(line)["prompt"]
                except (json.JSONDecodeError, KeyError, TypeError) as e:
                    raise ValueError(f"{path}:{number + 1}: expected a JSON object with a \"prompt\" ({e})") from e
            ids.append(number)
            prompts.append(line)
    if not prompts:
        raise ValueError(f"{path} holds no prompts")
    return ids, prompts


def text_pipeline(family: str, **components):
    """The family's diffusers pipeline holding only `components` (text encoders and tokenizers)."""
    import diffusers

    if family not in PIPELINES:
        raise ValueError(f"unknown model family {family!r}; expected one of {sorted(PIPELINES)}")
    cls = getattr(diffusers, PIPELINES[family][0])
    absent = {name: None for name, p in inspect.signature(cls.__init__).parameters.items()
              if name != "self" and p.default is inspect.Parameter.empty and name not in components}
    return cls(**components, **absent)


def load_pipeline(family: str, encoder_dir: str, *, device: str = "cpu", dtype: str = "bfloat16"):
    """Loads the family's text encoders and tokenizers from a diffusers pipeline folder."""
    import torch
    import transformers

    if family not in PIPELINES:
        raise ValueError(f"unknown model family {family!r}; expected one of {sorted(PIPELINES)}")
    _, encoders, tokenizers, _, _ = PIPELINES[family]
    components = {}
    for name, default_class in encoders.items():
        folder = os.path.join(encoder_dir, name)
        if not os.path.isdir(folder):
            raise FileNotFoundError(f"{folder} not found: --encoder_dir must be a diffusers {family} pipeline "
                                    f"folder with subfolders {sorted([*encoders, *tokenizers])}")
        with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
            class_name = (json.load(f).get("architectures") or [default_class])[0]
        logging.info("loading %s (%s) from %s", name, class_name, folder)
        model = getattr(transformers, class_name).from_pretrained(folder, dtype=getattr(torch, dtype))
        components[name] = model.to(device).eval()
    for name in tokenizers:
        components[name] = transformers.AutoTokenizer.from_pretrained(os.path.join(encoder_dir, name))
    return text_pipeline(family, **components)


def _numpy(tensor) -> np.ndarray:
    # bfloat16 -> float32 is exact, so a bfloat16 cache holds the encoder's bits.
    return tensor.detach().float().cpu().numpy()


def encode_batch(pipe, family: str, prompts: Sequence[str], *, max_sequence_length: int | None = None,
                 device: str = "cpu") -> dict[str, np.ndarray]:
    """What the pipeline's `encode_prompt` gives for `prompts`, as float32/int numpy arrays.

    Returns 'text' (B, L', D) and, as the family stores them, 'pooled' (B, P), 'mask' (B, L')
    bool and 'lengths' (B,) int32. L' is max_sequence_length except for Qwen-Image, where it is
    this batch's longest prompt (capped).
    """
    import torch

    if family not in PIPELINES:
        raise ValueError(f"unknown model family {family!r}; expected one of {sorted(PIPELINES)}")
    max_len = max_sequence_length or PIPELINES[family].default_len
    pipeline = PIPELINES[family].pipeline
    prompts = list(prompts)
    with torch.inference_mode():
        if pipeline == "FluxPipeline":
            text, pooled, _ = pipe.encode_prompt(prompts, device=torch.device(device), max_sequence_length=max_len)
            return {"text": _numpy(text), "pooled": _numpy(pooled)}
        if pipeline == "QwenImagePipeline":
            text, mask = pipe.encode_prompt(prompts, device=torch.device(device), max_sequence_length=max_len)
            # diffusers returns no mask when every position is real.
            mask = np.ones(text.shape[:2], bool) if mask is None else mask.cpu().numpy().astype(bool)
            return {"text": _numpy(text), "mask": mask, "lengths": mask.sum(1).astype(np.int32)}
        if pipeline == "WanPipeline":
            from diffusers.pipelines.wan.pipeline_wan import prompt_clean

            text, _ = pipe.encode_prompt(prompts, do_classifier_free_guidance=False, max_sequence_length=max_len,
                                         device=torch.device(device))
            # The real length as `_get_t5_prompt_embeds` measures it (its zeroing starts there).
            mask = pipe.tokenizer([prompt_clean(p) for p in prompts], padding="max_length", max_length=max_len,
                                  truncation=True, add_special_tokens=True, return_attention_mask=True,
                                  return_tensors="np").attention_mask
            return {"text": _numpy(text), "lengths": mask.sum(1).astype(np.int32)}
        if pipeline == "HunyuanVideoPipeline":
            text, pooled, mask = pipe.encode_prompt(prompts, device=torch.device(device),
                                                    max_sequence_length=max_len)
            mask = mask.cpu().numpy().astype(bool)
            return {"text": _numpy(text), "pooled": _numpy(pooled), "mask": mask,
                    "lengths": mask.sum(1).astype(np.int32)}
        if pipeline == "StableDiffusion3Pipeline":
            text, _, pooled, _ = pipe.encode_prompt(prompts, None, None, device=torch.device(device),
                                                    do_classifier_free_guidance=False, max_sequence_length=max_len)
            return {"text": _numpy(text), "pooled": _numpy(pooled)}
    raise ValueError(f"{family}: no prompt encoding is written for {pipeline} (data/encode.py encode_batch)")


def _qwen_lengths(pipe, prompts: Sequence[str], max_len: int) -> np.ndarray:
    """Per prompt, the number of positions `_get_qwen_prompt_embeds` + the cap keep (tokenizer only)."""
    drop = pipe.prompt_template_encode_start_idx
    tokens = pipe.tokenizer([pipe.prompt_template_encode.format(p) for p in prompts],
                            max_length=pipe.tokenizer_max_length + drop, truncation=True)
    return np.minimum([len(ids) - drop for ids in tokens.input_ids], max_len).astype(np.int32)


def encode_to_cache(pipe, family: str, prompts: Sequence[str], out: str, *, prompt_ids: Sequence[int] | None = None,
                    batch_size: int = 8, max_sequence_length: int | None = None,
                    negative_prompt=FAMILY_DEFAULT, dtype: str = "float32", device: str = "cpu",
                    info: dict | None = None) -> str:
    """Encodes `prompts` with `pipe` (see :func:`text_pipeline`, :func:`load_pipeline`) into a cache.

    Args:
      pipe: the family's diffusers pipeline with its text encoders and tokenizers.
      family: one of PIPELINES.
      prompts, prompt_ids: the prompts and their source line numbers (default 0..N-1).
      out: the cache directory to create.
      batch_size: prompts per encoder call.
      max_sequence_length: the family's text length cap; default FLUX 512, Qwen-Image 512,
        Wan 512, HunyuanVideo 256, SD3 256 (T5's; what the pipelines' __call__ pass).
      negative_prompt: the negative prompt of true-CFG families; FAMILY_DEFAULT gives Qwen-Image
        " ", Wan "" and SD3 "", and none for FLUX/HunyuanVideo; None stores none.
      dtype: the stored dtype ('float32', 'float16', 'bfloat16').
      device: torch device the encoders run on.
      info: extra meta.json entries.

    Returns:
      out.
    """
    if family not in PIPELINES:
        raise ValueError(f"unknown model family {family!r}; expected one of {sorted(PIPELINES)}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    _, _, _, default_len, cap = PIPELINES[family]
    max_len = max_sequence_length or default_len
    if cap is not None and max_len > cap:
        raise ValueError(f"max_sequence_length for {family} can be at most {cap}, got {max_len}")
    if negative_prompt is FAMILY_DEFAULT:
        negative_prompt = EMBEDDING_LAYOUTS[family]["negative"]
    prompts = list(prompts)
    encode = lambda batch: encode_batch(pipe, family, batch, max_sequence_length=max_len, device=device)  # noqa: E731
    start_time = time.time()
    negative = None if negative_prompt is None else encode([negative_prompt])
    first = encode(prompts[:batch_size])
    if PIPELINES[family].pipeline == "QwenImagePipeline":
        # diffusers pads each batch to its longest prompt; the cache needs one L for all rows,
        # found by tokenising everything first (cheap next to encoding).
        lengths = _qwen_lengths(pipe, prompts, max_len)
        text_len = int(max(lengths.max(), 0 if negative is None else negative["text"].shape[1]))
    else:
        lengths, text_len = None, first["text"].shape[1]
    writer = CacheWriter(
        out, family, prompts, text_len=text_len, text_dim=first["text"].shape[2],
        pooled_dim=first["pooled"].shape[1] if "pooled" in first else None, dtype=dtype, prompt_ids=prompt_ids,
        negative_prompt=negative_prompt,
        # Which encoders made the cache: training checks its widths, and errors name these.
        info={"max_sequence_length": max_len,
              "encoders": {name: type(getattr(pipe, name)).__name__ for name in PIPELINES[family][1]},
              **(info or {})})
    if negative is not None:
        writer.write_negative(negative)
    for start in range(0, len(prompts), batch_size):
        block = first if start == 0 else encode(prompts[start:start + batch_size])
        if lengths is not None and not np.array_equal(block["lengths"], lengths[start:start + len(block["text"])]):
            raise RuntimeError(f"Qwen-Image lengths of rows {start}.. differ from the tokenizer's; not caching")
        writer.write(start, block)
        done = start + len(block["text"])
        logging.info("encoded %d/%d prompts (%.1f prompts/s)", done, len(prompts),
                     done / max(time.time() - start_time, 1e-9))
    return writer.finish()
