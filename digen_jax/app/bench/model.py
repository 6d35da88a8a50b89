"""The model bench (`--mode=model`): one transformer of a family with random weights, initialised
on the device in the benchmark dtype and timed on one device, per measurement of `WHATS`.

With `seq_parallel` > 1 (video families) every measurement runs on that many devices, each
sample's tokens split over them as `runtime.seq_parallel` splits them (Ulysses attention); its
FLOPs, memory and MFU are then per device.

`forward_fp8` is the rollout role's FP8 forward (`model.rollout_precision='fp8'`, models/fp8.py):
the same weights with the blocks' kernels quantised to e4m3 (`rl.quantized_params`), the same inputs.
With `forward` in the same run the result's `fp8` entry gives its speed-up over the bf16 forward
and the relative error of its velocity against the bf16 one."""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import os
import re
import time
import traceback
from typing import Any, Callable

from digen_jax.app.bench import peaks as peaks_lib
from digen_jax.app.errors import ConfigError
from digen_jax.app.bench import profiler, provenance
from digen_jax.app.bench.timing import summary, time_calls
from digen_jax.models.specs import SPECS

WHATS = ("forward", "forward_fp8", "lora_fwd_bwd", "full_fwd_bwd")
# The measurements the PyTorch peer makes (it has no FP8 path).
PEER_WHATS = ("forward", "lora_fwd_bwd", "full_fwd_bwd")
# Text-encoder sequence lengths of the pipelines (docs/models.md section 7), from the family specs;
# Qwen-Image pads to the longest prompt, assumed 128 tokens.
DEFAULT_TEXT_LEN = {name: s.text_prefix + s.text_pipeline.default_len for name, s in SPECS.items()} | {"qwenimage": 128}


@dataclasses.dataclass(frozen=True)
class ModelBench:
    """What the model bench builds and times (the `launch/bench.py` flags of the same names)."""

    family: str
    variant: str | None  # None: the family's full-size model
    batch: int
    height: int
    width: int
    frames: int
    text_len: int | None  # None: DEFAULT_TEXT_LEN of the family
    what: tuple[str, ...]
    lora_rank: int
    lora_alpha: float  # 0: 2 x rank
    lora_targets: tuple[str, ...]
    lora_mode: str
    remat_policy: str
    num_layers: int  # > 0: keep that many blocks of the variant
    scan_layers: bool
    attention_impl: str
    dtype: str
    repeats: int
    warmup: int
    seed: int
    seq_parallel: int = 1  # devices each sample's tokens are split over (video families)

    @property
    def lora_scale(self) -> float:
        return (self.lora_alpha or 2.0 * self.lora_rank) / self.lora_rank


def setup(bench: ModelBench) -> dict[str, Any]:
    """Family, config, shapes and exact FLOPs of `bench`, validated before any device work; a
    `ConfigError` naming the flag for a bench that cannot run."""
    try:
        return _setup(bench)
    except ConfigError:
        raise
    except ValueError as e:  # the shapes' and the models' own checks (frames, pixels, heads)
        raise ConfigError(str(e)) from None


