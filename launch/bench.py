r"""Benchmarks: one JSON file per run under benchmarks/results/.

Model level (`--mode=model`): one transformer of a family at full size (or any variant) with
random weights, initialised on the device in the benchmark dtype, timed on one device:

    python launch/bench.py --mode=model --family=qwenimage --variant=qwen-image --batch=4 \
        --height=512 --width=512 --text_len=128 --what=forward,lora_fwd_bwd --lora_rank=64 --peer
    python launch/bench.py --mode=model --family=wan --variant=t2v-14b --batch=1 \
        --height=480 --width=832 --frames=33 --what=forward --remat_policy=full

For each of `--what` (forward; forward_fp8: the rollout role's FP8 forward,
`model.rollout_precision='fp8'`, with the speed-up and velocity error against `forward` of the
same run when both are listed; lora_fwd_bwd: forward and backward w.r.t. LoRA adapters over
the frozen base; full_fwd_bwd: w.r.t. every weight) it records the compile time, every timed
repeat after `--warmup` untimed calls (each synchronised with `block_until_ready`), the median,
the exact FLOPs (`digen_jax.model_flops`), the achieved FLOP rate and the MFU against both the
datasheet bf16 dense peak of the card and a bf16 matmul peak measured in the same run. The
traced matmul count (`flops.jaxpr_matmul_flops`, which includes remat recomputation but not
fused attention kernels) is recorded beside it. `--peer` first runs the diffusers PyTorch module
of the same family and config on the same card (eager, SDPA with flash/fused kernels, the same
LoRA targets) in a subprocess, so each framework has the card to itself, and records its times
and the ratio peer / JAX per measurement (> 1: JAX is faster). `--profile` records one more
call of each measurement with the JAX profiler and adds its device time per kernel and per
kernel class (matmul, attention, copy, fusion) to the JSON; every measurement lists the
library GEMM calls of its compiled program (`matmul_custom_calls`: cuBLASLt's FP8 GEMM is
`__cublas$lt$matmul$f8`).

Every JSON also records the XLA flags in effect (the launchers add the GPU defaults of
`digen_jax/xla_flags.py`), the share of device memory JAX may take (`mem_fraction`, from
XLA_PYTHON_CLIENT_MEM_FRACTION; every launcher sets it to 0.95 unless it is set,
`digen_jax/xla_flags.py`) and `source_sha256`, a digest of the code that ran.

A measurement that fails (out of memory, an unsupported kernel) is recorded with its error and
the run goes on; the exit status is 1 if any failed. Modes are entries of `BENCHES`; their
parts are the modules of `digen_jax/app/bench/`.
"""
from __future__ import annotations

import os
import sys
from typing import Any, Callable

from absl import app, flags
from ml_collections import config_flags

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)
from digen_jax import cli  # noqa: E402  (imports neither jax nor torch)
from digen_jax.app.bench import model, results, torch_peer  # noqa: E402  (jax and torch are imported where used)
from digen_jax.app.bench.results import default_out  # noqa: E402,F401  (a public name of the script)
from digen_jax.app.errors import ConfigError  # noqa: E402
from digen_jax.models.specs import SPECS  # noqa: E402
from digen_jax.runtime import plan  # noqa: E402

