r"""Benchmarks: one JSON file per run under benchmarks/results/.

Model level (`--mode=model`): one transformer of a family at full size (or any variant) with
random weights, initialised on the device in the benchmark dtype, timed on one device:

    python launch/bench.py --mode=model --family=qwenimage --variant=qwen-image --batch=4 \
        --height=512 --width=512 --text_len=128 --what=forward,lora_fwd_bwd --lora_rank=64 --peer
    python launch/bench.py --mode=model --family=wan --variant=t2v-14b --batch=1 \
        --height=480 --width=832 --frames=33 --what=forward --remat_policy=full

For each of `--what` (forward; lora_fwd_bwd: forward and backward w.r.t. LoRA adapters over
the frozen base; full_fwd_bwd: w.r.t. every weight) it records the compile time, every timed
repeat after `--warmup` untimed calls (each synchronised with `block_until_ready`), the median,
the exact FLOPs (`digen_jax.flops`), the achieved FLOP rate and the MFU against both the
datasheet bf16 dense peak of the card and a bf16 matmul peak measured in the same run. The
traced matmul count (`flops.jaxpr_matmul_flops`, which includes remat recomputation but not
fused attention kernels) is recorded beside it. `--peer` first runs the diffusers PyTorch module
of the same family and config on the same card (eager, SDPA with flash/fused kernels, the same
LoRA targets) in a subprocess, so each framework has the card to itself, and records its times
and the ratio peer / JAX per measurement (> 1: JAX is faster). `--profile` records one more
call of each measurement with the JAX profiler and adds its device time per kernel and per
kernel class (matmul, attention, copy, fusion) to the JSON.

Every JSON also records the XLA flags in effect (the launchers add the GPU defaults of
`digen_jax/xla_flags.py`), the share of device memory JAX may take (`mem_fraction`, from
XLA_PYTHON_CLIENT_MEM_FRACTION; `--mode=model` sets it to 0.95 unless it is set: JAX's default
0.75 of an 80 GB card is too little for the largest documented measurement, LoRA fwd+bwd of
Qwen-Image-20B with unrolled blocks, which needs about 72 GB) and `source_sha256`, a digest of
the code that ran.

A measurement that fails (out of memory, an unsupported kernel) is recorded with its error and
the run goes on; the exit status is 1 if any failed. Modes are entries of `MODES`.
"""
from __future__ import annotations

import datetime
import functools
import hashlib
import importlib.metadata
import json
import math
import os
import platform
import re
import statistics
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any, Callable

from absl import flags
from ml_collections import config_flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from configs.sections import ATTENTION_MLP_TARGETS
from digen_jax import cli  # noqa: E402  (imports neither jax nor torch)
# jax, torch and digen_jax are imported inside the functions that use them: `--help` stays fast,
# and nothing initialises a GPU backend before the PyTorch peer has run and exited.

WHATS = ("forward", "lora_fwd_bwd", "full_fwd_bwd")
# Text-encoder sequence lengths of the pipelines (MODELS.md section 7; Qwen-Image's is the
# prompt length, assumed 128).
DEFAULT_TEXT_LEN = {"flux": 512, "qwenimage": 128, "wan": 512, "hunyuan_video": 256}
# Datasheet dense bf16 tensor-core peaks (FLOP/s, no sparsity), matched in order against the
# lower-cased device kind.
DATASHEET_BF16_PEAK = (
    ("h100 pcie", 756e12),
    ("h100", 989.4e12),
    ("h200", 989.4e12),
    ("h800", 989.4e12),
    ("a100", 312e12),
    ("l40s", 362e12),
)

# The device-memory share of `--mode=model` (XLA_PYTHON_CLIENT_MEM_FRACTION) unless the user set one.
MODEL_MEM_FRACTION = "0.95"

_MODE = flags.DEFINE_enum(
    "mode", "model", ["model", "system"],
    "What to benchmark: 'model' (one transformer on one device) or 'system' (RL iterations of --config in "
    "every schedule mode of --modes on all devices).",
)
_FAMILY = flags.DEFINE_enum("family", "flux", ["flux", "qwenimage", "wan", "hunyuan_video"], "Model family.")
_VARIANT = flags.DEFINE_string(
    "variant", None, "Variant of the family's VARIANTS table: flux dev|schnell|tiny, qwenimage qwen-image|tiny, "
    "wan t2v-14b|tiny, hunyuan_video t2v|tiny. Default: the full-size model."
)
_BATCH = flags.DEFINE_integer("batch", 1, "Batch size of one forward (CFG doubles it in sampling; not applied here).")
_HEIGHT = flags.DEFINE_integer("height", 512, "Image/video height in pixels (multiple of 16).")
_WIDTH = flags.DEFINE_integer("width", 512, "Image/video width in pixels (multiple of 16).")
_FRAMES = flags.DEFINE_integer("frames", 1, "Video frames (4k + 1) for wan/hunyuan_video; 1 for images.")
_TEXT_LEN = flags.DEFINE_integer("text_len", None, f"Text tokens fed to the model. Default per family: {DEFAULT_TEXT_LEN}.")
_WHAT = flags.DEFINE_list("what", ["forward", "lora_fwd_bwd"], f"Comma-separated measurements, of {WHATS}.")
_LORA_RANK = flags.DEFINE_integer("lora_rank", 64, "LoRA rank for lora_fwd_bwd.")
_LORA_ALPHA = flags.DEFINE_float("lora_alpha", 0.0, "LoRA alpha (scale alpha / rank); 0: 2 x rank.")
_LORA_TARGETS = flags.DEFINE_multi_string(
    "lora_target", None, "LoRA target regex, repeatable (searched in params paths). Default: attention and MLP "
    "of every block (rl.ATTENTION_MLP_TARGETS)."
)
_LORA_MODE = flags.DEFINE_enum("lora_mode", "factored", ["factored", "merged"], "How LoRA is applied in lora_fwd_bwd.")
_REMAT = flags.DEFINE_string("remat_policy", "none", "Per-block remat policy: a key of models.layers.REMAT_POLICIES.")
_NUM_LAYERS = flags.DEFINE_integer(
    "num_layers", 0, "Model mode: > 0 keeps that many (double-stream) blocks of the variant, for short probes.")
