"""On-disk cache of precomputed prompt embeddings, read by training without torch.

The text encoders are frozen during RL fine-tuning, so their outputs are computed once in torch
(``convert/encode_prompts.py``, which calls :func:`digen_jax.data.encode.encode_to_cache`) and
read here as memory-mapped numpy arrays.

A cache is a directory::

    meta.json            format name and version, family, sizes, dtype, source, encoder classes and settings
    prompts.jsonl        one {"id": int, "prompt": str} per row, in row order
    prompt_ids.npy       (N,) int64: each row's 0-based line number in the source prompt file
    text.npy             (N, L, D) text states, exactly what the family's transformer receives
    pooled.npy           (N, P) pooled text vector            [flux, hunyuan_video, sd3]
    mask.npy             (N, L) bool, True = real token       [qwenimage, hunyuan_video]
    lengths.npy          (N,) int32 number of real positions  [qwenimage, wan, hunyuan_video]
    negative_text.npy    (1, L, D) the negative prompt's      [qwenimage, wan, sd3]: true-CFG families
    negative_pooled.npy  (1, P)                               [sd3]
    negative_mask.npy    (1, L)                               [qwenimage]
    negative_lengths.npy (1,)                                 [qwenimage, wan]

What each family stores (docs/models.md section 6):

* ``flux``: T5 ``last_hidden_state`` padded to max_length (512; padding positions are real T5
  outputs, not zeros, and there is no mask); CLIP ``pooler_output`` from 77 tokens as ``pooled``.
  The transformer's ``txt_ids`` are zeros of shape (L, 3) and are not stored.
* ``qwenimage``: Qwen2.5-VL ``hidden_states[-1]`` with the chat template's first 34 tokens
  dropped, capped at max_sequence_length; zero-padded (with mask False) to L, the longest prompt
  of the file (or the negative prompt, if longer). diffusers pads to the longest prompt of each
  batch instead; with the mask the transformer output is the same.
* ``wan``: umT5 ``last_hidden_state`` zeroed past the real length, padded to 512; no mask (the
  transformer takes none), ``lengths`` says where the zeros start.
* ``hunyuan_video``: Llama ``hidden_states[-3]`` with the template's first 95 tokens cropped,
  (L=256) plus mask; CLIP ``pooler_output`` as ``pooled``.
* ``sd3``: as ``StableDiffusion3Pipeline.encode_prompt`` builds them: the penultimate hidden
  states of CLIP-L and CLIP-G (77 tokens each, concatenated to 768 + 1280 = 2048 and
  zero-padded to T5's 4096) followed by T5-XXL's ``last_hidden_state`` padded to
  max_sequence_length, so L = 77 + max_sequence_length (256 by default; Flow-GRPO encodes 128);
  no mask. ``pooled`` is the two CLIPs' projected ``text_embeds`` concatenated (2048). The
  negative prompt ("" by default) stores its text and pooled vector.

Text arrays are float32, float16 or bfloat16 (``meta["dtype"]``). numpy has no bfloat16, so
bfloat16 arrays are saved as their raw bits (uint16) and viewed back as ``ml_dtypes.bfloat16``
when read: no conversion, and they stay memory-mappable.

``meta.json`` is written last, so a directory without it is an interrupted write.
"""
from __future__ import annotations

import json
import os
from collections.abc import Sequence

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from digen_jax.models.specs import SPECS

FORMAT = "digen_jax.embeddings"
VERSION = 1
DTYPES = ("float32", "float16", "bfloat16")

# Which arrays each family stores, and its true-CFG default negative prompt (None: no true CFG),
# from the family specs.
EMBEDDING_LAYOUTS = {name: spec.embedding for name, spec in SPECS.items()}

_HOW_TO_CREATE = (
    "create it with: python convert/encode_prompts.py --family=FAMILY --prompts=PROMPTS.txt "
    "--encoder_dir=DIFFUSERS_PIPELINE_DIR --out={path}"
)


def _check_family(family: str) -> dict:
    if family not in EMBEDDING_LAYOUTS:
        raise ValueError(f"unknown model family {family!r}; expected one of {sorted(EMBEDDING_LAYOUTS)}")
    return EMBEDDING_LAYOUTS[family]


def _storage_dtype(dtype: str) -> np.dtype:
    """The numpy dtype a text array of `dtype` is saved as (bfloat16 as its uint16 bits)."""
    return np.dtype(np.uint16) if dtype == "bfloat16" else np.dtype(dtype)


def _to_storage(array, dtype: str) -> np.ndarray:
    """`array` (any float numpy array) rounded to `dtype`, in its storage representation."""
    if dtype == "bfloat16":
        return np.asarray(array).astype(ml_dtypes.bfloat16).view(np.uint16)
    return np.asarray(array).astype(dtype)