def _setup(bench: ModelBench) -> dict[str, Any]:
    from digen_jax import model_flops
    from digen_jax.models import FAMILIES

    family = bench.family
    fam = FAMILIES[family]
    variant = bench.variant or next(iter(fam.variants))
    if variant not in fam.variants:
        raise ConfigError(f"--variant={variant!r} is not a {family} variant; choose from {sorted(fam.variants)}")
    unknown = sorted(set(bench.what) - set(WHATS))
    if unknown or not bench.what:
        raise ConfigError(f"--what must list some of {WHATS}, got {list(bench.what)}")
    if bench.batch < 1 or bench.repeats < 1 or bench.warmup < 0 or bench.lora_rank < 1:
        raise ConfigError("--batch, --repeats and --lora_rank must be >= 1 and --warmup >= 0")
    cfg = dataclasses.replace(
        fam.variants[variant], dtype=bench.dtype, param_dtype=bench.dtype,
        attention_impl=bench.attention_impl, remat_policy=bench.remat_policy, scan_layers=bench.scan_layers,
    )
    if bench.num_layers > 0:
        cfg = dataclasses.replace(cfg, num_layers=bench.num_layers)
    text_len = bench.text_len or DEFAULT_TEXT_LEN[family]
    shape = dict(height=bench.height, width=bench.width, frames=bench.frames)
    grid = model_flops.latent_grid(family, cfg, **shape)
    if bench.seq_parallel != 1:
        import jax  # only here: the PyTorch peer's process (seq_parallel 1) never starts JAX

        from digen_jax.app.families import ZOO
        from digen_jax.models.attention import check_seq_parallel

        if not ZOO[family].video or bench.seq_parallel < 1:
            raise ConfigError(f"--seq_parallel={bench.seq_parallel}: sequence parallelism is built for the video "
                              "families (wan, hunyuan_video), with 1 or more devices")
        try:
            check_seq_parallel(cfg.num_attention_heads, grid[0] * grid[1] * grid[2], bench.seq_parallel)
        except ValueError as e:
            raise ConfigError(f"--seq_parallel={bench.seq_parallel}: {e}") from None
        if jax.device_count() < bench.seq_parallel:
            raise ConfigError(f"--seq_parallel={bench.seq_parallel} needs {bench.seq_parallel} devices; this host "
                              f"has {jax.device_count()}")
    terms = model_flops.model_terms(family, cfg, batch=bench.batch, text_len=text_len, **shape)
    targets = list(bench.lora_targets)
    counts = {
        "forward": terms.forward(),
        "forward_fp8": terms.forward(),
        "lora_fwd_bwd": terms.lora_fwd_bwd(bench.lora_rank, targets),
        "full_fwd_bwd": terms.full_fwd_bwd(),
    }
    return dict(family=family, fam=fam, variant=variant, cfg=cfg, text_len=text_len, shape=shape, grid=grid,
                terms=terms, flops=counts, targets=targets)


def measure(bench: ModelBench, *, matmul_size: int | None, matmul_chain: int, peer: Callable[[], dict[str, Any]] | None,
        profile_dir: str | None) -> dict[str, Any]:
    """The model bench's result: `peer` (the PyTorch peer's result, run first so that it has the card
    to itself; None: no peer), the bf16 matmul peak of `matmul_size` (0: skipped; None: the
    platform's default, `peaks.matmul_size_for`), then the JAX
    measurements, each profiled under `profile_dir/<what>` unless it is None."""
    prepared = setup(bench)
    peer_result = peer() if peer is not None else None

    import jax

    device = jax.devices()[0]
    peaks = {"datasheet": peaks_lib.datasheet_peak(device.device_kind)}
    matmul_size = peaks_lib.matmul_size_for(matmul_size, device.platform)
    if matmul_size:
        matmul = peaks_lib.measure_matmul_peak(matmul_size, matmul_chain, max(bench.repeats, 3))
        peaks["measured_peak"] = matmul["flops_per_s"]
    else:
        matmul = None
        peaks["measured_peak"] = None
    jax_out = measure_jax(bench, prepared, peaks, profile_dir)
    result = {
        **provenance.run_record("model", used=bench.seq_parallel),
        "config": config_record(bench, prepared),
        "peaks": {"datasheet_bf16_flops_per_s": peaks["datasheet"], "measured_matmul": matmul},
        **jax_out,
        "peer": peer_result,
    }
    if peer_result is not None:
        result["peer_ratio"] = {
            what: peer_result["results"][what]["median_s"] / entry["median_s"]
            for what, entry in jax_out["results"].items()
            if "median_s" in entry and "median_s" in peer_result.get("results", {}).get(what, {})
        }
    return result