_SCAN_LAYERS = flags.DEFINE_bool(
    "scan_layers", True, "Run the blocks as one scan (stacked weights); false unrolls them (no per-layer weight copies).")
_ATTENTION = flags.DEFINE_enum(
    "attention_impl", "auto", ["auto", "cudnn", "xla"], "Attention kernel (auto: cuDNN on GPU in bf16)."
)
_DTYPE = flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float16", "float32"], "Weights and compute dtype.")
_REPEATS = flags.DEFINE_integer("repeats", 10, "Timed calls per measurement (the median is reported).")
_WARMUP = flags.DEFINE_integer("warmup", 2, "Untimed calls before timing (after compilation).")
_MATMUL_SIZE = flags.DEFINE_integer("matmul_size", 8192, "Side of the square bf16 matmuls that measure the peak; 0 skips.")
_MATMUL_CHAIN = flags.DEFINE_integer("matmul_chain", 16, "Matmuls per timed call of the peak measurement.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the random weights and inputs.")
_OUT = flags.DEFINE_string(
    "out", None,
    "Output JSON path. Default: benchmarks/results/model_<family>_<variant>_b<batch>_<h>x<w>[x<frames>]_<utc time>.json.",
)
_PROFILE = flags.DEFINE_bool(
    "profile", False,
    "Model mode: record one more call of each measurement with the JAX profiler (a Perfetto trace in "
    "<out without .json>_profile/) and put its device time per kernel and per kernel class into the JSON.",
)
_PEER = flags.DEFINE_bool("peer", False, "Also time the diffusers PyTorch module (bf16, eager, SDPA) on the same card.")
_CONFIG = config_flags.DEFINE_config_file(
    "config", "configs/tiny.py", "System mode: the training config (ml_collections; override keys as --config.a.b=v)."
)
_MODES = flags.DEFINE_list(
    "modes", ["colocated", "disagg_sync", "gap", "gap+tsp", "gap+tsp+tag", "gap+tsp+tag+tcss"],
    "System mode: the runtime.mode values to measure, one after another on the same devices.",
)
_ITERATIONS = flags.DEFINE_integer("iterations", 2, "System mode: timed iterations per schedule mode.")
_ANCHORS = flags.DEFINE_list(
    "onpolicy_anchors", [],
    "System mode: run every mode once per value of rl.onpolicy_anchor listed here ('trainer', 'rollout'), "
    "from the same weights; empty: the config's value only.")
_WARMUP_ITERATIONS = flags.DEFINE_integer(
    "warmup_iterations", 1,
    "System mode: untimed iterations first (compilation, first measured costs); modes with elastic splits "
    "add one, planned from those costs, so that the timed iterations start as a long run's do.",
)
_WORKDIR = flags.DEFINE_string("workdir", "/tmp/digen_bench", "System mode: where traces (trace_<mode>.json) go.")
_PEER_WORKER = flags.DEFINE_string("peer_worker", None, "Internal: run only the PyTorch peer and write its JSON here.")
# The flags the peer process needs to build the same model and inputs.
_FORWARDED = (_FAMILY, _VARIANT, _BATCH, _HEIGHT, _WIDTH, _FRAMES, _TEXT_LEN, _WHAT, _LORA_RANK, _LORA_ALPHA,
              _LORA_TARGETS, _REMAT, _NUM_LAYERS, _SCAN_LAYERS, _ATTENTION, _DTYPE, _REPEATS, _WARMUP, _SEED)


# ============================================================================ shared
def datasheet_peak(device_kind: str) -> float | None:
    """The datasheet dense bf16 peak (FLOP/s) of a device kind; None when unknown."""
    kind = device_kind.lower()
    return next((peak for name, peak in DATASHEET_BF16_PEAK if name in kind), None)


def time_calls(call: Callable[[], Any], sync: Callable[[Any], Any], repeats: int, warmup: int) -> list[float]:
    """Seconds of `repeats` synchronised calls after `warmup` untimed ones."""
    for _ in range(warmup):
        sync(call())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        sync(call())
        times.append(time.perf_counter() - start)
    return times