def _from_storage(array: np.ndarray, dtype: str) -> np.ndarray:
    return array.view(ml_dtypes.bfloat16) if dtype == "bfloat16" else array


def _array_specs(family: str, n: int, text_len: int, text_dim: int, pooled_dim: int | None,
                 dtype: str, negative: bool) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """name -> (shape, stored dtype) of every .npy file a cache of these sizes holds."""
    spec = _check_family(family)
    text_dtype = _storage_dtype(dtype)
    arrays = {"prompt_ids": ((n,), np.dtype(np.int64)), "text": ((n, text_len, text_dim), text_dtype)}
    if spec["pooled"]:
        arrays["pooled"] = ((n, pooled_dim), text_dtype)
    if spec["mask"]:
        arrays["mask"] = ((n, text_len), np.dtype(bool))
    if spec["lengths"]:
        arrays["lengths"] = ((n,), np.dtype(np.int32))
    if negative:
        for name in ("text", "pooled", "mask", "lengths"):
            if name in arrays:
                shape, array_dtype = arrays[name]
                arrays["negative_" + name] = ((1, *shape[1:]), array_dtype)
    return arrays


class CacheWriter:
    """Writes a cache row block by row block into preallocated memory-mapped arrays.

    Peak memory is one block, so caches larger than RAM (FLUX over 25k prompts is about 100 GB
    in bfloat16) can be written. Call :meth:`write` for consecutive row ranges covering all N
    rows, :meth:`write_negative` once if the cache has a negative prompt, then :meth:`finish`.
    """

    def __init__(self, path: str, family: str, prompts: Sequence[str], *, text_len: int, text_dim: int,
                 pooled_dim: int | None = None, dtype: str = "float32", prompt_ids: Sequence[int] | None = None,
                 negative_prompt: str | None = None, info: dict | None = None):
        """Creates the directory and its arrays.

        Args:
          path: the cache directory; must not already hold a cache (meta.json).
          family: one of EMBEDDING_LAYOUTS.
          prompts: the N prompt strings, in row order.
          text_len, text_dim, pooled_dim: L, D and P (P only for families with a pooled vector).
          dtype: 'float32', 'float16' or 'bfloat16', the stored dtype of text and pooled arrays.
          prompt_ids: each prompt's line number in its source file; default 0..N-1.
          negative_prompt: the true-CFG negative prompt whose embedding is stored, or None.
          info: extra JSON-serialisable entries for meta.json (source file, encoder settings).
        """
        spec = _check_family(family)
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
        if spec["pooled"] != (pooled_dim is not None):
            raise ValueError(f"family {family!r} {'needs' if spec['pooled'] else 'has no'} pooled_dim")
        if negative_prompt is not None and spec["negative"] is None:
            raise ValueError(f"family {family!r} has no true CFG; it stores no negative prompt")
        if os.path.exists(os.path.join(path, "meta.json")):
            raise FileExistsError(f"{path} already holds an embedding cache; remove it or choose another --out")
        prompts = list(prompts)
        n = len(prompts)
        ids = np.arange(n, dtype=np.int64) if prompt_ids is None else np.asarray(prompt_ids, np.int64)
        if ids.shape != (n,):
            raise ValueError(f"prompt_ids has shape {ids.shape}; {n} prompts need ({n},)")
        self.path, self.family, self.dtype, self.n = path, family, dtype, n
        self._specs = _array_specs(family, n, text_len, text_dim, pooled_dim, dtype, negative_prompt is not None)
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "prompts.jsonl"), "w", encoding="utf-8") as f:
            for i, prompt in zip(ids.tolist(), prompts):
                f.write(json.dumps({"id": i, "prompt": prompt}, ensure_ascii=False) + "\n")
        self._arrays = {
            name: np.lib.format.open_memmap(os.path.join(path, name + ".npy"), mode="w+", dtype=d, shape=s)
            for name, (s, d) in self._specs.items()
        }
        self._arrays["prompt_ids"][:] = ids
        self._meta = {
            "format": FORMAT, "version": VERSION, "family": family, "num_prompts": n, "text_len": text_len,
            "text_dim": text_dim, "pooled_dim": pooled_dim, "dtype": dtype, "negative_prompt": negative_prompt,
            **(info or {}),
        }
        self._rows_written = 0
        self._negative_written = negative_prompt is None

    def write(self, start: int, block: dict) -> None:
        """Stores rows [start, start + B) from `block`: 'text' (B, L', D) with L' <= L (zero-padded
        here to L), plus 'pooled', 'mask' (B, L') and 'lengths' as the family stores them."""
        if start != self._rows_written:
            raise ValueError(f"rows must be written in order: next row is {self._rows_written}, got {start}")
        count = self._write_rows("", start, block)
        self._rows_written += count

    def write_negative(self, block: dict) -> None:
        """Stores the negative prompt's embedding (a block of one row, same keys as :meth:`write`)."""
        if "negative_text" not in self._arrays:
            raise ValueError("this cache was created without a negative_prompt")
        self._write_rows("negative_", 0, block)
        self._negative_written = True

    def _write_rows(self, prefix: str, start: int, block: dict) -> int:
        """Checks `block` against the arrays named prefix + key and stores it at `start`; returns B."""
        names = [name for name in self._arrays if name != "prompt_ids" and name.startswith("negative_") == bool(prefix)]
        expected = {name[len(prefix):] for name in names}
        if set(block) != expected:
            raise ValueError(f"{self.family} block needs keys {sorted(expected)}, got {sorted(block)}")
        count = np.shape(block["text"])[0]
        for name, value in block.items():
            target = self._arrays[prefix + name]
            value = np.asarray(value)
            # Text and mask blocks may be shorter than L (Qwen-Image pads per batch): zero-pad them.
            width = value.shape[1] if name in ("text", "mask") and value.ndim == target.ndim else None
            fits = value.shape[0] == count and start + count <= target.shape[0] and (
                value.shape[1:] == target.shape[1:] if width is None
                else width <= target.shape[1] and value.shape[2:] == target.shape[2:])
            if not fits:
                raise ValueError(f"{name} block of shape {value.shape} at row {start} does not fit {target.shape}")
            if name in ("text", "pooled"):
                value = _to_storage(value, self.dtype)
            rows = target[start:start + count]
            if width is not None and width < target.shape[1]:
                rows[:, width:] = 0
                rows = rows[:, :width]
            rows[...] = value
        return count

    def finish(self) -> str:
        """Flushes the arrays and writes meta.json (which marks the cache complete); returns path."""
        if self._rows_written != self.n:
            raise ValueError(f"only {self._rows_written} of {self.n} rows were written")
        if not self._negative_written:
            raise ValueError("the negative prompt's embedding was not written")
        for array in self._arrays.values():
            array.flush()
        self._arrays.clear()
        tmp = os.path.join(self.path, "meta.json.tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(self._meta, f, indent=1, ensure_ascii=False)
        os.replace(tmp, os.path.join(self.path, "meta.json"))
        return self.path


def write_cache(path: str, family: str, *, prompts: Sequence[str], text, pooled=None, mask=None, lengths=None,
                prompt_ids: Sequence[int] | None = None, negative_prompt: str | None = None,
                negative: dict | None = None,
                dtype: str = "float32", info: dict | None = None) -> str:
    """Writes a whole cache from in-memory arrays (see the module docstring for what each holds).

    Args:
      path, family, prompts, prompt_ids, dtype, info: as for :class:`CacheWriter`.
      text: (N, L, D); pooled: (N, P); mask: (N, L); lengths: (N,) -- as the family stores them.
      negative_prompt, negative: the negative prompt and its embedding, a dict with 'text' (1, L', D)
        and the family's 'mask'/'lengths'; both or neither.

    Returns:
      path.
    """
    if (negative_prompt is None) != (negative is None):
        raise ValueError("give both negative_prompt and its embedding `negative`, or neither")
    text = np.asarray(text)
    block = {"text": text, "pooled": pooled, "mask": mask, "lengths": lengths}
    writer = CacheWriter(
        path, family, prompts, text_len=text.shape[1], text_dim=text.shape[2],
        pooled_dim=None if pooled is None else np.shape(pooled)[1], dtype=dtype, prompt_ids=prompt_ids,
        negative_prompt=negative_prompt, info=info)
    writer.write(0, {k: v for k, v in block.items() if v is not None})
    if negative is not None:
        writer.write_negative(negative)
    return writer.finish()


class EmbeddingCache:
    """A cache opened for reading: arrays memory-mapped, rows gathered on demand.

    Attributes:
      path, family, meta: the directory, its family and its parsed meta.json.
      text_len, text_dim, pooled_dim, dtype: L, D, P (None without a pooled vector) and the dtype.
      prompts: the N prompt strings; prompt_ids: (N,) their source line numbers.
    """

    def __init__(self, path: str, meta: dict, arrays: dict[str, np.ndarray], prompts: list[str]):
        self.path, self.meta, self._arrays, self.prompts = path, meta, arrays, prompts
        self.family = meta["family"]
        self.text_len, self.text_dim, self.pooled_dim = meta["text_len"], meta["text_dim"], meta["pooled_dim"]
        self.dtype = meta["dtype"]
        self.prompt_ids = arrays["prompt_ids"]

    @classmethod
    def open(cls, path: str, expect_family: str | None = None) -> "EmbeddingCache":
        """Opens and validates the cache at `path`.

        Args:
          path: the cache directory.
          expect_family: if given, the family the caller's model belongs to; a cache of another
            family is an error.

        Raises:
          FileNotFoundError: no cache (or an interrupted write) at `path`; the message says how to
            create one.
          ValueError: a cache of another family than expect_family, or arrays that are missing,
            corrupt or disagree with meta.json.
        """
        if expect_family is not None:
            _check_family(expect_family)
        meta_path = os.path.join(path, "meta.json")
        if not os.path.isdir(path):
            raise FileNotFoundError(f"no prompt-embedding cache at {path}: {_HOW_TO_CREATE.format(path=path)}")
        if not os.path.exists(meta_path):
            raise FileNotFoundError(
                f"{path} has no meta.json (not a cache, or its writing was interrupted): "
                + _HOW_TO_CREATE.format(path=path))
        try:
            with open(meta_path, encoding="utf-8") as f:
                meta = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"corrupt cache {path}: cannot read meta.json ({e})") from e
        if not isinstance(meta, dict) or meta.get("format") != FORMAT or meta.get("version") != VERSION:
            raise ValueError(f"{path} is not a {FORMAT} cache of version {VERSION} "
                             f"(meta.json says format {meta.get('format')!r}, version {meta.get('version')!r})")
        missing = sorted({"family", "num_prompts", "text_len", "text_dim", "pooled_dim", "dtype",
                          "negative_prompt"} - set(meta))
        if missing:
            raise ValueError(f"corrupt cache {path}: meta.json lacks {missing}")
        family = meta["family"]
        if family not in EMBEDDING_LAYOUTS or meta["dtype"] not in DTYPES:
            raise ValueError(f"corrupt cache {path}: unknown family {family!r} or dtype {meta['dtype']!r}")
        if expect_family is not None and family != expect_family:
            raise ValueError(
                f"{path} holds {family!r} prompt embeddings but the model is {expect_family!r}; "
                f"encode the prompts with --family={expect_family}")
        specs = _array_specs(family, meta["num_prompts"], meta["text_len"], meta["text_dim"], meta["pooled_dim"],
                             meta["dtype"], meta["negative_prompt"] is not None)
        arrays = {}
        for name, (shape, dtype) in specs.items():
            file = os.path.join(path, name + ".npy")
            try:
                array = np.load(file, mmap_mode="r", allow_pickle=False)
            except (OSError, ValueError) as e:
                raise ValueError(f"corrupt cache {path}: cannot read {name}.npy ({e})") from e
            if array.shape != shape or array.dtype != dtype:
                raise ValueError(f"corrupt cache {path}: {name}.npy has shape {array.shape} and dtype {array.dtype}; "
                                 f"meta.json implies {shape} and {dtype}")
            arrays[name] = _from_storage(array, meta["dtype"]) if name.endswith(("text", "pooled")) else array
        for prefix in ("", "negative_"):
            if prefix + "mask" in arrays and not np.array_equal(
                    arrays[prefix + "mask"].sum(axis=1), arrays[prefix + "lengths"]):
                raise ValueError(f"corrupt cache {path}: {prefix}mask.npy disagrees with {prefix}lengths.npy")
        prompts = []
        with open(os.path.join(path, "prompts.jsonl"), encoding="utf-8") as f:
            for line in f:
                prompts.append(json.loads(line)["prompt"])
        if len(prompts) != meta["num_prompts"]:
            raise ValueError(f"corrupt cache {path}: prompts.jsonl has {len(prompts)} prompts; "
                             f"meta.json says {meta['num_prompts']}")
        return cls(path, meta, arrays, prompts)

    def __len__(self) -> int:
        return self.meta["num_prompts"]

    def batch(self, indices) -> dict[str, jnp.ndarray]:
        """Rows `indices` (ints in [0, N)) as jnp arrays: 'text' (B, L, D), 'prompt_ids' (B,) (int32
        unless jax_enable_x64) and the family's 'pooled' (B, P), 'mask' (B, L) bool and 'lengths' (B,)."""
        indices = np.asarray(indices, np.int64)
        if indices.ndim != 1 or (indices.size and (indices.min() < 0 or indices.max() >= len(self))):
            raise IndexError(f"indices must be a 1-D sequence in [0, {len(self)}), got {indices.tolist()}")
        return {name: jnp.asarray(array[indices]) for name, array in self._arrays.items()
                if not name.startswith("negative_")}

    @property
    def has_negative(self) -> bool:
        return self.meta["negative_prompt"] is not None

    def negative(self) -> dict[str, jnp.ndarray]:
        """The negative prompt's 'text' (1, L, D) and its 'mask'/'lengths' where the family has them."""
        if not self.has_negative:
            raise ValueError(f"{self.path} stores no negative prompt (family {self.family!r})")
        return {name[len("negative_"):]: jnp.asarray(array) for name, array in self._arrays.items()
                if name.startswith("negative_")}