def config_record(bench: ModelBench, prepared: dict[str, Any]) -> dict[str, Any]:
    """The result's `config`: the model, its shapes and the measurement settings."""
    frames, rows, cols = prepared["grid"]
    return {
        "family": prepared["family"],
        "variant": prepared["variant"],
        "model": dataclasses.asdict(prepared["cfg"]),
        "batch": bench.batch,
        "seq_parallel": bench.seq_parallel,
        **prepared["shape"],
        "text_len": prepared["text_len"],
        "image_tokens": frames * rows * cols,
        "what": list(bench.what),
        "lora": {"rank": bench.lora_rank, "scale": bench.lora_scale, "targets": prepared["targets"],
                 "mode": bench.lora_mode},
        "repeats": bench.repeats,
        "warmup": bench.warmup,
        "seed": bench.seed,
    }


def compiled_memory(compiled) -> dict[str, int] | None:
    """Device bytes XLA planned for a compiled program (arguments, outputs, temporaries); None
    where the backend does not say."""
    stats = compiled.memory_analysis()
    if stats is None:
        return None
    return {name: int(getattr(stats, f"{name}_size_in_bytes")) for name in ("argument", "output", "alias", "temp")}


def matmul_custom_calls(hlo_text: str) -> dict[str, int]:
    """Library GEMM calls of a compiled program by target (`__cublas$lt$matmul$f8` is cuBLASLt's FP8
    GEMM, which XLA's GEMM rewriter makes of an f8 dot on Hopper); empty where XLA emits its own
    dots (the CPU)."""
    targets = re.findall(r'custom_call_target="([^"]*(?:gemm|matmul)[^"]*)"', hlo_text)
    return dict(collections.Counter(targets))


def all_to_all_ops(hlo_text: str) -> int:
    """All-to-alls of a compiled program: the CPU's synchronous `all-to-all(` and the GPU's
    `all-to-all-start(` (each with its `-done`), not the ragged kind."""
    return len(re.findall(r"= [^=]*(?<![-\w])all-to-all(?:-start)?\(", hlo_text))


def _jax_inputs(bench: ModelBench, prepared: dict[str, Any], key):
    """Random latents, conditioning and sigmas of the benchmark shape (on the device)."""
    import jax
    import jax.numpy as jnp

    from digen_jax import model_flops
    from digen_jax.app.families import ZOO
    from digen_jax.rl.rollout import Conditioning

    family, cfg, batch, text_len = prepared["family"], prepared["cfg"], bench.batch, prepared["text_len"]
    zoo = ZOO[family]
    frames, rows, cols = prepared["grid"]
    k_lat, k_txt, k_pool, k_sigma = jax.random.split(key, 4)
    if zoo.video:
        pt = model_flops.FORMULAS[family].temporal_patch(cfg)
        latent_shape = (batch, cfg.in_channels, frames * pt, 2 * rows, 2 * cols)
    else:
        latent_shape = (batch, rows * cols, getattr(cfg, zoo.latent_dim))  # packed 2x2 tokens
    text_dim = getattr(cfg, zoo.text_dim)
    pooled = None
    if zoo.pooled_dim:
        pooled = jax.random.normal(k_pool, (batch, getattr(cfg, zoo.pooled_dim)), jnp.float32)
    # HunyuanVideo requires its text mask; Qwen-Image's pipeline passes none when all are valid.
    mask = jnp.ones((batch, text_len), jnp.int32) if family == "hunyuan_video" else None
    cond = Conditioning(jax.random.normal(k_txt, (batch, text_len, text_dim), jnp.float32), pooled, mask)
    latents = jax.random.normal(k_lat, latent_shape, jnp.float32)
    sigma = jax.random.uniform(k_sigma, (batch,), jnp.float32, 0.05, 0.95)
    return latents, cond, sigma