def _summary(times: list[float], flop: int | None, peaks: dict[str, float | None]) -> dict[str, Any]:
    median = statistics.median(times)
    out = {"times_s": times, "median_s": median, "min_s": min(times)}
    if flop is not None:
        rate = flop / median
        out["flops_per_s"] = rate
        for name, peak in peaks.items():
            out[f"mfu_{name}"] = rate / peak if peak else None
    return out


def _versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": platform.python_version()}
    for pkg in ("jax", "jaxlib", "flax", "torch", "diffusers", "peft", "numpy"):
        try:
            out[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            out[pkg] = None
    return out


def _git_commit() -> dict[str, Any]:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        status = subprocess.run(["git", "status", "--porcelain"], cwd=root, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return {"commit": None, "dirty": None}
    if commit.returncode:
        return {"commit": None, "dirty": None}
    return {"commit": commit.stdout.strip(), "dirty": bool(status.stdout.strip())}


def source_digest(root: str | None = None) -> str:
    """SHA-256 over the code (path and bytes of every .py under digen_jax/, launch/, configs/).

    It names the code that ran where git cannot: a copy of the tree with stale or no git
    metadata (a device machine's). `git ls-files` + this function on a checkout tell which
    commit it was.
    """
    root = root or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    digest = hashlib.sha256()
    for top in ("digen_jax", "launch", "configs"):
        for folder, dirs, files in sorted(os.walk(os.path.join(root, top))):
            dirs.sort()
            for name in sorted(f for f in files if f.endswith(".py")):
                path = os.path.join(folder, name)
                digest.update(os.path.relpath(path, root).encode() + b"\0")
                with open(path, "rb") as f:
                    digest.update(f.read() + b"\0")
    return digest.hexdigest()


def _lora_targets(family: str) -> list[str]:
    return list(_LORA_TARGETS.value or ATTENTION_MLP_TARGETS[family])


def _lora_scale() -> float:
    return (_LORA_ALPHA.value or 2.0 * _LORA_RANK.value) / _LORA_RANK.value


def _model_setup() -> dict[str, Any]:
    """Family, config and shapes from the flags, validated before any device work."""
    import dataclasses

    from digen_jax import flops
    from digen_jax.models import FAMILIES

    family = _FAMILY.value
    fam = FAMILIES[family]
    variant = _VARIANT.value or next(iter(fam.variants))
    if variant not in fam.variants:
        raise ValueError(f"--variant={variant!r} is not a {family} variant; choose from {sorted(fam.variants)}")
    unknown = sorted(set(_WHAT.value) - set(WHATS))
    if unknown or not _WHAT.value:
        raise ValueError(f"--what must list some of {WHATS}, got {_WHAT.value}")
    if _BATCH.value < 1 or _REPEATS.value < 1 or _WARMUP.value < 0 or _LORA_RANK.value < 1:
        raise ValueError("--batch, --repeats and --lora_rank must be >= 1 and --warmup >= 0")
    cfg = dataclasses.replace(
        fam.variants[variant], dtype=_DTYPE.value, param_dtype=_DTYPE.value,
        attention_impl=_ATTENTION.value, remat_policy=_REMAT.value, scan_layers=_SCAN_LAYERS.value,
    )
    if _NUM_LAYERS.value > 0:
        cfg = dataclasses.replace(cfg, num_layers=_NUM_LAYERS.value)
    text_len = _TEXT_LEN.value or DEFAULT_TEXT_LEN[family]
    shape = dict(height=_HEIGHT.value, width=_WIDTH.value, frames=_FRAMES.value)
    grid = flops.latent_grid(family, cfg, **shape)
    terms = flops.model_terms(family, cfg, batch=_BATCH.value, text_len=text_len, **shape)
    targets = _lora_targets(family)
    counts = {
        "forward": terms.forward(),
        "lora_fwd_bwd": terms.lora_fwd_bwd(_LORA_RANK.value, targets),
        "full_fwd_bwd": terms.full_fwd_bwd(),
    }
    return dict(family=family, fam=fam, variant=variant, cfg=cfg, text_len=text_len, shape=shape, grid=grid,
                terms=terms, flops=counts, targets=targets)


# ============================================================================ JAX model mode
def measure_matmul_peak(size: int, chain: int, repeats: int) -> dict[str, Any]:
    """Best FLOP rate of `chain` chained (size x size) bf16 matmuls in one jitted call."""
    import jax
    import jax.numpy as jnp

    @jax.jit
    def make(key):
        kx, kw = jax.random.split(key)
        x = jax.random.normal(kx, (size, size), jnp.bfloat16)
        # Scaled so that the chain neither overflows nor underflows.
        return x, (jax.random.normal(kw, (size, size), jnp.float32) / math.sqrt(size)).astype(jnp.bfloat16)

    @jax.jit
    def run(x, w):
        return jax.lax.fori_loop(0, chain, lambda _, y: jnp.dot(y, w), x)

    x, w = make(jax.random.key(0))
    times = time_calls(lambda: run(x, w), jax.block_until_ready, repeats, warmup=2)
    flop = 2 * chain * size**3
    return {"size": size, "chain": chain, "times_s": times, "flops_per_s": flop / min(times)}


def compiled_memory(compiled) -> dict[str, int] | None:
    """Device bytes XLA planned for a compiled program (arguments, outputs, temporaries); None
    where the backend does not say."""
    stats = compiled.memory_analysis()
    if stats is None:
        return None
    return {name: int(getattr(stats, f"{name}_size_in_bytes")) for name in ("argument", "output", "alias", "temp")}


def _jax_inputs(setup: dict[str, Any], key):
    """Random latents, conditioning and sigmas of the benchmark shape (on the device)."""
    import jax
    import jax.numpy as jnp

    from digen_jax.rl.rollout import Conditioning

    family, cfg, batch, text_len = setup["family"], setup["cfg"], _BATCH.value, setup["text_len"]
    frames, rows, cols = setup["grid"]
    k_lat, k_txt, k_pool, k_sigma = jax.random.split(key, 4)
    if family in ("flux", "qwenimage"):
        latent_shape = (batch, rows * cols, cfg.in_channels)
        text_dim = cfg.joint_attention_dim
    else:
        pt = cfg.patch_size[0] if family == "wan" else cfg.patch_size_t
        latent_shape = (batch, cfg.in_channels, frames * pt, 2 * rows, 2 * cols)
        text_dim = cfg.text_dim if family == "wan" else cfg.text_embed_dim
    pooled = None
    if family in ("flux", "hunyuan_video"):
        pooled = jax.random.normal(k_pool, (batch, cfg.pooled_projection_dim), jnp.float32)
    # HunyuanVideo requires its text mask; Qwen-Image's pipeline passes none when all are valid.
    mask = jnp.ones((batch, text_len), jnp.int32) if family == "hunyuan_video" else None
    cond = Conditioning(jax.random.normal(k_txt, (batch, text_len, text_dim), jnp.float32), pooled, mask)
    latents = jax.random.normal(k_lat, latent_shape, jnp.float32)
    sigma = jax.random.uniform(k_sigma, (batch,), jnp.float32, 0.05, 0.95)
    return latents, cond, sigma


def run_model_jax(setup: dict[str, Any], peaks: dict[str, float | None]) -> dict[str, Any]:
    """Time every `--what` of the JAX model; a failing one is recorded with its error."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    from digen_jax import flops
    from digen_jax.models import layers
    from digen_jax.rl import lora
    from digen_jax.rl.rollout import make_denoiser

    family, fam, cfg = setup["family"], setup["fam"], setup["cfg"]
    module = fam.module_cls(cfg)
    grid = setup["grid"][1:] if family in ("flux", "qwenimage") else None
    denoise = make_denoiser(fam, module, guidance=3.5, image_grid=grid)
    example = fam.example_inputs(cfg)

    stored = fam.stored_config(cfg)

    @jax.jit
    def init(key):
        # Initialised stacked (one compiled block however deep), then split into per-block
        # arrays if the run unrolls them.
        dummy = {k: jnp.zeros(v.shape, v.dtype) if isinstance(v, jax.ShapeDtypeStruct) else v for k, v in example.items()}
        return nn.unbox(fam.module_cls(stored).init(key, **dummy))["params"]

    key_params, key_lora, key_inputs = jax.random.split(jax.random.key(_SEED.value), 3)
    start = time.perf_counter()
    params = jax.block_until_ready(fam.to_layout(init(key_params), cfg, consume=True))
    out: dict[str, Any] = {"init_s": time.perf_counter() - start,
                           "param_count": sum(int(p.size) for p in jax.tree.leaves(params))}
    print(f"random weights: {out['param_count']:,} parameters in {out['init_s']:.1f} s", flush=True)
    latents, cond, sigma = _jax_inputs(setup, key_inputs)

    def mean_square(velocity):
        return jnp.mean(jnp.square(velocity.astype(jnp.float32)))

    def lora_grad(adapters, base, x, c, s):
        def loss(a):
            return mean_square(denoise(lora.LoraWeights(base, a, _lora_scale(), _LORA_MODE.value), x, c, s))

        return jax.grad(loss)(adapters)

    def full_grad(p, x, c, s):
        return jax.grad(lambda q: mean_square(denoise(q, x, c, s)))(p)

    # what -> (function, its arguments)
    fns: dict[str, tuple[Callable, tuple]] = {
        "forward": (denoise, (params, latents, cond, sigma)),
        "full_fwd_bwd": (full_grad, (params, latents, cond, sigma)),
    }
    if "lora_fwd_bwd" in _WHAT.value:
        # Drawn in the stored (stacked) layout like the weights, then split: drawn per block, one
        # RNG program per unrolled adapter took GPU XLA 48 s to compile at 12 Qwen-Image blocks.
        stacked_params = nn.unbox(fam.abstract_params(stored))
        draw = functools.partial(lora.init_lora, rank=_LORA_RANK.value, target_patterns=setup["targets"])

        @jax.jit
        def make_adapters(key):
            k_a, k_b = jax.random.split(key)
            adapters = draw(stacked_params, key=k_a)
            # Random B (init gives zeros): no timing on zeros.
            leaves, tree = jax.tree.flatten(adapters)
            keys = jax.random.split(k_b, len(leaves))
            return jax.tree.unflatten(tree, [0.01 * jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)])

        like = jax.eval_shape(lambda p: draw(p, key=key_lora), params)
        adapters = jax.block_until_ready(
            layers.relayout_blocks(make_adapters(key_lora), like, unstack=layers.unstack_consuming)
        )
        out["lora_param_count"] = lora.lora_param_count(adapters)
        fns["lora_fwd_bwd"] = (lora_grad, (adapters, params, latents, cond, sigma))

    results = {}
    for what in _WHAT.value:
        fn, args = fns[what]
        entry: dict[str, Any] = {"flops": setup["flops"][what].total, "flops_breakdown": setup["flops"][what].as_dict()}
        try:
            entry["traced_matmul_flops"] = flops.jaxpr_matmul_flops(fn, *args)
        except ValueError as e:  # a program the jaxpr count cannot walk; the timing still runs
            entry["traced_matmul_flops"] = None
            entry["traced_matmul_flops_error"] = str(e)
        try:
            start = time.perf_counter()
            compiled = jax.jit(fn).lower(*args).compile()
            entry["compile_s"] = time.perf_counter() - start
            entry["memory_bytes"] = compiled_memory(compiled)
            entry.update(_summary(
                time_calls(lambda: compiled(*args), jax.block_until_ready, _REPEATS.value, _WARMUP.value),
                entry["flops"], peaks,
            ))
            if _PROFILE.value:
                log_dir = os.path.join(_profile_root(), what)
                with jax.profiler.trace(log_dir, create_perfetto_trace=True):
                    jax.block_until_ready(compiled(*args))
                entry["profile"] = device_time_by_kernel(log_dir)
        except Exception as e:  # noqa: BLE001 - recorded, and the run goes on
            entry["error"] = f"{type(e).__name__}: {e}"[:4000]
            traceback.print_exc()
        results[what] = entry
        print(_row(what, entry), flush=True)
    out["results"] = results
    return out


def _profile_root() -> str:
    out = _OUT.value or os.path.join("benchmarks", "results", "profile")
    return os.path.splitext(out)[0] + "_profile"


# Kernel classes by name, first match wins: GEMMs (cuBLAS/cuBLASLt/CUTLASS), fused attention
# (cuDNN/flash), collectives, copies; the rest are XLA's generated fusions.
KERNEL_CLASSES = (
    ("attention", re.compile(r"cudnn|flash|fmha|sdpa", re.I)),
    ("matmul", re.compile(r"gemm|cutlass|xmma|nvjet|cublas|wgmma", re.I)),
    ("collective", re.compile(r"nccl|all_reduce|all_gather|reduce_scatter", re.I)),
    ("copy", re.compile(r"memcpy|memset|copy", re.I)),
)


def kernel_class(name: str) -> str:
    return next((cls for cls, pattern in KERNEL_CLASSES if pattern.search(name)), "fusion/other")


def device_time_by_kernel(log_dir: str, top: int = 40) -> dict[str, Any]:
    """Device time of the Perfetto trace under `log_dir`: per kernel class and the `top` kernels.

    Device events are those of processes named like a device ('/device:GPU:0'), except the
    XLA summary lines (modules and ops), which would count every kernel twice.
    """
    import glob
    import gzip

    paths = sorted(glob.glob(os.path.join(log_dir, "**", "perfetto_trace.json.gz"), recursive=True))
    if not paths:
        return {"error": f"no perfetto_trace.json.gz under {log_dir}"}
    with gzip.open(paths[-1], "rt") as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    names = {(e.get("pid"), e.get("tid")): e.get("args", {}).get("name", "")
             for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"}
    processes = {e.get("pid"): e.get("args", {}).get("name", "") for e in events
                 if e.get("ph") == "M" and e.get("name") == "process_name"}
    devices = {pid for pid, name in processes.items() if "/device:" in name}
    per_kernel: dict[str, list[float]] = {}
    for e in events:
        if e.get("ph") != "X" or e.get("pid") not in devices:
            continue
        if re.search(r"XLA (Modules|Ops|TraceMe)|Steps", names.get((e.get("pid"), e.get("tid")), "")):
            continue
        stat = per_kernel.setdefault(e.get("name", "?"), [0.0, 0])
        stat[0] += float(e.get("dur", 0.0)) / 1e3
        stat[1] += 1
    total = sum(ms for ms, _ in per_kernel.values())
    classes: dict[str, float] = {}
    for name, (ms, _) in per_kernel.items():
        classes[kernel_class(name)] = classes.get(kernel_class(name), 0.0) + ms
    kernels = sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[:top]
    return {
        "trace": paths[-1],
        "processes": sorted(processes.values()),
        "device_ms": total,
        "class_ms": dict(sorted(classes.items(), key=lambda kv: -kv[1])),
        "kernels": [{"name": n[:200], "ms": ms, "calls": calls, "class": kernel_class(n)} for n, (ms, calls) in kernels],
    }


def _row(what: str, entry: dict[str, Any]) -> str:
    if "error" in entry:
        return f"{what:14s} ERROR {entry['error'][:200]}"
    mfu = " ".join(f"{k}={v:.1%}" for k, v in entry.items() if k.startswith("mfu_") and v is not None)
    row = (f"{what:14s} median {entry['median_s'] * 1e3:9.2f} ms  {entry['flops'] / 1e12:9.2f} TFLOP  "
           f"{entry['flops_per_s'] / 1e12:7.1f} TFLOP/s  {mfu}")
    if "class_ms" in entry.get("profile", {}):
        row += "\n  device ms by class: " + ", ".join(f"{c} {ms:.1f}" for c, ms in entry["profile"]["class_ms"].items())
    return row


def _run_record(mode: str, used: int) -> dict[str, Any]:
    """The fields every result JSON starts with: mode, time, command, commit, versions, devices."""
    import jax

    device = jax.devices()[0]
    return {
        "mode": mode,
        "created_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "argv": sys.argv,
        "git": _git_commit(),
        "source_sha256": source_digest(),
        "versions": _versions(),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "mem_fraction": os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION"),
        "device": {"kind": device.device_kind, "platform": device.platform, "count": jax.device_count(),
                   "used": used, "all_kinds": sorted({d.device_kind for d in jax.devices()})},
    }


def run_model() -> dict[str, Any]:
    """`--mode=model`: the PyTorch peer (subprocess, first) then the JAX measurements."""
    setup = _model_setup()
    peer = _run_peer_subprocess() if _PEER.value else None

    import jax

    device = jax.devices()[0]
    peaks = {"datasheet": datasheet_peak(device.device_kind)}
    if _MATMUL_SIZE.value:
        matmul = measure_matmul_peak(_MATMUL_SIZE.value, _MATMUL_CHAIN.value, max(_REPEATS.value, 3))
        peaks["measured_peak"] = matmul["flops_per_s"]
    else:
        matmul = None
        peaks["measured_peak"] = None
    jax_out = run_model_jax(setup, peaks)
    result = {
        **_run_record("model", used=1),
        "config": _config_record(setup),
        "peaks": {"datasheet_bf16_flops_per_s": peaks["datasheet"], "measured_matmul": matmul},
        **jax_out,
        "peer": peer,
    }
    if peer is not None:
        result["peer_ratio"] = {
            what: peer["results"][what]["median_s"] / entry["median_s"]
            for what, entry in jax_out["results"].items()
            if "median_s" in entry and "median_s" in peer.get("results", {}).get(what, {})
        }
    return result


def _config_record(setup: dict[str, Any]) -> dict[str, Any]:
    import dataclasses

    frames, rows, cols = setup["grid"]
    return {
        "family": setup["family"],
        "variant": setup["variant"],
        "model": dataclasses.asdict(setup["cfg"]),
        "batch": _BATCH.value,
        **setup["shape"],
        "text_len": setup["text_len"],
        "image_tokens": frames * rows * cols,
        "what": list(_WHAT.value),
        "lora": {"rank": _LORA_RANK.value, "scale": _lora_scale(), "targets": setup["targets"], "mode": _LORA_MODE.value},
        "repeats": _REPEATS.value,
        "warmup": _WARMUP.value,
        "seed": _SEED.value,
    }


# ============================================================================ PyTorch peer
def _run_peer_subprocess() -> dict[str, Any]:
    """Run this script as the PyTorch peer in a fresh process (JAX never touches the card there)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "peer.json")
        argv = [line for holder in _FORWARDED for line in flags.FLAGS[holder.name].serialize().splitlines() if line]
        env = dict(os.environ, JAX_PLATFORMS="cpu")
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), *argv, f"--peer_worker={path}"],
                              env=env, capture_output=True, text=True)
        if not os.path.exists(path):
            return {"error": f"peer exited with {proc.returncode}: {proc.stderr[-4000:]}"}
        with open(path) as f:
            peer = json.load(f)
        if proc.returncode:
            peer["error"] = f"peer exited with {proc.returncode} after {sorted(peer['results'])}: {proc.stderr[-4000:]}"
        return peer