_MODE = flags.DEFINE_enum(
    "mode", "model", ["model", "system"],
    "What to benchmark: 'model' (one transformer on one device) or 'system' (RL iterations of --config in "
    "every schedule mode of --modes on all devices).",
)
_FAMILY = flags.DEFINE_enum("family", "flux", list(SPECS), "Model family.")
_VARIANT = flags.DEFINE_string(
    "variant", None, "Variant of the family's VARIANTS table: flux dev|schnell|tiny, qwenimage qwen-image|tiny, "
    "wan t2v-14b|tiny, wan22 ti2v-5b|t2v-a14b|tiny|tiny-a14b (sides multiples of 32 for ti2v-5b and tiny), "
    "hunyuan_video t2v|tiny, sd3 sd3.5-medium|sd3-medium|sd3.5-large|tiny. Default: the family's first variant."
)
_BATCH = flags.DEFINE_integer("batch", 1, "Batch size of one forward (CFG doubles it in sampling; not applied here).")
_HEIGHT = flags.DEFINE_integer("height", 512, "Image/video height in pixels (multiple of 16).")
_WIDTH = flags.DEFINE_integer("width", 512, "Image/video width in pixels (multiple of 16).")
_FRAMES = flags.DEFINE_integer("frames", 1, "Video frames (4k + 1) for wan/hunyuan_video; 1 for images.")
_TEXT_LEN = flags.DEFINE_integer("text_len", None, f"Text tokens fed to the model. Default per family: {model.DEFAULT_TEXT_LEN}.")
_WHAT = flags.DEFINE_list("what", ["forward", "lora_fwd_bwd"], f"Comma-separated measurements, of {model.WHATS}.")
_LORA_RANK = flags.DEFINE_integer("lora_rank", 64, "LoRA rank for lora_fwd_bwd.")
_LORA_ALPHA = flags.DEFINE_float("lora_alpha", 0.0, "LoRA alpha (scale alpha / rank); 0: 2 x rank.")
_LORA_TARGETS = flags.DEFINE_multi_string(
    "lora_target", None, "LoRA target regex, repeatable (searched in params paths). Default: attention and MLP "
    "of every block (the family spec's lora_targets)."
)
_LORA_MODE = flags.DEFINE_enum("lora_mode", "factored", ["factored", "merged"], "How LoRA is applied in lora_fwd_bwd.")
_REMAT = flags.DEFINE_string("remat_policy", "none", "Per-block remat policy: a key of models.stacking.REMAT_POLICIES.")
_NUM_LAYERS = flags.DEFINE_integer(
    "num_layers", 0, "Model mode: > 0 keeps that many (double-stream) blocks of the variant, for short probes.")
_SCAN_LAYERS = flags.DEFINE_bool(
    "scan_layers", True, "Run the blocks as one scan (stacked weights); false unrolls them (no per-layer weight copies).")
_SEQ_PARALLEL = flags.DEFINE_integer(
    "seq_parallel", 1, "Model mode, video families: split each sample's tokens over this many devices "
    "(Ulysses attention, as runtime.seq_parallel); FLOP rates, MFU and memory are then per device.")
_ATTENTION = flags.DEFINE_enum(
    "attention_impl", "auto", ["auto", "cudnn", "xla", "splash"],
    "Attention kernel (auto: splash on TPU, cuDNN on GPU in bf16)."
)
_DTYPE = flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float16", "float32"], "Weights and compute dtype.")
_REPEATS = flags.DEFINE_integer("repeats", 10, "Timed calls per measurement (the median is reported).")
_WARMUP = flags.DEFINE_integer("warmup", 2, "Untimed calls before timing (after compilation).")
_MATMUL_SIZE = flags.DEFINE_integer(
    "matmul_size", None, "Side of the square bf16 matmuls that measure the peak; 0 skips. Default: 8192 on a GPU "
    "or TPU, skipped on a CPU.")
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
with cli.config_override_errors():  # the default config reads the overrides here (renamed keys renamed first)
    _CONFIG = config_flags.DEFINE_config_file(  # the default is the repository's, wherever the command runs from
        "config", os.path.join(REPO_ROOT, "configs", "tiny.py"),
        "System mode: the training config (ml_collections; override keys as --config.a.b=v).")