def measure_jax(bench: ModelBench, prepared: dict[str, Any], peaks: dict[str, float | None],
            profile_dir: str | None) -> dict[str, Any]:
    """Time every measurement of `bench.what` on the JAX model; a failing one is recorded with its error."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from digen_jax import model_flops
    from digen_jax.models import stacking
    from digen_jax.rl import lora, quantized_params
    from digen_jax.app.families import ZOO
    from digen_jax.rl.rollout import make_denoiser

    family, fam, cfg = prepared["family"], prepared["fam"], prepared["cfg"]
    module = fam.module_cls(cfg)
    grid = None if ZOO[family].video else prepared["grid"][1:]  # image families: the packed token grid
    denoise = make_denoiser(fam, module, guidance=3.5, image_grid=grid)
    example = fam.example_inputs(cfg)

    stored = fam.stored_config(cfg)

    @jax.jit
    def init(key):
        # Initialised stacked (one compiled block however deep), then split into per-block
        # arrays if the run unrolls them.
        dummy = {k: jnp.zeros(v.shape, v.dtype) if isinstance(v, jax.ShapeDtypeStruct) else v for k, v in example.items()}
        return nn.unbox(fam.module_cls(stored).init(key, **dummy))["params"]

    key_params, key_lora, key_inputs = jax.random.split(jax.random.key(bench.seed), 3)
    start = time.perf_counter()
    params = jax.block_until_ready(fam.to_layout(init(key_params), cfg, consume=True))
    out: dict[str, Any] = {"init_s": time.perf_counter() - start,
                           "param_count": sum(int(p.size) for p in jax.tree.leaves(params))}
    print(f"random weights: {out['param_count']:,} parameters in {out['init_s']:.1f} s", flush=True)
    latents, cond, sigma = _jax_inputs(bench, prepared, key_inputs)

    def mean_square(velocity):
        return jnp.mean(jnp.square(velocity.astype(jnp.float32)))

    def lora_grad(adapters, base, x, c, s):
        def loss(a):
            return mean_square(denoise(lora.LoraWeights(base, a, bench.lora_scale, bench.lora_mode), x, c, s))

        return jax.grad(loss)(adapters)

    def full_grad(p, x, c, s):
        return jax.grad(lambda q: mean_square(denoise(q, x, c, s)))(p)

    # what -> (function, its arguments)
    fns: dict[str, tuple[Callable, tuple]] = {
        "forward": (denoise, (params, latents, cond, sigma)),
        "full_fwd_bwd": (full_grad, (params, latents, cond, sigma)),
    }
    if "forward_fp8" in bench.what:
        paths = quantized_params.quantized_kernel_paths(fam.abstract_params(cfg))
        params_fp8 = jax.block_until_ready(jax.jit(lambda p: quantized_params.quantize_params(p, paths))(params))
        fns["forward_fp8"] = (denoise, (params_fp8, latents, cond, sigma))
    if "lora_fwd_bwd" in bench.what:
        # Drawn in the stored (stacked) layout like the weights, then split: drawn per block, one
        # RNG program per unrolled adapter took GPU XLA 48 s to compile at 12 Qwen-Image blocks.
        stacked_params = nn.unbox(fam.abstract_params(stored))
        draw = functools.partial(lora.init_lora, rank=bench.lora_rank, target_patterns=prepared["targets"])

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
            stacking.relayout_blocks(make_adapters(key_lora), like, unstack=stacking.unstack_consuming)
        )
        out["lora_param_count"] = lora.lora_param_count(adapters)
        fns["lora_fwd_bwd"] = (lora_grad, (adapters, params, latents, cond, sigma))

    devices = bench.seq_parallel
    context = contextlib.nullcontext  # a fresh context per use: `jax.set_mesh` sets the mesh once
    if devices > 1:
        mesh = Mesh(np.array(jax.devices()[:devices]).reshape(1, devices), ("data", "seq"))
        context = functools.partial(jax.set_mesh, mesh)
        # Weights and inputs whole on every device of the group; the model splits the tokens.
        fns = {what: (fn, jax.device_put(args, NamedSharding(mesh, PartitionSpec()))) for what, (fn, args) in fns.items()}
    results, compiled_fns = {}, {}
    for what in bench.what:
        fn, args = fns[what]
        entry: dict[str, Any] = {"flops": prepared["flops"][what].total,
                                 "flops_breakdown": prepared["flops"][what].as_dict()}
        try:
            with context():
                entry["traced_matmul_flops"] = model_flops.jaxpr_matmul_flops(fn, *args)
        except ValueError as e:  # a program the jaxpr count cannot walk; the timing still runs
            entry["traced_matmul_flops"] = None
            entry["traced_matmul_flops_error"] = str(e)
        try:
            start = time.perf_counter()
            with context():
                compiled = jax.jit(fn).lower(*args).compile()
            entry["compile_s"] = time.perf_counter() - start
            entry["memory_bytes"] = compiled_memory(compiled)
            hlo = compiled.as_text()
            entry["matmul_custom_calls"] = matmul_custom_calls(hlo)
            if devices > 1:  # the tokens really split: Ulysses' all-to-alls are in the program
                entry["all_to_all_ops"] = all_to_all_ops(hlo)
            if what in ("forward", "forward_fp8"):
                compiled_fns[what] = compiled
            entry.update(summary(
                time_calls(lambda: compiled(*args), jax.block_until_ready, bench.repeats, bench.warmup),
                entry["flops"] // devices, peaks,  # per device: the rate and MFU of one card
            ))
            if profile_dir is not None:
                entry["profile"] = profiler.profile(lambda: compiled(*args), os.path.join(profile_dir, what))
        except Exception as e:  # noqa: BLE001 - recorded, and the run goes on
            entry["error"] = f"{type(e).__name__}: {e}"[:4000]
            traceback.print_exc()
        results[what] = entry
        print(_row(what, entry), flush=True)
    out["results"] = results
    if {"forward", "forward_fp8"} <= compiled_fns.keys():
        out["fp8"] = fp8_record(results, *(compiled_fns[w](*fns[w][1]) for w in ("forward", "forward_fp8")))
        print(f"fp8 forward: {out['fp8']['speedup_vs_bf16']:.2f}x the bf16 forward, velocity relative error "
              f"{out['fp8']['velocity_rel_err']:.2e}", flush=True)
    return out


def fp8_record(results: dict[str, Any], velocity_bf16, velocity_fp8) -> dict[str, Any]:
    """The FP8 forward against the bf16 one of the same run: speed-up (ratio of medians) and the
    relative error of the velocity, ||v_fp8 - v_bf16|| / ||v_bf16|| over the whole batch."""
    import jax.numpy as jnp

    ref = velocity_bf16.astype(jnp.float32)
    err = jnp.linalg.norm(velocity_fp8.astype(jnp.float32) - ref) / jnp.linalg.norm(ref)
    return {"speedup_vs_bf16": results["forward"]["median_s"] / results["forward_fp8"]["median_s"],
            "velocity_rel_err": float(err)}


def _row(what: str, entry: dict[str, Any]) -> str:
    """One printed line (two with a profile) of a measurement's figures."""
    if "error" in entry:
        return f"{what:14s} ERROR {entry['error'][:200]}"
    mfu = " ".join(f"{k}={v:.1%}" for k, v in entry.items() if k.startswith("mfu_") and v is not None)
    row = (f"{what:14s} median {entry['median_s'] * 1e3:9.2f} ms  {entry['flops'] / 1e12:9.2f} TFLOP  "
           f"{entry['flops_per_s'] / 1e12:7.1f} TFLOP/s  {mfu}")
    if "class_ms" in entry.get("profile", {}):
        row += "\n  device ms by class: " + ", ".join(f"{c} {ms:.1f}" for c, ms in entry["profile"]["class_ms"].items())
    return row