def _torch_lora_names(setup: dict[str, Any]) -> tuple[re.Pattern, int]:
    """The diffusers Linear modules the JAX LoRA targets adapt, found through the weight-conversion
    rules, as one pattern over module names; and how many modules it must match."""
    keys = [
        re.escape(rule.key.removesuffix(".weight")).replace(re.escape("{i}"), r"\d+")
        for rule in setup["fam"].weight_rules(setup["cfg"])
        if rule.path[-1] == "kernel" and any(re.search(p, "/".join(rule.path)) for p in setup["targets"])
    ]
    expected = sum(m.layers for m in setup["terms"].adapted(setup["targets"]))
    return re.compile("|".join(f"(?:{k})" for k in keys)), expected


def _torch_inputs(setup: dict[str, Any], device, dtype) -> dict[str, Any]:
    import torch

    family, cfg, batch, text_len = setup["family"], setup["cfg"], _BATCH.value, setup["text_len"]
    frames, rows, cols = setup["grid"]
    g = torch.Generator(device="cpu").manual_seed(_SEED.value)
    rand = lambda *shape: torch.randn(*shape, generator=g).to(device, dtype)  # noqa: E731
    if family in ("flux", "qwenimage"):
        text_dim = cfg.joint_attention_dim
        hidden = rand(batch, rows * cols, cfg.in_channels)
    else:
        pt = cfg.patch_size[0] if family == "wan" else cfg.patch_size_t
        text_dim = cfg.text_dim if family == "wan" else cfg.text_embed_dim
        hidden = rand(batch, cfg.in_channels, frames * pt, 2 * rows, 2 * cols)
    text = rand(batch, text_len, text_dim)
    sigma = torch.rand(batch, generator=g).to(device, dtype) * 0.9 + 0.05
    if family == "flux":
        ids = torch.stack(torch.meshgrid(torch.arange(1), torch.arange(rows), torch.arange(cols), indexing="ij"), -1)
        return dict(hidden_states=hidden, encoder_hidden_states=text,
                    pooled_projections=rand(batch, cfg.pooled_projection_dim), timestep=sigma,
                    img_ids=ids.reshape(-1, 3).to(device, dtype),
                    txt_ids=torch.zeros(text_len, 3, device=device, dtype=dtype),
                    guidance=torch.full((batch,), 3.5, device=device, dtype=dtype) if cfg.guidance_embeds else None)
    if family == "qwenimage":
        return dict(hidden_states=hidden, encoder_hidden_states=text, encoder_hidden_states_mask=None, timestep=sigma,
                    img_shapes=[[(1, rows, cols)]] * batch)
    if family == "wan":
        return dict(hidden_states=hidden, timestep=sigma * 1000, encoder_hidden_states=text)
    return dict(hidden_states=hidden, timestep=sigma * 1000, encoder_hidden_states=text,
                encoder_attention_mask=torch.ones(batch, text_len, device=device, dtype=torch.int64),
                pooled_projections=rand(batch, cfg.pooled_projection_dim),
                guidance=torch.full((batch,), 3500.0, device=device, dtype=dtype) if cfg.guidance_embeds else None)