_MODES = flags.DEFINE_list(
    "modes", list(plan.MODES),
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


def _model_bench() -> model.ModelBench:
    return model.ModelBench(
        family=_FAMILY.value, variant=_VARIANT.value, batch=_BATCH.value, height=_HEIGHT.value, width=_WIDTH.value,
        frames=_FRAMES.value, text_len=_TEXT_LEN.value, what=tuple(_WHAT.value), lora_rank=_LORA_RANK.value,
        lora_alpha=_LORA_ALPHA.value, lora_targets=tuple(_LORA_TARGETS.value or SPECS[_FAMILY.value].lora_targets),
        lora_mode=_LORA_MODE.value, remat_policy=_REMAT.value, num_layers=_NUM_LAYERS.value,
        scan_layers=_SCAN_LAYERS.value, attention_impl=_ATTENTION.value, dtype=_DTYPE.value, repeats=_REPEATS.value,
        warmup=_WARMUP.value, seed=_SEED.value, seq_parallel=_SEQ_PARALLEL.value,
    )


def _peer_worker_argv(path: str) -> list[str]:
    """This script as the PyTorch peer of the same model and inputs, writing its JSON to `path`."""
    argv = [line for holder in _FORWARDED for line in flags.FLAGS[holder.name].serialize().splitlines() if line]
    return [os.path.abspath(__file__), *argv, f"--peer_worker={path}"]


def run_model() -> dict[str, Any]:
    """`--mode=model`: the PyTorch peer (subprocess, first) then the JAX measurements."""
    profile_dir = None
    if _PROFILE.value:
        out = _OUT.value or os.path.join("benchmarks", "results", "profile")
        profile_dir = os.path.splitext(out)[0] + "_profile"
    if _PEER.value and _SEQ_PARALLEL.value != 1:
        raise app.UsageError("--peer times the unsplit PyTorch module on one device; run it with --seq_parallel=1")
    peer = (lambda: torch_peer.measure_in_subprocess(_peer_worker_argv)) if _PEER.value else None
    return model.measure(_model_bench(), matmul_size=_MATMUL_SIZE.value, matmul_chain=_MATMUL_CHAIN.value, peer=peer,
                         profile_dir=profile_dir)


def run_peer(path: str) -> None:
    """`--peer_worker`: time the diffusers module of the same family, config and shape; write JSON."""
    torch_peer.measure(_model_bench(), path)


def run_system() -> dict[str, Any]:
    """`--mode=system`: every schedule mode of `--modes` on the same devices, model and batch.

    The JSON (and the traces) are written after every mode, so a run cut short keeps what it measured.
    """
    from digen_jax.app.settings import distributed_settings
    from digen_jax.runtime.multihost import initialize

    # Several processes (`--config.runtime.distributed=True`): each runs this same bench, process 0
    # writes the JSON and the traces.
    initialize(distributed_settings(_CONFIG.value))
    import jax

    from digen_jax.app.bench import system

    runs = len(_MODES.value) * max(1, len(_ANCHORS.value))

    def write(result: dict[str, Any]) -> None:
        if jax.process_index() != 0:
            return
        path = _OUT.value or default_out(result)
        results.write(result, path, _WORKDIR.value)
        print(f"wrote {path} ({len(result['modes'])} of {runs} runs)", flush=True)

    return system.measure(
        _CONFIG.value, _MODES.value, _WORKDIR.value, warmups=_WARMUP_ITERATIONS.value, iterations=_ITERATIONS.value,
        onpolicy_anchors=_ANCHORS.value, matmul_size=_MATMUL_SIZE.value, matmul_chain=_MATMUL_CHAIN.value,
        on_update=write,
    )


BENCHES: dict[str, Callable[[], dict[str, Any]]] = {"model": run_model, "system": run_system}


def run_from_flags() -> tuple[dict[str, Any], str | None]:
    """Run the bench the parsed flags ask for and write its JSON; returns (result, path), the path
    None on processes other than 0 of a multi-process run."""
    result = BENCHES[_MODE.value]()
    import jax  # loaded by the bench

    if jax.process_index() != 0:  # process 0 writes a multi-process run's result
        return result, None
    path = _OUT.value or default_out(result)
    results.write(result, path, _WORKDIR.value)
    return result, path


def main(argv):
    del argv
    from digen_jax import xla_flags

    xla_flags.set_defaults()  # before the first device is touched
    if _PEER_WORKER.value:
        run_peer(_PEER_WORKER.value)
        return 0
    try:
        result, path = run_from_flags()
    except ConfigError as e:
        sys.exit(f"error: {e}")
    if path is not None:
        print(f"wrote {path}")
    failed = [w for w, e in result.get("results", {}).items() if "error" in e]
    return 1 if failed else 0


if __name__ == "__main__":
    cli.run(main)