def _add_torch_lora(model, pattern: re.Pattern, rank: int, scale: float, expected: int) -> str:
    """Freeze `model` and adapt the Linear layers named by `pattern`: peft when installed, else
    a wrapper computing base(x) + scale * B(A(x)). Returns which was used."""
    import torch

    model.requires_grad_(False)
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and pattern.fullmatch(n)]
    if len(names) != expected:
        raise ValueError(f"the LoRA targets match {len(names)} diffusers Linear layers, the JAX model adapts {expected}")
    try:
        import peft
    except ImportError:
        peft = None
    if peft is not None:
        config = peft.LoraConfig(r=rank, lora_alpha=scale * rank, target_modules=names, lora_dropout=0.0)
        peft.inject_adapter_in_model(config, model)
        return "peft"

    class LoraLinear(torch.nn.Module):
        def __init__(self, base):
            super().__init__()
            self.base = base
            self.down = torch.nn.Linear(base.in_features, rank, bias=False, device=base.weight.device, dtype=base.weight.dtype)
            self.up = torch.nn.Linear(rank, base.out_features, bias=False, device=base.weight.device, dtype=base.weight.dtype)
            torch.nn.init.normal_(self.up.weight, std=0.01)  # non-zero: no timing on zeros

        def forward(self, x):
            return self.base(x) + scale * self.up(self.down(x))

    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, LoraLinear(getattr(parent, child)))
    return "manual"


def run_peer(path: str) -> None:
    """`--peer_worker`: time the diffusers module of the same family, config and shape; write JSON."""
    import contextlib

    import diffusers
    import torch

    from digen_jax.models.conversion import POLICY_FIELDS

    setup = _model_setup()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, _DTYPE.value)
    cls = getattr(diffusers, setup["fam"].diffusers_class)
    config = {k: list(v) if isinstance(v, tuple) else v
              for k, v in vars(setup["cfg"]).items() if k not in POLICY_FIELDS}

    def build():
        torch.manual_seed(_SEED.value)
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)  # random init straight in the benchmark dtype, on the card
        try:
            with device:
                return cls.from_config(config).eval()
        finally:
            torch.set_default_dtype(previous)

    if device.type == "cuda":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        # Flash first, memory-efficient as fallback. Not cuDNN: its backward faulted (illegal
        # memory access) on FLUX.1-dev at 512x512 (torch 2.11, H100).
        backends = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
        attention = lambda: sdpa_kernel(backends)  # noqa: E731
        sync = lambda _: torch.cuda.synchronize()  # noqa: E731
    else:
        attention = contextlib.nullcontext
        sync = lambda _: None  # noqa: E731
    inputs = _torch_inputs(setup, device, dtype)

    def loss(model):
        return model(**inputs, return_dict=False)[0].float().square().mean()

    def forward(model):
        with torch.no_grad():
            return model(**inputs, return_dict=False)[0]

    def fwd_bwd(model):
        model.zero_grad(set_to_none=True)
        loss(model).backward()

    out: dict[str, Any] = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                           "torch": torch.__version__, "diffusers": diffusers.__version__,
                           "attention": "sdpa (flash, efficient)" if device.type == "cuda" else "sdpa (default)",
                           "results": {}}
    for what in _WHAT.value:
        entry: dict[str, Any] = {}
        model = None
        try:
            model = build()
            if what == "lora_fwd_bwd":
                pattern, expected = _torch_lora_names(setup)
                entry["lora_impl"] = _add_torch_lora(model, pattern, _LORA_RANK.value, _lora_scale(), expected)
            elif what == "full_fwd_bwd":
                model.requires_grad_(True)
            call = forward if what == "forward" else fwd_bwd
            with attention():
                entry.update(_summary(time_calls(lambda: call(model), sync, _REPEATS.value, _WARMUP.value),
                                      setup["flops"][what].total, {}))
        except Exception as e:  # noqa: BLE001 - recorded, and the run goes on
            entry["error"] = f"{type(e).__name__}: {e}"[:4000]
            traceback.print_exc()
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
        out["results"][what] = entry
        with open(path, "w") as f:  # after each measurement: a fault that kills the process keeps the rest
            json.dump(out, f, indent=1)


# ============================================================================ main
def run_system() -> dict[str, Any]:
    """`--mode=system`: every schedule mode of `--modes` on the same devices, model and batch.

    The JSON (and the traces) are written after every mode, so a run cut short keeps what it measured.
    """
    import jax

    from digen_jax.app.benchmark import run_modes

    config = _CONFIG.value
    device = jax.devices()[0]
    matmul = measure_matmul_peak(_MATMUL_SIZE.value, _MATMUL_CHAIN.value, 3) if _MATMUL_SIZE.value else None
    peak = matmul["flops_per_s"] if matmul else datasheet_peak(device.device_kind)
    result = {
        **_run_record("system", used=jax.device_count()),
        "gpu": device.device_kind,
        "config": json.loads(config.to_json_best_effort()),
        "peaks": {"datasheet_bf16_flops_per_s": datasheet_peak(device.device_kind), "measured_matmul": matmul,
                  "mfu_against": "measured_matmul" if matmul else "datasheet"},
    }
    path = _OUT.value or default_out(result)

    def write(figures: dict[str, Any]) -> None:
        result.update(figures)
        _write_result(result, path)
        print(f"wrote {path} ({len(figures['modes'])} of {len(_MODES.value) * max(1, len(_ANCHORS.value))} runs)", flush=True)

    run_modes(
        config, _MODES.value, _WORKDIR.value, warmups=_WARMUP_ITERATIONS.value, iterations=_ITERATIONS.value,
        peak_flops=peak, log=lambda m: print(m, flush=True), on_mode=write, onpolicy_anchors=_ANCHORS.value,
    )
    return result


def _write_result(result: dict[str, Any], path: str) -> None:
    """Write `result` as JSON to `path`; a system run's traces go next to it (they explain the bubbles)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    if result["mode"] == "system":
        traces = os.path.splitext(path)[0] + "_traces"
        os.makedirs(traces, exist_ok=True)
        for record in result.get("modes", {}).values():
            shutil.copy(os.path.join(_WORKDIR.value, record["trace"]), traces)


MODES: dict[str, Callable[[], dict[str, Any]]] = {"model": run_model, "system": run_system}


def default_out(result: dict[str, Any]) -> str:
    stamp = result["created_utc"].replace(":", "").replace("-", "").split("+")[0]
    root = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "results")
    if result["mode"] == "system":
        model = result["config"]["model"]
        name = f"system_{model['family']}_{model.get('variant', 'custom')}_{result['device']['count']}dev_{stamp}.json"
        return os.path.join(root, name)
    c = result["config"]
    frames = f"x{c['frames']}" if c["family"] in ("wan", "hunyuan_video") else ""
    stamp = result["created_utc"].replace(":", "").replace("-", "").split("+")[0]
    name = f"{result['mode']}_{c['family']}_{c['variant']}_b{c['batch']}_{c['height']}x{c['width']}{frames}_{stamp}.json"
    return os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "results", name)


def set_memory_fraction(environ=os.environ) -> str | None:
    """`--mode=model`: XLA_PYTHON_CLIENT_MEM_FRACTION as MODEL_MEM_FRACTION unless already set (JAX
    reads it when it first uses the GPU); returns the value in effect (None: JAX's default)."""
    if _MODE.value == "model":
        environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", MODEL_MEM_FRACTION)
    return environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION")


def run_from_flags() -> tuple[dict[str, Any], str]:
    """Run the mode the parsed flags ask for and write its JSON; returns (result, path)."""
    set_memory_fraction()  # before JAX first touches a device
    result = MODES[_MODE.value]()
    path = _OUT.value or default_out(result)
    _write_result(result, path)
    return result, path


def main(argv):
    del argv
    from digen_jax import xla_flags

    xla_flags.set_defaults()  # before the first device is touched
    if _PEER_WORKER.value:
        run_peer(_PEER_WORKER.value)
        return 0
    result, path = run_from_flags()
    print(f"wrote {path}")
    failed = [w for w, e in result.get("results", {}).items() if "error" in e]
    return 1 if failed else 0


if __name__ == "__main__":
    cli.run(main)
